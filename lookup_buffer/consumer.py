"""The consumer side of the lookup buffer: selects over ZeroMQ, outcomes read off the data pipe.

Each calling thread has its own DEALER socket (zmq sockets are not thread-safe) and its own doorbell.
Every select asks for its outcome on the data pipe (``answer_on_pipe``): a hit's header and
tensors, or the header of a miss, a refusal or the producer closing. The calling threads read the
data pipe themselves, one at a time: the *leader* reads outcome after outcome and routes each by its
request id, to itself or to the waiting call of that id, whose doorbell it rings; so concurrent
selects never get each other's tensors, and a lone caller reads its own hit with no hand-over from
another thread (a reader thread ringing the caller cost a 16 MiB select ~6% of the raw transfer:
README, performance). A leader whose select is answered passes the role to another waiting call.
The others wait in one poll for the first of: their outcome, the role passed to them, a control
reply (a refusal that could not go on the pipe), or the buffer stopping.
Request ids are random 63-bit numbers: a stray or hostile select cannot guess a live one.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time

import torch
import zmq

from kv_pipe.base import KVPipeBase
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVPeerLostError, KVPipeClosedError, KVProtocolError, KVTimeoutError, KVTransferError
from lookup_buffer.base import BufferStats, SelectResult
from lookup_buffer.control import HIGH_WATER_MARK, Doorbell, open_socket
from lookup_buffer.errors import fresh_error
from lookup_buffer.matching import MatchKey, token_arrays
from lookup_buffer.protocol import (
    ITEM_NAMES,
    MAX_REPLY_BYTES,
    ControlSigner,
    Outcome,
    OutcomeStatus,
    Reply,
    decode_reply,
    encode_request,
    parse_header,
)

logger = logging.getLogger(__name__)

#: Until the producer has answered a select on the data pipe, the leader looks at its control socket
#: this often: a producer that refuses every request (another kv_secret or protocol version) answers
#: only there, and must be heard at once, not after a select's whole wait.
_FIRST_ANSWER_CHECK = 0.05


class _Call:
    """One drop_select in flight: the leader sets ``announced`` when the call's hit header arrives,
    then fills ``items`` (a hit's), sets ``outcome`` and rings ``doorbell`` (unless it is the
    call's own thread)."""

    __slots__ = ("request_id", "doorbell", "announced", "items", "outcome")

    def __init__(self, request_id: int, doorbell: Doorbell) -> None:
        self.request_id = request_id
        self.doorbell = doorbell  # the calling thread's
        self.announced = False
        self.items: tuple[torch.Tensor | None, ...] = ()
        self.outcome: Outcome | None = None


class _ThreadChannel:
    """A calling thread's control socket, its doorbell, and a poller on both and on ``stopped``."""

    def __init__(self, sock: zmq.Socket, stopped: Doorbell) -> None:
        self.sock = sock
        self.doorbell = Doorbell()
        self.poller = zmq.Poller()
        for watched in (sock, self.doorbell.fileno(), stopped.fileno()):
            self.poller.register(watched, zmq.POLLIN)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.doorbell.close()


class BufferConsumer:
    """Serves a :class:`lookup_buffer.SimpleBuffer` with ``kv_role='kv_consumer'``."""

    def __init__(self, pipe: KVPipeBase, config: KVTransferConfig, address: str) -> None:
        self._pipe = pipe
        self._config = config
        self._address = address
        self._context = zmq.Context(io_threads=1)
        self._local = threading.local()
        self._signer = ControlSigner(config.kv_secret)
        self._channels: list[_ThreadChannel] = []
        self._lock = threading.Lock()  # guards everything below
        self._idle = threading.Condition(self._lock)
        self._calls: dict[int, _Call] = {}
        self._leader: _Call | None = None  # the call whose thread reads the data pipe
        self._answered_on_pipe = False  # the producer accepted a select of ours
        self._closed = False
        self._failure: KVTransferError | None = None
        self._failure_reported = False
        self._received_tensors = 0  # the data pipe's progress
        self._hits = self._misses = self._waits = self._received_bytes = 0
        # Rung once and never cleared: wakes every waiting call, now and later.
        self._stopped = Doorbell()
        logger.info("lookup buffer consumer selecting from %s", address)

    # ------------------------------------------------------------------ caller API

    def drop_select(self, input_tokens: torch.Tensor, roi: torch.Tensor, wait: float) -> SelectResult:
        tokens, roi_array = token_arrays(input_tokens, roi)
        wait_ms = math.ceil(wait * 1000)
        channel = self._thread_channel()
        call = self._open_call(channel.doorbell)
        try:
            request = encode_request(self._signer, call.request_id, tokens, roi_array, wait_ms, answer_on_pipe=True)
            try:
                channel.sock.send(request, zmq.NOBLOCK)
            except zmq.Again:
                raise KVPeerLostError(
                    f"lookup buffer: {HIGH_WATER_MARK} selects queued unsent to {self._address}; "
                    f"the producer is unreachable"
                ) from None
            query = MatchKey(tokens, roi_array)  # needed only to check a hit: built while the request travels
            reply = self._await_outcome(channel, call, wait_ms / 1000 + self._config.kv_timeout)
            if reply is None:
                return self._conclude(call, query)
            if reply.status == "miss":  # a producer whose data pipe failed may still say so
                self._count_miss(reply.waited)
                return [None] * len(ITEM_NAMES)
            if reply.status == "closed":
                raise KVPipeClosedError(f"lookup buffer: {reply.message}")
            raise KVProtocolError(f"lookup buffer: the producer refused the select: {reply.message}")
        finally:
            self._close_call(call)

    def _conclude(self, call: _Call, query: MatchKey) -> SelectResult:
        """The result of a select whose outcome came on the data pipe."""
        outcome = call.outcome
        if outcome.status is OutcomeStatus.MISS:
            self._count_miss(outcome.waited)
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

    def _count_miss(self, waited: bool) -> None:
        with self._lock:
            self._misses += 1
            self._waits += waited

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
            if self._closed:
                return
            self._closed = True
            unread = self._leader is None
            if unread:
                self._leader = _Call(-1, self._stopped)  # this thread: no select may start reading now
        self._stopped.ring()  # wakes every waiting call but the leader
        if unread:
            self._take_what_arrived()
        pipe_error = None
        try:
            self._pipe.close()  # ends the leader's recv_tensor
        except KVTransferError as exc:
            pipe_error = exc
        bound = self._config.kv_timeout
        with self._idle:
            self._idle.wait_for(lambda: not self._calls, timeout=bound)
        with self._lock:
            busy = len(self._calls)
            failure = None if self._failure_reported else self._failure
            self._failure_reported = True
        if busy:
            logger.error(
                "lookup buffer: %d drop_select calls did not return within %.1f s; sockets stay open", busy, bound
            )
        else:
            for channel in self._channels:
                channel.close()
            self._context.term()
            self._stopped.close()
        if pipe_error is not None:
            raise pipe_error
        if failure is not None and not isinstance(failure, KVPipeClosedError):
            raise fresh_error(failure)

    def _take_what_arrived(self) -> None:
        """Route what the data pipe holds and record how it ended, if it did: with no select
        running, nobody else would see a producer that died in the meantime (close reports it)."""
        try:
            while True:
                self._route_one(None, self._next_tensor(timeout=0))
        except KVTimeoutError:
            pass  # nothing more arrived: the pipe is fine
        except KVPipeClosedError:
            pass  # the producer closed first: orderly
        except KVTransferError as exc:
            with self._lock:
                if self._failure is None:
                    self._failure = exc

    # ------------------------------------------------------------------ calls

    def _open_call(self, doorbell: Doorbell) -> _Call:
        with self._lock:
            self._raise_if_stopped()
            request_id = secrets.randbits(63)
            while request_id in self._calls:
                request_id = secrets.randbits(63)
            call = self._calls[request_id] = _Call(request_id, doorbell)
            return call

    def _close_call(self, call: _Call) -> None:
        with self._lock:
            del self._calls[call.request_id]
            if self._leader is call or self._leader is None:
                # Someone must read the pipe while calls wait. A successor that leaves before it takes
                # the role passes it on here too.
                self._leader = None
                successor = next(iter(self._calls.values()), None)
                if successor is not None:
                    successor.doorbell.ring()
            if not self._calls:
                self._idle.notify_all()

    def _take_lead(self, call: _Call) -> bool:
        """Whether ``call``'s thread is (now) the one that reads the data pipe."""
        with self._lock:
            self._raise_if_stopped()
            if self._leader is None:
                self._leader = call
            return self._leader is call

    def _raise_if_stopped(self) -> None:
        """Raise the failure or the closed state (hold ``_lock``)."""
        if self._failure is not None:
            self._failure_reported = True
            raise fresh_error(self._failure)
        if self._closed:
            raise KVPipeClosedError("lookup buffer closed (drop_select woken or called after close)")

    def _thread_channel(self) -> _ThreadChannel:
        channel = getattr(self._local, "channel", None)
        if channel is None:
            with self._lock:
                self._raise_if_stopped()  # a closed buffer's context takes no new sockets
                sock = open_socket(self._context, zmq.DEALER, self._address, MAX_REPLY_BYTES, bind=False)
                channel = self._local.channel = _ThreadChannel(sock, self._stopped)
                self._channels.append(channel)  # close() closes it once no call is active
        return channel

    def _await_outcome(self, channel: _ThreadChannel, call: _Call, bound: float) -> Reply | None:
        """The producer's control reply to ``call``, or None once its outcome has come on the data
        pipe (``call.outcome``, and ``call.items`` for a hit).

        Raises KVPeerLostError if within ``bound`` neither a reply nor the outcome's header came,
        or if the tensors of an announced hit stop arriving for ``2 * kv_timeout``; the buffer's
        failure or KVPipeClosedError if it stops.
        """
        deadline = time.monotonic() + bound
        pipe_progress = -1
        while call.outcome is None:
            if self._take_lead(call):
                return self._lead(channel, call, deadline, bound)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if not call.announced:
                    raise KVPeerLostError(
                        f"lookup buffer: the producer at {self._address} did not answer a select within "
                        f"{bound:g} s (its wait + kv_timeout)"
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
                continue
            events = dict(channel.poller.poll(math.ceil(remaining * 1000)))
            if self._stopped.fileno() in events:
                with self._lock:
                    self._raise_if_stopped()
            if channel.doorbell.fileno() in events:
                channel.doorbell.clear()  # before the loop looks at the call: a later ring wakes the next poll
            if channel.sock in events:
                reply = self._reply_for(channel, call)
                if reply is not None:
                    return reply
        return None

    def _reply_for(self, channel: _ThreadChannel, call: _Call) -> Reply | None:
        """The control reply waiting on ``channel`` if it answers ``call``; None if there is none (a
        late reply to an earlier call of this thread is dropped)."""
        try:
            frames = channel.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        if len(frames) != 1:
            raise KVProtocolError(f"lookup buffer: the producer sent a reply of {len(frames)} frames")
        reply = decode_reply(self._signer, frames[0])
        if reply.request_id == call.request_id:
            return reply
        # The answer to an earlier call of this thread that gave up waiting.
        logger.debug("lookup buffer: discarding a late reply for request %d", reply.request_id)
        return None

    # ------------------------------------------------------------------ the leader

    def _lead(self, channel: _ThreadChannel, call: _Call, deadline: float, bound: float) -> Reply | None:
        """Read and route outcomes from the data pipe until ``call`` has its own (see _await_outcome)."""
        while call.outcome is None:
            reply = self._reply_for(channel, call)  # a refusal sent as a control reply
            if reply is not None:
                return reply
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise KVPeerLostError(
                    f"lookup buffer: the producer at {self._address} did not answer a select within "
                    f"{bound:g} s (its wait + kv_timeout)"
                )
            if not self._answered_on_pipe:
                remaining = min(remaining, _FIRST_ANSWER_CHECK)
            try:
                # Bounded by the pipe's liveness check, the deadline and close(), which closes the pipe.
                self._route_one(call, self._next_tensor(timeout=remaining))
            except KVTimeoutError:
                continue
            except KVTransferError as exc:
                self._fail(exc)
                with self._lock:
                    self._raise_if_stopped()
                raise
            except Exception as exc:  # a bug; fail loudly rather than leave other calls waiting
                self._fail(KVTransferError(f"lookup buffer: reading the data pipe failed: {exc!r}"))
                raise
        return None

    def _route_one(self, leader: _Call | None, header: torch.Tensor) -> None:
        """Route the outcome that ``header`` starts (reading a hit's tensors) to its call.

        A function of its own so that no reference to the tensors outlives it: the pipe recycles a
        receive buffer only once its tensor is gone.
        """
        outcome = parse_header(header)
        self._answered_on_pipe = True
        hit = outcome.status is OutcomeStatus.HIT
        with self._lock:
            call = self._calls.get(outcome.request_id)
            if call is not None and hit:
                call.announced = True
        items: tuple[torch.Tensor | None, ...] = ()
        if hit:  # key, then value and hidden if present, in the order they were sent
            items = (outcome.input_tokens, outcome.roi, self._next_tensor(),
                     self._next_tensor() if outcome.has_value else None,
                     self._next_tensor() if outcome.has_hidden else None)
        if call is None:
            if hit:
                logger.warning("lookup buffer: dropped the entry sent for request %d: its drop_select gave up",
                               outcome.request_id)
            return
        call.items = items
        call.outcome = outcome  # last: it completes the call
        if call is not leader:
            call.doorbell.ring()
            # Give up the GIL to the call just woken: it would otherwise wait until this thread blocks
            # in its next receive (4 KiB selects against a raw request/response: median 1.37x of 7 runs
            # -> 1.21x of 9, measured with a reader thread).
            time.sleep(0)

    def _next_tensor(self, timeout: float | None = None) -> torch.Tensor:
        item = self._pipe.recv_tensor(timeout)
        with self._lock:
            self._received_tensors += 1
        if item is None:
            raise KVProtocolError("lookup buffer: the producer sent None on the data pipe; outcomes carry only tensors")
        return item

    def _fail(self, error: KVTransferError) -> None:
        with self._lock:
            if self._closed or self._failure is not None:
                return  # a closing pipe ends the reader: not a failure
            self._failure = error
        if isinstance(error, KVPipeClosedError):
            logger.info("lookup buffer: the producer closed its side (%s)", error)
        else:
            logger.error("lookup buffer consumer stops: %s", error)
        self._stopped.ring()
