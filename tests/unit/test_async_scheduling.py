"""Held blocks under vLLM's asynchronous scheduling: vLLM's real AsyncScheduler schedules step N+1
before it takes in step N's output (:class:`harness.vllm_scheduler.AsyncSteps`), so a request
finishes, is preempted or is aborted while a later step is already on its way to the worker.

A request whose blocks a save reads (the store's gather) or lends (the P/D producer) keeps them
until the worker has seen the save and is done with it: vLLM frees them once, then, and the
forward pass of a later step writes other KV into them; what was stored or lent still holds the
request's bits. Every table is empty at the end."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from connector.paged import gather_blocks
from connector.vllm_store import StoreWorker
from connector.vllm_store_connector import KVBridgeStoreConnector
from connector.vllm_worker import find_layout
from harness import vllm_procs as vp
from harness.store_gathers import WAIT, GatherGate, hold_gathers, stored_chunks
from harness.vllm_fakes import LendingInserts, bare_connector
from harness.vllm_scheduler import AsyncSteps, make_scheduler, tiny_model_config
from lookup_buffer.loans import RETURNED, TAKEN_BACK, Loan

B = vp.BLOCK_SIZE
BLOCKS = vp.FAKE_BLOCKS  # vLLM's block 0 is its null block: 8 blocks for requests


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return tiny_model_config(tmp_path_factory.mktemp("tiny-llama-async"))


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatherGate]:
    held = hold_gathers(monkeypatch)
    yield held
    held.opened.set()  # a failed test leaves no gather waiting


def _request(req_id: str, start: int, length: int, max_tokens: int) -> Request:
    return Request(
        req_id,
        list(range(start, start + length)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        None,
        block_hasher=get_request_block_hasher(B, sha256),
    )


class Store:
    """An instance storing its prompts (chunks of one block) under vLLM's AsyncScheduler, its worker
    a real store connector over fake caches of :data:`BLOCKS` blocks."""

    def __init__(self, model_config: ModelConfig, tmp_path: Path, seed: int, defer_finalize: bool) -> None:
        extra = {"kv_store": {"tiers": f"disk:{tmp_path}", "chunk_size": B}}
        self.scheduler: Scheduler = make_scheduler(
            model_config, "kv_both", num_blocks=BLOCKS, extra=extra, async_scheduling=True
        )
        connector = self.scheduler.connector
        assert isinstance(connector, KVBridgeStoreConnector)
        self.store_scheduler = connector._store_scheduler
        self.caches = vp.fake_caches(seed, block_size=B)
        self.layout = find_layout(self.caches[0], BLOCKS, B, "CPU_ATTN/vec")
        self.worker = StoreWorker(self.store_scheduler.settings, vp.store_identity(len(self.caches), B))
        self.worker.register(self.caches, self.layout, "CPU_ATTN/vec")
        connector.set_xfer_handshake_metadata_pp_aware({(0, 0): self.worker.handshake()})
        worker_connector = object.__new__(KVBridgeStoreConnector)
        worker_connector._store_worker, worker_connector._store_scheduler = self.worker, None
        worker_connector._connector_metadata = None
        self.connector = worker_connector
        self.free = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks
        self.free_at_start = self.free()
        self.loop = AsyncSteps(
            self.scheduler, worker_connector, self.caches, self._on_free, seed=seed, defer_finalize=defer_finalize
        )
        #: The bits of each saved request's blocks when the worker was handed its save.
        self.saved_bits: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
        self._save = self.worker.save
        self.worker.save = self._record_save  # type: ignore[method-assign]

    def _record_save(self, saves: Any) -> None:
        for spec in saves:
            self.saved_bits[spec.req_id] = (
                spec.token_ids,
                [gather_blocks(self.caches, self.layout, torch.tensor([block])) for block in spec.block_ids],
            )
        self._save(saves)

    def _on_free(self, request: Request) -> None:
        # vLLM frees a request's blocks: no gather of this worker may still read them.
        assert not self.worker.holds(request.request_id), f"{request.request_id} freed while its save reads it"

    def blocks(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def assert_stored(self, req_id: str) -> None:
        """Every chunk of ``req_id``'s save is stored with the bits its blocks held at the save."""
        tokens, bits = self.saved_bits[req_id]
        chunks = stored_chunks(self.worker, tokens, B)
        assert len(chunks) == len(bits)
        for index, (chunk, expected) in enumerate(zip(chunks, bits, strict=True)):
            assert chunk is not None and torch.equal(chunk, expected), f"chunk {index} of {req_id}"

    def drain(self) -> None:
        """Step until idle, every save handed over put before each look (the gathers run in a
        thread: stepping alone does not wait for them)."""

        def idle() -> bool:
            self.worker.flush()
            return self.loop.idle()

        self.loop.run(idle)

    def assert_idle(self, finished: list[str]) -> None:
        """Each request freed once, nothing held anywhere, every block free again."""
        assert sorted(self.loop.freed) == sorted(finished)
        assert self.loop.idle() and self.free() == self.free_at_start
        assert self.worker.held_requests() == 0 and not self.worker._finished
        assert not self.store_scheduler._saving and not self.store_scheduler._prompts

    def close(self) -> None:
        self.worker.close()
        self.scheduler.connector.shutdown()


def _defers_finalize(request: pytest.FixtureRequest) -> bool:
    """Whether the test runs its worker's ``wait_for_save`` after ``get_finished``, as vLLM's model
    runner does with speculative decoding (the test's ``defer_finalize`` parameter; False if none)."""
    callspec = getattr(request.node, "callspec", None)
    return bool(callspec.params.get("defer_finalize", False)) if callspec is not None else False


DEFER_FINALIZE = pytest.mark.parametrize("defer_finalize", [False, True], ids=["in_step", "deferred_save"])


@pytest.fixture
def store(model_config: ModelConfig, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Store]:
    instance = Store(model_config, tmp_path, len(request.node.name), _defers_finalize(request))
    yield instance
    instance.close()


@DEFER_FINALIZE
def test_a_request_finishing_with_the_next_step_scheduled_keeps_its_blocks_until_its_gather_is_done(
    store: Store, gate: GatherGate, defer_finalize: bool
) -> None:
    _finish_with_the_next_step_scheduled(store, gate)


def _finish_with_the_next_step_scheduled(store: Store, gate: GatherGate) -> None:
    loop = store.loop
    store.scheduler.add_request(_request("r", 1000, 3 * B + 5, max_tokens=1))
    loop.step()  # step 1 scheduled and run: the worker is handed r's save, its gather is held
    assert gate.started.wait(WAIT) and list(store.worker._gathers) == ["r"]
    r_blocks = store.blocks("r")
    loop.step()  # step 2 is scheduled (nothing finished yet), then step 1's output finishes r
    assert len(loop.steps) == 2 and not loop.steps[1].finished_req_ids
    assert store.scheduler.requests["r"].is_finished() and "r" in store.scheduler.requests
    # A request that needs more blocks than are left besides r's: vLLM can give it r's once freed.
    store.scheduler.add_request(_request("w", 5000, 6 * B + 1, max_tokens=2))
    loop.run(lambda: len(loop.steps) >= 8)
    assert loop.freed == [] and "w" not in store.scheduler.running  # r's blocks are all still kept
    gate.opened.set()
    store.drain()
    assert loop.freed == ["r", "w"]
    w_steps = [step for step in loop.steps if any(new.req_id == "w" for new in step.scheduled_new_reqs)]
    (w_new,) = [new for new in w_steps[0].scheduled_new_reqs if new.req_id == "w"]
    assert set(w_new.block_ids[0]) & set(r_blocks)  # written by w's forward pass after r was freed
    store.assert_stored("r")
    store.assert_idle(["r", "w"])


def test_a_request_preempted_in_async_mode_during_its_gather_is_stored_whole_and_freed_once(
    store: Store, gate: GatherGate
) -> None:
    loop = store.loop
    preempting: list[list[str]] = []
    handle_preemptions = store.connector.handle_preemptions

    def opening(meta: Any) -> None:
        # The step that preempts b reaches the worker while b's gather is under way (held).
        if meta.preempted:
            assert gate.started.is_set()
            preempting.append(list(meta.preempted))
            gate.opened.set()
        handle_preemptions(meta)

    store.connector.handle_preemptions = opening  # type: ignore[method-assign]
    # a (one block, no full chunk: nothing to save) and b (7 blocks) take all 8; the first of them
    # to need another block has b preempted.
    store.scheduler.add_request(_request("a", 100, B - 1, max_tokens=3 * B))
    store.scheduler.add_request(_request("b", 2000, 7 * B - 1, max_tokens=4))
    loop.step()
    assert gate.started.wait(WAIT)
    b_blocks = store.blocks("b")
    loop.run(lambda: bool(preempting))
    assert preempting == [["b"]] and store.scheduler.requests["b"].num_preemptions == 1
    assert set(store.blocks("a")) & set(b_blocks)  # a's forward pass writes a block b had
    store.drain()
    assert store.worker.stats().saves_dropped == 0
    store.assert_stored("b")
    assert len(store.saved_bits) == 1  # resumed, b finds its prompt stored: no second save
    store.assert_idle(["a", "b"])


def test_an_aborted_request_with_a_step_in_flight_keeps_its_blocks_until_its_gather_is_done(
    store: Store, gate: GatherGate
) -> None:
    loop = store.loop
    store.scheduler.add_request(_request("x", 3000, 4 * B + 3, max_tokens=50))
    store.scheduler.add_request(_request("y", 4000, 2 * B, max_tokens=50))
    loop.step()
    assert gate.started.wait(WAIT)
    loop.step()  # step 2 in flight with x's and y's next tokens; step 1's output taken in
    loop.step()
    store.scheduler.finish_requests(["x", "y"], RequestStatus.FINISHED_ABORTED)
    assert loop.freed == []  # neither: x and y both have a save under way (y's waits behind x's)
    loop.run(lambda: len(loop.steps) >= 10)
    assert loop.freed == []
    gate.opened.set()
    store.drain()
    store.assert_stored("x")
    store.assert_stored("y")
    store.assert_idle(["x", "y"])


# ====================================================================== the P/D producer's lent blocks


class Producer:
    """A prefill instance (``kv_producer``) under vLLM's AsyncScheduler whose worker lends every
    save: each one's loan lasts until the test ends it, as a decode instance that took the KV would."""

    def __init__(self, model_config: ModelConfig, seed: int, defer_finalize: bool) -> None:
        self.scheduler: Scheduler = make_scheduler(
            model_config, "kv_producer", num_blocks=BLOCKS, async_scheduling=True
        )
        self.side = self.scheduler.connector._require_scheduler()
        self.caches = vp.fake_caches(seed, block_size=B)
        self.buffer = LendingInserts()
        self.worker = vp.fake_worker(
            "kv_producer",
            1,
            B,
            self.caches,
            {"kv_lend_blocks": False},
            listener_factory=lambda settings, offset, on_connect: self.buffer,
        )
        self.connector = bare_connector(self.worker)
        self.free = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks
        self.free_at_start = self.free()
        self.loop = AsyncSteps(
            self.scheduler, self.connector, self.caches, on_free=self._on_free, seed=seed, defer_finalize=defer_finalize
        )
        #: Each save's loan, and the bits of its blocks when the worker was handed it, per request.
        self.lent: dict[str, list[tuple[Loan, list[int], torch.Tensor]]] = {}
        self._save = self.worker.save
        self.worker.save = self._record_save  # type: ignore[method-assign]

    def _record_save(self, saves: Any) -> None:
        bits = {spec.req_id: torch.stack([cache[spec.block_ids].clone() for cache in self.caches]) for spec in saves}
        loans = len(self.buffer.loans)
        self._save(saves)
        for spec, loan in zip(saves, self.buffer.loans[loans:], strict=True):
            self.lent.setdefault(spec.req_id, []).append((loan, list(spec.block_ids), bits[spec.req_id]))

    def _on_free(self, request: Request) -> None:
        # vLLM frees a request's blocks: none of them may still be lent.
        lent = self.lent.get(request.request_id, ())
        assert all(loan.outcome is not None for loan, _, _ in lent), f"{request.request_id} freed still lent"

    def blocks(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def assert_lent_bits(self, req_id: str, index: int = -1) -> None:
        """The blocks of ``req_id``'s save ``index`` still hold what they held when it was lent."""
        _, block_ids, bits = self.lent[req_id][index]
        assert torch.equal(torch.stack([cache[block_ids] for cache in self.caches]), bits), f"{req_id}'s lent blocks"

    def end_loan(self, req_id: str) -> None:
        """A decode instance copied ``req_id``'s entry (its blocks checked bit-exact first) and returned it."""
        self.assert_lent_bits(req_id)
        loan = self.lent[req_id][-1][0]
        assert loan.outcome is None
        loan.end(RETURNED)

    def drain(self) -> None:
        """Step until idle, each finished request's loan ended once vLLM holds it."""

        def idle() -> bool:
            for req_id in list(self.worker._held):
                if self.lent[req_id][-1][0].outcome is None:
                    self.end_loan(req_id)
            return self.loop.idle()

        self.loop.run(idle)

    def assert_idle(self, finished: list[str]) -> None:
        assert sorted(self.loop.freed) == sorted(finished)
        assert self.loop.idle() and self.free() == self.free_at_start
        worker, side = self.worker, self.side
        assert not (worker._kept or worker._held or worker._lent_blocks or worker._gone)
        assert not (side._saving or side._saved or side._pending or side._held or side._prefixes or side._unsaved)

    def close(self) -> None:
        self.worker.close()


@pytest.fixture
def producer(model_config: ModelConfig, request: pytest.FixtureRequest) -> Iterator[Producer]:
    instance = Producer(model_config, len(request.node.name), _defers_finalize(request))
    yield instance
    instance.close()


@DEFER_FINALIZE
def test_lent_blocks_of_a_request_finishing_with_the_next_step_scheduled_stay_until_the_loan_ends(
    producer: Producer, defer_finalize: bool
) -> None:
    _lend_and_finish_with_the_next_step_scheduled(producer)


def _lend_and_finish_with_the_next_step_scheduled(producer: Producer) -> None:
    loop, scheduler = producer.loop, producer.scheduler
    scheduler.add_request(_request("r", 1000, 3 * B + 5, max_tokens=1))
    loop.step()  # step 1: r's prefix is saved, lent
    (loan, r_blocks, _) = producer.lent["r"][0]
    loop.step()  # step 2 is scheduled (nothing finished yet), then step 1's output finishes r
    assert len(loop.steps) == 2 and not loop.steps[1].finished_req_ids
    assert scheduler.requests["r"].is_finished()
    scheduler.add_request(_request("w", 5000, 6 * B + 1, max_tokens=2))
    loop.run(lambda: "r" in producer.worker._held)  # the worker saw r's save, then its hold
    loop.run(lambda: len(loop.steps) >= 10)
    assert loop.freed == [] and loan.outcome is None and "w" not in scheduler.running
    producer.end_loan("r")
    producer.drain()
    assert loop.freed == ["r", "w"]
    (w_new,) = [new for step in loop.steps for new in step.scheduled_new_reqs if new.req_id == "w"]
    assert set(w_new.block_ids[0]) & set(r_blocks)
    producer.assert_idle(["r", "w"])


def test_a_preempted_request_is_taken_back_before_the_step_writes_its_blocks_and_lent_again_once_recomputed(
    producer: Producer,
) -> None:
    loop, scheduler = producer.loop, producer.scheduler
    taken_back: list[list[str]] = []
    handle_preemptions = producer.connector.handle_preemptions

    def checked(meta: Any) -> None:
        handle_preemptions(meta)
        if meta.take_back:
            # Before this step's forward pass writes the blocks vLLM freed: ended, and still intact.
            taken_back.append(list(meta.take_back))
            assert producer.lent["b"][0][0].outcome == TAKEN_BACK
            producer.assert_lent_bits("b", 0)

    producer.connector.handle_preemptions = checked  # type: ignore[method-assign]
    scheduler.add_request(_request("a", 100, B - 1, max_tokens=3 * B))  # no whole block before its last token
    scheduler.add_request(_request("b", 2000, 7 * B - 1, max_tokens=4))
    loop.run(lambda: bool(taken_back))
    assert taken_back == [["b"]] and scheduler.requests["b"].num_preemptions == 1
    loop.run(lambda: "b" in producer.worker._held)  # resumed, saved again from its new blocks, finished
    assert len(producer.lent["b"]) == 2 and loop.freed == ["a"]
    producer.drain()
    producer.assert_idle(["a", "b"])


def test_an_aborted_request_with_a_step_in_flight_keeps_its_lent_blocks_until_the_loan_ends(
    producer: Producer,
) -> None:
    loop, scheduler = producer.loop, producer.scheduler
    scheduler.add_request(_request("x", 3000, 4 * B + 3, max_tokens=50))
    loop.step()
    loop.step()
    loop.step()  # x decodes, a step in flight
    scheduler.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    loop.run(lambda: "x" in producer.worker._held)
    loop.run(lambda: len(loop.steps) >= 10)
    assert loop.freed == []
    producer.drain()
    producer.assert_idle(["x"])


# ====================================================================== the checks themselves


def test_the_checks_catch_a_store_worker_reporting_a_request_before_its_gather_is_done(
    store: Store, gate: GatherGate
) -> None:
    # Broken on purpose: finished sending as soon as vLLM finished the request.
    worker = store.worker
    worker.take_finished_sending = lambda req_ids: set(req_ids) & set(worker._gathers)  # type: ignore[method-assign]
    with pytest.raises(AssertionError, match="freed while its save reads it"):
        _finish_with_the_next_step_scheduled(store, gate)


def test_the_checks_catch_a_producer_worker_returning_blocks_still_lent(producer: Producer) -> None:
    # Broken on purpose: every held request reported finished sending at once, its loan not ended.
    worker = producer.worker

    def returning_at_once() -> set[str]:
        held = set(worker._held)
        worker._held.clear()
        return held

    worker.take_finished_sending = returning_at_once  # type: ignore[method-assign]
    with pytest.raises(AssertionError, match="still lent"):
        _lend_and_finish_with_the_next_step_scheduled(producer)


# ====================================================================== vLLM's choice


@pytest.mark.parametrize("asked", [True, None])
def test_vllm_on_cpu_runs_kvbridge_with_synchronous_scheduling_even_when_asynchronous_is_asked(
    model_config: ModelConfig, tmp_path: Path, asked: bool | None
) -> None:
    # vLLM 0.32's CPU platform turns it off in check_and_update_config, without a word; on a GPU the
    # same configuration runs the AsyncScheduler (asked, or by default), which the tests above drive.
    config = VllmConfig(
        model_config=copy.deepcopy(model_config),
        scheduler_config=SchedulerConfig(max_model_len=512, is_encoder_decoder=False, async_scheduling=asked),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVBridgeConnector",
            kv_connector_module_path="connector.vllm_v1",
            kv_role="kv_both",
            kv_connector_extra_config={"kv_store": {"tiers": f"disk:{tmp_path}"}},
        ),
        device_config=DeviceConfig("cpu"),
    )
    assert config.scheduler_config.async_scheduling is False
    assert config.scheduler_config.get_scheduler_cls() is Scheduler
    assert config.max_concurrent_batches == 1
