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
import socket
import threading
import time
from collections.abc import Sequence

import torch

from kv_pipe import device as devices
from kv_pipe import rendezvous, shared_memory
from kv_pipe.base import KVPipeBase
from kv_pipe.channel import TAG_PAYLOAD, GroupChannel, SocketChannel
from kv_pipe.config import KVTransferConfig
from kv_pipe.credit import CreditLedger
from kv_pipe.errors import KVConfigError, KVPeerLostError, KVPipeClosedError, KVTimeoutError, KVTransferError
from kv_pipe.exported_memory import ExportDescriptor, PeerMemory
from kv_pipe.failure import fresh_error
from kv_pipe.pipe_state import PipeState, TransportError, deadline_after, wait_on
from kv_pipe.protocol import (
    HEADER_BYTES,
    ITEM_KINDS,
    SHARED_MIN_BYTES,
    FrameHeader,
    FrameKind,
    Hello,
    check_sendable,
    chunk_bounds,
    decode_frame,
    message_cost,
)
from kv_pipe.sender import Outgoing, Sender
from kv_pipe.turns import RECEIVER_PARK_SECONDS
from kv_pipe.wire import HostWire

logger = logging.getLogger(__name__)


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

    def __init__(
        self,
        config: KVTransferConfig,
        port_offset: int = 0,
        listener: socket.socket | None = None,
        split: bool | None = None,
    ) -> None:
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
        streams = devices.pipe_streams(self.device)
        # Frames are host memory on every pipe: on CUDA they travel over gloo.
        wire = HostWire(torch.device("cpu"), max_idle_bytes=config.kv_buffer_size)
        hello = Hello(
            frame_bytes=wire.frame_bytes,
            max_in_flight=config.kv_buffer_size,
            device=config.kv_buffer_device,
            timeout_ms=max(1, round(config.kv_timeout * 1000)),
            gpu_id=devices.gpu_identity(self.device),
        )
        with streams.context("setup"):  # NCCL set-up on the pipe's device and stream, not the caller's
            connection = rendezvous.connect(config, self.port, hello, self.device, listener, split)
        self._store = connection.store
        self._outgoing_group = connection.outgoing
        self._incoming_group = connection.incoming
        peer_hello = connection.peer_hello
        credit = CreditLedger(min(config.kv_buffer_size, peer_hello.max_in_flight))
        # A posted receive fails after the receiving side's kv_timeout: keepalives go often enough
        # for the shorter of the two.
        keepalive_interval = min(config.kv_timeout, peer_hello.timeout_ms / 1000) / 4
        try:
            with streams.context("setup"):
                # Over the frame groups (gloo, host memory); never on a split pipe.
                shared = shared_memory.establish(
                    self._outgoing_group,
                    self._incoming_group,
                    self.rank,
                    "off" if split else config.kv_shared_memory,
                    credit.budget,
                    torch.device("cpu"),
                )
        except (RuntimeError, OSError) as exc:
            raise KVPeerLostError(f"pipe rank {self.rank}: the peer vanished during setup: {exc}") from exc
        if shared is not None:
            channel = SocketChannel(shared.connection, silence=config.kv_timeout)
        else:
            # Callers may post operations themselves on gloo (no thread hand-off per message), never
            # on NCCL: there an operation runs on the issuing thread's current stream.
            channel = GroupChannel(
                self._outgoing_group,
                self._incoming_group,
                self.peer_rank,
                callers_may_post=not split,
                settle=streams.synchronize,
                payload_groups=connection.payloads,
                silence=config.kv_timeout if split else None,
            )
        self._state = PipeState(config, streams, wire, channel, credit, shared, keepalive_interval, split)
        self._pinned = self._pin_segments()
        self._peer_exports: dict[ExportDescriptor, PeerMemory] = {}  # mapped once, kept while the pipe lives
        self._sender = Sender(self._state)
        self._receiver_parked = self._state.condition()  # the receiver thread, while callers receive
        self._items = self._state.condition()  # recv_tensor: an item, or the end of the stream
        self._recv_queue: collections.deque[tuple[torch.Tensor | None, int]] = collections.deque()
        self._next_recv_seq = 0
        self._last_received = time.monotonic()
        # On a local socket a caller receives frames itself when nobody else is: whoever holds the
        # role is the only one using that direction of the channel.
        self._recv_role = threading.Lock()

        name = f"kvbridge-pipe-{self.port}-r{self.rank}"
        self._sender_thread = threading.Thread(target=self._sender.run, name=f"{name}-send", daemon=True)
        self._receiver_thread = threading.Thread(target=self._recv_loop, name=f"{name}-recv", daemon=True)
        self._sender_thread.start()
        self._receiver_thread.start()
        logger.info(
            "pipe rank %d <-> %d up on %s:%d (%s, in-flight budget %d bytes, payloads %s)",
            self.rank,
            self.peer_rank,
            config.kv_ip,
            self.port,
            self.device,
            credit.budget,
            "through shared memory" if self.uses_shared_memory else "over the transport",
        )

    # ------------------------------------------------------------------ public API

    @property
    def max_tensor_bytes(self) -> int:
        return self._state.credit.budget - message_cost(0)

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
        shared = self._state.shared  # close() may drop it meanwhile
        if shared is not None and nbytes >= SHARED_MIN_BYTES:
            lent = shared.lend(shape, dtype)
            if lent is not None:
                return lent
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=self.device)
        return self._state.wire.allocate_to_send(nbytes).view(dtype).reshape(shape)

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
        if self._state.shared is None or self.host_staged_device is None:
            return []
        return [
            segment.address
            for segment in (self._state.shared.own, self._state.shared.peer)
            if devices.pin_host_memory(segment.address, segment.nbytes)
        ]

    @property
    def uses_shared_memory(self) -> bool:
        """Whether the same-host path is up: payloads through shared memory and frames over a local
        socket, in both directions (see ``kv_shared_memory``)."""
        return self._state.shared is not None

    def map_peer_memory(self, descriptor: ExportDescriptor) -> PeerMemory:
        shared = self._state.shared  # close() may drop it meanwhile
        if shared is None:
            return super().map_peer_memory(descriptor)
        with self._state.lock:
            mapped = self._peer_exports.get(descriptor)
        if mapped is None:
            mapped = PeerMemory.open(shared.peer_pid, descriptor)  # outside the lock: it may take a while
            with self._state.lock:
                mapped = self._peer_exports.setdefault(descriptor, mapped)
        return mapped

    def send_tensor(self, tensor: torch.Tensor | None, timeout: float | None = None) -> None:
        self._sender.queue_unit([self._outgoing(tensor)], timeout, deadline_after(timeout))

    def send_tensors(self, tensors: Sequence[torch.Tensor | None], timeout: float | None = None) -> None:
        unit = [self._outgoing(tensor) for tensor in tensors]
        deadline = deadline_after(timeout)
        if sum(message.cost for message in unit) <= self._state.credit.budget:
            if unit:
                self._sender.queue_unit(unit, timeout, deadline)
            return
        for message in unit:  # more than the budget at once: it cannot travel as one unit
            self._sender.queue_unit([message], timeout, deadline)

    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor | None:
        deadline = deadline_after(timeout)
        while True:
            with self._state.lock:
                if self._recv_queue:
                    tensor, cost = self._recv_queue.popleft()
                    self._state.credit.take(cost)
                    self._sender.report_credit()
                    self._state.streams.hand_over(tensor)
                    return tensor
                self._state.failure.raise_if_failed()
                if self._state.peer_finished:
                    raise KVPipeClosedError("the peer closed the pipe; nothing more will arrive")
                if self._state.failure.closed:
                    raise KVPipeClosedError("recv_tensor on a closed pipe")
                may_receive_here = self._state.turns.may_receive_here(deadline)
                receive_here = may_receive_here and self._recv_role.acquire(blocking=False)
                if not receive_here and not self._wait_for_an_item(may_receive_here, deadline):
                    raise KVTimeoutError(f"recv_tensor: nothing arrived within {timeout:g} s")
                if receive_here:
                    self._state.turns.caller_took_role()
            if receive_here:
                try:
                    arrived = self._receive_until_an_item(deadline)
                finally:
                    self._recv_role.release()
                    with self._state.lock:
                        if self._state.turns.caller_left_role():
                            self._receiver_parked.notify()
                if arrived is CallerReceive.TIMED_OUT:
                    with self._state.lock:
                        if not self._recv_queue:
                            self._state.failure.raise_if_failed()
                            raise KVTimeoutError(f"recv_tensor: nothing arrived within {timeout:g} s")

    def _wait_for_an_item(self, may_receive_here: bool, deadline: float | None) -> bool:
        """Wait for an item, the end of the stream, or (``may_receive_here``) the receive role to
        come free; False once ``deadline`` passed (hold the lock)."""
        self._state.turns.caller_waits(for_role=may_receive_here)
        if not may_receive_here:
            self._receiver_parked.notify()  # this caller waits for the receiver thread
        try:
            return wait_on(self._items, deadline)
        finally:
            self._state.turns.caller_stops_waiting(for_role=may_receive_here)

    def flush(self, timeout: float | None = None) -> None:
        self._sender.flush(timeout)

    def close(self) -> None:
        with self._state.lock:
            if not self._state.failure.close():
                return
            if self._state.failure.error is None and not self._state.final_frame_queued:
                self._sender.queue_final_frame(FrameKind.CLOSE)
            self._state.wake_callers()
        # Both threads end once the peer has answered CLOSE; a dead peer ends them with an error
        # within kv_timeout (the keepalive bound), so these joins are bounded.
        bound = self.config.kv_timeout * 2
        end = time.monotonic() + bound
        self._sender_thread.join(bound)
        self._receiver_thread.join(max(0.0, end - time.monotonic()))
        if self._sender_thread.is_alive() or self._receiver_thread.is_alive():
            # A thread blocked inside the transport cannot be interrupted; it is a daemon and holds
            # no lock. The groups stay referenced: destroying them under a pending operation is not safe.
            logger.warning("pipe rank %d: transfer threads did not stop within %.1f s", self.rank, bound)
        else:
            self._outgoing_group = self._incoming_group = None
            self._state.channel.close()
            self._store = None
            for address in self._pinned:  # before the segments can be unmapped
                devices.unpin_host_memory(address)
            self._pinned = []
            self._state.shared = None  # received tensors keep the peer's segment mapped while they live
        with self._state.lock:
            unsent = self._sender.queued_messages - self._sender.sent_messages
            lost = unsent > 0 or not isinstance(self._state.failure.error, KVTransferError)  # a bug surfaces anyway
            error = self._state.failure.unreported() if lost else None
            if isinstance(error, KVTransferError):
                raise KVTransferError(f"close: {unsent} queued message(s) were never sent") from error
            if error is not None:
                raise fresh_error(error)

    # ------------------------------------------------------------------ sending (callers)

    def _outgoing(self, tensor: torch.Tensor | None) -> Outgoing:
        if tensor is None:
            return Outgoing(FrameKind.NONE)
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
            return Outgoing(FrameKind.TENSOR, data)
        data = tensor.to(self.device).contiguous()
        return Outgoing(FrameKind.TENSOR, data, self._state.streams.ready_event(data))

    # ------------------------------------------------------------------ receiver thread

    def _recv_loop(self) -> None:
        """Take in what arrives while no caller is receiving it."""
        with self._state.streams.context("recv"):
            self._receive_frames()

    def _receive_frames(self) -> None:
        while True:
            with self._state.lock:
                while not self._state.peer_finished and self._state.failure.error is None:
                    pause = self._state.turns.receiver_pause()
                    if not pause:
                        break
                    self._receiver_parked.wait(pause)
                if self._state.peer_finished or self._state.failure.error is not None:
                    return
            self._state.channel.readable(
                min(self._state.keepalive_interval, self._last_received + self.config.kv_timeout - time.monotonic())
            )
            if self._state.turns.receiving or not self._recv_role.acquire(blocking=False):
                continue
            try:
                if self._state.peer_finished or self._state.failure.error is not None:
                    return
                while (
                    self._state.run(self._receive_frame, time.monotonic(), action="receiving") is Frame.TAKEN
                    and not self._state.turns.receiver_yields()
                ):
                    pass
            finally:
                self._recv_role.release()
                with self._state.lock:
                    if self._state.turns.receiver_left_role():  # a caller waited for the role meanwhile
                        self._items.notify_all()

    def _receive_until_an_item(self, deadline: float | None) -> CallerReceive:
        """Receive frames here (hold the receive role) until an item, the end of the stream or a
        failure is queued, or until ``deadline``.

        It looks at the pipe's state at least every RECEIVER_PARK_SECONDS, so that a failure
        elsewhere (which cannot wake a poll) reaches it soon."""
        wait_until = math.inf if deadline is None else deadline
        started = time.monotonic()
        spin = self._state.turns.spin
        while True:
            with self._state.lock:
                if self._recv_queue or self._state.peer_finished or self._state.failure.error is not None:
                    return CallerReceive.READY
                if not self._state.turns.may_receive_here(deadline):
                    return CallerReceive.LEAVE_TO_THREAD
            outcome = self._state.run(
                self._receive_frame, min(wait_until, time.monotonic() + RECEIVER_PARK_SECONDS), spin, action="receiving"
            )
            if outcome is Frame.NONE_YET:
                if time.monotonic() >= wait_until:
                    return CallerReceive.TIMED_OUT
                spin = 0.0  # the poll was spun once already
                continue
            spin = self._state.turns.frame_waited(self._last_received - started)
            started = time.monotonic()

    def _receive_frame(self, wait_until: float, spin: float = 0.0) -> Frame:
        """Receive one frame, if one starts by the monotonic time ``wait_until`` (a receive on the
        groups lasts until a frame comes), and queue what it carries."""
        if not self._recv_frame_by(wait_until, spin):
            return Frame.NONE_YET
        first, items = self._receive_records()
        self._state.streams.synchronize()  # CUDA: the items are complete before any caller sees them
        with self._state.lock:
            self._sender.on_peer_credit(first.consumed, first.want_credit)
            self._recv_queue.extend(items)
            if first.kind is FrameKind.CLOSE:
                self._state.peer_finished = True
                if not self._state.final_frame_queued and self._state.failure.error is None:
                    self._sender.queue_final_frame(FrameKind.CLOSE_ACK)
            elif first.kind is FrameKind.CLOSE_ACK:
                self._state.peer_finished = True
            if self._state.peer_finished:
                self._state.wake_callers()  # senders waiting for credit too: none will come any more
            elif items:
                self._items.notify_all()
            self._sender.report_credit()
            return Frame.ENDED if self._state.peer_finished else Frame.TAKEN

    def _receive_records(self) -> tuple[FrameHeader, list[tuple[torch.Tensor | None, int]]]:
        """Validate the received frame's records and take in their items, payloads included.

        Returns the first record's header (credit, and the frame kind for control frames) and the
        items with their costs, in order.
        """
        records = decode_frame(
            self._state.wire.received_frame(),
            self._state.inline_payloads,
            self._state.credit.budget,
            self._state.shared.peer_bytes if self._state.shared is not None else 0,
            self._next_recv_seq,
        )
        items = []
        for offset, header in records:
            if header.freed:
                self._state.shared.release([header.freed])
            if header.kind is FrameKind.FREED:
                self._state.shared.release(self._state.wire.read_inline(offset + HEADER_BYTES, header).tolist())
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
            return self._state.wire.read_inline(offset + HEADER_BYTES, header)
        if header.place:
            return self._state.shared.view(header.place, header.dtype, header.shape, self._sender.region_freed)
        if self.device.type != "cpu":
            data = torch.empty(header.nbytes, dtype=torch.uint8, device=self.device)
        else:
            data = self._state.wire.allocate(header.nbytes)
        for start, end in chunk_bounds(header.nbytes):
            self._recv(data[start:end], TAG_PAYLOAD)
            self._last_received = time.monotonic()  # a long payload is the peer's sign of life too
        return data.view(header.dtype).reshape(header.shape)

    def _recv(self, tensor: torch.Tensor, tag: int) -> None:
        try:
            self._state.channel.recv(tensor, tag)
        except (RuntimeError, OSError) as exc:  # torch.distributed's errors derive from RuntimeError
            raise TransportError(exc) from exc

    def _recv_frame_by(self, wait_until: float, spin: float) -> bool:
        """Receive a frame from the local socket if one starts by ``wait_until``; a peer silent for
        kv_timeout is lost, as over the transport."""
        silent_at = self._last_received + self.config.kv_timeout
        try:
            arrived = self._state.channel.recv_frame_by(
                self._state.wire.frame_to_receive(), min(wait_until, silent_at), spin
            )
        except (RuntimeError, OSError) as exc:
            raise TransportError(exc) from exc
        now = time.monotonic()
        if arrived:
            self._last_received = now
        elif now >= silent_at:
            silence = TimeoutError(f"the peer sent nothing for kv_timeout={self.config.kv_timeout:g} s")
            raise TransportError(silence) from silence
        return arrived
