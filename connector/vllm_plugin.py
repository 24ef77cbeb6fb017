"""vLLM plugin hook: registers ``KVBridgeConnector`` so ``kv_connector_module_path`` can be omitted.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes (API server,
EngineCore, workers), possibly more than once; registration is lazy (nothing is imported until
vLLM creates the connector) and idempotent. pyproject.toml declares::

    [project.entry-points."vllm.general_plugins"]
    kvbridge = "connector.vllm_plugin:register"
"""

from __future__ import annotations

CONNECTOR_NAME = "KVBridgeConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:  # no public "is registered" API in vLLM 0.32
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "connector.vllm_v1", "KVBridgeConnector")
