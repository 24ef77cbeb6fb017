"""``kvbridge pair --store``: the pair's KV through a store both ranks reach (a directory, a real
redis-server) instead of a pipe, every sequence checked against its recompute."""

from __future__ import annotations

from pathlib import Path

import pytest

from connector.transfer_state import KVConnectorConfig
from harness import procs
from harness.launchers import NUM_PROMPTS, console_script, explain, run_processes, table_rows
from harness.redis_servers import start_server
from kv_pipe import KVConfigError, KVTransferConfig
from launch.pair import PairSettings, run

#: Prompts of 5 to 80 tokens in chunks of 16: several chunks each, most with a partial last one.
CHUNKED = {"KVBRIDGE_KV_CHUNK_SIZE": "16"}


def pair_with_store(tmp_path: Path, spec: str, env: dict[str, str] | None = None) -> procs.Finished:
    port = procs.free_port(span=6)
    command = [
        console_script(),
        "pair",
        "--num-prompts",
        str(NUM_PROMPTS),
        "--store",
        spec,
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
    ]
    [result] = run_processes([(command, {**CHUNKED, **(env or {})})], tmp_path, timeout=140)
    return result


def assert_every_sequence_transferred_and_matching(result: procs.Finished) -> None:
    assert result.returncode == 0, explain(result)
    assert len(table_rows(result.stdout, "yes")) == NUM_PROMPTS, explain(result)
    assert result.stdout.count("| transferred ") == NUM_PROMPTS, explain(result)
    assert "MISMATCH" not in result.stdout
    assert f"decode side reports {NUM_PROMPTS}/{NUM_PROMPTS} sequences matching, {NUM_PROMPTS} hits" in result.stdout


@pytest.mark.timeout(150)
@pytest.mark.parametrize("tiers", ["disk:{}", "memory,disk:{}"])
def test_pair_through_a_disk_store(tmp_path: Path, tiers: str) -> None:
    """Alone, or behind a memory tier (each rank's own; the disk is then written in the background)."""
    directory = tmp_path / "kv"
    result = pair_with_store(tmp_path, tiers.format(directory))
    assert_every_sequence_transferred_and_matching(result)
    assert any(path.is_file() for path in directory.rglob("*"))  # the KV went through the directory


@pytest.mark.timeout(150)
def test_pair_through_redis_with_signed_objects(tmp_path: Path) -> None:
    secret = tmp_path / "kv_secret"
    secret.write_text("correct horse battery staple\n")
    secret.chmod(0o600)
    server = start_server(tmp_path / "redis")
    try:
        result = pair_with_store(tmp_path, server.url, {"KVBRIDGE_KV_SECRET_FILE": str(secret)})
        assert_every_sequence_transferred_and_matching(result)
        assert server.client().dbsize() >= NUM_PROMPTS  # at least one object per prompt
    finally:
        server.kill()
    assert "correct horse" not in result.stdout + result.stderr


@pytest.mark.timeout(60)
def test_a_memory_store_is_refused_for_the_pair() -> None:
    config = KVConnectorConfig(KVTransferConfig(kv_role="kv_producer"), kv_store="memory")
    with pytest.raises(KVConfigError, match="cannot share the store 'memory'.*disk:PATH.*redis://"):
        run(PairSettings(), config)


def test_the_cli_passes_the_store_to_the_ranks() -> None:
    environment = KVConnectorConfig.from_env(
        KVTransferConfig(), {"KVBRIDGE_KV_STORE": "disk:/tmp/kv", "KVBRIDGE_KV_CHUNK_SIZE": "64"}
    )
    assert (environment.kv_store, environment.kv_chunk_size) == ("disk:/tmp/kv", 64)
    assert KVConnectorConfig.from_env(KVTransferConfig(), {}).kv_store is None
    with pytest.raises(KVConfigError, match="KVBRIDGE_KV_CHUNK_SIZE"):
        KVConnectorConfig.from_env(KVTransferConfig(), {"KVBRIDGE_KV_CHUNK_SIZE": "many"})
    with pytest.raises(KVConfigError, match="kv_chunk_size"):
        KVConnectorConfig(kv_chunk_size=0)
