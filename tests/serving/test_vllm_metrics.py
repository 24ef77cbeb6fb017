"""kvbridge's series in the ``/metrics`` of real ``vllm serve`` instances, after traffic."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from harness import servers as serving
from harness import vllm_procs as vp
from harness.servers import scrape, total, values

model = serving.model


@pytest.fixture(scope="module")
def stack(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The stack of the serving tests (launch.serve: prefill and decode instances and the proxy),
    started anew for this module."""
    with serving.serve_stack(model, tmp_path_factory.mktemp("stack")) as urls:
        yield urls


NAME = serving.NAME
PROMPTS = vp.make_prompts(seed=11)
#: Gauges that are 0 on an idle instance.
IDLE_GAUGES = ("entries_held", "bytes_buffered", "loans_out", "blocks_lent", "loads_in_flight")


def wait_for(urls: list[str], names: tuple[str, ...], expected: float) -> list[dict[str, Any]]:
    """Scrape until the series ``names`` add up to ``expected`` over ``urls`` (vLLM records a step's
    stats after it); each instance's samples."""
    deadline = time.monotonic() + 60
    while True:
        samples = [scrape(url) for url in urls]
        if sum(total(one, *names) for one in samples) >= expected:
            return samples
        assert time.monotonic() < deadline, f"{names} at {urls} stayed below {expected}: {samples}"
        time.sleep(0.5)


@pytest.mark.timeout(600)
def test_both_instances_export_kvbridge_series_after_traffic(stack: dict[str, str]) -> None:
    openai = serving.client(stack["proxy"])
    for prompt in PROMPTS:
        openai.completions.create(
            model=NAME, prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
    moved = sum(1 for p in PROMPTS[:-1] if vp.transfer_prefix(p))  # the last one duplicates a prompt
    # The duplicate is saved again, and loaded or found in the decode instance's prefix cache (drained).
    decodes = wait_for(stack["decodes"], ("load_hits_total", "drained_total"), moved + 1)
    prefills = wait_for(stack["prefills"], ("saved_requests_total",), moved + 1)
    for samples in (*decodes, *prefills):
        for name in ("vllm:kvbridge_load_hits_total", "vllm:kvbridge_connections"):
            ((labels, _),) = values(samples, name)
            assert labels["model_name"] == NAME and labels["engine"] == "0"  # vLLM's labels
        ((_, connections),) = values(samples, "vllm:kvbridge_connections")
        assert 1 <= connections <= 2  # one per instance of the other kind it exchanged KV with
    positive = {
        "decode": [
            "load_hits_total",
            "loaded_bytes_total",
            "loaded_blocks_total",
            "load_seconds_total",
            "transfer_seconds_count",
            "transfer_seconds_sum",
            "load_wait_seconds_count",
        ],
        "prefill": [
            "saved_requests_total",
            "saved_bytes_total",
            "saved_blocks_total",
            "save_seconds_total",
            "transfer_seconds_count",
        ],
    }
    for instance, every in (("decode", decodes), ("prefill", prefills)):
        for samples in every:  # the proxy's round robin gave each instance some of the traffic
            for name in positive[instance]:
                ((_, value),) = values(samples, "vllm:kvbridge_" + name)
                assert value > 0, f"{instance}: {name}"
    assert sum(total(one, "load_hits_total", "drained_total") for one in decodes) == moved + 1
    assert sum(total(one, "load_misses_total", "load_errors_total", "expired_entries_total") for one in decodes) == 0
    assert sum(total(one, "saved_requests_total") for one in prefills) == moved + 1
    assert sum(total(one, "expired_entries_total") for one in prefills) == 0
    # Lent on this host, and every saved request's blocks handed back to vLLM, without new traffic.
    assert sum(total(one, "lent_requests_total") for one in prefills) > 0
    wait_for(stack["prefills"], ("returned_requests_total",), moved + 1)
    # Nothing leaks: once idle, every gauge but the connections is back at 0 on every instance.
    deadline = time.monotonic() + 60
    while any(total(scrape(url), *IDLE_GAUGES) for url in [*stack["prefills"], *stack["decodes"]]):
        assert time.monotonic() < deadline, {url: scrape(url) for url in [*stack["prefills"], *stack["decodes"]]}
        time.sleep(0.5)
    for url in [*stack["prefills"], *stack["decodes"]]:
        assert {name for (name, _) in scrape(url)} >= {"vllm:kvbridge_" + name for name in IDLE_GAUGES}
