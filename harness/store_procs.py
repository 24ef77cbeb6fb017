"""Engine bodies for the storage tier's tests: a ``kv_both`` instance with a ``kv_store`` setting.

Run in child processes by :class:`harness.vllm_procs.Engines`, in vLLM's single-process mode, so
that the worker-side connector (its store counters) is reachable from the body.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from harness import vllm_procs as vp

#: Tokens per stored chunk: two of the tiny model's blocks.
CHUNK_SIZE = 2 * vp.BLOCK_SIZE


def store_transfer_config(tiers: str, failure_policy: str = "recompute", **options: Any) -> dict[str, Any]:
    """A storage-tier instance: ``kv_both`` over a store of ``tiers`` with the tests' chunk size, no
    pipe; a load that fails is recomputed (``failure_policy``)."""
    return {
        "kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "connector.vllm_v1",
        "kv_role": "kv_both",
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": {"kv_store": {"tiers": tiers, "chunk_size": CHUNK_SIZE, **options}},
    }


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


def pd_store_transfer_config(role: str, port: int, tiers: str, failure_policy: str = "recompute") -> dict[str, Any]:
    """A prefill (``kv_producer``) or decode (``kv_consumer``) instance of the tests' pairs with a store
    of ``tiers`` (chunks of :data:`CHUNK_SIZE` tokens)."""
    return vp.kv_transfer_config(
        role, port, failure_policy=failure_policy, kv_store={"tiers": tiers, "chunk_size": CHUNK_SIZE}
    )


def _counters() -> dict[str, Any]:
    """The worker-side connector's pipe and store counters, once every save is in the store (None
    in vLLM's multiprocess mode: the worker is out of reach)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return {"stats": None, "store": None}
    connector = get_kv_transfer_group()
    connector.flush_saves()
    return {"stats": dict(connector.total_stats().data), "store": dataclasses.asdict(connector.store_stats())}


def pd_store_producer_body(
    model: str,
    transfer: dict[str, Any],
    batches: list[list[list[int]]],
    prefilled: vp.Flag,
    consumer_done: vp.Flag,
    timeout: float,
    announce: Any,
) -> dict[str, Any]:
    """Prefill each batch (max_tokens=1) once the saves of the batch before are in the store (vLLM's
    prefix cache off: what a batch reuses comes from the store); put the outputs' kv_transfer_params
    into ``announce``, set ``prefilled``, stay up until the consumer is done."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    kwargs = vp.engine_kwargs(model, transfer)
    kwargs["enable_prefix_caching"] = False
    llm = vp._llm(kwargs)
    try:
        outputs = []
        for batch in batches:
            outputs.append(vp._generate(llm, batch, 1))
            get_kv_transfer_group().flush_saves()
        announce.put([[o["params"] for o in batch] for batch in outputs])
        prefilled.set()
        if not consumer_done.wait(timeout):
            raise TimeoutError(f"the consumer did not finish within {timeout} s")
        return {"outputs": outputs, **_counters(), "entries_left": vp._entries_left()}
    finally:
        vp._shutdown(llm)


def pd_store_consumer_body(
    model: str,
    transfer: dict[str, Any],
    batches: list[list[list[int]]],
    prefilled: vp.Flag,
    consumer_done: vp.Flag,
    timeout: float,
    announced: Any,
) -> dict[str, Any]:
    """Once the producer prefilled, decode each batch with its kv_transfer_params (vLLM's prefix
    cache off: every reused block comes from the store or the pipe)."""
    kwargs = vp.engine_kwargs(model, transfer)
    kwargs["enable_prefix_caching"] = False
    llm = vp._llm(kwargs)
    try:
        if not prefilled.wait(timeout):
            raise TimeoutError(f"the producer did not prefill within {timeout} s")
        params = announced.get(timeout=timeout)
        outputs = [vp._generate(llm, batch, vp.MAX_TOKENS, params[index]) for index, batch in enumerate(batches)]
        return {"outputs": outputs, **_counters()}
    finally:
        consumer_done.set()
        vp._shutdown(llm)


def worker_store_stats(worker: Any) -> dict[str, Any]:
    """Run in each vLLM worker (``LLM.collective_rpc``): its TP rank and store counters, once every
    save it was handed is in the store's fastest tier."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    connector = get_kv_transfer_group()
    connector.flush_saves()
    return {"tp_rank": get_tensor_model_parallel_rank(), **dataclasses.asdict(connector.store_stats())}


def tp_store_body(
    model: str, transfer: dict[str, Any], batches: list[list[list[int]]], tp: int, prefix_caching: bool = True
) -> dict[str, Any]:
    """Serve ``batches`` one after the other at TP size ``tp`` (each rank a worker process, the
    scheduler in this one); return their outputs, each rank's store counters (by rank) and the
    namespaces the scheduler looks up (hex, by rank)."""
    kwargs = vp.engine_kwargs(model, transfer)
    kwargs["enable_prefix_caching"] = prefix_caching
    kwargs["tensor_parallel_size"] = tp
    llm = vp._llm(kwargs)
    try:
        outputs = []
        for batch in batches:
            outputs.append(vp._generate(llm, batch, vp.MAX_TOKENS))
            llm.collective_rpc(worker_store_stats, timeout=60)  # the next batch finds this one's chunks
        stats = sorted(llm.collective_rpc(worker_store_stats, timeout=60), key=lambda ranked: ranked["tp_rank"])
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        spaces = [space.hex() for space in scheduler.connector._store_scheduler.namespaces]
        return {"outputs": outputs, "stats": stats, "namespaces": spaces}
    finally:
        vp._shutdown(llm)


def worker_thread_cores(worker: Any) -> dict[str, list[int]]:
    """Run in a vLLM worker (``LLM.collective_rpc``): the cores each of its Python threads may run on,
    by thread name (``main`` for the worker's main thread), read from the kernel by thread id."""
    import os
    import threading

    cores = {thread.name: sorted(os.sched_getaffinity(thread.native_id)) for thread in threading.enumerate()}
    cores["main"] = sorted(os.sched_getaffinity(threading.main_thread().native_id))
    return cores


def worker_process_store_body(model: str, transfer: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    """Serve ``prompts`` with the model in a vLLM worker process (TP 1 on vLLM's multiprocess
    executor, which binds the worker as ``VLLM_CPU_OMP_THREADS_BIND`` says); return the outputs and,
    once every save is in the store, the cores of the worker's threads (:func:`worker_thread_cores`)."""
    kwargs = vp.engine_kwargs(model, transfer)
    kwargs["distributed_executor_backend"] = "mp"
    llm = vp._llm(kwargs)
    try:
        outputs = vp._generate(llm, prompts, vp.MAX_TOKENS)
        llm.collective_rpc(worker_store_stats, timeout=60)  # every save done: its threads have run
        (threads,) = llm.collective_rpc(worker_thread_cores, timeout=60)
        return {"outputs": outputs, "threads": threads}
    finally:
        vp._shutdown(llm)


class _Lines(logging.Handler):
    """Keeps the messages of the records it handles."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def store_rounds_body(
    model: str, transfer: dict[str, Any], prompts: list[list[int]], rounds: Any, answers: Any, timeout: float
) -> dict[str, Any]:
    """Serve ``prompts`` once for every ``True`` taken from the queue ``rounds`` (``False``: stop), vLLM's
    prefix cache off; after each round put into ``answers`` its tokens, the store counters, whether the
    worker's Redis tier is up (what the ``store_tier_up`` gauge reports) and the Redis tier's log lines
    so far (the scheduler's and the worker's tier alike)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    lines = _Lines()
    redis_log = logging.getLogger("kv_store.redis_tier")
    redis_log.setLevel(logging.INFO)
    redis_log.addHandler(lines)
    kwargs = vp.engine_kwargs(model, transfer)
    kwargs["enable_prefix_caching"] = False
    llm = vp._llm(kwargs)
    try:
        connector = get_kv_transfer_group()
        while rounds.get(timeout=timeout):
            outputs = vp._generate(llm, prompts, vp.MAX_TOKENS)
            connector.flush_saves()
            answers.put(
                {
                    "tokens": [o["tokens"] for o in outputs],
                    "finish": [o["finish"] for o in outputs],
                    "stats": dataclasses.asdict(connector.store_stats()),
                    "up": connector._store_worker.store.stats().tiers["redis"].up,
                    "log": list(lines.messages),
                }
            )
        return {}
    finally:
        vp._shutdown(llm)
