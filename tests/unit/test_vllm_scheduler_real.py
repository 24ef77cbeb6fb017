"""KVBridgeConnector's scheduler side driven by vLLM's own Scheduler, in this process, on CPU.

The connector relies on how vLLM's ``Scheduler`` orders its calls (``request_finished`` before
``update_connector_output`` in one ``update_from_output``; preempted ids in the ``SchedulerOutput``
whose step may write their freed blocks; ``get_num_new_matched_tokens`` then
``update_state_after_alloc`` then ``build_connector_meta`` within ``schedule()``) and on what it
does with the connector's answers (blocks kept until ``finished_sending`` / ``finished_recving``,
``WAITING_FOR_REMOTE_KVS``, recomputation of failed blocks). Here the real ``Scheduler`` runs
with fake model-runner outputs standing in for the workers, so that a vLLM upgrade that breaks
one of these assumptions fails a test whose message names it. No model runs: the tiny Llama only
gives vLLM a model configuration to read.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.config import ModelConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from connector import compat
from connector.transfer_plan import PARAMS_KEY, LoadSpec, SaveSpec, transfer_prefix_len
from connector.vllm_scheduler import KVBridgeMetadata, KVBridgeWorkerMetadata, SchedulerSide
from connector.vllm_settings import ConnectorSettings
from connector.vllm_v1 import KVBridgeConnector
from connector.vllm_worker import WorkerSide, find_layout
from harness import vllm_procs as vp
from harness import vllm_scheduler
from harness.procs import free_port
from harness.vllm_fakes import bare_connector
from kv_pipe.exported_memory import page_aligned_empty
from lookup_buffer import BufferListener
from lookup_buffer.loans import EXPIRED
from lookup_buffer.matching import MatchKey

B = vp.BLOCK_SIZE
PRODUCER_PORT = vllm_scheduler.PRODUCER_PORT
#: Sampled by the fake workers: never the tiny Llama's EOS, so requests stop at ``max_tokens``.
TOKEN = 7
HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)


# ---------------------------------------------------------------------- vLLM in this process


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return vllm_scheduler.tiny_model_config(tmp_path_factory.mktemp("tiny-llama-sched"))


def make_scheduler(
    model_config: ModelConfig, role: str, num_blocks: int = 64, failure_policy: str = "fail"
) -> Scheduler:
    """vLLM's Scheduler with KVBridgeConnector loaded from its kv-transfer config, as vLLM loads it."""
    scheduler = vllm_scheduler.make_scheduler(model_config, role, num_blocks, failure_policy)
    assert isinstance(scheduler.connector, KVBridgeConnector), type(scheduler.connector)
    assert not scheduler.scheduler_config.async_scheduling, (
        "vLLM assumption: on CPU each step's output is processed before the next step is scheduled"
    )
    return scheduler


def make_request(
    req_id: str, num_tokens: int, max_tokens: int, seed: int, kv_transfer_params: dict[str, Any] | None = None
) -> Request:
    rng = random.Random(seed)
    request = Request(
        request_id=req_id,
        prompt_token_ids=[rng.randrange(5, vp.VOCAB) for _ in range(num_tokens)],
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        block_hasher=get_request_block_hasher(B, sha256),
    )
    request.kv_transfer_params = kv_transfer_params
    return request


def announcement(prefix_tokens: int) -> dict[str, Any]:
    """``kv_transfer_params`` as a producer announces a saved prefix."""
    return {
        PARAMS_KEY: {
            "prefix_tokens": prefix_tokens,
            "host": "127.0.0.1",
            "port": PRODUCER_PORT,
            "engine_id": "prefill-0",
            "tp_size": 1,
        }
    }


def worker_output(
    scheduler: Scheduler,
    step: SchedulerOutput,
    *,
    finished_sending: Iterable[str] = (),
    finished_recving: Iterable[str] = (),
    invalid_block_ids: Iterable[int] = (),
    saved: Iterable[str] = (),
    failed: Iterable[str] = (),
) -> ModelRunnerOutput:
    """What the workers answer for ``step``: one token per request whose prompt is complete (none
    for a partial prefill chunk), and the connector's outcomes, as one TP rank reports them."""
    req_ids = list(step.num_scheduled_tokens)
    sampled = [
        [TOKEN] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else []
        for r in req_ids
    ]
    saved, failed = set(saved), set(failed)
    kv_output = KVConnectorOutput(
        finished_sending=set(finished_sending) or None,
        finished_recving=set(finished_recving) or None,
        invalid_block_ids=set(invalid_block_ids),
        kv_connector_worker_meta=KVBridgeWorkerMetadata.of_one_worker(saved, failed) if saved or failed else None,
    )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_output,
    )


class HookLog:
    """Records, in order, the connector hooks vLLM calls, with their arguments and answers."""

    def __init__(self, connector: KVBridgeConnector) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], Any]] = []
        for name in HOOKS:
            setattr(connector, name, self._recording(name, getattr(connector, name)))

    def _recording(self, name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            result = hook(*args)
            self.calls.append((name, args, result))
            return result

        return call

    def take(self) -> list[tuple[str, tuple[Any, ...], Any]]:
        calls, self.calls = self.calls, []
        return calls

    @staticmethod
    def names(calls: list[tuple[str, tuple[Any, ...], Any]]) -> list[str]:
        return [name for name, _, _ in calls]


def metadata(step: SchedulerOutput) -> KVBridgeMetadata:
    meta = step.kv_connector_metadata
    assert isinstance(meta, KVBridgeMetadata), (
        f"vLLM assumption: schedule() puts build_connector_meta's answer into SchedulerOutput."
        f"kv_connector_metadata (got {type(meta).__name__})"
    )
    return meta


def scheduler_side(scheduler: Scheduler) -> SchedulerSide:
    side = scheduler.connector._scheduler
    assert side is not None
    return side


def block_ids(scheduler: Scheduler, req_id: str) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(req_id)[0])


def free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def assert_all_freed(scheduler: Scheduler) -> None:
    """vLLM holds no request and no block, and the connector remembers nothing."""
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    assert not scheduler.finished_recving_kv_req_ids
    assert free_blocks(scheduler) == scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1  # the null block
    left = {
        name: value
        for name, value in vars(scheduler_side(scheduler)).items()
        if isinstance(value, dict | list | set) and value
    }
    assert not left, f"the connector's scheduler side still holds {left}"


def run_to_end(scheduler: Scheduler, max_steps: int = 40) -> None:
    """Step until no request is left, the workers reporting every finished request at once."""
    for _ in range(max_steps):
        if not scheduler.requests:
            return
        step = scheduler.schedule()
        meta = metadata(step)
        scheduler.update_from_output(
            step, worker_output(scheduler, step, finished_sending=meta.held, saved=[save.req_id for save in meta.saves])
        )
    raise AssertionError(f"requests left after {max_steps} steps: {list(scheduler.requests)}")


# ---------------------------------------------------------------------- producer


def test_producer_announces_the_saved_prefix_and_keeps_blocks_until_finished_sending(model_config: ModelConfig) -> None:
    scheduler = make_scheduler(model_config, "kv_producer")
    log = HookLog(scheduler.connector)
    request = make_request("p-1", num_tokens=3 * B + 5, max_tokens=1, seed=1)
    prefix = transfer_prefix_len(request.num_prompt_tokens, B)
    scheduler.add_request(request)

    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"p-1": request.num_prompt_tokens}
    blocks = block_ids(scheduler, "p-1")
    assert metadata(step).saves == [
        SaveSpec(req_id="p-1", token_ids=request.prompt_token_ids[:prefix], block_ids=blocks[: prefix // B])
    ]
    log.take()

    outputs = scheduler.update_from_output(step, worker_output(scheduler, step, saved=["p-1"]))
    calls = log.take()
    assert HookLog.names(calls) == ["request_finished", "update_connector_output"], (
        "vLLM assumption: update_from_output calls request_finished for a request that finishes in "
        f"this step before it hands the step's worker outcomes to update_connector_output (got {calls})"
    )
    delay_free, params = calls[0][2]
    assert delay_free, "request_finished must have vLLM keep the blocks the workers were asked to save"
    engine_id = scheduler.vllm_config.kv_transfer_config.engine_id
    assert params == {PARAMS_KEY: {**announcement(prefix)[PARAMS_KEY], "engine_id": engine_id}}
    (output,) = outputs[0].outputs
    assert output.finished and output.kv_transfer_params == params, (
        "vLLM assumption: the kv_transfer_params request_finished returned leave the engine core "
        "after update_connector_output ran (the announcement is completed in place)"
    )
    assert output.kv_transfer_params[PARAMS_KEY]["prefix_tokens"] == prefix

    assert "p-1" in scheduler.requests and set(block_ids(scheduler, "p-1")) == set(blocks), (
        "vLLM assumption: delay_free=True from request_finished keeps the request's blocks"
    )
    step = scheduler.schedule()
    assert metadata(step).held == ["p-1"]
    assert "p-1" in step.finished_req_ids
    scheduler.update_from_output(step, worker_output(scheduler, step))
    assert "p-1" in scheduler.requests, "vLLM freed a delayed request's blocks before finished_sending"
    step = scheduler.schedule()
    scheduler.update_from_output(step, worker_output(scheduler, step, finished_sending=["p-1"]))
    assert_all_freed(scheduler)


def test_producer_announces_nothing_when_the_save_failed(model_config: ModelConfig) -> None:
    scheduler = make_scheduler(model_config, "kv_producer")
    log = HookLog(scheduler.connector)
    scheduler.add_request(make_request("p-2", num_tokens=2 * B + 1, max_tokens=1, seed=2))
    step = scheduler.schedule()
    assert [s.req_id for s in metadata(step).saves] == ["p-2"]
    log.take()
    outputs = scheduler.update_from_output(step, worker_output(scheduler, step, failed=["p-2"]))
    calls = log.take()
    assert HookLog.names(calls) == ["request_finished", "update_connector_output"]
    (output,) = outputs[0].outputs
    assert output.kv_transfer_params[PARAMS_KEY]["prefix_tokens"] == 0, "a failed save is announced as nothing"
    assert calls[0][2][0], "blocks handed to the workers are kept until they report finished sending"
    run_to_end(scheduler)
    assert_all_freed(scheduler)


def test_chunked_prompt_is_saved_in_the_step_that_completes_its_prefix(model_config: ModelConfig) -> None:
    scheduler = make_scheduler(model_config, "kv_producer")
    budget = scheduler.scheduler_config.max_num_batched_tokens
    request = make_request("p-3", num_tokens=budget + B + 7, max_tokens=1, seed=7)
    prefix = transfer_prefix_len(request.num_prompt_tokens, B)
    assert prefix > budget
    scheduler.add_request(request)
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"p-3": budget}, "vLLM assumption: a long prompt is prefilled in chunks"
    assert not metadata(step).saves, "a chunk that ends before the transfer prefix saves nothing"
    scheduler.update_from_output(step, worker_output(scheduler, step))
    step = scheduler.schedule()
    cached = step.scheduled_cached_reqs
    assert list(cached.req_ids) == ["p-3"] and list(cached.num_computed_tokens) == [budget], (
        "vLLM assumption: the next chunk's request is in scheduled_cached_reqs with the tokens computed so far"
    )
    assert metadata(step).saves == [
        SaveSpec(
            req_id="p-3",
            token_ids=request.prompt_token_ids[:prefix],
            block_ids=block_ids(scheduler, "p-3")[: prefix // B],
        )
    ]
    scheduler.update_from_output(step, worker_output(scheduler, step, saved=["p-3"]))
    run_to_end(scheduler)
    assert_all_freed(scheduler)


def test_preempted_saved_request_is_taken_back_in_the_step_that_frees_its_blocks(model_config: ModelConfig) -> None:
    # 8 blocks (7 usable): two prompts of 2 blocks + 1 token take 3 blocks each, and each needs a
    # 4th one 2 blocks later: the KV cache is too small for both, and vLLM preempts one.
    scheduler = make_scheduler(model_config, "kv_producer", num_blocks=8)
    requests = [make_request(f"p-{i}", num_tokens=2 * B + 1, max_tokens=2 * B, seed=10 + i) for i in range(2)]
    for request in requests:
        scheduler.add_request(request)
    step = scheduler.schedule()
    assert sorted(s.req_id for s in metadata(step).saves) == ["p-0", "p-1"]
    scheduler.update_from_output(step, worker_output(scheduler, step, saved=["p-0", "p-1"]))

    preempted: set[str] = set()
    for _ in range(2 * B):
        step = scheduler.schedule()
        preempted = set(step.preempted_req_ids or ())
        if preempted:
            break
        scheduler.update_from_output(step, worker_output(scheduler, step))
    assert preempted, "vLLM assumption: a KV cache too small for both requests makes schedule() preempt one"
    victim = next(iter(preempted))
    assert scheduler.requests[victim].status == RequestStatus.PREEMPTED
    assert metadata(step).take_back == [victim], (
        "vLLM assumption: SchedulerOutput.preempted_req_ids of the step whose forward pass may write the "
        "preempted request's freed blocks names it, and build_connector_meta sees it"
    )
    assert not metadata(step).saves
    scheduler.update_from_output(step, worker_output(scheduler, step))

    # Once recomputed from its new blocks, the preempted request is saved again.
    saves: list[SaveSpec] = []
    held: list[str] = []
    for _ in range(4 * B):
        step = scheduler.schedule()
        saves = [s for s in metadata(step).saves if s.req_id == victim]
        if saves:
            break
        scheduler.update_from_output(step, worker_output(scheduler, step, finished_sending=held))
        held = metadata(step).held
    assert saves, f"{victim} was not saved again after its preemption"
    assert saves[0].block_ids == block_ids(scheduler, victim)[:2]
    scheduler.update_from_output(step, worker_output(scheduler, step, finished_sending=held, saved=[victim]))
    run_to_end(scheduler, max_steps=4 * B)
    assert_all_freed(scheduler)


# ---------------------------------------------------------------------- consumer


def schedule_claimed_load(scheduler: Scheduler, request: Request) -> tuple[SchedulerOutput, LoadSpec]:
    """Add ``request`` (announced by its producer) and schedule: vLLM allocates its blocks, the
    connector plans its load, and the request waits for it."""
    log = HookLog(scheduler.connector)
    prefix = transfer_prefix_len(request.num_prompt_tokens, B)
    scheduler.add_request(request)
    step = scheduler.schedule()
    calls = log.take()
    assert HookLog.names(calls) == ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta"], (
        "vLLM assumption: schedule() asks get_num_new_matched_tokens, allocates, calls "
        f"update_state_after_alloc, then build_connector_meta (got {HookLog.names(calls)})"
    )
    assert calls[0][2] == (prefix, True), "the connector claims the whole prefix, loaded asynchronously"
    assert calls[1][1][2] == prefix, "vLLM assumption: update_state_after_alloc gets the claimed tokens"
    assert request.request_id not in step.num_scheduled_tokens
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS, (
        "vLLM assumption: an asynchronous claim parks the request in WAITING_FOR_REMOTE_KVS"
    )
    blocks = block_ids(scheduler, request.request_id)
    (load,) = metadata(step).loads
    assert load == LoadSpec(
        req_id=request.request_id,
        token_ids=request.prompt_token_ids[:prefix],
        block_ids=blocks[: prefix // B],
        skip_blocks=0,
        wait=True,
        producer=("127.0.0.1", PRODUCER_PORT),
        producer_tp=1,
    )
    return step, load


def test_consumer_request_waits_for_remote_kvs_until_finished_recving(model_config: ModelConfig) -> None:
    scheduler = make_scheduler(model_config, "kv_consumer")
    request = make_request("d-1", num_tokens=3 * B + 5, max_tokens=3, seed=3, kv_transfer_params=announcement(3 * B))
    step, load = schedule_claimed_load(scheduler, request)
    scheduler.update_from_output(step, worker_output(scheduler, step))

    step = scheduler.schedule()  # the load is still running
    assert not step.num_scheduled_tokens and not metadata(step).loads
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    scheduler.update_from_output(step, worker_output(scheduler, step, finished_recving=["d-1"]))

    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"d-1": request.num_prompt_tokens - 3 * B}, (
        "vLLM assumption: after finished_recving the request runs with the loaded prefix computed"
    )
    assert request.status == RequestStatus.RUNNING
    assert block_ids(scheduler, "d-1")[:3] == load.block_ids, "vLLM moved the blocks the load wrote"
    assert not metadata(step).loads
    scheduler.update_from_output(step, worker_output(scheduler, step))
    run_to_end(scheduler)
    assert_all_freed(scheduler)


def test_claim_that_finds_no_free_blocks_is_asked_again_and_loaded_once(model_config: ModelConfig) -> None:
    # 6 blocks (5 usable): the first request takes 4, the second one needs 4 as well.
    scheduler = make_scheduler(model_config, "kv_consumer", num_blocks=6)
    first = make_request("d-8", num_tokens=3 * B + 5, max_tokens=2, seed=10, kv_transfer_params=announcement(3 * B))
    step, _ = schedule_claimed_load(scheduler, first)
    scheduler.update_from_output(step, worker_output(scheduler, step, finished_recving=["d-8"]))
    log = HookLog(scheduler.connector)
    request = make_request("d-9", num_tokens=3 * B + 5, max_tokens=2, seed=11, kv_transfer_params=announcement(3 * B))
    scheduler.add_request(request)
    loads: list[LoadSpec] = []
    for _ in range(4):
        step = scheduler.schedule()
        loads += metadata(step).loads
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
        assert request.status == RequestStatus.WAITING
        scheduler.update_from_output(step, worker_output(scheduler, step))
    calls = [name for name, args, _ in log.take() if args and getattr(args[0], "request_id", None) == "d-9"]
    assert calls.count("get_num_new_matched_tokens") > 1 and calls.count("update_state_after_alloc") == 1, (
        "vLLM assumption: a claim whose blocks cannot be allocated gets no update_state_after_alloc and "
        f"is asked again in a later step (got {calls})"
    )
    assert [load.req_id for load in loads] == ["d-9"]
    assert loads[0].block_ids == block_ids(scheduler, "d-9")[:3]
    scheduler.update_from_output(step, worker_output(scheduler, step, finished_recving=["d-9"]))
    run_to_end(scheduler)
    assert_all_freed(scheduler)


@pytest.mark.parametrize("failed_block", [0, 2])
def test_failed_load_is_recomputed_and_not_loaded_again(model_config: ModelConfig, failed_block: int) -> None:
    scheduler = make_scheduler(model_config, "kv_consumer", failure_policy="recompute")
    request = make_request("d-2", num_tokens=3 * B + 5, max_tokens=2, seed=4, kv_transfer_params=announcement(3 * B))
    step, load = schedule_claimed_load(scheduler, request)
    log = HookLog(scheduler.connector)
    # The worker reports the request finished receiving, the blocks from the failed one on failed.
    scheduler.update_from_output(
        step, worker_output(scheduler, step, finished_recving=["d-2"], invalid_block_ids=load.block_ids[failed_block:])
    )
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    step = scheduler.schedule()
    valid = failed_block * B
    assert step.num_scheduled_tokens == {"d-2": request.num_prompt_tokens - valid}, (
        "vLLM assumption: under kv_load_failure_policy=recompute the request runs, recomputing from "
        "its first invalid block"
    )
    asked = [result for name, _, result in log.take() if name == "get_num_new_matched_tokens"]
    assert all(result == (0, False) for result in asked), f"a request is loaded at most once (asked: {asked})"
    assert not metadata(step).loads
    scheduler.update_from_output(step, worker_output(scheduler, step))
    run_to_end(scheduler)
    assert_all_freed(scheduler)


def test_failed_load_fails_the_request_under_policy_fail(model_config: ModelConfig) -> None:
    scheduler = make_scheduler(model_config, "kv_consumer", failure_policy="fail")
    request = make_request("d-7", num_tokens=3 * B + 5, max_tokens=2, seed=9, kv_transfer_params=announcement(3 * B))
    step, load = schedule_claimed_load(scheduler, request)
    outputs = scheduler.update_from_output(
        step, worker_output(scheduler, step, finished_recving=["d-7"], invalid_block_ids=load.block_ids)
    )
    (output,) = outputs[0].outputs
    assert output.finished and request.status == RequestStatus.FINISHED_ERROR, (
        "vLLM assumption: under kv_load_failure_policy=fail a failed load ends the request with an error"
    )
    assert_all_freed(scheduler)


def test_aborted_request_waiting_for_its_load_frees_everything(model_config: ModelConfig) -> None:
    scheduler = make_scheduler(model_config, "kv_consumer")
    request = make_request("d-3", num_tokens=2 * B + 3, max_tokens=4, seed=5, kv_transfer_params=announcement(2 * B))
    step, _ = schedule_claimed_load(scheduler, request)
    scheduler.update_from_output(step, worker_output(scheduler, step))
    log = HookLog(scheduler.connector)

    scheduler.finish_requests("d-3", RequestStatus.FINISHED_ABORTED)
    calls = log.take()
    assert [(name, result) for name, _, result in calls] == [("request_finished", (False, None))]
    assert "d-3" in scheduler.requests, (
        "vLLM assumption: an aborted request waiting for its load keeps its blocks until the worker "
        "reports it finished receiving (the load may still write them)"
    )
    step = scheduler.schedule()
    assert "d-3" in step.finished_req_ids, (
        "vLLM assumption: the next SchedulerOutput lists the aborted request in finished_req_ids "
        "(the worker stops its load on it)"
    )
    assert not metadata(step).loads
    scheduler.update_from_output(step, worker_output(scheduler, step, finished_recving=["d-3"]))
    assert_all_freed(scheduler)


def test_aborted_request_before_its_load_drains_the_announced_entry(model_config: ModelConfig) -> None:
    scheduler = make_scheduler(model_config, "kv_consumer")
    request = make_request("d-4", num_tokens=2 * B + 3, max_tokens=4, seed=6, kv_transfer_params=announcement(2 * B))
    scheduler.add_request(request)
    scheduler.finish_requests("d-4", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.requests, "vLLM assumption: a request aborted before it was scheduled holds nothing"
    step = scheduler.schedule()
    assert metadata(step).loads == [
        LoadSpec(
            req_id="d-4",
            token_ids=request.prompt_token_ids[: 2 * B],
            block_ids=[],
            skip_blocks=0,
            producer=("127.0.0.1", PRODUCER_PORT),
            producer_tp=1,
        )
    ]
    scheduler.update_from_output(step, worker_output(scheduler, step))
    assert_all_freed(scheduler)


def test_prefix_in_the_local_cache_is_drained_not_loaded(model_config: ModelConfig) -> None:
    scheduler = make_scheduler(model_config, "kv_consumer")
    first = make_request("d-5", num_tokens=3 * B + 5, max_tokens=2, seed=8, kv_transfer_params=announcement(3 * B))
    step, _ = schedule_claimed_load(scheduler, first)
    scheduler.update_from_output(step, worker_output(scheduler, step, finished_recving=["d-5"]))
    run_to_end(scheduler)

    # The same prompt again: vLLM's prefix cache holds the loaded blocks.
    again = make_request("d-6", num_tokens=3 * B + 5, max_tokens=2, seed=8, kv_transfer_params=announcement(3 * B))
    log = HookLog(scheduler.connector)
    scheduler.add_request(again)
    step = scheduler.schedule()
    (asked,) = [args for name, args, _ in log.take() if name == "get_num_new_matched_tokens"]
    assert asked[1] == 3 * B, (
        "vLLM assumption: get_num_new_matched_tokens gets the block-aligned local prefix-cache hit"
    )
    assert step.num_scheduled_tokens == {"d-6": again.num_prompt_tokens - 3 * B}
    assert [new.req_id for new in step.scheduled_new_reqs] == ["d-6"], (
        "vLLM assumption: build_connector_meta sees the request in scheduled_new_reqs of the step that "
        "asked get_num_new_matched_tokens"
    )
    assert metadata(step).loads == [
        LoadSpec(
            req_id="d-6",
            token_ids=again.prompt_token_ids[: 3 * B],
            block_ids=block_ids(scheduler, "d-6")[:3],
            skip_blocks=3,
            producer=("127.0.0.1", PRODUCER_PORT),
            producer_tp=1,
        )
    ]
    scheduler.update_from_output(step, worker_output(scheduler, step))
    run_to_end(scheduler)
    assert_all_freed(scheduler)


# ---------------------------------------------------------------------- producer worker and scheduler


def producer_worker(num_blocks: int, budget: int, lend: bool = False) -> tuple[WorkerSide, list[torch.Tensor]]:
    """A producer's worker over random caches of ``num_blocks`` blocks, its listener on a free port,
    copying its saves into a lookup buffer of ``budget`` bytes (evicting the oldest when full), or
    with ``lend`` lending them where they lie."""
    generator = torch.Generator().manual_seed(3)
    caches = [torch.randn((num_blocks, 4, B, 128), generator=generator) for _ in range(2)]
    if lend:
        caches = [page_aligned_empty(cache.shape, cache.dtype).copy_(cache) for cache in caches]
    settings = ConnectorSettings.from_vllm(
        "kv_producer", free_port(), "cpu", {"kv_ip": "127.0.0.1", "kv_buffer_size": budget, "kv_lend_blocks": lend}
    )
    identity = compat.KVLayoutInfo(
        version=compat.VERSION,
        role="kv_producer",
        model="fake",
        dtype="",
        block_size=B,
        num_layers=0,
        block_shape=(),
        layout="",
        tp_size=1,
        tp_rank=0,
    )
    worker = WorkerSide(settings, identity, port_offset=0)
    worker.connect(caches, find_layout(caches[0], num_blocks, B, "CPU_ATTN/fake"))
    return worker, caches


def step_with_workers(scheduler: Scheduler, *workers: WorkerSide) -> tuple[SchedulerOutput, list[Any], list[set[str]]]:
    """One engine step whose connector outcomes come from real producer workers, one per TP rank,
    each through the connector's worker hooks as vLLM's model runner calls them; returns the step,
    its request outputs and the requests each rank reported finished sending. vLLM takes a request
    as finished sending once every rank has reported it; here every rank is expected to in one step."""
    step = scheduler.schedule()
    meta = metadata(step)
    sending: list[set[str]] = []
    outcomes: KVBridgeWorkerMetadata | None = None
    for worker in workers:
        connector = bare_connector(worker)
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(None)
        connector.wait_for_save()
        sending.append(connector.get_finished(set())[0] or set())
        rank = connector.build_connector_worker_meta()
        if rank is not None:
            outcomes = rank if outcomes is None else outcomes.aggregate(rank)
        connector.clear_connector_metadata()
    req_ids = list(step.num_scheduled_tokens)
    sampled = [
        [TOKEN] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else []
        for r in req_ids
    ]
    kv_output = KVConnectorOutput(
        finished_sending=set.intersection(*sending) or None, kv_connector_worker_meta=outcomes
    )
    output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_output,
    )
    outputs = scheduler.update_from_output(step, output)
    return step, [out for engine in outputs.values() for out in engine.outputs], sending


def announced_until_done(scheduler: Scheduler, *workers: WorkerSide, max_steps: int = 8) -> dict[str, int]:
    """Step with the workers until no request is left; the prefix each finished request announced."""
    finished: dict[str, int] = {}
    for _ in range(max_steps):
        _, outputs, _ = step_with_workers(scheduler, *workers)
        finished |= {
            out.request_id: out.kv_transfer_params[PARAMS_KEY]["prefix_tokens"] for out in outputs if out.finished
        }
        if not scheduler.requests:
            return finished
    raise AssertionError(f"requests left after {max_steps} steps: {list(scheduler.requests)}")


def test_producer_announces_nothing_for_a_copy_evicted_before_its_request_finished(model_config: ModelConfig) -> None:
    # An entry of 2 blocks is 2 layers x 2 blocks x 64 KiB: the buffer holds one, not two.
    scheduler = make_scheduler(model_config, "kv_producer", num_blocks=16)
    worker, _ = producer_worker(num_blocks=16, budget=400_000)
    try:
        early = make_request("p-early", num_tokens=2 * B + 5, max_tokens=3, seed=21)  # decodes two more steps
        late = make_request("p-late", num_tokens=2 * B + 9, max_tokens=1, seed=22)
        scheduler.add_request(early)
        step, _, _ = step_with_workers(scheduler, worker)
        assert [save.req_id for save in metadata(step).saves] == ["p-early"]
        assert worker.buffer_stats().entries == 1

        scheduler.add_request(late)
        step, outputs, _ = step_with_workers(scheduler, worker)  # saving p-late evicts p-early's copy
        assert [save.req_id for save in metadata(step).saves] == ["p-late"]
        assert (worker.buffer_stats().entries, worker.buffer_stats().evicted) == (1, 1)
        announced = {
            out.request_id: out.kv_transfer_params[PARAMS_KEY]["prefix_tokens"] for out in outputs if out.finished
        }
        assert announced == {"p-late": 2 * B}

        finished = announced_until_done(scheduler, worker)
        assert finished == {"p-early": 0}, "the decode instance must not be sent to an entry that is gone"
        assert_all_freed(scheduler)
        assert worker.take_gone() == set()
    finally:
        worker.close()


def test_a_lent_entry_that_expires_while_its_request_still_generates_is_announced_as_nothing(
    model_config: ModelConfig,
) -> None:
    scheduler = make_scheduler(model_config, "kv_producer", num_blocks=16)
    worker, _ = producer_worker(num_blocks=16, budget=1 << 20, lend=True)
    try:
        scheduler.add_request(make_request("p-long", num_tokens=2 * B + 5, max_tokens=4, seed=41))
        step, _, _ = step_with_workers(scheduler, worker)
        assert [save.req_id for save in metadata(step).saves] == ["p-long"]
        (loan,) = worker._kept.values()
        assert loan is not None and loan.outcome is None  # lent where it lies
        # kv_entry_timeout counts from the save: it runs out while the request still generates.
        assert worker._buffer._store.expire(now=time.monotonic() + 10 * 480.0)[0] == 1
        assert loan.outcome == EXPIRED
        finished = announced_until_done(scheduler, worker)
        assert finished == {"p-long": 0}, "the decode instance must not be sent to an entry that is gone"
        assert_all_freed(scheduler)
        assert worker.take_gone() == set()
    finally:
        worker.close()


def test_a_copy_taken_before_its_request_finished_is_reported_gone_once_and_saved_again_after_a_preemption() -> None:
    worker, caches = producer_worker(num_blocks=8, budget=1 << 20)
    try:
        tokens = list(range(100, 100 + 2 * B))
        worker.save([SaveSpec("r", tokens, [3, 5])])
        assert worker.take_save_outcomes() == ({"r"}, set())
        listener = worker._buffer
        assert isinstance(listener, BufferListener)
        # Another consumer takes it (drained, or a duplicate prompt's decode): the store pops it.
        store = listener._store
        key = MatchKey(np.asarray(tokens, dtype=np.int64), np.ones(len(tokens), dtype=bool))
        entry = store.pop(key)
        assert entry is not None  # the key: (layer, block, ...) of the saved blocks
        assert torch.equal(entry.items[1][0, 0], caches[0][3]) and torch.equal(entry.items[1][1, 1], caches[1][5])
        assert worker.take_gone() == {"r"}
        assert worker.take_gone() == set()  # once
        # Preempted, recomputed and saved again: the copy is gone, so a new one is inserted.
        worker.take_back(["r"])
        worker.save([SaveSpec("r", tokens, [6, 2])])
        assert worker.take_save_outcomes() == ({"r"}, set())
        assert worker.buffer_stats().entries == 1
        again = store.pop(key)
        assert again is not None
        assert torch.equal(again.items[1][0, 0], caches[0][6]) and torch.equal(again.items[1][1, 1], caches[1][2])
        assert worker.take_gone() == {"r"}
    finally:
        worker.close()


def prefix_key(token_ids: list[int]) -> MatchKey:
    """The match key a producer worker stores a copy of these tokens under."""
    return MatchKey(np.asarray(token_ids, dtype=np.int64), np.ones(len(token_ids), dtype=bool))


def test_a_request_one_of_two_tp_ranks_saved_by_a_copy_leaves_no_copy_behind(model_config: ModelConfig) -> None:
    scheduler = make_scheduler(model_config, "kv_producer", num_blocks=16)
    scheduler_side(scheduler).num_workers = 2  # two TP ranks: saved only once both saved their share
    copying, _ = producer_worker(num_blocks=16, budget=1 << 20)
    full, _ = producer_worker(num_blocks=16, budget=1 << 16)  # less than one entry: its save fails at once
    try:
        request = make_request("p", num_tokens=2 * B + 5, max_tokens=1, seed=31)
        scheduler.add_request(request)
        step, outputs, sending = step_with_workers(scheduler, copying, full)
        assert [save.req_id for save in metadata(step).saves] == ["p"]
        assert (copying.buffer_stats().entries, full.buffer_stats().rejected) == (1, 1)
        assert [(out.request_id, out.kv_transfer_params[PARAMS_KEY]["prefix_tokens"]) for out in outputs] == [("p", 0)]
        assert sending == [set(), set()]

        step, _, sending = step_with_workers(scheduler, copying, full)
        meta = metadata(step)
        assert (meta.withdraw, meta.take_back, meta.held) == (["p"], [], ["p"])
        assert sending == [{"p"}, {"p"}]
        buffer = copying.buffer_stats()
        assert (buffer.entries, buffer.bytes, buffer.expired, buffer.evicted) == (0, 0, 0, 0)
        store = copying._buffer._store
        key = prefix_key(request.prompt_token_ids[: 2 * B])
        assert store.pop(key) is None and store.gone(key)  # a select for it would miss at once
        assert (copying.take_gone(), full.take_gone()) == (set(), set())  # withdrawn, not lost
        assert [worker.total_stats().data["taken_back"] for worker in (copying, full)] == [1, 0]
        assert not copying._copied and not copying._copy_keys and not copying._withdrawing
        assert_all_freed(scheduler)
    finally:
        copying.close()
        full.close()


def test_a_withdrawn_request_gives_up_its_place_among_copies_of_the_same_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, _ = producer_worker(num_blocks=16, budget=4 << 20)
    try:
        tokens = list(range(300, 300 + 2 * B))
        names = ["a", "b", "c", "d"]  # the same prompt four times: four copies under one key
        worker.save([SaveSpec(name, tokens, [2 * index + 1, 2 * index + 2]) for index, name in enumerate(names)])
        assert worker.take_save_outcomes() == (set(names), set())
        store, key = worker._buffer._store, prefix_key(tokens)
        worker.take_back([], withdraw=["b"])
        assert worker.buffer_stats().entries == 3 and worker.take_gone() == set()
        worker.take_back(["d"])  # preempted: its copy stays for its next save
        assert worker.buffer_stats().entries == 3

        withdraw_copy = store.withdraw_copy

        def select_comes_first(at: MatchKey) -> bool:
            assert store.pop(at) is not None  # a select takes the oldest copy between the two steps
            return withdraw_copy(at)

        monkeypatch.setattr(store, "withdraw_copy", select_comes_first)
        worker.take_back([], withdraw=["a"])
        # Two copies left: the select's departure stood for the withdrawal, the withdrawal's for the
        # oldest request still there.
        assert worker.buffer_stats().entries == 1 and worker.take_gone() == {"c"}
        worker.hold(names)
        assert worker.take_finished_sending() == set(names)
        assert store.pop(key) is not None and worker.take_gone() == set()  # "d", finished: nothing to report
        assert worker.total_stats().data["taken_back"] == 2
        assert not worker._copied and not worker._copy_keys and not worker._withdrawing
    finally:
        worker.close()


def test_a_withdrawn_request_whose_copy_a_select_split_takes_its_parts_out_and_whole_copies_stay() -> None:
    worker, caches = producer_worker(num_blocks=16, budget=4 << 20)
    try:
        tokens = list(range(500, 500 + 2 * B))
        names = ["x", "r", "y"]  # the same prompt three times: three copies under one key
        worker.save([SaveSpec(name, tokens, [2 * index + 1, 2 * index + 2]) for index, name in enumerate(names)])
        assert worker.take_save_outcomes() == (set(names), set())
        store, key = worker._buffer._store, prefix_key(tokens)
        whole_bytes = store.counters().bytes // 3
        # A decode rank of an instance with more TP ranks takes heads 1 of 4 of the oldest copy, x's:
        # the copy is split, and x, still running, is reported gone.
        part = store.pop_part(key, (2, 1, 2))
        assert part is not None and torch.equal(part.items[1][0, 0], caches[0][1][1:2])
        assert worker.take_gone() == {"x"}
        assert store.counters().entries == 3 + 2  # x's other three parts, r's and y's copies
        # r is withdrawn: a whole copy leaves, x's parts stay.
        worker.take_back([], withdraw=["r"])
        assert store.counters().entries == 3 + 1 and worker.take_gone() == set()
        # x is withdrawn (announced with 0 tokens): its parts leave at once, y's copy stays.
        parts_bytes = store.counters().bytes - whole_bytes
        worker.take_back([], withdraw=["x"])
        left = store.counters()
        assert (left.entries, left.bytes) == (1, whole_bytes) and parts_bytes > 0
        assert store.gone(key) and worker.take_gone() == set()
        assert worker.total_stats().data["taken_back"] == 2
        worker.hold(names)
        assert worker.take_finished_sending() == set(names)
        last = store.pop(key)  # y's copy, whole
        assert last is not None and torch.equal(last.items[1][1, 1], caches[1][6])
        assert worker.take_gone() == set()  # y finished: nothing to report
        assert not worker._copied and not worker._copy_keys and not worker._withdrawing and not worker._split
    finally:
        worker.close()
