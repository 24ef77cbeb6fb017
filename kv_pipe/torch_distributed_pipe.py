"""A tensor pipe over torch.distributed point-to-point on dedicated process groups.

* The pipe builds its own groups (:mod:`kv_pipe.rendezvous`): ``ProcessGroupGloo`` for frames, one
  per direction, and on CUDA a second pair, ``ProcessGroupNCCL``, for payloads alone (the *split*
  channel, :mod:`kv_pipe.channel`): a payload's NCCL receive is posted only once its frame arrived
  over gloo and was validated, so an idle CUDA pipe holds no NCCL work, every wait on NCCL work is
  bounded by ``kv_timeout``, and a failed pipe aborts its NCCL groups and raises KVPeerLostError
  with the process alive. The default process group is never created, needed or touched.
* Each direction has a role, held by one thread at a time. The *sender* thread sends the units
  queued for it (and keepalives, credit, the close); the *receiver* thread receives the peer's
  frames while no caller does, validates them, takes their payloads in and queues the items for
  :meth:`recv_tensor`. A caller sends its own unit when nothing is queued ahead of it, and receives
  frames itself while no one else does, so a message costs no thread hand-off (two kernel wake-ups,
  about 100 µs). Which callers may, on each channel, is :mod:`kv_pipe.turns`; the frame layout and
  its checks are pure functions of :mod:`kv_pipe.protocol`.
* Any transport timeout closes gloo's connection for good, and an operation on the groups ends only
  once the peer has done its part (posted its receive, sent a frame), which a live peer does within
  the keepalive interval. So over the groups only a caller with twice that interval to spare waits
  in the transport, and only for frames (a payload waits for the wire); a caller in a hurry leaves
  it to the threads and waits on a queue, and its timeout leaves the pipe usable.
* The transport's own timeout is ``kv_timeout``, the liveness bound: each sender sends a keepalive
  frame whenever it has been quiet for a quarter of the shorter ``kv_timeout`` of the two sides, so
  a posted receive on a healthy connection always completes in time, an idle pipe stays healthy,
  and a dead or unreachable peer makes the receive fail within ``kv_timeout``.
* Memory is bounded by credit (:mod:`kv_pipe.credit`): ``send_tensor`` blocks while the bytes in
  flight would exceed the budget both sides agreed on, so the receiver can take frames in whether or
  not its user is receiving. A sender therefore waits in the transport for the wire only, never for
  the peer's user.
* On one host, payloads travel through shared memory (:mod:`kv_pipe.shared_memory`): one copy into
  the sender's segment, the receiver's tensor a view of it; frames travel over a local socket
  (:mod:`kv_pipe.channel`), which any caller may use whatever its timeout: a poll of the socket
  can end at a deadline. Frames, records, credit and every check are the same on both channels.
* On CUDA (NCCL) the device is the configured one (``kv_device_index``), never the calling thread's
  current device, and only the pipe's own threads issue NCCL operations, each on a stream of its own
  (:mod:`kv_pipe.device`): callers hand their units to the sender thread and take items from the
  receiver thread's queue, so no engine stream ever waits behind a pipe operation. Frames are host
  memory there too, and carry no tensor bytes: every non-empty tensor is a payload.
* Host-staged mode: a CPU pipe sends a caller's CUDA tensor by copying it once, on a stream of the
  caller's thread, straight into the pipe's memory (shared memory on one host, pinned for that copy
  when ``kv_device_index`` names the GPU).
* Headers are validated before any payload receive is posted (:mod:`kv_pipe.protocol`): gloo
  aborts the process if a message is larger than the receive buffer.
* Only the transport's errors mean a lost peer. A bug in the pipe's own threads fails the pipe and
  reaches every caller as itself.
"""

from __future__ import annotations

import collections
import enum
import logging
import math
import queue
import socket
import threading
import time
from collections.abc import Sequence

import torch

from kv_pipe import device as devices
from kv_pipe import rendezvous, shared_memory
from kv_pipe.base import KVPipeBase
from kv_pipe.channel import TAG_FRAME, TAG_PAYLOAD, GroupChannel, SocketChannel
from kv_pipe.config import KVTransferConfig
from kv_pipe.credit import CreditLedger
from kv_pipe.errors import (
    KVConfigError,
    KVPeerLostError,
    KVPipeClosedError,
    KVProtocolError,
    KVTimeoutError,
    KVTransferError,
)
from kv_pipe.exported_memory import ExportDescriptor, PeerMemory
from kv_pipe.failure import FailureLatch, fresh_error
from kv_pipe.protocol import (
    HEADER_BYTES,
    ITEM_KINDS,
    MAX_FREED_PER_RECORD,
    SHARED_MIN_BYTES,
    FrameHeader,
    FrameKind,
    Hello,
    Record,
    check_sendable,
    chunk_bounds,
    decode_frame,
    frame_length,
    lay_out_records,
    message_cost,
    record_inline_capacity,
)
from kv_pipe.turns import RECEIVER_PARK_SECONDS, GroupTurns, SocketTurns, ThreadTurns
from kv_pipe.wire import HostWire, flat_bytes

logger = logging.getLogger(__name__)

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


class _TransportError(Exception):
    """A torch.distributed send or receive failed: the peer is gone or the connection broke."""


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


class _Step(enum.Enum):
    FAILED = enum.auto()  # a step of a transfer failed the pipe (see TorchDistributedPipe._run)


class _Outgoing:
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


class TorchDistributedPipe(KVPipeBase):
    """FIFO tensor pipe between ``kv_rank`` 0 and 1 (see :class:`kv_pipe.KVPipeBase`).

    Construction blocks until the peer has connected (at most ``kv_connect_timeout``) and raises
    :class:`KVTransferError` subclasses naming the cause (no peer, incompatible peer, failed
    authentication).

    Args:
        config: this side's configuration; ``kv_rank`` must differ between the two sides, ``kv_ip``
            and ``kv_port`` must be equal.
        port_offset: added to ``kv_port``, so one process can hold several pipes. A pipe uses port
            ``kv_port + port_offset`` and reserves the next one for a lookup buffer's control
            channel: give pipes offsets that differ by at least 2.
        listener: rank 0 only: a socket already listening for the rendezvous (from
            :func:`kv_pipe.rendezvous.listen`, e.g. on a port the kernel picked); the pipe takes it
            over and its port replaces ``kv_port + port_offset``.
        split: whether payloads travel on groups of their own behind their frames (NCCL's layout);
            None: exactly on CUDA. True on a host pipe runs that layout on gloo, for tests: callers
            then leave every operation to the pipe's threads, as on NCCL, and the same-host path
            is off. Both sides must agree.
    """

    def __init__(self, config: KVTransferConfig, port_offset: int = 0, listener: socket.socket | None = None,
                 split: bool | None = None) -> None:
        config.validate()
        if listener is not None and config.kv_rank != 0:
            raise KVConfigError("only rank 0 listens for the rendezvous: a listener needs kv_rank 0")
        self.config = config
        self.port_offset = port_offset
        self.rank = config.kv_rank
        self.peer_rank = 1 - config.kv_rank
        self.port = config.kv_port + port_offset if listener is None else listener.getsockname()[1]
        if not 1 <= self.port <= 65535:
            raise KVConfigError(f"the pipe's port kv_port + port_offset = {self.port} is not a valid port")
        self.device = devices.select_device(config)
        split = self.device.type == "cuda" if split is None else split
        if self.device.type == "cuda" and not split:
            raise KVConfigError("a CUDA pipe always carries its payloads apart from its frames")
        if split and config.kv_shared_memory == "on":
            raise KVConfigError("kv_shared_memory='on' needs a host pipe whose payloads travel with its frames")
        self._streams = devices.pipe_streams(self.device)
        # Frames are host memory on every pipe: on CUDA they travel over gloo.
        self._wire = HostWire(torch.device("cpu"), max_idle_bytes=config.kv_buffer_size)
        hello = Hello(frame_bytes=self._wire.frame_bytes, max_in_flight=config.kv_buffer_size,
                      device=config.kv_buffer_device, timeout_ms=max(1, round(config.kv_timeout * 1000)),
                      gpu_id=devices.gpu_identity(self.device))
        with self._streams.context("setup"):  # NCCL set-up on the pipe's device and stream, not the caller's
            connection = rendezvous.connect(config, self.port, hello, self.device, listener, split)
        self._store = connection.store
        self._outgoing_group = connection.outgoing
        self._incoming_group = connection.incoming
        peer_hello = connection.peer_hello
        self._credit = CreditLedger(min(config.kv_buffer_size, peer_hello.max_in_flight))
        # A posted receive fails after the receiving side's kv_timeout: keepalives go often enough
        # for the shorter of the two.
        self._keepalive_interval = min(config.kv_timeout, peer_hello.timeout_ms / 1000) / 4
        try:
            with self._streams.context("setup"):
                # Over the frame groups (gloo, host memory); never on a split pipe.
                self._shared = shared_memory.establish(self._outgoing_group, self._incoming_group, self.rank,
                                                       "off" if split else config.kv_shared_memory,
                                                       self._credit.budget, torch.device("cpu"))
        except (RuntimeError, OSError) as exc:
            raise KVPeerLostError(f"pipe rank {self.rank}: the peer vanished during setup: {exc}") from exc
        if self._shared is not None:
            self._channel = SocketChannel(self._shared.connection, silence=config.kv_timeout)
        else:
            # Callers may post operations themselves on gloo (no thread hand-off per message), never
            # on NCCL: there an operation runs on the issuing thread's current stream.
            self._channel = GroupChannel(self._outgoing_group, self._incoming_group, self.peer_rank,
                                         callers_may_post=not split, settle=self._streams.synchronize,
                                         payload_groups=connection.payloads,
                                         silence=config.kv_timeout if split else None)
        # A frame's records carry their tensors' bytes only where payloads travel with frames.
        self._inline_payloads = not split
        self._pinned = self._pin_segments()
        # Regions of the peer's segment whose tensors died, to give back. Appended to by finalizers,
        # which may run in any thread at any moment: a deque's append and popleft are atomic.
        self._freed: collections.deque[int] = collections.deque()
        self._peer_exports: dict[ExportDescriptor, PeerMemory] = {}  # mapped once, kept while the pipe lives
        self._return_due: float | None = None  # when the sender thread sends pending credit and regions
        self._return_delay = RETURN_DELAY_SECONDS[0]  # how long before _return_due that was decided

        # Reentrant: a received tensor over shared memory may die, and tell the pipe, in any thread
        # at any moment, including inside the pipe's own critical sections (garbage collection).
        # Each wait has its own condition, so that an event wakes only the threads it concerns: a
        # caller waiting for an item woken by every transmission costs a wake-up per message.
        self._lock = threading.RLock()
        self._items = threading.Condition(self._lock)  # recv_tensor: an item, or the end of the stream
        self._room = threading.Condition(self._lock)  # send_tensor: credit
        self._credit_waiters: collections.deque[object] = collections.deque()  # senders waiting for credit, in turn
        self._transmitted = threading.Condition(self._lock)  # flush: messages on the wire
        # The sender thread sleeps on a queue, not a condition: a finalizer may ring it from inside any
        # lock (SimpleQueue.put is reentrant), and a ring between its look and its sleep is not lost.
        self._sender_doorbell: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._receiver_parked = threading.Condition(self._lock)  # the receiver thread, while callers receive
        self._failure = FailureLatch()  # the first fatal error, and close()
        self._final_frame_queued = False  # CLOSE or CLOSE_ACK queued: nothing may follow it
        self._peer_finished = False  # the peer sent CLOSE or CLOSE_ACK
        self._send_queue: collections.deque[list[_Outgoing]] = collections.deque()
        self._queued_messages = 0
        self._sent_messages = 0
        self._next_send_seq = 0
        self._last_sent = time.monotonic()
        self._recv_queue: collections.deque[tuple[torch.Tensor | None, int]] = collections.deque()
        self._next_recv_seq = 0
        self._last_received = time.monotonic()
        # On a local socket a caller sends or receives frames itself when nobody else is: whoever
        # holds a role is the only one using that direction of the channel.
        self._send_role = threading.Lock()
        self._recv_role = threading.Lock()
        self._turns = self._make_turns()

        name = f"kvbridge-pipe-{self.port}-r{self.rank}"
        self._sender = threading.Thread(target=self._send_loop, name=f"{name}-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name=f"{name}-recv", daemon=True)
        self._sender.start()
        self._receiver.start()
        logger.info("pipe rank %d <-> %d up on %s:%d (%s, in-flight budget %d bytes, payloads %s)", self.rank,
                    self.peer_rank, config.kv_ip, self.port, self.device, self._credit.budget,
                    "through shared memory" if self.uses_shared_memory else "over the transport")

    # ------------------------------------------------------------------ public API

    @property
    def max_tensor_bytes(self) -> int:
        return self._credit.budget - message_cost(0)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A new tensor to fill and send: on the same-host path it lies in this side's shared-memory
        segment, and :meth:`send_tensor` hands it to the peer without copying it; otherwise it is
        pooled memory of the pipe's device (warm pages: fresh ones cost more than the wire), and a
        host tensor is sent from where it lies, with its frame's header written in front of it.

        Once sent, its memory is also the peer's tensor: do not modify it after sending. Its region
        is reused only once both the peer's tensor and every local reference to it have died.
        Thread-safe.
        """
        shape = tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        shared = self._shared  # close() may drop it meanwhile
        if shared is not None and nbytes >= SHARED_MIN_BYTES:
            lent = shared.lend(shape, dtype)
            if lent is not None:
                return lent
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=self.device)
        return self._wire.allocate_to_send(nbytes).view(dtype).reshape(shape)

    @property
    def host_staged_device(self) -> torch.device | None:
        """The GPU this host pipe stages KV for (``kv_device_index`` on a CPU pipe), or None."""
        index = self.config.kv_device_index
        if self.device.type != "cpu" or index is None or not torch.cuda.is_available():
            return None
        return torch.device("cuda", index)

    def _pin_segments(self) -> list[int]:
        """Host-staged mode on one host: pin both shared-memory segments for the GPU's copies (the
        caller's device-to-host copy lands in this side's segment, the peer's is read by its
        host-to-device copy), so that each is one DMA transfer. The addresses pinned."""
        if self._shared is None or self.host_staged_device is None:
            return []
        return [segment.address for segment in (self._shared.own, self._shared.peer)
                if devices.pin_host_memory(segment.address, segment.nbytes)]

    @property
    def uses_shared_memory(self) -> bool:
        """Whether the same-host path is up: payloads through shared memory and frames over a local
        socket, in both directions (see ``kv_shared_memory``)."""
        return self._shared is not None

    def map_peer_memory(self, descriptor: ExportDescriptor) -> PeerMemory:
        shared = self._shared  # close() may drop it meanwhile
        if shared is None:
            return super().map_peer_memory(descriptor)
        with self._lock:
            mapped = self._peer_exports.get(descriptor)
        if mapped is None:
            mapped = PeerMemory.open(shared.peer_pid, descriptor)  # outside the lock: it may take a while
            with self._lock:
                mapped = self._peer_exports.setdefault(descriptor, mapped)
        return mapped

    def send_tensor(self, tensor: torch.Tensor | None, timeout: float | None = None) -> None:
        self._queue_unit([self._outgoing(tensor)], timeout, _deadline(timeout))

    def send_tensors(self, tensors: Sequence[torch.Tensor | None], timeout: float | None = None) -> None:
        unit = [self._outgoing(tensor) for tensor in tensors]
        deadline = _deadline(timeout)
        if sum(message.cost for message in unit) <= self._credit.budget:
            if unit:
                self._queue_unit(unit, timeout, deadline)
            return
        for message in unit:  # more than the budget at once: it cannot travel as one unit
            self._queue_unit([message], timeout, deadline)

    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor | None:
        deadline = _deadline(timeout)
        while True:
            with self._lock:
                if self._recv_queue:
                    tensor, cost = self._recv_queue.popleft()
                    self._credit.take(cost)
                    self._report_credit()
                    self._streams.hand_over(tensor)
                    return tensor
                self._failure.raise_if_failed()
                if self._peer_finished:
                    raise KVPipeClosedError("the peer closed the pipe; nothing more will arrive")
                if self._failure.closed:
                    raise KVPipeClosedError("recv_tensor on a closed pipe")
                may_receive_here = self._turns.may_receive_here(deadline)
                receive_here = may_receive_here and self._recv_role.acquire(blocking=False)
                if not receive_here and not self._wait_for_an_item(may_receive_here, deadline):
                    raise KVTimeoutError(f"recv_tensor: nothing arrived within {timeout:g} s")
                if receive_here:
                    self._turns.caller_took_role()
            if receive_here:
                try:
                    arrived = self._receive_until_an_item(deadline)
                finally:
                    self._recv_role.release()
                    with self._lock:
                        if self._turns.caller_left_role():
                            self._receiver_parked.notify()
                if arrived is CallerReceive.TIMED_OUT:
                    with self._lock:
                        if not self._recv_queue:
                            self._failure.raise_if_failed()
                            raise KVTimeoutError(f"recv_tensor: nothing arrived within {timeout:g} s")

    def _wait_for_an_item(self, may_receive_here: bool, deadline: float | None) -> bool:
        """Wait for an item, the end of the stream, or (``may_receive_here``) the receive role to
        come free; False once ``deadline`` passed (hold ``_lock``)."""
        self._turns.caller_waits(for_role=may_receive_here)
        if not may_receive_here:
            self._receiver_parked.notify()  # this caller waits for the receiver thread
        try:
            return _wait(self._items, deadline)
        finally:
            self._turns.caller_stops_waiting(for_role=may_receive_here)

    def flush(self, timeout: float | None = None) -> None:
        deadline = _deadline(timeout)
        with self._lock:
            while self._sent_messages < self._queued_messages:
                self._failure.raise_if_failed()
                if not _wait(self._transmitted, deadline):
                    raise KVTimeoutError(f"flush: queued tensors were not sent within {timeout:g} s")

    def close(self) -> None:
        with self._lock:
            if not self._failure.close():
                return
            if self._failure.error is None and not self._final_frame_queued:
                self._queue_final_frame(FrameKind.CLOSE)
            self._wake_callers()
        # Both threads end once the peer has answered CLOSE; a dead peer ends them with an error
        # within kv_timeout (the keepalive bound), so these joins are bounded.
        bound = self.config.kv_timeout * 2
        end = time.monotonic() + bound
        self._sender.join(bound)
        self._receiver.join(max(0.0, end - time.monotonic()))
        if self._sender.is_alive() or self._receiver.is_alive():
            # A thread blocked inside the transport cannot be interrupted; it is a daemon and holds
            # no lock. The groups stay referenced: destroying them under a pending operation is not safe.
            logger.warning("pipe rank %d: transfer threads did not stop within %.1f s", self.rank, bound)
        else:
            self._outgoing_group = self._incoming_group = None
            self._channel.close()
            self._store = None
            for address in self._pinned:  # before the segments can be unmapped
                devices.unpin_host_memory(address)
            self._pinned = []
            self._shared = None  # received tensors keep the peer's segment mapped while they live
        with self._lock:
            unsent = self._queued_messages - self._sent_messages
            lost = unsent > 0 or not isinstance(self._failure.error, KVTransferError)  # a bug surfaces anyway
            error = self._failure.unreported() if lost else None
            if isinstance(error, KVTransferError):
                raise KVTransferError(f"close: {unsent} queued message(s) were never sent") from error
            if error is not None:
                raise fresh_error(error)

    # ------------------------------------------------------------------ sending (callers)

    def _outgoing(self, tensor: torch.Tensor | None) -> _Outgoing:
        if tensor is None:
            return _Outgoing(FrameKind.NONE)
        check_sendable(tensor)
        if tensor.nbytes > self.max_tensor_bytes:
            raise KVTransferError(
                f"a {tensor.nbytes}-byte tensor exceeds the pipe's limit of {self.max_tensor_bytes} bytes "
                f"(max_tensor_bytes: the smaller kv_buffer_size of the two sides, less bookkeeping)"
            )
        # Contiguous, on the pipe's device, and memory that holds exactly the tensor's values.
        tensor = tensor.detach().resolve_conj().resolve_neg()
        if tensor.device.type != "cpu" and self.device.type == "cpu":
            # Host-staged: one copy from the GPU straight into the pipe's memory (on one host, a
            # region of the shared-memory segment that is sent without another copy).
            data = self.empty(tensor.shape, tensor.dtype)
            devices.copy_between(data, tensor)
            return _Outgoing(FrameKind.TENSOR, data)
        data = tensor.to(self.device).contiguous()
        return _Outgoing(FrameKind.TENSOR, data, self._streams.ready_event(data))

    def _queue_unit(self, unit: list[_Outgoing], timeout: float | None, deadline: float | None) -> None:
        """Queue ``unit`` for the sender thread once the budget has room for it, waiting until
        ``deadline`` (``timeout`` seconds after the user's call began)."""
        cost = sum(message.cost for message in unit)
        with self._lock:
            self._raise_if_unusable_for_send()
            if self._credit_waiters or not self._credit.has_room(cost):
                self._wait_for_credit(cost, timeout, deadline)
            self._credit.reserve(cost)
            self._queued_messages += len(unit)
            tensors = [message.data for message in unit if message.kind is FrameKind.TENSOR]
            if not (not self._send_queue and self._turns.may_send_here(tensors, deadline)
                    and self._send_role.acquire(blocking=False)):
                self._send_queue.append(unit)
                self._sender_doorbell.put(None)
                return
            # Nothing is queued ahead of this unit and no one else is sending: send it from here.
            prepared = self._run(self._prepare_own_unit, unit, action="sending")
            if prepared is _Step.FAILED:
                self._send_role.release()
                self._failure.raise_if_failed()
                return
        try:
            self._send_unit(*prepared)
        finally:
            self._send_role.release()
        self._failure.raise_if_failed()

    def _wait_for_credit(self, cost: int, timeout: float | None, deadline: float | None) -> None:
        """Wait until the budget has room for a unit of ``cost`` and no sender that waited longer is
        still waiting (hold ``_lock``). Credit goes to senders in the order they asked for it, so a
        large unit is not overtaken for ever by another thread's stream of small ones."""
        turn = object()
        self._credit_waiters.append(turn)
        try:
            while True:
                if self._credit_waiters[0] is turn:
                    if self._credit.has_room(cost):
                        return
                    if self._credit.ask():
                        self._sender_doorbell.put(None)  # the sender thread tells the peer we are waiting
                if not _wait(self._room, deadline):
                    raise KVTimeoutError(
                        f"send_tensor: the in-flight budget of {self._credit.budget} bytes stayed full "
                        f"for {timeout:g} s (the peer is not taking what was sent)"
                    )
                self._raise_if_unusable_for_send()
        finally:
            if self._credit_waiters[0] is turn and len(self._credit_waiters) > 1:
                self._room.notify_all()  # the next in line may find room at once
            self._credit_waiters.remove(turn)

    def _make_turns(self) -> ThreadTurns:
        """Who sends and receives on this pipe's channel (see :mod:`kv_pipe.turns`)."""
        if not self._channel.callers_may_post:
            return ThreadTurns()
        if self._channel.interruptible:
            return SocketTurns(self._shared.room_for)
        return GroupTurns(self._keepalive_interval, record_inline_capacity(self._wire.frame_bytes, 0))

    def _prepare_own_unit(self, unit: list[_Outgoing]) -> tuple[list[tuple[int, FrameHeader]], list[_Outgoing]]:
        """Headers for a unit a caller sends itself, with the regions to give back (hold ``_lock``)."""
        record, freed = self._take_freed()
        unit = unit if record is None else [record, *unit]
        return self._frame_headers(unit, freed), unit

    def _raise_if_unusable_for_send(self) -> None:
        self._failure.raise_if_unusable("send_tensor on a closed pipe")
        if self._final_frame_queued or self._peer_finished:
            raise KVPipeClosedError("the peer closed the pipe; nothing more can be sent")

    # ------------------------------------------------------------------ sender thread

    def _send_loop(self) -> None:
        with self._streams.context("send"):
            self._send_frames()

    def _send_frames(self) -> None:
        while True:
            if not self._wait_for_work():
                return
            with self._send_role:  # a caller may be sending: the work may be gone once it is done
                prepared = self._run(self._prepare_next_unit, action="sending")
                if prepared is _Step.FAILED:
                    return
                if prepared is None:
                    continue
                laid_out, unit = prepared
                if not self._send_unit(laid_out, unit):
                    return
            if unit[0].kind in _FINAL_KINDS:
                return

    def _prepare_next_unit(self) -> tuple[list[tuple[int, FrameHeader]], list[_Outgoing]] | None:
        """The next unit the sender thread sends, with its headers; None if nothing is due."""
        with self._lock:
            found = self._next_unit()
            if found is None:
                return None
            unit, freed = found
            return self._frame_headers(unit, freed), unit

    def _send_unit(self, laid_out: list[tuple[int, FrameHeader]], unit: list[_Outgoing]) -> bool:
        """Transmit a unit (hold the send role); False if the pipe failed."""
        if self._run(self._transmit, laid_out, unit, action="sending") is _Step.FAILED:
            return False
        counted = sum(message.kind in _COUNTED_KINDS for message in unit)
        with self._lock:
            self._last_sent = time.monotonic()
            if counted:
                self._sent_messages += counted
                self._transmitted.notify_all()
        return True

    def _wait_for_work(self) -> bool:
        """Wait until something is to be sent; False once the pipe failed."""
        while True:
            with self._lock:
                if self._failure.error is not None:
                    return False
                if self._send_queue or self._credit.report_urgent():
                    return True
                now = time.monotonic()
                if self._freed and self._return_due is None:  # regions given back by finalizers
                    self._return_due = now + self._return_delay
                if self._return_due is not None and now >= self._return_due:
                    pending = self._freed or self._credit.frame_due()
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
                quiet_left = self._last_sent + self._keepalive_interval - now
                if quiet_left <= 0:
                    return True
                due_left = quiet_left if self._return_due is None else min(quiet_left, self._return_due - now)
            try:
                self._sender_doorbell.get(timeout=due_left)
                while True:  # one look serves every ring so far
                    self._sender_doorbell.get_nowait()
            except queue.Empty:
                pass

    def _next_unit(self) -> tuple[list[_Outgoing], int] | None:
        """The next unit to send, or a keepalive if one is due, with the region its first header gives
        back (hold ``_lock``); None if nothing is due."""
        if self._freed and (not self._send_queue or self._send_queue[0][0].kind in _FINAL_KINDS):
            return [self._freed_record()], 0  # a final frame goes alone: nothing may share its frame
        if self._send_queue:
            record, freed = self._take_freed()
            unit = self._send_queue.popleft()
            return (unit if record is None else [record, *unit]), freed
        if self._last_sent + self._keepalive_interval <= time.monotonic() or self._credit.frame_due():
            return [_Outgoing(FrameKind.KEEPALIVE)], 0
        return None

    def _take_freed(self) -> tuple[_Outgoing | None, int]:
        """Regions of the peer's segment to give back with the next unit (hold ``_lock``): one alone
        rides in the unit's first header, several go in a FREED record ahead of it."""
        if len(self._freed) == 1:  # finalizers only append, and only lock holders take
            return None, self._freed.popleft()
        return self._freed_record(), 0

    def _freed_record(self) -> _Outgoing | None:
        """A FREED record for regions of the peer's segment whose tensors died, if any (hold ``_lock``)."""
        if not self._freed:
            return None
        places = [self._freed.popleft() for _ in range(min(len(self._freed), MAX_FREED_PER_RECORD))]
        return _Outgoing(FrameKind.FREED, torch.tensor(places, dtype=torch.int64))

    def _region_freed(self, place: int) -> None:
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
            self._sender_doorbell.put(None)

    def _report_credit(self) -> None:
        """Have the credit this side owes the peer sent: now if asked for, else soon (hold ``_lock``)."""
        if self._credit.report_urgent():
            self._sender_doorbell.put(None)
        elif self._credit.frame_due():
            self._return_soon()

    def _return_soon(self) -> None:
        """Credit or regions are to go back to the peer: within the return delay (hold ``_lock``)."""
        if self._return_due is None:
            self._return_due = time.monotonic() + self._return_delay
            self._sender_doorbell.put(None)

    def _frame_headers(self, unit: list[_Outgoing], freed: int = 0) -> list[tuple[int, FrameHeader]]:
        """Where each record of ``unit`` starts in its frame and its header, the first giving back
        region ``freed`` (hold ``_lock``): payloads from SHARED_MIN_BYTES take a region of this
        side's shared-memory segment first."""
        consumed, want_credit = self._credit.report()
        records = []
        for message in unit:
            record = Record(message.kind, nbytes=message.nbytes)
            if message.data is not None:
                record.dtype, record.shape = message.data.dtype, tuple(message.data.shape)
                if (message.kind is FrameKind.TENSOR and message.nbytes >= SHARED_MIN_BYTES
                        and self._shared is not None):
                    record.place = self._shared.take_lent(message.data)
                    message.in_place = bool(record.place)
                    record.place = record.place or self._shared.place(message.nbytes)
            records.append(record)
        laid_out = lay_out_records(records, self._wire.frame_bytes, self._inline_payloads, self._next_send_seq,
                                   consumed, want_credit, freed)
        self._next_send_seq += sum(message.kind in ITEM_KINDS for message in unit)
        return laid_out

    def _transmit(self, laid_out: list[tuple[int, FrameHeader]], unit: list[_Outgoing]) -> None:
        """Send the unit's frames and payloads: each frame with its payloads posted together, then
        waited for (the frame is written again next)."""
        payloads = []  # tensors of this frame's records that do not fit inside it
        for (offset, header), message in zip(laid_out, unit, strict=True):
            if message.ready is not None:  # CUDA: the caller's stream made the data; this stream waits for it
                self._streams.wait_ready(message.ready)
                message.ready = None
            self._wire.write_record(offset, header, message.data)
            if header.place:
                if not message.in_place:
                    self._shared.write(header.place, flat_bytes(message.data))
            elif header.kind is FrameKind.TENSOR and not header.inline:
                payloads.append(flat_bytes(message.data))
            message.data = None  # the caller's tensor is released as soon as it is on the wire
            if header.more:
                continue
            try:  # torch.distributed's errors derive from RuntimeError
                posted = [self._channel.post(self._wire.frame_to_send(frame_length(offset, header)), TAG_FRAME)]
                for flat in payloads:
                    posted += [self._channel.post(flat[start:end], TAG_PAYLOAD)
                               for start, end in chunk_bounds(flat.numel())]
                for handle in posted:
                    if handle is not None:
                        self._channel.finish(handle)
            except (RuntimeError, OSError) as exc:
                raise _TransportError(exc) from exc
            payloads.clear()

    def _queue_final_frame(self, kind: FrameKind) -> None:
        """Queue CLOSE or CLOSE_ACK, after which this side sends nothing (hold ``_lock``)."""
        self._final_frame_queued = True
        self._queued_messages += 1
        self._send_queue.append([_Outgoing(kind)])
        self._sender_doorbell.put(None)

    # ------------------------------------------------------------------ receiver thread

    def _recv_loop(self) -> None:
        """Take in what arrives while no caller is receiving it."""
        with self._streams.context("recv"):
            self._receive_frames()

    def _receive_frames(self) -> None:
        while True:
            with self._lock:
                while not self._peer_finished and self._failure.error is None:
                    pause = self._turns.receiver_pause()
                    if not pause:
                        break
                    self._receiver_parked.wait(pause)
                if self._peer_finished or self._failure.error is not None:
                    return
            self._channel.readable(min(self._keepalive_interval, self._last_received + self.config.kv_timeout
                                       - time.monotonic()))
            if self._turns.receiving or not self._recv_role.acquire(blocking=False):
                continue
            try:
                if self._peer_finished or self._failure.error is not None:
                    return
                while (self._run(self._receive_frame, time.monotonic(), action="receiving") is Frame.TAKEN
                       and not self._turns.receiver_yields()):
                    pass
            finally:
                self._recv_role.release()
                with self._lock:
                    if self._turns.receiver_left_role():  # a caller waited for the role meanwhile
                        self._items.notify_all()

    def _receive_until_an_item(self, deadline: float | None) -> CallerReceive:
        """Receive frames here (hold the receive role) until an item, the end of the stream or a
        failure is queued, or until ``deadline``.

        It looks at the pipe's state at least every RECEIVER_PARK_SECONDS, so that a failure
        elsewhere (which cannot wake a poll) reaches it soon."""
        wait_until = math.inf if deadline is None else deadline
        started = time.monotonic()
        spin = self._turns.spin
        while True:
            with self._lock:
                if self._recv_queue or self._peer_finished or self._failure.error is not None:
                    return CallerReceive.READY
                if not self._turns.may_receive_here(deadline):
                    return CallerReceive.LEAVE_TO_THREAD
            outcome = self._run(self._receive_frame, min(wait_until, time.monotonic() + RECEIVER_PARK_SECONDS),
                                spin, action="receiving")
            if outcome is Frame.NONE_YET:
                if time.monotonic() >= wait_until:
                    return CallerReceive.TIMED_OUT
                spin = 0.0  # the poll was spun once already
                continue
            spin = self._turns.frame_waited(self._last_received - started)
            started = time.monotonic()

    def _receive_frame(self, wait_until: float, spin: float = 0.0) -> Frame:
        """Receive one frame, if one starts by the monotonic time ``wait_until`` (a receive on the
        groups lasts until a frame comes), and queue what it carries."""
        if not self._recv_frame_by(wait_until, spin):
            return Frame.NONE_YET
        first, items = self._receive_records()
        self._streams.synchronize()  # CUDA: the items are complete before any caller sees them
        with self._lock:
            if self._credit.on_frame(first.consumed, first.want_credit):
                self._room.notify_all()
            self._recv_queue.extend(items)
            if first.kind is FrameKind.CLOSE:
                self._peer_finished = True
                if not self._final_frame_queued and self._failure.error is None:
                    self._queue_final_frame(FrameKind.CLOSE_ACK)
            elif first.kind is FrameKind.CLOSE_ACK:
                self._peer_finished = True
            if self._peer_finished:
                self._wake_callers()  # senders waiting for credit too: none will come any more
            elif items:
                self._items.notify_all()
            self._report_credit()
            return Frame.ENDED if self._peer_finished else Frame.TAKEN

    def _receive_records(self) -> tuple[FrameHeader, list[tuple[torch.Tensor | None, int]]]:
        """Validate the received frame's records and take in their items, payloads included.

        Returns the first record's header (credit, and the frame kind for control frames) and the
        items with their costs, in order.
        """
        records = decode_frame(self._wire.received_frame(), self._inline_payloads, self._credit.budget,
                               self._shared.peer_bytes if self._shared is not None else 0, self._next_recv_seq)
        items = []
        for offset, header in records:
            if header.freed:
                self._shared.release([header.freed])
            if header.kind is FrameKind.FREED:
                self._shared.release(self._wire.read_inline(offset + HEADER_BYTES, header).tolist())
            elif header.kind in ITEM_KINDS:
                items.append((self._receive_item(header, offset), message_cost(header.nbytes)))
        self._next_recv_seq += len(items)
        return records[0][1], items

    def _receive_item(self, header: FrameHeader, offset: int) -> torch.Tensor | None:
        if header.kind is FrameKind.NONE:
            return None
        if header.nbytes == 0:
            return torch.empty(header.shape, dtype=header.dtype, device=self.device)
        if header.inline:
            return self._wire.read_inline(offset + HEADER_BYTES, header)
        if header.place:
            return self._shared.view(header.place, header.dtype, header.shape, self._region_freed)
        if self.device.type != "cpu":
            data = torch.empty(header.nbytes, dtype=torch.uint8, device=self.device)
        else:
            data = self._wire.allocate(header.nbytes)
        for start, end in chunk_bounds(header.nbytes):
            self._recv(data[start:end], TAG_PAYLOAD)
            self._last_received = time.monotonic()  # a long payload is the peer's sign of life too
        return data.view(header.dtype).reshape(header.shape)

    def _recv(self, tensor: torch.Tensor, tag: int) -> None:
        try:
            self._channel.recv(tensor, tag)
        except (RuntimeError, OSError) as exc:  # torch.distributed's errors derive from RuntimeError
            raise _TransportError(exc) from exc

    def _recv_frame_by(self, wait_until: float, spin: float) -> bool:
        """Receive a frame from the local socket if one starts by ``wait_until``; a peer silent for
        kv_timeout is lost, as over the transport."""
        silent_at = self._last_received + self.config.kv_timeout
        try:
            arrived = self._channel.recv_frame_by(self._wire.frame_to_receive(), min(wait_until, silent_at), spin)
        except (RuntimeError, OSError) as exc:
            raise _TransportError(exc) from exc
        now = time.monotonic()
        if arrived:
            self._last_received = now
        elif now >= silent_at:
            silence = TimeoutError(f"the peer sent nothing for kv_timeout={self.config.kv_timeout:g} s")
            raise _TransportError(silence) from silence
        return arrived

    # ------------------------------------------------------------------ both threads

    def _run(self, step, *args, action: str):
        """Run one step of a transfer; its result, or _Step.FAILED once it failed the pipe."""
        try:
            return step(*args)
        except _TransportError as exc:
            self._fail(KVPeerLostError(
                f"pipe rank {self.rank}: connection to rank {self.peer_rank} lost while {action} (the peer "
                f"exited, was killed, or was silent for kv_timeout={self.config.kv_timeout:g} s): {exc.__cause__}"
            ))
        except KVProtocolError as exc:
            self._fail(exc)
        except BaseException as exc:  # a bug in the pipe: it surfaces as itself, the pipe fails cleanly
            logger.exception("pipe rank %d: internal error while %s", self.rank, action)
            self._fail(exc)
        return _Step.FAILED

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            # Closing, the pipe still fails until the peer answered CLOSE (messages may be unsent).
            first = self._failure.fail(error, after_close=not self._peer_finished)
            if first:
                if isinstance(error, KVTransferError):
                    logger.error("%s", error)
            self._wake_callers()
            self._sender_doorbell.put(None)
        if first:
            # No payload operation may stay posted once the pipe failed (on NCCL it would hold the
            # device, and the other thread may be waiting in one): outside the lock, as it may take
            # a moment.
            self._channel.abort()

    def _wake_callers(self) -> None:
        """Wake every caller waiting in the pipe: the pipe failed, is closing, or the peer finished
        (hold ``_lock``)."""
        for condition in (self._items, self._room, self._transmitted, self._receiver_parked):
            condition.notify_all()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _wait(condition: threading.Condition, deadline: float | None) -> bool:
    """Wait on ``condition`` for a state change; False once ``deadline`` has passed."""
    if deadline is None:
        condition.wait()
        return True
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return False
    condition.wait(remaining)
    return True

