"""xPyD serving with real vLLM instances: two prefill and two decode ``vllm serve`` with kvbridge's
connector, every (prefill, decode) pairing by hand, behind kvbridge's proxy and behind vllm-router,
and instances killed and restarted on the same ports while the others keep serving.

Decode instances fail a request whose load failed (``kv_load_failure_policy: fail``): an answer
that arrives was computed from the transferred KV, and its cached tokens say how much was loaded
(each decode instance sees every prompt once, so its own prefix cache never holds it before).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import sys
import threading
import time
import urllib.error
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from harness import vllm_procs as vp
from harness import xpyd as xp
from harness.procs import free_port
from harness.servers import SERVE_ARGS, Server, ThreadedProxy


def _distinct(seed: int) -> list[list[int]]:
    """The prompts of :func:`vp.make_prompts` without its duplicate."""
    return vp.make_prompts(seed=seed)[:-1]


PAIRINGS = [(p, d) for p in range(2) for d in range(2)]
PAIR_PROMPTS = {pair: _distinct(seed=10 + index) for index, pair in enumerate(PAIRINGS)}
PROXY_PROMPTS = _distinct(seed=20) + _distinct(seed=21)
ROUTER_PROMPTS = _distinct(seed=30) + _distinct(seed=31)
ROUTER_WARMUP = _distinct(seed=32)[3]
PREFILL_KILL = {
    "flow": _distinct(seed=40) + _distinct(seed=41),
    "after": _distinct(seed=42),
    "restarted": {d: _distinct(seed=43 + d) for d in range(2)},
}
DECODE_KILL = {
    "flow": _distinct(seed=50) + _distinct(seed=51),
    "after": _distinct(seed=52),
    "restarted": {p: _distinct(seed=53 + p) for p in range(2)},
}
ALL_PROMPTS = [
    *(p for prompts in PAIR_PROMPTS.values() for p in prompts),
    *PROXY_PROMPTS,
    *ROUTER_PROMPTS,
    ROUTER_WARMUP,
    *(p for case in (PREFILL_KILL, DECODE_KILL) for p in case["flow"] + case["after"]),
    *(p for case in (PREFILL_KILL, DECODE_KILL) for prompts in case["restarted"].values() for p in prompts),
]
CLIENTS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vp.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-xpyd"), with_tokenizer=True)


@pytest.fixture(scope="module")
def reference(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, ...], tuple[str, list[int]]]:
    """(text, token ids) of every prompt of the module from one plain ``vllm serve`` (no connector),
    stopped before the instances start."""
    assert len({tuple(p) for p in ALL_PROMPTS}) == len(ALL_PROMPTS), "the tests need distinct prompts"
    return xp.plain_answers(
        model, ALL_PROMPTS, tmp_path_factory.mktemp("reference") / "server.log", SERVE_ARGS, clients=1
    )


@pytest.fixture(scope="module")
def cluster(model: str, reference: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[xp.Fleet]:
    cluster = xp.Fleet(model, tmp_path_factory.mktemp("xpyd"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _assert_loaded_by_hand(cluster: xp.Fleet, p: int, d: int, prompts: list[list[int]], reference: dict) -> None:
    """The P/D flow by hand from prefill ``p`` to decode ``d``: tokens of the reference, every
    transfer prefix loaded (cached tokens, and the decode's external prefix-cache hits), the
    prefill's params naming its own kvbridge address."""
    prefill, decode = cluster.prefills[p], cluster.decodes[d]
    hits_before = xp.metric(decode.url, xp.HIT_METRIC)
    for index, prompt in enumerate(prompts):
        answer, params = xp.by_hand(prefill.url, decode.url, prompt, stream=index == len(prompts) - 2)
        assert answer.tokens == reference[tuple(prompt)], (prefill.name, decode.name, len(prompt))
        assert answer.cached == vp.transfer_prefix(prompt), (prefill.name, decode.name, len(prompt))
        announced = params["kvbridge"]
        assert (announced["host"], announced["port"], announced["prefix_tokens"]) == (
            "127.0.0.1",
            prefill.kv_port,
            vp.transfer_prefix(prompt),
        )
    grown = xp.metric(decode.url, xp.HIT_METRIC) - hits_before
    assert grown == sum(vp.transfer_prefix(p) for p in prompts), (prefill.name, decode.name)


@pytest.mark.timeout(600)
def test_every_pairing_loads_the_prefix_its_prefill_announces(cluster: xp.Fleet, reference: dict) -> None:
    for p, d in PAIRINGS:
        _assert_loaded_by_hand(cluster, p, d, PAIR_PROMPTS[(p, d)], reference)
    engine_ids = {
        xp.prefill(cluster.prefills[p].url, PAIR_PROMPTS[(p, 0)][0])["kvbridge"]["engine_id"] for p in range(2)
    }
    assert len(engine_ids) == 2


# ---------------------------------------------------------------------- fronts: kvbridge's proxy, vllm-router


def xpyd_proxy(cluster: xp.Fleet, decode_policy: str = "least_outstanding") -> ThreadedProxy:
    """kvbridge's proxy over every instance of ``cluster``, round robin over the prefill instances."""
    return ThreadedProxy(
        [i.url for i in cluster.prefills],
        [i.url for i in cluster.decodes],
        xp.REQUEST_TIMEOUT,
        prefill_policy="round_robin",
        decode_policy=decode_policy,
    )


def _ask_concurrently(url: str, prompts: list[list[int]]) -> list[xp.Answer]:
    """Every prompt through ``url`` from :data:`CLIENTS` client threads, every other one streamed."""
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(xp.ask, url, prompt, index % 2 == 1) for index, prompt in enumerate(prompts)]
        return [future.result(timeout=xp.REQUEST_TIMEOUT * len(prompts)) for future in futures]


def _assert_all_loaded(answers: list[xp.Answer], prompts: list[list[int]], reference: dict) -> None:
    assert [a.tokens for a in answers] == [reference[tuple(p)] for p in prompts]
    assert [a.cached for a in answers] == [vp.transfer_prefix(p) for p in prompts]


@pytest.mark.timeout(300)
def test_proxy_over_two_prefills_and_two_decodes(cluster: xp.Fleet, reference: dict) -> None:
    hits_before = sum(xp.metric(d.url, xp.HIT_METRIC) for d in cluster.decodes)
    front = xpyd_proxy(cluster)
    try:
        answers = _ask_concurrently(front.url, PROXY_PROMPTS)
    finally:
        front.close()
    _assert_all_loaded(answers, PROXY_PROMPTS, reference)
    hits = sum(xp.metric(d.url, xp.HIT_METRIC) for d in cluster.decodes) - hits_before
    assert hits == sum(vp.transfer_prefix(p) for p in PROXY_PROMPTS)


@pytest.fixture()
def router(cluster: xp.Fleet, tmp_path: Path) -> Iterator[str]:
    # The test extra installs it: missing is a failure, not a skip.
    assert shutil.which("vllm-router") or (Path(sys.executable).parent / "vllm-router").exists(), (
        "vllm-router is not installed (pip install -e '.[test]')"
    )
    port = free_port(1)
    command = xp.router_command([i.url for i in cluster.prefills], [i.url for i in cluster.decodes], port)
    server = Server(command, tmp_path / "router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            xp.wait_answering(url, server.process, ROUTER_WARMUP, xp.READY_TIMEOUT)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{exc}; log:\n{server.log.read_text(errors='replace')[-5000:]}") from exc
        yield url
    finally:
        server.stop()


@pytest.mark.timeout(400)
def test_vllm_router_over_two_prefills_and_two_decodes(cluster: xp.Fleet, router: str, reference: dict) -> None:
    hits_before = sum(xp.metric(d.url, xp.HIT_METRIC) for d in cluster.decodes)
    answers = _ask_concurrently(router, ROUTER_PROMPTS)
    assert [a.tokens for a in answers] == [reference[tuple(p)] for p in ROUTER_PROMPTS]
    # vllm-router answers with the prefill instance's usage (no cached tokens there): the decode
    # instances' own counters tell what they loaded.
    hits = sum(xp.metric(d.url, xp.HIT_METRIC) for d in cluster.decodes) - hits_before
    assert hits == sum(vp.transfer_prefix(p) for p in ROUTER_PROMPTS)


# ---------------------------------------------------------------------- instances killed and restarted


def _is_timeout(exc: BaseException) -> bool:
    reason = getattr(exc, "reason", None)
    return isinstance(exc, (TimeoutError, socket.timeout)) or isinstance(reason, (TimeoutError, socket.timeout))


Send = Callable[[list[int], bool], xp.Answer]


@contextlib.contextmanager
def _front(cluster: xp.Fleet) -> Iterator[Send]:
    """Requests through kvbridge's proxy over all instances."""
    front = xpyd_proxy(cluster, decode_policy="round_robin")
    try:
        yield lambda prompt, stream: xp.ask(front.url, prompt, stream)
    finally:
        front.close()


def _flow_with_kill(send: Send, prompts: list[list[int]], kill: Callable[[], None]) -> dict[int, Any]:
    """Send ``prompts`` from client threads; once a quarter of them were answered, run ``kill``.
    Returns each prompt's answer or exception; every request returned (bounded by
    :data:`xp.REQUEST_TIMEOUT` each)."""
    outcomes: dict[int, Any] = {}
    lock = threading.Lock()

    def one(index: int) -> None:
        try:
            result: Any = send(prompts[index], index % 2 == 1)
        except (urllib.error.URLError, OSError, RuntimeError, ValueError, AssertionError) as exc:
            result = exc
        with lock:
            outcomes[index] = result

    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(one, index) for index in range(len(prompts))]
        deadline = time.monotonic() + xp.REQUEST_TIMEOUT
        while len(outcomes) < len(prompts) // 4:
            assert time.monotonic() < deadline, "no request came back before the kill"
            time.sleep(0.05)
        kill()
        for future in futures:
            future.result(timeout=xp.REQUEST_TIMEOUT * len(prompts))
    return outcomes


def _assert_flow(outcomes: dict[int, Any], prompts: list[list[int]], reference: dict) -> None:
    """No request hung; every answer has the reference's tokens (answers computed from KV that a
    dying instance left half-sent would not)."""
    assert sorted(outcomes) == list(range(len(prompts)))
    timeouts = [repr(o) for o in outcomes.values() if isinstance(o, BaseException) and _is_timeout(o)]
    assert not timeouts, timeouts
    answered = {i: o for i, o in outcomes.items() if isinstance(o, xp.Answer)}
    assert answered, [repr(o) for o in outcomes.values()]
    for index, answer in answered.items():
        assert answer.tokens == reference[tuple(prompts[index])], len(prompts[index])


@pytest.mark.timeout(600)
def test_a_killed_prefill_instance_is_routed_around_and_serves_again_after_a_restart(
    cluster: xp.Fleet, reference: dict
) -> None:
    victim = cluster.prefills[1]
    with _front(cluster) as send:
        outcomes = _flow_with_kill(send, PREFILL_KILL["flow"], victim.kill)
        _assert_flow(outcomes, PREFILL_KILL["flow"], reference)
        # The dead instance's requests go to the other prefill: every answer loaded from it.
        after = [send(prompt, False) for prompt in PREFILL_KILL["after"]]
        _assert_all_loaded(after, PREFILL_KILL["after"], reference)
    victim.start()  # same HTTP and kv ports; the decode instances keep running
    for d in range(2):
        _assert_loaded_by_hand(cluster, 1, d, PREFILL_KILL["restarted"][d], reference)


@pytest.mark.timeout(600)
def test_a_killed_decode_instance_is_routed_around_and_loads_again_after_a_restart(
    cluster: xp.Fleet, reference: dict
) -> None:
    victim = cluster.decodes[1]
    with _front(cluster) as send:
        outcomes = _flow_with_kill(send, DECODE_KILL["flow"], victim.kill)
        _assert_flow(outcomes, DECODE_KILL["flow"], reference)
        after = [send(prompt, False) for prompt in DECODE_KILL["after"]]
        _assert_all_loaded(after, DECODE_KILL["after"], reference)
    victim.start()
    for p in range(2):
        _assert_loaded_by_hand(cluster, p, 1, DECODE_KILL["restarted"][p], reference)
