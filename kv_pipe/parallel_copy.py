"""Large host copies split over a few threads.

One core cannot use all of a machine's memory bandwidth: on a 2-core host a 16 MiB copy runs at
about 14 GB/s on one thread and 26 GB/s on two. A payload's copy into shared memory is the only
copy of the same-host path, so it is split into parts, one per thread, for copies of at least
:data:`PARALLEL_MIN_BYTES` (below that, waking a helper costs more than it saves).

The helpers run ``memmove`` outside the GIL and are started once per process, one fewer than the
cores this process may run on, at most :data:`MAX_THREADS` in all. OpenMP (torch's own copy) is
not used: its threads keep spinning after each copy and take the core from the peer process.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Sequence

PARALLEL_MIN_BYTES = 4 << 20
MAX_THREADS = 4
_PART_ALIGN = 4096

_jobs: queue.SimpleQueue | None = None
_helpers = 0
_start_lock = threading.Lock()


def copy_bytes(destination: int, source: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``source`` to address ``destination`` (non-overlapping)."""
    threads = _threads() if nbytes >= PARALLEL_MIN_BYTES else 1
    if threads == 1:
        ctypes.memmove(destination, source, nbytes)
        return
    part = -(-nbytes // threads // _PART_ALIGN) * _PART_ALIGN
    _run_groups([[(destination + start, source + start, min(part, nbytes - start))]
                 for start in range(0, nbytes, part)])


def copy_many(copies: Sequence[tuple[int, int, int]]) -> None:
    """Run several non-overlapping copies ``(destination, source, nbytes)``, spread over the threads
    in groups of about equal bytes (a paged cache's blocks: many copies of a few hundred KiB)."""
    total = sum(nbytes for _, _, nbytes in copies)
    threads = _threads() if total >= PARALLEL_MIN_BYTES else 1
    if threads == 1 or len(copies) < 2 * threads:
        for destination, source, nbytes in copies:
            copy_bytes(destination, source, nbytes)
        return
    groups: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]
    loads = [0] * threads
    for copy in sorted(copies, key=lambda item: -item[2]):
        lightest = loads.index(min(loads))
        groups[lightest].append(copy)
        loads[lightest] += copy[2]
    _run_groups(groups)


def copy_pieces(targets: Sequence[tuple[int, int]], sources: Sequence[tuple[int, int]]) -> None:
    """Copy the bytes of ``sources`` into ``targets``, each a list of ``(address, nbytes)`` pieces
    read (written) one after another as one stream; both streams have the same length (else
    ValueError, before anything is copied). Pieces are split where the other side's end."""
    if sum(nbytes for _, nbytes in targets) != sum(nbytes for _, nbytes in sources):
        raise ValueError("the target and source pieces hold different numbers of bytes")
    copies = []
    target_index = source_index = target_done = source_done = 0
    while target_index < len(targets) and source_index < len(sources):
        (target, target_bytes), (source, source_bytes) = targets[target_index], sources[source_index]
        nbytes = min(target_bytes - target_done, source_bytes - source_done)
        if nbytes:
            copies.append((target + target_done, source + source_done, nbytes))
        target_done += nbytes
        source_done += nbytes
        if target_done == target_bytes:
            target_index, target_done = target_index + 1, 0
        if source_done == source_bytes:
            source_index, source_done = source_index + 1, 0
    copy_many(copies)


def _run_groups(groups: list[list[tuple[int, int, int]]]) -> None:
    """Run the first group of copies here and the others on the helpers; return when all are done."""
    done: queue.SimpleQueue = queue.SimpleQueue()
    for group in groups[1:]:
        _jobs.put((group, done))
    _copy_group(groups[0])
    for _ in groups[1:]:
        done.get()


def _threads() -> int:
    """How many threads a large copy uses (this one and the helpers), starting the helpers once."""
    global _jobs, _helpers
    if _jobs is None:
        with _start_lock:
            if _jobs is None:
                try:
                    cores = len(os.sched_getaffinity(0))
                except (AttributeError, OSError):
                    cores = os.cpu_count() or 1
                jobs: queue.SimpleQueue = queue.SimpleQueue()
                _helpers = max(0, min(cores, MAX_THREADS) - 1)
                for index in range(_helpers):
                    threading.Thread(target=_serve, args=(jobs,), name=f"kvbridge-copy-{index}", daemon=True).start()
                _jobs = jobs
    return _helpers + 1


def _forget_helpers() -> None:
    """In a forked child the helpers do not exist: start new ones on first use."""
    global _jobs
    _jobs = None


os.register_at_fork(after_in_child=_forget_helpers)


def _copy_group(group: list[tuple[int, int, int]]) -> None:
    for destination, source, nbytes in group:
        ctypes.memmove(destination, source, nbytes)


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        group, done = jobs.get()
        _copy_group(group)
        done.put(None)
