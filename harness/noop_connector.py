"""A vLLM connector that claims nothing and saves nothing: vLLM's connector machinery alone.

vLLM loads it like any external connector::

    kv_transfer_config={"kv_connector": "NoopKVConnector",
                        "kv_connector_module_path": "harness.noop_connector", "kv_role": "kv_producer"}

With it, an instance runs every connector hook vLLM calls per step and per layer (metadata built
in the scheduler and passed to the worker, ``save_kv_layer`` per layer, ``wait_for_save``) with no
work inside them: the baseline that separates vLLM's own connector cost from kvbridge's in
``benchmarks/bench_e2e.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

if TYPE_CHECKING:
    import torch
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class NoopKVConnector(KVConnectorBase_V1):
    """Every hook vLLM requires, each doing nothing: no external tokens, nothing saved or loaded."""

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()
