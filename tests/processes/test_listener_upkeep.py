"""A BufferListener's upkeep (accepting consumers, setting their connections up, expiring entries)
never waits for a connection that is slow to close; the memory of connections' pipes is counted.
No vLLM."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from harness import procs
from harness.tensors import same_bits
from kv_pipe import TorchDistributedPipe
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVPeerLostError
from lookup_buffer import BufferListener, dial
from lookup_buffer.config import BufferConfig
from lookup_buffer.listener import pipe_memory

pytestmark = pytest.mark.timeout(180)

HOST = "127.0.0.1"
ROI = torch.ones(3, dtype=torch.bool)


def producer_config(port: int, **changes: object) -> KVTransferConfig:
    return KVTransferConfig(
        **{
            "kv_role": "kv_producer",
            "kv_ip": HOST,
            "kv_port": port,
            "kv_timeout": 5.0,
            "kv_buffer_size": 1 << 22,
            **changes,
        }
    )


def consumer_config(**changes: object) -> KVTransferConfig:
    return KVTransferConfig(
        **{"kv_role": "kv_consumer", "kv_rank": 1, "kv_timeout": 5.0, "kv_buffer_size": 1 << 22, **changes}
    )


def wait_until(condition, timeout: float = 30.0) -> None:  # noqa: ANN001 - any callable
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def buffer_threads(before: set[threading.Thread]) -> list[str]:
    """The lookup buffer's threads alive now that were not alive ``before``."""
    return sorted(thread.name for thread in set(threading.enumerate()) - before if thread.name.startswith("kvbuf"))


class HeldClose:
    """A pipe factory whose first pipe's close waits until the test releases it."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.closing = threading.Event()  # the held close has begun
        self.closed = threading.Event()  # ... and ended
        self._lock = threading.Lock()
        self._made = 0

    def __call__(self, config: KVTransferConfig, **kwargs: object) -> TorchDistributedPipe:
        pipe = TorchDistributedPipe(config, **kwargs)
        with self._lock:
            self._made += 1
            first = self._made == 1
        if first:
            close = pipe.close

            def held_close() -> None:
                self.closing.set()
                try:
                    self.release.wait(120)
                    close()
                finally:
                    self.closed.set()

            pipe.close = held_close  # type: ignore[method-assign]
        return pipe


def close_within(listener: BufferListener, timeout: float) -> None:
    """Close ``listener`` in a thread and fail if that takes longer than ``timeout`` (a hang guard)."""
    closer = threading.Thread(target=listener.close, name="test-close")
    closer.start()
    closer.join(timeout)
    assert not closer.is_alive(), "the listener's close() did not return"


def test_a_connection_slow_to_close_delays_neither_a_new_consumer_nor_expiry() -> None:
    port = procs.free_port()
    held = HeldClose()
    before = set(threading.enumerate())
    config = producer_config(port)
    listener = BufferListener(config, pipe_factory=held, buffer_config=BufferConfig(kv_entry_timeout=1.0))
    try:
        first = dial(consumer_config(), HOST, port)
        wait_until(lambda: listener.connections == 1)
        first.close()
        assert held.closing.wait(30), "the listener never closed the ended connection"
        # The listener is closing the first connection, and that close hangs: meanwhile a second
        # consumer connects and is served, and an entry nobody takes expires.
        with dial(consumer_config(), HOST, port) as second:
            wait_until(lambda: listener.connections == 1)
            wanted = torch.arange(6.0)
            listener.insert(torch.tensor([1, 2, 3]), ROI, wanted, None, None)
            assert same_bits(second.drop_select(torch.tensor([1, 2, 3]), ROI, timeout=10)[2], wanted)
            listener.insert(torch.tensor([4, 5, 6]), ROI, torch.ones(4), None, None)
            wait_until(lambda: listener.stats().expired == 1)
            assert second.drop_select(torch.tensor([4, 5, 6]), ROI, timeout=0) == [None] * 5
            assert not held.closed.is_set(), "the first connection's close was not held all along"
            stats = listener.stats()
            assert (stats.hits, stats.misses, stats.entries) == (1, 1, 0)
        held.release.set()
        assert held.closed.wait(60)
        close_within(listener, 4 * config.kv_timeout + 30)
        assert buffer_threads(before) == []
        assert listener.stats().hits == 1  # counters of the connections that ended are kept
    finally:
        held.release.set()
        listener.close()


def test_close_is_bounded_while_a_connection_close_hangs_and_no_thread_outlives_it() -> None:
    port = procs.free_port()
    held = HeldClose()
    before = set(threading.enumerate())
    config = producer_config(port, kv_timeout=2.0)
    listener = BufferListener(config, pipe_factory=held)
    try:
        first = dial(consumer_config(kv_timeout=2.0), HOST, port)  # its pipe is the first: its close hangs
        wait_until(lambda: listener.connections == 1)
        with dial(consumer_config(kv_timeout=2.0), HOST, port) as lasting:
            wait_until(lambda: listener.connections == 2)
            first.close()
            assert held.closing.wait(30)
            close_within(listener, 4 * config.kv_timeout + 30)
            assert not held.closed.is_set(), "close() waited for the held connection close"
            wait_until(lambda: lasting.failure is not None)  # the other connection was closed
        held.release.set()
        assert held.closed.wait(60)
        wait_until(lambda: buffer_threads(before) == [])  # the held close's thread ends once it is released
    finally:
        held.release.set()
        listener.close()


def test_connections_are_refused_for_memory_while_an_ended_one_still_holds_its_pipe() -> None:
    port = procs.free_port()
    held = HeldClose()
    before = set(threading.enumerate())
    config = producer_config(port)
    one_connection = pipe_memory(config, shared=True)  # what a same-host connection is charged
    listener = BufferListener(config, pipe_factory=held, max_pipe_bytes=one_connection)
    try:
        first = dial(consumer_config(), HOST, port)
        wait_until(lambda: listener.connections == 1)
        [connection] = listener._live_connections()
        charged = pipe_memory(config, shared=connection._pipe.uses_shared_memory)  # less without the same-host path
        assert listener.pipe_bytes == charged
        with pytest.raises(KVPeerLostError, match="busy.*pipe memory"):
            dial(consumer_config(), HOST, port)
        first.close()
        assert held.closing.wait(30)
        # Ended, but its pipe is not closed yet: its memory is still held, and so still counted.
        with pytest.raises(KVPeerLostError, match="busy.*pipe memory"):
            dial(consumer_config(), HOST, port)
        assert listener.connections == 0 and listener.pipe_bytes == charged
        held.release.set()
        assert held.closed.wait(60)
        wait_until(lambda: listener.pipe_bytes == 0)
        with dial(consumer_config(), HOST, port) as again:
            listener.insert(torch.tensor([7, 8, 9]), ROI, torch.arange(3.0), None, None)
            assert same_bits(again.drop_select(torch.tensor([7, 8, 9]), ROI, timeout=10)[2], torch.arange(3.0))
    finally:
        held.release.set()
        close_within(listener, 4 * config.kv_timeout + 30)
    assert listener.pipe_bytes == 0
    assert buffer_threads(before) == []


def test_across_hosts_a_lone_consumer_keeps_no_pooled_memory_of_the_listener() -> None:
    """Without the same-host path, lending a lone consumer's pipe memory saves no copy, and would
    leave pooled memory in that pipe for as long as the consumer stays: ``empty`` uses the
    listener's own pool."""
    port = procs.free_port()
    config = producer_config(port, kv_shared_memory="off")
    with BufferListener(config) as listener, dial(consumer_config(), HOST, port) as consumer:
        wait_until(lambda: listener.connections == 1)
        assert listener.pipe_bytes == pipe_memory(config, shared=False)
        for index in range(3):
            tensor = listener.empty((2 << 20,), torch.uint8)
            tensor.fill_(index)
            tokens = torch.tensor([index, 10, 20])
            listener.insert(tokens, ROI, tensor, None, None)
            del tensor
            got = consumer.drop_select(tokens, ROI, timeout=10)
            assert bool((got[2] == index).all())
            del got
        [connection] = listener._live_connections()
        assert connection._pipe._state.wire._memory.idle_bytes == 0
        # The listener's pool gets a buffer back once the pipe has sent it and dropped it, which
        # may be a moment after the consumer has it.
        wait_until(lambda: listener._memory.idle_bytes > 0)
