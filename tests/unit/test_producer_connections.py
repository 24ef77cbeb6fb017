"""ProducerConnections on its own, over a scripted dialer and a clock the tests move: one attempt per
producer at a time, in a dial thread; a circuit per producer that opens after a failed attempt and
half-opens for exactly one attempt after its backoff; callers that never wait; close.

Nothing here measures time: every wait is on an event, with a timeout that only guards against hangs.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from harness.dialing import WAIT, Dialer, FakeBuffer, Gate, Told
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVPeerLostError, KVPipeClosedError, KVProtocolError
from lookup_buffer import connections as connections_module
from lookup_buffer.connections import FIRST_BACKOFF, ProducerConnections

DEAD, ALIVE = ("10.0.0.66", 9000), ("10.0.0.7", 9000)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The connections' monotonic clock, moved by the test only."""
    now = [1000.0]
    monkeypatch.setattr(connections_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def make(dialer: Dialer) -> ProducerConnections:
    return ProducerConnections(KVTransferConfig(kv_role="kv_consumer", kv_rank=1), max_backoff=10.0, connect=dialer)


def no_dial_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name == "kvbuf-dial"]


def test_one_attempt_serves_every_waiter_and_no_caller_waits_for_it(clock: list[float]) -> None:
    buffer = FakeBuffer("p")
    gate = Gate(buffer)
    dialer = Dialer({DEAD: [gate]})
    connections = make(dialer)
    try:
        waiters = [Told() for _ in range(12)]
        for told in waiters:
            connections.when_ready(DEAD, told)  # returns while the attempt is blocked
        assert gate.entered.wait(WAIT)
        assert dialer.count(DEAD) == 1 and connections.dialing == 1
        assert not any(told.done.is_set() for told in waiters)
        assert dialer.threads == {"kvbuf-dial"}
        gate.opened.set()
        assert all(told.wait() is buffer for told in waiters)
        assert connections.count == 1 and connections.dialing == 0
        now = Told()
        connections.when_ready(DEAD, now)
        assert now.done.is_set() and now.wait() is buffer  # connected: told at once, in this thread
        assert now.threads == [threading.current_thread().name]
        assert connections.get(DEAD) is buffer and dialer.count(DEAD) == 1  # kept
    finally:
        gate.opened.set()
        connections.close()
    assert buffer.closed.is_set() and no_dial_threads()


def test_a_producer_being_dialed_delays_no_other_producer(clock: list[float]) -> None:
    stuck = Gate(KVPeerLostError("no producer answered"))
    alive = FakeBuffer("alive")
    dialer = Dialer({DEAD: [stuck], ALIVE: [alive]})
    connections = make(dialer)
    try:
        dead_waiters = [Told() for _ in range(10)]
        for told in dead_waiters:
            connections.when_ready(DEAD, told)
        assert stuck.entered.wait(WAIT)
        told = Told()
        connections.when_ready(ALIVE, told)
        assert told.wait() is alive  # while the other attempt is still blocked
        assert not stuck.left.is_set() and not any(t.done.is_set() for t in dead_waiters)
        assert connections.get(ALIVE) is alive
    finally:
        stuck.opened.set()
        connections.close()
    assert no_dial_threads()


def test_a_failed_attempt_opens_the_circuit_and_after_the_backoff_exactly_one_attempt_is_made(
    clock: list[float],
) -> None:
    first = Gate(KVPeerLostError("no producer answered at 10.0.0.66:9000"))
    second = Gate(KVPeerLostError("still nobody"))
    buffer = FakeBuffer("back")
    dialer = Dialer({DEAD: [first, second, buffer]})
    connections = make(dialer)
    try:
        waiters = [Told() for _ in range(9)]
        for told in waiters:
            connections.when_ready(DEAD, told)
        assert first.entered.wait(WAIT)
        first.opened.set()
        errors = [told.wait() for told in waiters]
        assert all(isinstance(error, KVPeerLostError) and "no producer answered" in str(error) for error in errors)
        # Open: told at once, in this thread, why and when the next attempt is; no attempt.
        for _ in range(20):
            told = Told()
            connections.when_ready(DEAD, told)
            assert told.done.is_set()
            error = told.wait()
            assert isinstance(error, KVPeerLostError)
            message = str(error)
            assert "10.0.0.66:9000" in message and "no producer answered at 10.0.0.66:9000" in message
            assert f"next attempt in {FIRST_BACKOFF:.1f} s" in message
        with pytest.raises(KVPeerLostError, match="next attempt in"):
            connections.get(DEAD)
        assert dialer.count(DEAD) == 1
        # Half-open: exactly one attempt, which the others wait for without calling the dialer.
        clock[0] += FIRST_BACKOFF
        waiters = [Told() for _ in range(9)]
        for told in waiters:
            connections.when_ready(DEAD, told)
        assert second.entered.wait(WAIT)
        assert dialer.count(DEAD) == 2 and not any(told.done.is_set() for told in waiters)
        second.opened.set()
        assert all("still nobody" in str(told.wait()) for told in waiters)
        # The backoff doubles: still open after the first backoff, half-open after twice that.
        clock[0] += FIRST_BACKOFF
        told = Told()
        connections.when_ready(DEAD, told)
        assert "still nobody" in str(told.wait()) and "next attempt in 0.5 s" in str(told.results[0])
        clock[0] += FIRST_BACKOFF
        assert connections.get(DEAD) is buffer and dialer.count(DEAD) == 3
        assert connections.count == 1
    finally:
        first.opened.set()
        second.opened.set()
        connections.close()
    assert no_dial_threads()


def test_a_connection_found_dead_is_replaced_at_once_without_a_backoff(clock: list[float]) -> None:
    old, new = FakeBuffer("old"), FakeBuffer("new")
    dialer = Dialer({ALIVE: [old, new]})
    connections = make(dialer)
    try:
        assert connections.get(ALIVE) is old
        old.failure = KVPeerLostError("the producer restarted")
        assert connections.get(ALIVE) is new and dialer.count(ALIVE) == 2
        assert old.closed.wait(WAIT)  # closed in the background
        connections.discard(ALIVE, old, KVPeerLostError("stale"))  # replaced since: nothing happens
        assert connections.connected(ALIVE) is new
        connections.discard(ALIVE, new, KVPeerLostError("lost"))
        assert connections.connected(ALIVE) is None and connections.count == 0
    finally:
        connections.close()


def test_a_refusal_and_a_faulty_dialer_reach_every_waiter_and_open_the_circuit(clock: list[float]) -> None:
    refused, faulty = Gate(KVProtocolError("authentication failed")), Gate(ValueError("a bug"))
    dialer = Dialer({DEAD: [refused], ALIVE: [faulty]})
    connections = make(dialer)
    try:
        for address, gate, kind, text in (
            (DEAD, refused, KVProtocolError, "authentication failed"),
            (ALIVE, faulty, ValueError, "a bug"),
        ):
            waiters = [Told() for _ in range(3)]
            for told in waiters:
                connections.when_ready(address, told)
            gate.opened.set()
            assert all(isinstance(told.wait(), kind) and text in str(told.results[0]) for told in waiters)
            told = Told()
            connections.when_ready(address, told)
            assert isinstance(told.wait(), KVPeerLostError) and text in str(told.results[0])  # open
        assert dialer.count(DEAD) == 1 and dialer.count(ALIVE) == 1
    finally:
        refused.opened.set()
        faulty.opened.set()
        connections.close()
    assert no_dial_threads()


def test_a_faulty_callback_does_not_keep_the_others_from_being_told(clock: list[float]) -> None:
    gate = Gate(FakeBuffer("p"))
    connections = make(Dialer({ALIVE: [gate]}))
    try:

        def faulty(result: object) -> None:
            raise RuntimeError("a bug in a callback")

        told = Told()
        connections.when_ready(ALIVE, faulty)
        connections.when_ready(ALIVE, told)
        gate.opened.set()
        assert told.wait() is gate.outcome
    finally:
        connections.close()


def test_close_tells_the_waiters_at_once_closes_a_late_connection_and_leaves_no_thread(clock: list[float]) -> None:
    gate = Gate(FakeBuffer("late"))
    connections = make(Dialer({DEAD: [gate]}))
    waiters = [Told() for _ in range(5)]
    for told in waiters:
        connections.when_ready(DEAD, told)
    assert gate.entered.wait(WAIT)
    closer = threading.Thread(target=connections.close, name="test-close")
    closer.start()
    try:
        # Told while the attempt is still blocked: nobody waits for it.
        assert all(isinstance(told.wait(), KVPipeClosedError) for told in waiters)
        assert not gate.left.is_set()
        after = Told()
        connections.when_ready(DEAD, after)
        assert after.done.is_set() and isinstance(after.wait(), KVPipeClosedError)
        with pytest.raises(KVPipeClosedError):
            connections.get(DEAD)
    finally:
        gate.opened.set()
        closer.join(WAIT)
    assert not closer.is_alive()  # close waits for the attempt in flight, which ends
    assert gate.outcome.closed.is_set()  # the connection it made after close is closed, not kept
    assert connections.count == 0 and no_dial_threads()
    connections.close()  # idempotent


def test_a_dial_thread_that_cannot_start_fails_the_waiter_and_the_next_request_dials(
    clock: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    buffer = FakeBuffer("p")
    dialer = Dialer({ALIVE: [buffer]})
    connections = make(dialer)
    start = threading.Thread.start
    refused = []

    def start_or_refuse(thread: threading.Thread) -> None:
        if thread.name == "kvbuf-dial" and not refused:  # the process is out of threads, once
            refused.append(thread)
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_or_refuse)
    try:
        first = Told()
        connections.when_ready(ALIVE, first)  # never raises: the caller is told
        error = first.wait()
        assert isinstance(error, KVPeerLostError) and "can't start new thread" in str(error)
        assert connections.dialing == 0 and dialer.count(ALIVE) == 0
        # Not the producer's fault: no backoff, the next request starts an attempt at once.
        assert connections.get(ALIVE) is buffer and dialer.count(ALIVE) == 1
    finally:
        connections.close()
    assert buffer.closed.is_set() and no_dial_threads()
