"""Several tiers as one store, fastest first.

Reads ask the tiers in order, each only for the keys the faster ones lacked (one round trip per
tier), and copy what a slower tier had into the faster ones. Writes go to the fastest tier at once
and to each slower tier from its own bounded queue and thread, so a slow or dead tier never blocks
the engine: a full queue drops the write (counted), and a tier that raises
:class:`KVStoreUnavailableError` is skipped as a miss (counted).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from kv_pipe import cores
from kv_store.base import Blob, KVStoreConfigError, KVStoreUnavailableError, StoreTier, TierStats
from kv_store.disk import DiskTier
from kv_store.memory import MemoryTier
from kv_store.redis_tier import RedisTier

logger = logging.getLogger(__name__)

#: Tells a writer thread to stop once everything queued before it is written.
_STOP = None


@dataclasses.dataclass(frozen=True)
class StoreStats:
    """Counters of a :class:`TieredStore`, each tier's by its name."""

    tiers: dict[str, TierStats]
    dropped_writes: dict[str, int]  # writes to a slower tier not made: queue full, tier unreachable, closed
    unavailable: dict[str, int]  # calls skipped because the tier was unreachable
    promotions: int  # objects copied into a faster tier after a hit in a slower one


class PutResult(enum.Enum):
    """What :meth:`TieredStore.put` did with an object."""

    STORED = "stored"  # the fastest tier holds it; the slower ones have it queued
    QUEUED = "queued"  # the fastest tier could not take it (full): only the slower tiers' queues have it
    PRESENT = "present"  # the fastest tier held it already: nothing written
    DROPPED = "dropped"  # no tier took it and none will (fastest full or unreachable, every queue refused)

    def __bool__(self) -> bool:
        # ``if store.put(...)`` would read PRESENT and DROPPED as success: callers name the member.
        raise TypeError("compare a PutResult with its members; it has no truth value")


class _Writer:
    """The queue and thread that write one slower tier."""

    def __init__(self, tier: StoreTier, depth: int) -> None:
        self.tier = tier
        self.queue: queue.Queue[tuple[bytes, Blob] | None] = queue.Queue(maxsize=depth)
        # Keys queued or being written: the same key is not queued twice.
        self.pending: set[bytes] = set()
        self.lock = threading.Lock()
        self.dropped = 0
        self.closing = False
        self.thread = cores.thread(self._run, f"kv_store-{tier.name}-writer")

    def offer(self, key: bytes, blob: Blob) -> bool:
        """Queue ``blob``; ``False`` if it was dropped instead (counted)."""
        with self.lock:
            if key in self.pending:
                return True
            if self.closing:
                self.dropped += 1
                return False
            try:
                self.queue.put_nowait((key, blob))
            except queue.Full:
                self.dropped += 1
                return False
            self.pending.add(key)
            return True

    def _run(self) -> None:
        while (item := self.queue.get()) is not _STOP:
            key, blob = item
            try:
                self.tier.put(key, blob)
            except KVStoreUnavailableError:
                self._count_drop()
            except Exception:  # a tier bug must not stop every later write to it
                logger.exception("writing to the %s tier failed", self.tier.name)
                self._count_drop()
            finally:
                with self.lock:
                    self.pending.discard(key)

    def _count_drop(self, count: int = 1) -> None:
        with self.lock:
            self.dropped += count

    def stop(self, deadline: float) -> None:
        """Let the thread write what is queued until ``deadline``, then drop the rest."""
        with self.lock:
            self.closing = True
        try:
            self.queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            self._discard_queued()
            self.queue.put_nowait(_STOP)
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            self._discard_queued()
            self.queue.put_nowait(_STOP)  # the thread exits after the put it is in (bounded by the tier)

    def _discard_queued(self) -> None:
        left = 0
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            left += item is not _STOP
        if left:
            logger.warning("closing the store dropped %d queued writes to the %s tier", left, self.tier.name)
            self._count_drop(left)


class TieredStore:
    """``tiers`` fastest first (e.g. memory, disk, Redis); ``queue_depth`` writes may wait per
    slower tier. Thread-safe."""

    def __init__(self, tiers: Sequence[StoreTier], queue_depth: int = 64) -> None:
        if not tiers:
            raise KVStoreConfigError("a store needs at least one tier")
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise KVStoreConfigError(f"store tiers must have distinct names, got {names}")
        if queue_depth < 1:
            raise KVStoreConfigError(f"queue_depth must be at least 1, got {queue_depth}")
        self.tiers = list(tiers)
        self._writers = [_Writer(tier, queue_depth) for tier in self.tiers[1:]]
        for writer in self._writers:
            writer.thread.start()
        self._lock = threading.Lock()
        self._unavailable = dict.fromkeys(names, 0)
        self._promotions = 0

    def _ask(self, tier: StoreTier, method: str, keys: list[bytes], *args: object) -> list | None:
        try:
            return getattr(tier, method)(keys, *args)
        except KVStoreUnavailableError:
            with self._lock:
                self._unavailable[tier.name] += 1
            return None

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` some tier holds now (a later get may still miss)."""
        present = [False] * len(keys)
        for tier in self.tiers:
            # Only keys before the first one no tier has matter; a slower tier is asked for the
            # missing ones among them.
            missing = [index for index, found in enumerate(present) if not found]
            if not missing:
                break
            answer = self._ask(tier, "contains_many", [keys[index] for index in missing])
            for index, found in zip(missing, answer or (), strict=False):
                present[index] = found
        return next((index for index, found in enumerate(present) if not found), len(keys))

    def get_many(self, keys: Sequence[bytes], each: Callable[[int, Blob], None] | None = None) -> list[Blob | None]:
        """The blob of each key from the fastest tier that has it, ``None`` where none has it;
        a blob found in a slower tier is copied into the faster ones. ``each(index, blob)`` is called
        (on this thread) with every blob found, as soon as its tier has read it (see
        :meth:`StoreTier.get_each`): a tier that fails part-way has still delivered those."""
        blobs: list[Blob | None] = [None] * len(keys)
        for level, tier in enumerate(self.tiers):
            missing = [index for index, blob in enumerate(blobs) if blob is None]
            if not missing:
                break

            def found(position: int, blob: Blob, level: int = level, missing: list[int] = missing) -> None:
                index = missing[position]
                blobs[index] = blob
                if level:
                    self._promote(level, keys[index], blob)
                if each is not None:
                    each(index, blob)

            self._ask(tier, "get_each", [keys[index] for index in missing], found)
        return blobs

    def _promote(self, level: int, key: bytes, blob: Blob) -> None:
        with self._lock:
            self._promotions += 1
        self._write_fastest(key, blob)
        for writer in self._writers[: level - 1]:
            writer.offer(key, blob)

    def _write_fastest(self, key: bytes, blob: Blob) -> PutResult:
        """Write the fastest tier: STORED, PRESENT (so the slower ones hold it too, or have it queued:
        nothing more to write) or DROPPED (full or unreachable: the slower ones still take it)."""
        fastest = self.tiers[0]
        try:
            if fastest.put(key, blob):
                return PutResult.STORED
            return PutResult.PRESENT if fastest.contains_many([key])[0] else PutResult.DROPPED
        except KVStoreUnavailableError:
            with self._lock:
                self._unavailable[fastest.name] += 1
            return PutResult.DROPPED

    def put(self, key: bytes, blob: bytes) -> PutResult:
        """Store ``blob`` under ``key`` in every tier: the fastest now, the others in the background.
        Says what happened (:class:`PutResult`)."""
        fastest = self._write_fastest(key, blob)
        if fastest is PutResult.PRESENT:
            return fastest
        queued = [writer.offer(key, blob) for writer in self._writers]
        if fastest is PutResult.STORED or not any(queued):
            return fastest
        return PutResult.QUEUED

    def stats(self) -> StoreStats:
        with self._lock:
            unavailable = dict(self._unavailable)
            promotions = self._promotions
        return StoreStats(
            tiers={tier.name: tier.stats() for tier in self.tiers},
            dropped_writes={writer.tier.name: writer.dropped for writer in self._writers},
            unavailable=unavailable,
            promotions=promotions,
        )

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (for at most ``timeout`` seconds in all; the rest is dropped, counted
        and logged) and close every tier."""
        deadline = time.monotonic() + timeout
        for writer in self._writers:
            writer.stop(deadline)
        for tier in self.tiers:
            tier.close()


def open_store(
    spec: str,
    *,
    memory_bytes: int = 1 << 30,
    disk_bytes: int = 16 << 30,
    redis_password: str | None = None,
    redis_timeout: float = 2.0,
    queue_depth: int = 64,
    redis_start_down: bool = False,
) -> TieredStore:
    """A store from a comma-separated list of tiers, fastest first: ``memory``, ``disk:PATH``,
    ``redis://HOST:PORT[/DB]``, ``unix://PATH[?db=DB]`` (a Redis server's Unix socket on this host)
    and ``redis+cluster://HOST:PORT`` (any node of a cluster). With
    ``redis_start_down`` a Redis that cannot be reached now is a tier that starts down (see
    :class:`RedisTier`), not an error."""
    tiers: list[StoreTier] = []
    try:
        for part in (item.strip() for item in spec.split(",")):
            if part == "memory":
                tiers.append(MemoryTier(memory_bytes))
            elif part.startswith("disk:") and part[len("disk:") :]:
                tiers.append(DiskTier(part[len("disk:") :], disk_bytes))
            elif part.startswith(("redis://", "rediss://", "unix://")):
                tiers.append(
                    RedisTier(part, password=redis_password, timeout=redis_timeout, start_down=redis_start_down)
                )
            elif part.startswith("redis+cluster://"):
                tiers.append(
                    RedisTier(
                        "redis://" + part[len("redis+cluster://") :],
                        password=redis_password,
                        cluster=True,
                        timeout=redis_timeout,
                        start_down=redis_start_down,
                    )
                )
            else:
                raise KVStoreConfigError(
                    f"store tier {part!r} in {spec!r} is not one of: memory, disk:PATH, "
                    "redis://HOST:PORT, unix://PATH, redis+cluster://HOST:PORT"
                )
        return TieredStore(tiers, queue_depth=queue_depth)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
