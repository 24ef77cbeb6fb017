"""The storage tier against recomputing: does loading a prompt's stored KV beat prefilling it again?

Two workloads on in-process vLLM CPU engines (``vllm.LLM``, single-process mode), greedy, with a
model whose KV is heavy and whose body is light (``make_heavy_kv_llama``: 128 KiB of KV per token in
fp32), random token ids (seeded):

* ``--workload qa`` (document QA, the default): ``--documents`` documents of ``--doc-tokens``
  tokens, each asked ``--rounds`` times, every round with another short question appended;
* ``--workload chat`` (multi-turn chats): ``--documents`` conversations over one shared system
  prompt, one turn a round; a turn's prompt is the conversation so far (the earlier user messages
  and recorded replies) and a new user message. The system prompt and each user message are a
  quarter of ``--doc-tokens``, each reply an eighth.

vLLM's own KV cache holds about one and a half of the longest prompts, fewer than a round asks for,
so its prefix cache alone misses when a prompt comes back.

Instances, one after another, each in its own process:

* ``plain``: no connector, prefix caching off: every prompt recomputed (the baseline of every ratio);
* ``plain + prefix cache``: the same with vLLM's prefix caching on (its later rounds);
* ``plain + prefix cache, everything fits``: the same with a KV cache that holds every prompt of a
  round (its later rounds: vLLM's best case, when memory allows it);
* for each tier of ``--tiers``, a ``kv_both`` instance with kvbridge's store: its first round with
  the store empty (``cold``; a chat's ``first turns``), its later rounds (``warm``; ``later
  turns``); for ``disk`` and ``redis`` also a new instance, which never saw the prompts, on the same
  store (``new instance``). ``memory`` is the worker's memory tier over a disk tier (the scheduler
  finds chunks in the shared tiers only); ``redis`` is a redis-server started for the run, over TCP
  on loopback, and ``redis-unix`` the same server over its Unix socket (as ``kvbridge serve
  --kv-store redis`` reaches the one it starts), in a database of its own;
* for each ``--connector-config NAME=JSON``, an instance of another connector (a peer: its
  ``kv_transfer_config`` as JSON, ``kv_role`` ``kv_both``), its cold and warm rounds, and with
  ``--new-instance NAME`` also a new instance. ``{redis}`` in the JSON stands for the URL of the
  run's redis-server, which ``--tiers`` then starts even without ``redis``. Peers read their other
  settings from the environment (LMCache: ``LMCACHE_*``): the instances inherit it.

``--clients 1,4,8`` runs every instance once per count, the store emptied in between: that many
closed-loop clients, each adding its next request when its last one finished. ``--engine-cores 0``
computes on those cores only (one thread each; in single-process mode vLLM binds nothing itself),
and kvbridge's threads (``kv_thread_cores=auto``) and redis-server run on the others: the layout of
a deployment that keeps a core for what is not the model. By default nothing is pinned and the
engine's two threads share both cores with the store's threads.

Measured per row: TTFT p50/p99 (the time from adding a request to the engine step that returns its
first token), requests per second (each request generates 8 tokens, 4 with ``--quick``), the hit
rate (prompt tokens loaded from the store, from the connector's ``store_stats()``, over the prompt
tokens; for a peer, the prompt tokens vLLM reports as cached, ``num_cached_tokens``), the load rate
(bytes loaded over the row's summed TTFT: a lower bound, since a TTFT also computes the question),
and every answer's tokens against the plain instance's at the fewest clients (mismatches). Ratios
(TTFT p50, requests/s) are to the plain instance's on the same rounds at the same clients (a chat's
turns grow from round to round); the targets column holds the product's, for document QA with one
client: a warm round at most 0.25x from the memory tier and 0.35x from Redis or a new instance, a
cold round within 5 % in TTFT and in requests/s. With several client counts, a last table puts
each row's requests/s at each count beside the plain instance's. Exits 1 when an answer differs.

    python -m benchmarks.bench_store [--quick] [--workload qa|chat] [--documents N] [--doc-tokens T]
        [--rounds R] [--clients 1,4,8] [--engine-cores 0] [--tiers memory,disk,redis,redis-unix]
        [--dtype float32|bfloat16|float16] [--connector-config NAME=JSON [--new-instance NAME]]...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import redis_servers
from harness import vllm_procs as vp
from kv_pipe.cores import parse_cores

#: make_heavy_kv_llama's KV values per token: 8 layers x 16 KV heads x 128 dims x (K, V).
KV_VALUES_PER_TOKEN = 8 * 16 * 128 * 2
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: vLLM's own KV cache holds this many of the longest prompts.
CACHED_PROMPTS = 1.5
QUESTION_TOKENS = 16
CHUNK_SIZE = 256
ENGINE_TIMEOUT = 1800.0
#: The product's targets, as a fraction of the recompute baseline's TTFT p50: a warm hit from the
#: memory tier, one from Redis or from an instance that never saw the prompt, and a cold round.
WARM_MEMORY, WARM_SHARED, COLD = 0.25, 0.35, 1.05
#: The store tiers a run measures with kvbridge ("redis-unix": the run's redis-server over its Unix socket).
KVBRIDGE_TIERS = ("memory", "disk", "redis", "redis-unix")
#: vLLM's prefix caching with a KV cache that holds every prompt of a round: its best case.
EVERYTHING_FITS = "plain + prefix cache, everything fits"


@dataclasses.dataclass(frozen=True)
class Workload:
    """``qa``: ``documents`` documents of ``doc_tokens`` tokens, each asked once a round with another
    question. ``chat``: ``documents`` conversations over one shared system prompt, one turn a round;
    a turn's prompt is the conversation so far (the earlier turns' user messages and recorded
    replies) and a new user message."""

    documents: int = 8
    doc_tokens: int = 2000
    rounds: int = 3
    answer_tokens: int = 8
    dtype: str = "float32"
    kind: str = "qa"

    @property
    def chat_parts(self) -> tuple[int, int, int]:
        """A chat's system prompt, each user message and each recorded reply, in tokens."""
        return self.doc_tokens // 4, self.doc_tokens // 4, self.doc_tokens // 8

    @property
    def longest_prompt(self) -> int:
        if self.kind == "qa":
            return self.doc_tokens + QUESTION_TOKENS
        system, user, reply = self.chat_parts
        return system + self.rounds * user + (self.rounds - 1) * reply

    @property
    def kv_bytes_per_token(self) -> int:
        return KV_VALUES_PER_TOKEN * DTYPE_BYTES[self.dtype]

    @property
    def max_model_len(self) -> int:
        return -(-(self.longest_prompt + self.answer_tokens) // vp.BLOCK_SIZE) * vp.BLOCK_SIZE

    def kv_cache_bytes(self, everything: bool = False) -> int:
        """vLLM's KV cache: room for ``CACHED_PROMPTS`` of the longest prompts, or (``everything``)
        for every prompt of the last round at once, so that its prefix cache keeps them all."""
        prompts = self.documents if everything else CACHED_PROMPTS
        blocks = int(prompts * self.max_model_len) // vp.BLOCK_SIZE
        return blocks * vp.BLOCK_SIZE * self.kv_bytes_per_token

    @property
    def store_bytes(self) -> int:
        """Room for every prompt's chunks, twice over."""
        return 2 * self.documents * self.longest_prompt * self.kv_bytes_per_token


QUICK = Workload(documents=3, doc_tokens=512, rounds=2, answer_tokens=4)


def prompts(workload: Workload, seed: int = 0) -> list[list[list[int]]]:
    """Per round, per document (or conversation): its prompt."""
    rng = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(5, vp.VOCAB) for _ in range(count)]

    if workload.kind == "chat":
        system_tokens, user_tokens, reply_tokens = workload.chat_parts
        system = tokens(system_tokens)
        histories = [list(system) for _ in range(workload.documents)]
        rounds = []
        for _ in range(workload.rounds):
            batch = []
            for history in histories:
                history.extend(tokens(user_tokens))
                batch.append(list(history))
                history.extend(tokens(reply_tokens))
            rounds.append(batch)
        return rounds
    documents = [tokens(workload.doc_tokens) for _ in range(workload.documents)]
    return [[document + tokens(QUESTION_TOKENS) for document in documents] for _ in range(workload.rounds)]


# ---------------------------------------------------------------------- engine body (a child process)


def _serve(
    engine: Any, requests: list[tuple[str, list[int]]], clients: int, answer_tokens: int, timeout: float = 600
) -> list[tuple[float, list[int], int]]:
    """``requests`` (id, prompt) from ``clients`` closed-loop clients: each adds its next request when
    its last one finished. Per request, in order: (seconds from adding it to the engine step that
    returned its first token, its tokens, the prompt tokens vLLM did not compute)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=answer_tokens, ignore_eos=True, detokenize=False)
    waiting = list(reversed(requests))
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, tuple[float, list[int], int]] = {}
    deadline = time.perf_counter() + timeout
    while waiting or engine.has_unfinished_requests():
        while waiting and len(added) - len(done) < clients:
            request_id, prompt = waiting.pop()
            added[request_id] = time.perf_counter()
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
        if time.perf_counter() > deadline:
            raise TimeoutError(f"requests {sorted(set(added) - set(done))} not finished within {timeout} s")
        for output in engine.step():
            tokens = list(output.outputs[0].token_ids)
            if tokens and output.request_id not in first:
                first[output.request_id] = time.perf_counter() - added[output.request_id]
            if output.finished:
                if output.request_id not in first:
                    raise RuntimeError(f"request {output.request_id} generated no token")
                done[output.request_id] = (first[output.request_id], tokens, output.num_cached_tokens or 0)
    return [done[request_id] for request_id, _ in requests]


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


def engine_body(
    model: str,
    workload: Workload,
    rounds: list[list[list[int]]],
    tiers: str | None,
    prefix_caching: bool,
    peer: dict[str, Any] | None = None,
    clients: int = 1,
    engine_cores: Sequence[int] = (),
    cache_everything: bool = False,
) -> list[dict[str, Any]]:
    """Serve ``rounds`` one after the other, each from ``clients`` closed-loop clients; per round its
    TTFTs, wall time, answers and the store's counters it added (``peer``: another connector's
    kv_transfer_config, whose loads are the tokens vLLM reports as cached). With ``engine_cores``
    the engine computes on those cores only, one thread each, and kvbridge's threads (``auto``) run
    on the others; ``cache_everything`` sizes vLLM's KV cache for every prompt of a round."""
    if engine_cores:
        import torch

        # Before vLLM starts: its compute threads inherit the main thread's cores.
        os.sched_setaffinity(0, engine_cores)
        torch.set_num_threads(len(engine_cores))
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    transfer = peer
    if tiers is not None:
        transfer = {
            "kv_connector": vp.KVBRIDGE_CONNECTOR[0],
            "kv_connector_module_path": vp.KVBRIDGE_CONNECTOR[1],
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "kv_store": {
                    "tiers": tiers,
                    "chunk_size": CHUNK_SIZE,
                    "memory_bytes": workload.store_bytes,
                    "disk_bytes": workload.store_bytes,
                }
            },
        }
    kwargs = vp.engine_kwargs(model, transfer)
    kwargs.update(
        enable_prefix_caching=prefix_caching,
        max_model_len=workload.max_model_len,
        dtype=workload.dtype,
        kv_cache_memory_bytes=workload.kv_cache_bytes(cache_everything),
        max_num_batched_tokens=workload.max_model_len,
    )
    llm = vp._llm(kwargs)
    try:
        engine = llm.llm_engine
        connector = get_kv_transfer_group() if tiers is not None else None
        # An untimed first request: the first forward passes of an engine are slower.
        _serve(engine, [("warmup", random.Random(-1).choices(range(5, vp.VOCAB), k=workload.longest_prompt))], 1, 2)
        results = []
        for index, batch in enumerate(rounds):
            before = connector.store_stats() if connector is not None else None
            start = time.perf_counter()
            requests = [(f"r{index}-d{doc}", prompt) for doc, prompt in enumerate(batch)]
            asked = _serve(engine, requests, clients, workload.answer_tokens)
            wall = time.perf_counter() - start
            loaded, tokens_loaded = 0, sum(cached for _, _, cached in asked)
            if connector is not None:
                after = connector.store_stats()
                loaded = after.bytes_loaded - before.bytes_loaded
                tokens_loaded = (after.chunks_loaded - before.chunks_loaded) * CHUNK_SIZE
                _settle(connector)
            results.append(
                {
                    "ttft": [ttft for ttft, _, _ in asked],
                    "tokens": [tokens for _, tokens, _ in asked],
                    "wall": wall,
                    "bytes_loaded": loaded,
                    "tokens_loaded": tokens_loaded,
                }
            )
        return results
    finally:
        vp._shutdown(llm)


# ---------------------------------------------------------------------- rows


@dataclasses.dataclass
class Row:
    name: str
    indices: list[int]  # the rounds it holds
    rounds: list[dict[str, Any]]
    prompts: list[list[list[int]]]
    target: tuple[str, float] | None = None  # ("cold" | "warm", fraction of the baseline's TTFT p50)

    @property
    def ttfts(self) -> list[float]:
        return [ttft for result in self.rounds for ttft in result["ttft"]]

    def over(self, indices: list[int]) -> Row:
        """This row (one that served every round) over ``indices`` only: a row's baseline is the
        plain instance on the same rounds, since a chat's turns grow from round to round."""
        return Row(self.name, indices, [self.rounds[i] for i in indices], [self.prompts[i] for i in indices])


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def mismatches(row: Row, reference: dict[tuple[int, ...], list[int]]) -> int:
    return sum(
        reference[tuple(prompt)] != tokens
        for batch, result in zip(row.prompts, row.rounds, strict=True)
        for prompt, tokens in zip(batch, result["tokens"], strict=True)
    )


def table(rows: list[Row], reference: dict[tuple[int, ...], list[int]]) -> tuple[str, int]:
    """The table, and the mismatches in all."""
    header = (
        "setup",
        "requests",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "x recompute",
        "req/s",
        "req/s x plain",
        "hit rate",
        "load GB/s",
        "mismatches",
        "target",
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    wrong = 0
    for row in rows:
        ttfts = row.ttfts
        p50 = statistics.median(ttfts)
        baseline = rows[0].over(row.indices)
        ratio = p50 / statistics.median(baseline.ttfts)
        throughput = requests_per_second(row) / requests_per_second(baseline)
        prompt_tokens = sum(len(prompt) for batch in row.prompts for prompt in batch)
        loaded = sum(result["bytes_loaded"] for result in row.rounds)
        hit = sum(result["tokens_loaded"] for result in row.rounds) / prompt_tokens
        rate = f"{loaded / sum(ttfts) / 1e9:.2f}" if loaded else "-"
        target = "-"
        if row.target is not None:
            kind, limit = row.target
            # A cold round's target holds for its requests/s too: within the same 5 % of plain's.
            met = ratio <= limit if kind == "warm" else ratio <= limit and throughput >= 1 / limit
            target = f"{'<=' if kind == 'warm' else 'within'} {limit:.2f}x: {'met' if met else 'MISSED'}"
        row_wrong = mismatches(row, reference)
        wrong += row_wrong
        cells = (
            row.name,
            str(len(ttfts)),
            f"{p50 * 1e3:.1f}",
            f"{percentile(ttfts, 0.99) * 1e3:.1f}",
            f"{ratio:.2f}x",
            f"{requests_per_second(row):.2f}",
            f"{throughput:.2f}x",
            f"{hit:.0%}",
            rate,
            str(row_wrong),
            target,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), wrong


@dataclasses.dataclass(frozen=True)
class Instance:
    name: str
    tiers: str | None  # kvbridge's store
    prefix_caching: bool
    rounds: list[int]
    peer: dict[str, Any] | None = None  # another connector's kv_transfer_config
    cache_everything: bool = False  # vLLM's KV cache holds every prompt of a round


@dataclasses.dataclass(frozen=True)
class Peer:
    """``--connector-config NAME=JSON``: another connector's kv_transfer_config, ``{redis}`` in it
    standing for the run's redis-server."""

    name: str
    config: str
    new_instance: bool = False

    def transfer(self, redis_url: str | None) -> dict[str, Any]:
        text = self.config.replace("{redis}", redis_url) if redis_url is not None else self.config
        return json.loads(text)

    @property
    def needs_redis(self) -> bool:
        return "{redis}" in self.config


def parse_peers(configs: list[str], new_instances: list[str]) -> list[Peer]:
    """The peers of ``--connector-config`` and ``--new-instance``; ValueError naming what is wrong."""
    peers: list[Peer] = []
    for item in configs:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"--connector-config takes NAME=JSON, got {item!r}")
        taken = {"plain", "plain + prefix cache", EVERYTHING_FITS, *KVBRIDGE_TIERS, *(peer.name for peer in peers)}
        if name in taken:
            raise ValueError(f"--connector-config name {name!r} is taken")
        try:
            config = json.loads(text.replace("{redis}", "redis://127.0.0.1:0"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"--connector-config {name}: not JSON ({exc})") from exc
        if not isinstance(config, dict) or not isinstance(config.get("kv_connector"), str):
            raise ValueError(f"--connector-config {name}: a kv_transfer_config object with kv_connector, got {text!r}")
        if config.get("kv_role", "kv_both") != "kv_both":
            raise ValueError(f"--connector-config {name}: kv_role must be kv_both, got {config['kv_role']!r}")
        peers.append(Peer(name, text, new_instance=name in new_instances))
    if unknown := sorted(set(new_instances) - {peer.name for peer in peers}):
        raise ValueError(f"--new-instance names no --connector-config: {unknown}")
    return peers


def plan(
    workload: Workload,
    tiers: list[str],
    directory: Path,
    redis_url: str | None,
    peers: Sequence[Peer] = (),
    redis_socket_url: str | None = None,
) -> list[Instance]:
    """Instances in order: kvbridge's, then the peers'. ``redis_url`` reaches the run's redis-server
    over TCP, ``redis_socket_url`` over its Unix socket. Chats get no new instance of kvbridge's:
    the first instance serves every turn, so a second one would ask prompts stored whole already."""
    every, later = list(range(workload.rounds)), list(range(1, workload.rounds))
    instances = [
        Instance("plain", None, False, every),
        Instance("plain + prefix cache", None, True, every),
        Instance(EVERYTHING_FITS, None, True, every, cache_everything=True),
    ]
    for tier in tiers:
        spec = {
            "memory": f"memory,disk:{directory / 'memory'}",
            "disk": f"disk:{directory / 'disk'}",
            "redis": redis_url,
            "redis-unix": redis_socket_url,
        }[tier]
        instances.append(Instance(tier, spec, True, every))
        if tier != "memory" and workload.kind == "qa":
            instances.append(Instance(f"{tier}, new instance", spec, True, later))
    for peer in peers:
        instances.append(Instance(peer.name, None, True, every, peer.transfer(redis_url)))
        if peer.new_instance:
            instances.append(Instance(f"{peer.name}, new instance", None, True, later, peer.transfer(redis_url)))
    return instances


def rows_of(
    name: str, served: list[int], results: list[dict[str, Any]], rounds: list[list[list[int]]], kind: str = "qa"
) -> list[Row]:
    """The rows one instance gives: plain rows whole, plain + prefix cache its later rounds, a store
    instance its cold round and its warm rounds (a new instance: warm only). The targets are
    kvbridge's, on document QA; a chat's rounds are its first and its later turns."""
    by_round = dict(zip(served, results, strict=True))
    later = [index for index in served if index > 0]
    if name == "plain":
        return [Row("plain (recompute)", served, results, [rounds[i] for i in served])]
    if name.startswith("plain + prefix cache"):
        return [Row(f"{name}, later rounds", later, [by_round[i] for i in later], [rounds[i] for i in later])]
    out = []
    ours = name.split(",")[0] in KVBRIDGE_TIERS and kind == "qa"
    first, again = ("cold", "warm") if kind == "qa" else ("first turns", "later turns")
    if 0 in served:
        out.append(Row(f"{name}, {first}", [0], [by_round[0]], [rounds[0]], ("cold", COLD) if ours else None))
    if later:
        new_instance = name.endswith("new instance")
        limit = WARM_MEMORY if name == "memory" else WARM_SHARED if new_instance or name.startswith("redis") else None
        limit = limit if ours else None
        out.append(
            Row(
                name if new_instance else f"{name}, {again}",
                later,
                [by_round[i] for i in later],
                [rounds[i] for i in later],
                ("warm", limit) if limit is not None else None,
            )
        )
    return out


def requests_per_second(row: Row) -> float:
    return len(row.ttfts) / sum(result["wall"] for result in row.rounds)


def by_clients_table(sweeps: dict[int, list[Row]]) -> str:
    """Requests/s (and its ratio to the plain instance's at the same clients) and TTFT p50 per row,
    a column group per client count."""
    counts = sorted(sweeps)
    header = ["setup"] + [f"{cell} ({count})" for count in counts for cell in ("req/s", "x plain", "TTFT p50 ms")]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for index, row in enumerate(sweeps[counts[0]]):
        cells = [row.name]
        for count in counts:
            same = sweeps[count][index]
            plain = sweeps[count][0].over(same.indices)
            rate = requests_per_second(same)
            cells += [
                f"{rate:.2f}",
                f"{rate / requests_per_second(plain):.2f}x",
                f"{statistics.median(same.ttfts) * 1e3:.1f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(
    workload: Workload,
    tiers: list[str],
    peers: Sequence[Peer] = (),
    clients: Sequence[int] = (1,),
    engine_cores: Sequence[int] = (),
) -> tuple[str, int]:
    """Every instance's rows, one table per client count (the store emptied between them) and, for
    several counts, a table of requests/s by clients; and the mismatches in all. Every answer is
    checked against the plain instance's at the fewest clients."""
    from tqdm import tqdm

    rounds = prompts(workload)
    sweeps: dict[int, list[Row]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-store-") as scratch, vp.Engines() as engines:
        directory = Path(scratch)
        model = vp.make_heavy_kv_llama(directory / "model", max_positions=max(2048, workload.max_model_len))
        wants_redis = bool({"redis", "redis-unix"} & set(tiers)) or any(peer.needs_redis for peer in peers)
        env = vp.engine_env(0)
        pinned: list[str] = []
        if engine_cores:
            env.update(
                VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, engine_cores)), OMP_NUM_THREADS=str(len(engine_cores))
            )
            spare = ",".join(map(str, sorted(os.sched_getaffinity(0) - set(engine_cores))))
            pinned = ["--server_cpulist", spare, "--bio_cpulist", spare]  # the store beside the engine
        redis = redis_servers.start_server(directory / "redis", *pinned, unix=True) if wants_redis else None
        try:
            tcp_url = f"redis://127.0.0.1:{redis.port}" if redis else None
            # Over the socket, another database: its cold round finds nothing the TCP instances stored.
            socket_url = f"{redis.url}?db=1" if redis else None
            for count in sorted(clients):
                if redis is not None:
                    redis.client().flushall()
                instances = plan(workload, tiers, directory / f"clients-{count}", tcp_url, peers, socket_url)
                rows: list[Row] = []
                for instance in tqdm(instances, desc=f"instances, {count} clients", file=sys.stderr):
                    name = f"{count}-{len(rows)}-{instance.name}"
                    engines.start(
                        name,
                        engine_body,
                        env,
                        model=model,
                        workload=workload,
                        rounds=[rounds[i] for i in instance.rounds],
                        tiers=instance.tiers,
                        prefix_caching=instance.prefix_caching,
                        peer=instance.peer,
                        clients=count,
                        engine_cores=list(engine_cores),
                        cache_everything=instance.cache_everything,
                    )
                    results = engines.wait([name], ENGINE_TIMEOUT)[name]
                    for row in rows_of(instance.name, instance.rounds, results, rounds, workload.kind):
                        # TTFT targets are for requests served alone.
                        rows.append(row if count == 1 else dataclasses.replace(row, target=None))
                sweeps[count] = rows
        finally:
            if redis is not None:
                redis.kill()
    fewest = sweeps[min(sweeps)][0]
    reference = {
        tuple(prompt): tokens
        for batch, result in zip(rounds, fewest.rounds, strict=True)
        for prompt, tokens in zip(batch, result["tokens"], strict=True)
    }
    texts, wrong = [], 0
    for count, rows in sweeps.items():
        text, row_wrong = table(rows, reference)
        texts.append(f"{count} client{'s' if count > 1 else ''}:\n{text}")
        wrong += row_wrong
    if len(sweeps) > 1:
        texts.append("requests/s by clients:\n" + by_clients_table(sweeps))
    return "\n\n".join(texts), wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of a few minutes")
    parser.add_argument(
        "--documents", type=int, help=f"documents (default {Workload.documents}, quick {QUICK.documents})"
    )
    parser.add_argument("--doc-tokens", type=int, help=f"tokens per document (default {Workload.doc_tokens})")
    parser.add_argument(
        "--rounds", type=int, help=f"times each document is asked, or turns of a chat (default {Workload.rounds})"
    )
    parser.add_argument(
        "--workload",
        choices=("qa", "chat"),
        default="qa",
        help="qa: documents asked again (default); chat: multi-turn chats over one shared system prompt, "
        "its parts sized from --doc-tokens",
    )
    parser.add_argument("--clients", default="1", help="client counts, each a run of every instance (default 1)")
    parser.add_argument(
        "--engine-cores",
        help="the engine's cores (such as 0), one compute thread each; kvbridge's threads and redis-server "
        "run on the other cores (default: the engine on every core, nothing pinned)",
    )
    parser.add_argument(
        "--tiers",
        default="memory,disk,redis",
        help="store tiers to measure, of memory,disk,redis,redis-unix (empty: none)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPE_BYTES),
        help="model and KV dtype (default float32: on CPU, bfloat16 is far slower)",
    )
    parser.add_argument(
        "--connector-config",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="also measure another connector: its kv_transfer_config as JSON ({redis}: the run's "
        "redis-server URL); repeatable",
    )
    parser.add_argument(
        "--new-instance",
        action="append",
        default=[],
        metavar="NAME",
        help="also a new instance of that --connector-config on the same store",
    )
    args = parser.parse_args(argv)
    base = QUICK if args.quick else Workload()
    workload = dataclasses.replace(
        base,
        dtype=args.dtype,
        kind=args.workload,
        **{
            key: value
            for key, value in (("documents", args.documents), ("doc_tokens", args.doc_tokens), ("rounds", args.rounds))
            if value is not None
        },
    )
    tiers = [tier.strip() for tier in args.tiers.split(",") if tier.strip()]
    if unknown := set(tiers) - set(KVBRIDGE_TIERS):
        parser.error(f"unknown tiers {sorted(unknown)}: choose from {', '.join(KVBRIDGE_TIERS)}")
    try:
        peers = parse_peers(args.connector_config, args.new_instance)
    except ValueError as exc:
        parser.error(str(exc))
    first_round = sum(len(prompt) for prompt in prompts(workload)[0])
    if workload.rounds < 2 or first_round <= CACHED_PROMPTS * workload.max_model_len:
        parser.error(
            f"need at least 2 rounds and more prompt tokens in a round ({first_round}) than vLLM's KV cache "
            f"holds ({CACHED_PROMPTS:g} of the longest prompts): more or longer documents"
        )
    try:
        clients = sorted({int(count) for count in args.clients.split(",")})
        if clients[0] < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--clients takes client counts of at least 1 such as 1,4,8, got {args.clients!r}")
    engine_cores: list[int] = []
    if args.engine_cores:
        usable = os.sched_getaffinity(0)
        try:
            engine_cores = sorted(parse_cores(args.engine_cores))
        except ValueError as exc:
            parser.error(f"--engine-cores takes a core list such as 0 or 0-2: {exc}")
        if not set(engine_cores) < usable:
            parser.error(f"--engine-cores {args.engine_cores} must leave one of the usable cores {sorted(usable)} free")
    if workload.kind == "chat":
        system, user, reply = workload.chat_parts
        print(
            f"{workload.documents} chats of {workload.rounds} turns over one {system}-token system prompt: "
            f"{user}-token user messages, {reply}-token recorded replies, {workload.answer_tokens}-token answers; "
            f"vLLM's KV cache: {workload.kv_cache_bytes() >> 20} MiB; store chunks of {CHUNK_SIZE} tokens; "
            f"{workload.dtype}."
        )
    else:
        print(
            f"{workload.documents} documents of {workload.doc_tokens} tokens, {workload.rounds} rounds, "
            f"{QUESTION_TOKENS}-token questions, {workload.answer_tokens}-token answers; vLLM's KV cache: "
            f"{workload.kv_cache_bytes() >> 20} MiB; store chunks of {CHUNK_SIZE} tokens; {workload.dtype}."
        )
    if engine_cores:
        print(f"The engine computes on cores {engine_cores}; kvbridge's threads and redis-server run on the others.")
    text, wrong = run(workload, tiers, peers, clients, engine_cores)
    print(text)
    print(
        "TTFT: from adding a request to the engine step that returns its first token; each client adds "
        "its next request when its last one finished. Targets (document QA, one client): warm from "
        "memory <= 0.25x of recompute, from Redis or a new instance <= 0.35x, cold within 5% of recompute."
        + (" A peer's hit rate: the prompt tokens vLLM reports as cached." if peers else "")
    )
    if wrong:
        print(f"{wrong} answers differ from the plain instance's", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
