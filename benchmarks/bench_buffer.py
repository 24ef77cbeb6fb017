"""Lookup buffer benchmark: drop_select against the raw pipe, and lookup cost against buffer fill.

Two spawned processes (producer rank 0, consumer rank 1), each holding two pipes: a raw one for
the baseline and one owned by the SimpleBuffer. Both measurements run in the same processes in the
same run, interleaved per size.

* Transfer: a request of S bytes is a key and a value of S/2 bytes each (float16, random) with 128
  tokens. Baseline ("raw"): the consumer sends a 1-element request tensor on the raw pipe and
  receives key and value back (sent with one ``send_tensors``, the pipe's best way to move them).
  Buffer: the producer has inserted the entries; the consumer times ``drop_select`` (control
  round trip over ZeroMQ; header, key and value on the pipe as one unit). The two are interleaved
  request by request.
* Lookup: drop_select latency of small entries while 10, 1,000 and 10,000 other entries are
  buffered (should be flat), and the producer-side key-build + dict lookup alone, in-process.

Usage: python -m benchmarks.bench_buffer [--port P] [--max-mib 64]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
import traceback
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.measure import reap
from kv_pipe import KVTransferConfig, TorchDistributedPipe
from lookup_buffer import SimpleBuffer
from lookup_buffer.matching import MatchKey, token_arrays
from lookup_buffer.store import Entry, EntryStore

KIB, MIB = 1 << 10, 1 << 20
TOKENS = 128
FILLS = (10, 1_000, 10_000)
PROBES = 300
WARMUP = 3
BUDGET = 2 << 30


def sizes(max_mib: int) -> list[int]:
    out, size = [], 4 * KIB
    while size <= max_mib * MIB:
        out.append(size)
        size *= 4
    return out


def repetitions(size: int) -> int:
    return max(16, min(300, (1024 * MIB) // size))  # all of them fit in BUDGET at once


def entry_tokens(group: int, index: int) -> torch.Tensor:
    tokens = torch.arange(TOKENS, dtype=torch.int64) * 7 + 1
    tokens[0], tokens[1] = group, index
    return tokens


ROI = torch.ones(TOKENS, dtype=torch.bool)


def payload(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(size)
    half = size // 4  # float16 elements in S/2 bytes
    return (torch.randn(half, generator=generator).half(), torch.randn(half, generator=generator).half())


def config(rank: int, port: int) -> KVTransferConfig:
    role = "kv_producer" if rank == 0 else "kv_consumer"
    return KVTransferConfig(
        kv_role=role, kv_rank=rank, kv_port=port, kv_buffer_size=BUDGET, kv_timeout=30, kv_connect_timeout=60
    )


# ---------------------------------------------------------------- the two processes


def producer(port: int, max_mib: int) -> None:
    cfg = config(0, port)
    raw = TorchDistributedPipe(cfg, port_offset=0)
    buffer = SimpleBuffer(TorchDistributedPipe(cfg, port_offset=2), cfg)
    try:
        for group, size in enumerate(sizes(max_mib)):
            key, value = payload(size)
            count = repetitions(size) + WARMUP
            for index in range(count):  # the same two tensors in every entry: memory stays small
                buffer.insert(entry_tokens(group, index), ROI, key, value, None, timeout=60)
            raw.send_tensor(torch.tensor(1))  # "inserted"
            for _ in range(count):  # the consumer interleaves raw fetches with drop_selects
                raw.recv_tensor(timeout=60)
                raw.send_tensors([key, value])  # as one unit, like the buffer's header, key and value
        filled = 0
        small_key, small_value = payload(4 * KIB)
        for fill in FILLS:
            for index in range(filled, fill):
                buffer.insert(entry_tokens(-1, index), ROI, small_key, small_value, None, timeout=60)
            filled = fill
            for index in range(PROBES + WARMUP):
                buffer.insert(entry_tokens(-2 - fill, index), ROI, small_key, small_value, None, timeout=60)
            raw.send_tensor(torch.tensor(1))
            raw.recv_tensor(timeout=600)
    finally:
        buffer.close()
        raw.close()


def consumer(port: int, max_mib: int) -> dict:
    cfg = config(1, port)
    raw = TorchDistributedPipe(cfg, port_offset=0)
    buffer = SimpleBuffer(TorchDistributedPipe(cfg, port_offset=2), cfg)
    transfer = []
    lookup = []
    request = torch.tensor([1])
    try:
        for group, size in enumerate(tqdm(sizes(max_mib), desc="transfer sizes", file=sys.stderr)):
            count = repetitions(size) + WARMUP
            raw.recv_tensor(timeout=600)  # entries inserted
            raw_times, buffer_times = [], []
            for index in range(count):  # interleaved, so that load from elsewhere hits both alike
                start = time.perf_counter()
                raw.send_tensor(request)
                key, value = raw.recv_tensor(timeout=60), raw.recv_tensor(timeout=60)
                raw_times.append(time.perf_counter() - start)
                assert key.nbytes + value.nbytes == size
                del key, value
                tokens = entry_tokens(group, index)  # built before the clock starts, like raw's request
                start = time.perf_counter()
                got = buffer.drop_select(tokens, ROI)
                buffer_times.append(time.perf_counter() - start)
                assert got[2] is not None and got[2].nbytes + got[3].nbytes == size, "unexpected miss"
                del got
            transfer.append((size, raw_times[WARMUP:], buffer_times[WARMUP:]))
        for fill in tqdm(FILLS, desc="buffer fills", file=sys.stderr):
            raw.recv_tensor(timeout=600)
            times = []
            for index in range(PROBES + WARMUP):
                tokens = entry_tokens(-2 - fill, index)
                start = time.perf_counter()
                got = buffer.drop_select(tokens, ROI)
                times.append(time.perf_counter() - start)
                assert got[2] is not None, "unexpected miss"
            raw.send_tensor(torch.tensor(1))
            lookup.append((fill, times[WARMUP:]))
    finally:
        buffer.close()
        raw.close()
    return {"transfer": transfer, "lookup": lookup}


def _child(target: Any, args: tuple, results: Any) -> None:
    torch.set_num_threads(1)  # two processes on two cores: OpenMP spinning would slow both
    try:
        results.put(("ok", target(*args)))
    except BaseException:
        results.put(("error", traceback.format_exc()))


# ---------------------------------------------------------------- in-process lookup cost


def local_lookup(fill: int) -> float:
    """Median seconds to build a query's MatchKey and pop its entry with ``fill`` others stored."""
    store = EntryStore(BUDGET, BUDGET)
    small = torch.zeros(1)
    for index in range(fill):
        store.put(MatchKey(*token_arrays(entry_tokens(-1, index), ROI)), Entry((small,), 4), timeout=0)
    probes = [entry_tokens(-2, index) for index in range(PROBES)]
    for tokens in probes:
        store.put(MatchKey(*token_arrays(tokens, ROI)), Entry((small,), 4), timeout=0)
    times = []
    for tokens in probes:
        start = time.perf_counter()
        entry = store.pop(MatchKey(*token_arrays(tokens, ROI)))
        times.append(time.perf_counter() - start)
        assert entry is not None
    return statistics.median(times)


# ---------------------------------------------------------------- report


def free_port() -> int:
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            for offset in range(4):
                with socket.socket() as other:
                    other.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port range")


def human(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def report(results: dict, load: tuple[float, float]) -> None:
    print(f"\nload average before/after: {load[0]:.2f} / {load[1]:.2f} (other work on the machine skews both columns)")
    print("\ndrop_select vs raw pipe (request/response moving the same key+value bytes), medians")
    print(
        f"| {'size':>7} | {'reps':>4} | {'raw ms':>8} | {'buffer ms':>9} | {'raw GB/s':>8} | "
        f"{'buffer GB/s':>11} | {'buffer/raw':>10} |"
    )
    print("|" + "---------|------|----------|-----------|----------|-------------|------------|")
    for size, raw_times, buffer_times in results["transfer"]:
        raw_t, buf_t = statistics.median(raw_times), statistics.median(buffer_times)
        print(
            f"| {human(size):>7} | {len(raw_times):>4} | {raw_t * 1e3:8.3f} | {buf_t * 1e3:9.3f} | "
            f"{size / raw_t / 1e9:8.2f} | {size / buf_t / 1e9:11.2f} | {buf_t / raw_t:10.3f} |"
        )
    print(f"\nlookup cost: {PROBES} drop_selects of 4 KiB entries while N other entries are buffered, medians")
    print(f"| {'N':>6} | {'drop_select us':>14} | {'p90 us':>8} | {'local key+pop us':>16} |")
    print("|--------|----------------|----------|------------------|")
    for fill, times in results["lookup"]:
        p90 = statistics.quantiles(times, n=10)[-1]
        print(
            f"| {fill:>6} | {statistics.median(times) * 1e6:14.1f} | {p90 * 1e6:8.1f} | "
            f"{local_lookup(fill) * 1e6:16.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0, help="first of 4 free ports (default: find one)")
    parser.add_argument("--max-mib", type=int, default=64, help="largest request size in MiB")
    args = parser.parse_args()
    torch.set_num_threads(1)
    port = args.port or free_port()
    load_before = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    processes = [
        ctx.Process(target=_child, args=(producer, (port, args.max_mib), results), daemon=True),
        ctx.Process(target=_child, args=(consumer, (port, args.max_mib), results), daemon=True),
    ]
    for process in processes:
        process.start()
    outcomes = []
    try:
        deadline = time.monotonic() + 1800
        while len(outcomes) < 2:
            try:
                status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit("benchmark did not finish within 30 minutes") from None
            if status == "error":
                raise SystemExit(f"a benchmark process failed:\n{value}")
            outcomes.append(value)
    finally:
        reap(processes, grace=30)
    report(next(value for value in outcomes if value is not None), (load_before, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
