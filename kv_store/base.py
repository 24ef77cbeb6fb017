"""The store tier contract.

A tier keeps immutable blobs under fixed-length binary keys (see :mod:`kv_store.keys`) and is a
cache: anything in it may vanish at any time (eviction, a restart, another process), so every read
may miss, and a miss is a plain ``None`` / ``False``, never an exception.

Blocking: every call blocks the calling thread, and every network or disk wait inside it is bounded
(a tier's own timeout), so no call hangs.

Threads: every tier is safe to call from several threads at once (:class:`kv_store.TieredStore`
writes slower tiers from background threads while the engine reads).

Errors: :class:`KVStoreUnavailableError` when the tier cannot be reached now (Redis down, disk
gone): the caller treats it as a miss and may try again later. :class:`KVStoreConfigError` at
construction for a setting that cannot work (names the setting). ``put`` never raises for a full or
failing tier: it returns ``False`` and counts the failure in :class:`TierStats` (an unreachable
tier still raises :class:`KVStoreUnavailableError`).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeAlias

from kv_pipe.errors import KVConfigError, KVTransferError

#: A stored object's bytes: ``bytes``, or a read-only ``memoryview`` of memory that nobody writes
#: any more (an object :func:`kv_store.encode_chunk` made, one the Redis tier received), which spares
#: a copy of tens of MiB. Tiers keep such a view as it is; a writable one they copy.
Blob: TypeAlias = bytes | memoryview


class KVStoreError(KVTransferError):
    """Base class of the store's errors."""


class KVStoreUnavailableError(KVStoreError):
    """A tier cannot be reached now (Redis down or too slow, disk gone). Callers count it as a miss."""


class KVStoreConfigError(KVConfigError):
    """A store setting cannot work; found at start, the message names the setting."""


class KVStoreObjectError(KVStoreError):
    """A stored object was refused; ``reason`` says why (``"truncated"``, ``"checksum"``,
    ``"tokens differ"``, ``"other key"``, ``"format version"``, ``"not authenticated"``,
    ``"malformed"``). Callers count it as a miss."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"stored object refused: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class TierStats:
    """Counters of one tier, as this process sees them."""

    hits: int = 0  # keys get_many found
    misses: int = 0  # keys get_many did not find
    bytes_stored: int = 0  # bytes this tier holds as far as this process knows
    evictions: int = 0  # objects this process evicted to stay under the capacity
    up: bool = True  # False while the tier is unreachable
    failed_writes: int = 0  # puts that stored nothing because of a full or failing tier


class StoreTier(abc.ABC):
    """One tier: memory, disk or Redis. Keys are bytes; blobs are immutable once written."""

    name: str

    @abc.abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[Blob | None]:
        """The blob of each key, ``None`` where missing; one round trip for all keys."""

    def get_each(self, keys: Sequence[bytes], each: Callable[[int, Blob], None]) -> list[Blob | None]:
        """:meth:`get_many`, and ``each(index, blob)`` with every blob found (on this thread), as soon
        as it is read where the tier receives one value after another (Redis). Here: once all are read."""
        blobs = self.get_many(keys)
        for index, blob in enumerate(blobs):
            if blob is not None:
                each(index, blob)
        return blobs

    @abc.abstractmethod
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored now; one round trip for all keys."""

    @abc.abstractmethod
    def put(self, key: bytes, blob: Blob) -> bool:
        """Store ``blob`` under ``key`` once, atomically (readers see all of it or nothing).
        ``False`` if the key was already there or the tier could not store it (counted). A read-only
        ``memoryview`` is taken as immutable (see :data:`Blob`): the tier may keep it without a copy."""

    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and files; the stored objects stay (for disk and Redis)."""
