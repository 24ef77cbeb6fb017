"""Hostile and malformed input: the control channel fuzzed while real traffic runs, forged pipe headers,
junk on every listening port, and strangers against a shared secret.

The fuzzing runs here, in the test process (hypothesis, derandomized so CI is reproducible), against
a real producer whose consumer keeps selecting real entries in another process at the same time;
that traffic is checked bit for bit in the consumer and must keep making progress.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import random
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import buffer_procs as buffer_bodies
from harness import procs
from harness.pipe_forgery import connect_as_forger, drain_until_dropped, send_records
from kv_pipe import KVTransferConfig, TorchDistributedPipe, auth
from kv_pipe import protocol as pipe_protocol
from kv_pipe.errors import (
    KVBufferFullError,
    KVPipeClosedError,
    KVProtocolError,
    KVTimeoutError,
    KVTransferError,
)
from lookup_buffer import SimpleBuffer
from lookup_buffer.matching import MAX_TOKENS, token_arrays
from lookup_buffer.protocol import (
    MAX_COUNTER,
    MAX_NDIM,
    MAX_PART_INDEX,
    MAX_REQUEST_BYTES,
    MAX_WAIT_MS,
    PROTOCOL_VERSION,
    SESSION_BYTES,
    ControlSigner,
    MessageError,
    Refusal,
    SelectRequest,
    decode_refusal,
    decode_request,
    encode_refusal,
    encode_request,
    make_session,
    select_request,
)

SEED = 71
TRAFFIC_BUDGET = 4 << 20
WINDOW = 4
BOUND = 30.0
#: A generous bound on the producer's memory growth over a long fuzz burst: a correctness check
#: (no per-message leak: the burst sends several hundred MB of junk), not a performance threshold.
RSS_GROWTH_LIMIT = 200 << 20
FUZZ = settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---------------------------------------------------------------- real traffic (spawned processes)


def traffic_side(rank: int, port: int, seed: int, stop: Any, done: Any, progress: Any, secret: str | None) -> dict:
    """Rank 0 inserts request after request; rank 1 selects them (shuffled per window) and checks each."""
    cfg = KVTransferConfig(
        kv_role="kv_producer" if rank == 0 else "kv_consumer",
        kv_rank=rank,
        kv_port=port,
        kv_timeout=5.0,
        kv_connect_timeout=30.0,
        kv_buffer_size=TRAFFIC_BUDGET,
        kv_secret=secret,
    )
    buffer = SimpleBuffer(TorchDistributedPipe(cfg), cfg)
    try:
        if rank == 0:
            index = 0
            while not done.is_set():
                try:
                    buffer.insert(*buffer_bodies.make_request(seed, index), timeout=0.2)
                    index += 1
                except KVBufferFullError:
                    continue  # the consumer has not taken enough yet
                except KVPipeClosedError:
                    if done.is_set():
                        break  # the consumer finished and closed its side while this insert waited
                    raise
            result = {"inserted": index}
        else:
            rng = random.Random(seed)
            window = 0
            while not stop.is_set():
                for index in rng.sample(range(window * WINDOW, (window + 1) * WINDOW), WINDOW):
                    want = buffer_bodies.make_request(seed, index)
                    got = buffer.drop_select(want[0], want[1], timeout=BOUND)
                    buffer_bodies.check_entry(got, want, f"request {index}")
                    with progress.get_lock():
                        progress.value += 1
                    time.sleep(0.002)  # leave the fuzzer some of the two cores
                window += 1
            done.set()
            result = {"selected": window * WINDOW}
        result["stats"] = dataclasses.asdict(buffer.stats())
    finally:
        done.set()
        buffer.close()
    return result


@dataclasses.dataclass
class LivePair:
    address: str
    port: int
    processes: list
    results: Any
    stop: Any
    progress: Any

    def selected(self) -> int:
        return self.progress.value

    def assert_alive(self) -> None:
        assert all(p.is_alive() for p in self.processes), [p.exitcode for p in self.processes]


@contextlib.contextmanager
def running_pair(secret: str | None = None) -> Iterator[LivePair]:
    """A producer and a consumer process exchanging real entries until ``stop`` is set; reaped on exit."""
    port = procs.free_port()
    ctx = procs._CTX
    stop, done, progress = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
    results = procs.new_queue()
    processes = [
        procs.start(traffic_side, (rank, port, SEED, stop, done, progress, secret), results, rank) for rank in (0, 1)
    ]
    try:
        pair = LivePair(f"tcp://127.0.0.1:{port + 1}", port, processes, results, stop, progress)
        deadline = time.monotonic() + 60
        while pair.selected() < 2 * WINDOW:
            assert time.monotonic() < deadline, "the real traffic did not start"
            pair.assert_alive()
            time.sleep(0.05)
        yield pair
    finally:
        stop.set()
        procs.reap(processes)


@pytest.fixture(scope="module")
def live_pair() -> Iterator[LivePair]:
    """One pair for the whole file: the fuzz tests hit it one after another, and the last test checks
    that its real traffic stayed bit-exact throughout."""
    with running_pair() as pair:
        yield pair


# ---------------------------------------------------------------- the fuzzer's side


class Prober:
    """DEALER sockets to the producer's control port, as a stranger would open them."""

    def __init__(self, address: str, secret: str | None = None) -> None:
        self.address = address
        self.signer = ControlSigner(secret)
        self.context = zmq.Context()

    def dealer(self) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(BOUND * 1000))
        sock.connect(self.address)
        return sock

    def ask(self, sock: zmq.Socket, frames: list[bytes]) -> Refusal:
        sock.send_multipart(frames)
        return decode_refusal(self.signer, sock.recv())

    def close(self) -> None:
        self.context.destroy(linger=0)


@pytest.fixture
def prober(live_pair: LivePair) -> Iterator[Prober]:
    instance = Prober(live_pair.address)
    try:
        yield instance
    finally:
        instance.close()


#: A stranger's guess at the producer's session: the producer draws its own at random.
GUESSED_SESSION = bytes(SESSION_BYTES)


def absent_request(request_id: int, wait_ms: int = 0, signer: ControlSigner | None = None) -> bytes:
    """A well-formed select for tokens no real entry has (real tokens are positive), in a guessed session."""
    tokens, roi = token_arrays(torch.tensor([-7, -8, -9]), torch.ones(3, dtype=torch.bool))
    request = select_request(request_id, tokens, roi, wait_ms, session=GUESSED_SESSION, counter=1)
    return encode_request(signer or ControlSigner(None), request)


def assert_still_serving(pair: LivePair, prober: Prober, selected_before: int) -> None:
    """The server answers a fresh peer, and the real traffic made progress meanwhile."""
    sock = prober.dealer()
    try:
        refusal = prober.ask(sock, [absent_request(424242)])
    finally:
        sock.close(linger=0)
    assert (refusal.reason, refusal.request_id) == ("stale", 424242), refusal
    deadline = time.monotonic() + BOUND
    while pair.selected() <= selected_before:
        assert time.monotonic() < deadline, "the real traffic stalled"
        time.sleep(0.02)
    pair.assert_alive()


def expected_reason(frame: bytes) -> str:
    """Why the producer must refuse a one-frame message from a stranger: "version" for a map whose
    integer ``v`` is another version, "stale" for a well-formed select (a stranger never has the
    producer's session), "malformed" for anything else. Written from the protocol's documentation,
    independently of the library's decoder."""
    try:
        message = msgspec.msgpack.decode(frame)
    except (msgspec.MsgspecError, UnicodeDecodeError):  # strings must be valid UTF-8
        return "malformed"

    def is_int(value: Any, low: int, high: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high

    if not isinstance(message, dict) or not all(isinstance(key, str) for key in message):
        return "malformed"
    if not is_int(message.get("v"), -(2**63), 2**64 - 1):
        return "malformed"
    if message["v"] != PROTOCOL_VERSION:
        return "version"  # read before anything else, so that another version's sender learns why
    if message.get("type") != "select":
        return "malformed"
    tokens, roi, session = message.get("tokens"), message.get("roi"), message.get("session")
    if not (is_int(message.get("request_id"), 0, (1 << 63) - 1) and is_int(message.get("wait_ms"), 0, MAX_WAIT_MS)):
        return "malformed"
    if not (
        isinstance(session, bytes) and len(session) == SESSION_BYTES and is_int(message.get("counter"), 1, MAX_COUNTER)
    ):
        return "malformed"
    if not (isinstance(tokens, bytes) and isinstance(roi, bytes)) or len(tokens) > MAX_TOKENS * 8:
        return "malformed"
    if len(tokens) == 0 or len(tokens) % 8 or len(roi) != len(tokens) // 8:
        return "malformed"
    if any(byte > 1 for byte in roi) or not any(roi):
        return "malformed"
    # Optional, each [dim, start, stop]: the part of the entry a select takes, and the span of that.
    for name in ("part", "span"):
        found = message.get(name)
        if found is not None and not (
            isinstance(found, list)
            and len(found) == 3
            and is_int(found[0], 0, MAX_NDIM)
            and is_int(found[1], 0, MAX_PART_INDEX - 1)
            and is_int(found[2], found[1] + 1, MAX_PART_INDEX)
        ):
            return "malformed"
    return "stale"


# ---------------------------------------------------------------- strategies

_ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=40),
    st.lists(st.integers(-3, 3), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(0, 9), max_size=2),
)
_EDGE_INTS = st.sampled_from(
    [-(2**63), -1, 0, 1, 2, PROTOCOL_VERSION + 1, 99, MAX_WAIT_MS, MAX_WAIT_MS + 1, 2**63 - 1, 2**63, 2**64 - 1]
)


#: A part's or a span's ``[dim, start, stop]``: well-formed, at and past its bounds, or not three integers.
_RANGES = st.one_of(
    st.tuples(st.integers(0, MAX_NDIM), st.integers(0, 9)).map(lambda pair: [pair[0], pair[1], pair[1] + 3]),
    st.lists(
        st.sampled_from(
            [-1, 0, 1, MAX_NDIM, MAX_NDIM + 1, MAX_PART_INDEX - 1, MAX_PART_INDEX, MAX_PART_INDEX + 1, 2**63 - 1]
        ),
        min_size=3,
        max_size=3,
    ),
    st.lists(st.integers(0, 4), max_size=5),
    _ANY_VALUE,
)


@st.composite
def negative_tokens(draw: Any) -> tuple[bytes, bytes]:
    count = draw(st.integers(1, 12))
    values = draw(st.lists(st.integers(-(2**63), -1), min_size=count, max_size=count))
    roi = draw(st.lists(st.integers(0, 1), min_size=count, max_size=count))
    roi[draw(st.integers(0, count - 1))] = 1
    return torch.tensor(values, dtype=torch.int64).numpy().astype("<i8").tobytes(), bytes(roi)


@st.composite
def mutated_selects(draw: Any) -> bytes:
    """A well-formed select with some fields replaced by wrong types or out-of-range values, some
    dropped, unknown ones added: raw msgpack maps, or msgspec Structs built without validation."""
    tokens, roi = draw(negative_tokens())
    fields: dict[str, Any] = dict(
        type="select",
        v=PROTOCOL_VERSION,
        request_id=draw(st.integers(0, 2**63 - 1)),
        session=draw(st.binary(min_size=SESSION_BYTES, max_size=SESSION_BYTES)),
        counter=draw(st.integers(1, MAX_COUNTER)),
        tokens=tokens,
        roi=roi,
        wait_ms=draw(st.integers(0, 20)),
    )
    for name in draw(st.sets(st.sampled_from(["part", "span"]))):
        fields[name] = draw(_RANGES)
    for name in draw(st.sets(st.sampled_from(sorted(fields)), max_size=3)):
        fields[name] = draw(
            st.one_of(
                _ANY_VALUE,
                _EDGE_INTS,
                st.sampled_from(["refusal", "select", "", "SELECT"]),
                st.binary(min_size=SESSION_BYTES - 1, max_size=SESSION_BYTES + 1),
            )
        )
    for name in draw(st.sets(st.sampled_from(sorted(fields)), max_size=2)):
        del fields[name]
    fields.update(draw(st.dictionaries(st.text(min_size=1, max_size=6), _ANY_VALUE, max_size=2)))
    return msgspec.msgpack.encode(defang(fields))


def defang(fields: dict[str, Any]) -> dict[str, Any]:
    """Keep the fuzzer from selecting for real, should the producer ever accept a stranger's select
    (the test then fails on its refusal reason): a select that may be well-formed gets negative tokens
    (real tokens are positive, so it cannot take a real entry) and no long wait (it would park)."""
    tokens, wait = fields.get("tokens"), fields.get("wait_ms")
    if isinstance(tokens, bytes) and len(tokens) % 8 == 0:
        words = bytearray(tokens)
        words[7::8] = bytes(byte | 0x80 for byte in words[7::8])
        fields["tokens"] = bytes(words)
    if isinstance(wait, int) and not isinstance(wait, bool) and 20 < wait <= MAX_WAIT_MS:
        fields["wait_ms"] = -wait
    return fields


_INT64 = st.one_of(st.integers(-(2**63), 2**63 - 1), _EDGE_INTS.filter(lambda v: v < 2**63))
#: The library's own Struct types, filled with anything (msgspec does not validate on construction).
struct_messages = st.one_of(
    st.fixed_dictionaries(
        dict(
            v=_INT64,
            request_id=_INT64,
            session=st.binary(max_size=SESSION_BYTES + 1),
            counter=_INT64,
            tokens=st.binary(max_size=33),
            roi=st.binary(max_size=5),
            wait_ms=_INT64,
        )
    ).map(lambda fields: SelectRequest(**defang(fields))),
    st.builds(
        Refusal,
        v=_INT64,
        request_id=_INT64,
        reason=st.sampled_from(["stale", "malformed", "miss", "x"]),
        message=st.text(max_size=20),
    ),
).map(msgspec.msgpack.encode)


# ---------------------------------------------------------------- control channel fuzzing


@pytest.mark.timeout(180)
def test_fuzz_random_bytes(live_pair: LivePair, prober: Prober) -> None:
    before = live_pair.selected()
    sock = prober.dealer()

    @settings(FUZZ, max_examples=400)
    @given(frame=st.one_of(st.binary(max_size=64), st.binary(min_size=1000, max_size=70_000)))
    def fuzz(frame: bytes) -> None:
        assert prober.ask(sock, [frame]).reason == expected_reason(frame)

    try:
        fuzz()
    finally:
        sock.close(linger=0)
    assert_still_serving(live_pair, prober, before)


@pytest.mark.timeout(180)
def test_fuzz_wrong_types_out_of_range_and_unknown_versions(live_pair: LivePair, prober: Prober) -> None:
    before = live_pair.selected()
    sock = prober.dealer()
    seen = {"stale": 0, "malformed": 0, "version": 0}

    @settings(FUZZ, max_examples=800)
    @given(frame=st.one_of(mutated_selects(), struct_messages))
    def fuzz(frame: bytes) -> None:
        expected = expected_reason(frame)
        refusal = prober.ask(sock, [frame])
        assert refusal.reason == expected, (frame, refusal)
        seen[expected] += 1

    try:
        fuzz()
    finally:
        sock.close(linger=0)
    assert all(seen.values()), seen  # well-formed, malformed and other versions' messages were exercised
    assert_still_serving(live_pair, prober, before)


@pytest.mark.timeout(120)
def test_fuzz_multipart_junk(live_pair: LivePair, prober: Prober) -> None:
    before = live_pair.selected()
    sock = prober.dealer()

    @settings(FUZZ, max_examples=200)
    @given(frames=st.lists(st.one_of(st.binary(max_size=48), st.just(absent_request(7))), min_size=2, max_size=6))
    def fuzz(frames: list[bytes]) -> None:
        refusal = prober.ask(sock, frames)
        assert refusal.reason == "malformed" and "frame" in refusal.message, refusal

    try:
        fuzz()
    finally:
        sock.close(linger=0)
    assert_still_serving(live_pair, prober, before)


@pytest.mark.timeout(120)
def test_truncated_and_oversized_frames(live_pair: LivePair, prober: Prober) -> None:
    before = live_pair.selected()
    tokens, roi = token_arrays(-torch.arange(1, 1001), torch.ones(1000, dtype=torch.bool))
    valid = encode_request(ControlSigner(None), select_request(99, tokens, roi, 0, session=GUESSED_SESSION, counter=1))
    sock = prober.dealer()
    try:
        for cut in sorted({*range(0, 40), *range(40, len(valid), 97), len(valid) - 1}):
            assert prober.ask(sock, [valid[:cut]]).reason == "malformed", cut
        assert prober.ask(sock, [valid + b"\0"]).reason == "malformed"  # trailing bytes
        assert prober.ask(sock, [valid]).reason == "stale"
        # One token over the limit: still under ZeroMQ's size cap, so the schema must refuse it.
        too_many = msgspec.msgpack.encode(
            dict(
                type="select",
                v=PROTOCOL_VERSION,
                request_id=5,
                session=GUESSED_SESSION,
                counter=1,
                tokens=b"\xff" * 8 * (MAX_TOKENS + 1),
                roi=b"\x01" * (MAX_TOKENS + 1),
                wait_ms=0,
            )
        )
        assert len(too_many) <= MAX_REQUEST_BYTES
        refusal = prober.ask(sock, [too_many])
        assert (refusal.reason, refusal.request_id) == ("malformed", 5), refusal
        assert "$.tokens" in refusal.message, refusal
    finally:
        sock.close(linger=0)
    # Over ZeroMQ's cap: the connection is dropped before the producer reads it; no answer comes.
    oversized = prober.dealer()
    oversized.setsockopt(zmq.RCVTIMEO, 1000)
    try:
        oversized.send(b"\x81" * (MAX_REQUEST_BYTES + 1))
        with pytest.raises(zmq.Again):
            oversized.recv()
    finally:
        oversized.close(linger=0)
    assert_still_serving(live_pair, prober, before)


def _invalid_utf8(frame: bytes, text: bytes) -> bytes:
    """``frame`` with the msgpack string ``text`` (a str of the message) turned into invalid UTF-8."""
    assert frame.count(text) == 1
    return frame.replace(text, text[:2] + b"\xff" + text[3:])


def test_invalid_utf8_in_control_messages_is_a_protocol_error() -> None:
    tokens, roi = token_arrays(torch.tensor([-1, -2]), torch.ones(2, dtype=torch.bool))
    request = encode_request(ControlSigner(None), select_request(5, tokens, roi, 0, session=GUESSED_SESSION, counter=1))
    refusal = encode_refusal(ControlSigner(None), 5, "stale", message="abc")
    with pytest.raises(MessageError):
        decode_request(ControlSigner(None), _invalid_utf8(request, b"\xa6select"))  # the type tag
    with pytest.raises(MessageError):
        decode_refusal(ControlSigner(None), _invalid_utf8(refusal, b"\xa5stale"))  # the reason
    with pytest.raises(MessageError):
        decode_refusal(ControlSigner(None), _invalid_utf8(refusal, b"\xa3abc"))  # the message


@pytest.mark.timeout(120)
def test_invalid_utf8_select_does_not_stop_the_producer() -> None:
    """One unauthenticated 60-byte message must not end the producer's service."""
    tokens, roi = token_arrays(torch.tensor([-1, -2]), torch.ones(2, dtype=torch.bool))
    poison = _invalid_utf8(absent_request(5), b"\xa6select")
    with running_pair() as pair:
        prober = Prober(pair.address)
        try:
            sock = prober.dealer()
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            try:
                refusal = prober.ask(sock, [poison])
            except zmq.Again:
                pytest.fail("the producer never answered the message: its server thread died (see the log)")
            assert refusal.reason == "malformed", refusal
            assert_still_serving(pair, prober, pair.selected())
        finally:
            prober.close()
        pair.stop.set()
        outcomes = procs.collect(pair.processes, pair.results, timeout=60)
    assert outcomes[1]["stats"]["misses"] == 0 and outcomes[0]["stats"]["hits"] == outcomes[1]["selected"]


def _junk_to(host: str, port: int, rng: random.Random, connections: int) -> list[socket.socket]:
    """Random bytes on ``connections`` TCP connections; returns a few left open (half-open peers)."""
    kept = []
    for index in range(connections):
        try:
            conn = socket.create_connection((host, port), timeout=BOUND)
            conn.sendall(rng.randbytes(rng.choice((1, 9, 512, 4096, 65536))))
        except OSError:
            continue  # the server may reset a connection it does not like: that is its right
        if index % 5 == 0:
            kept.append(conn)
        else:
            conn.close()
    return kept


@pytest.mark.timeout(120)
def test_connection_flood(live_pair: LivePair, prober: Prober) -> None:
    before = live_pair.selected()
    rng = random.Random(5)
    dealers = [prober.dealer() for _ in range(200)]
    host, port = "127.0.0.1", live_pair.port + 1
    half_open = []
    frames = [rng.randbytes(rng.randint(0, 300)) if index % 2 else absent_request(index) for index in range(200)]
    try:
        for sock, frame in zip(dealers, frames, strict=True):
            sock.send(frame)
        half_open += _junk_to(host, port, rng, 50)
        for index, (sock, frame) in enumerate(zip(dealers, frames, strict=True)):
            if index % 3 == 0:  # most never read their answer, as a flood would not
                refusal = decode_refusal(prober.signer, sock.recv())
                assert refusal.reason == expected_reason(frame), (index, refusal)
        assert_still_serving(live_pair, prober, before)
    finally:
        for sock in dealers:
            sock.close(linger=0)
        for conn in half_open:
            conn.close()
    assert_still_serving(live_pair, prober, live_pair.selected())


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.mark.timeout(180)
def test_producer_memory_stays_bounded_under_a_long_fuzz_burst(live_pair: LivePair, prober: Prober) -> None:
    before = live_pair.selected()
    producer_pid = live_pair.processes[0].pid
    rss_before = _rss_bytes(producer_pid)
    rng = random.Random(11)
    sent = junk_bytes = 0
    for _ in range(60):  # new peers each round: the ROUTER keeps per-peer state
        dealers = [prober.dealer() for _ in range(10)]
        try:
            sent_by = []
            for sock in dealers:
                frames = [rng.randbytes(rng.randint(0, 64 << 10)) for _ in range(40)]
                for frame in frames:
                    sock.send(frame)
                junk_bytes += sum(len(f) for f in frames)
                sent += len(frames)
                sent_by.append(frames)
            for sock, frames in zip(dealers, sent_by, strict=True):
                for frame in frames:  # answered in order: one connection, one server thread
                    assert decode_refusal(prober.signer, sock.recv()).reason == expected_reason(frame)
        finally:
            for sock in dealers:
                sock.close(linger=0)
    rss_after = _rss_bytes(producer_pid)
    print(
        f"fuzz burst: {sent} messages, {junk_bytes >> 20} MiB of junk; producer RSS "
        f"{rss_before >> 20} -> {rss_after >> 20} MiB"
    )
    assert junk_bytes > 3 * RSS_GROWTH_LIMIT  # a leak of a third of each message would show
    assert rss_after - rss_before < RSS_GROWTH_LIMIT, (rss_before, rss_after)
    assert_still_serving(live_pair, prober, before)


def _listening_ports(pid: int) -> list[int]:
    listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=BOUND).stdout
    ports = set()
    for line in listing.splitlines():
        if f"pid={pid}," in line:
            local = line.split()[3]
            assert local.startswith("127.0.0.1:"), f"listening beyond kv_ip: {line}"
            ports.add(int(local.rsplit(":", 1)[1]))
    return sorted(ports)


@pytest.mark.timeout(120)
def test_junk_on_every_listening_port_of_both_sides(live_pair: LivePair, prober: Prober) -> None:
    """Rendezvous store, gloo's listeners and the control port: junk on any of them harms no one."""
    before = live_pair.selected()
    rng = random.Random(13)
    kept = []
    ports = {rank: _listening_ports(p.pid) for rank, p in enumerate(live_pair.processes)}
    assert live_pair.port in ports[0] and live_pair.port + 1 in ports[0], ports  # store and control port
    assert ports[1], ports  # the consumer's gloo listener
    try:
        for port in ports[0] + ports[1]:
            kept += _junk_to("127.0.0.1", port, rng, 10)
        # A stranger speaking the store's own protocol, meddling with the rendezvous keys of a running pipe.
        stranger = torch.distributed.TCPStore(
            "127.0.0.1", live_pair.port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        stranger.set("kvbridge/hello/1", b"junk")
        stranger.delete_key("kvbridge/hello/0")
        stranger.add("kvbridge/counter", 5)
        del stranger
        assert_still_serving(live_pair, prober, before)
    finally:
        for conn in kept:
            conn.close()


@pytest.mark.timeout(120)
def test_real_traffic_survived_the_fuzzing(live_pair: LivePair) -> None:
    """Last in this file: stop the real traffic; both sides finished cleanly, every entry bit-exact."""
    live_pair.stop.set()
    outcomes = procs.collect(live_pair.processes, live_pair.results, timeout=60)
    producer, consumer = outcomes[0], outcomes[1]
    assert consumer["selected"] >= 2 * WINDOW and consumer["stats"]["hits"] == consumer["selected"]
    assert consumer["stats"]["misses"] == 0
    assert producer["stats"]["hits"] == consumer["selected"]
    print(
        f"real traffic: {consumer['selected']} entries selected bit-exact; producer refused "
        f"{producer['stats']['bad_messages']} control messages"
    )


# ---------------------------------------------------------------- forged pipe headers

_BASE = pipe_protocol.FrameHeader(
    kind=pipe_protocol.FrameKind.TENSOR,
    seq=0,
    consumed=0,
    want_credit=False,
    dtype=torch.float32,
    shape=(4, 4),
    nbytes=64,
    inline=True,
)
_INLINE_CAPACITY = pipe_protocol.HOST_FRAME_BYTES - pipe_protocol.HEADER_BYTES
PIPE_BUDGET = 4 << 20  # above the host inline capacity, so that an inline-flag lie is not also over budget
P = pipe_protocol  # word positions: _W_MAGIC, _W_SEQ, ...


def _header(**changes: Any) -> list[int]:
    return pipe_protocol.encode_header(dataclasses.replace(_BASE, **changes))


def _edit(words: list[int], **positions: int) -> list[int]:
    edited = list(words)
    for name, value in positions.items():
        edited[getattr(P, f"_W_{name.upper()}")] = value
    return edited


def _keepalive(consumed: int) -> list[int]:
    return pipe_protocol.encode_header(
        pipe_protocol.FrameHeader(kind=pipe_protocol.FrameKind.KEEPALIVE, seq=0, consumed=consumed, want_credit=False)
    )


_SECOND_RECORD = P.next_record_offset(0, _BASE.nbytes)  # where a record after _BASE starts


def _freed() -> list[int]:
    """A FREED record giving back one region (offset 0, as the frame's zeroed inline bytes say)."""
    return pipe_protocol.encode_header(
        pipe_protocol.FrameHeader(
            kind=pipe_protocol.FrameKind.FREED,
            seq=0,
            consumed=0,
            want_credit=False,
            dtype=torch.int64,
            shape=(1,),
            nbytes=8,
            inline=True,
        )
    )


def _close(seq: int = 0) -> list[int]:
    return pipe_protocol.encode_header(
        pipe_protocol.FrameHeader(kind=pipe_protocol.FrameKind.CLOSE, seq=seq, consumed=0, want_credit=False)
    )


#: name -> (the frames: header words at offset 0, or {offset: header words} for several records;
#: what the refusal must say)
HOSTILE_HEADERS: dict[str, tuple[list[list[int] | dict[int, list[int]]], str]] = {
    "over the budget": (
        [_header(dtype=torch.uint8, shape=(PIPE_BUDGET + 1,), nbytes=PIPE_BUDGET + 1)],
        "refused before allocating",
    ),
    "one TiB": ([_header(dtype=torch.uint8, shape=(1 << 40,), nbytes=1 << 40)], "refused before allocating"),
    "nbytes below the shape": ([_edit(_header(shape=(1 << 20,), nbytes=1 << 22), nbytes=64)], "inconsistent"),
    "nbytes above the shape": ([_edit(_header(), nbytes=1 << 19)], "inconsistent"),
    "shape overflowing int64": ([_header(dtype=torch.uint8, shape=(1 << 32, 1 << 32), nbytes=0)], "inconsistent"),
    "negative dims": ([_edit(_header(), shape=-4)], "malformed shape"),
    "negative nbytes": ([_edit(_header(shape=(0,), nbytes=0), nbytes=-8)], "inconsistent"),
    "unknown dtype code": ([_edit(_header(), dtype=999)], "unknown dtype code"),
    "dtype code 0": ([_edit(_header(), dtype=0)], "unknown dtype code"),
    "bad magic": ([_edit(_header(), magic=0x1234)], "bad magic"),
    "future version": ([_edit(_header(), version=pipe_protocol.PROTOCOL_VERSION + 1)], "version"),
    "wrong seq": ([_header(seq=5)], "arrived where 0 was due"),
    "negative seq": ([_edit(_header(), seq=-1)], "malformed"),
    "unknown kind": ([_edit(_header(), kind=99)], "unknown frame kind"),
    "ndim over the limit": ([_edit(_header(), ndim=pipe_protocol.MAX_NDIM + 1)], "ndim"),
    "negative ndim": ([_edit(_header(), ndim=-1)], "ndim"),
    "words after the shape": ([_edit(_header(), ndim=1, shape=16)], "malformed shape"),
    "inline flag lie": (
        [_edit(_header(dtype=torch.uint8, shape=(_INLINE_CAPACITY + 1,), nbytes=_INLINE_CAPACITY + 1), inline=1)],
        "inline flag",
    ),
    "keepalive with tensor fields": ([_edit(_keepalive(0), dtype=8)], "tensor fields"),
    "want_credit 2": ([_edit(_header(), want_credit=2)], "malformed"),
    "negative consumed": ([_edit(_header(), consumed=-1)], "malformed"),
    "consumed more than was sent": ([_keepalive(4096)], "was sent at most"),
    "more word 2": ([_edit(_header(), more=2)], "malformed"),
    "keepalive claiming a next record": ([_edit(_keepalive(0), more=1)], "claims another record"),
    "next record past the frame": (
        [_header(dtype=torch.uint8, shape=(_INLINE_CAPACITY,), nbytes=_INLINE_CAPACITY, more=True)],
        "past the end of its frame",
    ),
    "records disagreeing on credit": (
        [{0: _header(more=True), _SECOND_RECORD: _edit(_header(seq=1), consumed=64)}],
        "disagree on credit",
    ),
    "close after a record": ([{0: _header(more=True), _SECOND_RECORD: _close(seq=1)}], "after another record"),
    "bad second record": ([{0: _header(more=True), _SECOND_RECORD: _edit(_header(seq=1), magic=7)}], "bad magic"),
    "second record out of sequence": (
        [{0: _header(more=True), _SECOND_RECORD: _header(seq=3)}],
        "arrived where 1 was due",
    ),
    # The forger's shared-memory segment, which the victim maps, holds PIPE_BUDGET bytes after its first page.
    "payload placed past the segment": (
        [
            _header(
                dtype=torch.uint8,
                shape=(_INLINE_CAPACITY + 1,),
                nbytes=_INLINE_CAPACITY + 1,
                inline=False,
                place=PIPE_BUDGET,
            )
        ],
        "refused before reading it",
    ),
    "payload placed off a region start": (
        [
            _header(
                dtype=torch.uint8,
                shape=(_INLINE_CAPACITY + 1,),
                nbytes=_INLINE_CAPACITY + 1,
                inline=False,
                place=P.SHARED_DATA_START + 8,
            )
        ],
        "refused before reading it",
    ),
    "payload placed in the proof page": (
        [
            _edit(
                _header(dtype=torch.uint8, shape=(_INLINE_CAPACITY + 1,), nbytes=_INLINE_CAPACITY + 1, inline=False),
                place=-P.SHARED_DATA_START,
            )
        ],
        "refused before reading it",
    ),
    "inline tensor with a place": ([_edit(_header(), place=P.SHARED_DATA_START)], "inline flag"),
    "freeing a region never given": ([_freed()], "never gave it"),
    "giving back a region never given, in a header": ([_header(freed=P.SHARED_DATA_START)], "never gave it"),
    "giving back an offset off a region start": ([_edit(_header(), freed=P.SHARED_DATA_START + 8)], "no region start"),
    "giving back a negative offset": ([_edit(_keepalive(0), freed=-P.SHARED_DATA_START)], "no region start"),
    "giving back a region in a second record": (
        [{0: _header(more=True), _SECOND_RECORD: _header(seq=1, freed=P.SHARED_DATA_START)}],
        "other than its frame's first",
    ),
    "FREED record of floats": ([_edit(_freed(), dtype=P.DTYPE_TO_CODE[torch.float64])], "malformed FREED"),
}


def body_hostile_headers(rank: int, port: int) -> dict:
    """One pipe per forged header (port offsets 0, 2, 4, ...): rank 1 forges, rank 0 must refuse."""
    verdicts = {}
    for offset, (name, (frames, _)) in enumerate(HOSTILE_HEADERS.items()):
        cfg = KVTransferConfig(
            kv_rank=rank, kv_port=port, kv_timeout=3.0, kv_connect_timeout=30.0, kv_buffer_size=PIPE_BUDGET
        )
        if rank == 1:
            connection = connect_as_forger(cfg, port_offset=2 * offset)
            for records in frames:
                send_records(connection, records if isinstance(records, dict) else {0: records})
            drain_until_dropped(connection)  # rank 0 dropped the connection
            continue
        pipe = TorchDistributedPipe(cfg, port_offset=2 * offset)
        allocations: list[int] = []
        allocate = pipe._state.wire.allocate
        pipe._state.wire.allocate = lambda n, seen=allocations, allocate=allocate: seen.append(n) or allocate(n)
        try:
            got = pipe.recv_tensor(timeout=30)
            verdicts[name] = {"error": None, "got": repr(got)[:200]}
        except KVTransferError as exc:
            verdicts[name] = {"error": type(exc).__name__, "message": str(exc)}
        try:  # the refusal is final: the pipe is unusable afterwards
            pipe.send_tensor(torch.ones(2))
            verdicts[name]["after"] = "accepted a send"
        except KVTransferError as exc:
            verdicts[name]["after"] = type(exc).__name__
        verdicts[name]["allocations"] = allocations
        _close_quietly(pipe)
    return verdicts


def _close_quietly(pipe: TorchDistributedPipe) -> None:
    try:
        pipe.close()
    except KVTransferError:
        pass  # the failure was reported already


@pytest.mark.timeout(180)
def test_forged_pipe_headers_are_refused_before_allocation() -> None:
    port = procs.free_port(span=2 * len(HOSTILE_HEADERS) + 2)
    verdicts, _ = procs.run_pair(body_hostile_headers, (0, port), (1, port), timeout=170)
    failures = []
    for name, (_, gist) in HOSTILE_HEADERS.items():
        verdict = verdicts[name]
        if (
            verdict["error"] != "KVProtocolError"
            or gist not in verdict.get("message", "")
            or verdict["allocations"]
            or verdict["after"] != "KVProtocolError"
        ):
            failures.append(f"{name}: {verdict}")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- shared secret: strangers and friends

SECRET = "correct horse battery staple"


def pipe_friend_server(rank: int, port: int, attempts: int) -> dict:
    """Rank 0 with a secret: rebuilt after each refused stranger; then serves its friend (rank 1)."""
    cfg = KVTransferConfig(kv_rank=rank, kv_port=port, kv_timeout=3.0, kv_connect_timeout=30.0, kv_secret=SECRET)
    refusals = []
    generator = torch.Generator().manual_seed(rank)
    for _ in range(attempts):
        try:
            pipe = TorchDistributedPipe(cfg)
        except KVTransferError as exc:
            refusals.append((type(exc).__name__, str(exc)))
            continue
        with pipe:
            mine = buffer_bodies.random_tensor(generator, torch.bfloat16, (33, 65))
            theirs = buffer_bodies.random_tensor(torch.Generator().manual_seed(1 - rank), torch.bfloat16, (33, 65))
            pipe.send_tensor(mine)
            assert buffer_bodies.same_bits(pipe.recv_tensor(timeout=BOUND), theirs)
            pipe.send_tensor(None)
            assert pipe.recv_tensor(timeout=BOUND) is None
        return {"refusals": refusals, "served": True}
    return {"refusals": refusals, "served": False}


def _stranger_handshake(port: int, mode: bytes, forge: str) -> None:
    """Play rank 1 at the rendezvous without the secret, speaking the pipe's own rendezvous protocol."""
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, world_size=2, is_master=False, timeout=datetime.timedelta(seconds=BOUND)
    )
    hello = pipe_protocol.Hello(
        frame_bytes=pipe_protocol.HOST_FRAME_BYTES, max_in_flight=1 << 30, device="cpu", timeout_ms=3000
    )
    store.set("kvbridge/hello/1", hello.pack())
    store.set("kvbridge/auth/1", mode)
    if mode == b"required":
        store.set("kvbridge/nonce/1", auth.new_nonce())
        their_proof = store.get("kvbridge/proof/0")
        store.set("kvbridge/proof/1", their_proof if forge == "reflected" else os.urandom(auth.TAG_BYTES))
    time.sleep(0.5)  # let rank 0 read it before this connection goes away


@pytest.mark.timeout(120)
def test_pipe_rendezvous_refuses_strangers_then_serves_the_friend() -> None:
    port = procs.free_port()
    results = procs.new_queue()
    server = procs.start(pipe_friend_server, (0, port, 4), results, 0)
    friend = None
    kept: list[socket.socket] = []
    try:
        rng = random.Random(3)
        deadline = time.monotonic() + 60
        while not kept:  # junk first; this also waits until the rendezvous listens
            assert time.monotonic() < deadline and server.is_alive(), "rank 0 never listened"
            kept = _junk_to("127.0.0.1", port, rng, 5)
            time.sleep(0.1)
        for mode, forge in ((b"required", "random"), (b"required", "reflected"), (b"none", "")):
            _stranger_handshake(port, mode, forge)
        friend = procs.start(pipe_friend_server, (1, port, 1), results, 1)
        outcomes = procs.collect([server, friend], results, timeout=90)
    finally:
        for conn in kept:
            conn.close()
        procs.reap([server] + ([friend] if friend else []))
    refusals = outcomes[0]["refusals"]
    assert [name for name, _ in refusals] == ["KVProtocolError"] * 3, refusals
    assert all("authentication failed" in message for _, message in refusals), refusals
    assert outcomes[0]["served"] and outcomes[1] == {"refusals": [], "served": True}


def buffer_side_with_secret(rank: int, port: int, seed: int, count: int, sync: dict) -> dict:
    """Rank 0 inserts ``count`` entries; rank 1 (the friend) selects every entry once the test's
    strangers are done."""
    cfg = KVTransferConfig(
        kv_role="kv_producer" if rank == 0 else "kv_consumer",
        kv_rank=rank,
        kv_port=port,
        kv_timeout=5.0,
        kv_connect_timeout=30.0,
        kv_secret=SECRET,
    )
    buffer = SimpleBuffer(TorchDistributedPipe(cfg), cfg)
    try:
        if rank == 0:
            for index in range(count):
                buffer.insert(*buffer_bodies.make_request(seed, index))
            sync["inserted"].set()
            buffer_bodies.wait_until(lambda: buffer.stats().hits == count, "the friend took every entry")
            return dataclasses.asdict(buffer.stats())
        assert sync["stranger_done"].wait(BOUND + 60), "the stranger never finished"
        for index in range(count):
            want = buffer_bodies.make_request(seed, index)
            buffer_bodies.check_entry(buffer.drop_select(want[0], want[1], timeout=BOUND), want, f"request {index}")
        sync["friend_done"].set()
        return dataclasses.asdict(buffer.stats())
    finally:
        if rank == 0:
            assert sync["friend_done"].wait(BOUND)
        buffer.close()


class _FakePipe:
    """The data pipe of a stranger's SimpleBuffer: a session header of its own making, then nothing."""

    port_offset = 0

    def __init__(self) -> None:
        self._closed = threading.Event()
        self._session: torch.Tensor | None = torch.from_numpy(make_session(GUESSED_SESSION))

    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor:
        if self._session is not None:
            session, self._session = self._session, None
            return session
        if not self._closed.wait(timeout):
            raise KVTimeoutError(f"nothing arrived within {timeout:g} s")
        raise KVPipeClosedError("closed")

    def close(self) -> None:
        self._closed.set()


def _stranger_buffer_select(port: int, secret: str | None, request: list) -> str:
    cfg = KVTransferConfig(kv_role="kv_consumer", kv_rank=1, kv_port=port, kv_timeout=2.0, kv_secret=secret)
    stranger = SimpleBuffer(_FakePipe(), cfg)  # type: ignore[arg-type]
    try:
        got = stranger.drop_select(request[0], request[1], timeout=0.5)
        return f"returned {'a hit' if got[0] is not None else 'a miss'}"
    except KVProtocolError as exc:
        return f"KVProtocolError: {exc}"
    except KVTransferError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        stranger.close()


@pytest.mark.timeout(120)
def test_control_channel_refuses_strangers_and_forged_sessions_then_serves_the_friend() -> None:
    seed, count = 81, 12
    port = procs.free_port()
    ctx = procs._CTX
    sync = {name: ctx.Event() for name in ("inserted", "stranger_done", "friend_done")}
    results = procs.new_queue()
    processes = [
        procs.start(buffer_side_with_secret, (rank, port, seed, count, sync), results, rank) for rank in (0, 1)
    ]
    verdicts: dict[str, Any] = {}
    try:
        assert sync["inserted"].wait(60), "the producer did not insert"
        target = buffer_bodies.make_request(seed, 0)
        tokens, roi = token_arrays(target[0], target[1])
        friend, guess, unsigned = ControlSigner(SECRET), ControlSigner("guess"), ControlSigner(None)

        def request(request_id: int, wait_ms: int = 500) -> SelectRequest:
            return select_request(request_id, tokens, roi, wait_ms, session=GUESSED_SESSION, counter=request_id)

        body = encode_request(unsigned, request(1001))
        signed_absent = encode_request(
            friend,
            select_request(
                1002, *token_arrays(torch.tensor([-1]), torch.ones(1, dtype=torch.bool)), 0, GUESSED_SESSION, 1002
            ),
        )
        attempts = {
            "unsigned": body,
            "wrong secret": encode_request(guess, request(1003)),
            "tampered": body + signed_absent[-auth.TAG_BYTES :],
            "tag only": signed_absent[-auth.TAG_BYTES :],
            "truncated tag": encode_request(friend, request(1004))[:-1],
            # With the secret but without the session, which only the data pipe carries.
            "signed, guessed session": encode_request(friend, request(1005)),
        }
        prober = Prober(f"tcp://127.0.0.1:{port + 1}", SECRET)
        sock = prober.dealer()
        try:
            for name, frame in attempts.items():
                verdicts[name] = _stranger_reply(_exchange(sock, frame))
        finally:
            prober.close()
        verdicts["SimpleBuffer, wrong secret"] = _stranger_buffer_select(port, "guess", target)
        verdicts["SimpleBuffer, no secret"] = _stranger_buffer_select(port, None, target)
        verdicts["SimpleBuffer, forged session"] = _stranger_buffer_select(port, SECRET, target)
        sync["stranger_done"].set()
        outcomes = procs.collect(processes, results, timeout=90)
    finally:
        procs.reap(processes)
    for name in attempts:
        expected = "stale" if name == "signed, guessed session" else "unauthenticated"
        assert verdicts[name] == expected, (name, verdicts)
    assert verdicts["SimpleBuffer, wrong secret"].startswith("KVProtocolError"), verdicts
    assert "authentication failed" in verdicts["SimpleBuffer, wrong secret"], verdicts
    assert verdicts["SimpleBuffer, no secret"].startswith("KVProtocolError"), verdicts
    assert "kv_secret" in verdicts["SimpleBuffer, no secret"], verdicts
    assert verdicts["SimpleBuffer, forged session"].startswith("KVProtocolError"), verdicts
    assert "foreign session" in verdicts["SimpleBuffer, forged session"], verdicts
    producer, consumer = outcomes[0], outcomes[1]
    # The friend got every entry bit-exact, including the strangers' target.
    assert consumer["hits"] == count and consumer["misses"] == 0, consumer
    assert producer["hits"] == count and producer["bad_messages"] == len(attempts) + 3, producer


def _exchange(sock: zmq.Socket, frame: bytes) -> bytes:
    sock.send(frame)
    return sock.recv()


def _stranger_reply(frame: bytes) -> str:
    """The reason a stranger reads in a refusal (signed, so it checks no tag: it strips one)."""
    return decode_refusal(ControlSigner(None), frame[: -auth.TAG_BYTES]).reason
