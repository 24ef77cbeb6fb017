#!/usr/bin/env bash
# kvbridge's store against its peers on one GPU machine, in one command, and one table: the
# multi-round document-QA rounds of benchmarks/bench_store.py (documents of random tokens, each
# asked again in later rounds with another question; vLLM's own KV cache holds 1.5 of them) on
#   - vLLM without connector (recompute: the baseline of every ratio), and with its prefix cache;
#   - kvbridge's store: the worker's memory tier over disk, and a redis-server (with a new instance);
#   - LMCache's vLLM connector (LMCacheConnectorV1) with its Redis backend on the same redis-server
#     (with a new instance), CPU cache off so that every hit comes from Redis;
#   - vLLM's OffloadingConnector (native CPU offload, 4 GiB of host memory).
# Every answer is compared with the recompute baseline's (greedy): exit 1 if one differs.
#
#   bash scripts/gpu-store-peers.sh                 # 8 documents of 2000 tokens, 3 rounds
#   bash scripts/gpu-store-peers.sh --quick         # any bench_store option passes through
#
# NEVER RUN: no part of this script has run yet, on any machine (written without a GPU). Unknown
# until it does: whether the installed LMCache accepts these "lmcache.*" keys and vLLM's KV layout,
# whether OffloadingConnector accepts the tiny model's 32-token blocks, and kvbridge's store on CUDA
# caches (its CUDA gather/scatter is tested with vLLM's GPU layouts by scripts/gpu-check.sh, the
# store on them nowhere). A peer that fails to start fails the run, with its traceback.
#
# Needs, preinstalled (no internet): vLLM with CUDA, torch, numpy, pyzmq, msgspec, redis (redis-py),
# redis-server on PATH; LMCache optional (its rows are left out, saying so, when it is missing).
# Exit status: 0 every answer equal, 1 an answer differed or the run failed, 2 the machine cannot run it.
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INDEX=1

python - <<'EOF' || exit 2
import importlib, shutil, sys
missing = []
for name in ("torch", "numpy", "zmq", "msgspec", "redis", "vllm"):
    try:
        importlib.import_module(name)
    except ImportError as exc:
        missing.append(f"{name} ({exc})")
if shutil.which("redis-server") is None:
    missing.append("redis-server (not on PATH)")
if missing:
    print("gpu-store-peers: cannot run, missing:", ", ".join(missing), file=sys.stderr)
    sys.exit(2)
import torch, vllm
if not torch.cuda.is_available():
    print(f"gpu-store-peers: torch {torch.__version__} sees no CUDA device", file=sys.stderr)
    sys.exit(2)
print(f"gpu-store-peers: vLLM {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
EOF

if ! python -m pip install -q --no-deps --no-build-isolation -e . >/tmp/kvbridge-gpu-store-peers-pip.log 2>&1; then
    echo "gpu-store-peers: pip could not install kvbridge offline (see /tmp/kvbridge-gpu-store-peers-pip.log);" \
         "running from the checkout instead" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# The peers' configurations, minimal: chunks of 256 tokens like kvbridge's; {redis} is the URL of
# the redis-server the benchmark starts for the run (kvbridge's redis tier uses the same server).
peers=()
if python -c "import lmcache" 2>/dev/null; then
    peers+=(--connector-config 'lmcache-redis={"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.chunk_size": 256, "lmcache.local_cpu": false,
        "lmcache.remote_url": "{redis}", "lmcache.remote_serde": "naive"}}' --new-instance lmcache-redis)
else
    echo "gpu-store-peers: LMCache is not installed: its rows are left out" >&2
fi
peers+=(--connector-config 'vllm-offload={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 4294967296}}')

# Bounded as a whole: 9 minutes (each engine start is also bounded by the benchmark).
timeout --signal=TERM --kill-after=15 540 python -m benchmarks.bench_store --dtype bfloat16 \
    --tiers memory,redis "${peers[@]}" "$@"
status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "gpu-store-peers: did not finish within 9 minutes" >&2
    exit 1
fi
exit "$status"
