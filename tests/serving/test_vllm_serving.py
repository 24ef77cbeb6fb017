"""Disaggregated serving over HTTP: ``launch.serve`` (two prefill and two decode vLLM instances and the
proxy) against a single plain vLLM server, through the standard ``openai`` client."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from openai import BadRequestError

from harness import procs, servers
from harness import vllm_procs as vp
from harness.procs import free_port
from harness.servers import NAME, SERVE_ARGS, Server, ThreadedProxy, client
from launch import proxy

PROMPTS = vp.make_prompts()
CHAT_PROMPTS = vp.make_prompts(seed=3)[2:7]  # 31 to 100 tokens, plus the chat template's 2
STREAMED = [3, 5, 7]  # indexes of PROMPTS also asked for as a stream

model = servers.model


def words(prompt: list[int]) -> str:
    return " ".join(vp.word(t) for t in prompt)


def ask_all(base_url: str) -> dict[str, list[Any]]:
    """Every request of the test, in a fixed order; greedy, fixed lengths."""
    openai = client(base_url)
    extra = {"ignore_eos": True, "return_token_ids": True}
    answers: dict[str, list[Any]] = {
        "completions": [],
        "cached": [],
        "stream": [],
        "chat": [],
        "chat_cached": [],
        "chat_stream": [],
    }
    for prompt in PROMPTS:
        reply = openai.completions.create(
            model=NAME, prompt=prompt, max_tokens=vp.MAX_TOKENS, temperature=0, extra_body=extra
        )
        choice = reply.choices[0]
        answers["completions"].append((choice.text, choice.model_extra["token_ids"]))
        answers["cached"].append(reply.usage.prompt_tokens_details.cached_tokens)
    for index in STREAMED:
        chunks = openai.completions.create(
            model=NAME, prompt=PROMPTS[index], max_tokens=vp.MAX_TOKENS, temperature=0, stream=True, extra_body=extra
        )
        answers["stream"].append("".join(chunk.choices[0].text for chunk in chunks if chunk.choices))
    for prompt in CHAT_PROMPTS:
        messages = [{"role": "user", "content": words(prompt)}]
        reply = openai.chat.completions.create(
            model=NAME, messages=messages, max_tokens=vp.MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        answers["chat"].append(reply.choices[0].message.content)
        answers["chat_cached"].append(reply.usage.prompt_tokens_details.cached_tokens)
        stream = openai.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=vp.MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        answers["chat_stream"].append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    return answers


@pytest.fixture(scope="module")
def reference(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """The answers of one plain ``vllm serve`` (no connector), stopped before the pair starts."""
    port = free_port()
    log = tmp_path_factory.mktemp("reference") / "server.log"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SERVE_ARGS,
    ]
    server = Server(command, log, env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    try:
        server.wait_ready(f"http://127.0.0.1:{port}")
        return ask_all(f"http://127.0.0.1:{port}")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stack(model: str, reference: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The serving stack (:func:`harness.servers.serve_stack`), started once the plain server stopped."""
    with servers.serve_stack(model, tmp_path_factory.mktemp("stack")) as urls:
        yield urls


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


@pytest.mark.timeout(300)
@pytest.mark.timeout(900)
def test_serving_through_a_store_equals_a_single_server(
    model: str, reference: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``kvbridge serve --kv-store disk:DIR``: prefill and decode instances with one disk store beside
    their pipe: a decode instance loads the stored prefix (whole chunks) from the store and the rest
    over the pipe. Every answer equals the plain server's, and decode instances did load KV."""
    store = tmp_path_factory.mktemp("kv-store")
    options = ("--kv-store", f"disk:{store}", "--kv-extra", json.dumps({"kv_store": {"chunk_size": vp.BLOCK_SIZE}}))
    last = max(os.sched_getaffinity(0))
    options += ("--reserved-cores", "1")  # the last core: kvbridge's threads, not the engines'
    with servers.serve_stack(model, tmp_path_factory.mktemp("store-stack"), kv_options=options) as urls:
        answers = ask_all(urls["proxy"])
        # Each engine process computes on the other cores; its kvbridge threads run on the last one.
        threads = {pid: procs.thread_cores(pid) for pid in procs.group_processes(urls["group"])}
        engines = {pid: t for pid, t in threads.items() if pid in t and last not in t[pid][1]}  # bound main thread
        assert len(engines) >= 4, threads
        assert all(any(cores == {last} for _, cores in t.values()) for t in engines.values()), engines
    for kind in ("completions", "stream", "chat", "chat_stream"):
        assert answers[kind] == reference[kind], kind
    assert sum(answers["cached"]) > 0, "no decode request found its prefix in the store"
    assert any(store.iterdir()), "nothing was stored"


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
        reply = openai.completions.create(
            model=NAME,
            prompt=PROMPTS[6],
            max_tokens=vp.MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert (reply.choices[0].text, reply.choices[0].model_extra["token_ids"]) == reference["completions"][6]
    finally:
        fallback.close()


@pytest.mark.timeout(120)
def test_proxy_returns_client_errors_of_the_prefill_instance(stack: dict) -> None:
    with pytest.raises(BadRequestError):
        client(stack["proxy"]).completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=-1)


def test_prefill_request_asks_for_one_token_without_streaming() -> None:
    body = {
        "model": NAME,
        "prompt": [5, 6],
        "max_tokens": 9,
        "max_completion_tokens": 9,
        "stream": True,
        "n": 2,
        "stream_options": {"include_usage": True},
    }
    prefill = proxy.prefill_body(body)
    assert prefill == {
        "model": NAME,
        "prompt": [5, 6],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "n": 1,
    }
    assert body["max_tokens"] == 9 and body["stream_options"] == {"include_usage": True}  # the original is intact
    params = {"kvbridge": {"prefix_tokens": 32}}
    assert proxy.decode_body(body, params) == {**body, "kv_transfer_params": params}
    assert proxy.decode_body(body, None) == body
