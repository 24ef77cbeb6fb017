"""Per-request phases on ``/metrics``: what the workers observe (fake buffers, and two workers over a
real pipe), how the stats carry them to Prometheus, and the histograms of a live ``vllm serve`` pair."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from connector.transfer_plan import LoadSpec, SaveSpec
from connector.vllm_prom import KVBridgePromMetrics
from connector.vllm_stats import SAMPLES, KVBridgeStats
from connector.vllm_worker import PHASES
from harness import vllm_procs as vp
from harness.procs import free_port
from harness.vllm_fakes import FAKE_TOKENS, poll_until_reported, random_blocks
from lookup_buffer.loans import COPIED, Loan
from lookup_buffer.matching import MatchKey, token_arrays
from lookup_buffer.store import Entry, EntryStore

PRODUCER_PHASES = ("save_copy_seconds", "entry_wait_seconds")
CONSUMER_PHASES = ("load_entry_wait_seconds", "load_receive_seconds", "load_copy_seconds")


def _phases(worker: Any) -> dict[str, list[float]]:
    """Every phase the worker observed since the last report (empty lists included)."""
    taken = worker.take_stats()
    phases = taken[1].phases if taken is not None else {}
    return {name: list(phases.get(name, ())) for name in PHASES}


# ====================================================================== the consumer, fake buffers


class _Arrived(list):
    """A select result that says when its header arrived (``perf_counter``), as a buffer may."""

    arrived: float


class _TimedSelects:
    """A consumer's lookup buffer: each select waits ``wait`` s for its entry's header, then
    ``receive`` s for its bytes; it says when the header arrived if ``tells``."""

    def __init__(self, hits: dict[int, torch.Tensor], wait: float, receive: float, tells: bool) -> None:
        self.hits, self.wait, self.receive, self.tells = hits, wait, receive, tells
        self.failure: Exception | None = None

    def drop_select(
        self, input_tokens: torch.Tensor, roi: torch.Tensor, timeout: float | None = None, borrow: bool = False
    ) -> list:
        time.sleep(self.wait)
        arrived = time.perf_counter()
        time.sleep(self.receive)
        blocks = self.hits.pop(int(input_tokens[0]), None)
        if blocks is None:
            return [None] * 5
        result = _Arrived([input_tokens.clone(), roi.clone(), blocks, None, None])
        if self.tells:
            result.arrived = arrived
        return result

    def close(self) -> None:
        pass


def _consumer(buffer: _TimedSelects) -> Any:
    return vp.fake_worker(
        "kv_consumer",
        1,
        vp.FAKE_BLOCK_SIZE,
        vp.fake_caches(2),
        {"kv_load_timeout": 1.0},
        dialer=lambda settings, host, port, on_connect: buffer,
    )


def test_a_load_splits_its_time_at_the_arrival_of_the_header_the_buffer_reports() -> None:
    a, b = random_blocks(1, 2), random_blocks(2, 3)
    worker = _consumer(
        _TimedSelects({FAKE_TOKENS["a"][0]: a, FAKE_TOKENS["b"][0]: b}, wait=0.2, receive=0.1, tells=True)
    )
    worker.start_loads([LoadSpec("a", FAKE_TOKENS["a"], [5, 0], 0), LoadSpec("x", FAKE_TOKENS["x"], [3], 0)])
    poll_until_reported(worker, {"a", "x"})
    worker.start_loads([LoadSpec("b", FAKE_TOKENS["b"], [2, 1, 6], 0)])
    poll_until_reported(worker, {"b"})
    phases = _phases(worker)
    # One value per hit, none for the miss ("x"); the producer's phases are not a consumer's.
    assert all(len(phases[name]) == 2 for name in CONSUMER_PHASES), phases
    assert all(not phases[name] for name in PRODUCER_PHASES)
    assert all(0.2 <= wait < 0.3 + 0.5 for wait in phases["load_entry_wait_seconds"])
    assert all(0.1 <= receive < 0.1 + 0.5 for receive in phases["load_receive_seconds"])
    assert all(0 < copy < 0.5 for copy in phases["load_copy_seconds"])
    worker.close()


def test_without_the_arrival_the_whole_select_is_the_wait_and_no_receive_is_observed() -> None:
    worker = _consumer(_TimedSelects({FAKE_TOKENS["a"][0]: random_blocks(1, 2)}, wait=0.2, receive=0.1, tells=False))
    worker.start_loads([LoadSpec("a", FAKE_TOKENS["a"], [5, 0], 0)])
    poll_until_reported(worker, {"a"})
    phases = _phases(worker)
    (wait,) = phases["load_entry_wait_seconds"]
    assert wait >= 0.3 and phases["load_receive_seconds"] == [] and len(phases["load_copy_seconds"]) == 1
    assert _phases(worker) == dict.fromkeys(PHASES, [])  # reported once
    worker.close()


# ====================================================================== the producer


class _Inserts:
    """A producer's lookup buffer that stores nothing: every insert succeeds."""

    failure = None

    def insert(self, *args: Any, **kwargs: Any) -> None:
        return None

    def empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def stats(self) -> Any:
        return None

    def close(self) -> None:
        pass


def test_each_save_observes_its_copy() -> None:
    worker = vp.fake_worker(
        "kv_producer",
        1,
        vp.FAKE_BLOCK_SIZE,
        vp.fake_caches(1),
        {},
        listener_factory=lambda settings, offset, on_connect: _Inserts(),
    )
    with torch.inference_mode():
        worker.save([SaveSpec("a", FAKE_TOKENS["a"], [0, 1]), SaveSpec("b", FAKE_TOKENS["b"], [2, 3, 4])])
    phases = _phases(worker)
    assert len(phases["save_copy_seconds"]) == 2 and all(value > 0 for value in phases["save_copy_seconds"])
    assert all(not phases[name] for name in CONSUMER_PHASES) and phases["entry_wait_seconds"] == []
    worker.close()


def _key(first: int) -> MatchKey:
    tokens = torch.arange(first, first + 4)
    return MatchKey(*token_arrays(tokens, torch.ones_like(tokens, dtype=torch.bool)))


def test_the_store_reports_how_long_each_taken_entry_waited_and_only_taken_ones() -> None:
    store = EntryStore(1 << 20, 1 << 20, entry_timeout=0.25)
    for first in (0, 10, 20):
        store.put(_key(first), Entry((torch.zeros(4),), 16), timeout=1)
    time.sleep(0.1)
    assert store.pop(_key(0)) is not None and store.pop(_key(99)) is None
    (wait,) = store.take_waits()
    assert 0.1 <= wait < 1.0 and store.take_waits() == []  # each wait once
    entry = Entry((torch.zeros(4),), 16)
    store.put(_key(30), entry, timeout=1)
    assert store.withdraw(entry)  # taken back, not taken
    time.sleep(0.3)
    assert store.expire() == (2, 32)  # expired, not taken
    assert store.take_waits() == []


def test_an_entry_copied_out_of_its_loan_waits_from_its_first_store() -> None:
    store = EntryStore(1 << 20, 1 << 20)
    loan = Loan()  # its item is a plain tensor: the copy keeps it, which is all this test needs
    store.put(_key(0), Entry((torch.zeros(4),), 16, loan=loan), timeout=1)
    time.sleep(0.1)
    assert store.unlend(loan, lambda shape, dtype: torch.empty(tuple(shape), dtype=dtype)) == _key(0)
    assert loan.outcome == COPIED and store.pop(_key(0)) is not None
    (wait,) = store.take_waits()
    assert wait >= 0.1


# ====================================================================== two workers over a real pipe

#: How long the consumer leaves the saved entries in the producer's buffer before it loads them.
DELAY = 0.4
SAVES = [SaveSpec("a", FAKE_TOKENS["a"], [3, 6]), SaveSpec("b", FAKE_TOKENS["b"], [1, 4, 7])]


def phase_producer_body(port: int, lend: bool, saved: Any, done: Any, timeout: float) -> dict[str, Any]:
    from kv_pipe.exported_memory import page_aligned_empty

    caches = [page_aligned_empty(cache.shape, cache.dtype).copy_(cache) for cache in vp.fake_caches(1)]
    worker = vp.fake_worker("kv_producer", port, vp.FAKE_BLOCK_SIZE, caches, {"kv_lend_blocks": lend})
    try:
        with torch.inference_mode():
            worker.save(SAVES)
        phases = _phases(worker)
        saved.set()
        if not done.wait(timeout):
            raise TimeoutError(f"the consumer did not finish within {timeout} s")
        for name, values in _phases(worker).items():
            phases[name] += values
        return {"phases": phases, "lent": worker.total_stats().data["lent_requests"]}
    finally:
        worker.close()


def phase_consumer_body(port: int, saved: Any, done: Any, timeout: float) -> dict[str, Any]:
    worker = vp.fake_worker("kv_consumer", port, vp.FAKE_BLOCK_SIZE, vp.fake_caches(2), {"kv_load_timeout": 5.0})
    try:
        if not saved.wait(timeout):
            raise TimeoutError(f"the producer did not save within {timeout} s")
        time.sleep(DELAY)
        failed = vp.load_and_wait(
            worker, [LoadSpec("a", FAKE_TOKENS["a"], [0, 5], 0), LoadSpec("b", FAKE_TOKENS["b"], [6, 8, 1], 0)], timeout
        )
        return {"failed": sorted(failed), "phases": _phases(worker)}
    finally:
        done.set()
        worker.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lend", [True, False], ids=["lent", "copied"])
def test_workers_over_a_real_pipe_observe_every_phase_once_per_request(lend: bool) -> None:
    port = free_port()
    with vp.Engines() as engines:
        flags = {name: engines.event() for name in ("saved", "done")}
        engines.start("producer", phase_producer_body, {}, port=port, lend=lend, timeout=60, **flags)
        engines.start("consumer", phase_consumer_body, {}, port=port, timeout=60, **flags)
        results = engines.wait(["producer", "consumer"], timeout=100)
    producer, consumer = results["producer"]["phases"], results["consumer"]["phases"]
    assert results["consumer"]["failed"] == [] and results["producer"]["lent"] == (2 if lend else 0)
    assert len(producer["save_copy_seconds"]) == 2
    # Taken once the consumer came, DELAY after the save (the producer reports every entry taken).
    assert len(producer["entry_wait_seconds"]) == 2 and min(producer["entry_wait_seconds"]) >= DELAY
    assert all(not producer[name] for name in CONSUMER_PHASES)
    assert len(consumer["load_entry_wait_seconds"]) == 2 and len(consumer["load_copy_seconds"]) == 2
    if lend:  # a lent entry's bytes are read by the copy: nothing is received
        assert consumer["load_receive_seconds"] == []
    assert all(not consumer[name] for name in PRODUCER_PHASES)


# ====================================================================== stats and Prometheus


def test_phases_travel_through_the_stats_and_become_histograms_with_vllms_labels() -> None:
    assert set(PHASES) <= set(SAMPLES)
    ranks = [
        KVBridgeStats.of_worker(*taken)
        for taken in (
            (
                SimpleNamespace(data={"load_hits": 1}),
                SimpleNamespace(
                    transfer_seconds=[0.01],
                    load_wait_seconds=[0.02],
                    gauges={},
                    phases={"load_entry_wait_seconds": [0.0004], "load_copy_seconds": [0.003]},
                ),
            ),
            (
                SimpleNamespace(data={"load_hits": 1}),
                SimpleNamespace(
                    transfer_seconds=[], load_wait_seconds=[], gauges={}, phases={"load_entry_wait_seconds": [2.0]}
                ),
            ),
        )
    ]
    total = ranks[0].aggregate(ranks[1])
    assert total.data["load_entry_wait_seconds"] == [0.0004, 2.0] and total.data["load_receive_seconds"] == []
    assert "load_entry_wait_seconds" not in total.reduce()  # the log line keeps to counters
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    metrics = KVBridgePromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    metrics.observe(total.data, engine_idx=0)

    def value(name: str, **extra: str) -> float | None:
        return registry.get_sample_value(f"vllm:kvbridge_{name}", {"model_name": "tiny", "engine": "0", **extra})

    assert value("load_entry_wait_seconds_count") == 2 and value("load_entry_wait_seconds_bucket", le="0.0005") == 1
    assert value("load_copy_seconds_count") == 1 and value("load_receive_seconds_count") == 0
    assert value("entry_wait_seconds_count") == 0 and value("save_copy_seconds_count") == 0
    assert value("entry_wait_seconds_bucket", le="600.0") == 0  # long waits have buckets too


# ====================================================================== a live vllm serve pair


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vp.make_tiny_llama(tmp_path_factory.mktemp("phases"), with_tokenizer=True)


@pytest.mark.timeout(600)
def test_a_live_pair_exports_every_phase_histogram_after_pd_requests(tiny_model: str, tmp_path: Path) -> None:
    from harness import xpyd as xp
    from harness.servers import scrape, total

    kv_port = free_port(2)
    prefill = xp.instance(tiny_model, "prefill", "kv_producer", kv_port, 0, tmp_path)
    decode = xp.instance(tiny_model, "decode", "kv_consumer", kv_port, 1, tmp_path)
    try:
        prefill.start()
        decode.start()
        prompts = vp.make_prompts(seed=23)
        moved = [prompt for prompt in prompts if vp.transfer_prefix(prompt)][:4]
        assert moved, "no prompt long enough to move KV"
        for prompt in moved:
            answer, params = xp.by_hand(prefill.url, decode.url, prompt)
            assert answer.cached, f"the decode request did not load its KV: {answer}, {params}"
        expected = {
            prefill.url: ("save_copy_seconds_count", "entry_wait_seconds_count"),
            decode.url: ("load_entry_wait_seconds_count", "load_copy_seconds_count"),
        }
        deadline = time.monotonic() + 60
        while True:  # vLLM records a step's stats after it; an idle engine still reports each interval
            samples = {url: scrape(url) for url in expected}
            counts = {url: {name: total(samples[url], name) for name in names} for url, names in expected.items()}
            if all(count >= len(moved) for names in counts.values() for count in names.values()):
                break
            assert time.monotonic() < deadline, f"phase histograms after {len(moved)} P/D requests: {counts}"
            time.sleep(0.5)
        for every in samples.values():
            for (name, labels), _ in every.items():
                if name.endswith("_seconds_count"):
                    assert {"model_name", "engine"} <= dict(labels).keys()
        # Exactly one per request: every entry moved once (lent, on one host: none received).
        assert all(count == len(moved) for names in counts.values() for count in names.values()), counts
        assert total(samples[decode.url], "load_receive_seconds_count") == 0
        assert total(samples[prefill.url], "entry_wait_seconds_sum") > 0
    finally:
        for one in (decode, prefill):
            one.stop()
