"""The compatibility check two instances run over their pipe before any KV moves.

Each side sends a :class:`KVLayoutInfo` (msgpack, as one uint8 tensor: nothing is unpickled), then
reads the peer's and compares. KV blocks are copied bit for bit, so everything that decides what
the bits mean must be equal: model, dtype, block size, the shape of one layer's block, the number
of layers, the cache layout (attention backend and, on CPU, its instruction set) and the TP size.
"""

from __future__ import annotations

import msgspec
import torch

from kv_pipe.base import KVPipeBase
from kv_pipe.errors import KVConfigError, KVProtocolError

VERSION = 1
#: Upper bound of an encoded message; the peer's tensor is checked before it is decoded.
MAX_MESSAGE_BYTES = 1 << 16


class KVLayoutInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One instance's KV cache, as far as a transfer depends on it."""

    version: int
    role: str
    model: str
    dtype: str
    block_size: int
    num_layers: int
    block_shape: tuple[int, ...]  # one block of one layer, the block dimension of size 1
    layout: str  # attention backend / interior layout, e.g. "CPU_ATTN/vec"
    tp_size: int
    tp_rank: int


class _Versioned(msgspec.Struct):
    """Just the version, read first so that a newer peer gets a version error, not a field error."""

    version: int


#: Fields that must be equal on both sides, in the order differences are reported.
_COMPARED = ("model", "dtype", "block_size", "num_layers", "block_shape", "layout", "tp_size", "tp_rank")


def encode(info: KVLayoutInfo) -> torch.Tensor:
    data = msgspec.msgpack.encode(info)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode(tensor: torch.Tensor | None) -> KVLayoutInfo:
    """Parse the peer's message; raise KVProtocolError if it is not a valid KVLayoutInfo."""
    if tensor is None or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise KVProtocolError(f"kvbridge handshake: expected a 1-D uint8 tensor from the peer, got {tensor!r}")
    if tensor.numel() > MAX_MESSAGE_BYTES:
        raise KVProtocolError(f"kvbridge handshake: peer message of {tensor.numel()} bytes is too large")
    data = tensor.cpu().numpy().tobytes()
    try:
        version = msgspec.msgpack.decode(data, type=_Versioned).version
    except msgspec.DecodeError as exc:
        raise KVProtocolError(f"kvbridge handshake: malformed peer message: {exc}") from exc
    if version != VERSION:
        raise KVProtocolError(f"kvbridge handshake: peer speaks version {version}, this side {VERSION}")
    try:
        info = msgspec.msgpack.decode(data, type=KVLayoutInfo)
    except msgspec.DecodeError as exc:
        raise KVProtocolError(f"kvbridge handshake: malformed peer message: {exc}") from exc
    if info.block_size <= 0 or info.num_layers <= 0 or info.tp_size <= 0 or not 0 <= info.tp_rank < info.tp_size:
        raise KVProtocolError(f"kvbridge handshake: inconsistent peer message {info}")
    return info


def check_compatible(local: KVLayoutInfo, peer: KVLayoutInfo) -> None:
    """Raise KVConfigError naming every field that differs, or a role pairing that cannot work
    (one side must produce, the other consume)."""
    differences = [
        f"{name}: this side {getattr(local, name)!r}, peer {getattr(peer, name)!r}"
        for name in _COMPARED
        if getattr(local, name) != getattr(peer, name)
    ]
    if differences:
        raise KVConfigError("kvbridge: the peer instance is incompatible; " + "; ".join(differences))
    if {local.role, peer.role} != {"kv_producer", "kv_consumer"}:
        raise KVConfigError(f"kvbridge: kv_role {local.role!r} cannot pair with a peer of kv_role {peer.role!r}; "
                            f"one instance must be the kv_producer, the other the kv_consumer")


def exchange(pipe: KVPipeBase, local: KVLayoutInfo, timeout: float) -> KVLayoutInfo:
    """Send ``local``, receive the peer's info (at most ``timeout`` s), check; return the peer's.

    Must be the first traffic on ``pipe`` in both directions.
    """
    pipe.send_tensor(encode(local), timeout=timeout)
    peer = decode(pipe.recv_tensor(timeout=timeout))
    check_compatible(local, peer)
    return peer
