"""The storage tier with tensor parallelism in real vLLM CPU engines: instances at TP size 2 (each
rank a worker process, the tiny Llama's 2 KV heads one per rank) on one disk store.

Instance A stores what it computes: each rank its own object of every chunk, under the namespace
its worker derived from its caches and told the scheduler. Instance B, new, loads under
``kv_load_failure_policy="fail"`` after one of rank 1's objects was removed: the scheduler claims
only the chunks both ranks can load, and every answer equals a plain engine's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from connector.transfer_plan import transfer_prefix_len
from harness import store_procs as sp
from harness import vllm_procs as vp
from kv_store import chunk_keys

CHUNK = sp.CHUNK_SIZE
TP = 2
#: Bytes of one block of every layer on one rank: 2 layers x 1 KV head x 32 tokens x (K + V of 64) x fp32.
RANK_BLOCK_BYTES = 2 * 1 * vp.BLOCK_SIZE * 2 * 64 * 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vp.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-store-tp"))


def _env() -> dict[str, str]:
    """The engine process with its scheduler; its two ranks' workers pinned one per core."""
    env = vp.engine_env(0)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    return env


def _stored_files(store: Path) -> set[str]:
    return {f.name for f in store.rglob("*") if f.is_file() and not f.name.startswith(".")}


def _claimed(prompt: list[int], chunks: int) -> int:
    """Tokens a load of the first ``chunks`` stored chunks of ``prompt`` brings (whole blocks before its last token)."""
    return min(chunks * CHUNK, transfer_prefix_len(len(prompt), vp.BLOCK_SIZE))


@pytest.mark.timeout(900)
def test_tp2_instances_store_each_ranks_objects_and_a_new_instance_claims_only_chunks_every_rank_has(
    tiny_model: str, tmp_path: Path
) -> None:
    rng = np.random.default_rng(11)
    prompts = [rng.integers(5, vp.VOCAB, n).tolist() for n in (200, 241, 4 * CHUNK)]
    shared = prompts[0][:CHUNK] + rng.integers(5, vp.VOCAB, 150).tolist()  # shares chunk 0 with prompts[0]
    store = tmp_path / "store"
    spec = f"disk:{store}"
    with vp.Engines() as engines:
        engines.start("reference", vp.reference_body, vp.engine_env(0), model=tiny_model, prompts=prompts + [shared])
        engines.start(
            "a",
            sp.tp_store_body,
            _env(),
            model=tiny_model,
            transfer=sp.store_transfer_config(spec),
            batches=[prompts],
            tp=TP,
        )
        results = engines.wait(["reference", "a"], timeout=840)
    reference = [o["tokens"] for o in results["reference"]]
    a = results["a"]
    assert [o["tokens"] for o in a["outputs"][0]] == reference[:3]

    # Both ranks stored every full chunk, each under the namespace the scheduler looks up.
    spaces = [bytes.fromhex(space) for space in a["namespaces"]]
    assert len(set(spaces)) == TP
    expected = {
        rank: [k.key.hex() for p in prompts for k in chunk_keys(spaces[rank], p[: len(p) // CHUNK * CHUNK], CHUNK)]
        for rank in range(TP)
    }
    assert _stored_files(store) == set(expected[0]) | set(expected[1])
    chunks = sum(len(p) // CHUNK for p in prompts)
    assert [(s["tp_rank"], s["chunks_saved"], s["chunks_loaded"]) for s in a["stats"]] == [
        (0, chunks, 0),
        (1, chunks, 0),
    ]

    # Rank 1's object of chunk 1 of the second prompt is lost (evicted, or its write dropped).
    lost = chunk_keys(spaces[1], prompts[1], CHUNK)[1].key.hex()
    (store / lost[:2] / lost).unlink()

    # B: a new instance, vLLM's prefix cache off (all it reuses comes from the store), "fail".
    repeat = list(prompts[0])
    with vp.Engines() as engines:
        engines.start(
            "b",
            sp.tp_store_body,
            _env(),
            model=tiny_model,
            transfer=sp.store_transfer_config(spec, failure_policy="fail"),
            batches=[prompts, [repeat, shared]],
            tp=TP,
            prefix_caching=False,
        )
        b = engines.wait(["b"], timeout=840)["b"]
    assert b["namespaces"] == a["namespaces"]  # derived from the same layout by both instances' workers
    outputs = b["outputs"][0] + b["outputs"][1]
    assert [o["tokens"] for o in outputs] == reference[:3] + [reference[0], reference[3]]
    assert [o["finish"] for o in outputs] == ["length"] * 5
    stored_chunks = [len(prompts[0]) // CHUNK, 1, len(prompts[2]) // CHUNK, len(prompts[0]) // CHUNK, 1]
    claimed = [_claimed(p, n) for p, n in zip(prompts + [repeat, shared], stored_chunks, strict=True)]
    assert [o["cached"] for o in outputs] == claimed == [192, CHUNK, 224, 192, CHUNK]
    loaded_chunks = sum(-(-tokens // CHUNK) for tokens in claimed)
    for rank, stats in enumerate(b["stats"]):
        assert stats["tp_rank"] == rank
        assert (stats["chunks_loaded"], stats["chunks_failed"]) == (loaded_chunks, 0)
        assert stats["bytes_loaded"] == sum(claimed) // vp.BLOCK_SIZE * RANK_BLOCK_BYTES
    # The second prompt is saved again from chunk 1: rank 0 finds its objects, rank 1 writes the lost
    # one; the shared prompt's chunks after the first are new for both.
    new_of_shared = len(shared) // CHUNK - 1
    assert [(s["chunks_saved"], s["chunks_present"]) for s in b["stats"]] == [
        (new_of_shared, 2),
        (new_of_shared + 1, 1),
    ]
    assert lost in _stored_files(store)
