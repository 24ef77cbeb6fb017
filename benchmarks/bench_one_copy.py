"""The floor of a one-copy connector: the consumer reading the producer's paged blocks straight into
its own, against the two copies the connector makes, measured in one run.

A producer process holds paged KV caches in vLLM's CPU layout (the shapes of bench_connector.py);
the consumer holds its own and a replica of the producer's. For a request of each size, scattered
over the caches, the consumer times, in alternating rounds:

* **two copies**: what the connector does in its place, gather the blocks out of the replica into
  one reused tensor (as the connector gathers into the pipe's memory) and scatter them into its own
  caches (``connector.gather_blocks`` and ``scatter_blocks``, on the connector's copy threads);
* **one copy**: each block copied from the replica straight into its place, on the same threads:
  the least any design can do;
* **shared caches**: the same copies, from the producer's own caches: it moved their pages into
  shared memory in place (:func:`kv_pipe.exported_memory.export_host_memory`) and the consumer
  mapped them read-only (:class:`kv_pipe.exported_memory.PeerMemory`), as a same-host pipe peer
  would;
* **cross-memory attach**: ``process_vm_readv`` from the producer's blocks into its own, one block
  per I/O vector, on 1 and on 2 threads. This needs the right to trace the producer (same user,
  and a Yama ``ptrace_scope`` that allows it); where it is refused the row says so.

Every method's result is checked bit for bit against the replica.

    python -m benchmarks.bench_one_copy [--mib 16,64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch

from benchmarks.bench_connector import BLOCK_BYTES, LAYERS, caches, page_aligned, request_blocks
from connector import VLLM_CPU_LAYOUT, gather_blocks, scatter_blocks
from kv_pipe.exported_memory import PeerMemory, export_host_memory
from kv_pipe.parallel_copy import copy_many

#: The most I/O vectors one process_vm_readv takes (the kernel's UIO_MAXIOV).
MAX_IOVECS = 1024
PRODUCER_SEED = 0


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(_IOVec),
    ctypes.c_ulong,
    ctypes.POINTER(_IOVec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]


def produce(num_blocks: int, addresses, done) -> None:
    """The producer: its caches, exported; their addresses and exports for the consumer; then wait
    until it is done."""
    layers = [page_aligned(layer) for layer in caches(num_blocks, seed=PRODUCER_SEED).caches]
    exports = [export_host_memory(layer) for layer in layers]
    addresses.put(
        [(layer.data_ptr(), export.address, export.descriptor) for layer, export in zip(layers, exports, strict=True)]
    )
    done.wait(600)


def block_copies(
    targets: list[int], sources: list[int], target_ids: torch.Tensor, source_ids: torch.Tensor
) -> list[tuple[int, int, int]]:
    """``(target address, source address, bytes)`` of every block of the request in every layer."""
    return [
        (target + int(t) * BLOCK_BYTES, source + int(s) * BLOCK_BYTES, BLOCK_BYTES)
        for target, source in zip(targets, sources, strict=True)
        for t, s in zip(target_ids.tolist(), source_ids.tolist(), strict=True)
    ]


def read_from(pid: int, copies: list[tuple[int, int, int]]) -> None:
    """process_vm_readv of ``copies`` (local target, remote source, bytes); OSError if refused."""
    for start in range(0, len(copies), MAX_IOVECS):
        batch = copies[start : start + MAX_IOVECS]
        local = (_IOVec * len(batch))(*[(target, nbytes) for target, _, nbytes in batch])
        remote = (_IOVec * len(batch))(*[(source, nbytes) for _, source, nbytes in batch])
        expected = sum(nbytes for _, _, nbytes in batch)
        got = _libc.process_vm_readv(pid, local, len(batch), remote, len(batch), 0)
        if got != expected:
            error = ctypes.get_errno()
            raise OSError(error, f"process_vm_readv moved {got} of {expected} bytes: {os.strerror(error)}")


def on_threads(work: Callable[[list], None], items: list, threads: int) -> None:
    """``work`` on ``threads`` about equal slices of ``items`` at once (ctypes calls drop the GIL)."""
    share = -(-len(items) // threads)
    helpers = [
        threading.Thread(target=work, args=(items[start : start + share],)) for start in range(share, len(items), share)
    ]
    for helper in helpers:
        helper.start()
    work(items[:share])
    for helper in helpers:
        helper.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="16,64", help="request sizes in MiB (multiples of 2)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the copies run on kvbridge's own threads; spinning OpenMP threads would slow them
    sizes = [int(size) << 20 for size in args.mib.split(",")]
    num_blocks = 2 * max(sizes) // (BLOCK_BYTES * LAYERS)
    context = multiprocessing.get_context("spawn")
    addresses, done = context.Queue(), context.Event()
    producer = context.Process(target=produce, args=(num_blocks, addresses, done), daemon=True)
    producer.start()
    try:
        produced = addresses.get(timeout=300)
        remote = [layer for layer, _, _ in produced]
        # Mapped once, as a pipe maps a peer's export once per connection (MAP_POPULATE: all pages).
        mapped = [
            (PeerMemory.open(producer.pid, descriptor), layer - exported) for layer, exported, descriptor in produced
        ]
        shared = [memory.address_of(offset, num_blocks * BLOCK_BYTES) for memory, offset in mapped]
        replica, own = caches(num_blocks, seed=PRODUCER_SEED), caches(num_blocks, seed=1)
        print(
            f"torch {torch.__version__}; {LAYERS} layers of fp32 blocks of {BLOCK_BYTES >> 10} KiB in vLLM's CPU "
            f"layout, the request's blocks scattered; medians of {args.repeats} alternating rounds; "
            f"{os.cpu_count()} cores"
        )
        print(
            f"{'size':>8} | {'two copies ms':>13} | {'one copy ms':>11} | {'shared caches ms':>16} | "
            f"{'CMA 1 thread ms':>15} | {'CMA 2 threads ms':>16} | {'two copies / shared':>19} | "
            f"{'two copies / best CMA':>21}"
        )
        print("-" * 145)
        for nbytes in sizes:
            print(row(nbytes, num_blocks, replica, own, remote, shared, producer.pid, args.repeats))
    finally:
        done.set()
        producer.join(30)
        if producer.is_alive():
            producer.kill()
            producer.join(10)


def row(
    nbytes: int, num_blocks: int, replica, own, remote: list[int], shared: list[int], pid: int, repeats: int
) -> str:
    source_ids = request_blocks(nbytes, num_blocks, seed=nbytes >> 20)
    target_ids = request_blocks(nbytes, num_blocks, seed=(nbytes >> 20) + 1)
    own_addresses = [layer.data_ptr() for layer in own.caches]
    local = block_copies(own_addresses, [layer.data_ptr() for layer in replica.caches], target_ids, source_ids)
    across = block_copies(own_addresses, remote, target_ids, source_ids)
    from_shared = block_copies(own_addresses, shared, target_ids, source_ids)
    expected = gather_blocks(replica.caches, VLLM_CPU_LAYOUT, source_ids)
    staging = torch.empty_like(expected)  # warm pages, reused: fresh ones would cost more than the copy

    def reuse_staging(shape, dtype) -> torch.Tensor:
        return staging.view(dtype).view(shape)

    methods = {
        "two copies": lambda: scatter_blocks(
            own.caches,
            VLLM_CPU_LAYOUT,
            target_ids,
            gather_blocks(replica.caches, VLLM_CPU_LAYOUT, source_ids, reuse_staging),
        ),
        "one copy": lambda: copy_many(local),
        "shared caches": lambda: copy_many(from_shared),
        "CMA 1 thread": lambda: read_from(pid, across),
        "CMA 2 threads": lambda: on_threads(lambda part: read_from(pid, part), across, 2),
    }
    cells: dict[str, list[float] | str] = {name: [] for name in methods}
    for _ in range(repeats + 1):  # the first round is a warm-up
        for name, method in methods.items():
            if isinstance(cells[name], str):
                continue
            for layer in own.caches:
                layer.zero_()  # every method must write every byte it claims
            try:
                start = time.perf_counter()
                method()
                cells[name].append(time.perf_counter() - start)
            except OSError as exc:
                cells[name] = f"refused: {exc.strerror or exc}"
                continue
            if not torch.equal(gather_blocks(own.caches, VLLM_CPU_LAYOUT, target_ids), expected):
                raise SystemExit(f"{name} delivered wrong bytes at {nbytes >> 20} MiB")
    medians = {name: statistics.median(times[1:]) for name, times in cells.items() if not isinstance(times, str)}
    shown = [f"{medians[name] * 1e3:.2f}" if name in medians else cells[name] for name in methods]
    cma = [medians[name] for name in ("CMA 1 thread", "CMA 2 threads") if name in medians]
    ratio = f"{medians['two copies'] / min(cma):.2f}x" if cma else "-"
    return (
        f"{nbytes >> 20:>4} MiB | {shown[0]:>13} | {shown[1]:>11} | {shown[2]:>16} | {shown[3]:>15} | "
        f"{shown[4]:>16} | {medians['two copies'] / medians['shared caches']:>18.2f}x | {ratio:>21}"
    )


if __name__ == "__main__":
    main()
