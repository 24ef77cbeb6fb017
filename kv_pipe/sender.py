"""The sending half of a pipe: the send queue, credit, regions to give back, keepalives, and the
sender thread.

A caller's unit waits for credit (:mod:`kv_pipe.credit`) in the order callers asked for it, then
goes out from the caller's own thread when nothing is queued ahead of it and the channel's turns
allow it (:mod:`kv_pipe.turns`), else through the send queue to the sender thread. The sender
thread also sends what no caller sends: credit this side owes, regions of the peer's segment whose
tensors died, keepalives when the wire has been quiet, and the final frame (CLOSE or CLOSE_ACK).
Whoever sends holds the send role, so one thread at a time uses this direction of the channel.
"""

from __future__ import annotations

import collections
import queue
import threading
import time

import torch

from kv_pipe.channel import TAG_FRAME, TAG_PAYLOAD
from kv_pipe.errors import KVPipeClosedError, KVTimeoutError
from kv_pipe.pipe_state import PipeState, Step, TransportError, deadline_after, wait_on
from kv_pipe.protocol import (
    ITEM_KINDS,
    MAX_FREED_PER_RECORD,
    SHARED_MIN_BYTES,
    FrameHeader,
    FrameKind,
    Record,
    chunk_bounds,
    frame_length,
    lay_out_records,
    message_cost,
)
from kv_pipe.wire import flat_bytes

_FINAL_KINDS = (FrameKind.CLOSE, FrameKind.CLOSE_ACK)
#: Kinds that count as the user's messages for flush(): items, and the final frame close() queues.
_COUNTED_KINDS = (*ITEM_KINDS, *_FINAL_KINDS)
#: How long credit and regions of the peer's segment whose tensors died wait to go back with a
#: message that is sent anyway, before the sender thread sends them alone (a wake-up and a frame per
#: message would cost more). Credit the peer asked for goes at once. The wait starts at the shortest;
#: each time messages took everything along meanwhile it doubles, up to the longest, and it falls
#: back to the shortest when the sender thread has to send them alone. While messages flow both
#: ways the sender thread then hardly wakes: a thread woken every millisecond on a small host moves
#: the callers between cores and leaves their caches cold.
RETURN_DELAY_SECONDS = (0.001, 0.064)

LaidOut = list[tuple[int, FrameHeader]]


class Outgoing:
    """One queued item: a frame kind and, for tensors, the contiguous data on the pipe's device.
    The send queue holds units: lists of items that go out back to back."""

    __slots__ = ("kind", "data", "nbytes", "cost", "in_place", "ready")

    def __init__(self, kind: FrameKind, data: torch.Tensor | None = None, ready: object | None = None) -> None:
        self.kind = kind
        self.data = data
        self.ready = ready  # CUDA: an event on the caller's stream after which ``data`` is complete
        self.nbytes = 0 if data is None else data.nbytes
        self.cost = message_cost(self.nbytes)
        self.in_place = False  # the data already lies in this side's shared-memory segment


class Sender:
    """This side's direction of the pipe: what callers queue, and the sender thread (:meth:`run`)."""

    def __init__(self, state: PipeState) -> None:
        self._state = state
        # A caller sends frames itself when nobody else is: whoever holds the role is the only one
        # using this direction of the channel.
        self.role = threading.Lock()
        self._room = state.condition()  # send_tensor: credit
        self._credit_waiters: collections.deque[object] = collections.deque()  # senders waiting for credit, in turn
        self._transmitted = state.condition()  # flush: messages on the wire
        self._queue: collections.deque[list[Outgoing]] = collections.deque()
        self.queued_messages = 0
        self.sent_messages = 0
        self._next_seq = 0
        self._last_sent = time.monotonic()
        # Regions of the peer's segment whose tensors died, to give back. Appended to by finalizers,
        # which may run in any thread at any moment: a deque's append and popleft are atomic.
        self._freed: collections.deque[int] = collections.deque()
        self._return_due: float | None = None  # when the sender thread sends pending credit and regions
        self._return_delay = RETURN_DELAY_SECONDS[0]  # how long before _return_due that was decided

    # ------------------------------------------------------------------ callers

    def queue_unit(self, unit: list[Outgoing], timeout: float | None, deadline: float | None) -> None:
        """Queue ``unit`` for the sender thread once the budget has room for it, waiting until
        ``deadline`` (``timeout`` seconds after the user's call began)."""
        state = self._state
        cost = sum(message.cost for message in unit)
        with state.lock:
            self._raise_if_unusable()
            if self._credit_waiters or not state.credit.has_room(cost):
                self._wait_for_credit(cost, timeout, deadline)
            state.credit.reserve(cost)
            self.queued_messages += len(unit)
            tensors = [message.data for message in unit if message.kind is FrameKind.TENSOR]
            if not (
                not self._queue and state.turns.may_send_here(tensors, deadline) and self.role.acquire(blocking=False)
            ):
                self._queue.append(unit)
                state.sender_doorbell.put(None)
                return
            # Nothing is queued ahead of this unit and no one else is sending: send it from here.
            prepared = state.run(self._prepare_own_unit, unit, action="sending")
            if prepared is Step.FAILED:
                self.role.release()
                state.failure.raise_if_failed()
                return
        try:
            self._send_unit(*prepared)
        finally:
            self.role.release()
        state.failure.raise_if_failed()

    def flush(self, timeout: float | None) -> None:
        deadline = deadline_after(timeout)
        with self._state.lock:
            while self.sent_messages < self.queued_messages:
                self._state.failure.raise_if_failed()
                if not wait_on(self._transmitted, deadline):
                    raise KVTimeoutError(f"flush: queued tensors were not sent within {timeout:g} s")

    def _wait_for_credit(self, cost: int, timeout: float | None, deadline: float | None) -> None:
        """Wait until the budget has room for a unit of ``cost`` and no sender that waited longer is
        still waiting (hold the lock). Credit goes to senders in the order they asked for it, so a
        large unit is not overtaken for ever by another thread's stream of small ones."""
        credit = self._state.credit
        turn = object()
        self._credit_waiters.append(turn)
        try:
            while True:
                if self._credit_waiters[0] is turn:
                    if credit.has_room(cost):
                        return
                    if credit.ask():
                        self._state.sender_doorbell.put(None)  # the sender thread tells the peer we are waiting
                if not wait_on(self._room, deadline):
                    raise KVTimeoutError(
                        f"send_tensor: the in-flight budget of {credit.budget} bytes stayed full "
                        f"for {timeout:g} s (the peer is not taking what was sent)"
                    )
                self._raise_if_unusable()
        finally:
            if self._credit_waiters[0] is turn and len(self._credit_waiters) > 1:
                self._room.notify_all()  # the next in line may find room at once
            self._credit_waiters.remove(turn)

    def _prepare_own_unit(self, unit: list[Outgoing]) -> tuple[LaidOut, list[Outgoing]]:
        """Headers for a unit a caller sends itself, with the regions to give back (hold the lock)."""
        record, freed = self._take_freed()
        unit = unit if record is None else [record, *unit]
        return self._frame_headers(unit, freed), unit

    def _raise_if_unusable(self) -> None:
        self._state.failure.raise_if_unusable("send_tensor on a closed pipe")
        if self._state.final_frame_queued or self._state.peer_finished:
            raise KVPipeClosedError("the peer closed the pipe; nothing more can be sent")

    # ------------------------------------------------------------------ what the receiving side tells

    def on_peer_credit(self, consumed: int, waiting: bool) -> None:
        """A frame from the peer carried its credit fields (hold the lock)."""
        if self._state.credit.on_frame(consumed, waiting):
            self._room.notify_all()

    def report_credit(self) -> None:
        """Have the credit this side owes the peer sent: now if asked for, else soon (hold the lock)."""
        if self._state.credit.report_urgent():
            self._state.sender_doorbell.put(None)
        elif self._state.credit.frame_due():
            self._return_soon()

    def region_freed(self, place: int) -> None:
        """A received tensor over the peer's segment died: give its region back. A finalizer, which
        may run in any thread inside any lock, so it takes none (waiting for the pipe's lock there
        could wait for a thread that waits for a lock this one holds): it only notes the region and
        rings the sender thread, which sends it back within the return delay (RETURN_DELAY_SECONDS)."""
        self._freed.append(place)
        # While a return is scheduled the sender thread wakes by then and takes every region noted so
        # far: a ring per tensor would wake it per message. It clears ``_return_due`` before it
        # looks at ``_freed`` again, and this notes the region before it looks at ``_return_due``,
        # so under the GIL one of the two sees the other.
        if self._return_due is None:
            self._state.sender_doorbell.put(None)

    def queue_final_frame(self, kind: FrameKind) -> None:
        """Queue CLOSE or CLOSE_ACK, after which this side sends nothing (hold the lock)."""
        self._state.final_frame_queued = True
        self.queued_messages += 1
        self._queue.append([Outgoing(kind)])
        self._state.sender_doorbell.put(None)

    def _return_soon(self) -> None:
        """Credit or regions are to go back to the peer: within the return delay (hold the lock)."""
        if self._return_due is None:
            self._return_due = time.monotonic() + self._return_delay
            self._state.sender_doorbell.put(None)

    # ------------------------------------------------------------------ sender thread

    def run(self) -> None:
        """The sender thread: send what is due until the final frame went out or the pipe failed."""
        with self._state.streams.context("send"):
            self._send_frames()

    def _send_frames(self) -> None:
        while True:
            if not self._wait_for_work():
                return
            with self.role:  # a caller may be sending: the work may be gone once it is done
                prepared = self._state.run(self._prepare_next_unit, action="sending")
                if prepared is Step.FAILED:
                    return
                if prepared is None:
                    continue
                laid_out, unit = prepared
                if not self._send_unit(laid_out, unit):
                    return
            if unit[0].kind in _FINAL_KINDS:
                return

    def _prepare_next_unit(self) -> tuple[LaidOut, list[Outgoing]] | None:
        """The next unit the sender thread sends, with its headers; None if nothing is due."""
        with self._state.lock:
            found = self._next_unit()
            if found is None:
                return None
            unit, freed = found
            return self._frame_headers(unit, freed), unit

    def _send_unit(self, laid_out: LaidOut, unit: list[Outgoing]) -> bool:
        """Transmit a unit (hold the send role); False if the pipe failed."""
        if self._state.run(self._transmit, laid_out, unit, action="sending") is Step.FAILED:
            return False
        counted = sum(message.kind in _COUNTED_KINDS for message in unit)
        with self._state.lock:
            self._last_sent = time.monotonic()
            if counted:
                self.sent_messages += counted
                self._transmitted.notify_all()
        return True

    def _wait_for_work(self) -> bool:
        """Wait until something is to be sent; False once the pipe failed."""
        state = self._state
        while True:
            with state.lock:
                if state.failure.error is not None:
                    return False
                if self._queue or state.credit.report_urgent():
                    return True
                now = time.monotonic()
                if self._freed and self._return_due is None:  # regions given back by finalizers
                    self._return_due = now + self._return_delay
                if self._return_due is not None and now >= self._return_due:
                    pending = self._freed or state.credit.frame_due()
                    if pending and self._last_sent >= self._return_due - self._return_delay:
                        # Messages are going out and take them along: look again later.
                        self._return_delay = min(2 * self._return_delay, RETURN_DELAY_SECONDS[1])
                        self._return_due = now + self._return_delay
                    else:
                        self._return_due = None
                        if pending:
                            self._return_delay = RETURN_DELAY_SECONDS[0]
                            return True
                        continue  # a region noted meanwhile rang no bell: look at _freed again
                quiet_left = self._last_sent + state.keepalive_interval - now
                if quiet_left <= 0:
                    return True
                due_left = quiet_left if self._return_due is None else min(quiet_left, self._return_due - now)
            try:
                state.sender_doorbell.get(timeout=due_left)
                while True:  # one look serves every ring so far
                    state.sender_doorbell.get_nowait()
            except queue.Empty:
                pass

    def _next_unit(self) -> tuple[list[Outgoing], int] | None:
        """The next unit to send, or a keepalive if one is due, with the region its first header gives
        back (hold the lock); None if nothing is due."""
        if self._freed and (not self._queue or self._queue[0][0].kind in _FINAL_KINDS):
            return [self._freed_record()], 0  # a final frame goes alone: nothing may share its frame
        if self._queue:
            record, freed = self._take_freed()
            unit = self._queue.popleft()
            return (unit if record is None else [record, *unit]), freed
        if self._last_sent + self._state.keepalive_interval <= time.monotonic() or self._state.credit.frame_due():
            return [Outgoing(FrameKind.KEEPALIVE)], 0
        return None

    def _take_freed(self) -> tuple[Outgoing | None, int]:
        """Regions of the peer's segment to give back with the next unit (hold the lock): one alone
        rides in the unit's first header, several go in a FREED record ahead of it."""
        if len(self._freed) == 1:  # finalizers only append, and only lock holders take
            return None, self._freed.popleft()
        return self._freed_record(), 0

    def _freed_record(self) -> Outgoing | None:
        """A FREED record for regions of the peer's segment whose tensors died, if any (hold the lock)."""
        if not self._freed:
            return None
        places = [self._freed.popleft() for _ in range(min(len(self._freed), MAX_FREED_PER_RECORD))]
        return Outgoing(FrameKind.FREED, torch.tensor(places, dtype=torch.int64))

    # ------------------------------------------------------------------ both: the wire

    def _frame_headers(self, unit: list[Outgoing], freed: int = 0) -> LaidOut:
        """Where each record of ``unit`` starts in its frame and its header, the first giving back
        region ``freed`` (hold the lock): payloads from SHARED_MIN_BYTES take a region of this
        side's shared-memory segment first."""
        state = self._state
        consumed, want_credit = state.credit.report()
        records = []
        for message in unit:
            record = Record(message.kind, nbytes=message.nbytes)
            if message.data is not None:
                record.dtype, record.shape = message.data.dtype, tuple(message.data.shape)
                if message.kind is FrameKind.TENSOR and message.nbytes >= SHARED_MIN_BYTES and state.shared is not None:
                    record.place = state.shared.take_lent(message.data)
                    message.in_place = bool(record.place)
                    record.place = record.place or state.shared.place(message.nbytes)
            records.append(record)
        laid_out = lay_out_records(
            records, state.wire.frame_bytes, state.inline_payloads, self._next_seq, consumed, want_credit, freed
        )
        self._next_seq += sum(message.kind in ITEM_KINDS for message in unit)
        return laid_out

    def _transmit(self, laid_out: LaidOut, unit: list[Outgoing]) -> None:
        """Send the unit's frames and payloads: each frame with its payloads posted together, then
        waited for (the frame is written again next)."""
        state = self._state
        payloads = []  # tensors of this frame's records that do not fit inside it
        for (offset, header), message in zip(laid_out, unit, strict=True):
            if message.ready is not None:  # CUDA: the caller's stream made the data; this stream waits for it
                state.streams.wait_ready(message.ready)
                message.ready = None
            state.wire.write_record(offset, header, message.data)
            if header.place:
                if not message.in_place:
                    state.shared.write(header.place, flat_bytes(message.data))
            elif header.kind is FrameKind.TENSOR and not header.inline:
                payloads.append(flat_bytes(message.data))
            message.data = None  # the caller's tensor is released as soon as it is on the wire
            if header.more:
                continue
            try:  # torch.distributed's errors derive from RuntimeError
                posted = [state.channel.post(state.wire.frame_to_send(frame_length(offset, header)), TAG_FRAME)]
                for flat in payloads:
                    posted += [
                        state.channel.post(flat[start:end], TAG_PAYLOAD) for start, end in chunk_bounds(flat.numel())
                    ]
                for handle in posted:
                    if handle is not None:
                        state.channel.finish(handle)
            except (RuntimeError, OSError) as exc:
                raise TransportError(exc) from exc
            payloads.clear()
