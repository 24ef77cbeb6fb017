"""P/D with the storage tier, scheduler and worker logic: vLLM's own Scheduler in this process with
the connector of a prefill or decode instance that has a ``kv_store`` (no model runs, no engine),
the configurations accepted and refused, and the join of a decode request's two loads."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.config import ModelConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from connector.transfer_plan import PARAMS_KEY, LoadSpec, SaveSpec
from connector.vllm_pd_store import KVBridgePDStoreConnector, LoadJoin, PDStoreMetadata
from connector.vllm_scheduler import KVBridgeMetadata, KVBridgeWorkerMetadata
from connector.vllm_store import StoreHandshake, StoreLoad, StoreMetadata, StoreSave
from connector.vllm_store_connector import KVBridgeStoreConnector
from harness import vllm_procs as vp
from harness.procs import free_port
from harness.vllm_scheduler import (
    PRODUCER_PORT,
    TINY_HEAD_SIZE,
    TINY_KV_HEADS,
    TINY_LAYERS,
    make_scheduler,
    make_worker_connector,
)
from kv_pipe.errors import KVConfigError
from kv_store import chunk_keys

B = vp.BLOCK_SIZE
CHUNK = 2 * B


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    init_none_hash(sha256)  # what EngineCore does before it hashes any block
    path = vp.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-pd-store"))
    return ModelConfig(model=path, dtype="float32", seed=0, max_model_len=512, skip_tokenizer_init=True)


def store_extra(store: Path) -> dict[str, Any]:
    return {"kv_ip": "127.0.0.1", "kv_store": {"tiers": f"disk:{store}", "chunk_size": CHUNK}}


#: A worker's store layout, as its connector tells it (the scheduler-only tests have no worker).
WORKER_LAYOUT = StoreHandshake(tp_rank=0, namespace=bytes(range(32)), layout="FullAttentionSpec/CPU_ATTN/vec")


def store_scheduler(
    model_config: ModelConfig,
    role: str,
    store: Path,
    failure_policy: str = "fail",
    handshake: StoreHandshake = WORKER_LAYOUT,
) -> Scheduler:
    """vLLM's scheduler with a P/D + store connector, told the worker's ``handshake`` as vLLM's
    engine core tells it before the first request."""
    scheduler = make_scheduler(model_config, role, failure_policy=failure_policy, extra=store_extra(store))
    connector = scheduler.connector
    assert type(connector) is KVBridgePDStoreConnector
    assert connector.get_handshake_metadata() is None  # the scheduler side has no worker
    with pytest.raises(KVConfigError, match="before the workers told their store layouts"):
        connector.get_num_new_matched_tokens(request_of("early", CHUNK + 1, 0), 0)
    connector.set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})
    assert connector._store_scheduler.namespaces == (handshake.namespace,)
    return scheduler


def request_of(
    req_id: str, num_tokens: int, seed: int, params: dict[str, Any] | None = None, max_tokens: int = 2
) -> Request:
    rng = random.Random(seed)
    request = Request(
        request_id=req_id,
        prompt_token_ids=[rng.randrange(5, vp.VOCAB) for _ in range(num_tokens)],
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        block_hasher=get_request_block_hasher(B, sha256),
    )
    request.kv_transfer_params = params
    return request


def announced(prefix_tokens: int) -> dict[str, Any]:
    return {
        PARAMS_KEY: {
            "prefix_tokens": prefix_tokens,
            "host": "127.0.0.1",
            "port": PRODUCER_PORT,
            "engine_id": "prefill-0",
            "tp_size": 1,
        }
    }


def put_chunks(scheduler: Scheduler, tokens: list[int], count: int) -> None:
    """Mark the first ``count`` chunks of ``tokens`` stored (a lookup asks only whether they are there)."""
    side = scheduler.connector._store_scheduler
    for space in side.namespaces:
        for key in chunk_keys(space, tokens, CHUNK)[:count]:
            side.store.put(key.key, b"stored")


def meta(step: SchedulerOutput) -> PDStoreMetadata:
    assert isinstance(step.kv_connector_metadata, PDStoreMetadata)
    return step.kv_connector_metadata


def answer(
    scheduler: Scheduler,
    step: SchedulerOutput,
    *,
    recving: set[str] = frozenset(),
    saved: set[str] = frozenset(),
    sending: set[str] = frozenset(),
    invalid: set[int] = frozenset(),
) -> Any:
    req_ids = list(step.num_scheduled_tokens)
    sampled = [
        [7] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else [] for r in req_ids
    ]
    kv = KVConnectorOutput(
        finished_sending=set(sending) or None,
        finished_recving=set(recving) or None,
        invalid_block_ids=set(invalid),
        kv_connector_worker_meta=KVBridgeWorkerMetadata.of_one_worker(set(saved), set()) if saved else None,
    )
    output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv,
    )
    return scheduler.update_from_output(step, output)


def blocks_of(scheduler: Scheduler, req_id: str) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(req_id)[0])


def run_to_end(scheduler: Scheduler) -> list[PDStoreMetadata]:
    """Step until no request is left, the workers reporting every save and finished request at once."""
    metas = []
    for _ in range(40):
        if not scheduler.requests:
            assert_forgotten(scheduler)
            return metas
        step = scheduler.schedule()
        metas.append(meta(step))
        answer(scheduler, step, sending=set(metas[-1].pipe.held), saved={s.req_id for s in metas[-1].pipe.saves})
    raise AssertionError(f"requests left: {list(scheduler.requests)}")


def assert_forgotten(scheduler: Scheduler) -> None:
    """vLLM holds no block, and no side of the connector remembers a request."""
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == (
        scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1
    )  # the null block
    connector = scheduler.connector
    for side in (connector._both, connector._scheduler, connector._store_scheduler):
        left = {
            name: value
            for name, value in vars(side).items()
            if isinstance(value, dict | list | set) and value and name != "settings"
        }
        assert not left, f"{type(side).__name__} still holds {left}"


# ---------------------------------------------------------------------- decode instance


def test_decode_loads_the_stored_prefix_from_the_store_and_the_rest_over_the_pipe(
    model_config: ModelConfig, tmp_path: Path
) -> None:
    scheduler = store_scheduler(model_config, "kv_consumer", tmp_path)
    request = request_of("d-1", 3 * CHUNK + 5, seed=1, params=announced(6 * B))  # transfer prefix: 6 blocks
    put_chunks(scheduler, request.prompt_token_ids, 2)  # 4 blocks stored
    scheduler.add_request(request)
    step = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    blocks = blocks_of(scheduler, "d-1")
    tokens = request.prompt_token_ids
    assert meta(step).store.loads == [StoreLoad("d-1", tokens[: 2 * CHUNK], blocks[:4], skip_blocks=0, stop_blocks=4)]
    assert meta(step).pipe.loads == [
        LoadSpec(
            "d-1",
            tokens[: 6 * B],
            blocks[:6],
            skip_blocks=4,
            wait=True,
            producer=("127.0.0.1", PRODUCER_PORT),
            producer_tp=1,
        )
    ]
    answer(scheduler, step, recving={"d-1"})
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"d-1": request.num_prompt_tokens - 6 * B}
    assert not meta(step).store.loads and not meta(step).pipe.loads
    answer(scheduler, step)
    later = run_to_end(scheduler)
    # A decode instance stores nothing: what it received its prefill instance stores.
    assert all(not m.store.saves for m in [meta(step), *later])


def test_decode_whose_store_holds_the_whole_prefix_drains_the_pipe_entry(
    model_config: ModelConfig, tmp_path: Path
) -> None:
    scheduler = store_scheduler(model_config, "kv_consumer", tmp_path)
    request = request_of("d-2", 2 * CHUNK + 1, seed=2, params=announced(4 * B))
    put_chunks(scheduler, request.prompt_token_ids, 2)
    scheduler.add_request(request)
    step = scheduler.schedule()
    blocks = blocks_of(scheduler, "d-2")
    assert meta(step).store.loads == [StoreLoad("d-2", request.prompt_token_ids[: 2 * CHUNK], blocks[:4], 0, 4)]
    assert meta(step).pipe.loads == []
    answer(scheduler, step, recving={"d-2"})
    step = scheduler.schedule()
    (drain,) = meta(step).pipe.loads
    assert drain.drain and drain.token_ids == request.prompt_token_ids[: 4 * B]
    answer(scheduler, step)
    run_to_end(scheduler)


def test_decode_without_an_announcement_loads_the_stored_prefix_alone(
    model_config: ModelConfig, tmp_path: Path
) -> None:
    scheduler = store_scheduler(model_config, "kv_consumer", tmp_path)
    request = request_of("d-3", 3 * CHUNK + 5, seed=3)
    put_chunks(scheduler, request.prompt_token_ids, 1)
    scheduler.add_request(request)
    step = scheduler.schedule()
    assert [load.stop_blocks for load in meta(step).store.loads] == [2]
    assert meta(step).pipe.loads == []
    answer(scheduler, step, recving={"d-3"})
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"d-3": request.num_prompt_tokens - CHUNK}
    answer(scheduler, step)
    run_to_end(scheduler)


def test_decode_fails_a_request_whose_pipe_part_failed_under_policy_fail(
    model_config: ModelConfig, tmp_path: Path
) -> None:
    scheduler = store_scheduler(model_config, "kv_consumer", tmp_path, failure_policy="fail")
    request = request_of("d-4", 3 * CHUNK + 5, seed=4, params=announced(6 * B))
    put_chunks(scheduler, request.prompt_token_ids, 1)
    scheduler.add_request(request)
    step = scheduler.schedule()
    (pipe_load,) = meta(step).pipe.loads
    assert pipe_load.skip_blocks == 2
    (output,) = answer(scheduler, step, recving={"d-4"}, invalid=set(pipe_load.block_ids[2:]))[0].outputs
    assert output.finished and request.status == RequestStatus.FINISHED_ERROR
    assert not scheduler.requests
    assert_forgotten(scheduler)


# ---------------------------------------------------------------------- prefill instance


def test_prefill_loads_the_stored_prefix_then_saves_and_announces_the_whole_transfer_prefix(
    model_config: ModelConfig, tmp_path: Path
) -> None:
    scheduler = store_scheduler(model_config, "kv_producer", tmp_path)
    request = request_of("p-1", 3 * CHUNK + 5, seed=5, max_tokens=1)
    tokens = request.prompt_token_ids
    put_chunks(scheduler, tokens, 1)
    scheduler.add_request(request)
    step = scheduler.schedule()
    blocks = blocks_of(scheduler, "p-1")
    assert meta(step).store.loads == [StoreLoad("p-1", tokens[:CHUNK], blocks[:2], skip_blocks=0, stop_blocks=2)]
    assert meta(step).pipe.loads == [] and meta(step).pipe.saves == []
    answer(scheduler, step, recving={"p-1"})
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"p-1": request.num_prompt_tokens - CHUNK}
    assert blocks_of(scheduler, "p-1")[:2] == blocks[:2]  # the blocks the store load wrote
    blocks = blocks_of(scheduler, "p-1")
    # The store saves the chunks it did not find; the pipe saves the whole transfer prefix, loaded blocks included.
    assert meta(step).store.saves == [StoreSave("p-1", tokens[: 3 * CHUNK], blocks[:6], first_chunk=1)]
    assert meta(step).pipe.saves == [SaveSpec("p-1", tokens[: 6 * B], blocks[:6])]
    (output,) = answer(scheduler, step, saved={"p-1"})[0].outputs
    assert output.finished and output.kv_transfer_params[PARAMS_KEY]["prefix_tokens"] == 6 * B
    assert "p-1" in scheduler.requests  # vLLM keeps the blocks the pipe may lend
    run_to_end(scheduler)


# ---------------------------------------------------------------------- the workers' layouts in the keys


def tiny_caches(seed: int) -> list[torch.Tensor]:
    """Random caches of the tiny Llama's layers (never zeros), vLLM's CPU shape, 16 blocks."""
    generator = torch.Generator().manual_seed(seed)
    shape = (16, TINY_KV_HEADS, B, 2 * TINY_HEAD_SIZE)
    return [torch.randn(shape, generator=generator) * 3 + 0.5 for _ in TINY_LAYERS]


def run_store_step(connector: Any, store: StoreMetadata) -> set[int]:
    """One step of a worker-side connector whose metadata holds the store's ``store`` (the pipe's
    part empty), polled as vLLM polls until its loads are reported; the failed blocks."""
    connector.bind_connector_metadata(PDStoreMetadata(store=store))
    connector.start_load_kv(None)
    connector.wait_for_save()
    connector.flush_saves()
    waiting, failed = {load.req_id for load in store.loads}, set()
    deadline = time.monotonic() + 60  # a hang guard only: no timing is asserted
    while waiting:
        assert time.monotonic() < deadline, f"loads {waiting} not reported"
        _, recving = connector.get_finished(set())
        waiting -= recving or set()
        failed |= connector.get_block_ids_with_load_errors()
        time.sleep(0.005)
    connector.clear_connector_metadata()
    return failed


def test_prefill_instances_of_two_attention_layouts_on_one_store_keep_apart(
    model_config: ModelConfig, tmp_path: Path
) -> None:
    """Two prefill instances of one model and configuration whose workers run other CPU attention
    interiors: each keys its objects by its own layout (told to its scheduler in vLLM's handshake
    metadata), so each claims and loads only its own, bit-exact, and the other's are a miss, never
    an object of another layout."""
    store = tmp_path / "store"
    sources = {"vec": tiny_caches(1), "amx": tiny_caches(2)}
    workers = {
        isa: make_worker_connector(model_config, "kv_producer", free_port(), store_extra(store), caches, isa)
        for isa, caches in sources.items()
    }
    try:
        handshakes = {isa: worker.get_handshake_metadata() for isa, worker in workers.items()}
        assert handshakes["vec"].namespace != handshakes["amx"].namespace
        assert handshakes["vec"].layout != handshakes["amx"].layout
        schedulers = {
            isa: store_scheduler(model_config, "kv_producer", store, handshake=handshakes[isa]) for isa in workers
        }
        request = request_of("r", 2 * CHUNK + 5, seed=9)
        tokens = request.prompt_token_ids[: 2 * CHUNK]

        def claimed(isa: str) -> int:
            return schedulers[isa].connector.get_num_new_matched_tokens(request, 0)[0]

        assert run_store_step(workers["vec"], StoreMetadata(saves=[StoreSave("s", tokens, [3, 7, 1, 5], 0)])) == set()
        assert claimed("vec") == 2 * CHUNK and claimed("amx") == 0
        # The other layout's worker misses: its keys hold nothing yet, and it writes nothing.
        target = [cache.clone() for cache in sources["amx"]]
        load = StoreLoad("l", tokens, [2, 4, 6, 8], skip_blocks=0, stop_blocks=4)
        assert run_store_step(workers["amx"], StoreMetadata(loads=[load])) == {2, 4, 6, 8}
        assert all(torch.equal(cache, before) for cache, before in zip(sources["amx"], target, strict=True))
        assert workers["amx"].get_kv_connector_stats().data["store_load_errors"] == {"missing": 2}
        # It stores its own objects beside the first instance's, and each loads its own.
        assert run_store_step(workers["amx"], StoreMetadata(saves=[StoreSave("t", tokens, [0, 9, 11, 13], 0)])) == set()
        assert claimed("vec") == claimed("amx") == 2 * CHUNK
        assert workers["amx"].store_stats().chunks_saved == 2
        expected = {"vec": [3, 7, 1, 5], "amx": [0, 9, 11, 13]}
        for isa, worker in workers.items():
            load = StoreLoad(f"{isa}-load", tokens, [10, 12, 14, 15], skip_blocks=0, stop_blocks=4)
            assert run_store_step(worker, StoreMetadata(loads=[load])) == set()
            for layer, cache in enumerate(sources[isa]):
                for src, dst in zip(expected[isa], [10, 12, 14, 15], strict=True):
                    assert torch.equal(cache[dst], cache[src]), (isa, layer, src)
            assert worker.get_kv_connector_stats().data["store_load_errors"] == {}
    finally:
        for worker in workers.values():
            worker.shutdown()


# ---------------------------------------------------------------------- configurations


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_prefill_and_decode_roles_take_a_store(model_config: ModelConfig, tmp_path: Path, role: str) -> None:
    scheduler = store_scheduler(model_config, role, tmp_path)
    assert scheduler.connector._scheduler.is_producer == (role == "kv_producer")
    both = make_scheduler(model_config, "kv_both", extra={"kv_store": f"disk:{tmp_path}"})
    assert type(both.connector) is KVBridgeStoreConnector


@pytest.mark.parametrize(
    ("role", "extra", "named"),
    [
        ("kv_producer", {"kv_ip": "127.0.0.1", "kv_store": "memory"}, "disk or Redis"),
        (
            "kv_consumer",
            {"kv_ip": "127.0.0.1", "kv_store": {"tiers": "disk:/tmp/x", "chunk_size": B + 1}},
            "multiple of vLLM's block size",
        ),
        ("kv_consumer", {"kv_store": {"tiers": "disk:/tmp/x", "chunks": 64}}, "unknown kv_store keys"),
        ("kv_producer", {"kv_store": "disk:/tmp/x", "kv_lend": True}, "kv_lend"),
        ("kv_both", {"kv_ip": "127.0.0.1", "kv_store": "disk:/tmp/x"}, "kv_ip"),
        ("kv_both", {"kv_ip": "127.0.0.1"}, "kv_store entry"),
    ],
)
def test_bad_store_combinations_are_refused_naming_the_cause(
    model_config: ModelConfig, role: str, extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(KVConfigError, match=named):
        make_scheduler(model_config, role, extra=extra)


# ---------------------------------------------------------------------- the join of two loads


def test_a_request_in_two_parts_is_reported_once_both_are_done_with_its_failed_blocks_then() -> None:
    join = LoadJoin()
    store = StoreMetadata(
        loads=[
            StoreLoad("two", [], [9, 4, 7, 2], skip_blocks=1, stop_blocks=3),
            StoreLoad("store-only", [], [5], skip_blocks=0, stop_blocks=1),
        ]
    )
    pipe = KVBridgeMetadata(
        loads=[LoadSpec("two", [], [9, 4, 7, 2, 8, 6], skip_blocks=3), LoadSpec("drain", [], [1], skip_blocks=1)],
        refused={"pipe-refused": [3]},
    )
    join.expect(store, pipe)
    # The pipe part of "two" failed first: its blocks wait for the store part.
    assert join.settle([], ["two", "pipe-refused"], {8, 6, 3}) == {"pipe-refused"}
    assert join.take_failed_blocks() == {3}
    assert join.settle(["store-only"], [], set()) == {"store-only"}
    assert join.take_failed_blocks() == set()
    assert join.settle(["two"], [], {7}) == {"two"}
    assert join.take_failed_blocks() == {8, 6, 7}
    assert join.take_failed_blocks() == set()


def test_both_parts_done_in_one_step_report_the_request_once() -> None:
    join = LoadJoin()
    join.expect(StoreMetadata(refused={"r": [1, 2]}), KVBridgeMetadata(loads=[LoadSpec("r", [], [1, 2, 3], 2)]))
    assert join.settle(["r"], ["r"], {1, 2}) == {"r"}
    assert join.take_failed_blocks() == {1, 2}


def test_a_finished_request_whose_blocks_both_sides_keep_is_reported_once_both_are_done() -> None:
    join = LoadJoin()
    join.expect_requests(["both", "both-at-once"])
    # The store's gather of "both" is done first: vLLM still keeps the blocks the pipe may have lent.
    assert join.settle(["both", "store-only"], ["pipe-only"], set()) == {"store-only", "pipe-only"}
    assert join.settle([], ["both"], set()) == {"both"}
    assert join.settle(["both-at-once"], ["both-at-once"], set()) == {"both-at-once"}
    assert join.settle([], [], set()) == set()
    assert join.take_failed_blocks() == set()
