"""Credit between the two sides of a pipe: the ledger's bookkeeping, without processes."""

from __future__ import annotations

from kv_pipe.credit import CreditLedger


def test_a_request_for_credit_is_answered_even_after_frames_that_carry_none():
    sender, receiver = CreditLedger(budget=1000), CreditLedger(budget=1000)
    sender.reserve(900)
    assert not sender.has_room(200) and sender.ask()
    consumed, asking = sender.report()
    assert asking
    receiver.on_frame(consumed, asking)
    receiver.report()  # a frame of the receiver's own (say, a tensor it sends) with no new credit
    assert not receiver.report_urgent()
    receiver.take(100)  # its user takes a small item: the waiting sender must hear of it now
    assert receiver.report_urgent()
    consumed, _ = receiver.report()
    sender.on_frame(consumed, False)
    assert sender.has_room(200)
