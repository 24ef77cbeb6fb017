"""What the two-process benchmarks share: message sizes and their labels, how many messages a round
times, the timing loop, and raw gloo's own process group (the baseline every table starts from)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch

from kv_pipe.config import local_address_towards

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
#: gloo's own timeout on the raw groups: longer than any round, since any gloo timeout closes the pair.
RAW_GROUP_TIMEOUT = datetime.timedelta(seconds=300)


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096; a bare number is bytes."""
    return int(text[:-1]) * UNITS[text[-1].upper()] if text[-1].upper() in UNITS else int(text)


def parse_sizes(text: str) -> list[int]:
    return [parse_size(size) for size in text.split(",")]


def label(nbytes: int) -> str:
    for suffix, unit in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= unit:
            return f"{nbytes // unit} {suffix}"
    return f"{nbytes} B"


def raw_group(
    rank: int, port: int, ip: str = "127.0.0.1"
) -> tuple[torch.distributed.ProcessGroup, torch.distributed.TCPStore]:
    """A two-member ProcessGroupGloo on its own TCPStore (hosted by rank 0 at ``ip:port``), listening
    on the local address that faces ``ip``. The store must outlive the group."""
    store = torch.distributed.TCPStore(ip, port, 2, rank == 0, timeout=RAW_GROUP_TIMEOUT)
    options = torch.distributed.ProcessGroupGloo._Options()
    options._timeout = RAW_GROUP_TIMEOUT
    options._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=local_address_towards(ip))]
    return torch.distributed.ProcessGroupGloo(store, rank, 2, options), store


def timed_round_trips(nbytes: int, iters: int) -> int:
    """Messages per round: small sizes get many more (up to 64 MiB moved per round, at most 1,000),
    since a median of a few 50-us samples on a shared machine is mostly noise."""
    if nbytes > 128 << 20:
        return max(3, iters // 2)
    return max(iters, min(1000, (64 << 20) // nbytes))


def warmup_count(nbytes: int) -> int:
    return 2 if nbytes <= 64 << 20 else 1


def timed(step: Callable[[], None], count: int, warmup: int, per_step: float = 1.0) -> list[float]:
    """Seconds each of ``count`` calls of ``step`` took (after ``warmup`` untimed ones), times
    ``per_step`` (1/2 for a round trip timed as one-way)."""
    times = []
    for index in range(warmup + count):
        start = time.perf_counter()
        step()
        if index >= warmup:
            times.append((time.perf_counter() - start) * per_step)
    return times


def run_two_ranks(worker: Callable[..., None], args: tuple, timeout: float = 1800) -> object:
    """Run ``worker(rank, *args, results)`` for ranks 0 and 1 in two spawned processes and return the
    first thing one of them puts on ``results``. Exits at once, instead of at the timeout, when a
    worker has failed; both are reaped however it ends."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    processes = [ctx.Process(target=worker, args=(rank, *args, results)) for rank in (0, 1)]
    for process in processes:
        process.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                failed = [process.exitcode for process in processes if process.exitcode not in (None, 0)]
                if failed:
                    raise SystemExit(
                        f"a benchmark process failed (exit codes {failed}); see its traceback above"
                    ) from None
                if time.monotonic() > deadline:
                    raise SystemExit(f"the benchmark did not finish within {timeout:g} s") from None
    finally:
        reap(processes)


def reap(processes: list, grace: float = 60) -> None:
    """Join each process, killing one that has not ended within ``grace`` seconds."""
    for process in processes:
        process.join(timeout=grace)
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
