"""Serving under memory pressure with real vLLM instances.

A prefill instance with a KV cache of 33 blocks and 128-token steps serves 12 concurrent clients
whose long prompts (400 to 650 tokens) are chunked and whose prefill requests generate 64 tokens,
so vLLM preempts running requests and gives their blocks to others while their entries wait for
the decode instance. The decode instance fails any request whose load failed
(``kv_load_failure_policy: fail``), so every answer that arrives was computed from transferred KV,
and each must equal one plain server's.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from harness import vllm_procs as vp
from harness import xpyd as xp
from harness.procs import free_port
from harness.servers import PRESSED_ARGS, ROOMY_ARGS
from launch import proxy

CLIENTS = 12
PREFILL_TOKENS = 64  # prefill requests that keep running after their save: that is where vLLM preempts
_rng = random.Random(36)
PROMPTS = [[_rng.randrange(5, vp.VOCAB) for _ in range(_rng.randrange(400, 651))] for _ in range(32)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vp.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-1k"), with_tokenizer=True, max_positions=1024)


@pytest.fixture(scope="module")
def reference(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, ...], tuple[str, list[int]]]:
    """(text, token ids) of every prompt from one plain ``vllm serve`` with room for all of them."""
    return xp.plain_answers(model, PROMPTS, tmp_path_factory.mktemp("reference") / "server.log", ROOMY_ARGS, CLIENTS)


@pytest.fixture(scope="module")
def pair(model: str, reference: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    logs, kv_port = tmp_path_factory.mktemp("pressure"), free_port()
    producer = xp.instance(model, "prefill", "kv_producer", kv_port, 0, logs, serve_args=PRESSED_ARGS)
    consumer = xp.instance(model, "decode", "kv_consumer", kv_port, 1, logs, serve_args=ROOMY_ARGS)
    try:
        producer.start()
        consumer.start()
        yield producer, consumer
    finally:
        producer.stop()
        consumer.stop()


def _prefill_then_decode(producer: Any, consumer: Any, prompt: list[int]) -> tuple[dict, xp.Answer]:
    body = xp.completion_body(prompt)
    prefill = {**proxy.prefill_body(body), "max_tokens": PREFILL_TOKENS}
    params = xp.post(producer.url + "/v1/completions", prefill)["kv_transfer_params"]
    return params, xp.answer(xp.post(consumer.url + "/v1/completions", proxy.decode_body(body, params)))


def _metric_reaches(url: str, name: str, bound: float = 30.0) -> float:
    """The counter's value once it is above 0 (vLLM publishes connector stats once per logging
    interval), or 0 after ``bound`` seconds."""
    deadline = time.monotonic() + bound
    while (value := xp.metric(url, name)) == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


@pytest.mark.timeout(900)
def test_preempted_prefill_requests_never_serve_wrong_kv(pair: tuple[Any, Any], reference: dict) -> None:
    producer, consumer = pair
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda p: _prefill_then_decode(producer, consumer, p), PROMPTS))
    preemptions = xp.metric(producer.url, "vllm:num_preemptions_total")
    assert preemptions > 0, "the prefill instance preempted nothing: the test proves nothing"
    wrong = [
        len(prompt)
        for prompt, (_, answer) in zip(PROMPTS, results, strict=True)
        if answer.tokens != reference[tuple(prompt)]
    ]
    assert wrong == [], (
        f"{len(wrong)} of {len(PROMPTS)} answers differ from the plain server's ({preemptions:g} preemptions)"
    )
    # Every answer was computed from its whole transfer prefix, loaded (the decode instance fails a
    # request whose load failed) and announced by the producer after its last save.
    for prompt, (params, answer) in zip(PROMPTS, results, strict=True):
        assert params["kvbridge"]["prefix_tokens"] == vp.transfer_prefix(prompt)
        assert answer.cached == vp.transfer_prefix(prompt)
    assert _metric_reaches(producer.url, "vllm:kvbridge_taken_back_total") > 0
