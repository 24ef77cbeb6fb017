"""Prefill and decode instances of different TP sizes: bytes moved and time per request.

One spawned process per TP rank of each side, each a connector worker (:class:`connector.vllm_worker.WorkerSide`,
what vLLM's worker runs) over kvbridge's pipes, with paged caches in vLLM's CPU layout
(``[num_blocks, kv_heads / tp, block_size, 2 * head_size]`` per layer) holding its slice of a
model's KV heads. The prefill ranks save every request (lent, as vLLM's connector does by default,
or copied with ``--copied``); then, request by request, the decode ranks start together (a barrier)
and each loads the request's KV into its own blocks: with P > D a decode rank gathers the entries of
P / D prefill ranks, with P < D it takes its part of one rank's heads.

Per pairing, per request: the bytes each decode rank moved (its heads only), the bytes all of them
moved, and the time from the barrier until the slowest decode rank had written its blocks (median
over the requests; the first request, which opens the connections, is not timed). Every decode
rank's blocks are checked bit for bit against the single-rank cache.

    python -m benchmarks.bench_tp [--pairs 1:1,1:2,2:1] [--tokens 1024] [--layers 16] [--heads 8]
        [--head-size 128] [--requests 6] [--copied]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import torch

from connector import compat, tp_layout
from connector.paged import VLLM_CPU_LAYOUT
from connector.transfer_plan import LoadSpec, SaveSpec
from connector.vllm_settings import ConnectorSettings, listen_port_offset
from harness.procs import free_port

BLOCK_SIZE = 32
DTYPE = torch.float16
_CTX = mp.get_context("spawn")


def _full_cache(layer: int, blocks: int, heads: int, head_size: int) -> torch.Tensor:
    """Layer ``layer`` of the single-rank cache (the same in every process)."""
    generator = torch.Generator().manual_seed(1000 + layer)
    return torch.randn((blocks, heads, BLOCK_SIZE, 2 * head_size), generator=generator).to(DTYPE)


def _worker(role: str, port: int, tp: int, rank: int, shape: argparse.Namespace, lend: bool) -> Any:
    from connector.vllm_worker import WorkerSide
    from kv_pipe.exported_memory import page_aligned_empty

    start, stop = tp_layout.heads_of_rank(shape.heads, tp, rank)
    caches = []
    for layer in range(shape.layers):
        cache = page_aligned_empty((shape.blocks, stop - start, BLOCK_SIZE, 2 * shape.head_size), DTYPE)
        if role == "kv_producer":
            cache.copy_(_full_cache(layer, shape.blocks, shape.heads, shape.head_size)[:, start:stop])
        else:
            cache.zero_()
        caches.append(cache)
    extra = {
        "kv_ip": "127.0.0.1",
        "kv_timeout": 30.0,
        "kv_buffer_size": 4 << 30,
        "kv_lend_blocks": lend,
        "kv_load_timeout": 30.0,
    }
    settings = ConnectorSettings.from_vllm(role, port, "cpu", extra)
    identity = compat.KVLayoutInfo(
        version=compat.VERSION,
        role=role,
        model="bench",
        dtype="",
        block_size=BLOCK_SIZE,
        num_layers=0,
        block_shape=(),
        layout="",
        tp_size=tp,
        tp_rank=rank,
        total_kv_heads=shape.heads,
        head_size=shape.head_size,
    )
    worker = WorkerSide(settings, identity, listen_port_offset(rank))
    worker.connect(caches, VLLM_CPU_LAYOUT)
    return worker, caches


def _requests(shape: argparse.Namespace) -> list[SaveSpec]:
    per = shape.tokens // BLOCK_SIZE
    return [
        SaveSpec(
            f"r{index}",
            list(range(index * 100_000, index * 100_000 + shape.tokens)),
            list(range(index * per, (index + 1) * per)),
        )
        for index in range(shape.requests)
    ]


def _log_warnings(name: str) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"{name}: %(name)s: %(message)s")


def prefill_rank(
    port: int, tp: int, rank: int, shape: argparse.Namespace, lend: bool, saved: Any, done: Any, results: Any
) -> None:
    _log_warnings(f"prefill rank {rank}")
    try:
        worker, _ = _worker("kv_producer", port, tp, rank, shape, lend)
        with torch.inference_mode():
            worker.save(_requests(shape))
        if worker.take_save_outcomes()[1]:
            raise RuntimeError("a save failed")
        saved.set()
        done.wait(600)
        worker.close()
        results.put(("prefill", rank, None))
    except BaseException as exc:  # report it rather than leave the run waiting
        results.put(("prefill", rank, repr(exc)))


def decode_rank(
    port: int, prefill_tp: int, tp: int, rank: int, shape: argparse.Namespace, saved: Any, barrier: Any, results: Any
) -> None:
    _log_warnings(f"decode rank {rank}")
    try:
        worker, caches = _worker("kv_consumer", port, tp, rank, shape, True)
        for flag in saved:
            if not flag.wait(600):
                raise TimeoutError("the prefill ranks did not save")
        times = []
        for spec in _requests(shape):
            barrier.wait()
            start = time.perf_counter()
            worker.start_loads(
                [
                    LoadSpec(
                        spec.req_id,
                        spec.token_ids,
                        spec.block_ids,
                        0,
                        wait=True,
                        producer=("127.0.0.1", port),
                        producer_tp=prefill_tp,
                    )
                ]
            )
            finished: set[str] = set()
            while spec.req_id not in finished:
                finished |= worker.take_finished_loads()
                if worker.take_failed_blocks():
                    raise RuntimeError(f"the load of {spec.req_id} failed")
                time.sleep(0.0002)
            times.append(time.perf_counter() - start)
        head_start, head_stop = tp_layout.heads_of_rank(shape.heads, tp, rank)
        used = len(_requests(shape)) * (shape.tokens // BLOCK_SIZE)
        for layer, cache in enumerate(caches):
            expected = _full_cache(layer, shape.blocks, shape.heads, shape.head_size)[:used, head_start:head_stop]
            if not torch.equal(cache[:used].view(torch.int16), expected.contiguous().view(torch.int16)):
                raise RuntimeError(f"decode rank {rank}: layer {layer} differs from the single-rank cache")
        stats = worker.total_stats().data
        worker.close()
        results.put(("decode", rank, {"times": times, "bytes": stats["loaded_bytes"]}))
    except BaseException as exc:
        results.put(("decode", rank, repr(exc)))


def run_pair(prefill_tp: int, decode_tp: int, shape: argparse.Namespace, lend: bool) -> dict[str, float]:
    port = free_port(span=max(prefill_tp, decode_tp))
    results, done = _CTX.Queue(), _CTX.Event()
    saved = [_CTX.Event() for _ in range(prefill_tp)]
    barrier = _CTX.Barrier(decode_tp)
    processes = [
        _CTX.Process(target=prefill_rank, args=(port, prefill_tp, rank, shape, lend, saved[rank], done, results))
        for rank in range(prefill_tp)
    ]
    processes += [
        _CTX.Process(target=decode_rank, args=(port, prefill_tp, decode_tp, rank, shape, saved, barrier, results))
        for rank in range(decode_tp)
    ]
    for process in processes:
        process.start()
    decoded: dict[int, dict[str, Any]] = {}
    try:
        while len(decoded) < decode_tp:
            kind, rank, value = results.get(timeout=600)
            if isinstance(value, str):
                raise RuntimeError(f"{kind} rank {rank}: {value}")
            if kind == "decode":
                decoded[rank] = value
        done.set()
        for _ in range(prefill_tp):
            kind, rank, value = results.get(timeout=120)
            if value is not None:
                raise RuntimeError(f"{kind} rank {rank}: {value}")
    finally:
        done.set()
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    per_request = [max(decoded[rank]["times"][index] for rank in decoded) for index in range(1, shape.requests)]
    moved = [decoded[rank]["bytes"] / shape.requests for rank in sorted(decoded)]
    return {
        "per_rank": moved[0],
        "total": sum(moved),
        "seconds": statistics.median(per_request),
        "spread": (min(per_request), max(per_request)),
    }


def _size(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes / (1 << 10):.1f} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default="1:1,1:2,2:1", help="prefill:decode TP sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of KV per request (whole blocks of 32)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8, help="the model's KV heads")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--requests", type=int, default=6, help="requests per pairing (the first is not timed)")
    parser.add_argument("--copied", action="store_true", help="prefill ranks copy saved blocks instead of lending")
    shape = parser.parse_args(argv)
    if shape.tokens % BLOCK_SIZE or shape.requests < 2:
        parser.error("--tokens must be a multiple of 32 and --requests at least 2")
    shape.blocks = shape.requests * shape.tokens // BLOCK_SIZE + 1
    pairs = [tuple(int(size) for size in pair.split(":")) for pair in shape.pairs.split(",")]
    request_mib = shape.layers * shape.tokens * shape.heads * 2 * shape.head_size * DTYPE.itemsize / (1 << 20)
    print(
        f"{shape.tokens} tokens x {shape.layers} layers x {shape.heads} KV heads of {shape.head_size} "
        f"({DTYPE}): {request_mib:.0f} MiB of KV per request; {'copied' if shape.copied else 'lent'}; "
        f"median of {shape.requests - 1} requests"
    )
    print(
        "| prefill TP -> decode TP | moved per decode rank | moved in all | time per request (median) | range | rate |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for prefill_tp, decode_tp in pairs:
        result = run_pair(prefill_tp, decode_tp, shape, not shape.copied)
        low, high = result["spread"]
        rate = result["total"] / result["seconds"] / (1 << 30)
        print(
            f"| {prefill_tp} -> {decode_tp} | {_size(result['per_rank'])} | {_size(result['total'])} "
            f"| {result['seconds'] * 1000:.1f} ms "
            f"| {low * 1000:.1f}-{high * 1000:.1f} ms | {rate:.2f} GiB/s |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
