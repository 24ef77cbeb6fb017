"""kv_store: KV chunks kept and reused across requests and instances, in memory, on disk or in Redis.

Reading path: :mod:`kv_store.base` (the tier contract and errors), :mod:`kv_store.keys` (content
keys), :mod:`kv_store.objects` (the stored format), the tiers, :mod:`kv_store.tiered` (the store).
"""

from kv_store.base import (
    Blob,
    KVStoreConfigError,
    KVStoreError,
    KVStoreObjectError,
    KVStoreUnavailableError,
    StoreTier,
    TierStats,
)
from kv_store.disk import DiskTier
from kv_store.keys import ChunkKey, chunk_keys, namespace
from kv_store.memory import MemoryTier
from kv_store.objects import ChunkBuilder, decode_chunk, encode_chunk, mac_key_from_secret
from kv_store.redis_tier import RedisTier
from kv_store.tiered import PutResult, StoreStats, TieredStore, open_store

__all__ = [
    "Blob",
    "ChunkBuilder",
    "ChunkKey",
    "DiskTier",
    "KVStoreConfigError",
    "KVStoreError",
    "KVStoreObjectError",
    "KVStoreUnavailableError",
    "MemoryTier",
    "PutResult",
    "RedisTier",
    "StoreStats",
    "StoreTier",
    "TierStats",
    "TieredStore",
    "chunk_keys",
    "decode_chunk",
    "encode_chunk",
    "mac_key_from_secret",
    "namespace",
    "open_store",
]
