"""Asynchronous loads of the vLLM connector's consumer: transfers run off vLLM's engine step.

vLLM's contract for a connector that claims tokens with ``load_kv_async=True``
(``kv_connector/v1/base.py``): the request waits (``WAITING_FOR_REMOTE_KVS``) with its blocks
allocated until a worker reports it in ``get_finished``'s finished-receiving set; its failed
blocks must be reported by ``get_block_ids_with_load_errors`` no later than the same step. An
aborted request that is still waiting keeps its blocks until that report too, so a load may
finish writing after the abort; the write is skipped when the abort is already known.

:class:`LoadTracker` holds that state machine and nothing else (no transport): a job runs in one
of its threads, returns the block ids that failed, and the tracker reports each request exactly
once, its failed blocks in the same report. A load may also be registered before it has a job
(:meth:`LoadTracker.begin`): it holds no thread while it waits for something else (its producer's
connection), then either runs (:meth:`LoadTracker.run`) or completes without ever taking a thread
(:meth:`LoadTracker.finish`), under the same contract. Work that reports nothing to vLLM (taking and
dropping an entry whose blocks vLLM already holds) runs in a thread of its own
(:meth:`LoadTracker.start_unreported`), never in a load thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable

from kv_pipe import cores

logger = logging.getLogger(__name__)

#: Loads that wait or receive at the same time. A load waiting for a late entry holds a thread for
#: up to ``kv_load_timeout``; more loads than threads queue behind them without holding the step.
#: A load takes a thread only once its producer's connection is open.
LOAD_THREADS = 16
#: Loads from one producer (one prefill rank: a gather counts against each of its ranks) that hold a
#: load thread at once, at most; the others wait for one of them to end without a thread
#: (:class:`connector.tp_sources.SourceConnections`). A producer that stops answering with its
#: connection open holds each of its selects until ``kv_timeout``: it must leave threads to the others.
PRODUCER_LOAD_SHARE = LOAD_THREADS // 2
#: Work that reports nothing to vLLM: see :meth:`LoadTracker.start_unreported`.
Unreported = Callable[[], None]


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

    Called from vLLM's model-runner thread (:meth:`start`, :meth:`begin`, :meth:`take_finished`,
    :meth:`take_failed_blocks`, :meth:`close`); jobs complete in the tracker's threads; :meth:`run`
    and :meth:`finish` may be called from any thread.
    """

    def __init__(self, threads: int = LOAD_THREADS) -> None:
        self._executor = cores.executor(threads, "kvbridge-load")
        self._unreported = cores.executor(1, "kvbridge-drain")
        self._lock = threading.Lock()  # guards the three fields below
        self._in_flight: dict[str, LoadTicket] = {}
        self._done: dict[str, set[int]] = {}  # req_id -> failed block ids, not reported yet
        self._failed_blocks: set[int] = set()  # reported requests' failed blocks, until vLLM takes them

    def start(self, req_id: str, block_ids: Iterable[int], job: LoadJob) -> None:
        """Run ``job`` for ``req_id``, which writes ``block_ids``, in a tracker thread. A request is
        loaded at most once."""
        self.run(self.begin(req_id, block_ids), job)

    def begin(self, req_id: str, block_ids: Iterable[int]) -> LoadTicket:
        """Register the load of ``req_id``, which writes ``block_ids``, without a job yet: it holds
        no thread until :meth:`run`, and is reported once :meth:`run`'s job or :meth:`finish`
        completes it. Its ticket is cancelled like any other when vLLM finishes the request. A
        request is loaded at most once."""
        ticket = LoadTicket(req_id, frozenset(block_ids))
        with self._lock:
            if req_id in self._in_flight or req_id in self._done:
                raise ValueError(f"kvbridge: request {req_id} already has a load in flight")
            self._in_flight[req_id] = ticket
        return ticket

    def run(self, ticket: LoadTicket, job: LoadJob) -> None:
        """Run ``job`` for a ticket of :meth:`begin` in a tracker thread. Never blocks; once the
        tracker is closed, the load fails at once (every block) instead."""
        try:
            self._executor.submit(self._run, ticket, job)
        except RuntimeError:  # shut down: no job runs any more
            self.finish(ticket, ticket.block_ids)

    def run_here(self, ticket: LoadTicket, job: LoadJob) -> None:
        """Run ``job`` for a ticket of :meth:`begin` in the calling thread, with :meth:`run`'s
        contract (an exception fails every block); the load is complete when this returns."""
        self._run(ticket, job)

    def finish(self, ticket: LoadTicket, failed: Iterable[int]) -> None:
        """Complete a ticket of :meth:`begin` without a thread, ``failed`` being the blocks that
        failed. Completing a ticket that is already complete does nothing."""
        self._settle(ticket, set(failed))

    def start_unreported(self, work: Unreported) -> None:
        """Run ``work``, which reports nothing to vLLM and which nobody waits for, in the tracker's
        own thread for such work: one at a time, in order, never in a load thread. Dropped once
        the tracker is closed; an exception is logged."""
        try:
            self._unreported.submit(self._run_unreported, work)
        except RuntimeError:
            logger.debug("kvbridge: the load tracker is closed: background work dropped")

    @staticmethod
    def _run_unreported(work: Unreported) -> None:
        try:
            work()
        except Exception:
            logger.exception("kvbridge: background work of the loads failed")

    def _run(self, ticket: LoadTicket, job: LoadJob) -> None:
        try:
            failed = set(job(ticket))
        except BaseException:  # a bug in a job must not leave vLLM waiting for the request forever
            logger.exception("kvbridge: the load of request %s failed", ticket.req_id)
            failed = set(ticket.block_ids)
        self._settle(ticket, failed)

    def _settle(self, ticket: LoadTicket, failed: set[int]) -> None:
        with self._lock:
            if self._in_flight.get(ticket.req_id) is not ticket:
                return  # complete already
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
        """Loads registered and not complete yet, with or without a thread."""
        with self._lock:
            return len(self._in_flight)

    def cancel_all(self) -> None:
        """Let no in-flight load write any more (the engine is shutting down)."""
        with self._lock:
            for ticket in self._in_flight.values():
                ticket.cancelled.set()

    def close(self) -> None:
        """Cancel every in-flight load and wait for the jobs (each is bounded by its own timeouts:
        close the transport first so that they end at once); unreported work not started yet is
        dropped. A load still waiting for a job fails at once when it gets one."""
        self.cancel_all()
        self._unreported.shutdown(wait=True, cancel_futures=True)
        self._executor.shutdown(wait=True)
