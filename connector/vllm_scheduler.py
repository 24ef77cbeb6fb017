"""Scheduler side of the vLLM connector: which blocks to save and to load, per engine step.

It runs in vLLM's scheduler (EngineCore) process and never touches the network: the worker side
owns the pipe. Its output is :class:`KVBridgeMetadata`, which vLLM hands to every worker; the
workers answer with :class:`KVBridgeWorkerMetadata` (which saves succeeded). What moves is stated
in :mod:`connector.transfer_plan`.

Announcing only what was saved: a prefill request (``max_tokens=1``) usually finishes in the very
step whose worker saves its KV, and vLLM calls ``request_finished`` for it *before* it hands that
step's worker outcomes to ``update_connector_output`` (both within one ``update_from_output``
call, before the step's outputs leave the engine core). So ``request_finished`` returns an
announcement of 0 tokens for a save still in flight and keeps it; :meth:`SchedulerSide.record_saves`
then sets the saved prefix into that same announcement if, and only if, every worker saved its
share. An outcome that comes later than that (vLLM defers ``wait_for_save`` past the step's
output only for draft-model speculative decoding) leaves the announcement at 0: the decode
instance then computes the prompt itself rather than wait for KV that may not exist.

Announcing nothing for an entry known gone: a saved request may lose its entry, copy or loan,
before it finishes (evicted from a full buffer, expired: ``kv_entry_timeout`` counts from the save,
or taken by a select for the same tokens). Its workers report it gone
(:attr:`KVBridgeWorkerMetadata.gone`), and the request is then announced with 0 tokens: the decode
instance computes the prompt at once instead of claiming blocks for a certain miss. A report that
comes in the step the request finishes still changes its announcement in place.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from connector.transfer_plan import PARAMS_KEY, LoadSpec, SaveSpec, transfer_prefix_len
from connector.vllm_settings import MAX_TP_SIZE

logger = logging.getLogger(__name__)

#: Longest host name accepted in ``kv_transfer_params`` (DNS names are at most 253 characters).
MAX_HOST_CHARS = 255


@dataclasses.dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """What the worker does in one step. Pickled by vLLM between its processes (never networked)."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)
    #: Claimed requests this connector cannot load (an allocation it does not plan for): vLLM waits
    #: for them all the same, so the worker reports them finished at once with these blocks failed.
    refused: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    #: Finished requests whose blocks vLLM keeps until the workers report them finished sending:
    #: every request that was handed to them to save (its blocks may be lent).
    held: list[str] = dataclasses.field(default_factory=list)
    #: Saved requests vLLM preempted (their blocks are freed, and may be written by this very step):
    #: the workers take their lent entries back before this step writes a block, and keep their
    #: copies for the request's next save.
    take_back: list[str] = dataclasses.field(default_factory=list)
    #: Saved requests that will not be announced (announced with 0 tokens: not every TP rank saved
    #: its share, or a rank's entry is gone): nobody asks for them, so the workers take back their
    #: entries, lent or copied, in the same hook.
    withdraw: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KVBridgeWorkerMetadata(KVConnectorWorkerMetadata):
    """The workers' save outcomes of one step; vLLM aggregates those of all TP ranks.

    ``saved`` counts, per request id, the ranks that saved their share; ``failed`` holds the ids
    that at least one rank could not save; ``gone`` those whose saved entry left at least one rank's
    buffer before the request finished. Pickled by vLLM between its processes (never networked).
    """

    saved: dict[str, int] = dataclasses.field(default_factory=dict)
    failed: set[str] = dataclasses.field(default_factory=set)
    gone: set[str] = dataclasses.field(default_factory=set)

    @classmethod
    def of_one_worker(cls, saved: set[str], failed: set[str], gone: set[str] = frozenset()) -> KVBridgeWorkerMetadata:
        """One rank's outcomes (:meth:`connector.vllm_producer_worker.ProducerWorker.take_save_outcomes` and
        :meth:`~connector.vllm_producer_worker.ProducerWorker.take_gone`)."""
        return cls(saved=dict.fromkeys(saved, 1), failed=set(failed), gone=set(gone))

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVBridgeWorkerMetadata:
        if not isinstance(other, KVBridgeWorkerMetadata):
            raise TypeError(f"cannot aggregate kvbridge worker metadata with {type(other).__name__}")
        saved = dict(self.saved)
        for req_id, ranks in other.saved.items():
            saved[req_id] = saved.get(req_id, 0) + ranks
        return KVBridgeWorkerMetadata(saved=saved, failed=self.failed | other.failed, gone=self.gone | other.gone)


class SchedulerSide:
    """Plans saves (producer role) or loads (consumer role).

    Drains: the producer saves every prompt, and its buffer holds each entry until the consumer
    takes it. When the consumer's own prefix cache already covers a request's whole transfer prefix
    (a repeated prompt), nothing is loaded, but the entry is still taken and dropped, without
    waiting for it, so repeated prompts do not pile up in the producer's buffer.

    Not thread-safe: vLLM calls the scheduler hooks from one thread.
    """

    def __init__(
        self,
        block_size: int,
        is_producer: bool,
        is_consumer: bool,
        num_workers: int = 1,
        address: tuple[str, int] = ("127.0.0.1", 14579),
        engine_id: str = "",
    ) -> None:
        self.block_size = block_size
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.num_workers = num_workers  # TP ranks: a request is saved when all of them saved their share
        self.address = address  # producer: where its workers listen (kv_ip, kv_port), announced with each prefix
        self.engine_id = engine_id
        self._prefixes: dict[str, list[int]] = {}  # producer: req_id -> transfer prefix tokens, until finished
        self._unsaved: dict[str, None] = {}  # producer: requests whose transfer prefix is not saved yet, in order
        self._saving: dict[str, int] = {}  # producer: req_id -> prefix tokens handed to the workers
        self._saved: dict[str, int] = {}  # producer: prefix tokens the workers saved (0: failed), still running
        self._pending: dict[str, tuple[dict[str, int], int]] = {}  # producer: announcement, prefix in flight
        self._finishing: dict[str, dict[str, Any]] = {}  # producer: announcements of this step's finished requests
        self._loads: dict[str, LoadSpec] = {}  # consumer: planned, not yet handed to the worker
        self._refused: dict[str, list[int]] = {}  # consumer: claimed but not loadable, not yet handed over
        self._loaded: set[str] = set()  # consumer: requests that already had their one load attempt
        # consumer: transfer prefix found in vLLM's prefix cache: drain it at the producer named here
        # (address and TP size, if announced)
        self._covered: dict[str, tuple[tuple[str, int] | None, int | None]] = {}
        self._held: list[str] = []  # producer: finished requests whose blocks vLLM keeps, not yet told
        self._abandoned: list[LoadSpec] = []  # consumer: entries of requests finished before their load, to drain
        self._take_back: list[str] = []  # producer: preempted saved requests, not yet told
        self._withdraw: list[str] = []  # producer: saved requests announced with 0 tokens, not yet told

    # ------------------------------------------------------------------ consumer

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens the consumer will load beyond the ``num_computed_tokens`` vLLM already holds.

        Side-effect free (vLLM may ask several times). A request is loaded at most once: after a
        preemption or a failed load it is recomputed, never fetched again (its entry is gone).
        """
        if (
            not self.is_consumer
            or request.prompt_token_ids is None  # prompt embeds: no token key
            or request.request_id in self._loaded
            or request.num_preemptions > 0
        ):
            return 0
        prefix = transfer_prefix_len(request.num_prompt_tokens, self.block_size)
        announced = _announced_prefix(request.kv_transfer_params)
        if prefix == 0 or (announced is not None and announced != prefix):
            # The producer said it saved another prefix (nothing, or another block size): no entry.
            return 0
        try:
            producer = announced_producer(request.kv_transfer_params)
            producer_tp = announced_tp_size(request.kv_transfer_params)
        except ValueError as exc:
            logger.warning("kvbridge: request %s loads nothing: %s", request.request_id, exc)
            return 0
        if num_computed_tokens >= prefix:
            self._covered[request.request_id] = (producer, producer_tp)  # idempotent: asking again changes nothing
            return 0
        self._covered.pop(request.request_id, None)
        return prefix - num_computed_tokens

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Record the blocks vLLM allocated for a claimed prefix (all of the request's blocks)."""
        if num_external_tokens <= 0:
            return
        prefix = transfer_prefix_len(request.num_prompt_tokens, self.block_size)
        local = prefix - num_external_tokens
        if local < 0 or local % self.block_size or len(block_ids) < prefix // self.block_size:
            # vLLM adjusted the claim in a way this connector does not plan for: its blocks fail.
            logger.warning(
                "kvbridge: unexpected allocation for %s (%d external tokens, prefix %d, %d blocks)",
                request.request_id,
                num_external_tokens,
                prefix,
                len(block_ids),
            )
            self._refused[request.request_id] = list(block_ids)
            self._loaded.add(request.request_id)
            return
        self._loads[request.request_id] = LoadSpec(
            req_id=request.request_id,
            token_ids=list(request.prompt_token_ids[:prefix]),
            block_ids=list(block_ids[: prefix // self.block_size]),
            skip_blocks=local // self.block_size,
            wait=_announced_prefix(request.kv_transfer_params) == prefix,
            producer=announced_producer(request.kv_transfer_params),
            producer_tp=announced_tp_size(request.kv_transfer_params),
        )
        self._loaded.add(request.request_id)

    # ------------------------------------------------------------------ both

    def build_meta(self, scheduler_output: Any, block_ids_of: Callable[[str], Sequence[int]]) -> KVBridgeMetadata:
        """The worker's work for this step; resets the planned loads.

        A request is saved in the step that completes its transfer prefix (with chunked prefill,
        the step of the chunk that crosses it); ``block_ids_of`` gives its current block ids.

        Preemption: vLLM frees a preempted request's blocks without a connector call and may give
        them to the requests of this very step, whose forward pass writes them. So the entry of a
        saved request that vLLM lists as preempted is taken back by the workers in vLLM's
        ``handle_preemptions``, before this step writes any block
        (:meth:`connector.vllm_producer_worker.ProducerWorker.take_back`), and the request is saved
        again from its new blocks once it has recomputed its prefix.
        """
        meta = KVBridgeMetadata()
        for req_id in self._pending:
            logger.warning(
                "kvbridge: the save outcome of request %s came after its announcement left the engine: "
                "announced 0 tokens (the decode instance computes the prompt)",
                req_id,
            )
        self._pending.clear()
        self._finishing.clear()  # their announcements have left the engine
        scheduled: Mapping[str, int] = scheduler_output.num_scheduled_tokens
        # Loads are asynchronous: their requests wait for them unscheduled.
        meta.loads = list(self._loads.values())
        self._loads.clear()
        meta.refused, self._refused = self._refused, {}
        meta.loads.extend(self._abandoned)
        self._abandoned.clear()
        meta.held, self._held = self._held, []
        if self.is_producer:
            for req_id in scheduler_output.preempted_req_ids or ():
                self._preempted(req_id)
        meta.take_back, self._take_back = self._take_back, []
        meta.withdraw, self._withdraw = self._withdraw, []
        for new_req in scheduler_output.scheduled_new_reqs:
            if new_req.req_id in self._covered and new_req.req_id not in self._loaded:
                prompt = new_req.prompt_token_ids or []
                prefix = transfer_prefix_len(len(prompt), self.block_size)
                num_blocks = prefix // self.block_size
                producer, producer_tp = self._covered[new_req.req_id]
                meta.loads.append(
                    LoadSpec(
                        req_id=new_req.req_id,
                        token_ids=list(prompt[:prefix]),
                        block_ids=list(new_req.block_ids[0][:num_blocks]),
                        skip_blocks=num_blocks,
                        producer=producer,
                        producer_tp=producer_tp,
                    )
                )
                self._loaded.add(new_req.req_id)
            self._covered.pop(new_req.req_id, None)
        if not self.is_producer:
            return meta
        computed: dict[str, int] = {}
        for new_req in scheduler_output.scheduled_new_reqs:
            computed[new_req.req_id] = new_req.num_computed_tokens
            prompt = new_req.prompt_token_ids or []
            prefix = transfer_prefix_len(len(prompt), self.block_size)
            if prefix and new_req.req_id not in self._prefixes:
                self._prefixes[new_req.req_id] = list(prompt[:prefix])
                self._unsaved[new_req.req_id] = None
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id in [r for r in self._unsaved if r in scheduled and r in computed]:
            tokens = self._prefixes[req_id]
            if computed[req_id] + scheduled[req_id] < len(tokens):
                continue  # chunked prefill: the prefix is not complete after this step
            blocks = list(block_ids_of(req_id)[: len(tokens) // self.block_size])
            meta.saves.append(SaveSpec(req_id=req_id, token_ids=tokens, block_ids=blocks))
            self._saving[req_id] = len(tokens)
            del self._unsaved[req_id]
        return meta

    def _preempted(self, req_id: str) -> None:
        """vLLM preempted ``req_id`` and freed its blocks: take its entry back, save it again later."""
        if req_id not in self._prefixes:
            return
        if self._saving.pop(req_id, None) is not None or self._saved.pop(req_id, None) is not None:
            self._take_back.append(req_id)
        self._unsaved[req_id] = None

    def record_saves(self, outcomes: KVBridgeWorkerMetadata) -> None:
        """Take in the workers' save outcomes of a step (see the module docstring)."""
        for req_id in outcomes.failed | outcomes.saved.keys():
            saved = (
                req_id not in outcomes.failed
                and req_id not in outcomes.gone
                and outcomes.saved.get(req_id, 0) >= self.num_workers
            )
            if req_id in self._pending:
                announcement, prefix = self._pending.pop(req_id)
                announcement["prefix_tokens"] = prefix if saved else 0
            elif req_id in self._saving:
                prefix = self._saving.pop(req_id)
                self._saved[req_id] = prefix if saved else 0
            else:
                continue  # a late outcome of a request already announced (see build_meta), preempted or aborted
            if not saved and outcomes.saved.get(req_id, 0) > 0:
                self._withdraw.append(req_id)  # announced with 0 tokens: the ranks that saved hold it for nobody
        for req_id in outcomes.gone - outcomes.failed - outcomes.saved.keys():
            if self._saved.get(req_id):
                self._saved[req_id] = 0
            elif req_id in self._finishing:
                self._finishing.pop(req_id)["prefix_tokens"] = 0
            else:
                continue  # announced already, or with 0 tokens
            self._withdraw.append(req_id)  # the ranks whose share is still there hold it for nobody

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Forget a finished or aborted request. The producer announces the prefix it saved, and
        has vLLM keep the blocks of every request its workers were asked to save (they may be lent)
        until the workers report it finished sending."""
        req_id = request.request_id
        if self.is_consumer and req_id not in self._loaded:
            self._drain_abandoned(request)
        handed_to_workers = req_id in self._saving or req_id in self._saved
        self._loads.pop(req_id, None)
        self._refused.pop(req_id, None)
        self._loaded.discard(req_id)
        self._covered.pop(req_id, None)
        self._prefixes.pop(req_id, None)
        self._unsaved.pop(req_id, None)
        in_flight = self._saving.pop(req_id, None)
        host, port = self.address
        announcement = {
            "prefix_tokens": self._saved.pop(req_id, 0),
            "host": host,
            "port": port,
            "engine_id": self.engine_id,
            "tp_size": self.num_workers,
        }
        if not self.is_producer:
            return False, None
        if in_flight is not None:
            self._pending[req_id] = (announcement, in_flight)
        elif announcement["prefix_tokens"]:
            self._finishing[req_id] = announcement
        if handed_to_workers:
            self._held.append(req_id)
        return handed_to_workers, {PARAMS_KEY: announcement}

    def _drain_abandoned(self, request: Any) -> None:
        """A request finished (aborted) before its load began: have the worker take and drop the entry
        its producer announced, so that it does not wait there for nobody."""
        if request.prompt_token_ids is None:
            return
        prefix = transfer_prefix_len(request.num_prompt_tokens, self.block_size)
        if prefix == 0 or _announced_prefix(request.kv_transfer_params) != prefix:
            return
        try:
            producer = announced_producer(request.kv_transfer_params)
            producer_tp = announced_tp_size(request.kv_transfer_params)
        except ValueError:
            return
        self._abandoned.append(
            LoadSpec(
                req_id=request.request_id,
                token_ids=list(request.prompt_token_ids[:prefix]),
                block_ids=[],
                skip_blocks=0,
                producer=producer,
                producer_tp=producer_tp,
            )
        )


def _announcement(params: Mapping[str, Any] | None) -> Mapping[str, Any]:
    entry = params.get(PARAMS_KEY) if isinstance(params, Mapping) else None
    return entry if isinstance(entry, Mapping) else {}


def _announced_prefix(params: Mapping[str, Any] | None) -> int | None:
    """The prefix length a producer announced in ``kv_transfer_params``, if any and well-formed."""
    value = _announcement(params).get("prefix_tokens")
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def announced_producer(params: Mapping[str, Any] | None) -> tuple[str, int] | None:
    """The (host, port) of the producer that announced ``kv_transfer_params``, if named and well-formed.

    Raises:
        ValueError: the parameters (from a client or a router) name a malformed address; the
            request then loads nothing, rather than wait at a producer that does not hold it.
    """
    announcement = _announcement(params)
    host, port = announcement.get("host"), announcement.get("port")
    if host is None and port is None:
        return None
    if (
        isinstance(host, str)
        and 0 < len(host) <= MAX_HOST_CHARS
        and host.isprintable()
        and " " not in host
        and isinstance(port, int)
        and not isinstance(port, bool)
        and 1 <= port <= 65535
    ):
        return host, port
    raise ValueError(
        f"malformed producer address in kv_transfer_params: host {str(host)[:80]!r}, port {str(port)[:20]!r}"
    )


def announced_tp_size(params: Mapping[str, Any] | None) -> int | None:
    """The TP size of the producer that announced ``kv_transfer_params``, if it said (None: an
    announcement without it, e.g. from an older producer, or no announcement).

    Raises:
        ValueError: the parameters name a TP size that is not an integer from 1 to
            :data:`connector.vllm_settings.MAX_TP_SIZE`; the request then loads nothing.
    """
    value = _announcement(params).get("tp_size")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TP_SIZE:
        raise ValueError(f"malformed producer TP size in kv_transfer_params: {str(value)[:20]!r}")
    return value
