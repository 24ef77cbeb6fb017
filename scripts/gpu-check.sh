#!/usr/bin/env bash
# Checks kvbridge's GPU path on a bare GPU machine, in one command and a few minutes, and prints one
# table (check, result, time, notes). Needs torch with CUDA preinstalled, plus numpy, pyzmq and
# msgspec; no internet: kvbridge is installed from this checkout without dependencies, and without
# pip if pip cannot do it offline. pytest is optional (only the CPU set-up tests need it).
#
#   bash scripts/gpu-check.sh            # the GPU: KVBRIDGE_CHECK_GPU (default 0)
#
# What it runs (harness/cuda_checks.py; the same checks run under `pytest -m cuda`):
#   - tests/processes/test_gpu_setup.py: group creation order, device choice, same-GPU refusal (CPU, gloo)
#   - the pipe's contract on CUDA tensors in host-staged mode, over shared memory and over gloo
#   - paged gather/scatter on vLLM's GPU cache layouts, bit-exact against the CPU
#   - two processes on one GPU moving a batch's KV through the connector (host-staged)
#   - two NCCL pipe ends on one GPU refused at once; an NCCL pipe between two GPUs (if there are two)
#   - with two GPUs: a peer killed on NCCL gives KVPeerLostError and a live survivor; an engine's
#     torch.cuda.synchronize() while an NCCL pipe is idle returns at once
#   - benchmarks/bench_host_staged.py: host-staged rate against a plain device-to-host copy
# Exit status: 0 all passed (skips allowed), 1 a check failed, 2 the machine cannot run the checks.
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INDEX=1

python - <<'EOF' || exit 2
import importlib, sys
missing = []
for name in ("torch", "numpy", "zmq", "msgspec"):
    try:
        importlib.import_module(name)
    except ImportError as exc:
        missing.append(f"{name} ({exc})")
if missing:
    print("gpu-check: cannot run, these modules are not importable:", ", ".join(missing), file=sys.stderr)
    print("gpu-check: kvbridge needs torch (with CUDA), numpy, pyzmq and msgspec; install them first", file=sys.stderr)
    sys.exit(2)
import torch
if not torch.cuda.is_available():
    print(f"gpu-check: torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda})",
          file=sys.stderr)
    sys.exit(2)
print(f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
EOF

# kvbridge from this checkout, no dependencies and no build isolation (nothing to download).
if ! python -m pip install -q --no-deps --no-build-isolation -e . >/tmp/kvbridge-gpu-check-pip.log 2>&1; then
    echo "gpu-check: pip could not install kvbridge offline (see /tmp/kvbridge-gpu-check-pip.log);" \
         "running from the checkout instead" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Every check is bounded; the whole run is too (8 minutes).
timeout --signal=TERM --kill-after=15 480 python -m harness.cuda_checks "$@"
status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "gpu-check: did not finish within 8 minutes" >&2
    exit 1
fi
exit "$status"
