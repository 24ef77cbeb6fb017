"""A tensor pipe over torch.distributed point-to-point on dedicated process groups.

* The pipe builds its own groups (:mod:`kv_pipe.rendezvous`): ``ProcessGroupGloo`` for frames, one
  per direction, and on CUDA a second pair, ``ProcessGroupNCCL``, for payloads alone (the *split*
  channel, :mod:`kv_pipe.channel`): a payload's NCCL receive is posted only once its frame arrived
  over gloo and was validated, so an idle CUDA pipe holds no NCCL work, every wait on NCCL work is
  bounded by ``kv_timeout``, and a failed pipe aborts its NCCL groups and raises KVPeerLostError
  with the process alive. The default process group is never created, needed or touched.
* Each direction has a role, held by one thread at a time, and its own object around the state
  both share (:mod:`kv_pipe.pipe_state`). The *sender* thread (:mod:`kv_pipe.sender`) sends the
  units queued for it (and keepalives, credit, the close); the *receiver* thread
  (:mod:`kv_pipe.receiver`) receives the peer's frames while no caller does, validates them, takes
  their payloads in and queues the items for :meth:`recv_tensor`. A caller sends its own unit when
  nothing is queued ahead of it, and receives frames itself while no one else does, so a message
  costs no thread hand-off (two kernel wake-ups, about 100 µs). Which callers may, on each
  channel, is :mod:`kv_pipe.turns`; the frame layout and its checks are pure functions of
  :mod:`kv_pipe.protocol`.
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

import logging
import math
import socket
import time
from collections.abc import Sequence

import torch

from kv_pipe import cores, rendezvous, shared_memory
from kv_pipe import device as devices
from kv_pipe.base import KVPipeBase
from kv_pipe.channel import GroupChannel, SocketChannel
from kv_pipe.config import KVTransferConfig
from kv_pipe.credit import CreditLedger
from kv_pipe.errors import KVConfigError, KVPeerLostError, KVTransferError
from kv_pipe.exported_memory import ExportDescriptor, PeerMemory
from kv_pipe.failure import fresh_error
from kv_pipe.pipe_state import PipeState, deadline_after
from kv_pipe.protocol import (
    SHARED_MIN_BYTES,
    FrameKind,
    Hello,
    check_sendable,
    message_cost,
)
from kv_pipe.receiver import Receiver
from kv_pipe.sender import Outgoing, Sender
from kv_pipe.wire import HostWire

logger = logging.getLogger(__name__)


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
        self._receiver = Receiver(self._state, self._sender, self.device)

        name = f"kvbridge-pipe-{self.port}-r{self.rank}"
        self._sender_thread = cores.thread(self._sender.run, f"{name}-send")
        self._receiver_thread = cores.thread(self._receiver.run, f"{name}-recv")
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
        return self._receiver.recv_tensor(timeout)

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
