"""Host-staged transfer rate against a plain device-to-host copy of the same bytes on the same GPU.

Host-staged mode moves GPU tensors through a CPU pipe: one device-to-host copy straight into the
pipe's memory (its shared-memory segment on one host, pinned for that copy), the pipe, and one
host-to-device copy on the other side. Two processes on one GPU ping-pong a GPU tensor of each size
that way (GPU -> pipe -> GPU and back); one-way time = round trip / 2 (median). The baseline is the
least any host staging can cost: one plain device-to-host copy of the same bytes into pinned memory
(``torch.Tensor.copy_``), and the host-to-device copy back, timed in one process on the same GPU.

    python -m benchmarks.bench_host_staged [--sizes 16M,64M,256M] [--iters 5] [--summary]

On a machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.measure import label, parse_sizes, run_two_ranks, timed
from harness.procs import free_port
from kv_pipe import KVTransferConfig, TorchDistributedPipe
from kv_pipe.device import copy_between


def plain_copies(nbytes: int, iters: int, device: torch.device) -> tuple[float, float]:
    """Median seconds of one device-to-host copy into pinned memory, and of one host-to-device copy."""
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def down() -> None:
        host.copy_(source)  # synchronous: returns once the bytes are in host memory

    def up() -> None:
        source.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)

    return (statistics.median(timed(down, iters, warmup=2)), statistics.median(timed(up, iters, warmup=2)))


def ping_pong(rank: int, port: int, sizes: list[int], iters: int, gpu: int, results) -> None:
    device = torch.device("cuda", gpu)
    config = KVTransferConfig(
        kv_rank=rank,
        kv_role="kv_producer" if rank == 0 else "kv_consumer",
        kv_port=port,
        kv_buffer_size=2 * max(sizes) + (1 << 20),
        kv_timeout=60.0,
        kv_connect_timeout=60.0,
        kv_device_index=gpu,
    )
    with TorchDistributedPipe(config) as pipe:
        times = {}
        for nbytes in sizes:
            mine = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)

            def round_trip(mine: torch.Tensor = mine) -> None:
                if rank == 0:
                    pipe.send_tensor(mine)
                    copy_between(mine, pipe.recv_tensor())  # host -> this GPU
                else:
                    copy_between(mine, pipe.recv_tensor())
                    pipe.send_tensor(mine)  # this GPU -> the pipe's memory -> the peer

            times[nbytes] = statistics.median(timed(round_trip, iters, warmup=2, per_step=0.5))
        if rank == 0:
            results.put({"times": times, "shared": pipe.uses_shared_memory, "pinned": len(pipe._pinned)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16M,64M,256M")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--summary", action="store_true", help="end with one 'summary:' line (for gpu-check.sh)")
    arguments = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_host_staged needs a CUDA GPU: torch sees none here, nothing was measured")
        return
    device = torch.device("cuda", arguments.gpu)
    sizes = parse_sizes(arguments.sizes)
    plain = {nbytes: plain_copies(nbytes, arguments.iters, device) for nbytes in sizes}
    started = time.perf_counter()
    staged = run_two_ranks(ping_pong, (free_port(), sizes, arguments.iters, arguments.gpu), timeout=600)
    card = torch.cuda.get_device_name(device)
    print(
        f"{card}: host-staged pipe ({'shared memory' if staged['shared'] else 'gloo'}, "
        f"segments pinned: {'yes' if staged['pinned'] == 2 else 'no'}), {time.perf_counter() - started:.0f} s\n"
    )
    print(
        "| size | plain D2H, GB/s | plain H2D, GB/s | host-staged GPU -> GPU one way, GB/s | host-staged / plain D2H |"
    )
    print("|---:|---:|---:|---:|---:|")
    ratios = []
    for nbytes in sizes:
        down, up = plain[nbytes]
        one_way = staged["times"][nbytes]
        ratio = down / one_way
        ratios.append((nbytes, ratio, nbytes / one_way / 1e9, nbytes / down / 1e9))
        print(
            f"| {label(nbytes)} | {nbytes / down / 1e9:.2f} | {nbytes / up / 1e9:.2f} | {nbytes / one_way / 1e9:.2f} "
            f"| {ratio:.2f}x |"
        )
    if arguments.summary:
        largest = ratios[-1]
        print(
            f"summary: {label(largest[0])}: host-staged {largest[2]:.1f} GB/s one way = {largest[1]:.2f}x "
            f"a plain D2H copy ({largest[3]:.1f} GB/s) on {card}"
        )


if __name__ == "__main__":
    main()
