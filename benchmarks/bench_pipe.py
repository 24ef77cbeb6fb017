"""Pipe throughput and latency on both payload paths against raw ProcessGroupGloo send/recv, in one run.

Two processes ping-pong a random tensor of each size; one-way time = round trip / 2 (median over
iterations, after warm-up). The raw baseline receives into a pre-allocated, reused buffer on its
own ProcessGroupGloo, which is the best gloo can do. Two pipes run beside it: one with
``kv_shared_memory="off"`` (payloads over the transport, as between two hosts) and one with
``kv_shared_memory="on"`` (payloads through a shared-memory segment, frames over a local socket). Both
add framing and credit and hand the caller a tensor it owns. Raw and the pipes
alternate in rounds, so that a noisy neighbour slows all alike and the ratios stay meaningful on a
shared machine.

For tensors that travel inside a frame (up to 1 MiB) the same rounds also time the one-copy floor:
the least any pipe that sends a header and its tensor as one gloo message can do. It copies the
tensor behind a header-sized gap in a reused frame, sends that prefix on the raw group, receives
into a reused frame and makes a tensor over the received bytes; no header is written or read, no
lock taken, no thread involved. (Such tensors travel inside their frame on both paths.)

    python -m benchmarks.bench_pipe [--iters 7] [--rounds 5] [--sizes 4K,64K,1M,4M,16M,128M,512M]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import sys

import torch

from benchmarks.measure import (
    label,
    parse_sizes,
    raw_group,
    run_two_ranks,
    timed,
    timed_round_trips,
    warmup_count,
)
from harness.procs import free_port
from kv_pipe import KVTransferConfig, TorchDistributedPipe
from kv_pipe.protocol import HEADER_BYTES, HOST_FRAME_BYTES

#: The pipes' payload paths: kv_shared_memory and the port offset of each pipe (the raw group has port).
PIPES = {"transport": ("off", 2), "shared": ("on", 4)}


def open_pipes(rank: int, port: int, max_bytes: int) -> dict[str, TorchDistributedPipe]:
    pipes = {}
    for name, (mode, offset) in PIPES.items():
        config = KVTransferConfig(
            kv_rank=rank,
            kv_port=port + offset,
            kv_buffer_size=max_bytes * 2 + (1 << 20),
            kv_timeout=60.0,
            kv_connect_timeout=60.0,
            kv_shared_memory=mode,
        )
        pipes[name] = TorchDistributedPipe(config)
        assert pipes[name].uses_shared_memory == (mode == "on"), f"{name} pipe took the wrong payload path"
    return pipes


def worker(rank: int, port: int, sizes: list[int], iters: int, rounds: int, results) -> None:
    torch.set_num_threads(1)
    group, _store = raw_group(rank, port)  # the store must outlive the group
    pipes = open_pipes(rank, port, max(sizes))
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
        count = timed_round_trips(nbytes, iters)

        def raw_round_trip(data: torch.Tensor = data, reused: torch.Tensor = reused) -> None:
            if rank == 0:
                group.send([data], peer, 0).wait()
                group.recv([reused], peer, 0).wait()
            else:
                group.recv([reused], peer, 0).wait()
                group.send([reused], peer, 0).wait()

        def pipe_round_trip(pipe: TorchDistributedPipe, data: torch.Tensor = data) -> None:
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

        modes = {"raw": raw_round_trip}
        modes.update((name, functools.partial(pipe_round_trip, pipe)) for name, pipe in pipes.items())
        if HEADER_BYTES + nbytes <= HOST_FRAME_BYTES:
            modes["floor"] = floor_round_trip
        times = {mode: [] for mode in modes}
        for _ in range(rounds if nbytes <= 128 << 20 else 1):
            for mode, round_trip in modes.items():
                times[mode] += timed(round_trip, count, warmup_count(nbytes), per_step=0.5)
        medians = {mode: statistics.median(samples) for mode, samples in times.items()}
        rows.append((nbytes, medians["raw"], medians["transport"], medians["shared"], medians.get("floor")))
        if progress is not None:
            progress.update()
    for pipe in pipes.values():
        pipe.close()
    if rank == 0:
        results.put(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,64K,1M,4M,16M,128M,512M")
    parser.add_argument(
        "--iters",
        type=int,
        default=7,
        help="timed round trips per round, at least (small sizes get more, see timed_round_trips)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternations of raw and the pipes (1 above 128 MiB)")
    args = parser.parse_args()
    sizes = parse_sizes(args.sizes)
    rows = run_two_ranks(worker, (free_port(span=6), sizes, args.iters, args.rounds))
    counts = ", ".join(str(timed_round_trips(nbytes, args.iters)) for nbytes in sizes)
    print(
        f"torch {torch.__version__}, two processes on one host, ping-pong one-way time (median of "
        f"{args.rounds} alternating rounds; round trips per round: {counts})"
    )
    print(
        "raw: gloo send/recv into a reused buffer; transport: the pipe with kv_shared_memory='off'; shm: with "
        "'on'; floor: one copy into a frame, one gloo message (sizes that fit a frame)"
    )
    print(
        f"{'size':>9} | {'raw GB/s':>8} | {'transp GB/s':>11} | {'shm GB/s':>8} | {'transp/raw':>10} | "
        f"{'shm/raw':>7} | {'raw us':>9} | {'transp us':>9} | {'shm us':>9} | {'floor us':>9} | {'floor/raw':>9}"
    )
    print("-" * 129)
    for nbytes, raw, transport, shared, floor in rows:
        floor_columns = f"{floor * 1e6:9.1f} | {raw / floor:8.2f}x" if floor is not None else f"{'-':>9} | {'-':>9}"
        print(
            f"{label(nbytes):>9} | {nbytes / raw / 1e9:8.2f} | {nbytes / transport / 1e9:11.2f} | "
            f"{nbytes / shared / 1e9:8.2f} | {raw / transport:9.2f}x | {raw / shared:6.2f}x | {raw * 1e6:9.1f} | "
            f"{transport * 1e6:9.1f} | {shared * 1e6:9.1f} | {floor_columns}"
        )


if __name__ == "__main__":
    main()
