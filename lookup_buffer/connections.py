"""A consumer's connections to many producers: opened on first use, kept, dropped when they fail,
opened again on a later use.

Each producer has a circuit. Connecting happens in a background dial thread, one attempt per
producer at a time, so no caller ever waits on another producer's attempt, and callers of
:meth:`ProducerConnections.when_ready` wait on none at all. A failed attempt opens the circuit:
until its backoff has passed (doubling from :data:`FIRST_BACKOFF` up to ``max_backoff`` with
consecutive failures), requests for that producer fail at once with a :class:`KVPeerLostError` that
says why and when the next attempt is. After the backoff the circuit half-opens: the next request
starts exactly one attempt, and every request for that producer that arrives meanwhile waits for
its outcome. A producer that restarts is found again by the first attempt after its backoff.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from kv_pipe.affinity import unpinned
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
#: Told the outcome of :meth:`ProducerConnections.when_ready`: the open connection, or why there is none.
Ready = Callable[[KVLookupBufferBase | Exception], None]


def _dial(config: KVTransferConfig, host: str, port: int, on_connect: OnConnect | None) -> KVLookupBufferBase:
    return dial(config, host, port, on_connect)


@dataclasses.dataclass
class _Producer:
    buffer: KVLookupBufferBase | None = None
    dialing: threading.Thread | None = None  # the one attempt in flight
    waiters: list[Ready] = dataclasses.field(default_factory=list)  # told when that attempt ends
    failures: int = 0  # consecutive failed attempts
    retry_at: float = 0.0  # the circuit is open until then
    last_error: str = ""


class ProducerConnections:
    """Thread-safe. ``on_connect`` runs on each new connection's pipe (see :func:`lookup_buffer.dialer.dial`)."""

    def __init__(
        self,
        config: KVTransferConfig,
        on_connect: OnConnect | None = None,
        max_backoff: float = 10.0,
        connect: Dial = _dial,
    ) -> None:
        self._config = config
        self._on_connect = on_connect
        self._max_backoff = max_backoff
        self._connect = connect
        self._lock = threading.Lock()  # guards everything below and every _Producer's fields
        self._producers: dict[Address, _Producer] = {}
        self._closed = False

    def when_ready(self, address: Address, ready: Ready) -> None:
        """Call ``ready`` with the connection to the producer at ``address``, or with the error that
        says why there is none. Never blocks, and never waits for an attempt to connect:

        - connected: ``ready(buffer)`` at once, in this thread;
        - circuit open (an attempt failed and its backoff has not passed), or closed:
          ``ready(error)`` at once, in this thread;
        - otherwise ``ready`` is called from the dial thread once the attempt in flight for that
          producer ends (one is started if there is none), with the new connection or the attempt's
          error. An attempt is bounded by about twice ``kv_timeout``; :meth:`close` ends the wait
          at once with a :class:`KVPipeClosedError`.

        ``ready`` must not block: it holds the dial thread that tells the other waiters. Errors are
        a :class:`KVPeerLostError` (unreachable now: the message names the producer, the last error
        and when the next attempt is), another :class:`KVTransferError` (e.g. the producer refused
        this consumer, or this object was closed), or, from a faulty dialer, any exception.
        """
        waiters = [ready]
        with self._lock:
            if self._closed:
                result: KVLookupBufferBase | Exception | None = _closed_error()
            else:
                producer = self._producers.setdefault(address, _Producer())
                result = self._ready_now(address, producer)
                if result is None:
                    producer.waiters.append(ready)
                    if producer.dialing is not None:
                        return
                    producer.dialing = threading.Thread(
                        target=self._dial, args=(address, producer), name="kvbuf-dial", daemon=True
                    )
                    try:
                        with unpinned():  # the attempt's threads may run on any CPU (see kv_pipe.affinity)
                            producer.dialing.start()
                        return
                    except RuntimeError as exc:  # out of threads: no attempt, and none in flight
                        # Not the producer's fault: its circuit stays as it was, the next request tries again.
                        producer.dialing = None
                        waiters, producer.waiters = producer.waiters, []
                        result = KVPeerLostError(
                            f"lookup buffer: cannot start a thread to connect to the producer "
                            f"at {_name(address)}: {exc}"
                        )
                        logger.error("%s", result)
        for waiter in waiters:
            _tell(waiter, result)

    def get(self, address: Address) -> KVLookupBufferBase:
        """The connection to the producer at ``address``, opened now if there is none (blocking,
        bounded by about twice ``kv_timeout``; an attempt already in flight is waited for, not
        repeated).

        Raises:
            KVPeerLostError: the producer cannot be reached now (the message says why, and when the
                next attempt will be made if this one was skipped for its backoff).
            KVTransferError: the producer refused this consumer (e.g. an incompatible layout), or
                this object was closed.
        """
        done = threading.Event()
        outcome: list[KVLookupBufferBase | Exception] = []

        def ready(result: KVLookupBufferBase | Exception) -> None:
            outcome.append(result)
            done.set()

        self.when_ready(address, ready)
        if not done.wait(self._attempt_bound()):
            raise KVPeerLostError(
                f"lookup buffer: the attempt to connect to the producer at {_name(address)} "
                f"did not end within {self._attempt_bound():g} s"
            )
        result = outcome[0]
        if isinstance(result, Exception):
            raise result
        return result

    def connected(self, address: Address) -> KVLookupBufferBase | None:
        """The open connection to ``address``, or None; never connects."""
        with self._lock:
            producer = self._producers.get(address)
            return producer.buffer if producer is not None else None

    def discard(self, address: Address, buffer: KVLookupBufferBase, error: BaseException) -> None:
        """Drop ``buffer``, the connection to ``address`` that failed with ``error``; the next
        request connects again. Closing it happens in the background (a dead peer may take up to a
        few ``kv_timeout``). Doing it twice, for a connection replaced since, or after :meth:`close`,
        does nothing."""
        with self._lock:
            producer = self._producers.get(address)
            if producer is not None and producer.buffer is buffer:
                self._drop(address, producer, error)

    @property
    def count(self) -> int:
        """Connections open now."""
        with self._lock:
            return sum(producer.buffer is not None for producer in self._producers.values())

    @property
    def dialing(self) -> int:
        """Attempts to connect in flight now."""
        with self._lock:
            return sum(producer.dialing is not None for producer in self._producers.values())

    def close(self, wait: bool = True) -> None:
        """Close every connection (waking calls in flight on them) and tell every waiting
        :meth:`when_ready` callback that this object is closed; with ``wait``, then wait for the
        attempts in flight (each bounded by the dial's own timeouts; a connection one of them makes
        is closed at once). Idempotent."""
        with self._lock:
            self._closed = True
            buffers, waiters, dials = [], [], []
            for producer in self._producers.values():
                if producer.buffer is not None:
                    buffers.append(producer.buffer)
                    producer.buffer = None
                waiters += producer.waiters
                producer.waiters = []
                if producer.dialing is not None:
                    dials.append(producer.dialing)
        error = _closed_error()
        for ready in waiters:
            _tell(ready, error)
        for buffer in buffers:
            _close_quietly(buffer)
        if wait:
            for thread in dials:
                if thread is not threading.current_thread():
                    thread.join(self._attempt_bound())
                    if thread.is_alive():
                        logger.error(
                            "lookup buffer: an attempt to connect did not end within %g s; left behind",
                            self._attempt_bound(),
                        )

    # ------------------------------------------------------------------ internals

    def _attempt_bound(self) -> float:
        """Longer than one attempt can take: the dial waits at most about twice ``kv_timeout``."""
        return 3 * self._config.kv_timeout + 1.0

    def _ready_now(self, address: Address, producer: _Producer) -> KVLookupBufferBase | Exception | None:
        """What a request for ``producer`` gets at once, or None if it must wait for an attempt
        (under the lock)."""
        if producer.buffer is not None:
            failure = producer.buffer.failure
            if failure is None:
                return producer.buffer
            # Found dead before any request used it (e.g. the producer restarted): replace it.
            self._drop(address, producer, failure)
        if producer.dialing is not None:
            return None
        wait = producer.retry_at - time.monotonic()
        if wait > 0:
            return KVPeerLostError(
                f"lookup buffer: the producer at {_name(address)} is unreachable "
                f"({producer.last_error}); next attempt in {wait:.1f} s"
            )
        return None

    def _dial(self, address: Address, producer: _Producer) -> None:
        """The dial thread: one attempt to connect to ``address``, then tell every waiter."""
        result: KVLookupBufferBase | Exception
        try:
            result = self._connect(self._config, address[0], address[1], self._on_connect)
        except KVTransferError as exc:
            result = exc
        except Exception as exc:  # a faulty dialer must still answer every waiter
            logger.exception("lookup buffer: connecting to the producer at %s failed", _name(address))
            result = exc
        late: KVLookupBufferBase | None = None
        with self._lock:
            producer.dialing = None
            waiters, producer.waiters = producer.waiters, []
            if isinstance(result, Exception):
                producer.failures += 1
                backoff = min(self._max_backoff, FIRST_BACKOFF * 2 ** (producer.failures - 1))
                producer.retry_at = time.monotonic() + backoff
                producer.last_error = str(result)
                logger.warning(
                    "lookup buffer: cannot connect to the producer at %s (attempt %d, next in at least %.1f s): %s",
                    _name(address),
                    producer.failures,
                    backoff,
                    result,
                )
            elif self._closed:
                late, result = result, _closed_error()
            else:
                producer.buffer, producer.failures, producer.retry_at = result, 0, 0.0
                logger.info("lookup buffer: connected to the producer at %s", _name(address))
        _close_quietly(late)
        for ready in waiters:
            _tell(ready, result)

    @staticmethod
    def _drop(address: Address, producer: _Producer, error: BaseException) -> None:
        """Forget ``producer``'s connection and close it in the background (under the lock)."""
        buffer, producer.buffer = producer.buffer, None
        logger.warning("lookup buffer: the connection to the producer at %s is dropped: %s", _name(address), error)
        threading.Thread(target=_close_quietly, args=(buffer,), name="kvbuf-close", daemon=True).start()


def _name(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _closed_error() -> KVPipeClosedError:
    return KVPipeClosedError("lookup buffer: the consumer's connections are closed")


def _tell(ready: Ready, result: KVLookupBufferBase | Exception) -> None:
    """Call one waiter; a faulty one must not keep the others from being told."""
    try:
        ready(result)
    except Exception:
        logger.exception("lookup buffer: a callback waiting for a producer's connection failed")


def _close_quietly(buffer: KVLookupBufferBase | None) -> None:
    if buffer is None:
        return
    try:
        buffer.close()
    except KVTransferError as exc:
        logger.info("lookup buffer: closing a dropped connection: %s", exc)
