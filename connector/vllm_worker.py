"""Worker side of the vLLM connector: the connections, the lookup buffers, and the block copies.

It runs in each vLLM worker (one per TP rank) and needs no vLLM import: vLLM-specific plumbing
lives in :mod:`connector.vllm_v1`, so this class can be driven directly by tests.

Connections: a producer worker listens (:class:`lookup_buffer.BufferListener`) at its
``kv_ip:kv_port + tp_rank`` and serves every consumer that connects, all from one set of entries.
A consumer worker connects to a producer when a load first names it
(:class:`lookup_buffer.ProducerConnections`), in a dial thread of that producer's, and keeps the
connection for later requests; a load takes a load thread only once its producer is connected, so
a producer that cannot be reached never holds up another's loads. Each new connection first
exchanges both sides' KV layouts (:mod:`connector.compat`): an incompatible pair is refused with an
error naming every difference.

Loads are asynchronous: each runs in a load thread (:mod:`connector.vllm_loads`) while vLLM keeps
stepping its other requests, and writes straight into the blocks vLLM allocated.

Failure policy: a load that cannot complete (no entry within ``kv_load_timeout``, an entry that
fails the checks, a producer that cannot be reached or died) writes nothing vLLM could trust and
reports the request's blocks through :meth:`WorkerSide.take_failed_blocks`, in the step that
reports the request finished receiving; vLLM then recomputes them
(``kv_load_failure_policy="recompute"``) or fails the request (``"fail"``). A connection that
fails is dropped; the next load that names its producer connects again (after a backoff when
connecting keeps failing), so a restarted producer is used again without restarting the consumer.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import msgspec
import numpy as np
import torch

from connector import compat, tp_layout
from connector.base import KVRequest
from connector.kv_transfer import recv_kv_caches_and_hidden_states, send_kv_caches_and_hidden_states
from connector.paged import PagedKV, PagedKVCaches, PagedKVLayout, scatter_blocks
from connector.tp_sources import SourceConnections, Sources
from connector.transfer_plan import LoadSpec, SaveSpec
from connector.transfer_stats import TransferStats
from connector.vllm_loads import LoadTicket, LoadTracker
from connector.vllm_settings import ConnectorSettings
from kv_pipe.base import KVPipeBase
from kv_pipe.errors import KVBufferFullError, KVConfigError, KVTimeoutError, KVTransferError
from kv_pipe.parallel_copy import copy_pieces
from lookup_buffer import BufferListener, ProducerConnections, dial
from lookup_buffer.base import BufferStats, KVLookupBufferBase
from lookup_buffer.connections import Address
from lookup_buffer.errors import KVEntryTakenBackError, KVInvalidRequestError
from lookup_buffer.listener import OnConnect
from lookup_buffer.loans import BorrowedTensor, Loan
from lookup_buffer.matching import MatchKey
from lookup_buffer.store import EntryStore

logger = logging.getLogger(__name__)

#: Most prefill instances of another TP size whose sources a consumer rank keeps planned.
_MAX_PLANS = 1024
#: Opens the producer's listener: (settings, port offset, on_connect) -> its buffer.
ListenerFactory = Callable[[ConnectorSettings, int, OnConnect], KVLookupBufferBase]
#: Connects a consumer to the producer at (host, port): (settings, host, port, on_connect) -> its buffer.
Dialer = Callable[[ConnectorSettings, str, int, OnConnect | None], KVLookupBufferBase]


@dataclasses.dataclass(frozen=True)
class _LoadTarget(PagedKV):
    """A request's transfer-prefix blocks, of which only those from ``skip_blocks`` on are written."""

    skip_blocks: int = 0
    cancelled: threading.Event | None = None  # set once vLLM no longer holds the blocks: write nothing

    def load(self, key: torch.Tensor, value: torch.Tensor | None) -> None:
        # vLLM keeps a waiting request's blocks until its load is reported finished, so a write
        # that started before the abort became known still lands in blocks the request owns.
        if self.cancelled is not None and self.cancelled.is_set():
            return
        block_dim = self.caches.layout.block_dim
        blocks = key.narrow(1 + block_dim, self.skip_blocks, len(self.block_ids) - self.skip_blocks)
        scatter_blocks(self.caches.caches, self.caches.layout, self.block_ids[self.skip_blocks:], blocks)

    def load_borrowed(self, key: BorrowedTensor, value: torch.Tensor | None) -> None:
        if self.cancelled is not None and self.cancelled.is_set():
            return
        targets = PagedKV(self.caches, self.block_ids[self.skip_blocks:]).pieces()
        if targets is None:
            self.load(key.to_tensor(), value)
            return
        # The key's bytes run layer by layer (and by each index before the block dimension) through
        # all the request's blocks: leave out the first skip_blocks blocks of each such row.
        rows = math.prod(key.shape[: 1 + self.caches.layout.block_dim])
        row_bytes = key.nbytes // rows
        skipped = self.skip_blocks * row_bytes // len(self.block_ids)
        copy_pieces(targets, [piece for row in range(rows)
                              for piece in key.slice_pieces(row * row_bytes + skipped, row_bytes - skipped)])


#: Requests saved by a copy, and requests taken back, that a worker remembers at most each (a
#: request vLLM preempted and then aborted before its next save is never held nor reported).
MAX_REMEMBERED = 10_000

#: What a worker holds now, exported as gauges. Each returns to 0 once nothing is in flight:
#: ``connections`` (consumers connected to this producer, or producers this consumer uses),
#: ``entries_held`` and ``bytes_buffered`` (the producer's stored entries, lent or copied),
#: ``loans_out`` and ``blocks_lent`` (saved requests whose blocks vLLM keeps for kvbridge, and how
#: many blocks), ``loads_in_flight`` (the consumer's loads not reported to vLLM yet).
GAUGES = ("connections", "entries_held", "bytes_buffered", "loans_out", "blocks_lent", "loads_in_flight")


#: Per-request phases, one value per event (histograms). Producer: ``save_copy_seconds`` (of a save,
#: packing the blocks into the buffer's memory, or describing where they lie when lent) and
#: ``entry_wait_seconds`` (an entry from its store until a select took it). Consumer, per hit:
#: ``load_entry_wait_seconds`` (the select sent until the entry's header or lent descriptor arrived),
#: ``load_receive_seconds`` (the header until a copied entry's bytes were in hand; where the buffer
#: says when the header arrived) and ``load_copy_seconds`` (the write into vLLM's blocks).
PHASES = ("save_copy_seconds", "entry_wait_seconds", "load_entry_wait_seconds", "load_receive_seconds",
          "load_copy_seconds")


@dataclasses.dataclass
class Observations:
    """Per-event values since the last report (histograms), and the change of each gauge of :data:`GAUGES`."""

    transfer_seconds: list[float] = dataclasses.field(default_factory=list)  # per save or load
    load_wait_seconds: list[float] = dataclasses.field(default_factory=list)  # claim to blocks written
    gauges: dict[str, int] = dataclasses.field(default_factory=dict)
    phases: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # by name of PHASES

    def is_empty(self) -> bool:
        return not (self.transfer_seconds or self.load_wait_seconds or any(self.gauges.values())
                    or any(self.phases.values()))


def find_layout(cache: torch.Tensor, num_blocks: int, block_size: int, name: str) -> PagedKVLayout:
    """The paged layout of a per-layer cache tensor: its first dimension of ``num_blocks`` entries
    counts blocks, the next one of ``block_size`` entries counts tokens.

    Raises KVConfigError when the tensor has no such dimensions (e.g. an attention backend that
    splits vLLM's blocks into smaller kernel blocks).
    """
    shape = tuple(cache.shape)
    block_dim = next((d for d, size in enumerate(shape) if size == num_blocks), None)
    if block_dim is not None:
        size_dim = next((d for d, size in enumerate(shape) if size == block_size and d != block_dim), None)
        if size_dim is not None:
            return PagedKVLayout(name, block_dim=block_dim, block_size_dim=size_dim)
    raise KVConfigError(
        f"kvbridge cannot find the block dimension ({num_blocks} blocks of {block_size} tokens) "
        f"in a KV cache tensor of shape {shape} (layout {name})"
    )


class WorkerSide:
    """One TP rank's end of the transfer. Methods are called from vLLM's model-runner thread.

    Args:
        settings: transport and connector settings.
        identity: this instance's KV description; :meth:`connect` fills in ``num_layers``,
            ``block_shape``, ``dtype`` and ``layout`` from the real caches.
        port_offset: the TP rank's port offset (:func:`connector.vllm_settings.listen_port_offset`):
            a producer listens at ``kv_port + port_offset``, a consumer connects to the named
            producer's port plus it.
        listener_factory / dialer: how to open the transport (the defaults are kvbridge's
            BufferListener and dial, over TorchDistributedPipe).
    """

    def __init__(self, settings: ConnectorSettings, identity: compat.KVLayoutInfo, port_offset: int,
                 listener_factory: ListenerFactory | None = None, dialer: Dialer | None = None) -> None:
        self.settings = settings
        self.identity = identity
        self.port_offset = port_offset
        self._listener_factory = listener_factory or _default_listener
        self._dialer = dialer or _default_dialer
        self._caches: PagedKVCaches | None = None
        self._buffer: KVLookupBufferBase | None = None  # the producer's listener
        self._producers: ProducerConnections | None = None  # the consumer's connections
        self._reported_gauges = dict.fromkeys(GAUGES, 0)
        self._reported_dropped = {"expired_entries": 0, "evicted_entries": 0}  # the buffer's counts reported so far
        self._loads = LoadTracker()
        self._saved: set[str] = set()  # request ids whose save succeeded / failed since the last report
        self._unsaved: set[str] = set()
        self._lends = False  # producer: its caches are exported, and saves lend their blocks
        self._kept: dict[str, Loan | None] = {}  # producer: every request saved, with its loan if lent
        self._lent_blocks: dict[str, int] = {}  # producer: blocks of each request in _kept
        self._copied: dict[str, None] = {}  # producer: requests saved by a copy, until finished (in order)
        # Producer, under _copies_lock (the buffer's threads report departures): the requests whose
        # copies are stored under each key's digest, in the order they were stored; departures of
        # copies not registered yet (a select took one before its insert returned); copies of
        # requests in _copied that left before the request was reported, to report.
        self._copies_lock = threading.Lock()
        self._copy_keys: dict[bytes, collections.deque[str]] = {}
        self._early_departures: dict[bytes, int] = {}
        self._gone: set[str] = set()
        self._released: dict[str, None] = {}  # producer: requests taken back, until held or saved again (in order)
        self._held: dict[str, float] = {}  # producer: finished requests whose blocks vLLM keeps, and since when
        self._interval = TransferStats()
        self._observed = Observations()
        self._total = TransferStats()
        self._stats_lock = threading.Lock()  # stats are read by tests/loggers from other threads
        # Consumer: the prefill TP size and rank expected at each address dialed (checked on connecting),
        # and the sources of each prefill instance of another TP size, by (host, port, TP size).
        self._expected_peers: dict[Address, tuple[int, int]] = {}
        self._sources: dict[tuple[str, int, int], Sources] = {}

    # ------------------------------------------------------------------ setup

    def connect(self, caches: Sequence[torch.Tensor], layout: PagedKVLayout) -> None:
        """Register the caches and open the transport: a producer starts listening (returns at
        once), a consumer gets ready to connect to producers as loads name them.

        Raises:
            KVConfigError: the listening address cannot be bound.
        """
        self._caches = PagedKVCaches(list(caches), layout)
        first = self._caches.caches[0]
        if first.device.type == "cuda" and self.settings.bridge.kv_device_index is None:
            # The worker's GPU, never the current device of whichever thread builds a pipe later.
            bridge = self.settings.bridge.replace(kv_device_index=first.device.index)
            self.settings = dataclasses.replace(self.settings, bridge=bridge)
        block_shape = layout.block_shape(first, 1)
        self.identity = msgspec.structs.replace(self.identity, num_layers=len(caches), block_shape=block_shape,
                                                dtype=str(first.dtype), layout=layout.name,
                                                **self._head_fields(block_shape, layout))
        if self.settings.bridge.is_producer:
            if self.settings.lend_blocks:
                try:
                    self._caches.export()
                    self._lends = True
                except KVConfigError as exc:
                    logger.warning("kvbridge: saved blocks will be copied, not lent: %s", exc)
            self._buffer = self._listener_factory(self.settings, self.port_offset, self._check_peer)
            store = _entry_store(self._buffer)
            if store is not None:
                store.watch_departures(self._on_departed)
        else:
            settings = self.settings
            # Each connection is checked against the prefill rank this rank dialed it for.
            self._producers = SourceConnections(ProducerConnections(
                settings.bridge, self._check_peer,
                connect=lambda config, host, port, on_connect: self._dialer(
                    settings, host, port, functools.partial(self._check_peer, address=(host, port)))))
        logger.info("kvbridge %s (TP rank %d of %d) ready: %d layers, blocks of %s %s (heads along dimension %d)",
                    self.identity.role, self.identity.tp_rank, self.identity.tp_size, len(caches), block_shape,
                    first.dtype, self.identity.head_dim)

    def _head_fields(self, block_shape: tuple[int, ...], layout: PagedKVLayout) -> dict[str, int]:
        """This rank's KV heads in a block (:class:`compat.KVLayoutInfo` fields): the head dimension
        and, when vLLM did not give it (tests), the model's head count as this rank's times the TP
        size. A latent cache has none; a cache whose head dimension cannot be found gets -1 (then
        only equal TP sizes pair)."""
        identity = self.identity
        if identity.latent:
            return {"head_dim": -1}
        heads = tp_layout.local_heads(identity.total_kv_heads, identity.tp_size) if identity.total_kv_heads else None
        head_dim = tp_layout.find_head_dim(block_shape, layout.block_dim, layout.block_size_dim, heads)
        if head_dim is None:
            logger.warning("kvbridge: no dimension of %s KV heads in a block of shape %s (layout %s): only an "
                           "instance of the same TP size can pair with this one", heads, block_shape, layout.name)
            return {"head_dim": -1}
        return {"head_dim": head_dim,
                "total_kv_heads": identity.total_kv_heads or block_shape[head_dim] * identity.tp_size}

    def _check_peer(self, pipe: KVPipeBase, address: Address | None = None) -> compat.KVLayoutInfo:
        """On each new connection: exchange layouts; KVConfigError names every difference. A consumer
        also checks that the producer at ``address`` is the prefill rank it dialed for
        (:meth:`producer_address`)."""
        peer = compat.exchange(pipe, self.identity, timeout=self.settings.bridge.kv_timeout)
        expected = self._expected_peers.get(address) if address is not None else None
        if expected is not None and (peer.tp_size, peer.tp_rank) != expected:
            host, port = address
            raise KVConfigError(
                f"kvbridge: the prefill instance at {host}:{port} is TP rank {peer.tp_rank} of {peer.tp_size}; this "
                f"decode rank (TP rank {self.identity.tp_rank} of {self.identity.tp_size}) loads from TP rank "
                f"{expected[1]} of {expected[0]} there (the prefill TP size its kv_transfer_params announced, else "
                f"kv_producer_tp_size, else this instance's own)")
        logger.info("kvbridge %s (TP rank %d of %d) connected to a %s peer (TP rank %d of %d)", self.identity.role,
                    self.identity.tp_rank, self.identity.tp_size, peer.role, peer.tp_rank, peer.tp_size)
        return peer

    def producer_address(self, named: Address | None, producer_tp: int | None = None) -> Address | Sources:
        """Where this TP rank loads from: the producer a request names (its listener's base address),
        else the configured ``kv_ip:kv_port``. With the producer's TP size (``producer_tp``, else
        ``kv_producer_tp_size``, else this instance's) equal to this instance's: its rank of this
        rank's number, at the base port plus this rank's port offset. Otherwise the prefill ranks
        whose heads this rank holds (:class:`connector.tp_sources.Sources`, planned by
        :func:`connector.tp_layout.plan_sources`; a pairing it refuses fails the loads with why)."""
        host, port = named or (self.settings.bridge.kv_ip, self.settings.bridge.kv_port)
        identity = self.identity
        producer_tp = producer_tp or self.settings.producer_tp_size or identity.tp_size
        if producer_tp == identity.tp_size:
            address = (host, port + self.port_offset)
            self._expected_peers[address] = (producer_tp, identity.tp_rank)
            return address
        key = (host, port, producer_tp)
        sources = self._sources.get(key)
        if sources is None:
            try:
                plan = tp_layout.plan_sources(identity.total_kv_heads, producer_tp, identity.tp_size,
                                              identity.tp_rank, latent=identity.latent,
                                              has_heads=identity.head_dim >= 0)
                sources = Sources(host, port, producer_tp, tuple(plan), 1 + identity.head_dim)
            except KVConfigError as exc:
                sources = Sources(host, port, producer_tp, (), -1, refused=str(exc).removeprefix("kvbridge: "))
            if len(self._sources) >= _MAX_PLANS:
                self._sources.clear()
            self._sources[key] = sources
        for source in sources.plan:
            self._expected_peers[sources.address(source)] = (producer_tp, source.rank)
        return sources

    def close(self) -> None:
        self._loads.cancel_all()
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            try:
                buffer.close()
            except KVTransferError as exc:
                logger.warning("kvbridge: closing the lookup buffer: %s", exc)
        if self._producers is not None:
            # In-flight loads fail at once rather than wait for their entries, and loads waiting for
            # a connection are completed; then the attempts in flight end (bounded by their timeouts).
            self._producers.close()
        self._loads.close()  # waits for the load threads, drops drains not started yet
        total = self.total_stats()
        if not total.is_empty():
            logger.info("kvbridge totals: %s", total.reduce())

    # ------------------------------------------------------------------ producer

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
                request = _kv_request(spec.token_ids, PagedKV(caches, spec.block_ids))
                (result,) = send_kv_caches_and_hidden_states(self._buffer, [request],
                                                             timeout=self.settings.save_timeout, lend=self._lends)
        except KVTransferError as exc:  # a full buffer, or a closed one
            level = logging.WARNING if isinstance(exc, (KVBufferFullError, KVTimeoutError)) else logging.ERROR
            logger.log(level, "kvbridge: KV of request %s not saved: %s", spec.req_id, exc)
            self._add(save_failures=1, save_seconds=time.perf_counter() - start)
            return False
        self._kept[spec.req_id] = result.loan
        self._lent_blocks[spec.req_id] = len(spec.block_ids)
        if result.loan is None:
            self._track_copy(spec.req_id, spec.token_ids)
        self._add(saved_requests=1, lent_requests=int(result.loan is not None), saved_blocks=len(spec.block_ids),
                  saved_bytes=result.num_bytes, save_seconds=result.seconds)
        self._observe(transfer_seconds=result.seconds, save_copy_seconds=result.copy_seconds)
        return True

    def hold(self, req_ids: Iterable[str]) -> None:
        """vLLM finished these requests and keeps their blocks until :meth:`take_finished_sending`
        reports them (each was handed to this worker to save)."""
        now = time.monotonic()
        self._held.update(dict.fromkeys(req_ids, now))

    def take_back(self, req_ids: Iterable[str]) -> None:
        """Take back the entries of these saved requests before vLLM writes their blocks (from vLLM's
        ``handle_preemptions``, which runs before the step zeroes, copies or computes into any
        block): an entry still stored leaves the buffer; one lent out has its stamp cleared (its
        borrower's load fails and nothing it copied is used); one being copied out for a consumer
        that does not borrow is waited for at most ``kv_timeout``, and answered as a miss if it
        takes longer. Entries copied into the buffer hold no blocks and stay: the request's next
        save, after a preemption, keeps them. A request taken back is no longer kept: held by vLLM
        (finished), in this step or a later one, it is reported finished sending."""
        for req_id in req_ids:
            with self._copies_lock:
                saved_here = req_id in self._kept or req_id in self._copied
            if not saved_here:
                continue
            loan = self._kept.pop(req_id, None)
            self._lent_blocks.pop(req_id, None)
            _remember(self._released, req_id)
            if loan is None or loan.outcome is not None:
                continue
            self._add(taken_back=1)
            if not loan.take_back(self.settings.bridge.kv_timeout):
                logger.warning("kvbridge: the entry of request %s was still being copied out after %g s; that copy "
                               "is answered as a miss", req_id, self.settings.bridge.kv_timeout)

    def take_finished_sending(self) -> set[str]:
        """Held requests whose blocks this worker no longer needs, each once: saved by a copy, taken
        back, or lent and the loan has ended (taken and released, copied for a consumer on another
        host, expired, evicted, or copied into the buffer because nobody took it within
        ``kv_lend_lease`` of the request's end)."""
        self._end_overdue_loans()
        done = {req_id for req_id in self._held if req_id in self._released or (
            req_id in self._kept and (self._kept[req_id] is None or self._kept[req_id].outcome is not None))}
        for req_id in done:
            self._kept.pop(req_id, None)
            del self._held[req_id]
            with self._copies_lock:
                self._copied.pop(req_id, None)
                self._gone.discard(req_id)
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
                logger.warning("kvbridge: the entry of request %s could not be copied out of its blocks: %s",
                               req_id, exc)

    def _track_copy(self, req_id: str, token_ids: Sequence[int]) -> None:
        """``req_id`` was saved by a copy, stored under the match key of ``token_ids``: remember it
        until it is finished, and report it gone if its copy leaves the buffer before that."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        digest = MatchKey(tokens, np.ones(len(tokens), dtype=bool)).digest
        with self._copies_lock:
            early = self._early_departures.pop(digest, 0)
            if early:
                if early > 1:
                    self._early_departures[digest] = early - 1
                self._gone.add(req_id)
                return
            self._copy_keys.setdefault(digest, collections.deque()).append(req_id)
            _remember(self._copied, req_id)

    def _on_departed(self, key: MatchKey) -> None:
        """A copy under ``key`` left the buffer (a buffer thread, under its store's lock): the oldest
        copy this worker stored under it. A request still running whose copy left is reported gone
        (:meth:`take_gone`), and its next save after a preemption makes a new copy."""
        digest = key.digest
        with self._copies_lock:
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

    def take_gone(self) -> set[str]:
        """Requests saved by a copy whose copy left the buffer (taken by a select, evicted, expired)
        before the request was reported finished, since the last call, each once: announcing them
        would send a decode instance after an entry that is no longer there."""
        with self._copies_lock:
            gone, self._gone = self._gone, set()
            return gone

    def take_save_outcomes(self) -> tuple[set[str], set[str]]:
        """Request ids saved, and not saved, since the last call (vLLM asks once per step)."""
        outcomes = (self._saved, self._unsaved)
        self._saved, self._unsaved = set(), set()
        return outcomes

    # ------------------------------------------------------------------ consumer

    def start_loads(self, loads: Sequence[LoadSpec]) -> None:
        """Start each request's load (see :mod:`connector.vllm_loads`) and each drain (an entry whose
        blocks vLLM already holds); waits for neither a connection nor a transfer.

        A load takes a load thread only once its producer's connection is open
        (:meth:`lookup_buffer.ProducerConnections.when_ready`): loads naming a producer that is
        being connected to wait without a thread, and a producer that cannot be reached (the
        attempt failed, or it failed recently and its backoff has not passed) fails its own loads
        without ever taking one."""
        for spec in loads:
            if spec.drain:
                self._drain(spec)
                continue
            claimed = time.perf_counter()
            ticket = self._loads.begin(spec.req_id, spec.block_ids[spec.skip_blocks:])
            if self._producers is None:
                self._load_job(spec, ticket, claimed, KVConfigError("the consumer is not connected"))
            else:
                self._producers.when_ready(
                    self.producer_address(spec.producer, spec.producer_tp),
                    lambda ready, spec=spec, ticket=ticket, claimed=claimed: self._load_job(spec, ticket, claimed,
                                                                                            ready))

    def refuse_loads(self, refused: Mapping[str, Sequence[int]]) -> None:
        """Report each request in ``refused`` finished at once, its blocks failed: vLLM waits for
        every request it was told is loaded asynchronously, loadable or not."""
        for req_id, block_ids in refused.items():
            self._add(load_misses=1)
            self._loads.start(req_id, block_ids, lambda ticket, failed=frozenset(block_ids): failed)

    def take_finished_loads(self, finished_req_ids: Iterable[str] = ()) -> set[str]:
        """Requests whose load completed (hit or not) since the last call, each once; their failed
        blocks go to :meth:`take_failed_blocks` in the same call. ``finished_req_ids``: requests
        vLLM finished since the last call, whose in-flight loads must not write any more."""
        return self._loads.take_finished(finished_req_ids)

    def take_failed_blocks(self) -> set[int]:
        """Block ids of failed loads reported by :meth:`take_finished_loads`, each once."""
        return self._loads.take_failed_blocks()

    def _load_job(self, spec: LoadSpec, ticket: LoadTicket, claimed: float,
                  ready: KVLookupBufferBase | Exception) -> None:
        """One request's load once its producer's connection is ``ready``, or known not to be (an
        error): run the transfer in a load thread, or report the load failed at once. Called in the
        engine's thread or a dial thread; never blocks."""

        def conclude(reason: str | None, start: float) -> set[int]:
            """The blocks that failed, for a load that failed for ``reason`` (None: it did not)."""
            if not ticket.cancelled.is_set():
                self._observe(load_wait_seconds=time.perf_counter() - claimed)
            if reason is None or ticket.cancelled.is_set():
                # A finished request's blocks are not reported: vLLM may give them to another request.
                return set()
            logger.warning("kvbridge: KV of request %s (%d tokens) not loaded, vLLM recomputes it or fails the "
                           "request (kv_load_failure_policy): %s",
                           spec.req_id, len(spec.token_ids), reason)
            self._add(load_seconds=time.perf_counter() - start)
            return set(spec.block_ids[spec.skip_blocks:])

        def transfer(ticket: LoadTicket, buffer: KVLookupBufferBase) -> set[int]:
            start = time.perf_counter()
            return conclude(self._load_one(spec, ticket, buffer), start)

        try:
            if isinstance(ready, Exception):  # no connection: fails without taking a load thread
                self._add(load_errors=1)
                self._loads.finish(ticket, conclude(str(ready), time.perf_counter()))
            else:
                self._loads.run(ticket, lambda ticket: transfer(ticket, ready))
        except Exception:  # a bug here must not leave vLLM waiting for the request forever
            logger.exception("kvbridge: the load of request %s failed", spec.req_id)
            self._loads.finish(ticket, ticket.block_ids)

    def _load_one(self, spec: LoadSpec, ticket: LoadTicket, buffer: KVLookupBufferBase) -> str | None:
        """Load one request over ``buffer``, the open connection to its producer, in a load thread;
        return why it failed, or None on success (or when cancelled)."""
        caches = self._require_caches()
        address = self.producer_address(spec.producer, spec.producer_tp)
        target = _LoadTarget(caches, spec.block_ids, skip_blocks=spec.skip_blocks, cancelled=ticket.cancelled)
        request = _kv_request(spec.token_ids, target)
        try:
            timeout = self.settings.load_timeout if spec.wait else 0.0
            (result,) = recv_kv_caches_and_hidden_states(buffer, [request], timeout=timeout)
        except KVTransferError as exc:
            self._drop(address, buffer, exc)
            self._add(load_errors=1)
            return str(exc)
        if ticket.cancelled.is_set():
            # vLLM finished the request meanwhile; its entry, if any, was taken and dropped.
            if result.hit:
                self._add(drained=1)
            return None
        if not result.hit:
            self._add(load_misses=1)
            return result.reason
        self._add(load_hits=1, loaded_blocks=len(spec.block_ids) - spec.skip_blocks, loaded_bytes=result.num_bytes,
                  load_seconds=result.seconds)
        self._observe(transfer_seconds=result.seconds, load_entry_wait_seconds=result.wait_seconds,
                      load_receive_seconds=result.receive_seconds, load_copy_seconds=result.copy_seconds)
        return None

    def _drain(self, spec: LoadSpec) -> None:
        """Take and drop the entry of a request vLLM already holds, without waiting for it: in the
        loads' thread for work that reports nothing (:meth:`LoadTracker.start_unreported`), never in
        the engine's thread nor in a load thread, one drain at a time. Only over a connection that
        is open, at this call and when the drain runs: a drain never connects (an entry left behind
        expires at the producer). Nothing is reported to vLLM: the request does not wait for it."""
        producers = self._producers
        address = self.producer_address(spec.producer, spec.producer_tp)
        if producers is None or producers.connected(address) is None:
            return

        def drain() -> None:
            buffer = producers.connected(address)
            if buffer is None:  # dropped meanwhile
                return
            tokens = torch.tensor(spec.token_ids, dtype=torch.int64)
            try:
                # Borrowed, a lent entry is given back unread: nobody copies what is dropped. The
                # select does not wait for an entry, only (at most kv_timeout) for the answer.
                entry = buffer.drop_select(tokens, torch.ones_like(tokens, dtype=torch.bool), timeout=0, borrow=True)
            except KVTransferError as exc:
                self._drop(address, buffer, exc)
                return
            for item in entry:
                if isinstance(item, BorrowedTensor):
                    item.borrowing.forget()
            if entry[0] is not None:
                self._add(drained=1)

        self._loads.start_unreported(drain)

    # ------------------------------------------------------------------ stats

    def take_stats(self) -> tuple[TransferStats, Observations] | None:
        """Counters and observations since the last call, or None when nothing happened."""
        gauges = self.gauges()
        store = _entry_store(self._buffer)
        entry_waits = store.take_waits() if store is not None else []
        buffer = self.buffer_stats()
        dropped = {"expired_entries": buffer.expired if buffer is not None else 0,
                   "evicted_entries": buffer.evicted if buffer is not None else 0}
        with self._stats_lock:
            for name, value in gauges.items():
                change = value - self._reported_gauges[name]
                if change:
                    self._observed.gauges[name] = self._observed.gauges.get(name, 0) + change
                    self._reported_gauges[name] = value
            for name, count in dropped.items():
                if count > self._reported_dropped[name]:
                    self._interval.add(**{name: count - self._reported_dropped[name]})
                    self._total.add(**{name: count - self._reported_dropped[name]})
                    self._reported_dropped[name] = count
            if entry_waits:
                self._observed.phases.setdefault("entry_wait_seconds", []).extend(entry_waits)
            if self._interval.is_empty() and self._observed.is_empty():
                return None
            interval, self._interval = self._interval, TransferStats()
            observed, self._observed = self._observed, Observations()
            return interval, observed

    def buffer_stats(self) -> BufferStats | None:
        """The producer's lookup buffer counters (e.g. entries still held); None on a consumer."""
        return self._buffer.stats() if self._buffer is not None else None

    def gauges(self) -> dict[str, int]:
        """The current value of each of :data:`GAUGES`."""
        buffer = self.buffer_stats()
        lent = [req_id for req_id, loan in list(self._kept.items()) if loan is not None and loan.outcome is None]
        return {"connections": self.connections, "entries_held": buffer.entries if buffer is not None else 0,
                "bytes_buffered": buffer.bytes if buffer is not None else 0, "loans_out": len(lent),
                "blocks_lent": sum(self._lent_blocks.get(req_id, 0) for req_id in lent),
                "loads_in_flight": self._loads.in_flight()}

    @property
    def connections(self) -> int:
        """Connections open now: consumers connected to this producer, or producers this consumer uses."""
        if self._producers is not None:
            return self._producers.count
        if isinstance(self._buffer, BufferListener):
            return self._buffer.connections
        return 0

    def total_stats(self) -> TransferStats:
        """Counters since the start (a copy)."""
        with self._stats_lock:
            return self._total.copy()

    def _add(self, **counts: float) -> None:
        with self._stats_lock:
            self._interval.add(**counts)
            self._total.add(**counts)

    def _observe(self, transfer_seconds: float | None = None, load_wait_seconds: float | None = None,
                 **phases: float | None) -> None:
        """Record one event's values (None: not observed); ``phases`` by name of :data:`PHASES`."""
        with self._stats_lock:
            if transfer_seconds is not None:
                self._observed.transfer_seconds.append(transfer_seconds)
            if load_wait_seconds is not None:
                self._observed.load_wait_seconds.append(load_wait_seconds)
            for name, value in phases.items():
                if name not in PHASES:
                    raise KeyError(f"unknown kvbridge phase {name!r}")
                if value is not None:
                    self._observed.phases.setdefault(name, []).append(value)

    # ------------------------------------------------------------------ helpers

    @property
    def caches(self) -> list[torch.Tensor]:
        """The registered per-layer caches (empty before :meth:`connect`)."""
        return list(self._caches.caches) if self._caches is not None else []

    def _require_caches(self) -> PagedKVCaches:
        if self._caches is None:
            raise KVConfigError("kvbridge: KV caches were not registered")
        return self._caches

    def _drop(self, address: Address, buffer: KVLookupBufferBase, error: KVTransferError) -> None:
        """A connection failed: drop it (a later load connects again); a refused select, or an entry
        its producer took back, leaves it."""
        if isinstance(error, (KVTimeoutError, KVBufferFullError, KVInvalidRequestError, KVEntryTakenBackError)):
            return
        if self._producers is not None:
            self._producers.discard(address, buffer, error)


def _remember(requests: dict[str, None], req_id: str) -> None:
    """Add ``req_id`` to ``requests`` as the newest, forgetting the oldest beyond :data:`MAX_REMEMBERED`."""
    requests.pop(req_id, None)
    requests[req_id] = None
    while len(requests) > MAX_REMEMBERED:
        requests.pop(next(iter(requests)))


def _entry_store(buffer: KVLookupBufferBase | None) -> EntryStore | None:
    """The producer's entry store behind ``buffer`` (a BufferListener's, or a SimpleBuffer's
    producer's), whose taken entries' waits the stats report; None for any other buffer."""
    for owner in (buffer, getattr(buffer, "_side", None)):
        store = getattr(owner, "_store", None)
        if isinstance(store, EntryStore):
            return store
    return None


def _kv_request(token_ids: Sequence[int], kv: PagedKV) -> KVRequest:
    return KVRequest(input_tokens=torch.tensor(token_ids, dtype=torch.int64), kv=kv)


def _default_listener(settings: ConnectorSettings, port_offset: int, on_connect: OnConnect) -> KVLookupBufferBase:
    return BufferListener(settings.bridge, port_offset, on_connect, buffer_config=settings.buffer)


def _default_dialer(settings: ConnectorSettings, host: str, port: int,
                    on_connect: OnConnect | None) -> KVLookupBufferBase:
    return dial(settings.bridge, host, port, on_connect)
