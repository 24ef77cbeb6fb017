"""What a lookup buffer's listener charges each connection's pipe against its memory bound."""

from __future__ import annotations

import pytest

from kv_pipe import KVTransferConfig
from lookup_buffer.listener import pipe_memory


def _config(device: str) -> KVTransferConfig:
    return KVTransferConfig(
        kv_rank=0, kv_role="kv_producer", kv_buffer_device=device, kv_device_index=0 if device == "cuda" else None
    )


def test_a_cuda_connection_is_charged_its_host_frames_and_its_nccl_buffers(monkeypatch: pytest.MonkeyPatch):
    """A CUDA pipe's frames are host memory like a CPU pipe's, and its two NCCL communicators keep
    a send and a receive buffer of NCCL_BUFFSIZE each on the device."""
    monkeypatch.setenv("NCCL_BUFFSIZE", str(3 << 20))
    host = pipe_memory(_config("cpu"), shared=False)
    assert host > 0
    assert pipe_memory(_config("cuda"), shared=False) == host + 4 * (3 << 20)
    monkeypatch.delenv("NCCL_BUFFSIZE")
    assert pipe_memory(_config("cuda"), shared=False) == host + 4 * (4 << 20)  # NCCL's default
