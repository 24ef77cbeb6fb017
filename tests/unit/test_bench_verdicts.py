"""The benchmarks' own bookkeeping, without any server: the split measurement's order and figures
(``benchmarks/bench_e2e.py``), and the chaos soak's verdicts on gauges and on errors after a TP
rank was killed, its command line, and the fleets it can start (``benchmarks/bench_chaos.py``,
``harness/xpyd.py``; nothing is started)."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from benchmarks import bench_chaos as chaos
from benchmarks import bench_e2e as e2e
from harness import xpyd as xp

VARIANTS = ["plain", "noop", "threads", "decode"]


def test_alternating_sends_every_batch_to_every_variant_once_per_turn_with_the_lead_rotating() -> None:
    batches = ["b0", "b1", "b2", "b3", "b4"]
    schedule = e2e.split_schedule("alternating", VARIANTS, batches)
    assert len(schedule) == len(VARIANTS) * len(batches)
    assert Counter(schedule) == Counter((v, b) for v in VARIANTS for b in batches)  # each pair once
    turns = [schedule[i : i + len(VARIANTS)] for i in range(0, len(schedule), len(VARIANTS))]
    for index, turn in enumerate(turns):
        assert {batch for _, batch in turn} == {batches[index]}
        assert sorted(v for v, _ in turn) == sorted(VARIANTS)
    assert [turn[0][0] for turn in turns] == ["plain", "noop", "threads", "decode", "plain"]


def test_alone_sends_each_variants_batches_back_to_back() -> None:
    schedule = e2e.split_schedule("alone", VARIANTS, ["b0", "b1"])
    assert schedule == [(v, b) for v in VARIANTS for b in ("b0", "b1")]


def _batch(requests: int, seconds: float, loaded: int | None = None) -> dict:
    return {"requests": requests, "seconds": seconds, "rps": requests / seconds, "loaded": loaded}


def test_split_summary_pools_the_batches_and_takes_every_ratio_against_plain() -> None:
    split = {
        "alone": {
            "plain": {"batches": [_batch(16, 4.0), _batch(16, 8.0)], "prefill_time": 10.0},
            "decode": {"batches": [_batch(16, 5.0, 16), _batch(16, 11.0, 15)], "prefill_time": 12.5},
        },
        "alternating": {
            "plain": {"batches": [_batch(8, 2.0)], "prefill_time": 4.0},
            "decode": {"batches": [_batch(8, 4.0, 7)], "prefill_time": 3.0},
        },
    }
    summary = e2e.summarise_split(split)
    alone = summary["alone"]
    assert alone["plain"]["rps"] == pytest.approx(32 / 12)
    assert alone["decode"]["rps"] == pytest.approx(32 / 16)
    assert alone["decode"]["ratio"] == pytest.approx((32 / 16) / (32 / 12))
    assert alone["decode"]["ratio_range"] == pytest.approx((4.0 / 5.0, 8.0 / 11.0)[::-1])  # min, max per batch
    assert alone["decode"]["prefill_time_ratio"] == pytest.approx(1.25)
    assert alone["decode"]["loaded"] == 31 and alone["plain"]["loaded"] is None
    assert alone["plain"]["ratio"] == pytest.approx(1.0)
    assert summary["alternating"]["decode"]["ratio"] == pytest.approx(0.5)
    assert summary["alternating"]["decode"]["prefill_time_ratio"] == pytest.approx(0.75)
    table = e2e.split_table(summary, e2e.Workload(producer_clients=(4,), producer_requests=4, split_batches=2))
    assert "| decode: kvbridge producer, decode takes every entry | 2.00 | 0.75x | 2.00 | 0.50x (0.50-0.50) |" in table


IDLE = {name: 0.0 for name in chaos.GAUGES} | {chaos.USAGE: 0.0}


@pytest.mark.parametrize(
    ("change", "idle"),
    [
        ({}, True),
        ({"connections": 2.0}, True),
        ({"connections": 3.0}, False),
        ({"entries_held": 1.0}, False),
        ({"blocks_lent": 4.0}, False),
        ({chaos.USAGE: 0.03}, False),  # vLLM still holds blocks nobody frees
    ],
)
def test_an_instance_is_idle_only_with_nothing_held_and_its_kv_cache_as_it_started(change: dict, idle: bool) -> None:
    assert chaos.gauges_idle(IDLE | change, usage_at_start=0.0) is idle


def test_the_kv_cache_usage_is_compared_with_the_start_of_the_instances_life() -> None:
    assert chaos.gauges_idle(IDLE | {chaos.USAGE: 0.25}, usage_at_start=0.25)
    assert not chaos.gauges_idle(IDLE | {chaos.USAGE: 0.0}, usage_at_start=0.25)


def _judged(outcomes: list[chaos.Outcome], kills: list[chaos.Kill], entry_timeout: float = 120.0) -> list[bool]:
    run = object.__new__(chaos.Chaos)  # judge reads only the outcomes, the kills and the settings
    run.outcomes, run.kills = outcomes, kills
    run.settings = chaos.Settings(entry_timeout=entry_timeout)
    run.judge()
    return [o.expected for o in outcomes]


def test_errors_at_an_instance_whose_rank_died_are_expected_until_it_is_gone_and_not_after() -> None:
    kill = chaos.Kill("decode0", "decode", at=10.0, rank=1, gone=14.0, failed_how="exited")
    outcomes = [
        chaos.Outcome("long", 0, 9.0, 11.0, "prefill0", "decode0", cause=chaos.LOAD_FAILED),  # in flight at the kill
        chaos.Outcome("long", 1, 12.0, 12.5, "prefill1", "decode0", cause=chaos.LOAD_FAILED),  # sent while failing
        chaos.Outcome("long", 2, 15.0, 16.0, "prefill1", "decode0", cause=chaos.LOAD_FAILED),  # after it was gone
        chaos.Outcome("long", 3, 12.0, 13.0, "prefill1", "decode1", cause=chaos.LOAD_FAILED),  # another instance
        chaos.Outcome("proxy", 4, 13.0, 13.5, cause=chaos.DECODE_KILLED),  # through the proxy
        chaos.Outcome("long", 5, 12.0, 13.0, "prefill0", "decode0", cause=chaos.HANG),  # a hang is never expected
        chaos.Outcome("long", 6, 1.0, 2.0, "prefill0", "decode0", cause=chaos.LOAD_FAILED),  # before the kill
    ]
    assert _judged(outcomes, [kill]) == [True, True, False, False, True, False, False]


def test_a_whole_instance_kill_explains_only_requests_in_flight_at_that_moment() -> None:
    kill = chaos.Kill("prefill0", "prefill", at=10.0)
    outcomes = [
        chaos.Outcome("long", 0, 9.0, 11.0, "prefill0", "decode0", cause=chaos.PREFILL_KILLED),
        chaos.Outcome("long", 1, 10.5, 11.0, "prefill0", "decode0", cause=chaos.PREFILL_KILLED),
        chaos.Outcome("long", 2, 9.0, 11.0, "prefill1", "decode0", cause=chaos.PREFILL_KILLED),
        chaos.Outcome("proxy", 3, 9.0, 11.0, cause=chaos.LOAD_FAILED),
        chaos.Outcome("proxy", 4, 9.0, 11.0, cause=chaos.DECODE_KILLED),  # the wrong role
    ]
    assert _judged(outcomes, [kill]) == [True, False, False, True, False]


@pytest.mark.parametrize(
    ("prefills", "decodes", "prefill_tp", "decode_tp", "most_prefill", "most_decode"),
    [
        (2, 2, 1, 1, 2, 2),
        (2, 2, 2, 2, 4, 4),
        (2, 2, 1, 2, 4, 4),
        (2, 2, 2, 1, 4, 4),
        (1, 1, 2, 1, 2, 2),  # the fleet that fits two cores: one pair of instances, two pairs of ranks
        (1, 1, 1, 2, 2, 2),
        (1, 1, 1, 1, 1, 1),
        (1, 3, 2, 1, 6, 2),  # a prefill instance serves three decode instances, each two of its ranks
        (3, 1, 1, 1, 1, 3),
    ],
)
def test_an_idle_instance_keeps_one_connection_per_pair_of_ranks_sharing_heads(
    prefills: int, decodes: int, prefill_tp: int, decode_tp: int, most_prefill: int, most_decode: int
) -> None:
    settings = chaos.Settings(prefills=prefills, decodes=decodes, prefill_tp=prefill_tp, decode_tp=decode_tp)
    for role, most in (("prefill", most_prefill), ("decode", most_decode)):
        assert chaos.most_connections(settings, role) == most
        assert chaos.gauges_idle(IDLE | {"connections": float(most)}, 0.0, most)
        assert not chaos.gauges_idle(IDLE | {"connections": float(most + 1)}, 0.0, most)


def test_the_command_line_keeps_two_of_each_by_default_and_takes_a_smaller_fleet() -> None:
    settings, _ = chaos.parse([])
    assert (settings.prefills, settings.decodes, settings.prefill_tp, settings.decode_tp) == (2, 2, 1, 1)
    assert settings == chaos.Settings()
    settings, args = chaos.parse(
        "--prefills 1 --decodes 1 --prefill-tp 2 --kill-roles prefill-rank --max-kills 1 --clients 2 "
        "--bound 240 --kv-timeout 30 --ready-timeout 600 --out x.json".split()
    )
    assert (settings.prefills, settings.decodes, settings.prefill_tp, settings.decode_tp) == (1, 1, 2, 1)
    assert settings.kill_roles == ("prefill-rank",)
    assert (settings.max_kills, settings.clients, settings.bound, settings.kv_timeout) == (1, 2, 240.0, 30.0)
    assert settings.ready_timeout == 600.0 and str(args.out) == "x.json"
    settings, _ = chaos.parse("--prefills 3 --decodes 1 --decode-tp 2 --kill-roles decode-rank,prefill".split())
    assert (settings.prefills, settings.decodes, settings.kill_roles) == (3, 1, ("decode-rank", "prefill"))


@pytest.mark.parametrize(
    "argv",
    [
        "--prefills 0",
        "--decodes 0",
        "--decodes -1",
        "--prefill-tp 0",
        "--kill-roles decode-rank",  # decode TP 1: no rank to kill but the instance's only one
        "--prefill-tp 2 --kill-roles decode-rank",
        "--prefills 1 --kill-roles prefill,somebody",
    ],
)
def test_the_command_line_refuses_a_fleet_the_soak_cannot_run(argv: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        chaos.parse(argv.split())
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err
    with pytest.raises(ValueError):  # run_chaos refuses the same settings before starting anything
        chaos.check(chaos.Settings(**_fields(argv)))


def _fields(argv: str) -> dict:
    settings, names = {}, argv.split()[::2]
    for name, value in zip(names, argv.split()[1::2], strict=True):
        key = name.removeprefix("--").replace("-", "_")
        settings[key] = tuple(value.split(",")) if key == "kill_roles" else int(value)
    return settings


class _Named:
    def __init__(self, name: str) -> None:
        self.name = name


class _Fleet:
    def __init__(self, prefills: int, decodes: int) -> None:
        self.prefills = [_Named(f"prefill{i}") for i in range(prefills)]
        self.decodes = [_Named(f"decode{j}") for j in range(decodes)]


def _run_over(prefills: int, decodes: int, down: set[str]) -> chaos.Chaos:
    run = object.__new__(chaos.Chaos)  # begin reads only the fleet, the instances down and the clock
    run.cluster, run.down, run.in_flight, run._serial = _Fleet(prefills, decodes), down, {}, 0
    run._lock, run._t0 = threading.Lock(), time.monotonic()
    return run


def test_with_one_decode_instance_nothing_is_sent_while_it_is_down() -> None:
    run = _run_over(1, 1, {"decode0"})
    rng = random.Random(0)
    assert run.begin("proxy", rng) is None
    assert run.begin("long", rng) is None
    assert run.in_flight == {}
    run.down.clear()
    assert run.begin("proxy", rng) == (1, None, None)
    serial, prefill, decode = run.begin("long", rng)
    assert (serial, prefill.name, decode.name) == (2, "prefill0", "decode0")
    assert [flow for flow, _ in run.in_flight.values()] == ["proxy", "long"]


def test_with_the_only_prefill_instance_down_the_proxy_still_gets_requests_the_flow_by_hand_none() -> None:
    # The proxy sends a request whose prefill failed everywhere to a decode instance, told that
    # nothing was saved; the P/D flow by hand has no prefill instance to send to.
    run = _run_over(1, 1, {"prefill0"})
    rng = random.Random(0)
    assert run.begin("long", rng) is None
    assert run.begin("proxy", rng) == (1, None, None)


def test_with_two_of_each_requests_go_only_to_instances_up() -> None:
    run = _run_over(2, 2, {"prefill1", "decode0"})
    rng = random.Random(0)
    chosen = {(p.name, d.name) for _, p, d in (run.begin("long", rng) for _ in range(40))}
    assert chosen == {("prefill0", "decode1")}
    assert run.begin("proxy", rng)[1:] == (None, None)
    assert len(run.in_flight) == 41


def test_a_failed_load_is_explained_by_the_entry_timeout_only_when_its_request_outlasted_it() -> None:
    # An entry's kv_entry_timeout counts from its save, after the request was sent; one that left
    # before its prefill answered was announced with 0 tokens. So a load can miss an expired entry
    # only when the request took longer than the timeout from its start to the decode's answer.
    outcomes = [
        chaos.Outcome("long", 0, 10.0, 31.0, "prefill0", "decode0", answered=28.0, cause=chaos.LOAD_FAILED),
        chaos.Outcome("long", 1, 10.0, 29.5, "prefill0", "decode0", answered=12.0, cause=chaos.LOAD_FAILED),
        chaos.Outcome("proxy", 2, 40.0, 60.5, cause=chaos.LOAD_FAILED),
        chaos.Outcome("long", 3, 10.0, 40.0, "prefill0", "decode0", cause=chaos.PREFILL_KILLED),  # not a load
        chaos.Outcome("long", 4, 10.0, 40.0, "prefill0", "decode0", answered=11.0, cause=chaos.HANG),
        chaos.Outcome("long", 5, 10.0, 30.0, "prefill0", "decode0", answered=11.0, cause=chaos.LOAD_FAILED),
    ]
    assert _judged(outcomes, [], entry_timeout=20.0) == [True, False, True, False, False, False]
    assert [o.explained_by for o in outcomes] == ["entry timeout", "", "entry timeout", "", "", ""]
    # A kill in flight explains it first; the default timeout (the request bound) explains none here.
    kill = chaos.Kill("prefill0", "prefill", at=20.0)
    assert _judged(outcomes, [kill]) == [True, True, False, True, False, True]
    assert {o.explained_by for o in outcomes} == {"kill", ""}
    assert chaos.Settings().entry_timeout >= chaos.Settings().bound


def test_the_report_counts_the_errors_the_entry_timeout_explains() -> None:
    outcomes = [
        chaos.Outcome("long", 0, 10.0, 31.0, "prefill0", "decode0", answered=28.0, cause=chaos.LOAD_FAILED),
        chaos.Outcome("long", 1, 10.0, 12.0, "prefill0", "decode0", answered=11.0, cause=chaos.LOAD_FAILED),
    ]
    _judged(outcomes, [], entry_timeout=20.0)
    run = object.__new__(chaos.Chaos)
    run.outcomes, run.kills, run.settings = outcomes, [], chaos.Settings(entry_timeout=20.0)
    run.prompts, run.cluster, run.counters, run.last_life, run.failure = [], _NoInstances(), {}, {}, None
    run.abandoned, run.abandon_failures = Counter(), []
    report = run.report(60.0, {})
    assert report["errors_by_cause"] == {chaos.LOAD_FAILED: {"expected": 1, "unexpected": 1, "entry_timeout": 1}}
    assert report["requests"]["unexpected_errors"] == 1
    assert report["error_details"][0]["answered"] == 28.0


class _NoInstances:
    prefills: list = []
    decodes: list = []


@pytest.mark.parametrize(
    ("prefills", "decodes", "prefill_tp", "decode_tp", "binds"),
    [
        # name: VLLM_CPU_OMP_THREADS_BIND (rank r of an instance on core (its core + r) % 2)
        (2, 2, 1, 1, {"prefill0": "0", "prefill1": "1", "decode0": "1", "decode1": "0"}),
        (2, 2, 2, 2, {"prefill0": "0|1", "prefill1": "1|0", "decode0": "1|0", "decode1": "0|1"}),
        (1, 1, 2, 1, {"prefill0": "0|1", "decode0": "1"}),
        (1, 1, 1, 2, {"prefill0": "0", "decode0": "1|0"}),
        (3, 1, 1, 1, {"prefill0": "0", "prefill1": "1", "prefill2": "0", "decode0": "1"}),
    ],
)
def test_a_fleet_of_any_size_pins_prefill_and_decode_instances_apart(
    tmp_path: Path, prefills: int, decodes: int, prefill_tp: int, decode_tp: int, binds: dict[str, str]
) -> None:
    fleet = xp.Fleet("model", tmp_path, prefill_tp=prefill_tp, decode_tp=decode_tp, prefills=prefills, decodes=decodes)
    assert [i.name for i in fleet.instances] == list(binds)
    assert {i.name: i.env["VLLM_CPU_OMP_THREADS_BIND"] for i in fleet.instances} == binds
    assert {i.role for i in fleet.prefills} == {"kv_producer"} and {i.role for i in fleet.decodes} == {"kv_consumer"}
    assert len({i.kv_port for i in fleet.prefills}) == prefills  # each prefill instance listens on its own
    assert {i.kv_port for i in fleet.decodes} == {fleet.prefills[0].kv_port}
    assert all(i.server is None for i in fleet.instances)  # nothing started
    for one in fleet.instances:
        tp = prefill_tp if one in fleet.prefills else decode_tp
        assert ("--tensor-parallel-size" in one.command) is (tp > 1)
    producer_tp = [json.loads(i.command[i.command.index("--kv-transfer-config") + 1]) for i in fleet.decodes]
    expected = prefill_tp if prefill_tp != decode_tp else None
    assert {c["kv_connector_extra_config"].get("kv_producer_tp_size") for c in producer_tp} == {expected}


@pytest.mark.parametrize(("prefills", "decodes"), [(0, 1), (1, 0)])
def test_a_fleet_needs_an_instance_of_each_role(tmp_path: Path, prefills: int, decodes: int) -> None:
    with pytest.raises(ValueError, match="at least"):
        xp.Fleet("model", tmp_path, prefills=prefills, decodes=decodes)
