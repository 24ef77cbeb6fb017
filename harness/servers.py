"""Real ``vllm serve`` instances for the serving tests and benchmarks: server processes reaped with
their process group, kvbridge's proxy served from a thread, the argument presets, the tiny model as a
pytest fixture, the serving stack (``launch.serve``), and kvbridge's series scraped from ``/metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from harness import vllm_procs as vp
from harness.procs import OWN_PROCESS_GROUP, REPO, free_port
from launch import proxy, serve

NAME = "tiny"
SERVE_ARGS = [
    "--served-model-name",
    NAME,
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "512",
    "--block-size",
    str(vp.BLOCK_SIZE),
    "--kv-cache-memory-bytes",
    str(64 << 20),
    "--seed",
    "0",
    "--max-num-batched-tokens",
    str(vp.MAX_NUM_BATCHED_TOKENS),
    "--enable-prompt-tokens-details",
]
READY_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vp.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tok"), with_tokenizer=True)


class Server:
    """A server process in its own process group, reaped with the whole group."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._file = log.open("wb")
        self.process = subprocess.Popen(
            command,
            stdout=self._file,
            stderr=subprocess.STDOUT,
            **OWN_PROCESS_GROUP,
            env={**os.environ, **(env or {})},
            cwd=REPO,
        )

    def wait_ready(self, url: str, timeout: float = READY_TIMEOUT) -> None:
        try:
            serve.wait_healthy(url, self.process, timeout)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{exc}; log:\n{self.log.read_text(errors='replace')[-5000:]}") from exc

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # launch.serve stops its instances itself
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # anything left in the group we started
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
        self._file.close()


def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


@contextlib.contextmanager
def serve_stack(
    model: str,
    log_dir: Path,
    kv_options: tuple[str, ...] = ("--kv-extra", '{"kv_timeout": 5, "kv_load_timeout": 5}'),
) -> Iterator[dict[str, Any]]:
    """``python -m launch.serve`` with two prefill and two decode instances (serve spreads them over
    the cores itself), and the proxy over all four; yields their URLs and the log. ``kv_options``:
    serve's options for moving KV (a pipe's timeouts by default)."""
    ports = {name: free_port() for name in ("proxy", "prefill", "decode", "kv")}  # each with the next ones free
    log = log_dir / "serve.log"
    command = [
        sys.executable,
        "-m",
        "launch.serve",
        model,
        "--port",
        str(ports["proxy"]),
        "--prefill-instances",
        "2",
        "--decode-instances",
        "2",
        "--prefill-port",
        str(ports["prefill"]),
        "--decode-port",
        str(ports["decode"]),
        "--kv-port",
        str(ports["kv"]),
        *kv_options,
        "--ready-timeout",
        str(READY_TIMEOUT),
        "--",
        *SERVE_ARGS,
    ]
    server = Server(command, log, env={"VLLM_LOG_STATS_INTERVAL": "1"})
    try:
        server.wait_ready(f"http://127.0.0.1:{ports['proxy']}")
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        yield {
            "log": log,
            "group": server.process.pid,  # serve leads the process group of every instance it starts
            **urls,
            "prefills": [f"http://127.0.0.1:{ports['prefill'] + i}" for i in range(2)],
            "decodes": [f"http://127.0.0.1:{ports['decode'] + j}" for j in range(2)],
        }
    finally:
        server.stop()


class ThreadedProxy:
    """launch.proxy.Proxy over the given instances, served from a thread of this process, on a free port."""

    def __init__(
        self, prefill_urls: list[str], decode_urls: list[str], read_timeout: float = 120, **routing: str
    ) -> None:
        self.port = free_port(1)
        app = proxy.Proxy(prefill_urls, decode_urls, proxy.Timeouts(read=read_timeout), **routing).app()
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()


# Memory pressure: a prefill instance whose KV cache holds one 1024-token request.
#: KV bytes of one block of the tiny model: 2 layers x (K, V) x 2 heads x 64 x fp32 x 32 tokens.
BLOCK_BYTES = 2 * 2 * 2 * 64 * 4 * vp.BLOCK_SIZE
COMMON_ARGS = [
    "--served-model-name",
    NAME,
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "1024",
    "--block-size",
    str(vp.BLOCK_SIZE),
    "--seed",
    "0",
    "--max-num-batched-tokens",
    "128",
    "--max-num-seqs",
    "16",
    "--enable-prompt-tokens-details",
]
PRESSED_ARGS = [*COMMON_ARGS, "--kv-cache-memory-bytes", str(33 * BLOCK_BYTES)]  # one 1024-token request
ROOMY_ARGS = [*COMMON_ARGS, "--kv-cache-memory-bytes", str(64 << 20)]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of kvbridge's series at ``url``/metrics, by name and labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:kvbridge_"):
                samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def values(samples: dict, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(labels), value) for (sample, labels), value in samples.items() if sample == name]


def total(samples: dict, *names: str) -> float:
    return sum(value for name in names for _, value in values(samples, "vllm:kvbridge_" + name))
