"""The prefill/decode pair: its model helpers in-process, and whole runs under torchrun in subprocesses."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from kv_pipe import KVConfigError
from launch.cli import torchrun_args
from launch.model import build_model, greedy_continue, greedy_generate, prefill, weights_digest
from launch.pair import PairSettings, decode_order, make_prompts
from tests import procs

NUM_PROMPTS = 5
#: A small workload: the pair then runs in a few seconds on 2 cores.
SMALL_RUN = {
    "KVBRIDGE_NUM_PROMPTS": str(NUM_PROMPTS),
    "KVBRIDGE_MAX_NEW_TOKENS": "6",
    "KVBRIDGE_MAX_PROMPT_LEN": "80",
    "KVBRIDGE_KV_TIMEOUT": "10",
    "KVBRIDGE_KV_CONNECT_TIMEOUT": "60",
    "KVBRIDGE_PEER_TIMEOUT": "60",
    "KVBRIDGE_SELECT_TIMEOUT": "5",
    "OMP_NUM_THREADS": "1",
}


# --- in-process -----------------------------------------------------------------------------------


def test_greedy_continue_matches_transformers_generate() -> None:
    torch.set_num_threads(1)
    model = build_model(None, seed=0)
    prompt = torch.randint(0, model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        reference = model.generate(prompt.view(1, -1), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert len(reference) == 8
    assert greedy_generate(model, prompt, 8) == reference
    state = prefill(model, prompt)
    received = dataclasses.replace(state, keys=[k.clone() for k in state.keys],
                                   values=[v.clone() for v in state.values], hidden=state.hidden.clone())
    assert greedy_continue(model, received, 8) == reference
    assert all(torch.equal(a, b) for a, b in zip(received.keys, state.keys, strict=True))  # cache left intact


def test_weights_digest_follows_the_seed() -> None:
    first, again, other = (weights_digest(build_model(None, seed)) for seed in (0, 0, 1))
    assert first.shape == (32,) and first.dtype == torch.uint8
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_settings_prompts_and_order() -> None:
    settings = PairSettings.from_env({"KVBRIDGE_NUM_PROMPTS": "7", "KVBRIDGE_MIN_PROMPT_LEN": "3",
                                      "KVBRIDGE_MAX_PROMPT_LEN": "9", "KVBRIDGE_TEST_SKIP_REQUEST": "2"})
    assert (settings.num_prompts, settings.max_new_tokens, settings.test_skip_request) == (7, 16, 2)
    prompts = make_prompts(settings, vocab_size=50)
    assert [p.tolist() for p in prompts] == [p.tolist() for p in make_prompts(settings, vocab_size=50)]
    assert all(3 <= len(p) <= 9 and int(p.max()) < 50 for p in prompts)
    order = decode_order(settings)
    assert sorted(order) == list(range(7)) and order != list(range(7))
    assert decode_order(dataclasses.replace(settings, num_prompts=2)) == [1, 0]
    for bad in ({"KVBRIDGE_NUM_PROMPTS": "0"}, {"KVBRIDGE_SEED": "x"}, {"KVBRIDGE_TEST_CORRUPT_KV": "yes"},
                {"KVBRIDGE_MIN_PROMPT_LEN": "10", "KVBRIDGE_MAX_PROMPT_LEN": "9"},
                {"KVBRIDGE_TEST_CRASH_RANK": "2"}, {"KVBRIDGE_SELECT_TIMEOUT": "-1"}):
        with pytest.raises(KVConfigError, match=next(iter(bad))):
            PairSettings.from_env(bad)


def test_cli_builds_torchrun_command() -> None:
    assert torchrun_args(["--master-port=5"]) == ["--nproc-per-node=2", "--master-port=5", "-m", "launch.pair"]
    assert torchrun_args(["--nnodes", "2", "--node-rank=1"])[0] == "--nproc-per-node=1"
    assert torchrun_args(["--nproc_per_node=3"]) == ["--nproc_per_node=3", "-m", "launch.pair"]


# --- whole runs in subprocesses ---------------------------------------------------------------------


def run_processes(
    commands: list[tuple[list[str], dict[str, str]]], tmp_path: Path, timeout: float
) -> list[procs.Finished]:
    """:func:`procs.run_commands` with the small workload in every command's environment."""
    return procs.run_commands([(command, {**SMALL_RUN, **env}) for command, env in commands], tmp_path, timeout)


def torchrun(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--master-addr=127.0.0.1", f"--master-port={port}",
            *args, "-m", "launch.pair"]


def table_rows(stdout: str, word: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("|") and f"| {word} " in line]


def explain(result: procs.Finished) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr[-4000:]}"


@pytest.mark.timeout(150)
def test_pair_under_torchrun_matches(tmp_path: Path) -> None:
    port = procs.free_port(span=6)
    [result] = run_processes([(torchrun(port, "--nproc-per-node=2"), {})], tmp_path, timeout=140)
    assert result.returncode == 0, explain(result)
    assert len(table_rows(result.stdout, "yes")) == NUM_PROMPTS, explain(result)
    assert result.stdout.count("| transferred ") == NUM_PROMPTS
    assert "MISMATCH" not in result.stdout
    assert f"decode side reports {NUM_PROMPTS}/{NUM_PROMPTS} sequences matching, {NUM_PROMPTS} hits" in result.stdout


@pytest.mark.timeout(150)
def test_pair_negative_control_corrupt_kv_fails(tmp_path: Path) -> None:
    port = procs.free_port(span=6)
    [result] = run_processes([(torchrun(port, "--nproc-per-node=2"), {"KVBRIDGE_TEST_CORRUPT_KV": "1"})],
                             tmp_path, timeout=140)
    assert result.returncode != 0, explain(result)
    assert len(table_rows(result.stdout, "MISMATCH")) >= 1, explain(result)
    assert "[rank 1] FAILED" in result.stdout
    assert "check failed: request" in result.stderr


@pytest.mark.timeout(150)
def test_missing_request_is_a_miss_and_recomputed_via_cli(tmp_path: Path) -> None:
    port = procs.free_port(span=6)
    command = [sys.executable, "-m", "launch.cli", "pair", "--num-prompts", str(NUM_PROMPTS),
               "--master-addr=127.0.0.1", f"--master-port={port}"]
    env = {"KVBRIDGE_TEST_SKIP_REQUEST": "2", "KVBRIDGE_SELECT_TIMEOUT": "1"}
    [result] = run_processes([(command, env)], tmp_path, timeout=140)
    assert result.returncode == 0, explain(result)
    [missed] = [line for line in result.stdout.splitlines() if "| miss, recomputed " in line]
    assert missed.startswith("|       2 |"), missed
    assert len(table_rows(result.stdout, "yes")) == NUM_PROMPTS, explain(result)
    assert result.stdout.count("| transferred ") == NUM_PROMPTS - 1
    assert "no entry for these" in result.stderr


@pytest.mark.timeout(150)
def test_pair_as_two_separate_launches(tmp_path: Path) -> None:
    port = procs.free_port(span=6)
    commands = [(torchrun(port, "--nnodes=2", f"--node-rank={rank}", "--nproc-per-node=1"), {}) for rank in (0, 1)]
    prefill_side, decode_side = run_processes(commands, tmp_path, timeout=140)
    assert prefill_side.returncode == 0 and decode_side.returncode == 0, explain(prefill_side) + explain(decode_side)
    assert len(table_rows(decode_side.stdout, "yes")) == NUM_PROMPTS, explain(decode_side)
    assert f"{NUM_PROMPTS}/{NUM_PROMPTS} sequences matching" in prefill_side.stdout


def plain_ranks(port: int, env: dict[str, str] | None = None,
                per_rank: dict[int, dict[str, str]] | None = None) -> list[tuple[list[str], dict[str, str]]]:
    """Both ranks as plain processes, configured as torchrun would (each survives the other's death)."""
    return [([sys.executable, "-m", "launch.pair"],
             {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              **(env or {}), **(per_rank or {}).get(rank, {})})
            for rank in (0, 1)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("crashing", [0, 1])
def test_survivor_reports_a_crashed_peer(tmp_path: Path, crashing: int) -> None:
    port = procs.free_port(span=6)
    env = {"KVBRIDGE_TEST_CRASH_RANK": str(crashing), "KVBRIDGE_KV_TIMEOUT": "5"}
    results = run_processes(plain_ranks(port, env), tmp_path, timeout=110)
    crashed, survivor = results[crashing], results[1 - crashing]
    assert crashed.returncode == 2 and "test hook: rank" in crashed.stderr, explain(crashed)
    assert survivor.returncode == 2, explain(survivor)
    assert "ERROR __main__: failed while" in survivor.stderr, explain(survivor)
    assert "KVPeerLostError" in survivor.stderr or "KVPipeClosedError" in survivor.stderr


@pytest.mark.timeout(120)
def test_ranks_with_different_weights_refuse_to_run(tmp_path: Path) -> None:
    port = procs.free_port(span=6)
    results = run_processes(plain_ranks(port, per_rank={1: {"KVBRIDGE_SEED": "1"}}), tmp_path, timeout=110)
    for result in results:
        assert result.returncode == 2, explain(result)
        assert "KVConfigError: the two ranks hold different model weights" in result.stderr, explain(result)
