"""The prefill/decode pair: its model helpers in-process, and whole runs under torchrun in subprocesses."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from harness import procs
from harness.launchers import NUM_PROMPTS, console_script, explain, run_processes, table_rows
from kv_pipe import KVConfigError
from launch.cli import torchrun_args
from launch.model import build_model, greedy_continue, greedy_generate, prefill, weights_digest
from launch.pair import PairSettings, decode_order, make_prompts

# --- in-process -----------------------------------------------------------------------------------


def test_greedy_continue_matches_transformers_generate() -> None:
    torch.set_num_threads(1)
    model = build_model(None, seed=0)
    prompt = torch.randint(0, model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        reference = model.generate(prompt.view(1, -1), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
    assert len(reference) == 8
    assert greedy_generate(model, prompt, 8) == reference
    state = prefill(model, prompt)
    received = dataclasses.replace(
        state,
        keys=[k.clone() for k in state.keys],
        values=[v.clone() for v in state.values],
        hidden=state.hidden.clone(),
    )
    assert greedy_continue(model, received, 8) == reference
    assert all(torch.equal(a, b) for a, b in zip(received.keys, state.keys, strict=True))  # cache left intact


def test_weights_digest_follows_the_seed() -> None:
    first, again, other = (weights_digest(build_model(None, seed)) for seed in (0, 0, 1))
    assert first.shape == (32,) and first.dtype == torch.uint8
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_settings_prompts_and_order() -> None:
    settings = PairSettings.from_env(
        {"KVBRIDGE_NUM_PROMPTS": "7", "KVBRIDGE_MIN_PROMPT_LEN": "3", "KVBRIDGE_MAX_PROMPT_LEN": "9"}
    )
    assert (settings.num_prompts, settings.max_new_tokens, settings.min_prompt_len) == (7, 16, 3)
    prompts = make_prompts(settings, vocab_size=50)
    assert [p.tolist() for p in prompts] == [p.tolist() for p in make_prompts(settings, vocab_size=50)]
    assert all(3 <= len(p) <= 9 and int(p.max()) < 50 for p in prompts)
    order = decode_order(settings)
    assert sorted(order) == list(range(7)) and order != list(range(7))
    assert decode_order(dataclasses.replace(settings, num_prompts=2)) == [1, 0]
    for bad in (
        {"KVBRIDGE_NUM_PROMPTS": "0"},
        {"KVBRIDGE_SEED": "x"},
        {"KVBRIDGE_MIN_PROMPT_LEN": "10", "KVBRIDGE_MAX_PROMPT_LEN": "9"},
        {"KVBRIDGE_SELECT_TIMEOUT": "-1"},
    ):
        with pytest.raises(KVConfigError, match=next(iter(bad))):
            PairSettings.from_env(bad)


def test_cli_builds_torchrun_command() -> None:
    assert torchrun_args(["--master-port=5"]) == ["--nproc-per-node=2", "--master-port=5", "-m", "launch.pair"]
    assert torchrun_args(["--nnodes", "2", "--node-rank=1"])[0] == "--nproc-per-node=1"
    assert torchrun_args(["--nproc_per_node=3"]) == ["--nproc_per_node=3", "-m", "launch.pair"]


# --- whole runs in subprocesses ---------------------------------------------------------------------


def torchrun(port: int, *args: str, module: str = "launch.pair") -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        *args,
        "-m",
        module,
    ]


def with_fault(port: int, fault: str) -> list[str]:
    """The pair on one node under torchrun, with ``fault`` injected (:mod:`harness.fault_injection`)."""
    return [*torchrun(port, "--nproc-per-node=2", module="harness.fault_injection"), fault]


@pytest.mark.timeout(150)
def test_console_script_pair_matches_with_a_secret_file(tmp_path: Path) -> None:
    """The quick start, ``kvbridge pair``, through the installed console script; both ranks read the
    shared secret from a file, so they authenticate each other."""
    secret = tmp_path / "kv_secret"
    secret.write_text("correct horse battery staple\n")
    secret.chmod(0o600)
    port = procs.free_port(span=6)
    command = [
        console_script(),
        "pair",
        "--num-prompts",
        str(NUM_PROMPTS),
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
    ]
    [result] = run_processes([(command, {"KVBRIDGE_KV_SECRET_FILE": str(secret)})], tmp_path, timeout=140)
    assert result.returncode == 0, explain(result)
    assert len(table_rows(result.stdout, "yes")) == NUM_PROMPTS, explain(result)
    assert result.stdout.count("| transferred ") == NUM_PROMPTS
    assert "MISMATCH" not in result.stdout
    assert f"decode side reports {NUM_PROMPTS}/{NUM_PROMPTS} sequences matching, {NUM_PROMPTS} hits" in result.stdout
    assert "correct horse" not in result.stdout + result.stderr


@pytest.mark.timeout(150)
def test_pair_negative_control_corrupt_kv_fails(tmp_path: Path) -> None:
    port = procs.free_port(span=6)
    [result] = run_processes([(with_fault(port, "corrupt-kv"), {})], tmp_path, timeout=140)
    assert result.returncode != 0, explain(result)
    assert len(table_rows(result.stdout, "MISMATCH")) >= 1, explain(result)
    assert result.stdout.count("| transferred ") == NUM_PROMPTS  # every check but the tokens passed
    assert "[rank 1] FAILED" in result.stdout
    assert "check failed: request" in result.stderr


@pytest.mark.timeout(150)
def test_lost_entry_is_a_miss_recomputed_and_reported(tmp_path: Path) -> None:
    port = procs.free_port(span=6)
    [result] = run_processes(
        [(with_fault(port, "lose-insert=2"), {"KVBRIDGE_SELECT_TIMEOUT": "1"})], tmp_path, timeout=140
    )
    assert result.returncode == 1, explain(result)  # the check fails: an entry was lost
    [missed] = [line for line in result.stdout.splitlines() if "| miss, recomputed " in line]
    assert missed.startswith("|       2 |"), missed
    assert len(table_rows(result.stdout, "yes")) == NUM_PROMPTS, explain(result)  # recomputed right
    assert result.stdout.count("| transferred ") == NUM_PROMPTS - 1
    assert "check failed: request 2: sent but missed: no entry for these" in result.stderr, explain(result)
    assert f"{NUM_PROMPTS}/{NUM_PROMPTS} sequences matching, {NUM_PROMPTS - 1} hits, 1 misses" in result.stdout


@pytest.mark.timeout(150)
def test_pair_as_two_separate_launches(tmp_path: Path) -> None:
    port = procs.free_port(span=6)
    commands = [(torchrun(port, "--nnodes=2", f"--node-rank={rank}", "--nproc-per-node=1"), {}) for rank in (0, 1)]
    prefill_side, decode_side = run_processes(commands, tmp_path, timeout=140)
    assert prefill_side.returncode == 0 and decode_side.returncode == 0, explain(prefill_side) + explain(decode_side)
    assert len(table_rows(decode_side.stdout, "yes")) == NUM_PROMPTS, explain(decode_side)
    assert f"{NUM_PROMPTS}/{NUM_PROMPTS} sequences matching" in prefill_side.stdout


def plain_ranks(
    port: int,
    env: dict[str, str] | None = None,
    per_rank: dict[int, dict[str, str]] | None = None,
    module: list[str] | None = None,
) -> list[tuple[list[str], dict[str, str]]]:
    """Both ranks as plain processes, configured as torchrun would (each survives the other's death)."""
    return [
        (
            [sys.executable, "-m", *(module or ["launch.pair"])],
            {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                **(env or {}),
                **(per_rank or {}).get(rank, {}),
            },
        )
        for rank in (0, 1)
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("crashing", [0, 1])
def test_survivor_reports_a_crashed_peer(tmp_path: Path, crashing: int) -> None:
    port = procs.free_port(span=6)
    ranks = plain_ranks(
        port, {"KVBRIDGE_KV_TIMEOUT": "5"}, module=["harness.fault_injection", f"crash-rank={crashing}"]
    )
    results = run_processes(ranks, tmp_path, timeout=110)
    crashed, survivor = results[crashing], results[1 - crashing]
    assert crashed.returncode == 2 and "fault injection: rank" in crashed.stderr, explain(crashed)
    assert survivor.returncode == 2, explain(survivor)
    assert "ERROR launch.pair: failed while" in survivor.stderr, explain(survivor)
    assert "KVPeerLostError" in survivor.stderr or "KVPipeClosedError" in survivor.stderr


@pytest.mark.timeout(120)
def test_ranks_with_different_weights_refuse_to_run(tmp_path: Path) -> None:
    port = procs.free_port(span=6)
    results = run_processes(plain_ranks(port, per_rank={1: {"KVBRIDGE_SEED": "1"}}), tmp_path, timeout=110)
    for result in results:
        assert result.returncode == 2, explain(result)
        assert "KVConfigError: the two ranks hold different model weights" in result.stderr, explain(result)


@pytest.mark.timeout(120)
def test_ranks_with_different_secret_files_refuse_each_other(tmp_path: Path) -> None:
    files = {}
    for rank in (0, 1):
        files[rank] = tmp_path / f"secret{rank}"
        files[rank].write_text(f"secret of rank {rank}")
        files[rank].chmod(0o600)
    port = procs.free_port(span=6)
    env = {"KVBRIDGE_KV_CONNECT_TIMEOUT": "20"}
    per_rank = {rank: {"KVBRIDGE_KV_SECRET_FILE": str(path)} for rank, path in files.items()}
    results = run_processes(plain_ranks(port, env, per_rank), tmp_path, timeout=110)
    for result in results:
        assert result.returncode == 2, explain(result)
        assert "authentication failed" in result.stderr, explain(result)
        assert "secret of rank" not in result.stdout + result.stderr
