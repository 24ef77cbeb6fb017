"""What the two halves of a pipe share: its lock, its failure latch, its channel and settings.

A :class:`kv_pipe.TorchDistributedPipe` is wired from three objects: this state, a
:class:`kv_pipe.sender.Sender` (the send queue, credit, the sender thread) and a
:class:`kv_pipe.receiver.Receiver` (frames in, the receive queue, the receiver thread). Both halves
hold the one lock here, so that a frame that arrives (credit, the peer's close) and a unit that is
queued see one state; and one rule ends them both: the first failure (:meth:`PipeState.fail`)
wakes every waiter in either half and aborts the channel.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kv_pipe.channel import Channel
from kv_pipe.config import KVTransferConfig
from kv_pipe.credit import CreditLedger
from kv_pipe.device import PipeStreams
from kv_pipe.errors import KVPeerLostError, KVProtocolError, KVTransferError
from kv_pipe.failure import FailureLatch
from kv_pipe.protocol import record_inline_capacity
from kv_pipe.shared_memory import SharedMemoryLink
from kv_pipe.turns import GroupTurns, SocketTurns, ThreadTurns
from kv_pipe.wire import HostWire

logger = logging.getLogger(__name__)

Result = TypeVar("Result")


class TransportError(Exception):
    """A torch.distributed send or receive failed: the peer is gone or the connection broke."""


class Step(enum.Enum):
    FAILED = enum.auto()  # a step of a transfer failed the pipe (see PipeState.run)


class PipeState:
    """The state both halves of one pipe read and change, guarded by :attr:`lock`."""

    def __init__(
        self,
        config: KVTransferConfig,
        streams: PipeStreams,
        wire: HostWire,
        channel: Channel,
        credit: CreditLedger,
        shared: SharedMemoryLink | None,
        keepalive_interval: float,
        split: bool,
    ) -> None:
        self.config = config
        self.rank = config.kv_rank
        self.peer_rank = 1 - config.kv_rank
        self.streams = streams
        self.wire = wire
        self.channel = channel
        self.credit = credit
        self.shared = shared  # the same-host path; close() drops it
        self.keepalive_interval = keepalive_interval
        # A frame's records carry their tensors' bytes only where payloads travel with frames.
        self.inline_payloads = not split
        self.turns = self._make_turns()
        # Reentrant: a received tensor over shared memory may die, and tell the pipe, in any thread
        # at any moment, including inside the pipe's own critical sections (garbage collection).
        self.lock = threading.RLock()
        self.failure = FailureLatch()  # the first fatal error, and close()
        # The sender thread sleeps on a queue, not a condition: a finalizer may ring it from inside any
        # lock (SimpleQueue.put is reentrant), and a ring between its look and its sleep is not lost.
        self.sender_doorbell: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.final_frame_queued = False  # CLOSE or CLOSE_ACK queued: nothing may follow it
        self.peer_finished = False  # the peer sent CLOSE or CLOSE_ACK
        self._conditions: list[threading.Condition] = []

    def _make_turns(self) -> ThreadTurns:
        """Who sends and receives on this pipe's channel (see :mod:`kv_pipe.turns`)."""
        if not self.channel.callers_may_post:
            return ThreadTurns()
        if self.channel.interruptible:
            return SocketTurns(self.shared.room_for)
        return GroupTurns(self.keepalive_interval, record_inline_capacity(self.wire.frame_bytes, 0))

    def condition(self) -> threading.Condition:
        """A condition on :attr:`lock` that :meth:`wake_callers` wakes. Each wait has its own, so
        that an event wakes only the threads it concerns: a caller waiting for an item woken by every
        transmission costs a wake-up per message."""
        condition = threading.Condition(self.lock)
        self._conditions.append(condition)
        return condition

    @property
    def stopped(self) -> bool:
        """Whether nothing more will come in: the peer finished or the pipe failed (hold :attr:`lock`)."""
        return self.peer_finished or self.failure.error is not None

    def run(self, step: Callable[..., Result], *args: object, action: str) -> Result | Step:
        """Run one step of a transfer; its result, or Step.FAILED once it failed the pipe."""
        try:
            return step(*args)
        except TransportError as exc:
            self.fail(
                KVPeerLostError(
                    f"pipe rank {self.rank}: connection to rank {self.peer_rank} lost while {action} (the peer "
                    f"exited, was killed, or was silent for kv_timeout={self.config.kv_timeout:g} s): {exc.__cause__}"
                )
            )
        except KVProtocolError as exc:
            self.fail(exc)
        except BaseException as exc:  # a bug in the pipe: it surfaces as itself, the pipe fails cleanly
            logger.exception("pipe rank %d: internal error while %s", self.rank, action)
            self.fail(exc)
        return Step.FAILED

    def fail(self, error: BaseException) -> None:
        with self.lock:
            # Closing, the pipe still fails until the peer answered CLOSE (messages may be unsent).
            first = self.failure.fail(error, after_close=not self.peer_finished)
            if first:
                if isinstance(error, KVTransferError):
                    logger.error("%s", error)
            self.wake_callers()
            self.sender_doorbell.put(None)
        if first:
            # No payload operation may stay posted once the pipe failed (on NCCL it would hold the
            # device, and the other thread may be waiting in one): outside the lock, as it may take
            # a moment.
            self.channel.abort()

    def wake_callers(self) -> None:
        """Wake every caller waiting in the pipe: the pipe failed, is closing, or the peer finished
        (hold :attr:`lock`)."""
        for condition in self._conditions:
            condition.notify_all()


def transport_call(operation: Callable[..., Result], *args: object) -> Result:
    """``operation(*args)`` on the channel; its failure (torch.distributed's errors derive from
    RuntimeError) as a TransportError."""
    try:
        return operation(*args)
    except (RuntimeError, OSError) as exc:
        raise TransportError(exc) from exc


def deadline_after(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def wait_on(condition: threading.Condition, deadline: float | None) -> bool:
    """Wait on ``condition`` for a state change; False once ``deadline`` has passed."""
    if deadline is None:
        condition.wait()
        return True
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return False
    condition.wait(remaining)
    return True
