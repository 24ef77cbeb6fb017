"""connector: move a batch of requests' KV caches (contiguous or paged) through a lookup buffer."""

from connector.base import KVRecvResult, KVRequest, KVSendResult, KVStorage
from connector.contiguous import ContiguousKV
from connector.kv_transfer import recv_kv_caches_and_hidden_states, send_kv_caches_and_hidden_states
from connector.paged import (
    FLASH_ATTN_LAYOUT,
    VLLM_CPU_LAYOUT,
    PagedKV,
    PagedKVCaches,
    PagedKVLayout,
    gather_blocks,
    scatter_blocks,
)

__all__ = [
    "FLASH_ATTN_LAYOUT",
    "VLLM_CPU_LAYOUT",
    "ContiguousKV",
    "KVRecvResult",
    "KVRequest",
    "KVSendResult",
    "KVStorage",
    "PagedKV",
    "PagedKVCaches",
    "PagedKVLayout",
    "gather_blocks",
    "recv_kv_caches_and_hidden_states",
    "scatter_blocks",
    "send_kv_caches_and_hidden_states",
]
