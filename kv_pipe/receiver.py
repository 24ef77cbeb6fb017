"""The receiving half of a pipe: frames in, their records validated, the items queued for
``recv_tensor``, and the receiver thread.

Whoever holds the receive role receives frames: a caller of :meth:`Receiver.recv_tensor` with
nothing queued, when the channel's turns allow it (:mod:`kv_pipe.turns`), else the receiver thread,
which takes frames in whether or not the user reads, so that credit, keepalives and the peer's
close keep arriving. A frame's records are checked by :func:`kv_pipe.protocol.decode_frame` before
any payload receive is posted (gloo aborts the process if a message is larger than the receive
buffer); what a frame tells the sending side (credit, regions to give back, the peer's close) goes
to the :class:`kv_pipe.sender.Sender`.
"""

from __future__ import annotations

import collections
import enum
import math
import threading
import time

import torch

from kv_pipe.channel import TAG_PAYLOAD
from kv_pipe.errors import KVPipeClosedError, KVTimeoutError
from kv_pipe.pipe_state import PipeState, TransportError, deadline_after, transport_call, wait_on
from kv_pipe.protocol import HEADER_BYTES, ITEM_KINDS, FrameHeader, FrameKind, chunk_bounds, decode_frame, message_cost
from kv_pipe.sender import Sender
from kv_pipe.turns import RECEIVER_PARK_SECONDS


class Frame(enum.Enum):
    """What one receive of a frame came to."""

    TAKEN = enum.auto()  # a frame arrived and what it carries is queued; more may come
    NONE_YET = enum.auto()  # no frame started by the deadline (a local socket only)
    ENDED = enum.auto()  # the peer finished: nothing more will come


class CallerReceive(enum.Enum):
    """How a caller's turn at receiving frames ended."""

    READY = enum.auto()  # an item, the end of the stream or a failure is queued
    TIMED_OUT = enum.auto()  # nothing of the sort came by the caller's deadline
    LEAVE_TO_THREAD = enum.auto()  # the caller's deadline is near: the receiver thread receives for it


class Receiver:
    """The peer's direction of the pipe: the items it sent, and the receiver thread (:meth:`run`)."""

    def __init__(self, state: PipeState, sender: Sender, device: torch.device) -> None:
        self._state = state
        self._sender = sender
        self._device = device  # where received tensors live
        self._parked = state.condition()  # the receiver thread, while callers receive
        self._items = state.condition()  # recv_tensor: an item, or the end of the stream
        self._queue: collections.deque[tuple[torch.Tensor | None, int]] = collections.deque()
        self._next_seq = 0
        self._last_received = time.monotonic()
        # A caller receives frames itself when nobody else is: whoever holds the role is the only
        # one using this direction of the channel.
        self._role = threading.Lock()

    # ------------------------------------------------------------------ callers

    def recv_tensor(self, timeout: float | None) -> torch.Tensor | None:
        """The next item; see :meth:`kv_pipe.KVPipeBase.recv_tensor`."""
        state = self._state
        deadline = deadline_after(timeout)
        while True:
            with state.lock:
                if self._queue:
                    tensor, cost = self._queue.popleft()
                    state.credit.take(cost)
                    self._sender.report_credit()
                    state.streams.hand_over(tensor)
                    return tensor
                state.failure.raise_if_failed()
                if state.peer_finished:
                    raise KVPipeClosedError("the peer closed the pipe; nothing more will arrive")
                if state.failure.closed:
                    raise KVPipeClosedError("recv_tensor on a closed pipe")
                may_receive_here = state.turns.may_receive_here(deadline)
                receive_here = may_receive_here and self._role.acquire(blocking=False)
                if not receive_here and not self._wait_for_an_item(may_receive_here, deadline):
                    raise KVTimeoutError(f"recv_tensor: nothing arrived within {timeout:g} s")
                if receive_here:
                    state.turns.caller_took_role()
            if receive_here:
                try:
                    arrived = self._receive_until_an_item(deadline)
                finally:
                    self._role.release()
                    with state.lock:
                        if state.turns.caller_left_role():
                            self._parked.notify()
                if arrived is CallerReceive.TIMED_OUT:
                    with state.lock:
                        if not self._queue:
                            state.failure.raise_if_failed()
                            raise KVTimeoutError(f"recv_tensor: nothing arrived within {timeout:g} s")

    def _wait_for_an_item(self, may_receive_here: bool, deadline: float | None) -> bool:
        """Wait for an item, the end of the stream, or (``may_receive_here``) the receive role to
        come free; False once ``deadline`` passed (hold the lock)."""
        self._state.turns.caller_waits(for_role=may_receive_here)
        if not may_receive_here:
            self._parked.notify()  # this caller waits for the receiver thread
        try:
            return wait_on(self._items, deadline)
        finally:
            self._state.turns.caller_stops_waiting(for_role=may_receive_here)

    def _receive_until_an_item(self, deadline: float | None) -> CallerReceive:
        """Receive frames here (hold the receive role) until an item, the end of the stream or a
        failure is queued, or until ``deadline``.

        It looks at the pipe's state at least every RECEIVER_PARK_SECONDS, so that a failure
        elsewhere (which cannot wake a poll) reaches it soon."""
        state = self._state
        wait_until = math.inf if deadline is None else deadline
        started = time.monotonic()
        spin = state.turns.spin
        while True:
            with state.lock:
                if self._queue or state.stopped:
                    return CallerReceive.READY
                if not state.turns.may_receive_here(deadline):
                    return CallerReceive.LEAVE_TO_THREAD
            outcome = state.run(
                self._receive_frame,
                min(wait_until, time.monotonic() + RECEIVER_PARK_SECONDS),
                spin,
                action="receiving",
            )
            if outcome is Frame.NONE_YET:
                if time.monotonic() >= wait_until:
                    return CallerReceive.TIMED_OUT
                spin = 0.0  # the poll was spun once already
                continue
            spin = state.turns.frame_waited(self._last_received - started)
            started = time.monotonic()

    # ------------------------------------------------------------------ receiver thread

    def run(self) -> None:
        """The receiver thread: take in what arrives while no caller is receiving it."""
        with self._state.streams.context("recv"):
            self._receive_frames()

    def _receive_frames(self) -> None:
        state = self._state
        while True:
            with state.lock:
                while not state.stopped:
                    pause = state.turns.receiver_pause()
                    if not pause:
                        break
                    self._parked.wait(pause)
                if state.stopped:
                    return
            state.channel.readable(
                min(state.keepalive_interval, self._last_received + state.config.kv_timeout - time.monotonic())
            )
            if state.turns.receiving or not self._role.acquire(blocking=False):
                continue
            try:
                if state.stopped:
                    return
                while (
                    state.run(self._receive_frame, time.monotonic(), action="receiving") is Frame.TAKEN
                    and not state.turns.receiver_yields()
                ):
                    pass
            finally:
                self._role.release()
                with state.lock:
                    if state.turns.receiver_left_role():  # a caller waited for the role meanwhile
                        self._items.notify_all()

    # ------------------------------------------------------------------ both: the wire

    def _receive_frame(self, wait_until: float, spin: float = 0.0) -> Frame:
        """Receive one frame, if one starts by the monotonic time ``wait_until`` (a receive on the
        groups lasts until a frame comes), and queue what it carries."""
        state = self._state
        if not self._recv_frame_by(wait_until, spin):
            return Frame.NONE_YET
        first, items = self._receive_records()
        state.streams.synchronize()  # CUDA: the items are complete before any caller sees them
        with state.lock:
            self._sender.on_peer_credit(first.consumed, first.want_credit)
            self._queue.extend(items)
            if first.kind is FrameKind.CLOSE:
                state.peer_finished = True
                if not state.final_frame_queued and state.failure.error is None:
                    self._sender.queue_final_frame(FrameKind.CLOSE_ACK)
            elif first.kind is FrameKind.CLOSE_ACK:
                state.peer_finished = True
            if state.peer_finished:
                state.wake_callers()  # senders waiting for credit too: none will come any more
            elif items:
                self._items.notify_all()
            self._sender.report_credit()
            return Frame.ENDED if state.peer_finished else Frame.TAKEN

    def _receive_records(self) -> tuple[FrameHeader, list[tuple[torch.Tensor | None, int]]]:
        """Validate the received frame's records and take in their items, payloads included.

        Returns the first record's header (credit, and the frame kind for control frames) and the
        items with their costs, in order.
        """
        state = self._state
        shared_bytes = state.shared.peer_bytes if state.shared is not None else 0
        records = decode_frame(
            state.wire.received_frame(), state.inline_payloads, state.credit.budget, shared_bytes, self._next_seq
        )
        items = []
        for offset, header in records:
            if header.freed:
                state.shared.release([header.freed])
            if header.kind is FrameKind.FREED:
                state.shared.release(state.wire.read_inline(offset + HEADER_BYTES, header).tolist())
            elif header.kind in ITEM_KINDS:
                items.append((self._receive_item(header, offset), message_cost(header.nbytes)))
        self._next_seq += len(items)
        return records[0][1], items

    def _receive_item(self, header: FrameHeader, offset: int) -> torch.Tensor | None:
        state = self._state
        if header.kind is FrameKind.NONE:
            return None
        if header.nbytes == 0:
            return torch.empty(header.shape, dtype=header.dtype, device=self._device)
        if header.inline:
            return state.wire.read_inline(offset + HEADER_BYTES, header)
        if header.place:
            return state.shared.view(header.place, header.dtype, header.shape, self._sender.region_freed)
        if self._device.type != "cpu":
            data = torch.empty(header.nbytes, dtype=torch.uint8, device=self._device)
        else:
            data = state.wire.allocate(header.nbytes)
        for start, end in chunk_bounds(header.nbytes):
            transport_call(state.channel.recv, data[start:end], TAG_PAYLOAD)
            self._last_received = time.monotonic()  # a long payload is the peer's sign of life too
        return data.view(header.dtype).reshape(header.shape)

    def _recv_frame_by(self, wait_until: float, spin: float) -> bool:
        """Receive a frame from the local socket if one starts by ``wait_until``; a peer silent for
        kv_timeout is lost, as over the transport."""
        state = self._state
        silent_at = self._last_received + state.config.kv_timeout
        arrived = transport_call(
            state.channel.recv_frame_by, state.wire.frame_to_receive(), min(wait_until, silent_at), spin
        )
        now = time.monotonic()
        if arrived:
            self._last_received = now
        elif now >= silent_at:
            silence = TimeoutError(f"the peer sent nothing for kv_timeout={state.config.kv_timeout:g} s")
            raise TransportError(silence) from silence
        return arrived
