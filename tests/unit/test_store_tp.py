"""The storage tier with tensor parallelism and with the workers' real cache layout in its keys.

Each TP rank stores its own object of a chunk, under its own namespace; the scheduler claims a
chunk only when every rank's object is there, in one lookup. The namespace digests the layout of
the worker's caches (attention backend and its interior variant, block shape), which only the
worker knows: it tells the scheduler through vLLM's handshake metadata.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from vllm.config import ModelConfig
from vllm.v1.core.sched.scheduler import Scheduler

from connector import compat
from connector.vllm_store import (
    StoreHandshake,
    StoreLoad,
    StoreSave,
    StoreScheduler,
    StoreSettings,
    StoreWorker,
    identity_namespace,
)
from connector.vllm_store_connector import KVBridgeStoreConnector
from connector.vllm_worker import find_layout
from harness import vllm_procs as vp
from harness.vllm_fakes import make_request, poll_until_reported, scheduler_output
from harness.vllm_scheduler import make_scheduler
from kv_pipe.errors import KVConfigError
from kv_store import DiskTier, StoreTier, TieredStore, TierStats, chunk_keys

B = vp.BLOCK_SIZE
CHUNK = 2 * B
FB = vp.FAKE_BLOCK_SIZE
FAKE_CHUNK = 2 * FB


def identity(tp_rank: int, tp_size: int, model: str = "m") -> compat.KVLayoutInfo:
    return vp.store_identity(2, B, model, "FullAttentionSpec/LBHNC", tp_rank, tp_size, total_kv_heads=2, head_size=64)


SPACES = [identity_namespace(identity(rank, 2)) for rank in range(2)]


class CountingTier(StoreTier):
    """A tier that counts the calls asking whether keys are stored."""

    def __init__(self, tier: StoreTier) -> None:
        self.tier, self.name = tier, tier.name
        self.asked: list[int] = []  # keys per contains_many call

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return self.tier.get_many(keys)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        self.asked.append(len(keys))
        return self.tier.contains_many(keys)

    def put(self, key: bytes, blob: bytes) -> bool:
        return self.tier.put(key, blob)

    def stats(self) -> TierStats:
        return self.tier.stats()

    def close(self) -> None:
        self.tier.close()


def tp_scheduler(path: Path, spaces: Sequence[bytes] | None = SPACES) -> tuple[StoreScheduler, CountingTier]:
    settings = StoreSettings.from_extra({"kv_store": {"tiers": f"disk:{path}", "chunk_size": CHUNK}}, environ={})
    tier = CountingTier(DiskTier(path, 1 << 30))
    return StoreScheduler(settings, B, spaces, TieredStore([tier])), tier


def store_objects(side: StoreScheduler, tokens: list[int], rank: int, chunks: Sequence[int]) -> None:
    keys = chunk_keys(side.namespaces[rank], tokens, CHUNK)
    for index in chunks:
        side.store.put(keys[index].key, b"object of rank %d" % rank)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, vp.VOCAB) for _ in range(length)]


def test_a_chunk_whose_rank_1_object_is_missing_is_not_claimed(tmp_path: Path) -> None:
    side, tier = tp_scheduler(tmp_path)
    tokens = prompt(1, 4 * CHUNK + 7)
    store_objects(side, tokens, 0, range(4))
    store_objects(side, tokens, 1, [0, 2, 3])  # rank 1's object of chunk 1 was dropped or evicted
    request = make_request("r", tokens)
    assert side.num_new_matched_tokens(request, 0) == CHUNK  # chunk 0 only: rank 1 cannot load chunk 1
    assert tier.asked == [8]  # one question for both ranks' objects of the 4 chunks
    store_objects(side, tokens, 1, [1])
    assert side.num_new_matched_tokens(request, 0) == 4 * CHUNK
    assert tier.asked == [8, 8]
    side.store.close()


def test_rank_0s_objects_alone_claim_nothing_and_are_saved_again_from_the_first_incomplete_chunk(
    tmp_path: Path,
) -> None:
    side, _ = tp_scheduler(tmp_path)
    tokens = prompt(2, 3 * CHUNK)
    store_objects(side, tokens, 0, range(3))
    store_objects(side, tokens, 1, [1, 2])  # chunk 0 of rank 1 gone: nothing after it counts either
    request = make_request("r", tokens)
    assert side.num_new_matched_tokens(request, 0) == 0
    blocks = list(range(10, 16))
    meta = side.build_meta(scheduler_output([], {"r": len(tokens)}, cached=_cached("r", 0)), lambda r: blocks)
    # Every rank saves from chunk 0 on: rank 0 finds its objects there (nothing written), rank 1 writes.
    assert meta.saves == [StoreSave("r", tokens, blocks, first_chunk=0)]
    side.store.close()


def test_the_scheduler_of_one_rank_asks_for_that_ranks_objects_only(tmp_path: Path) -> None:
    side, tier = tp_scheduler(tmp_path, [identity_namespace(identity(0, 1))])
    tokens = prompt(3, 2 * CHUNK + 1)
    store_objects(side, tokens, 0, range(2))
    assert side.num_new_matched_tokens(make_request("r", tokens), 0) == 2 * CHUNK
    assert tier.asked == [2]
    side.store.close()


def _cached(req_id: str, computed: int):
    from harness.vllm_fakes import cached_data

    return cached_data([req_id], [computed])


# ---------------------------------------------------------------------- the workers' layout in the keys


def worker(path: Path, layout_name: str, tp_rank: int = 0, caches: list[torch.Tensor] | None = None) -> StoreWorker:
    settings = StoreSettings.from_extra({"kv_store": {"tiers": f"disk:{path}", "chunk_size": FAKE_CHUNK}}, environ={})
    caches = caches if caches is not None else vp.fake_caches(tp_rank + 1)
    side = StoreWorker(settings, identity(tp_rank, 2))
    side.register(caches, find_layout(caches[0], vp.FAKE_BLOCKS, FB, layout_name), layout_name)
    return side


def loaded(side: StoreWorker, load: StoreLoad) -> set[int]:
    """The blocks of ``load`` that failed."""
    side.start_loads([load], {})
    return set().union(*(failed for _, failed in poll_until_reported(side, {load.req_id})))


def test_two_layouts_of_the_same_configuration_store_under_different_keys(tmp_path: Path) -> None:
    vec, amx, vec_again = (worker(tmp_path, name) for name in ("CPU_ATTN/vec", "CPU_ATTN/amx", "CPU_ATTN/vec"))
    assert vec.namespace != amx.namespace
    assert vec.namespace == vec_again.namespace  # derived, not random: every instance of a layout agrees
    assert vec.namespace != identity_namespace(identity(0, 2))  # the configuration alone is not the key
    tokens = prompt(4, FAKE_CHUNK)
    assert chunk_keys(vec.namespace, tokens, FAKE_CHUNK) != chunk_keys(amx.namespace, tokens, FAKE_CHUNK)
    for side in (vec, amx, vec_again):
        side.close()


def test_an_instance_of_another_layout_misses_and_then_stores_its_own_objects(tmp_path: Path) -> None:
    """Two layouts on one store: each reads only its own objects, and neither blocks the other's
    writes (before, the first writer's objects took the keys and the other only ever missed)."""
    tokens = prompt(5, 2 * FAKE_CHUNK)
    vec = worker(tmp_path, "CPU_ATTN/vec", caches=vp.fake_caches(1))
    vec.save([StoreSave("s", tokens, [3, 7, 1, 5], first_chunk=0)])
    vec.flush()
    amx_source = vp.fake_caches(2)
    amx = worker(tmp_path, "CPU_ATTN/amx", caches=amx_source)
    load = StoreLoad("l", tokens, [2, 4, 6, 8], skip_blocks=0, stop_blocks=4)
    assert loaded(amx, load) == {2, 4, 6, 8}
    amx.save([StoreSave("t", tokens, [0, 2, 4, 6], first_chunk=0)])
    amx.flush()
    assert amx.stats().chunks_saved == 2  # its own keys: nothing was there
    target = vp.fake_caches(3)
    reader = worker(tmp_path, "CPU_ATTN/amx", caches=target)
    assert loaded(reader, StoreLoad("m", tokens, [1, 3, 5, 7], skip_blocks=0, stop_blocks=4)) == set()
    for layer, cache in enumerate(target):
        for src, dst in zip([0, 2, 4, 6], [1, 3, 5, 7], strict=True):
            assert torch.equal(cache[dst], amx_source[layer][src])
    for side in (vec, amx, reader):
        side.close()


def test_the_scheduler_looks_up_the_namespaces_the_workers_tell(tmp_path: Path) -> None:
    workers = [worker(tmp_path, "CPU_ATTN/vec", tp_rank=rank) for rank in range(2)]
    handshakes = {rank: side.handshake() for rank, side in enumerate(workers)}
    assert [h.namespace for h in handshakes.values()] == [side.namespace for side in workers]
    assert handshakes[0].namespace != handshakes[1].namespace  # each rank its own objects
    side, _ = tp_scheduler(tmp_path, None)
    with pytest.raises(KVConfigError, match="before the workers told their store layouts"):
        side.num_new_matched_tokens(make_request("r", prompt(6, CHUNK + 1)), 0)
    side.adopt_handshakes(handshakes, tp_size=2)
    assert side.namespaces == tuple(side.namespace for side in workers)
    for side_of_rank in workers:
        side_of_rank.close()
    side.store.close()


@pytest.mark.parametrize(
    ("handshakes", "named"),
    [
        ({0: StoreHandshake(0, bytes(32), "x")}, "each of 2 TP ranks"),
        ({0: StoreHandshake(0, bytes(32), "x"), 1: StoreHandshake(0, bytes(32), "x")}, "each of 2 TP ranks"),
        ({0: StoreHandshake(0, bytes(32), "x"), 1: None}, "each of 2 TP ranks"),
        ({0: StoreHandshake(0, bytes(32), "x"), 1: StoreHandshake(1, bytes(31), "x")}, "32-byte namespace"),
    ],
)
def test_handshakes_that_do_not_give_every_rank_one_namespace_are_refused(
    tmp_path: Path, handshakes: dict, named: str
) -> None:
    side, _ = tp_scheduler(tmp_path, None)
    with pytest.raises(KVConfigError, match=named):
        side.adopt_handshakes(handshakes, tp_size=2)
    side.store.close()


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    path = vp.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-store-tp"))
    return ModelConfig(model=path, dtype="float32", seed=0, max_model_len=512, skip_tokenizer_init=True)


def test_vllms_handshake_hook_gives_the_connectors_scheduler_the_workers_namespace(
    model_config: ModelConfig, tmp_path: Path
) -> None:
    """vLLM's scheduler with the store connector: it waits for the workers' namespaces, which vLLM
    hands over through the connector's ``set_xfer_handshake_metadata_pp_aware``."""
    scheduler: Scheduler = make_scheduler(
        model_config, "kv_both", extra={"kv_store": {"tiers": f"disk:{tmp_path}", "chunk_size": CHUNK}}
    )
    connector = scheduler.connector
    assert isinstance(connector, KVBridgeStoreConnector)
    assert connector._store_scheduler.namespaces is None
    rank_0 = worker(tmp_path / "w", "CPU_ATTN/vec")
    assert connector.get_handshake_metadata() is None  # the scheduler side has no worker
    connector.set_xfer_handshake_metadata_pp_aware({(0, 0): rank_0.handshake()})
    assert connector._store_scheduler.namespaces == (rank_0.namespace,)
    rank_0.close()
    connector.shutdown()
