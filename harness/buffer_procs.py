"""Bodies of the lookup buffer's two-process tests (imported by spawned children, so module level).

Each test runs :func:`run_side` in two processes: rank 0 is the producer, rank 1 the consumer.
Both sides build the same requests from a seed (:func:`make_request`), so the consumer checks
every selected entry bit for bit against what the producer inserted.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import zmq

from harness.tensors import random_tensor, same_bits
from kv_pipe import KVTransferConfig, TorchDistributedPipe
from kv_pipe.errors import KVBufferFullError, KVPipeClosedError, KVProtocolError, KVTransferError
from lookup_buffer import SimpleBuffer
from lookup_buffer.config import BufferConfig
from lookup_buffer.matching import token_arrays
from lookup_buffer.protocol import (
    MAX_REQUEST_BYTES,
    PROTOCOL_VERSION,
    SESSION_BYTES,
    ControlSigner,
    Refusal,
    SelectRequest,
    decode_refusal,
    encode_request,
    select_request,
)

#: Events shared by the two sides of one test (multiprocessing events, see new_sync in the test file).
SYNC_EVENTS = ("inserted", "stage", "stage2", "consumer_done")
BOUND = 30.0  # seconds any single wait in a body may take before the body fails


def config(rank: int, port: int, **changes: Any) -> KVTransferConfig:
    values: dict[str, Any] = dict(
        kv_role="kv_producer" if rank == 0 else "kv_consumer",
        kv_rank=rank,
        kv_port=port,
        kv_timeout=5,
        kv_connect_timeout=30,
    )
    values.update(changes)
    return KVTransferConfig(**values)


def run_side(rank: int, port: int, body: Callable[..., Any], changes: dict, sync: dict, *args: Any) -> dict:
    """Build this side's pipe and buffer, run ``body(buffer, sync, *args)``, report and close.

    The producer stays up until the consumer's body has finished (its ``consumer_done`` event).
    """
    kept = {name: value for name, value in changes.items() if name in BufferConfig.fields()}
    cfg = config(rank, port, **{name: value for name, value in changes.items() if name not in kept})
    buffer = SimpleBuffer(TorchDistributedPipe(cfg), cfg, buffer_config=BufferConfig(**kept))
    close_error = None
    try:
        result = body(buffer, sync, *args)
        if rank == 1:
            sync["consumer_done"].set()
        else:
            assert sync["consumer_done"].wait(BOUND), "the consumer did not finish"
        stats = dataclasses.asdict(buffer.stats())
    finally:
        try:
            buffer.close()
        except KVTransferError as exc:
            close_error = repr(exc)
    return {"result": result, "stats": stats, "close_error": close_error}


# ---------------------------------------------------------------- data


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64, torch.uint8, torch.int32)


def make_request(seed: int, index: int, small: bool = False) -> list[torch.Tensor | None]:
    """Request ``index`` of a test: unique selected tokens, random roi, KV of varied dtype and shape.

    ``small`` keeps every tensor tiny (for tests that move thousands of entries).
    """
    rng = random.Random(seed * 1_000_003 + index)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    length = rng.randint(1, 12 if small else 70)
    tokens = torch.randint(1, 1 << 40, (length,), generator=generator)
    roi = torch.rand(length, generator=generator) < rng.choice((0.5, 0.9, 1.0))
    first = rng.randrange(length)
    roi[first] = True
    tokens[first] = index  # the selected tokens differ between the requests of one test
    if rng.random() < 0.3:
        tokens = tokens.to(torch.int32) & 0x7FFFFFFF
    selected = int(roi.sum())
    dtype = _DTYPES[index % len(_DTYPES)]
    width = rng.choice((1, 3, 8) if small else (1, 5, 64, 130))
    key = random_tensor(generator, dtype, (2, selected, width))
    value = None if index % 5 == 1 else random_tensor(generator, dtype, (2, selected, width))
    hidden = None if index % 3 == 1 else random_tensor(generator, torch.float32, (selected, rng.randint(1, 9)))
    return [tokens, roi, key, value, hidden]


def check_entry(got: list, want: list, what: str) -> None:
    names = ("input_tokens", "roi", "key", "value", "hidden")
    for name, a, b in zip(names, got, want, strict=True):
        assert same_bits(a, b), f"{what}: {name} differs (got {a!r}, want {b!r})"


def insert(buffer: SimpleBuffer, request: list, timeout: float | None = BOUND) -> None:
    buffer.insert(*request, timeout=timeout)


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def wait_event(sync: dict, name: str) -> None:
    assert sync[name].wait(BOUND), f"event {name!r} was not set within {BOUND} s"


# ---------------------------------------------------------------- basic


def producer_basic(buffer: SimpleBuffer, sync: dict, seed: int, count: int) -> int:
    for index in range(count):
        insert(buffer, make_request(seed, index))
    return count


def consumer_basic(buffer: SimpleBuffer, sync: dict, seed: int, count: int) -> dict:
    order = list(range(count))[::-1]  # the newest first: not the insertion order
    for index in order:
        want = make_request(seed, index)
        query = want[0].to(torch.int64) if index % 2 else want[0]  # the token dtype plays no part
        got = buffer.drop_select(query, want[1], timeout=BOUND)
        check_entry(got, want, f"request {index}")
    first = make_request(seed, 0)
    again = buffer.drop_select(first[0], first[1])
    refused = {}
    for name, call in (
        ("insert on the consumer", lambda: buffer.insert(*first)),
        ("negative timeout", lambda: buffer.drop_select(first[0], first[1], timeout=-1)),
        ("float tokens", lambda: buffer.drop_select(first[0].float(), first[1])),
        ("roi selects nothing", lambda: buffer.drop_select(first[0], torch.zeros_like(first[1]))),
    ):
        try:
            call()
            refused[name] = "accepted"
        except KVTransferError as exc:
            refused[name] = type(exc).__name__
    return {"selected": len(order), "second_select": again, "refused": refused}


# ---------------------------------------------------------------- spans

_SPAN_DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.int8)


def span_request(seed: int, index: int) -> tuple[list[torch.Tensor | None], tuple[int, int, int]]:
    """Request ``index`` of a span test: paged-like blocks ``[layers, blocks, heads, block size,
    width]`` of random bits in an odd shape and one of several dtypes, and the span of blocks
    ``[start, stop)`` (along dimension 1) a consumer that holds the first ``start`` selects."""
    rng = random.Random(seed * 1_000_003 + index)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    blocks = rng.randint(2, 9)
    shape = (rng.choice((1, 3)), blocks, rng.choice((1, 2)), rng.choice((3, 5)), rng.choice((7, 16)))
    key = random_tensor(generator, _SPAN_DTYPES[index % len(_SPAN_DTYPES)], shape)
    tokens = torch.randint(1, 1 << 40, (blocks * shape[3],), generator=generator)
    tokens[0] = index  # the requests of one test differ
    start = rng.randrange(1, blocks)
    span = (1, start, rng.randint(start + 1, blocks))
    return [tokens, torch.ones(len(tokens), dtype=torch.bool), key, None, None], span


def producer_spans(buffer: SimpleBuffer, sync: dict, seed: int, count: int) -> int:
    for index in range(count):
        insert(buffer, span_request(seed, index)[0])
    return count


def consumer_spans(buffer: SimpleBuffer, sync: dict, seed: int, count: int) -> dict:
    """Select each entry's span, newest first, and check it bit for bit; the bytes received are
    counted (a select of a span that does not fit an entry is refused, and a whole select then
    takes the entry, which the refusal left)."""
    received = []
    for index in reversed(range(count)):
        request, span = span_request(seed, index)
        if index == 0:
            blocks = request[2].shape[1]
            try:
                buffer.drop_select(request[0], request[1], timeout=BOUND, span=(1, 1, blocks + 1))
                raise AssertionError("a span past the entry's end was accepted")
            except KVProtocolError as exc:
                refusal = str(exc)
            got = buffer.drop_select(request[0], request[1], timeout=BOUND)
            check_entry(got, request, "the entry a refused span left")
            received.append(sum(item.nbytes for item in got if item is not None))
            continue
        got = buffer.drop_select(request[0], request[1], timeout=BOUND, span=span)
        dim, start, stop = span
        want = [request[0], request[1], request[2].narrow(dim, start, stop - start), None, None]
        check_entry(got, want, f"span {span} of request {index}")
        received.append(sum(item.nbytes for item in got if item is not None))
    return {"received": received[::-1], "refusal": refusal}


def _raw_dealer(address: str) -> tuple[zmq.Context, zmq.Socket]:
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, int(BOUND * 1000))
    dealer.connect(address)
    return context, dealer


def _refusal_to(dealer: zmq.Socket, frame: bytes, signer: ControlSigner) -> Refusal:
    dealer.send(frame)
    return decode_refusal(signer, dealer.recv())


def consumer_with_stranger(buffer: SimpleBuffer, sync: dict, seed: int, count: int, address: str) -> dict:
    """A stranger (raw DEALER) tries to select; then the friend (this buffer) selects everything.

    The stranger reads refusals without checking their tag (it strips it): it cannot, without the secret.
    """
    from kv_pipe import auth

    secret = buffer.config.kv_secret
    tokens, roi = token_arrays(*make_request(seed, 0)[:2])
    guessed = select_request(1, tokens, roi, 2000, session=bytes(SESSION_BYTES), counter=1)
    attempts = {
        "unsigned": encode_request(ControlSigner(None), guessed),
        "wrong secret": encode_request(ControlSigner("guess"), guessed),
        "signed, guessed session": encode_request(ControlSigner(secret), guessed),
    }
    verdicts = {}
    context, dealer = _raw_dealer(address)
    try:
        for what, frame in attempts.items():
            dealer.send(frame)
            refusal = decode_refusal(ControlSigner(None), dealer.recv()[: -auth.TAG_BYTES])
            verdicts[what] = refusal.reason
    finally:
        dealer.close(linger=0)
        context.term()
    for index in range(count):
        want = make_request(seed, index)
        check_entry(buffer.drop_select(want[0], want[1], timeout=BOUND), want, f"request {index}")
    return {"stranger": verdicts, "selected": count}


# ---------------------------------------------------------------- freshness: captured selects replayed


def other_copy(seed: int, index: int) -> list:
    """Entry ``index``'s tokens and roi with other KV: a second entry a replayed select could take."""
    request = make_request(seed, index)
    request[2] = random_tensor(torch.Generator().manual_seed(seed + index), torch.float16, (5, 3))
    return request


def producer_with_copies(buffer: SimpleBuffer, sync: dict, seed: int, count: int) -> dict:
    """Entries 0 .. count-1, and entry 0 twice (first in, first out)."""
    for index in range(count):
        insert(buffer, make_request(seed, index))
    insert(buffer, other_copy(seed, 0))
    sync["inserted"].set()
    wait_event(sync, "consumer_done")
    return dataclasses.asdict(buffer.stats())


def consumer_captures_and_replays(
    buffer: SimpleBuffer, sync: dict, seed: int, count: int, address: str, old_frames: list[bytes], later: int
) -> dict:
    """Record every select frame this buffer sends, as a sniffer would. Replay ``old_frames`` (captured
    from an earlier producer) first; then take entry 0 and replay its select at once and after
    ``later`` more selects; then take every entry, entry 0's second copy included, bit for bit.
    Returns the refusals' reasons and the frames captured."""
    from lookup_buffer import consumer

    captured: list[bytes] = []
    original = consumer.encode_request

    def recording(signer: ControlSigner, request: SelectRequest) -> bytes:
        captured.append(original(signer, request))
        return captured[-1]

    consumer.encode_request = recording
    wait_event(sync, "inserted")
    signer = ControlSigner(buffer.config.kv_secret)  # the replayer holds the secret: it can read refusals
    context, dealer = _raw_dealer(address)
    verdicts: dict[str, Any] = {}
    try:
        verdicts["from an earlier producer"] = [_refusal_to(dealer, frame, signer).reason for frame in old_frames]
        first = make_request(seed, 0)
        check_entry(buffer.drop_select(first[0], first[1], timeout=BOUND), first, "entry 0")
        hit_frame = captured[-1]
        verdicts["at once"] = _refusal_to(dealer, hit_frame, signer).reason
        for index in range(later):
            assert buffer.drop_select(*_absent(index)) == [None] * 5
        verdicts["later"] = _refusal_to(dealer, hit_frame, signer).reason
        verdicts["a miss's, later"] = _refusal_to(dealer, captured[-later], signer).reason
    finally:
        dealer.close(linger=0)
        context.term()
    for index in range(count):
        want = other_copy(seed, 0) if index == 0 else make_request(seed, index)
        check_entry(buffer.drop_select(want[0], want[1], timeout=BOUND), want, f"request {index}")
    return {"verdicts": verdicts, "captured": [hit_frame, captured[-1]]}


# ---------------------------------------------------------------- backpressure


def producer_shuffled(buffer: SimpleBuffer, sync: dict, seed: int, count: int, small: bool) -> int:
    order = list(range(count))
    random.Random(seed).shuffle(order)
    for index in order:
        insert(buffer, make_request(seed, index, small))
    return count


def consumer_threads(
    buffer: SimpleBuffer, sync: dict, seed: int, count: int, small: bool, threads: int, wait: float
) -> dict:
    """``threads`` threads select every request in another random order; a miss goes back in the queue."""
    order = list(range(count))
    random.Random(seed + 1).shuffle(order)
    work: queue.Queue[int] = queue.Queue()
    for index in order:
        work.put(index)
    done: list[int] = []
    misses: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        try:
            while True:
                with lock:
                    if len(done) == count:
                        return
                try:
                    index = work.get(timeout=0.05)
                except queue.Empty:
                    continue
                want = make_request(seed, index, small)
                got = buffer.drop_select(want[0], want[1], timeout=wait)
                if got[0] is None:
                    assert got == [None] * 5
                    with lock:
                        misses.append(index)
                    work.put(index)
                    continue
                check_entry(got, want, f"request {index}")
                with lock:
                    done.append(index)
        except BaseException as exc:  # reported by the main thread
            errors.append(repr(exc))
            with lock:
                done.extend([-1] * count)  # stop the other workers

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(4 * BOUND)
    assert not any(thread.is_alive() for thread in workers), "a consumer thread hung"
    assert not errors, errors
    return {"selected": sorted(done), "misses": len(misses)}


# ---------------------------------------------------------------- matching rules


def _tokens(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _ones(length: int) -> torch.Tensor:
    return torch.ones(length, dtype=torch.bool)


def _marker(value: float) -> torch.Tensor:
    return torch.full((3, 5), value, dtype=torch.float32)


LONG = (11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22)
DUPLICATE = (7, 7, 7, 8)
MASKED = (31, 32, 33, 34, 35, 36, 37, 38, 39, 40)
MASK = (True, True, True, True, True, True, False, False, False, False)


def producer_matching(buffer: SimpleBuffer, sync: dict) -> int:
    buffer.insert(_tokens(*LONG), _ones(12), _marker(1.0), None, None)  # the long entry
    buffer.insert(_tokens(*LONG[:6]), _ones(6), _marker(2.0), None, None)  # a prefix of it
    for copy in range(3):
        buffer.insert(_tokens(*DUPLICATE), _ones(4), _marker(10.0 + copy), _marker(20.0 + copy), None)
    for copy in range(2):  # KV for positions 0..5 only
        buffer.insert(_tokens(*MASKED), torch.tensor(MASK), _marker(30.0 + copy), None, _marker(40.0 + copy))
    sync["inserted"].set()
    return 7


def consumer_matching(buffer: SimpleBuffer, sync: dict) -> dict:
    wait_event(sync, "inserted")
    outcome: dict[str, Any] = {}

    def key_of(tokens: torch.Tensor, roi: torch.Tensor) -> float | None:
        got = buffer.drop_select(tokens, roi)
        return None if got[2] is None else float(got[2][0, 0])

    outcome["shorter_prefix"] = key_of(_tokens(*LONG[:4]), _ones(4))  # prefix of both entries
    outcome["longer"] = key_of(_tokens(*LONG, 23), _ones(13))  # extends the long entry
    outcome["prefix"] = key_of(_tokens(*LONG[:6]), _ones(6))
    outcome["prefix_again"] = key_of(_tokens(*LONG[:6]), _ones(6))  # must not take the long one
    outcome["long"] = key_of(_tokens(*LONG), _ones(12))
    outcome["duplicates"] = [key_of(_tokens(*DUPLICATE), _ones(4)) for _ in range(4)]
    other_mask = torch.tensor(MASK)
    other_mask[5] = False
    outcome["other_roi"] = key_of(_tokens(*MASKED), other_mask)
    outside = _tokens(*MASKED[:6], 99, 98, 97, 96)  # differs only where the roi is False
    got = buffer.drop_select(outside, torch.tensor(MASK))
    check_entry(got, [_tokens(*MASKED), torch.tensor(MASK), _marker(30.0), None, _marker(40.0)], "masked entry")
    outcome["outside_roi_differs"] = float(got[2][0, 0])
    outcome["same_positions_shorter_query"] = key_of(_tokens(*MASKED[:6]), _ones(6))
    return outcome


# ---------------------------------------------------------------- miss, then hit


KEY_TOKENS = (5, 4, 3, 2, 1)


def producer_late(buffer: SimpleBuffer, sync: dict) -> dict:
    wait_event(sync, "stage")  # the consumer has missed twice and now waits
    wait_until(lambda: buffer.stats().pending == 1, "the consumer's select is parked")
    buffer.insert(_tokens(*KEY_TOKENS), _ones(5), _marker(3.5), _marker(4.5), None)
    wait_until(lambda: buffer.stats().hits == 1, "the parked select is served")
    return buffer.stats().pending


def consumer_late(buffer: SimpleBuffer, sync: dict) -> dict:
    query = (_tokens(*KEY_TOKENS), _ones(5))
    timed_out = buffer.drop_select(*query, timeout=0.2)
    immediate = buffer.drop_select(*query)
    sync["stage"].set()
    got = buffer.drop_select(*query, timeout=BOUND)
    check_entry(got, [query[0], query[1], _marker(3.5), _marker(4.5), None], "late entry")
    return {"timed_out": timed_out, "immediate": immediate}


# ---------------------------------------------------------------- routing

# One thread of the consumer reads every outcome off the data pipe and hands it to the select of its
# request id. These bodies keep one select waiting for a late insert while other selects come and
# go (hits and misses, from several threads at once): the waiting one must get its own entry at the
# end, the others theirs meanwhile.
PARKED, ROUTED = (63, 3), (64, 4)
PASSING = 24  # selects that come and go while PARKED waits: half hit, half miss


def _passing_request(index: int) -> list:
    generator = torch.Generator().manual_seed(1000 + index)
    tokens = _tokens(70, index)
    return [
        tokens,
        _ones(2),
        random_tensor(generator, torch.float32, (3, 40 + index)),
        None,
        random_tensor(generator, torch.bfloat16, (index + 1,)),
    ]


def _in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list]:
    """Run ``target`` in a thread; the list gets ("ok", result) or ("error", repr)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(("ok", target()))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outcome.append(("error", repr(exc)))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _joined(thread: threading.Thread, outcome: list, what: str) -> Any:
    thread.join(BOUND)
    assert not thread.is_alive(), f"{what} did not return within {BOUND} s"
    status, value = outcome[0]
    assert status == "ok", f"{what} failed: {value}"
    return value


def producer_serves_around_a_waiter(buffer: SimpleBuffer, sync: dict) -> dict:
    wait_until(lambda: buffer.stats().pending == 1, "the consumer's first select is parked")
    sync["stage"].set()
    for index in range(0, PASSING, 2):  # the even ones hit; the consumer selects them as they come
        buffer.insert(*_passing_request(index))
    wait_event(sync, "stage2")  # every passing select returned
    pending_meanwhile = buffer.stats().pending
    buffer.insert(_tokens(*PARKED), _ones(2), _marker(4.5), None, _marker(5.5))
    wait_until(lambda: buffer.stats().hits == PASSING // 2 + 1, "the parked select was served")
    return {"pending_meanwhile": pending_meanwhile, "stats": dataclasses.asdict(buffer.stats())}


def consumer_serves_around_a_waiter(buffer: SimpleBuffer, sync: dict) -> dict:
    parked, parked_outcome = _in_thread(lambda: buffer.drop_select(_tokens(*PARKED), _ones(2), timeout=3 * BOUND))
    wait_event(sync, "stage")

    def passing(index: int) -> Callable[[], str]:
        def select() -> str:
            want = _passing_request(index)
            got = buffer.drop_select(want[0], want[1], timeout=BOUND if index % 2 == 0 else 0)
            if index % 2:
                assert got == [None] * 5, f"passing select {index} should miss"
                return "miss"
            check_entry(got, want, f"passing select {index}")
            return "hit"

        return select

    passers = [_in_thread(passing(index)) for index in range(PASSING)]
    verdicts = [_joined(thread, outcome, f"passing select {index}") for index, (thread, outcome) in enumerate(passers)]
    still_waiting = parked.is_alive()
    sync["stage2"].set()
    got = _joined(parked, parked_outcome, "the parked select")
    check_entry(got, [_tokens(*PARKED), _ones(2), _marker(4.5), None, _marker(5.5)], "parked")
    return {"verdicts": verdicts, "still_waiting": still_waiting}


# ---------------------------------------------------------------- short-lived calling threads


def _absent(index: int) -> list:
    return [_tokens(-1, -index - 1), _ones(2)]


def producer_small_entries(buffer: SimpleBuffer, sync: dict, seed: int, count: int) -> int:
    for index in range(count):
        insert(buffer, make_request(seed, index, small=True))
    sync["inserted"].set()
    return count


def consumer_many_short_threads(buffer: SimpleBuffer, sync: dict, seed: int, count: int, wave: int) -> dict:
    """``2 * count`` threads, ``wave`` at a time, each doing one drop_select and ending: even ones
    hit (entry i // 2, checked bit for bit), odd ones miss. Counts this process's open descriptors
    and threads before and after."""
    wait_event(sync, "inserted")
    assert buffer.drop_select(*_absent(-2)) == [None] * 5  # whatever is built at the first select is built
    fds_before, threads_before = len(os.listdir("/proc/self/fd")), threading.active_count()
    results: dict[int, str] = {}

    def one(index: int) -> None:
        if index % 2:
            got = buffer.drop_select(*_absent(index))
            results[index] = "miss" if got == [None] * 5 else f"unexpected {got!r}"
        else:
            want = make_request(seed, index // 2, small=True)
            check_entry(buffer.drop_select(want[0], want[1]), want, f"request {index // 2}")
            results[index] = "hit"

    for first in range(0, 2 * count, wave):
        threads = [_in_thread(lambda index=index: one(index)) for index in range(first, min(first + wave, 2 * count))]
        for index, (thread, outcome) in enumerate(threads, start=first):
            _joined(thread, outcome, f"select {index}")
    return {
        "fds": (fds_before, len(os.listdir("/proc/self/fd"))),
        "threads": (threads_before, threading.active_count()),
        "hits": sum(verdict == "hit" for verdict in results.values()),
        "misses": sum(verdict == "miss" for verdict in results.values()),
    }


def producer_busy(buffer: SimpleBuffer, sync: dict) -> dict:
    from lookup_buffer import producer

    producer.MAX_WAITING_SELECTS = 1  # read per select: one parked select fills the producer
    sync["stage"].set()
    wait_until(lambda: buffer.stats().pending == 1, "a select is parked")
    sync["stage2"].set()
    wait_event(sync, "inserted")  # the consumer's second select was refused
    buffer.insert(_tokens(*PARKED), _ones(2), _marker(6.5), None, None)
    wait_until(lambda: buffer.stats().hits == 1, "the parked select was served")
    return dataclasses.asdict(buffer.stats())


def consumer_busy(buffer: SimpleBuffer, sync: dict) -> dict:
    wait_event(sync, "stage")
    leader, led = _in_thread(lambda: buffer.drop_select(_tokens(*PARKED), _ones(2), timeout=BOUND))
    wait_event(sync, "stage2")
    try:
        buffer.drop_select(_tokens(*ROUTED), _ones(2), timeout=BOUND)
        refused = "not refused"
    except KVTransferError as exc:
        refused = f"{type(exc).__name__}: {exc}"
    sync["inserted"].set()
    parked = _joined(leader, led, "the parked select")
    check_entry(parked, [_tokens(*PARKED), _ones(2), _marker(6.5), None, None], "parked")
    return {"refused": refused}


# ---------------------------------------------------------------- oversize and full

SMALL_BUDGET = 256 << 10
CHUNK = 60 << 10


def _chunk_request(index: int) -> list:
    generator = torch.Generator().manual_seed(index)
    return [_tokens(index + 1, 2, 3), _ones(3), random_tensor(generator, torch.uint8, (CHUNK,)), None, None]


def producer_full(buffer: SimpleBuffer, sync: dict) -> dict:
    outcome: dict[str, Any] = {}
    generator = torch.Generator().manual_seed(0)
    huge = random_tensor(generator, torch.uint8, (SMALL_BUDGET + 1,))
    try:  # at once, although the wait allowed is long
        buffer.insert(_tokens(1000), _ones(1), huge, None, None, timeout=3000)
    except KVBufferFullError as exc:
        outcome["oversize"] = str(exc)
    for index in range(4):
        buffer.insert(*_chunk_request(index), timeout=1)
    try:
        buffer.insert(*_chunk_request(4), timeout=0.3)
    except KVBufferFullError as exc:
        outcome["full"] = str(exc)
    outcome["stats"] = dataclasses.asdict(buffer.stats())
    sync["inserted"].set()
    return outcome


def consumer_full(buffer: SimpleBuffer, sync: dict) -> dict:
    wait_event(sync, "inserted")
    hits = []
    for index in range(4):
        want = _chunk_request(index)
        got = buffer.drop_select(want[0], want[1])
        check_entry(got, want, f"chunk {index}")
        hits.append(index)
    rejected = _chunk_request(4)
    return {
        "hits": hits,
        "rejected": buffer.drop_select(rejected[0], rejected[1]),
        "oversize": buffer.drop_select(_tokens(1000), _ones(1)),
    }


# ---------------------------------------------------------------- hostile control traffic


def producer_trickle(buffer: SimpleBuffer, sync: dict, seed: int, count: int) -> int:
    for index in range(count):
        insert(buffer, make_request(seed, index))
        time.sleep(0.002)  # spread the real traffic over the attack
    return count


def _junk_frames(rng: random.Random) -> list[tuple[str, list[bytes], str]]:
    """Junk for the control port: (name, frames, the reason the producer must refuse it for)."""
    tokens = _tokens(1, 2, 3).numpy()
    roi = _ones(3).numpy()
    session = bytes(SESSION_BYTES)  # never the producer's: it draws its session at random
    valid = encode_request(ControlSigner(None), select_request(77, tokens, roi, 0, session=session, counter=1))
    good = dict(
        type="select",
        v=PROTOCOL_VERSION,
        request_id=5,
        session=session,
        counter=1,
        tokens=tokens.tobytes(),
        roi=roi.tobytes(),
        wait_ms=0,
    )

    def variant(**changes: Any) -> list[bytes]:
        fields = dict(good, **changes)
        return [msgspec.msgpack.encode({k: v for k, v in fields.items() if v is not _DROP})]

    malformed = [
        ("empty", [b""]),
        *[(f"random {n}", [rng.randbytes(n)]) for n in (1, 7, 64, 1000)],
        *[(f"truncated {n}", [valid[:n]]) for n in (1, len(valid) // 2, len(valid) - 1)],
        ("msgpack nil", [msgspec.msgpack.encode(None)]),
        ("msgpack array", [msgspec.msgpack.encode([1, 2, 3])]),
        ("string version", variant(v="1")),
        ("no version", variant(v=_DROP)),
        ("string request id", variant(request_id="x")),
        ("negative request id", variant(request_id=-1)),
        ("short session", variant(session=session[:-1])),
        ("no session", variant(session=_DROP)),
        ("counter 0", variant(counter=0)),
        ("counter 2**63", variant(counter=2**63)),
        ("tokens as list", variant(tokens=[1, 2, 3])),
        ("7 token bytes", variant(tokens=b"\x01" * 7, roi=b"\x01")),
        ("roi too short", variant(roi=b"\x01\x01")),
        ("roi byte 2", variant(roi=b"\x01\x02\x01")),
        ("roi selects nothing", variant(roi=b"\x00\x00\x00")),
        ("no tokens", variant(tokens=b"", roi=b"")),
        ("negative wait", variant(wait_ms=-5)),
        ("huge wait", variant(wait_ms=10**12)),
        ("refusal type", variant(type="refusal")),
        ("unknown type", variant(type="drop_everything")),
        ("no type", variant(type=_DROP)),
        ("multipart", [b"junk", valid, b"more"]),
        ("two valid frames", [valid, valid]),
    ]
    return [
        *[(name, frames, "malformed") for name, frames in malformed],
        ("unknown version", variant(v=PROTOCOL_VERSION + 98), "version"),
        ("huge version", [msgspec.msgpack.encode({"v": 2**64 - 1})], "version"),
        ("foreign session", [valid], "stale"),
    ]


_DROP = object()


def _attack(address: str, rounds: int, stop: threading.Event) -> dict:
    """Send every kind of junk to the producer's control port; collect the answers."""
    rng = random.Random(3)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    silent = None  # a half-open peer, kept open; made once the producer has answered (so it listens)
    sent = sent_during_traffic = answered = 0
    wrong = []  # (name, reason) of refusals for another reason than expected
    version_refusal = None
    try:
        for round_ in range(rounds):
            for name, frames, reason in _junk_frames(rng):
                dealer.send_multipart(frames)
                sent += 1
                sent_during_traffic += not stop.is_set()
                assert dealer.poll(int(BOUND * 1000)), f"no answer to {name!r}"
                refusal = decode_refusal(ControlSigner(None), dealer.recv())
                answered += 1
                if refusal.reason != reason:
                    wrong.append((name, refusal.reason))
                if name == "unknown version":
                    version_refusal = (refusal.request_id, refusal.message)
                if silent is None:
                    silent = socket.create_connection((host, int(port)), timeout=BOUND)
            # Junk below the message layer: no answer expected, the producer must shrug it off.
            req = context.socket(zmq.REQ)
            req.setsockopt(zmq.LINGER, 0)
            req.connect(address)
            req.send(b"req junk")
            sent += 1
            req.close()
            with socket.create_connection((host, int(port)), timeout=BOUND) as raw:
                raw.sendall(rng.randbytes(4096))  # not even ZMTP
            if round_ == 0:
                oversize = context.socket(zmq.DEALER)
                oversize.setsockopt(zmq.LINGER, 0)
                oversize.connect(address)
                oversize.send(b"\0" * (MAX_REQUEST_BYTES + 1))  # ZeroMQ drops the connection
                oversize.close()
            if stop.is_set() and round_ > 0:
                break
    finally:
        if silent is not None:
            silent.close()
        dealer.close()
        context.term()
    return {
        "sent_during_traffic": sent_during_traffic,
        "answered": answered,
        "wrong": wrong,
        "version_refusal": version_refusal,
    }


def consumer_under_attack(buffer: SimpleBuffer, sync: dict, seed: int, count: int, address: str) -> dict:
    stop = threading.Event()
    attack: dict[str, Any] = {}

    def attacker() -> None:
        try:
            attack.update(_attack(address, rounds=50, stop=stop))
        except BaseException as exc:  # reported below
            attack["error"] = repr(exc)

    thread = threading.Thread(target=attacker)
    thread.start()
    try:
        for index in random.Random(seed).sample(range(count), count):
            want = make_request(seed, index)
            got = buffer.drop_select(want[0], want[1], timeout=BOUND)
            check_entry(got, want, f"request {index}")
    finally:
        stop.set()
        thread.join(4 * BOUND)
    assert not thread.is_alive(), "the attacker hung"
    assert "error" not in attack, attack.get("error")
    return attack


# ---------------------------------------------------------------- failures


def _announce_parked(buffer: SimpleBuffer, sync: dict) -> None:
    wait_until(lambda: buffer.stats().pending == 1, "the consumer's select is parked")
    sync["stage"].set()


def producer_parks_then_sleeps(buffer: SimpleBuffer, sync: dict) -> str:
    """Announce the consumer's parked select, then sleep until the test kills this process.

    It must not be killed inside a multiprocessing wait: the consumer's Event.set() would then
    wait forever for the dead waiter to wake.
    """
    _announce_parked(buffer, sync)
    time.sleep(4 * BOUND)
    return "not killed"


def consumer_waits_for_death(buffer: SimpleBuffer, sync: dict) -> dict:
    outcome: dict[str, Any] = {}
    start = time.monotonic()
    try:
        got = buffer.drop_select(_tokens(1, 2), _ones(2), timeout=3 * BOUND)
        outcome["first"] = f"returned {got!r}"
    except KVTransferError as exc:
        outcome["first"] = type(exc).__name__
        outcome["first_message"] = str(exc)
    outcome["seconds"] = time.monotonic() - start
    try:
        got = buffer.drop_select(_tokens(1, 2), _ones(2))
        outcome["second"] = f"returned {got!r}"
    except KVTransferError as exc:
        outcome["second"] = type(exc).__name__
    try:
        buffer.close()
        outcome["close"] = "ok"
    except KVTransferError as exc:
        outcome["close"] = type(exc).__name__
    return outcome


def producer_sleeps(buffer: SimpleBuffer, sync: dict) -> str:
    time.sleep(4 * BOUND)  # until the test kills this process (not inside a multiprocessing wait)
    return "not killed"


def consumer_idle_while_producer_dies(buffer: SimpleBuffer, sync: dict) -> dict:
    sync["stage"].set()  # idle: no select running
    wait_event(sync, "stage2")  # the producer is dead
    time.sleep(1.0)  # a closed connection is seen at once; the pipe's own thread takes it in
    outcome: dict[str, Any] = {"pending": buffer.stats().pending}
    try:
        buffer.close()
        outcome["close"] = "ok"
    except KVTransferError as exc:
        outcome["close"] = type(exc).__name__
    try:
        buffer.drop_select(_tokens(1, 2), _ones(2))
        outcome["after_close"] = "returned"
    except KVTransferError as exc:
        outcome["after_close"] = type(exc).__name__
    return outcome


def consumer_closes_while_waiting(buffer: SimpleBuffer, sync: dict) -> dict:
    outcome: dict[str, Any] = {}

    def waiter() -> None:
        try:
            got = buffer.drop_select(_tokens(9, 9), _ones(2), timeout=3 * BOUND)
            outcome["waiter"] = f"returned {got!r}"
        except KVTransferError as exc:
            outcome["waiter"] = type(exc).__name__

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_event(sync, "stage")  # the producer has the select parked
    buffer.close()
    thread.join(BOUND)
    outcome["waiter_hung"] = thread.is_alive()
    try:
        buffer.drop_select(_tokens(9, 9), _ones(2))
        outcome["after_close"] = "returned"
    except KVPipeClosedError:
        outcome["after_close"] = "KVPipeClosedError"
    sync["inserted"].set()  # tell the producer this side is closed
    return outcome


def producer_sees_consumer_close(buffer: SimpleBuffer, sync: dict) -> dict:
    _announce_parked(buffer, sync)
    wait_event(sync, "inserted")
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        try:
            buffer.insert(_tokens(1), _ones(1), _marker(1.0), None, None)
        except KVTransferError as exc:
            return {"insert": type(exc).__name__, "message": str(exc)}
        time.sleep(0.01)
    return {"insert": "never failed"}


def producer_closes_under_waiters(buffer: SimpleBuffer, sync: dict) -> dict:
    """Close while an insert is blocked on a full buffer and a consumer's select is parked."""
    generator = torch.Generator().manual_seed(1)
    buffer.insert(_tokens(1), _ones(1), random_tensor(generator, torch.uint8, (SMALL_BUDGET - 1024,)), None, None)
    wait_until(lambda: buffer.stats().pending == 1, "the consumer's select is parked")
    outcome: dict[str, Any] = {}

    def blocked_insert() -> None:
        try:
            buffer.insert(
                _tokens(2), _ones(1), random_tensor(generator, torch.uint8, (4096,)), None, None, timeout=3 * BOUND
            )
            outcome["insert"] = "stored"
        except KVTransferError as exc:
            outcome["insert"] = type(exc).__name__

    thread = threading.Thread(target=blocked_insert)
    thread.start()
    wait_until(lambda: buffer.stats().inserts_blocked == 1, "the insert blocks on the full buffer")
    buffer.close()
    thread.join(BOUND)
    outcome["insert_hung"] = thread.is_alive()
    return outcome


def consumer_sees_producer_close(buffer: SimpleBuffer, sync: dict) -> dict:
    try:
        got = buffer.drop_select(_tokens(3, 3), _ones(2), timeout=3 * BOUND)
        return {"select": f"returned {got!r}"}
    except KVTransferError as exc:
        return {"select": type(exc).__name__, "message": str(exc)}
