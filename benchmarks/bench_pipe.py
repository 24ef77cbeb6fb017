"""Pipe throughput and latency against raw ProcessGroupGloo send/recv, measured in the same run.

Two processes ping-pong a random tensor of each size; one-way time = round trip / 2 (median over
iterations, after warm-up). The raw baseline receives into a pre-allocated, reused buffer on its
own ProcessGroupGloo, which is the best gloo can do; the pipe adds framing, credit, background
threads and hands the caller a tensor it owns. Raw and pipe alternate in rounds, so that a noisy
neighbour slows both alike and the ratio stays meaningful on a shared machine.

For tensors that travel inside a frame (up to 1 MiB) the same rounds also time the one-copy floor:
the least any pipe that sends a header and its tensor as one gloo message can do. It copies the
tensor behind a header-sized gap in a reused frame, sends that prefix on the raw group, receives
into a reused frame and makes a tensor over the received bytes; no header is written or read, no
lock taken, no thread involved. The pipe's distance from it is its Python; the floor's distance
from raw is the copy that one message costs.

    python benchmarks/bench_pipe.py [--iters 7] [--rounds 5] [--sizes 4K,64K,1M,4M,16M,128M,512M]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import multiprocessing as mp
import queue
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv_pipe import KVTransferConfig, TorchDistributedPipe  # noqa: E402
from kv_pipe.config import local_address_towards  # noqa: E402
from kv_pipe.protocol import HEADER_BYTES, HOST_FRAME_BYTES  # noqa: E402
from tests.procs import free_port  # noqa: E402

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    return int(text[:-1]) * UNITS[text[-1].upper()] if text[-1].upper() in UNITS else int(text)


def label(nbytes: int) -> str:
    for suffix, unit in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= unit:
            return f"{nbytes // unit} {suffix}"
    return f"{nbytes} B"


def raw_group(rank: int, port: int) -> tuple[torch.distributed.ProcessGroup, torch.distributed.TCPStore]:
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    options = torch.distributed.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=120)
    options._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=local_address_towards("127.0.0.1"))]
    return torch.distributed.ProcessGroupGloo(store, rank, 2, options), store


def timed_round_trips(nbytes: int, iters: int) -> int:
    """Round trips per round: small sizes get many more (up to 64 MiB moved per round, at most 1,000),
    since a median of a few 50-us samples on a shared machine is mostly noise."""
    if nbytes > 128 << 20:
        return max(3, iters // 2)
    return max(iters, min(1000, (64 << 20) // nbytes))


def one_way_times(rank: int, iters: int, warmup: int, round_trip) -> list[float]:
    times = []
    for index in range(warmup + iters):
        start = time.perf_counter()
        round_trip()
        if index >= warmup:
            times.append((time.perf_counter() - start) / 2)
    return times


def worker(rank: int, port: int, sizes: list[int], iters: int, rounds: int, results) -> None:
    torch.set_num_threads(1)
    group, _store = raw_group(rank, port)  # the store must outlive the group
    config = KVTransferConfig(
        kv_rank=rank,
        kv_port=port + 2,
        kv_buffer_size=max(sizes) * 2 + (1 << 20),
        kv_timeout=60.0,
        kv_connect_timeout=60.0,
    )
    pipe = TorchDistributedPipe(config)
    peer = 1 - rank
    send_frame = torch.zeros(HOST_FRAME_BYTES, dtype=torch.uint8)
    recv_frame = torch.zeros(HOST_FRAME_BYTES, dtype=torch.uint8)
    recv_bytes = memoryview(recv_frame.numpy())
    rows = []
    progress = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=len(sizes), desc="sizes", file=sys.stderr)
    for nbytes in sizes:
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        reused = torch.empty_like(data)
        warmup = 2 if nbytes <= 64 << 20 else 1
        count = timed_round_trips(nbytes, iters)

        def raw_round_trip(data: torch.Tensor = data, reused: torch.Tensor = reused) -> None:
            if rank == 0:
                group.send([data], peer, 0).wait()
                group.recv([reused], peer, 0).wait()
            else:
                group.recv([reused], peer, 0).wait()
                group.send([reused], peer, 0).wait()

        def pipe_round_trip(data: torch.Tensor = data) -> None:
            if rank == 0:
                pipe.send_tensor(data)
                pipe.recv_tensor(timeout=120)
            else:
                pipe.send_tensor(pipe.recv_tensor(timeout=120))

        frame_prefix = send_frame[: HEADER_BYTES + nbytes]

        def one_copy_send(tensor: torch.Tensor, frame_prefix: torch.Tensor = frame_prefix) -> None:
            ctypes.memmove(frame_prefix.data_ptr() + HEADER_BYTES, tensor.data_ptr(), tensor.nbytes)
            group.send([frame_prefix], peer, 0).wait()

        def one_copy_recv(nbytes: int = nbytes) -> torch.Tensor:
            group.recv([recv_frame], peer, 0).wait()
            return torch.frombuffer(recv_bytes[HEADER_BYTES : HEADER_BYTES + nbytes], dtype=torch.uint8)

        def floor_round_trip(data: torch.Tensor = data) -> None:
            if rank == 0:
                one_copy_send(data)
                one_copy_recv()
            else:
                one_copy_send(one_copy_recv())

        modes = {"raw": raw_round_trip, "pipe": pipe_round_trip}
        if HEADER_BYTES + nbytes <= HOST_FRAME_BYTES:
            modes["floor"] = floor_round_trip
        times = {mode: [] for mode in modes}
        for _ in range(rounds if nbytes <= 128 << 20 else 1):
            for mode, round_trip in modes.items():
                times[mode] += one_way_times(rank, count, warmup, round_trip)
        floor = statistics.median(times["floor"]) if "floor" in times else None
        rows.append((nbytes, statistics.median(times["raw"]), statistics.median(times["pipe"]), floor))
        if progress is not None:
            progress.update()
    pipe.close()
    if rank == 0:
        results.put(rows)


def wait_for_rows(results, processes: list[mp.Process], timeout: float = 1800) -> list[tuple]:
    """Rank 0's table rows; exits at once, instead of at the timeout, when a worker has failed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            failed = [process.exitcode for process in processes if process.exitcode not in (None, 0)]
            if failed:
                raise SystemExit(f"a benchmark process failed (exit codes {failed}); see its traceback above") from None
            if time.monotonic() > deadline:
                raise SystemExit(f"the benchmark did not finish within {timeout:g} s") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,64K,1M,4M,16M,128M,512M")
    parser.add_argument("--iters", type=int, default=7,
                        help="timed round trips per round, at least (small sizes get more, see timed_round_trips)")
    parser.add_argument("--rounds", type=int, default=5, help="alternations of raw and pipe (1 above 128 MiB)")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port(span=4)
    processes = [ctx.Process(target=worker, args=(rank, port, sizes, args.iters, args.rounds, results))
                 for rank in (0, 1)]
    for process in processes:
        process.start()
    try:
        rows = wait_for_rows(results, processes)
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    counts = ", ".join(str(timed_round_trips(nbytes, args.iters)) for nbytes in sizes)
    print(f"torch {torch.__version__}, gloo over loopback, ping-pong one-way time (median of "
          f"{args.rounds} alternating rounds; round trips per round: {counts}); floor: one copy into a "
          f"frame, one gloo message (sizes that fit a frame)")
    print(f"{'size':>9} | {'raw GB/s':>8} | {'pipe GB/s':>9} | {'pipe/raw':>8} | {'raw us':>9} | {'pipe us':>9} | "
          f"{'floor us':>9} | {'floor/raw':>9}")
    print("-" * 92)
    for nbytes, raw, piped, floor in rows:
        floor_columns = f"{floor * 1e6:9.1f} | {raw / floor:8.2f}x" if floor is not None else f"{'-':>9} | {'-':>9}"
        print(
            f"{label(nbytes):>9} | {nbytes / raw / 1e9:8.2f} | {nbytes / piped / 1e9:9.2f} | "
            f"{raw / piped:7.2f}x | {raw * 1e6:9.1f} | {piped * 1e6:9.1f} | {floor_columns}"
        )


if __name__ == "__main__":
    main()
