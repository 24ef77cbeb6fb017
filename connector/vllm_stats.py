"""The connector's counters in the form vLLM's metrics loggers aggregate and log.

vLLM collects ``get_kv_connector_stats()`` from every worker each step, aggregates them with
``aggregate``, and logs ``reduce()`` periodically ("KV Transfer metrics: ..."). The counters are
those of :class:`connector.transfer_stats.TransferStats`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from connector.transfer_stats import TransferStats


@dataclasses.dataclass
class KVBridgeStats(TransferStats, KVConnectorStats):
    """kvbridge's counters as a vLLM ``KVConnectorStats`` (serialisable: ``data`` is a plain dict)."""

    @classmethod
    def from_data(cls, data: dict[str, Any] | None) -> KVBridgeStats:
        return cls(data=dict(data or {}))
