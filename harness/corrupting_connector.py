"""A test-only vLLM connector: kvbridge's, except that every KV it loads is noise.

vLLM loads it like any external connector::

    kv_transfer_config={"kv_connector": "CorruptingKVBridgeConnector",
                        "kv_connector_module_path": "harness.corrupting_connector", ...}

It is the negative control of the engine tests: outputs served from transferred KV must change,
and only those.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from connector.vllm_settings import ConnectorSettings
from connector.vllm_v1 import KVBridgeConnector
from connector.vllm_worker import WorkerSide
from harness.fault_injection import CorruptingBuffer
from lookup_buffer import KVLookupBufferBase, dial
from lookup_buffer.listener import OnConnect

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig


def corrupting_dialer(
    settings: ConnectorSettings, host: str, port: int, on_connect: OnConnect | None
) -> KVLookupBufferBase:
    return CorruptingBuffer(dial(settings.bridge, host, port, on_connect))


class CorruptingKVBridgeConnector(KVBridgeConnector):
    """:class:`connector.vllm_v1.KVBridgeConnector` whose worker loads through a :class:`CorruptingBuffer`."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self._worker is not None:  # not connected yet: the worker connects in register_kv_caches
            self._worker = WorkerSide(
                self._worker.settings, self._worker.identity, self._worker.port_offset, dialer=corrupting_dialer
            )
