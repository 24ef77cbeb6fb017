"""The stored object: one chunk's tensors with everything needed to refuse the wrong ones.

Layout (little-endian; struct-packed, nothing unpickled)::

    preamble  magic "KVBS" | format version u16 | flags u16 | body length u64
    checksum  BLAKE3-256 of preamble and body
    [tag]     keyed BLAKE3-256 of preamble and checksum, with the store's MAC key (flag AUTHENTICATED)
    body      key length u16 | token count u32 | tensor count u32 | key | token ids int64 ...
              | per tensor: dtype code u8 (0: None) | ndim u8 | shape int64 x ndim
              | payload: each tensor's bytes, in order

The checksum catches torn and bit-flipped objects; the tag, when a secret is configured, refuses
objects written by anyone without it (a poisoned store), because anyone can compute a checksum. The
reader checks that the object is the one it asked for (its key and its exact token ids), so a hash
collision or a mixed-up file is a miss, never wrong KV. Dtypes use kvbridge's fixed wire table.

Why BLAKE3 and one pass: hashing is most of the cost of reading an object (tens of MiB per chunk),
and BLAKE3 is a cryptographic hash several times faster than BLAKE2b or SHA-256. The tag signs the
checksum rather than the body (hash, then MAC): forging an authenticated object without the key
means finding another body with the BLAKE3-256 digest of an authentic one, which BLAKE3's collision
resistance rules out, and the keyed BLAKE3 (a PRF under the key) rules out tagging a new digest. So
the payload is hashed once, with or without a secret, and a damaged object is still told apart from
a foreign one (``checksum`` vs ``not authenticated``). A non-cryptographic checksum (CRC32, xxHash)
would do against corruption alone, but then a secret would need a second, keyed pass over the
payload; BLAKE3 does both in one pass at about the speed of CRC32.
"""

from __future__ import annotations

import hmac
import math
import struct
import warnings
from collections.abc import Sequence
from typing import TypeAlias

import numpy
import torch
from blake3 import blake3

from kv_pipe.auth import derive_key
from kv_pipe.protocol import CODE_TO_DTYPE, DTYPE_TO_CODE
from kv_store.base import Blob, KVStoreError, KVStoreObjectError
from kv_store.keys import token_bytes

FORMAT_VERSION = 2
MAGIC = b"KVBS"
_PREAMBLE = struct.Struct("<4sHHQ")
_COUNTS = struct.Struct("<HII")
_TENSOR = struct.Struct("<BB")
_DIM = struct.Struct("<q")
_DIGEST_BYTES = 32
_AUTHENTICATED = 1
MAX_NDIM = 64

# decode_chunk(copy=False) returns read-only views of the (immutable) blob on purpose; torch warns
# about each. Only this module's calls are silenced.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=__name__)


def mac_key_from_secret(secret: str | None) -> bytes | None:
    """The HMAC key of stored objects for a ``kv_secret`` (None without one): derived for this
    purpose only, so a store signature is worthless on the pipe and the other way round."""
    return None if secret is None else derive_key(secret, "kv_store/objects")


def _checksum(preamble: bytes, body: Sequence[bytes | memoryview]) -> bytes:
    digest = blake3(preamble)
    for part in body:
        digest.update(part)
    return digest.digest(_DIGEST_BYTES)


def _tag(mac_key: bytes, preamble: bytes, checksum: bytes) -> bytes:
    """An object's MAC: keyed BLAKE3 of its preamble and checksum (see the module's docstring)."""
    return blake3(preamble + checksum, key=mac_key).digest(_DIGEST_BYTES)


#: The payload starts at a multiple of this many bytes in memory: the copies into it stay aligned.
_PAYLOAD_ALIGN = 64

#: What a stored tensor will be (dtype and shape), or ``None`` for a ``None`` entry.
TensorSpec: TypeAlias = tuple[torch.dtype, Sequence[int]] | None


class ChunkBuilder:
    """An object under construction, in the one buffer it is stored from: the header is written,
    :attr:`tensors` are writable views of the object's memory where each tensor's bytes go (``None``
    for a ``None`` entry), and :meth:`seal` hashes the object and hands it over. Writing the tensors
    in place makes the object with one copy of the payload; the memory is new because every tier
    may keep the object as it is."""

    def __init__(
        self, key: bytes, token_ids: Sequence[int], specs: Sequence[TensorSpec], mac_key: bytes | None
    ) -> None:
        tokens = token_bytes(token_ids)
        parts: list[bytes] = [_COUNTS.pack(len(key), len(token_ids), len(specs)), key, tokens]
        sizes: list[int] = []
        for spec in specs:
            if spec is None:
                parts.append(_TENSOR.pack(0, 0))
                continue
            dtype, shape = spec
            if dtype not in DTYPE_TO_CODE:
                raise KVStoreError(f"a {dtype} tensor cannot be stored")
            if len(shape) > MAX_NDIM:
                raise KVStoreError(f"a stored tensor has at most {MAX_NDIM} dimensions, got {len(shape)}")
            if any(size < 0 for size in shape):
                raise KVStoreError(f"negative size in shape {tuple(shape)}")
            parts.append(_TENSOR.pack(DTYPE_TO_CODE[dtype], len(shape)))
            parts.extend(_DIM.pack(size) for size in shape)
            sizes.append(math.prod(shape) * dtype.itemsize)
        header = b"".join(parts)
        self._mac_key = mac_key
        self._body_start = _PREAMBLE.size + (2 if mac_key is not None else 1) * _DIGEST_BYTES
        payload_start = self._body_start + len(header)
        total = payload_start + sum(sizes)
        # Not zeroed (every byte is written before the seal); placed so that the payload is aligned.
        # torch's memory, not NumPy's: NumPy asks for huge pages for large arrays, and an object
        # that a tier keeps is long-lived memory; on a host whose memory is fragmented, faulting in
        # huge pages compacts memory, migrating the engine's own pages under it (a cold round's
        # TTFT measured 1.21x of recomputing in huge pages, 1.08x in 4 KiB pages).
        memory = torch.empty(total + _PAYLOAD_ALIGN, dtype=torch.uint8).numpy()
        first = -(memory.ctypes.data + payload_start) % _PAYLOAD_ALIGN
        self._memory = memory[first : first + total]
        flags = _AUTHENTICATED if mac_key is not None else 0
        self._preamble = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, flags, total - self._body_start)
        self._memory[: _PREAMBLE.size] = numpy.frombuffer(self._preamble, dtype=numpy.uint8)
        self._memory[self._body_start : payload_start] = numpy.frombuffer(header, dtype=numpy.uint8)
        self.tensors: list[torch.Tensor | None] = []
        offset = payload_start
        sized = iter(sizes)
        for spec in specs:
            if spec is None:
                self.tensors.append(None)
                continue
            dtype, shape = spec
            size = next(sized)
            if not size:  # no bytes to write; torch views no empty buffer
                self.tensors.append(torch.empty(tuple(shape), dtype=dtype))
                continue
            part = memoryview(self._memory[offset : offset + size])
            self.tensors.append(torch.frombuffer(part, dtype=dtype).reshape(tuple(shape)))
            offset += size

    def seal(self) -> memoryview:
        """The object, read-only, once every tensor is written: checksum (and tag) computed over
        it as it is now. Its memory is the object's alone from here on: the views of
        :attr:`tensors` are dropped, and whoever wrote through others must not write again."""
        if self.tensors is None:
            raise KVStoreError("this object is sealed already")
        self.tensors = None
        view = memoryview(self._memory)
        digests = [_checksum(self._preamble, [view[self._body_start :]])]
        if self._mac_key is not None:
            digests.append(_tag(self._mac_key, self._preamble, digests[0]))
        self._memory[_PREAMBLE.size : self._body_start] = numpy.frombuffer(b"".join(digests), dtype=numpy.uint8)
        self._memory.flags.writeable = False
        return view.toreadonly()


def encode_chunk(
    key: bytes, token_ids: Sequence[int], tensors: Sequence[torch.Tensor | None], mac_key: bytes | None
) -> memoryview:
    """The object holding ``tensors`` for the chunk ``key`` of ``token_ids``: a read-only view of
    memory of its own (:class:`ChunkBuilder`, with the tensors copied in once)."""
    specs: list[TensorSpec] = []
    for tensor in tensors:
        if tensor is None:
            specs.append(None)
            continue
        if tensor.layout is not torch.strided or tensor.is_quantized:
            raise KVStoreError(f"a {tensor.dtype} tensor with layout {tensor.layout} cannot be stored")
        specs.append((tensor.dtype, tuple(tensor.shape)))
    builder = ChunkBuilder(key, token_ids, specs, mac_key)
    for target, tensor in zip(builder.tensors, tensors, strict=True):
        if target is None or tensor is None or not target.numel():
            continue
        source = tensor.detach().resolve_conj().resolve_neg()
        if source.is_contiguous():  # as bytes: every dtype copies so, even those torch computes nothing with
            target.reshape(-1).view(torch.uint8).copy_(source.reshape(-1).view(torch.uint8))
        else:
            target.copy_(source)
    return builder.seal()


def decode_chunk(
    blob: Blob, key: bytes, token_ids: Sequence[int], mac_key: bytes | None, *, copy: bool = True
) -> list[torch.Tensor | None]:
    """The tensors of the object ``blob``, which must be chunk ``key`` of exactly ``token_ids``
    (and carry a valid tag when ``mac_key`` is given); else :class:`KVStoreObjectError`.

    With ``copy=False`` the tensors are read-only views of ``blob`` (no copy; they keep it alive),
    for a caller that copies them on at once, e.g. into its KV cache: never write into them."""
    view = memoryview(blob)
    if len(view) < _PREAMBLE.size:
        raise KVStoreObjectError("truncated", f"{len(view)} bytes, shorter than the preamble")
    magic, version, flags, body_len = _PREAMBLE.unpack_from(view)
    if magic != MAGIC:
        raise KVStoreObjectError("malformed", "not a kvbridge store object")
    if version != FORMAT_VERSION:
        raise KVStoreObjectError("format version", f"object has format {version}, this reader {FORMAT_VERSION}")
    if flags & ~_AUTHENTICATED:
        raise KVStoreObjectError("malformed", f"unknown flags {flags:#x}")
    digests = 2 if flags & _AUTHENTICATED else 1
    body_start = _PREAMBLE.size + digests * _DIGEST_BYTES
    if len(view) < body_start + body_len:
        raise KVStoreObjectError("truncated", f"{len(view)} bytes of {body_start + body_len}")
    if len(view) > body_start + body_len:
        raise KVStoreObjectError("malformed", f"{len(view) - body_start - body_len} bytes after the object")
    preamble = bytes(view[: _PREAMBLE.size])
    body = view[body_start:]
    if mac_key is not None and not flags & _AUTHENTICATED:
        raise KVStoreObjectError("not authenticated", "written without the store secret")
    checksum = _checksum(preamble, [body])
    if not hmac.compare_digest(view[_PREAMBLE.size : _PREAMBLE.size + _DIGEST_BYTES], checksum):
        raise KVStoreObjectError("checksum")
    if mac_key is not None:
        tag = view[_PREAMBLE.size + _DIGEST_BYTES : body_start]
        if not hmac.compare_digest(tag, _tag(mac_key, preamble, checksum)):
            raise KVStoreObjectError("not authenticated", "written with another secret")
    return _parse_body(body, key, token_bytes(token_ids), copy)


def _parse_body(body: memoryview, key: bytes, tokens: bytes, copy: bool) -> list[torch.Tensor | None]:
    def take(size: int) -> memoryview:
        nonlocal offset
        if offset + size > len(body):
            raise KVStoreObjectError("malformed", "fields run past the end of the object")
        offset += size
        return body[offset - size : offset]

    offset = 0
    key_len, token_count, tensor_count = _COUNTS.unpack(take(_COUNTS.size))
    if take(key_len) != key:
        raise KVStoreObjectError("other key")
    if take(8 * token_count) != tokens:
        raise KVStoreObjectError("tokens differ")
    specs: list[tuple[torch.dtype, tuple[int, ...]] | None] = []
    for _ in range(tensor_count):
        code, ndim = _TENSOR.unpack(take(_TENSOR.size))
        if code == 0:
            if ndim:
                raise KVStoreObjectError("malformed", "a None entry with dimensions")
            specs.append(None)
            continue
        dtype = CODE_TO_DTYPE.get(code)
        if dtype is None or ndim > MAX_NDIM:
            raise KVStoreObjectError("malformed", f"dtype code {code}, {ndim} dimensions")
        shape = tuple(_DIM.unpack(take(_DIM.size))[0] for _ in range(ndim))
        if any(size < 0 for size in shape):
            raise KVStoreObjectError("malformed", f"negative size in shape {shape}")
        specs.append((dtype, shape))
    tensors: list[torch.Tensor | None] = []
    for spec in specs:
        if spec is None:
            tensors.append(None)
            continue
        dtype, shape = spec
        nbytes = math.prod(shape) * dtype.itemsize
        data = take(nbytes)
        if not nbytes:
            tensors.append(torch.empty(shape, dtype=dtype))
            continue
        # Copied, the tensor owns its memory and the blob can go; else it views the blob.
        payload = bytearray(data) if copy else data
        tensors.append(torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape))
    if offset != len(body):
        raise KVStoreObjectError("malformed", f"{len(body) - offset} payload bytes left over")
    return tensors
