"""Asynchronous loads of the vLLM connector's consumer: transfers run off vLLM's engine step.

vLLM's contract for a connector that claims tokens with ``load_kv_async=True``
(``kv_connector/v1/base.py``): the request waits (``WAITING_FOR_REMOTE_KVS``) with its blocks
allocated until a worker reports it in ``get_finished``'s finished-receiving set; its failed
blocks must be reported by ``get_block_ids_with_load_errors`` no later than the same step. An
aborted request that is still waiting keeps its blocks until that report too, so a load may
finish writing after the abort; the write is skipped when the abort is already known.

:class:`LoadTracker` holds that state machine and nothing else (no transport): a job runs in one
of its threads, returns the block ids that failed, and the tracker reports each request exactly
once, its failed blocks in the same report.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

#: Loads that wait or receive at the same time. A load waiting for a late entry holds a thread for
#: up to ``kv_load_timeout``; more loads than threads queue behind them without holding the step.
LOAD_THREADS = 8


@dataclasses.dataclass
class LoadTicket:
    """One in-flight load. ``cancelled`` turns true once vLLM has finished (aborted) the request:
    from then on the job must not write into its blocks."""

    req_id: str
    block_ids: frozenset[int]  # the blocks the job may write: all of them fail if the job raises
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)


#: A load job: writes a request's blocks unless its ticket is cancelled; returns the failed block ids.
LoadJob = Callable[[LoadTicket], Iterable[int]]


class LoadTracker:
    """Runs load jobs in its threads and reports their completion once per request.

    Called from vLLM's model-runner thread (:meth:`start`, :meth:`take_finished`,
    :meth:`take_failed_blocks`, :meth:`close`); jobs complete in the tracker's threads.
    """

    def __init__(self, threads: int = LOAD_THREADS) -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvbridge-load")
        self._lock = threading.Lock()  # guards the three fields below
        self._in_flight: dict[str, LoadTicket] = {}
        self._done: dict[str, set[int]] = {}  # req_id -> failed block ids, not reported yet
        self._failed_blocks: set[int] = set()  # reported requests' failed blocks, until vLLM takes them

    def start(self, req_id: str, block_ids: Iterable[int], job: LoadJob) -> None:
        """Run ``job`` for ``req_id``, which writes ``block_ids``, in a tracker thread. A request is
        loaded at most once."""
        ticket = LoadTicket(req_id, frozenset(block_ids))
        with self._lock:
            if req_id in self._in_flight or req_id in self._done:
                raise ValueError(f"kvbridge: request {req_id} already has a load in flight")
            self._in_flight[req_id] = ticket
        self._executor.submit(self._run, ticket, job)

    def _run(self, ticket: LoadTicket, job: LoadJob) -> None:
        try:
            failed = set(job(ticket))
        except BaseException:  # a bug in a job must not leave vLLM waiting for the request forever
            logger.exception("kvbridge: the load of request %s failed", ticket.req_id)
            failed = set(ticket.block_ids)
        with self._lock:
            del self._in_flight[ticket.req_id]
            self._done[ticket.req_id] = failed

    def take_finished(self, finished_req_ids: Iterable[str] = ()) -> set[str]:
        """Requests whose load completed since the last call (each reported once); their failed
        blocks move to :meth:`take_failed_blocks`. ``finished_req_ids`` are the requests vLLM has
        finished since the last call: their in-flight loads write nothing any more."""
        with self._lock:
            for req_id in finished_req_ids:
                ticket = self._in_flight.get(req_id)
                if ticket is not None:
                    ticket.cancelled.set()
            done, self._done = self._done, {}
            for failed in done.values():
                self._failed_blocks |= failed
            return set(done)

    def take_failed_blocks(self) -> set[int]:
        """Failed blocks of the requests :meth:`take_finished` has reported, each returned once."""
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
            return failed

    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def cancel_all(self) -> None:
        """Let no in-flight load write any more (the engine is shutting down)."""
        with self._lock:
            for ticket in self._in_flight.values():
                ticket.cancelled.set()

    def close(self) -> None:
        """Cancel every in-flight load and wait for the jobs (each is bounded by its own timeouts:
        close the transport first so that they end at once)."""
        self.cancel_all()
        self._executor.shutdown(wait=True)
