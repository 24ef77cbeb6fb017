"""The memory tier (a byte-capped LRU) and the tiered store over it: lookups of leading chunks,
promotion of slower hits, blobs handed on as each tier reads them, bounded background writes that
drop and count instead of blocking, no duplicate writes, and an unreachable tier read as a miss."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kv_store import (
    DiskTier,
    KVStoreConfigError,
    KVStoreUnavailableError,
    MemoryTier,
    PutResult,
    TieredStore,
    encode_chunk,
    open_store,
)

pytestmark = pytest.mark.timeout(120)


def blob(size: int) -> bytes:
    return os.urandom(size)


def test_memory_tier_evicts_least_recently_used_by_bytes():
    tier = MemoryTier(capacity_bytes=1000)
    blobs = {bytes([i]) * 32: blob(300) for i in range(3)}
    assert all(tier.put(key, value) for key, value in blobs.items())
    a, b, c = blobs
    assert tier.get_many([a]) == [blobs[a]]  # a is now more recent than b
    assert tier.put(b"d" * 32, blob(350))  # 1250 bytes: b goes, the least recently used
    assert tier.contains_many([a, b, c, b"d" * 32]) == [True, False, True, True]
    assert tier.put(b"e" * 32, blob(700))  # a, c and d all give way
    assert tier.contains_many([a, c, b"d" * 32, b"e" * 32]) == [False, False, False, True]
    stats = tier.stats()
    assert (stats.evictions, stats.bytes_stored, stats.hits) == (4, 700, 1)


def test_memory_tier_writes_once_and_refuses_what_cannot_fit():
    tier = MemoryTier(capacity_bytes=100)
    first = blob(60)
    assert tier.put(b"k", first) and not tier.put(b"k", blob(60))
    assert tier.get_many([b"k", b"missing"]) == [first, None]
    assert not tier.put(b"huge", blob(101))
    assert tier.get_many([b"k"]) == [first]  # nothing was evicted for an object that cannot fit
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.failed_writes, stats.evictions) == (2, 1, 1, 0)
    with pytest.raises(KVStoreConfigError, match="capacity_bytes"):
        MemoryTier(0)


def test_memory_tier_keeps_a_read_only_object_as_it_is_and_copies_writable_memory():
    tier = MemoryTier(capacity_bytes=1 << 20)
    staging = bytearray(blob(500))
    first = bytes(staging)
    assert tier.put(b"w" * 32, memoryview(staging))
    staging[:] = blob(500)  # the caller reuses its buffer for the next object
    assert tier.get_many([b"w" * 32]) == [first]
    frozen = encode_chunk(b"r" * 32, [1, 2, 3], [torch.arange(40, dtype=torch.float32)], None)
    assert tier.put(b"r" * 32, frozen)
    kept = tier.get_many([b"r" * 32])[0]
    assert kept is frozen and bytes(kept) == bytes(frozen)  # no copy of an object nobody writes
    assert tier.stats().bytes_stored == 500 + len(frozen)


class SlowTier(MemoryTier):
    """A slower tier whose writes wait for ``gate``, counting every put, and that can be made
    unreachable."""

    def __init__(self, name: str) -> None:
        super().__init__(capacity_bytes=1 << 30)
        self.name = name
        self.gate = threading.Event()
        self.gate.set()
        self.puts: list[bytes] = []
        self.down = False
        self.written = threading.Semaphore(0)
        self.entered = threading.Semaphore(0)

    def _check(self) -> None:
        if self.down:
            raise KVStoreUnavailableError(f"{self.name} is down")

    def get_many(self, keys):
        self._check()
        return super().get_many(keys)

    def contains_many(self, keys):
        self._check()
        return super().contains_many(keys)

    def put(self, key, blob):
        self.entered.release()
        assert self.gate.wait(60)
        self.puts.append(key)
        try:
            self._check()
            return super().put(key, blob)
        finally:
            self.written.release()

    def preload(self, key: bytes, blob: bytes) -> None:
        assert super().put(key, blob)

    def wait_written(self, count: int) -> None:
        for _ in range(count):
            assert self.written.acquire(timeout=60)


def keys(count: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(count)]


def test_lookup_counts_leading_keys_across_tiers_and_asks_slower_tiers_only_for_the_rest():
    fast, slow = MemoryTier(1 << 20), SlowTier("slow")
    store = TieredStore([fast, slow])
    k = keys(5)
    fast.put(k[0], b"0")
    slow.preload(k[1], b"1")
    fast.put(k[2], b"2")
    slow.preload(k[4], b"4")  # after the gap: not counted
    asked: list[list[bytes]] = []
    original = slow.contains_many
    slow.contains_many = lambda wanted: asked.append(list(wanted)) or original(wanted)
    assert store.lookup(k) == 3
    assert asked == [[k[1], k[3], k[4]]]
    store.close()


def test_a_hit_in_a_slower_tier_is_promoted():
    fast, middle, slow = MemoryTier(1 << 20), SlowTier("middle"), SlowTier("slow")
    store = TieredStore([fast, middle, slow])
    k = keys(3)
    slow.preload(k[1], b"one")
    middle.preload(k[2], b"two")
    assert store.get_many(k) == [None, b"one", b"two"]
    middle.wait_written(1)
    assert fast.contains_many(k) == [False, True, True]
    assert middle.contains_many(k) == [False, True, True]
    assert middle.puts == [k[1]] and slow.puts == []
    assert store.stats().promotions == 2
    assert store.get_many([k[1]]) == [b"one"] and fast.stats().hits == 1
    store.close()


def test_a_full_write_queue_drops_and_counts_instead_of_blocking():
    fast, slow = MemoryTier(1 << 20), SlowTier("slow")
    slow.gate.clear()
    store = TieredStore([fast, slow], queue_depth=4)
    k = keys(10)
    assert store.put(k[0], b"v") is PutResult.STORED
    assert slow.entered.acquire(timeout=60)  # the writer is stuck in its first put
    for key in k[1:]:
        assert store.put(key, b"v") is PutResult.STORED  # never blocks, though the slow tier does
    assert fast.contains_many(k) == [True] * 10
    # One write is in the stuck put, four wait in the queue: five are dropped.
    assert store.stats().dropped_writes == {"slow": 5}
    slow.gate.set()
    store.close()
    assert slow.puts == k[:5]


def test_the_same_object_is_written_once():
    fast, slow = MemoryTier(1 << 20), SlowTier("slow")
    slow.gate.clear()
    store = TieredStore([fast, slow])
    k = keys(3)
    for _ in range(5):
        for key in k:
            store.put(key, b"v")
    fast.close()  # the fast tier forgets: the key is still queued for the slow one, not queued again
    for key in k:
        store.put(key, b"v")
    slow.gate.set()
    store.close()
    assert sorted(slow.puts) == k


def test_an_object_too_big_for_the_fastest_tier_still_reaches_the_slower_ones():
    fast, slow = MemoryTier(10), SlowTier("slow")
    store = TieredStore([fast, slow])
    assert store.put(b"k", b"x" * 11) is PutResult.QUEUED
    slow.wait_written(1)
    assert slow.get_many([b"k"]) == [b"x" * 11]
    store.close()


def test_put_says_what_happened_to_the_object():
    fast, slow = MemoryTier(10), SlowTier("slow")
    slow.gate.clear()
    store = TieredStore([fast, slow], queue_depth=1)
    assert store.put(b"a", b"x" * 4) is PutResult.STORED
    assert store.put(b"a", b"x" * 4) is PutResult.PRESENT
    assert slow.entered.acquire(timeout=60)  # the writer is stuck in the put of "a": its queue is empty
    assert store.put(b"b", b"y" * 11) is PutResult.QUEUED  # too big for the fast tier: queued for the slow one
    assert store.put(b"c", b"z" * 11) is PutResult.DROPPED  # too big, and the slow tier's queue is full
    assert fast.contains_many([b"b", b"c"]) == [False, False]
    with pytest.raises(TypeError):
        bool(store.put(b"d", b"v"))  # a result has no truth value: callers compare it with a member
    slow.gate.set()
    store.close()
    assert slow.puts == [b"a", b"b"]
    alone = TieredStore([MemoryTier(10)])
    assert alone.put(b"e", b"x" * 11) is PutResult.DROPPED  # one tier, and it is full
    alone.close()


class BrokenStreamTier(SlowTier):
    """Hands on its first ``delivers`` blobs one by one, then fails as a server lost mid-read does."""

    def __init__(self, name: str, delivers: int) -> None:
        super().__init__(name)
        self.delivers = delivers

    def get_each(self, keys, each):
        for index, blob in enumerate(super().get_many(keys)[: self.delivers]):
            if blob is not None:
                each(index, blob)
        raise KVStoreUnavailableError(f"{self.name} went away in the middle of a read")


def test_blobs_are_handed_on_as_read_and_a_tier_failing_part_way_keeps_what_it_handed_on():
    fast, broken, slow = MemoryTier(1 << 20), BrokenStreamTier("broken", delivers=2), SlowTier("slow")
    store = TieredStore([fast, broken, slow])
    k = keys(6)
    values = {key: blob(1000 + index) for index, key in enumerate(k)}
    fast.put(k[3], values[k[3]])
    for key in (k[0], k[1], k[4]):
        broken.preload(key, values[key])
    for key in (k[2], k[4]):
        slow.preload(key, values[key])
    handed: list[tuple[int, bytes]] = []
    found = store.get_many(k, lambda index, got: handed.append((index, got)))
    # broken is asked for k0, k1, k2, k4, k5 and hands on k0 and k1 before failing (its k4 is lost
    # with it); slow is asked for the rest.
    assert found == [values[k[0]], values[k[1]], values[k[2]], values[k[3]], values[k[4]], None]
    assert handed == [(3, values[k[3]]), (0, values[k[0]]), (1, values[k[1]]), (2, values[k[2]]), (4, values[k[4]])]
    broken.wait_written(2)  # slow's hits are queued for broken
    assert broken.puts == [k[2], k[4]] and slow.puts == []
    stats = store.stats()
    assert stats.promotions == 4 and stats.unavailable == {"memory": 0, "broken": 1, "slow": 0}
    assert fast.contains_many(k) == [True, True, True, True, True, False]
    store.close()


def test_an_unreachable_tier_is_a_counted_miss():
    fast, slow = MemoryTier(1 << 20), SlowTier("slow")
    store = TieredStore([fast, slow])
    k = keys(2)
    slow.preload(k[0], b"a")
    slow.down = True
    assert store.lookup(k) == 0
    assert store.get_many(k) == [None, None]
    store.put(k[1], b"b")
    slow.wait_written(1)
    assert store.stats().unavailable == {"memory": 0, "slow": 2}
    slow.down = False
    assert store.lookup(k) == 2 and store.get_many(k) == [b"a", b"b"]
    store.close()  # joins the writer, which counted the write it could not make
    assert store.stats().dropped_writes == {"slow": 1}


def test_close_is_bounded_and_counts_what_it_drops():
    fast, slow = MemoryTier(1 << 20), SlowTier("slow")
    slow.gate.clear()
    store = TieredStore([fast, slow], queue_depth=8)
    first, *rest = keys(6)
    store.put(first, b"v")
    assert slow.entered.acquire(timeout=60)
    for key in rest:
        store.put(key, b"v")
    store.close(timeout=0.2)
    assert store.stats().dropped_writes == {"slow": 5}  # the one in the stuck put is not counted
    slow.gate.set()
    assert store.put(b"late", b"v") is PutResult.STORED and store.stats().dropped_writes == {"slow": 6}


def test_bad_store_settings_are_config_errors():
    with pytest.raises(KVStoreConfigError, match="distinct"):
        TieredStore([MemoryTier(10), MemoryTier(10)])
    with pytest.raises(KVStoreConfigError, match="queue_depth"):
        TieredStore([MemoryTier(10)], queue_depth=0)
    with pytest.raises(KVStoreConfigError, match="at least one tier"):
        TieredStore([])


def test_open_store_builds_the_tiers_fastest_first(tmp_path):
    store = open_store(f"memory, disk:{tmp_path / 'objects'}", memory_bytes=1000, disk_bytes=5000)
    assert [type(tier) for tier in store.tiers] == [MemoryTier, DiskTier]
    assert (store.tiers[0].capacity_bytes, store.tiers[1].capacity_bytes) == (1000, 5000)
    assert store.put(b"k" * 32, b"v") is PutResult.STORED
    store.close()
    assert (tmp_path / "objects").is_dir()
    for spec in ("", "memory,,disk:/x", "disk:", "s3://bucket", "memory,memory"):
        with pytest.raises(KVStoreConfigError, match="store tier|distinct"):
            open_store(spec)
