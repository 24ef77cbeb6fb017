"""kv_pipe: a FIFO tensor pipe over torch.distributed point-to-point on a dedicated process group."""

from kv_pipe.base import KVPipeBase
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import (
    KVBufferFullError,
    KVConfigError,
    KVPeerLostError,
    KVPipeClosedError,
    KVProtocolError,
    KVTimeoutError,
    KVTransferError,
)
from kv_pipe.torch_distributed_pipe import TorchDistributedPipe

__all__ = [
    "KVBufferFullError",
    "KVConfigError",
    "KVPeerLostError",
    "KVPipeClosedError",
    "KVPipeBase",
    "KVProtocolError",
    "KVTimeoutError",
    "KVTransferConfig",
    "KVTransferError",
    "TorchDistributedPipe",
]
