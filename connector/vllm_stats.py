"""The connector's counters in the form vLLM's metrics loggers aggregate, log and export.

vLLM collects ``get_kv_connector_stats()`` from every worker each step, aggregates them with
``aggregate``, logs ``reduce()`` periodically ("KV Transfer metrics: ...") and hands ``data`` to
the connector's Prometheus metrics (:mod:`connector.vllm_prom`). The counters are those of
:class:`connector.transfer_stats.TransferStats`; beside them ``data`` holds the observations of
:class:`connector.vllm_worker.Observations`: per-transfer and per-load seconds and the phases of
:data:`connector.vllm_worker.PHASES` (lists, for histograms) and the change of each gauge of
:data:`connector.vllm_worker.GAUGES`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from connector.transfer_stats import TransferStats
from connector.vllm_worker import GAUGES, PHASES, Observations

#: Keys of ``data`` holding one value per event (concatenated when aggregated): per transfer, per
#: load, and per-request phases (:data:`connector.vllm_worker.PHASES`).
SAMPLES = ("transfer_seconds", "load_wait_seconds", *PHASES)


@dataclasses.dataclass
class KVBridgeStats(TransferStats, KVConnectorStats):
    """kvbridge's counters and observations as a vLLM ``KVConnectorStats`` (``data`` is a plain dict)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in SAMPLES:
            self.data[name] = list(self.data.get(name, ()))
        for name in GAUGES:  # each holds the gauge's change (summed when aggregated)
            self.data.setdefault(name, 0)

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> KVBridgeStats:
        return cls(data=dict(data or {}))

    @classmethod
    def of_worker(cls, counters: TransferStats, observed: Observations) -> KVBridgeStats:
        return cls(data={**counters.data, "transfer_seconds": observed.transfer_seconds,
                         "load_wait_seconds": observed.load_wait_seconds,
                         **{name: list(observed.phases.get(name, ())) for name in PHASES},
                         **{name: observed.gauges.get(name, 0) for name in GAUGES}})

    def aggregate(self, other: Any) -> Any:
        super().aggregate(other)
        for name in SAMPLES:
            self.data[name] = self.data[name] + list(other.data.get(name, ()))
        for name in GAUGES:
            self.data[name] += other.data.get(name, 0)
        return self

    def reset(self) -> None:
        super().reset()
        for name in SAMPLES:
            self.data[name] = []
        for name in GAUGES:
            self.data[name] = 0

    def reduce(self) -> dict[str, int | float]:
        """The counters, the gauges' changes, and how many transfers the interval saw."""
        reduced = {name: value for name, value in super().reduce().items() if name not in SAMPLES}
        reduced["transfers"] = len(self.data["transfer_seconds"])
        return reduced

    def is_empty(self) -> bool:
        return (super().is_empty() and not any(self.data[name] for name in GAUGES)
                and not any(self.data[name] for name in SAMPLES))
