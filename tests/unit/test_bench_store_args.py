"""benchmarks/bench_store.py's options for other connectors (peers) and dtypes: what it accepts,
what it refuses (naming the option), and the instances and rows they give. Nothing runs an engine."""

from __future__ import annotations

import itertools
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
        (bs.EVERYTHING_FITS, False, [0, 1, 2]),
        ("disk", True, [0, 1, 2]),
        ("disk, new instance", True, [1, 2]),
        ("lmcache", False, [0, 1, 2]),
        ("lmcache, new instance", False, [1, 2]),
        ("offload", False, [0, 1, 2]),
    ]
    assert [i.cache_everything for i in instances] == [False, False, True, False, False, False, False, False]
    lmcache = instances[5].peer
    assert lmcache == {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"url": "redis://127.0.0.1:7001"},
    }
    assert instances[7].peer == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    assert all(i.peer is None for i in instances[:5]) and all(i.prefix_caching for i in instances[1:])


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
    assert [(i.name, i.tiers, i.rounds) for i in instances[3:]] == [
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
    assert workload.max_model_len == 544  # 512 + a 16-token question + 8 answer tokens, in whole blocks
    assert workload.store_bytes == 2 * 2 * (512 + 16) * per_token
    assert workload.kv_cache_bytes() == int(1.5 * 544) // 32 * 32 * per_token
    assert workload.kv_cache_bytes(everything=True) == 2 * 544 * per_token


def test_a_chat_turn_is_the_conversation_so_far_and_a_new_message_over_one_shared_system_prompt() -> None:
    workload = bs.Workload(documents=3, doc_tokens=400, rounds=3, kind="chat")
    system, user, reply = workload.chat_parts
    rounds = bs.prompts(workload)
    assert [[len(prompt) for prompt in batch] for batch in rounds] == [
        [system + user] * 3,
        [system + 2 * user + reply] * 3,
        [system + 3 * user + 2 * reply] * 3,
    ]
    assert workload.longest_prompt == system + 3 * user + 2 * reply
    for conversation in range(3):
        turns = [batch[conversation] for batch in rounds]
        assert turns[0][:system] == rounds[0][0][:system]  # every chat starts with the same system prompt
        for earlier, later in itertools.pairwise(turns):
            assert later[: len(earlier)] == earlier  # a turn extends the last one
    assert rounds[0][0][system:] != rounds[0][1][system:]  # and goes on with its own messages
    assert bs.prompts(workload) == rounds  # seeded


def test_document_questions_are_the_same_prompts_whatever_the_clients() -> None:
    workload = bs.Workload(documents=2, doc_tokens=64, rounds=2)
    first, second = bs.prompts(workload)
    assert [prompt[:64] for prompt in first] == [prompt[:64] for prompt in second]
    assert all(len(prompt) == 64 + bs.QUESTION_TOKENS for prompt in first + second)
    assert [prompt[64:] for prompt in first] != [prompt[64:] for prompt in second]


def test_chat_rows_are_first_and_later_turns_without_the_document_targets() -> None:
    rounds = [[[1, 2]], [[3, 4]]]
    result = {"ttft": [0.1], "tokens": [[7]], "wall": 0.1, "bytes_loaded": 0, "tokens_loaded": 1}
    first, later = bs.rows_of("redis", [0, 1], [result] * 2, rounds, "chat")
    assert (first.name, first.target, later.name, later.target) == (
        "redis, first turns",
        None,
        "redis, later turns",
        None,
    )
    assert (first.indices, later.indices) == ([0], [1])
    chat = bs.plan(bs.Workload(rounds=2, kind="chat"), ["memory", "disk", "redis"], Path("/d"), "redis://h:1")
    assert [i.name for i in chat[3:]] == ["memory", "disk", "redis"]  # no new instance: it would replay stored prompts
    [fits] = bs.rows_of(bs.EVERYTHING_FITS, [0, 1], [result] * 2, rounds)
    assert (fits.name, fits.rounds) == (f"{bs.EVERYTHING_FITS}, later rounds", [result])


class FakeEngine:
    """vLLM's LLMEngine as ``_serve`` uses it: each step gives every running request one token;
    a request finishes with ``answer`` tokens."""

    def __init__(self, answer: int) -> None:
        self.answer = answer
        self.running: dict[str, list[int]] = {}
        self.most_at_once = 0

    def add_request(self, request_id, prompt, params) -> None:
        assert params.max_tokens == self.answer and params.temperature == 0
        self.running[request_id] = []
        self.most_at_once = max(self.most_at_once, len(self.running))

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self):
        from types import SimpleNamespace

        outputs = []
        for request_id, tokens in list(self.running.items()):
            tokens.append(int(request_id[1:]))
            finished = len(tokens) == self.answer
            outputs.append(
                SimpleNamespace(
                    request_id=request_id,
                    outputs=[SimpleNamespace(token_ids=list(tokens))],
                    finished=finished,
                    num_cached_tokens=5,
                )
            )
            if finished:
                del self.running[request_id]
        return outputs


@pytest.mark.parametrize("clients", [1, 3, 8])
def test_serve_keeps_at_most_its_clients_requests_in_flight_and_answers_in_request_order(clients: int) -> None:
    pytest.importorskip("vllm")
    engine = FakeEngine(answer=3)
    requests = [(f"r{index}", [index] * 4) for index in range(6)]
    served = bs._serve(engine, requests, clients, 3)
    assert engine.most_at_once == min(clients, 6)
    assert [tokens for _, tokens, _ in served] == [[index] * 3 for index in range(6)]
    assert all(ttft >= 0 and cached == 5 for ttft, _, cached in served)


def test_requests_per_second_by_clients_puts_each_count_beside_its_own_plain_instance() -> None:
    def row(name: str, wall: float) -> bs.Row:
        return bs.Row(name, [0], [{"ttft": [0.2, 0.4], "tokens": [[1], [2]], "wall": wall}], [[[1], [2]]])

    text = bs.by_clients_table(
        {
            1: [row("plain (recompute)", 2.0), row("memory, warm", 1.0)],
            4: [row("plain (recompute)", 1.0), row("memory, warm", 0.25)],
        }
    )
    lines = text.splitlines()
    assert lines[0].startswith("| setup | req/s (1) | x plain (1) | TTFT p50 ms (1) | req/s (4) |")
    assert lines[3] == "| memory, warm | 2.00 | 2.00x | 300.0 | 8.00 | 4.00x | 300.0 |"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--clients", "0,4"], "--clients takes client counts of at least 1"),
        (["--clients", "four"], "--clients takes client counts"),
        (["--engine-cores", "x"], "--engine-cores takes a core list"),
        (["--engine-cores", "0-4095"], "must leave one of the usable cores"),
        (["--workload", "chat", "--documents", "2", "--doc-tokens", "100"], "more prompt tokens in a round"),
    ],
)
def test_main_refuses_bad_clients_cores_and_workloads_naming_the_option(
    argv: list[str], named: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exit_:
        bs.main(["--quick", *argv])
    assert exit_.value.code == 2 and named in capsys.readouterr().err


def test_each_rows_ratios_are_to_the_plain_instance_on_the_same_rounds() -> None:
    """A chat's turns grow: a later turn is compared with plain's later turns, not its short first ones."""
    rounds = [[[1, 2]], [[1, 2, 3, 4]]]

    def result(ttft: float, wall: float) -> dict:
        return {"ttft": [ttft], "tokens": [[7]], "wall": wall, "bytes_loaded": 0, "tokens_loaded": 0}

    [plain] = bs.rows_of("plain", [0, 1], [result(0.1, 0.1), result(1.0, 1.0)], rounds, "chat")
    first, later = bs.rows_of("disk", [0, 1], [result(0.1, 0.1), result(0.5, 0.5)], rounds, "chat")
    text, wrong = bs.table([plain, first, later], {(1, 2): [7], (1, 2, 3, 4): [7]})
    assert wrong == 0
    assert "| disk, first turns | 1 | 100.0 | 100.0 | 1.00x |" in text
    assert "| disk, later turns | 1 | 500.0 | 500.0 | 0.50x |" in text
    by_clients = bs.by_clients_table({1: [plain, first, later]})
    assert "| disk, later turns | 2.00 | 2.00x | 500.0 |" in by_clients


@pytest.mark.parametrize(
    ("ttft", "wall", "verdict"),
    [(1.04, 1.04, "met"), (1.06, 1.0, "MISSED"), (1.0, 1.1, "MISSED")],  # TTFT and requests/s within 5 %
)
def test_a_cold_round_meets_its_target_only_within_5_percent_in_ttft_and_in_requests_per_second(
    ttft: float, wall: float, verdict: str
) -> None:
    rounds = [[[1, 2]], [[1, 2]]]

    def result(ttft: float, wall: float) -> dict:
        return {"ttft": [ttft], "tokens": [[7]], "wall": wall, "bytes_loaded": 0, "tokens_loaded": 0}

    [plain] = bs.rows_of("plain", [0, 1], [result(1.0, 1.0), result(1.0, 1.0)], rounds)
    cold, _ = bs.rows_of("disk", [0, 1], [result(ttft, wall), result(0.2, 0.2)], rounds)
    text, _ = bs.table([plain, cold], {(1, 2): [7]})
    assert text.splitlines()[-1].endswith(f"| within 1.05x: {verdict} |")
