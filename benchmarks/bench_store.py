"""The storage tier against recomputing: does loading a document's stored KV beat prefilling it again?

A document-QA workload on in-process vLLM CPU engines (``vllm.LLM``, single-process mode, one core),
greedy, with a model whose KV is heavy and whose body is light (``make_heavy_kv_llama``: 128 KiB of
KV per token in fp32): ``--documents`` documents of ``--doc-tokens`` random token ids (seeded), each
asked ``--rounds`` times, every round with another short question appended. vLLM's own KV cache
holds about one and a half documents, fewer than there are, so its prefix cache alone misses when
the documents come back.

Instances, one after another, each in its own process:

* ``plain``: no connector, prefix caching off: every prompt recomputed (the baseline of every ratio);
* ``plain + prefix cache``: the same with vLLM's prefix caching on (its later rounds);
* for each tier of ``--tiers``, a ``kv_both`` instance with kvbridge's store: its first round with
  the store empty (``cold``), its later rounds (``warm``); for ``disk`` and ``redis`` also a new
  instance, which never saw the documents, on the same store (``new instance``). ``memory`` is the
  worker's memory tier over a disk tier (the scheduler finds chunks in the shared tiers only);
  ``redis`` is a redis-server started for the run.

Measured per row: TTFT p50/p99 (sequential requests; the time from adding a request to the engine
step that returns its first token), requests per second (each request generates 8 tokens, 4 with
``--quick``), the hit rate (prompt tokens loaded from the store, from the connector's
``store_stats()``, over the prompt tokens), the load rate (bytes loaded over the row's summed
TTFT: a lower bound, since a TTFT also computes the question), and every answer's tokens against
the plain instance's (mismatches).
Ratios are to the plain instance's TTFT p50; the targets column holds the product's: a warm round
at most 0.25x from the memory tier and 0.35x from Redis or a new instance, a cold round within 5 %.
Exits 1 when an answer differs.

    python -m benchmarks.bench_store [--quick] [--documents N] [--doc-tokens T] [--rounds R]
        [--tiers memory,disk,redis]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import redis_servers
from harness import vllm_procs as vp

#: make_heavy_kv_llama's KV per token: 8 layers x 16 KV heads x 128 dims x (K, V) x 4 bytes.
KV_BYTES_PER_TOKEN = 8 * 16 * 128 * 2 * 4
#: vLLM's own KV cache holds this many of the longest prompts.
CACHED_PROMPTS = 1.5
QUESTION_TOKENS = 16
CHUNK_SIZE = 256
ENGINE_TIMEOUT = 1800.0
#: The product's targets, as a fraction of the recompute baseline's TTFT p50: a warm hit from the
#: memory tier, one from Redis or from an instance that never saw the prompt, and a cold round.
WARM_MEMORY, WARM_SHARED, COLD = 0.25, 0.35, 1.05


@dataclasses.dataclass(frozen=True)
class Workload:
    documents: int = 8
    doc_tokens: int = 2000
    rounds: int = 3
    answer_tokens: int = 8

    @property
    def max_model_len(self) -> int:
        return -(-(self.doc_tokens + QUESTION_TOKENS + self.answer_tokens) // vp.BLOCK_SIZE) * vp.BLOCK_SIZE

    @property
    def kv_cache_bytes(self) -> int:
        blocks = int(CACHED_PROMPTS * self.max_model_len) // vp.BLOCK_SIZE
        return blocks * vp.BLOCK_SIZE * KV_BYTES_PER_TOKEN

    @property
    def store_bytes(self) -> int:
        """Room for every document's chunks, twice over."""
        return 2 * self.documents * self.doc_tokens * KV_BYTES_PER_TOKEN


QUICK = Workload(documents=3, doc_tokens=512, rounds=2, answer_tokens=4)


def prompts(workload: Workload, seed: int = 0) -> list[list[list[int]]]:
    """Per round, per document: the document followed by that round's question."""
    rng = random.Random(seed)
    documents = [[rng.randrange(5, vp.VOCAB) for _ in range(workload.doc_tokens)] for _ in range(workload.documents)]
    rounds = []
    for _ in range(workload.rounds):
        questions = [[rng.randrange(5, vp.VOCAB) for _ in range(QUESTION_TOKENS)] for _ in documents]
        rounds.append([document + question for document, question in zip(documents, questions, strict=True)])
    return rounds


# ---------------------------------------------------------------------- engine body (a child process)


def _ask(engine: Any, request_id: str, prompt: list[int], answer_tokens: int,
         timeout: float = 600) -> tuple[float, list[int]]:
    """One request alone in the engine: (seconds to its first token, its tokens)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=answer_tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
    ttft, tokens = None, []
    while engine.has_unfinished_requests():
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"request {request_id} not finished within {timeout} s")
        for output in engine.step():
            tokens = list(output.outputs[0].token_ids)
            if ttft is None and tokens:
                ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError(f"request {request_id} generated no token")
    return ttft, tokens


def _settle(connector: Any, timeout: float = 120) -> None:
    """Until every save so far is in every tier (the scheduler looks chunks up in the slower ones)."""
    connector.flush_saves(timeout)
    store = connector._worker_side().store  # the worker's TieredStore: its tiers' counters
    deadline = time.monotonic() + timeout
    while True:
        stats = store.stats()
        held = [tier.bytes_stored for tier in stats.tiers.values()]
        if all(size == held[0] for size in held) or any(stats.dropped_writes.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the store's slower tiers did not catch up within {timeout} s: {held}")
        time.sleep(0.05)


def engine_body(model: str, workload: Workload, rounds: list[list[list[int]]], tiers: str | None,
                prefix_caching: bool) -> list[dict[str, Any]]:
    """Serve ``rounds`` one after the other, each prompt alone; per round its TTFTs, wall time,
    answers and the store's counters it added."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    transfer = None
    if tiers is not None:
        transfer = {"kv_connector": vp.KVBRIDGE_CONNECTOR[0], "kv_connector_module_path": vp.KVBRIDGE_CONNECTOR[1],
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"kv_store": {"tiers": tiers, "chunk_size": CHUNK_SIZE,
                                                               "memory_bytes": workload.store_bytes,
                                                               "disk_bytes": workload.store_bytes}}}
    kwargs = vp.engine_kwargs(model, transfer)
    kwargs.update(enable_prefix_caching=prefix_caching, max_model_len=workload.max_model_len,
                  kv_cache_memory_bytes=workload.kv_cache_bytes, max_num_batched_tokens=workload.max_model_len)
    llm = vp._llm(kwargs)
    try:
        engine = llm.llm_engine
        connector = get_kv_transfer_group() if tiers is not None else None
        # An untimed first request: the first forward passes of an engine are slower.
        _ask(engine, "warmup", random.Random(-1).choices(range(5, vp.VOCAB), k=workload.doc_tokens), 2)
        results = []
        for index, batch in enumerate(rounds):
            before = connector.store_stats() if connector is not None else None
            start = time.perf_counter()
            asked = [_ask(engine, f"r{index}-d{doc}", prompt, workload.answer_tokens)
                     for doc, prompt in enumerate(batch)]
            wall = time.perf_counter() - start
            loaded = chunks = 0
            if connector is not None:
                after = connector.store_stats()
                loaded = after.bytes_loaded - before.bytes_loaded
                chunks = after.chunks_loaded - before.chunks_loaded
                _settle(connector)
            results.append({"ttft": [ttft for ttft, _ in asked], "tokens": [tokens for _, tokens in asked],
                            "wall": wall, "bytes_loaded": loaded,
                            "tokens_loaded": chunks * CHUNK_SIZE})
        return results
    finally:
        vp._shutdown(llm)


# ---------------------------------------------------------------------- rows


@dataclasses.dataclass
class Row:
    name: str
    rounds: list[dict[str, Any]]
    prompts: list[list[list[int]]]
    target: tuple[str, float] | None = None  # ("cold" | "warm", fraction of the baseline's TTFT p50)

    @property
    def ttfts(self) -> list[float]:
        return [ttft for result in self.rounds for ttft in result["ttft"]]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def mismatches(row: Row, reference: dict[tuple[int, ...], list[int]]) -> int:
    return sum(reference[tuple(prompt)] != tokens
               for batch, result in zip(row.prompts, row.rounds, strict=True)
               for prompt, tokens in zip(batch, result["tokens"], strict=True))


def table(rows: list[Row], reference: dict[tuple[int, ...], list[int]]) -> tuple[str, int]:
    """The table, and the mismatches in all."""
    baseline = statistics.median(rows[0].ttfts)
    header = ("setup", "requests", "TTFT p50 ms", "TTFT p99 ms", "x recompute", "req/s", "hit rate", "load GB/s",
              "mismatches", "target")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    wrong = 0
    for row in rows:
        ttfts = row.ttfts
        p50 = statistics.median(ttfts)
        ratio = p50 / baseline
        prompt_tokens = sum(len(prompt) for batch in row.prompts for prompt in batch)
        loaded = sum(result["bytes_loaded"] for result in row.rounds)
        hit = sum(result["tokens_loaded"] for result in row.rounds) / prompt_tokens
        rate = f"{loaded / sum(ttfts) / 1e9:.2f}" if loaded else "-"
        target = "-"
        if row.target is not None:
            kind, limit = row.target
            target = f"{'<=' if kind == 'warm' else 'within'} {limit:.2f}x: {'met' if ratio <= limit else 'MISSED'}"
        row_wrong = mismatches(row, reference)
        wrong += row_wrong
        cells = (row.name, str(len(ttfts)), f"{p50 * 1e3:.1f}", f"{percentile(ttfts, 0.99) * 1e3:.1f}",
                 f"{ratio:.2f}x", f"{len(ttfts) / sum(r['wall'] for r in row.rounds):.2f}", f"{hit:.0%}", rate,
                 str(row_wrong), target)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), wrong


def plan(workload: Workload, tiers: list[str], directory: Path, redis_url: str | None
         ) -> list[tuple[str, str | None, bool, list[int]]]:
    """Instances in order: (name, store tiers or None, prefix caching, rounds it serves)."""
    every, later = list(range(workload.rounds)), list(range(1, workload.rounds))
    instances: list[tuple[str, str | None, bool, list[int]]] = [("plain", None, False, every),
                                                                 ("plain + prefix cache", None, True, every)]
    for tier in tiers:
        spec = {"memory": f"memory,disk:{directory / 'memory'}", "disk": f"disk:{directory / 'disk'}",
                "redis": redis_url}[tier]
        instances.append((tier, spec, True, every))
        if tier != "memory":
            instances.append((f"{tier}, new instance", spec, True, later))
    return instances


def rows_of(name: str, served: list[int], results: list[dict[str, Any]], rounds: list[list[list[int]]]
            ) -> list[Row]:
    """The rows one instance gives: plain rows whole, plain + prefix cache its later rounds, a store
    instance its cold round and its warm rounds (a new instance: warm only)."""
    by_round = dict(zip(served, results, strict=True))
    later = [index for index in served if index > 0]
    if name == "plain":
        return [Row("plain (recompute)", results, [rounds[i] for i in served])]
    if name == "plain + prefix cache":
        return [Row("plain + prefix cache, later rounds", [by_round[i] for i in later], [rounds[i] for i in later])]
    out = []
    if 0 in served:
        out.append(Row(f"{name}, cold", [by_round[0]], [rounds[0]], ("cold", COLD)))
    if later:
        new_instance = name.endswith("new instance")
        limit = WARM_MEMORY if name == "memory" else WARM_SHARED if new_instance or name == "redis" else None
        out.append(Row(name if new_instance else f"{name}, warm", [by_round[i] for i in later],
                       [rounds[i] for i in later], ("warm", limit) if limit is not None else None))
    return out


def run(workload: Workload, tiers: list[str]) -> tuple[str, int]:
    """The table of every instance's rows, and the mismatches in all."""
    from tqdm import tqdm

    rounds = prompts(workload)
    with tempfile.TemporaryDirectory(prefix="bench-store-") as scratch, vp.Engines() as engines:
        directory = Path(scratch)
        model = vp.make_heavy_kv_llama(directory / "model", max_positions=max(2048, workload.max_model_len))
        redis = redis_servers.start_server(directory / "redis") if "redis" in tiers else None
        try:
            rows: list[Row] = []
            instances = plan(workload, tiers, directory, redis.url if redis else None)
            for index, (name, spec, caching, served) in enumerate(tqdm(instances, desc="instances",
                                                                        file=sys.stderr)):
                engines.start(f"{index}", engine_body, vp.engine_env(0), model=model, workload=workload,
                              rounds=[rounds[i] for i in served], tiers=spec, prefix_caching=caching)
                results = engines.wait([f"{index}"], ENGINE_TIMEOUT)[f"{index}"]
                rows.extend(rows_of(name, served, results, rounds))
        finally:
            if redis is not None:
                redis.kill()
    reference = {tuple(prompt): tokens for batch, result in zip(rounds, rows[0].rounds, strict=True)
                 for prompt, tokens in zip(batch, result["tokens"], strict=True)}
    return table(rows, reference)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of a few minutes")
    parser.add_argument("--documents", type=int, help=f"documents (default {Workload.documents}, quick "
                                                      f"{QUICK.documents})")
    parser.add_argument("--doc-tokens", type=int, help=f"tokens per document (default {Workload.doc_tokens})")
    parser.add_argument("--rounds", type=int, help=f"times each document is asked (default {Workload.rounds})")
    parser.add_argument("--tiers", default="memory,disk,redis", help="store tiers to measure, of memory,disk,redis")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else Workload()
    workload = dataclasses.replace(base, **{key: value for key, value in (
        ("documents", args.documents), ("doc_tokens", args.doc_tokens), ("rounds", args.rounds)) if value is not None})
    tiers = [tier.strip() for tier in args.tiers.split(",") if tier.strip()]
    if unknown := set(tiers) - {"memory", "disk", "redis"}:
        parser.error(f"unknown tiers {sorted(unknown)}: choose from memory, disk, redis")
    if workload.rounds < 2 or workload.documents * workload.doc_tokens <= CACHED_PROMPTS * workload.max_model_len:
        parser.error("need at least 2 rounds and more documents than vLLM's KV cache holds "
                     f"({CACHED_PROMPTS:g} documents)")
    print(f"{workload.documents} documents of {workload.doc_tokens} tokens, {workload.rounds} rounds, "
          f"{QUESTION_TOKENS}-token questions, {workload.answer_tokens}-token answers; vLLM's KV cache: "
          f"{workload.kv_cache_bytes >> 20} MiB; store chunks of {CHUNK_SIZE} tokens; one core, vLLM CPU fp32.")
    text, wrong = run(workload, tiers)
    print(text)
    print("TTFT: sequential requests, from adding one to the engine step that returns its first token. "
          "Targets: warm from memory <= 0.25x of recompute, from Redis or a new instance <= 0.35x, "
          "cold within 5% of recompute.")
    if wrong:
        print(f"{wrong} answers differ from the plain instance's", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
