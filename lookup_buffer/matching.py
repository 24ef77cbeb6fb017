"""The match key of an entry or a query: the selected positions and the tokens there.

The rule itself is documented in :mod:`lookup_buffer.base`. A :class:`MatchKey` hashes by a
blake2b digest and compares by the full canonical bytes, so a dict keyed by it is an O(1) lookup
that never trusts the hash alone.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from lookup_buffer.errors import KVInvalidRequestError

#: Longest token sequence accepted (also bounds control messages, see lookup_buffer.protocol).
MAX_TOKENS = 1 << 21

#: Tokens in control messages (lookup_buffer.protocol): int64, little-endian.
TOKEN_WIRE_DTYPE = np.dtype("<i8")
#: Accepted token dtypes; their positions are wire codes (lookup_buffer.protocol): append only.
TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class MatchKey:
    """Positions selected by a roi and the tokens at them, in one canonical byte string."""

    __slots__ = ("canonical", "_digest")

    def __init__(self, tokens: np.ndarray, roi: np.ndarray) -> None:
        positions = np.flatnonzero(roi).astype(TOKEN_WIRE_DTYPE)
        # Both halves have the same length, so the concatenation is unambiguous.
        self.canonical = positions.tobytes() + tokens[positions].astype(TOKEN_WIRE_DTYPE).tobytes()
        self._digest: bytes | None = None

    @property
    def digest(self) -> bytes:
        """The blake2b digest of the canonical bytes, made when first needed: a consumer only
        compares keys, and a long prompt's digest costs tens of microseconds."""
        if self._digest is None:
            self._digest = hashlib.blake2b(self.canonical, digest_size=16).digest()
        return self._digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MatchKey):
            return NotImplemented
        return self.canonical == other.canonical

    def __repr__(self) -> str:
        return f"MatchKey({len(self.canonical) // 16} positions, {self.digest.hex()[:12]})"


def token_arrays(input_tokens: torch.Tensor, roi: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Validate a caller's ``(input_tokens, roi)``; return them as int64 and bool numpy arrays.

    The arrays may share memory with the tensors: read them only.

    Raises:
        KVInvalidRequestError: not a 1-D integer tensor and a 1-D bool tensor of the same length,
            longer than MAX_TOKENS, or a roi that selects no position.
    """
    if not isinstance(input_tokens, torch.Tensor) or not isinstance(roi, torch.Tensor):
        raise KVInvalidRequestError(
            f"input_tokens and roi must be tensors, got {type(input_tokens).__name__} and {type(roi).__name__}"
        )
    if input_tokens.dim() != 1 or input_tokens.dtype not in TOKEN_DTYPES:
        raise KVInvalidRequestError(
            f"input_tokens must be a 1-D integer tensor, got {input_tokens.dtype} of shape {tuple(input_tokens.shape)}"
        )
    if roi.dim() != 1 or roi.dtype != torch.bool or roi.shape != input_tokens.shape:
        raise KVInvalidRequestError(
            f"roi must be a 1-D bool tensor as long as input_tokens ({input_tokens.shape[0]}), "
            f"got {roi.dtype} of shape {tuple(roi.shape)}"
        )
    if input_tokens.shape[0] > MAX_TOKENS:
        raise KVInvalidRequestError(f"{input_tokens.shape[0]} tokens exceed the limit of {MAX_TOKENS}")
    roi_array = _as_numpy(roi)
    if not roi_array.any():
        raise KVInvalidRequestError("roi selects no position: an entry must cover at least one token")
    return _as_numpy(input_tokens).astype(np.int64, copy=False), roi_array


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    # Integer and bool tensors never require grad. Few torch calls on purpose: each one releases the
    # GIL, which costs a thread switch while the pipe's threads are busy.
    return (tensor if tensor.device.type == "cpu" else tensor.cpu()).numpy()
