"""The connector's counters in the form vLLM's metrics loggers aggregate, log and export.

vLLM collects ``get_kv_connector_stats()`` from every worker each step, aggregates them with
``aggregate``, logs ``reduce()`` periodically ("KV Transfer metrics: ...") and hands ``data`` to
the connector's Prometheus metrics (:mod:`connector.vllm_prom`). The counters are those of
:class:`connector.transfer_stats.TransferStats`; beside them ``data`` holds the observations of
:class:`connector.vllm_worker.Observations`: per-transfer and per-load seconds and the phases of
:data:`connector.vllm_worker.PHASES` (lists, for histograms) and the change of each gauge of
:data:`connector.vllm_worker.GAUGES`.

A storage-tier instance (:mod:`connector.vllm_store`) reports its workers' store counters in the same
object: per tier (:data:`STORE_TIER_COUNTERS`, each a dict from tier name to the interval's count;
:data:`STORE_TIER_UP`, 1 or 0 per tier, sent when it changed), load errors per reason
(:data:`STORE_LOAD_ERRORS`) and the samples ``store_load_seconds`` and ``store_save_seconds``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from connector.transfer_stats import TransferStats
from connector.vllm_worker import GAUGES, PHASES, Observations

#: Keys of ``data`` holding one value per event (concatenated when aggregated): per transfer, per
#: load, and per-request phases (:data:`connector.vllm_worker.PHASES`).
SAMPLES = ("transfer_seconds", "load_wait_seconds", *PHASES, "store_load_seconds", "store_save_seconds")

#: Per-tier counters of a storage tier: chunks found and not found among those asked of the tier (a
#: miss in a faster tier asks the next), bytes of the chunks it returned and stored, objects evicted,
#: writes dropped before reaching it (queue full, tier down) and writes it failed (full, failing).
STORE_TIER_COUNTERS = (
    "store_hit_chunks",
    "store_miss_chunks",
    "store_read_bytes",
    "store_written_bytes",
    "store_evictions",
    "store_dropped_writes",
    "store_failed_writes",
)
#: Per tier: 1 while the workers reach it, 0 while one does not (the lowest report wins).
STORE_TIER_UP = "store_tier_up"
#: Chunks a load could not use, per reason (``missing``, a check such as ``checksum``, ``other layout``).
STORE_LOAD_ERRORS = "store_load_errors"
#: Keys of ``data`` whose dicts are added key by key when aggregated.
_SUMMED_BY_KEY = (*STORE_TIER_COUNTERS, STORE_LOAD_ERRORS)


@dataclasses.dataclass
class KVBridgeStats(TransferStats, KVConnectorStats):
    """kvbridge's counters and observations as a vLLM ``KVConnectorStats`` (``data`` is a plain dict)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in SAMPLES:
            self.data[name] = list(self.data.get(name, ()))
        for name in GAUGES:  # each holds the gauge's change (summed when aggregated)
            self.data.setdefault(name, 0)
        for name in (*_SUMMED_BY_KEY, STORE_TIER_UP):
            self.data[name] = dict(self.data.get(name) or {})

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> KVBridgeStats:
        return cls(data=dict(data or {}))

    @classmethod
    def of_worker(cls, counters: TransferStats, observed: Observations) -> KVBridgeStats:
        return cls(
            data={
                **counters.data,
                "transfer_seconds": observed.transfer_seconds,
                "load_wait_seconds": observed.load_wait_seconds,
                **{name: list(observed.phases.get(name, ())) for name in PHASES},
                **{name: observed.gauges.get(name, 0) for name in GAUGES},
            }
        )

    def aggregate(self, other: Any) -> Any:
        super().aggregate(other)
        for name in SAMPLES:
            self.data[name] = self.data[name] + list(other.data.get(name, ()))
        for name in GAUGES:
            self.data[name] += other.data.get(name, 0)
        for name in _SUMMED_BY_KEY:
            for key, value in (other.data.get(name) or {}).items():
                self.data[name][key] = self.data[name].get(key, 0) + value
        for tier, up in (other.data.get(STORE_TIER_UP) or {}).items():
            self.data[STORE_TIER_UP][tier] = min(self.data[STORE_TIER_UP].get(tier, up), up)
        return self

    def reset(self) -> None:
        super().reset()
        for name in SAMPLES:
            self.data[name] = []
        for name in GAUGES:
            self.data[name] = 0
        for name in (*_SUMMED_BY_KEY, STORE_TIER_UP):
            self.data[name] = {}

    def reduce(self) -> dict[str, int | float]:
        """The counters, the gauges' changes, how many transfers the interval saw, and the store's
        per-tier and per-reason numbers as ``name.key``."""
        keyed = (*_SUMMED_BY_KEY, STORE_TIER_UP)
        reduced = {name: value for name, value in super().reduce().items() if name not in (*SAMPLES, *keyed)}
        reduced["transfers"] = len(self.data["transfer_seconds"])
        for name in keyed:
            reduced.update({f"{name}.{key}": value for key, value in self.data[name].items()})
        return reduced

    def is_empty(self) -> bool:
        return (
            super().is_empty()
            and not any(self.data[name] for name in GAUGES)
            and not any(self.data[name] for name in SAMPLES)
            and not any(any(self.data[name].values()) for name in _SUMMED_BY_KEY)
            and not self.data[STORE_TIER_UP]
        )
