"""benchmarks/bench_store.py's options for other connectors (peers) and dtypes: what it accepts,
what it refuses (naming the option), and the instances and rows they give. Nothing runs an engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import bench_store as bs

LMCACHE = (
    '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_connector_extra_config": {"url": "{redis}"}}'
)
OFFLOAD = '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}'


def test_peers_become_instances_after_kvbridges_with_the_runs_redis_url_filled_in(tmp_path: Path) -> None:
    peers = bs.parse_peers([f"lmcache={LMCACHE}", f"offload={OFFLOAD}"], ["lmcache"])
    assert [(p.name, p.new_instance, p.needs_redis) for p in peers] == [
        ("lmcache", True, True),
        ("offload", False, False),
    ]
    workload = bs.Workload(rounds=3)
    instances = bs.plan(workload, ["disk"], tmp_path, "redis://127.0.0.1:7001", peers)
    assert [(i.name, i.tiers is not None, i.rounds) for i in instances] == [
        ("plain", False, [0, 1, 2]),
        ("plain + prefix cache", False, [0, 1, 2]),
        ("disk", True, [0, 1, 2]),
        ("disk, new instance", True, [1, 2]),
        ("lmcache", False, [0, 1, 2]),
        ("lmcache, new instance", False, [1, 2]),
        ("offload", False, [0, 1, 2]),
    ]
    lmcache = instances[4].peer
    assert lmcache == {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"url": "redis://127.0.0.1:7001"},
    }
    assert instances[6].peer == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    assert all(i.peer is None for i in instances[:4]) and all(i.prefix_caching for i in instances[1:])


def test_a_peers_rows_carry_no_target_of_kvbridges() -> None:
    rounds = [[[1, 2]], [[3, 4]], [[5, 6]]]
    result = {"ttft": [0.1], "tokens": [[7]], "wall": 0.1, "bytes_loaded": 0, "tokens_loaded": 1}
    peer = bs.rows_of("lmcache, new instance", [1, 2], [result, result], rounds)
    assert [(row.name, row.target) for row in peer] == [("lmcache, new instance", None)]
    cold, warm = bs.rows_of("offload", [0, 1, 2], [result] * 3, rounds)
    assert (cold.name, cold.target, warm.name, warm.target) == ("offload, cold", None, "offload, warm", None)
    ours = bs.rows_of("redis, new instance", [1, 2], [result, result], rounds)
    assert ours[0].target == ("warm", bs.WARM_SHARED)
    _, socket_warm = bs.rows_of("redis-unix", [0, 1, 2], [result] * 3, rounds)
    assert (socket_warm.name, socket_warm.target) == ("redis-unix, warm", ("warm", bs.WARM_SHARED))


def test_redis_over_tcp_and_over_the_unix_socket_are_instances_of_their_own(tmp_path: Path) -> None:
    instances = bs.plan(
        bs.Workload(rounds=2), ["redis", "redis-unix"], tmp_path, "redis://127.0.0.1:7001", (), "unix:///r/s.sock"
    )
    assert [(i.name, i.tiers, i.rounds) for i in instances[2:]] == [
        ("redis", "redis://127.0.0.1:7001", [0, 1]),
        ("redis, new instance", "redis://127.0.0.1:7001", [1]),
        ("redis-unix", "unix:///r/s.sock", [0, 1]),
        ("redis-unix, new instance", "unix:///r/s.sock", [1]),
    ]


@pytest.mark.parametrize(
    ("configs", "new", "named"),
    [
        (["lmcache"], [], "takes NAME=JSON"),
        (["=" + OFFLOAD], [], "takes NAME=JSON"),
        (["redis=" + OFFLOAD], [], "name 'redis' is taken"),
        (["a=" + OFFLOAD, "a=" + OFFLOAD], [], "name 'a' is taken"),
        (["a={not json"], [], "a: not JSON"),
        (['a=["OffloadingConnector"]'], [], "kv_transfer_config object with kv_connector"),
        (['a={"kv_role": "kv_both"}'], [], "kv_transfer_config object with kv_connector"),
        (['a={"kv_connector": "X", "kv_role": "kv_producer"}'], [], "kv_role must be kv_both"),
        (["a=" + OFFLOAD], ["b"], "--new-instance names no --connector-config: ['b']"),
    ],
)
def test_bad_peer_options_are_refused_naming_the_option(configs: list[str], new: list[str], named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        bs.parse_peers(configs, new)


def test_main_refuses_bad_peer_options_and_dtypes_before_running_anything(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        bs.main(["--quick", "--connector-config", "a={not json"])
    assert exit_.value.code == 2 and "a: not JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bs.main(["--quick", "--dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


@pytest.mark.parametrize(("dtype", "per_token"), [("float32", 128 << 10), ("bfloat16", 64 << 10)])
def test_kv_sizes_follow_the_dtype(dtype: str, per_token: int) -> None:
    workload = bs.Workload(documents=2, doc_tokens=512, dtype=dtype)
    assert workload.kv_bytes_per_token == per_token
    assert workload.store_bytes == 2 * 2 * 512 * per_token
    assert workload.kv_cache_bytes == int(1.5 * workload.max_model_len) // 32 * 32 * per_token
