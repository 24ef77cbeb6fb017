"""A consumer's connections to many producers: opened on first use, kept, dropped when they fail,
opened again on a later use.

A producer that restarts is found again by the next request that names it; one that is down costs
each request at most one bounded connection attempt, and after consecutive failures none at all
until its backoff has passed (doubling from :data:`FIRST_BACKOFF` up to ``max_backoff``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVPeerLostError, KVPipeClosedError, KVTransferError
from lookup_buffer.base import KVLookupBufferBase
from lookup_buffer.dialer import dial
from lookup_buffer.listener import OnConnect

logger = logging.getLogger(__name__)

#: Seconds without attempts after a first failed connection attempt; doubled per further failure.
FIRST_BACKOFF = 0.5
#: (host, port) of a producer's listener.
Address = tuple[str, int]
Dial = Callable[[KVTransferConfig, str, int, OnConnect | None], KVLookupBufferBase]


def _dial(config: KVTransferConfig, host: str, port: int, on_connect: OnConnect | None) -> KVLookupBufferBase:
    return dial(config, host, port, on_connect)


@dataclasses.dataclass
class _Producer:
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # one attempt at a time
    buffer: KVLookupBufferBase | None = None
    failures: int = 0  # consecutive failed attempts
    retry_at: float = 0.0
    last_error: str = ""


class ProducerConnections:
    """Thread-safe. ``on_connect`` runs on each new connection's pipe (see :func:`lookup_buffer.dialer.dial`)."""

    def __init__(self, config: KVTransferConfig, on_connect: OnConnect | None = None, max_backoff: float = 10.0,
                 connect: Dial = _dial) -> None:
        self._config = config
        self._on_connect = on_connect
        self._max_backoff = max_backoff
        self._connect = connect
        self._lock = threading.Lock()
        self._producers: dict[Address, _Producer] = {}
        self._closed = False

    def get(self, address: Address) -> KVLookupBufferBase:
        """The connection to the producer at ``address``, opened now if there is none (blocking,
        bounded by about twice ``kv_timeout``).

        Raises:
            KVPeerLostError: the producer cannot be reached now (the message says why, and when the
                next attempt will be made if this one was skipped for its backoff).
            KVTransferError: the producer refused this consumer (e.g. an incompatible layout), or
                this object was closed.
        """
        producer = self._producer(address)
        with producer.lock:
            if producer.buffer is not None:
                if producer.buffer.failure is None:
                    return producer.buffer
                # Found dead before any request used it (e.g. the producer restarted): replace it.
                self._drop(address, producer, producer.buffer.failure)
            wait = producer.retry_at - time.monotonic()
            if wait > 0:
                raise KVPeerLostError(f"lookup buffer: the producer at {_name(address)} is unreachable "
                                      f"({producer.last_error}); next attempt in {wait:.1f} s")
            try:
                buffer = self._connect(self._config, address[0], address[1], self._on_connect)
            except KVTransferError as exc:
                producer.failures += 1
                backoff = min(self._max_backoff, FIRST_BACKOFF * 2 ** (producer.failures - 1))
                producer.retry_at = time.monotonic() + backoff
                producer.last_error = str(exc)
                logger.warning("lookup buffer: cannot connect to the producer at %s (attempt %d, next in at least "
                               "%.1f s): %s", _name(address), producer.failures, backoff, exc)
                raise
            with self._lock:
                if self._closed:
                    _close_quietly(buffer)
                    raise KVPipeClosedError("lookup buffer: the consumer's connections are closed")
            producer.buffer, producer.failures, producer.retry_at = buffer, 0, 0.0
            logger.info("lookup buffer: connected to the producer at %s", _name(address))
            return buffer

    def connected(self, address: Address) -> KVLookupBufferBase | None:
        """The open connection to ``address``, or None; never connects."""
        with self._lock:
            producer = self._producers.get(address)
        return producer.buffer if producer is not None else None

    def discard(self, address: Address, buffer: KVLookupBufferBase, error: BaseException) -> None:
        """Drop ``buffer``, the connection to ``address`` that failed with ``error``; the next
        :meth:`get` connects again. Closing it happens in the background (a dead peer may take up
        to a few ``kv_timeout``). Doing it twice, or for a connection replaced since, does nothing."""
        producer = self._producer(address)
        with producer.lock:
            if producer.buffer is buffer:
                self._drop(address, producer, error)

    @staticmethod
    def _drop(address: Address, producer: _Producer, error: BaseException) -> None:
        """Forget ``producer``'s connection and close it in the background (under its lock)."""
        buffer, producer.buffer = producer.buffer, None
        logger.warning("lookup buffer: the connection to the producer at %s is dropped: %s", _name(address), error)
        threading.Thread(target=_close_quietly, args=(buffer,), name="kvbuf-close", daemon=True).start()

    @property
    def count(self) -> int:
        """Connections open now."""
        with self._lock:
            producers = list(self._producers.values())
        return sum(producer.buffer is not None for producer in producers)

    def close(self) -> None:
        """Close every connection (waking calls in flight on them). Idempotent."""
        with self._lock:
            self._closed = True
            producers = list(self._producers.values())
        for producer in producers:
            with producer.lock:
                buffer, producer.buffer = producer.buffer, None
            if buffer is not None:
                _close_quietly(buffer)

    def _producer(self, address: Address) -> _Producer:
        with self._lock:
            if self._closed:
                raise KVPipeClosedError("lookup buffer: the consumer's connections are closed")
            return self._producers.setdefault(address, _Producer())


def _name(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _close_quietly(buffer: KVLookupBufferBase | None) -> None:
    if buffer is None:
        return
    try:
        buffer.close()
    except KVTransferError as exc:
        logger.info("lookup buffer: closing a dropped connection: %s", exc)
