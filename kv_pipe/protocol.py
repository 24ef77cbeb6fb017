"""The pipe's wire format: fixed-size frames whose headers are validated before anything is received.

Every message starts with one frame: a header of ``HEADER_WORDS`` little-endian int64 words, then
an inline area. A tensor that fits the inline area travels inside its frame (one message); a larger
one follows its frame as a payload, cut into chunks of at most ``CHUNK_BYTES`` so that no single
transport operation outlives ``kv_timeout``.

A frame may hold several records, one per item of a ``send_tensors`` unit: each record is a header
and the item's inline bytes, the next starting at the following ``RECORD_ALIGN`` boundary, and a
header's ``more`` word says whether another record follows. Payloads of the frame's records follow
the frame in record order. So a small header and the large tensors it describes cost one frame.

A payload may instead travel through shared memory (:mod:`kv_pipe.shared_memory`): its record then
names the region of the sender's segment that holds it (``place``). Regions whose tensors have died
go back to their owner with the next frame: one alone in its first record's ``freed`` word (no
record of its own: with one message in flight each way, the usual case), several in a ``FREED``
record first in the frame.

Every frame reports, in its first record, the bytes its sender's user has consumed (credit, see
:mod:`kv_pipe.credit`) and whether its sender is waiting for credit.

Frames travel over gloo on every pipe (a CUDA pipe's payloads over NCCL), and both sides check
the frame size at the rendezvous. Gloo accepts a message shorter than the posted receive, so a
frame is sent only as long as its header and inline bytes, and its inline area is large (1 MiB):
tensors up to that size cost one message instead of two (on CUDA, where payloads are device
memory, records carry no inline bytes). Gloo aborts the whole process when a message is *larger*
than the posted receive, so sizes are never taken on trust: :func:`decode_header` checks every
field before a payload receive is posted.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
from collections.abc import Sequence

import torch

from kv_pipe.errors import KVProtocolError, KVTransferError

MAGIC = 0x4B5642524447  # "KVBRDG"
PROTOCOL_VERSION = 8
HEADER_WORDS = 64
HEADER_BYTES = HEADER_WORDS * 8
HOST_FRAME_BYTES = HEADER_BYTES + (1 << 20)
CHUNK_BYTES = 64 << 20
MAX_NDIM = 48
#: Shared-memory regions start at multiples of this (page-aligned copies run fastest; every dtype is
#: aligned), after the segment's first page, which holds the nonce that proves the mapping.
SHARED_REGION_ALIGN = 4096
SHARED_DATA_START = SHARED_REGION_ALIGN
#: Tensors from this size up go through shared memory when it is set up, even those that would fit a
#: frame: the frame then carries only the header, and the receiver's tensor is a view (no copy).
SHARED_MIN_BYTES = 256 << 10
#: Most regions one FREED record gives back.
MAX_FREED_PER_RECORD = 1024
#: Records in a frame start at multiples of this, so every dtype's inline bytes are aligned.
RECORD_ALIGN = 64
#: Bytes charged against the in-flight budget per message on top of its payload, so that floods of
#: tiny tensors or Nones are bounded too.
MESSAGE_OVERHEAD = 256


class FrameKind(enum.IntEnum):
    TENSOR = 1
    NONE = 2
    KEEPALIVE = 3  # carries credit and proves liveness; nothing for the user
    CLOSE = 4  # the sender will send nothing more
    CLOSE_ACK = 5  # answer to CLOSE: the sender will send nothing more either
    FREED = 6  # int64 offsets of shared-memory regions whose tensors died; first in its frame


#: Kinds of records that carry an item for the user (and a sequence number).
ITEM_KINDS = (FrameKind.TENSOR, FrameKind.NONE)
#: Kinds of records that carry tensor fields.
_TENSOR_KINDS = (FrameKind.TENSOR, FrameKind.FREED)


# Stable wire codes: append only, never renumber. Quantized dtypes are absent on purpose (their
# scale and zero point are not part of the storage).
_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
    "float64", "complex32", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
)  # fmt: skip
DTYPE_TO_CODE: dict[torch.dtype, int] = {}
CODE_TO_DTYPE: dict[int, torch.dtype] = {}
for _code, _name in enumerate(_DTYPE_NAMES, start=1):
    _dtype = getattr(torch, _name, None)
    if isinstance(_dtype, torch.dtype):  # older torch builds lack some
        DTYPE_TO_CODE[_dtype] = _code
        CODE_TO_DTYPE[_code] = _dtype

# Header word positions.
_W_MAGIC, _W_VERSION, _W_KIND, _W_SEQ, _W_CONSUMED, _W_WANT_CREDIT = 0, 1, 2, 3, 4, 5
_W_DTYPE, _W_NDIM, _W_NBYTES, _W_INLINE, _W_MORE, _W_PLACE, _W_FREED, _W_SHAPE = 6, 7, 8, 9, 10, 11, 12, 13

# Headers are packed with struct straight into the frame's memory: per message this costs a third
# of building and reading lists of words, which a small tensor's whole trip would notice.
_FIXED = struct.Struct(f"<{_W_SHAPE}q")  # the words before the shape
_SHAPES = tuple(struct.Struct(f"<{ndim}q") for ndim in range(MAX_NDIM + 1))
_ALL_WORDS = struct.Struct(f"<{HEADER_WORDS}q")
_ZERO_BYTES = bytes(HEADER_BYTES)  # compared against as bytes (fast), assigned from as a view (no copy)
_ZEROS = memoryview(_ZERO_BYTES)
_KINDS = {int(kind): kind for kind in FrameKind}


@dataclasses.dataclass(slots=True)
class FrameHeader:
    kind: FrameKind
    seq: int
    consumed: int
    want_credit: bool
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    nbytes: int = 0
    inline: bool = False  # the tensor's bytes are inside the frame
    more: bool = False  # another record follows in this frame
    place: int = 0  # where the payload is in the sender's shared-memory segment; 0: not there
    freed: int = 0  # a region of the receiver's segment given back (first record of a frame only); 0: none


def record_inline_capacity(frame_bytes: int, offset: int) -> int:
    """How many inline bytes a record starting at ``offset`` of a frame can carry."""
    return frame_bytes - offset - HEADER_BYTES


def next_record_offset(offset: int, inline_bytes: int) -> int:
    """Where the record after one at ``offset`` with ``inline_bytes`` inside the frame starts."""
    end = offset + HEADER_BYTES + inline_bytes
    return (end + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN


def message_cost(nbytes: int) -> int:
    return nbytes + MESSAGE_OVERHEAD


def pack_header(header: FrameHeader, buffer: memoryview | bytearray) -> None:
    """Write ``header`` as the first HEADER_BYTES of ``buffer`` (writable, byte-addressed)."""
    tensor = header.kind in _TENSOR_KINDS
    ndim = len(header.shape) if tensor else 0
    _FIXED.pack_into(
        buffer,
        0,
        MAGIC,
        PROTOCOL_VERSION,
        header.kind,
        header.seq,
        header.consumed,
        header.want_credit,
        DTYPE_TO_CODE[header.dtype] if tensor else 0,
        ndim,
        header.nbytes,
        header.inline,
        header.more,
        header.place,
        header.freed,
    )
    _SHAPES[ndim].pack_into(buffer, _FIXED.size, *header.shape)
    end = _FIXED.size + 8 * ndim
    buffer[end:HEADER_BYTES] = _ZEROS[end:]  # frames are reused: no word may stay from an earlier header


def encode_header(header: FrameHeader) -> list[int]:
    """The HEADER_WORDS int64 words of ``header`` (for tools and tests that forge frames)."""
    buffer = bytearray(HEADER_BYTES)
    pack_header(header, buffer)
    return list(_ALL_WORDS.unpack(buffer))


def _all_zero(buffer: memoryview, start: int) -> bool:
    """Whether the header's bytes from ``start`` on are all zero."""
    # As bytes: comparing memoryviews goes byte by byte in Python's generic path, four times slower.
    return buffer[start:HEADER_BYTES].tobytes() == _ZERO_BYTES[start:]


def decode_header(buffer: memoryview, max_nbytes: int, inline_capacity: int, shared_bytes: int = 0) -> FrameHeader:
    """Parse and validate a received header; raise KVProtocolError on anything off.

    ``buffer`` holds the record's HEADER_BYTES, byte-addressed. ``max_nbytes`` is the largest
    payload this side agreed to accept: a header claiming more is refused before any memory is
    allocated or any receive is posted. ``inline_capacity`` is what the record's inline area can
    hold (:func:`record_inline_capacity`): the header's inline flag must say exactly whether the
    tensor fits it, and is never set for a tensor in shared memory. ``shared_bytes`` is the size of
    the peer's shared-memory segment as mapped on this side (0: none): a place outside it is refused
    before anything is read there. Only records of items (TENSOR, NONE) and FREED may say that
    another record follows. A ``freed`` word must name a region start of a segment (whether this
    side gave that region is the caller's to check).
    """
    (
        magic,
        version,
        kind_code,
        seq,
        consumed,
        want_credit,
        dtype_code,
        ndim,
        nbytes,
        inline_word,
        more,
        place,
        freed,
    ) = _FIXED.unpack_from(buffer)
    if magic != MAGIC:
        raise KVProtocolError(f"peer sent a frame with bad magic {magic:#x}: not a kvbridge pipe")
    if version != PROTOCOL_VERSION:
        raise KVProtocolError(
            f"peer speaks kvbridge pipe protocol version {version}, this side speaks "
            f"{PROTOCOL_VERSION}: install the same kvbridge version on both sides"
        )
    kind = _KINDS.get(kind_code)
    if kind is None:
        raise KVProtocolError(f"peer sent an unknown frame kind {kind_code}")
    if consumed < 0 or want_credit not in (0, 1) or seq < 0 or more not in (0, 1):
        raise KVProtocolError(f"peer sent a malformed {kind.name} header: {list(_FIXED.unpack_from(buffer))}")
    if more and kind not in ITEM_KINDS and kind is not FrameKind.FREED:
        raise KVProtocolError(f"peer sent a {kind.name} record that claims another record follows it")
    if freed and (freed < SHARED_DATA_START or freed % SHARED_REGION_ALIGN):
        raise KVProtocolError(f"peer gave back shared-memory offset {freed}, which is no region start")
    if kind not in _TENSOR_KINDS:
        if dtype_code or ndim or nbytes or inline_word or place or not _all_zero(buffer, _FIXED.size):
            raise KVProtocolError(f"peer sent a {kind.name} frame with tensor fields set")
        return FrameHeader(kind, seq, consumed, bool(want_credit), more=bool(more), freed=freed)
    dtype = CODE_TO_DTYPE.get(dtype_code)
    if dtype is None:
        raise KVProtocolError(f"peer sent unknown dtype code {dtype_code}")
    if not 0 <= ndim <= MAX_NDIM:
        raise KVProtocolError(f"peer sent a tensor header with ndim={ndim} (limit {MAX_NDIM})")
    shape = _SHAPES[ndim].unpack_from(buffer, _FIXED.size)
    end = _FIXED.size + 8 * ndim
    if (shape and min(shape) < 0) or not _all_zero(buffer, end):
        raise KVProtocolError(f"peer sent a malformed shape {list(_ALL_WORDS.unpack_from(buffer))[_W_SHAPE:]}")
    if nbytes > max_nbytes:
        raise KVProtocolError(
            f"peer announced a {nbytes}-byte tensor, more than the agreed limit of {max_nbytes} "
            f"bytes (kv_buffer_size); refused before allocating"
        )
    if nbytes != math.prod(shape) * dtype.itemsize:
        raise KVProtocolError(
            f"peer announced {nbytes} bytes for a {dtype} tensor of shape {shape}: inconsistent header"
        )
    inline = nbytes <= inline_capacity and not place
    if inline_word != inline:
        raise KVProtocolError(f"peer's inline flag {inline_word} disagrees with size {nbytes}")
    if kind is FrameKind.FREED and (
        dtype is not torch.int64 or ndim != 1 or not inline or place or not nbytes or shape[0] > MAX_FREED_PER_RECORD
    ):
        raise KVProtocolError(f"peer sent a malformed FREED record: {list(_FIXED.unpack_from(buffer))}")
    if place and (inline or place < SHARED_DATA_START or place % SHARED_REGION_ALIGN or place + nbytes > shared_bytes):
        raise KVProtocolError(
            f"peer placed a {nbytes}-byte payload at byte {place} of its shared-memory segment, outside the "
            f"{shared_bytes} bytes mapped here (or not at a region start); refused before reading it"
        )
    return FrameHeader(kind, seq, consumed, bool(want_credit), dtype, shape, nbytes, inline, bool(more), place, freed)


@dataclasses.dataclass(slots=True)
class Record:
    """One record to send, before it is laid out in a frame: an item (TENSOR, NONE) or a control
    record. ``place``: where its payload lies in the sender's shared-memory segment (0: not there)."""

    kind: FrameKind
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    nbytes: int = 0
    place: int = 0


def lay_out_records(
    records: Sequence[Record],
    frame_bytes: int,
    inline_payloads: bool,
    seq: int,
    consumed: int,
    want_credit: bool,
    freed: int = 0,
) -> list[tuple[int, FrameHeader]]:
    """Where each record of a unit starts in its frame, and its header: the first record's gives
    back region ``freed``; ``seq`` is the sequence number of the unit's first item.

    Records share a frame while the next one's header fits after the last one's inline bytes; a
    tensor is inline if it fits where its record starts, is not in shared memory, and
    ``inline_payloads`` (else it is a payload behind its frame). A frame ends after a record whose
    header says no ``more``.
    """
    laid_out = []
    offset = 0  # where the current record starts in its frame
    last = len(records) - 1
    for index, record in enumerate(records):
        header = FrameHeader(
            record.kind,
            seq,
            consumed,
            want_credit,
            record.dtype,
            record.shape,
            record.nbytes,
            freed=0 if index else freed,
            place=record.place,
        )
        if record.dtype is not None:
            capacity = record_inline_capacity(frame_bytes, offset) if inline_payloads else 0
            header.inline = record.nbytes <= capacity and not record.place
        if record.kind in ITEM_KINDS:
            seq += 1
        laid_out.append((offset, header))
        if index < last:
            following = next_record_offset(offset, record.nbytes if header.inline else 0)
            header.more = following + HEADER_BYTES <= frame_bytes
            offset = following if header.more else 0
    return laid_out


def frame_length(offset: int, header: FrameHeader) -> int:
    """The bytes a frame whose last record starts at ``offset`` with ``header`` fills."""
    return offset + HEADER_BYTES + (header.nbytes if header.inline else 0)


def decode_frame(
    frame: memoryview, inline_payloads: bool, max_nbytes: int, shared_bytes: int, seq: int
) -> list[tuple[int, FrameHeader]]:
    """Parse and validate every record of a received frame (byte-addressed, as long as the frames
    both sides agreed on): where each starts and its header, in order. ``seq`` is the sequence
    number the peer's next item must carry; the rest is as for :func:`decode_header`. Raises
    KVProtocolError on anything off, before any payload is received.
    """
    frame_bytes = len(frame)
    offset = 0
    records = []
    while True:
        capacity = record_inline_capacity(frame_bytes, offset) if inline_payloads else 0
        header = decode_header(
            frame[offset : offset + HEADER_BYTES],
            max_nbytes=max_nbytes,
            inline_capacity=capacity,
            shared_bytes=shared_bytes,
        )
        if records:
            first = records[0][1]
            if header.consumed != first.consumed or header.want_credit != first.want_credit:
                raise KVProtocolError("peer sent a frame whose records disagree on credit")
            if header.kind not in ITEM_KINDS:
                raise KVProtocolError(f"peer sent a {header.kind.name} record after another record in one frame")
            if header.freed:
                raise KVProtocolError("peer gave a region back in a record other than its frame's first")
        if (header.freed or header.kind is FrameKind.FREED) and not shared_bytes:
            raise KVProtocolError("peer freed shared-memory regions, but this side gave it none")
        if header.kind in ITEM_KINDS:
            if header.seq != seq:
                raise KVProtocolError(f"peer's message {header.seq} arrived where {seq} was due")
            seq += 1
        records.append((offset, header))
        if not header.more:
            return records
        offset = next_record_offset(offset, header.nbytes if header.inline else 0)
        if offset + HEADER_BYTES > frame_bytes:
            raise KVProtocolError(f"peer announced a record at byte {offset}, past the end of its frame")


def check_sendable(tensor: torch.Tensor) -> None:
    """Raise KVTransferError if ``tensor`` cannot travel through a pipe."""
    if not isinstance(tensor, torch.Tensor):
        raise KVTransferError(f"send_tensor takes a torch.Tensor or None, got {type(tensor).__name__}")
    if tensor.layout is not torch.strided:
        raise KVTransferError(f"only strided (dense) tensors can be sent, got layout {tensor.layout}")
    if tensor.is_quantized:
        raise KVTransferError("quantized tensors carry a scale and zero point: dequantize before sending")
    if tensor.dtype not in DTYPE_TO_CODE:
        raise KVTransferError(f"dtype {tensor.dtype} cannot be sent through a kvbridge pipe")
    if tensor.dim() > MAX_NDIM:
        raise KVTransferError(f"tensor has {tensor.dim()} dimensions; the pipe carries at most {MAX_NDIM}")


def chunk_bounds(nbytes: int) -> list[tuple[int, int]]:
    """The [start, end) byte ranges a payload of ``nbytes`` is sent in; both sides agree on them."""
    return [(start, min(start + CHUNK_BYTES, nbytes)) for start in range(0, nbytes, CHUNK_BYTES)]


# The rendezvous greeting, exchanged through the TCPStore before the process group exists, so that
# incompatible peers are told why instead of failing inside gloo.
_HELLO_PREFIX = struct.Struct("<qq")  # magic, version: read first, so any version is told apart
_HELLO = struct.Struct("<qqqqqq16s")
DEVICE_CODES = {"cpu": 0, "cuda": 1}
GPU_ID_BYTES = 16


@dataclasses.dataclass(frozen=True)
class Hello:
    frame_bytes: int
    max_in_flight: int
    device: str
    #: The sender's kv_timeout: both sides send keepalives often enough for the shorter one.
    timeout_ms: int
    #: The UUID of the sender's GPU (a CUDA pipe's device); empty for a host pipe. Two sides on one
    #: GPU are refused: NCCL cannot connect two processes on the same device.
    gpu_id: bytes = b""

    def pack(self) -> bytes:
        if len(self.gpu_id) not in (0, GPU_ID_BYTES):
            raise ValueError(f"a GPU identity has {GPU_ID_BYTES} bytes, got {len(self.gpu_id)}")
        return _HELLO.pack(
            MAGIC,
            PROTOCOL_VERSION,
            self.frame_bytes,
            self.max_in_flight,
            DEVICE_CODES[self.device],
            self.timeout_ms,
            self.gpu_id,
        )

    @classmethod
    def unpack(cls, data: bytes) -> Hello:
        if len(data) < _HELLO_PREFIX.size:
            raise KVProtocolError(f"peer's rendezvous greeting has {len(data)} bytes, expected {_HELLO.size}")
        magic, version = _HELLO_PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise KVProtocolError("the process at the rendezvous address is not a kvbridge pipe")
        if version != PROTOCOL_VERSION:
            raise KVProtocolError(
                f"peer speaks kvbridge pipe protocol version {version}, this side speaks "
                f"{PROTOCOL_VERSION}: install the same kvbridge version on both sides"
            )
        if len(data) != _HELLO.size:
            raise KVProtocolError(f"peer's rendezvous greeting has {len(data)} bytes, expected {_HELLO.size}")
        _, _, frame_bytes, max_in_flight, device_code, timeout_ms, gpu_id = _HELLO.unpack(data)
        devices = {code: name for name, code in DEVICE_CODES.items()}
        if device_code not in devices or frame_bytes <= HEADER_BYTES or max_in_flight <= 0 or timeout_ms <= 0:
            raise KVProtocolError(f"peer's rendezvous greeting is malformed: {_HELLO.unpack(data)}")
        return cls(
            frame_bytes=frame_bytes,
            max_in_flight=max_in_flight,
            device=devices[device_code],
            timeout_ms=timeout_ms,
            gpu_id=b"" if gpu_id == bytes(GPU_ID_BYTES) else gpu_id,
        )
