"""The compatibility check two instances run over their pipe before any KV moves.

Each side sends a :class:`KVLayoutInfo` (msgpack, as one uint8 tensor: nothing is unpickled), then
reads the peer's and compares. KV blocks are copied bit for bit, so everything that decides what
the bits mean must be equal: model, dtype, block size, head size, the model's KV head count, the
shape of one layer's block apart from its heads, the number of layers and the cache layout
(attention backend and, on CPU, its instruction set). TP sizes may differ where one divides the
other and the heads split over them (:mod:`connector.tp_layout`); anything else is refused naming
both sides' values.
"""

from __future__ import annotations

import msgspec
import torch

from connector import tp_layout
from kv_pipe.base import KVPipeBase
from kv_pipe.errors import KVConfigError, KVProtocolError

VERSION = 2
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
    #: The model's KV heads, over all TP ranks (0: not known, or a latent cache).
    total_kv_heads: int = 0
    head_size: int = 0  # 0: not known
    #: The head dimension of ``block_shape`` (-1: none known); this rank's heads are its size.
    head_dim: int = -1
    #: An MLA-style cache: one latent per token, the same on every TP rank, no heads.
    latent: bool = False


class _Versioned(msgspec.Struct):
    """Just the version, read first so that a newer peer gets a version error, not a field error."""

    version: int


#: Fields that must be equal on both sides, in the order differences are reported; ``block_shape``
#: is compared apart from its head dimension, whose size follows from the TP size.
_COMPARED = (
    "model",
    "dtype",
    "block_size",
    "head_size",
    "total_kv_heads",
    "latent",
    "num_layers",
    "head_dim",
    "block_shape",
    "layout",
)


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
    if (
        info.block_size <= 0
        or info.num_layers <= 0
        or info.tp_size <= 0
        or not 0 <= info.tp_rank < info.tp_size
        or info.total_kv_heads < 0
        or info.head_size < 0
        or heads_problem(info) is not None
    ):
        raise KVProtocolError(
            f"kvbridge handshake: inconsistent peer message {info}: {heads_problem(info) or 'a size out of range'}"
        )
    return info


def heads_problem(info: KVLayoutInfo) -> str | None:
    """Why ``info``'s head fields contradict each other or its TP size, or None."""
    if info.head_dim < 0:
        return None if info.head_dim == -1 else f"head dimension {info.head_dim}"
    if info.latent or info.head_dim >= len(info.block_shape):
        return f"head dimension {info.head_dim} of a block of shape {info.block_shape} (latent: {info.latent})"
    total, tp = info.total_kv_heads, info.tp_size
    if total < 1 or (total % tp and tp % total):
        return f"{total} KV heads cannot be split over {tp} TP ranks"
    if info.block_shape[info.head_dim] != tp_layout.local_heads(total, tp):
        return (
            f"{info.block_shape[info.head_dim]} KV heads in a block, but {total} KV heads over {tp} TP ranks "
            f"give {tp_layout.local_heads(total, tp)} per rank"
        )
    return None


def _without_heads(info: KVLayoutInfo) -> tuple[int, ...]:
    shape = info.block_shape
    return shape if info.head_dim < 0 else (*shape[: info.head_dim], *shape[info.head_dim + 1 :])


def check_compatible(local: KVLayoutInfo, peer: KVLayoutInfo) -> None:
    """Raise KVConfigError naming every field that differs (each with both sides' values), TP sizes
    that cannot be paired (:func:`connector.tp_layout.tp_refusal`), or a role pairing that cannot
    work (one side must produce, the other consume)."""
    differences = []
    for name in _COMPARED:
        mine, theirs = getattr(local, name), getattr(peer, name)
        if name == "block_shape":
            if _without_heads(local) == _without_heads(peer):
                continue
            if local.head_dim >= 0:
                name = "block_shape (apart from its KV heads)"
        if mine != theirs:
            differences.append(f"{name}: this side {mine!r}, peer {theirs!r}")
    if not differences:
        prefill, decode = (local, peer) if local.role == "kv_producer" else (peer, local)
        refusal = tp_layout.tp_refusal(
            local.total_kv_heads, local.latent, local.head_dim >= 0, prefill.tp_size, decode.tp_size
        )
        if refusal is not None:
            differences.append(f"tp_size: this side {local.tp_size}, peer {peer.tp_size}: {refusal}")
    if differences:
        raise KVConfigError("kvbridge: the peer instance is incompatible; " + "; ".join(differences))
    if {local.role, peer.role} != {"kv_producer", "kv_consumer"}:
        raise KVConfigError(
            f"kvbridge: kv_role {local.role!r} cannot pair with a peer of kv_role {peer.role!r}; "
            f"one instance must be the kv_producer, the other the kv_consumer"
        )


def exchange(pipe: KVPipeBase, local: KVLayoutInfo, timeout: float) -> KVLayoutInfo:
    """Send ``local``, receive the peer's info (at most ``timeout`` s), check; return the peer's.

    Must be the first traffic on ``pipe`` in both directions.
    """
    pipe.send_tensor(encode(local), timeout=timeout)
    peer = decode(pipe.recv_tensor(timeout=timeout))
    check_compatible(local, peer)
    return peer
