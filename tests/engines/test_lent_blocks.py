"""The life of a lent block: a saved request's entry never outlives vLLM's hold on its blocks, and
never holds them for nobody.

vLLM frees a preempted request's blocks without telling the connector, and the same step's forward
pass may write them for another request. The producer's scheduler side therefore lists the saved
requests vLLM preempted, and the workers take their entries back before that forward pass: an
entry still stored leaves the buffer, one borrowed has its stamp cleared (its borrower's load
fails, the connection stays), and the request is saved again from its new blocks. A finished
request's blocks stay lent at most ``kv_lend_lease``: then its entry is copied into the buffer and
vLLM gets the blocks back. A decode request aborted before its load has its entry drained.
"""

from __future__ import annotations

import inspect
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from connector import compat
from connector.transfer_plan import PARAMS_KEY, LoadSpec, SaveSpec
from connector.vllm_consumer_worker import ConsumerWorker
from connector.vllm_pd_store import KVBridgePDStoreConnector, PDStoreMetadata
from connector.vllm_producer_worker import DualWorker, ProducerWorker
from connector.vllm_scheduler import KVBridgeMetadata, KVBridgeWorkerMetadata, SchedulerSide
from connector.vllm_settings import ConnectorSettings
from connector.vllm_store import StoreMetadata
from connector.vllm_v1 import KVBridgeConnector
from connector.vllm_worker import WorkerSide, find_layout
from harness import vllm_procs as vp
from harness.procs import free_port
from harness.vllm_fakes import (
    FAKE_TOKENS,
    B,
    FailingInserts,
    LendingInserts,
    bare_connector,
    cached_data,
    make_request,
    new_req_data,
    scheduler_output,
)
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVBufferFullError, KVConfigError
from lookup_buffer.loans import EVICTED, EXPIRED, RETURNED, TAKEN_BACK

# ====================================================================== scheduler side


def _preempted(output: Any, *req_ids: str) -> Any:
    output.preempted_req_ids = set(req_ids)
    return output


def test_a_preempted_saved_request_is_taken_back_and_saved_again_from_its_new_blocks() -> None:
    side = SchedulerSide(B, is_producer=True, is_consumer=False)
    tokens = list(range(500, 600))  # prefix 96: 3 blocks
    request = make_request("r", tokens)
    first = side.build_meta(
        scheduler_output([new_req_data(request, [1, 2, 3, 4], 0)], {"r": 100}), {"r": [1, 2, 3, 4]}.__getitem__
    )
    assert first.saves == [SaveSpec("r", tokens[:96], [1, 2, 3])] and first.take_back == []
    side.record_saves(KVBridgeWorkerMetadata.of_one_worker({"r"}, set()))
    blocks = {"r": [1, 2, 3, 4]}.__getitem__
    decoding = side.build_meta(scheduler_output([], {"r": 1}, cached_data(["r"], [100])), blocks)
    assert decoding.saves == [] and decoding.take_back == []
    # vLLM preempts "r" to make room: blocks 1-4 are freed and may be written by this very step.
    preempted = side.build_meta(_preempted(scheduler_output([], {}), "r"), {}.__getitem__)
    assert (preempted.take_back, preempted.withdraw, preempted.saves) == (["r"], [], [])  # its copy is kept
    # Resumed, it recomputes its prompt in new blocks, in two chunks: saved again once its prefix is.
    new_blocks = {"r": [7, 8, 9, 5]}.__getitem__
    chunk = side.build_meta(scheduler_output([], {"r": 64}, cached_data(["r"], [0])), new_blocks)
    assert chunk.saves == [] and chunk.take_back == []
    again = side.build_meta(scheduler_output([], {"r": 37}, cached_data(["r"], [64])), new_blocks)
    assert again.saves == [SaveSpec("r", tokens[:96], [7, 8, 9])]
    side.record_saves(KVBridgeWorkerMetadata.of_one_worker({"r"}, set()))
    request.num_computed_tokens = 101
    held, params = side.request_finished(request)
    assert held and params[PARAMS_KEY]["prefix_tokens"] == 96


def test_a_request_preempted_before_its_save_took_effect_is_taken_back_and_its_late_outcome_ignored() -> None:
    side = SchedulerSide(B, is_producer=True, is_consumer=False)
    tokens = list(range(700, 765))  # prefix 64
    request = make_request("r", tokens)
    side.build_meta(scheduler_output([new_req_data(request, [1, 2, 3], 0)], {"r": 65}), {"r": [1, 2, 3]}.__getitem__)
    # With asynchronous scheduling the next schedule may preempt it before the save's outcome came back.
    preempted = side.build_meta(_preempted(scheduler_output([], {}), "r"), {}.__getitem__)
    assert preempted.take_back == ["r"]
    side.record_saves(KVBridgeWorkerMetadata.of_one_worker({"r"}, set()))  # the taken-back save's outcome
    held, params = side.request_finished(request)  # aborted while waiting to resume: nothing was saved since
    assert (held, params[PARAMS_KEY]["prefix_tokens"]) == (False, 0)


def test_preempted_requests_never_saved_are_not_taken_back() -> None:
    side = SchedulerSide(B, is_producer=True, is_consumer=False)
    request = make_request("r", list(range(200)))
    side.build_meta(scheduler_output([new_req_data(request, [1, 2], 0)], {"r": 64}), {}.__getitem__)  # chunked
    assert side.build_meta(_preempted(scheduler_output([], {}), "r", "unknown"), {}.__getitem__).take_back == []


def test_entries_of_a_request_some_tp_ranks_failed_to_save_are_taken_back() -> None:
    side = SchedulerSide(B, is_producer=True, is_consumer=False, num_workers=2)
    requests = {
        name: make_request(name, list(range(start, start + 65)))
        for name, start in (("both", 0), ("one", 100), ("none", 200))
    }
    new = [new_req_data(request, [index], 0) for index, request in enumerate(requests.values())]
    side.build_meta(scheduler_output(new, {name: 65 for name in requests}), lambda req_id: [1, 2, 3])
    finished = {name: side.request_finished(request) for name, request in requests.items()}
    rank0 = KVBridgeWorkerMetadata.of_one_worker({"both", "one"}, {"none"})
    rank1 = KVBridgeWorkerMetadata.of_one_worker({"both"}, {"one", "none"})
    side.record_saves(rank0.aggregate(rank1))
    assert {name: params[PARAMS_KEY]["prefix_tokens"] for name, (_, params) in finished.items()} == {
        "both": 64,
        "one": 0,
        "none": 0,
    }
    # Rank 0 holds an entry of "one" that nobody will ask for: it goes at once, copy or loan, not when
    # it expires.
    after = side.build_meta(scheduler_output([], {}), {}.__getitem__)
    assert (after.withdraw, after.take_back) == (["one"], [])


def test_a_decode_request_aborted_before_its_load_has_its_announced_entry_drained() -> None:
    side = SchedulerSide(B, is_producer=False, is_consumer=True)
    announced = {PARAMS_KEY: {"prefix_tokens": 64, "host": "10.1.2.3", "port": 14600}}
    waiting = make_request("waiting", list(range(900, 965)), announced)
    assert side.num_new_matched_tokens(waiting, 0) == 64  # vLLM asked, then the client went away
    loaded = make_request("loaded", list(range(1000, 1065)), announced)
    side.after_alloc(loaded, [1, 2, 3], side.num_new_matched_tokens(loaded, 0))
    plain = make_request("plain", list(range(1100, 1165)))  # no announcement: no entry anywhere
    for request in (waiting, loaded, plain):
        side.request_finished(request)
    (drain,) = side.build_meta(scheduler_output([], {}), {}.__getitem__).loads
    assert (drain.req_id, drain.token_ids, drain.drain, drain.producer) == (
        "waiting",
        list(range(900, 964)),
        True,
        ("10.1.2.3", 14600),
    )
    assert side.build_meta(scheduler_output([], {}), {}.__getitem__).loads == []  # once


def test_a_preempted_request_saved_by_a_copy_keeps_its_one_entry() -> None:
    buffer = FailingInserts({})
    worker = vp.fake_worker(
        "kv_producer",
        1,
        vp.FAKE_BLOCK_SIZE,
        vp.fake_caches(1),
        {"kv_lend_blocks": False},
        listener_factory=lambda settings, offset, on_connect: buffer,
    )
    try:
        worker.save([SAVES[0]])
        worker.take_back([SAVES[0].req_id])  # preempted: its copy holds no block and stays
        worker.save([SaveSpec(SAVES[0].req_id, SAVES[0].token_ids, [5, 8])])  # recomputed in new blocks
        assert worker.take_save_outcomes() == ({SAVES[0].req_id}, set())
        assert buffer.inserted == [SAVES[0].token_ids]  # one entry, not a second one waiting for nobody
        worker.hold([SAVES[0].req_id])
        assert worker.take_finished_sending() == {SAVES[0].req_id}
    finally:
        worker.close()


def test_a_request_saved_by_a_copy_then_preempted_and_aborted_leaves_nothing_behind() -> None:
    buffer = FailingInserts({})
    worker = vp.fake_worker(
        "kv_producer",
        1,
        vp.FAKE_BLOCK_SIZE,
        vp.fake_caches(1),
        {"kv_lend_blocks": False},
        listener_factory=lambda settings, offset, on_connect: buffer,
    )
    try:
        worker.save([SAVES[0]])
        worker.take_back([SAVES[0].req_id])  # preempted, then aborted: vLLM never holds it
        assert SAVES[0].req_id not in worker._kept and SAVES[0].req_id not in worker._lent_blocks
    finally:
        worker.close()


def _tp_ranks() -> tuple[list[Any], LendingInserts]:
    """Three TP ranks of one producer: rank 0 lends its saves, rank 1 copies them, rank 2 finds its
    buffer full for SAVES[1]."""
    lending = LendingInserts()
    buffers = [lending, FailingInserts({}), FailingInserts({SAVES[1].token_ids[0]: KVBufferFullError("full")})]
    workers = [
        vp.fake_worker(
            "kv_producer",
            1,
            vp.FAKE_BLOCK_SIZE,
            vp.fake_caches(1),
            {"kv_lend_blocks": False},
            listener_factory=lambda settings, offset, on_connect, buffer=buffer: buffer,
        )
        for buffer in buffers
    ]
    return workers, lending


@pytest.mark.parametrize("take_back_first", [True, False])
def test_a_request_only_some_tp_ranks_saved_is_finished_sending_on_every_rank(take_back_first: bool) -> None:
    workers, lending = _tp_ranks()
    req_id = SAVES[1].req_id
    try:
        for worker in workers:
            worker.save([SAVES[1]])
        assert [worker.take_save_outcomes() for worker in workers] == [({req_id}, set())] * 2 + [(set(), {req_id})]
        # The next step's metadata holds it (finished) and withdraws it (not every rank saved it).
        for worker in workers:
            if take_back_first:
                worker.take_back([], withdraw=[req_id])
                worker.hold([req_id])
            else:
                worker.hold([req_id])
                worker.take_back([], withdraw=[req_id])
        assert [worker.take_finished_sending() for worker in workers] == [{req_id}] * 3
        assert lending.loans[0].outcome == TAKEN_BACK
        assert [worker.take_finished_sending() for worker in workers] == [set()] * 3  # once
        assert not any(worker._kept or worker._held or worker._lent_blocks for worker in workers)
    finally:
        for worker in workers:
            worker.close()


@pytest.mark.parametrize("reason", ["take_back", "withdraw"])
def test_entries_are_taken_back_in_handle_preemptions_before_vllm_writes_any_block(reason: str) -> None:
    # vLLM's execute_model calls handle_preemptions first; only then does it zero newly allocated
    # blocks and apply block copies (_update_states), and binds the metadata later still.
    source = inspect.getsource(GPUModelRunner.execute_model)
    assert source.index(".handle_preemptions(") < source.index("self._update_states(")
    workers, lending = _tp_ranks()
    connector = bare_connector(workers[0])
    try:
        workers[0].save([SAVES[1]])
        meta = KVBridgeMetadata(**{reason: [SAVES[1].req_id]})  # preempted, or never to be announced
        connector.handle_preemptions(meta)
        assert lending.loans[0].outcome == TAKEN_BACK  # before any block of this step is written
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(None)
        assert workers[0].total_stats().data["taken_back"] == 1  # once
        connector.clear_connector_metadata()
    finally:
        for worker in workers:
            worker.close()


@pytest.mark.parametrize("reason", ["take_back", "withdraw"])
def test_the_pd_store_connector_takes_entries_back_in_handle_preemptions_too(reason: str) -> None:
    # P/D with the store forwards the pipe's part of the metadata to the same producer worker, and the
    # store's (its preempted gathers) to its store worker.
    workers, lending = _tp_ranks()
    connector = object.__new__(KVBridgePDStoreConnector)
    connector._worker, connector._scheduler, connector._connector_metadata = workers[0], None, None
    store_preemptions: list[list[str]] = []
    connector._store_worker = SimpleNamespace(preempt=lambda req_ids: store_preemptions.append(list(req_ids)))
    try:
        workers[0].save([SAVES[1]])
        connector.handle_preemptions(
            PDStoreMetadata(
                pipe=KVBridgeMetadata(**{reason: [SAVES[1].req_id]}), store=StoreMetadata(preempted=[SAVES[1].req_id])
            )
        )
        assert lending.loans[0].outcome == TAKEN_BACK
        assert workers[0].total_stats().data["taken_back"] == 1
        assert store_preemptions == [[SAVES[1].req_id]]
    finally:
        for worker in workers:
            worker.close()


def test_the_connector_refuses_sleep_mode() -> None:
    # Sleep mode releases and re-creates the KV cache: exported, lent blocks would not survive it.
    assert KVBridgeConnector.supports_sleep_mode(None) is False


# ====================================================================== workers, over a real pipe

#: Requests saved lent: "stored" is taken back before anyone selects it, "borrowed" while a consumer
#: copies it, "kept" is never taken back.
SAVES = [
    SaveSpec("stored", FAKE_TOKENS["a"], [3, 6]),
    SaveSpec("borrowed", FAKE_TOKENS["b"], [1, 4, 7]),
    SaveSpec("kept", FAKE_TOKENS["c"], [2]),
]


def taking_back_producer_body(
    port: int, saved: Any, borrowed: Any, taken_back: Any, done: Any, timeout: float
) -> dict[str, Any]:
    """Save SAVES lent; take back "stored" and, once the consumer borrowed it, "borrowed", each time
    writing noise into the blocks as the forward pass of the step that reuses them would."""
    from kv_pipe.exported_memory import page_aligned_empty

    caches = [page_aligned_empty(cache.shape, cache.dtype).copy_(cache) for cache in vp.fake_caches(1)]
    worker = vp.fake_worker("kv_producer", port, vp.FAKE_BLOCK_SIZE, caches, {})
    loans = {}
    try:
        with torch.inference_mode():
            worker.save(SAVES)
        loans = dict(worker._kept)
        worker.take_back(["stored"])
        _scribble(caches, SAVES[0].block_ids)
        saved.set()
        if not borrowed.wait(timeout):
            raise TimeoutError("the consumer did not borrow")
        worker.take_back(["borrowed"])
        _scribble(caches, SAVES[1].block_ids)
        taken_back.set()
        if not done.wait(timeout):
            raise TimeoutError(f"the consumer did not finish within {timeout} s")
        deadline = time.monotonic() + timeout
        while loans["kept"].outcome is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return {
            "outcomes": {req_id: loan.outcome for req_id, loan in loans.items()},
            "stats": worker.total_stats().data,
            "entries_left": worker.buffer_stats().entries,
        }
    finally:
        worker.close()


def _scribble(caches: list[torch.Tensor], block_ids: list[int]) -> None:
    for cache in caches:
        cache[block_ids] = torch.full_like(cache[block_ids], -7.25)


class _PausingBuffer:
    """The consumer's connection, pausing a borrowed select of ``pause_token`` after it returned and
    before its bytes are copied, until the producer has taken the entry back."""

    def __init__(self, buffer: Any, pause_token: int, borrowed: Any, taken_back: Any) -> None:
        self._buffer, self._pause_token = buffer, pause_token
        self._borrowed, self._taken_back = borrowed, taken_back

    def drop_select(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        timeout: float | None = None,
        borrow: bool = False,
        span: tuple[int, int, int] | None = None,
    ) -> list[Any]:
        entry = self._buffer.drop_select(input_tokens, roi, timeout=timeout, borrow=borrow, span=span)
        if int(input_tokens[0]) == self._pause_token:
            self._borrowed.set()
            if not self._taken_back.wait(60):
                raise TimeoutError("the producer did not take the entry back")
        return entry

    def __getattr__(self, name: str) -> Any:
        return getattr(self._buffer, name)


def taking_back_consumer_body(
    port: int, saved: Any, borrowed: Any, taken_back: Any, done: Any, timeout: float
) -> dict[str, Any]:
    from lookup_buffer import dial

    dials = []

    def pausing(settings: Any, host: str, producer_port: int, on_connect: Any) -> _PausingBuffer:
        dials.append(producer_port)
        return _PausingBuffer(
            dial(settings.bridge, host, producer_port, on_connect), FAKE_TOKENS["b"][0], borrowed, taken_back
        )

    worker = vp.fake_worker(
        "kv_consumer", port, vp.FAKE_BLOCK_SIZE, vp.fake_caches(2), {"kv_load_timeout": 0.5}, dialer=pausing
    )
    try:
        if not saved.wait(timeout):
            raise TimeoutError(f"the producer did not save within {timeout} s")
        failed = [
            sorted(vp.load_and_wait(worker, [LoadSpec(spec.req_id, spec.token_ids, targets, 0)], timeout))
            for spec, targets in zip(SAVES, ([0, 5], [6, 8, 1], [4]), strict=True)
        ]
        return {
            "failed": failed,
            "stats": worker.total_stats().data,
            "dials": dials,
            "connections": worker.connections,
            "caches": [cache.numpy() for cache in worker.caches],
        }
    finally:
        done.set()
        worker.close()


def lease_producer_body(port: int, saved: Any, copied: Any, done: Any, timeout: float) -> dict[str, Any]:
    """Save SAVES lent with a lease of 0 s; once they are held (finished), the next step copies them
    into the buffer and hands their blocks back; then scribble over the blocks, as vLLM would."""
    from kv_pipe.exported_memory import page_aligned_empty

    caches = [page_aligned_empty(cache.shape, cache.dtype).copy_(cache) for cache in vp.fake_caches(1)]
    worker = vp.fake_worker("kv_producer", port, vp.FAKE_BLOCK_SIZE, caches, {"kv_lend_lease": 0.0})
    try:
        with torch.inference_mode():
            worker.save(SAVES)
        loans = dict(worker._kept)
        worker.hold([spec.req_id for spec in SAVES])
        returned = worker.take_finished_sending()
        for spec in SAVES:
            _scribble(caches, spec.block_ids)
        gauges = worker.gauges()
        saved.set()
        copied.set()
        if not done.wait(timeout):
            raise TimeoutError(f"the consumer did not finish within {timeout} s")
        return {
            "returned": returned,
            "outcomes": {req_id: loan.outcome for req_id, loan in loans.items()},
            "stats": worker.total_stats().data,
            "gauges": gauges,
        }
    finally:
        worker.close()


def lease_consumer_body(port: int, saved: Any, copied: Any, done: Any, timeout: float) -> dict[str, Any]:
    worker = vp.fake_worker("kv_consumer", port, vp.FAKE_BLOCK_SIZE, vp.fake_caches(2), {"kv_load_timeout": 0.5})
    try:
        if not (saved.wait(timeout) and copied.wait(timeout)):
            raise TimeoutError(f"the producer did not save within {timeout} s")
        failed = sorted(
            vp.load_and_wait(
                worker,
                [
                    LoadSpec(spec.req_id, spec.token_ids, targets, 0)
                    for spec, targets in zip(SAVES, ([0, 5], [6, 8, 1], [4]), strict=True)
                ],
                timeout,
            )
        )
        return {"failed": failed, "caches": [cache.numpy() for cache in worker.caches]}
    finally:
        done.set()
        worker.close()


@pytest.mark.timeout(120)
def test_blocks_lent_past_the_lease_go_back_to_vllm_and_their_entries_still_load_bit_exact() -> None:
    port = free_port()
    with vp.Engines() as engines:
        flags = {name: engines.event() for name in ("saved", "copied", "done")}
        engines.start("producer", lease_producer_body, {}, port=port, timeout=60, **flags)
        engines.start("consumer", lease_consumer_body, {}, port=port, timeout=60, **flags)
        results = engines.wait(["producer", "consumer"], timeout=100)
    producer, consumer = results["producer"], results["consumer"]
    assert producer["returned"] == {spec.req_id for spec in SAVES}  # in the step after their lease ran out
    assert set(producer["outcomes"].values()) == {"copied"} and producer["stats"]["unlent_requests"] == 3
    assert producer["gauges"]["loans_out"] == 0 and producer["gauges"]["blocks_lent"] == 0
    assert producer["gauges"]["entries_held"] == 3
    # The blocks were overwritten after they were handed back: the consumer got the copies, bit-exact.
    assert consumer["failed"] == []
    source = [c.numpy() for c in vp.fake_caches(1)]
    for layer, got in enumerate(consumer["caches"]):
        for targets, spec in zip(([0, 5], [6, 8, 1], [4]), SAVES, strict=True):
            assert np.array_equal(got[targets].view(np.uint32), source[layer][spec.block_ids].view(np.uint32))


@pytest.mark.timeout(120)
def test_entries_taken_back_are_never_loaded_and_the_connection_stays() -> None:
    port = free_port()
    with vp.Engines() as engines:
        flags = {name: engines.event() for name in ("saved", "borrowed", "taken_back", "done")}
        engines.start("producer", taking_back_producer_body, {}, port=port, timeout=60, **flags)
        engines.start("consumer", taking_back_consumer_body, {}, port=port, timeout=60, **flags)
        results = engines.wait(["producer", "consumer"], timeout=100)
    producer, consumer = results["producer"], results["consumer"]
    # "stored" left the buffer: a miss, nothing written. "borrowed" was copied from overwritten memory:
    # the load failed (vLLM recomputes those blocks). "kept" arrived bit-exact over the same connection.
    assert consumer["failed"] == [[0, 5], [1, 6, 8], []]
    stats = consumer["stats"]
    assert (stats["load_hits"], stats["load_misses"], stats["load_errors"]) == (1, 1, 1)
    assert consumer["dials"] == [port] and consumer["connections"] == 1
    before, source = [c.numpy() for c in vp.fake_caches(2)], [c.numpy() for c in vp.fake_caches(1)]
    for layer, got in enumerate(consumer["caches"]):
        assert np.array_equal(got[4].view(np.uint32), source[layer][2].view(np.uint32)), f"layer {layer}"
        # The taken-back "stored" wrote nothing; the failed "borrowed" blocks are vLLM's to recompute.
        assert np.array_equal(got[[0, 5]].view(np.uint32), before[layer][[0, 5]].view(np.uint32))
    assert producer["outcomes"] == {"stored": TAKEN_BACK, "borrowed": TAKEN_BACK, "kept": "returned"}
    assert producer["stats"]["taken_back"] == 2 and producer["entries_left"] == 0


def test_a_copy_gone_in_the_step_its_request_finishes_is_announced_as_nothing_and_later_reports_change_nothing() -> (
    None
):
    side = SchedulerSide(B, is_producer=True, is_consumer=False)
    requests = {name: make_request(name, list(range(start, start + 65))) for name, start in (("r", 0), ("s", 100))}
    new = [new_req_data(request, [index], 0) for index, request in enumerate(requests.values())]
    side.build_meta(scheduler_output(new, {name: 65 for name in requests}), lambda req_id: [1, 2, 3])
    side.record_saves(KVBridgeWorkerMetadata.of_one_worker({"r", "s"}, set()))
    side.build_meta(scheduler_output([], {"r": 1, "s": 1}, cached_data(["r", "s"], [65, 65])), {}.__getitem__)
    _, params = side.request_finished(requests["r"])
    assert params[PARAMS_KEY]["prefix_tokens"] == 64
    # The same step's worker outcomes: its copy was evicted (vLLM hands them over after request_finished).
    side.record_saves(KVBridgeWorkerMetadata.of_one_worker(set(), set(), {"r"}))
    assert params[PARAMS_KEY]["prefix_tokens"] == 0
    after = side.build_meta(scheduler_output([], {"s": 1}), {}.__getitem__)
    assert (after.withdraw, after.take_back) == (["r"], [])
    # Once its announcement left the engine, a report about "s" changes only what is still to come.
    _, later = side.request_finished(requests["s"])
    side.build_meta(scheduler_output([], {}), {}.__getitem__)
    side.record_saves(KVBridgeWorkerMetadata.of_one_worker(set(), set(), {"s"}))
    assert later[PARAMS_KEY]["prefix_tokens"] == 64
    last = side.build_meta(scheduler_output([], {}), {}.__getitem__)
    assert (last.withdraw, last.take_back) == ([], [])


# ====================================================================== the worker of each role


def _settings(role: str | None, port: int) -> ConnectorSettings:
    bridge = KVTransferConfig(
        kv_role=role, kv_ip="127.0.0.1", kv_port=port, kv_timeout=5.0, kv_connect_timeout=30.0, kv_buffer_size=1 << 20
    )
    return ConnectorSettings(bridge=bridge, load_timeout=5.0, save_timeout=0.0, lend_blocks=False)


def _identity(role: str) -> compat.KVLayoutInfo:
    return compat.KVLayoutInfo(
        version=compat.VERSION,
        role=role,
        model="fake",
        dtype="",
        block_size=vp.FAKE_BLOCK_SIZE,
        num_layers=0,
        block_shape=(),
        layout="",
        tp_size=1,
        tp_rank=0,
    )


def test_each_role_gets_its_worker_class_and_only_its_methods() -> None:
    port = free_port()
    kinds = {
        role: WorkerSide(_settings(role, port), _identity(role), 0)
        for role in ("kv_producer", "kv_consumer", "kv_both")
    }
    assert [type(worker) for worker in kinds.values()] == [ProducerWorker, ConsumerWorker, DualWorker]
    assert not hasattr(kinds["kv_producer"], "start_loads") and not hasattr(kinds["kv_consumer"], "save")
    assert isinstance(kinds["kv_both"], ProducerWorker) and isinstance(kinds["kv_both"], ConsumerWorker)
    with pytest.raises(KVConfigError, match="kv_role"):
        WorkerSide(_settings(None, port), _identity("kv_producer"), 0)


def test_a_worker_of_both_roles_loads_bit_exact_what_it_saved_over_its_own_listener() -> None:
    """``kv_both``: on the connection it dials it is the consumer, on the one it accepts the producer."""
    caches = vp.fake_caches(5)
    worker = WorkerSide(_settings("kv_both", free_port()), _identity("kv_both"), 0)
    worker.connect(caches, find_layout(caches[0], vp.FAKE_BLOCKS, vp.FAKE_BLOCK_SIZE, "CPU_ATTN/fake"))
    try:
        saved = [cache[[1, 7]].clone() for cache in caches]
        untouched = [cache[[0, 2, 3, 4, 6, 8]].clone() for cache in caches]
        tokens = list(range(40, 40 + 2 * vp.FAKE_BLOCK_SIZE))
        worker.save([SaveSpec("r", tokens, [1, 7])])
        assert worker.take_save_outcomes() == ({"r"}, set())
        failed = vp.load_and_wait(worker, [LoadSpec("r", tokens, [5, 2], skip_blocks=0, wait=True)], timeout=60)
        assert failed == set()
        for cache, blocks, others in zip(caches, saved, untouched, strict=True):
            assert torch.equal(cache[[5, 2]], blocks)
            assert torch.equal(cache[[0, 3, 4, 6, 8]], others[[0, 2, 3, 4, 5]])  # block 2 was written
        assert worker.take_gone() == {"r"}  # its copy was taken, before "r" finished
        assert worker.gauges()["connections"] == 2  # one each way: accepted and dialed
    finally:
        worker.close()


def test_a_loan_that_ends_before_its_request_finishes_is_reported_gone_once() -> None:
    # A prefill request that keeps generating may outlive its entry (kv_entry_timeout counts from the
    # save): announced, it would send its decode request after an entry that is gone.
    lending = LendingInserts()
    worker = vp.fake_worker(
        "kv_producer",
        1,
        vp.FAKE_BLOCK_SIZE,
        vp.fake_caches(1),
        {"kv_lend_blocks": False},
        listener_factory=lambda settings, offset, on_connect: lending,
    )
    try:
        worker.save(SAVES)
        assert worker.take_gone() == set()
        lending.loans[0].end(EXPIRED)  # "stored" expired while its request still runs
        assert worker.take_gone() == {"stored"}
        assert worker.take_gone() == set()  # once
        worker.hold(["stored", "borrowed"])
        lending.loans[1].end(RETURNED)  # "borrowed" finished, then its decode instance took it: not gone
        assert worker.take_gone() == set()
        assert worker.take_finished_sending() == {"stored", "borrowed"}
        lending.loans[2].end(EXPIRED)
        assert worker.take_gone() == {"kept"}
        worker.take_back(["kept"])  # preempted, then saved again from its new blocks: a new entry
        worker.save([SaveSpec("kept", SAVES[2].token_ids, [5])])
        assert worker.take_gone() == set()
        lending.loans[3].end(EVICTED)
        assert worker.take_gone() == {"kept"}
    finally:
        worker.close()
