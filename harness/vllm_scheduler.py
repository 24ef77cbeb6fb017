"""vLLM's own ``Scheduler`` in the test's process with kvbridge's connector loaded from a kv-transfer
config, as vLLM loads it, and a worker-side connector with caches registered; no model runs (the
tiny Llama only gives vLLM a model configuration). :class:`AsyncSteps` drives such a scheduler as
vLLM's engine loop does with asynchronous scheduling."""

from __future__ import annotations

import copy
import types
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from harness import vllm_procs as vp


def tiny_model_config(path: Path) -> ModelConfig:
    """vLLM's configuration of a tiny Llama made under ``path``, with block hashing set up as
    EngineCore sets it up before it hashes any block."""
    init_none_hash(sha256)
    model = vp.make_tiny_llama(path)
    return ModelConfig(model=model, dtype="float32", seed=0, max_model_len=512, skip_tokenizer_init=True)


#: The producer port the connector announces (its scheduler side opens nothing).
PRODUCER_PORT = 14579


def _configs(
    model_config: ModelConfig,
    role: str,
    num_blocks: int,
    failure_policy: str,
    extra: dict[str, Any] | None,
    spec: FullAttentionSpec,
    layer_names: list[str],
    port: int = PRODUCER_PORT,
) -> tuple[VllmConfig, KVCacheConfig]:
    """vLLM's configuration of an instance of ``num_blocks`` blocks whose connector is
    KVBridgeConnector in ``role``, and its KV cache configuration: one group of ``layer_names``."""
    transfer = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_connector_module_path="connector.vllm_v1",
        kv_role=role,
        kv_port=port,
        kv_load_failure_policy=failure_policy,
        kv_connector_extra_config=extra if extra is not None else {"kv_ip": "127.0.0.1"},
    )
    config = VllmConfig(
        model_config=copy.deepcopy(model_config),  # VllmConfig adjusts the one it gets
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=vp.BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    kv_cache = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layer_names, spec)]
    )
    return config, kv_cache


def make_scheduler(
    model_config: ModelConfig,
    role: str,
    num_blocks: int = 64,
    failure_policy: str = "fail",
    extra: dict[str, Any] | None = None,
    async_scheduling: bool = False,
) -> Scheduler:
    """A Scheduler of ``num_blocks`` blocks whose connector is KVBridgeConnector in ``role``, with
    ``kv_connector_extra_config`` ``extra`` (default: kv_ip only). ``async_scheduling``: vLLM's
    AsyncScheduler, configured as on a GPU (vLLM's CPU platform turns asynchronous scheduling off in
    its configuration; here it is set back, so that vLLM plans for two batches in flight)."""
    spec = FullAttentionSpec(block_size=vp.BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config, kv_cache = _configs(model_config, role, num_blocks, failure_policy, extra, spec, ["layer"])
    config.scheduler_config.async_scheduling = async_scheduling
    assert config.max_concurrent_batches == (2 if async_scheduling else 1)
    return (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config=config,
        kv_cache_config=kv_cache,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=vp.BLOCK_SIZE,
    )


#: The tiny Llama's attention layers, KV heads and head size (:func:`harness.vllm_procs.make_tiny_llama`).
TINY_LAYERS = [f"model.layers.{index}.self_attn.attn" for index in range(2)]
TINY_KV_HEADS, TINY_HEAD_SIZE = 2, 64


def make_worker_connector(
    model_config: ModelConfig, role: str, port: int, extra: dict[str, Any], caches: list[torch.Tensor], isa: str
) -> KVConnectorBase_V1:
    """The worker-side connector of TP rank 0 of 1 of an instance of the tiny Llama whose connector
    is KVBridgeConnector in ``role`` at ``kv_port`` ``port`` with ``kv_connector_extra_config``
    ``extra``, with ``caches`` (one per layer of :data:`TINY_LAYERS`, vLLM's CPU shape ``[blocks,
    heads, block size, 2 x head size]``) registered as vLLM registers them, its attention layers on
    CPU attention of the interior variant ``isa``. No model runs and vLLM's distributed state is not
    set up: the connector is told rank 0 of 1."""
    from vllm.distributed import parallel_state

    from connector.vllm_v1 import KVBridgeConnector

    spec = FullAttentionSpec(
        block_size=vp.BLOCK_SIZE, num_kv_heads=TINY_KV_HEADS, head_size=TINY_HEAD_SIZE, dtype=torch.float32
    )
    config, kv_cache = _configs(model_config, role, caches[0].shape[0], "recompute", extra, spec, TINY_LAYERS, port)
    backend = types.SimpleNamespace(get_name=lambda: "CPU_ATTN")
    layers = config.compilation_config.static_forward_context
    layers.update({name: types.SimpleNamespace(attn_backend=backend, isa=isa) for name in TINY_LAYERS})
    with (
        mock.patch.object(parallel_state, "get_tensor_model_parallel_rank", return_value=0),
        mock.patch.object(parallel_state, "get_tensor_model_parallel_world_size", return_value=1),
    ):
        connector = KVBridgeConnector(config, KVConnectorRole.WORKER, kv_cache)
    connector.register_kv_caches(dict(zip(TINY_LAYERS, caches, strict=True)))
    return connector


class AsyncSteps:
    """vLLM's engine loop with asynchronous scheduling (``EngineCore.step_with_batch_queue``, a queue
    of two batches) over ``scheduler``, and one worker-side ``connector`` over ``caches`` (vLLM's CPU
    layout ``[blocks, heads, block size, 2 x head size]``): step N+1 is scheduled before the
    scheduler takes in step N's output. The worker runs each step as soon as it is scheduled, hooks
    in the order of vLLM's model runner: ``handle_preemptions``, the forward pass (fresh random KV
    written into the slots of every token the step computes, as a model would, into blocks that may
    have been another request's a step ago), ``bind_connector_metadata``, ``start_load_kv``,
    ``wait_for_save``, ``get_transfer_results``, ``build_connector_worker_meta``; with
    ``defer_finalize``, ``wait_for_save`` comes after those two, as vLLM's model runner calls it with
    speculative decoding (after the draft model's forward pass). A request whose prompt is computed
    samples one token per step.

    ``freed`` lists, in order, each request whose blocks vLLM freed, and ``on_free`` (if given) is
    called with it just before: a test checks there that nothing still reads them."""

    def __init__(
        self,
        scheduler: Scheduler,
        connector: KVConnectorBase_V1,
        caches: list[torch.Tensor],
        on_free: Callable[[Request], None] | None = None,
        seed: int = 0,
        defer_finalize: bool = False,
    ) -> None:
        self.scheduler, self.connector, self.caches = scheduler, connector, caches
        self.defer_finalize = defer_finalize
        self.freed: list[str] = []
        self.steps: list[SchedulerOutput] = []
        self._queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self._generator = torch.Generator().manual_seed(seed)
        free_blocks = scheduler._free_blocks

        def recorded_free(request: Request) -> None:
            if on_free is not None:
                on_free(request)
            self.freed.append(request.request_id)
            free_blocks(request)

        scheduler._free_blocks = recorded_free

    def step(self) -> None:
        """One call of ``step_with_batch_queue``: schedule and run a step if there is work, then
        take in the oldest step's output once two are in flight, or nothing more was scheduled."""
        executed = False
        if self.scheduler.has_requests():
            output = self.scheduler.schedule()
            self.steps.append(output)
            self._queue.appendleft((output, self._execute(output)))
            executed = output.total_num_scheduled_tokens > 0
            if len(self._queue) < 2 and (executed or self.scheduler.has_requests()):
                return
        if self._queue:
            output, result = self._queue.pop()
            self.scheduler.update_from_output(output, result)

    def run(self, until: Callable[[], bool], max_steps: int = 200) -> None:
        """Step until ``until()`` holds (checked after each step)."""
        for _ in range(max_steps):
            if until():
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def idle(self) -> bool:
        """Whether the scheduler holds no request and no step is in flight."""
        return not self.scheduler.has_requests() and not self._queue and not self.scheduler.requests

    def _execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        connector = self.connector
        connector.handle_preemptions(output.kv_connector_metadata)
        computed = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in ids:
            self._forward(req_id, computed[req_id], output.num_scheduled_tokens[req_id])
            request = self.scheduler.requests[req_id]
            sampled.append([] if request.is_prefill_chunk else [7])
        connector.bind_connector_metadata(output.kv_connector_metadata)
        connector.start_load_kv(None)
        if not self.defer_finalize:
            connector.wait_for_save()
        results = connector.get_transfer_results(output.finished_req_ids)
        worker_meta = connector.build_connector_worker_meta()
        if self.defer_finalize:
            connector.wait_for_save()
        connector.clear_connector_metadata()
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={req_id: index for index, req_id in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                kv_connector_worker_meta=worker_meta,
            ),
        )

    def _forward(self, req_id: str, start: int, count: int) -> None:
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        size = self.caches[0].shape[2]
        for position in range(start, start + count):
            block, slot = blocks[position // size], position % size
            for cache in self.caches:
                row = cache[block, :, slot]
                row.copy_(torch.randn(row.shape, generator=self._generator) - 9.0)
