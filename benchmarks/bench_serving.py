"""What running streams on a decode instance feel when P/D requests arrive: stall per arrival, ITL, TTFT.

Setups, each measured with the same workload in one run:

* **colocated**: one ``vllm serve`` (no connector); arrivals are plain requests with nothing to
  load: vLLM's own per-request cost.
* **loopback**: a prefill and a decode ``vllm serve`` with kvbridge on one host (cores 0 and 1).
* **1gbit**: the same pair in two network namespaces joined by a veth link limited to 1 Gbit/s
  (``tc ... tbf``; needs root, see harness/netns.py); the client runs in the decode namespace.

Workload: a model with heavy KV (8 layers x 16 KV heads x 128 dims, fp32: 128 KiB per token) and a
light body; three streams decode on the decode instance; P/D requests of ``--prompt`` tokens
arrive one after another (prefill on the prefill instance with ``max_tokens=1``, then the decode
request with the prefill's ``kv_transfer_params``, as kvbridge's proxy does). An arrival's *stall*
is the longest gap of any running stream between sending its decode request and its first token.
ITL is that of the streams over the whole run; TTFT is the arrival's, from its prefill request.

    python -m benchmarks.bench_serving [--arrivals 8] [--setups colocated,loopback,1gbit] [--out DIR]

Prints one table and saves ``bench_serving.png`` (each stream's ITL over time, arrivals marked).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness import netns
from harness.procs import OWN_PROCESS_GROUP, free_port
from harness.vllm_procs import VOCAB, make_heavy_kv_llama
from launch.serve import kv_transfer_config, stop, vllm_serve_command

MODEL_NAME = "heavy-kv"
STREAMS, STREAM_PROMPT, STREAM_TOKENS = 3, 16, 1500
SERVE_ARGS = [
    "--served-model-name",
    MODEL_NAME,
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-model-len",
    "2048",
    "--block-size",
    "32",
    "--seed",
    "0",
    "--enable-prompt-tokens-details",
]
KV_MEMORY = {"prefill": 512 << 20, "decode": 1 << 30, "colocated": 1 << 30}
READY_TIMEOUT = 300.0
LINK_RATE = "1gbit"


# ---------------------------------------------------------------------- the client (one process)


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> urllib.request.addinfourl:
    request = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=timeout)


def _wait_up(url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} was not up within {READY_TIMEOUT:g} s") from None
        time.sleep(0.5)


def _stream(url: str, body: dict[str, Any], times: list[float], stop_event: threading.Event) -> int | None:
    """Send a streamed completion; append the arrival time of each token chunk to ``times``; return
    the prompt tokens vLLM reports as cached (loaded, for a P/D arrival)."""
    cached = None
    options = {"stream": True, "stream_options": {"include_usage": True}}
    with _post(url, {**body, **options}) as reply:
        for line in reply:
            if stop_event.is_set():
                return None  # closing the connection aborts the request in vLLM
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[len(b"data: ") :])
            if chunk.get("choices"):
                times.append(time.monotonic())
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    return cached


def run_client(prefill_url: str | None, decode_url: str, arrivals: int, prompt_tokens: int, seed: int) -> dict:
    """The workload against one setup; ``prefill_url=None``: colocated (arrivals load nothing)."""
    for url in (prefill_url, decode_url):
        if url is not None:
            _wait_up(url)
    rng = random.Random(seed)
    stop_event = threading.Event()
    streams: list[list[float]] = [[] for _ in range(STREAMS)]
    threads = []
    for index in range(STREAMS):
        body = {
            "model": MODEL_NAME,
            "prompt": [rng.randrange(5, VOCAB) for _ in range(STREAM_PROMPT)],
            "max_tokens": STREAM_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        thread = threading.Thread(target=_stream, args=(decode_url, body, streams[index], stop_event), daemon=True)
        thread.start()
        threads.append(thread)
    deadline = time.monotonic() + 120
    while not all(len(times) >= 20 for times in streams):  # all three are decoding, quietly
        if time.monotonic() > deadline:
            raise TimeoutError("the streams did not start within 120 s")
        time.sleep(0.05)
    records = []
    for _ in range(arrivals):
        prompt = [rng.randrange(5, VOCAB) for _ in range(prompt_tokens)]
        body = {"model": MODEL_NAME, "prompt": prompt, "temperature": 0, "ignore_eos": True}
        start = time.monotonic()
        params = None
        if prefill_url is not None:
            with _post(prefill_url, {**body, "max_tokens": 1}) as reply:
                params = json.load(reply).get("kv_transfer_params")
        sent = time.monotonic()
        first: list[float] = []
        decode_body = {**body, "max_tokens": 2, **({"kv_transfer_params": params} if params else {})}
        cached = _stream(decode_url, decode_body, first, threading.Event())
        records.append({"start": start, "sent": sent, "first": first[0], "params": params, "cached": cached})
        time.sleep(1.0)  # let the streams settle between arrivals
    stop_event.set()
    if not all(thread.is_alive() for thread in threads):
        raise RuntimeError("a stream ended before the last arrival: raise STREAM_TOKENS")
    return {"streams": streams, "arrivals": records}


def _client_main(args: list[str]) -> None:
    """``bench_serving.py --client JSON OUT``: run the client here (inside a namespace) and save its result."""
    kwargs = json.loads(args[0])
    Path(args[1]).write_text(json.dumps(run_client(**kwargs)))


# ---------------------------------------------------------------------- servers


@contextlib.contextmanager
def servers(
    commands: list[tuple[list[str], dict[str, str]]], log_dir: Path, tag: str, popen: Any = None
) -> Iterator[None]:
    """Start ``(argv, env)`` servers (the client waits until they answer), stop them on exit."""
    processes = []
    try:
        for index, (argv, env) in enumerate(commands):
            log = open(log_dir / f"{tag}-{index}.log", "wb")  # noqa: SIM115 - closed with the process
            if popen is None:
                process = subprocess.Popen(
                    argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, **OWN_PROCESS_GROUP
                )
            else:
                process = popen(index, argv, env, log)
            processes.append(process)
        yield
    finally:
        stop(processes)


def pair_commands(model: str, hosts: tuple[str, str], ports: dict[str, int]) -> list[tuple[list[str], dict]]:
    extra = {"kv_timeout": 10, "kv_load_timeout": 10, "kv_buffer_size": 1 << 30, "kv_connect_timeout": 300}
    commands = []
    for index, (name, role) in enumerate((("prefill", "kv_producer"), ("decode", "kv_consumer"))):
        transfer = kv_transfer_config(role, hosts[0], ports["kv"], extra)
        argv = vllm_serve_command(
            model, hosts[index], ports[name], transfer, [*SERVE_ARGS, "--kv-cache-memory-bytes", str(KV_MEMORY[name])]
        )
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(index), "VLLM_LOGGING_LEVEL": "WARNING"}
        commands.append((argv, env))
    return commands


def measure(setup: str, model: str, log_dir: Path, arrivals: int, prompt_tokens: int) -> dict:
    ports = {name: free_port() for name in ("prefill", "decode", "kv")}
    if setup == "colocated":
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(ports["decode"]),
            *SERVE_ARGS,
            "--kv-cache-memory-bytes",
            str(KV_MEMORY["colocated"]),
        ]
        with servers([(argv, {"VLLM_CPU_OMP_THREADS_BIND": "1"})], log_dir, setup):
            return run_client(None, f"http://127.0.0.1:{ports['decode']}", arrivals, prompt_tokens, seed=1)
    if setup == "loopback":
        with servers(pair_commands(model, ("127.0.0.1", "127.0.0.1"), ports), log_dir, setup):
            return run_client(
                f"http://127.0.0.1:{ports['prefill']}",
                f"http://127.0.0.1:{ports['decode']}",
                arrivals,
                prompt_tokens,
                seed=1,
            )
    with netns.two_hosts() as hosts:
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
        commands = pair_commands(model, hosts.addresses, ports)

        def popen(index: int, argv: list[str], env: dict[str, str], log: Any) -> subprocess.Popen:
            return subprocess.Popen(
                ["ip", "netns", "exec", hosts.names[index], *argv],
                env=netns.child_env(env),
                stdout=log,
                stderr=subprocess.STDOUT,
                **OWN_PROCESS_GROUP,
            )

        with servers(commands, log_dir, setup, popen):
            out = log_dir / "client.json"
            kwargs = {
                "prefill_url": f"http://{hosts.addresses[0]}:{ports['prefill']}",
                "decode_url": f"http://{hosts.addresses[1]}:{ports['decode']}",
                "arrivals": arrivals,
                "prompt_tokens": prompt_tokens,
                "seed": 1,
            }
            client = [sys.executable, "-m", "benchmarks.bench_serving", "--client", json.dumps(kwargs), str(out)]
            subprocess.run(
                ["ip", "netns", "exec", hosts.names[1], *client],
                env=netns.child_env(),
                check=True,
                timeout=READY_TIMEOUT + 600,
            )
            return json.loads(out.read_text())


# ---------------------------------------------------------------------- analysis


def _gaps(times: list[float]) -> list[tuple[float, float]]:
    return list(zip(times, times[1:], strict=False))


def summarise(result: dict) -> dict[str, Any]:
    stalls, ttfts = [], []
    for arrival in result["arrivals"]:
        window = (arrival["sent"], arrival["first"])
        longest = max(
            (
                end - begin
                for times in result["streams"]
                for begin, end in _gaps(times)
                if end > window[0] and begin < window[1]
            ),
            default=0.0,
        )
        stalls.append(longest)
        ttfts.append(arrival["first"] - arrival["start"])
    itl = sorted(end - begin for times in result["streams"] for begin, end in _gaps(times))
    decode = [arrival["first"] - arrival["sent"] for arrival in result["arrivals"]]
    loaded = sum(1 for arrival in result["arrivals"] if arrival["cached"])
    return {
        "stall_median": statistics.median(stalls),
        "stall_max": max(stalls),
        "itl_p50": itl[len(itl) // 2],
        "itl_p99": itl[min(len(itl) - 1, int(len(itl) * 0.99))],
        "ttft_median": statistics.median(ttfts),
        "decode_median": statistics.median(decode),
        "loaded": loaded,
        "arrivals": len(stalls),
    }


def table(summaries: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| setup | stall per arrival, median (max) | stream ITL p50 / p99 | arrival TTFT, median "
        "(of which on the decode instance) | arrivals served from loaded KV |",
        "|---|---|---|---|---|",
    ]
    for setup, s in summaries.items():
        lines.append(
            f"| {setup} | {s['stall_median'] * 1e3:.0f} ms ({s['stall_max'] * 1e3:.0f} ms) | "
            f"{s['itl_p50'] * 1e3:.0f} / {s['itl_p99'] * 1e3:.0f} ms | {s['ttft_median'] * 1e3:.0f} ms "
            f"({s['decode_median'] * 1e3:.0f} ms) | {s['loaded']} of {s['arrivals']} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(results), 1, figsize=(11, 3.2 * len(results)), squeeze=False)
    for axis, (setup, result) in zip(axes[:, 0], results.items(), strict=True):
        origin = min(times[0] for times in result["streams"])
        for index, times in enumerate(result["streams"]):
            axis.plot(
                [end - origin for _, end in _gaps(times)],
                [(end - begin) * 1e3 for begin, end in _gaps(times)],
                lw=0.8,
                label=f"stream {index}",
            )
        for arrival in result["arrivals"]:
            axis.axvline(arrival["sent"] - origin, color="red", lw=0.6, ls="--")
            axis.axvline(arrival["first"] - origin, color="grey", lw=0.6, ls=":")
        axis.set_title(
            f"{setup}: inter-token latency of the running streams "
            "(red: an arrival's decode request, grey: its first token)"
        )
        axis.set_ylabel("ITL (ms)")
        axis.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("time (s)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        _client_main(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arrivals", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=450, help="tokens of each arriving P/D request")
    parser.add_argument("--setups", default="colocated,loopback,1gbit")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results, summaries = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as scratch:
        model = make_heavy_kv_llama(Path(scratch) / "model")
        for setup in args.setups.split(","):
            log_dir = args.out / f"logs-{setup}"
            log_dir.mkdir(exist_ok=True)
            try:
                results[setup] = measure(setup, model, log_dir, args.arrivals, args.prompt)
            except netns.NamespacesUnavailable as exc:
                print(f"{setup}: skipped ({exc})")
                continue
            summaries[setup] = summarise(results[setup])
            print(setup, json.dumps({k: round(v, 4) for k, v in summaries[setup].items()}), flush=True)
    print(table(summaries))
    plot(results, args.out / "bench_serving.png")
    (args.out / "bench_serving.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
