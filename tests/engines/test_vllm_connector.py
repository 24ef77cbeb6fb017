"""The vLLM V1 connector: its parts on their own, then two real vLLM engines moving KV.

Engine tests run a producer and a consumer vLLM engine in two live processes, on a tiny random
Llama made here (no downloads), and compare the consumer's greedy tokens with a plain engine's.
"""

from __future__ import annotations

import functools
import importlib.metadata
import pickle
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from connector import compat
from connector.transfer_plan import PARAMS_KEY, LoadSpec, SaveSpec, transfer_prefix_len
from connector.transfer_stats import COUNTERS
from connector.vllm_loads import LoadTicket, LoadTracker
from connector.vllm_prom import KVBridgePromMetrics
from connector.vllm_scheduler import KVBridgeMetadata, KVBridgeWorkerMetadata, SchedulerSide
from connector.vllm_settings import ConnectorSettings, listen_port_offset
from connector.vllm_stats import STORE_TIER_COUNTERS, KVBridgeStats
from connector.vllm_worker import GAUGES, WorkerSide, find_layout
from harness import vllm_procs as vp
from harness.procs import free_port
from harness.vllm_fakes import (
    FAKE_TOKENS,
    B,
    FailingInserts,
    cached_data,
    make_request,
    new_req_data,
    poll_until_reported,
    random_blocks,
    scheduler_output,
)
from kv_pipe.errors import KVBufferFullError, KVConfigError, KVPeerLostError, KVProtocolError

# ====================================================================== settings


def test_settings_defaults_and_overrides() -> None:
    producer = ConnectorSettings.from_vllm("kv_producer", 20000, "cpu", {"kv_ip": "10.1.2.3"})
    consumer = ConnectorSettings.from_vllm(
        "kv_consumer", 20000, "cpu", {"kv_port": 21000, "kv_load_timeout": 2, "kv_timeout": 7}
    )
    assert (producer.bridge.kv_rank, producer.bridge.kv_role, producer.bridge.kv_port) == (0, "kv_producer", 20000)
    assert producer.bridge.kv_ip == "10.1.2.3"
    assert (consumer.bridge.kv_rank, consumer.bridge.kv_port, consumer.bridge.kv_timeout) == (1, 21000, 7)
    assert (consumer.load_timeout, consumer.save_timeout) == (2.0, 0.0)
    assert (
        producer.lend_blocks
        and not ConnectorSettings.from_vllm("kv_producer", 20000, "cpu", {"kv_lend_blocks": False}).lend_blocks
    )
    assert [listen_port_offset(r) for r in range(3)] == [0, 1, 2]


@pytest.mark.parametrize(
    ("role", "extra", "named"),
    [
        ("kv_consumer", {"kv_nonsense": 1}, "kv_nonsense"),
        ("kv_both", {}, "kv_both"),
        ("kv_consumer", {"kv_role": "kv_producer"}, "kv_role"),
        ("kv_consumer", {"kv_load_timeout": -1}, "kv_load_timeout"),
        ("kv_consumer", {"kv_save_timeout": True}, "kv_save_timeout"),
        ("kv_producer", {"kv_lend_blocks": "yes"}, "kv_lend_blocks"),
        ("kv_consumer", {"kv_debug_corrupt_loads": True}, "kv_debug_corrupt_loads"),  # no test hooks in production
        ("kv_consumer", {"kv_timeout": 0}, "kv_timeout"),
    ],
)
def test_settings_errors_name_the_key(role: str, extra: dict, named: str) -> None:
    with pytest.raises(KVConfigError, match=named):
        ConnectorSettings.from_vllm(role, 20000, "cpu", extra)


# ====================================================================== scheduler side


@pytest.mark.parametrize(
    ("n", "prefix"),
    [(0, 0), (1, 0), (7, 0), (31, 0), (32, 0), (33, 32), (64, 32), (65, 64), (96, 64), (97, 96), (100, 96), (200, 192)],
)
def test_transfer_prefix_leaves_the_last_token_to_vllm(n: int, prefix: int) -> None:
    assert transfer_prefix_len(n, B) == prefix


def test_consumer_claims_the_block_aligned_prefix_and_plans_its_load() -> None:
    side = SchedulerSide(B, is_producer=False, is_consumer=True)
    tokens = list(range(100, 200))  # 100 tokens: prefix 96 = 3 blocks
    request = make_request("r1", tokens)
    assert side.num_new_matched_tokens(request, 0) == 96
    assert side.num_new_matched_tokens(request, 0) == 96  # asking again changes nothing
    assert side.num_new_matched_tokens(request, 32) == 64  # vLLM's prefix cache holds the first block
    side.after_alloc(request, [7, 3, 9, 11], 64)
    # The load is asynchronous: the request waits for it, unscheduled.
    meta = side.build_meta(scheduler_output([], {}), _no_blocks)
    assert meta.loads == [LoadSpec(req_id="r1", token_ids=tokens[:96], block_ids=[7, 3, 9], skip_blocks=1)]
    assert meta.saves == []
    # Loaded once: never claimed again (e.g. after a preemption or a failed load).
    assert side.num_new_matched_tokens(request, 0) == 0
    assert side.build_meta(scheduler_output([], {"r1": 1}), _no_blocks).loads == []


@pytest.mark.parametrize("n", [1, 7, 31, 32])
def test_consumer_claims_nothing_for_prompts_within_one_block(n: int) -> None:
    side = SchedulerSide(B, is_producer=False, is_consumer=True)
    assert side.num_new_matched_tokens(make_request("r", list(range(n))), 0) == 0


def test_consumer_waits_only_for_announced_entries() -> None:
    side = SchedulerSide(B, is_producer=False, is_consumer=True)
    tokens = list(range(65))
    plain, announced = make_request("plain", tokens), make_request("ann", tokens, {PARAMS_KEY: {"prefix_tokens": 64}})
    for request in (plain, announced):
        assert side.num_new_matched_tokens(request, 0) == 64
        side.after_alloc(request, [1, 2, 3], 64)
    meta = side.build_meta(scheduler_output([], {"plain": 1, "ann": 1}), _no_blocks)
    assert {spec.req_id: spec.wait for spec in meta.loads} == {"plain": False, "ann": True}


def test_consumer_skips_preempted_requests_and_announced_mismatches() -> None:
    side = SchedulerSide(B, is_producer=False, is_consumer=True)
    tokens = list(range(65))
    preempted = make_request("p", tokens)
    preempted.num_preemptions = 1
    assert side.num_new_matched_tokens(preempted, 0) == 0
    announced_none = make_request("a", tokens, {PARAMS_KEY: {"prefix_tokens": 0}})
    assert side.num_new_matched_tokens(announced_none, 0) == 0
    announced_ok = make_request("b", tokens, {PARAMS_KEY: {"prefix_tokens": 64}})
    assert side.num_new_matched_tokens(announced_ok, 0) == 64
    malformed = make_request("c", tokens, {PARAMS_KEY: {"prefix_tokens": "64"}})
    assert side.num_new_matched_tokens(malformed, 0) == 64  # ignored: defaults apply


def test_consumer_loads_from_the_producer_its_announcement_names() -> None:
    side = SchedulerSide(B, is_producer=False, is_consumer=True)
    tokens = list(range(65))
    named = make_request(
        "n", tokens, {PARAMS_KEY: {"prefix_tokens": 64, "host": "10.0.0.7", "port": 9000, "engine_id": "p1"}}
    )
    unnamed = make_request("u", tokens, {PARAMS_KEY: {"prefix_tokens": 64}})
    for request in (named, unnamed):
        assert side.num_new_matched_tokens(request, 0) == 64
        side.after_alloc(request, [1, 2, 3], 64)
    meta = side.build_meta(scheduler_output([], {}), _no_blocks)
    assert {spec.req_id: spec.producer for spec in meta.loads} == {"n": ("10.0.0.7", 9000), "u": None}
    # A drain goes to the named producer too.
    covered = make_request("c", list(range(100, 165)), {PARAMS_KEY: {"prefix_tokens": 64, "host": "h", "port": 7}})
    assert side.num_new_matched_tokens(covered, 64) == 0
    (drain,) = side.build_meta(scheduler_output([new_req_data(covered, [4, 5, 6], 64)], {"c": 1}), _no_blocks).loads
    assert drain.drain and drain.producer == ("h", 7)


@pytest.mark.parametrize(
    "address",
    [
        {"host": "", "port": 9000},
        {"host": "h", "port": 0},
        {"host": "h", "port": 70000},
        {"host": "h", "port": "9000"},
        {"host": "h", "port": True},
        {"host": 5, "port": 9000},
        {"host": "h"},
        {"host": "a b", "port": 1},
        {"host": "h\n", "port": 1},
        {"host": "h" * 300, "port": 1},
    ],
)
def test_a_malformed_producer_address_claims_nothing(address: dict) -> None:
    side = SchedulerSide(B, is_producer=False, is_consumer=True)
    request = make_request("m", list(range(65)), {PARAMS_KEY: {"prefix_tokens": 64, **address}})
    assert side.num_new_matched_tokens(request, 0) == 0


def test_producer_announces_its_address_and_engine() -> None:
    side = SchedulerSide(B, is_producer=True, is_consumer=False, address=("10.0.0.5", 14579), engine_id="e7")
    request = make_request("r", list(range(65)))
    side.build_meta(scheduler_output([new_req_data(request, [1, 2, 3], 0)], {"r": 65}), lambda req_id: [1, 2, 3])
    held, params = side.request_finished(request)
    side.record_saves(KVBridgeWorkerMetadata.of_one_worker({"r"}, set()))
    assert params == {
        PARAMS_KEY: {"prefix_tokens": 64, "host": "10.0.0.5", "port": 14579, "engine_id": "e7", "tp_size": 1}
    }
    # Its blocks may be lent: vLLM keeps them until the workers, told in the next step, report them.
    assert held and side.build_meta(scheduler_output([], {}), _no_blocks).held == ["r"]
    assert side.build_meta(scheduler_output([], {}), _no_blocks).held == []  # told once


def test_consumer_drains_entries_its_prefix_cache_already_holds() -> None:
    side = SchedulerSide(B, is_producer=False, is_consumer=True)
    tokens = list(range(500, 565))  # prefix 64
    request = make_request("dup", tokens)
    assert side.num_new_matched_tokens(request, 64) == 0
    meta = side.build_meta(scheduler_output([new_req_data(request, [4, 5, 6], 64)], {"dup": 1}), _no_blocks)
    (spec,) = meta.loads
    assert spec.drain and spec.token_ids == tokens[:64] and spec.block_ids == [4, 5]
    assert side.build_meta(scheduler_output([], {"dup": 1}), _no_blocks).loads == []


def test_consumer_hands_an_unplanned_allocation_to_the_worker_to_fail() -> None:
    """vLLM waits for every asynchronously claimed request: one the connector cannot load must be
    reported failed by the worker, not forgotten."""
    side = SchedulerSide(B, is_producer=False, is_consumer=True)
    request = make_request("odd", list(range(100)))
    assert side.num_new_matched_tokens(request, 0) == 96
    side.after_alloc(request, [4, 5], 96)  # fewer blocks than the claim needs
    meta = side.build_meta(scheduler_output([], {}), _no_blocks)
    assert meta.loads == [] and meta.refused == {"odd": [4, 5]}
    assert side.build_meta(scheduler_output([], {}), _no_blocks).refused == {}
    assert side.num_new_matched_tokens(request, 0) == 0  # never claimed again


def test_consumer_forgets_aborted_requests() -> None:
    side = SchedulerSide(B, is_producer=False, is_consumer=True)
    request = make_request("gone", list(range(70)))
    side.num_new_matched_tokens(request, 0)
    side.after_alloc(request, [1, 2, 3], 64)
    assert side.request_finished(request) == (False, None)
    assert side.build_meta(scheduler_output([], {}), _no_blocks).loads == []


def test_producer_saves_once_the_prefix_is_computed_with_chunked_prefill() -> None:
    side = SchedulerSide(B, is_producer=True, is_consumer=False)
    tokens = list(range(1000, 1200))  # 200 tokens: prefix 192 = 6 blocks
    request = make_request("r", tokens)
    blocks = [40, 41, 42, 43, 44, 45, 46]
    block_ids_of = {"r": blocks}.__getitem__
    step1 = side.build_meta(scheduler_output([new_req_data(request, blocks[:3], 0)], {"r": 96}), block_ids_of)
    assert step1.saves == []  # 96 of 192 computed
    step2 = side.build_meta(scheduler_output([], {"r": 64}, cached_data(["r"], [96])), block_ids_of)
    assert step2.saves == []  # 160 of 192
    step3 = side.build_meta(scheduler_output([], {"r": 40}, cached_data(["r"], [160])), block_ids_of)
    assert step3.saves == [SaveSpec(req_id="r", token_ids=tokens[:192], block_ids=blocks[:6])]
    side.record_saves(KVBridgeWorkerMetadata.of_one_worker({"r"}, set()))  # the workers' outcome of step 3
    step4 = side.build_meta(scheduler_output([], {"r": 1}, cached_data(["r"], [200])), block_ids_of)
    assert step4.saves == []  # saved once
    request.num_computed_tokens = 201
    assert side.request_finished(request) == (
        True,
        {PARAMS_KEY: {"prefix_tokens": 192, "host": "127.0.0.1", "port": 14579, "engine_id": "", "tp_size": 1}},
    )


def test_producer_announces_a_prefix_only_once_every_worker_saved_it() -> None:
    side = SchedulerSide(B, is_producer=True, is_consumer=False, num_workers=2)
    requests = {
        name: make_request(name, list(range(start, start + 65)))
        for name, start in (("saved", 0), ("full", 100), ("half", 200), ("short", 300))
    }
    requests["short"] = make_request("short", list(range(300, 307)))  # within one block: nothing to save
    new = [new_req_data(request, [index], 0) for index, request in enumerate(requests.values())]
    meta = side.build_meta(scheduler_output(new, {name: 65 for name in requests}), lambda req_id: [1, 2, 3])
    assert [spec.req_id for spec in meta.saves] == ["saved", "full", "half"]
    # A prefill request (max_tokens=1) finishes in the step that saves it: vLLM calls
    # request_finished before it hands over that step's worker outcomes...
    finished = {name: side.request_finished(request) for name, request in requests.items()}
    announced = {name: params for name, (_, params) in finished.items()}
    assert all(params[PARAMS_KEY]["prefix_tokens"] == 0 for params in announced.values())
    # vLLM keeps the blocks of each request handed to the workers to save, saved or not.
    assert {name: held for name, (held, _) in finished.items()} == {
        "saved": True,
        "full": True,
        "half": True,
        "short": False,
    }
    # ...then the outcomes of both TP ranks, aggregated by vLLM: rank 1 could not save "full" (buffer
    # full) and did not report "half" at all.
    rank0 = KVBridgeWorkerMetadata.of_one_worker({"saved", "full", "half"}, set())
    rank1 = KVBridgeWorkerMetadata.of_one_worker({"saved"}, {"full"})
    side.record_saves(pickle.loads(pickle.dumps(rank0.aggregate(rank1))))
    assert {name: params[PARAMS_KEY]["prefix_tokens"] for name, params in announced.items()} == {
        "saved": 64,
        "full": 0,
        "half": 0,
        "short": 0,
    }


def test_producer_announces_nothing_for_a_failed_save_known_before_the_finish() -> None:
    side = SchedulerSide(B, is_producer=True, is_consumer=False)
    request = make_request("r", list(range(100)))
    meta = side.build_meta(
        scheduler_output([new_req_data(request, [5, 6, 7, 8], 0)], {"r": 96}), lambda req_id: [5, 6, 7, 8]
    )
    assert [spec.req_id for spec in meta.saves] == ["r"]
    side.record_saves(KVBridgeWorkerMetadata.of_one_worker(set(), {"r"}))  # e.g. the peer was lost
    assert side.request_finished(request)[1][PARAMS_KEY]["prefix_tokens"] == 0


def test_producer_keeps_zero_when_the_outcome_comes_after_the_announcement_left() -> None:
    side = SchedulerSide(B, is_producer=True, is_consumer=False)
    request = make_request("r", list(range(65)))
    side.build_meta(scheduler_output([new_req_data(request, [1, 2, 3], 0)], {"r": 65}), lambda req_id: [1, 2, 3])
    _, params = side.request_finished(request)
    side.build_meta(scheduler_output([], {}), _no_blocks)  # the next step: the announcement is gone
    side.record_saves(KVBridgeWorkerMetadata.of_one_worker({"r"}, set()))
    assert params[PARAMS_KEY]["prefix_tokens"] == 0


def test_worker_metadata_aggregates_ranks() -> None:
    one = KVBridgeWorkerMetadata.of_one_worker({"a", "b"}, {"c"})
    two = KVBridgeWorkerMetadata.of_one_worker({"a"}, {"b"})
    assert one.aggregate(two) == KVBridgeWorkerMetadata(saved={"a": 2, "b": 1}, failed={"b", "c"})
    assert one == KVBridgeWorkerMetadata.of_one_worker({"a", "b"}, {"c"})  # inputs left intact


def test_producer_saves_a_prefix_served_by_its_own_prefix_cache() -> None:
    side = SchedulerSide(B, is_producer=True, is_consumer=False)
    tokens = list(range(3000, 3065))  # prefix 64
    request = make_request("r", tokens)
    meta = side.build_meta(
        scheduler_output([new_req_data(request, [8, 9, 10], 64)], {"r": 1}), {"r": [8, 9, 10]}.__getitem__
    )
    assert meta.saves == [SaveSpec(req_id="r", token_ids=tokens[:64], block_ids=[8, 9])]


def test_producer_announces_nothing_for_requests_aborted_before_their_save() -> None:
    side = SchedulerSide(B, is_producer=True, is_consumer=False)
    request = make_request("r", list(range(200)))
    side.build_meta(scheduler_output([new_req_data(request, [1, 2, 3], 0)], {"r": 96}), _no_blocks)
    assert side.request_finished(request) == (
        False,
        {PARAMS_KEY: {"prefix_tokens": 0, "host": "127.0.0.1", "port": 14579, "engine_id": "", "tp_size": 1}},
    )
    later = side.build_meta(scheduler_output([], {"r": 96}, cached_data(["r"], [96])), _no_blocks)
    assert later.saves == []  # forgotten


def test_metadata_survives_pickling_between_vllm_processes() -> None:
    meta = KVBridgeMetadata(loads=[LoadSpec("a", [1, 2], [3], 0)], saves=[SaveSpec("b", [4], [5])])
    assert pickle.loads(pickle.dumps(meta)) == meta


def _no_blocks(req_id: str) -> list[int]:
    raise AssertionError(f"no block lookup expected, got one for {req_id}")


# ====================================================================== compatibility handshake


def layout_info(**changes: object) -> compat.KVLayoutInfo:
    values = dict(
        version=compat.VERSION,
        role="kv_producer",
        model="m",
        dtype="torch.float32",
        block_size=32,
        num_layers=2,
        block_shape=(1, 2, 32, 128),
        layout="CPU_ATTN/vec",
        tp_size=1,
        tp_rank=0,
    )
    values.update(changes)
    return compat.KVLayoutInfo(**values)


def test_handshake_roundtrip_and_compatible_pair() -> None:
    info = layout_info()
    assert compat.decode(compat.encode(info)) == info
    compat.check_compatible(info, layout_info(role="kv_consumer"))


def test_handshake_names_every_difference() -> None:
    with pytest.raises(KVConfigError) as error:
        compat.check_compatible(
            layout_info(),
            layout_info(role="kv_consumer", block_size=64, dtype="torch.bfloat16", block_shape=(1, 2, 64, 128)),
        )
    message = str(error.value)
    assert "block_size: this side 32, peer 64" in message
    assert "dtype" in message and "block_shape" in message and "model" not in message
    with pytest.raises(KVConfigError, match="kv_producer"):
        compat.check_compatible(layout_info(), layout_info())  # two producers


@pytest.mark.parametrize(
    "payload",
    [
        torch.tensor([1.0, 2.0]),
        torch.zeros((2, 2), dtype=torch.uint8),
        torch.frombuffer(bytearray(b"\xc1garbage"), dtype=torch.uint8),
        torch.zeros(compat.MAX_MESSAGE_BYTES + 1, dtype=torch.uint8),
        None,
    ],
)
def test_handshake_rejects_malformed_messages(payload: torch.Tensor | None) -> None:
    with pytest.raises(KVProtocolError):
        compat.decode(payload)


def test_handshake_rejects_another_version() -> None:
    with pytest.raises(KVProtocolError, match="version 99"):
        compat.decode(compat.encode(layout_info(version=99)))


# ====================================================================== stats and layout


def test_stats_aggregate_reduce_and_reset() -> None:
    a, b = (
        KVBridgeStats(),
        KVBridgeStats.from_data({"load_hits": 2, "loaded_bytes": 10, "transfer_seconds": [0.5], "connections": 1}),
    )
    assert a.is_empty() and not b.is_empty()
    a.add(load_hits=1, load_seconds=0.25)
    a.data["transfer_seconds"].append(0.125)
    total = a.aggregate(b)
    assert total.data["transfer_seconds"] == [0.125, 0.5] and total.data["connections"] == 1
    reduced = total.reduce()
    assert set(reduced) == {*COUNTERS, *GAUGES, "transfers"}
    assert (reduced["load_hits"], reduced["loaded_bytes"], reduced["load_seconds"], reduced["transfers"]) == (
        3,
        10,
        0.25,
        2,
    )
    with pytest.raises(KeyError):
        a.add(nonsense=1)
    a.reset()
    assert a.is_empty()
    assert not KVBridgeStats.from_data({"connections": -1}).is_empty()  # a lost connection is news
    assert pickle.loads(pickle.dumps(total)).data == total.data  # travels between vLLM's processes


def test_prometheus_metrics_carry_vllms_labels() -> None:
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    labels = {0: ["tiny", "0"], 1: ["tiny", "1"]}
    metrics = KVBridgePromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], labels)
    data = KVBridgeStats.from_data(
        {
            "load_hits": 2,
            "loaded_bytes": 4096,
            "load_errors": 1,
            "transfer_seconds": [0.002, 0.3],
            "load_wait_seconds": [1.5],
            "connections": 1,
        }
    ).data
    metrics.observe(data, engine_idx=1)
    metrics.observe(KVBridgeStats.from_data({"load_hits": 1, "transfer_seconds": [0.01]}).data, engine_idx=1)

    def value(name: str, engine: str = "1", **extra: str) -> float | None:
        return registry.get_sample_value(f"vllm:kvbridge_{name}", {"model_name": "tiny", "engine": engine, **extra})

    assert (value("load_hits_total"), value("loaded_bytes_total"), value("load_errors_total")) == (3, 4096, 1)
    assert value("load_misses_total") == 0 and value("load_hits_total", engine="0") == 0
    assert value("transfer_seconds_count") == 3 and value("transfer_seconds_bucket", le="0.005") == 1
    assert value("load_wait_seconds_count") == 1 and value("load_wait_seconds_sum") == 1.5
    assert value("connections") == 1


def test_store_stats_aggregate_per_tier_across_workers() -> None:
    one = KVBridgeStats.from_data(
        {
            "store_hit_chunks": {"memory": 2},
            "store_read_bytes": {"memory": 100},
            "store_tier_up": {"memory": 1, "redis": 1},
            "store_load_errors": {"missing": 1},
            "store_load_seconds": [0.5],
        }
    )
    two = KVBridgeStats.from_data(
        {
            "store_hit_chunks": {"memory": 1, "redis": 3},
            "store_read_bytes": {"redis": 7},
            "store_tier_up": {"redis": 0},
            "store_load_errors": {"missing": 2, "checksum": 1},
            "store_save_seconds": [0.25],
        }
    )
    assert KVBridgeStats().is_empty() and not two.is_empty()
    total = one.aggregate(two)
    assert total.data["store_hit_chunks"] == {"memory": 3, "redis": 3}
    assert total.data["store_read_bytes"] == {"memory": 100, "redis": 7}
    assert total.data["store_tier_up"] == {"memory": 1, "redis": 0}  # down for one worker: down
    assert total.data["store_load_errors"] == {"missing": 3, "checksum": 1}
    assert (total.data["store_load_seconds"], total.data["store_save_seconds"]) == ([0.5], [0.25])
    reduced = total.reduce()
    assert (reduced["store_hit_chunks.redis"], reduced["store_tier_up.redis"]) == (3, 0)
    assert pickle.loads(pickle.dumps(total)).data == total.data
    total.reset()
    assert total.is_empty()


def test_prometheus_metrics_carry_the_store_tier_and_reason_labels() -> None:
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    metrics = KVBridgePromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    counts = {name: {"disk": 3} for name in STORE_TIER_COUNTERS}
    metrics.observe(
        KVBridgeStats.from_data(
            {
                **counts,
                "store_tier_up": {"disk": 1, "redis": 0},
                "store_load_errors": {"checksum": 2},
                "store_load_seconds": [0.002],
                "store_save_seconds": [0.0002],
            }
        ).data
    )
    metrics.observe(KVBridgeStats.from_data({"store_hit_chunks": {"disk": 1}, "store_tier_up": {"redis": 1}}).data)

    def value(name: str, **extra: str) -> float | None:
        return registry.get_sample_value(f"vllm:kvbridge_{name}", {"model_name": "tiny", "engine": "0", **extra})

    assert value("store_hit_chunks_total", tier="disk") == 4
    for name in STORE_TIER_COUNTERS[1:]:
        assert value(f"{name}_total", tier="disk") == 3
    assert (value("store_tier_up", tier="disk"), value("store_tier_up", tier="redis")) == (1, 1)
    assert value("store_load_errors_total", reason="checksum") == 2
    assert value("store_load_seconds_count") == 1 and value("store_load_seconds_sum") == 0.002
    assert value("store_save_seconds_bucket", le="0.00025") == 1


def test_find_layout_cpu_and_flash_shapes() -> None:
    cpu = find_layout(torch.empty(10, 2, 32, 128), 10, 32, "cpu")
    flash = find_layout(torch.empty(2, 10, 32, 4, 64), 10, 32, "flash")
    assert (cpu.block_dim, cpu.block_size_dim, flash.block_dim, flash.block_size_dim) == (0, 2, 1, 2)
    with pytest.raises(KVConfigError, match="block dimension"):
        find_layout(torch.empty(40, 2, 8, 128), 10, 32, "split kernel blocks")


# ====================================================================== worker side over a real pipe


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lend", [True, False], ids=["lent", "copied"])
def test_worker_moves_whole_blocks_bit_exact_and_reports_misses(lend: bool) -> None:
    saves = [
        SaveSpec("a", FAKE_TOKENS["a"], [3, 6]),
        SaveSpec("b", FAKE_TOKENS["b"], [1, 4, 7]),
        SaveSpec("c", FAKE_TOKENS["c"], [2]),
        SaveSpec("d", FAKE_TOKENS["d"], [8]),
    ]
    steps = [
        ("load", [LoadSpec("a", FAKE_TOKENS["a"], [5, 0], 0)]),
        ("load", [LoadSpec("b", FAKE_TOKENS["b"], [2, 1, 6], 1)]),  # block 2 is held locally: not written
        ("load", [LoadSpec("x", FAKE_TOKENS["x"], [3], 0)]),  # never saved: a miss
        ("load", [LoadSpec("c", FAKE_TOKENS["c"], [4], 1)]),  # fully held locally: drained
        ("corrupt", True),
        ("load", [LoadSpec("d", FAKE_TOKENS["d"], [7], 0)]),
    ]
    port = free_port()
    with vp.Engines() as engines:
        saved, done = engines.event(), engines.event()
        engines.start(
            "producer",
            vp.worker_producer_body,
            {},
            port=port,
            saves=saves,
            saved=saved,
            done=done,
            timeout=60,
            extra={"kv_lend_blocks": lend},
        )
        engines.start(
            "consumer", vp.worker_consumer_body, {}, port=port, steps=steps, saved=saved, done=done, timeout=60
        )
        results = engines.wait(["producer", "consumer"], timeout=100)
    producer, consumer = results["producer"], results["consumer"]
    src = [c.numpy() for c in vp.fake_caches(1)]
    expected = [c.numpy() for c in vp.fake_caches(2)]
    for layer in range(vp.FAKE_LAYERS):
        for dst, source in ((5, 3), (0, 6), (1, 4), (6, 7)):
            expected[layer][dst] = src[layer][source]
    got = consumer["caches"]
    for layer in range(vp.FAKE_LAYERS):
        untouched_or_loaded = [b for b in range(vp.FAKE_BLOCKS) if b != 7]
        assert np.array_equal(
            got[layer][untouched_or_loaded].view(np.uint32), expected[layer][untouched_or_loaded].view(np.uint32)
        ), f"layer {layer}"
        # The negative control wrote noise: neither the producer's block nor what was there before.
        assert not np.array_equal(got[layer][7], src[layer][8])
        assert not np.array_equal(got[layer][7], expected[layer][7])
        assert np.isfinite(got[layer][7]).all() and np.abs(got[layer][7]).sum() > 0
    assert consumer["failed"] == [[], [], [3], [], []]
    stats = consumer["stats"]
    assert (stats["load_hits"], stats["load_misses"], stats["load_errors"], stats["drained"]) == (3, 1, 0, 1)
    # Only the blocks not held locally travel ("b": 2 of its 3), with each entry's int64 tokens and bool roi.
    block_bytes = vp.FAKE_LAYERS * vp.FAKE_HEADS * vp.FAKE_BLOCK_SIZE * 2 * vp.FAKE_HEAD_SIZE * 4
    assert stats["loaded_blocks"] == 5 and stats["loaded_bytes"] == sum(
        9 * len(FAKE_TOKENS[req_id]) + blocks * block_bytes for req_id, blocks in (("a", 2), ("b", 2), ("d", 1))
    )
    assert producer["stats"]["saved_requests"] == 4 and producer["stats"]["saved_blocks"] == 7
    assert producer["outcomes"] == ({"a", "b", "c", "d"}, set())
    assert producer["entries_left"] == 0
    # Lent: each save's blocks were returned to vLLM once its loan ended (borrowed and copied by the
    # consumer, borrowed and given back unread by the drain, or copied by the producer for the
    # corrupting buffer, which does not borrow), and not before. Copied: at once. A held request that
    # was never saved is never reported.
    assert producer["stats"]["lent_requests"] == (4 if lend else 0)
    assert producer["early"] == (set() if lend else {"a", "b", "c", "d"})
    assert producer["returned"] == {"a", "b", "c", "d"} and producer["stats"]["returned_requests"] == 4


def test_worker_reports_which_saves_reached_the_buffer() -> None:
    buffer = FailingInserts(
        {FAKE_TOKENS["b"][0]: KVBufferFullError("full"), FAKE_TOKENS["d"][0]: KVPeerLostError("the consumer is gone")}
    )
    worker = vp.fake_worker(
        "kv_producer",
        1,
        vp.FAKE_BLOCK_SIZE,
        vp.fake_caches(1),
        {},
        listener_factory=lambda settings, offset, on_connect: buffer,
    )
    worker.save(
        [
            SaveSpec("a", FAKE_TOKENS["a"], [0, 1]),
            SaveSpec("b", FAKE_TOKENS["b"], [2, 3, 4]),
            SaveSpec("c", FAKE_TOKENS["c"], [5]),
        ]
    )
    assert worker.take_save_outcomes() == ({"a", "c"}, {"b"})
    assert buffer.inserted == [FAKE_TOKENS["a"], FAKE_TOKENS["c"]]
    # A failed insert costs that request only: the next one is tried.
    worker.save([SaveSpec("d", FAKE_TOKENS["d"], [3]), SaveSpec("x", FAKE_TOKENS["x"], [4])])
    assert worker.take_save_outcomes() == ({"x"}, {"d"})
    assert worker.take_save_outcomes() == (set(), set())
    assert buffer.inserted == [FAKE_TOKENS["a"], FAKE_TOKENS["c"], FAKE_TOKENS["x"]]
    worker.close()


# ====================================================================== asynchronous loads


class _ScriptedSelects:
    """A consumer's lookup buffer answering each select by the request's first token: with the
    blocks in ``hits``, a miss, or by raising ``errors``; a select whose token has a gate in
    ``gates`` waits for it first (as for an entry the producer inserts late)."""

    def __init__(
        self,
        hits: dict[int, torch.Tensor],
        errors: dict[int, Exception] | None = None,
        gates: dict[int, threading.Event] | None = None,
    ) -> None:
        self.hits, self.errors, self.gates = hits, errors or {}, gates or {}
        self.selected: list[int] = []  # first tokens of the selects that reached the buffer
        self.failure: Exception | None = None  # a live connection

    def drop_select(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        timeout: float | None = None,
        borrow: bool = False,
        span: tuple[int, int, int] | None = None,
    ) -> list:
        first = int(input_tokens[0])
        self.selected.append(first)
        gate = self.gates.get(first)
        if gate is not None and not gate.wait(60):
            raise AssertionError("the test never opened the gate")
        if first in self.errors:
            raise self.errors[first]
        blocks = self.hits.pop(first, None)  # taken: a second select misses
        if blocks is None:
            return [None] * 5
        if span is not None:  # as a producer does: only that range of the entry
            blocks = blocks.narrow(span[0], span[1], span[2] - span[1])
        return [input_tokens.clone(), roi.clone(), blocks, None, None]

    def close(self) -> None:
        for gate in self.gates.values():
            gate.set()


def _consumer(*buffers: _ScriptedSelects, dialed: list[tuple[str, int]] | None = None):
    """A consumer worker whose connections are ``buffers``, one per connection made, in order."""
    remaining = list(buffers)

    def dialer(settings: ConnectorSettings, host: str, port: int, on_connect: object) -> _ScriptedSelects:
        if dialed is not None:
            dialed.append((host, port))
        if not remaining:
            raise KVPeerLostError("no more connections in this test")
        return remaining.pop(0)

    return vp.fake_worker(
        "kv_consumer", 1, vp.FAKE_BLOCK_SIZE, vp.fake_caches(2), {"kv_load_timeout": 1.0}, dialer=dialer
    )


def _same_bits(got: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    return all(torch.equal(g.view(torch.int32), e.view(torch.int32)) for g, e in zip(got, expected, strict=True))


def test_async_loads_report_each_request_once_and_its_errors_no_later() -> None:
    a, b = random_blocks(1, 2), random_blocks(2, 3)
    buffer = _ScriptedSelects({FAKE_TOKENS["a"][0]: a, FAKE_TOKENS["b"][0]: b})
    worker = _consumer(buffer)
    worker.start_loads(
        [
            LoadSpec("a", FAKE_TOKENS["a"], [5, 0], 0),
            LoadSpec("x", FAKE_TOKENS["x"], [3], 0),
            LoadSpec("b", FAKE_TOKENS["b"], [2, 1, 6], 1),
        ]
    )  # block 2 is held locally
    polls = poll_until_reported(worker, {"a", "x", "b"})
    reported = [req_id for finished, _ in polls for req_id in finished]
    assert sorted(reported) == ["a", "b", "x"]  # each exactly once
    (miss_poll,) = [index for index, (finished, _) in enumerate(polls) if "x" in finished]
    assert polls[miss_poll][1] == {3}  # the miss's blocks in the very poll that reports it
    assert all(not failed for index, (_, failed) in enumerate(polls) if index != miss_poll)
    for _ in range(3):
        assert worker.take_finished_loads() == set() and worker.take_failed_blocks() == set()
    expected = vp.fake_caches(2)
    for layer in range(vp.FAKE_LAYERS):
        expected[layer][[5, 0]] = a[layer]
        expected[layer][[1, 6]] = b[layer][1:]
    assert _same_bits(worker.caches, expected)
    stats = worker.total_stats().data
    assert (stats["load_hits"], stats["load_misses"], stats["loaded_blocks"]) == (2, 1, 4)
    counters, observed = worker.take_stats()
    assert counters.data["load_hits"] == 2 and observed.gauges.get("connections", 0) == 1
    assert len(observed.transfer_seconds) == 2 and len(observed.load_wait_seconds) == 3  # the miss waited too
    assert worker.take_stats() is None
    worker.close()


def test_a_waiting_load_holds_neither_the_caller_nor_other_loads() -> None:
    late = threading.Event()
    a, b = random_blocks(1, 2), random_blocks(2, 3)
    buffer = _ScriptedSelects({FAKE_TOKENS["a"][0]: a, FAKE_TOKENS["b"][0]: b}, gates={FAKE_TOKENS["a"][0]: late})
    worker = _consumer(buffer)
    worker.start_loads([LoadSpec("a", FAKE_TOKENS["a"], [5, 0], 0, wait=True)])  # returns while "a" waits
    worker.start_loads([LoadSpec("b", FAKE_TOKENS["b"], [2, 1, 6], 0)])
    polls = poll_until_reported(worker, {"b"})
    assert "a" not in set().union(*(f for f, _ in polls))  # still waiting for its entry
    late.set()  # the producer inserts the entry
    poll_until_reported(worker, {"a"})
    expected = vp.fake_caches(2)
    for layer in range(vp.FAKE_LAYERS):
        expected[layer][[5, 0]] = a[layer]
        expected[layer][[2, 1, 6]] = b[layer]
    assert _same_bits(worker.caches, expected)
    worker.close()


def test_an_aborted_load_writes_nothing_yet_takes_its_entry() -> None:
    late = threading.Event()
    buffer = _ScriptedSelects({FAKE_TOKENS["a"][0]: random_blocks(1, 2)}, gates={FAKE_TOKENS["a"][0]: late})
    worker = _consumer(buffer)
    worker.start_loads([LoadSpec("a", FAKE_TOKENS["a"], [5, 0], 0, wait=True)])
    # vLLM aborts the waiting request: the abort reaches the worker before the entry does.
    assert worker.take_finished_loads({"a"}) == set()
    late.set()
    polls = poll_until_reported(worker, {"a"})
    assert all(not failed for _, failed in polls)  # the blocks may belong to another request by now
    assert _same_bits(worker.caches, vp.fake_caches(2))  # nothing written
    assert buffer.selected == [FAKE_TOKENS["a"][0]] and buffer.hits == {}  # the entry was taken: no leak
    stats = worker.total_stats().data
    assert (stats["load_hits"], stats["drained"]) == (0, 1)
    worker.close()


def test_a_connection_lost_mid_load_fails_that_load_and_the_next_load_connects_again() -> None:
    late = threading.Event()
    lost = _ScriptedSelects(
        {}, gates={FAKE_TOKENS["a"][0]: late}, errors={FAKE_TOKENS["a"][0]: KVPeerLostError("the producer is gone")}
    )
    replacement = _ScriptedSelects({FAKE_TOKENS["b"][0]: random_blocks(2, 3)})
    dialed: list[tuple[str, int]] = []
    worker = _consumer(lost, replacement, dialed=dialed)
    worker.start_loads([LoadSpec("a", FAKE_TOKENS["a"], [5, 0], 0, wait=True, producer=("10.0.0.7", 9000))])
    assert worker.take_finished_loads() == set()
    late.set()  # the peer dies while the load waits
    polls = poll_until_reported(worker, {"a"})
    (poll,) = [p for p in polls if "a" in p[0]]
    assert poll[1] == {5, 0}
    _, observed = worker.take_stats()
    assert observed.gauges.get("connections", 0) == 0  # opened, then lost
    worker.start_loads([LoadSpec("b", FAKE_TOKENS["b"], [2, 1, 6], 0, wait=True, producer=("10.0.0.7", 9000))])
    polls = poll_until_reported(worker, {"b"})
    (poll,) = [p for p in polls if "b" in p[0]]
    assert poll[1] == set()
    assert dialed == [("10.0.0.7", 9000), ("10.0.0.7", 9000)]  # connected again to the producer the request named
    assert lost.selected == [FAKE_TOKENS["a"][0]] and replacement.selected == [FAKE_TOKENS["b"][0]]
    assert _same_bits([c[[2, 1, 6]] for c in worker.caches], [b.squeeze(0) for b in random_blocks(2, 3).split(1)])
    stats = worker.total_stats().data
    assert (stats["load_errors"], stats["load_hits"]) == (1, 1)
    _, observed = worker.take_stats()
    assert observed.gauges.get("connections", 0) == 1
    worker.close()


def test_loads_go_to_the_producer_their_request_names_else_the_configured_one() -> None:
    buffers = [_ScriptedSelects({}) for _ in range(3)]
    dialed: list[tuple[str, int]] = []
    worker = _consumer(*buffers, dialed=dialed)
    specs = [
        LoadSpec("p", FAKE_TOKENS["a"], [0, 1], 0, producer=("10.0.0.7", 9000)),
        LoadSpec("q", FAKE_TOKENS["c"], [2], 0, producer=("10.0.0.8", 9000)),
        LoadSpec("r", FAKE_TOKENS["d"], [3], 0),
        LoadSpec("s", FAKE_TOKENS["x"], [4], 0, producer=("10.0.0.7", 9000)),
    ]
    for spec in specs:  # one at a time: the order of connections is then known
        worker.start_loads([spec])
        poll_until_reported(worker, {spec.req_id})
    assert dialed == [("10.0.0.7", 9000), ("10.0.0.8", 9000), ("127.0.0.1", 1)]  # the last reuses the first
    assert [b.selected for b in buffers] == [
        [FAKE_TOKENS["a"][0], FAKE_TOKENS["x"][0]],
        [FAKE_TOKENS["c"][0]],
        [FAKE_TOKENS["d"][0]],
    ]
    assert worker.connections == 3
    worker.close()


def test_a_tp_rank_uses_its_own_port_at_the_named_producer() -> None:
    settings = ConnectorSettings.from_vllm("kv_consumer", 20000, "cpu", {"kv_ip": "10.0.0.1"})
    identity = compat.KVLayoutInfo(
        version=compat.VERSION,
        role="kv_consumer",
        model="m",
        dtype="",
        block_size=B,
        num_layers=0,
        block_shape=(),
        layout="",
        tp_size=4,
        tp_rank=3,
    )
    worker = WorkerSide(settings, identity, listen_port_offset(3))
    assert worker.producer_address(("10.0.0.9", 30000)) == ("10.0.0.9", 30003)
    assert worker.producer_address(None) == ("10.0.0.1", 20003)


def test_a_refused_load_is_reported_at_once_with_its_blocks_failed() -> None:
    buffer = _ScriptedSelects({})
    worker = _consumer(buffer)
    worker.refuse_loads({"odd": [4, 5]})
    (poll,) = [p for p in poll_until_reported(worker, {"odd"}) if "odd" in p[0]]
    assert poll[1] == {4, 5} and buffer.selected == []
    assert _same_bits(worker.caches, vp.fake_caches(2))
    worker.close()


def test_a_load_that_raises_fails_all_its_blocks() -> None:
    tracker = LoadTracker(threads=1)

    def broken(ticket: LoadTicket) -> set[int]:
        raise RuntimeError("a bug")

    tracker.start("r", [4, 7], broken)
    with pytest.raises(ValueError, match="already"):  # in flight or not reported yet
        tracker.start("r", [1], lambda ticket: set())
    tracker.close()  # waits for the job
    assert tracker.take_finished() == {"r"} and tracker.take_failed_blocks() == {4, 7}


class _FullBuffer(FailingInserts):
    """A producer's lookup buffer that stays full: an insert allowed to wait for room would wait
    for ever (here: fails the test), one that may not is refused at once."""

    def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None,
        hidden: torch.Tensor | None,
        timeout: float | None = None,
    ) -> None:
        if timeout != 0:
            raise AssertionError(f"the engine step would wait up to {timeout} s for room in the buffer")
        raise KVBufferFullError("no room")


def test_by_default_a_save_holds_the_step_only_for_the_copy() -> None:
    buffer = _FullBuffer({})
    worker = vp.fake_worker(
        "kv_producer",
        1,
        vp.FAKE_BLOCK_SIZE,
        vp.fake_caches(1),
        {},
        listener_factory=lambda settings, offset, on_connect: buffer,
    )
    worker.save([SaveSpec("a", FAKE_TOKENS["a"], [0, 1])])
    assert worker.take_save_outcomes() == (set(), {"a"})  # announced with 0 tokens: the consumer computes it
    worker.close()


def test_a_producer_counts_the_entries_that_expired_unselected() -> None:
    worker = vp.fake_worker(
        "kv_producer", free_port(), vp.FAKE_BLOCK_SIZE, vp.fake_caches(1), {"kv_entry_timeout": 0.3}
    )
    try:
        worker.save([SaveSpec("a", FAKE_TOKENS["c"], [2]), SaveSpec("b", FAKE_TOKENS["d"], [3])])
        assert worker.take_save_outcomes() == ({"a", "b"}, set())
        expired = 0
        deadline = time.monotonic() + 30
        while expired < 2:  # a hang guard, not a timing claim
            assert time.monotonic() < deadline, "the entries never expired"
            taken = worker.take_stats()
            expired += taken[0].data["expired_entries"] if taken is not None else 0
            time.sleep(0.05)
        assert expired == 2 and worker.buffer_stats().entries == 0
        assert worker.take_stats() is None  # reported once
    finally:
        worker.close()


@pytest.mark.timeout(120)
def test_worker_refuses_an_incompatible_peer_naming_the_difference() -> None:
    port = free_port()
    with vp.Engines() as engines:
        done = engines.event()
        engines.start("producer", vp.worker_mismatch_producer_body, {}, port=port, block_size=4, done=done, timeout=60)
        engines.start("consumer", vp.worker_mismatch_consumer_body, {}, port=port, block_size=8, done=done, timeout=60)
        results = engines.wait(["producer", "consumer"], timeout=100)
    assert results["consumer"]["failed"] == [0]  # the load failed: vLLM recomputes or fails it
    for side, warnings in (("producer", results["producer"]), ("consumer", results["consumer"]["warnings"])):
        refusal = [w for w in warnings if "incompatible" in w]
        assert refusal, (side, warnings)
        assert "block_size" in refusal[0] and "block_shape" in refusal[0], (side, refusal)


@pytest.mark.timeout(180)
def test_a_restarted_producer_is_used_again_without_restarting_the_consumer() -> None:
    first, second, lost = (SaveSpec(name, FAKE_TOKENS[name], [i]) for i, name in enumerate("cdx"))  # 1 block each
    loads = [
        LoadSpec(spec.req_id, spec.token_ids, [5 + i], 0, wait=True) for i, spec in enumerate((first, second, lost))
    ]
    port = free_port()
    with vp.Engines() as engines:
        first_saved, first_loaded, killed = engines.event(), engines.event(), engines.event()
        second_saved, done = engines.event(), engines.event()
        producer = engines.start(
            "producer",
            vp.worker_producer_body,
            {},
            port=port,
            saves=[first],
            saved=first_saved,
            done=engines.event(),
            timeout=120,
        )
        engines.start(
            "consumer",
            vp.worker_reconnecting_consumer_body,
            {},
            port=port,
            first=loads[0],
            lost=loads[2],
            second=loads[1],
            first_saved=first_saved,
            first_loaded=first_loaded,
            killed=killed,
            second_saved=second_saved,
            timeout=60,
        )
        assert first_loaded.wait(60), "the consumer did not load from the first producer"
        producer.kill()  # SIGKILL: no goodbye on any connection
        producer.join(10)
        killed.set()
        engines.start(
            "restarted",
            vp.worker_producer_body,
            {},
            port=port,
            saves=[second],
            saved=second_saved,
            done=done,
            timeout=120,
        )
        consumer = engines.wait(["consumer"], timeout=120)["consumer"]
        done.set()
        restarted = engines.wait(["restarted"], timeout=60)["restarted"]
    failed_first, failed_lost = consumer["failed"]
    assert failed_first == [] and failed_lost == [7]
    assert consumer["connections_before"] == 1 and consumer["connections_after"] == 1
    src, expected = [c.numpy() for c in vp.fake_caches(1)], [c.numpy() for c in vp.fake_caches(2)]
    for layer in range(vp.FAKE_LAYERS):
        expected[layer][5], expected[layer][6] = src[layer][0], src[layer][1]  # from each producer's block
        assert np.array_equal(consumer["caches"][layer].view(np.uint32), expected[layer].view(np.uint32))
    assert restarted["entries_left"] == 0 and restarted["stats"]["saved_requests"] == 1
    assert consumer["stats"]["load_hits"] == 2


@pytest.mark.timeout(120)
def test_worker_fails_loads_fast_after_the_producer_died() -> None:
    # Announced entries (wait=True): the first select is waiting on the producer when it dies.
    specs = [
        LoadSpec(name, FAKE_TOKENS[name], list(range(len(FAKE_TOKENS[name]) // vp.FAKE_BLOCK_SIZE)), 0, wait=True)
        for name in "abcd"
    ]
    port = free_port()
    with vp.Engines() as engines:
        connected, kill = engines.event(), engines.event()
        engines.start(
            "producer", vp.worker_killed_producer_body, {}, port=port, connected=connected, kill=kill, timeout=60
        )
        engines.start(
            "consumer",
            vp.worker_orphan_consumer_body,
            {},
            port=port,
            specs=specs,
            connected=connected,
            kill=kill,
            timeout=60,
        )
        consumer = engines.wait(["consumer"], timeout=100)["consumer"]
    assert consumer["failed"] == [s.block_ids for s in specs]  # every load failed, each reported
    stats = consumer["stats"]
    assert stats["load_hits"] == 0 and stats["load_errors"] >= 1
    assert stats["load_errors"] + stats["load_misses"] == len(specs) + 1  # the connecting load missed
    original = [c.numpy() for c in vp.fake_caches(2)]
    for got, before in zip(consumer["caches"], original, strict=True):
        assert np.array_equal(got.view(np.uint32), before.view(np.uint32))  # nothing was written


# ====================================================================== two real vLLM engines

KILL_BATCHES = [vp.make_prompts(seed=1)[:8], vp.make_prompts(seed=2)[:8]]  # unseen by the producer
ABORT_PROMPTS = vp.make_prompts(seed=5)[3:7]  # 33, 64, 65 and 100 tokens
ABORTED = [1, 3]
#: The producer aborts a 200-token prompt in the middle of its chunked prefill: nothing is saved.
PRODUCER_ABORT = {"prompts": [vp.make_prompts(seed=6)[7]], "abort": [0], "abort_after_steps": 1}
#: The consumer aborts two requests after their first step (in which all four were loaded).
CONSUMER_ABORT = {"prompts": ABORT_PROMPTS, "abort": ABORTED, "abort_after_steps": 1}
#: A 33-token prompt (its 1-block entry fits the producer's small buffer), a 100-token one (3 blocks:
#: larger than the buffer), a 64-token one (1 block: the buffer is full by then) and a short one.
ANNOUNCE_PROMPTS = [vp.make_prompts(seed=7)[i] for i in (3, 6, 4, 0)]
#: Requested from the decode instance before the prefill instance has prefilled it (100 tokens).
LATE_PROMPT = vp.make_prompts(seed=8)[6]
#: Short prompts (nothing to load) that the decode instance decodes meanwhile, and their length.
STREAMS, STREAM_TOKENS = [vp.make_prompts(seed=9)[i] for i in (0, 1, 2)], 300
#: Steps the decode instance takes with the late request waiting before the prefill starts.
WAITING_STEPS = 5
#: Holds one 1-block entry (64 KiB of KV of the tiny model plus its tokens), not two.
ONE_BLOCK_BUFFER = 100_000


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vp.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of a plain engine for every prompt used below."""
    prompts = (
        vp.make_prompts()
        + [p for batch in KILL_BATCHES for p in batch]
        + ABORT_PROMPTS
        + ANNOUNCE_PROMPTS
        + [LATE_PROMPT]
    )
    with vp.Engines() as engines:
        engines.start("reference", vp.reference_body, vp.engine_env(0), model=tiny_model, prompts=prompts)
        outputs = engines.wait(["reference"], timeout=240)["reference"]
    return {tuple(p): o["tokens"] for p, o in zip(prompts, outputs, strict=True)}


def run_pair(
    model: str,
    producer_batches: list,
    consumer_batches: list,
    multiprocess: tuple[bool, bool] = (False, False),
    kill_producer: bool = False,
    announce: bool = False,
    timeout: float = 240,
    consumer_connector: tuple[str, str] = vp.KVBRIDGE_CONNECTOR,
    producer_extra: dict | None = None,
    consumer_policy: str = "fail",
) -> dict:
    """A producer and a consumer engine; ``multiprocess`` per side (vLLM's default mode: the connector
    is then found by its plugin); with ``announce``, the consumer's requests carry the producer's
    kv_transfer_params, as behind a proxy. The consumer fails a request whose load failed
    (``consumer_policy``), so that equal tokens prove the loads succeeded."""
    port = free_port()
    with vp.Engines() as engines:
        prefilled, done = engines.event(), engines.event()
        announcements = engines.queue() if announce else None
        producer = engines.start(
            "producer",
            vp.producer_body,
            vp.engine_env(0, multiprocess[0]),
            model=model,
            transfer=vp.kv_transfer_config(
                "kv_producer", port, module_path=not multiprocess[0], **(producer_extra or {})
            ),
            batches=producer_batches,
            prefilled=prefilled,
            consumer_done=done,
            timeout=timeout,
            announce=announcements,
        )
        engines.start(
            "consumer",
            vp.consumer_body,
            vp.engine_env(1, multiprocess[1]),
            model=model,
            transfer=vp.kv_transfer_config(
                "kv_consumer",
                port,
                module_path=not multiprocess[1],
                connector=consumer_connector,
                failure_policy=consumer_policy,
            ),
            batches=consumer_batches,
            prefilled=prefilled,
            consumer_done=done,
            timeout=timeout,
            kill_pid=producer.pid if kill_producer else None,
            announced=announcements,
        )
        names = ["consumer"] if kill_producer else ["producer", "consumer"]
        return engines.wait(names, timeout=timeout)


def assert_loaded(prompts: list[list[int]], outputs: list[dict]) -> None:
    """vLLM reports the transferred prefix as cached tokens: the KV was loaded, not recomputed."""
    assert [o["cached"] for o in outputs] == [vp.transfer_prefix(p) for p in prompts]


@pytest.mark.timeout(300)
def test_offline_pair_equals_a_single_engine(tiny_model: str, reference: dict) -> None:
    """Prompts of 7 to 200 tokens (chunked prefill on both sides), a duplicate, and aborts on both sides."""
    prompts = vp.make_prompts()
    results = run_pair(tiny_model, [prompts, PRODUCER_ABORT, ABORT_PROMPTS], [prompts, CONSUMER_ABORT])
    outputs, stepped = results["consumer"]["outputs"]
    assert [o["tokens"] for o in outputs] == [reference[tuple(p)] for p in prompts]
    assert_loaded(prompts, outputs)
    kept = [index for index in range(len(ABORT_PROMPTS)) if index not in ABORTED]
    assert [stepped[i]["tokens"] for i in kept] == [reference[tuple(ABORT_PROMPTS[i])] for i in kept]
    assert_loaded([ABORT_PROMPTS[i] for i in kept], [stepped[i] for i in kept])
    producer_outputs = results["producer"]["outputs"]
    announced = [o["params"][PARAMS_KEY]["prefix_tokens"] for o in producer_outputs[0] + producer_outputs[2]]
    assert announced == [vp.transfer_prefix(p) for p in prompts + ABORT_PROMPTS]
    moved = [p for p in prompts + ABORT_PROMPTS if vp.transfer_prefix(p)]
    consumer, producer = results["consumer"]["stats"], results["producer"]["stats"]
    assert producer["saved_requests"] == len(moved) and producer["save_failures"] == 0  # not the aborted one
    # On one host the blocks are lent (those touching the partial pages at a cache's ends are copied).
    assert producer["lent_requests"] > 0
    # The duplicate was either loaded or found in vLLM's own prefix cache and its entry drained.
    assert consumer["load_hits"] + consumer["drained"] == len(moved)
    assert consumer["load_misses"] == consumer["load_errors"] == 0
    assert consumer["loaded_bytes"] > 0 and consumer["loaded_bytes"] <= producer["saved_bytes"]
    # Every entry was taken, also those of the consumer requests aborted while their loads ran.
    assert results["producer"]["entries_left"] == 0


@pytest.mark.timeout(300)
def test_corrupted_kv_changes_exactly_the_outputs_served_from_it(tiny_model: str, reference: dict) -> None:
    prompts = vp.make_prompts()
    results = run_pair(tiny_model, [prompts], [prompts], consumer_connector=vp.CORRUPTING_CONNECTOR)
    (outputs,) = results["consumer"]["outputs"]
    assert_loaded(prompts, outputs)
    for prompt, output in zip(prompts, outputs, strict=True):
        same = output["tokens"] == reference[tuple(prompt)]
        assert same == (vp.transfer_prefix(prompt) == 0), f"prompt of {len(prompt)} tokens"


@pytest.mark.timeout(300)
def test_consumer_recomputes_and_keeps_serving_after_the_producer_is_killed(tiny_model: str, reference: dict) -> None:
    prompts = vp.make_prompts()
    results = run_pair(tiny_model, [prompts], [prompts, *KILL_BATCHES], kill_producer=True, consumer_policy="recompute")
    first, *after_kill = results["consumer"]["outputs"]
    assert [o["tokens"] for o in first] == [reference[tuple(p)] for p in prompts]
    assert_loaded(prompts, first)
    for batch, outputs in zip(KILL_BATCHES, after_kill, strict=True):
        assert [o["tokens"] for o in outputs] == [reference[tuple(p)] for p in batch]
        assert all(o["finish"] == "length" for o in outputs)
    stats = results["consumer"]["stats"]
    claimed = sum(1 for batch in KILL_BATCHES for p in batch if vp.transfer_prefix(p))
    assert stats["load_errors"] >= 1
    assert stats["load_errors"] + stats["load_misses"] == claimed


@pytest.mark.timeout(420)
def test_multiprocess_engines_pinned_one_core_each(tiny_model: str, reference: dict) -> None:
    """vLLM's default mode: scheduler and worker in separate processes, connector found by its plugin."""
    prompts = vp.make_prompts()
    results = run_pair(tiny_model, [prompts], [prompts], multiprocess=(True, True), timeout=360)
    (outputs,) = results["consumer"]["outputs"]
    assert [o["tokens"] for o in outputs] == [reference[tuple(p)] for p in prompts]
    assert_loaded(prompts, outputs)


@pytest.mark.timeout(420)
def test_producer_announces_only_what_it_saved(tiny_model: str, reference: dict) -> None:
    """The producer in vLLM's default mode (scheduler and worker in separate processes), so that the
    workers' outcomes travel as worker metadata; the consumer gets its announcements, as behind a proxy."""
    # Without eviction, the full buffer refuses the later saves (with it, they would evict the first).
    results = run_pair(
        tiny_model,
        [ANNOUNCE_PROMPTS],
        [ANNOUNCE_PROMPTS],
        multiprocess=(True, False),
        announce=True,
        timeout=360,
        producer_extra={"kv_buffer_size": ONE_BLOCK_BUFFER, "kv_evict_unclaimed": False},
    )
    (announced,) = results["producer"]["outputs"]
    assert [o["params"][PARAMS_KEY]["prefix_tokens"] for o in announced] == [32, 0, 0, 0]
    (outputs,) = results["consumer"]["outputs"]
    assert [o["tokens"] for o in outputs] == [reference[tuple(p)] for p in ANNOUNCE_PROMPTS]
    assert [o["cached"] for o in outputs] == [32, 0, 0, 0]
    # Requests announced with 0 tokens are not even looked up: no miss, no wait.
    stats = results["consumer"]["stats"]
    assert (stats["load_hits"], stats["load_misses"], stats["load_errors"]) == (1, 0, 0)


@pytest.mark.timeout(300)
def test_a_late_entry_is_waited_for_while_the_other_requests_decode(tiny_model: str, reference: dict) -> None:
    """The decode request comes before its prefill: it waits for the entry off the engine step."""
    port = free_port()
    transfer = {"kv_load_timeout": 60.0}
    with vp.Engines() as engines:
        go, done = engines.event(), engines.event()
        engines.start(
            "producer",
            vp.late_producer_body,
            vp.engine_env(0),
            model=tiny_model,
            transfer=vp.kv_transfer_config("kv_producer", port, **transfer),
            prompt=LATE_PROMPT,
            go=go,
            consumer_done=done,
            timeout=240,
        )
        engines.start(
            "consumer",
            vp.late_consumer_body,
            vp.engine_env(1),
            model=tiny_model,
            transfer=vp.kv_transfer_config("kv_consumer", port, failure_policy="fail", **transfer),
            streams=STREAMS,
            stream_tokens=STREAM_TOKENS,
            prompt=LATE_PROMPT,
            waiting_steps=WAITING_STEPS,
            go=go,
            consumer_done=done,
            timeout=240,
        )
        results = engines.wait(["producer", "consumer"], timeout=280)
    consumer = results["consumer"]
    history = consumer["history"]
    # The producer prefilled only after WAITING_STEPS steps, all taken while the late request waited
    # for its entry: every stream gained a token in each of them.
    before, waited = history[0], history[WAITING_STEPS]
    assert waited[-1] == 0
    assert [after - start for start, after in zip(before[:-1], waited[:-1], strict=True)] == [WAITING_STEPS] * 3
    late = consumer["late"]
    assert late["tokens"] == reference[tuple(LATE_PROMPT)] and late["finish"] == "length"
    assert late["cached"] == vp.transfer_prefix(LATE_PROMPT)  # loaded, under the "fail" policy
    assert all(s["finish"] == "length" and len(s["tokens"]) == STREAM_TOKENS for s in consumer["streams"])
    assert consumer["stats"]["load_hits"] == 1 and results["producer"]["entries_left"] == 0


def test_plugin_entry_point_is_installed() -> None:
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    (point,) = [p for p in points if p.value == "connector.vllm_plugin:register"]
    point.load()()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert KVConnectorFactory.get_connector_class_by_name("KVBridgeConnector").__name__ == "KVBridgeConnector"
