"""The storage tier inside vLLM: a ``kv_both`` instance stores what it computes, and a new instance
on the same store loads it, with vLLM's real engine in process on the tiny random Llama.

Each instance's greedy tokens are compared with a plain engine's; loads are counted by the
connector's own store counters (blocks written from stored chunks), not by vLLM's hit counter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from connector.transfer_plan import transfer_prefix_len
from harness import store_procs as sp
from harness import vllm_procs as vp

CHUNK = sp.CHUNK_SIZE
#: Prompts of about 3-4 chunks, among them one of exactly 4 chunks (its last block is vLLM's to compute).
PROMPT_LENGTHS = (200, 241, 4 * CHUNK)
#: Bytes of one block of every layer of the tiny Llama: 2 layers x 2 KV heads x 32 tokens x (K + V of 64) x fp32.
BLOCK_BYTES = 2 * 2 * vp.BLOCK_SIZE * 2 * 64 * 4


def _prompts() -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(7)
    prompts = [rng.integers(5, vp.VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    # Shares only its first chunk with the first prompt.
    shared = prompts[0][:CHUNK] + rng.integers(5, vp.VOCAB, 150).tolist()
    return prompts, shared


def _loaded_blocks(prompt: list[int], stored_chunks: int) -> int:
    return min(stored_chunks * CHUNK, transfer_prefix_len(len(prompt), vp.BLOCK_SIZE)) // vp.BLOCK_SIZE


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vp.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_a_new_instance_loads_what_another_stored(tiny_model: str, tmp_path: Path) -> None:
    prompts, shared = _prompts()
    store = tmp_path / "store"
    spec = f"disk:{store}"
    with vp.Engines() as engines:
        engines.start("reference", vp.reference_body, vp.engine_env(0), model=tiny_model, prompts=prompts + [shared])
        engines.start("a", sp.store_body, vp.engine_env(1), model=tiny_model,
                      transfer=sp.store_transfer_config(spec), batches=[prompts])
        results = engines.wait(["reference", "a"], timeout=300)
    reference = [o["tokens"] for o in results["reference"]]
    a = results["a"]
    assert [o["tokens"] for o in a["outputs"][0]] == reference[:3]
    assert a["stats"]["chunks_saved"] == sum(len(p) // CHUNK for p in prompts)
    assert a["stats"]["chunks_loaded"] == 0

    # B: a new instance on the same directory; "fail" turns any load error into a failed request.
    # vLLM's own prefix cache is off, so every reused block comes from the store.
    with vp.Engines() as engines:
        engines.start("b", sp.store_body, vp.engine_env(0), model=tiny_model,
                      transfer=sp.store_transfer_config(spec, failure_policy="fail"),
                      batches=[prompts, [shared]], prefix_caching=False)
        b = engines.wait(["b"], timeout=300)["b"]
    assert [o["tokens"] for o in b["outputs"][0] + b["outputs"][1]] == reference
    assert all(o["finish"] == "length" for o in b["outputs"][0] + b["outputs"][1])
    blocks = sum(_loaded_blocks(p, len(p) // CHUNK) for p in prompts) + _loaded_blocks(shared, 1)
    assert b["stats"]["bytes_loaded"] == blocks * BLOCK_BYTES
    assert b["stats"]["chunks_loaded"] == sum(-(-_loaded_blocks(p, len(p) // CHUNK) // 2) for p in prompts) + 1
    assert b["stats"]["chunks_failed"] == 0
    # The shared prompt's own full chunks after the first one were stored by B.
    assert b["stats"]["chunks_saved"] == len(shared) // CHUNK - 1

    # A corrupted object: its chunk is a load error, recomputed under "recompute": same tokens.
    victim = max((f for f in store.rglob("*") if f.is_file() and not f.name.startswith(".")), key=lambda f: f.name)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with vp.Engines() as engines:
        engines.start("c", sp.store_body, vp.engine_env(0), model=tiny_model,
                      transfer=sp.store_transfer_config(spec), batches=[prompts + [shared]], prefix_caching=False)
        c = engines.wait(["c"], timeout=300)["c"]
    assert [o["tokens"] for o in c["outputs"][0]] == reference
    assert c["stats"]["chunks_failed"] == 1
    assert c["stats"]["chunks_loaded"] == b["stats"]["chunks_loaded"] + len(shared) // CHUNK - 1 - 1
