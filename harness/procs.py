"""Run test bodies in two real processes, or commands in subprocesses (spawned, reaped, time-bounded),
and pick free ports."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kv_pipe.cores import parse_cores

_CTX = mp.get_context("spawn")
REPO = Path(__file__).resolve().parents[1]

#: ``subprocess.Popen`` arguments for a child reaped with everything it starts (``os.killpg``): a
#: process group of its own, in the caller's session. Not a session of its own: with
#: ``kernel.sched_autogroup_enabled`` (the default of most distributions) Linux gives every session a
#: scheduling group, and on a host where vLLM's busy-polling workers outnumber the cores, a whole
#: instance in another group went 3 to 27 s without a CPU (docs/failure-behaviour.md).
OWN_PROCESS_GROUP: dict[str, Any] = {"process_group": 0, "stdin": subprocess.DEVNULL}


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


def new_event() -> Any:
    return _CTX.Event()


def collect(processes: list[mp.Process], results: Any, timeout: float, expect: int | None = None) -> dict[int, Any]:
    """Wait for ``expect`` results (default: one per process); kill every process in the end.

    Raises AssertionError with the child's traceback if a body failed, or on timeout.
    """
    import queue

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


@dataclasses.dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


def run_commands(commands: list[tuple[list[str], dict[str, str]]], tmp_path: Path, timeout: float) -> list[Finished]:
    """Run the commands at once from the repository, each with the test's environment (less any
    ``KVBRIDGE_*`` variable, plus the repository on PYTHONPATH) updated by its own, and each in its
    own process group (:data:`OWN_PROCESS_GROUP`), so that the processes it starts (torchrun's workers,
    a benchmark's) die with it.
    Output goes to files, not pipes, so that no process blocks on a full pipe while another waits for it.
    Raises AssertionError with the tails of their stderr if they have not all ended within ``timeout``."""
    env_base = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    env_base["PYTHONPATH"] = os.pathsep.join([str(REPO), env_base.get("PYTHONPATH", "")])
    started, files = [], []
    try:
        for index, (command, env) in enumerate(commands):
            out, err = tmp_path / f"{index}.out", tmp_path / f"{index}.err"
            files.append((out, err))
            with out.open("w") as stdout, err.open("w") as stderr:
                started.append(
                    subprocess.Popen(
                        command, cwd=REPO, env={**env_base, **env}, stdout=stdout, stderr=stderr, **OWN_PROCESS_GROUP
                    )
                )
        deadline = time.monotonic() + timeout
        for process in started:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                tails = "\n".join(err.read_text()[-3000:] for _, err in files)
                raise AssertionError(f"{process.args} did not finish within {timeout} s:\n{tails}") from None
    finally:
        for process in started:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(timeout=10)
    return [
        Finished(process.returncode, out.read_text(), err.read_text())
        for process, (out, err) in zip(started, files, strict=True)
    ]


def group_processes(leader: int) -> list[int]:
    """The pids of every process in the process group ``leader`` leads (a server started with
    :data:`OWN_PROCESS_GROUP`)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            group = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        if group == leader:
            pids.append(int(entry))
    return pids


def thread_cores(pid: int) -> dict[int, tuple[str, frozenset[int]]]:
    """Per thread of process ``pid`` (native ones included): its name and the cores the kernel lets
    it run on (``Cpus_allowed_list``); the threads that ended meanwhile, or all of a process that
    did, are left out."""
    threads = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            status = (task / "status").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        (listed,) = [line.split(":", 1)[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")]
        threads[int(task.name)] = (name, parse_cores(listed))
    return threads
