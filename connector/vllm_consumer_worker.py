"""The consumer's worker of the vLLM connector: connections to producers, and loads into vLLM's blocks.

A consumer worker connects to a producer when a load first names it
(:class:`lookup_buffer.ProducerConnections`), in a dial thread of that producer's, and keeps the
connection for later requests; a load takes a load thread only once its producer is connected, so
a producer that cannot be reached never holds up another's loads. Loads are asynchronous: each
runs in a load thread (:mod:`connector.vllm_loads`) while vLLM keeps stepping its other requests,
and writes straight into the blocks vLLM allocated. With tensor parallelism each rank loads the
heads it holds from the prefill ranks that hold them (:mod:`connector.tp_sources`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import torch

from connector import tp_layout
from connector.kv_transfer import recv_kv_caches_and_hidden_states
from connector.paged import PagedKV
from connector.tp_sources import SourceConnections, Sources
from connector.transfer_plan import LoadSpec
from connector.vllm_loads import LoadTicket, LoadTracker
from connector.vllm_worker import WorkerSide, kv_request
from kv_pipe.errors import KVBufferFullError, KVConfigError, KVTimeoutError, KVTransferError
from lookup_buffer import ProducerConnections
from lookup_buffer.base import KVLookupBufferBase
from lookup_buffer.connections import Address
from lookup_buffer.errors import KVEntryTakenBackError, KVInvalidRequestError
from lookup_buffer.loans import BorrowedTensor

logger = logging.getLogger(__name__)

#: Most prefill instances of another TP size whose sources a consumer rank keeps planned.
_MAX_PLANS = 1024


@dataclasses.dataclass(frozen=True)
class _LoadTarget(PagedKV):
    """A request's transfer-prefix blocks, of which only those from ``skip_blocks`` on are selected
    (the entry's span of them: the rest never travels) and written."""

    skip_blocks: int = 0
    cancelled: threading.Event | None = None  # set once vLLM no longer holds the blocks: write nothing

    @property
    def span(self) -> tuple[int, int, int] | None:
        if not self.skip_blocks:
            return None
        return 1 + self.caches.layout.block_dim, self.skip_blocks, len(self.block_ids)

    def _written(self) -> PagedKV:
        return PagedKV(self.caches, self.block_ids[self.skip_blocks :])

    def mismatch(self, key: torch.Tensor | None, value: torch.Tensor | None) -> str | None:
        return self._written().mismatch(key, value)

    def load(self, key: torch.Tensor, value: torch.Tensor | None) -> None:
        # vLLM keeps a waiting request's blocks until its load is reported finished, so a write
        # that started before the abort became known still lands in blocks the request owns.
        if self.cancelled is None or not self.cancelled.is_set():
            self._written().load(key, value)

    def load_borrowed(self, key: BorrowedTensor, value: torch.Tensor | None) -> None:
        if self.cancelled is None or not self.cancelled.is_set():
            self._written().load_borrowed(key, value)


class ConsumerWorker(WorkerSide):
    """A decode instance's TP rank (``kv_consumer``): see the module docstring and :class:`WorkerSide`."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._producers: ProducerConnections | None = None
        self._loads = LoadTracker()
        # The prefill TP size and rank expected at each address dialed (checked on connecting), and
        # the sources of each prefill instance of another TP size, by (host, port, TP size).
        self._expected_peers: dict[Address, tuple[int, int]] = {}
        self._sources: dict[tuple[str, int, int], Sources] = {}

    def _open(self) -> None:
        """Get ready to connect to producers as loads name them."""
        settings = self.settings
        # Each connection is checked against the prefill rank this rank dialed it for.
        self._producers = SourceConnections(
            ProducerConnections(
                settings.bridge,
                self._check_peer,
                connect=lambda config, host, port, on_connect: self._dialer(
                    settings, host, port, functools.partial(self._check_peer, address=(host, port))
                ),
            )
        )
        super()._open()

    def _close(self) -> None:
        self._loads.cancel_all()
        if self._producers is not None:
            # In-flight loads fail at once rather than wait for their entries, and loads waiting for
            # a connection are completed; then the attempts in flight end (bounded by their timeouts).
            self._producers.close()
        self._loads.close()  # waits for the load threads, drops drains not started yet
        super()._close()

    def _expected_peer(self, address: Address | None) -> tuple[int, int] | None:
        return self._expected_peers.get(address) if address is not None else None

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
                plan = tp_layout.plan_sources(
                    identity.total_kv_heads,
                    producer_tp,
                    identity.tp_size,
                    identity.tp_rank,
                    latent=identity.latent,
                    has_heads=identity.head_dim >= 0,
                )
                sources = Sources(host, port, producer_tp, tuple(plan), 1 + identity.head_dim)
            except KVConfigError as exc:
                sources = Sources(host, port, producer_tp, (), -1, refused=str(exc).removeprefix("kvbridge: "))
            if len(self._sources) >= _MAX_PLANS:
                self._sources.clear()
            self._sources[key] = sources
        for source in sources.plan:
            self._expected_peers[sources.address(source)] = (producer_tp, source.rank)
        return sources

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
            ticket = self._loads.begin(spec.req_id, spec.block_ids[spec.skip_blocks :])
            if self._producers is None:
                self._load_job(spec, ticket, claimed, KVConfigError("the consumer is not connected"))
            else:
                self._producers.when_ready(
                    self.producer_address(spec.producer, spec.producer_tp),
                    lambda ready, spec=spec, ticket=ticket, claimed=claimed: self._load_job(
                        spec, ticket, claimed, ready
                    ),
                )

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

    def _load_job(
        self, spec: LoadSpec, ticket: LoadTicket, claimed: float, ready: KVLookupBufferBase | Exception
    ) -> None:
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
            logger.warning(
                "kvbridge: KV of request %s (%d tokens) not loaded, vLLM recomputes it or fails the "
                "request (kv_load_failure_policy): %s",
                spec.req_id,
                len(spec.token_ids),
                reason,
            )
            self._add(load_seconds=time.perf_counter() - start)
            return set(spec.block_ids[spec.skip_blocks :])

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
        request = kv_request(spec.token_ids, target)
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
        self._add(
            load_hits=1,
            loaded_blocks=len(spec.block_ids) - spec.skip_blocks,
            loaded_bytes=result.num_bytes,
            load_seconds=result.seconds,
        )
        self._observe(
            transfer_seconds=result.seconds,
            load_entry_wait_seconds=result.wait_seconds,
            load_receive_seconds=result.receive_seconds,
            load_copy_seconds=result.copy_seconds,
        )
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
        layout = self._require_caches().layout

        def drain() -> None:
            buffer = producers.connected(address)
            if buffer is None:  # dropped meanwhile
                return
            tokens = torch.tensor(spec.token_ids, dtype=torch.int64)
            blocks = len(spec.block_ids)
            try:
                # Borrowed, a lent entry is given back unread: nobody copies what is dropped; a copied
                # one sends only its last block (a span). The select does not wait for an entry, only
                # (at most kv_timeout) for the answer.
                entry = buffer.drop_select(
                    tokens,
                    torch.ones_like(tokens, dtype=torch.bool),
                    timeout=0,
                    borrow=True,
                    span=(1 + layout.block_dim, blocks - 1, blocks),
                )
            except KVTransferError as exc:
                self._drop(address, buffer, exc)
                return
            for item in entry:
                if isinstance(item, BorrowedTensor):
                    item.borrowing.forget()
            if entry[0] is not None:
                self._add(drained=1)

        self._loads.start_unreported(drain)

    def _drop(self, address: Address, buffer: KVLookupBufferBase, error: KVTransferError) -> None:
        """A connection failed: drop it (a later load connects again); a refused select, or an entry
        its producer took back, leaves it."""
        if isinstance(error, (KVTimeoutError, KVBufferFullError, KVInvalidRequestError, KVEntryTakenBackError)):
            return
        if self._producers is not None:
            self._producers.discard(address, buffer, error)

    def _gauges(self, gauges: dict[str, int]) -> None:
        super()._gauges(gauges)
        gauges["loads_in_flight"] = self._loads.in_flight()
        if self._producers is not None:
            gauges["connections"] += self._producers.count
