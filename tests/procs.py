"""Run test bodies in two real processes (spawned, reaped, time-bounded) and pick free ports."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from collections.abc import Callable
from typing import Any

_CTX = mp.get_context("spawn")


def free_port(span: int = 4) -> int:
    """A port p such that p .. p+span-1 were all free a moment ago."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + span > 65000:
            continue
        try:
            for offset in range(span):
                with socket.socket() as other:
                    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    other.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range found")


def _child(target: Callable[..., Any], args: tuple, results: Any, slot: int) -> None:
    import torch

    torch.set_num_threads(1)  # two processes on two cores: OpenMP spinning would slow both
    try:
        results.put((slot, "ok", target(*args)))
    except BaseException:  # report everything, including SystemExit from the body
        results.put((slot, "error", traceback.format_exc()))


def start(target: Callable[..., Any], args: tuple, results: Any, slot: int) -> mp.Process:
    process = _CTX.Process(target=_child, args=(target, args, results, slot), daemon=True)
    process.start()
    return process


def new_queue() -> Any:
    return _CTX.Queue()


def collect(processes: list[mp.Process], results: Any, timeout: float, expect: int | None = None) -> dict[int, Any]:
    """Wait for ``expect`` results (default: one per process); kill every process in the end.

    Raises AssertionError with the child's traceback if a body failed, or on timeout.
    """
    import queue
    import time

    expect = len(processes) if expect is None else expect
    deadline = time.monotonic() + timeout
    outcomes: dict[int, Any] = {}
    try:
        while len(outcomes) < expect:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"test processes did not finish within {timeout} s; got {sorted(outcomes)}")
            try:
                slot, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p for p in processes if not p.is_alive() and p.exitcode not in (0, None)]
                if dead and results.empty():
                    codes = [p.exitcode for p in dead]
                    raise AssertionError(f"a test process died with exit code(s) {codes}") from None
                continue
            if status == "error":
                raise AssertionError(f"process {slot} failed:\n{value}")
            outcomes[slot] = value
        return outcomes
    finally:
        reap(processes)


def reap(processes: list[mp.Process]) -> None:
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def run_pair(target: Callable[..., Any], args0: tuple, args1: tuple, timeout: float = 60) -> tuple[Any, Any]:
    """Run ``target(*args0)`` and ``target(*args1)`` in two processes; return both results."""
    results = new_queue()
    processes = [start(target, args0, results, 0), start(target, args1, results, 1)]
    outcomes = collect(processes, results, timeout)
    return outcomes[0], outcomes[1]
