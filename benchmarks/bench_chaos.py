"""Chaos soak: prefill and decode ``vllm serve`` instances (``--prefills`` and ``--decodes``, 2 of each
by default) with kvbridge's connector behind kvbridge's proxy, under memory pressure, while instances
are SIGKILLed and restarted and clients go away.

Setup (one host, the instances pinned to cores 0 and 1):

* a tiny random Llama (1024 positions); a pool of prompts of 400-650 tokens (chunked: 128-token
  steps), reused all along the run, and a second pool for abandoned prefills;
* one plain ``vllm serve`` (no connector) answers the pool first, then stops: the reference;
* prefill instances get a 33-block KV cache (one 1024-token request) and ``kv_entry_timeout``
  ``--entry-timeout`` (default: the request bound); decode instances fail a request whose load failed
  (``kv_load_failure_policy: fail``), so no answer can come from a load that silently failed.

Load, for ``--duration`` seconds, from ``--clients`` client threads, each prompt picked at random:

* ``proxy``: a completion through kvbridge's proxy (in this process; round robin over the prefill
  instances, least outstanding over the decode ones), greedy, ``ignore_eos``, 8 tokens, token ids
  returned; about one in four streamed; none while every decode instance is down (with one decode
  instance: while it restarts), since the proxy has nowhere to send it then;
* ``long`` (a share ``--long-share`` of the requests): the P/D flow by hand, its prefill request
  generating ``--long-tokens`` tokens after its KV was saved, as in
  ``tests/serving/test_serving_under_pressure.py``: prefill-only requests never preempt (a request leaves
  right after its last chunk), requests that keep generating make vLLM preempt on the prefill
  instances, so entries are taken back.

Every answer is compared with the reference (tokens and text). Faults injected:

* abandoned prefills: every ``--abandon-every`` seconds a prefill-only request (as the proxy sends)
  straight to a prefill instance, never followed by its decode request: an entry nobody takes;
* every ``--kill-every`` seconds a random instance is SIGKILLed (its whole process group) and
  restarted on the same ports, one at a time (the next kill waits for the restart); no kill starts
  in the last half period (or, with ``--max-kills N``: N kills, the load going on until
  ``--after-restart`` seconds after the last restart);
* a failing rank (``--kill-roles prefill-rank,decode-rank`` with ``--prefill-tp`` / ``--decode-tp``
  2): one TP worker process of an instance is SIGKILLed, not the instance. The instance must then
  exit, or still answer, within 90 s (it is probed with a small request every few seconds: vLLM's
  API server leaves once a request meets its dead engine); one that does neither is a hang and
  fails the run. What is left of it is then killed and it is restarted like the others.

Tensor parallelism: ``--prefill-tp`` and ``--decode-tp`` give the prefill and decode instances that
many TP ranks (vLLM worker processes, rank r of an instance on core ``(its core + r) % 2``; prefill i
on core ``i % 2``, decode j on core ``(1 + j) % 2``); the reference server runs at the decode
instances' TP size, so its sums run in the same order. On a 2-core host four TP 2 instances are too
many (8 workers, 4 engine cores, 4 API servers): ``--prefills 1 --decodes 1`` with one role at TP 2
is the fleet that fits.

Errors are classified by cause and each is checked against the kills: an error is *expected* only
when an instance of the role its cause names (for the P/D flow by hand, that very instance) was
killed while the request was in flight; after a rank kill, an error of a request at that instance
(through the proxy: at any) between the kill and the instance's exit is expected too. The causes:

* ``decode killed``: the decode instance's connection broke (the proxy answers 502, cuts a JSON
  answer or ends a stream with an error event);
* ``prefill killed``: the prefill instance's connection broke or it answered 500 (P/D flow by hand
  only: the proxy sends such a request to the next prefill instance, and with none left to a decode
  instance told that nothing was saved, which computes the prompt);
* ``load failed``: the decode instance answered 500 (its load failed and ``fail`` failed the
  request): expected when a prefill instance was killed meanwhile, or when the request took longer
  than ``--entry-timeout`` from its start to the decode instance's answer. An entry's
  ``kv_entry_timeout`` counts from its save, which comes after the request was sent, and an entry
  that leaves before its prefill request finished is announced with 0 tokens (the decode instance
  computes the prompt, no load): so an entry can have expired under a load only if the load's
  select came more than ``kv_entry_timeout`` after the request was sent. The P/D flow by hand also
  records when its prefill answered, to tell the prefill's own generation from the decode's wait;
* ``hang``: no answer within ``--bound`` seconds; anything else is ``other``.

After the load, the gauges of every live instance (``vllm:kvbridge_entries_held``,
``_bytes_buffered``, ``_loans_out``, ``_blocks_lent``, ``_loads_in_flight``, ``_connections``) and
vLLM's ``vllm:kv_cache_usage_perc`` are polled until they are idle (0, connections at most one per
pair of ranks sharing KV heads with an instance of the other role, the KV cache usage what it was
when that life of the instance started, before any request: every block vLLM lent or held is free
again), for
``--entry-timeout`` plus 30 s; an instance still not idle then gets one small request to make its
engine step (said in the output), and is polled again. Counters (preemptions, loads, entries) are
read from ``/metrics`` just before each kill and at the end, and summed over an instance's lives.

Prints a table; ``--out`` writes every figure as JSON. Exit status 0 when no answer was wrong, none
hung, every error was expected and every gauge came back to idle, else 1.

    python -m benchmarks.bench_chaos [--duration 600] [--kill-every 60] [--clients 6] [--seed 0]
        [--prefills 1 --decodes 1] [--prefill-tp 2 --decode-tp 2 --kill-roles prefill-rank,decode-rank,prefill,decode]
        [--out chaos.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import logging
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from connector.vllm_worker import GAUGES
from harness import vllm_procs as vp
from harness import xpyd as xp
from harness.servers import PRESSED_ARGS, ROOMY_ARGS, ThreadedProxy
from launch import proxy
from launch.table import format_table

logger = logging.getLogger("bench_chaos")

PROMPT_LENGTHS = (400, 650)
#: Counters read from ``/metrics`` (summed over series), by their short name.
COUNTERS = {
    "preemptions": "vllm:num_preemptions_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "local_hits": "vllm:prefix_cache_hits_total",
    "external_hits": "vllm:external_prefix_cache_hits_total",
    "external_queries": "vllm:external_prefix_cache_queries_total",
    "saved_requests": "vllm:kvbridge_saved_requests_total",
    "save_failures": "vllm:kvbridge_save_failures_total",
    "taken_back": "vllm:kvbridge_taken_back_total",
    "expired": "vllm:kvbridge_expired_entries_total",
    "evicted": "vllm:kvbridge_evicted_entries_total",
    "drained": "vllm:kvbridge_drained_total",
    "load_hits": "vllm:kvbridge_load_hits_total",
    "load_misses": "vllm:kvbridge_load_misses_total",
    "load_errors": "vllm:kvbridge_load_errors_total",
}
GAUGE_METRICS = {name: f"vllm:kvbridge_{name}" for name in GAUGES}
#: vLLM's share of its KV cache's blocks in use (free blocks include cached ones no request holds): at
#: rest it must be back where the instance's life started.
USAGE, USAGE_METRIC = "kv_cache_usage", "vllm:kv_cache_usage_perc"
#: How long an instance whose TP rank was killed may take to exit (or answer) before it counts as hung.
RANK_FAILURE_BOUND = 90.0
#: Error causes (see the module docstring) and the role of the instance whose kill explains each.
DECODE_KILLED, PREFILL_KILLED, LOAD_FAILED, HANG = "decode killed", "prefill killed", "load failed", "hang"
CAUSE_ROLE = {DECODE_KILLED: "decode", PREFILL_KILLED: "prefill", LOAD_FAILED: "prefill"}


def role_of(instance: xp.Instance) -> str:
    return "prefill" if instance.role == "kv_producer" else "decode"


@dataclasses.dataclass(frozen=True)
class Settings:
    duration: float = 600.0
    kill_every: float = 60.0
    clients: int = 6
    seed: int = 0
    prompts: int = 48
    abandon_every: float = 10.0
    long_share: float = 0.34
    long_tokens: int = 64
    stream_share: float = 0.25
    #: kv_entry_timeout of every instance: at least the bound, so that an entry expires under a load
    #: only when its request is slower than a request may be.
    entry_timeout: float = xp.REQUEST_TIMEOUT
    bound: float = xp.REQUEST_TIMEOUT
    #: Roles of the victims in turn (e.g. ("prefill", "decode")); empty: any instance at random. A role
    #: with ``-rank`` (``prefill-rank``, ``decode-rank``) kills one TP worker of such an instance, not
    #: the instance: a failing rank (TP size at least 2).
    kill_roles: tuple[str, ...] = ()
    #: With ``max_kills`` > 0: exactly that many kills (none left out near the end), and the load goes
    #: on past ``duration`` until ``after_restart`` seconds after the last restart (at most 3 x
    #: ``duration``), so that every restarted instance serves again. 0: kills until near the end.
    max_kills: int = 0
    after_restart: float = 20.0
    #: TP sizes of the prefill and decode instances (each rank a vLLM worker process, the ranks on both cores).
    prefill_tp: int = 1
    decode_tp: int = 1
    #: Seconds an instance's (re)start may take until it answers (TP instances on a busy host: more).
    ready_timeout: float = xp.READY_TIMEOUT
    #: kvbridge's ``kv_timeout`` and ``kv_load_timeout`` of every instance (None: the harness's 5 and 8 s).
    kv_timeout: float | None = None
    #: How many prefill and decode instances: fewer fit a small host with TP (each rank a process).
    prefills: int = 2
    decodes: int = 2


# ---------------------------------------------------------------------- prompts, reference, cluster


def prompt_pool(count: int, seed: int) -> list[list[int]]:
    """``count`` distinct prompts of 400-650 tokens."""
    rng = random.Random(seed)
    pool: dict[tuple[int, ...], None] = {}
    while len(pool) < count:
        pool[tuple(rng.randrange(5, vp.VOCAB) for _ in range(rng.randint(*PROMPT_LENGTHS)))] = None
    return [list(prompt) for prompt in pool]


def reference_answers(
    model: str, prompts: list[list[int]], logs: Path, clients: int = 6, tp: int = 1
) -> dict[tuple[int, ...], tuple[str, list[int]]]:
    """(text, token ids) of every prompt from one plain ``vllm serve`` with room for all of them (at
    the decode instances' TP size ``tp``: the same sums in the same order), stopped before returning."""
    logs.mkdir(parents=True, exist_ok=True)
    return xp.plain_answers(model, prompts, logs / "reference.log", ROOMY_ARGS, clients, tp)


def chaos_cluster(model: str, logs: Path, settings: Settings) -> xp.Fleet:
    """The settings' prefill instances (pressed KV cache, ``kv_entry_timeout`` of the settings) and
    decode instances (roomy, ``fail`` on a failed load), each pinned to one of the two cores (its ranks
    on both)."""
    kv_extra: dict[str, Any] = {"kv_entry_timeout": settings.entry_timeout}
    if settings.kv_timeout is not None:
        kv_extra |= {"kv_timeout": settings.kv_timeout, "kv_load_timeout": settings.kv_timeout}
    return xp.Fleet(
        model,
        logs,
        prefill_args=PRESSED_ARGS,
        decode_args=ROOMY_ARGS,
        kv_extra=kv_extra,
        prefill_tp=settings.prefill_tp,
        decode_tp=settings.decode_tp,
        ready_timeout=settings.ready_timeout,
        prefills=settings.prefills,
        decodes=settings.decodes,
    )


# ---------------------------------------------------------------------- metrics


def read_metrics(url: str, names: dict[str, str], timeout: float = 10.0) -> dict[str, float]:
    """The sum of every series of each metric of ``names`` (short name -> Prometheus name) in the
    instance's ``/metrics``; 0 for a metric it does not show."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as response:
        text = response.read().decode()
    values = dict.fromkeys(names, 0.0)
    by_metric = {metric: short for short, metric in names.items()}
    for match in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$", text, re.MULTILINE):
        short = by_metric.get(match.group(1))
        if short is not None:
            values[short] += float(match.group(2))
    return values


def gauges_idle(gauges: dict[str, float], usage_at_start: float, most_connections: int = 2) -> bool:
    """Idle: nothing held, lent, buffered or loading; at most ``most_connections`` connections (see
    :func:`most_connections`); vLLM's KV cache usage back where it started (every block free again)."""
    return (
        all(value == 0 for name, value in gauges.items() if name not in ("connections", USAGE))
        and gauges["connections"] <= most_connections
        and gauges[USAGE] == usage_at_start
    )


def most_connections(settings: Settings, role: str) -> int:
    """Connections an idle instance of ``role`` may keep, summed over its ranks: each pair of a
    prefill and a decode rank that share KV heads keeps one, ``max(prefill_tp, decode_tp)`` per
    instance of the other role (TP sizes divide one another)."""
    others = settings.decodes if role == "prefill" else settings.prefills
    return others * max(settings.prefill_tp, settings.decode_tp)


def kv_cache_usage(instance: xp.Instance) -> float:
    return read_metrics(instance.url, {USAGE: USAGE_METRIC})[USAGE]


def nudge(instance: xp.Instance, timeout: float = xp.REQUEST_TIMEOUT) -> None:
    """One small request (within one block: no KV moves) so that the instance's engine steps."""
    body = xp.completion_body(list(range(5, 5 + vp.BLOCK_SIZE // 2)))
    if role_of(instance) == "prefill":
        body = proxy.prefill_body(body)
    xp.post(instance.url + "/v1/completions", body, timeout=timeout)


def settle(
    instances: list[xp.Instance],
    usage_at_start: dict[str, float],
    wait: float,
    connections: dict[str, int],
    poll: float = 2.0,
) -> dict[str, Any]:
    """Poll the gauges of every live instance until all are idle (``usage_at_start``: each instance's
    KV cache usage when its life started; ``connections``: the most each may keep) or ``wait`` seconds
    passed; then nudge those still busy (one small request each) and poll again for 30 s."""
    start = time.monotonic()
    live = [i for i in instances if i.alive]
    gauges: dict[str, dict[str, float]] = {}
    idle_after: dict[str, float | None] = dict.fromkeys(i.name for i in live)
    nudged: list[str] = []

    def poll_until(deadline: float) -> bool:
        while True:
            for instance in live:
                try:
                    gauges[instance.name] = read_metrics(instance.url, {**GAUGE_METRICS, USAGE: USAGE_METRIC})
                except (urllib.error.URLError, OSError) as exc:
                    logger.warning("reading the gauges of %s failed: %s", instance.name, exc)
                    continue
                if idle_after[instance.name] is None and gauges_idle(
                    gauges[instance.name], usage_at_start[instance.name], connections[instance.name]
                ):
                    idle_after[instance.name] = round(time.monotonic() - start, 1)
            if all(value is not None for value in idle_after.values()) or time.monotonic() >= deadline:
                return all(value is not None for value in idle_after.values())
            time.sleep(poll)

    idle = poll_until(start + wait)
    if not idle:
        for instance in live:
            if idle_after[instance.name] is None:
                logger.warning(
                    "%s not idle %.0f s after the load (%s): sending it one small request",
                    instance.name,
                    time.monotonic() - start,
                    gauges.get(instance.name),
                )
                nudged.append(instance.name)
                try:
                    nudge(instance)
                except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
                    logger.warning("the nudge of %s failed: %s", instance.name, exc)
        idle = poll_until(time.monotonic() + 30)
    return {
        "idle": idle,
        "gauges": gauges,
        "idle_after_s": idle_after,
        "nudged": nudged,
        "not_live": [i.name for i in instances if not i.alive],
        "usage_at_start": usage_at_start,
        "most_connections": connections,
    }


# ---------------------------------------------------------------------- requests and their outcomes


@dataclasses.dataclass
class Outcome:
    flow: str  # "proxy" or "long"
    prompt: int
    start: float
    end: float
    prefill: str | None = None  # the instances of the P/D flow by hand
    decode: str | None = None
    answered: float | None = None  # the P/D flow by hand: when its prefill request answered
    cached: int | None = None
    wrong: bool = False
    cause: str | None = None  # None: served
    detail: str = ""
    expected: bool = False
    explained_by: str = ""  # what explains an expected error: "kill", "dead rank", "entry timeout"

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclasses.dataclass
class Kill:
    victim: str
    role: str
    at: float  # seconds since the load started
    ready: float | None = None  # restarted and healthy
    in_flight: int = 0  # requests in flight when it was killed
    rank: int | None = None  # a TP worker killed, not the instance
    #: After a rank kill: when the instance was gone (its API server exited, else it was killed once it
    #: failed its probe), and how it went: "exited", "answered" (it still served), or "hung".
    gone: float | None = None
    failed_how: str | None = None

    @property
    def failing_until(self) -> float:
        """Until when the victim may fail requests: a killed instance at once, one with a dead rank
        until it is gone."""
        return self.gone if self.gone is not None else self.at


class _ProtocolProblem(Exception):
    """An answer that lacks what it must carry."""


def _is_timeout(exc: BaseException) -> bool:
    reason = getattr(exc, "reason", None)
    return isinstance(exc, (TimeoutError, socket.timeout)) or isinstance(reason, (TimeoutError, socket.timeout))


def classify(exc: BaseException, stage: str, via_proxy: bool) -> tuple[str, str]:
    """(cause, detail) of a failed request; ``stage`` is "prefill" or "decode"."""
    if _is_timeout(exc):
        return HANG, repr(exc)
    if isinstance(exc, urllib.error.HTTPError):
        try:
            body = exc.read().decode(errors="replace")
        except (OSError, http.client.HTTPException):
            body = ""
        detail = f"HTTP {exc.code}: {body[:300]}"
        if stage == "decode" and exc.code == 500:
            return LOAD_FAILED, detail
        if stage == "prefill" and exc.code == 500:  # the P/D flow by hand: its engine died under it
            return PREFILL_KILLED, detail
        if via_proxy and exc.code == 502 and "decode instance failed" in body:
            return DECODE_KILLED, detail
        return f"other: HTTP {exc.code}", detail
    if isinstance(exc, RuntimeError) and "error event" in str(exc):  # a stream that ended with an error
        message = str(exc)
        if "decode instance failed" in message:
            return DECODE_KILLED, message[:300]
        if "Internal" in message or "500" in message:
            return LOAD_FAILED, message[:300]
        return "other: stream error", message[:300]
    if isinstance(exc, urllib.error.URLError) and via_proxy:
        return f"other: proxy unreachable ({exc.reason})", repr(exc)
    if isinstance(exc, (ConnectionError, http.client.HTTPException, urllib.error.URLError, json.JSONDecodeError)):
        # a connection reset, refused or cut short; through the proxy, a JSON answer the proxy cut
        return (PREFILL_KILLED if stage == "prefill" else DECODE_KILLED), repr(exc)
    return f"other: {type(exc).__name__}", repr(exc)[:300]


# ---------------------------------------------------------------------- the run


class Chaos:
    """The clients, the abandoner and the killer over a started cluster and proxy."""

    def __init__(
        self,
        settings: Settings,
        cluster: xp.Fleet,
        proxy_url: str,
        prompts: list[list[int]],
        abandon_prompts: list[list[int]],
        reference: dict[tuple[int, ...], tuple[str, list[int]]],
    ) -> None:
        self.settings = settings
        self.cluster = cluster
        self.proxy_url = proxy_url
        self.prompts = prompts
        self.abandon_prompts = abandon_prompts
        self.reference = reference
        self.outcomes: list[Outcome] = []
        self.in_flight: dict[int, tuple[str, float]] = {}  # request serial -> (flow, start)
        self.kills: list[Kill] = []
        self.abandoned: Counter[str] = Counter()
        self.abandon_failures: list[str] = []
        self.down: set[str] = set()
        self.failure: str | None = None
        # counters of the lives that ended (read just before each kill), per instance
        self.retired: dict[str, Counter[str]] = {i.name: Counter() for i in cluster.instances}
        self.counters: dict[str, Counter[str]] = {}  # every life
        self.last_life: dict[str, dict[str, float]] = {}  # the life running at the end (after a restart)
        self.usage_at_start: dict[str, float] = {}  # vLLM's KV cache usage as each instance's life started
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._serial = 0
        self._t0 = 0.0

    def now(self) -> float:
        return time.monotonic() - self._t0

    # ------------------------------------------------------------------ the load

    def run(self, progress: bool = True) -> float:
        """Run the load for the settings' duration; returns its length in seconds."""
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._t0 = time.monotonic()
        threads = [
            threading.Thread(target=self._client, args=(i,), name=f"client{i}", daemon=True)
            for i in range(self.settings.clients)
        ]
        threads.append(threading.Thread(target=self._abandoner, name="abandoner", daemon=True))
        killer = threading.Thread(target=self._killer, name="killer", daemon=True)
        for thread in [*threads, killer]:
            thread.start()
        try:
            with (
                logging_redirect_tqdm(),
                tqdm(
                    total=int(self.settings.duration), unit="s", desc="chaos", disable=not progress, file=sys.stderr
                ) as bar,
            ):
                while not self._load_done() and self.failure is None:
                    time.sleep(1.0)
                    bar.update(min(int(self.now()), int(self.settings.duration)) - bar.n)
                    bar.set_postfix(self._summary(), refresh=False)
        finally:
            self._stop.set()
            length = self.now()
            for thread in threads:  # each finishes its request in flight, bounded by the request bound
                thread.join(timeout=self.settings.bound + 30)
            killer.join(timeout=self.settings.ready_timeout + RANK_FAILURE_BOUND + 60)  # a restart completes
        stuck = [t.name for t in [*threads, killer] if t.is_alive()]
        if stuck:
            self.failure = self.failure or f"threads still running after the load: {stuck}"
        return length

    def _load_done(self) -> bool:
        settings = self.settings
        if self.now() < settings.duration:
            return False
        if settings.max_kills <= 0 or self.now() >= 3 * settings.duration:
            return True
        restarted = [kill.ready for kill in self.kills if kill.ready is not None]
        return len(restarted) >= settings.max_kills and self.now() >= restarted[-1] + settings.after_restart

    def _summary(self) -> dict[str, int]:
        with self._lock:
            outcomes = list(self.outcomes)
        return {
            "served": sum(o.cause is None for o in outcomes),
            "wrong": sum(o.wrong for o in outcomes),
            "errors": sum(o.cause is not None and o.cause != HANG for o in outcomes),
            "hangs": sum(o.cause == HANG for o in outcomes),
            "kills": len(self.kills),
            "abandoned": sum(self.abandoned.values()),
        }

    def _up(self, instances: list[xp.Instance]) -> list[xp.Instance]:
        with self._lock:
            return [i for i in instances if i.name not in self.down]

    def _client(self, index: int) -> None:
        rng = random.Random(f"{self.settings.seed}-client-{index}")
        while not self._stop.is_set():
            prompt = rng.randrange(len(self.prompts))
            flow = "long" if rng.random() < self.settings.long_share else "proxy"
            stream = flow == "proxy" and rng.random() < self.settings.stream_share
            begun = self.begin(flow, rng)
            if begun is None:
                time.sleep(0.2)
                continue
            self._request(*begun, flow, prompt, stream)

    def begin(self, flow: str, rng: random.Random) -> tuple[int, xp.Instance | None, xp.Instance | None] | None:
        """Register a request of ``flow`` as in flight: (its serial, its prefill and decode instances
        for the P/D flow by hand, None through the proxy), or None when no instance it needs is up.
        Done under the lock the killer takes to mark its victim down, so that a request is either
        sent before the kill (in flight at it) or not to the victim at all. The proxy computes at a
        decode instance when every prefill instance failed, but needs a decode instance: with one,
        nothing goes through the proxy while it is down."""
        with self._lock:
            prefills = [i for i in self.cluster.prefills if i.name not in self.down]
            decodes = [i for i in self.cluster.decodes if i.name not in self.down]
            if not decodes or (flow == "long" and not prefills):
                return None
            self._serial += 1
            self.in_flight[self._serial] = (flow, self.now())
            if flow == "long":
                return self._serial, rng.choice(prefills), rng.choice(decodes)
            return self._serial, None, None

    def _request(
        self,
        serial: int,
        prefill: xp.Instance | None,
        decode: xp.Instance | None,
        flow: str,
        index: int,
        stream: bool,
    ) -> None:
        prompt = self.prompts[index]
        body = xp.completion_body(prompt, stream)
        outcome = Outcome(
            flow,
            index,
            self.in_flight[serial][1],
            0.0,
            prefill.name if prefill else None,
            decode.name if decode else None,
        )
        stage = "prefill" if prefill is not None else "decode"
        try:
            if prefill is None or decode is None:
                payload = xp.post(self.proxy_url + "/v1/completions", body, timeout=self.settings.bound)
            else:
                long_prefill = {**proxy.prefill_body(body), "max_tokens": self.settings.long_tokens}
                answered = xp.post(prefill.url + "/v1/completions", long_prefill, timeout=self.settings.bound)
                outcome.answered = self.now()
                params = answered.get("kv_transfer_params")
                if not isinstance(params, dict):
                    raise _ProtocolProblem(f"{prefill.name} answered without kv_transfer_params: {answered}")
                stage = "decode"
                payload = xp.post(
                    decode.url + "/v1/completions", proxy.decode_body(body, params), timeout=self.settings.bound
                )
            answer = xp.answer(payload)
            outcome.cached = answer.cached
            outcome.wrong = answer.tokens != self.reference[tuple(prompt)]
            if outcome.wrong:
                outcome.detail = f"got {answer.tokens}, expected {self.reference[tuple(prompt)]}"
                logger.error(
                    "WRONG answer (%s flow, prompt %d of %d tokens, %s -> %s): %s",
                    flow,
                    index,
                    len(prompt),
                    outcome.prefill,
                    outcome.decode,
                    outcome.detail,
                )
        except _ProtocolProblem as exc:
            outcome.cause, outcome.detail = "other: no kv_transfer_params", str(exc)[:300]
        except Exception as exc:  # every failure is classified and counted
            outcome.cause, outcome.detail = classify(exc, stage, via_proxy=prefill is None)
        outcome.end = self.now()
        with self._lock:
            del self.in_flight[serial]
            self.outcomes.append(outcome)

    def _abandoner(self) -> None:
        """A prefill-only request straight to a prefill instance every ``abandon_every`` seconds, the
        first after half a period; its decode request never comes."""
        rng = random.Random(f"{self.settings.seed}-abandon")
        wait = self.settings.abandon_every / 2
        while not self._stop.wait(wait):
            wait = self.settings.abandon_every
            prefills = self._up(self.cluster.prefills)
            if not prefills:
                continue
            instance = rng.choice(prefills)
            prompt = rng.choice(self.abandon_prompts)
            try:
                xp.post(
                    instance.url + "/v1/completions",
                    proxy.prefill_body(xp.completion_body(prompt)),
                    timeout=self.settings.bound,
                )
                with self._lock:
                    self.abandoned[instance.name] += 1
            except Exception as exc:  # counted; its instance may have been killed
                self.abandon_failures.append(f"{self.now():.1f} s {instance.name}: {classify(exc, 'prefill', False)}")

    def _killer(self) -> None:
        """SIGKILL an instance every ``kill_every`` seconds and restart it on the same ports, one at a time."""
        rng = random.Random(f"{self.settings.seed}-kills")
        every, roles = self.settings.kill_every, self.settings.kill_roles
        next_at = every
        while not self._stop.wait(max(0.0, next_at - self.now())):
            if self.settings.max_kills > 0:
                if len(self.kills) >= self.settings.max_kills:
                    return
            elif self.now() > self.settings.duration - every / 2:
                return
            role = roles[len(self.kills) % len(roles)] if roles else None
            rank = None
            if role is not None and role.endswith("-rank"):
                role = role.removesuffix("-rank")
                rank = rng.randrange(self.settings.prefill_tp if role == "prefill" else self.settings.decode_tp)
            victim = rng.choice([i for i in self.cluster.instances if role is None or role_of(i) == role])
            try:
                self._kill_and_restart(victim, rank)
            except Exception as exc:  # the run stops and says why
                self.failure = f"restarting {victim.name} failed: {exc}"
                logger.error("%s", self.failure)
                return
            next_at = max(next_at + every, self.now())

    def _kill_and_restart(self, victim: xp.Instance, rank: int | None = None) -> None:
        """SIGKILL the instance (its process group), or only its TP rank ``rank``'s worker: then the
        instance must exit or still answer within :data:`RANK_FAILURE_BOUND`, never hang; restart it."""
        with self._lock:
            self.down.add(victim.name)
        try:
            before = read_metrics(victim.url, COUNTERS)
            self.retired[victim.name].update(before)
        except (urllib.error.URLError, OSError) as exc:
            logger.warning("reading the counters of %s before its kill failed: %s", victim.name, exc)
        with self._lock:
            kill = Kill(victim.name, role_of(victim), self.now(), in_flight=len(self.in_flight), rank=rank)
            self.kills.append(kill)
        if rank is None:
            victim.kill()
            logger.info("killed %s at %.1f s (%d requests in flight)", victim.name, kill.at, kill.in_flight)
        else:
            pid = victim.kill_rank(rank)
            logger.info(
                "killed TP rank %d (pid %d) of %s at %.1f s (%d requests in flight)",
                rank,
                pid,
                victim.name,
                kill.at,
                kill.in_flight,
            )
            kill.failed_how = self._await_failure(victim)
            kill.gone = self.now()
            logger.info("%s with a dead rank: %s after %.1f s", victim.name, kill.failed_how, kill.gone - kill.at)
            if kill.failed_how == "hung":
                self.failure = self.failure or (
                    f"{victim.name} neither exited nor answered within "
                    f"{RANK_FAILURE_BOUND:g} s of its TP rank {rank}'s death"
                )
            victim.kill()  # what is left of it
        victim.start()  # same ports; waits until /health answers
        kill.ready = self.now()
        self.record_usage(victim)
        with self._lock:
            self.down.discard(victim.name)
        logger.info("%s restarted in %.1f s", victim.name, kill.ready - kill.at)

    def _await_failure(self, victim: xp.Instance) -> str:
        """How an instance whose TP rank died fails: "exited" (its API server), "answered" (a small
        request was served: it still works), or "hung" (neither within :data:`RANK_FAILURE_BOUND`). It is
        probed with a small request every few seconds: vLLM's API server leaves once a request meets
        the dead engine."""
        deadline = time.monotonic() + RANK_FAILURE_BOUND
        assert victim.server is not None
        process = victim.server.process
        while time.monotonic() < deadline:
            try:
                process.wait(timeout=3)
                return "exited"
            except subprocess.TimeoutExpired:
                pass
            try:
                nudge(victim, timeout=max(1.0, deadline - time.monotonic()))
                return "answered"
            except (urllib.error.URLError, OSError, http.client.HTTPException, json.JSONDecodeError):
                continue  # refused or failed: it is going down
        return "exited" if process.poll() is not None else "hung"

    def record_usage(self, instance: xp.Instance) -> None:
        """vLLM's KV cache usage of the instance's new life, before any request of it."""
        self.usage_at_start[instance.name] = kv_cache_usage(instance)

    # ------------------------------------------------------------------ the figures

    def judge(self) -> None:
        """Mark each error expected or not, and by what (see the module docstring)."""
        for outcome in self.outcomes:
            role = CAUSE_ROLE.get(outcome.cause or "")
            if role is None:
                continue
            named = outcome.prefill if role == "prefill" else outcome.decode  # None through the proxy
            at_a_kill = (
                kill.role == role and named in (None, kill.victim) and outcome.start <= kill.at <= outcome.end
                for kill in self.kills
            )
            if any(at_a_kill):
                outcome.explained_by = "kill"
            elif any(self._failed_by_rank(outcome, kill) for kill in self.kills):
                outcome.explained_by = "dead rank"
            elif outcome.cause == LOAD_FAILED and outcome.seconds > self.settings.entry_timeout:
                outcome.explained_by = "entry timeout"
            else:
                outcome.explained_by = ""
            outcome.expected = bool(outcome.explained_by)
            if not outcome.expected:
                logger.error(
                    "UNEXPECTED error (%s flow, %.1f-%.1f s, %s -> %s): %s: %s",
                    outcome.flow,
                    outcome.start,
                    outcome.end,
                    outcome.prefill,
                    outcome.decode,
                    outcome.cause,
                    outcome.detail,
                )

    @staticmethod
    def _failed_by_rank(outcome: Outcome, kill: Kill) -> bool:
        """An instance whose rank died fails what it serves until it is gone: a request there (through
        the proxy: at any instance) in that time."""
        if kill.rank is None:
            return False
        there = kill.victim in (outcome.prefill, outcome.decode) or outcome.prefill is None
        return there and outcome.start <= kill.failing_until and kill.at <= outcome.end

    def read_final_counters(self) -> None:
        for instance in self.cluster.instances:
            total = Counter(self.retired[instance.name])
            if instance.alive:
                try:
                    self.last_life[instance.name] = read_metrics(instance.url, COUNTERS)
                    total.update(self.last_life[instance.name])
                except (urllib.error.URLError, OSError) as exc:
                    logger.warning("reading the counters of %s failed: %s", instance.name, exc)
            self.counters[instance.name] = total

    def report(self, load_seconds: float, settled: dict[str, Any]) -> dict[str, Any]:
        outcomes = self.outcomes
        served = [o for o in outcomes if o.cause is None]
        errors = [o for o in outcomes if o.cause is not None and o.cause != HANG]
        by_cause: dict[str, dict[str, int]] = {}
        for outcome in errors:
            entry = by_cause.setdefault(outcome.cause or "", {"expected": 0, "unexpected": 0, "entry_timeout": 0})
            entry["expected" if outcome.expected else "unexpected"] += 1
            entry["entry_timeout"] += outcome.explained_by == "entry timeout"
        latency = {}
        for flow in ("proxy", "long"):
            seconds = sorted(o.seconds for o in served if o.flow == flow)
            if seconds:
                latency[flow] = {
                    "median_s": round(statistics.median(seconds), 3),
                    "p99_s": round(seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))], 3),
                    "max_s": round(seconds[-1], 3),
                    "over_15_s": sum(s > 15 for s in seconds),
                }
        prefill_names = [i.name for i in self.cluster.prefills]
        decode_names = [i.name for i in self.cluster.decodes]

        def total(names: list[str], counter: str) -> float:
            return sum(self.counters[name][counter] for name in names)

        loaded_whole = sum(1 for o in served if o.cached == vp.transfer_prefix(self.prompts[o.prompt]))
        return {
            "settings": dataclasses.asdict(self.settings),
            "load_seconds": round(load_seconds, 1),
            "requests": {
                "sent": len(outcomes),
                "served": len(served),
                "wrong": sum(o.wrong for o in outcomes),
                "hangs": sum(o.cause == HANG for o in outcomes),
                "errors": len(errors),
                "unexpected_errors": sum(not o.expected for o in errors),
                "by_flow": {
                    flow: {"sent": sum(o.flow == flow for o in outcomes), "served": sum(o.flow == flow for o in served)}
                    for flow in ("proxy", "long")
                },
                "answers_with_whole_prefix_cached": loaded_whole,
                "latency": latency,
            },
            "errors_by_cause": by_cause,
            "error_details": [dataclasses.asdict(o) for o in outcomes if o.cause is not None][:50],
            "wrong_details": [dataclasses.asdict(o) for o in outcomes if o.wrong][:20],
            "slowest": [dataclasses.asdict(o) for o in sorted(served, key=lambda o: -o.seconds)[:20]],
            "faults": {
                "kills": [dataclasses.asdict(k) for k in self.kills],
                "kills_by_instance": dict(Counter(k.victim for k in self.kills)),
                "abandoned": sum(self.abandoned.values()),
                "abandoned_by_instance": dict(self.abandoned),
                "abandon_failures": self.abandon_failures,
            },
            "counters": {name: dict(counter) for name, counter in self.counters.items()},
            "counters_last_life": self.last_life,
            "prefill": {
                name: total(prefill_names, name)
                for name in ("preemptions", "saved_requests", "save_failures", "taken_back", "expired", "evicted")
            },
            "decode": {
                name: total(decode_names, name)
                for name in (
                    "load_hits",
                    "load_misses",
                    "load_errors",
                    "drained",
                    "external_hits",
                    "external_queries",
                    "local_hits",
                    "prompt_tokens",
                )
            },
            "settle": settled,
            "failure": self.failure,
        }


def passed(report: dict[str, Any]) -> bool:
    requests = report["requests"]
    return (
        requests["wrong"] == 0
        and requests["hangs"] == 0
        and requests["unexpected_errors"] == 0
        and report["settle"]["idle"]
        and report["failure"] is None
    )


def check(settings: Settings) -> None:
    """Raise ValueError for settings the soak cannot run."""
    if settings.prefills < 1 or settings.decodes < 1:
        raise ValueError(f"--prefills and --decodes must be at least 1, not {settings.prefills} and {settings.decodes}")
    if settings.prefill_tp < 1 or settings.decode_tp < 1:
        raise ValueError(f"TP sizes must be at least 1, not {settings.prefill_tp} and {settings.decode_tp}")
    for role in settings.kill_roles:
        tp = {"prefill-rank": settings.prefill_tp, "decode-rank": settings.decode_tp}.get(role)
        if role not in ("prefill", "decode") and (tp is None or tp < 2):
            raise ValueError(f"kill role {role!r}: prefill, decode, or prefill-rank / decode-rank with a TP size >= 2")


def run_chaos(settings: Settings, root: Path, progress: bool = True) -> dict[str, Any]:
    """Everything: model, reference, cluster, proxy, load, settling; every process is stopped on
    the way out, whatever happens. Returns the report (see :meth:`Chaos.report`)."""
    check(settings)
    root.mkdir(parents=True, exist_ok=True)
    model = vp.make_tiny_llama(root / "model", with_tokenizer=True, max_positions=1024)
    prompts = prompt_pool(settings.prompts, settings.seed)
    abandon_prompts = [p for p in prompt_pool(16, settings.seed + 1000) if p not in prompts]
    logger.info("reference answers of %d prompts from one plain vllm serve", len(prompts))
    reference = reference_answers(model, prompts, root / "logs", settings.clients, settings.decode_tp)
    cluster = chaos_cluster(model, root / "logs", settings)
    front: ThreadedProxy | None = None
    try:
        logger.info(
            "starting %d prefill and %d decode instances (logs in %s)",
            settings.prefills,
            settings.decodes,
            root / "logs",
        )
        cluster.start()
        # The proxy's own read bound is above the clients' so that a hang shows as one, not as a 504.
        front = ThreadedProxy(
            [i.url for i in cluster.prefills],
            [i.url for i in cluster.decodes],
            read_timeout=settings.bound * 5,
            prefill_policy="round_robin",
            decode_policy="least_outstanding",
        )
        chaos = Chaos(settings, cluster, front.url, prompts, abandon_prompts, reference)
        for instance in cluster.instances:
            chaos.record_usage(instance)
        logger.info(
            "load for %.0f s: %d clients, a kill every %.0f s, an abandoned prefill every %.0f s",
            settings.duration,
            settings.clients,
            settings.kill_every,
            settings.abandon_every,
        )
        load_seconds = chaos.run(progress)
        chaos.judge()
        logger.info("load stopped; waiting for every gauge to come back to idle")
        settled = settle(
            cluster.instances,
            chaos.usage_at_start,
            settings.entry_timeout + 30,
            {i.name: most_connections(settings, role_of(i)) for i in cluster.instances},
        )
        chaos.read_final_counters()
        return chaos.report(load_seconds, settled)
    finally:
        if front is not None:
            front.close()
        cluster.stop()


# ---------------------------------------------------------------------- output


def _per_instance(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {count}" for name, count in sorted(counts.items())) or "-"


def format_report(report: dict[str, Any]) -> str:
    requests, faults = report["requests"], report["faults"]
    lines = [
        f"Load: {report['load_seconds']:.0f} s, {report['settings']['clients']} clients; "
        f"{requests['sent']} requests ({requests['by_flow']['proxy']['sent']} through the proxy, "
        f"{requests['by_flow']['long']['sent']} P/D by hand with a long prefill)",
        "",
    ]
    rows = [
        ("requests served", requests["served"]),
        ("answers wrong (must be 0)", requests["wrong"]),
        (f"hangs, no answer within {report['settings']['bound']:g} s (must be 0)", requests["hangs"]),
        ("errors", requests["errors"]),
        ("errors not explained by a kill or kv_entry_timeout (must be 0)", requests["unexpected_errors"]),
    ]
    for cause, counts in sorted(report["errors_by_cause"].items()):
        rows.append((f"  {cause}: explained / not", f"{counts['expected']} / {counts['unexpected']}"))
        if counts["entry_timeout"]:
            rows.append(
                (
                    f"    of which slower than kv_entry_timeout {report['settings']['entry_timeout']:g} s",
                    counts["entry_timeout"],
                )
            )
    rows += [
        ("kills (restarted on the same ports)", len(faults["kills"])),
        ("  by instance", _per_instance(faults["kills_by_instance"])),
        ("abandoned prefills (decode never sent)", faults["abandoned"]),
        ("  by instance", _per_instance(faults["abandoned_by_instance"])),
        ("  failed (instance killed)", len(faults["abandon_failures"])),
        ("prefill: preemptions", f"{report['prefill']['preemptions']:g}"),
        (
            "prefill: entries saved / taken back",
            f"{report['prefill']['saved_requests']:g} / {report['prefill']['taken_back']:g}",
        ),
        ("prefill: entries expired / evicted", f"{report['prefill']['expired']:g} / {report['prefill']['evicted']:g}"),
        (
            "decode: loads hit / missed / failed",
            f"{report['decode']['load_hits']:g} / "
            f"{report['decode']['load_misses']:g} / "
            f"{report['decode']['load_errors']:g}",
        ),
        ("decode: entries drained (own prefix cache)", f"{report['decode']['drained']:g}"),
        (
            "decode: external prefix hits / prompt tokens",
            f"{report['decode']['external_hits']:g} / {report['decode']['prompt_tokens']:g}",
        ),
        ("answers with the whole transfer prefix cached", requests["answers_with_whole_prefix_cached"]),
    ]
    for flow, figures in requests["latency"].items():
        rows.append(
            (
                f"latency {flow}: median / p99 / max (over 15 s)",
                f"{figures['median_s']:.2f} / {figures['p99_s']:.2f} / {figures['max_s']:.2f} s "
                f"({figures['over_15_s']})",
            )
        )
    lines.append(format_table(["what", "value"], rows))
    if faults["kills"]:
        lines += [
            "",
            format_table(
                [
                    "kill",
                    "victim",
                    "what died",
                    "at (s)",
                    "a dead rank: the instance (s)",
                    "healthy again after (s)",
                    "requests in flight (all)",
                ],
                [
                    (
                        n + 1,
                        k["victim"],
                        "instance" if k["rank"] is None else f"TP rank {k['rank']}",
                        f"{k['at']:.1f}",
                        "-" if k["rank"] is None else f"{k['failed_how']} after {k['gone'] - k['at']:.1f}",
                        f"{k['ready'] - k['at']:.1f}" if k["ready"] is not None else "never",
                        k["in_flight"],
                    )
                    for n, k in enumerate(faults["kills"])
                ],
            ),
        ]
    settled = report["settle"]
    names = sorted(settled["gauges"])
    rows = [
        (
            name,
            *(
                f"{settled['gauges'][name].get(g, 0):g}"
                + (f" (<= {settled['most_connections'][name]})" if g == "connections" else "")
                for g in GAUGES
            ),
            f"{settled['gauges'][name].get(USAGE, 0):g} ({settled['usage_at_start'].get(name, 0):g})",
            settled["idle_after_s"].get(name) if settled["idle_after_s"].get(name) is not None else "never",
            "yes" if name in settled["nudged"] else "no",
        )
        for name in names
    ]
    lines += [
        "",
        "Gauges after the load (idle: 0, connections at most one per pair of ranks sharing KV heads, vLLM's KV "
        "cache usage as at the start of the instance's life):",
        format_table(["instance", *GAUGES, "KV cache usage (start)", "idle after (s)", "nudged"], rows),
    ]
    if settled["nudged"]:
        lines.append(
            f"Nudged (one small request each, their engines were idle and took no step): {', '.join(settled['nudged'])}"
        )
    if report["failure"]:
        lines.append(f"FAILURE: {report['failure']}")
    lines.append("PASS" if passed(report) else "FAIL")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    """The settings of the command line (checked by :func:`check`) and its other arguments."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Settings()
    parser.add_argument("--duration", type=float, default=defaults.duration, help="seconds of load")
    parser.add_argument(
        "--kill-every",
        type=float,
        default=defaults.kill_every,
        help="seconds between two kills (each followed by a restart)",
    )
    parser.add_argument("--clients", type=int, default=defaults.clients, help="concurrent client threads")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--prompts", type=int, default=defaults.prompts, help="prompts in the pool")
    parser.add_argument(
        "--abandon-every", type=float, default=defaults.abandon_every, help="seconds between two abandoned prefills"
    )
    parser.add_argument(
        "--long-share",
        type=float,
        default=defaults.long_share,
        help="share of requests whose prefill generates --long-tokens (P/D flow by hand)",
    )
    parser.add_argument("--long-tokens", type=int, default=defaults.long_tokens)
    parser.add_argument(
        "--entry-timeout",
        type=float,
        default=defaults.entry_timeout,
        help="kv_entry_timeout of every instance (seconds)",
    )
    parser.add_argument(
        "--bound", type=float, default=defaults.bound, help="seconds without an answer that count as a hang"
    )
    parser.add_argument(
        "--kill-roles",
        default="",
        help="victims' roles in turn, e.g. prefill,decode "
        "(default: any instance at random); prefill-rank / decode-rank: one TP worker of such "
        "an instance (TP size at least 2)",
    )
    parser.add_argument(
        "--max-kills",
        type=int,
        default=0,
        help="exactly this many kills, the load going on until --after-restart seconds after the last "
        "restart (0: a kill every --kill-every seconds until near the end)",
    )
    parser.add_argument("--after-restart", type=float, default=defaults.after_restart)
    parser.add_argument("--prefills", type=int, default=defaults.prefills, help="how many prefill instances")
    parser.add_argument("--decodes", type=int, default=defaults.decodes, help="how many decode instances")
    parser.add_argument("--prefill-tp", type=int, default=defaults.prefill_tp, help="TP size of the prefill instances")
    parser.add_argument("--decode-tp", type=int, default=defaults.decode_tp, help="TP size of the decode instances")
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=defaults.ready_timeout,
        help="seconds an instance's (re)start may take until it answers",
    )
    parser.add_argument(
        "--kv-timeout",
        type=float,
        default=None,
        help="kvbridge's kv_timeout and kv_load_timeout of every instance (default: 5 and 8 s)",
    )
    parser.add_argument(
        "--logs",
        type=Path,
        default=None,
        help="folder for the model and every log (default: a new temporary folder, kept)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write every figure there as JSON")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    settings = Settings(
        duration=args.duration,
        kill_every=args.kill_every,
        clients=args.clients,
        seed=args.seed,
        prompts=args.prompts,
        abandon_every=args.abandon_every,
        long_share=args.long_share,
        long_tokens=args.long_tokens,
        entry_timeout=args.entry_timeout,
        bound=args.bound,
        kill_roles=tuple(r for r in args.kill_roles.split(",") if r),
        max_kills=args.max_kills,
        after_restart=args.after_restart,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        ready_timeout=args.ready_timeout,
        kv_timeout=args.kv_timeout,
        prefills=args.prefills,
        decodes=args.decodes,
    )
    try:
        check(settings)
    except ValueError as exc:
        parser.error(str(exc))
    return settings, args


def main(argv: list[str] | None = None) -> int:
    settings, args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # one line per request otherwise
    root = args.logs or Path(tempfile.mkdtemp(prefix="bench_chaos-"))
    report = run_chaos(settings, root, progress=not args.no_progress)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    print(format_report(report))
    print(f"(logs: {root / 'logs'})")
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
