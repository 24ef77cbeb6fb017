"""kvbridge's Prometheus metrics in vLLM's ``/metrics``, with vLLM's labels (model name, engine).

vLLM builds them once per API server through ``KVBridgeConnector.build_prom_metrics`` and feeds
them each interval's aggregated stats ``data`` (:class:`connector.vllm_stats.KVBridgeStats`).

Series (``vllm:kvbridge_*``): every counter of :data:`connector.transfer_stats.COUNTERS` as a
Prometheus counter (``_total``); ``transfer_seconds`` (one save or load: gather and insert, or
select and write) and ``load_wait_seconds`` (from the claim of a request's KV to its blocks being
written, waiting for a late entry included) as histograms; the per-request phases of
:data:`connector.vllm_worker.PHASES` as histograms (prefill: the save's copy, an entry's wait in
the buffer until taken; decode: the wait for the entry, its receive, the copy into the cache); the gauges of
:data:`connector.vllm_worker.GAUGES` (connections, entries held, bytes buffered, loans out, blocks
lent, loads in flight), updated each engine step.

A storage tier (:mod:`connector.vllm_store`) adds, with a ``tier`` label: the counters of
:data:`connector.vllm_stats.STORE_TIER_COUNTERS` and the gauge ``store_tier_up``; with a ``reason``
label the counter ``store_load_errors``; and the histograms ``store_load_seconds`` (one request's
load: read, check, write) and ``store_save_seconds`` (one chunk's encoding and put).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, PromMetric, PromMetricT
from vllm.v1.metrics.utils import create_metric_per_engine

from connector.transfer_stats import COUNTERS
from connector.vllm_stats import SAMPLES, STORE_LOAD_ERRORS, STORE_TIER_COUNTERS, STORE_TIER_UP
from connector.vllm_worker import GAUGES

PREFIX = "vllm:kvbridge_"

_COUNTER_HELP = {
    "saved_requests": "Requests whose KV the prefill instance inserted into its lookup buffer.",
    "saved_blocks": "KV blocks inserted into the lookup buffer.",
    "saved_bytes": "Bytes of KV inserted into the lookup buffer.",
    "save_failures": "Requests whose KV could not be inserted (buffer full, peer lost).",
    "save_seconds": "Seconds spent gathering and inserting KV.",
    "lent_requests": "Saved requests whose KV blocks were lent where they lie instead of copied.",
    "returned_requests": "Saved requests whose KV blocks the prefill instance handed back to vLLM.",
    "unlent_requests": "Lent entries the prefill instance copied into its buffer, nobody having taken them "
    "within kv_lend_lease, to hand their blocks back to vLLM.",
    "taken_back": "Saved requests whose entry the prefill instance took back (preempted, or not announced: a TP "
    "rank's save failed or its entry left).",
    "load_hits": "Requests whose KV the decode instance loaded.",
    "load_misses": "Loads without a usable entry within kv_load_timeout.",
    "load_errors": "Loads failed by a transport error (peer lost, protocol).",
    "loaded_blocks": "KV blocks written into vLLM's cache.",
    "loaded_bytes": "Bytes of KV received for hits.",
    "load_seconds": "Seconds spent waiting for, receiving and writing KV.",
    "drained": "Entries taken and dropped (vLLM held their blocks, or the request was aborted).",
    "expired_entries": "Entries the prefill instance dropped: no decode instance took them within kv_entry_timeout.",
    "evicted_entries": "Entries the prefill instance dropped, untaken, to make room for newer ones (buffer full).",
}

_HISTOGRAM_HELP = {
    "transfer_seconds": "Seconds of one transfer: a save (gather and insert) or a load (select and write).",
    "load_wait_seconds": "Seconds from the claim of a request's KV to its blocks being written.",
    # Per-request phases (connector.vllm_worker.PHASES). Prefill instance:
    "save_copy_seconds": "Seconds of a save spent packing the KV blocks into the buffer's memory (a copy), or "
    "describing where they lie (lent).",
    "entry_wait_seconds": "Seconds an entry waited in the prefill instance's buffer, from its store until a "
    "decode instance's select took it (the count: entries taken).",
    # Decode instance, per load that hit:
    "load_entry_wait_seconds": "Seconds from a load's select sent until its entry's header (or lent descriptor) "
    "arrived: the wait for the prefill instance.",
    "load_receive_seconds": "Seconds from a copied entry's header until its bytes were received (not observed "
    "for a lent entry, whose bytes the copy reads).",
    "load_copy_seconds": "Seconds writing a loaded entry into vLLM's KV cache blocks (for a lent entry the "
    "only copy, straight out of the prefill instance's memory).",
    # Storage tier:
    "store_load_seconds": "Seconds of one request's load from the store: reading, checking and writing its chunks.",
    "store_save_seconds": "Seconds of one chunk's save into the store: encoding it and putting it into the "
    "fastest tier (slower tiers are written in the background).",
}

_STORE_HELP = {
    "store_hit_chunks": "Chunks a store tier returned (a chunk a faster tier missed is asked of the next).",
    "store_miss_chunks": "Chunks a store tier was asked for and did not hold.",
    "store_read_bytes": "Bytes of the chunks a store tier returned.",
    "store_written_bytes": (
        "Bytes of the chunks a store tier stored (saves, and copies of chunks a slower tier served)."
    ),
    "store_evictions": "Objects a store tier evicted to stay under its capacity.",
    "store_dropped_writes": "Writes to a slower store tier not made: its queue was full, it was unreachable, or "
    "the store closed.",
    "store_failed_writes": "Writes a store tier failed: full, or failing.",
    STORE_TIER_UP: "1 while the workers reach the store tier, 0 while one does not.",
    STORE_LOAD_ERRORS: "Chunks a store load could not use, by reason (missing, a failed check, another layout): "
    "their blocks are load errors.",
}

_GAUGE_HELP = {
    "connections": "Open kvbridge connections: decode instances connected to this prefill instance, or prefill "
    "instances this decode instance loads from (per TP rank).",
    "entries_held": "Entries the prefill instance holds for decode instances now.",
    "bytes_buffered": "Bytes of the entries the prefill instance holds now (lent or copied).",
    "loans_out": "Saved requests whose KV blocks vLLM keeps for kvbridge now (lent, not yet handed back).",
    "blocks_lent": "KV blocks vLLM keeps for kvbridge now.",
    "loads_in_flight": "Loads the decode instance has started and not yet reported to vLLM.",
}

#: From 1 ms to 60 s: a hit on one host takes milliseconds, a late entry up to kv_load_timeout.
_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
#: The phases from 100 µs (a lent save, a small copy) to 10 minutes (an entry waiting out kv_entry_timeout).
_PHASE_BUCKETS = [0.0001, 0.00025, 0.0005, *_BUCKETS, 120.0, 300.0, 600.0]
#: The samples on :data:`_BUCKETS`; the phases and the store's (a chunk put into memory: microseconds) on
#: :data:`_PHASE_BUCKETS`.
_TRANSFER_SAMPLES = ("transfer_seconds", "load_wait_seconds")


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """Registers kvbridge's series and records each interval's stats into them."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {name: self._per_engine(self._counter_cls, name, _COUNTER_HELP[name]) for name in COUNTERS}
        self._histograms = {
            name: self._per_engine(
                self._histogram_cls,
                name,
                _HISTOGRAM_HELP[name],
                buckets=_BUCKETS if name in _TRANSFER_SAMPLES else _PHASE_BUCKETS,
            )
            for name in SAMPLES
        }
        self._gauges = {name: self._per_engine(self._gauge_cls, name, _GAUGE_HELP[name]) for name in GAUGES}
        # name -> (metric with the extra label, its children per (engine, label value)), made when first seen
        self._keyed: dict[str, tuple[Any, dict[tuple[int, str], Any]]] = {
            name: (
                self._counter_cls(
                    name=PREFIX + name, documentation=_STORE_HELP[name], labelnames=[*self._labelnames, "tier"]
                ),
                {},
            )
            for name in STORE_TIER_COUNTERS
        }
        self._keyed[STORE_LOAD_ERRORS] = (
            self._counter_cls(
                name=PREFIX + STORE_LOAD_ERRORS,
                documentation=_STORE_HELP[STORE_LOAD_ERRORS],
                labelnames=[*self._labelnames, "reason"],
            ),
            {},
        )
        self._keyed[STORE_TIER_UP] = (
            self._gauge_cls(
                name=PREFIX + STORE_TIER_UP,
                documentation=_STORE_HELP[STORE_TIER_UP],
                labelnames=[*self._labelnames, "tier"],
            ),
            {},
        )

    def _per_engine(self, cls: type[PromMetric], name: str, documentation: str, **kwargs: Any) -> dict[int, Any]:
        metric = cls(name=PREFIX + name, documentation=documentation, labelnames=self._labelnames, **kwargs)
        return create_metric_per_engine(metric, self.per_engine_labelvalues)

    def _child(self, name: str, engine_idx: int, key: str) -> Any:
        metric, children = self._keyed[name]
        child = children.get((engine_idx, key))
        if child is None:
            child = children[engine_idx, key] = metric.labels(*self.per_engine_labelvalues[engine_idx], key)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, counter in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counter[engine_idx].inc(value)
        for name, histogram in self._histograms.items():
            for value in transfer_stats_data.get(name, ()):
                histogram[engine_idx].observe(value)
        for name, gauge in self._gauges.items():
            change = transfer_stats_data.get(name, 0)
            if change:
                gauge[engine_idx].inc(change)
        for name in (*STORE_TIER_COUNTERS, STORE_LOAD_ERRORS):
            for key, value in (transfer_stats_data.get(name) or {}).items():
                if value:
                    self._child(name, engine_idx, key).inc(value)
        for tier, up in (transfer_stats_data.get(STORE_TIER_UP) or {}).items():
            self._child(STORE_TIER_UP, engine_idx, tier).set(up)
