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
    MAX_REQUEST_BYTES,
    MAX_WAIT_MS,
    PROTOCOL_VERSION,
    ControlSigner,
    MessageError,
    Reply,
    SelectRequest,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from tests import _buffer_procs as buffer_bodies
from tests import procs
from tests.pipe_forgery import connect_as_forger, drain_until_dropped, send_records

SEED = 71
TRAFFIC_BUDGET = 4 << 20
WINDOW = 4
BOUND = 30.0
#: A generous bound on the producer's memory growth over a long fuzz burst: a correctness check
#: (no per-message leak: the burst sends several hundred MB of junk), not a performance threshold.
RSS_GROWTH_LIMIT = 200 << 20
FUZZ = settings(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------- real traffic (spawned processes)


def traffic_side(rank: int, port: int, seed: int, stop: Any, done: Any, progress: Any, secret: str | None) -> dict:
    """Rank 0 inserts request after request; rank 1 selects them (shuffled per window) and checks each."""
    cfg = KVTransferConfig(kv_role="kv_producer" if rank == 0 else "kv_consumer", kv_rank=rank, kv_port=port,
                           kv_timeout=5.0, kv_connect_timeout=30.0, kv_buffer_size=TRAFFIC_BUDGET, kv_secret=secret)
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
    processes = [procs.start(traffic_side, (rank, port, SEED, stop, done, progress, secret), results, rank)
                 for rank in (0, 1)]
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

    def ask(self, sock: zmq.Socket, frames: list[bytes]) -> Reply:
        sock.send_multipart(frames)
        return decode_reply(self.signer, sock.recv())

    def close(self) -> None:
        self.context.destroy(linger=0)


@pytest.fixture
def prober(live_pair: LivePair) -> Iterator[Prober]:
    instance = Prober(live_pair.address)
    try:
        yield instance
    finally:
        instance.close()


def absent_request(request_id: int, wait_ms: int = 0, signer: ControlSigner | None = None) -> bytes:
    """A valid select for tokens no real entry has (real tokens are positive)."""
    tokens, roi = token_arrays(torch.tensor([-7, -8, -9]), torch.ones(3, dtype=torch.bool))
    return encode_request(signer or ControlSigner(None), request_id, tokens, roi, wait_ms)


def assert_still_serving(pair: LivePair, prober: Prober, selected_before: int) -> None:
    """The server answers a fresh peer, and the real traffic made progress meanwhile."""
    sock = prober.dealer()
    try:
        reply = prober.ask(sock, [absent_request(424242)])
    finally:
        sock.close(linger=0)
    assert (reply.status, reply.request_id) == ("miss", 424242), reply
    deadline = time.monotonic() + BOUND
    while pair.selected() <= selected_before:
        assert time.monotonic() < deadline, "the real traffic stalled"
        time.sleep(0.02)
    pair.assert_alive()


def expected_status(frame: bytes) -> str:
    """What the producer must answer to a one-frame message: "miss" for a valid select (its tokens
    are never real ones), "error" for anything else. Written from the protocol's documentation,
    independently of the library's decoder."""
    try:
        message = msgspec.msgpack.decode(frame)
    except (msgspec.MsgspecError, UnicodeDecodeError):  # strings must be valid UTF-8
        return "error"

    def is_int(value: Any, low: int, high: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high

    if not isinstance(message, dict) or message.get("type") != "select":
        return "error"
    if not is_int(message.get("v"), PROTOCOL_VERSION, PROTOCOL_VERSION):
        return "error"
    tokens, roi = message.get("tokens"), message.get("roi")
    if not (is_int(message.get("request_id"), 0, (1 << 63) - 1) and is_int(message.get("wait_ms"), 0, MAX_WAIT_MS)):
        return "error"
    if not (isinstance(tokens, bytes) and isinstance(roi, bytes)) or len(tokens) > MAX_TOKENS * 8:
        return "error"
    if len(tokens) == 0 or len(tokens) % 8 or len(roi) != len(tokens) // 8:
        return "error"
    if any(byte > 1 for byte in roi) or not any(roi):
        return "error"
    return "miss"


# ---------------------------------------------------------------- strategies

_ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1), st.floats(),
    st.text(max_size=12), st.binary(max_size=40), st.lists(st.integers(-3, 3), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(0, 9), max_size=2),
)
_EDGE_INTS = st.sampled_from([-(2**63), -1, 0, 1, 2, PROTOCOL_VERSION + 1, 99, MAX_WAIT_MS, MAX_WAIT_MS + 1,
                              2**63 - 1, 2**63, 2**64 - 1])


@st.composite
def negative_tokens(draw: Any) -> tuple[bytes, bytes]:
    count = draw(st.integers(1, 12))
    values = draw(st.lists(st.integers(-(2**63), -1), min_size=count, max_size=count))
    roi = draw(st.lists(st.integers(0, 1), min_size=count, max_size=count))
    roi[draw(st.integers(0, count - 1))] = 1
    return torch.tensor(values, dtype=torch.int64).numpy().astype("<i8").tobytes(), bytes(roi)


@st.composite
def mutated_selects(draw: Any) -> bytes:
    """A valid select with some fields replaced by wrong types or out-of-range values, some dropped,
    unknown ones added: raw msgpack maps, or msgspec Structs built without validation."""
    tokens, roi = draw(negative_tokens())
    fields: dict[str, Any] = dict(type="select", v=PROTOCOL_VERSION, request_id=draw(st.integers(0, 2**63 - 1)),
                                  tokens=tokens, roi=roi, wait_ms=draw(st.integers(0, 20)))
    for name in draw(st.sets(st.sampled_from(sorted(fields)), max_size=3)):
        fields[name] = draw(st.one_of(_ANY_VALUE, _EDGE_INTS, st.sampled_from(["reply", "select", "", "SELECT"])))
    for name in draw(st.sets(st.sampled_from(sorted(fields)), max_size=2)):
        del fields[name]
    fields.update(draw(st.dictionaries(st.text(min_size=1, max_size=6), _ANY_VALUE, max_size=2)))
    return msgspec.msgpack.encode(defang(fields))


def defang(fields: dict[str, Any]) -> dict[str, Any]:
    """Keep the fuzzer from selecting for real: a select that may be valid gets negative tokens (real
    tokens are positive, so it cannot take a real entry) and no long wait (it would park for real)."""
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
    st.fixed_dictionaries(dict(v=_INT64, request_id=_INT64, tokens=st.binary(max_size=33), roi=st.binary(max_size=5),
                               wait_ms=_INT64)).map(lambda fields: SelectRequest(**defang(fields))),
    st.builds(Reply, v=_INT64, request_id=_INT64, status=st.sampled_from(["hit", "miss", "error", "closed", "x"]),
              waited=st.booleans(), message=st.text(max_size=20)),
).map(msgspec.msgpack.encode)


# ---------------------------------------------------------------- control channel fuzzing


@pytest.mark.timeout(180)
def test_fuzz_random_bytes(live_pair: LivePair, prober: Prober) -> None:
    before = live_pair.selected()
    sock = prober.dealer()

    @settings(FUZZ, max_examples=400)
    @given(frame=st.one_of(st.binary(max_size=64), st.binary(min_size=1000, max_size=70_000)))
    def fuzz(frame: bytes) -> None:
        assert prober.ask(sock, [frame]).status == expected_status(frame)

    try:
        fuzz()
    finally:
        sock.close(linger=0)
    assert_still_serving(live_pair, prober, before)


@pytest.mark.timeout(180)
def test_fuzz_wrong_types_out_of_range_and_unknown_versions(live_pair: LivePair, prober: Prober) -> None:
    before = live_pair.selected()
    sock = prober.dealer()
    seen = {"miss": 0, "error": 0}

    @settings(FUZZ, max_examples=800)
    @given(frame=st.one_of(mutated_selects(), struct_messages))
    def fuzz(frame: bytes) -> None:
        expected = expected_status(frame)
        reply = prober.ask(sock, [frame])
        assert reply.status == expected, (frame, reply)
        seen[expected] += 1

    try:
        fuzz()
    finally:
        sock.close(linger=0)
    assert seen["miss"] > 0 and seen["error"] > 0, seen  # both valid and invalid messages were exercised
    assert_still_serving(live_pair, prober, before)


@pytest.mark.timeout(120)
def test_fuzz_multipart_junk(live_pair: LivePair, prober: Prober) -> None:
    before = live_pair.selected()
    sock = prober.dealer()

    @settings(FUZZ, max_examples=200)
    @given(frames=st.lists(st.one_of(st.binary(max_size=48), st.just(absent_request(7))), min_size=2, max_size=6))
    def fuzz(frames: list[bytes]) -> None:
        reply = prober.ask(sock, frames)
        assert reply.status == "error" and "frame" in reply.message, reply

    try:
        fuzz()
    finally:
        sock.close(linger=0)
    assert_still_serving(live_pair, prober, before)


@pytest.mark.timeout(120)
def test_truncated_and_oversized_frames(live_pair: LivePair, prober: Prober) -> None:
    before = live_pair.selected()
    tokens, roi = token_arrays(-torch.arange(1, 1001), torch.ones(1000, dtype=torch.bool))
    valid = encode_request(ControlSigner(None), 99, tokens, roi, 0)
    sock = prober.dealer()
    try:
        for cut in sorted({*range(0, 40), *range(40, len(valid), 97), len(valid) - 1}):
            assert prober.ask(sock, [valid[:cut]]).status == "error", cut
        assert prober.ask(sock, [valid + b"\0"]).status == "error"  # trailing bytes
        assert prober.ask(sock, [valid]).status == "miss"
        # One token over the limit: still under ZeroMQ's size cap, so the schema must refuse it.
        too_many = msgspec.msgpack.encode(dict(type="select", v=PROTOCOL_VERSION, request_id=5,
                                               tokens=b"\xff" * 8 * (MAX_TOKENS + 1), roi=b"\x01" * (MAX_TOKENS + 1),
                                               wait_ms=0))
        assert len(too_many) <= MAX_REQUEST_BYTES
        reply = prober.ask(sock, [too_many])
        assert reply.status == "error" and reply.request_id == 5, reply
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
    request = encode_request(ControlSigner(None), 5, tokens, roi, 0)
    reply = encode_reply(ControlSigner(None), 5, "miss", message="abc")
    with pytest.raises(MessageError):
        decode_request(ControlSigner(None), _invalid_utf8(request, b"\xa6select"))  # the type tag
    with pytest.raises(MessageError):
        decode_reply(ControlSigner(None), _invalid_utf8(reply, b"\xa4miss"))  # the status
    with pytest.raises(MessageError):
        decode_reply(ControlSigner(None), _invalid_utf8(reply, b"\xa3abc"))  # the message


@pytest.mark.timeout(120)
def test_invalid_utf8_select_does_not_stop_the_producer() -> None:
    """One unauthenticated 60-byte message must not end the producer's service."""
    tokens, roi = token_arrays(torch.tensor([-1, -2]), torch.ones(2, dtype=torch.bool))
    poison = _invalid_utf8(encode_request(ControlSigner(None), 5, tokens, roi, 0), b"\xa6select")
    with running_pair() as pair:
        prober = Prober(pair.address)
        try:
            sock = prober.dealer()
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            try:
                reply = prober.ask(sock, [poison])
            except zmq.Again:
                pytest.fail("the producer never answered the message: its server thread died (see the log)")
            assert reply.status == "error", reply
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
    try:
        for index, sock in enumerate(dealers):
            sock.send(rng.randbytes(rng.randint(0, 300)) if index % 2 else absent_request(index))
        half_open += _junk_to(host, port, rng, 50)
        for index, sock in enumerate(dealers):
            if index % 3 == 0:  # most never read their answer, as a flood would not
                reply = decode_reply(prober.signer, sock.recv())
                assert reply.status == ("error" if index % 2 else "miss"), (index, reply)
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
            for sock in dealers:
                frames = [rng.randbytes(rng.randint(0, 64 << 10)) for _ in range(40)]
                for frame in frames:
                    sock.send(frame)
                junk_bytes += sum(len(f) for f in frames)
                sent += len(frames)
            for sock in dealers:
                for _ in range(40):
                    assert decode_reply(prober.signer, sock.recv()).status == "error"
        finally:
            for sock in dealers:
                sock.close(linger=0)
    rss_after = _rss_bytes(producer_pid)
    print(f"fuzz burst: {sent} messages, {junk_bytes >> 20} MiB of junk; producer RSS "
          f"{rss_before >> 20} -> {rss_after >> 20} MiB")
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
        stranger = torch.distributed.TCPStore("127.0.0.1", live_pair.port, is_master=False,
                                              timeout=datetime.timedelta(seconds=10))
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
    print(f"real traffic: {consumer['selected']} entries selected bit-exact; producer refused "
          f"{producer['stats']['bad_messages']} control messages")


# ---------------------------------------------------------------- forged pipe headers

_BASE = pipe_protocol.FrameHeader(kind=pipe_protocol.FrameKind.TENSOR, seq=0, consumed=0, want_credit=False,
                                  dtype=torch.float32, shape=(4, 4), nbytes=64, inline=True)
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
    return pipe_protocol.encode_header(pipe_protocol.FrameHeader(
        kind=pipe_protocol.FrameKind.KEEPALIVE, seq=0, consumed=consumed, want_credit=False))


_SECOND_RECORD = P.next_record_offset(0, _BASE.nbytes)  # where a record after _BASE starts


def _freed() -> list[int]:
    """A FREED record giving back one region (offset 0, as the frame's zeroed inline bytes say)."""
    return pipe_protocol.encode_header(pipe_protocol.FrameHeader(
        kind=pipe_protocol.FrameKind.FREED, seq=0, consumed=0, want_credit=False, dtype=torch.int64, shape=(1,),
        nbytes=8, inline=True))


def _close(seq: int = 0) -> list[int]:
    return pipe_protocol.encode_header(pipe_protocol.FrameHeader(
        kind=pipe_protocol.FrameKind.CLOSE, seq=seq, consumed=0, want_credit=False))


#: name -> (the frames: header words at offset 0, or {offset: header words} for several records;
#: what the refusal must say)
HOSTILE_HEADERS: dict[str, tuple[list[list[int] | dict[int, list[int]]], str]] = {
    "over the budget": ([_header(dtype=torch.uint8, shape=(PIPE_BUDGET + 1,), nbytes=PIPE_BUDGET + 1)],
                        "refused before allocating"),
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
    "inline flag lie": ([_edit(_header(dtype=torch.uint8, shape=(_INLINE_CAPACITY + 1,),
                                       nbytes=_INLINE_CAPACITY + 1), inline=1)], "inline flag"),
    "keepalive with tensor fields": ([_edit(_keepalive(0), dtype=8)], "tensor fields"),
    "want_credit 2": ([_edit(_header(), want_credit=2)], "malformed"),
    "negative consumed": ([_edit(_header(), consumed=-1)], "malformed"),
    "consumed more than was sent": ([_keepalive(4096)], "was sent at most"),
    "more word 2": ([_edit(_header(), more=2)], "malformed"),
    "keepalive claiming a next record": ([_edit(_keepalive(0), more=1)], "claims another record"),
    "next record past the frame": ([_header(dtype=torch.uint8, shape=(_INLINE_CAPACITY,), nbytes=_INLINE_CAPACITY,
                                            more=True)], "past the end of its frame"),
    "records disagreeing on credit": ([{0: _header(more=True), _SECOND_RECORD: _edit(_header(seq=1), consumed=64)}],
                                      "disagree on credit"),
    "close after a record": ([{0: _header(more=True), _SECOND_RECORD: _close(seq=1)}], "after another record"),
    "bad second record": ([{0: _header(more=True), _SECOND_RECORD: _edit(_header(seq=1), magic=7)}], "bad magic"),
    "second record out of sequence": ([{0: _header(more=True), _SECOND_RECORD: _header(seq=3)}],
                                      "arrived where 1 was due"),
    # The forger's shared-memory segment, which the victim maps, holds PIPE_BUDGET bytes after its first page.
    "payload placed past the segment": ([_header(dtype=torch.uint8, shape=(_INLINE_CAPACITY + 1,),
                                                 nbytes=_INLINE_CAPACITY + 1, inline=False, place=PIPE_BUDGET)],
                                        "refused before reading it"),
    "payload placed off a region start": ([_header(dtype=torch.uint8, shape=(_INLINE_CAPACITY + 1,),
                                                   nbytes=_INLINE_CAPACITY + 1, inline=False,
                                                   place=P.SHARED_DATA_START + 8)],
                                          "refused before reading it"),
    "payload placed in the proof page": ([_edit(_header(dtype=torch.uint8, shape=(_INLINE_CAPACITY + 1,),
                                                        nbytes=_INLINE_CAPACITY + 1, inline=False),
                                               place=-P.SHARED_DATA_START)],
                                         "refused before reading it"),
    "inline tensor with a place": ([_edit(_header(), place=P.SHARED_DATA_START)], "refused before reading it"),
    "freeing a region never given": ([_freed()], "never gave it"),
    "FREED record of floats": ([_edit(_freed(), dtype=P.DTYPE_TO_CODE[torch.float64])], "malformed FREED"),
}


def body_hostile_headers(rank: int, port: int) -> dict:
    """One pipe per forged header (port offsets 0, 2, 4, ...): rank 1 forges, rank 0 must refuse."""
    verdicts = {}
    for offset, (name, (frames, _)) in enumerate(HOSTILE_HEADERS.items()):
        cfg = KVTransferConfig(kv_rank=rank, kv_port=port, kv_timeout=3.0, kv_connect_timeout=30.0,
                               kv_buffer_size=PIPE_BUDGET)
        if rank == 1:
            connection = connect_as_forger(cfg, port_offset=2 * offset)
            for records in frames:
                send_records(connection, records if isinstance(records, dict) else {0: records})
            drain_until_dropped(connection)  # rank 0 dropped the connection
            continue
        pipe = TorchDistributedPipe(cfg, port_offset=2 * offset)
        allocations: list[int] = []
        allocate = pipe._wire.allocate
        pipe._wire.allocate = lambda n, seen=allocations, allocate=allocate: seen.append(n) or allocate(n)
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
        if (verdict["error"] != "KVProtocolError" or gist not in verdict.get("message", "")
                or verdict["allocations"] or verdict["after"] != "KVProtocolError"):
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
    store = torch.distributed.TCPStore("127.0.0.1", port, world_size=2, is_master=False,
                                       timeout=datetime.timedelta(seconds=BOUND))
    hello = pipe_protocol.Hello(frame_bytes=pipe_protocol.HOST_FRAME_BYTES, max_in_flight=1 << 30, device="cpu",
                                timeout_ms=3000)
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
    """Rank 0 inserts ``count`` entries plus a second copy of entry 1; rank 1 (the friend) selects
    every entry once the test's stranger is done. The first copy of entry 1 goes to a select the test
    sends as the friend (then replays), so the friend must receive the second copy."""
    cfg = KVTransferConfig(kv_role="kv_producer" if rank == 0 else "kv_consumer", kv_rank=rank, kv_port=port,
                           kv_timeout=5.0, kv_connect_timeout=30.0, kv_secret=SECRET)
    buffer = SimpleBuffer(TorchDistributedPipe(cfg), cfg)
    try:
        if rank == 0:
            for index in range(count):
                buffer.insert(*buffer_bodies.make_request(seed, index))
            buffer.insert(*second_copy(seed))
            sync["inserted"].set()
            # the friend's hits and the one select the test sends as the friend
            buffer_bodies.wait_until(lambda: buffer.stats().hits == count + 1, "the friend took every entry")
            return dataclasses.asdict(buffer.stats())
        assert sync["stranger_done"].wait(BOUND + 60), "the stranger never finished"
        for index in range(count):
            want = second_copy(seed) if index == 1 else buffer_bodies.make_request(seed, index)
            buffer_bodies.check_entry(buffer.drop_select(want[0], want[1], timeout=BOUND), want, f"request {index}")
        sync["friend_done"].set()
        return dataclasses.asdict(buffer.stats())
    finally:
        if rank == 0:
            assert sync["friend_done"].wait(BOUND)
        buffer.close()


def second_copy(seed: int) -> list:
    """Entry 1's tokens and roi again, with other KV: it must reach the friend, not a replayer."""
    request = buffer_bodies.make_request(seed, 1)
    request[2] = buffer_bodies.random_tensor(torch.Generator().manual_seed(seed + 7), torch.float16, (5, 3))
    return request


class _FakePipe:
    """The data pipe of a stranger's SimpleBuffer: it never receives anything."""

    port_offset = 0

    def __init__(self) -> None:
        self._closed = threading.Event()

    def recv_tensor(self, timeout: float | None = None) -> None:
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
def test_control_channel_refuses_strangers_and_replays_then_serves_the_friend() -> None:
    seed, count = 81, 12
    port = procs.free_port()
    ctx = procs._CTX
    sync = {name: ctx.Event() for name in ("inserted", "stranger_done", "friend_done")}
    results = procs.new_queue()
    processes = [procs.start(buffer_side_with_secret, (rank, port, seed, count, sync), results, rank)
                 for rank in (0, 1)]
    verdicts: dict[str, Any] = {}
    try:
        assert sync["inserted"].wait(60), "the producer did not insert"
        target = buffer_bodies.make_request(seed, 0)
        tokens, roi = token_arrays(target[0], target[1])
        friend, guess, unsigned = ControlSigner(SECRET), ControlSigner("guess"), ControlSigner(None)
        body = encode_request(unsigned, 1001, tokens, roi, 500)
        signed_absent = encode_request(friend, 1002, *token_arrays(torch.tensor([-1]), torch.ones(1, dtype=torch.bool)),
                                       0)
        attempts = {
            "unsigned": body,
            "wrong secret": encode_request(guess, 1003, tokens, roi, 500),
            "tampered": body + signed_absent[-auth.TAG_BYTES:],
            "tag only": signed_absent[-auth.TAG_BYTES:],
            "truncated tag": encode_request(friend, 1004, tokens, roi, 500)[:-1],
        }
        one, one_roi = token_arrays(*buffer_bodies.make_request(seed, 1)[:2])
        captured = encode_request(friend, 1005, one, one_roi, 0)  # as the friend sent it (and a sniffer saw it)
        dealer = Prober(f"tcp://127.0.0.1:{port + 1}", SECRET)
        sock = dealer.dealer()
        try:
            for name, frame in attempts.items():
                verdicts[name] = _stranger_reply(_exchange(sock, frame))
            # The first use hits: the entry goes down the data pipe, to the friend (who drops it:
            # not its request), and the control channel stays silent. So the replay's answer is the
            # first to come back.
            sock.send(captured)
            verdicts["captured, replayed"] = _stranger_reply(_exchange(sock, captured))
            verdicts["after the replay"] = sock.poll(500)
        finally:
            dealer.close()
        verdicts["SimpleBuffer, wrong secret"] = _stranger_buffer_select(port, "guess", target)
        verdicts["SimpleBuffer, no secret"] = _stranger_buffer_select(port, None, target)
        sync["stranger_done"].set()
        outcomes = procs.collect(processes, results, timeout=90)
    finally:
        procs.reap(processes)
    for name in attempts:
        assert verdicts[name] == ("error", "authentication failed"), (name, verdicts)
    assert verdicts["captured, replayed"] == ("error", "replay refused"), verdicts
    assert verdicts["after the replay"] == 0, verdicts  # one answer for two requests: the hit had none
    assert verdicts["SimpleBuffer, wrong secret"].startswith("KVProtocolError"), verdicts
    assert "authentication failed" in verdicts["SimpleBuffer, wrong secret"], verdicts
    assert verdicts["SimpleBuffer, no secret"].startswith("KVProtocolError"), verdicts
    assert "kv_secret" in verdicts["SimpleBuffer, no secret"], verdicts
    producer, consumer = outcomes[0], outcomes[1]
    # The friend got every entry bit-exact, including the stranger's target and the replayer's target.
    assert consumer["hits"] == count and consumer["misses"] == 0, consumer
    assert producer["hits"] == count + 1 and producer["bad_messages"] >= len(attempts) + 3, producer


def _exchange(sock: zmq.Socket, frame: bytes) -> bytes:
    sock.send(frame)
    return sock.recv()


def _stranger_reply(frame: bytes) -> tuple[str, str]:
    """What a stranger reads in a reply (signed, so it checks no tag: it strips one)."""
    reply = decode_reply(ControlSigner(None), frame[: -auth.TAG_BYTES])
    gist = next((g for g in ("authentication failed", "replay refused") if g in reply.message), reply.message)
    return reply.status, gist

