"""How a pipe's frames and payload chunks travel: process groups, or a local socket on one host.

* :class:`GroupChannel`: torch.distributed groups, one per direction (gloo or NCCL). Frames travel
  on one pair of groups; payloads on the same pair, told apart by tag, or on a pair of their own
  (*split*: NCCL's layout). Whoever holds a direction's role issues its operations, so they are
  issued in order as NCCL needs: on gloo a pipe thread or a caller, on NCCL only the pipe's threads
  (:attr:`Channel.callers_may_post`), each on the pipe's own stream for its direction. A frame and
  the payloads behind it are posted together, then waited for. No frame wait can be abandoned: a
  gloo wait that times out breaks the connection for good, so a frame receive ends only when a
  frame arrives or the peer is lost.

  Split, frames (headers, credit, keepalives, close) go over gloo groups and only payloads over
  the payload groups, and the receiver posts a payload's receive only once its frame has arrived
  and was validated: on NCCL no receive is ever posted blind, so an idle pipe holds no NCCL work
  (a device-wide synchronize in the engine does not wait for the peer's next frame) and a dead
  peer leaves no receive behind. Frames then carry no payload bytes inline (frames are host
  memory, payloads device memory: a copy through the host would cost two synchronising copies).
  Every wait on a payload is bounded by ``silence`` (``Work.wait(timeout=...)``, which on NCCL
  blocks the host until the work is done), and :meth:`GroupChannel.abort` aborts the payload
  groups, so that no payload operation stays posted once the pipe failed.
* :class:`SocketChannel`: on one host, once shared memory is set up (:mod:`kv_pipe.shared_memory`),
  a connected Unix stream socket between the two processes. A frame is sent as its length and its
  bytes; a payload that is not in shared memory follows its frame as plain bytes. A socket reaches
  the peer in a few microseconds and needs no posted receive, and any thread may use it in turn, so
  a caller can send and receive frames itself instead of handing them to a pipe thread (two thread
  wake-ups, about 100 µs a message). A dead peer closes it at once.

Both raise ``OSError`` or ``RuntimeError`` for a broken connection or a peer silent for
``kv_timeout``, which the pipe reports as a lost peer.
"""

from __future__ import annotations

import abc
import datetime
import logging
import math
import select
import socket
import struct
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from kv_pipe.errors import KVProtocolError

logger = logging.getLogger(__name__)

TAG_FRAME = 0
TAG_PAYLOAD = 1
_LENGTH = struct.Struct("<Q")  # a frame's byte count, before its bytes on a socket


def wait_for(work: dist.Work, timeout: float) -> None:
    """Wait until ``work`` is done, at most ``timeout`` seconds. On NCCL this blocks the host (a wait
    without a timeout only makes the current stream wait). Raises RuntimeError (from torch) or
    TimeoutError once the bound passed, or the peer was lost."""
    if not work.wait(timeout=datetime.timedelta(seconds=timeout)):
        raise TimeoutError(f"a transfer did not complete within kv_timeout={timeout:g} s")


class Channel(abc.ABC):
    #: Whether a receive can give up at a deadline (else it lasts until a frame comes or the peer is
    #: lost, and only a caller with time to spare may wait in it).
    interruptible: bool
    #: Whether a caller's thread may send and receive frames itself rather than leave it to the
    #: pipe's threads. Not on NCCL: an NCCL operation runs on the issuing thread's current stream,
    #: and its wait makes that stream (an engine's) wait, for a receive until the peer's next frame.
    callers_may_post: bool = True

    @abc.abstractmethod
    def post(self, tensor: torch.Tensor, tag: int) -> object | None:
        """Start sending ``tensor`` (contiguous, 1-D uint8): a frame (TAG_FRAME) or a payload chunk.
        Returns None once it is sent, else a handle to :meth:`finish`; until then ``tensor`` must
        stay alive and unchanged, and later posts go out after it."""

    @abc.abstractmethod
    def finish(self, handle: object) -> None:
        """Wait until the send behind ``handle`` (from :meth:`post`) has completed."""

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        """Send ``tensor`` and wait until it has left."""
        handle = self.post(tensor, tag)
        if handle is not None:
            self.finish(handle)

    @abc.abstractmethod
    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        """Receive a frame into ``tensor`` (at most its size) or a payload chunk of exactly its size."""

    @abc.abstractmethod
    def recv_frame_by(self, frame: torch.Tensor, wait_until: float | None, spin: float = 0.0) -> bool:
        """Receive a frame into ``frame``; False if none started by the monotonic time ``wait_until``
        (None: wait up to the silence bound; ignored where not :attr:`interruptible`), polling
        without pause for the first ``spin`` seconds where that is possible."""

    @abc.abstractmethod
    def readable(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a frame to start; True if one may have (at once where
        not :attr:`interruptible`: only a receive can tell)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """The pipe failed: end what no thread should wait for any more. Never raises."""

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of the connection (once no thread uses the channel any more)."""


class GroupChannel(Channel):
    interruptible = False

    def __init__(
        self,
        outgoing: dist.ProcessGroup,
        incoming: dist.ProcessGroup,
        peer_rank: int,
        callers_may_post: bool = True,
        settle: Callable[[], None] | None = None,
        payload_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
        silence: float | None = None,
    ) -> None:
        """``outgoing``/``incoming``: the groups of frames (and of payloads, unless split).
        ``settle``: called after each wait; on NCCL it blocks until the operation is done (a plain
        wait there only orders the current stream), so that every operation ends as on gloo.
        ``payload_groups``: (outgoing, incoming) groups of payloads alone: the split channel, whose
        payload waits last at most ``silence`` seconds each (required with it)."""
        if payload_groups is not None and silence is None:
            raise ValueError("a split channel bounds its payload waits: it needs silence")
        self.callers_may_post = callers_may_post
        self._settle = settle or (lambda: None)
        self.outgoing = outgoing
        self.incoming = incoming
        self.payload_outgoing, self.payload_incoming = payload_groups or (outgoing, incoming)
        self._peer = peer_rank
        self._payload_wait = None if payload_groups is None else silence

    @property
    def split(self) -> bool:
        """Whether payloads travel on groups of their own, each posted only behind its frame."""
        return self._payload_wait is not None

    @property
    def inline_payloads(self) -> bool:
        """Whether a frame may carry a tensor's bytes after its header (not when split)."""
        return not self.split

    def post(self, tensor: torch.Tensor, tag: int) -> tuple[dist.Work, int]:
        group = self.outgoing if tag == TAG_FRAME else self.payload_outgoing
        return group.send([tensor], self._peer, tag), tag  # the work holds the tensor until done

    def finish(self, handle: tuple[dist.Work, int]) -> None:
        self._wait(*handle)

    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        group = self.incoming if tag == TAG_FRAME else self.payload_incoming
        self._wait(group.recv([tensor], self._peer, tag), tag)

    def _wait(self, work: dist.Work, tag: int) -> None:
        if tag == TAG_FRAME or self._payload_wait is None:
            work.wait()
        else:
            wait_for(work, self._payload_wait)
        self._settle()

    def recv_frame_by(self, frame: torch.Tensor, wait_until: float | None, spin: float = 0.0) -> bool:
        self.recv(frame, TAG_FRAME)
        return True

    def readable(self, timeout: float) -> bool:
        return True

    def abort(self) -> None:
        """The pipe failed: abort the payload groups of a split channel, so that no payload
        operation stays posted (on NCCL it would hold the device; a thread waiting in one returns).
        Local and bounded; never raises. The frame groups are left to their own timeout."""
        if not self.split:
            return
        for group in (self.payload_outgoing, self.payload_incoming):
            try:
                group.abort()
            except RuntimeError as exc:
                logger.info("aborting a payload group failed: %s", exc)

    def close(self) -> None:
        """Release the groups; a split channel aborts its payload groups first (no operation is
        pending by now), as NCCL expects a communicator to be ended before it is destroyed and
        an abort, unlike a shutdown, never waits for the peer."""
        self.abort()
        self.outgoing = self.incoming = None  # the pipe keeps the store alive as long as the groups
        self.payload_outgoing = self.payload_incoming = None


class SocketChannel(Channel):
    """A connected stream socket, kept in blocking mode and driven with MSG_DONTWAIT and poll, so
    that every wait has its own bound: ``silence`` seconds without progress is a lost peer."""

    interruptible = True

    def __init__(self, sock: socket.socket, silence: float) -> None:
        sock.setblocking(True)
        self.sock = sock
        self.silence = silence
        self._length = bytearray(_LENGTH.size)

    def post(self, tensor: torch.Tensor, tag: int) -> None:
        data = memoryview(tensor.numpy()).cast("B")
        if tag == TAG_FRAME:
            self._write(memoryview(_LENGTH.pack(len(data))))
        self._write(data)

    def finish(self, handle: object) -> None:
        raise AssertionError("a socket's posts complete before they return: there is nothing to finish")

    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        if tag == TAG_FRAME:
            self.recv_frame_by(tensor, wait_until=None)
        else:
            self._read(memoryview(tensor.numpy()).cast("B"), None)

    def recv_frame_by(self, frame: torch.Tensor, wait_until: float | None, spin: float = 0.0) -> bool:
        # Spinning, a peer that answers within ``spin`` is seen without a kernel wake-up.
        length = memoryview(self._length)
        if not self._read(length, wait_until, spin):
            return False
        (nbytes,) = _LENGTH.unpack(length)
        view = memoryview(frame.numpy()).cast("B")
        if not 0 < nbytes <= len(view):
            raise KVProtocolError(f"peer announced a {nbytes}-byte frame; frames hold at most {len(view)}")
        self._read(view[:nbytes], None)
        return True

    def readable(self, timeout: float) -> bool:
        return bool(_poll(self.sock, select.POLLIN, timeout))

    def abort(self) -> None:
        pass  # every wait on a socket has its own bound; the socket closes with the pipe

    def close(self) -> None:
        self.sock.close()

    def _read(self, view: memoryview, wait_until: float | None, spin: float = 0.0) -> bool:
        """Fill ``view``. With ``wait_until``, return False if not one byte came by then; once one
        has (or without it), no pause may last ``silence`` seconds."""
        got = 0
        spin_until = time.monotonic() + spin
        while got < len(view):
            try:
                count = self.sock.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                now = time.monotonic()
                if now < spin_until:
                    continue
                if not got and wait_until is not None:
                    if not _poll(self.sock, select.POLLIN, wait_until - now) and time.monotonic() >= wait_until:
                        return False
                elif not _poll(self.sock, select.POLLIN, self.silence):
                    raise TimeoutError(f"the peer sent nothing for kv_timeout={self.silence:g} s") from None
                continue
            if count == 0:
                raise ConnectionResetError("the peer closed the connection")
            got += count
        return True

    def _write(self, data: memoryview) -> None:
        sent = 0
        while sent < len(data):
            try:
                sent += self.sock.send(data[sent:], socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            except BlockingIOError:
                if not _poll(self.sock, select.POLLOUT, self.silence):
                    raise TimeoutError(f"the peer took nothing in for kv_timeout={self.silence:g} s") from None


def _poll(sock: socket.socket, events: int, timeout: float) -> int:
    poller = select.poll()
    poller.register(sock, events | select.POLLHUP | select.POLLERR)
    ready = poller.poll(math.ceil(timeout * 1000) if timeout > 0 else 0)
    return ready[0][1] if ready else 0
