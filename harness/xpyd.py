"""Helpers of the xPyD serving tests: real ``vllm serve`` instances (prefill and decode) with
kvbridge's connector, started one after another, killed and restarted on the same ports; the P/D
flow by hand; an OpenAI-compatible request with its cached-token count; vllm-router."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness import vllm_procs as vp
from harness.procs import free_port, group_processes
from harness.servers import NAME, SERVE_ARGS, Server
from launch import proxy, serve

logger = logging.getLogger(__name__)

READY_TIMEOUT = 240.0
#: Bound of one HTTP request to an instance or a router (the longest here generates 8 tokens).
REQUEST_TIMEOUT = 120.0
#: Connector options of every instance: short waits, so a failed load fails fast.
KV_EXTRA = {"kv_timeout": 5, "kv_load_timeout": 8}
HIT_METRIC = "vllm:external_prefix_cache_hits_total"


@dataclasses.dataclass
class Instance:
    """One ``vllm serve`` with kvbridge's connector; ``kv_port`` is the producer's own listening port
    (prefill) or the producer used for requests whose params name none (decode)."""

    name: str
    role: str
    port: int
    kv_port: int
    core: int
    command: list[str]
    env: dict[str, str]
    logs: Path
    server: Server | None = None
    starts: int = 0
    ready_timeout: float = READY_TIMEOUT  # seconds a start may take until /health answers

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start (again, on the same ports) and wait until ``/health`` answers."""
        self.starts += 1
        self.server = Server(self.command, self.logs / f"{self.name}-{self.starts}.log", env=self.env)
        self.server.wait_ready(self.url, self.ready_timeout)

    @property
    def alive(self) -> bool:
        return self.server is not None and self.server.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the instance's whole process group (API server, engine core, workers)."""
        assert self.server is not None
        try:
            os.killpg(self.server.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.server.process.wait(timeout=30)

    def kill_rank(self, rank: int) -> int:
        """SIGKILL the worker process of TP rank ``rank`` only (vLLM's ``VLLM::Worker_TP<rank>``), as a
        rank that crashes; returns its pid. Raises LookupError when the instance has no such worker."""
        assert self.server is not None
        title = f"Worker_TP{rank}"
        for pid in group_processes(self.server.process.pid):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if command.split(" ", 1)[0].endswith(title):
                os.kill(pid, signal.SIGKILL)
                return pid
        raise LookupError(f"{self.name} has no process titled *{title}")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def log_tail(self, chars: int = 4000) -> str:
        assert self.server is not None
        return self.server.log.read_text(errors="replace")[-chars:]


def instance(
    model: str,
    name: str,
    role: str,
    kv_port: int,
    core: int,
    logs: Path,
    multiprocess: bool = False,
    serve_args: list[str] = SERVE_ARGS,
    kv_extra: dict[str, Any] | None = None,
    tp: int = 1,
) -> Instance:
    """A prefill (``kv_producer``) or decode (``kv_consumer``) instance pinned to ``core``. Decode
    instances fail a request whose load failed (``kv_load_failure_policy: fail``), so a load that
    silently failed cannot pass as a hit. ``kv_extra`` adds to (or overrides) :data:`KV_EXTRA` in
    the connector's ``kv_connector_extra_config``, e.g. a short ``kv_entry_timeout``. With ``tp`` > 1
    the instance runs that many TP ranks (vLLM's worker processes, so multiprocess), rank r on core
    ``(core + r) % 2``; a prefill instance then listens at ``kv_port`` to ``kv_port + tp - 1``."""
    port = free_port(1)
    transfer = serve.kv_transfer_config(role, "127.0.0.1", kv_port, {**KV_EXTRA, **(kv_extra or {})})
    if role == "kv_consumer":
        transfer["kv_load_failure_policy"] = "fail"
    args, env = tp_placement(serve_args, tp, core, multiprocess)
    command = serve.vllm_serve_command(model, "127.0.0.1", port, transfer, args)
    return Instance(name, role, port, kv_port, core, command, env, logs)


def tp_placement(
    serve_args: list[str], tp: int, core: int, multiprocess: bool = False
) -> tuple[list[str], dict[str, str]]:
    """(vLLM arguments, environment) of an instance of ``tp`` TP ranks, rank r pinned to core
    ``(core + r) % 2``; TP needs vLLM's worker processes (multiprocess)."""
    args = [*serve_args, "--tensor-parallel-size", str(tp)] if tp > 1 else serve_args
    bind = "|".join(str((core + rank) % 2) for rank in range(tp))
    return args, {
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess or tp > 1 else "0",
    }


class Fleet:
    """``prefills`` prefill and ``decodes`` decode instances (two of each by default), prefill i pinned
    to core ``i % 2`` and decode j to core ``(1 + j) % 2``, so that a prefill and a decode instance
    share no core while there are two cores for two of them. Requests always name their producer;
    the decode instances' configured one (the first prefill instance) only serves requests naming none."""

    def __init__(
        self,
        model: str,
        logs: Path,
        prefill_args: list[str] = SERVE_ARGS,
        decode_args: list[str] = SERVE_ARGS,
        kv_extra: dict[str, Any] | None = None,
        prefill_tp: int = 1,
        decode_tp: int = 1,
        ready_timeout: float = READY_TIMEOUT,
        prefills: int = 2,
        decodes: int = 2,
    ) -> None:
        if prefills < 1 or decodes < 1:
            raise ValueError(f"a fleet needs a prefill and a decode instance at least, not {prefills} and {decodes}")
        logs.mkdir(parents=True, exist_ok=True)
        kv_ports = [free_port(max(4, prefill_tp)) for _ in range(prefills)]
        self.prefills = [
            instance(
                model,
                f"prefill{i}",
                "kv_producer",
                kv_ports[i],
                i % 2,
                logs,
                serve_args=prefill_args,
                kv_extra=kv_extra,
                tp=prefill_tp,
            )
            for i in range(prefills)
        ]
        decode_extra = {**(kv_extra or {}), "kv_producer_tp_size": prefill_tp} if prefill_tp != decode_tp else kv_extra
        self.decodes = [
            instance(
                model,
                f"decode{j}",
                "kv_consumer",
                kv_ports[0],
                (1 + j) % 2,
                logs,
                serve_args=decode_args,
                kv_extra=decode_extra,
                tp=decode_tp,
            )
            for j in range(decodes)
        ]

        for one in self.instances:
            one.ready_timeout = ready_timeout

    @property
    def instances(self) -> list[Instance]:
        return [*self.prefills, *self.decodes]

    def start(self) -> None:
        for one in self.instances:  # one after another: two cores
            one.start()

    def stop(self) -> None:
        """Stop every instance (its whole process group), whatever happened before."""
        for one in self.instances:
            try:
                one.stop()
            except Exception:  # the others must still be stopped
                logger.exception("stopping %s failed", one.name)

    def logs(self) -> str:
        return "\n".join(f"--- {i.name}:\n{i.log_tail(2000)}" for i in self.instances if i.server is not None)


def plain_answers(
    model: str, prompts: list[list[int]], log: Path, serve_args: list[str], clients: int, tp: int = 1
) -> dict[tuple[int, ...], Any]:
    """Each prompt's answer (:attr:`Answer.tokens`) from one plain ``vllm serve`` on core 0 (at TP size
    ``tp``: its ranks on cores 0 and 1 in turn), asked by ``clients`` at a time; the server is
    stopped before returning."""
    port = free_port(1)
    args, env = tp_placement(serve_args, tp, 0)
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    server = Server(command, log, env=env)
    try:
        server.wait_ready(f"http://127.0.0.1:{port}")
        with ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(lambda p: ask(f"http://127.0.0.1:{port}", p).tokens, prompts))
        return {tuple(prompt): answer for prompt, answer in zip(prompts, answers, strict=True)}
    finally:
        server.stop()


# ---------------------------------------------------------------------- requests


def post(url: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
    """POST a JSON body; the JSON answer, or the answer of a server-sent event stream merged into
    one (text joined, token ids joined, the last usage). Raises on an HTTP error or an error event."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        if not body.get("stream"):
            return json.loads(response.read())
        text, token_ids, usage, finish = [], [], None, None
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data:") :])
            if "error" in event:
                raise RuntimeError(f"the stream of {url} ended with an error event: {event['error']}")
            for choice in event.get("choices", []):
                text.append(choice.get("text") or "")
                token_ids.extend(choice.get("token_ids") or [])
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
        return {"choices": [{"text": "".join(text), "token_ids": token_ids, "finish_reason": finish}], "usage": usage}


def completion_body(prompt: list[int], stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": NAME,
        "prompt": prompt,
        "max_tokens": vp.MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclasses.dataclass(frozen=True)
class Answer:
    text: str
    token_ids: list[int]
    cached: int | None

    @property
    def tokens(self) -> tuple[str, list[int]]:
        return self.text, self.token_ids


def answer(payload: dict[str, Any]) -> Answer:
    choice = payload["choices"][0]
    details = (payload.get("usage") or {}).get("prompt_tokens_details") or {}
    return Answer(choice["text"], list(choice.get("token_ids") or []), details.get("cached_tokens"))


def ask(base_url: str, prompt: list[int], stream: bool = False) -> Answer:
    return answer(post(base_url + "/v1/completions", completion_body(prompt, stream)))


def prefill(prefill_url: str, prompt: list[int]) -> dict[str, Any] | None:
    """The prefill step of the P/D flow: the kv_transfer_params the prefill instance returns."""
    payload = post(prefill_url + "/v1/completions", proxy.prefill_body(completion_body(prompt)))
    return payload.get("kv_transfer_params")


def by_hand(prefill_url: str, decode_url: str, prompt: list[int], stream: bool = False) -> tuple[Answer, dict]:
    """The P/D flow as a proxy does it, to the instances chosen: (decode answer, prefill params)."""
    params = prefill(prefill_url, prompt)
    assert params is not None, f"{prefill_url} returned no kv_transfer_params"
    payload = post(decode_url + "/v1/completions", proxy.decode_body(completion_body(prompt, stream), params))
    return answer(payload), params


def metric(base_url: str, name: str) -> float:
    """The sum of every series of counter ``name`` in the instance's Prometheus ``/metrics``."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


# ---------------------------------------------------------------------- vllm-router


def router_command(prefill_urls: list[str], decode_urls: list[str], port: int) -> list[str]:
    """vllm-router in P/D mode; round-robin prefill with random decode reaches every pairing."""
    binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    command = [
        binary,
        "--vllm-pd-disaggregation",
        "--kv-connector",
        "nixl",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill-policy",
        "round_robin",
        "--decode-policy",
        "random",
    ]
    for url in prefill_urls:
        command += ["--prefill", url]
    for url in decode_urls:
        command += ["--decode", url]
    return command


def wait_answering(url: str, process: subprocess.Popen, prompt: list[int], timeout: float) -> None:
    """Wait until a completion through ``url`` succeeds (a router knows its workers only once it
    checked them)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with code {process.returncode} before it answered")
        try:
            post(url + "/v1/completions", {**completion_body(prompt), "max_tokens": 1}, timeout=30)
            return
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer a completion within {timeout:g} s (last error: {last})")
