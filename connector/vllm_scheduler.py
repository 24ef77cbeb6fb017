"""Scheduler side of the vLLM connector: which blocks to save and to load, per engine step.

It runs in vLLM's scheduler (EngineCore) process and never touches the network: the worker side
owns the pipe. Its only output is :class:`KVBridgeMetadata`, which vLLM hands to every worker.
What moves is stated in :mod:`connector.transfer_plan`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from connector.transfer_plan import PARAMS_KEY, LoadSpec, SaveSpec, transfer_prefix_len

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """What the worker does in one step. Pickled by vLLM between its processes (never networked)."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)


class SchedulerSide:
    """Plans saves (producer role) or loads (consumer role).

    Drains: the producer saves every prompt, and its buffer holds each entry until the consumer
    takes it. When the consumer's own prefix cache already covers a request's whole transfer prefix
    (a repeated prompt), nothing is loaded, but the entry is still taken and dropped, without
    waiting for it, so repeated prompts do not pile up in the producer's buffer.

    Not thread-safe: vLLM calls the scheduler hooks from one thread.
    """

    def __init__(self, block_size: int, is_producer: bool, is_consumer: bool) -> None:
        self.block_size = block_size
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self._unsaved: dict[str, list[int]] = {}  # producer: req_id -> transfer prefix not saved yet
        self._loads: dict[str, LoadSpec] = {}  # consumer: planned, not yet handed to the worker
        self._loaded: set[str] = set()  # consumer: requests that already had their one load attempt
        self._covered: set[str] = set()  # consumer: transfer prefix found in vLLM's prefix cache: drain

    # ------------------------------------------------------------------ consumer

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens the consumer will load beyond the ``num_computed_tokens`` vLLM already holds.

        Side-effect free (vLLM may ask several times). A request is loaded at most once: after a
        preemption or a failed load it is recomputed, never fetched again (its entry is gone).
        """
        if (not self.is_consumer or request.prompt_token_ids is None  # prompt embeds: no token key
                or request.request_id in self._loaded or request.num_preemptions > 0):
            return 0
        prefix = transfer_prefix_len(request.num_prompt_tokens, self.block_size)
        announced = _announced_prefix(request.kv_transfer_params)
        if prefix == 0 or (announced is not None and announced != prefix):
            # The producer said it saved another prefix (nothing, or another block size): no entry.
            return 0
        if num_computed_tokens >= prefix:
            self._covered.add(request.request_id)  # idempotent: asking again changes nothing
            return 0
        self._covered.discard(request.request_id)
        return prefix - num_computed_tokens

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Record the blocks vLLM allocated for a claimed prefix (all of the request's blocks)."""
        if num_external_tokens <= 0:
            return
        prefix = transfer_prefix_len(request.num_prompt_tokens, self.block_size)
        local = prefix - num_external_tokens
        if local < 0 or local % self.block_size or len(block_ids) < prefix // self.block_size:
            # vLLM adjusted the claim in a way this connector does not plan for: recompute.
            logger.warning("kvbridge: unexpected allocation for %s (%d external tokens, prefix %d, %d blocks)",
                           request.request_id, num_external_tokens, prefix, len(block_ids))
            return
        self._loads[request.request_id] = LoadSpec(
            req_id=request.request_id,
            token_ids=list(request.prompt_token_ids[:prefix]),
            block_ids=list(block_ids[: prefix // self.block_size]),
            skip_blocks=local // self.block_size,
            wait=_announced_prefix(request.kv_transfer_params) == prefix,
        )
        self._loaded.add(request.request_id)

    # ------------------------------------------------------------------ both

    def build_meta(self, scheduler_output: Any, block_ids_of: Callable[[str], Sequence[int]]) -> KVBridgeMetadata:
        """The worker's work for this step; resets the planned loads.

        A request is saved in the step that completes its transfer prefix (with chunked prefill,
        the step of the chunk that crosses it); ``block_ids_of`` gives its current block ids.
        """
        meta = KVBridgeMetadata()
        scheduled: Mapping[str, int] = scheduler_output.num_scheduled_tokens
        meta.loads = [spec for req_id, spec in self._loads.items() if req_id in scheduled]
        self._loads.clear()
        for new_req in scheduler_output.scheduled_new_reqs:
            if new_req.req_id in self._covered and new_req.req_id not in self._loaded:
                prompt = new_req.prompt_token_ids or []
                prefix = transfer_prefix_len(len(prompt), self.block_size)
                num_blocks = prefix // self.block_size
                meta.loads.append(LoadSpec(req_id=new_req.req_id, token_ids=list(prompt[:prefix]),
                                           block_ids=list(new_req.block_ids[0][:num_blocks]), skip_blocks=num_blocks))
                self._loaded.add(new_req.req_id)
            self._covered.discard(new_req.req_id)
        if not self.is_producer:
            return meta
        computed: dict[str, int] = {}
        for new_req in scheduler_output.scheduled_new_reqs:
            computed[new_req.req_id] = new_req.num_computed_tokens
            prompt = new_req.prompt_token_ids or []
            prefix = transfer_prefix_len(len(prompt), self.block_size)
            if prefix and new_req.req_id not in self._unsaved:
                self._unsaved[new_req.req_id] = list(prompt[:prefix])
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id in [r for r in self._unsaved if r in scheduled and r in computed]:
            tokens = self._unsaved[req_id]
            if computed[req_id] + scheduled[req_id] < len(tokens):
                continue  # chunked prefill: the prefix is not complete after this step
            blocks = list(block_ids_of(req_id)[: len(tokens) // self.block_size])
            meta.saves.append(SaveSpec(req_id=req_id, token_ids=tokens, block_ids=blocks))
            del self._unsaved[req_id]
        return meta

    def request_finished(self, request: Any) -> dict[str, Any] | None:
        """Forget a finished or aborted request; the producer announces the prefix it saved."""
        req_id = request.request_id
        self._loads.pop(req_id, None)
        self._loaded.discard(req_id)
        self._covered.discard(req_id)
        unsaved = self._unsaved.pop(req_id, None)
        if not self.is_producer:
            return None
        prefix = transfer_prefix_len(request.num_prompt_tokens, self.block_size)
        return {PARAMS_KEY: {"prefix_tokens": 0 if unsaved is not None else prefix}}


def _announced_prefix(params: Mapping[str, Any] | None) -> int | None:
    """The prefix length a producer announced in ``kv_transfer_params``, if any and well-formed."""
    if not isinstance(params, Mapping):
        return None
    entry = params.get(PARAMS_KEY)
    if not isinstance(entry, Mapping):
        return None
    value = entry.get("prefix_tokens")
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value
