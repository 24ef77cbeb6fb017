"""Credit-based flow control: the bytes one side may have in flight towards the other.

A message costs its payload bytes plus :data:`kv_pipe.protocol.MESSAGE_OVERHEAD`, so a flood of
tiny tensors or ``None`` is bounded too. A sender may have at most ``budget`` bytes of cost in
flight: queued, on the wire, or received by the peer's pipe but not yet taken by the peer's user.
The budget is the smaller ``kv_buffer_size`` of the two sides, so neither side's memory is exceeded.

Every frame reports the cumulative cost its sender's user has consumed. A receiver also reports in a
frame of its own once a quarter of the budget has gone unreported, and at once when the peer says
it waits for credit; a sender says so once per stall. So a sender never waits longer than one
message's trip for credit its peer has already freed.
"""

from __future__ import annotations

from kv_pipe.errors import KVProtocolError


class CreditLedger:
    """The byte accounting of one pipe, both directions. Not thread-safe: the pipe holds its lock."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        # Towards the peer.
        self._queued = 0  # cumulative cost of every message this side queued
        self._peer_consumed = 0  # cumulative cost the peer's user has taken, as last reported
        self._asked_at = -1  # _peer_consumed when this side last asked for credit
        self._asking = False  # the next frame asks for credit
        # From the peer.
        self._consumed = 0  # cumulative cost this side's user has taken
        self._reported = 0  # the last _consumed a frame carried
        self._peer_waiting = False  # the peer asked for credit and has not been answered

    def has_room(self, cost: int) -> bool:
        """Whether a unit of ``cost`` fits in the budget now."""
        return self._queued + cost - self._peer_consumed <= self.budget

    def reserve(self, cost: int) -> None:
        """Count a unit of ``cost`` as in flight (call once :meth:`has_room` said yes)."""
        self._queued += cost

    def ask(self) -> bool:
        """A sender is out of credit. True if the peer should be told (once per stall)."""
        if self._asked_at == self._peer_consumed:
            return False
        self._asked_at = self._peer_consumed
        self._asking = True
        return True

    def on_frame(self, consumed: int, waiting: bool) -> bool:
        """Take in the credit fields of a frame from the peer; refuse impossible values. True if
        the peer's user took more since the last frame (a waiting sender may have room now)."""
        if not self._peer_consumed <= consumed <= self._queued:
            raise KVProtocolError(
                f"peer claims to have consumed {consumed} bytes; it had consumed {self._peer_consumed} "
                f"and was sent at most {self._queued}"
            )
        grew = consumed > self._peer_consumed
        self._peer_consumed = consumed
        self._peer_waiting = self._peer_waiting or waiting
        return grew

    def take(self, cost: int) -> None:
        """This side's user took a message of ``cost`` from the pipe."""
        self._consumed += cost

    def report(self) -> tuple[int, bool]:
        """The credit fields of the next frame: consumed, and whether this side asks for credit.
        The frame carries them, so nothing is owed after it."""
        asking, self._asking = self._asking, False
        if self._consumed > self._reported:
            self._peer_waiting = False  # answered; a frame without new credit leaves the peer waiting
        self._reported = self._consumed
        return self._consumed, asking

    def report_urgent(self) -> bool:
        """Whether a frame must go out now: this side asks for credit, or the peer asked for it."""
        return self._asking or (self._consumed > self._reported and self._peer_waiting)

    def frame_due(self) -> bool:
        """Whether a frame should go out now only to carry credit fields."""
        unreported = self._consumed - self._reported
        return self._asking or (unreported > 0 and (self._peer_waiting or unreported >= self.budget // 4))
