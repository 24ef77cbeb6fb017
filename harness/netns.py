"""Two "hosts" on one machine: two network namespaces joined by a veth pair, and processes inside them.

Only namespaces created here are touched, and traffic only goes to their own addresses
(``ADDRESSES``). Creating them needs root or CAP_NET_ADMIN; :func:`two_hosts` raises
:class:`NamespacesUnavailable` (tests turn it into a skip) only when the namespace itself cannot be
made. Everything is deleted on exit, and leftovers of an earlier run that was killed are removed
the next time (matched by this module's name prefix and a dead owner pid).

Processes inside a namespace run ``python -m harness.netns MODULE:FUNCTION RESULT_FILE JSON_ARGS``:
the function's JSON-able return value (or its traceback) lands in ``RESULT_FILE``, and anything it
prints with :func:`progress` can be awaited by the test with :meth:`Child.wait_for`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.procs import OWN_PROCESS_GROUP, REPO

ADDRESSES = ("10.231.0.1", "10.231.0.2")
_PREFIX = "kvbridge-test"
_COUNTER = itertools.count()
_COMMAND_TIMEOUT = 20.0


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no CAP_NET_ADMIN, no iproute2)."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


@dataclasses.dataclass
class TwoHosts:
    """Namespaces ``names[i]`` with veth end ``links[i]`` at ``ADDRESSES[i]``/24."""

    names: tuple[str, str]
    links: tuple[str, str]
    addresses: tuple[str, str] = ADDRESSES

    def ip(self, host: int, *args: str) -> subprocess.CompletedProcess:
        return _run("ip", "-n", self.names[host], *args)

    def tc(self, host: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", self.names[host], "tc", *args, check=check)

    def set_link(self, host: int, up: bool) -> None:
        self.ip(host, "link", "set", self.links[host], "up" if up else "down")

    def popen(self, host: int, argv: list[str], env: dict[str, str], log_dir: Path, tag: str) -> subprocess.Popen:
        """Start ``argv`` inside namespace ``host`` in its own process group; output goes to files in ``log_dir``."""
        with open(log_dir / f"{tag}.out", "w") as out, open(log_dir / f"{tag}.err", "w") as err:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.names[host], *argv],
                env=env,
                cwd=REPO,
                stdout=out,
                stderr=err,
                **OWN_PROCESS_GROUP,
            )

    def spawn(
        self, host: int, target: str, args: list[Any], log_dir: Path, tag: str, env: dict[str, str] | None = None
    ) -> Child:
        """Run ``target`` ("module:function") with ``args`` in a Python process inside namespace ``host``."""
        result_file = log_dir / f"{tag}.json"
        argv = [sys.executable, "-m", "harness.netns", target, str(result_file), json.dumps(args)]
        process = self.popen(host, argv, child_env(env), log_dir, tag)
        return Child(tag, process, log_dir / f"{tag}.out", log_dir / f"{tag}.err", result_file)

    def destroy(self) -> None:
        for name in self.names:
            _run("ip", "netns", "delete", name, check=False)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """Create two namespaces joined by a veth pair; delete them on exit."""
    _remove_leftovers()
    pid, serial = os.getpid(), next(_COUNTER)
    # Interface names have at most 15 characters.
    hosts = TwoHosts(
        names=(f"{_PREFIX}-{pid}-{serial}-a", f"{_PREFIX}-{pid}-{serial}-b"),
        links=(f"kv{pid % 10**7}x{serial % 1000}a", f"kv{pid % 10**7}x{serial % 1000}b"),
    )
    try:
        _run("ip", "netns", "add", hosts.names[0])
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        raise NamespacesUnavailable(f"cannot create a network namespace (needs root / CAP_NET_ADMIN): {exc}") from exc
    try:
        _run("ip", "netns", "add", hosts.names[1])
        # Created inside the first namespace, so the host's own interfaces are never involved.
        _run(
            "ip",
            "-n",
            hosts.names[0],
            "link",
            "add",
            hosts.links[0],
            "type",
            "veth",
            "peer",
            "name",
            hosts.links[1],
            "netns",
            hosts.names[1],
        )
        for host in (0, 1):
            hosts.ip(host, "link", "set", "lo", "up")
            hosts.ip(host, "addr", "add", f"{hosts.addresses[host]}/24", "dev", hosts.links[host])
            hosts.set_link(host, up=True)
        _wait_reachable(hosts)
        yield hosts
    finally:
        hosts.destroy()


def _wait_reachable(hosts: TwoHosts) -> None:
    # An address can stay "tentative" for a moment after the link comes up; binding it fails until then.
    deadline = time.monotonic() + _COMMAND_TIMEOUT
    while True:
        states = [hosts.ip(host, "-o", "-4", "addr", "show", "dev", hosts.links[host]).stdout for host in (0, 1)]
        if all("tentative" not in state and "inet " in state for state in states):
            link = [hosts.ip(host, "-o", "link", "show", hosts.links[host]).stdout for host in (0, 1)]
            if all("LOWER_UP" in state for state in link):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"veth link did not come up: {states}")
        time.sleep(0.05)


def _remove_leftovers() -> None:
    listed = _run("ip", "netns", "list", check=False).stdout
    for match in re.finditer(rf"^({_PREFIX}-(\d+)-\d+-[ab])\b", listed, re.MULTILINE):
        name, pid = match.group(1), int(match.group(2))
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            _run("ip", "netns", "delete", name, check=False)


# ---------------------------------------------------------------- child processes


@dataclasses.dataclass
class Child:
    """A process started by :meth:`TwoHosts.spawn`."""

    tag: str
    process: subprocess.Popen
    stdout: Path
    stderr: Path
    result_file: Path

    def wait_for(self, word: str, timeout: float) -> str:
        """Wait until the child printed a line starting with ``word`` (see :func:`progress`); return it."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.stdout.read_text().splitlines():
                if line.startswith(word + " "):
                    return line[len(word) + 1 :]
            if self.process.poll() is not None:
                raise AssertionError(f"{self.tag} exited ({self.process.returncode}) before {word!r}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.tag} did not report {word!r} within {timeout} s:\n{self.logs()}")
            time.sleep(0.02)

    def result(self, timeout: float) -> Any:
        """The function's return value; AssertionError with its traceback or logs if it failed or hung."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.tag} did not finish within {timeout} s:\n{self.logs()}") from None
        if not self.result_file.exists():
            raise AssertionError(f"{self.tag} exited ({self.process.returncode}) without a result:\n{self.logs()}")
        outcome = json.loads(self.result_file.read_text())
        if "error" in outcome:
            raise AssertionError(f"{self.tag} failed:\n{outcome['error']}\n{self.logs()}")
        return outcome["value"]

    def kill(self) -> None:
        kill_session(self.process)

    def logs(self) -> str:
        return (
            f"--- {self.tag} stdout\n{self.stdout.read_text()[-3000:]}\n--- {self.tag} stderr\n"
            f"{self.stderr.read_text()[-5000:]}"
        )


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL a process started by :meth:`TwoHosts.popen` and everything in its session; reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def progress(word: str, value: Any = "") -> None:
    """Tell the test something from inside a child (read by :meth:`Child.wait_for`)."""
    print(word, json.dumps(value), flush=True)


@contextlib.contextmanager
def reaping(*children: Child) -> Iterator[None]:
    """Kill every child (and its session) on exit, however the block ends."""
    try:
        yield
    finally:
        for child in children:
            child.kill()


def _main(target: str, result_file: str, args_json: str) -> None:
    module_name, function_name = target.split(":")
    try:
        import torch

        torch.set_num_threads(1)  # two processes on two cores: OpenMP spinning would slow both
        function = getattr(importlib.import_module(module_name), function_name)
        outcome = {"value": function(*json.loads(args_json))}
    except BaseException:  # reported to the test, which fails with it
        outcome = {"error": traceback.format_exc()}
    partial = result_file + ".partial"
    with open(partial, "w") as out:
        json.dump(outcome, out)
    os.replace(partial, result_file)


if __name__ == "__main__":
    _main(*sys.argv[1:4])
