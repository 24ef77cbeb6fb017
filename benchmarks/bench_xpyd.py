"""What xPyD costs per request: a new connection, and the proxy, with 2 prefill and 2 decode vLLM instances.

Starts two prefill and two decode ``vllm serve`` instances of a tiny random Llama (one after
another, pinned to the host's cores, decode instances with ``kv_load_failure_policy: fail``) and
times, one request at a time (a 100-token prompt, 8 generated tokens, 96 tokens of KV moved):

* per (prefill, decode) pairing, the first request, which opens the decode instance's connection to
  that prefill instance, against the median of the next ones;
* the same requests through kvbridge's proxy over all four instances (round robin) against the P/D
  flow by hand to the same instances: the proxy's overhead per request.

Every answer is checked to have loaded its whole prefix (its cached tokens).

    python -m benchmarks.bench_xpyd [--requests 10]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from harness import vllm_procs as vp
from harness import xpyd as xp
from harness.procs import free_port
from harness.servers import ThreadedProxy

PROMPT_TOKENS = 100


def prompts(count: int, seed: int) -> list[list[int]]:
    """Distinct prompts: no instance's own prefix cache ever holds one."""
    generator = random.Random(seed)
    return [[generator.randrange(5, vp.VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


def timed_request(send, prompt: list[int]) -> float:  # noqa: ANN001 - a callable of the prompt
    start = time.perf_counter()
    answer = send(prompt)
    seconds = time.perf_counter() - start
    if answer.cached != vp.transfer_prefix(prompt):
        raise SystemExit(f"a request loaded {answer.cached} tokens, not {vp.transfer_prefix(prompt)}")
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10, help="requests per pairing after the first")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        model = vp.make_tiny_llama(root / "model", with_tokenizer=True)
        kv_ports = [free_port(), free_port()]
        prefills = [xp.instance(model, f"prefill{i}", "kv_producer", kv_ports[i], i % 2, root) for i in range(2)]
        decodes = [xp.instance(model, f"decode{j}", "kv_consumer", kv_ports[0], (j + 1) % 2, root) for j in range(2)]
        instances = [*prefills, *decodes]
        try:
            for instance in instances:
                instance.start()
            for instance in prefills:  # warm every engine up without opening any connection:
                xp.prefill(instance.url, prompts(1, seed=99)[0])
            for instance in decodes:  # a prompt within one block moves no KV
                xp.ask(instance.url, prompts(1, seed=98)[0][: vp.BLOCK_SIZE - 1])
            rows = []
            for p, prefill in enumerate(prefills):
                for d, decode in enumerate(decodes):
                    batch = prompts(args.requests + 1, seed=10 * p + d)
                    times = [
                        timed_request(lambda q, a=prefill, b=decode: xp.by_hand(a.url, b.url, q)[0], prompt)
                        for prompt in batch
                    ]
                    rows.append((f"P{p} -> D{d}", times[0], statistics.median(times[1:])))
            pairs = [(prefill, decode) for prefill in prefills for decode in decodes]
            batch = prompts(4 * args.requests, seed=77)
            by_hand = [
                timed_request(lambda q, pair=pairs[i % 4]: xp.by_hand(pair[0].url, pair[1].url, q)[0], prompt)
                for i, prompt in enumerate(batch[: 2 * args.requests])
            ]
            front = ThreadedProxy([i.url for i in prefills], [i.url for i in decodes], read_timeout=600)
            try:
                proxied = [
                    timed_request(lambda q: xp.ask(front.url, q), prompt) for prompt in batch[2 * args.requests :]
                ]
            finally:
                front.close()
        finally:
            for instance in instances:
                instance.stop()
    print(f"2 prefill + 2 decode instances, {PROMPT_TOKENS}-token prompts, one request at a time")
    print("| pairing | first request (opens the connection) | next requests (median) |")
    print("|---|---:|---:|")
    for name, first, later in rows:
        print(f"| {name} | {first * 1e3:.0f} ms | {later * 1e3:.0f} ms |")
    hand, through = statistics.median(by_hand), statistics.median(proxied)
    print("| route | per request (median) |  |")
    print("|---|---:|---:|")
    print(f"| by hand (prefill, then decode) | {hand * 1e3:.1f} ms | |")
    overhead = (through - hand) * 1e3
    print(f"| through the proxy, 2P2D round robin | {through * 1e3:.1f} ms | overhead {overhead:+.1f} ms |")


if __name__ == "__main__":
    main()
