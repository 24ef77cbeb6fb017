"""How a producer's lookup buffer keeps its entries: the settings only the buffer reads.

The transport's settings (:class:`kv_pipe.KVTransferConfig`) say how to reach the peer and how many
bytes to hold; these say what the producer's entries become when nobody selects them. A consumer
holds no entries and has none of these.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from kv_pipe.config import ENV_PREFIX, parse_bool
from kv_pipe.errors import KVConfigError


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    """What a producer's lookup buffer does with entries nobody selects.

    Attributes:
        kv_entry_timeout: seconds a producer keeps an entry that no consumer selects (its client
            went away, or a router sent the request elsewhere) before dropping it and freeing its
            bytes.
        kv_evict_unclaimed: what the buffer does when an insert does not fit in ``kv_buffer_size``.
            False (the default): the insert waits for selects or expiry to free room, up to its
            timeout (backpressure: nothing inserted is lost). True: the oldest entries no consumer
            has selected yet are evicted until it fits, so entries whose consumer never comes give
            way to new ones instead of filling the budget until they expire. The vLLM connector
            turns it on.
    """

    kv_entry_timeout: float = 480.0
    kv_evict_unclaimed: bool = False

    def __post_init__(self) -> None:
        value = self.kv_entry_timeout
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise KVConfigError(f"kv_entry_timeout must be a positive, finite number of seconds, got {value!r}")
        if not isinstance(self.kv_evict_unclaimed, bool):
            raise KVConfigError(f"kv_evict_unclaimed must be true or false, got {self.kv_evict_unclaimed!r}")

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The names of the settings (the keys :meth:`from_dict` takes)."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> BufferConfig:
        """Build from a mapping; unknown keys are an error."""
        unknown = sorted(set(values) - set(cls.fields()))
        if unknown:
            raise KVConfigError(f"unknown lookup buffer config keys {unknown}; known keys: {sorted(cls.fields())}")
        return cls(**dict(values))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BufferConfig:
        """Build from ``KVBRIDGE_KV_ENTRY_TIMEOUT`` (seconds) and ``KVBRIDGE_KV_EVICT_UNCLAIMED``
        (``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``); unset ones keep their default."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        key = ENV_PREFIX + "KV_ENTRY_TIMEOUT"
        if key in env:
            try:
                values["kv_entry_timeout"] = float(env[key])
            except ValueError:
                raise KVConfigError(f"environment variable {key} must be a number, got {env[key]!r}") from None
        key = ENV_PREFIX + "KV_EVICT_UNCLAIMED"
        if key in env:
            values["kv_evict_unclaimed"] = parse_bool(key, env[key])
        return cls(**values)
