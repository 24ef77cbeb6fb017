"""A producer with many consumers (lookup_buffer.BufferListener) and consumers that connect on demand
(dial, ProducerConnections): disjoint and contended selects, consumers that die, expiry, restarts,
refusals. No vLLM."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import zmq

from harness import procs
from harness.tensors import random_tensor, same_bits
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVConfigError, KVPeerLostError, KVPipeClosedError, KVProtocolError, KVTransferError
from lookup_buffer import BufferListener, ProducerConnections, dial
from lookup_buffer.config import BufferConfig
from lookup_buffer.protocol import ControlSigner, Refusal, decode_connect_answer

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.float64,
    torch.bool,
    torch.uint8,
    torch.int64,
    torch.complex64,
    torch.float8_e4m3fn,
)
SHAPES = ((3, 5), (1,), (2, 3, 7), (17,), (4, 1, 9))


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


class Entry:
    """Random tokens (distinct per entry), a roi, and key/value/hidden of several dtypes and odd shapes."""

    def __init__(self, index: int, generator: torch.Generator) -> None:
        count = 5 + index % 7
        self.tokens = torch.arange(count, dtype=torch.int64) + 1000 * (index + 1)
        self.roi = torch.ones(count, dtype=torch.bool)
        self.key = random_tensor(generator, DTYPES[index % len(DTYPES)], SHAPES[index % len(SHAPES)])
        self.value = None if index % 3 == 0 else random_tensor(generator, DTYPES[(index + 1) % len(DTYPES)], (6, 2))
        self.hidden = None if index % 2 else random_tensor(generator, torch.float32, (1, 8))

    def insert(self, listener: BufferListener) -> None:
        listener.insert(self.tokens, self.roi, self.key, self.value, self.hidden)

    def matches(self, got: list) -> bool:
        return (
            same_bits(got[0], self.tokens)
            and same_bits(got[1], self.roi)
            and same_bits(got[2], self.key)
            and same_bits(got[3], self.value)
            and same_bits(got[4], self.hidden)
        )


def entries(count: int, seed: int = 0) -> list[Entry]:
    generator = torch.Generator().manual_seed(seed)
    return [Entry(index, generator) for index in range(count)]


@pytest.fixture()
def port() -> int:
    return procs.free_port()


@pytest.fixture()
def listener(port: int) -> Iterator[BufferListener]:
    with BufferListener(producer_config(port)) as producer:
        yield producer


def wait_until(condition, timeout: float = 30.0) -> None:  # noqa: ANN001 - any callable
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------- many consumers


def test_three_consumers_take_disjoint_entries_in_any_order_each_bit_exact(listener: BufferListener, port: int) -> None:
    wanted = entries(24, seed=1)
    consumers = [dial(consumer_config(), HOST, port) for _ in range(3)]
    try:
        for entry in wanted[:12]:  # half before the selects, half while they wait
            entry.insert(listener)
        shares = [wanted[index::3] for index in range(3)]
        for share in shares:
            random.Random(len(share)).shuffle(share)

        def take(consumer_index: int, entry: Entry) -> bool:
            got = consumers[consumer_index].drop_select(entry.tokens, entry.roi, timeout=30)
            return entry.matches(got)

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(take, index, entry) for index, share in enumerate(shares) for entry in share]
            time.sleep(0.2)
            for entry in wanted[12:]:
                entry.insert(listener)
            assert all(future.result(timeout=60) for future in futures)
        stats = listener.stats()
        assert (stats.hits, stats.entries, stats.bytes, stats.misses) == (24, 0, 0, 0)
        assert listener.connections == 3
    finally:
        for consumer in consumers:
            consumer.close()
    wait_until(lambda: listener.connections == 0)
    assert listener.stats().hits == 24  # counters of ended connections are kept


def test_an_entry_asked_for_by_two_consumers_goes_to_exactly_one(listener: BufferListener, port: int) -> None:
    wanted = entries(12, seed=2)
    consumers = [dial(consumer_config(), HOST, port) for _ in range(2)]
    try:

        def take_all(consumer_index: int) -> list[int]:
            taken = []
            for index, entry in enumerate(wanted):
                got = consumers[consumer_index].drop_select(entry.tokens, entry.roi, timeout=1.0)
                if got[0] is not None:
                    assert entry.matches(got)
                    taken.append(index)
            return taken

        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(take_all, index) for index in range(2)]
            for entry in wanted:
                entry.insert(listener)
                time.sleep(0.02)
            first, second = (future.result(timeout=60) for future in futures)
        assert sorted(first + second) == list(range(len(wanted)))  # every entry once, none twice
        stats = listener.stats()
        assert (stats.hits, stats.entries) == (len(wanted), 0)
    finally:
        for consumer in consumers:
            consumer.close()


def _select_and_wait_to_die(port: int, tokens: list[int], waiting: object) -> None:
    """A consumer process: connect, park a select for ``tokens`` that is never served, say so."""
    consumer = dial(consumer_config(), HOST, port)
    waiting.set()  # type: ignore[attr-defined]
    query = torch.tensor(tokens)
    consumer.drop_select(query, torch.ones_like(query, dtype=torch.bool), timeout=60)
    raise AssertionError("the parked select returned although nothing was inserted")


def test_a_consumer_killed_while_selecting_does_not_disturb_the_others(listener: BufferListener, port: int) -> None:
    results, waiting = procs.new_queue(), multiprocessing.get_context("spawn").Event()
    victim = procs.start(_select_and_wait_to_die, (port, [7, 7, 7], waiting), results, 0)
    survivor = dial(consumer_config(), HOST, port)
    try:
        assert waiting.wait(30), "the victim did not connect"
        wait_until(lambda: listener.connections == 2 and listener.stats().pending == 1)
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(lambda: listener.connections == 1)  # reaped
        wanted = entries(4, seed=3)
        for entry in wanted:
            entry.insert(listener)
        for entry in reversed(wanted):
            assert entry.matches(survivor.drop_select(entry.tokens, entry.roi, timeout=5))
        # The victim's key, inserted now, is there for anyone.
        orphan = torch.tensor([7, 7, 7])
        listener.insert(orphan, torch.ones(3, dtype=torch.bool), torch.arange(4.0), None, None)
        got = survivor.drop_select(orphan, torch.ones(3, dtype=torch.bool), timeout=5)
        assert same_bits(got[2], torch.arange(4.0))
    finally:
        survivor.close()
        procs.reap([victim])


def _in_own_segment(listener: BufferListener, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in the shared-memory segment of the listener's only connection's pipe."""
    [connection] = listener._live_connections()
    segment = connection._pipe._state.shared.own
    return segment.address <= tensor.data_ptr() < segment.address + segment.nbytes


def test_tensors_made_by_the_listener_reach_whichever_consumer_selects_them_bit_exact(
    listener: BufferListener, port: int
) -> None:
    """With one consumer connected, ``empty`` is that consumer's pipe memory (sent without a copy);
    otherwise pooled memory. Either way the entry reaches any consumer intact, also one that
    connected later, and also after the consumer whose memory it is has gone."""
    generator = torch.Generator().manual_seed(5)
    made: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def make(name: str, dtype: torch.dtype) -> torch.Tensor:
        # 384 KiB: from 256 KiB on, payloads go through shared memory
        tensor = listener.empty((3, (1 << 17) // dtype.itemsize), dtype)
        tensor.copy_(random_tensor(generator, dtype, tuple(tensor.shape)))
        tokens = torch.arange(4, dtype=torch.int64) + 100 * (len(made) + 1)
        listener.insert(tokens, torch.ones(4, dtype=torch.bool), tensor, None, None)
        made[name] = (tokens, tensor.clone())
        return tensor

    def take(consumer, name: str) -> None:  # noqa: ANN001 - a dialled buffer
        tokens, expected = made[name]
        got = consumer.drop_select(tokens, torch.ones(4, dtype=torch.bool), timeout=30)
        assert got[0] is not None, f"{name}: a miss"
        assert same_bits(got[2], expected), f"{name}: changed on the way"

    make("no consumer yet", torch.float32)
    first = dial(consumer_config(), HOST, port)
    second = None
    try:
        wait_until(lambda: listener.connections == 1)
        assert _in_own_segment(listener, make("one consumer", torch.bfloat16))
        assert _in_own_segment(listener, make("one consumer, taken by the next", torch.int16))
        assert _in_own_segment(listener, make("one consumer, who then leaves", torch.uint8))
        second = dial(consumer_config(), HOST, port)
        wait_until(lambda: listener.connections == 2)
        make("two consumers", torch.float64)
        take(first, "one consumer")
        take(first, "no consumer yet")
        take(second, "one consumer, taken by the next")
        take(second, "two consumers")
        first.close()
        wait_until(lambda: listener.connections == 1)
        take(second, "one consumer, who then leaves")
        assert listener.stats().entries == 0
    finally:
        first.close()
        if second is not None:
            second.close()


# ---------------------------------------------------------------------------------------------- expiry


def test_entries_nobody_takes_expire_and_free_their_bytes(port: int) -> None:
    config = producer_config(port, kv_buffer_size=1 << 20)
    expiring = BufferConfig(kv_entry_timeout=1.0)
    with (
        BufferListener(config, buffer_config=expiring) as listener,
        dial(consumer_config(kv_buffer_size=1 << 20), HOST, port) as consumer,
    ):
        tokens = [torch.tensor([index, index + 1]) for index in range(3)]
        roi = torch.ones(2, dtype=torch.bool)
        big = torch.zeros(600_000, dtype=torch.uint8)
        listener.insert(tokens[0], roi, big, None, None)  # fills most of the budget
        blocked = ThreadPoolExecutor(1)
        try:
            # Does not fit until the first entry expires: then it is stored.
            later = blocked.submit(listener.insert, tokens[1], roi, big.clone(), None, None, 30.0)
            later.result(timeout=30)
        finally:
            blocked.shutdown()
        stats = listener.stats()
        assert stats.expired >= 1 and stats.insert_waits == 1
        assert consumer.drop_select(tokens[0], roi, timeout=0) == [None] * 5  # expired: a miss
        fresh = torch.arange(5)
        listener.insert(tokens[2], roi, fresh, None, None)
        assert same_bits(consumer.drop_select(tokens[2], roi, timeout=0)[2], fresh)  # taken in time
        wait_until(lambda: listener.stats().entries == 0)  # the second big one expires too
        assert listener.stats().bytes == 0


# ---------------------------------------------------------------------------------------------- reconnection


def test_a_restarted_producer_is_reached_again_after_the_backoff(port: int) -> None:
    config = consumer_config(kv_timeout=1.0)
    connections = ProducerConnections(config, max_backoff=1.0)
    query = torch.tensor([4, 5, 6])
    roi = torch.ones(3, dtype=torch.bool)
    try:
        with BufferListener(producer_config(port)) as first:
            first.insert(query, roi, torch.arange(3.0), None, None)
            buffer = connections.get((HOST, port))
            assert same_bits(buffer.drop_select(query, roi, timeout=5)[2], torch.arange(3.0))
        wait_until(lambda: buffer.failure is not None)  # the producer closed: the connection knows
        with pytest.raises(KVPeerLostError, match="no producer answered"):
            connections.get((HOST, port))  # nothing listens: one bounded attempt
        with pytest.raises(KVPeerLostError, match="next attempt in"):
            connections.get((HOST, port))  # during the backoff: at once
        assert connections.count == 0
        with BufferListener(producer_config(port)) as second:
            second.insert(query, roi, torch.arange(6.0), None, None)
            deadline = time.monotonic() + 30
            while True:
                try:
                    again = connections.get((HOST, port))
                    break
                except KVPeerLostError:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
            assert again is not buffer and connections.count == 1
            assert same_bits(again.drop_select(query, roi, timeout=5)[2], torch.arange(6.0))
    finally:
        connections.close()


def test_a_connection_that_failed_a_call_is_replaced_on_the_next_use(listener: BufferListener, port: int) -> None:
    connections = ProducerConnections(consumer_config())
    try:
        first = connections.get((HOST, port))
        assert connections.get((HOST, port)) is first  # kept
        connections.discard((HOST, port), first, KVPeerLostError("test"))
        second = connections.get((HOST, port))
        assert second is not first
        connections.discard((HOST, port), first, KVPeerLostError("stale"))  # a replaced one: no effect
        assert connections.get((HOST, port)) is second
        wait_until(lambda: listener.connections == 1)
    finally:
        connections.close()
    with pytest.raises(KVPipeClosedError):
        connections.get((HOST, port))


# ---------------------------------------------------------------------------------------------- refusals


def test_a_wrong_or_missing_secret_is_refused_and_the_listener_keeps_serving(port: int) -> None:
    with BufferListener(producer_config(port, kv_secret="right")) as listener:
        for secret in ("wrong", None):
            with pytest.raises(KVProtocolError, match="authentication|kv_secret"):
                dial(consumer_config(kv_secret=secret), HOST, port)
        with dial(consumer_config(kv_secret="right"), HOST, port) as consumer:
            listener.insert(torch.tensor([1]), torch.tensor([True]), torch.ones(2), None, None)
            assert consumer.drop_select(torch.tensor([1]), torch.tensor([True]), timeout=5)[2] is not None


@pytest.mark.parametrize("frames", [[b"junk"], [b"\x81\xa4type\xa7connect"], [b"a", b"b"], [os.urandom(3000)]])
def test_junk_on_the_listening_port_gets_a_refusal_and_harms_no_one(
    listener: BufferListener, port: int, frames: list[bytes]
) -> None:
    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{HOST}:{port}")
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no answer to junk"
        answer = decode_connect_answer(ControlSigner(None), sock.recv())
        assert isinstance(answer, Refusal) and answer.reason == "malformed"
        sock.close()
    finally:
        context.term()
    with dial(consumer_config(), HOST, port):
        wait_until(lambda: listener.connections == 1)


def test_a_consumer_with_a_smaller_budget_is_refused_naming_it(listener: BufferListener, port: int) -> None:
    with pytest.raises(KVConfigError, match="kv_buffer_size"):
        dial(consumer_config(kv_buffer_size=1 << 20), HOST, port)


def test_a_refused_connection_check_costs_that_consumer_only(port: int) -> None:
    calls = []

    def check(pipe: object) -> None:
        calls.append(pipe)
        if len(calls) == 1:
            raise KVConfigError("incompatible peer: block_size differs")

    with BufferListener(producer_config(port), on_connect=check) as listener:
        refused = dial(consumer_config(), HOST, port)
        with pytest.raises(KVTransferError):  # the producer closed this connection at once
            refused.drop_select(torch.tensor([1]), torch.tensor([True]), timeout=5)
        refused.close()
        with dial(consumer_config(), HOST, port) as accepted:
            listener.insert(torch.tensor([2]), torch.tensor([True]), torch.ones(3), None, None)
            assert accepted.drop_select(torch.tensor([2]), torch.tensor([True]), timeout=5)[2] is not None
        assert len(calls) == 2


def test_nothing_listening_is_a_bounded_lost_peer_error() -> None:
    start = time.monotonic()
    with pytest.raises(KVPeerLostError, match="no producer answered"):
        dial(consumer_config(kv_timeout=0.5), HOST, procs.free_port())
    assert time.monotonic() - start < 30  # a hang guard, not a timing claim


def test_an_unanswered_connect_request_says_how_far_its_connection_got() -> None:
    """The error tells nothing listening (connect retried), a listener whose owner never accepts
    (TCP connected, no ZeroMQ handshake) and a ZeroMQ peer that never answers (handshake done), and
    says what each means."""
    config = consumer_config(kv_timeout=0.5)
    with pytest.raises(KVPeerLostError, match="no producer answered") as nobody:
        dial(config, HOST, procs.free_port(1))
    assert "connect retried" in str(nobody.value) and "connected" not in str(nobody.value)
    assert "nothing accepted the connection" in str(nobody.value)
    with socket.create_server((HOST, 0)) as never_accepts:
        with pytest.raises(KVPeerLostError, match="no producer answered") as silent_tcp:
            dial(config, HOST, never_accepts.getsockname()[1])
    assert "connected 1x" in str(silent_tcp.value) and "handshake done" not in str(silent_tcp.value)
    assert "never sent ZeroMQ's greeting" in str(silent_tcp.value)
    context = zmq.Context()
    never_reads = context.socket(zmq.ROUTER)
    try:
        port = never_reads.bind_to_random_port(f"tcp://{HOST}")
        with pytest.raises(KVPeerLostError, match="no producer answered") as silent_router:
            dial(config, HOST, port)
        assert "connected 1x" in str(silent_router.value) and "handshake done 1x" in str(silent_router.value)
        assert "never answered the request" in str(silent_router.value)
    finally:
        never_reads.close(linger=0)
        context.term()


# ---------------------------------------------------------------------------------------------- close


def test_close_wakes_a_blocked_insert_and_ends_every_connection(port: int) -> None:
    listener = BufferListener(producer_config(port, kv_buffer_size=1 << 20))
    consumer = dial(consumer_config(kv_buffer_size=1 << 20), HOST, port)
    roi = torch.ones(1, dtype=torch.bool)
    listener.insert(torch.tensor([1]), roi, torch.zeros(700_000, dtype=torch.uint8), None, None)
    with ThreadPoolExecutor(2) as pool:
        blocked = pool.submit(
            listener.insert, torch.tensor([2]), roi, torch.zeros(700_000, dtype=torch.uint8), None, None, 60.0
        )
        waiting = pool.submit(consumer.drop_select, torch.tensor([3]), roi, 60.0)
        wait_until(lambda: listener.stats().inserts_blocked == 1 and listener.stats().pending == 1)
        listener.close()
        with pytest.raises(KVPipeClosedError):
            blocked.result(timeout=30)
        with pytest.raises(KVTransferError) as error:  # an error, never a miss
            waiting.result(timeout=30)
        assert isinstance(error.value, (KVPipeClosedError, KVPeerLostError, KVProtocolError))
    wait_until(lambda: consumer.failure is not None)
    consumer.close()
    with pytest.raises(KVPipeClosedError):
        listener.insert(torch.tensor([4]), roi, torch.ones(1), None, None)
