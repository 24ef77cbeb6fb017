"""Transfer counters of the vLLM connector's worker side (no vLLM import; see :mod:`connector.vllm_stats`).

All counters are sums, so merging intervals or TP ranks is addition.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: Counter names. Producer: saves; consumer: loads (hits + misses + errors = load attempts).
COUNTERS = (
    "saved_requests",  # entries inserted into the lookup buffer
    "saved_blocks",
    "saved_bytes",
    "save_failures",  # requests whose KV could not be inserted (buffer full, peer gone)
    "save_seconds",  # time spent gathering and inserting
    "lent_requests",  # saved requests whose blocks were lent, not copied (a subset of saved_requests)
    "returned_requests",  # saved requests whose blocks vLLM was told it may free (finished sending)
    "unlent_requests",  # lent entries copied into the buffer when nobody took them within kv_lend_lease
    "taken_back",  # saved requests whose entry was taken back (vLLM preempted the request) or withdrawn, loan or copy
    "load_hits",  # requests whose KV was loaded
    "load_misses",  # no entry within kv_load_timeout, or an entry that failed the checks
    "load_errors",  # transport errors (peer lost, pipe closed, protocol)
    "loaded_blocks",  # blocks written into vLLM's cache
    "loaded_bytes",  # bytes received for hits
    "load_seconds",  # time spent waiting for, receiving and writing entries
    "drained",  # entries taken and dropped: vLLM's prefix cache already held their blocks
    "expired_entries",  # producer: entries no consumer took within kv_entry_timeout, dropped
    "evicted_entries",  # producer: entries nobody had taken when the full buffer made room for newer ones
)


@dataclasses.dataclass
class TransferStats:
    """Counters since the last :meth:`reset`; ``data`` maps each name of :data:`COUNTERS` to a number.

    Not thread-safe: the owner serialises access.
    """

    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, **counts: float) -> None:
        for name, value in counts.items():
            if name not in self.data:
                raise KeyError(f"unknown kvbridge counter {name!r}")
            self.data[name] += value

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: Any) -> Any:
        """Add ``other``'s counters to this object's and return it (vLLM's aggregation protocol)."""
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(value, 4) if isinstance(value, float) else value for name, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in COUNTERS)

    def copy(self) -> Any:
        return type(self)(data=dict(self.data))
