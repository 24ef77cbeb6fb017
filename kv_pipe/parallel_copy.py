"""Large host copies split over a few threads.

One core cannot use all of a machine's memory bandwidth: on a 2-core host a 16 MiB copy runs at
about 14 GB/s on one thread and 26 GB/s on two. A payload's copy into shared memory is the only
copy of the same-host path, so it is split into parts, one per thread, for copies of at least
:data:`PARALLEL_MIN_BYTES` (below that, waking a helper costs more than it saves).

The helpers run ``memmove`` outside the GIL and are started once per process, one fewer than the
cores this process may run on (:func:`kv_pipe.cores.allowed_cores`), at most :data:`MAX_THREADS` in
all. OpenMP (torch's own copy) is not used: its threads keep spinning after each copy and take the
core from the peer process.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Sequence

import numpy as np

from kv_pipe import cores

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
    _run_groups(
        [[(destination + start, source + start, min(part, nbytes - start))] for start in range(0, nbytes, part)]
    )


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


def copy_pieces(
    targets: Sequence[tuple[int, int]] | np.ndarray, sources: Sequence[tuple[int, int]] | np.ndarray
) -> None:
    """Copy the bytes of ``sources`` into ``targets``, each ``(address, nbytes)`` pieces (a sequence or
    an ``[n, 2]`` int64 array) read (written) one after another as one stream; both streams have
    the same length (else ValueError, before anything is copied). Each copy is where a piece of one
    side meets a piece of the other, found with arrays (a paged transfer has hundreds of pieces)."""
    target = np.asarray(targets, dtype=np.int64).reshape(-1, 2)
    source = np.asarray(sources, dtype=np.int64).reshape(-1, 2)
    target_ends, source_ends = np.cumsum(target[:, 1]), np.cumsum(source[:, 1])
    total = int(target_ends[-1]) if len(target) else 0
    if total != (int(source_ends[-1]) if len(source) else 0):
        raise ValueError("the target and source pieces hold different numbers of bytes")
    if total == 0:
        return
    ends = np.union1d(target_ends, source_ends)
    ends = ends[ends > 0]
    starts = np.concatenate(([0], ends[:-1]))
    # The piece of each side that holds a segment's first byte (empty pieces are skipped).
    in_target = np.searchsorted(target_ends, starts, side="right")
    in_source = np.searchsorted(source_ends, starts, side="right")
    destinations = target[in_target, 0] + starts - (target_ends[in_target] - target[in_target, 1])
    origins = source[in_source, 0] + starts - (source_ends[in_source] - source[in_source, 1])
    copy_many(list(zip(destinations.tolist(), origins.tolist(), (ends - starts).tolist(), strict=True)))


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
                # The process's cores, not the caller's: an engine thread pinned to one core would
                # otherwise start no helper, and the helpers run on kvbridge's own cores.
                jobs: queue.SimpleQueue = queue.SimpleQueue()
                _helpers = max(0, min(len(cores.allowed_cores()), MAX_THREADS) - 1)
                for index in range(_helpers):
                    cores.thread(_serve, f"kvbridge-copy-{index}", (jobs,)).start()
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
