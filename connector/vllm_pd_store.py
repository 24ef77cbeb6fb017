"""P/D with the storage tier: what vLLM gets for ``kv_role="kv_producer"`` or ``"kv_consumer"`` with ``kv_store``.

A prefill instance looks in the store before it computes, and stores what it computed; a decode
instance takes the longest stored prefix from the store and the rest of the transfer prefix from
its prefill instance, as without a store::

    # prefill instance
    --kv-transfer-config '{"kv_connector": "KVBridgeConnector", "kv_role": "kv_producer", "kv_port": 14579,
        "kv_connector_extra_config": {"kv_ip": "PREFILL_HOST", "kv_store": {"tiers": "disk:/var/cache/kv"}}}'
    # decode instance
    --kv-transfer-config '{"kv_connector": "KVBridgeConnector", "kv_role": "kv_consumer", "kv_port": 14579,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_ip": "PREFILL_HOST", "kv_store": {"tiers": "disk:/var/cache/kv"}}}'

:class:`KVBridgePDStoreConnector` holds both sides of both mechanisms, the pipe's
(:class:`connector.vllm_scheduler.SchedulerSide`, :class:`connector.vllm_worker.WorkerSide`) and the
store's (:class:`connector.vllm_store.StoreScheduler`, :class:`connector.vllm_store.StoreWorker`), and
forwards each of vLLM's hooks to both; ``kv_store`` configures the store, every other key of
``kv_connector_extra_config`` the pipe (``kv_secret_file`` both).

Prefill (``kv_producer``): the store claims the stored prefix beyond vLLM's prefix cache and loads
it asynchronously; vLLM computes the rest; the store saves the full chunks it did not find, and the
pipe saves the transfer prefix (loaded and computed KV alike) into the lookup buffer and announces
it in ``kv_transfer_params``, exactly as without a store. vLLM keeps a finished request's blocks
while either needs them (the pipe may lend them; the store's gather thread may still copy them
out): each side says whether it holds the request, and it is reported finished sending once every
side that holds it is done with it (a second :class:`LoadJoin`).

Decode (``kv_consumer``): the claim is the longer of the stored prefix ``s`` and the transfer prefix
``n`` the prefill instance announced (:class:`PDStoreScheduler`). The store loads the blocks from
vLLM's prefix cache up to ``s``, the pipe the blocks from ``s`` to ``n``: its entry holds the whole
prefix, and the select names only the blocks beyond ``s`` (a span of the entry), so only those
travel; the producer drops the rest with the entry. A request waits until both parts are loaded
(:class:`LoadJoin`); the blocks of a part that failed are reported as load errors (vLLM recomputes
them or fails the request, ``kv_load_failure_policy``). A request with no announcement loads the
stored prefix alone, as a storage tier does. When the store holds the whole transfer prefix, the
pipe's entry is taken and dropped (drained), as when vLLM's own prefix cache holds it.

The store's keys digest each worker's real attention layout, as the storage tier's do: each worker
tells the scheduler its namespace in vLLM's handshake metadata before the first request
(:class:`connector.vllm_store_connector.StoreLayoutHandshake`), so instances of other layouts on
one store keep apart. The pipe sends no handshake metadata: it checks layouts on each connection.

What a decode instance receives over the pipe is not saved into the store: its prefill instance
stores the same chunks itself, but in the background, after the announcement left; so the decode
instance cannot count on them at announce time and takes that part over the pipe, and storing it
a second time would only repeat the prefill instance's writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole

from connector.secret import SECRET_FILE_KEY
from connector.vllm_scheduler import KVBridgeMetadata, SchedulerSide, _announced_prefix
from connector.vllm_stats import KVBridgeStats
from connector.vllm_store import STORE_KEY, StoreMetadata, StoreScheduler, StoreSettings, StoreStats, StoreWorker
from connector.vllm_store_connector import StoreLayoutHandshake, open_store_sides
from connector.vllm_v1 import KVBridgeConnector
from connector.vllm_worker import find_layout
from kv_pipe.errors import KVConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclasses.dataclass
class PDStoreMetadata(KVConnectorMetadata):
    """One step's work for the workers: the pipe's and the store's. Pickled by vLLM between its
    processes (never networked)."""

    pipe: KVBridgeMetadata = dataclasses.field(default_factory=KVBridgeMetadata)
    store: StoreMetadata = dataclasses.field(default_factory=StoreMetadata)


class PDStoreScheduler:
    """The scheduler sides of the pipe and the store, and how a claim is split between them.

    Not thread-safe: vLLM calls the scheduler hooks from one thread.
    """

    def __init__(self, pipe: SchedulerSide, store: StoreScheduler) -> None:
        self.pipe = pipe
        self.store = store
        store.plans_saves = not pipe.is_consumer  # a decode instance does not store: see the module docstring
        self._parts: dict[str, tuple[int, int]] = {}  # req_id -> (store's tokens, pipe's tokens) last claimed

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """The stored prefix beyond vLLM's ``num_computed_tokens``, then (decode instance, announced
        requests only) the rest of the announced transfer prefix from the pipe."""
        stored = self.store.num_new_matched_tokens(request, num_computed_tokens)
        piped = 0
        if self.pipe.is_consumer and _announced_prefix(request.kv_transfer_params):
            # From where the store's part ends: a store that holds the whole prefix has the pipe drain its entry.
            piped = self.pipe.num_new_matched_tokens(request, num_computed_tokens + stored)
        self._parts[request.request_id] = (stored, piped)
        return stored + piped

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """Plan each part's load into the blocks vLLM allocated for the claim."""
        stored, piped = self._parts.pop(request.request_id, (0, 0))
        if num_external_tokens != stored + piped:
            # vLLM adjusted the claim in a way neither plan covers: the side that claimed first refuses
            # it whole (its blocks fail, none is written); the pipe's entry is drained when the request ends.
            (self.store if stored else self.pipe).after_alloc(request, block_ids, num_external_tokens)
            return
        if stored:
            self.store.after_alloc(request, block_ids, stored)
        if piped:
            self.pipe.after_alloc(request, block_ids, piped)

    def build_meta(self, scheduler_output: Any, block_ids_of: Any) -> PDStoreMetadata:
        store = self.store.build_meta(scheduler_output, block_ids_of)
        return PDStoreMetadata(pipe=self.pipe.build_meta(scheduler_output, block_ids_of), store=store)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """vLLM keeps the blocks if the store (a save) or the pipe (a save, maybe lent) holds them;
        the pipe announces the prefix it saved."""
        self._parts.pop(request.request_id, None)
        store_holds, _ = self.store.request_finished(request)
        pipe_holds, params = self.pipe.request_finished(request)
        return store_holds or pipe_holds, params


class LoadJoin:
    """Requests loaded in two parts, one by the store and one by the pipe: each is reported finished
    once both parts are, and the failed blocks of a part are held back until then (vLLM must not
    act on a request whose other part still writes into its blocks). The same for the finished
    requests whose blocks both keep (:meth:`expect_requests`): reported once both are done with them.

    Called from vLLM's model-runner thread only.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, set[int]] = {}  # req_id -> its blocks, while one part is still loading
        self._one_done: set[str] = set()
        self._failed: set[int] = set()  # failed blocks not reported to vLLM yet

    def expect(self, store: StoreMetadata, pipe: KVBridgeMetadata) -> None:
        """Note the requests that this step's metadata loads in two parts (both are planned in the same step)."""
        store_parts = {load.req_id: load.block_ids[load.skip_blocks : load.stop_blocks] for load in store.loads}
        store_parts.update(store.refused)
        pipe_parts = {spec.req_id: spec.block_ids[spec.skip_blocks :] for spec in pipe.loads if not spec.drain}
        pipe_parts.update(pipe.refused)
        for req_id in store_parts.keys() & pipe_parts.keys():
            self._waiting[req_id] = set(store_parts[req_id]) | set(pipe_parts[req_id])

    def expect_requests(self, req_ids: Iterable[str]) -> None:
        """Note requests that both the store and the pipe will report (no blocks to hold back)."""
        for req_id in req_ids:
            self._waiting[req_id] = set()

    def settle(self, store_done: Iterable[str], pipe_done: Iterable[str], failed: set[int]) -> set[str]:
        """The requests to report finished, given the parts that completed (``failed``: their failed blocks)."""
        finished: set[str] = set()
        for req_id in [*store_done, *pipe_done]:
            if req_id not in self._waiting:
                finished.add(req_id)
            elif req_id in self._one_done:
                self._one_done.discard(req_id)
                del self._waiting[req_id]
                finished.add(req_id)
            else:
                self._one_done.add(req_id)
        self._failed |= failed
        return finished

    def take_failed_blocks(self) -> set[int]:
        """Failed blocks of the requests reported so far, each once."""
        held = set().union(*self._waiting.values()) if self._waiting else set()
        ready = self._failed - held
        self._failed &= held
        return ready


class KVBridgePDStoreConnector(StoreLayoutHandshake, KVBridgeConnector):
    """A prefill or decode instance with a store; see the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config
        if transfer.kv_role not in ("kv_producer", "kv_consumer"):
            raise KVConfigError(
                f"kv_store with the pipe needs kv_role 'kv_producer' or 'kv_consumer', got {transfer.kv_role!r}"
            )
        if kv_cache_config is None:
            raise KVConfigError("kvbridge's store needs vLLM's KV cache config (vLLM >= 0.32)")
        settings = StoreSettings.from_extra({key: extra[key] for key in (STORE_KEY, SECRET_FILE_KEY) if key in extra})
        super().__init__(vllm_config, role, kv_cache_config)
        self._store_scheduler, self._store_worker = open_store_sides(settings, vllm_config, role, kv_cache_config)
        self._both: PDStoreScheduler | None = None
        if self._scheduler is not None and self._store_scheduler is not None:
            self._both = PDStoreScheduler(self._scheduler, self._store_scheduler)
        self._join = LoadJoin()
        self._sends = LoadJoin()  # finished requests whose blocks both the store and the pipe keep

    def _pipe_extra(self, extra: Any) -> Any:
        return {key: value for key, value in extra.items() if key != STORE_KEY} if isinstance(extra, Mapping) else extra

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)  # a producer exports the caches in place: the same tensors
        caches = self._require_worker().caches
        layout_name = self._layout_name(next(iter(kv_caches)))
        layout = find_layout(caches[0], self._kv_cache_config.num_blocks, self._block_size, layout_name)
        self._store_side().register(caches, layout, layout_name)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # The pipe takes back the entries of preempted requests and withdraws those never announced; the store
        # cancels or waits for their gathers.
        meta = _pd_metadata(kv_connector_metadata)
        if (producer := self._producer) is not None:
            producer.take_back(meta.pipe.take_back, meta.pipe.withdraw)
        self._store_side().preempt(meta.store.preempted)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._pd_meta()
        self._join.expect(meta.store, meta.pipe)
        if (producer := self._producer) is not None:
            producer.hold(meta.pipe.held)
            self._sends.expect_requests(req_id for req_id in meta.pipe.held if self._store_side().holds(req_id))
        if (consumer := self._consumer) is not None:
            consumer.start_loads(meta.pipe.loads)
            consumer.refuse_loads(meta.pipe.refused)
        self._store_side().start_loads(meta.store.loads, meta.store.refused)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        producer, consumer, store = self._producer, self._consumer, self._store_side()
        pipe_done = consumer.take_finished_loads(finished_req_ids) if consumer is not None else set()
        pipe_failed = consumer.take_failed_blocks() if consumer is not None else set()
        store_done = store.take_finished_loads(finished_req_ids)
        recving = self._join.settle(store_done, pipe_done, pipe_failed | store.take_failed_blocks())
        pipe_sending = producer.take_finished_sending() if producer is not None else set()
        sending = self._sends.settle(store.take_finished_sending(finished_req_ids), pipe_sending, set())
        return sending or None, recving or None

    def wait_for_save(self) -> None:
        meta = self._pd_meta()
        if (producer := self._producer) is not None:
            producer.save(meta.pipe.saves)
        self._store_side().save(meta.store.saves)  # copied out in a thread: see StoreWorker.save

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._join.take_failed_blocks() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        pipe = super().get_kv_connector_stats()
        store = self._store_worker.take_stats() if self._store_worker is not None else None
        if store is None or store.is_empty():
            return pipe
        return store if pipe is None else pipe.aggregate(store)

    def store_stats(self) -> StoreStats:
        """Worker: the store counters since the start (chunks and bytes loaded and saved)."""
        return self._store_side().stats()

    def flush_saves(self, timeout: float = 30.0) -> None:
        """Worker: wait until every save handed to the store so far is in its fastest tier."""
        self._store_side().flush(timeout)

    def shutdown(self) -> None:
        super().shutdown()
        if self._store_worker is not None:
            self._store_worker.close()
        if self._store_scheduler is not None:
            self._store_scheduler.store.close()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = self._both_sides().num_new_matched_tokens(request, num_computed_tokens)
        return tokens, tokens > 0  # loaded asynchronously: vLLM keeps stepping its other requests

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._both_sides().after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        manager = self._kv_cache_manager
        if manager is None:
            raise KVConfigError("kvbridge: vLLM did not bind its KV cache manager to the connector")
        return self._both_sides().build_meta(scheduler_output, lambda req_id: manager.get_block_ids(req_id)[0])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._both_sides().request_finished(request)

    # ------------------------------------------------------------------ helpers

    def _pd_meta(self) -> PDStoreMetadata:
        return _pd_metadata(self._get_connector_metadata())

    def _store_side(self) -> StoreWorker:
        if self._store_worker is None:
            raise KVConfigError("kvbridge: a worker-side hook was called on the scheduler-side connector")
        return self._store_worker

    def _both_sides(self) -> PDStoreScheduler:
        if self._both is None:
            raise KVConfigError("kvbridge: a scheduler-side hook was called on the worker-side connector")
        return self._both


def _pd_metadata(meta: KVConnectorMetadata) -> PDStoreMetadata:
    if not isinstance(meta, PDStoreMetadata):
        raise KVConfigError(f"kvbridge: unexpected connector metadata {type(meta).__name__}")
    return meta
