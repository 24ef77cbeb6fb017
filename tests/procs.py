"""Run test bodies in two real processes (spawned, reaped, time-bounded) and pick free ports."""

from __future__ import annotations

import multiprocessing as mp
import random
import socket
import traceback
from collections.abc import Callable
from typing import Any

_CTX = mp.get_context("spawn")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            low, high = (int(word) for word in ranges.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(span: int = 4) -> int:
    """A port p such that p .. p+span-1 were all free a moment ago.

    Chosen below the kernel's ephemeral range: gloo's listeners and every outgoing connection take
    ephemeral ports, which would otherwise collide with a port picked earlier and bound later.
    """
    low, _ = _ephemeral_range()
    chooser = random.SystemRandom()  # concurrent test processes must not walk the same sequence
    for _ in range(500):
        base = chooser.randrange(10000, low - span)
        try:
            for offset in range(span):
                with socket.socket() as probe:
                    probe.bind(("0.0.0.0", base + offset))
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
