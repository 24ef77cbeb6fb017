"""Which CPUs kvbridge's background threads may run on.

A Linux thread starts with the CPU affinity of the thread that created it, and so do the native
threads a library starts on its behalf (ZeroMQ's I/O threads, the TCPStore's server thread, gloo's
threads). vLLM's CPU workers pin their main thread to one core each (``VLLM_CPU_OMP_THREADS_BIND``),
and after each step that thread polls vLLM's shared-memory queue for a second, yielding the CPU
in a loop. A kvbridge thread started from that thread would share that one core with the poller
and, on a busy host, could wait many seconds for it: long enough for a connect request, a
rendezvous or a TCPStore connection to miss its ``kv_timeout``.

:func:`unpinned` lets the calling thread run on every CPU the process may use while it starts
threads or native libraries, so that everything started there may run on any of those CPUs; the
caller's own affinity is restored afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_usable: frozenset[int] | None = None


def usable_cpus() -> frozenset[int]:
    """Every CPU this process may use: all of the host's CPUs that its cpuset allows (a thread
    pinned by vLLM is narrower). Linux only; elsewhere, the empty set."""
    global _usable
    if not hasattr(os, "sched_setaffinity"):
        return frozenset()
    with _lock:
        if _usable is None:
            _usable = _probe_usable_cpus()
        return _usable


def _probe_usable_cpus() -> frozenset[int]:
    """What the kernel lets a thread of this process run on when it asks for every CPU: the
    kernel keeps the CPUs of the process's cpuset. Probed on a thread of its own, so that no
    caller's affinity changes even for a moment."""
    found: list[frozenset[int]] = []

    def probe() -> None:
        try:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        except OSError as exc:  # e.g. a seccomp filter: keep the affinity threads are given
            logger.debug("kvbridge: cannot widen a thread's CPU affinity: %s", exc)
        found.append(frozenset(os.sched_getaffinity(0)))

    prober = threading.Thread(target=probe, name="kvbridge-cpus", daemon=True)
    prober.start()
    prober.join()
    return found[0]


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Within this block the calling thread may run on every usable CPU (see :func:`usable_cpus`);
    threads started in it, Python's or a native library's, keep that affinity. The caller's own
    affinity is restored on exit."""
    usable = usable_cpus()
    if not usable:
        yield
        return
    own = os.sched_getaffinity(0)
    if own >= usable:
        yield
        return
    os.sched_setaffinity(0, usable)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)
