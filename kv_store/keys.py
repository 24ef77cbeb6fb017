"""Content keys of stored KV chunks, the same in every process and on every host.

A prompt is cut into chunks of ``chunk_size`` tokens. Chunk i's key is
``SHA-256(namespace || key of chunk i-1 || token ids of chunk i as little-endian int64)``, so a key
stands for the whole prefix up to its chunk: two prompts share the keys of their common leading
chunks and nothing else. The namespace is a digest of everything that makes stored KV usable by a
reader (model, KV dtype and layout, shapes, format version, which tensor-parallel part), so
incompatible instances never read each other's objects. Python's ``hash()`` is never used: it
differs between processes (``PYTHONHASHSEED``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

from kv_store.base import KVStoreConfigError

KEY_BYTES = hashlib.sha256().digest_size
#: The parent of the first chunk.
_ROOT = bytes(KEY_BYTES)
_NAMESPACE_TAG = b"kvbridge/kv_store/namespace/v1"


@dataclasses.dataclass(frozen=True)
class ChunkKey:
    """The key of tokens ``[start, stop)`` of a prompt (and of everything before them)."""

    key: bytes
    start: int
    stop: int


def _field(data: bytes) -> bytes:
    # Length-prefixed so that no two different identities encode to the same bytes.
    return len(data).to_bytes(8, "little") + data


def namespace(identity: Mapping[str, str | int]) -> bytes:
    """SHA-256 of the canonical encoding of ``identity`` (names sorted; str and int values kept
    apart, so ``"1"`` and ``1`` differ)."""
    digest = hashlib.sha256(_NAMESPACE_TAG)
    for name in sorted(identity):
        value = identity[name]
        if not isinstance(name, str):
            raise KVStoreConfigError(f"store identity names must be str, got {name!r}")
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise KVStoreConfigError(f"store identity {name!r} must be a str or an int, got {value!r}")
        encoded = b"s" + value.encode() if isinstance(value, str) else b"i" + str(value).encode()
        digest.update(_field(name.encode()) + _field(encoded))
    return digest.digest()


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 (what keys and stored objects hold). Bools and floats are
    refused, not converted: ``True`` would key as token 1, and so would ``1.5``."""
    if any(isinstance(token, bool | np.bool_) for token in token_ids):
        raise KVStoreConfigError("token ids must be integers that fit int64, got a bool")
    try:
        given = np.asarray(token_ids)
        if given.size and given.dtype.kind not in "iu":
            raise TypeError(f"got {given.dtype} values")
        if given.dtype.kind == "u" and given.size and int(given.max()) >= 2**63:
            raise OverflowError(f"{int(given.max())} does not fit int64")
        return given.astype("<i8").tobytes()
    except (OverflowError, ValueError, TypeError) as exc:
        raise KVStoreConfigError(f"token ids must be integers that fit int64: {exc}") from exc


def chunk_keys(namespace: bytes, token_ids: Sequence[int], chunk_size: int) -> list[ChunkKey]:
    """One key per ``chunk_size`` tokens, plus one for a final partial chunk if any."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise KVStoreConfigError(f"chunk_size must be an integer of at least 1, got {chunk_size!r}")
    if len(namespace) != KEY_BYTES:
        raise KVStoreConfigError(f"namespace must be {KEY_BYTES} bytes (from namespace()), got {len(namespace)}")
    tokens = token_bytes(token_ids)
    keys: list[ChunkKey] = []
    parent = _ROOT
    for start in range(0, len(token_ids), chunk_size):
        stop = min(start + chunk_size, len(token_ids))
        parent = hashlib.sha256(namespace + parent + tokens[8 * start : 8 * stop]).digest()
        keys.append(ChunkKey(parent, start, stop))
    return keys
