"""Entries lent where they lie: the consumer copies the producer's exported memory itself.

Two-process tests run the lookup buffer's own harness (harness/buffer_procs.py): rank 0 lends the
requests of :func:`make_request` from scattered pieces of an exported arena, rank 1 selects them,
borrowing or not, and checks every byte.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from harness import buffer_procs as bodies
from harness import procs
from harness.tensors import random_tensor, same_bits
from kv_pipe.errors import KVProtocolError
from kv_pipe.exported_memory import ExportDescriptor, export_host_memory, page_aligned_empty
from kv_pipe.parallel_copy import copy_pieces
from lookup_buffer import SimpleBuffer
from lookup_buffer.errors import KVEntryTakenBackError
from lookup_buffer.loans import SENT, TAKEN_BACK, BorrowedTensor, Borrowing, LentTensor, Loan, LoanTable, release_all
from lookup_buffer.protocol import make_loan_descriptor, make_release, parse_loan_descriptor

ARENA_BYTES = 8 << 20

# ---------------------------------------------------------------- in one process


def _split(rng: random.Random, start: int, nbytes: int, most: int = 5) -> list[tuple[int, int]]:
    """``[start, start + nbytes)`` cut into up to ``most`` consecutive pieces (some may be empty)."""
    cuts = sorted(rng.randint(0, nbytes) for _ in range(rng.randint(0, most - 1)))
    bounds = [0, *cuts, nbytes]
    return [(start + low, high - low) for low, high in zip(bounds, bounds[1:], strict=False)]


def test_copy_pieces_joins_and_splits_bit_exactly():
    rng = random.Random(4)
    for nbytes in (0, 1, 4095, 1 << 20, (5 << 20) + 3):
        source = random_tensor(torch.Generator().manual_seed(nbytes), torch.uint8, (nbytes,))
        target = torch.zeros(nbytes, dtype=torch.uint8)
        copy_pieces(_split(rng, target.data_ptr(), nbytes, 40), _split(rng, source.data_ptr(), nbytes, 40))
        assert torch.equal(target, source)
    with pytest.raises(ValueError):
        copy_pieces([(target.data_ptr(), 8)], [(source.data_ptr(), 9)])


def test_a_lent_tensor_lies_in_exports_or_is_not_made():
    first, second = (page_aligned_empty((1 << 16,), torch.float32) for _ in range(2))
    for memory in (first, second):
        memory.copy_(torch.rand(memory.shape))
    exports = [export_host_memory(memory) for memory in (first, second)]
    outside = torch.rand(1 << 16)  # never exported
    both = [(first.data_ptr() + 4096, 8192), (second.data_ptr(), 4096), (first.data_ptr(), 4096)]
    lent = LentTensor.over((4, 1024), torch.float32, both)
    assert lent is not None and len(lent.exports) == 2
    # Each piece names its export (in whatever order the exports lie in memory) and its offset there.
    assert [lent.exports[index] for index, _ in lent.places] == [exports[0], exports[1], exports[0]]
    assert [int(offset) for _, offset in lent.places] == [4096, 0, 0]
    assert LentTensor.over((1024,), torch.float32, [(outside.data_ptr(), 4096)]) is None
    # Across the end of the export (which may reach a page past the tensor: it holds the storage's whole pages).
    past_the_end = [(exports[0].address + exports[0].nbytes - 2048, 4096)]
    assert LentTensor.over((1024,), torch.float32, past_the_end) is None
    with pytest.raises(ValueError):
        LentTensor.over((1025,), torch.float32, both[:1])
    materialized = lent.materialize(lambda shape, dtype: torch.empty(shape, dtype=dtype))
    assert same_bits(materialized.reshape(-1), torch.cat([first[1024:3072], second[:1024], first[:1024]]))


def test_a_borrower_sees_a_loan_taken_back_by_its_stamp():
    table = LoanTable(slots=2)
    given_back = []
    taken = [table.take(), table.take()]
    assert None not in taken and table.take() is None  # two slots: a third loan is copied instead
    for (slot, stamp), cleared in zip(taken, (False, True), strict=True):
        borrowing = Borrowing(table.words.data_ptr() + 8 * slot, stamp, lambda: given_back.append(1), None)
        if cleared:
            table.clear(slot)  # the producer took it back before the borrower looked
            with pytest.raises(KVEntryTakenBackError, match="took back"):
                borrowing.release()
        else:
            borrowing.release()
        borrowing.release()
        borrowing.forget()
    assert given_back == [1, 1]  # each entry given back exactly once
    assert table.take() is not None  # the cleared slot is free again


def test_loan_descriptors_round_trip_and_refuse_every_inconsistency():
    exports = [ExportDescriptor(7, 1234, 1 << 20), ExportDescriptor(9, 99, 4096)]
    places, sizes = np.array([(0, 4096), (1, 0), (0, 0)]), np.array([2048, 0, 4096])
    words = make_loan_descriptor(exports, (3, 1024), torch.bfloat16, places, sizes, (1, 8, 77))
    parsed = parse_loan_descriptor(torch.from_numpy(words))
    assert parsed.exports == exports and parsed.shape == (3, 1024) and parsed.dtype == torch.bfloat16
    assert parsed.pieces.tolist() == [[0, 4096, 2048], [1, 0, 0], [0, 0, 4096]] and parsed.stamp == (1, 8, 77)

    def changed(index: int, value: int) -> torch.Tensor:
        bad = words.copy()
        bad[index] = value
        return torch.from_numpy(bad)

    at_pieces = len(words) - 9
    for bad in [
        changed(0, 1),
        changed(1, 999),
        changed(2, -1),
        changed(2, 49),
        changed(3, -3),
        changed(5, 3),
        changed(6, -1),
        changed(8, 0),
        changed(12, 2),
        changed(13, -8),
        changed(at_pieces - 1, 4),
        changed(at_pieces, 2),
        changed(at_pieces + 1, -4096),
        changed(at_pieces + 2, 2049),
        changed(at_pieces + 1, (1 << 20) - 1024),
        changed(13, 4092),  # a piece, the stamp past the end
        changed(at_pieces + 2, 1 << 62),
        changed(at_pieces + 5, -1),
        torch.from_numpy(words[:-1]),
        torch.from_numpy(words[:5]),
        torch.from_numpy(words.astype(np.int32)),
        torch.from_numpy(words).reshape(1, -1),
    ]:
        with pytest.raises(KVProtocolError):
            parse_loan_descriptor(bad)


# ---------------------------------------------------------------- bodies run in the child processes


def _arena(seed: int) -> torch.Tensor:
    """An exported arena of random bytes, the same on both sides for one seed."""
    arena = page_aligned_empty((ARENA_BYTES,), torch.uint8)
    arena.copy_(random_tensor(torch.Generator().manual_seed(seed), torch.uint8, (ARENA_BYTES,)))
    return arena


def _lend_plan(seed: int, count: int) -> list[list[bool]]:
    """Which of key, value and hidden each request lends."""
    rng = random.Random(seed)
    return [[rng.random() < 0.7 for _ in range(3)] for _ in range(count)]


def _scattered(rng: random.Random, arena: torch.Tensor, used: list[int], tensor: torch.Tensor) -> LentTensor:
    """``tensor``'s bytes written into the arena in pieces at scattered places, and lent from there."""
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    pieces = []
    for _, nbytes in _split(rng, 0, flat.numel()):
        start = used[0] + rng.randint(0, 64)  # a gap: pieces are not back to back
        used[0] = start + nbytes
        assert used[0] <= ARENA_BYTES
        pieces.append((arena.data_ptr() + start, nbytes))
    rng.shuffle(pieces)  # not in address order either
    copy_pieces(pieces, [(flat.data_ptr(), flat.numel())])
    lent = LentTensor.over(tensor.shape, tensor.dtype, pieces)
    assert lent is not None
    return lent


def producer_lends(buffer: SimpleBuffer, sync: dict, seed: int, count: int) -> list[str | None]:
    arena = _arena(seed)
    export_host_memory(arena)
    rng = random.Random(seed)
    used = [0]
    loans = []
    for index, lends in enumerate(_lend_plan(seed, count)):
        tokens, roi, *items = bodies.make_request(seed, index)
        items = [
            _scattered(rng, arena, used, item) if lend and item is not None else item
            for item, lend in zip(items, lends, strict=True)
        ]
        loans.append(buffer.insert(tokens, roi, *items, timeout=bodies.BOUND))
    return [None if loan is None else loan.wait(bodies.BOUND) for loan in loans]


def consumer_borrows(buffer: SimpleBuffer, sync: dict, seed: int, count: int, borrow_every: int) -> dict:
    """Select every request in a shuffled order, borrowing every ``borrow_every``-th (0: none)."""
    order = list(range(count))
    random.Random(seed + 1).shuffle(order)
    kinds: dict[str, int] = {}
    for position, index in enumerate(order):
        borrow = borrow_every > 0 and position % borrow_every == 0
        want = bodies.make_request(seed, index)
        got = buffer.drop_select(want[0], want[1], timeout=bodies.BOUND, borrow=borrow)
        for item in got[2:]:
            kind = type(item).__name__
            kinds[kind] = kinds.get(kind, 0) + 1
        if isinstance(got[2], BorrowedTensor):  # copied into scattered places of our own, as a cache would
            target = torch.empty(got[2].shape, dtype=got[2].dtype)
            got[2].copy_to(_split(random.Random(index), target.data_ptr(), target.nbytes, 9))
            assert same_bits(target, want[2]), f"request {index}: the key copied into pieces differs"
        as_tensors = [item.to_tensor() if isinstance(item, BorrowedTensor) else item for item in got]
        release_all(got)
        bodies.check_entry(as_tensors, want, f"request {index}")
    return kinds


def _pair(
    producer, consumer, producer_args: tuple, consumer_args: tuple, clean: bool = True, **changes
) -> tuple[dict, dict]:
    port = procs.free_port()
    sync = {name: procs.new_event() for name in bodies.SYNC_EVENTS}
    results = procs.new_queue()
    processes = [
        procs.start(bodies.run_side, (0, port, producer, changes, sync, *producer_args), results, 0),
        procs.start(bodies.run_side, (1, port, consumer, changes, sync, *consumer_args), results, 1),
    ]
    outcomes = procs.collect(processes, results, 150)
    for side in outcomes.values():
        assert not clean or side["close_error"] is None, side["close_error"]
    return outcomes[0], outcomes[1]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("path", "borrow_every", "expected"),
    [
        ("on", 1, "returned"),  # every select borrows: each loan ends when its consumer released it
        ("on", 0, "sent"),  # no select borrows: the producer copies lent items into the pipe
        ("off", 1, "sent"),  # borrowing over the transport: the producer copies them too
    ],
)
def test_lent_entries_arrive_bit_exact_borrowed_or_copied(path, borrow_every, expected):
    seed, count = 31, 24
    producer, consumer = _pair(
        producer_lends,
        consumer_borrows,
        (seed, count),
        (seed, count, borrow_every),
        kv_shared_memory=path,
        kv_buffer_size=32 << 20,
    )
    plan = _lend_plan(seed, count)
    requests = [bodies.make_request(seed, index) for index in range(count)]
    lent = [
        any(lend and item is not None for item, lend in zip(request[2:], lends, strict=True))
        for request, lends in zip(requests, plan, strict=True)
    ]
    assert producer["result"] == [expected if any_lent else None for any_lent in lent]
    kinds = consumer["result"]
    assert ("BorrowedTensor" in kinds) == (expected == "returned"), kinds
    p, c = producer["stats"], consumer["stats"]
    assert p["hits"] == c["hits"] == count and p["transferred_bytes"] == c["transferred_bytes"]
    assert p["bytes"] == 0 and p["entries"] == 0


def producer_lends_one(buffer: SimpleBuffer, sync: dict, seed: int) -> str | None:
    arena = _arena(seed)
    export_host_memory(arena)
    tokens, roi, key, _, _ = bodies.make_request(seed, 0)
    loan = buffer.insert(tokens, roi, _scattered(random.Random(seed), arena, [0], key), None, None)
    return loan.wait(bodies.BOUND)


def consumer_holds_too_long(buffer: SimpleBuffer, sync: dict, seed: int) -> dict:
    tokens, roi, key, _, _ = bodies.make_request(seed, 0)
    got = buffer.drop_select(tokens, roi, timeout=bodies.BOUND, borrow=True)
    copied = got[2].to_tensor()
    time.sleep(buffer.config.kv_timeout + 2.5)  # the producer takes the loan back meanwhile
    try:
        release_all(got)
        outcome = "released"
    except KVEntryTakenBackError as exc:
        outcome = str(exc)
    return {"outcome": outcome, "copy": same_bits(copied, key)}


@pytest.mark.timeout(120)
def test_a_borrow_held_past_kv_timeout_is_taken_back_and_its_release_fails():
    producer, consumer = _pair(producer_lends_one, consumer_holds_too_long, (41,), (41,), kv_timeout=2.0)
    assert producer["result"] == "reclaimed"
    assert "took back a lent entry" in consumer["result"]["outcome"]
    assert consumer["result"]["copy"]  # nothing changed the memory here: the stamp alone tells


def producer_lends_unselected(buffer: SimpleBuffer, sync: dict, seed: int) -> list[str | None]:
    arena = _arena(seed)
    export_host_memory(arena)
    rng, used = random.Random(seed), [0]
    outcomes = []
    tokens, roi, key, _, _ = bodies.make_request(seed, 0)
    loan = buffer.insert(tokens, roi, _scattered(rng, arena, used, key), None, None)
    outcomes.append(loan.wait(bodies.BOUND))  # nobody selects it within kv_entry_timeout
    bodies.wait_event(sync, "stage")  # the consumer holds the next one borrowed
    tokens, roi, key, _, _ = bodies.make_request(seed, 1)
    loan = buffer.insert(tokens, roi, _scattered(rng, arena, used, key), None, None)
    sync["inserted"].set()
    outcomes.append(loan.wait(bodies.BOUND))  # the consumer closes without releasing it
    sync["stage2"].set()
    return outcomes


def consumer_closes_holding(buffer: SimpleBuffer, sync: dict, seed: int) -> str:
    sync["stage"].set()
    bodies.wait_event(sync, "inserted")
    tokens, roi, _, _, _ = bodies.make_request(seed, 1)
    got = buffer.drop_select(tokens, roi, timeout=bodies.BOUND, borrow=True)
    assert isinstance(got[2], BorrowedTensor)
    buffer.close()
    bodies.wait_event(sync, "stage2")  # the producer has ended the loan
    try:
        release_all(got)
    except KVEntryTakenBackError:
        return "taken back"
    return "released"


@pytest.mark.timeout(120)
def test_loans_end_when_unselected_and_when_the_borrower_leaves():
    producer, consumer = _pair(producer_lends_unselected, consumer_closes_holding, (43,), (43,), kv_entry_timeout=1.0)
    assert producer["result"] == ["expired", "dropped"]
    assert consumer["result"] == "taken back"  # its stamp was cleared before the loan ended


def producer_watches_releases(buffer: SimpleBuffer, sync: dict, seed: int) -> str:
    bodies.insert(buffer, bodies.make_request(seed, 0))
    bodies.wait_event(sync, "stage")  # the consumer sent garbage where only releases may come
    bodies.wait_until(lambda: buffer.failure is not None, "the producer noticed")
    return repr(buffer.failure)


def consumer_sends_forged_releases(buffer: SimpleBuffer, sync: dict, seed: int) -> dict:
    pipe = buffer._data_pipe  # as a hostile consumer would: straight onto the data pipe
    pipe.send_tensor(torch.from_numpy(make_release(12345)))  # of nothing lent: ignored
    want = bodies.make_request(seed, 0)
    got = buffer.drop_select(want[0], want[1], timeout=bodies.BOUND, borrow=True)
    bodies.check_entry(got, want, "the entry after a stray release")
    pipe.send_tensor(torch.arange(3, dtype=torch.int32))  # not a release
    sync["stage"].set()
    try:
        buffer.drop_select(want[0], want[1], timeout=bodies.BOUND)
        return {"after garbage": "served"}
    except KVProtocolError as exc:
        return {"after garbage": str(exc)}


@pytest.mark.timeout(120)
def test_a_consumer_may_send_releases_only():
    producer, consumer = _pair(producer_watches_releases, consumer_sends_forged_releases, (47,), (47,), clean=False)
    assert "KVProtocolError" in producer["result"] and "sends only releases" in producer["result"]
    assert "sends only releases" in producer["close_error"]  # close reports the failure too
    assert "refused" in consumer["result"]["after garbage"]


# --- a loan taken back while the producer copies it out for a consumer that does not borrow -------
# The take-back waits for the copy at most ``kv_timeout``; past that the memory changes under it, so
# the copy must never reach the consumer: its select is answered as a miss.


def test_a_loan_taken_back_during_a_copy_out_ends_and_the_copy_cannot_end_it() -> None:
    loan = Loan()
    assert loan.begin_copy()
    assert not loan.take_back(0.01)  # the copy out never finishes: the wait ends at its timeout
    assert loan.outcome == TAKEN_BACK
    assert not loan.end(SENT) and loan.outcome == TAKEN_BACK


def producer_takes_back_during_a_copy_out(buffer: SimpleBuffer, sync: dict, seed: int) -> dict:
    """Lend one entry; while the buffer copies it out for the consumer, take it back (waiting 0.2 s
    for a copy that cannot finish before), scribble over its memory as vLLM would, then let the copy go on."""
    arena = _arena(seed)
    export_host_memory(arena)
    copying, go_on = threading.Event(), threading.Event()
    materialize = LentTensor.materialize

    def paused_materialize(self: LentTensor, empty: object) -> object:
        copying.set()
        assert go_on.wait(bodies.BOUND)
        return materialize(self, empty)

    LentTensor.materialize = paused_materialize
    try:
        tokens, roi, key, _, _ = bodies.make_request(seed, 0)
        loan = buffer.insert(tokens, roi, _scattered(random.Random(seed), arena, [0], key), None, None)
        assert copying.wait(bodies.BOUND)
        in_time = loan.take_back(0.2)
        arena.fill_(0x5A)
        go_on.set()
        bodies.wait_event(sync, "consumer_done")
        return {"in_time": in_time, "outcome": loan.outcome, "hits": buffer.stats().hits}
    finally:
        go_on.set()
        LentTensor.materialize = materialize


def consumer_selects_without_borrowing(buffer: SimpleBuffer, sync: dict, seed: int) -> bool:
    tokens, roi, _, _, _ = bodies.make_request(seed, 0)
    got = buffer.drop_select(tokens, roi, timeout=bodies.BOUND)
    return got[0] is None  # a miss


@pytest.mark.timeout(120)
def test_a_copy_out_that_outlasts_the_take_back_is_answered_as_a_miss() -> None:
    producer, consumer = _pair(producer_takes_back_during_a_copy_out, consumer_selects_without_borrowing, (47,), (47,))
    assert producer["result"] == {"in_time": False, "outcome": TAKEN_BACK, "hits": 0}
    assert consumer["result"] is True
