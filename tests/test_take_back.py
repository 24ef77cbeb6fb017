"""A lent entry taken back while the producer copies it out for a consumer that does not borrow.

The take-back waits for the copy at most ``kv_timeout``; past that the memory changes under it,
so the copy must never reach the consumer: its select is answered as a miss.
"""

from __future__ import annotations

import random
import threading

import pytest

from kv_pipe.exported_memory import export_host_memory
from lookup_buffer import SimpleBuffer
from lookup_buffer.loans import SENT, TAKEN_BACK, LentTensor, Loan
from tests import _buffer_procs as bodies
from tests.test_loans import _arena, _pair, _scattered


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
    producer, consumer = _pair(producer_takes_back_during_a_copy_out, consumer_selects_without_borrowing,
                               (47,), (47,))
    assert producer["result"] == {"in_time": False, "outcome": TAKEN_BACK, "hits": 0}
    assert consumer["result"] is True
