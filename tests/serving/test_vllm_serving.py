"""Disaggregated serving over HTTP: ``launch.serve`` (two prefill and two decode vLLM instances and the
proxy) against a single plain vLLM server, through the standard ``openai`` client."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from openai import BadRequestError, OpenAI

from launch import proxy, serve
from tests import _vllm_procs as vp
from tests.procs import free_port

NAME = "tiny"
SERVE_ARGS = ["--served-model-name", NAME, "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
              "--block-size", str(vp.BLOCK_SIZE), "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
              "--max-num-batched-tokens", str(vp.MAX_NUM_BATCHED_TOKENS), "--enable-prompt-tokens-details"]
PROMPTS = vp.make_prompts()
CHAT_PROMPTS = vp.make_prompts(seed=3)[2:7]  # 31 to 100 tokens, plus the chat template's 2
STREAMED = [3, 5, 7]  # indexes of PROMPTS also asked for as a stream
READY_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vp.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tok"), with_tokenizer=True)


class Server:
    """A server process in its own session, reaped with its whole process group."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._file = log.open("wb")
        self.process = subprocess.Popen(command, stdout=self._file, stderr=subprocess.STDOUT, start_new_session=True,
                                        env={**os.environ, **(env or {})}, cwd=Path(__file__).parent.parent)

    def wait_ready(self, url: str) -> None:
        try:
            serve.wait_healthy(url, self.process, READY_TIMEOUT)
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


def words(prompt: list[int]) -> str:
    return " ".join(vp.word(t) for t in prompt)


def ask_all(base_url: str) -> dict[str, list[Any]]:
    """Every request of the test, in a fixed order; greedy, fixed lengths."""
    openai = client(base_url)
    extra = {"ignore_eos": True, "return_token_ids": True}
    answers: dict[str, list[Any]] = {"completions": [], "cached": [], "stream": [], "chat": [], "chat_cached": [],
                                     "chat_stream": []}
    for prompt in PROMPTS:
        reply = openai.completions.create(model=NAME, prompt=prompt, max_tokens=vp.MAX_TOKENS, temperature=0,
                                          extra_body=extra)
        choice = reply.choices[0]
        answers["completions"].append((choice.text, choice.model_extra["token_ids"]))
        answers["cached"].append(reply.usage.prompt_tokens_details.cached_tokens)
    for index in STREAMED:
        chunks = openai.completions.create(model=NAME, prompt=PROMPTS[index], max_tokens=vp.MAX_TOKENS,
                                           temperature=0, stream=True, extra_body=extra)
        answers["stream"].append("".join(chunk.choices[0].text for chunk in chunks if chunk.choices))
    for prompt in CHAT_PROMPTS:
        messages = [{"role": "user", "content": words(prompt)}]
        reply = openai.chat.completions.create(model=NAME, messages=messages, max_tokens=vp.MAX_TOKENS,
                                               temperature=0, extra_body={"ignore_eos": True})
        answers["chat"].append(reply.choices[0].message.content)
        answers["chat_cached"].append(reply.usage.prompt_tokens_details.cached_tokens)
        stream = openai.chat.completions.create(model=NAME, messages=messages, max_tokens=vp.MAX_TOKENS,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
        answers["chat_stream"].append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    return answers


@pytest.fixture(scope="module")
def reference(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """The answers of one plain ``vllm serve`` (no connector), stopped before the pair starts."""
    port = free_port()
    log = tmp_path_factory.mktemp("reference") / "server.log"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), *SERVE_ARGS]
    server = Server(command, log, env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    try:
        server.wait_ready(f"http://127.0.0.1:{port}")
        return ask_all(f"http://127.0.0.1:{port}")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stack(model: str, reference: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``python -m launch.serve`` with two prefill and two decode instances (serve spreads them over
    the cores itself), and the proxy over all four."""
    ports = {name: free_port() for name in ("proxy", "prefill", "decode", "kv")}  # each with the next ones free
    log = tmp_path_factory.mktemp("stack") / "serve.log"
    command = [sys.executable, "-m", "launch.serve", model, "--port", str(ports["proxy"]),
               "--prefill-instances", "2", "--decode-instances", "2",
               "--prefill-port", str(ports["prefill"]), "--decode-port", str(ports["decode"]),
               "--kv-port", str(ports["kv"]), "--kv-extra", '{"kv_timeout": 5, "kv_load_timeout": 5}',
               "--ready-timeout", str(READY_TIMEOUT), "--", *SERVE_ARGS]
    server = Server(command, log, env={"VLLM_LOG_STATS_INTERVAL": "1"})
    try:
        server.wait_ready(f"http://127.0.0.1:{ports['proxy']}")
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        yield {"log": log, **urls, "prefills": [f"http://127.0.0.1:{ports['prefill'] + i}" for i in range(2)],
               "decodes": [f"http://127.0.0.1:{ports['decode'] + j}" for j in range(2)]}
    finally:
        server.stop()


@pytest.mark.timeout(600)
def test_disaggregated_serving_equals_a_single_server(stack: dict, reference: dict) -> None:
    answers = ask_all(stack["proxy"])
    for kind in ("completions", "stream", "chat", "chat_stream"):
        assert answers[kind] == reference[kind], kind
    # The decode instance never saw these prompts before: its cached tokens are the transferred prefix.
    assert answers["cached"] == [vp.transfer_prefix(p) for p in PROMPTS]
    assert answers["chat_cached"] == [vp.transfer_prefix([3, *p, 4]) for p in CHAT_PROMPTS]
    assert reference["cached"][: len(PROMPTS) - 1] == [0] * (len(PROMPTS) - 1)  # a plain server recomputes
    # vLLM aggregates and logs the connector's counters (VLLM_LOG_STATS_INTERVAL=1 s).
    deadline = time.monotonic() + 30
    while not re.search(r"KV Transfer metrics: .*load_hits=[1-9]", stack["log"].read_text(errors="replace")):
        assert time.monotonic() < deadline, "no 'KV Transfer metrics' with load hits in the decode instance's log"
        time.sleep(0.5)


class ThreadedProxy:
    """launch.proxy.Proxy over the given instances, served from a thread of this process, on a free port."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], read_timeout: float = 120,
                 **routing: str) -> None:
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


@pytest.mark.timeout(300)
def test_proxy_falls_back_to_the_decode_instance_when_prefill_is_down(stack: dict, reference: dict) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    fallback = ThreadedProxy([dead], [stack["decode"]])
    try:
        new_prompts = vp.make_prompts(seed=4)
        openai = client(fallback.url)
        cached = []
        for prompt in new_prompts:
            reply = openai.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0)
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        # Told that nothing was saved, the decode instance claims nothing and computes every prompt
        # (except the duplicate, from its own prefix cache).
        assert cached == [0] * (len(new_prompts) - 1) + [vp.transfer_prefix(new_prompts[-1])]
        # And it still answers the known prompts exactly.
        reply = openai.completions.create(model=NAME, prompt=PROMPTS[6], max_tokens=vp.MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
        assert (reply.choices[0].text, reply.choices[0].model_extra["token_ids"]) == reference["completions"][6]
    finally:
        fallback.close()


@pytest.mark.timeout(120)
def test_proxy_returns_client_errors_of_the_prefill_instance(stack: dict) -> None:
    with pytest.raises(BadRequestError):
        client(stack["proxy"]).completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=-1)


def test_prefill_request_asks_for_one_token_without_streaming() -> None:
    body = {"model": NAME, "prompt": [5, 6], "max_tokens": 9, "max_completion_tokens": 9, "stream": True, "n": 2,
            "stream_options": {"include_usage": True}}
    prefill = proxy.prefill_body(body)
    assert prefill == {"model": NAME, "prompt": [5, 6], "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                       "n": 1}
    assert body["max_tokens"] == 9 and body["stream_options"] == {"include_usage": True}  # the original is intact
    params = {"kvbridge": {"prefix_tokens": 32}}
    assert proxy.decode_body(body, params) == {**body, "kv_transfer_params": params}
    assert proxy.decode_body(body, None) == body
