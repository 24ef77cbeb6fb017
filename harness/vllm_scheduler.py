"""vLLM's own ``Scheduler`` in the test's process with kvbridge's connector loaded from a kv-transfer
config, as vLLM loads it; no model runs (the tiny Llama only gives vLLM a model configuration)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.structured_output import StructuredOutputManager

from harness import vllm_procs as vp

#: The producer port the connector announces (its scheduler side opens nothing).
PRODUCER_PORT = 14579


def make_scheduler(
    model_config: ModelConfig,
    role: str,
    num_blocks: int = 64,
    failure_policy: str = "fail",
    extra: dict[str, Any] | None = None,
) -> Scheduler:
    """A Scheduler of ``num_blocks`` blocks whose connector is KVBridgeConnector in ``role``, with
    ``kv_connector_extra_config`` ``extra`` (default: kv_ip only)."""
    block = vp.BLOCK_SIZE
    transfer = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_connector_module_path="connector.vllm_v1",
        kv_role=role,
        kv_port=PRODUCER_PORT,
        kv_load_failure_policy=failure_policy,
        kv_connector_extra_config=extra if extra is not None else {"kv_ip": "127.0.0.1"},
    )
    config = VllmConfig(
        model_config=copy.deepcopy(model_config),  # VllmConfig adjusts the one it gets
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=block, enable_prefix_caching=True),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    kv_cache = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=1, dtype=torch.float32)
            )
        ],
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block,
    )
