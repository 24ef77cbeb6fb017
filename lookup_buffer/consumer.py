"""The consumer side of the lookup buffer: selects go out over ZeroMQ, outcomes come in on the data pipe.

Two threads serve every calling thread, so the consumer holds the same few sockets and descriptors
however many threads call drop_select (and however short-lived they are):

* One ZeroMQ socket (a DEALER) carries the selects. A calling thread stamps its request with the
  producer's session and the next counter, signs it and sends it itself, so that a select costs
  no thread hand-off before it leaves. Requests made before the session is known wait in a queue
  the control thread sends once it is. The control thread also hands each refusal the producer
  sends back to the call it names.
* The reader thread reads the data pipe: the producer's session header first, then outcome after
  outcome (a hit's header and tensors, a miss, a refusal for lack of room, the producer closing),
  each handed to the call of its request id.

A calling thread waits on its own call (an event), at most its wait + ``kv_timeout`` for the
outcome to start, and then as long as the hit's tensors keep arriving. Request ids are random
63-bit numbers: a stray or hostile select cannot guess a live one. A hit is returned only if its
tokens and roi match the query.

A select that may borrow (:mod:`lookup_buffer.loans`) can get lent items: the reader maps the
producer's export through the pipe (once per export) and hands out :class:`BorrowedTensor` objects
over it. Releasing one checks the loan's stamp and has a release sent on the data pipe (by the
control thread: nothing answers it, so the caller need not wait for it). A lent entry that never
reaches its caller (the select gave up, or the entry failed a check) is released at once.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import secrets
import threading
import time

import msgspec
import numpy as np
import torch
import zmq

from kv_pipe import cores
from kv_pipe.base import KVPipeBase
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVConfigError, KVPeerLostError, KVPipeClosedError, KVProtocolError, KVTransferError
from kv_pipe.failure import FailureLatch, fresh_error
from lookup_buffer.base import BufferStats, SelectResult
from lookup_buffer.control import HIGH_WATER_MARK, Endpoint
from lookup_buffer.errors import KVInvalidRequestError
from lookup_buffer.loans import BorrowedTensor, Borrowing
from lookup_buffer.matching import MatchKey, token_arrays
from lookup_buffer.protocol import (
    ITEM_NAMES,
    MAX_REFUSAL_BYTES,
    ControlSigner,
    Outcome,
    OutcomeStatus,
    SelectRequest,
    decode_refusal,
    encode_request,
    make_release,
    parse_header,
    parse_loan_descriptor,
    select_request,
)

logger = logging.getLogger(__name__)

#: The control thread's longest sleep: it is woken by its doorbell and its socket, this only bounds
#: how long a lost wake-up could go unnoticed.
_MAX_POLL_MS = 1000


class _Call:
    """One drop_select in flight. The reader thread sets ``announced`` when the call's hit header
    arrives, then ``items`` (a hit's) and ``outcome``; the control thread sets ``error`` when the
    request was refused or could not be sent. Either one then sets ``done``."""

    __slots__ = ("request_id", "request", "done", "announced", "items", "outcome", "error", "borrow")

    def __init__(self, request_id: int, borrow: bool = False) -> None:
        self.request_id = request_id
        self.borrow = borrow
        self.request: SelectRequest | None = None  # from the calling thread until the control thread sends it
        self.done = threading.Event()
        self.announced = False
        self.items: tuple[torch.Tensor | BorrowedTensor | None, ...] = ()
        self.outcome: Outcome | None = None
        self.error: KVTransferError | None = None


class BufferConsumer:
    """Serves a :class:`lookup_buffer.SimpleBuffer` with ``kv_role='kv_consumer'``."""

    def __init__(self, pipe: KVPipeBase, config: KVTransferConfig, address: str) -> None:
        self._pipe = pipe
        self._config = config
        self._address = address
        self._signer = ControlSigner(config.kv_secret)
        self._lock = threading.Lock()  # guards everything below but the control thread's own state
        self._calls: dict[int, _Call] = {}
        self._failure = FailureLatch()
        self._received_tensors = 0  # the data pipe's progress
        self._hits = self._misses = self._waits = self._received_bytes = 0
        self._session: bytes | None = None  # set once by the reader thread

        # Sending a select: the session, the counter of the last select sent, and the selects made
        # before the session arrived (the control thread sends those).
        self._send_lock = threading.Lock()
        self._outbox: collections.deque[_Call] = collections.deque()
        self._counter = 0
        self._releases: collections.deque[int] = collections.deque()  # request ids, for the control thread
        self._release_lock = threading.Lock()
        self._endpoint = Endpoint(zmq.DEALER, address, MAX_REFUSAL_BYTES, bind=False)
        self._control = cores.thread(self._run_control, "kvbuf-consumer-control")
        self._reader = cores.thread(self._read_pipe, "kvbuf-consumer-reader")
        self._control.start()
        self._reader.start()
        logger.info("lookup buffer consumer selecting from %s", address)

    # ------------------------------------------------------------------ caller API

    def drop_select(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        wait: float,
        borrow: bool = False,
        part: tuple[int, int, int] | None = None,
        span: tuple[int, int, int] | None = None,
    ) -> SelectResult:
        tokens, roi_array = token_arrays(input_tokens, roi)
        try:
            # A copy of the tokens (the caller's tensors are theirs again once this call returns), and
            # the part and span checked before anything is sent.
            request = select_request(0, tokens, roi_array, 0, part=part, span=span)
        except ValueError as exc:
            raise KVInvalidRequestError(f"drop_select: {exc}") from None
        wait_ms = math.ceil(wait * 1000)
        with self._lock:
            self._raise_if_stopped()
            request_id = secrets.randbits(63)
            while request_id in self._calls:
                request_id = secrets.randbits(63)
            call = self._calls[request_id] = _Call(request_id, borrow)
        returned = False
        try:
            call.request = msgspec.structs.replace(request, request_id=request_id, wait_ms=wait_ms, borrow=borrow)
            with self._send_lock:
                if self._session is None:
                    self._outbox.append(call)
                else:
                    self._send(call)
            query = MatchKey(tokens, roi_array)  # needed only to check a hit: built while the request travels
            self._await(call, wait_ms / 1000 + self._config.kv_timeout)
            result = self._conclude(call, query)
            returned = True
            return result
        finally:
            call.request = None  # if still unsent (no session yet), the control thread drops it
            with self._lock:  # the reader hands items over under the lock: either it or this sees them
                del self._calls[call.request_id]
            if not returned:
                self._give_back(call.items)

    def _forget(self, request_id: int) -> None:
        """Have the release of the entry lent to select ``request_id`` sent (by the control thread:
        nothing answers a release, so no caller waits for it to go out)."""
        self._releases.append(request_id)
        self._endpoint.doorbell.ring()

    def _send_releases(self) -> None:
        """Send the releases queued so far (control thread, and close before the pipe closes). One
        caller at a time: close's call returns only once a release the control thread took out of
        the queue has gone out as well, so none is sent into a closing pipe."""
        with self._release_lock:
            while self._releases:
                request_id = self._releases.popleft()
                try:
                    self._pipe.send_tensor(torch.from_numpy(make_release(request_id)), timeout=self._config.kv_timeout)
                except KVTransferError as exc:  # the producer takes it back after its kv_timeout anyway
                    logger.warning("lookup buffer: could not release the entry lent to request %d: %s", request_id, exc)

    def _give_back(self, items: tuple[object, ...]) -> None:
        """Release, without waiting, a lent entry that its caller never got."""
        borrowed = next((item for item in items if isinstance(item, BorrowedTensor)), None)
        if borrowed is not None:
            borrowed.borrowing.forget()

    @property
    def failure(self) -> KVTransferError | None:
        with self._lock:
            return self._failure.reason("the lookup buffer was closed")

    def stats(self) -> BufferStats:
        with self._lock:
            return BufferStats(
                role="kv_consumer",
                capacity_bytes=self._config.kv_buffer_size,
                hits=self._hits,
                misses=self._misses,
                waits=self._waits,
                pending=len(self._calls),
                transferred_bytes=self._received_bytes,
            )

    def close(self) -> None:
        with self._lock:
            if not self._failure.close():
                return
            calls = list(self._calls.values())
        for call in calls:
            call.done.set()  # each raises KVPipeClosedError unless its outcome is in
        self._endpoint.doorbell.ring()  # the control thread stops
        self._send_releases()  # the producer's loans end returned, not dropped with the pipe
        pipe_error = None
        try:
            self._pipe.close()  # ends the reader's recv_tensor
        except KVTransferError as exc:
            pipe_error = exc
        bound = self._config.kv_timeout
        self._control.join(bound)
        self._reader.join(bound)
        if self._control.is_alive():
            logger.error("lookup buffer control thread did not stop within %.1f s; its socket stays open", bound)
        else:
            self._endpoint.close()
        if self._reader.is_alive():
            logger.error("lookup buffer pipe reader did not stop within %.1f s after the pipe closed", bound)
        with self._lock:
            failure = self._failure.unreported()
        if pipe_error is not None:
            raise pipe_error
        if failure is not None and not isinstance(failure, KVPipeClosedError):
            raise fresh_error(failure)

    # ------------------------------------------------------------------ calling threads

    def _await(self, call: _Call, bound: float) -> None:
        """Wait until ``call`` is done.

        Raises KVPeerLostError if within ``bound`` no outcome started, or if the tensors of an
        announced hit stop arriving for ``2 * kv_timeout``.
        """
        deadline = time.monotonic() + bound
        pipe_progress = -1
        while not call.done.wait(max(0.0, deadline - time.monotonic())):
            if not call.announced:
                unstarted = (
                    ""
                    if self._session is not None
                    else ("; its session header never came on the data pipe: is its lookup buffer running?")
                )
                raise KVPeerLostError(
                    f"lookup buffer: the producer at {self._address} did not answer a select within "
                    f"{bound:g} s (its wait + kv_timeout){unstarted}"
                )
            # A hit larger than the bound is still on its way: wait while the pipe makes progress.
            stall = 2 * self._config.kv_timeout
            with self._lock:
                if self._received_tensors == pipe_progress:
                    raise KVPeerLostError(
                        f"lookup buffer: the producer announced a hit but nothing arrived on the data pipe "
                        f"for {stall:g} s"
                    )
                pipe_progress = self._received_tensors
            deadline = time.monotonic() + stall

    def _conclude(self, call: _Call, query: MatchKey) -> SelectResult:
        """The result of a call that is done: its outcome, or the error that ended it."""
        outcome = call.outcome
        if outcome is None:
            if call.error is not None:
                raise call.error
            with self._lock:
                self._raise_if_stopped()
            raise AssertionError("a drop_select call ended with neither an outcome nor an error")
        if outcome.status is OutcomeStatus.MISS:
            with self._lock:
                self._misses += 1
                self._waits += outcome.waited
            return [None] * len(ITEM_NAMES)
        if outcome.status is OutcomeStatus.CLOSED:
            raise KVPipeClosedError("lookup buffer: the producer closed the lookup buffer")
        if outcome.status is OutcomeStatus.BUSY:
            raise KVProtocolError("lookup buffer: the producer refused the select: too many selects were waiting")
        if outcome.match_key != query:  # routing must never hand out another request's KV
            raise KVProtocolError("lookup buffer: the producer sent an entry that does not match the query")
        items = call.items
        with self._lock:
            self._hits += 1
            self._waits += outcome.waited
            self._received_bytes += sum(item.nbytes for item in items if item is not None)
        return list(items)

    def _raise_if_stopped(self) -> None:
        """Raise the failure or the closed state (hold ``_lock``)."""
        self._failure.raise_if_unusable("lookup buffer closed (drop_select woken or called after close)")

    def _fail(self, error: KVTransferError) -> None:
        """The buffer cannot serve selects any more: wake every call, refuse new ones."""
        with self._lock:
            if not self._failure.fail(error):
                return  # a closing pipe ends the reader: not a failure
            calls = list(self._calls.values())
        if isinstance(error, KVPipeClosedError):
            logger.info("lookup buffer: the producer closed its side (%s)", error)
        else:
            logger.error("lookup buffer consumer stops: %s", error)
        for call in calls:
            call.done.set()

    # ------------------------------------------------------------------ control thread

    def _run_control(self) -> None:
        try:
            while not self._failure.closed:
                self._endpoint.wait(_MAX_POLL_MS)
                self._send_queued()
                self._take_refusals()
                self._send_releases()
        except Exception as exc:  # a bug; fail loudly rather than leave calls waiting
            logger.exception("lookup buffer control thread failed")
            self._fail(KVTransferError(f"lookup buffer: the control thread failed: {exc!r}"))

    def _send_queued(self) -> None:
        with self._send_lock:
            if self._session is None:
                return  # the reader rings the doorbell once the session has arrived
            while self._outbox:
                self._send(self._outbox.popleft())

    def _send(self, call: _Call) -> None:
        """Stamp, sign and send ``call``'s select (hold ``_send_lock``: counters go out in order)."""
        request, call.request = call.request, None
        if request is None or call.done.is_set():
            return  # the select gave up, or the buffer stopped, meanwhile
        self._counter += 1
        stamped = msgspec.structs.replace(request, session=self._session, counter=self._counter)
        try:
            self._endpoint.send([encode_request(self._signer, stamped)])
        except zmq.Again:
            call.error = KVPeerLostError(
                f"lookup buffer: {HIGH_WATER_MARK} selects queued unsent to {self._address}; "
                f"the producer is unreachable"
            )
            call.done.set()
        except zmq.ZMQError as exc:  # closed meanwhile
            call.error = KVPipeClosedError(f"lookup buffer: the select could not be sent: {exc}")
            call.done.set()

    def _take_refusals(self) -> None:
        for frames in self._endpoint.received(HIGH_WATER_MARK):
            try:
                if len(frames) != 1:
                    raise KVProtocolError(f"the producer sent a refusal of {len(frames)} frames")
                refusal = decode_refusal(self._signer, frames[0])
            except KVProtocolError as exc:
                # Only the producer's address reaches this socket: it speaks another protocol version
                # or holds another kv_secret, and will refuse every select.
                self._fail(
                    KVProtocolError(f"lookup buffer: unreadable answer from the producer at {self._address}: {exc}")
                )
                return
            with self._lock:
                call = self._calls.get(refusal.request_id)
            if call is None:
                logger.warning(
                    "lookup buffer: refusal for no select in flight (request %d, %s): %s",
                    refusal.request_id,
                    refusal.reason,
                    refusal.message,
                )
                continue
            call.error = KVProtocolError(
                f"lookup buffer: the producer refused the select ({refusal.reason}): {refusal.message}"
            )
            call.done.set()

    # ------------------------------------------------------------------ reader thread

    def _read_pipe(self) -> None:
        # Bounded by the pipe's liveness check (a dead producer fails it within kv_timeout) and by
        # close(), which closes the pipe.
        try:
            first = parse_header(self._next_tensor())
            if first.status is not OutcomeStatus.SESSION:
                raise KVProtocolError(
                    f"lookup buffer: the producer's first header is a {first.status.name}, not its session"
                )
            with self._send_lock:
                self._session = first.session
            self._endpoint.doorbell.ring()  # the control thread sends what was queued meanwhile
            while True:
                self._route_one(self._next_tensor())
        except KVTransferError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug; fail loudly rather than leave calls waiting
            logger.exception("lookup buffer pipe reader failed")
            self._fail(KVTransferError(f"lookup buffer: reading the data pipe failed: {exc!r}"))

    def _route_one(self, header: torch.Tensor) -> None:
        """Hand the outcome that ``header`` starts (reading a hit's tensors) to its call.

        A function of its own so that no reference to the tensors outlives it: the pipe may recycle
        a receive buffer once its tensor is gone.
        """
        outcome = parse_header(header)
        if outcome.status is OutcomeStatus.SESSION:
            raise KVProtocolError("lookup buffer: the producer sent a second session header")
        hit = outcome.status is OutcomeStatus.HIT
        with self._lock:
            call = self._calls.get(outcome.request_id)
            if call is not None and hit:
                call.announced = True
        items: tuple[torch.Tensor | BorrowedTensor | None, ...] = ()
        if hit:  # key, then value and hidden if present, in the order they were sent
            present = (True, outcome.has_value, outcome.has_hidden)
            received = [self._next_tensor() if here else None for here in present]
            borrowed = self._borrowed(
                outcome.request_id, [item for item, lent in zip(received, outcome.lent, strict=True) if lent]
            )
            items = (
                outcome.input_tokens,
                outcome.roi,
                *(borrowed.pop(0) if lent else item for item, lent in zip(received, outcome.lent, strict=True)),
            )
            if any(outcome.lent) and (call is None or not call.borrow):
                self._give_back(items)
                if call is not None:
                    raise KVProtocolError("lookup buffer: the producer lent an entry to a select that did not borrow")
        with self._lock:  # drop_select forgets its call under the lock: either it or this sees the items
            handed = call is not None and self._calls.get(outcome.request_id) is call
            if handed:
                call.items = items
                call.outcome = outcome  # before done: the woken thread reads it
        if not handed:
            if hit:
                self._give_back(items)
                logger.warning(
                    "lookup buffer: dropped the entry sent for request %d: its drop_select gave up", outcome.request_id
                )
            return
        call.done.set()
        # Let the woken thread run now rather than when this one next blocks in the pipe: a small
        # select's latency is mostly such thread hand-overs.
        time.sleep(0)

    def _borrowed(self, request_id: int, descriptors: list[torch.Tensor]) -> list[BorrowedTensor]:
        """The lent tensors the loan descriptors of one entry describe, over this side's mappings of
        the producer's exports; they share one :class:`Borrowing`, checked by the first one's stamp."""
        borrowing = None
        borrowed = []
        for descriptor in descriptors:
            loan = parse_loan_descriptor(descriptor)
            try:
                memories = [self._pipe.map_peer_memory(export) for export in loan.exports]
            except KVConfigError as exc:  # the producer lends only over a same-host pipe
                raise KVProtocolError(
                    f"lookup buffer: the producer lent an entry over a pipe that cannot map it: {exc}"
                ) from exc
            if borrowing is None:
                index, offset, stamp = loan.stamp
                borrowing = Borrowing(
                    memories[index].address_of(offset, 8),
                    stamp,
                    functools.partial(self._forget, request_id),
                    memories[index],
                )
            # Each piece was checked against its export's size, which its mapping has.
            bases = np.array([memory.address for memory in memories], dtype=np.int64)
            pieces = (
                np.stack([bases[loan.pieces[:, 0]] + loan.pieces[:, 1], loan.pieces[:, 2]], axis=1)
                if len(loan.pieces)
                else np.zeros((0, 2), dtype=np.int64)
            )
            borrowed.append(BorrowedTensor(loan.shape, loan.dtype, pieces, memories, borrowing))
        return borrowed

    def _next_tensor(self) -> torch.Tensor:
        item = self._pipe.recv_tensor()
        with self._lock:
            self._received_tensors += 1
        if item is None:
            raise KVProtocolError("lookup buffer: the producer sent None on the data pipe; outcomes carry only tensors")
        return item
