"""P/D with the storage tier, with vLLM's real engines in process on the tiny random Llama: a prefill
instance that looks in the store before it computes and stores what it computed, and a decode
instance that takes the stored prefix from the store and the rest over the pipe.

Both instances run with vLLM's prefix cache off, so every reused block comes from the store or the
pipe; the decode instance fails a request whose load failed, so tokens equal to a plain engine's
prove that both parts loaded the right KV.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from connector.transfer_plan import PARAMS_KEY
from harness import store_procs as sp
from harness import vllm_procs as vp
from harness.procs import free_port

CHUNK = sp.CHUNK_SIZE
B = vp.BLOCK_SIZE
#: Bytes of one block of every layer of the tiny Llama: 2 layers x 2 KV heads x 32 tokens x (K + V of 64) x fp32.
BLOCK_BYTES = 2 * 2 * B * 2 * 64 * 4


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    """The first batch: random prompts of 3 chunks and a block (and a tail), 1 chunk and a block,
    and one block; the second: the first prompt again, and one sharing its first 2 chunks."""
    rng = np.random.default_rng(11)
    first = [rng.integers(5, vp.VOCAB, n).tolist() for n in (3 * CHUNK + B + 6, CHUNK + B + 4, B + 8)]
    shared = first[0][: 2 * CHUNK] + rng.integers(5, vp.VOCAB, CHUNK + 26).tolist()
    return first, [list(first[0]), shared]


def _full_chunks(prompt: list[int]) -> int:
    """Chunks of ``prompt`` inside its transfer prefix (a stored prefix is never longer)."""
    return vp.transfer_prefix(prompt) // CHUNK


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vp.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _run_pair(
    model: str, store: Path, first: list[list[int]], second: list[list[int]], multiprocess: bool = False
) -> dict:
    """A plain engine for every prompt, and a prefill and a decode instance with a store at ``store``
    (the decode instance failing a request whose load failed; in vLLM's multiprocess mode with
    ``multiprocess``): the prefill instance serves ``first``, then ``second``, then the decode
    instance both with the announcements."""
    spec = f"disk:{store}"
    port = free_port()
    with vp.Engines() as engines:
        prefilled, done, announcements = engines.event(), engines.event(), engines.queue()
        engines.start("reference", vp.reference_body, vp.engine_env(0), model=model, prompts=first + second)
        engines.start(
            "producer",
            sp.pd_store_producer_body,
            vp.engine_env(0),
            model=model,
            transfer=sp.pd_store_transfer_config("kv_producer", port, spec),
            batches=[first, second],
            prefilled=prefilled,
            consumer_done=done,
            timeout=480,
            announce=announcements,
        )
        engines.start(
            "consumer",
            sp.pd_store_consumer_body,
            vp.engine_env(1, multiprocess),
            model=model,
            transfer=sp.pd_store_transfer_config("kv_consumer", port, spec, failure_policy="fail"),
            batches=[first, second],
            prefilled=prefilled,
            consumer_done=done,
            timeout=480,
            announced=announcements,
        )
        return engines.wait(["reference", "producer", "consumer"], timeout=560)


@pytest.mark.timeout(600)
def test_prefill_loads_stored_prefixes_and_decode_takes_the_rest_over_the_pipe(tiny_model: str, tmp_path: Path) -> None:
    first, second = _prompts()
    prompts = first + second
    results = _run_pair(tiny_model, tmp_path / "store", first, second)
    reference = [o["tokens"] for o in results["reference"]]
    producer, consumer = results["producer"], results["consumer"]

    # Prefill: its first token equals a plain engine's; the whole transfer prefix is announced.
    prefilled_outputs = producer["outputs"][0] + producer["outputs"][1]
    assert [o["tokens"] for o in prefilled_outputs] == [tokens[:1] for tokens in reference]
    assert [o["params"][PARAMS_KEY]["prefix_tokens"] for o in prefilled_outputs] == [
        vp.transfer_prefix(p) for p in prompts
    ]
    # The second batch came from the store: the repeated prompt's every chunk, the sharing prompt's first two.
    stored_first = sum(_full_chunks(p) for p in first)
    assert producer["store"]["chunks_loaded"] == _full_chunks(first[0]) + 2
    assert [o["cached"] for o in producer["outputs"][1]] == [_full_chunks(first[0]) * CHUNK, 2 * CHUNK]
    assert producer["store"]["chunks_failed"] == 0
    # It stored every chunk it computed, once: the first batch's, and the sharing prompt's new one.
    assert producer["store"]["chunks_saved"] == stored_first + _full_chunks(second[1]) - 2
    assert producer["stats"]["saved_requests"] == len(prompts) and producer["stats"]["save_failures"] == 0

    # Decode, under "fail": a plain engine's tokens, the whole transfer prefix loaded.
    decoded = consumer["outputs"][0] + consumer["outputs"][1]
    assert [o["tokens"] for o in decoded] == reference
    assert all(o["finish"] == "length" for o in decoded)
    assert [o["cached"] for o in decoded] == [vp.transfer_prefix(p) for p in prompts]
    # The store gave each prompt its full chunks; the pipe the block after them, where there is one.
    store_blocks = sum(_full_chunks(p) * CHUNK // B for p in prompts)
    assert consumer["store"]["chunks_loaded"] == sum(_full_chunks(p) for p in prompts)
    assert consumer["store"]["bytes_loaded"] == store_blocks * BLOCK_BYTES
    assert consumer["store"]["chunks_failed"] == 0
    piped = [p for p in prompts if vp.transfer_prefix(p) > _full_chunks(p) * CHUNK]
    stats = consumer["stats"]
    assert stats["loaded_blocks"] == sum(vp.transfer_prefix(p) // B - _full_chunks(p) * CHUNK // B for p in piped)
    # Only those blocks travelled over the pipe (with the entry's int64 tokens and bool roi), not the
    # stored prefix's: less than the whole transfer prefixes (some of them were stored in part).
    assert any(_full_chunks(p) for p in piped)
    assert stats["loaded_bytes"] == sum(
        9 * vp.transfer_prefix(p) + (vp.transfer_prefix(p) // B - _full_chunks(p) * CHUNK // B) * BLOCK_BYTES
        for p in piped
    )
    assert stats["loaded_bytes"] < sum(
        9 * vp.transfer_prefix(p) + vp.transfer_prefix(p) // B * BLOCK_BYTES for p in piped
    )
    assert stats["load_misses"] == stats["load_errors"] == 0
    # The sharing prompt's store held its whole transfer prefix: its pipe entry was taken and dropped.
    assert stats["load_hits"] == len(piped) and stats["load_hits"] + stats["drained"] == len(prompts)
    # A decode instance stores nothing.
    assert consumer["store"]["chunks_saved"] == consumer["store"]["chunks_present"] == 0
    assert producer["entries_left"] == 0


@pytest.mark.timeout(600)
def test_a_decode_instance_in_vllms_multiprocess_mode_loads_both_parts(tiny_model: str, tmp_path: Path) -> None:
    """The decode instance's scheduler and worker in two processes: the plan of both parts crosses
    pickled, and its tokens equal a plain engine's under "fail" with every prefix loaded."""
    first, second = _prompts()
    results = _run_pair(tiny_model, tmp_path / "store", first, second, multiprocess=True)
    decoded = results["consumer"]["outputs"][0] + results["consumer"]["outputs"][1]
    assert [o["tokens"] for o in decoded] == [o["tokens"] for o in results["reference"]]
    assert [o["cached"] for o in decoded] == [vp.transfer_prefix(p) for p in first + second]
    assert results["producer"]["store"]["chunks_loaded"] == _full_chunks(first[0]) + 2
