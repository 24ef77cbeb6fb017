"""The producer's worker of the vLLM connector: its listener, saves, lent blocks, taking entries back.

A producer worker listens (:class:`lookup_buffer.BufferListener`) at its ``kv_ip:kv_port + tp_rank``
and serves every consumer that connects, all from one set of entries. Each save inserts a request's
transfer-prefix blocks: lent where they lie when its caches are exported (``kv_lend_blocks``),
else copied into the buffer. vLLM keeps a saved request's blocks once it finishes until
:meth:`ProducerWorker.take_finished_sending` reports them; a preempted request's entry is taken back
before vLLM writes its blocks, and that of a request that will not be announced (not every TP rank
saved it) leaves the buffer, copy or loan.

A copy that leaves the buffer before its request finished (evicted, expired, taken by a select for
the same tokens), or a loan that ends before it, is reported by :meth:`ProducerWorker.take_gone`:
the scheduler then announces 0 tokens for it instead of sending a decode instance after it. The
buffer's store tells this worker each copy's departure
(:meth:`lookup_buffer.store.EntryStore.watch_departures`), by key: the copies under one key leave in
the order they were stored, so the oldest request saved under that key is the one whose copy left.
A copy withdrawn (:meth:`lookup_buffer.store.EntryStore.withdraw_copy`) leaves in that order too,
whichever request under its key is withdrawn: the copies are alike, so the withdrawn request gives
up its place in the key's order instead, and the departure that the withdrawal causes is not
reported (the first one under that key after it, which may be a select's that came in between: the
copy the withdrawal then removes is the oldest request's). A copy that a select split into parts
(a decode instance with more TP ranks takes some of its KV heads) leaves when its first part is
taken, and its request is reported gone; if that request is then withdrawn, the parts still in the
buffer leave with it (:meth:`lookup_buffer.store.EntryStore.withdraw_split_copy`) rather than hold
buffer memory until they expire.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np
import torch

from connector import compat
from connector.kv_transfer import send_kv_caches_and_hidden_states
from connector.paged import PagedKV
from connector.transfer_plan import SaveSpec
from connector.vllm_consumer_worker import ConsumerWorker
from connector.vllm_settings import ConnectorSettings
from connector.vllm_worker import MAX_REMEMBERED, WorkerSide, entry_store, kv_request, remember
from kv_pipe.errors import KVBufferFullError, KVConfigError, KVTimeoutError, KVTransferError
from lookup_buffer.base import BufferStats, KVLookupBufferBase
from lookup_buffer.connections import Address
from lookup_buffer.listener import BufferListener
from lookup_buffer.loans import Loan
from lookup_buffer.matching import MatchKey

logger = logging.getLogger(__name__)


class ProducerWorker(WorkerSide):
    """A prefill instance's TP rank (``kv_producer``): see the module docstring and :class:`WorkerSide`."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._buffer: KVLookupBufferBase | None = None  # the listener
        self._reported_dropped = {"expired_entries": 0, "evicted_entries": 0}  # the buffer's counts reported so far
        self._saved: set[str] = set()  # request ids whose save succeeded / failed since the last report
        self._unsaved: set[str] = set()
        self._lends = False  # its caches are exported, and saves lend their blocks
        self._kept: dict[str, Loan | None] = {}  # every request saved, with its loan if lent
        self._lent_blocks: dict[str, int] = {}  # blocks of each request in _kept
        # Under _copies_lock (the buffer's threads report departures): requests saved by a copy, with
        # its match key, until finished (in order); the requests whose copies are stored under each
        # key's digest, in the order they were stored; departures of copies not registered yet (a
        # select took one before its insert returned); departures that withdrawals cause, not yet
        # told; copies of requests in _copied that left before the request was reported, to report;
        # of those, the ones a select split, with their key (their parts leave if they are withdrawn).
        self._copies_lock = threading.Lock()
        self._copied: dict[str, MatchKey] = {}
        self._copy_keys: dict[bytes, collections.deque[str]] = {}
        self._early_departures: dict[bytes, int] = {}
        self._withdrawing: dict[bytes, int] = {}
        self._gone: set[str] = set()
        self._split: dict[str, MatchKey] = {}
        self._released: dict[str, None] = {}  # requests taken back, until held or saved again (in order)
        self._ended_early: set[str] = set()  # requests in _kept whose loan ended before they were held, reported
        self._held: dict[str, float] = {}  # finished requests whose blocks vLLM keeps, and since when

    def _open(self) -> None:
        """Start listening (returns at once); lend saved blocks if the caches can be exported."""
        if self.settings.lend_blocks:
            try:
                self._require_caches().export()
                self._lends = True
            except KVConfigError as exc:
                logger.warning("kvbridge: saved blocks will be copied, not lent: %s", exc)
        self._buffer = self._listener_factory(self._listening_settings(), self.port_offset, self._check_peer)
        store = entry_store(self._buffer)
        if store is not None:
            store.watch_departures(self._on_departed)
        super()._open()

    def _listening_settings(self) -> ConnectorSettings:
        """The settings the listener is opened with (a listener is a producer)."""
        return self.settings

    def _close(self) -> None:
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            try:
                buffer.close()
            except KVTransferError as exc:
                logger.warning("kvbridge: closing the lookup buffer: %s", exc)
        super()._close()

    def save(self, saves: Sequence[SaveSpec]) -> None:
        """Insert each request's transfer-prefix blocks into the lookup buffer.

        Never raises for a transfer problem: a request that cannot be saved is logged, counted
        and reported by :meth:`take_save_outcomes`, so that the producer does not announce it.
        """
        for spec in saves:
            if self._save_one(spec):
                self._saved.add(spec.req_id)
            else:
                self._unsaved.add(spec.req_id)

    def _save_one(self, spec: SaveSpec) -> bool:
        """Save one request; return whether its entry is in the lookup buffer."""
        with self._copies_lock:
            if spec.req_id in self._copied:
                # Saved again after a preemption: its copy, made before, is still in the buffer, and
                # holds the same prefix's KV. A second entry would wait for nobody.
                return True
        self._kept[spec.req_id] = None  # vLLM keeps its blocks once finished: see take_finished_sending
        self._ended_early.discard(spec.req_id)
        self._released.pop(spec.req_id, None)
        if self._buffer is None:
            self._add(save_failures=1)
            return False
        caches = self._require_caches()
        start = time.perf_counter()
        try:
            # vLLM runs its steps under torch.inference_mode; the entry outlives the step and the
            # buffer's threads handle it outside that mode, so it must be made of normal tensors.
            with torch.inference_mode(False):
                request = kv_request(spec.token_ids, PagedKV(caches, spec.block_ids))
                (result,) = send_kv_caches_and_hidden_states(
                    self._buffer, [request], timeout=self.settings.save_timeout, lend=self._lends
                )
        except KVTransferError as exc:  # a full buffer, or a closed one
            level = logging.WARNING if isinstance(exc, (KVBufferFullError, KVTimeoutError)) else logging.ERROR
            logger.log(level, "kvbridge: KV of request %s not saved: %s", spec.req_id, exc)
            self._add(save_failures=1, save_seconds=time.perf_counter() - start)
            return False
        self._kept[spec.req_id] = result.loan
        self._lent_blocks[spec.req_id] = len(spec.block_ids)
        if result.loan is None:
            self._track_copy(spec.req_id, spec.token_ids)
        self._add(
            saved_requests=1,
            lent_requests=int(result.loan is not None),
            saved_blocks=len(spec.block_ids),
            saved_bytes=result.num_bytes,
            save_seconds=result.seconds,
        )
        self._observe(transfer_seconds=result.seconds, save_copy_seconds=result.copy_seconds)
        return True

    def hold(self, req_ids: Iterable[str]) -> None:
        """vLLM finished these requests and keeps their blocks until :meth:`take_finished_sending`
        reports them (each was handed to this worker to save)."""
        now = time.monotonic()
        self._held.update(dict.fromkeys(req_ids, now))

    def take_back(self, req_ids: Iterable[str], withdraw: Iterable[str] = ()) -> None:
        """Take back the entries of saved requests before vLLM writes their blocks (from vLLM's
        ``handle_preemptions``, which runs before the step zeroes, copies or computes into any
        block): ``req_ids`` vLLM preempted, ``withdraw`` will not be announced (not every TP rank
        saved its share, or a rank's entry is gone).

        A lent entry still stored leaves the buffer; one lent out has its stamp cleared (its
        borrower's load fails and nothing it copied is used); one being copied out for a consumer
        that does not borrow is waited for at most ``kv_timeout``, and answered as a miss if it
        takes longer. An entry copied into the buffer holds no blocks: a preempted request's stays,
        and its next save keeps it; one of a request in ``withdraw`` leaves the buffer (a copy
        already taken, evicted or expired is not replaced by another). A request taken back is no
        longer kept: held by vLLM (finished), in this step or a later one, it is reported finished
        sending."""
        withdrawn = dict.fromkeys(withdraw)
        for req_id in dict.fromkeys([*req_ids, *withdrawn]):
            with self._copies_lock:
                saved_here = req_id in self._kept or req_id in self._copied
                key = self._give_up_copy(req_id) if req_id in withdrawn else None
                split_key = self._split.pop(req_id, None)  # taken back: a later departure is its next copy's
            if not saved_here:
                continue
            if key is not None and self._withdraw_copy(req_id, key):
                self._add(taken_back=1)
            if req_id in withdrawn and split_key is not None and self._withdraw_split_copy(split_key):
                self._add(taken_back=1)
            loan = self._kept.pop(req_id, None)
            self._ended_early.discard(req_id)
            self._lent_blocks.pop(req_id, None)
            remember(self._released, req_id)
            if loan is None or loan.outcome is not None:
                continue
            self._add(taken_back=1)
            if not loan.take_back(self.settings.bridge.kv_timeout):
                logger.warning(
                    "kvbridge: the entry of request %s was still being copied out after %g s; that copy "
                    "is answered as a miss",
                    req_id,
                    self.settings.bridge.kv_timeout,
                )

    def _give_up_copy(self, req_id: str) -> MatchKey | None:
        """Under _copies_lock: forget ``req_id``'s copy, if it is still stored, and expect the departure
        of its withdrawal; its match key, or None if there is no copy to withdraw."""
        key = self._copied.pop(req_id, None)
        queue = self._copy_keys.get(key.digest) if key is not None else None
        if queue is None or req_id not in queue or entry_store(self._buffer) is None:
            return None
        queue.remove(req_id)
        if not queue:
            del self._copy_keys[key.digest]
        self._withdrawing[key.digest] = self._withdrawing.get(key.digest, 0) + 1
        return key

    def _withdraw_copy(self, req_id: str, key: MatchKey) -> bool:
        """Take a copy under ``key`` out of the buffer for ``req_id`` (given up); whether one was."""
        store = entry_store(self._buffer)
        if store is not None and store.withdraw_copy(key):
            return True
        # Another departure under the key came first and was counted as this withdrawal's; a buffer
        # closed meanwhile has dropped every copy.
        logger.debug("kvbridge: the copy of request %s had already left the buffer", req_id)
        return False

    def _withdraw_split_copy(self, key: MatchKey) -> bool:
        """Take out of the buffer the parts left of a copy under ``key`` that a select split; whether
        any were left (the other TP ranks of the decode instance that split it may have taken them all)."""
        store = entry_store(self._buffer)
        return store is not None and store.withdraw_split_copy(key)

    def take_finished_sending(self) -> set[str]:
        """Held requests whose blocks this worker no longer needs, each once: saved by a copy, taken
        back, or lent and the loan has ended (taken and released, copied for a consumer on another
        host, expired, evicted, or copied into the buffer because nobody took it within
        ``kv_lend_lease`` of the request's end)."""
        self._end_overdue_loans()
        done = {
            req_id
            for req_id in self._held
            if req_id in self._released
            or (req_id in self._kept and (self._kept[req_id] is None or self._kept[req_id].outcome is not None))
        }
        for req_id in done:
            self._kept.pop(req_id, None)
            self._ended_early.discard(req_id)
            del self._held[req_id]
            with self._copies_lock:
                self._copied.pop(req_id, None)
                self._gone.discard(req_id)
                self._split.pop(req_id, None)
            self._released.pop(req_id, None)
            self._lent_blocks.pop(req_id, None)
        if done:
            self._add(returned_requests=len(done))
        return done

    def _end_overdue_loans(self) -> None:
        """Copy into the buffer the entries of finished requests still lent ``kv_lend_lease`` after
        the request's end: their KV stays available to a decode instance that comes late, and vLLM
        gets the blocks back for new requests. Unused entries thus hold host memory, which gives way
        to new saves, never vLLM's KV cache."""
        if self._buffer is None:
            return
        due = time.monotonic() - self.settings.lend_lease
        for req_id, since in list(self._held.items()):
            loan = self._kept.get(req_id)
            if since > due or loan is None or loan.outcome is not None:
                continue
            try:
                if self._buffer.unlend(loan):
                    self._add(unlent_requests=1)
            except KVTransferError as exc:  # a copy into pipe memory that failed: the loan ended dropped
                logger.warning(
                    "kvbridge: the entry of request %s could not be copied out of its blocks: %s", req_id, exc
                )

    def _track_copy(self, req_id: str, token_ids: Sequence[int]) -> None:
        """``req_id`` was saved by a copy, stored under the match key of ``token_ids``: remember it
        until it is finished, and report it gone if its copy leaves the buffer before that."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        key = MatchKey(tokens, np.ones(len(tokens), dtype=bool))
        digest = key.digest
        with self._copies_lock:
            early = self._early_departures.pop(digest, 0)
            if early:
                if early > 1:
                    self._early_departures[digest] = early - 1
                self._gone.add(req_id)
                return
            self._copy_keys.setdefault(digest, collections.deque()).append(req_id)
            remember(self._copied, req_id, key)

    def _on_departed(self, key: MatchKey, split: bool) -> None:
        """A copy under ``key`` left the buffer (a buffer thread, under its store's lock): the oldest
        copy this worker stored under it; ``split`` when a select split it (its other parts are in
        the buffer still). A request still running whose copy left is reported gone
        (:meth:`take_gone`), and its next save after a preemption makes a new copy."""
        digest = key.digest
        with self._copies_lock:
            withdrawing = self._withdrawing.pop(digest, 0)
            if withdrawing:
                if withdrawing > 1:
                    self._withdrawing[digest] = withdrawing - 1
                return
            queue = self._copy_keys.get(digest)
            if not queue:
                self._early_departures[digest] = self._early_departures.get(digest, 0) + 1
                while len(self._early_departures) > MAX_REMEMBERED:
                    self._early_departures.pop(next(iter(self._early_departures)))
                return
            req_id = queue.popleft()
            if not queue:
                del self._copy_keys[digest]
            if req_id in self._copied:
                del self._copied[req_id]
                self._gone.add(req_id)
                if split:
                    remember(self._split, req_id, key)

    def take_gone(self) -> set[str]:
        """Saved requests whose entry left the buffer (taken by a select, evicted, expired) before the
        request finished, since the last call, each once: a copy that left before the request was
        reported finished, or a loan that ended before vLLM finished the request (a prefill request
        that keeps generating outlives ``kv_entry_timeout``). Announcing them would send a decode
        instance after an entry that is no longer there."""
        ended = {
            req_id
            for req_id, loan in self._kept.items()
            if loan is not None
            and loan.outcome is not None
            and req_id not in self._held
            and req_id not in self._ended_early
        }
        self._ended_early |= ended
        with self._copies_lock:
            gone, self._gone = self._gone, set()
        return gone | ended

    def take_save_outcomes(self) -> tuple[set[str], set[str]]:
        """Request ids saved, and not saved, since the last call (vLLM asks once per step)."""
        outcomes = (self._saved, self._unsaved)
        self._saved, self._unsaved = set(), set()
        return outcomes

    # ------------------------------------------------------------------ stats

    def _report_buffer(self) -> None:
        store = entry_store(self._buffer)
        entry_waits = store.take_waits() if store is not None else []
        buffer = self.buffer_stats()
        dropped = {
            "expired_entries": buffer.expired if buffer is not None else 0,
            "evicted_entries": buffer.evicted if buffer is not None else 0,
        }
        with self._stats_lock:
            for name, count in dropped.items():
                if count > self._reported_dropped[name]:
                    self._interval.add(**{name: count - self._reported_dropped[name]})
                    self._total.add(**{name: count - self._reported_dropped[name]})
                    self._reported_dropped[name] = count
            if entry_waits:
                self._observed.phases.setdefault("entry_wait_seconds", []).extend(entry_waits)
        super()._report_buffer()

    def buffer_stats(self) -> BufferStats | None:
        """The lookup buffer's counters (e.g. entries still held)."""
        return self._buffer.stats() if self._buffer is not None else None

    def _gauges(self, gauges: dict[str, int]) -> None:
        super()._gauges(gauges)
        buffer = self.buffer_stats()
        lent = [req_id for req_id, loan in list(self._kept.items()) if loan is not None and loan.outcome is None]
        gauges["entries_held"] = buffer.entries if buffer is not None else 0
        gauges["bytes_buffered"] = buffer.bytes if buffer is not None else 0
        gauges["loans_out"] = len(lent)
        gauges["blocks_lent"] = sum(self._lent_blocks.get(req_id, 0) for req_id in lent)
        if isinstance(self._buffer, BufferListener):
            gauges["connections"] += self._buffer.connections


class DualWorker(ProducerWorker, ConsumerWorker):
    """Both roles in one worker (``kv_both``): it listens and saves, and connects and loads."""

    def _listening_settings(self) -> ConnectorSettings:
        bridge = self.settings.bridge.replace(kv_role="kv_producer")
        return dataclasses.replace(self.settings, bridge=bridge)

    def _identity_towards(self, address: Address | None) -> compat.KVLayoutInfo:
        # A connection carries KV one way: this worker produces on those it accepts, consumes on those it dials.
        role = "kv_producer" if address is None else "kv_consumer"
        return msgspec.structs.replace(super()._identity_towards(address), role=role)
