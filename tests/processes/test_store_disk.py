"""The disk tier: whole objects or none, one winner among concurrent writers, objects that survive a
restart, eviction of the least recently used files, and a full or read-only disk that makes writes
fail (counted) without raising."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import procs
from kv_store import KVStoreConfigError
from kv_store.disk import DiskTier

pytestmark = pytest.mark.timeout(120)


def key(index: int) -> bytes:
    return index.to_bytes(32, "little")


def object_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def test_objects_are_written_once_whole_and_survive_a_restart(tmp_path):
    tier = DiskTier(tmp_path / "store", capacity_bytes=1 << 20)
    blobs = {key(i): os.urandom(1000 + i) for i in range(20)}
    assert all(tier.put(k, blob) for k, blob in blobs.items())
    assert not tier.put(key(0), os.urandom(10))
    files = object_files(tmp_path / "store")
    assert len(files) == 20 and not any(f.name.startswith(".tmp-") for f in files)
    tier.close()
    again = DiskTier(tmp_path / "store", capacity_bytes=1 << 20)
    assert again.stats().bytes_stored == sum(len(b) for b in blobs.values())
    assert again.get_many([*blobs, key(99)]) == [*blobs.values(), None]
    assert again.contains_many([key(3), key(99)]) == [True, False]
    stats = again.stats()
    assert (stats.hits, stats.misses) == (20, 1)


def test_a_dead_writers_temporary_file_is_removed_at_start_and_never_read(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.put(key(1), b"object")
    subdir = object_files(tmp_path)[0].parent
    stale, fresh = subdir / ".tmp-dead", subdir / ".tmp-live"
    stale.write_bytes(b"half an obj")
    fresh.write_bytes(b"being written")
    os.utime(stale, (1, 1))
    again = DiskTier(tmp_path, capacity_bytes=1 << 20)
    assert not stale.exists() and fresh.exists()
    assert again.stats().bytes_stored == len(b"object")


def test_the_least_recently_used_files_are_evicted_to_stay_under_capacity(tmp_path):
    tier = DiskTier(tmp_path, capacity_bytes=1000)
    blobs = [os.urandom(300) for _ in range(3)]
    for index, blob in enumerate(blobs):
        assert tier.put(key(index), blob)
    for index, file in enumerate(tier._file(key(i)) for i in range(3)):
        os.utime(file, (1000 * (index + 1), 1000 * (index + 1)))  # written in this order, long ago
    assert tier.get_many([key(0)]) == [blobs[0]]  # now the most recently used
    assert tier.put(key(3), os.urandom(350))
    assert tier.contains_many([key(i) for i in range(4)]) == [True, False, False, True]
    stats = tier.stats()
    assert (stats.evictions, stats.bytes_stored) == (2, 650)
    assert sum(f.stat().st_size for f in object_files(tmp_path)) == 650
    assert not tier.put(key(4), os.urandom(1001)) and tier.stats().failed_writes == 1


def _write_all(path: str, seed: int, count: int) -> list[tuple[bool, bytes]]:
    tier = DiskTier(path, capacity_bytes=1 << 30)
    results = []
    for index in range(count):
        blob = bytes([seed]) * 16 + os.urandom(50_000)
        results.append((tier.put(key(index), blob), blob))
    return results


def test_two_processes_writing_the_same_keys_store_each_object_once_and_whole(tmp_path):
    results = procs.new_queue()
    writers = [procs.start(_write_all, (str(tmp_path), seed, 40), results, seed) for seed in (1, 2)]
    outcomes = procs.collect(writers, results, timeout=100)
    tier = DiskTier(tmp_path, capacity_bytes=1 << 30)
    stored = tier.get_many([key(i) for i in range(40)])
    for index, blob in enumerate(stored):
        winners = [outcomes[seed][index][1] for seed in (1, 2) if outcomes[seed][index][0]]
        assert winners == [blob]
    assert len(object_files(tmp_path)) == 40


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True, timeout=30
    )
    if mounted.returncode:
        pytest.skip(f"a full disk is simulated with a tiny tmpfs, which needs root: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True, timeout=30)


def test_a_full_disk_makes_writes_fail_counted_and_leaves_no_partial_file(tmp_path):
    with tmpfs(tmp_path / "tiny", "128k") as path:
        tier = DiskTier(path, capacity_bytes=1 << 30)
        blobs = {key(i): os.urandom(20_000) for i in range(12)}
        written = [tier.put(k, blob) for k, blob in blobs.items()]
        assert written[0] and not written[-1]
        stats = tier.stats()
        assert stats.failed_writes == written.count(False) > 0
        assert not any(f.name.startswith(".tmp-") for f in object_files(path))
        stored = tier.get_many(list(blobs))
        assert [blob is not None for blob in stored] == written
        assert all(blob == blobs[k] for k, blob in zip(blobs, stored, strict=True) if blob is not None)


def test_a_directory_that_turns_read_only_makes_writes_fail_counted(tmp_path):
    with tmpfs(tmp_path / "ro", "1m") as path:
        tier = DiskTier(path, capacity_bytes=1 << 20)
        assert tier.put(key(1), b"before")
        subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, timeout=30)
        assert not tier.put(key(2), b"after") and not tier.put(key(3), b"after")
        assert tier.stats().failed_writes == 2
        assert tier.get_many([key(1), key(2)]) == [b"before", None]  # reading still works
        with pytest.raises(KVStoreConfigError, match="cannot hold objects.*Read-only"):
            DiskTier(path, capacity_bytes=1 << 20)


def test_an_unusable_directory_at_start_is_a_config_error(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(KVStoreConfigError, match="file/store"):
        DiskTier(tmp_path / "file" / "store", capacity_bytes=1 << 20)
    with pytest.raises(KVStoreConfigError, match="capacity_bytes"):
        DiskTier(tmp_path, capacity_bytes=0)
