"""Who sends and who receives on a pipe's channel at a moment: a caller itself, which costs no thread
hand-off (two kernel wake-ups, about 100 µs a message), or the pipe's sender and receiver threads.
One class per channel, so that each one's rules read in one place:

* :class:`ThreadTurns` (the split channel: NCCL, or its layout on gloo): only the pipe's threads
  send and receive. An NCCL operation runs on the issuing thread's current stream, and its wait
  makes that stream (an engine's) wait, for a receive until the peer's next frame.
* :class:`SocketTurns` (the local socket beside shared memory): any caller may send or receive,
  whatever its timeout, since a poll of the socket can end at a deadline. A caller receiving
  spins on the socket for a while before it sleeps, and the receiver thread stays away while
  callers receive.
* :class:`GroupTurns` (gloo's groups): an operation there ends only once the peer has done its
  part, which a live peer does within the keepalive interval, and cannot be abandoned earlier (a
  wait that times out breaks the connection for good). So only a caller with twice that interval
  to spare sends or receives itself, and the receiver thread, which cannot leave a receive either,
  keeps away from the receive role for a moment after a caller had it.

The pipe holds its lock around every method here; the receive role itself is the pipe's lock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from kv_pipe.protocol import SHARED_MIN_BYTES

#: A caller receiving on a local socket polls it without sleeping for a while before it sleeps: a
#: frame that arrives meanwhile is seen without a kernel wake-up (50-100 µs on a virtual machine,
#: paid by both sides). The while adapts: half again the last wait for a frame, if that was under
#: the longest spin, else the shortest (a long wait is a large copy on the peer's side, which
#: polling would take a core from).
SPIN_SECONDS = (50e-6, 1e-3)
#: While callers receive on a local socket, the receiver thread leaves the socket to them and looks
#: again after this long: were it to wake at every arrival too, it would contend with them.
RECEIVER_PARK_SECONDS = 0.05
#: On the groups, the receiver thread leaves the receive role to callers for this long after one
#: received, so that a caller receiving again soon (a ping-pong) finds it free. Meanwhile a peer's
#: frame that no caller is receiving waits for the thread, and so may the peer's send (at most this).
CALLERS_RETURN_SECONDS = 0.01


class ThreadTurns:
    """Only the pipe's threads send and receive; callers hand units over and take items from a queue."""

    spin = 0.0  # a caller never polls the channel

    def __init__(self) -> None:
        self.receiving = 0  # callers holding the receive role (never more than 0 here)

    def may_send_here(self, tensors: Sequence[torch.Tensor], deadline: float | None) -> bool:
        """Whether a caller with ``deadline`` may send a unit carrying ``tensors`` itself."""
        return False

    def may_receive_here(self, deadline: float | None) -> bool:
        """Whether a caller with ``deadline`` may receive frames itself."""
        return False

    def caller_waits(self, for_role: bool) -> None:
        """A caller waits for an item: for the receive role too (``for_role``), or for the thread."""

    def caller_stops_waiting(self, for_role: bool) -> None:
        """The caller of :meth:`caller_waits` woke."""

    def caller_took_role(self) -> None:
        self.receiving += 1

    def caller_left_role(self) -> bool:
        """A caller gave the receive role back; whether the receiver thread is to be woken."""
        self.receiving -= 1
        return False

    def receiver_pause(self) -> float:
        """How long the receiver thread leaves receiving to callers before it looks again; 0 to
        receive now."""
        return 0.0

    def receiver_yields(self) -> bool:
        """Whether the receiver thread is to give the role up after the frame it just received."""
        return False

    def receiver_left_role(self) -> bool:
        """The receiver thread gave the role up; whether callers waiting for it are to be woken."""
        return False

    def frame_waited(self, seconds: float) -> float:
        """A caller waited ``seconds`` for a frame: how long its next poll spins."""
        return self.spin


class SocketTurns(ThreadTurns):
    """Callers send and receive on the local socket themselves."""

    def __init__(self, room_for: Callable[[list[torch.Tensor]], bool]) -> None:
        """``room_for``: whether this side's shared-memory segment has room for these payloads now."""
        super().__init__()
        self._room_for = room_for
        self._role_wanted = False  # a caller waited for the role since the receiver thread took it
        self.spin = SPIN_SECONDS[0]

    def may_send_here(self, tensors: Sequence[torch.Tensor], deadline: float | None) -> bool:
        # A frame leaves at once, but a payload written to the socket waits for the wire, which a
        # caller's timeout cannot: payloads must all go through shared memory.
        payloads = [tensor for tensor in tensors if tensor.nbytes >= SHARED_MIN_BYTES]
        return not payloads or self._room_for(payloads)

    def may_receive_here(self, deadline: float | None) -> bool:
        return True

    def caller_waits(self, for_role: bool) -> None:
        self._role_wanted = True

    def receiver_pause(self) -> float:
        return RECEIVER_PARK_SECONDS if self.receiving else 0.0

    def receiver_left_role(self) -> bool:
        wanted, self._role_wanted = self._role_wanted, False
        return wanted

    def frame_waited(self, seconds: float) -> float:
        shortest, longest = SPIN_SECONDS
        self.spin = max(shortest, 1.5 * seconds) if seconds * 1.5 < longest else shortest
        return self.spin


class GroupTurns(ThreadTurns):
    """Callers with time to spare send and receive on gloo's groups themselves."""

    def __init__(self, keepalive_interval: float, inline_capacity: int) -> None:
        """``inline_capacity``: the most tensor bytes a frame's first record carries."""
        super().__init__()
        self._keepalive_interval = keepalive_interval
        self._inline_capacity = inline_capacity
        self._waiting_for_thread = 0  # callers that must leave the receiving to the receiver thread
        self._last_caller_received = -math.inf  # when callers last had the receive role
        self._role_wanted = False  # a caller waited for the role since the receiver thread took it

    def _has_time(self, deadline: float | None) -> bool:
        """Whether a caller with ``deadline`` may wait in an operation on the groups."""
        return deadline is None or deadline - time.monotonic() >= 2 * self._keepalive_interval

    def may_send_here(self, tensors: Sequence[torch.Tensor], deadline: float | None) -> bool:
        # At most a frame's worth of wire per item, so that the wait stays within the caller's time.
        return self._has_time(deadline) and all(tensor.nbytes <= self._inline_capacity for tensor in tensors)

    def may_receive_here(self, deadline: float | None) -> bool:
        return self._has_time(deadline)

    def caller_waits(self, for_role: bool) -> None:
        if for_role:
            self._role_wanted = True
        else:
            self._waiting_for_thread += 1

    def caller_stops_waiting(self, for_role: bool) -> None:
        if not for_role:
            self._waiting_for_thread -= 1

    def caller_left_role(self) -> bool:
        super().caller_left_role()
        self._last_caller_received = time.monotonic()
        return bool(self._waiting_for_thread)

    def receiver_pause(self) -> float:
        # A receive on the groups cannot be abandoned: the thread also stays away for a moment after
        # a caller received, or after it handed the role to a caller that waited for it, so that a
        # caller receiving again soon (a ping-pong) finds the role free rather than the thread in a
        # receive. A caller that waits for the thread ends that at once.
        if self.receiving:
            return RECEIVER_PARK_SECONDS
        if self._waiting_for_thread:
            return 0.0
        return max(0.0, self._last_caller_received + CALLERS_RETURN_SECONDS - time.monotonic())

    def receiver_yields(self) -> bool:
        return self._role_wanted

    def receiver_left_role(self) -> bool:
        if not self._role_wanted:
            return False
        self._role_wanted = False  # the role is the callers' now
        self._last_caller_received = time.monotonic()
        return True
