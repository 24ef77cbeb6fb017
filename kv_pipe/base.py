"""The tensor pipe contract.

A pipe connects exactly two processes and carries a FIFO stream of tensors (or ``None``) in each
direction. Upper layers (the lookup buffer, the connector) only rely on what this module states.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from types import TracebackType

import torch

from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVConfigError
from kv_pipe.exported_memory import ExportDescriptor, PeerMemory


class KVPipeBase(abc.ABC):
    """A bidirectional, FIFO, point-to-point tensor pipe.

    Ordering: tensors sent by one side arrive at the other in the order ``send_tensor`` was called
    (calls made from several threads are ordered by the pipe's internal lock). The two directions
    are independent and may be used at the same time.

    Errors: every error is a :class:`kv_pipe.KVTransferError`. A dead or silent peer surfaces as
    :class:`kv_pipe.KVPeerLostError` within the configured ``kv_timeout``; an orderly close by the
    peer as :class:`kv_pipe.KVPipeClosedError` once everything it sent has been received. A bug in
    the pipe itself (a ``TypeError``, say) is not dressed up as a transfer error: it fails the pipe
    and every later call raises it as itself.

    Attributes every pipe has: ``config`` (its :class:`kv_pipe.KVTransferConfig`) and
    ``port_offset`` (added to ``kv_port``; layers above derive their own ports from it).
    """

    config: KVTransferConfig
    port_offset: int

    @property
    @abc.abstractmethod
    def max_tensor_bytes(self) -> int:
        """The largest tensor (in bytes) :meth:`send_tensor` accepts, agreed with the peer at connect
        time (the smaller ``kv_buffer_size`` of the two sides, less per-message bookkeeping)."""

    @abc.abstractmethod
    def send_tensor(self, tensor: torch.Tensor | None, timeout: float | None = None) -> None:
        """Queue ``tensor`` (or ``None``) for sending and return; the transfer runs in the background.

        Ownership: the pipe keeps a reference to ``tensor`` (a contiguous tensor is not copied)
        until it has been sent; the caller must not modify it in place before :meth:`flush`
        returns. Blocks while the bytes in flight (queued, on the wire, or received but not yet
        taken by the peer) would exceed ``kv_buffer_size``, at most ``timeout`` seconds (``None``:
        as long as the peer is alive); calls that wait get room in the order they began waiting.
        A pipe may also send a small tensor from the calling thread and return once its frame has
        left, if the caller has time to spare: it never waits for the peer's user. Thread-safe.

        Raises:
            KVTransferError: the tensor alone exceeds ``kv_buffer_size``, its dtype cannot be
                transferred, the pipe is closed or broken, or an earlier background send failed.
            KVTimeoutError: the byte budget stayed full for ``timeout`` seconds.
        """

    @abc.abstractmethod
    def send_tensors(self, tensors: Sequence[torch.Tensor | None], timeout: float | None = None) -> None:
        """Queue ``tensors`` (each a tensor or ``None``) in order, as one unit, and return.

        A unit leaves back to back: no tensor sent by another thread comes between its items, and
        small items share a frame with their neighbours, so a small header sent with the large
        tensors it describes costs no message of its own. The receiver takes each item with its own
        :meth:`recv_tensor`. A unit whose items together exceed ``kv_buffer_size`` cannot be in
        flight at once; it is sent item by item, and other threads' tensors may then come between.

        Ownership, blocking (``timeout`` covers the whole call), thread safety and errors are those
        of :meth:`send_tensor`; every item is checked before any is queued.
        """

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A new tensor to fill and then send, in memory the pipe sends fastest (see the
        implementation); a plain ``torch.empty`` here. Once sent, do not modify it. Thread-safe."""
        return torch.empty(tuple(shape), dtype=dtype)

    @property
    def uses_shared_memory(self) -> bool:
        """Whether this pipe has a same-host path to its peer (which can then map exported memory)."""
        return False

    def map_peer_memory(self, descriptor: ExportDescriptor) -> PeerMemory:
        """Memory the peer exported (:func:`kv_pipe.exported_memory.export_host_memory`), mapped
        read-only here; the same mapping for every call with the same export. Thread-safe.

        Raises:
            KVConfigError: this pipe has no same-host path to its peer.
            KVProtocolError: the descriptor names no export of the peer.
        """
        raise KVConfigError("this pipe cannot map its peer's memory: it has no same-host path")

    @abc.abstractmethod
    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor | None:
        """Return the next tensor (or ``None``) the peer sent, on this pipe's device.

        Blocks until one has arrived, at most ``timeout`` seconds (``None``: as long as the peer is
        alive; an idle, live peer is not an error). The returned tensor belongs to the caller. On
        the host its memory may come from the pipe rather than torch's allocator, so its storage
        cannot be resized (``resize_``); ``clone()`` gives one that can.
        Thread-safe; each item goes to exactly one caller.

        Raises:
            KVTimeoutError: nothing arrived within ``timeout``; the pipe remains usable.
            KVPeerLostError / KVPipeClosedError / KVProtocolError: the stream ended; items that
                arrived before the failure are still returned first.
        """

    @abc.abstractmethod
    def flush(self, timeout: float | None = None) -> None:
        """Block until every queued tensor has been handed to the wire; re-raise a send error."""

    @abc.abstractmethod
    def close(self) -> None:
        """Send everything queued, tell the peer, release the connection. Idempotent.

        Bounded by twice ``kv_timeout``. Raises the first background error that was not yet
        reported if it cost queued messages (they were never sent) or is a bug in the pipe itself.
        """

    def __enter__(self) -> KVPipeBase:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
