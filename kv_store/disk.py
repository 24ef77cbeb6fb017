"""The disk tier: one file per object in a directory that several processes may share.

A write goes to a temporary file in the object's own directory and is then hard-linked to its
name: the link appears atomically with all the bytes, and fails if the name exists, so of several
writers (threads or processes) exactly one stores the object and readers never see part of one.
Files outlive the process; a restart finds them. Reading a file marks it used (its mtime), and
when this process's count of the directory's bytes would pass ``capacity_bytes`` it scans the
directory and deletes the least recently used files down to 90% of it (other processes' files
included: the scan is the truth, the count between scans an estimate).

A full disk or a directory that became unwritable makes ``put`` return ``False`` (counted, logged
once until a write succeeds again); it never raises into the engine. Objects are not fsynced: a
file torn by a power loss fails its checksum when read (:mod:`kv_store.objects`) and is a miss.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from kv_store.base import Blob, KVStoreConfigError, KVStoreUnavailableError, StoreTier, TierStats

logger = logging.getLogger(__name__)

_TEMP_PREFIX = ".tmp-"
#: A temporary file this old was left by a writer that died; a live writer finishes in far less.
_STALE_TEMP_SECONDS = 3600
#: Eviction frees down to this share of the capacity, so that it scans once per many writes.
_LOW_WATER = 0.9


class DiskTier(StoreTier):
    """Objects as files under ``path`` (created if missing), at most ``capacity_bytes`` of them."""

    name = "disk"

    def __init__(self, path: str | os.PathLike, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise KVStoreConfigError(f"disk tier capacity_bytes must be positive, got {capacity_bytes}")
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._failed_writes = 0
        self._failing = False
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._probe()
        except OSError as exc:
            raise KVStoreConfigError(f"disk tier path {str(self.path)!r} cannot hold objects: {exc}") from exc
        self._bytes = self._scan(remove_stale=True)[1]

    def _probe(self) -> None:
        """Write, hard-link and delete a file: what every put does."""
        fd, temp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=self.path)
        os.close(fd)
        try:
            os.link(temp, temp + ".link")
            os.unlink(temp + ".link")
        finally:
            os.unlink(temp)

    def _file(self, key: bytes) -> Path:
        name = key.hex()
        return self.path / name[:2] / name

    def _scan(self, remove_stale: bool = False) -> tuple[list[tuple[float, int, Path]], int]:
        """Every object file as (mtime, size, path), oldest first, and their total size."""
        files: list[tuple[float, int, Path]] = []
        now = time.time()
        for directory in self.path.iterdir():
            if not directory.is_dir():
                continue
            for entry in os.scandir(directory):
                try:
                    info = entry.stat()
                except FileNotFoundError:  # another process evicted it meanwhile
                    continue
                if not entry.name.startswith(_TEMP_PREFIX):
                    files.append((info.st_mtime, info.st_size, Path(entry.path)))
                elif remove_stale and now - info.st_mtime > _STALE_TEMP_SECONDS:
                    Path(entry.path).unlink(missing_ok=True)
        files.sort()
        return files, sum(size for _, size, _ in files)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        found: list[bytes | None] = []
        for key in keys:
            file = self._file(key)
            try:
                blob = file.read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                blob = None
            except OSError as exc:
                raise KVStoreUnavailableError(f"disk tier {str(self.path)!r} cannot be read: {exc}") from exc
            if blob is not None:
                with contextlib.suppress(OSError):  # evicted since, or a read-only directory: still a hit
                    os.utime(file)  # recently used: evicted last
            found.append(blob)
        hits = sum(blob is not None for blob in found)
        with self._lock:
            self._hits += hits
            self._misses += len(found) - hits
        return found

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        present = []
        for key in keys:
            try:
                self._file(key).stat()
            except (FileNotFoundError, NotADirectoryError):
                present.append(False)
            except OSError as exc:
                raise KVStoreUnavailableError(f"disk tier {str(self.path)!r} cannot be read: {exc}") from exc
            else:
                present.append(True)
        return present

    def put(self, key: bytes, blob: Blob) -> bool:
        file = self._file(key)
        if len(blob) > self.capacity_bytes:
            self._write_failed(f"an object of {len(blob)} bytes is larger than capacity_bytes")
            return False
        temp = None
        try:
            if file.exists():  # no need to write the bytes only to find it there
                return False
            self._make_room(len(blob))
            file.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=file.parent)
            with os.fdopen(fd, "wb") as out:
                out.write(blob)
            os.link(temp, file)
        except FileExistsError:
            return False  # another writer stored it first
        except OSError as exc:
            self._write_failed(str(exc))
            return False
        finally:
            if temp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
        with self._lock:
            self._bytes += len(blob)
            if self._failing:
                self._failing = False
                logger.info("disk tier %s stores objects again", self.path)
        return True

    def _write_failed(self, why: str) -> None:
        with self._lock:
            self._failed_writes += 1
            if self._failing:
                return
            self._failing = True
        logger.warning("disk tier %s stores nothing (until a write succeeds again): %s", self.path, why)

    def _make_room(self, nbytes: int) -> None:
        with self._lock:
            if self._bytes + nbytes <= self.capacity_bytes:
                return
            try:
                files, total = self._scan()
            except OSError as exc:
                logger.warning("disk tier %s cannot be scanned for eviction: %s", self.path, exc)
                return
            target = _LOW_WATER * self.capacity_bytes - nbytes
            for _, size, path in files:
                if total <= target:
                    break
                try:
                    path.unlink()
                except FileNotFoundError:  # another process evicted it
                    pass
                except OSError:
                    continue
                else:
                    self._evictions += 1
                total -= size
            self._bytes = total

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
        """Nothing to release: every call opens and closes its own files."""
