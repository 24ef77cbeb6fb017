"""A tensor pipe over torch.distributed point-to-point on a dedicated process group.

Design (the measured facts behind it are in shared/notes/transport-facts.md):

* The pipe builds its own 2-member group from a TCPStore at ``kv_ip:kv_port + port_offset``:
  ``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA, driven by the same ``send``/``recv``
  calls. The default process group is never created, needed or touched.
* Any gloo timeout destroys the connection, so the group's timeout is used only as the liveness
  bound (``kv_timeout``): each side's sender thread sends a keepalive frame whenever it has been
  quiet for a quarter of that bound, so a posted receive on a healthy connection always completes
  in time, an idle pipe stays healthy forever, and a dead or unreachable peer makes the receive
  fail within ``kv_timeout``. Caller-facing timeouts (``recv_tensor(timeout=...)``) wait on queues
  above gloo and leave the pipe usable.
* Exactly one thread at a time receives frames: a caller blocked in ``recv_tensor`` receives
  them itself (a hand-off from another thread costs more than a small message's whole trip), and
  the receiver thread takes over once no caller has come back for ``_CALLER_GRACE``, so frames,
  credit, keepalives and the peer's close keep being taken in while the user is away: a sender
  waits in gloo for the other side's receive at most that long, never for its user. A caller
  whose timeout is shorter than the keepalive bound leaves receiving to the receiver thread, since
  a wait in gloo cannot be cut short. Memory is bounded by credit: every frame carries how many
  bytes its sender's user has consumed, and ``send_tensor`` blocks while the bytes in flight
  (queued, on the wire, or received but not yet taken) would exceed the budget both sides agreed on.
* Headers are validated before any payload receive is posted: gloo aborts the process if a
  message is larger than the receive buffer.
* On gloo, tensors up to 1 MiB ride inside their frame (see kv_pipe.protocol): one message, no
  header/payload rendezvous. A large one is handed to the caller in the frame's own memory and the
  next frame is received into an earlier frame whose caller has dropped its tensor, or into another
  pooled buffer, so nothing is copied on the receiving side.
* Gloo sends a message only once its receive is posted, and a receive posted after its header
  costs the payload a rendezvous (60-230 us from 2 to 8 MiB here). So on gloo, payloads up to
  8 MiB travel in slots: once a payload of a size class has arrived, the receiving thread keeps a
  receive for the next one of that class posted (two, once a frame has carried two of the class,
  as a KV unit's key and value do), re-posted before each frame receive into a slot whose
  payload's caller has dropped it, or else a pooled buffer. Gloo enforces its timeout
  only on a wait, never on a receive that merely stays posted, and a slot is waited on only after
  its frame has announced the payload. The first payload of a class, and one more in a frame than
  the slots of its class, are received after their header as before.
"""

from __future__ import annotations

import collections
import ctypes
import datetime
import logging
import math
import socket
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from kv_pipe import auth
from kv_pipe.base import KVPipeBase
from kv_pipe.config import KVTransferConfig, local_address_towards
from kv_pipe.errors import (
    KVPeerLostError,
    KVPipeClosedError,
    KVProtocolError,
    KVTimeoutError,
    KVTransferError,
)
from kv_pipe.host_memory import HandedOverBuffers, HostMemoryPool
from kv_pipe.protocol import (
    HEADER_BYTES,
    KIND_NONE,
    KIND_TENSOR,
    FrameHeader,
    FrameKind,
    Hello,
    check_sendable,
    chunk_bounds,
    decode_header,
    frame_bytes_for,
    message_cost,
    next_record_offset,
    pack_header,
    pack_tensor_header,
    record_inline_capacity,
    slot_bytes,
    slot_tag,
)

logger = logging.getLogger(__name__)

_TAG_FRAME = 0
_TAG_PAYLOAD = 1
#: How long the receiver thread leaves receiving to a caller that has just returned from
#: recv_tensor: long enough for a ping-pong's turn around, short enough that a producer running
#: ahead of a busy consumer stalls only briefly. Each expiry wakes the receiver thread, and on two
#: cores a wake-up per message cost a 1 MiB ping-pong ~60 us one way: 1 ms -> 5 ms took it from
#: ~1 to ~0.2 wake-ups per message and from 0.8x to ~0.95x of raw gloo.
_CALLER_GRACE = 0.005
#: How long credit that the peer has not asked for waits for one of this side's messages to carry
#: it: a caller that has just taken an item often answers at once, and a keepalive sent first would
#: take the wire from that answer (1 MiB ping-pong, 3 MiB budget: 450 -> 417 us one way). A peer
#: that runs out of credit asks for it and gets it at once.
_CREDIT_DEFERRAL = 0.001


#: Frames handed over to callers that are remembered for reuse once the callers drop their tensors:
#: a ping-pong needs one, a caller holding on to a few tensors more.
_FRAMES_KEPT = 2

#: Slots kept posted per size at most: a lookup-buffer hit carries a key and a value of one size.
_SLOT_DEPTH = 2

#: Slots handed over to callers that are remembered for reuse, of any sizes: a lookup-buffer hit's
#: key and value. At most this many slots of up to SLOT_MAX_BYTES (a size class itself) stay idle per pipe.
_SLOTS_KEPT = 2


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a 1-D uint8 tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


class _Outgoing:
    """One queued item: a frame kind and, for tensors, the bytes to send. The send queue holds
    units, lists of items that go out back to back (one item, or a ``send_tensors`` batch)."""

    __slots__ = ("kind", "data", "nbytes", "cost")

    def __init__(self, kind: FrameKind, data: torch.Tensor | None = None, nbytes: int = 0) -> None:
        self.kind = kind
        self.data = data  # the tensor, contiguous and on the pipe's device
        self.nbytes = nbytes
        self.cost = message_cost(nbytes)


class TorchDistributedPipe(KVPipeBase):
    """FIFO tensor pipe between ``kv_rank`` 0 and 1 (see :class:`kv_pipe.KVPipeBase`).

    Construction blocks until the peer has connected (at most ``kv_connect_timeout``) and raises
    :class:`KVTransferError` subclasses naming the cause (no peer, incompatible peer).

    Args:
        config: this side's configuration; ``kv_rank`` must differ between the two sides, ``kv_ip``
            and ``kv_port`` must be equal.
        port_offset: added to ``kv_port``, so one process can hold several pipes. A pipe uses port
            ``kv_port + port_offset`` and reserves the next one for a lookup buffer's control
            channel: give pipes offsets that differ by at least 2.
    """

    def __init__(self, config: KVTransferConfig, port_offset: int = 0) -> None:
        config.validate()
        self.config = config
        self.port_offset = port_offset
        self.rank = config.kv_rank
        self.peer_rank = 1 - config.kv_rank
        self.port = config.kv_port + port_offset
        self.device = self._select_device(config.kv_buffer_device)
        self._frame_bytes = frame_bytes_for(self.device.type)
        self._inline_capacity = self._frame_bytes - HEADER_BYTES
        self._max_direct_cost = message_cost(self._inline_capacity)
        self._on_host = self.device.type == "cpu"  # checked per message: cheaper than a tensor's .device
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # The transfer threads wait apart from the callers: a wake-up costs more than a small
        # message's trip, so each message wakes only the thread that has work from it.
        self._sender_wakeup = threading.Condition(lock)
        self._receiver_wakeup = threading.Condition(lock)
        # flush() waits apart too: every transmission notifies it, and a caller waiting in
        # recv_tensor woken by each one cost a lookup-buffer producer ~50 us of CPU per select.
        self._transmitted = threading.Condition(lock)
        self._error: KVTransferError | None = None  # first fatal error; the pipe is dead after it
        self._error_raised = False
        self._closing = False  # close() was called
        self._final_frame_queued = False  # CLOSE or CLOSE_ACK queued: nothing may follow it
        self._peer_finished = False  # peer sent CLOSE or CLOSE_ACK

        # Sending side.
        self._send_queue: collections.deque[list[_Outgoing]] = collections.deque()
        self._queued_cost = 0  # cumulative cost of every message ever queued
        self._queued_messages = 0
        self._sent_messages = 0
        self._peer_consumed = 0  # cumulative cost the peer's user has taken
        self._want_credit = False  # ask the peer for credit in the next frame
        self._credit_asked_at = -1  # _peer_consumed when we last asked: ask once per stall
        self._next_send_seq = 0

        # Receiving side.
        self._recv_queue: collections.deque[tuple[torch.Tensor | None, int]] = collections.deque()
        self._consumed = 0  # cumulative cost our user has taken
        self._reported_consumed = 0  # the last value announced to the peer
        self._peer_wants_credit = False
        self._credit_ample_at: float | None = None  # when a quarter of the budget went unreported
        self._next_recv_seq = 0
        self._receiving = False  # a thread (the receiver or a caller) is receiving frames
        self._caller_released_at = -math.inf  # when a caller last stopped receiving
        self._callers_waiting = 0  # callers in recv_tensor waiting for another thread to receive
        self._callers_unable = 0  # those of them whose timeout is too short to wait in gloo
        self._receiver_parked = False  # the receiver thread waits for a receiving caller to stop
        self._wire_busy = False  # a thread is transmitting: frames must not interleave

        self._store, peer_hello = self._rendezvous()
        self._max_in_flight = min(config.kv_buffer_size, peer_hello.max_in_flight)
        # A posted receive fails after the receiving side's kv_timeout: keepalives go often enough
        # for the shorter of the two.
        self._keepalive_interval = min(config.kv_timeout, peer_hello.timeout_ms / 1000) / 4
        self._group = self._create_group()
        self._host_memory = HostMemoryPool(max_idle_bytes=config.kv_buffer_size)
        self._send_frame = torch.zeros(self._frame_bytes, dtype=torch.uint8, device=self.device)
        self._recv_frame: torch.Tensor | None = torch.zeros(self._frame_bytes, dtype=torch.uint8, device=self.device)
        # Headers and small tensors are written and read through byte views of host memory: far
        # cheaper per message than torch operations. On CUDA the header is staged in host memory.
        self._send_bytes = self._host_bytes(self._send_frame)
        self._send_address = self._send_frame.data_ptr()
        self._send_prefix = self._send_frame
        self._recv_bytes = self._host_bytes(self._recv_frame)
        self._handed_frames = HandedOverBuffers(keep=_FRAMES_KEPT)
        self._handed_slots = HandedOverBuffers(keep=_SLOTS_KEPT)
        # Posted slot receives by slot size, each a buffer, its byte view and its pending work, in
        # the order the peer's payloads fill them; only the receiving thread touches these. Slots
        # taken are re-posted before the next frame receive.
        self._slots: dict[int, collections.deque[tuple[torch.Tensor, memoryview, dist.Work]]] = {}
        self._slots_to_post: collections.Counter[int] = collections.Counter()
        name = f"kvbridge-pipe-{self.port}-r{self.rank}"
        self._last_sent = time.monotonic()
        self._sender = threading.Thread(target=self._send_loop, name=f"{name}-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name=f"{name}-recv", daemon=True)
        self._sender.start()
        self._receiver.start()
        logger.info("pipe rank %d <-> %d up on %s:%d (%s, in-flight budget %d bytes)", self.rank,
                    self.peer_rank, config.kv_ip, self.port, self.device, self._max_in_flight)

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _select_device(kind: str) -> torch.device:
        if kind == "cuda":
            if not torch.cuda.is_available():
                raise KVTransferError("kv_buffer_device='cuda' but torch sees no CUDA device")
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _rendezvous(self) -> tuple[dist.TCPStore, Hello]:
        config = self.config
        connect_timeout = datetime.timedelta(seconds=config.kv_connect_timeout)
        # TCPStore listens on every interface by itself; hand it a socket bound to kv_ip only.
        listen_fd = self._listen_on_kv_ip() if self.rank == 0 else None
        try:
            store = dist.TCPStore(config.kv_ip, self.port, world_size=2, is_master=self.rank == 0,
                                  timeout=connect_timeout, wait_for_workers=True, master_listen_fd=listen_fd)
        except Exception as exc:  # torch raises several types (DistStoreError, RuntimeError, OSError)
            raise KVPeerLostError(
                f"kvbridge pipe rank {self.rank}: no peer at {config.kv_ip}:{self.port} within "
                f"{config.kv_connect_timeout:g} s (kv_connect_timeout): {exc}"
            ) from exc
        if store.add("kvbridge/arrivals", 1) > 2:
            # A rank 0 that kept its broken pipe open still serves the old rendezvous: joining it
            # would pair with a dead peer's leftovers.
            raise KVPeerLostError(
                f"kvbridge pipe rank {self.rank}: the rendezvous at {config.kv_ip}:{self.port} already served a "
                f"pair; the other side must close its old pipe and create a new one before this side reconnects"
            )
        hello = Hello(frame_bytes=self._frame_bytes, max_in_flight=config.kv_buffer_size,
                      device=config.kv_buffer_device, timeout_ms=max(1, round(config.kv_timeout * 1000)))
        try:
            peer_hello = Hello.unpack(self._exchange(store, "hello", hello.pack()))
            self._authenticate(store)
        except KVProtocolError:
            raise
        except Exception as exc:
            raise KVPeerLostError(f"kvbridge pipe rank {self.rank}: rendezvous with the peer failed: {exc}") from exc
        if peer_hello.frame_bytes != self._frame_bytes or peer_hello.device != config.kv_buffer_device:
            raise KVProtocolError(
                f"incompatible peer: it uses {peer_hello.device} with {peer_hello.frame_bytes}-byte frames, "
                f"this side {config.kv_buffer_device} with {self._frame_bytes}-byte frames"
            )
        store.set_timeout(datetime.timedelta(seconds=config.kv_timeout))
        return store, peer_hello

    def _listen_on_kv_ip(self) -> int:
        host = self.config.kv_ip
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            server = socket.create_server((host, self.port), family=family)
        except OSError as exc:
            raise KVTransferError(f"kvbridge pipe rank 0 cannot listen on {host}:{self.port}: {exc}") from exc
        return server.detach()  # the TCPStore owns the descriptor from here on

    def _exchange(self, store: dist.Store, name: str, value: bytes) -> bytes:
        """Publish this side's ``value`` under ``name`` and return the peer's.

        Rank 1 reads before it writes. Rank 0 hosts the store and may refuse, and so take the store
        down, as soon as it has read rank 1's value; by then rank 1 already holds what it needs to
        refuse with the same clear error instead of a lost connection.
        """
        mine, theirs = f"kvbridge/{name}/{self.rank}", f"kvbridge/{name}/{self.peer_rank}"
        if self.rank == 0:
            store.set(mine, value)
            return store.get(theirs)
        peer_value = store.get(theirs)
        store.set(mine, value)
        return peer_value

    def _authenticate(self, store: dist.Store) -> None:
        """Challenge-response on ``kv_secret`` before any tensor moves; both sides must agree."""
        secret = self.config.kv_secret
        peer_mode = self._exchange(store, "auth", b"required" if secret else b"none")
        if not secret:
            if peer_mode != b"none":
                raise KVProtocolError("authentication failed: the peer requires kv_secret and this side has none")
            return
        if peer_mode != b"required":
            raise KVProtocolError("authentication failed: this side requires kv_secret and the peer has none")
        key = auth.derive_key(secret, "pipe-rendezvous")
        nonce = auth.new_nonce()
        peer_nonce = self._exchange(store, "nonce", nonce)
        peer_proof = self._exchange(store, "proof", auth.sign(key, bytes([self.rank]), nonce, peer_nonce))
        if not auth.verify(key, peer_proof, bytes([self.peer_rank]), peer_nonce, nonce):
            raise KVProtocolError(
                "authentication failed: the peer does not hold this side's kv_secret (wrong secret or a stranger)"
            )

    def _create_group(self) -> dist.ProcessGroup:
        group_store = dist.PrefixStore("kvbridge/group", self._store)
        timeout = datetime.timedelta(seconds=self.config.kv_timeout)
        try:
            if self.device.type == "cuda":
                # Unverified on GPU (no GPU in this project's CI): same calls, NCCL backend.
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                return dist.ProcessGroupNCCL(group_store, self.rank, 2, options)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            # Listen on the interface that faces the peer, not on whatever the host name resolves to.
            address = local_address_towards(self.config.kv_ip)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
            return dist.ProcessGroupGloo(group_store, self.rank, 2, options)
        except Exception as exc:
            raise KVPeerLostError(f"kvbridge pipe rank {self.rank}: could not connect the group: {exc}") from exc

    # ------------------------------------------------------------------ public API

    @property
    def max_tensor_bytes(self) -> int:
        return self._max_in_flight - message_cost(0)

    def send_tensor(self, tensor: torch.Tensor | None, timeout: float | None = None) -> None:
        if tensor is not None and self._on_host and self._send_lone_inline(tensor):
            return
        self._send_unit([self._outgoing(tensor)], timeout, self._deadline(timeout))

    def send_tensors(self, tensors: Sequence[torch.Tensor | None], timeout: float | None = None) -> None:
        unit = [self._outgoing(tensor) for tensor in tensors]
        deadline = self._deadline(timeout)
        if sum(message.cost for message in unit) <= self._max_in_flight:
            if unit:
                self._send_unit(unit, timeout, deadline)
            return
        for message in unit:  # more than the budget at once: it cannot travel as one unit
            self._send_unit([message], timeout, deadline)

    @staticmethod
    def _deadline(timeout: float | None) -> float | None:
        return None if timeout is None else time.monotonic() + timeout

    def _outgoing(self, tensor: torch.Tensor | None) -> _Outgoing:
        if tensor is None:
            return _Outgoing(KIND_NONE)
        check_sendable(tensor)
        data = self._as_sendable(tensor)
        if data.nbytes > self.max_tensor_bytes:
            raise KVTransferError(
                f"a {data.nbytes}-byte tensor exceeds the pipe's limit of {self.max_tensor_bytes} bytes "
                f"(max_tensor_bytes: the smaller kv_buffer_size of the two sides, less bookkeeping)"
            )
        return _Outgoing(KIND_TENSOR, data, data.nbytes)

    def _send_unit(self, unit: list[_Outgoing], timeout: float | None, deadline: float | None) -> None:
        """Queue ``unit`` once the in-flight budget has room for it, waiting until ``deadline``
        (``timeout`` seconds after the user's call began)."""
        cost = unit[0].cost if len(unit) == 1 else sum(message.cost for message in unit)
        with self._cond:
            while True:
                self._raise_if_unusable_for_send()
                if self._has_room(cost):
                    break
                if self._credit_asked_at != self._peer_consumed:
                    self._credit_asked_at = self._peer_consumed
                    self._want_credit = True
                    self._sender_wakeup.notify()  # the sender thread tells the peer we are waiting
                if not self._wait(deadline):
                    raise KVTimeoutError(
                        f"send_tensor: the in-flight budget of {self._max_in_flight} bytes stayed full "
                        f"for {timeout:g} s (the peer is not taking what was sent)"
                    )
            self._queued_cost += cost
            self._queued_messages += len(unit)
            # Units about as small as one frame go out from the caller's thread when the wire is
            # free: a hand-off to the sender thread costs more than the send itself (the peer's pipe
            # takes frames in whether or not its user receives, so this waits for the wire, not the user).
            if not self._wire_free_for(cost):
                self._send_queue.append(unit)
                self._sender_wakeup.notify()
                return
            headers = self._claim_wire(unit)
        if not self._transmit_claimed(headers, unit):
            with self._cond:
                self._raise_if_failed()

    def _send_lone_inline(self, tensor: torch.Tensor) -> bool:
        """Send ``tensor`` in a frame of its own from the caller's thread, if it fits one as it is
        and the wire is free; False leaves it to the general path. Raises what :func:`check_sendable`
        raises for a tensor no pipe can carry.

        The general path's unit, header objects and loops cost a 4 KiB message ~7 us one way here.
        """
        check_sendable(tensor)
        nbytes = tensor.nbytes
        if nbytes > self._inline_capacity or not self._is_sendable_as_is(tensor):
            return False
        cost = message_cost(nbytes)
        with self._cond:
            if self._unusable_for_send() or not self._has_room(cost) or not self._wire_free_for(cost):
                return False
            self._wire_busy = True
            self._queued_cost += cost
            self._queued_messages += 1
            seq = self._next_send_seq
            self._next_send_seq += 1
            consumed, want_credit = self._report_credit()
        pack_tensor_header(self._send_bytes, seq, consumed, want_credit, tensor.dtype, tensor.shape, nbytes,
                           inline=True, more=False)
        if nbytes:
            ctypes.memmove(self._send_address + HEADER_BYTES, tensor.data_ptr(), nbytes)
        sent = False
        try:
            self._group.send([self._send_frame_prefix(HEADER_BYTES + nbytes)], self.peer_rank, _TAG_FRAME).wait()
            sent = True
        except Exception as exc:
            self._fail(self._peer_lost("sending", exc))
        finally:
            self._release_wire(messages=1)
        if not sent:
            with self._cond:
                self._raise_if_failed()
        return True

    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor | None:
        deadline = self._deadline(timeout)
        while True:
            with self._cond:
                while not self._recv_queue:
                    self._raise_if_failed()
                    if self._peer_finished:
                        raise KVPipeClosedError("the peer closed the pipe; nothing more will arrive")
                    if self._closing:
                        raise KVPipeClosedError("recv_tensor on a closed pipe")
                    unable = not self._may_wait_in_gloo(deadline)
                    if not self._receiving:
                        if not unable:
                            self._receiving = True
                            break
                        self._receiver_wakeup.notify()  # it needs the receiver thread now, not after the grace
                    self._callers_waiting += 1
                    self._callers_unable += unable
                    try:
                        if not self._wait(deadline):
                            raise KVTimeoutError(f"recv_tensor: nothing arrived within {timeout:g} s")
                    finally:
                        self._callers_waiting -= 1
                        self._callers_unable -= unable
                else:
                    tensor, cost = self._recv_queue.popleft()
                    self._consumed += cost
                    if self._credit_ample_at is None and self._credit_ample():
                        self._credit_ample_at = time.monotonic()
                        self._sender_wakeup.notify()  # to shorten its sleep, not to send now
                    return tensor
            # The frame goes to the queue like any other, so FIFO order holds across callers.
            self._receive_frame(by_caller=True)

    def _may_wait_in_gloo(self, deadline: float | None) -> bool:
        """Whether a caller with ``deadline`` may block in gloo for the next frame: a live peer sends
        one at least every keepalive interval, and a wait in gloo cannot be cut short."""
        return deadline is None or deadline - time.monotonic() >= 2 * self._keepalive_interval

    def flush(self, timeout: float | None = None) -> None:
        deadline = self._deadline(timeout)
        with self._cond:
            while self._sent_messages < self._queued_messages:
                self._raise_if_failed()
                if not self._wait(deadline, self._transmitted):
                    raise KVTimeoutError(f"flush: queued tensors were not sent within {timeout:g} s")

    def close(self) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
            if self._error is None and not self._final_frame_queued:
                self._queue_final_frame(FrameKind.CLOSE)
            self._cond.notify_all()
            self._transmitted.notify_all()
            self._sender_wakeup.notify()
        # Both threads end once the peer has answered CLOSE; a dead peer ends them with an error
        # within kv_timeout (the keepalive bound), so these joins are bounded.
        bound = self.config.kv_timeout * 2
        self._sender.join(bound)
        self._receiver.join(bound)
        if self._sender.is_alive() or self._receiver.is_alive():
            # A thread blocked inside gloo cannot be interrupted; it is a daemon and holds no lock.
            # The group stays referenced: destroying it under a pending operation is not safe.
            logger.warning("pipe rank %d: transfer threads did not stop within %.1f s", self.rank, bound)
        else:
            self._slots.clear()  # receives still posted for slots: gloo drops them with the group
            self._group = None
            self._store = None
        with self._cond:
            unsent = self._queued_messages - self._sent_messages
            if self._error is not None and not self._error_raised and unsent > 0:
                self._error_raised = True
                raise KVTransferError(f"close: {unsent} queued message(s) were never sent") from self._error

    # ------------------------------------------------------------------ state helpers (hold _cond)

    def _wait(self, deadline: float | None, condition: threading.Condition | None = None) -> bool:
        """Wait on ``condition`` (``_cond`` by default) for a state change; False once ``deadline`` has passed."""
        condition = condition or self._cond
        if deadline is None:
            condition.wait()
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        condition.wait(remaining)
        return True

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            self._error_raised = True
            raise self._error

    def _raise_if_unusable_for_send(self) -> None:
        if not self._unusable_for_send():
            return
        self._raise_if_failed()
        if self._closing:
            raise KVPipeClosedError("send_tensor on a closed pipe")
        if self._final_frame_queued or self._peer_finished:
            raise KVPipeClosedError("the peer closed the pipe; nothing more can be sent")

    def _unusable_for_send(self) -> bool:
        """Whether the pipe failed or either side is closing it, so nothing may be sent
        (:meth:`_raise_if_unusable_for_send` says why)."""
        return self._error is not None or self._closing or self._final_frame_queued or self._peer_finished

    def _has_room(self, cost: int) -> bool:
        """Whether the in-flight budget has room for a unit of ``cost``."""
        return self._queued_cost + cost - self._peer_consumed <= self._max_in_flight

    def _wire_free_for(self, cost: int) -> bool:
        """Whether a unit of ``cost`` may go out from the caller's thread now: nothing is queued or on
        the wire, and the unit is about one frame (a hand-off to the sender thread costs more than
        sending that)."""
        return not self._send_queue and not self._wire_busy and cost <= self._max_direct_cost

    def _credit_ample(self) -> bool:
        """A quarter of the budget was consumed and not reported: worth a frame of its own soon."""
        return self._consumed - self._reported_consumed >= self._max_in_flight // 4

    def _credit_requested(self) -> bool:
        """The peer is out of credit and some can be given: send it now."""
        return self._peer_wants_credit and self._consumed > self._reported_consumed

    def _queue_final_frame(self, kind: FrameKind) -> None:
        self._final_frame_queued = True
        self._queued_messages += 1
        self._send_queue.append([_Outgoing(kind)])
        self._sender_wakeup.notify()

    def _fail(self, error: KVTransferError) -> None:
        with self._cond:
            if self._error is None and not (self._closing and self._peer_finished):
                self._error = error
                logger.error("%s", error)
            self._cond.notify_all()
            self._transmitted.notify_all()
            self._sender_wakeup.notify()
            self._receiver_wakeup.notify()

    def _peer_lost(self, action: str, cause: Exception) -> KVPeerLostError:
        return KVPeerLostError(
            f"pipe rank {self.rank}: connection to rank {self.peer_rank} lost while {action} (the peer exited, "
            f"was killed, or was silent for kv_timeout={self.config.kv_timeout:g} s): {cause}"
        )

    def _as_sendable(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in memory the pipe can send as it is: contiguous, on the pipe's device."""
        # The checks cost a fraction of the operations they spare a small tensor that needs none.
        if not self._is_sendable_as_is(tensor):
            tensor = tensor.detach().to(self.device).resolve_conj().resolve_neg().contiguous()
        return tensor

    def _is_sendable_as_is(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory holds exactly its values, on the pipe's device."""
        return not (tensor.device != self.device or tensor.requires_grad or not tensor.is_contiguous()
                    or tensor.is_conj() or tensor.is_neg())

    # ------------------------------------------------------------------ sender thread

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._error is not None:
                        return
                    if not self._wire_busy:
                        if self._send_queue:
                            unit = self._send_queue.popleft()
                            break
                        now = time.monotonic()
                        quiet_left = self._last_sent + self._keepalive_interval - now
                        if self._credit_ample_at is not None:
                            quiet_left = min(quiet_left, self._credit_ample_at + _CREDIT_DEFERRAL - now)
                        if quiet_left <= 0 or self._want_credit or self._credit_requested():
                            unit = [_Outgoing(FrameKind.KEEPALIVE)]
                            break
                        self._sender_wakeup.wait(quiet_left)
                    else:
                        self._sender_wakeup.wait()
                headers = self._claim_wire(unit)
            if not self._transmit_claimed(headers, unit):
                return
            if unit[0].kind in (FrameKind.CLOSE, FrameKind.CLOSE_ACK):
                return

    def _claim_wire(self, unit: list[_Outgoing]) -> list[FrameHeader]:
        """Reserve the wire for ``unit`` and build its records' headers (hold ``_cond``).

        Records share a frame while the next one's header fits after the last one's inline bytes;
        whether a tensor is inline depends on where its record starts (see kv_pipe.protocol).
        """
        self._wire_busy = True
        consumed, want_credit = self._report_credit()
        headers = []
        offset, capacity = 0, self._inline_capacity  # where the next record starts, and its inline room
        last = len(unit) - 1
        for index, message in enumerate(unit):
            data, nbytes = message.data, message.nbytes
            header = FrameHeader(kind=message.kind, seq=self._next_send_seq, consumed=consumed,
                                 want_credit=want_credit, nbytes=nbytes)
            if data is not None:
                header.dtype, header.shape, header.inline = data.dtype, data.shape, nbytes <= capacity
            if message.kind is KIND_TENSOR or message.kind is KIND_NONE:
                self._next_send_seq += 1
            if index < last:
                offset = next_record_offset(offset, nbytes if header.inline else 0)
                header.more = offset + HEADER_BYTES <= self._frame_bytes
                if not header.more:
                    offset = 0
                capacity = record_inline_capacity(self._frame_bytes, offset)
            headers.append(header)
        return headers

    def _report_credit(self) -> tuple[int, bool]:
        """The credit fields of the next frame: what our user consumed, and whether we ask for credit
        (hold ``_cond``). The frame reports them, so nothing is owed after it."""
        consumed, want_credit = self._consumed, self._want_credit
        self._reported_consumed = consumed
        self._credit_ample_at = None
        self._peer_wants_credit = False
        self._want_credit = False
        return consumed, want_credit

    def _transmit_claimed(self, headers: list[FrameHeader], unit: list[_Outgoing]) -> bool:
        """Send a unit whose wire was claimed; release the wire. False if the send failed."""
        try:
            self._transmit(headers, unit)
        except Exception as exc:
            self._fail(self._peer_lost("sending", exc))
            return False
        finally:
            for message in unit:
                message.data = None  # release the caller's tensor as soon as it is on the wire
            self._release_wire(messages=sum(message.kind is not FrameKind.KEEPALIVE for message in unit))
        return True

    def _release_wire(self, messages: int) -> None:
        """Free the wire after a transmission that carried ``messages`` of the user's messages."""
        with self._cond:
            self._wire_busy = False
            self._last_sent = time.monotonic()
            self._sent_messages += messages
            self._transmitted.notify_all()
            if self._send_queue:  # queued behind a caller's direct send
                self._sender_wakeup.notify()

    def _transmit(self, headers: list[FrameHeader], unit: list[_Outgoing]) -> None:
        offset = 0
        payloads = []  # tensors of this frame's records that do not fit inside it
        for header, message in zip(headers, unit, strict=True):
            inline_bytes = header.nbytes if header.inline else 0
            self._pack_record(header, message.data, offset, inline_bytes)
            if header.kind is KIND_TENSOR and not header.inline:
                payloads.append(_flat_bytes(message.data))
            if header.more:
                offset = next_record_offset(offset, inline_bytes)
                continue
            frame = self._send_frame
            if self._on_host:  # gloo accepts a message shorter than the posted receive; NCCL needs equal sizes
                frame = self._send_frame_prefix(offset + HEADER_BYTES + inline_bytes)
            # One operation at a time: posting a payload while the frame is still pending measured
            # ~2 ms slower per message on gloo. Payloads follow their frame: sent ahead of it into a
            # slot posted for them, they measured slower (2-8 MiB, five of six alternating runs).
            self._group.send([frame], self.peer_rank, _TAG_FRAME).wait()
            for flat in payloads:
                self._send_payload(flat)
            offset = 0
            payloads.clear()

    def _send_payload(self, flat: torch.Tensor) -> None:
        size = self._slot_bytes(flat.numel())
        if size is not None:
            self._group.send([flat], self.peer_rank, slot_tag(size)).wait()
            return
        for start, end in chunk_bounds(flat.numel()):
            self._group.send([flat[start:end]], self.peer_rank, _TAG_PAYLOAD).wait()

    def _pack_record(self, header: FrameHeader, data: torch.Tensor | None, offset: int, inline_bytes: int) -> None:
        """Write a record's header and inline bytes into the send frame at ``offset``."""
        frame = self._send_frame
        if not self._on_host:
            pack_header(header, self._send_bytes)
            frame[offset : offset + HEADER_BYTES].copy_(torch.frombuffer(self._send_bytes, dtype=torch.uint8))
            if inline_bytes:
                start = offset + HEADER_BYTES
                frame[start : start + inline_bytes].copy_(_flat_bytes(data))
            return
        pack_header(header, self._send_bytes[offset : offset + HEADER_BYTES] if offset else self._send_bytes)
        if inline_bytes:
            # A plain memory copy: a byte view of the tensor costs more than the copy itself at 4 KiB.
            ctypes.memmove(self._send_address + offset + HEADER_BYTES, data.data_ptr(), inline_bytes)

    def _send_frame_prefix(self, nbytes: int) -> torch.Tensor:
        # Consecutive messages tend to have one size: the view is kept rather than cut per message.
        if self._send_prefix.numel() != nbytes:
            self._send_prefix = self._send_frame[:nbytes]
        return self._send_prefix

    @staticmethod
    def _host_bytes(frame: torch.Tensor) -> memoryview:
        """A byte view of a host frame; for a device frame, of a host buffer for its header."""
        return memoryview(frame.numpy() if frame.device.type == "cpu" else bytearray(HEADER_BYTES))

    def _received_header(self, offset: int) -> memoryview:
        if not self._on_host:
            self._recv_bytes[:] = self._recv_frame[offset : offset + HEADER_BYTES].cpu().numpy()
            return self._recv_bytes
        return self._recv_bytes[offset : offset + HEADER_BYTES]

    # ------------------------------------------------------------------ receiver thread

    def _recv_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._error is not None or self._peer_finished:
                        return
                    if self._receiving:  # a caller waits on the frame; it wakes us when it leaves
                        self._receiver_parked = True
                        self._receiver_wakeup.wait()
                        self._receiver_parked = False
                        continue
                    grace_left = self._caller_released_at + _CALLER_GRACE - time.monotonic()
                    if grace_left <= 0 or self._callers_unable:
                        break
                    self._receiver_wakeup.wait(grace_left)
                self._receiving = True
            if not self._receive_frame(by_caller=False):
                return

    def _receive_frame(self, by_caller: bool) -> bool:
        """Post a frame receive, wait for the frame and queue what it carries.

        Only the thread that set ``_receiving`` calls this, without holding ``_cond``; it clears
        ``_receiving`` when done. False once nothing more will be received (the peer finished, or a failure).
        Posting just before waiting, not right after the previous frame, keeps the post off a
        caller's path from a frame to its tensor; a peer that sends before the post waits for it
        inside gloo, a wait bounded by this side's caller coming back or by ``_CALLER_GRACE``.
        """
        try:
            self._post_receives().wait()
            header, items = self._receive_records()
        except KVProtocolError as exc:
            self._fail(exc)
            return False
        except Exception as exc:
            self._fail(self._peer_lost("receiving", exc))
            return False
        except BaseException as exc:  # e.g. KeyboardInterrupt in a caller: the frame is half taken
            self._fail(KVTransferError(f"pipe rank {self.rank}: receive interrupted mid-frame: {exc!r}"))
            raise
        with self._cond:
            self._receiving = False
            self._peer_consumed = header.consumed
            self._peer_wants_credit = self._peer_wants_credit or header.want_credit
            carries_item = bool(items)
            if carries_item:
                self._recv_queue.extend(items)
            elif header.kind is FrameKind.CLOSE:
                self._peer_finished = True
                if not self._final_frame_queued and self._error is None:
                    self._queue_final_frame(FrameKind.CLOSE_ACK)
            elif header.kind is FrameKind.CLOSE_ACK:
                self._peer_finished = True
            self._cond.notify_all()
            if self._credit_requested():
                self._sender_wakeup.notify()
            if by_caller or (self._callers_waiting and carries_item):
                # A caller has (or is about to get) an item and will likely be back for the next.
                self._caller_released_at = time.monotonic()
                if self._receiver_parked:  # else it is counting down the grace already
                    self._receiver_wakeup.notify()
            return not self._peer_finished

    def _post_receives(self) -> dist.Work:
        """Post the slot receives taken since the last frame, then the frame receive."""
        if self._recv_frame is None:  # the last one went to a caller
            self._recv_frame, self._recv_bytes = self._take_host_buffer(self._handed_frames, self._frame_bytes)
        if self._slots_to_post:
            for size, count in self._slots_to_post.items():
                posted = self._slots.setdefault(size, collections.deque())
                posted.extend(self._post_slot(size) for _ in range(count))
            self._slots_to_post.clear()
        return self._group.recv([self._recv_frame], self.peer_rank, _TAG_FRAME)

    def _receive_records(self) -> tuple[FrameHeader, list[tuple[torch.Tensor | None, int]]]:
        """Parse the received frame's records and take in their items (payloads included).

        Returns the first record's header (credit, and the frame kind for control frames) and the
        items with their costs, in order.
        """
        offset = 0
        capacity = self._inline_capacity
        items = []
        while True:
            header = decode_header(self._received_header(offset), max_nbytes=self._max_in_flight,
                                   inline_capacity=capacity)
            if not offset:
                first = header
                # Only the receiving thread writes _peer_consumed.
                if not self._peer_consumed <= header.consumed <= self._queued_cost:
                    raise KVProtocolError(
                        f"peer claims to have consumed {header.consumed} bytes; it had consumed {self._peer_consumed} "
                        f"and was sent at most {self._queued_cost}"
                    )
            elif header.consumed != first.consumed or header.want_credit != first.want_credit:
                raise KVProtocolError("peer sent a frame whose records disagree on credit")
            elif header.kind is not KIND_TENSOR and header.kind is not KIND_NONE:
                raise KVProtocolError(f"peer sent a {header.kind.name} record after another record in one frame")
            item = self._receive_item(header, offset)
            if header.kind is KIND_TENSOR or header.kind is KIND_NONE:
                items.append((item, message_cost(header.nbytes)))
            if not header.more:
                return first, items
            offset = next_record_offset(offset, header.nbytes if header.inline else 0)
            if offset + HEADER_BYTES > self._frame_bytes:
                raise KVProtocolError(f"peer announced a record at byte {offset}, past the end of its frame")
            capacity = record_inline_capacity(self._frame_bytes, offset)

    def _receive_item(self, header: FrameHeader, offset: int) -> torch.Tensor | None:
        if header.kind is KIND_TENSOR or header.kind is KIND_NONE:
            if header.seq != self._next_recv_seq:
                raise KVProtocolError(f"peer's message {header.seq} arrived where {self._next_recv_seq} was due")
            self._next_recv_seq += 1
        if header.kind is not KIND_TENSOR:
            return None
        if header.nbytes == 0:
            return torch.empty(header.shape, dtype=header.dtype, device=self.device)
        if header.inline:
            start = offset + HEADER_BYTES
            if not self._on_host:
                data = self._recv_frame[start : start + header.nbytes]
                return data.clone().view(header.dtype).reshape(header.shape)
            if header.nbytes < self._inline_capacity // 2:
                # A bytearray copy and a tensor over it cost half of torch's clone of a frame slice.
                received = bytearray(self._recv_bytes[start : start + header.nbytes])
            else:
                # A large inline tensor is handed over in its host frame (no copy); the next frame
                # is received into a frame whose caller has dropped its tensor, or else into another
                # pooled buffer, taken when that receive is posted, off the path to this tensor's
                # caller. Below half a frame a copy is cheaper than the memory the caller's tensor
                # would pin. The byte view keeps the frame alive; one torch call over it costs a
                # third of slicing and viewing the frame.
                received = self._handed_frames.hand_over(self._recv_frame, self._recv_bytes, start, header.nbytes)
                self._recv_frame = None
        else:
            size = self._slot_bytes(header.nbytes)
            if size is None:
                return self._receive_chunks(header.nbytes).view(header.dtype).reshape(header.shape)
            received = self._receive_slot(size, header.nbytes)
        flat = torch.frombuffer(received, dtype=header.dtype)
        return flat if len(header.shape) == 1 else flat.reshape(header.shape)

    def _receive_slot(self, size: int, nbytes: int) -> memoryview:
        """Wait for a payload of ``nbytes`` in a slot of ``size``; hand it over as a byte view of the
        slot, like a large inline tensor, so the slot is received into again once the caller drops it."""
        # No slot is posted for the first payload of a size, nor for one past the slots of its size
        # in a frame; such a payload is received after its header.
        posted = self._slots.get(size)
        buffer, buffer_bytes, work = posted.popleft() if posted else self._post_slot(size)
        if len(posted or ()) + self._slots_to_post[size] < _SLOT_DEPTH:
            self._slots_to_post[size] += 1
        work.wait()
        return self._handed_slots.hand_over(buffer, buffer_bytes, 0, nbytes)

    def _receive_chunks(self, nbytes: int) -> torch.Tensor:
        data = self._allocate(nbytes)
        for start, end in chunk_bounds(nbytes):
            self._group.recv([data[start:end]], self.peer_rank, _TAG_PAYLOAD).wait()
        return data

    def _slot_bytes(self, nbytes: int) -> int | None:
        """The slot a payload of ``nbytes`` travels in, or None if it goes in chunks (CUDA has no slots)."""
        return slot_bytes(nbytes) if self._on_host else None

    def _post_slot(self, size: int) -> tuple[torch.Tensor, memoryview, dist.Work]:
        buffer, buffer_bytes = self._take_host_buffer(self._handed_slots, size)
        return buffer, buffer_bytes, self._group.recv([buffer], self.peer_rank, slot_tag(size))

    def _take_host_buffer(self, handed: HandedOverBuffers, nbytes: int) -> tuple[torch.Tensor, memoryview]:
        """A host buffer of ``nbytes`` to receive into, with its byte view: one that went to a caller
        who has dropped it, else a pooled one."""
        idle = handed.take_idle(nbytes)
        if idle is None:
            buffer = self._allocate(nbytes)
            idle = buffer, self._host_bytes(buffer)
        return idle

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self._on_host:
            return self._host_memory.allocate(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
