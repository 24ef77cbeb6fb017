"""A store's save copies its blocks out in a gather thread while vLLM keeps them: the blocks are
overwritten right after each step here, as vLLM may once it frees them or preempts the request, and
every stored object must still hold the original bits."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams
from vllm.config import ModelConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from connector.paged import gather_blocks
from connector.vllm_store import SAVE_QUEUE_DEPTH, StoreSave, StoreScheduler, StoreSettings, StoreWorker
from connector.vllm_store_connector import KVBridgeStoreConnector
from connector.vllm_worker import find_layout
from harness import vllm_procs as vp
from harness.store_gathers import WAIT, GatherGate, hold_gathers, stored_chunks
from harness.vllm_fakes import make_request, new_req_data, scheduler_output
from harness.vllm_scheduler import make_scheduler, tiny_model_config

FB = vp.FAKE_BLOCK_SIZE
CHUNK = 2 * FB


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatherGate]:
    held = hold_gathers(monkeypatch)
    yield held
    held.opened.set()  # a failed test leaves no gather waiting


def _worker(path: Path, caches: list[torch.Tensor]) -> StoreWorker:
    settings = StoreSettings.from_extra({"kv_store": {"tiers": f"disk:{path}", "chunk_size": CHUNK}}, environ={})
    worker = StoreWorker(settings, vp.store_identity(len(caches), FB))
    worker.register(caches, find_layout(caches[0], vp.FAKE_BLOCKS, FB, "CPU_ATTN/vec"), "CPU_ATTN/vec")
    return worker


def _tokens(start: int, chunks: int = 2) -> list[int]:
    return list(range(start, start + chunks * CHUNK))


def _overwrite(caches: list[torch.Tensor], block_ids: list[int]) -> None:
    """What vLLM may do to freed or preempted blocks: write another request's KV into them."""
    for cache in caches:
        cache[block_ids] = torch.randn_like(cache[block_ids]) - 7.0


def _stored_chunks(worker: StoreWorker, tokens: list[int]) -> list[torch.Tensor | None]:
    return stored_chunks(worker, tokens, CHUNK)


def _assert_stored(worker: StoreWorker, tokens: list[int], original: list[torch.Tensor], block_ids: list[int]) -> None:
    layout = worker._require_caches().layout
    stored = _stored_chunks(worker, tokens)
    assert len(stored) == len(block_ids) // 2
    for index, chunk in enumerate(stored):
        expected = gather_blocks(original, layout, torch.tensor(block_ids[2 * index : 2 * index + 2]))
        assert chunk is not None and torch.equal(chunk, expected), f"chunk {index} differs from its blocks' bits"


def test_a_request_that_finishes_before_its_gather_is_reported_once_the_gather_is_done(
    tmp_path: Path, gate: GatherGate
) -> None:
    caches = vp.fake_caches(1)
    original = [cache.clone() for cache in caches]
    worker = _worker(tmp_path, caches)
    tokens, blocks = _tokens(10), [7, 2, 8, 4]
    worker.save([StoreSave("r", tokens, blocks, first_chunk=0)])
    assert gate.started.wait(WAIT)
    # vLLM finished the request (finished_req_ids of the next steps): its blocks stay until reported.
    assert worker.take_finished_sending({"r"}) == set()
    assert worker.take_finished_sending(set()) == set()
    assert worker.held_requests() == 1
    gate.opened.set()
    worker.flush()
    assert worker.take_finished_sending(set()) == {"r"}
    _overwrite(caches, blocks)  # vLLM frees the blocks and reuses them
    assert worker.take_finished_sending({"r"}) == set()  # reported once
    worker.flush()
    _assert_stored(worker, tokens, original, blocks)
    assert worker.held_requests() == 0
    worker.close()


def test_a_request_preempted_before_its_gather_started_stores_nothing_and_is_held_until_it_finishes(
    tmp_path: Path, gate: GatherGate
) -> None:
    caches = vp.fake_caches(2)
    original = [cache.clone() for cache in caches]
    worker = _worker(tmp_path, caches)
    first, second = (_tokens(10), [1, 3, 5, 7]), (_tokens(900), [8, 0, 6, 2])
    worker.save([StoreSave("a", *first, first_chunk=0), StoreSave("b", *second, first_chunk=0)])
    assert gate.started.wait(WAIT)  # a's gather is under way and held; b's waits behind it
    worker.preempt(["b"])  # returns at once: b's gather is cancelled
    _overwrite(caches, second[1])
    gate.opened.set()
    worker.flush()
    _assert_stored(worker, first[0], original, first[1])
    assert _stored_chunks(worker, second[0]) == [None, None]
    assert worker.stats().saves_dropped == 2
    assert worker.held_requests() == 2  # the preempted request is held again once rescheduled
    assert worker.take_finished_sending({"a", "b"}) == {"a", "b"}
    assert worker.held_requests() == 0
    worker.close()


def test_a_request_preempted_during_its_gather_is_waited_for_and_stored_whole(tmp_path: Path, gate: GatherGate) -> None:
    caches = vp.fake_caches(3)
    original = [cache.clone() for cache in caches]
    worker = _worker(tmp_path, caches)
    tokens, blocks = _tokens(40, chunks=3), [8, 1, 4, 6, 0, 3]
    worker.save([StoreSave("p", tokens, blocks, first_chunk=0)])
    assert gate.started.wait(WAIT)

    def open_later() -> None:
        time.sleep(0.2)  # ordering only: preempt is most likely waiting by then (if not, it finds the gather done)
        gate.opened.set()

    opener = threading.Thread(target=open_later)
    opener.start()
    worker.preempt(["p"])
    _overwrite(caches, blocks)  # handle_preemptions returned: vLLM writes the blocks
    opener.join(WAIT)
    worker.flush()
    _assert_stored(worker, tokens, original, blocks)
    assert worker.stats().saves_dropped == 0
    assert worker.take_finished_sending({"p"}) == {"p"}
    assert worker.held_requests() == 0
    worker.close()


def test_a_preempted_gather_not_done_within_the_wait_is_dropped(tmp_path: Path, gate: GatherGate) -> None:
    caches = vp.fake_caches(4)
    worker = _worker(tmp_path, caches)
    tokens, blocks = _tokens(70), [2, 5, 8, 1]
    worker.save([StoreSave("p", tokens, blocks, first_chunk=0)])
    assert gate.started.wait(WAIT)
    worker.preempt(["p"], timeout=0.0)
    _overwrite(caches, blocks)  # the gather may read these: its result must never be stored
    gate.opened.set()
    worker.flush()
    assert _stored_chunks(worker, tokens) == [None, None]
    assert worker.stats().saves_dropped == 2
    assert worker.take_finished_sending({"p"}) == {"p"}
    worker.close()


def test_an_aborted_request_keeps_its_blocks_until_its_gather_is_done(tmp_path: Path, gate: GatherGate) -> None:
    scheduler_settings = StoreSettings.from_extra(
        {"kv_store": {"tiers": f"disk:{tmp_path}", "chunk_size": CHUNK}}, environ={}
    )
    caches = vp.fake_caches(5)
    original = [cache.clone() for cache in caches]
    worker = _worker(tmp_path, caches)
    scheduler = StoreScheduler(scheduler_settings, FB, [worker.namespace], scheduler_settings.open())
    tokens, blocks = _tokens(300), [6, 4, 2, 0]
    request, idle = make_request("x", tokens + [1]), make_request("idle", _tokens(5000))
    for req in (request, idle):
        assert scheduler.num_new_matched_tokens(req, 0) == 0
    step = scheduler_output([new_req_data(request, blocks + [8], 0)], {"x": len(tokens) + 1})
    meta = scheduler.build_meta(step, lambda req_id: blocks + [8])
    assert meta.saves == [StoreSave("x", tokens, blocks, first_chunk=0)]
    worker.save(meta.saves)
    assert gate.started.wait(WAIT)
    # Aborted: vLLM asks whether to keep the blocks; the request saved keeps them, the other not.
    assert scheduler.request_finished(request) == (True, None)
    assert scheduler.request_finished(idle) == (False, None)
    assert scheduler.request_finished(request) == (False, None)  # forgotten: asked once
    assert worker.take_finished_sending({"x"}) == set()
    gate.opened.set()
    worker.flush()
    assert worker.take_finished_sending(set()) == {"x"}
    _overwrite(caches, blocks)
    _assert_stored(worker, tokens, original, blocks)
    assert worker.held_requests() == 0
    scheduler.store.close()
    worker.close()


def test_the_scheduler_tells_the_workers_only_the_preempted_requests_with_a_save(tmp_path: Path) -> None:
    settings = StoreSettings.from_extra({"kv_store": {"tiers": f"disk:{tmp_path}", "chunk_size": CHUNK}}, environ={})
    scheduler = StoreScheduler(settings, FB, [b"n" * 32], settings.open())
    saved, unsaved = (make_request(req_id, _tokens(7, chunks=1) + [1]) for req_id in ("s", "t"))
    for request in (saved, unsaved):
        assert scheduler.num_new_matched_tokens(request, 0) == 0
    step = scheduler_output([new_req_data(saved, [3, 5, 1], 0)], {"s": CHUNK + 1})
    first = scheduler.build_meta(step, lambda _: [3, 5, 1])
    assert [save.req_id for save in first.saves] == ["s"]
    later = scheduler_output([], {})
    later.preempted_req_ids = {"s", "t", "u"}
    assert scheduler.build_meta(later, lambda _: []).preempted == ["s"]
    scheduler.store.close()


def test_a_full_save_queue_drops_the_save_and_still_reports_the_request(tmp_path: Path, gate: GatherGate) -> None:
    caches = vp.fake_caches(6)
    worker = _worker(tmp_path, caches)
    specs = [
        StoreSave(f"q{i}", _tokens(100 * i, chunks=1), [i % 9, (i + 3) % 9], first_chunk=0)
        for i in range(SAVE_QUEUE_DEPTH + 1)
    ]
    worker.save(specs)
    assert gate.started.wait(WAIT)
    assert worker.stats().saves_dropped == 1  # the last one found the queue full
    assert worker.take_finished_sending({spec.req_id for spec in specs}) == {specs[-1].req_id}
    gate.opened.set()
    worker.flush()
    assert worker.take_finished_sending(set()) == {spec.req_id for spec in specs[:-1]}
    assert worker.held_requests() == 0
    assert worker.stats().chunks_saved == SAVE_QUEUE_DEPTH
    worker.close()


def test_closing_finishes_the_gathers_pending(tmp_path: Path, gate: GatherGate) -> None:
    caches = vp.fake_caches(7)
    original = [cache.clone() for cache in caches]
    worker = _worker(tmp_path, caches)
    tokens, blocks = _tokens(600), [3, 8, 5, 2]
    worker.save([StoreSave("c", tokens, blocks, first_chunk=0)])
    assert gate.started.wait(WAIT)
    gate.opened.set()
    worker.close()
    reader = _worker(tmp_path, vp.fake_caches(8))
    _assert_stored(reader, tokens, original, blocks)
    reader.close()


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return tiny_model_config(tmp_path_factory.mktemp("tiny-llama-store-saves"))


def test_vllm_frees_a_saved_requests_blocks_only_once_the_worker_reports_its_gather_done(
    model_config: ModelConfig, tmp_path: Path, gate: GatherGate
) -> None:
    """vLLM's own scheduler with the store connector, and a worker whose gather is held: the finished
    request's blocks stay allocated until the worker reports it finished sending."""
    scheduler: Scheduler = make_scheduler(
        model_config, "kv_both", extra={"kv_store": {"tiers": f"disk:{tmp_path}", "chunk_size": vp.BLOCK_SIZE}}
    )
    connector = scheduler.connector
    assert isinstance(connector, KVBridgeStoreConnector)
    caches = vp.fake_caches(11, block_size=vp.BLOCK_SIZE)
    worker = StoreWorker(connector._store_scheduler.settings, vp.store_identity(len(caches), vp.BLOCK_SIZE))
    worker.register(caches, find_layout(caches[0], vp.FAKE_BLOCKS, vp.BLOCK_SIZE, "CPU_ATTN/vec"), "CPU_ATTN/vec")
    connector.set_xfer_handshake_metadata_pp_aware({(0, 0): worker.handshake()})
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks
    free_at_start = free()
    request = Request(
        "r",
        list(range(40, 40 + 2 * vp.BLOCK_SIZE + 3)),
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(vp.BLOCK_SIZE, sha256),
    )
    scheduler.add_request(request)
    step = scheduler.schedule()
    saves = step.kv_connector_metadata.saves
    assert [(save.req_id, save.first_chunk, len(save.block_ids)) for save in saves] == [("r", 0, 2)]
    worker.save(saves)
    assert gate.started.wait(WAIT)

    def answer(step: SchedulerOutput, sending: set[str]) -> None:
        ids = list(step.num_scheduled_tokens)
        scheduler.update_from_output(
            step,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={req_id: i for i, req_id in enumerate(ids)},
                sampled_token_ids=[[7] for _ in ids],
                kv_connector_output=KVConnectorOutput(finished_sending=sending or None),
            ),
        )

    answer(step, set())  # the request is done (one token): its blocks are kept
    assert request.is_finished() and free() == free_at_start - 3
    step = scheduler.schedule()
    assert step.finished_req_ids == {"r"}
    sending = worker.take_finished_sending(step.finished_req_ids)
    assert sending == set()
    answer(step, sending)
    assert free() == free_at_start - 3
    gate.opened.set()
    worker.flush()
    step = scheduler.schedule()
    sending = worker.take_finished_sending(step.finished_req_ids)
    assert sending == {"r"}
    answer(step, sending)
    assert free() == free_at_start and "r" not in scheduler.requests
    assert worker.held_requests() == 0 and worker.stats().chunks_saved == 2
    worker.close()
    connector.shutdown()
