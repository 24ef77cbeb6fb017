"""Engine bodies for the storage tier's tests: a ``kv_both`` instance with a ``kv_store`` setting.

Run in child processes by :class:`harness.vllm_procs.Engines`, in vLLM's single-process mode, so
that the worker-side connector (its store counters) is reachable from the body.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from harness import vllm_procs as vp
from launch import serve

#: Tokens per stored chunk: two of the tiny model's blocks.
CHUNK_SIZE = 2 * vp.BLOCK_SIZE


def store_transfer_config(tiers: str, failure_policy: str = "recompute", **options: Any) -> dict[str, Any]:
    """What ``kvbridge serve --kv-store`` gives its instances, with the tests' chunk size."""
    return serve.store_transfer_config({"tiers": tiers, "chunk_size": CHUNK_SIZE, **options}, failure_policy)


def store_body(
    model: str, transfer: dict[str, Any], batches: list[list[list[int]]], prefix_caching: bool = True
) -> dict[str, Any]:
    """Serve ``batches`` one after the other; return their outputs and the store counters, once
    every save is in the store's fastest tier. In vLLM's multiprocess mode the worker is out of
    reach: no counters, and the saves are complete once the engine is shut down."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    kwargs = vp.engine_kwargs(model, transfer)
    kwargs["enable_prefix_caching"] = prefix_caching
    llm = vp._llm(kwargs)
    try:
        outputs = [vp._generate(llm, batch, vp.MAX_TOKENS) for batch in batches]
        if not has_kv_transfer_group():
            return {"outputs": outputs, "stats": None}
        connector = get_kv_transfer_group()
        connector.flush_saves()
        return {"outputs": outputs, "stats": dataclasses.asdict(connector.store_stats())}
    finally:
        vp._shutdown(llm)
