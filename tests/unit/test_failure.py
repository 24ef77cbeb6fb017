"""The rule every pipe and lookup buffer follows: one that lost its peer stays dead, and close raises
the first failure nobody reported (:class:`kv_pipe.failure.FailureLatch`)."""

from __future__ import annotations

import pytest

from kv_pipe.errors import KVPeerLostError, KVPipeClosedError, KVProtocolError
from kv_pipe.failure import FailureLatch, fresh_error


def test_the_first_failure_stays_and_later_ones_are_dropped():
    latch = FailureLatch()
    first, second = KVPeerLostError("peer gone"), KVProtocolError("bad frame")
    assert latch.fail(first)
    assert not latch.fail(second)
    assert latch.error is first
    for _ in range(3):  # dead for good: every caller is told, each with an exception of its own
        with pytest.raises(KVPeerLostError, match="peer gone") as raised:
            latch.raise_if_failed()
        assert raised.value is not first and raised.value.__cause__ is first


def test_close_raises_a_failure_only_if_no_caller_was_told():
    told = FailureLatch()
    told.fail(KVPeerLostError("peer gone"))
    with pytest.raises(KVPeerLostError):
        told.raise_if_unusable("closed")
    assert told.close()
    assert told.unreported() is None

    untold = FailureLatch()
    error = KVPeerLostError("peer gone")
    untold.fail(error)
    assert untold.close()
    assert untold.unreported() is error
    assert untold.unreported() is None  # close reports it once


def test_a_failure_after_close_counts_only_while_work_with_the_peer_remains():
    latch = FailureLatch()
    assert latch.close() and not latch.close()
    assert not latch.fail(KVPipeClosedError("the peer closed too"))
    assert latch.error is None
    error = KVPeerLostError("lost before the peer answered the close")
    assert latch.fail(error, after_close=True)
    assert latch.unreported() is error


def test_a_working_owner_raises_nothing_and_a_closed_one_says_so():
    latch = FailureLatch()
    latch.raise_if_unusable("closed")  # neither failed nor closed
    assert latch.reason("closed") is None
    latch.close()
    with pytest.raises(KVPipeClosedError, match="send on a closed pipe"):
        latch.raise_if_unusable("send on a closed pipe")
    reason = latch.reason("the buffer was closed")
    assert isinstance(reason, KVPipeClosedError) and str(reason) == "the buffer was closed"
    assert latch.unreported() is None


def test_a_closed_owner_that_failed_first_names_the_failure():
    latch = FailureLatch()
    error = KVPeerLostError("peer gone")
    latch.fail(error)
    latch.close()
    assert latch.reason("closed") is error
    with pytest.raises(KVPeerLostError):
        latch.raise_if_unusable("closed")


class _Rigid(Exception):
    """An exception its class cannot rebuild from its args."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")


def test_an_error_that_cannot_be_copied_is_raised_as_itself():
    error = _Rigid(7, "internal")
    assert fresh_error(error) is error
    copied = fresh_error(KeyError("slot"))
    assert type(copied) is KeyError and copied.args == ("slot",) and copied.__cause__ is not None
