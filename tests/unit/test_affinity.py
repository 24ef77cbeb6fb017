"""kvbridge's background threads started from a thread pinned to one CPU (as vLLM pins a CPU worker's
main thread) may run on every CPU the process may use, and the pinned caller stays pinned.

Affinity is read from the kernel (``/proc/self/task/<tid>/status``), for Python threads and for the
native threads libraries start (ZeroMQ's I/O thread).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import zmq

from harness.procs import free_port
from kv_pipe import affinity
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVPeerLostError
from lookup_buffer.connections import ProducerConnections
from lookup_buffer.listener import BufferListener

WAIT = 30.0  # guards against a hang only


def cpus_of(tid: int) -> frozenset[int]:
    """A thread's CPU affinity as the kernel reports it."""
    status = Path(f"/proc/self/task/{tid}/status").read_text()
    (listed,) = [line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list")]
    cpus: set[int] = set()
    for part in listed.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def tasks_named(name: str) -> set[int]:
    return {int(task.name) for task in Path("/proc/self/task").iterdir() if (task / "comm").read_text().strip() == name}


@contextlib.contextmanager
def pinned_to_one_cpu() -> Iterator[frozenset[int]]:
    """The calling thread pinned to one usable CPU (the last), as vLLM pins a worker's main thread."""
    own = os.sched_getaffinity(0)
    one = frozenset({max(affinity.usable_cpus())})
    os.sched_setaffinity(0, one)
    try:
        yield one
    finally:
        os.sched_setaffinity(0, own)


def test_usable_cpus_are_the_process_cpus_whatever_the_caller_is_pinned_to() -> None:
    usable = affinity.usable_cpus()
    assert usable and usable <= set(range(os.cpu_count() or 1))
    with pinned_to_one_cpu() as one:
        affinity._usable = None  # probe again, from the pinned thread
        try:
            assert affinity.usable_cpus() == usable
        finally:
            affinity._usable = usable
        assert os.sched_getaffinity(0) == one  # the probe left the caller as it was


def test_threads_and_zmq_io_threads_started_unpinned_may_use_every_cpu_and_the_caller_stays_pinned() -> None:
    seen: list[frozenset[int]] = []
    before = tasks_named("ZMQbg/IO/0")
    with pinned_to_one_cpu() as one:
        with affinity.unpinned():
            started = threading.Thread(target=lambda: seen.append(frozenset(os.sched_getaffinity(0))))
            started.start()
            context = zmq.Context(io_threads=1)
            sock = context.socket(zmq.DEALER)  # libzmq starts its I/O thread with the first socket
        try:
            assert os.sched_getaffinity(0) == one
            started.join(WAIT)
            assert seen == [affinity.usable_cpus()]
            (io_thread,) = tasks_named("ZMQbg/IO/0") - before
            assert cpus_of(io_thread) == affinity.usable_cpus()
            # Started outside the block, a thread inherits the caller's pin: what the block is for.
            outside: list[frozenset[int]] = []
            plain = threading.Thread(target=lambda: outside.append(frozenset(os.sched_getaffinity(0))))
            plain.start()
            plain.join(WAIT)
            assert outside == [one]
        finally:
            sock.close(linger=0)
            context.term()


def test_a_listener_and_a_dial_started_from_a_pinned_thread_run_on_every_cpu() -> None:
    port = free_port(1)
    config = KVTransferConfig(kv_role="kv_producer", kv_ip="127.0.0.1", kv_port=port, kv_buffer_size=1 << 22)
    dialed: list[frozenset[int]] = []
    dial_done = threading.Event()

    def dial(*_: object) -> object:
        dialed.append(frozenset(os.sched_getaffinity(0)))
        dial_done.set()
        raise KVPeerLostError("this test looks only at where the attempt ran")

    before = tasks_named("ZMQbg/IO/0")
    with pinned_to_one_cpu() as one:
        listener = BufferListener(config)
        connections = ProducerConnections(KVTransferConfig(kv_role="kv_consumer", kv_rank=1), connect=dial)
        try:
            connections.when_ready(("127.0.0.1", port), lambda _: None)
            assert dial_done.wait(WAIT)
            assert os.sched_getaffinity(0) == one
            assert dialed == [affinity.usable_cpus()]
            (acceptor,) = [t for t in threading.enumerate() if t.name == f"kvbuf-listener-{port}"]
            assert acceptor.native_id is not None
            assert cpus_of(acceptor.native_id) == affinity.usable_cpus()
            (io_thread,) = tasks_named("ZMQbg/IO/0") - before
            assert cpus_of(io_thread) == affinity.usable_cpus()
        finally:
            connections.close()
            listener.close()
