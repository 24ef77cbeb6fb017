"""Tensor parallelism with real vLLM CPU engines: a prefill engine at TP size P and a decode engine at
TP size D (each TP rank a worker process of vLLM's), the decode requests carrying the prefill
engine's kv_transfer_params as a proxy passes them on.

Each test checks that the decode engine gives the tokens of one plain engine while failing any
request whose load failed (``kv_load_failure_policy="fail"``), and that every load was real: vLLM
reports each prompt's whole transfer prefix as cached tokens. On the 2-core CI machine a TP=2
engine starts in about 20 s; each test takes 1-2 minutes.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from connector.transfer_plan import PARAMS_KEY
from harness import vllm_procs as vp
from harness import xpyd as xp
from harness.procs import free_port
from harness.servers import SERVE_ARGS, Server

#: Prompts asked through vllm-router (the decode instance must not hold them in its prefix cache yet).
ROUTER_PROMPTS = [p for p in vp.make_prompts(seed=5) if vp.transfer_prefix(p)][:4]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vp.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tp"), with_tokenizer=True)


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of one plain engine (TP 1) for every prompt."""
    prompts = vp.make_prompts() + ROUTER_PROMPTS
    with vp.Engines() as engines:
        engines.start("reference", vp.reference_body, vp.engine_env(0), model=tiny_model, prompts=prompts)
        outputs = engines.wait(["reference"], timeout=240)["reference"]
    return {tuple(p): o["tokens"] for p, o in zip(prompts, outputs, strict=True)}


def _engine(model: str, tp: int, transfer: dict[str, Any]) -> Any:
    kwargs = vp.engine_kwargs(model, transfer)
    kwargs["tensor_parallel_size"] = tp
    return vp._llm(kwargs)


def tp_prefill_body(
    model: str,
    tp: int,
    transfer: dict[str, Any],
    prompts: list[list[int]],
    announce: Any,
    decoded: vp.Flag,
    timeout: float,
) -> list[dict[str, Any]]:
    """Prefill ``prompts`` (max_tokens=1) at TP size ``tp``; hand their kv_transfer_params on; stay up
    until the decode engine is done."""
    llm = _engine(model, tp, transfer)
    try:
        outputs = vp._generate(llm, prompts, 1)
        announce.put([o["params"] for o in outputs])
        if not decoded.wait(timeout):
            raise TimeoutError(f"the decode engine did not finish within {timeout} s")
        return outputs
    finally:
        vp._shutdown(llm)


def tp_decode_body(
    model: str,
    tp: int,
    transfer: dict[str, Any],
    prompts: list[list[int]],
    announced: Any,
    decoded: vp.Flag,
    timeout: float,
) -> list[dict[str, Any]]:
    """Decode ``prompts`` at TP size ``tp`` with the prefill engine's kv_transfer_params."""
    try:
        llm = _engine(model, tp, transfer)
        try:
            params = announced.get(timeout=timeout)
            return vp._generate(llm, prompts, vp.MAX_TOKENS, params)
        finally:
            vp._shutdown(llm)
    finally:
        decoded.set()


def _env(tp: int) -> dict[str, str]:
    """One engine process (scheduler in it), its TP ranks' workers pinned one per core."""
    env = vp.engine_env(0)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % 2) for rank in range(tp))
    return env


#: The negative control: a decode rank that puts the heads it loads in the wrong places.
SWAPPING_CONNECTOR = ("HeadSwappingKVBridgeConnector", "harness.swapping_connector")


def run_tp_pair(
    model: str,
    prefill_tp: int,
    decode_tp: int,
    prompts: list[list[int]],
    timeout: float = 240,
    decode_connector: tuple[str, str] = vp.KVBRIDGE_CONNECTOR,
) -> tuple[list[dict], list[dict]]:
    port = free_port(span=prefill_tp)
    with vp.Engines() as engines:
        decoded, announcements = engines.event(), engines.queue()
        engines.start(
            "prefill",
            tp_prefill_body,
            _env(prefill_tp),
            model=model,
            tp=prefill_tp,
            transfer=vp.kv_transfer_config("kv_producer", port),
            prompts=prompts,
            announce=announcements,
            decoded=decoded,
            timeout=timeout,
        )
        engines.start(
            "decode",
            tp_decode_body,
            _env(decode_tp),
            model=model,
            tp=decode_tp,
            transfer=vp.kv_transfer_config("kv_consumer", port, failure_policy="fail", connector=decode_connector),
            prompts=prompts,
            announced=announcements,
            decoded=decoded,
            timeout=timeout,
        )
        results = engines.wait(["prefill", "decode"], timeout=timeout + 30)
    return results["prefill"], results["decode"]


@pytest.mark.timeout(330)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), (1, 2), (2, 1)], ids=["2to2", "1to2", "2to1"])
def test_tp_engines_give_one_plain_engines_tokens_from_loaded_kv(
    tiny_model: str, reference: dict, prefill_tp: int, decode_tp: int
) -> None:
    """Prompts of 7 to 200 tokens (chunked prefill on both sides) and a duplicate; the tiny model's
    2 KV heads split over the TP ranks (one each at TP 2)."""
    prompts = vp.make_prompts()
    prefilled, decoded = run_tp_pair(tiny_model, prefill_tp, decode_tp, prompts)
    announced = [o["params"][PARAMS_KEY] for o in prefilled]
    assert [a["prefix_tokens"] for a in announced] == [vp.transfer_prefix(p) for p in prompts]
    assert {a["tp_size"] for a in announced} == {prefill_tp}
    assert [o["finish"] for o in decoded] == ["length"] * len(prompts)
    assert [o["tokens"] for o in decoded] == [reference[tuple(p)] for p in prompts]
    # Every load was real: vLLM counts each prompt's whole transfer prefix as cached (the duplicate's
    # from the load of its twin, or its own).
    assert [o["cached"] for o in decoded] == [vp.transfer_prefix(p) for p in prompts]


@pytest.mark.timeout(330)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)], ids=["1to2", "2to1"])
def test_heads_loaded_into_the_wrong_slice_change_exactly_the_outputs_served_from_them(
    tiny_model: str, reference: dict, prefill_tp: int, decode_tp: int
) -> None:
    prompts = vp.make_prompts()
    _, decoded = run_tp_pair(tiny_model, prefill_tp, decode_tp, prompts, decode_connector=SWAPPING_CONNECTOR)
    assert [o["cached"] for o in decoded] == [vp.transfer_prefix(p) for p in prompts]  # loaded all the same
    for prompt, output in zip(prompts, decoded, strict=True):
        same = output["tokens"] == reference[tuple(prompt)]
        assert same == (vp.transfer_prefix(prompt) == 0), f"prompt of {len(prompt)} tokens"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), (1, 2)], ids=["2to2", "1to2"])
def test_kvbridge_serve_with_tp_behind_its_proxy_and_vllm_router(
    tiny_model: str, reference: dict, tmp_path: Path, prefill_tp: int, decode_tp: int
) -> None:
    """``kvbridge serve --prefill-tp P --decode-tp D``: the proxy's answers, then vllm-router's over the
    same instances, are one plain engine's, from loaded KV (the decode instance's hit counter)."""
    ports = {name: free_port() for name in ("proxy", "prefill", "decode", "kv")}
    command = [
        sys.executable,
        "-m",
        "launch.serve",
        tiny_model,
        "--port",
        str(ports["proxy"]),
        "--prefill-tp",
        str(prefill_tp),
        "--decode-tp",
        str(decode_tp),
        "--prefill-port",
        str(ports["prefill"]),
        "--decode-port",
        str(ports["decode"]),
        "--kv-port",
        str(ports["kv"]),
        "--kv-extra",
        '{"kv_timeout": 20, "kv_load_timeout": 20}',
        "--ready-timeout",
        str(xp.READY_TIMEOUT),
        "--",
        *SERVE_ARGS,
    ]
    server = Server(command, tmp_path / "serve.log", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    router = None
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        server.wait_ready(urls["proxy"])
        # Both decode ranks connect to the prefill rank at their first load (on a loaded 2-core
        # machine that may take longer than a load waits: the request is then recomputed).
        warm_up = vp.make_prompts(seed=7)[-1]
        for _ in range(3):
            if xp.ask(urls["proxy"], warm_up).cached == vp.transfer_prefix(warm_up):
                break
            warm_up = warm_up[1:]
        prompts = vp.make_prompts()
        answers = [xp.ask(urls["proxy"], prompt) for prompt in prompts]
        assert [a.token_ids for a in answers] == [reference[tuple(p)] for p in prompts]
        assert [a.cached for a in answers] == [vp.transfer_prefix(p) for p in prompts]

        assert shutil.which("vllm-router") or (Path(sys.executable).parent / "vllm-router").exists()
        router_port = free_port(1)
        router = Server(xp.router_command([urls["prefill"]], [urls["decode"]], router_port), tmp_path / "router.log")
        router_url = f"http://127.0.0.1:{router_port}"
        xp.wait_answering(router_url, router.process, prompts[0], xp.READY_TIMEOUT)
        hits_before = xp.metric(urls["decode"], xp.HIT_METRIC)
        routed = [xp.ask(router_url, prompt) for prompt in ROUTER_PROMPTS]
        assert [a.token_ids for a in routed] == [reference[tuple(p)] for p in ROUTER_PROMPTS]
        # vllm-router answers with the prefill instance's usage: the decode instance's counter tells.
        hits = xp.metric(urls["decode"], xp.HIT_METRIC) - hits_before
        assert hits == sum(vp.transfer_prefix(p) for p in ROUTER_PROMPTS)
    except AssertionError:
        print(server.log.read_text(errors="replace")[-6000:])
        raise
    finally:
        if router is not None:
            router.stop()
        server.stop()
