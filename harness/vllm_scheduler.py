"""vLLM's own ``Scheduler`` in the test's process with kvbridge's connector loaded from a kv-transfer
config, as vLLM loads it, and a worker-side connector with caches registered; no model runs (the
tiny Llama only gives vLLM a model configuration)."""

from __future__ import annotations

import copy
import types
from typing import Any
from unittest import mock

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.structured_output import StructuredOutputManager

from harness import vllm_procs as vp

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
) -> Scheduler:
    """A Scheduler of ``num_blocks`` blocks whose connector is KVBridgeConnector in ``role``, with
    ``kv_connector_extra_config`` ``extra`` (default: kv_ip only)."""
    spec = FullAttentionSpec(block_size=vp.BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config, kv_cache = _configs(model_config, role, num_blocks, failure_policy, extra, spec, ["layer"])
    return Scheduler(
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
