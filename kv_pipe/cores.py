"""The cores kvbridge's own threads run on: off the cores vLLM binds its compute threads to.

vLLM on CPU binds its compute (OpenMP) threads to cores (``VLLM_CPU_OMP_THREADS_BIND``), and the
binding pins the worker's main thread too. Linux threads inherit their creator's affinity, so every
thread kvbridge starts from an engine thread (saves, loads, pipe senders and receivers, tier writers)
would compete with the model on the engine's cores while the process's other cores sit idle. Every
kvbridge thread is therefore made by :func:`thread` or :func:`executor`, which move it, when it
starts, to the cores the process's setting chose (``kv_thread_cores``, :func:`parse_setting`):

``auto`` (the default)
    The cores this process may use (its cpuset) minus the cores its first kvbridge thread inherited
    and the cores ``VLLM_CPU_OMP_THREADS_BIND`` names (every TP rank's list). If none are left (an
    unpinned process, one allowed core, every core bound), every core the process may use: a thread
    confined to a vLLM worker's one core shares it with the worker's shared-memory queue poller,
    which spins on ``sched_yield`` for a second after each step, and on a busy host such a thread
    waited tens of seconds for its core (connect requests, rendezvous and TCPStore connections
    missed ``kv_timeout``); spread over the allowed cores, the kernel balances it.
``inherit``
    Threads keep their creator's affinity (e.g. a process run under ``taskset`` on purpose).
a list such as ``"1,3"`` or ``"2-5"``
    Exactly these cores; each must be one this process may use.

The choice is made once per process, by the first kvbridge thread that starts after
:func:`configure`, and logged at INFO. Native threads that a library starts on its own (ZeroMQ's I/O
thread with a context's first socket, the TCPStore's and gloo's threads) inherit the thread that
starts them: code that may run on an engine thread creates such objects inside :func:`spawning`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

from kv_pipe.errors import KVConfigError

logger = logging.getLogger(__name__)

#: The connector's setting (``kv_connector_extra_config``), named like vLLM's own variables.
SETTING_KEY = "kv_thread_cores"
AUTO = "auto"
INHERIT = "inherit"
#: A ``kv_thread_cores`` setting: :data:`AUTO`, :data:`INHERIT` or a set of cores.
Setting = str | frozenset[int]

#: vLLM's variable: one core list per local rank, separated by ``|``, or ``auto`` / ``nobind``.
VLLM_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
_ONLINE = "/sys/devices/system/cpu/online"
_PROBE_TIMEOUT = 10.0


def parse_cores(text: str) -> frozenset[int]:
    """The cores of a Linux CPU list such as ``"0-3,8,10-11"``; ValueError if it is not one."""
    found: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        low = int(first)
        high = int(last) if dash else low
        if low < 0 or high < low:
            raise ValueError(f"bad core range {part.strip()!r}")
        found.update(range(low, high + 1))
    return frozenset(found)


def parse_setting(value: Any, allowed: Collection[int] | None = None) -> Setting:
    """Validate a ``kv_thread_cores`` value: ``"auto"``, ``"inherit"``, a CPU list string or a list of
    core numbers. Cores outside ``allowed`` (default: :func:`allowed_cores`) are a KVConfigError."""
    if value in (AUTO, INHERIT):
        return str(value)
    try:
        if isinstance(value, str):
            cores = parse_cores(value)
        elif isinstance(value, (list, tuple)) and value and all(type(core) is int and core >= 0 for core in value):
            cores = frozenset(value)
        else:
            raise ValueError("not a core list")
    except ValueError:
        raise KVConfigError(
            f"kv_thread_cores must be 'auto', 'inherit' or a list of cores such as '1,3' or '2-5', got {value!r}"
        ) from None
    usable = allowed_cores() if allowed is None else frozenset(allowed)
    outside = sorted(cores - usable)
    if outside:
        raise KVConfigError(
            f"kv_thread_cores {value!r} names cores {outside} this process may not use; it may use {sorted(usable)}"
        )
    return cores


def _online_cores() -> frozenset[int]:
    try:
        with open(_ONLINE) as f:
            return parse_cores(f.read())
    except (OSError, ValueError):
        return frozenset(range(os.cpu_count() or 1))


@cache
def allowed_cores() -> frozenset[int]:
    """The cores this process may run on (its cpuset), whatever the calling thread is pinned to.

    Asked of the kernel: a short-lived thread asks for every online core and reads back what it got,
    which the kernel restricts to the cpuset (cgroup v1 or v2, container or not). A pinned thread's
    own affinity cannot tell, and the cgroup files sit in different places per version."""
    online = _online_cores()
    if not hasattr(os, "sched_setaffinity"):
        return online
    found: list[frozenset[int]] = []

    def probe() -> None:
        try:
            os.sched_setaffinity(0, online)
            found.append(frozenset(os.sched_getaffinity(0)))
        except OSError as exc:
            logger.warning("kvbridge: cannot read this process's allowed cores (%s); assuming %s", exc, sorted(online))

    prober = threading.Thread(target=probe, name="kvbridge-cores-probe", daemon=True)
    prober.start()
    prober.join(_PROBE_TIMEOUT)
    return found[0] if found else online


def vllm_bound_cores(environ: Mapping[str, str] | None = None) -> frozenset[int]:
    """Every core ``VLLM_CPU_OMP_THREADS_BIND`` names (all local ranks); none for ``auto``/``nobind``."""
    text = (os.environ if environ is None else environ).get(VLLM_BIND_ENV, AUTO).strip()
    bound: set[int] = set()
    for rank_list in text.split("|"):
        try:
            bound |= parse_cores(rank_list)
        except ValueError:
            pass  # "auto", "nobind": vLLM's choice shows in the inherited affinity instead
    return frozenset(bound)


def choose(setting: Setting, allowed: frozenset[int], bound: frozenset[int]) -> frozenset[int] | None:
    """The cores kvbridge's threads run on, None (``inherit``) to keep what they inherit (see the
    module docstring)."""
    if setting == INHERIT:
        return None
    if isinstance(setting, frozenset):
        return setting
    return (allowed - bound) or allowed


class ThreadCores:
    """One process's choice of cores for kvbridge's threads; made once, by the first :meth:`enter`.

    ``allowed`` and ``environ`` default to :func:`allowed_cores` and ``os.environ``."""

    def __init__(
        self,
        setting: Setting = AUTO,
        allowed: frozenset[int] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.setting = setting
        self._allowed = allowed
        self._environ = environ
        self._lock = threading.Lock()
        self._decided = False
        self._cores: frozenset[int] | None = None

    def _decide(self) -> frozenset[int] | None:
        with self._lock:
            if not self._decided:
                allowed = allowed_cores() if self._allowed is None else self._allowed
                inherited = frozenset(os.sched_getaffinity(0))
                bound = inherited | vllm_bound_cores(self._environ)
                self._cores = choose(self.setting, allowed, bound)
                self._decided = True
                if self._cores is None:
                    logger.info(
                        "kvbridge threads keep the cores they start on (%s; kv_thread_cores=%s, allowed %s, bound %s)",
                        sorted(inherited),
                        _show(self.setting),
                        sorted(allowed),
                        sorted(bound),
                    )
                else:
                    logger.info(
                        "kvbridge threads run on cores %s (kv_thread_cores=%s, allowed %s, bound %s)",
                        sorted(self._cores),
                        _show(self.setting),
                        sorted(allowed),
                        sorted(bound),
                    )
            return self._cores

    def enter(self) -> None:
        """Move the calling thread (a kvbridge thread, as it starts) onto the chosen cores."""
        if not hasattr(os, "sched_setaffinity"):
            return
        cores = self._decide()
        if cores is None:
            return
        try:
            os.sched_setaffinity(0, cores)
        except OSError as exc:
            # The cpuset shrank since the choice: the thread still works where it was.
            logger.warning(
                "kvbridge thread %s stays on its inherited cores: moving it to %s failed (%s)",
                threading.current_thread().name,
                sorted(cores),
                exc,
            )


def _show(setting: Setting) -> str:
    return ",".join(map(str, sorted(setting))) if isinstance(setting, frozenset) else setting


#: The process's choice; :func:`configure` replaces it when the setting changes.
PROCESS = ThreadCores()
_configure_lock = threading.Lock()


def configure(setting: Setting) -> None:
    """Set this process's ``kv_thread_cores`` (a value from :func:`parse_setting`), before it starts
    kvbridge threads. Called by each connector as it is created; the same setting again keeps the
    choice already made."""
    global PROCESS
    with _configure_lock:
        if setting != PROCESS.setting:
            PROCESS = ThreadCores(setting)


def _forget_choice() -> None:
    """In a forked child, a choice being made in another thread (its lock held) would never finish:
    the child makes its own."""
    global PROCESS
    PROCESS = ThreadCores(PROCESS.setting)


os.register_at_fork(after_in_child=_forget_choice)


def enter() -> None:
    """Move the calling thread onto this process's kvbridge cores (the start of every kvbridge thread)."""
    PROCESS.enter()


@contextlib.contextmanager
def spawning() -> Iterator[None]:
    """Within this block the calling thread (e.g. an engine thread vLLM pinned) runs on this
    process's kvbridge cores, so that the native threads libraries start in it inherit them; the
    caller's own affinity is restored on exit."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    own = os.sched_getaffinity(0)
    enter()
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def _entered(target: Callable[..., Any], *args: Any) -> Any:
    enter()
    return target(*args)


def thread(target: Callable[..., Any], name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
    """A daemon thread (not started) that runs ``target(*args)`` on this process's kvbridge cores."""
    return threading.Thread(target=_entered, args=(target, *args), name=name, daemon=True)


def executor(max_workers: int, thread_name_prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run on this process's kvbridge cores."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix, initializer=enter)
