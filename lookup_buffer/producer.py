"""The producer side of the lookup buffer: the entry store and the control server that serves selects.

At start the producer sends its session header on the data pipe (a random nonce of this buffer's
lifetime) and accepts only selects that carry that session and a counter above the last one it
accepted: a select captured on the network cannot be replayed, neither to this producer nor to a
later one.

One server thread owns the ROUTER socket and every parked select; it sleeps in a zmq poll that
wakes on a control message, on an insert (a doorbell), or at the next select's deadline, so a
select is answered as soon as its entry is inserted, without polling on a timer. It answers every
accepted select on the data pipe. A second thread blocks in ``recv_tensor`` on the data pipe, where
the consumer sends nothing but releases of lent entries (:mod:`lookup_buffer.loans`): it ends each
such loan, and otherwise that call returns only when the consumer died or closed, which then
surfaces in ``insert`` and ``close``. Loans lent out are kept until their consumer releases them; the
server takes back any not released within ``kv_timeout``, and all end when the consumer is lost.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch
import zmq

from kv_pipe import auth, cores
from kv_pipe.base import KVPipeBase
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVPipeClosedError, KVTransferError
from kv_pipe.failure import FailureLatch, fresh_error
from lookup_buffer.base import BufferStats
from lookup_buffer.config import BufferConfig
from lookup_buffer.control import Endpoint
from lookup_buffer.errors import KVInvalidRequestError
from lookup_buffer.loans import DROPPED, RECLAIMED, RETURNED, SENT, LentTensor, Loan, loan_table
from lookup_buffer.matching import MatchKey, token_arrays
from lookup_buffer.protocol import (
    MAX_REQUEST_BYTES,
    ControlSigner,
    MessageError,
    OutcomeStatus,
    Reason,
    SelectRequest,
    decode_request,
    encode_refusal,
    make_header,
    make_loan_descriptor,
    make_outcome,
    make_session,
    only_frame,
    parse_release,
    stamp_header,
)
from lookup_buffer.store import Entry, EntryStore, Part

logger = logging.getLogger(__name__)

#: Most selects parked at once, and most bytes of match keys they hold; more are refused, so that
#: hostile requests cannot take unbounded memory.
MAX_WAITING_SELECTS = 10_000
MAX_WAITING_KEY_BYTES = 256 << 20
_MESSAGES_PER_ROUND = 256  # then expire and match before reading more: a flood cannot starve them
_MAX_POLL_MS = 1000
_LOGGED_REFUSALS = 20


def log_expired(entries: int, nbytes: int) -> None:
    if entries:
        logger.warning(
            "lookup buffer: %d entries (%d bytes) that no consumer selected within kv_entry_timeout were dropped",
            entries,
            nbytes,
        )


@dataclasses.dataclass(eq=False)
class _Waiter:
    """A select parked until its entry is inserted or its deadline passes."""

    identity: bytes
    request_id: int
    key: MatchKey
    deadline: float
    borrow: bool = False
    waited: bool = False
    done: bool = False
    part: Part | None = None  # the part of the entry it takes (None: all of it)
    span: Part | None = None  # the span of that it takes, the rest dropped (None: all of it)


Item = torch.Tensor | LentTensor


def make_entry(
    input_tokens: torch.Tensor, roi: torch.Tensor, key: Item, value: Item | None, hidden: Item | None
) -> tuple[MatchKey, Entry]:
    """Check an insert's arguments (KVInvalidRequestError) and build its entry and match key.

    Lent items are charged like copied ones: the budget bounds the bytes of entries waiting for a
    consumer, wherever they lie.
    """
    tokens, roi_array = token_arrays(input_tokens, roi)
    for name, item in (("key", key), ("value", value), ("hidden", hidden)):
        if not isinstance(item, (torch.Tensor, LentTensor)) and (item is not None or name == "key"):
            kinds = "a tensor or a LentTensor" + ("" if name == "key" else " or None")
            raise KVInvalidRequestError(f"{name} must be {kinds}, got {type(item).__name__}")
    header = make_header(tokens, roi_array, input_tokens.dtype, value is not None, hidden is not None)
    given = (input_tokens, roi, key, value, hidden)
    lent = any(isinstance(item, LentTensor) for item in (key, value, hidden))
    entry = Entry(
        (torch.from_numpy(header), *(item for item in (key, value, hidden) if item is not None)),
        nbytes=sum(item.nbytes for item in given if item is not None),
        loan=Loan() if lent else None,
        lent=(isinstance(key, LentTensor), isinstance(value, LentTensor), isinstance(hidden, LentTensor)),
        tracked=not lent,  # a lent entry's departure is its loan's outcome
    )
    return MatchKey(tokens, roi_array), entry


class BufferProducer:
    """Serves a :class:`lookup_buffer.SimpleBuffer` with ``kv_role='kv_producer'``, or one consumer's
    connection of a :class:`lookup_buffer.BufferListener`.

    Args:
        address: where to bind the control channel, or an endpoint already bound (a ROUTER).
        store: the entries to serve, shared with other connections; the connection then neither
            expires nor drops them (their owner does), and a failure of this connection leaves
            them to the others. Without it the producer has a store of its own, kept as
            ``buffer_config`` says (default: :class:`~lookup_buffer.config.BufferConfig`'s defaults).
    """

    def __init__(
        self,
        pipe: KVPipeBase,
        config: KVTransferConfig,
        address: str | Endpoint,
        store: EntryStore | None = None,
        buffer_config: BufferConfig | None = None,
    ) -> None:
        self._pipe = pipe
        self._config = config
        self._owns_store = store is None
        # An entry whose tensors the pipe would refuse is refused at insert, not halfway through a hit.
        if store is None:
            kept = buffer_config or BufferConfig()
            store = EntryStore(
                config.kv_buffer_size, pipe.max_tensor_bytes, kept.kv_entry_timeout, kept.kv_evict_unclaimed
            )
        self._store = store
        self._lock = threading.Lock()  # guards the counters and the failure state below
        self._hits = self._misses = self._waits = self._bad_messages = self._sent_bytes = 0
        self._failure = FailureLatch()

        # Owned by the server thread.
        self._waiters: dict[MatchKey, collections.deque[_Waiter]] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._waiting = 0
        self._waiting_key_bytes = 0
        self._sequence = itertools.count()
        # Loans lent out to this consumer, by select, with when they are reclaimed: until released or
        # reclaimed (under _lock: the watcher ends them too). Their owner may end them first.
        self._lent_out: dict[int, tuple[Loan, float]] = {}

        self._signer = ControlSigner(config.kv_secret)
        self._session = auth.new_nonce()
        self._last_counter = 0  # of the last select accepted (server thread)
        self._inserted: collections.deque[MatchKey] = collections.deque()  # insert() -> server thread
        # Keys of entries that left the store unselected (any thread) -> server thread.
        self._removed: collections.deque[MatchKey] = collections.deque()
        self._stopping = threading.Event()
        self._endpoint = (
            address if isinstance(address, Endpoint) else Endpoint(zmq.ROUTER, address, MAX_REQUEST_BYTES, bind=True)
        )
        self.address = self._endpoint.address
        try:
            # Before any select can be answered: the consumer reads the session first.
            pipe.send_tensor(torch.from_numpy(make_session(self._session)), timeout=config.kv_timeout)
        except BaseException:
            self._endpoint.close()
            raise
        self._server = cores.thread(self._serve, "kvbuf-producer-server")
        self._watcher = cores.thread(self._watch_consumer, "kvbuf-producer-watch")
        self._store.watch(self._on_removed)
        self._server.start()
        self._watcher.start()
        logger.info("lookup buffer producer serving selects on %s (%d bytes)", self.address, config.kv_buffer_size)

    # ------------------------------------------------------------------ caller API

    def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        key: Item,
        value: Item | None,
        hidden: Item | None,
        timeout: float,
    ) -> Loan | None:
        match_key, entry = make_entry(input_tokens, roi, key, value, hidden)
        self._raise_if_unusable()
        self._store.put(match_key, entry, timeout)
        self.notify_inserted(match_key)
        return entry.loan

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor in this connection's pipe memory (:meth:`kv_pipe.KVPipeBase.empty`)."""
        return self._pipe.empty(shape, dtype)

    def unlend(self, loan: Loan) -> bool:
        """See :meth:`lookup_buffer.base.KVLookupBufferBase.unlend` (the copy goes into pipe memory)."""
        match_key = self._store.unlend(loan, self._pipe.empty)
        if match_key is None:
            return False
        self.notify_inserted(match_key)
        return True

    def notify_inserted(self, key: MatchKey) -> None:
        """An entry under ``key`` was stored: serve the selects waiting for it. Any thread."""
        self._inserted.append(key)
        self._endpoint.doorbell.ring()

    def _on_removed(self, key: MatchKey) -> None:
        """An entry under ``key`` left the store unselected (under the store's lock): the selects
        waiting for it miss at once."""
        self._removed.append(key)
        self._endpoint.doorbell.ring()

    @property
    def failure(self) -> KVTransferError | None:
        """Why this producer stopped serving (its consumer died or closed, or it was closed), or None."""
        with self._lock:
            return self._failure.reason("the lookup buffer was closed")

    def stats(self) -> BufferStats:
        store = self._store.counters()
        with self._lock:
            return BufferStats(
                role="kv_producer",
                **dataclasses.asdict(store),  # the store's counters carry BufferStats' names
                hits=self._hits,
                misses=self._misses,
                waits=self._waits,
                pending=self._waiting,
                transferred_bytes=self._sent_bytes,
                bad_messages=self._bad_messages,
            )

    def close(self) -> None:
        with self._lock:
            if not self._failure.close():
                return
        self._stopping.set()
        self._store.unwatch(self._on_removed)
        if self._owns_store:
            entries, nbytes = self._store.stop(KVPipeClosedError("insert on a closed lookup buffer"))
            if entries:
                logger.warning("lookup buffer closed with %d unselected entries (%d bytes): dropped", entries, nbytes)
        self._endpoint.doorbell.ring()
        bound = self._config.kv_timeout
        self._server.join(bound)
        pipe_error = None
        try:
            self._pipe.close()  # also wakes a server blocked in send_tensor, and the watcher
        except KVTransferError as exc:
            pipe_error = exc
        self._server.join(bound)
        self._watcher.join(bound)
        self._end_loans(DROPPED)
        if self._server.is_alive():
            logger.error("lookup buffer server thread did not stop within %.1f s; its socket stays open", 2 * bound)
        else:
            self._endpoint.close()
        if pipe_error is not None:
            raise pipe_error
        with self._lock:
            failure = self._failure.unreported()
        if failure is not None and not isinstance(failure, KVPipeClosedError):
            raise fresh_error(failure)

    # ------------------------------------------------------------------ failure state

    def _raise_if_unusable(self) -> None:
        with self._lock:
            self._failure.raise_if_unusable("insert on a closed lookup buffer")

    def _end_loans(self, outcome: str) -> None:
        """End every loan lent out on this connection."""
        with self._lock:
            lent, self._lent_out = list(self._lent_out.values()), {}
        for loan, _ in lent:
            loan.end(outcome)

    def _fail(self, error: KVTransferError) -> None:
        """The data pipe is unusable: refuse inserts and selects from now on."""
        self._end_loans(DROPPED)  # its consumer can no longer be told that its copy is good
        with self._lock:
            if not self._failure.fail(error):
                return
        if not self._owns_store:
            logger.info("lookup buffer: the connection to a consumer ends (%s); its entries stay for others", error)
            self._endpoint.doorbell.ring()
            return
        entries, nbytes = self._store.stop(error)
        # The consumer closing its side is orderly; anything else is a failure.
        level = logging.INFO if isinstance(error, KVPipeClosedError) and not entries else logging.ERROR
        logger.log(
            level, "lookup buffer producer stops (%s); %d unselected entries (%d bytes) dropped", error, entries, nbytes
        )
        self._endpoint.doorbell.ring()

    def _watch_consumer(self) -> None:
        # Bounded by the pipe's liveness check (a dead consumer fails it within kv_timeout) and by close().
        try:
            while True:
                self._on_release(parse_release(self._pipe.recv_tensor()))
        except KVTransferError as exc:
            if not self._stopping.is_set():
                self._fail(exc)

    # ------------------------------------------------------------------ server thread

    def _serve(self) -> None:
        try:
            while not self._stopping.is_set():
                self._endpoint.wait(self._poll_timeout_ms())
                self._receive_requests()
                self._match_inserted()
                self._miss_removed()
                self._expire(time.monotonic())
                if self._owns_store:
                    log_expired(*self._store.expire())
                if self._failure.error is not None:
                    self._refuse_all(f"the producer's data pipe failed: {self._failure.error}")
        except Exception as exc:  # a bug; answer everyone rather than leave them waiting
            logger.exception("lookup buffer server thread failed")
            self._fail(KVTransferError(f"lookup buffer server thread failed: {exc!r}"))
            self._refuse_all(f"the producer's server failed: {exc!r}")
        else:
            for waiter in self._take_all_waiters():
                self._answer(waiter, OutcomeStatus.CLOSED, "the producer closed the lookup buffer")

    def _poll_timeout_ms(self) -> int:
        if not self._deadlines:
            return _MAX_POLL_MS
        remaining = self._deadlines[0][0] - time.monotonic()
        return min(_MAX_POLL_MS, max(0, math.ceil(remaining * 1000)))

    def _receive_requests(self) -> None:
        for identity, frames in self._endpoint.routed(_MESSAGES_PER_ROUND):
            try:
                request, tokens, roi = decode_request(self._signer, only_frame(frames))
                self._check_fresh(request)
            except MessageError as exc:
                with self._lock:
                    self._bad_messages += 1
                    refused = self._bad_messages
                if refused <= _LOGGED_REFUSALS or refused % 1000 == 0:  # a flood must not flood the log
                    logger.warning(
                        "lookup buffer: refused a control message from %s (%d so far): %s",
                        identity[:16].hex(),
                        refused,
                        exc,
                    )
                self._refuse(identity, exc.request_id, exc.reason, str(exc))
                continue
            waiter = _Waiter(
                identity,
                request.request_id,
                MatchKey(tokens, roi),
                time.monotonic() + request.wait_ms / 1000,
                borrow=request.borrow,
                part=request.part,
                span=request.span,
            )
            self._on_select(waiter, request.wait_ms)

    def _check_fresh(self, request: SelectRequest) -> None:
        """Accept ``request`` only once and only in this producer's session (consumes its counter)."""
        if request.session != self._session:
            raise MessageError(
                "select request of a foreign session: captured from an earlier producer, or forged; refused",
                "stale",
                request.request_id,
            )
        if request.counter <= self._last_counter:
            raise MessageError(
                f"select request counter {request.counter} is not above the last accepted "
                f"({self._last_counter}): replay refused",
                "stale",
                request.request_id,
            )
        self._last_counter = request.counter

    def _on_select(self, waiter: _Waiter, wait_ms: int) -> None:
        if self._failure.error is not None:
            message = f"the producer's data pipe failed: {self._failure.error}"
            self._refuse(waiter.identity, waiter.request_id, "failed", message)
            return
        key = waiter.key
        if self._waiting >= MAX_WAITING_SELECTS or self._waiting_key_bytes + len(key.canonical) > MAX_WAITING_KEY_BYTES:
            self._answer(waiter, OutcomeStatus.BUSY, f"too many selects waiting ({self._waiting})")
            return
        self._waiters.setdefault(key, collections.deque()).append(waiter)  # behind earlier waiters: FIFO
        self._waiting += 1
        self._waiting_key_bytes += len(key.canonical)
        self._match(key)
        self._miss_if_gone(key)
        if not waiter.done:  # a wait of 0 expires in this round: an immediate miss
            heapq.heappush(self._deadlines, (waiter.deadline, next(self._sequence), waiter))
            if wait_ms > 0:
                waiter.waited = True
                with self._lock:
                    self._waits += 1

    def _match_inserted(self) -> None:
        while self._inserted:
            key = self._inserted.popleft()
            if key in self._waiters:
                self._match(key)

    def _miss_removed(self) -> None:
        while self._removed:
            self._miss_if_gone(self._removed.popleft())

    def _miss_if_gone(self, key: MatchKey) -> None:
        """Answer a miss to every select still waiting for ``key`` if an entry under it left the store
        unselected just now (:meth:`EntryStore.gone`): it would not come back within their wait, and
        each would hold its consumer (a load thread) for all of it."""
        if key not in self._waiters or not self._store.gone(key):
            return
        for waiter in self._waiters.pop(key):
            self._unpark(waiter)
            with self._lock:
                self._misses += 1
            self._answer(waiter, OutcomeStatus.MISS)

    def _match(self, key: MatchKey) -> None:
        """Serve the waiters of ``key`` in order while entries for it are stored: a select of the whole
        entry takes a whole one, a select of a part takes that part (splitting a whole entry if
        need be), each only its span if it names one; one that finds nothing leaves the next ones
        their chance."""
        queue = self._waiters[key]
        unserved: collections.deque[_Waiter] = collections.deque()
        whole_left = True  # until a whole select finds none, none will
        while queue and self._failure.error is None:
            waiter = queue[0]
            try:
                if waiter.part is None:
                    entry = self._store.pop(key, waiter.span) if whole_left else None
                    whole_left = entry is not None
                else:
                    entry = self._store.pop_part(key, waiter.part, waiter.span)
            except KVInvalidRequestError as exc:  # the entry cannot be divided or narrowed as that select asks
                queue.popleft()
                self._unpark(waiter)
                self._refuse(waiter.identity, waiter.request_id, "config", str(exc))
                continue
            unserved.append(queue.popleft())
            if entry is not None:
                self._unpark(unserved.pop())
                self._send_hit(waiter, entry)
        queue.extendleft(reversed(unserved))
        if not queue:
            del self._waiters[key]

    def _send_hit(self, waiter: _Waiter, entry: Entry) -> None:
        header, *items = entry.items
        # Lent only to a consumer that asked and can map it; else (or with no slot free) copied.
        lends = entry.loan is not None and waiter.borrow and self._pipe.uses_shared_memory
        taken = loan_table().take() if lends else None
        if entry.loan is not None and not (
            entry.loan.lend_out(taken[0]) if taken is not None else entry.loan.begin_copy()
        ):
            # Its owner took it back between the store and here: the memory is no longer the entry's.
            if taken is not None:
                loan_table().clear(taken[0])
            with self._lock:
                self._misses += 1
            self._answer(waiter, OutcomeStatus.MISS)
            return
        # Counted before the tensors go: the consumer may have them, and its select may have
        # returned, before send_tensors does here; stats on both sides agree once selects return.
        with self._lock:
            self._hits += 1
            self._sent_bytes += entry.nbytes
            if taken is not None:
                self._lent_out[waiter.request_id] = (entry.loan, time.monotonic() + self._config.kv_timeout)
        try:
            if taken is not None:
                items = [
                    torch.from_numpy(_loan_descriptor(item, *taken)) if isinstance(item, LentTensor) else item
                    for item in items
                ]
            elif entry.loan is not None:  # a consumer that cannot borrow gets a copy, made now
                items = [item.materialize(self._pipe.empty) if isinstance(item, LentTensor) else item for item in items]
                if not entry.loan.end(SENT):  # taken back during the copy: its bytes may have changed
                    with self._lock:
                        self._hits -= 1
                        self._sent_bytes -= entry.nbytes
                        self._misses += 1
                    self._answer(waiter, OutcomeStatus.MISS)
                    return
            # A part of a copied entry (a strided view of it) goes straight into pipe memory: one copy.
            items = [
                self._pipe.empty(item.shape, item.dtype).copy_(item)
                if isinstance(item, torch.Tensor) and not item.is_contiguous()
                else item
                for item in items
            ]
            # timeout None: wait for pipe credit as long as the consumer is alive; a partial hit
            # would leave the stream out of step.
            stamp_header(
                header.numpy(), waiter.request_id, waiter.waited, entry.lent if taken is not None else (False,) * 3
            )
            # One unit: the small header shares a frame with the key's and value's records instead of
            # costing a message of its own before them.
            self._pipe.send_tensors([header, *items])
        except KVTransferError as exc:
            with self._lock:
                self._hits -= 1
                self._sent_bytes -= entry.nbytes
            if taken is not None:
                with self._lock:
                    self._lent_out.pop(waiter.request_id, None)
            if entry.loan is not None:
                entry.loan.end(DROPPED)
            self._fail(exc)
            message = f"the producer could not send the entry on the data pipe: {exc}"
            self._refuse(waiter.identity, waiter.request_id, "failed", message)

    def _on_release(self, request_id: int) -> None:
        """The consumer copied the entry lent to select ``request_id`` (watcher thread): end the loan.
        One taken back already is not there any more: the consumer saw that by its stamp."""
        with self._lock:
            lent = self._lent_out.pop(request_id, None)
        if lent is not None:
            lent[0].end(RETURNED)

    def _reclaim(self, now: float) -> None:
        """Take back the loans their consumer did not release within kv_timeout."""
        with self._lock:
            overdue = [request_id for request_id, (_, deadline) in self._lent_out.items() if deadline <= now]
            loans = [self._lent_out.pop(request_id) for request_id in overdue]
        for loan, _ in loans:
            loan.end(RECLAIMED)
        if loans:
            logger.warning(
                "lookup buffer: %d lent entries not released within kv_timeout (%g s) were taken back; "
                "their borrower finds them taken back when it releases them",
                len(loans),
                self._config.kv_timeout,
            )

    def _expire(self, now: float) -> None:
        self._reclaim(now)
        while self._deadlines and self._deadlines[0][0] <= now:
            waiter = heapq.heappop(self._deadlines)[2]
            if waiter.done:
                continue
            queue = self._waiters[waiter.key]
            queue.remove(waiter)
            if not queue:
                del self._waiters[waiter.key]
            self._unpark(waiter)
            with self._lock:
                self._misses += 1
            self._answer(waiter, OutcomeStatus.MISS)
        if len(self._deadlines) > 2 * self._waiting + 1024:  # served waiters linger in the heap
            self._deadlines = [item for item in self._deadlines if not item[2].done]
            heapq.heapify(self._deadlines)

    def _take_all_waiters(self) -> list[_Waiter]:
        """Unpark every waiter (to answer them all at once)."""
        waiters = [waiter for queue in self._waiters.values() for waiter in queue]
        for waiter in waiters:
            waiter.done = True
        self._waiters.clear()
        self._deadlines.clear()
        self._waiting = self._waiting_key_bytes = 0
        return waiters

    def _refuse_all(self, message: str) -> None:
        for waiter in self._take_all_waiters():
            self._refuse(waiter.identity, waiter.request_id, "failed", message)

    def _unpark(self, waiter: _Waiter) -> None:
        """Account for a waiter taken out of ``_waiters``."""
        waiter.done = True
        self._waiting -= 1
        self._waiting_key_bytes -= len(waiter.key.canonical)

    def _answer(self, waiter: _Waiter, outcome: OutcomeStatus, message: str = "") -> None:
        """Answer a select that did not hit, on the data pipe; with a refusal if the pipe is broken
        (``message`` says what the outcome was)."""
        if self._failure.error is None:
            try:
                # Waits for pipe credit as long as the consumer is alive, like a hit.
                self._pipe.send_tensor(torch.from_numpy(make_outcome(waiter.request_id, outcome, waiter.waited)))
                return
            except KVTransferError as exc:
                self._fail(exc)
        self._refuse(
            waiter.identity,
            waiter.request_id,
            "failed",
            f"{message or outcome.name.lower()}; the producer's data pipe failed: {self._failure.error}",
        )

    def _refuse(self, identity: bytes, request_id: int, reason: Reason, message: str) -> None:
        try:
            # A ROUTER drops (never blocks on) messages to unknown or saturated peers.
            frame = encode_refusal(self._signer, request_id, reason, message)
            self._endpoint.send([identity, frame])
        except zmq.ZMQError as exc:
            logger.debug("lookup buffer: refusal to %s dropped: %s", identity.hex(), exc)


def _loan_descriptor(item: LentTensor, slot: int, stamp: int) -> np.ndarray:
    """The descriptor of a lent item, with the loan's stamp word (the table's export comes last)."""
    table = loan_table()
    exports = [export.descriptor for export in item.exports] + [table.export.descriptor]
    return make_loan_descriptor(
        exports,
        item.shape,
        item.dtype,
        item.places,
        item.pieces[:, 1],
        (len(exports) - 1, slot * table.words.element_size(), stamp),
    )
