"""A test-only vLLM connector: kvbridge's, except that a decode rank of another TP size than its
prefill instance puts the KV heads it loads in the wrong places.

vLLM loads it like any external connector::

    kv_transfer_config={"kv_connector": "HeadSwappingKVBridgeConnector",
                        "kv_connector_module_path": "harness.swapping_connector", ...}

It is the negative control of the TP engine tests (tests/serving/test_tensor_parallel_engines.py): a decode
rank that gathers several prefill ranks' entries takes them in reverse order, one that takes part of
a prefill rank's heads takes the mirror part. Every byte still moves and every load still succeeds,
so only the outputs can tell that each head must land in its own slice.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from connector.tp_layout import Source
from connector.tp_sources import Sources
from connector.vllm_consumer_worker import ConsumerWorker
from connector.vllm_v1 import KVBridgeConnector
from lookup_buffer.connections import Address

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig


class HeadSwappingWorker(ConsumerWorker):
    def producer_address(self, named: Address | None, producer_tp: int | None = None) -> Address | Sources:
        address = super().producer_address(named, producer_tp)
        if not isinstance(address, Sources) or not address.plan:
            return address
        plan = address.plan
        if len(plan) > 1:  # each source's heads go where another's belong
            swapped = tuple(
                Source(theirs.rank, theirs.part, mine.heads) for mine, theirs in zip(plan, reversed(plan), strict=True)
            )
        else:
            (source,) = plan
            held = self.identity.total_kv_heads // address.producer_tp
            start, stop = source.part
            swapped = (Source(source.rank, (held - stop, held - start), source.heads),)
        return dataclasses.replace(address, plan=swapped)


class HeadSwappingKVBridgeConnector(KVBridgeConnector):
    """:class:`connector.vllm_v1.KVBridgeConnector` with a :class:`HeadSwappingWorker`."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self._worker is not None:  # not connected yet: the worker connects in register_kv_caches
            self._worker = HeadSwappingWorker(self._worker.settings, self._worker.identity, self._worker.port_offset)
