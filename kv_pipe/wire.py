"""Where a pipe's frames live and how records are written into and read out of them.

* :class:`HostWire`: frames are host memory, headers and inline bytes are written and read
  through byte views (far cheaper per message than torch operations), and a frame is sent only as
  long as its records, since gloo accepts a message shorter than the posted receive. A large inline
  item (from :data:`INLINE_VIEW_MIN_BYTES`) is received as a view of its frame, not a copy: the
  frame's buffer is the item's memory from then on (at most 2.5 times its size), and the next frame
  is received into another buffer from the pool. The same way round, a large item alone in its
  frame that lies in pipe memory with room for a header in front (from :meth:`Wire.allocate_to_send`,
  or a received view) is sent from where it lies: its header is written in front of it, and no
  copy is made.

A CUDA pipe's frames are host memory too: they travel over gloo, its payloads over NCCL
(:mod:`kv_pipe.channel`), and its records carry no inline bytes.
"""

from __future__ import annotations

import abc
import ctypes

import torch

from kv_pipe.host_memory import HostMemoryPool
from kv_pipe.protocol import (
    HEADER_BYTES,
    HOST_FRAME_BYTES,
    FrameHeader,
    pack_header,
    record_inline_capacity,
)

#: From this size a received inline item is a view of its frame rather than a copy (the copy would
#: cost more than taking another frame buffer from the pool), and one in pipe memory is sent from
#: where it lies.
INLINE_VIEW_MIN_BYTES = 512 << 10


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a 1-D uint8 tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


class Wire(abc.ABC):
    """One pipe's frames: a send frame written by the sending thread, a receive frame read by the
    receiving thread. Each frame is used by one thread only."""

    frame_bytes: int

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.send_frame = torch.zeros(self.frame_bytes, dtype=torch.uint8, device=device)
        self.recv_frame = self._new_receive_frame()

    def _new_receive_frame(self) -> torch.Tensor:
        return torch.zeros(self.frame_bytes, dtype=torch.uint8, device=self.device)

    @abc.abstractmethod
    def write_record(self, offset: int, header: FrameHeader, data: torch.Tensor | None) -> None:
        """Write a record's header at ``offset`` of the send frame, and ``data`` (contiguous, on the
        pipe's device) after it if the header says it is inline."""

    @abc.abstractmethod
    def frame_to_send(self, used_bytes: int) -> torch.Tensor:
        """The part of the send frame to send when its records fill ``used_bytes``."""

    @abc.abstractmethod
    def received_frame(self) -> memoryview:
        """The last frame received, byte-addressed on the host (its records' headers and inline bytes)."""

    def frame_to_receive(self) -> torch.Tensor:
        """The buffer the next frame is received into (read the last frame's records before)."""
        return self.recv_frame

    @abc.abstractmethod
    def read_inline(self, start: int, header: FrameHeader) -> torch.Tensor:
        """A tensor holding the inline item of ``header`` whose bytes start at ``start``, valid while
        later frames arrive."""

    @abc.abstractmethod
    def allocate(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 buffer on the pipe's device to receive a payload into; owned by the caller."""

    def allocate_to_send(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 buffer on the pipe's device for a tensor the caller fills and sends; owned by
        the caller, and sent fastest."""
        return self.allocate(nbytes)


class HostWire(Wire):
    frame_bytes = HOST_FRAME_BYTES

    def __init__(self, device: torch.device, max_idle_bytes: int) -> None:
        self._memory = HostMemoryPool(max_idle_bytes)
        super().__init__(device)
        self._send_bytes = memoryview(self.send_frame.numpy())
        self._send_address = self.send_frame.data_ptr()
        self._recv_bytes = memoryview(self.recv_frame.numpy())
        self._frame_lent = False  # a received item is a view of the receive frame
        self._frame_in_place: torch.Tensor | None = None  # a frame written in front of its item

    def _new_receive_frame(self) -> torch.Tensor:
        # Pooled, since it may become a received item's memory and come back when that dies; its
        # first header's room stays out of that item, so the item can be sent on without a copy.
        return self._memory.allocate(self.frame_bytes, headroom=HEADER_BYTES)

    def write_record(self, offset: int, header: FrameHeader, data: torch.Tensor | None) -> None:
        if (
            not offset
            and not header.more
            and header.inline
            and header.nbytes >= INLINE_VIEW_MIN_BYTES
            and self._memory.headroom(data) >= HEADER_BYTES
        ):
            # The bytes in front are the pipe's: header and item leave as one message, uncopied.
            flat = flat_bytes(data)
            frame = flat.as_strided((HEADER_BYTES + header.nbytes,), (1,), flat.storage_offset() - HEADER_BYTES)
            pack_header(header, memoryview(frame.numpy())[:HEADER_BYTES])
            self._frame_in_place = frame
            return
        pack_header(header, self._send_bytes[offset : offset + HEADER_BYTES])
        if header.inline and header.nbytes:
            # A plain memory copy: a byte view of the tensor costs more than the copy itself at 4 KiB.
            ctypes.memmove(self._send_address + offset + HEADER_BYTES, data.data_ptr(), header.nbytes)

    def frame_to_send(self, used_bytes: int) -> torch.Tensor:
        if self._frame_in_place is not None:
            frame, self._frame_in_place = self._frame_in_place, None
            return frame
        return self.send_frame[:used_bytes]

    def received_frame(self) -> memoryview:
        return self._recv_bytes

    def read_inline(self, start: int, header: FrameHeader) -> torch.Tensor:
        if header.nbytes >= INLINE_VIEW_MIN_BYTES:
            # The item keeps the whole frame; the next frame is received into another buffer.
            self._frame_lent = True
            return self.recv_frame[start : start + header.nbytes].view(header.dtype).reshape(header.shape)
        # A bytearray copy and a tensor over it cost half of torch's clone of a frame slice.
        flat = torch.frombuffer(bytearray(self._recv_bytes[start : start + header.nbytes]), dtype=header.dtype)
        return flat.reshape(header.shape)

    def frame_to_receive(self) -> torch.Tensor:
        if self._frame_lent:
            self._frame_lent = False
            self.recv_frame = self._new_receive_frame()
            self._recv_bytes = memoryview(self.recv_frame.numpy())
        return self.recv_frame

    def allocate(self, nbytes: int) -> torch.Tensor:
        return self._memory.allocate(nbytes)

    def allocate_to_send(self, nbytes: int) -> torch.Tensor:
        # Room for a header only where it can be used: a larger tensor is a payload after its frame,
        # and the room would cost it a larger size class.
        if not INLINE_VIEW_MIN_BYTES <= nbytes <= record_inline_capacity(self.frame_bytes, 0):
            return self.allocate(nbytes)
        return self._memory.allocate(HEADER_BYTES + nbytes, headroom=HEADER_BYTES)[HEADER_BYTES:]
