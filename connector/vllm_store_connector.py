"""``KVBridgeConnector`` as a storage tier: what vLLM gets for ``kv_role="kv_both"`` with ``kv_store``.

:class:`connector.vllm_v1.KVBridgeConnector` builds this subclass for such a configuration; it
forwards vLLM's hooks to :mod:`connector.vllm_store` (see there for what it does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from connector.vllm_stats import KVBridgeStats
from connector.vllm_store import (
    StoreHandshake,
    StoreMetadata,
    StoreScheduler,
    StoreSettings,
    StoreStats,
    StoreWorker,
    config_identity,
    shared_tiers,
)
from connector.vllm_v1 import KVBridgeConnector
from connector.vllm_worker import find_layout
from kv_pipe import cores
from kv_pipe.errors import KVConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def open_store_sides(
    settings: StoreSettings,
    vllm_config: VllmConfig,
    role: KVConnectorRole,
    kv_cache_config: KVCacheConfig,
) -> tuple[StoreScheduler | None, StoreWorker | None]:
    """The store's side of an instance in ``role``: (its scheduler side, None) in vLLM's scheduler,
    (None, its worker side) in a worker.

    The scheduler looks up every TP rank's object of a chunk, in the shared tiers only (each
    worker's memory tier is out of its reach). The namespaces digest the workers' real cache
    layout, which only they know: the connector must pass the workers' :meth:`StoreWorker.handshake`
    to :meth:`StoreScheduler.adopt_handshakes` (vLLM's handshake metadata, :class:`StoreLayoutHandshake`)
    before the scheduler's first lookup."""
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    if role == KVConnectorRole.SCHEDULER:
        store = settings.open(shared_tiers(settings.tiers))
        try:
            return StoreScheduler(settings, vllm_config.cache_config.block_size, None, store), None
        except BaseException:
            store.close()
            raise
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    identity = config_identity(vllm_config, kv_cache_config, get_tensor_model_parallel_rank(), tp_size)
    return None, StoreWorker(settings, identity)


class StoreLayoutHandshake:
    """vLLM's handshake hooks for a connector with store sides (``_store_worker``,
    ``_store_scheduler``, from :func:`open_store_sides`): each worker tells its namespace, vLLM
    hands them all to the scheduler before the first request. The pipe exchanges its layouts on
    each connection (:mod:`connector.compat`), so this is all a worker's handshake metadata holds."""

    _store_worker: StoreWorker | None
    _store_scheduler: StoreScheduler | None
    _vllm_config: VllmConfig

    def get_handshake_metadata(self) -> StoreHandshake | None:
        return self._store_worker.handshake() if self._store_worker is not None else None

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self._store_scheduler is not None:
            self._store_scheduler.adopt_handshakes(metadata, self._vllm_config.parallel_config.tensor_parallel_size)


class KVBridgeStoreConnector(StoreLayoutHandshake, KVBridgeConnector):
    """Stores what the instance computes and loads what any instance stored; see :mod:`connector.vllm_store`."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        KVConnectorBase_V1.__init__(self, vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise KVConfigError("kvbridge's store needs vLLM's KV cache config (vLLM >= 0.32)")
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise KVConfigError("kvbridge does not support pipeline parallelism (pipeline_parallel_size > 1)")
        settings = StoreSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        cores.configure(settings.thread_cores)  # before the store's tiers start their writers
        self._block_size = vllm_config.cache_config.block_size
        self._scheduler, self._worker = None, None  # the transfer sides: none here
        self._store_scheduler, self._store_worker = open_store_sides(settings, vllm_config, role, kv_cache_config)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(kv_caches)
        caches = [kv_caches[name] for name in names]
        layout_name = self._layout_name(names[0])
        layout = find_layout(caches[0], self._kv_cache_config.num_blocks, self._block_size, layout_name)
        self._worker_side().register(caches, layout, layout_name)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        KVConnectorBase_V1.bind_connector_metadata(self, connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # A preempted request's blocks may be written once this returns: its save's gather, run in a
        # thread, is cancelled or waited for. vLLM does not preempt a request while its load is in flight.
        if not isinstance(kv_connector_metadata, StoreMetadata):
            raise KVConfigError(f"kvbridge store: unexpected connector metadata {type(kv_connector_metadata).__name__}")
        self._worker_side().preempt(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._store_metadata()
        self._worker_side().start_loads(meta.loads, meta.refused, meta.load_inline)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        worker = self._worker_side()
        sending = worker.take_finished_sending(finished_req_ids)
        return sending or None, worker.take_finished_loads(finished_req_ids) or None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # a chunk holds every layer: wait_for_save hands them all over at once

    def wait_for_save(self) -> None:
        self._worker_side().save(self._store_metadata().saves)  # copied out in a thread: see StoreWorker.save

    def build_connector_worker_meta(self) -> None:
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._store_worker.take_failed_blocks() if self._store_worker is not None else set()

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        stats = self._store_worker.take_stats() if self._store_worker is not None else None
        return stats if stats is not None and not stats.is_empty() else None

    def store_stats(self) -> StoreStats:
        """Worker: the store counters since the start (chunks and bytes loaded and saved)."""
        return self._worker_side().stats()

    def flush_saves(self, timeout: float = 30.0) -> None:
        """Worker: wait until every save handed over so far is in the store's fastest tier."""
        self._worker_side().flush(timeout)

    def shutdown(self) -> None:
        if self._store_worker is not None:
            self._store_worker.close()
        if self._store_scheduler is not None:
            self._store_scheduler.store.close()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = self._scheduler_side().num_new_matched_tokens(request, num_computed_tokens)
        return tokens, tokens > 0  # loaded asynchronously: vLLM keeps stepping its other requests

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._scheduler_side().after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        manager = self._kv_cache_manager
        if manager is None:
            raise KVConfigError("kvbridge: vLLM did not bind its KV cache manager to the connector")
        return self._scheduler_side().build_meta(scheduler_output, lambda req_id: manager.get_block_ids(req_id)[0])

    def update_connector_output(self, connector_output: Any) -> None:
        return

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request)

    # ------------------------------------------------------------------ helpers

    def _store_metadata(self) -> StoreMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, StoreMetadata):
            raise KVConfigError(f"kvbridge store: unexpected connector metadata {type(meta).__name__}")
        return meta

    def _worker_side(self) -> StoreWorker:
        if self._store_worker is None:
            raise KVConfigError("kvbridge: a worker-side hook was called on the scheduler-side connector")
        return self._store_worker

    def _scheduler_side(self) -> StoreScheduler:
        if self._store_scheduler is None:
            raise KVConfigError("kvbridge: a scheduler-side hook was called on the worker-side connector")
        return self._store_scheduler
