"""End to end, as a vLLM user sees it: one plain ``vllm serve``, kvbridge P/D, and vLLM's NixlConnector P/D.

One run, the same vLLM CPU build, model and prompts through each setup:

* **plain**: one ``vllm serve`` without a connector, on both cores (it computes every prompt); with
  ``--setups plain-one-core`` also the same on the prefill instance's one core, the floor of any prefill leg;
* **kvbridge**: a prefill (``kv_producer``, core 0) and a decode (``kv_consumer``, core 1) instance
  with kvbridge's ``KVBridgeConnector``; each request is sent to the prefill instance with
  ``max_tokens=1``, then to the decode instance with the returned ``kv_transfer_params``, as
  kvbridge's proxy does;
* **nixl**: the same pair with vLLM's own ``NixlConnector`` (PyPI ``nixl``, UCX), the prefill request
  carrying ``kv_transfer_params = {"do_remote_decode": true, ...}``, as vLLM's toy proxy and
  vllm-router do.

With ``--netns`` the pairs also run across two network namespaces joined by a veth link (the
prefill instance in one, the decode instance and the client in the other), unlimited and limited to
1 Gbit/s (``tc tbf``); NIXL is then forced to TCP (``UCX_TLS=tcp``: UCX finds shared memory between
namespaces otherwise). Needs root.

Workload: a model with heavy KV and a light body (8 layers x 16 KV heads x 128 dims, fp32: 128 KiB
of KV per token), prompts of ``--prompt`` tokens (1000: 125 MiB of KV each), greedy, every prompt
used once per setup (no prefix cache hits), ``--max-tokens`` generated tokens (16).

Measured per setup:

* sequential TTFT, one request at a time, with its prefill leg (the prefill instance's answer) and
  its decode leg (the decode request until its first token);
* 1, 4 and 8 clients (``--clients``): TTFT and ITL p50/p99 and requests per second;
* the prefill instance's throughput (``producer``): ``--producer-clients`` clients (4 and 8) send
  prefill requests only (``max_tokens=1``) to the pair's prefill instance and, in alternating rounds
  (``--rounds``) with the same prompts, to the same instance without a connector, started beside it
  on the same core and idle meanwhile; the decode instance takes every entry (its one-token requests
  go out from other threads, so the clients keep the prefill instance as busy as the plain one);
* every answer (token ids) against the plain server's;
* ``--measure split``: the prefill instance's gap to a plain instance, split into its parts. One
  instance per variant (``--split-variants``), all on core 0, each sent batches of prefill requests
  (``producer_clients[0]`` clients, ``x producer_requests`` requests a batch): ``plain`` (no
  connector), ``noop`` (a connector that claims and saves nothing, :mod:`harness.noop_connector`:
  vLLM's connector machinery alone), ``threads`` (kvbridge's producer, nobody taking its entries:
  its threads and saves, and the copies of entries whose lease ends), ``decode`` (kvbridge's producer,
  a decode instance on core 1 taking every entry) and ``no-lend`` (the same with
  ``kv_lend_blocks`` false). Two methods: ``alone``, each variant's batches in its own window, one
  variant after another; ``alternating``, batch by batch, every variant in turn (the order
  rotating), which cancels drift from other load on the host: trust that one on a shared machine.
  Per variant: requests per second, the ratio to plain, and vLLM's ``request_prefill_time_seconds``
  sum (its time computing the prompts).

Placement: the prefill instance's processes (API server, engine core, worker, every thread) run on
core 0 and the decode instance's on core 1; the plain server on both. ``VLLM_CPU_OMP_THREADS_BIND``
places vLLM's compute threads, and once an instance answers, every thread of its processes is pinned
to its cores: vLLM's NIXL worker on CPU moves its thread to the last core of each NUMA node ("reserved
for kv transfer"), which on a 2-core host puts both NIXL instances' forward passes on core 1.

    python -m benchmarks.bench_e2e [--quick] [--setups plain,kvbridge,nixl] [--clients 1,4,8]
        [--producer-clients 4,8] [--netns] [--out DIR]
    python -m benchmarks.bench_e2e --measure split --producer-clients 4 [--split-batches 3]
        [--producer-requests 4] [--split-variants plain,noop,threads,decode,no-lend]

Prints the tables (and ``--json``), saves ``bench_e2e.png`` (matplotlib) and ``bench_e2e.json``.
``--quick``: 300-token prompts, 4 tokens, 1 and 2 clients, few requests: a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from harness import netns
from harness.procs import OWN_PROCESS_GROUP, free_port, group_processes
from harness.vllm_procs import VOCAB, make_heavy_kv_llama
from launch.serve import kv_transfer_config, stop, vllm_serve_command

MODEL_NAME = "heavy-kv"
READY_TIMEOUT = 300.0
REQUEST_TIMEOUT = 300.0
LINK_RATE = "1gbit"
#: The plain servers' cores: ``plain`` has the pair's two, ``plain-one-core`` the prefill instance's
#: one (the least a prefill leg on that core can take, whatever moves the KV afterwards).
PLAIN_CORES = {"plain": {0, 1}, "plain-one-core": {0}}
#: Prefill instances that answer without ``kv_transfer_params``: no connector, or one that saves nothing.
WITHOUT_PARAMS = {"plain-prefill", "plain", "noop"}
#: What a NIXL prefill request carries (vLLM's toy proxy sends the same).
NIXL_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclasses.dataclass(frozen=True)
class Workload:
    prompt: int = 1000
    max_tokens: int = 16
    sequential: int = 6
    per_client: int = 4  # requests per client at each concurrency (at least 8 in all)
    producer_requests: int = 6  # prefill requests per client in the producer measurement
    clients: tuple[int, ...] = (1, 4, 8)
    producer_clients: tuple[int, ...] = (4, 8)
    rounds: int = 3  # of the producer measurement, alternating with the instance without a connector
    kv_memory: int = 5 << 28  # 1.25 GiB: 8 requests of 1016 tokens at 128 KiB per token, each instance
    kv_extra: str = "{}"  # JSON: kvbridge settings on top of the defaults (kv_extra_config)
    split_batches: int = 3  # batches per variant and method in the split measurement


QUICK = Workload(
    prompt=300,
    max_tokens=4,
    sequential=2,
    per_client=2,
    producer_requests=3,
    clients=(1, 2),
    producer_clients=(2,),
    rounds=1,
    kv_memory=1 << 29,
    split_batches=1,
)


# ---------------------------------------------------------------------- instances


def serve_args(workload: Workload) -> list[str]:
    return [
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(workload.prompt + workload.max_tokens + 64),
        "--block-size",
        "32",
        "--seed",
        "0",
        "--enable-prompt-tokens-details",
        "--kv-cache-memory-bytes",
        str(workload.kv_memory),
    ]


@dataclasses.dataclass
class Server:
    name: str
    url: str
    cores: set[int]
    process: subprocess.Popen


def _group_threads(leader: int) -> Iterator[int]:
    """Every thread of every process in the process group that ``leader`` leads."""
    for pid in group_processes(leader):
        with contextlib.suppress(OSError):
            yield from (int(tid) for tid in os.listdir(f"/proc/{pid}/task"))


def pin(server: Server) -> int:
    """Pin every thread of the server's processes to its cores; how many threads."""
    count = 0
    for tid in _group_threads(server.process.pid):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, server.cores)
            count += 1
    return count


_HEALTH_PROBE = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=2)"


def wait_up(server: Server, namespace: str | None = None) -> None:
    """Until the server answers ``/health``; asked from ``namespace`` (its own) where it runs in one,
    since this namespace has no route to theirs."""
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with code {server.process.returncode} before it was ready")
        if _answers_health(server.url, namespace):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server.name} was not up within {READY_TIMEOUT:g} s")
        time.sleep(0.5)


def _answers_health(url: str, namespace: str | None) -> bool:
    if namespace is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False
    probe = ["ip", "netns", "exec", namespace, sys.executable, "-c", _HEALTH_PROBE, url]
    return subprocess.run(probe, env=netns.child_env(), capture_output=True, timeout=30).returncode == 0


@contextlib.contextmanager
def servers(
    specs: list[dict[str, Any]], log_dir: Path, tag: str, hosts: netns.TwoHosts | None = None
) -> Iterator[list[Server]]:
    """Start each ``{"name", "argv", "env", "cores", "host" (index), "address", "port"}`` one after another,
    wait until it answers, pin it; stop them all on exit."""
    started: list[Server] = []
    try:
        for spec in specs:
            log = open(log_dir / f"{tag}-{spec['name']}.log", "wb")  # noqa: SIM115 - closed with the process
            cores = sorted(spec["cores"])
            extra = {
                "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0]),
                "VLLM_LOGGING_LEVEL": "WARNING",
                **spec.get("env", {}),
            }
            argv, env = spec["argv"], {**os.environ, **extra}
            if hosts is not None:
                argv, env = ["ip", "netns", "exec", hosts.names[spec["host"]], *argv], netns.child_env(extra)
            process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, **OWN_PROCESS_GROUP)
            server = Server(spec["name"], f"http://{spec['address']}:{spec['port']}", set(spec["cores"]), process)
            started.append(server)
            wait_up(server, hosts.names[spec["host"]] if hosts is not None else None)
            pin(server)
        yield started
    finally:
        stop_all([server.process for server in started])


def stop_all(processes: list[subprocess.Popen]) -> None:
    """Stop each server (SIGTERM, 30 s grace), then SIGKILL whatever is left of its process group
    (vLLM's engine core and worker processes outlive an API server that was killed)."""
    try:
        stop(processes)
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)


# ---------------------------------------------------------------------- one request


@dataclasses.dataclass
class Record:
    """One request: times (``time.monotonic``) and the tokens it generated."""

    start: float
    prefill_done: float | None  # the prefill instance's answer (P/D setups)
    tokens: list[float]  # arrival of each generated token's chunk
    token_ids: list[int]
    cached: int | None  # prompt tokens vLLM reports cached (loaded from the prefill instance)

    @property
    def ttft(self) -> float:
        return self.tokens[0] - self.start

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.tokens, self.tokens[1:], strict=False)]


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT)


def _body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def prefill(setup: str, url: str, prompt: list[int]) -> dict[str, Any] | None:
    """The prefill leg: the kv_transfer_params of the prefill instance's one-token answer."""
    body = {**_body(prompt, 1), "stream": False}
    if setup.startswith("nixl"):
        body["kv_transfer_params"] = dict(NIXL_PREFILL_PARAMS)
    with _post(url, body) as reply:
        params = json.load(reply).get("kv_transfer_params")
    if params is None and setup not in WITHOUT_PARAMS:
        raise RuntimeError(f"{url} returned no kv_transfer_params")
    return params


def stream(
    url: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None
) -> tuple[list[float], list[int], int | None]:
    body = {**_body(prompt, max_tokens), "stream": True, "stream_options": {"include_usage": True}}
    if params is not None:
        body["kv_transfer_params"] = params
    times, token_ids, cached = [], [], None
    with _post(url, body) as reply:
        for line in reply:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[len(b"data: ") :])
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                if ids:
                    times.extend([time.monotonic()] * len(ids))
                    token_ids.extend(ids)
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    return times, token_ids, cached


def request(setup: str, urls: dict[str, str], prompt: list[int], max_tokens: int) -> Record:
    start = time.monotonic()
    params, prefill_done = None, None
    if "prefill" in urls:
        params = prefill(setup, urls["prefill"], prompt)
        prefill_done = time.monotonic()
    times, token_ids, cached = stream(urls["decode"], prompt, max_tokens, params)
    if len(token_ids) != max_tokens:
        raise RuntimeError(f"{setup}: {len(token_ids)} tokens generated, {max_tokens} asked for")
    return Record(start, prefill_done, times, token_ids, cached)


# ---------------------------------------------------------------------- workloads


def concurrently(clients: int, jobs: list[Any], work: Callable[[Any], Any]) -> tuple[list[Any], float]:
    """Run ``work(job)`` for every job from ``clients`` threads; (results in job order, wall seconds)."""
    pending: queue.SimpleQueue = queue.SimpleQueue()
    for index, job in enumerate(jobs):
        pending.put((index, job))
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def client() -> None:
        while not errors:
            try:
                index, job = pending.get_nowait()
            except queue.Empty:
                return
            try:
                results[index] = work(job)
            except BaseException as exc:  # noqa: BLE001 - reported by the caller
                errors.append(exc)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results, time.monotonic() - start


def producer_throughput(setup: str, urls: dict[str, str], prompts: list[list[int]], clients: int) -> dict[str, Any]:
    """Prefill requests only, from ``clients`` threads; for a P/D setup the decode instance takes each
    entry (decode requests of one token, sent from other threads). Requests per second of the
    prefill instance, from the first request sent to the last prefill answer."""
    takers: queue.SimpleQueue = queue.SimpleQueue()
    taken: list[Any] = []

    def take() -> None:
        while (job := takers.get()) is not None:
            prompt, params = job
            try:
                taken.append(stream(urls["decode"], prompt, 1, params)[2])
            except Exception as exc:  # noqa: BLE001 - counted as not taken
                taken.append(exc)

    taker_threads = [threading.Thread(target=take, daemon=True) for _ in range(clients if "decode" in urls else 0)]
    for thread in taker_threads:
        thread.start()
    latencies = []

    def one(prompt: list[int]) -> None:
        start = time.monotonic()
        params = prefill(setup, urls["prefill"], prompt)
        latencies.append(time.monotonic() - start)
        if taker_threads:
            takers.put((prompt, params))

    _, wall = concurrently(clients, prompts, one)
    for _ in taker_threads:
        takers.put(None)
    for thread in taker_threads:
        thread.join(REQUEST_TIMEOUT)
    loaded = sum(1 for cached in taken if isinstance(cached, int) and cached > 0)
    return {
        "clients": clients,
        "requests": len(prompts),
        "seconds": wall,
        "rps": len(prompts) / wall,
        "latency_p50": _pct(latencies, 50),
        "loaded": loaded if taker_threads else None,
    }


def metric(url: str, name: str) -> float:
    """The sum of every sample of counter ``name`` on ``url``/metrics (0 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


#: The decode instance's count of prompt tokens it took from a connector instead of computing them.
LOADED_METRIC = "vllm:external_prefix_cache_hits_total"


def _pct(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def prompts_for(workload: Workload, seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, VOCAB) for _ in range(workload.prompt)] for _ in range(count)]


@dataclasses.dataclass
class Plan:
    """The prompts of each measurement: the same for every setup, each used once per setup."""

    sequential: list[list[int]]
    concurrent: dict[int, list[list[int]]]
    producer: list[dict[int, list[list[int]]]]  # per round, per concurrency
    warmup: list[list[int]]

    @classmethod
    def of(cls, workload: Workload) -> Plan:
        return cls(
            sequential=prompts_for(workload, 1, workload.sequential),
            concurrent={c: prompts_for(workload, 100 + c, max(8, c * workload.per_client)) for c in workload.clients},
            producer=[
                {
                    c: prompts_for(workload, 1000 * (r + 1) + c, c * workload.producer_requests)
                    for c in workload.producer_clients
                }
                for r in range(workload.rounds)
            ],
            warmup=prompts_for(workload, 999, 2),
        )


def measure_serving(setup: str, urls: dict[str, str], plan: Plan, workload: Workload) -> dict[str, Any]:
    """Sequential requests, then each concurrency; every record."""
    for prompt in plan.warmup:
        request(setup, urls, prompt, workload.max_tokens)
    sequential = [request(setup, urls, prompt, workload.max_tokens) for prompt in plan.sequential]
    concurrent = {}
    for clients, prompts in plan.concurrent.items():
        records, wall = concurrently(clients, prompts, lambda p: request(setup, urls, p, workload.max_tokens))
        concurrent[clients] = {"records": records, "seconds": wall}
    return {"sequential": sequential, "concurrent": concurrent}


def measure_producer(setup: str, urls: dict[str, str], plain_url: str, plan: Plan) -> dict[int, dict[str, list]]:
    """The prefill instance of ``setup`` against ``plain_url`` (the same instance without a connector,
    on the same core, idle meanwhile), in alternating rounds with the same prompts: per concurrency,
    each side's result per round."""
    sides = {setup: urls, "plain-prefill": {"prefill": plain_url}}
    for name, side in sides.items():
        for prompt in plan.warmup:
            prefill(name, side["prefill"], prompt)
    results: dict[int, dict[str, list]] = {}
    for index, prompts in enumerate(plan.producer):
        order = list(sides) if index % 2 else list(sides)[::-1]
        for clients, batch in prompts.items():
            for name in order:
                results.setdefault(clients, {}).setdefault(name, []).append(
                    producer_throughput(name, sides[name], batch, clients)
                )
    return results


# ---------------------------------------------------------------------- the prefill instance's gap, split

#: The prefill instance's variants of the ``split`` measurement, all on core 0 (see the module docstring).
SPLIT_VARIANTS = ("plain", "noop", "threads", "decode", "no-lend")
#: vLLM's own time in prefill, summed over requests (the sum of its histogram).
PREFILL_TIME_METRIC = "vllm:request_prefill_time_seconds_sum"
NOOP_TRANSFER = {
    "kv_connector": "NoopKVConnector",
    "kv_connector_module_path": "harness.noop_connector",
    "kv_role": "kv_producer",
}


def split_specs(model: str, workload: Workload, variants: list[str]) -> list[dict[str, Any]]:
    """One prefill instance per variant on core 0, then (when a variant takes its entries) one decode
    instance on core 1 that loads from whichever producer a request names."""
    address, extra = "127.0.0.1", {"kv_connect_timeout": 300, **json.loads(workload.kv_extra)}
    transfers: dict[str, dict[str, Any] | None] = {"plain": None, "noop": NOOP_TRANSFER}
    kv_ports = {}
    for variant in ("threads", "decode", "no-lend"):
        kv_ports[variant] = free_port()
        lend = {"kv_lend_blocks": False} if variant == "no-lend" else {}
        transfers[variant] = kv_transfer_config("kv_producer", address, kv_ports[variant], {**extra, **lend})
    # Without a decode leg is the decode variant's instance with nobody taking its entries: one fewer
    # instance on the host (the work an untaken entry leaves behind, its copy when its lease ends,
    # falls on core 0 whichever instance it is).
    alone = [v for v in variants if not (v == "threads" and "decode" in variants)]
    specs = [_spec(variant, model, workload, {0}, address, 0, transfers[variant]) for variant in alone]
    taking = [variant for variant in variants if variant in SPLIT_TAKEN]
    if taking:
        specs.append(
            _spec(
                "decode-instance",
                model,
                workload,
                {1},
                address,
                1,
                {
                    **kv_transfer_config("kv_consumer", address, kv_ports[taking[0]], extra),
                    "kv_load_failure_policy": "fail",
                },
            )
        )
    return specs


#: The variants whose every entry the decode instance takes.
SPLIT_TAKEN = {"decode", "no-lend"}


def split_plan(workload: Workload, variants: list[str]) -> dict[str, dict[str, list[list[list[int]]]]]:
    """Per method and variant, ``split_batches`` batches of ``producer_clients[0] x producer_requests``
    prompts of their own (variants may share an instance: no prompt is seen twice, no prefix cache hit)."""
    size = workload.producer_clients[0] * workload.producer_requests
    return {
        method: {
            variant: [
                prompts_for(workload, 7000 + 1000 * index + 100 * number + batch, size)
                for batch in range(workload.split_batches)
            ]
            for number, variant in enumerate(variants)
        }
        for index, method in enumerate(("alone", "alternating"))
    }


def split_schedule(method: str, variants: list[str], batches: list[Any]) -> list[tuple[str, Any]]:
    """(variant, batch) in the order sent: ``alone``, each variant's batches back to back, one variant
    after another; ``alternating``, batch by batch, every variant in turn, the first variant of each
    turn the next one (so that no variant always follows the same one)."""
    if method == "alone":
        return [(variant, batch) for variant in variants for batch in batches]
    return [
        (variants[(index + turn) % len(variants)], batch)
        for index, batch in enumerate(batches)
        for turn in range(len(variants))
    ]


def measure_split(
    urls: dict[str, str],
    variants: list[str],
    plan: dict[str, dict[str, list[list[list[int]]]]],
    warmup: list[list[int]],
    clients: int,
) -> dict[str, dict[str, Any]]:
    """Per method and variant: each batch's result (:func:`producer_throughput`) and vLLM's prefill
    time over its batches (read around each batch: variants may share an instance). ``alone``: each
    variant's batches back to back, one variant after another; ``alternating``: batch by batch, every
    variant in turn (the order rotating), so that drift (other load on the host) falls on every
    variant alike."""

    def side(variant: str) -> dict[str, str]:
        return {"prefill": urls[variant], **({"decode": urls["decode-instance"]} if variant in SPLIT_TAKEN else {})}

    for variant in variants:  # the decode instance takes a taken variant's warm-up entries too
        producer_throughput(variant, side(variant), warmup, 1)
    results: dict[str, dict[str, Any]] = {}
    for method, batches in plan.items():
        results[method] = {variant: {"batches": [], "prefill_time": 0.0} for variant in variants}
        for variant, index in split_schedule(method, variants, list(range(len(batches[variants[0]])))):
            before = metric(urls[variant], PREFILL_TIME_METRIC)
            run = producer_throughput(variant, side(variant), batches[variant][index], clients)
            time.sleep(1.0)  # vLLM records a request's stats after its answer
            results[method][variant]["batches"].append(run)
            results[method][variant]["prefill_time"] += metric(urls[variant], PREFILL_TIME_METRIC) - before
    return results


def run_split(model: str, workload: Workload, variants: list[str], log_dir: Path) -> dict[str, Any]:
    """Start the variants' instances, measure them both ways, stop them."""
    specs = split_specs(model, workload, variants)
    with servers(specs, log_dir, "split") as started:
        urls = {server.name: server.url for server in started}
        if "threads" in variants and "decode" in variants:
            urls["threads"] = urls["decode"]
        return measure_split(
            urls, variants, split_plan(workload, variants), prompts_for(workload, 999, 2), workload.producer_clients[0]
        )


def summarise_split(split: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per method and variant: requests, req/s (all its batches' requests over their summed time), the
    ratio to plain's (and, alternating, the range of the per-batch ratios), vLLM's prefill time."""
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for method, by_variant in split.items():
        plain = by_variant["plain"]
        rows = {}
        for variant, one in by_variant.items():
            requests = sum(run["requests"] for run in one["batches"])
            seconds = sum(run["seconds"] for run in one["batches"])
            rps = requests / seconds
            plain_rps = sum(run["requests"] for run in plain["batches"]) / sum(
                run["seconds"] for run in plain["batches"]
            )
            ratios = [run["rps"] / base["rps"] for run, base in zip(one["batches"], plain["batches"], strict=True)]
            taken = [run["loaded"] for run in one["batches"] if run["loaded"] is not None]
            rows[variant] = {
                "requests": requests,
                "rps": rps,
                "ratio": rps / plain_rps,
                "ratio_range": (min(ratios), max(ratios)),
                "prefill_time": one["prefill_time"],
                "prefill_time_ratio": one["prefill_time"] / plain["prefill_time"],
                "loaded": sum(taken) if taken else None,
            }
        summary[method] = rows
    return summary


SPLIT_MEANING = {
    "plain": "no connector",
    "noop": "a connector that does nothing (vLLM's machinery)",
    "threads": "kvbridge producer, no decode leg",
    "decode": "kvbridge producer, decode takes every entry",
    "no-lend": "the same, kv_lend_blocks false",
}


def split_table(summary: dict[str, dict[str, dict[str, Any]]], workload: Workload) -> str:
    variants = list(next(iter(summary.values())))
    lines = [
        f"The prefill instance's gap, split (core 0, {workload.prompt}-token prompts, max_tokens=1, "
        f"{workload.producer_clients[0]} clients, {workload.split_batches} batches of "
        f"{workload.producer_clients[0] * workload.producer_requests} per variant and method; alone: each variant "
        "in its own window; alternating: batch by batch, variants in turn):",
        "",
        "| variant | alone req/s | alone ratio | alternating req/s | alternating ratio (batch range) | "
        "prefill time sum, alone / alternating (s) | its ratio to plain, alone / alternating | "
        "entries taken |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant in variants:
        alone, alt = summary["alone"][variant], summary["alternating"][variant]
        low, high = alt["ratio_range"]
        loaded = (
            "-" if alt["loaded"] is None else f"{alone['loaded']}+{alt['loaded']}/{alone['requests'] + alt['requests']}"
        )
        lines.append(
            f"| {variant}: {SPLIT_MEANING[variant]} | {alone['rps']:.2f} | {alone['ratio']:.2f}x | "
            f"{alt['rps']:.2f} | {alt['ratio']:.2f}x ({low:.2f}-{high:.2f}) | "
            f"{alone['prefill_time']:.2f} / {alt['prefill_time']:.2f} | "
            f"{alone['prefill_time_ratio']:.2f} / {alt['prefill_time_ratio']:.2f} | {loaded} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- setups


def _spec(
    name: str,
    model: str,
    workload: Workload,
    cores: set[int],
    address: str,
    host: int,
    transfer: dict[str, Any] | None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    port = free_port()
    argv = (
        vllm_serve_command(model, address, port, transfer, serve_args(workload))
        if transfer is not None
        else [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            address,
            "--port",
            str(port),
            *serve_args(workload),
        ]
    )
    return {
        "name": name,
        "argv": argv,
        "env": env or {},
        "cores": cores,
        "address": address,
        "port": port,
        "host": host,
    }


def pair_specs(kind: str, model: str, workload: Workload, addresses: tuple[str, str]) -> list[dict[str, Any]]:
    if kind == "kvbridge":
        kv_port = free_port()
        extra = {"kv_connect_timeout": 300, **json.loads(workload.kv_extra)}
        return [
            _spec(
                "prefill",
                model,
                workload,
                {0},
                addresses[0],
                0,
                kv_transfer_config("kv_producer", addresses[0], kv_port, extra),
            ),
            _spec(
                "decode",
                model,
                workload,
                {1},
                addresses[1],
                1,
                {**kv_transfer_config("kv_consumer", addresses[0], kv_port, extra), "kv_load_failure_policy": "fail"},
            ),
        ]
    transfer = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "fail",
    }
    specs = []
    for index, name in enumerate(("prefill", "decode")):
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NIXL_SIDE_CHANNEL_HOST": addresses[index]}
        if addresses[0] != addresses[1]:
            env["UCX_TLS"] = "tcp"  # UCX finds shared memory between namespaces otherwise
        specs.append(_spec(name, model, workload, {index}, addresses[index], index, transfer, env))
    return specs


def run_setup(
    setup: str, model: str, workload: Workload, plan: Plan, log_dir: Path, measure: set[str]
) -> dict[str, Any]:
    """Start one setup, measure it, stop it. ``setup``: plain, plain-prefill, kvbridge, nixl, or a pair
    with ``@netns`` / ``@1gbit`` (across two namespaces, the link unlimited or limited)."""
    local = ("127.0.0.1", "127.0.0.1")
    if setup in PLAIN_CORES:
        with servers([_spec(setup, model, workload, PLAIN_CORES[setup], local[0], 0, None)], log_dir, setup) as (
            server,
        ):
            return {"serving": measure_serving(setup, {"decode": server.url}, plan, workload)}
    kind, _, where = setup.partition("@")
    if not where:
        specs = pair_specs(kind, model, workload, local)
        if "producer" in measure:  # the same prefill instance without a connector, beside it, idle meanwhile
            specs.append(_spec("plain-prefill", model, workload, {0}, local[0], 0, None))
        with servers(specs, log_dir, setup) as started:
            result = _measure_pair(setup, started[0], started[1], plan, workload, measure - {"producer"})
            if "producer" in measure:
                result["producer"] = measure_producer(
                    setup, {"prefill": started[0].url, "decode": started[1].url}, started[2].url, plan
                )
            return result
    with netns.two_hosts() as hosts:
        if where == "1gbit":
            for host in (0, 1):
                hosts.tc(
                    host,
                    "qdisc",
                    "add",
                    "dev",
                    hosts.links[host],
                    "root",
                    "tbf",
                    "rate",
                    LINK_RATE,
                    "burst",
                    "512kb",
                    "latency",
                    "50ms",
                )
        specs = pair_specs(kind, model, workload, hosts.addresses)
        with servers(specs, log_dir, setup, hosts) as (prefill_server, decode_server):
            out = log_dir / f"{setup}-client.json"
            args = {
                "setup": setup,
                "urls": {"prefill": prefill_server.url, "decode": decode_server.url},
                "workload": dataclasses.asdict(workload),
                "measure": sorted(measure - {"producer"}),
            }
            client = [sys.executable, "-m", "benchmarks.bench_e2e", "--client", json.dumps(args), str(out)]
            subprocess.run(
                ["ip", "netns", "exec", hosts.names[1], *client], env=netns.child_env(), check=True, timeout=3600
            )
            return _from_json(json.loads(out.read_text()))


def _measure_pair(
    setup: str, prefill_server: Server, decode_server: Server, plan: Plan, workload: Workload, measure: set[str]
) -> dict[str, Any]:
    urls = {"prefill": prefill_server.url, "decode": decode_server.url}
    result: dict[str, Any] = {}
    if "serving" in measure:
        before = metric(decode_server.url, LOADED_METRIC)
        result["serving"] = measure_serving(setup, urls, plan, workload)
        time.sleep(1.5)  # vLLM records the last steps' stats after them
        result["serving"]["external_tokens"] = metric(decode_server.url, LOADED_METRIC) - before
    return result


def _client_main(args: list[str]) -> None:
    """``--client JSON OUT``: measure a pair from inside the decode namespace; save the records."""
    spec = json.loads(args[0])
    workload = Workload(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["workload"].items()})
    result = _measure_pair(
        spec["setup"],
        Server("prefill", spec["urls"]["prefill"], set(), None),  # type: ignore[arg-type]
        Server("decode", spec["urls"]["decode"], set(), None),  # type: ignore[arg-type]
        Plan.of(workload),
        workload,
        set(spec["measure"]),
    )
    Path(args[1]).write_text(json.dumps(_to_json(result)))


def _to_json(result: Any) -> Any:
    if isinstance(result, Record):
        return {"__record__": dataclasses.asdict(result)}
    if isinstance(result, dict):
        return {str(k): _to_json(v) for k, v in result.items()}
    if isinstance(result, list):
        return [_to_json(v) for v in result]
    return result


def _from_json(result: Any) -> Any:
    if isinstance(result, dict):
        if "__record__" in result:
            return Record(**result["__record__"])
        return {int(k) if k.isdigit() else k: _from_json(v) for k, v in result.items()}
    if isinstance(result, list):
        return [_from_json(v) for v in result]
    return result


# ---------------------------------------------------------------------- analysis


def summarise(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per setup: sequential TTFT and legs, per concurrency TTFT/ITL/req/s, answers against plain, producer rps."""
    reference = results.get("plain", {}).get("serving")

    def answers(serving: dict[str, Any]) -> list[list[int]]:
        return [r.token_ids for r in serving["sequential"]] + [
            r.token_ids for c in sorted(serving["concurrent"]) for r in serving["concurrent"][c]["records"]
        ]

    summary: dict[str, Any] = {}
    for setup, result in results.items():
        row: dict[str, Any] = {}
        serving = result.get("serving")
        if serving is not None:
            seq = serving["sequential"]
            row["seq_ttft"] = statistics.median(r.ttft for r in seq)
            if seq[0].prefill_done is not None:
                row["seq_prefill"] = statistics.median(r.prefill_done - r.start for r in seq)
                row["seq_decode"] = statistics.median(r.tokens[0] - r.prefill_done for r in seq)
            row["concurrent"] = {}
            for clients, run in serving["concurrent"].items():
                records = run["records"]
                gaps = [gap for r in records for gap in r.gaps]
                row["concurrent"][clients] = {
                    "ttft_p50": _pct([r.ttft for r in records], 50),
                    "ttft_p99": _pct([r.ttft for r in records], 99),
                    "itl_p50": _pct(gaps, 50),
                    "itl_p99": _pct(gaps, 99),
                    "rps": len(records) / run["seconds"],
                }
            mine = answers(serving)
            row["loaded"] = (
                sum(1 for r in seq if r.cached)
                + sum(1 for run in serving["concurrent"].values() for r in run["records"] if r.cached),
                len(mine),
            )
            if "external_tokens" in serving:  # warm-up requests included
                row["external_per_request"] = serving["external_tokens"] / (len(mine) + 2)
            if reference is not None:
                row["equal"] = (sum(1 for a, b in zip(mine, answers(reference), strict=True) if a == b), len(mine))
        if "producer" in result:
            row["producer"] = {}
            for clients, sides in result["producer"].items():
                mine, plain = sides[setup], sides["plain-prefill"]
                ratios = [a["rps"] / b["rps"] for a, b in zip(mine, plain, strict=True)]
                row["producer"][clients] = {
                    "rounds": len(mine),
                    "requests": mine[0]["requests"],
                    "rps": statistics.median(one["rps"] for one in mine),
                    "plain_rps": statistics.median(one["rps"] for one in plain),
                    "ratio": statistics.median(ratios),
                    "ratio_range": (min(ratios), max(ratios)),
                    "latency_p50": statistics.median(one["latency_p50"] for one in mine),
                    "plain_latency_p50": statistics.median(one["latency_p50"] for one in plain),
                    "loaded": sum(one["loaded"] or 0 for one in mine),
                    "taken": sum(one["requests"] for one in mine),
                }
        summary[setup] = row
    return summary


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def tables(summary: dict[str, Any], workload: Workload) -> str:
    lines = [
        f"Sequential, {workload.prompt}-token prompts, {workload.max_tokens} tokens (median, ms):",
        "",
        "| setup | TTFT | prefill leg | decode leg (load + first token) | answers = plain | "
        "requests reporting cached tokens | tokens loaded per request |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for setup, row in summary.items():
        if "seq_ttft" not in row:
            continue
        equal = f"{row['equal'][0]}/{row['equal'][1]}" if "equal" in row else "-"
        loaded = f"{row['loaded'][0]}/{row['loaded'][1]}" if row.get("seq_prefill") is not None else "-"
        external = f"{row['external_per_request']:.0f}" if "external_per_request" in row else "-"
        lines.append(
            f"| {setup} | {_ms(row['seq_ttft'])} | {_ms(row.get('seq_prefill'))} | "
            f"{_ms(row.get('seq_decode'))} | {equal} | {loaded} | {external} |"
        )
    lines += [
        "",
        "Concurrent clients: TTFT p50/p99, ITL p50/p99 (ms), requests per second:",
        "",
        "| setup | clients | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | req/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for setup, row in summary.items():
        for clients, c in row.get("concurrent", {}).items():
            lines.append(
                f"| {setup} | {clients} | {_ms(c['ttft_p50'])} | {_ms(c['ttft_p99'])} | {_ms(c['itl_p50'])} | "
                f"{_ms(c['itl_p99'])} | {c['rps']:.2f} |"
            )
    producer_rows = [(setup, row["producer"]) for setup, row in summary.items() if "producer" in row]
    if producer_rows:
        lines += [
            "",
            "The prefill instance (core 0), prefill requests only (max_tokens=1), against the same "
            "instance without a connector, alternating rounds (medians; the ratio's range over rounds):",
            "",
            "| setup | clients | rounds x requests | req/s | without connector | ratio | prefill answer p50 "
            "(ms), with / without | entries loaded |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for setup, producer in producer_rows:
            for clients, one in producer.items():
                low, high = one["ratio_range"]
                lines.append(
                    f"| {setup} | {clients} | {one['rounds']} x {one['requests']} | {one['rps']:.2f} | "
                    f"{one['plain_rps']:.2f} | {one['ratio']:.2f}x ({low:.2f}-{high:.2f}) | "
                    f"{_ms(one['latency_p50'])} / {_ms(one['plain_latency_p50'])} | "
                    f"{one['loaded']}/{one['taken']} |"
                )
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    serving = {setup: row for setup, row in summary.items() if "concurrent" in row}
    figure, axes = plt.subplots(1, 4, figsize=(17, 4))
    for setup, row in serving.items():
        clients = sorted(row["concurrent"])
        for axis, key, scale in ((axes[0], "ttft_p50", 1e3), (axes[1], "itl_p50", 1e3), (axes[2], "rps", 1)):
            axis.plot(clients, [row["concurrent"][c][key] * scale for c in clients], marker="o", label=setup)
    for axis, title in zip(axes[:3], ("TTFT p50 (ms)", "ITL p50 (ms)", "requests per second"), strict=True):
        axis.set_title(title)
        axis.set_xlabel("clients")
        axis.legend(fontsize=7)
    producers = [(setup, row["producer"]) for setup, row in summary.items() if "producer" in row]
    bars = [("without connector", None)] + [(setup, setup) for setup, _ in producers]
    width = 0.8 / len(bars)
    clients = sorted(producers[0][1]) if producers else []
    for index, (label, setup) in enumerate(bars):
        source = dict(producers)[setup] if setup else (producers[0][1] if producers else {})
        key = "rps" if setup else "plain_rps"
        axes[3].bar(
            [i + index * width for i in range(len(clients))], [source[c][key] for c in clients], width, label=label
        )
    axes[3].set_xticks([i + 0.4 - width / 2 for i in range(len(clients))], [f"{c} clients" for c in clients])
    axes[3].set_title("prefill instance: prefill requests/s")
    axes[3].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True


def main() -> int:
    # SIGTERM (timeout, a CI runner) unwinds like Ctrl-C, so that every server is stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        _client_main(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: short prompts, few requests")
    parser.add_argument("--setups", default="plain,kvbridge,nixl", help="plain, kvbridge, nixl")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the producer measurement")
    parser.add_argument("--clients", default=None, help="concurrencies, e.g. 1,4,8")
    parser.add_argument("--producer-clients", default=None, help="concurrencies of the producer measurement, e.g. 4,8")
    parser.add_argument("--measure", default="serving,producer", help="serving, producer, split")
    parser.add_argument(
        "--split-variants",
        default="plain,noop,threads,decode",
        help=f"the split measurement's prefill instances, plain first: {', '.join(SPLIT_VARIANTS)}",
    )
    parser.add_argument("--split-batches", type=int, default=None, help="batches per variant and method (split)")
    parser.add_argument(
        "--producer-requests",
        type=int,
        default=None,
        help="prefill requests per client in a producer round or a split batch",
    )
    parser.add_argument("--kv-extra", default=None, help='kvbridge settings (JSON), e.g. {"kv_lend_blocks": false}')
    parser.add_argument("--netns", action="store_true", help="the pairs also across two namespaces (needs root)")
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--kv-memory", type=int, default=None, help="each instance's --kv-cache-memory-bytes")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--json", action="store_true", help="print the summary as JSON too")
    args = parser.parse_args()
    workload = QUICK if args.quick else Workload()
    if args.clients:
        workload = dataclasses.replace(workload, clients=tuple(int(c) for c in args.clients.split(",")))
    if args.producer_clients:
        workload = dataclasses.replace(
            workload, producer_clients=tuple(int(c) for c in args.producer_clients.split(","))
        )
    if args.prompt:
        workload = dataclasses.replace(workload, prompt=args.prompt)
    if args.kv_memory:
        workload = dataclasses.replace(workload, kv_memory=args.kv_memory)
    if args.kv_extra:
        workload = dataclasses.replace(workload, kv_extra=args.kv_extra)
    if args.rounds:
        workload = dataclasses.replace(workload, rounds=args.rounds)
    if args.producer_requests:
        workload = dataclasses.replace(workload, producer_requests=args.producer_requests)
    if args.split_batches:
        workload = dataclasses.replace(workload, split_batches=args.split_batches)
    measure = set(args.measure.split(","))
    split_variants = args.split_variants.split(",")
    if split_variants[0] != "plain" or not set(split_variants) <= set(SPLIT_VARIANTS):
        parser.error(f"--split-variants: plain first, then any of {', '.join(SPLIT_VARIANTS)}")
    setups = args.setups.split(",") if measure & {"serving", "producer"} else []
    if "serving" not in measure:
        setups = [s for s in setups if s not in PLAIN_CORES]
    if args.netns:
        setups += [f"{kind}@{where}" for where in ("netns", "1gbit") for kind in ("kvbridge", "nixl") if kind in setups]
    args.out.mkdir(parents=True, exist_ok=True)
    plan = Plan.of(workload)
    results: dict[str, dict[str, Any]] = {}
    print(f"load average before: {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as scratch:
        positions = max(2048, workload.prompt + workload.max_tokens + 64)
        model = make_heavy_kv_llama(Path(scratch) / "model", max_positions=positions)
        for setup in setups:
            log_dir = args.out / "logs"
            log_dir.mkdir(exist_ok=True)
            started = time.monotonic()
            try:
                results[setup] = run_setup(setup, model, workload, plan, log_dir, measure)
            except netns.NamespacesUnavailable as exc:
                print(f"{setup}: skipped ({exc})", flush=True)
                continue
            print(
                f"{setup}: done in {time.monotonic() - started:.0f} s, load average "
                f"{Path('/proc/loadavg').read_text().split()[:3]}",
                flush=True,
            )
        split = None
        if "split" in measure:
            started = time.monotonic()
            (args.out / "logs").mkdir(exist_ok=True)
            split = run_split(model, workload, split_variants, args.out / "logs")
            print(
                f"split: done in {time.monotonic() - started:.0f} s, load average "
                f"{Path('/proc/loadavg').read_text().split()[:3]}",
                flush=True,
            )
    summary = summarise(results)
    print(tables(summary, workload))
    split_summary = summarise_split(split) if split is not None else None
    if split_summary is not None:
        print()
        print(split_table(split_summary, workload))
    (args.out / "bench_e2e.json").write_text(
        json.dumps(
            _to_json(
                {
                    "workload": dataclasses.asdict(workload),
                    "summary": summary,
                    "results": results,
                    "split": split,
                    "split_summary": split_summary,
                }
            )
        )
    )
    if results and plot(summary, args.out / "bench_e2e.png"):
        print(f"saved {args.out / 'bench_e2e.png'}")
    if args.json:
        print(json.dumps(_to_json(summary)))
    failures = [setup for setup, row in summary.items() if "equal" in row and row["equal"][0] != row["equal"][1]]
    if failures:
        print(f"answers differ from the plain server's: {failures}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
