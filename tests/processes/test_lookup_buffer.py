"""The lookup buffer: unit tests of its parts, then two real processes over gloo."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import random
import select
import signal
import threading
import time
import types
import weakref
from typing import Any

import msgspec
import pytest
import torch
import zmq

from harness import buffer_procs as bodies
from harness import procs
from kv_pipe import KVTransferConfig
from kv_pipe.errors import (
    KVBufferFullError,
    KVConfigError,
    KVPeerLostError,
    KVPipeClosedError,
    KVProtocolError,
    KVTimeoutError,
)
from lookup_buffer import KVInvalidRequestError, SimpleBuffer, matching
from lookup_buffer.control import Doorbell, Endpoint, control_address
from lookup_buffer.matching import TOKEN_DTYPES, MatchKey, token_arrays
from lookup_buffer.producer import BufferProducer
from lookup_buffer.protocol import (
    PROTOCOL_VERSION,
    SESSION_BYTES,
    ControlSigner,
    MessageError,
    Outcome,
    OutcomeStatus,
    Refusal,
    decode_refusal,
    decode_request,
    encode_refusal,
    encode_request,
    make_header,
    make_outcome,
    make_session,
    parse_header,
    select_request,
    stamp_header,
)
from lookup_buffer.store import Entry, EntryStore


def key_of(tokens: list[int], roi: list[bool]) -> MatchKey:
    return MatchKey(*token_arrays(torch.tensor(tokens), torch.tensor(roi)))


# ---------------------------------------------------------------- matching


def test_match_rule() -> None:
    long = key_of([1, 2, 3, 4], [True] * 4)
    assert key_of([1, 2, 3], [True] * 3) != long  # a prefix query does not match
    assert key_of([1, 2, 3, 4, 5], [True] * 5) != long  # nor an extension
    assert key_of([1, 2, 3, 4], [True, True, True, False]) != long  # nor another roi
    assert key_of([1, 2, 3, 5], [True] * 4) != long
    assert key_of([1, 2, 3, 4], [True] * 4) == long
    assert (
        MatchKey(*token_arrays(torch.tensor([1, 2, 3, 4], dtype=torch.int32), torch.ones(4, dtype=torch.bool))) == long
    )
    masked = key_of([1, 2, 9, 9], [True, True, False, False])
    assert masked == key_of([1, 2, 7, 7], [True, True, False, False])  # tokens outside the roi play no part
    assert masked == key_of([1, 2], [True, True])  # same positions, same tokens
    assert key_of([9, 1, 2], [False, True, True]) != masked  # same tokens at other positions
    assert hash(masked) == hash(key_of([1, 2], [True, True]))


def test_match_never_trusts_the_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    class Colliding:
        @staticmethod
        def blake2b(data: bytes, digest_size: int) -> Any:
            return types.SimpleNamespace(digest=lambda: b"\0" * digest_size)

    monkeypatch.setattr(matching, "hashlib", Colliding)
    a, b = key_of([1, 2], [True, True]), key_of([3, 4], [True, True])
    assert a.digest == b.digest and hash(a) == hash(b) and a != b
    store = EntryStore(1 << 20, 1 << 20)
    entry_a, entry_b = Entry((torch.tensor([1.0]),), 4), Entry((torch.tensor([2.0]),), 4)
    store.put(a, entry_a, timeout=1)
    store.put(b, entry_b, timeout=1)
    assert store.pop(b) is entry_b and store.pop(a) is entry_a and store.pop(a) is None


@pytest.mark.parametrize(
    "tokens, roi",
    [
        ([[1, 2]], [[True, True]]),  # 2-D
        (torch.tensor([1.0, 2.0]), [True, True]),  # float tokens
        ([1, 2], torch.tensor([1, 1])),  # roi not bool
        ([1, 2, 3], [True, True]),  # lengths differ
        ([1, 2], [False, False]),  # selects nothing
        ([], []),
    ],
)
def test_invalid_queries(tokens: Any, roi: Any) -> None:
    tokens = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, dtype=torch.int64)
    roi = roi if isinstance(roi, torch.Tensor) else torch.tensor(roi, dtype=torch.bool)
    with pytest.raises(KVInvalidRequestError):
        token_arrays(tokens, roi)


def test_non_tensor_query_is_refused() -> None:
    with pytest.raises(KVInvalidRequestError, match="must be tensors"):
        token_arrays([1, 2], torch.tensor([True, True]))  # type: ignore[arg-type]


# ---------------------------------------------------------------- protocol


def test_request_round_trip() -> None:
    tokens, roi = token_arrays(torch.tensor([5, -3, 1 << 40]), torch.tensor([True, False, True]))
    session = os.urandom(SESSION_BYTES)
    frame = encode_request(UNSIGNED, select_request(123, tokens, roi, 4500, session=session, counter=2**63 - 1))
    request, got_tokens, got_roi = decode_request(UNSIGNED, frame)
    assert (request.request_id, request.wait_ms, request.v) == (123, 4500, PROTOCOL_VERSION)
    assert (request.session, request.counter) == (session, 2**63 - 1)
    assert got_tokens.tolist() == [5, -3, 1 << 40] and got_roi.tolist() == [True, False, True]
    assert MatchKey(got_tokens, got_roi) == MatchKey(tokens, roi)
    assert (request.part, request.span) == (None, None)
    spanned = select_request(7, tokens, roi, 0, session=session, counter=1, part=(2, 0, 4), span=(1, 3, 9))
    decoded = decode_request(UNSIGNED, encode_request(UNSIGNED, spanned))[0]
    assert (decoded.part, decoded.span) == ((2, 0, 4), (1, 3, 9))
    for bad in ((1, 4, 4), (1, -1, 3), (99, 0, 1), (1, 0, 1 << 40)):
        with pytest.raises(ValueError, match="span"):
            select_request(7, tokens, roi, 0, span=bad)
        forged = msgspec.structs.replace(spanned, span=bad)
        with pytest.raises(MessageError, match="span"):
            decode_request(UNSIGNED, encode_request(UNSIGNED, forged))
    # A peer of the protocol before spans is answered "version", whatever its select holds.
    with pytest.raises(MessageError, match="version") as caught:
        decode_request(UNSIGNED, encode_request(UNSIGNED, msgspec.structs.replace(spanned, v=PROTOCOL_VERSION - 1)))
    assert caught.value.reason == "version"
    refusal = decode_refusal(UNSIGNED, encode_refusal(UNSIGNED, 99, "stale", message="x" * 5000))
    assert (refusal.request_id, refusal.reason, len(refusal.message)) == (99, "stale", 1000)
    # Every outcome but a refusal goes on the data pipe: a refusal for any other reason is refused.
    for reason in ("miss", "hit", "error", "closed"):
        with pytest.raises(MessageError, match="reason"):
            decode_refusal(UNSIGNED, msgspec.msgpack.encode(Refusal(v=PROTOCOL_VERSION, request_id=99, reason=reason)))
    # Not valid on the wire until the consumer stamps the session and the counter.
    with pytest.raises(MessageError, match="session"):
        decode_request(UNSIGNED, encode_request(UNSIGNED, select_request(5, tokens, roi, 0)))


def test_signed_frames_accept_only_the_same_secret_and_direction() -> None:
    tokens, roi = token_arrays(torch.tensor([7, 8, 9]), torch.tensor([True, True, False]))
    friend, stranger = ControlSigner("s3cret"), ControlSigner("guess")
    request = select_request(5, tokens, roi, 0, session=bytes(SESSION_BYTES), counter=1)
    frame = encode_request(friend, request)
    assert decode_request(friend, frame)[0].request_id == 5
    tampered = bytearray(frame)
    tampered[len(tampered) // 2] ^= 1
    refusals = {
        "wrong secret": (stranger, frame),
        "unsigned": (friend, encode_request(UNSIGNED, request)),
        "tampered": (friend, bytes(tampered)),
        "truncated": (friend, frame[:20]),
    }
    for what, (signer, candidate) in refusals.items():
        with pytest.raises(MessageError, match="authentication failed") as caught:
            decode_request(signer, candidate)
            pytest.fail(f"{what} was accepted")
        assert caught.value.reason == "unauthenticated"
    refusal = encode_refusal(friend, 5, "stale", "")
    assert decode_refusal(friend, refusal).reason == "stale"
    with pytest.raises(MessageError, match="authentication failed"):  # a refusal never passes as a request
        decode_request(friend, refusal)


def test_every_junk_message_is_refused() -> None:
    rng = random.Random(0)
    for name, frames, reason in bodies._junk_frames(rng):
        if len(frames) != 1 or reason == "stale":
            continue  # refused by the server: for its frame count, or as not fresh
        with pytest.raises(MessageError) as caught:
            decode_request(UNSIGNED, frames[0])
            pytest.fail(f"{name} was accepted")
        assert caught.value.reason == reason, (name, caught.value)
        with pytest.raises(MessageError):
            decode_refusal(UNSIGNED, frames[0])


def test_a_select_is_accepted_once_whatever_number_of_selects_follow() -> None:
    """Freshness holds past any window of remembered ids: a select is refused once a later one was
    accepted, after 70,000 later ones as at once, and a select of another session is refused."""
    session = os.urandom(SESSION_BYTES)
    producer = types.SimpleNamespace(_session=session, _last_counter=0)  # the state _check_fresh uses
    tokens, roi = token_arrays(torch.tensor([-4, -5]), torch.ones(2, dtype=torch.bool))

    def fresh(counter: int, of: bytes = session) -> bool:
        try:
            BufferProducer._check_fresh(producer, select_request(counter, tokens, roi, 0, of, counter))
            return True
        except MessageError as exc:
            assert exc.reason == "stale" and exc.request_id == counter, exc
            return False

    assert fresh(1) and not fresh(1)
    assert all(fresh(counter) for counter in range(2, 70_002))
    assert not any(fresh(counter) for counter in (1, 2, 65_537, 70_001))
    assert not fresh(70_002, of=os.urandom(SESSION_BYTES))  # a restarted producer has another session
    assert fresh(70_002) and fresh(10**18)  # counters may skip (requests lost on the way)


def test_unknown_version_names_both_versions() -> None:
    frame = {name: frames for name, frames, _ in bodies._junk_frames(random.Random(0))}["unknown version"][0]
    with pytest.raises(MessageError) as caught:
        decode_request(UNSIGNED, frame)
    assert caught.value.request_id == 5  # echoed, so the sender learns which request failed
    assert f"version {PROTOCOL_VERSION + 98}" in str(caught.value)
    assert f"speaks version {PROTOCOL_VERSION}" in str(caught.value)


@pytest.mark.parametrize("dtype", TOKEN_DTYPES)
def test_hit_header_round_trip(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(5)
    info = torch.iinfo(dtype)
    for length, has_value, has_hidden in ((1, False, False), (13, True, False), (64, False, True), (1000, True, True)):
        tokens = torch.randint(info.min, info.max, (length,), dtype=dtype, generator=generator)
        roi = torch.rand(length, generator=generator) < 0.6
        roi[length // 2] = True
        header = make_header(*token_arrays(tokens, roi), tokens.dtype, has_value, has_hidden)
        # Stamped again for each select: a waited flag from an earlier stamp must not stick.
        for request_id, waited in ((2**62 + length, True), (length, False)):
            stamp_header(header, request_id, waited)
            got = parse_header(torch.from_numpy(header))
            assert (got.request_id, got.waited, got.has_value, got.has_hidden) == (
                request_id,
                waited,
                has_value,
                has_hidden,
            )
            assert bodies.same_bits(got.input_tokens, tokens) and bodies.same_bits(got.roi, roi)
            assert got.match_key == MatchKey(*token_arrays(tokens, roi))
            assert got.status is OutcomeStatus.HIT


@pytest.mark.parametrize("status", [OutcomeStatus.MISS, OutcomeStatus.BUSY, OutcomeStatus.CLOSED])
def test_outcome_header_round_trip(status: OutcomeStatus) -> None:
    for request_id, waited in ((0, False), (2**63 - 1, True), (12345, False)):
        got = parse_header(torch.from_numpy(make_outcome(request_id, status, waited)))
        assert got == Outcome(request_id, status, waited), got


def test_session_header_round_trip_and_refusals() -> None:
    session = os.urandom(SESSION_BYTES)
    header = torch.from_numpy(make_session(session))
    assert parse_header(header) == Outcome(0, OutcomeStatus.SESSION, False, session=session)

    def changed(index: int, value: int) -> torch.Tensor:
        bad = header.clone()
        bad[index] = value
        return bad

    for bad in [
        header[:-1],  # a short nonce
        torch.cat([header, header[-1:]]),
        changed(2, 7),  # a request id
        changed(4, 1),  # a token count
        changed(5, 1),  # a dtype code
        changed(6, 4),  # the waited flag
        changed(1, PROTOCOL_VERSION - 1),
        changed(3, int(OutcomeStatus.MISS)),  # a miss with a nonce
    ]:
        with pytest.raises(KVProtocolError):
            parse_header(bad)


def test_bad_hit_headers_are_refused() -> None:
    def header(tokens: list[int], roi: list[bool]) -> torch.Tensor:
        arrays = token_arrays(torch.tensor(tokens), torch.tensor(roi))
        return torch.from_numpy(make_header(*arrays, torch.int64, True, False))

    good = header([3, 4, 5], [True, False, True])
    parse_header(good)
    miss = torch.from_numpy(make_outcome(7, OutcomeStatus.MISS, waited=True))
    parse_header(miss)
    bad_outcomes = []
    for index, value in ((3, int(OutcomeStatus.HIT)), (4, 1), (5, 1), (6, 1 | 4), (6, 8)):
        bad = miss.clone()
        bad[index] = value  # a hit without tokens, tokens or a dtype or a value flag on a miss, unknown flag
        bad_outcomes.append(bad)
    bad_outcomes.append(torch.cat([miss, miss[-1:]]))  # a miss longer than its fixed words
    narrow = header([1 << 40], [True])
    narrow[5] = TOKEN_DTYPES.index(torch.int32)  # a token that does not fit the dtype it claims

    def changed(index: int, value: int) -> torch.Tensor:
        bad = good.clone()
        bad[index] = value
        return bad

    roi_bytes = good.clone()
    roi_bytes[-1] = 2  # a roi byte that is not 0/1
    for bad in [
        None,
        good.to(torch.int32),
        good[:5],
        good[:-1],
        torch.cat([good, good[-1:]]),
        good.reshape(1, -1),
        changed(0, 12345),  # magic
        changed(1, PROTOCOL_VERSION + 1),
        changed(2, -1),  # request id
        changed(3, len(OutcomeStatus)),  # unknown status
        changed(3, -1),
        changed(3, int(OutcomeStatus.MISS)),  # a miss with a hit's tokens
        changed(3, int(OutcomeStatus.SESSION)),  # a session header with a hit's tokens
        changed(4, 4),  # token count disagrees with the length
        changed(4, 0),
        changed(5, len(TOKEN_DTYPES)),  # dtype code
        changed(6, 64),  # an unknown flag
        changed(6, 32 | 1),  # a lent hidden state that does not follow
        changed(6, 16),  # a lent value that does not follow
        roi_bytes,
        narrow,
        *bad_outcomes,
    ]:
        with pytest.raises(KVProtocolError):
            parse_header(bad)


# ---------------------------------------------------------------- store


def test_the_store_lets_go_of_a_taken_entry_while_older_ones_wait() -> None:
    """Once taken, an entry's tensors are the taker's alone: the store keeps no reference to them,
    also while an older entry nobody takes waits to expire (its memory would otherwise stay held
    long after the store counted it free)."""
    store = EntryStore(capacity_bytes=1 << 20, max_item_bytes=1 << 20, entry_timeout=480)
    waiting, taken = key_of([1], [True]), key_of([2], [True])
    store.put(waiting, Entry((torch.ones(8),), 32), timeout=0)
    tensor = torch.ones(8)
    alive = weakref.ref(tensor)
    store.put(taken, Entry((tensor,), 32), timeout=0)
    del tensor
    entry = store.pop(taken)
    assert alive() is not None  # the taker holds it
    del entry
    gc.collect()
    assert alive() is None, "the store still holds a taken entry's tensors"
    assert store.expire(now=time.monotonic() + 481) == (1, 32)  # the waiting one expires as before
    assert store.pop(waiting) is None


def test_store_fifo_budget_and_stop() -> None:
    store = EntryStore(capacity_bytes=1000, max_item_bytes=800)
    key = key_of([1], [True])

    def entry(nbytes: int, fill: int) -> Entry:
        return Entry((torch.full((nbytes,), fill, dtype=torch.uint8),), nbytes)

    with pytest.raises(KVBufferFullError, match="does not fit"):
        store.put(key, entry(1001, 0), timeout=1000)  # refused at once, whatever the timeout
    with pytest.raises(KVBufferFullError, match="does not fit"):
        store.put(key, entry(801, 0), timeout=1000)  # one tensor too large for the pipe
    first, second = entry(400, 1), entry(400, 2)
    store.put(key, first, timeout=0)
    store.put(key, second, timeout=0)
    with pytest.raises(KVBufferFullError, match="full"):
        store.put(key, entry(300, 3), timeout=0.05)
    counters = store.counters()
    assert (counters.entries, counters.bytes, counters.rejected, counters.inserts) == (2, 800, 3, 2)

    outcome: list[Any] = []
    third = entry(300, 3)
    blocked = threading.Thread(target=lambda: outcome.append(store.put(key, third, timeout=30)))
    blocked.start()
    bodies.wait_until(lambda: store.counters().inserts_blocked == 1, "the put blocks")
    assert store.pop(key) is first  # frees room: the blocked put goes through
    blocked.join(30)
    assert outcome == [None] and store.counters().insert_waits == 1
    assert store.pop(key) is second and store.pop(key) is third and store.pop(key) is None

    store.put(key, Entry((entry(450, 4).items[0], entry(450, 4).items[0]), 900), timeout=0)
    errors: list[BaseException] = []

    def put_blocked() -> None:
        try:
            store.put(key, entry(500, 5), timeout=30)
        except KVPipeClosedError as exc:
            errors.append(exc)

    blocked = threading.Thread(target=put_blocked)
    blocked.start()
    bodies.wait_until(lambda: store.counters().inserts_blocked == 1, "the put blocks")
    assert store.stop(KVPipeClosedError("closed")) == (1, 900)
    blocked.join(30)
    assert len(errors) == 1 and store.counters().entries == 0
    with pytest.raises(KVPipeClosedError):
        store.put(key, entry(1, 6), timeout=0)


# ---------------------------------------------------------------- control plumbing


def test_control_address_and_doorbell() -> None:
    config = KVTransferConfig(kv_role="kv_producer", kv_ip="10.1.2.3", kv_port=4000)
    assert control_address(config, port_offset=2) == "tcp://10.1.2.3:4003"
    assert control_address(config.replace(kv_ip="::1"), port_offset=0) == "tcp://[::1]:4001"
    bell = Doorbell()
    assert select.select([bell], [], [], 0)[0] == []
    bell.ring()
    bell.ring()
    assert select.select([bell], [], [], 0)[0] == [bell]
    bell.clear()
    assert select.select([bell], [], [], 0)[0] == []
    bell.close()
    bell.ring()  # harmless after close


def test_an_endpoint_owner_wakes_for_every_answer_while_other_threads_send() -> None:
    """Threads send on one endpoint while its owner sleeps on ZMQ_FD; every answer must wake it. A
    send that takes in an answer on the owner's behalf must ring the owner's doorbell, else the owner
    sleeps its whole (here 10-minute) wait and the joins below fail."""
    router = Endpoint(zmq.ROUTER, "tcp://127.0.0.1:*", 1 << 16, bind=True)
    dealer = Endpoint(zmq.DEALER, router.address, 1 << 16, bind=False)
    senders, per_sender = 4, 500
    total = senders * per_sender
    answered: list[bytes] = []
    stop = threading.Event()

    def echo() -> None:  # the router's owner answers every message
        echoed = 0
        while echoed < total and not stop.is_set():
            router.wait(600_000)
            for identity, frames in router.routed(256):
                router.send([identity, *frames])
                echoed += 1

    def collect() -> None:  # the dealer's owner takes the answers
        while len(answered) < total and not stop.is_set():
            dealer.wait(600_000)
            answered.extend(frames[0] for frames in dealer.received(256))

    def send(sender: int) -> None:
        for index in range(per_sender):
            message = f"{sender}:{index}".encode()
            while True:
                try:
                    dealer.send([message])
                    break
                except zmq.Again:  # the high-water mark: the router's owner is behind
                    time.sleep(0.001)

    owners = [threading.Thread(target=echo), threading.Thread(target=collect)]
    threads = owners + [threading.Thread(target=send, args=(sender,)) for sender in range(senders)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "an endpoint's owner slept through a message"
        assert sorted(answered) == sorted(f"{s}:{i}".encode() for s in range(senders) for i in range(per_sender))
    finally:
        stop.set()
        router.doorbell.ring()
        dealer.doorbell.ring()
        for thread in owners:
            thread.join(10)
        dealer.close()
        router.close()


def test_a_send_while_an_answer_waits_rings_the_owners_doorbell() -> None:
    """The owner sleeps on ZMQ_FD, which a send from another thread can drain by taking in an answer
    on the owner's behalf: a send that leaves an answer waiting must ring the owner's doorbell."""
    router = Endpoint(zmq.ROUTER, "tcp://127.0.0.1:*", 1 << 16, bind=True)
    dealer = Endpoint(zmq.DEALER, router.address, 1 << 16, bind=False)
    try:
        dealer.send([b"ping"])
        deadline = time.monotonic() + 10
        routed: list[tuple[bytes, list[bytes]]] = []
        while not routed:  # a wait may also end for the socket's other events
            assert time.monotonic() < deadline, "the ping never reached the router"
            router.wait(1000)
            routed = list(router.routed(1))
        [(identity, frames)] = routed
        router.send([identity, *frames])
        deadline = time.monotonic() + 10
        # Looking at ZMQ_EVENTS takes the answer in, as a send may: ZMQ_FD says nothing of it after.
        while not dealer._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            assert time.monotonic() < deadline, "the answer never reached the dealer"
            time.sleep(0.001)
        dealer.doorbell.clear()
        dealer.send([b"another"])  # from a thread that is not the owner
        assert select.select([dealer.doorbell], [], [], 0)[0] == [dealer.doorbell]
        dealer.wait(600_000)  # returns at once
        assert list(dealer.received(2)) == [[b"ping"]]
    finally:
        dealer.close()
        router.close()


def test_simple_buffer_refuses_kv_both() -> None:
    pipe = types.SimpleNamespace(port_offset=0)
    with pytest.raises(KVConfigError, match="kv_producer"):
        SimpleBuffer(pipe, KVTransferConfig(kv_role="kv_both"))  # type: ignore[arg-type]


# ---------------------------------------------------------------- two processes

UNSIGNED = ControlSigner(None)

_CTX = mp.get_context("spawn")


def new_sync() -> dict:
    return {name: _CTX.Event() for name in bodies.SYNC_EVENTS}


def run_buffer_pair(
    producer: Any,
    consumer: Any,
    producer_args: tuple = (),
    consumer_args: tuple = (),
    changes: dict | None = None,
    port: int | None = None,
    timeout: float = 100,
) -> tuple[dict, dict]:
    port = procs.free_port() if port is None else port
    sync = new_sync()
    results = procs.new_queue()
    processes = [
        procs.start(bodies.run_side, (0, port, producer, changes or {}, sync, *producer_args), results, 0),
        procs.start(bodies.run_side, (1, port, consumer, changes or {}, sync, *consumer_args), results, 1),
    ]
    outcomes = procs.collect(processes, results, timeout)
    return outcomes[0], outcomes[1]


def assert_clean(*sides: dict) -> None:
    for side in sides:
        assert side["close_error"] is None, side["close_error"]


def entry_bytes(seed: int, count: int, small: bool = False) -> list[int]:
    return [sum(t.nbytes for t in bodies.make_request(seed, i, small) if t is not None) for i in range(count)]


@pytest.mark.timeout(120)
def test_insert_then_select_bit_exact() -> None:
    seed, count = 11, 30
    producer, consumer = run_buffer_pair(bodies.producer_basic, bodies.consumer_basic, (seed, count), (seed, count))
    assert consumer["result"]["selected"] == count
    assert consumer["result"]["second_select"] == [None] * 5  # the entry was dropped by the first select
    assert consumer["result"]["refused"] == {
        "insert on the consumer": "KVConfigError",
        "negative timeout": "KVInvalidRequestError",
        "float tokens": "KVInvalidRequestError",
        "roi selects nothing": "KVInvalidRequestError",
    }
    p, c = producer["stats"], consumer["stats"]
    assert (p["inserts"], p["hits"], p["misses"], p["entries"], p["bytes"]) == (count, count, 1, 0, 0)
    assert (c["hits"], c["misses"], c["waits"]) == (count, 1, p["waits"])
    assert p["transferred_bytes"] == c["transferred_bytes"] == sum(entry_bytes(seed, count))
    assert_clean(producer, consumer)


@pytest.mark.timeout(120)
def test_a_span_select_moves_exactly_the_bytes_of_its_blocks_bit_exact() -> None:
    seed, count = 5, 12
    producer, consumer = run_buffer_pair(bodies.producer_spans, bodies.consumer_spans, (seed, count), (seed, count))
    expected = []
    for index in range(count):
        (tokens, roi, key, _, _), (dim, start, stop) = bodies.span_request(seed, index)
        spanned = key if index == 0 else key.narrow(dim, start, stop - start)
        assert index == 0 or spanned.nbytes < key.nbytes
        expected.append(tokens.nbytes + roi.nbytes + spanned.nbytes)
    assert consumer["result"]["received"] == expected
    assert "(config)" in consumer["result"]["refusal"] and "does not fit" in consumer["result"]["refusal"]
    p, c = producer["stats"], consumer["stats"]
    # Both sides count only what travelled; nothing of the entries is left at the producer.
    assert p["transferred_bytes"] == c["transferred_bytes"] == sum(expected)
    assert (p["hits"], c["hits"], p["entries"], p["bytes"]) == (count, count, 0, 0)
    assert_clean(producer, consumer)


@pytest.mark.timeout(150)
def test_backpressure_shuffled_orders_half_sized_buffer() -> None:
    seed, count = 21, 200
    sizes = entry_bytes(seed, count)
    budget = sum(sizes) // 2
    assert budget >= 1 << 16 and max(sizes) < budget // 2  # every entry fits, all of them do not
    producer, consumer = run_buffer_pair(
        bodies.producer_shuffled,
        bodies.consumer_threads,
        (seed, count, False),
        (seed, count, False, 4, 0.1),
        changes={"kv_buffer_size": budget},
    )
    assert consumer["result"]["selected"] == list(range(count))
    p, c = producer["stats"], consumer["stats"]
    assert p["insert_waits"] > 0  # the producer really was held back
    assert p["peak_bytes"] <= budget and p["rejected"] == 0
    assert (p["hits"], p["entries"], p["bytes"]) == (count, 0, 0)
    assert (c["hits"], c["misses"]) == (count, consumer["result"]["misses"]) == (p["hits"], p["misses"])
    assert_clean(producer, consumer)


@pytest.mark.timeout(150)
def test_thousand_requests_four_threads_random_order() -> None:
    seed, count = 31, 1200
    producer, consumer = run_buffer_pair(
        bodies.producer_shuffled, bodies.consumer_threads, (seed, count, True), (seed, count, True, 4, 30.0)
    )
    assert consumer["result"]["selected"] == list(range(count))  # each checked bit for bit
    assert consumer["result"]["misses"] == 0
    p, c = producer["stats"], consumer["stats"]
    assert (p["hits"], p["misses"], p["entries"], c["hits"]) == (count, 0, 0, count)
    assert p["transferred_bytes"] == c["transferred_bytes"] == sum(entry_bytes(seed, count, small=True))
    assert_clean(producer, consumer)


@pytest.mark.timeout(120)
def test_matching_rules_prefixes_duplicates_masks() -> None:
    producer, consumer = run_buffer_pair(bodies.producer_matching, bodies.consumer_matching)
    assert consumer["result"] == {
        "shorter_prefix": None,
        "longer": None,
        "prefix": 2.0,
        "prefix_again": None,  # the long entry is not stolen by a prefix query
        "long": 1.0,
        "duplicates": [10.0, 11.0, 12.0, None],  # first in, first out
        "other_roi": None,
        "outside_roi_differs": 30.0,
        "same_positions_shorter_query": 31.0,
    }
    assert producer["stats"]["entries"] == 0 and producer["stats"]["hits"] == 7
    assert_clean(producer, consumer)


@pytest.mark.timeout(120)
def test_miss_after_timeout_then_parked_select_hits() -> None:
    producer, consumer = run_buffer_pair(bodies.producer_late, bodies.consumer_late)
    assert consumer["result"] == {"timed_out": [None] * 5, "immediate": [None] * 5}
    p, c = producer["stats"], consumer["stats"]
    assert (p["hits"], p["misses"], p["waits"]) == (1, 2, 2)  # the 0.2 s miss and the hit waited
    assert (c["hits"], c["misses"], c["waits"]) == (1, 2, 2)
    assert producer["result"] == 0  # nothing parked once the entry was handed over
    assert_clean(producer, consumer)


@pytest.mark.timeout(120)
def test_a_waiting_select_is_served_while_others_come_and_go() -> None:
    """One select waits for a late insert while others, from several threads at once, hit (each its
    own entry, inserted as they wait) and miss; each gets exactly its own outcome."""
    producer, consumer = run_buffer_pair(bodies.producer_serves_around_a_waiter, bodies.consumer_serves_around_a_waiter)
    assert consumer["result"] == {
        "verdicts": ["miss" if index % 2 else "hit" for index in range(bodies.PASSING)],
        "still_waiting": True,
    }
    p, c = producer["result"]["stats"], consumer["stats"]
    assert producer["result"]["pending_meanwhile"] == 1  # the first select stayed parked throughout
    half = bodies.PASSING // 2
    assert (p["hits"], p["misses"], p["pending"]) == (half + 1, half, 0)
    assert (c["hits"], c["misses"], c["waits"], c["pending"]) == (half + 1, half, p["waits"], 0)
    assert_clean(producer, consumer)


@pytest.mark.timeout(150)
def test_concurrent_selects_never_get_each_others_entries() -> None:
    """Sixteen threads select entries of varied sizes, inserted in another random order: outcomes of
    different selects interleave on the data pipe, and each thread checks its own bit for bit."""
    seed, count = 37, 240
    producer, consumer = run_buffer_pair(
        bodies.producer_shuffled, bodies.consumer_threads, (seed, count, False), (seed, count, False, 16, 30.0)
    )
    assert consumer["result"]["selected"] == list(range(count))
    p, c = producer["stats"], consumer["stats"]
    assert (p["hits"], c["hits"], p["entries"]) == (count, count, 0)
    assert p["transferred_bytes"] == c["transferred_bytes"] == sum(entry_bytes(seed, count))
    assert_clean(producer, consumer)


@pytest.mark.timeout(300)
def test_thousands_of_short_lived_threads_leave_no_descriptors_behind() -> None:
    """Each of 4000 threads does one drop_select and ends (half hit, half miss): the consumer's open
    descriptors and threads are back where they were (a socket or doorbell per calling thread would
    leave thousands behind)."""
    seed, count = 43, 2000
    producer, consumer = run_buffer_pair(
        bodies.producer_small_entries, bodies.consumer_many_short_threads, (seed, count), (seed, count, 50), timeout=280
    )
    result = consumer["result"]
    assert (result["hits"], result["misses"]) == (count, count)
    fds_before, fds_after = result["fds"]
    assert fds_after - fds_before <= 4, result["fds"]
    assert result["threads"][1] == result["threads"][0], result["threads"]
    assert (producer["stats"]["hits"], producer["stats"]["misses"]) == (count, count + 1)
    assert_clean(producer, consumer)


@pytest.mark.timeout(120)
def test_a_select_refused_for_room_says_so_and_the_parked_one_still_hits() -> None:
    producer, consumer = run_buffer_pair(bodies.producer_busy, bodies.consumer_busy)
    refused = consumer["result"]["refused"]
    assert refused.startswith("KVProtocolError") and "too many selects" in refused, refused
    assert (producer["result"]["hits"], producer["result"]["pending"]) == (1, 0)
    assert (consumer["stats"]["hits"], consumer["stats"]["misses"]) == (1, 0)
    assert_clean(producer, consumer)


@pytest.mark.timeout(120)
def test_oversize_and_full_inserts_are_refused() -> None:
    producer, consumer = run_buffer_pair(
        bodies.producer_full, bodies.consumer_full, changes={"kv_buffer_size": bodies.SMALL_BUDGET}
    )
    result = producer["result"]
    assert "larger" in result["oversize"] or "does not fit" in result["oversize"]
    assert "full" in result["full"]
    assert (result["stats"]["rejected"], result["stats"]["inserts"], result["stats"]["entries"]) == (2, 4, 4)
    assert consumer["result"] == {"hits": [0, 1, 2, 3], "rejected": [None] * 5, "oversize": [None] * 5}
    assert_clean(producer, consumer)


@pytest.mark.timeout(150)
def test_garbage_on_the_control_port_while_real_traffic_runs() -> None:
    seed, count = 41, 60
    port = procs.free_port()
    producer, consumer = run_buffer_pair(
        bodies.producer_trickle,
        bodies.consumer_under_attack,
        (seed, count),
        (seed, count, f"tcp://127.0.0.1:{port + 1}"),
        port=port,
    )
    attack = consumer["result"]
    assert attack["answered"] and attack["wrong"] == [], attack["wrong"]  # each refused, for the right reason
    request_id, message = attack["version_refusal"]
    assert request_id == 5 and str(PROTOCOL_VERSION + 98) in message and str(PROTOCOL_VERSION) in message
    assert attack["sent_during_traffic"] > 0
    # Every DEALER message was refused and counted (raw TCP junk can parse as legacy ZMTP messages too).
    assert producer["stats"]["bad_messages"] >= attack["answered"]
    assert producer["stats"]["hits"] == consumer["stats"]["hits"] == count
    assert_clean(producer, consumer)


def _kill_the_producer_under(producer_body: Any, consumer_body: Any, ready: str) -> dict:
    """Run the pair, SIGKILL the producer once the consumer sets ``stage``, then tell the consumer
    (``stage2``); return the consumer body's result."""
    port = procs.free_port()
    sync = new_sync()
    results = procs.new_queue()
    producer = procs.start(bodies.run_side, (0, port, producer_body, {}, sync), results, 0)
    consumer = procs.start(bodies.run_side, (1, port, consumer_body, {}, sync), results, 1)
    try:
        assert sync["stage"].wait(60), ready
        os.kill(producer.pid, signal.SIGKILL)
        producer.join(30)
        sync["stage2"].set()
        return procs.collect([consumer], results, timeout=60, expect=1)[1]["result"]
    finally:
        procs.reap([producer, consumer])


@pytest.mark.timeout(120)
def test_producer_killed_while_consumer_waits() -> None:
    outcome = _kill_the_producer_under(
        bodies.producer_parks_then_sleeps, bodies.consumer_waits_for_death, "the consumer's select was never parked"
    )
    assert outcome["first"] == "KVPeerLostError", outcome  # an error, not a miss
    assert outcome["second"] == "KVPeerLostError"
    assert outcome["close"] == "ok"  # the failure was reported already


@pytest.mark.timeout(120)
def test_producer_killed_while_the_consumer_is_idle_is_reported_by_close() -> None:
    """No select reads the data pipe while none runs; close() must still report the dead producer."""
    outcome = _kill_the_producer_under(
        bodies.producer_sleeps, bodies.consumer_idle_while_producer_dies, "the consumer never got ready"
    )
    assert outcome == {"pending": 0, "close": "KVPeerLostError", "after_close": "KVPeerLostError"}, outcome


@pytest.mark.timeout(120)
def test_consumer_close_wakes_its_waiting_select_and_the_producer_notices() -> None:
    producer, consumer = run_buffer_pair(bodies.producer_sees_consumer_close, bodies.consumer_closes_while_waiting)
    assert consumer["result"] == {
        "waiter": "KVPipeClosedError",
        "waiter_hung": False,
        "after_close": "KVPipeClosedError",
    }
    assert producer["result"]["insert"] == "KVPipeClosedError", producer["result"]
    assert_clean(producer, consumer)


class _ScriptedPipe:
    """A consumer's data pipe that delivers a session header, then one hit for whichever select is in
    flight: its header once a select is, then each tensor ``pause`` seconds after the previous one."""

    port_offset = 0

    def __init__(self, hit: list[torch.Tensor], pause: float) -> None:
        self.buffer: SimpleBuffer | None = None
        self._session: torch.Tensor | None = torch.from_numpy(make_session(os.urandom(SESSION_BYTES)))
        self._header: torch.Tensor | None = hit[0]
        self._tensors = hit[1:]
        self._pause = pause
        self._closed = threading.Event()

    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor:
        if self._session is not None:
            session, self._session = self._session, None
            return session
        if self._header is not None:
            while (self.buffer is None or not self.buffer._side._calls) and not self._closed.wait(0.001):
                pass
            if not self._closed.is_set():
                header, self._header = self._header, None
                stamp_header(header.numpy(), next(iter(self.buffer._side._calls)), waited=True)
                return header
        if self._tensors and not self._closed.wait(self._pause):
            return self._tensors.pop(0)
        if not self._closed.wait(timeout):
            raise KVTimeoutError(f"nothing arrived within {timeout:g} s")
        raise KVPipeClosedError("closed")

    def close(self) -> None:
        self._closed.set()


def _scripted_select(hit: list[torch.Tensor], pause: float, kv_timeout: float, query: list[torch.Tensor]) -> Any:
    """Run one drop_select of ``query`` against a _ScriptedPipe delivering ``hit``; return (result or
    error, seconds taken, stats)."""
    pipe = _ScriptedPipe(hit, pause)
    cfg = KVTransferConfig(kv_role="kv_consumer", kv_rank=1, kv_port=procs.free_port(), kv_timeout=kv_timeout)
    buffer = pipe.buffer = SimpleBuffer(pipe, cfg)  # type: ignore[arg-type]
    try:
        started = time.monotonic()
        try:
            got: Any = buffer.drop_select(query[0], query[1], timeout=0)
        except KVProtocolError as exc:
            got = exc
        return got, time.monotonic() - started, buffer.stats()
    finally:
        buffer.close()


def _hit_of(tokens: torch.Tensor, roi: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> list[torch.Tensor]:
    return [torch.from_numpy(make_header(*token_arrays(tokens, roi), tokens.dtype, True, False)), key, value]


@pytest.mark.timeout(60)
def test_a_hit_slower_than_the_answer_bound_is_still_delivered() -> None:
    """A hit is announced by its header on the data pipe: once the header is in, a select waits for
    its tensors while they keep coming, past the bound for an answer (its wait + kv_timeout), and
    does not declare the producer lost."""
    kv_timeout, pause = 0.5, 0.4
    tokens, roi = torch.tensor([11, 12, 13]), torch.tensor([True, True, False])
    key, value = torch.randn(4, 5), torch.randint(-9, 9, (7,), dtype=torch.int16)
    got, elapsed, stats = _scripted_select(_hit_of(tokens, roi, key, value), pause, kv_timeout, [tokens, roi])
    assert elapsed > kv_timeout, "the tensors came within the bound: the test did not exercise the late path"
    assert bodies.same_bits(got[0], tokens) and bodies.same_bits(got[1], roi)
    assert bodies.same_bits(got[2], key) and bodies.same_bits(got[3], value) and got[4] is None
    assert (stats.hits, stats.waits, stats.misses) == (1, 1, 0)


class _SilentPipe:
    """A consumer's data pipe on which nothing ever arrives, not even the producer's session."""

    port_offset = 0

    def __init__(self) -> None:
        self._closed = threading.Event()

    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor:
        if not self._closed.wait(timeout):
            raise KVTimeoutError(f"nothing arrived within {timeout:g} s")
        raise KVPipeClosedError("closed")

    def close(self) -> None:
        self._closed.set()


@pytest.mark.timeout(60)
def test_a_select_without_a_producer_session_fails_within_its_bound_and_says_why() -> None:
    cfg = KVTransferConfig(kv_role="kv_consumer", kv_rank=1, kv_port=procs.free_port(), kv_timeout=0.5)
    buffer = SimpleBuffer(_SilentPipe(), cfg)  # type: ignore[arg-type]
    try:
        with pytest.raises(KVPeerLostError, match="session header never came"):
            buffer.drop_select(torch.tensor([1, 2]), torch.ones(2, dtype=torch.bool), timeout=0.2)
        assert buffer.stats().pending == 0
    finally:
        buffer.close()


@pytest.mark.timeout(60)
def test_a_hit_routed_to_a_select_it_does_not_match_is_refused() -> None:
    """The outcome routed to a select by its request id must also match the select's query: another
    request's KV is never handed out."""
    tokens, roi = torch.tensor([11, 12, 13]), torch.tensor([True, True, False])
    hit = _hit_of(torch.tensor([11, 12, 14]), torch.tensor([True, True, True]), torch.randn(4), torch.randn(2))
    got, _, stats = _scripted_select(hit, 0, 5.0, [tokens, roi])
    assert isinstance(got, KVProtocolError) and "does not match the query" in str(got), got
    assert (stats.hits, stats.misses, stats.transferred_bytes) == (0, 0, 0)


@pytest.mark.timeout(120)
def test_producer_close_wakes_blocked_insert_and_parked_select() -> None:
    producer, consumer = run_buffer_pair(
        bodies.producer_closes_under_waiters,
        bodies.consumer_sees_producer_close,
        changes={"kv_buffer_size": bodies.SMALL_BUDGET},
    )
    assert producer["result"] == {"insert": "KVPipeClosedError", "insert_hung": False}
    assert consumer["result"]["select"] == "KVPipeClosedError", consumer["result"]
    assert_clean(producer, consumer)


@pytest.mark.timeout(150)
def test_shared_secret_refuses_a_stranger_and_serves_the_friend() -> None:
    seed, count = 51, 10
    port = procs.free_port()
    producer, consumer = run_buffer_pair(
        bodies.producer_basic,
        bodies.consumer_with_stranger,
        (seed, count),
        (seed, count, f"tcp://127.0.0.1:{port + 1}"),
        changes={"kv_secret": "correct horse battery staple"},
        port=port,
    )
    assert consumer["result"]["stranger"] == {
        "unsigned": "unauthenticated",
        "wrong secret": "unauthenticated",
        "signed, guessed session": "stale",  # the secret alone does not let a select through
    }
    assert consumer["result"]["selected"] == count  # the stranger took nothing
    assert producer["stats"]["hits"] == count
    assert producer["stats"]["bad_messages"] == 3
    assert_clean(producer, consumer)


@pytest.mark.timeout(180)
def test_a_captured_select_replayed_later_or_to_a_restarted_producer_is_refused() -> None:
    """A sniffer holding the secret captures the consumer's signed selects and replays them: at once,
    after many more selects, and to a restarted producer holding the same entries. Every replay is
    refused as stale and takes nothing: the consumer then gets every entry, bit for bit."""
    seed, count, later = 61, 6, 300
    secret = {"kv_secret": "correct horse battery staple"}
    verdicts = []
    captured: list[bytes] = []
    for _ in range(2):  # the second producer is the first one restarted
        port = procs.free_port()
        producer, consumer = run_buffer_pair(
            bodies.producer_with_copies,
            bodies.consumer_captures_and_replays,
            (seed, count),
            (seed, count, f"tcp://127.0.0.1:{port + 1}", captured, later),
            changes=secret,
            port=port,
        )
        verdicts.append(consumer["result"]["verdicts"])
        captured = consumer["result"]["captured"]
        assert (producer["result"]["hits"], producer["result"]["entries"]) == (count + 1, 0)
        assert producer["result"]["bad_messages"] == 3 + len(verdicts[-1]["from an earlier producer"])
        assert_clean(producer, consumer)
    assert verdicts[0] == {
        "from an earlier producer": [],
        "at once": "stale",
        "later": "stale",
        "a miss's, later": "stale",
    }
    assert verdicts[1] == {
        "from an earlier producer": ["stale", "stale"],
        "at once": "stale",
        "later": "stale",
        "a miss's, later": "stale",
    }
