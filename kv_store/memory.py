"""The memory tier: a byte-capped LRU of blobs in this process."""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

from kv_store.base import Blob, KVStoreConfigError, StoreTier, TierStats


class MemoryTier(StoreTier):
    """Blobs in a dict, least recently read or written evicted first once ``capacity_bytes``
    (the blobs' sizes) would be exceeded. ``bytes`` and read-only views are kept as they are (the
    store's objects are immutable: see :data:`kv_store.base.Blob`), writable views copied.
    Thread-safe; never raises on put."""

    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise KVStoreConfigError(f"memory tier capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._blobs: collections.OrderedDict[bytes, Blob] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._bytes = self._hits = self._misses = self._evictions = self._failed_writes = 0

    def get_many(self, keys: Sequence[bytes]) -> list[Blob | None]:
        found: list[Blob | None] = []
        with self._lock:
            for key in keys:
                blob = self._blobs.get(key)
                if blob is not None:
                    self._blobs.move_to_end(key)
                found.append(blob)
            hits = sum(blob is not None for blob in found)
            self._hits += hits
            self._misses += len(found) - hits
        return found

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._blobs for key in keys]

    def put(self, key: bytes, blob: Blob) -> bool:
        if isinstance(blob, memoryview) and not blob.readonly:
            blob = bytes(blob)  # writable memory the caller may reuse: a copy of its own
        with self._lock:
            if key in self._blobs:
                return False
            if len(blob) > self.capacity_bytes:
                self._failed_writes += 1
                return False
            while self._bytes + len(blob) > self.capacity_bytes:
                _, old = self._blobs.popitem(last=False)
                self._bytes -= len(old)
                self._evictions += 1
            self._blobs[key] = blob
            self._bytes += len(blob)
            return True

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                hits=self._hits,
                misses=self._misses,
                bytes_stored=self._bytes,
                evictions=self._evictions,
                up=True,
                failed_writes=self._failed_writes,
            )

    def close(self) -> None:
        with self._lock:
            self._blobs.clear()
            self._bytes = 0
