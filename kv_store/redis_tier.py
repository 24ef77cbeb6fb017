"""The Redis tier: objects shared by every instance that reaches one Redis (or Redis Cluster).

One Redis key per object (``kvbridge/`` + the chunk key), written with ``SET NX`` so the first
writer wins and an object is never overwritten. Because an object is a single value, Redis's own
eviction (``maxmemory`` with ``allkeys-lru``) removes whole objects, never half of one. Reads and
existence checks of many keys are pipelined: one round trip (one per node on a cluster).

Reads from one server (not a cluster, not TLS) go through :class:`kv_store.redis_reads.BulkReader`,
which receives each value straight into the buffer it returns and hands it on as soon as it is
complete (:meth:`RedisTier.get_each`); everything else through redis-py. A server on the same host
is reached faster over its Unix socket (``unix://PATH``) than over TCP on loopback.

Every call is bounded by ``timeout`` and never retried inside redis-py. A server that cannot be
reached makes the call raise :class:`KVStoreUnavailableError` and marks the tier down; for
``backoff`` seconds existence checks and writes fail at once without touching the network, then one
call tries again. Reads always try (they follow a lookup that found the keys).
Down and up are logged once each.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kv_store.base import Blob, KVStoreConfigError, KVStoreError, KVStoreUnavailableError, StoreTier, TierStats
from kv_store.redis_reads import BulkReader

try:
    import redis
    import redis.cluster
    from redis.backoff import NoBackoff
    from redis.exceptions import ClusterError, RedisClusterException, RedisError
    from redis.retry import Retry
except ImportError:  # the store extra is not installed: RedisTier says so when used
    redis = None

logger = logging.getLogger(__name__)

KEY_PREFIX = b"kvbridge/"
#: Bytes redis-py asks the socket for at once (its default is 64 KiB). Objects are tens of MiB, and
#: redis-py's own parser (without hiredis) goes through Python once per read: fewer, larger reads
#: make a read of a 128 MiB object set about twice as fast.
SOCKET_READ_BYTES = 1 << 20
#: What an unreachable or unusable server raises through redis-py, or through the BulkReader's sockets.
_UNAVAILABLE = (
    (OSError,)
    if redis is None
    else (OSError, redis.ConnectionError, redis.TimeoutError, ClusterError, RedisClusterException)
)


#: ``proto-max-bulk-len`` of a server that does not say its own, or has not answered yet.
DEFAULT_MAX_BULK_LEN = 512 * 1024 * 1024
#: Servers some tier of this process found down and not yet up again: each change is logged once per
#: process, though an instance's scheduler and worker each keep a tier of the same server.
_down: set[str] = set()
_down_lock = threading.Lock()


def _say_down(url: str, cause: BaseException) -> None:
    with _down_lock:
        first = url not in _down
        _down.add(url)
    if first:
        logger.warning("redis at %s is down (%s): its tier misses until it answers again", url, cause)


def _say_up(url: str) -> None:
    with _down_lock:
        was_down = url in _down
        _down.discard(url)
    if was_down:
        logger.info("redis at %s answers again", url)


class RedisTier(StoreTier):
    """A Redis server at ``url`` (``redis://HOST:PORT[/DB]``, or ``unix://PATH[?db=DB]``: its Unix
    socket on this host), or a Redis Cluster reached through
    any of its nodes when ``cluster``. Connects at construction: an unreachable server raises
    :class:`KVStoreUnavailableError` (with ``start_down`` the tier starts down instead, logs so, and
    connects on the first call after it), a refused password or a bad URL :class:`KVStoreConfigError`."""

    name = "redis"

    def __init__(
        self,
        url: str,
        password: str | None = None,
        cluster: bool = False,
        timeout: float = 2.0,
        backoff: float = 1.0,
        start_down: bool = False,
    ) -> None:
        if redis is None:
            raise KVStoreConfigError("the Redis tier needs redis-py: pip install 'kvbridge[store]'")
        if timeout <= 0 or backoff < 0:
            raise KVStoreConfigError(f"redis timeout must be positive and backoff not negative: {timeout}, {backoff}")
        self.url = url
        self.cluster = cluster
        self.backoff = backoff
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._hits = self._misses = self._failed_writes = self._bytes = 0
        self._retry_at: float | None = None  # set while down
        self._options: dict[str, Any] = {
            "password": password,
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 0),
            "socket_read_size": SOCKET_READ_BYTES,
        }
        self._client: Any = None  # until a server answered
        self._reader: BulkReader | None = None
        #: Until the server says its own: Redis's default.
        self.max_object_bytes = DEFAULT_MAX_BULK_LEN
        try:
            self._connect()
        except redis.AuthenticationError as exc:
            raise KVStoreConfigError(f"redis at {url} refused the password: {exc}") from exc
        except ValueError as exc:
            raise KVStoreConfigError(f"bad redis URL {url!r}: {exc}") from exc
        except _UNAVAILABLE as exc:
            if not start_down:
                raise KVStoreUnavailableError(f"cannot reach redis at {url}: {exc}") from exc
            self._retry_at = time.monotonic()  # down; the first call tries again
            _say_down(self.url, exc)

    def _connect(self) -> None:
        """Build the client and the reader and ask the server its largest value; raises redis-py's
        errors. The client is kept only once all of that worked."""
        if self.cluster:
            client = redis.cluster.RedisCluster.from_url(self.url, **self._options)
        else:
            client = redis.Redis.from_url(self.url, **self._options)
        try:
            client.ping()
            self.max_object_bytes = self._read_max_bulk_len(client)
        except BaseException:
            client.close()
            raise
        self._reader = None if self.cluster else self._bulk_reader(client)
        self._client = client

    def _bulk_reader(self, client: Any) -> BulkReader | None:
        """A reader of this server's values over a plain TCP or Unix socket; None over TLS."""
        pool = client.connection_pool
        options = pool.connection_kwargs
        if pool.connection_class is redis.connection.Connection:
            address: tuple[str, int] | str = (options["host"], options["port"])
        elif pool.connection_class is redis.connection.UnixDomainSocketConnection:
            address = options["path"]
        else:
            return None
        return BulkReader(
            address,
            int(options.get("db") or 0),
            options.get("username"),
            options.get("password"),
            self._options["socket_timeout"],
        )

    def _read_max_bulk_len(self, client: Any) -> int:
        """The server's largest value (``proto-max-bulk-len``; the smallest over a cluster's nodes)."""
        try:
            if self.cluster:
                answers = client.config_get("proto-max-bulk-len", target_nodes=redis.cluster.RedisCluster.ALL_NODES)
                values = [int(answer["proto-max-bulk-len"]) for answer in answers.values()]
                return min(values)
            return int(client.config_get("proto-max-bulk-len")["proto-max-bulk-len"])
        except redis.ResponseError as exc:  # CONFIG disabled (a managed Redis): Redis's default
            logger.info("redis at %s does not say its proto-max-bulk-len (%s); assuming 512 MB", self.url, exc)
            return DEFAULT_MAX_BULK_LEN

    def check_object_size(self, nbytes: int) -> None:
        """Raise :class:`KVStoreConfigError` if an object of ``nbytes`` cannot be stored."""
        if nbytes > self.max_object_bytes:
            raise KVStoreConfigError(
                f"an object of {nbytes} bytes is larger than proto-max-bulk-len ({self.max_object_bytes}) of "
                f"redis at {self.url}: raise proto-max-bulk-len or store smaller chunks"
            )

    def _call(self, action: Callable[[], Any], wait_backoff: bool = True) -> Any:
        with self._lock:
            if wait_backoff and self._retry_at is not None and time.monotonic() < self._retry_at:
                raise KVStoreUnavailableError(
                    f"redis at {self.url} is down; next try in {self._retry_at - time.monotonic():.1f} s"
                )
        try:
            if self._client is None:
                with self._connect_lock:
                    if self._client is None:
                        self._connect()
            result = action()
        except _UNAVAILABLE as exc:
            with self._lock:
                was_up = self._retry_at is None
                self._retry_at = time.monotonic() + self.backoff
            if was_up:
                _say_down(self.url, exc)
            raise KVStoreUnavailableError(f"redis at {self.url} is down: {exc}") from exc
        except RedisError as exc:
            raise KVStoreError(f"redis at {self.url} refused a request: {exc}") from exc
        with self._lock:
            was_down, self._retry_at = self._retry_at is not None, None
        if was_down:
            _say_up(self.url)
        return result

    def _pipelined(self, command: str, keys: Sequence[bytes]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            getattr(pipe, command)(KEY_PREFIX + key)
        return pipe.execute()

    def _get(self, keys: Sequence[bytes], each: Callable[[int, Blob], None]) -> list[Blob | None]:
        if self._reader is None:
            found = self._pipelined("get", keys)
            for index, blob in enumerate(found):
                if blob is not None:
                    each(index, blob)
            return found
        return self._reader.get_many([KEY_PREFIX + key for key in keys], self.max_object_bytes, each)

    def get_many(self, keys: Sequence[bytes]) -> list[Blob | None]:
        return self.get_each(keys, lambda index, blob: None)

    def get_each(self, keys: Sequence[bytes], each: Callable[[int, Blob], None]) -> list[Blob | None]:
        def counted(index: int, blob: Blob) -> None:
            # A hit once handed on: a read that fails later has still delivered it.
            with self._lock:
                self._hits += 1
            each(index, blob)

        # Tried even within the back-off: a read follows a lookup that found the keys (here, or in
        # another process of the instance), so the server answered a moment ago, and a read that
        # failed without trying would fail a load that was promised.
        found = self._call(lambda: self._get(keys, counted), wait_backoff=False) if keys else []
        with self._lock:
            self._misses += sum(blob is None for blob in found)
        return found

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [bool(count) for count in self._call(lambda: self._pipelined("exists", keys))] if keys else []

    def put(self, key: bytes, blob: bytes) -> bool:
        if len(blob) > self.max_object_bytes:
            self._write_failed(f"an object of {len(blob)} bytes is larger than proto-max-bulk-len")
            return False
        try:
            stored = self._call(lambda: self._client.set(KEY_PREFIX + key, blob, nx=True))
        except KVStoreUnavailableError:
            raise
        except KVStoreError as exc:  # out of memory under noeviction, say
            self._write_failed(str(exc))
            return False
        if stored:
            with self._lock:
                self._bytes += len(blob)
        return bool(stored)

    def _write_failed(self, why: str) -> None:
        with self._lock:
            self._failed_writes += 1
            first = self._failed_writes == 1
        # Once: a full server refuses every write alike; stats() counts them.
        (logger.warning if first else logger.debug)("redis at %s stored nothing: %s", self.url, why)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                hits=self._hits,
                misses=self._misses,
                bytes_stored=self._bytes,
                evictions=0,
                up=self._retry_at is None,
                failed_writes=self._failed_writes,
            )

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._client is not None:
            self._client.close()
