"""A producer that serves any number of consumers: one listening address, one pipe per consumer.

The producer binds a ZeroMQ ROUTER at ``kv_ip:kv_port + port_offset``. A consumer that wants its
entries sends a connect request there (:func:`lookup_buffer.dialer.dial`); the listener binds two
ports of the kernel's choosing on ``kv_ip`` for that consumer alone (the data pipe's rendezvous and
the control channel), answers with them, and in a thread of its own waits for the consumer's pipe,
runs the caller's ``on_connect`` check on it (e.g. the vLLM connector's layout check) and starts a
:class:`lookup_buffer.producer.BufferProducer` on it. Every connection serves the same entries
(one :class:`lookup_buffer.store.EntryStore`): an entry goes to exactly one select, whichever
connection it came on.

A connection whose consumer dies or closes is dropped; its entries stay for the others. Consumers
may come, go and come back at any time; the listener never waits for one. Its thread only answers
connect requests, expires entries and hands ended connections over: closing one (its server, its
pipe) may take several ``kv_timeout`` and runs in closing threads of their own, so a consumer slow
to close delays neither another's connect nor an entry's expiry.

Each connection's pipe keeps memory of its own besides the entries (its frames and, on one host,
the pages of its shared-memory segment, which stay once used): it is counted from the connect
request until the pipe is closed, and a consumer whose connection would take it past the bound
(``max_pipe_bytes``) is refused as "busy".
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence

import torch
import zmq

from kv_pipe import TorchDistributedPipe, cores, rendezvous
from kv_pipe.base import KVPipeBase
from kv_pipe.config import KVTransferConfig
from kv_pipe.device import nccl_pipe_bytes
from kv_pipe.errors import KVConfigError, KVPipeClosedError, KVTransferError
from kv_pipe.host_memory import HostMemoryPool
from kv_pipe.protocol import HOST_FRAME_BYTES, SHARED_DATA_START, message_cost
from kv_pipe.shared_memory import MAX_SEGMENT_BYTES
from lookup_buffer.base import BufferStats, KVLookupBufferBase, SelectResult
from lookup_buffer.config import BufferConfig
from lookup_buffer.control import Endpoint, control_host
from lookup_buffer.loans import LentTensor, Loan
from lookup_buffer.producer import BufferProducer, log_expired, make_entry
from lookup_buffer.protocol import (
    MAX_REQUEST_BYTES,
    ControlSigner,
    MessageError,
    Reason,
    decode_connect_request,
    encode_connect_reply,
    encode_refusal,
    only_frame,
)
from lookup_buffer.store import EntryStore

logger = logging.getLogger(__name__)

#: Called with each new connection's pipe before it serves anything; raising refuses the consumer
#: (the error is logged, the pipe closed).
OnConnect = Callable[[KVPipeBase], object]
PipeFactory = Callable[..., KVPipeBase]

#: Connections held at once (serving, or ended and still closing), and connections being set up at
#: once; more are refused ("busy").
MAX_CONNECTIONS = 256
MAX_PENDING_CONNECTIONS = 16
#: Threads closing ended connections at once: started as needed, gone once nothing is left to close.
#: Further ended connections wait for one of them (still counted as held).
MAX_CLOSING_THREADS = 16
#: The default bound of the memory all connections' pipes keep together, in ``kv_buffer_size``:
#: with the 1 GiB default, 16 GiB, so 15 consumers on the producer's host at the largest segment
#: (1 GiB). It is never below what MAX_CONNECTIONS connections without shared memory need.
PIPE_MEMORY_BUDGETS = 16
#: close() waits at most this many kv_timeout, in all, for set-ups and connections to end: a pipe to
#: a dead or hung consumer closes within two (the pipe's own bound), its server within one more.
CLOSE_TIMEOUTS = 4
_POLL_MS = 500  # also how often ended connections are handed over and old entries expired
_LOGGED_REFUSALS = 20


def pipe_memory(config: KVTransferConfig, shared: bool) -> int:
    """Memory one connection's pipe may keep while idle, with the listener's ``config``.

    Its two frames (:data:`kv_pipe.protocol.HOST_FRAME_BYTES` each, host memory on every pipe);
    on the same-host path (``shared``), its shared-memory segment: the pipe's budget plus one page,
    at most 1 GiB (a segment's pages are touched only as payloads use them, but stay once touched,
    as long as the pipe lives); on CUDA, the device memory of its NCCL communicators
    (:func:`kv_pipe.device.nccl_pipe_bytes`).
    """
    frames = 2 * HOST_FRAME_BYTES
    segment = min(config.kv_buffer_size + SHARED_DATA_START, MAX_SEGMENT_BYTES) if shared else 0
    device = nccl_pipe_bytes() if config.kv_buffer_device == "cuda" else 0
    return frames + segment + device


@dataclasses.dataclass
class _Totals:
    """Counters of connections that ended, so that stats never go backwards."""

    hits: int = 0
    misses: int = 0
    waits: int = 0
    transferred_bytes: int = 0
    bad_messages: int = 0

    def add(self, stats: BufferStats) -> None:
        self.hits += stats.hits
        self.misses += stats.misses
        self.waits += stats.waits
        self.transferred_bytes += stats.transferred_bytes
        self.bad_messages += stats.bad_messages


@dataclasses.dataclass(frozen=True)
class _Pipe:
    """What the listener knows of a connection's pipe: whether it is on the same-host path, and the
    memory charged for it."""

    shared: bool
    nbytes: int


class BufferListener(KVLookupBufferBase):
    """The producer side of a lookup buffer for many consumers (``kv_role='kv_producer'``).

    Args:
        config: ``kv_ip``/``kv_port`` (+ ``port_offset``) is where consumers ask to connect;
            ``kv_buffer_size`` bounds the bytes held for all consumers together (each connection's
            pipe has this budget too; a consumer with a smaller one is refused, as it could not
            receive every entry).
        port_offset: added to ``kv_port`` (e.g. a TP rank).
        on_connect: see :data:`OnConnect`.
        max_pipe_bytes: bound of the memory all connections' pipes keep together (see
            :func:`pipe_memory`; a connection is charged as if on the same-host path until its pipe
            is up); None: ``PIPE_MEMORY_BUDGETS * kv_buffer_size``, at least what ``MAX_CONNECTIONS``
            connections without shared memory keep.
        buffer_config: what becomes of entries nobody selects (``kv_entry_timeout`` drops them,
            ``kv_evict_unclaimed`` lets a new entry evict the oldest of them from a full budget);
            default: :class:`~lookup_buffer.config.BufferConfig`'s defaults.

    Construction binds the address and returns at once. Thread-safe. ``drop_select`` is the
    consumer's and raises KVConfigError here. :meth:`close` returns within about
    ``CLOSE_TIMEOUTS * kv_timeout``.

    Raises:
        KVConfigError: the role is not ``kv_producer``, or the address cannot be bound.
    """

    def __init__(
        self,
        config: KVTransferConfig,
        port_offset: int = 0,
        on_connect: OnConnect | None = None,
        pipe_factory: PipeFactory = TorchDistributedPipe,
        max_pipe_bytes: int | None = None,
        buffer_config: BufferConfig | None = None,
    ) -> None:
        config.validate()
        if config.kv_role != "kv_producer":
            raise KVConfigError(
                f"a BufferListener is a producer: kv_role must be 'kv_producer', got {config.kv_role!r}"
            )
        self.config = config
        self._on_connect = on_connect
        self._pipe_factory = pipe_factory
        self._max_item_bytes = config.kv_buffer_size - message_cost(0)
        kept = buffer_config or BufferConfig()
        self.buffer_config = kept
        self._store = EntryStore(
            config.kv_buffer_size, self._max_item_bytes, kept.kv_entry_timeout, kept.kv_evict_unclaimed
        )
        self._memory = HostMemoryPool(config.kv_buffer_size)
        self._signer = ControlSigner(config.kv_secret)
        # Until its pipe is up, a connection is charged as if it were on the same-host path.
        may_share = config.kv_shared_memory != "off" and config.kv_buffer_device == "cpu"
        self._reserved_bytes = pipe_memory(config, shared=may_share)
        if max_pipe_bytes is None:
            max_pipe_bytes = max(
                PIPE_MEMORY_BUDGETS * config.kv_buffer_size, MAX_CONNECTIONS * pipe_memory(config, shared=False)
            )
        self.max_pipe_bytes = max_pipe_bytes
        # Guards the connection sets and queues, the counts of set-ups and pipe memory, the totals
        # and the closed flag; _changed is signalled when a set-up or a connection's close ends.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._connections: dict[BufferProducer, _Pipe] = {}  # serving
        self._closing: dict[BufferProducer, _Pipe] = {}  # ended, handed over to be closed
        self._to_close: collections.deque[BufferProducer] = collections.deque()  # ... and not taken yet
        self._closers: set[threading.Thread] = set()
        self._setups: set[threading.Thread] = set()
        self._pending = 0
        self._pipe_bytes = 0  # charged for connections being set up, serving, or closing
        self._totals = _Totals()
        self._accepted = 0
        self._refused = 0
        self._closed = False
        port = config.kv_port + port_offset
        self._stopping = threading.Event()
        # The socket's ZeroMQ I/O thread starts here, on the caller's thread (a vLLM worker's pinned
        # one): it runs on kvbridge's cores like the acceptor and every thread the acceptor starts.
        with cores.spawning():
            self._endpoint = Endpoint(
                zmq.ROUTER, f"tcp://{control_host(config.kv_ip)}:{port}", MAX_REQUEST_BYTES, bind=True
            )
        self.address = self._endpoint.address
        self._acceptor = cores.thread(self._accept, f"kvbuf-listener-{port}")
        self._acceptor.start()
        logger.info(
            "lookup buffer producer listening for consumers on %s (%d bytes)", self.address, config.kv_buffer_size
        )

    # ------------------------------------------------------------------ caller API

    def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        key: torch.Tensor | LentTensor,
        value: torch.Tensor | LentTensor | None,
        hidden: torch.Tensor | LentTensor | None,
        timeout: float | None = None,
    ) -> Loan | None:
        match_key, entry = make_entry(input_tokens, roi, key, value, hidden)
        with self._lock:
            if self._closed:
                raise KVPipeClosedError("insert on a closed lookup buffer")
        self._store.put(match_key, entry, self.config.kv_timeout if timeout is None else timeout)
        for connection in self._live_connections():
            connection.notify_inserted(match_key)
        return entry.loan

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor to fill and insert. With one consumer connected on the same host, in that
        connection's pipe memory (:meth:`kv_pipe.KVPipeBase.empty`: it reaches that consumer without
        a copy, and any other with one); otherwise pooled host memory of the listener's, whose pages
        are warm (writing into fresh pages costs several times the copy). Across hosts a pipe's
        memory would save no copy, and would stay pooled in that pipe for as long as it lives."""
        with self._lock:
            lone = next(iter(self._connections.items())) if len(self._connections) == 1 else None
        if lone is not None and lone[1].shared:
            return lone[0].empty(shape, dtype)
        shape = tuple(shape)
        return self._memory.allocate(math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)

    def unlend(self, loan: Loan) -> bool:
        match_key = self._store.unlend(loan, self.empty)
        if match_key is None:
            return False
        for connection in self._live_connections():
            connection.notify_inserted(match_key)
        return True

    def drop_select(
        self, input_tokens: torch.Tensor, roi: torch.Tensor, timeout: float | None = None, borrow: bool = False
    ) -> SelectResult:
        raise KVConfigError("drop_select() needs kv_role='kv_consumer'; this buffer is the producer's listener")

    @property
    def connections(self) -> int:
        """Consumers connected now."""
        with self._lock:
            return len(self._connections)

    @property
    def pipe_bytes(self) -> int:
        """Memory charged now for the pipes of connections being set up, serving, or ended and not
        closed yet (:func:`pipe_memory`); at most ``max_pipe_bytes``."""
        with self._lock:
            return self._pipe_bytes

    def stats(self) -> BufferStats:
        store = self._store.counters()
        with self._lock:
            live = list(self._connections)
            closing = list(self._closing)
            totals = dataclasses.replace(self._totals)
        live_stats = [connection.stats() for connection in live]
        for stats in live_stats + [connection.stats() for connection in closing]:
            totals.add(stats)
        return BufferStats(
            role="kv_producer",
            **dataclasses.asdict(store),  # the store's counters carry BufferStats' names
            pending=sum(stats.pending for stats in live_stats),
            **dataclasses.asdict(totals),
        )

    def close(self) -> None:
        """Stop accepting, drop the unselected entries, close every connection (in the closing
        threads, several at once) and wait for them and the set-ups in progress, at most
        ``CLOSE_TIMEOUTS * kv_timeout`` in all; what is still running then is logged and left to
        end on its own (daemon threads, each bounded by its own timeouts)."""
        deadline = time.monotonic() + CLOSE_TIMEOUTS * self.config.kv_timeout
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._hand_over(list(self._connections))  # their last answers may still go out
        self._stopping.set()
        self._endpoint.doorbell.ring()
        entries, nbytes = self._store.stop(KVPipeClosedError("insert on a closed lookup buffer"))
        if entries:
            logger.warning("lookup buffer closed with %d unselected entries (%d bytes): dropped", entries, nbytes)
        self._acceptor.join(max(0.0, deadline - time.monotonic()))
        with self._lock:  # no set-up starts any more; one ending now hands its connection over like the rest
            self._hand_over([])  # start closers that could not be started before, if any
            while (self._pending or self._closing) and self._changed.wait(max(0.0, deadline - time.monotonic())):
                pass
            threads = list(self._setups | self._closers)
            pending, closing = self._pending, len(self._closing)
        for thread in threads:  # ending: each has nothing left to do
            thread.join(max(0.0, deadline - time.monotonic()))
        if pending or closing:
            logger.error(
                "lookup buffer: %d connection set-ups and %d connection closes did not end within %.1f s; "
                "they end on their own",
                pending,
                closing,
                CLOSE_TIMEOUTS * self.config.kv_timeout,
            )
        if self._acceptor.is_alive():
            logger.error(
                "lookup buffer listener thread did not stop within %.1f s; its socket stays open",
                CLOSE_TIMEOUTS * self.config.kv_timeout,
            )
        else:
            self._endpoint.close()

    # ------------------------------------------------------------------ connections

    def _live_connections(self) -> list[BufferProducer]:
        with self._lock:
            return list(self._connections)

    def _end(self, connection: BufferProducer) -> None:
        """Close a connection handed over (in a closing thread: it may wait several kv_timeout)."""
        try:
            connection.close()
        except KVTransferError as exc:
            logger.info("lookup buffer: a consumer's connection ended: %s", exc)
        except Exception:  # a bug: the connection is given up all the same
            logger.exception("lookup buffer: closing a consumer's connection failed")

    def _hand_over(self, connections: list[BufferProducer]) -> None:
        """Take ``connections`` out of the live set and queue them to be closed by the closing threads,
        starting those needed (under the lock; never waits). Their pipes and counters stay counted
        until they are closed."""
        for connection in connections:
            self._closing[connection] = self._connections.pop(connection)
            self._to_close.append(connection)
        while self._to_close and len(self._closers) < min(MAX_CLOSING_THREADS, len(self._closing)):
            closer = cores.thread(self._close_ended, "kvbuf-listener-close")
            try:
                closer.start()
            except RuntimeError as exc:  # no thread to be had now: the next hand-over tries again
                logger.warning("lookup buffer: cannot start a thread to close ended connections: %s", exc)
                return
            self._closers.add(closer)

    def _close_ended(self) -> None:
        """A closing thread: close the connections handed over, one at a time, until none is left."""
        me = threading.current_thread()
        while True:
            with self._lock:
                if not self._to_close:
                    self._closers.discard(me)
                    self._changed.notify_all()
                    return
                connection = self._to_close.popleft()
            try:
                self._end(connection)
            finally:
                with self._lock:
                    pipe = self._closing.pop(connection)
                    self._pipe_bytes -= pipe.nbytes
                    self._totals.add(connection.stats())  # closed: it counts nothing more
                    self._changed.notify_all()

    # ------------------------------------------------------------------ acceptor thread

    def _accept(self) -> None:
        """Answer connect requests, hand ended connections over, expire entries: none of it waits for
        a consumer, a pipe or another thread."""
        while not self._stopping.is_set():
            self._endpoint.wait(_POLL_MS)
            self._receive_connect_requests()
            with self._lock:
                self._hand_over([connection for connection in self._connections if connection.failure is not None])
            log_expired(*self._store.expire())

    def _receive_connect_requests(self) -> None:
        for identity, frames in self._endpoint.routed(MAX_PENDING_CONNECTIONS):
            try:
                request = decode_connect_request(self._signer, only_frame(frames))
            except MessageError as exc:
                self._refuse(identity, exc.reason, f"connect request refused: {exc}")
                continue
            if request.buffer_bytes < self.config.kv_buffer_size:
                self._refuse(
                    identity,
                    "config",
                    f"the consumer's kv_buffer_size ({request.buffer_bytes} bytes) is "
                    f"smaller than the producer's ({self.config.kv_buffer_size}): it could not receive every "
                    f"entry; give it at least as much",
                )
                continue
            with self._lock:
                if self._closed:
                    return
                held = len(self._connections) + len(self._closing)
                full = held >= MAX_CONNECTIONS or self._pending >= MAX_PENDING_CONNECTIONS
                pipe_bytes = self._pipe_bytes
                short = not full and pipe_bytes + self._reserved_bytes > self.max_pipe_bytes
                if not (full or short):
                    self._pending += 1
                    self._pipe_bytes += self._reserved_bytes
            if full:
                self._refuse(
                    identity,
                    "busy",
                    f"the producer at {self.address} holds {MAX_CONNECTIONS} connections "
                    f"or sets up {MAX_PENDING_CONNECTIONS} already",
                )
                continue
            if short:
                self._refuse(
                    identity,
                    "busy",
                    f"the producer at {self.address} holds {pipe_bytes} bytes of pipe "
                    f"memory for its connections; another (up to {self._reserved_bytes} bytes: its frames "
                    f"and, on one host, a shared-memory segment the size of kv_buffer_size) would exceed "
                    f"its bound of {self.max_pipe_bytes} bytes",
                )
                continue
            try:
                self._open(identity, request.nonce)
            except BaseException:
                self._setup_done(self._reserved_bytes)
                raise

    def _open(self, identity: bytes, nonce: bytes) -> None:
        """Bind this consumer's two ports, tell it, and set the connection up in a thread of its own."""
        host = self.config.kv_ip
        try:
            store_socket = rendezvous.listen(host, 0)
        except KVTransferError as exc:
            self._setup_done(self._reserved_bytes)
            self._refuse(identity, "failed", str(exc))
            return
        try:
            control = Endpoint(zmq.ROUTER, f"tcp://{control_host(host)}:*", MAX_REQUEST_BYTES, bind=True)
        except KVConfigError as exc:
            store_socket.close()
            self._setup_done(self._reserved_bytes)
            self._refuse(identity, "failed", str(exc))
            return
        control_port = int(control.address.rsplit(":", 1)[1])
        reply = encode_connect_reply(self._signer, nonce, store_socket.getsockname()[1], control_port)
        setup = cores.thread(self._set_up, "kvbuf-listener-setup", (store_socket, control))
        try:
            self._endpoint.send([identity, reply])
            with self._lock:
                self._setups.add(setup)
            setup.start()
        except (zmq.ZMQError, RuntimeError) as exc:  # the consumer is gone, or no thread to be had
            with self._lock:
                self._setups.discard(setup)
            control.close()
            store_socket.close()
            self._setup_done(self._reserved_bytes)
            logger.warning("lookup buffer: a consumer's connection to %s could not be set up: %s", self.address, exc)

    def _set_up(self, store_socket: socket.socket, control: Endpoint) -> None:
        try:
            self._build(store_socket, control)
        finally:
            with self._lock:
                self._setups.discard(threading.current_thread())

    def _build(self, store_socket: socket.socket, control: Endpoint) -> None:
        # The consumer dials as soon as it has the reply: kv_timeout, not kv_connect_timeout, bounds the wait.
        config = self.config.replace(kv_rank=0, kv_connect_timeout=self.config.kv_timeout)
        pipe: KVPipeBase | None = None
        try:
            pipe = self._pipe_factory(config, listener=store_socket)
            if pipe.max_tensor_bytes < self._max_item_bytes:  # it said otherwise in its connect request
                raise KVConfigError(
                    f"the consumer's kv_buffer_size is smaller than the producer's ({self.config.kv_buffer_size} "
                    f"bytes): it could not receive every entry; give it at least as much"
                )
            if self._on_connect is not None:
                self._on_connect(pipe)
            connection = BufferProducer(pipe, self.config, control, store=self._store)
        except Exception as exc:  # refused or failed: this consumer only
            if isinstance(exc, KVTransferError):
                logger.warning("lookup buffer: a consumer's connection to %s failed to start: %s", self.address, exc)
            else:
                logger.exception("lookup buffer: setting up a consumer's connection to %s failed", self.address)
            control.close()
            if pipe is None:
                store_socket.close()
            else:
                _close_quietly(pipe)
            self._setup_done(self._reserved_bytes)
            return
        shared = pipe.uses_shared_memory
        charged = _Pipe(shared, pipe_memory(self.config, shared))
        with self._lock:
            self._pending -= 1
            self._accepted += 1
            self._pipe_bytes += charged.nbytes - self._reserved_bytes  # never more than reserved
            self._connections[connection] = charged
            closed = self._closed
            if closed:  # too late: closed like the others, and close() waits for it as for them
                self._hand_over([connection])
            self._changed.notify_all()
        if closed:
            return
        logger.info("lookup buffer: a consumer connected to %s (%d connected)", self.address, self.connections)

    def _setup_done(self, reserved: int) -> None:
        """A set-up ended without a connection: give its charge back."""
        with self._lock:
            self._pending -= 1
            self._pipe_bytes -= reserved
            self._changed.notify_all()

    def _refuse(self, identity: bytes, reason: Reason, message: str) -> None:
        with self._lock:
            self._refused += 1
            refused = self._refused
        if refused <= _LOGGED_REFUSALS or refused % 1000 == 0:  # a flood must not flood the log
            logger.warning("lookup buffer: refused a connect request (%d so far): %s", refused, message)
        try:
            frame = encode_refusal(self._signer, 0, reason, message)
            self._endpoint.send([identity, frame])
        except zmq.ZMQError as exc:
            logger.debug("lookup buffer: refusal to %s dropped: %s", identity.hex(), exc)


def _close_quietly(pipe: KVPipeBase) -> None:
    try:
        pipe.close()
    except KVTransferError as exc:
        logger.debug("lookup buffer: closing a pipe that failed to start: %s", exc)
