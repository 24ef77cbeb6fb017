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
may come, go and come back at any time; the listener never waits for one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import socket
import threading
from collections.abc import Callable, Sequence

import torch
import zmq

from kv_pipe import TorchDistributedPipe, rendezvous
from kv_pipe.base import KVPipeBase
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVConfigError, KVPipeClosedError, KVTransferError
from kv_pipe.host_memory import HostMemoryPool
from kv_pipe.protocol import message_cost
from lookup_buffer.base import BufferStats, KVLookupBufferBase, SelectResult
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

#: Connections served at once, and connections being set up at once; more are refused ("busy").
MAX_CONNECTIONS = 256
MAX_PENDING_CONNECTIONS = 16
_POLL_MS = 500  # also how often dead connections are reaped and old entries expired
_LOGGED_REFUSALS = 20


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


class BufferListener(KVLookupBufferBase):
    """The producer side of a lookup buffer for many consumers (``kv_role='kv_producer'``).

    Args:
        config: ``kv_ip``/``kv_port`` (+ ``port_offset``) is where consumers ask to connect;
            ``kv_buffer_size`` bounds the bytes held for all consumers together (each connection's
            pipe has this budget too; a consumer with a smaller one is refused, as it could not
            receive every entry); ``kv_entry_timeout`` drops entries nobody selects;
            ``kv_evict_unclaimed`` lets a new entry evict the oldest unselected ones from a full budget.
        port_offset: added to ``kv_port`` (e.g. a TP rank).
        on_connect: see :data:`OnConnect`.

    Construction binds the address and returns at once. Thread-safe. ``drop_select`` is the
    consumer's and raises KVConfigError here.

    Raises:
        KVConfigError: the role is not ``kv_producer``, or the address cannot be bound.
    """

    def __init__(self, config: KVTransferConfig, port_offset: int = 0, on_connect: OnConnect | None = None,
                 pipe_factory: PipeFactory = TorchDistributedPipe) -> None:
        config.validate()
        if config.kv_role != "kv_producer":
            raise KVConfigError(f"a BufferListener is a producer: kv_role must be 'kv_producer', "
                                f"got {config.kv_role!r}")
        self.config = config
        self._on_connect = on_connect
        self._pipe_factory = pipe_factory
        self._max_item_bytes = config.kv_buffer_size - message_cost(0)
        self._store = EntryStore(config.kv_buffer_size, self._max_item_bytes, config.kv_entry_timeout,
                                 config.kv_evict_unclaimed)
        self._memory = HostMemoryPool(config.kv_buffer_size)
        self._signer = ControlSigner(config.kv_secret)
        self._lock = threading.Lock()  # guards the connection sets, totals and the closed flag
        self._connections: set[BufferProducer] = set()
        self._pending = 0
        self._totals = _Totals()
        self._accepted = 0
        self._refused = 0
        self._closed = False
        port = config.kv_port + port_offset
        self._endpoint = Endpoint(zmq.ROUTER, f"tcp://{control_host(config.kv_ip)}:{port}", MAX_REQUEST_BYTES,
                                  bind=True)
        self.address = self._endpoint.address
        self._stopping = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name=f"kvbuf-listener-{port}", daemon=True)
        self._acceptor.start()
        logger.info("lookup buffer producer listening for consumers on %s (%d bytes)", self.address,
                    config.kv_buffer_size)

    # ------------------------------------------------------------------ caller API

    def insert(self, input_tokens: torch.Tensor, roi: torch.Tensor, key: torch.Tensor | LentTensor,
               value: torch.Tensor | LentTensor | None, hidden: torch.Tensor | LentTensor | None,
               timeout: float | None = None) -> Loan | None:
        match_key, entry = make_entry(input_tokens, roi, key, value, hidden)
        with self._lock:
            if self._closed:
                raise KVPipeClosedError("insert on a closed lookup buffer")
        self._store.put(match_key, entry, self.config.kv_timeout if timeout is None else timeout)
        for connection in self._live_connections():
            connection.notify_inserted(match_key)
        return entry.loan

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor to fill and insert. With one consumer connected, in that connection's pipe memory
        (:meth:`kv_pipe.KVPipeBase.empty`: on one host it reaches that consumer without a copy, and
        any other with one); otherwise pooled host memory, whose pages are warm (writing into fresh
        pages costs several times the copy)."""
        live = self._live_connections()
        if len(live) == 1:
            return live[0].empty(shape, dtype)
        shape = tuple(shape)
        return self._memory.allocate(math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)

    def drop_select(self, input_tokens: torch.Tensor, roi: torch.Tensor, timeout: float | None = None,
                    borrow: bool = False) -> SelectResult:
        raise KVConfigError("drop_select() needs kv_role='kv_consumer'; this buffer is the producer's listener")

    @property
    def connections(self) -> int:
        """Consumers connected now."""
        with self._lock:
            return len(self._connections)

    def stats(self) -> BufferStats:
        store = self._store.counters()
        live = [connection.stats() for connection in self._live_connections()]
        with self._lock:
            totals = dataclasses.replace(self._totals)
        for stats in live:
            totals.add(stats)
        return BufferStats(
            role="kv_producer",
            **dataclasses.asdict(store),  # the store's counters carry BufferStats' names
            pending=sum(stats.pending for stats in live),
            **dataclasses.asdict(totals),
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections)
        self._stopping.set()
        self._endpoint.doorbell.ring()
        entries, nbytes = self._store.stop(KVPipeClosedError("insert on a closed lookup buffer"))
        if entries:
            logger.warning("lookup buffer closed with %d unselected entries (%d bytes): dropped", entries, nbytes)
        for connection in connections:
            self._end(connection)  # its last answers may still go out: counted once it is closed
        with self._lock:
            self._retire(connections)
        self._acceptor.join(self.config.kv_timeout)
        if self._acceptor.is_alive():
            logger.error("lookup buffer listener thread did not stop within %.1f s; its socket stays open",
                         self.config.kv_timeout)
        else:
            self._endpoint.close()

    # ------------------------------------------------------------------ connections

    def _live_connections(self) -> list[BufferProducer]:
        with self._lock:
            return list(self._connections)

    def _end(self, connection: BufferProducer) -> None:
        """Close a connection taken out of the live set (its counters are in the totals already)."""
        try:
            connection.close()
        except KVTransferError as exc:
            logger.info("lookup buffer: a consumer's connection ended: %s", exc)

    def _retire(self, connections: list[BufferProducer]) -> None:
        """Take ``connections`` out of the live set, keeping their counters (under the lock: stats
        never miss them). A connection that failed or closed counts nothing more."""
        for connection in connections:
            self._connections.discard(connection)
            self._totals.add(connection.stats())

    def _reap(self) -> None:
        with self._lock:
            ended = [connection for connection in self._connections if connection.failure is not None]
            self._retire(ended)
        for connection in ended:
            self._end(connection)

    # ------------------------------------------------------------------ acceptor thread

    def _accept(self) -> None:
        while not self._stopping.is_set():
            self._endpoint.wait(_POLL_MS)
            self._receive_connect_requests()
            self._reap()
            log_expired(*self._store.expire())

    def _receive_connect_requests(self) -> None:
        for identity, frames in self._endpoint.routed(MAX_PENDING_CONNECTIONS):
            try:
                request = decode_connect_request(self._signer, only_frame(frames))
            except MessageError as exc:
                self._refuse(identity, exc.reason, f"connect request refused: {exc}")
                continue
            if request.buffer_bytes < self.config.kv_buffer_size:
                self._refuse(identity, "config", f"the consumer's kv_buffer_size ({request.buffer_bytes} bytes) is "
                             f"smaller than the producer's ({self.config.kv_buffer_size}): it could not receive every "
                             f"entry; give it at least as much")
                continue
            with self._lock:
                full = len(self._connections) >= MAX_CONNECTIONS or self._pending >= MAX_PENDING_CONNECTIONS
                if not full:
                    self._pending += 1
            if full:
                self._refuse(identity, "busy", f"the producer at {self.address} serves {MAX_CONNECTIONS} consumers "
                             f"or sets up {MAX_PENDING_CONNECTIONS} already")
                continue
            try:
                self._open(identity, request.nonce)
            except BaseException:
                with self._lock:
                    self._pending -= 1
                raise

    def _open(self, identity: bytes, nonce: bytes) -> None:
        """Bind this consumer's two ports, tell it, and set the connection up in a thread of its own."""
        host = self.config.kv_ip
        try:
            store_socket = rendezvous.listen(host, 0)
        except KVTransferError as exc:
            self._setup_done()
            self._refuse(identity, "failed", str(exc))
            return
        try:
            control = Endpoint(zmq.ROUTER, f"tcp://{control_host(host)}:*", MAX_REQUEST_BYTES, bind=True)
        except KVConfigError as exc:
            store_socket.close()
            self._setup_done()
            self._refuse(identity, "failed", str(exc))
            return
        control_port = int(control.address.rsplit(":", 1)[1])
        reply = encode_connect_reply(self._signer, nonce, store_socket.getsockname()[1], control_port)
        self._endpoint.send([identity, reply])
        threading.Thread(target=self._set_up, args=(store_socket, control), name="kvbuf-listener-setup",
                         daemon=True).start()

    def _set_up(self, store_socket: socket.socket, control: Endpoint) -> None:
        # The consumer dials as soon as it has the reply: kv_timeout, not kv_connect_timeout, bounds the wait.
        config = self.config.replace(kv_rank=0, kv_connect_timeout=self.config.kv_timeout)
        pipe: KVPipeBase | None = None
        try:
            pipe = self._pipe_factory(config, listener=store_socket)
            if pipe.max_tensor_bytes < self._max_item_bytes:  # it said otherwise in its connect request
                raise KVConfigError(
                    f"the consumer's kv_buffer_size is smaller than the producer's ({self.config.kv_buffer_size} "
                    f"bytes): it could not receive every entry; give it at least as much")
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
            self._setup_done()
            return
        with self._lock:
            self._pending -= 1
            self._accepted += 1
            closed = self._closed
            if not closed:
                self._connections.add(connection)
        if closed:
            self._end(connection)
            with self._lock:
                self._totals.add(connection.stats())
            return
        logger.info("lookup buffer: a consumer connected to %s (%d connected)", self.address, self.connections)

    def _setup_done(self) -> None:
        with self._lock:
            self._pending -= 1

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
