"""Producer and consumer on two "hosts": two network namespaces joined by a veth pair (harness/netns.py).

The pipe, the lookup buffer and the torchrun pair run across the link; then the link is cut in the
middle of a large transfer, and slowed / made lossy with ``tc``. Needs root (CI runs as root); the
tests skip, saying why, only where a namespace cannot be created at all.
"""

from __future__ import annotations

import random
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import buffer_procs as buffer_bodies
from harness import netns
from harness.launchers import NUM_PROMPTS, SMALL_RUN, table_rows
from harness.netns import progress
from harness.tensors import exchange_both_ways
from kv_pipe import KVTransferConfig, TorchDistributedPipe
from kv_pipe.errors import KVTransferError
from kv_pipe.protocol import DTYPE_TO_CODE
from lookup_buffer import SimpleBuffer

# A fresh namespace has every port free, so fixed ports are safe here.
PORT = 29600
MODULE = __name__
#: kv_timeout of the fault tests: small, so that a lost peer is declared quickly.
FAULT_TIMEOUT = 3.0
#: What a process may take beyond kv_timeout to report a lost peer on this busy 2-core machine.
SLACK = 5.0
#: The link-cut tests shape the producer's egress so that one entry takes about a second.
SLOW_RATE = "100mbit"
CUT_ITEM_BYTES = 12 << 20


@pytest.fixture
def hosts() -> Iterator[netns.TwoHosts]:
    try:
        context = netns.two_hosts()
        created = context.__enter__()
    except netns.NamespacesUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield created
    finally:
        context.__exit__(None, None, None)


def config(rank: int, ip: str, **changes: Any) -> KVTransferConfig:
    values: dict[str, Any] = dict(
        kv_rank=rank,
        kv_role="kv_producer" if rank == 0 else "kv_consumer",
        kv_ip=ip,
        kv_port=PORT,
        kv_timeout=5.0,
        kv_connect_timeout=30.0,
    )
    values.update(changes)
    return KVTransferConfig(**values)


def run_both(
    hosts: netns.TwoHosts, tmp_path: Path, target: str, args: tuple[list, list], timeout: float
) -> tuple[Any, Any]:
    children = [hosts.spawn(rank, f"{MODULE}:{target}", args[rank], tmp_path, f"rank{rank}") for rank in (0, 1)]
    with netns.reaping(*children):
        return children[0].result(timeout), children[1].result(timeout)


# ---------------------------------------------------------------- bodies (run inside the namespaces)


def pipe_stream(seed: int) -> list[torch.Tensor | None]:
    """Random tensors of every dtype and odd shapes, Nones, and one 64 MiB tensor."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    items: list[torch.Tensor | None] = []
    for dtype in DTYPE_TO_CODE:
        shape = tuple(rng.choice([0, 1, 3, 17, 129]) for _ in range(rng.randint(0, 3)))
        items.append(buffer_bodies.random_tensor(generator, dtype, shape))
        if rng.random() < 0.2:
            items.append(None)
    items.insert(len(items) // 2, buffer_bodies.random_tensor(generator, torch.float32, (16 << 20,)))  # 64 MiB
    items.append(buffer_bodies.random_tensor(generator, torch.bfloat16, (3, 1 << 20)))
    return items


def body_pipe(rank: int, ip: str) -> dict:
    """Both sides send their stream at once and check the other's, bit for bit."""
    with TorchDistributedPipe(config(rank, ip, kv_buffer_size=96 << 20)) as pipe:
        # Another network namespace counts as another host: the same-host path is not taken.
        assert pipe.config.kv_shared_memory == "auto" and not pipe.uses_shared_memory
        theirs = pipe_stream(1 - rank)
        received = exchange_both_ways(pipe, pipe_stream(rank), theirs, timeout=60)
        pipe.send_tensor(None)  # both sides finished checking before either closes
        assert pipe.recv_tensor(timeout=60) is None
    return {"items": len(theirs), "bytes": received}


def body_buffer(rank: int, ip: str, seed: int, count: int, budget: int) -> dict:
    """Producer inserts in one random order, four consumer threads select in another (bit-exact)."""
    cfg = config(rank, ip, kv_buffer_size=budget)
    buffer = SimpleBuffer(TorchDistributedPipe(cfg), cfg)
    try:
        if rank == 0:
            buffer_bodies.producer_shuffled(buffer, {}, seed, count, False)
            buffer_bodies.wait_until(lambda: buffer.stats().hits == count, "every entry was selected")
            result: dict = {}
        else:
            result = buffer_bodies.consumer_threads(buffer, {}, seed, count, False, 4, 0.2)
        stats = buffer.stats()
    finally:
        buffer.close()
    return {"result": result, "hits": stats.hits, "insert_waits": stats.insert_waits, "peak": stats.peak_bytes}


def cut_item(index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(index)
    return buffer_bodies.random_tensor(generator, torch.uint8, (CUT_ITEM_BYTES,))


def cut_request(index: int) -> list[torch.Tensor | None]:
    return [torch.tensor([index, 7, 7]), torch.ones(3, dtype=torch.bool), cut_item(index), None, None]


def _failure(exc: KVTransferError) -> dict:
    return {"error": type(exc).__name__, "message": str(exc), "at": time.monotonic()}


def _timed_close(closable: Any) -> dict:
    start = time.monotonic()
    try:
        closable.close()
        error = None
    except KVTransferError as exc:
        error = type(exc).__name__
    return {"close_error": error, "close_seconds": time.monotonic() - start}


def body_cut_pipe(rank: int, ip: str) -> dict:
    """Rank 0 streams large tensors; rank 1 checks each. Both run until the link cut fails them."""
    pipe = TorchDistributedPipe(config(rank, ip, kv_timeout=FAULT_TIMEOUT, kv_buffer_size=3 * CUT_ITEM_BYTES))
    outcome: dict[str, Any] = {"done": []}
    try:
        for index in range(1000):
            if rank == 0:
                pipe.send_tensor(cut_item(index), timeout=120)
            else:
                progress("receiving", index)
                got = pipe.recv_tensor(timeout=120)
                assert buffer_bodies.same_bits(got, cut_item(index)), f"item {index} differs"
            outcome["done"].append(index)
        pipe.flush(timeout=120)
    except KVTransferError as exc:
        outcome.update(_failure(exc))
    outcome.update(_timed_close(pipe))
    return outcome


def body_cut_buffer(rank: int, ip: str) -> dict:
    """The same through the lookup buffer: the consumer selects, in order, what the producer inserts."""
    cfg = config(rank, ip, kv_timeout=FAULT_TIMEOUT, kv_buffer_size=3 * CUT_ITEM_BYTES)
    buffer = SimpleBuffer(TorchDistributedPipe(cfg), cfg)
    outcome: dict[str, Any] = {"done": [], "misses": []}
    try:
        for index in range(1000):
            if rank == 0:
                buffer.insert(*cut_request(index), timeout=120)
            else:
                progress("selecting", index)
                want = cut_request(index)
                got = buffer.drop_select(want[0], want[1], timeout=120)
                if got[0] is None:
                    outcome["misses"].append(index)
                    continue
                buffer_bodies.check_entry(got, want, f"entry {index}")
            outcome["done"].append(index)
    except KVTransferError as exc:
        outcome.update(_failure(exc))
    outcome.update(_timed_close(buffer))
    return outcome


def body_shared_memory_required(rank: int, ip: str) -> str:
    """kv_shared_memory='on' across namespaces: both sides refuse, saying why."""
    try:
        TorchDistributedPipe(config(rank, ip, kv_shared_memory="on"))
    except KVTransferError as exc:
        assert "same-host path could not be set up" in str(exc), exc
        return "refused"
    return "connected"


# ---------------------------------------------------------------- tests


@pytest.mark.timeout(120)
def test_pipe_across_hosts_both_ways_bit_exact(hosts: netns.TwoHosts, tmp_path: Path) -> None:
    ip = hosts.addresses[0]
    first, second = run_both(hosts, tmp_path, "body_pipe", ([0, ip], [1, ip]), timeout=100)
    assert first["items"] == len(pipe_stream(1)) and second["items"] == len(pipe_stream(0))
    assert min(first["bytes"], second["bytes"]) > 64 << 20


@pytest.mark.timeout(120)
def test_shared_memory_required_across_hosts_is_refused(hosts: netns.TwoHosts, tmp_path: Path) -> None:
    ip = hosts.addresses[0]
    assert run_both(hosts, tmp_path, "body_shared_memory_required", ([0, ip], [1, ip]), timeout=100) == (
        "refused",
        "refused",
    )


@pytest.mark.timeout(120)
def test_lookup_buffer_across_hosts_out_of_order(hosts: netns.TwoHosts, tmp_path: Path) -> None:
    seed, count = 61, 80
    sizes = [sum(t.nbytes for t in buffer_bodies.make_request(seed, i) if t is not None) for i in range(count)]
    budget = max(sum(sizes) // 2, 1 << 16)
    ip = hosts.addresses[0]
    producer, consumer = run_both(
        hosts, tmp_path, "body_buffer", ([0, ip, seed, count, budget], [1, ip, seed, count, budget]), timeout=100
    )
    assert consumer["result"]["selected"] == list(range(count))  # each checked bit for bit
    assert producer["hits"] == consumer["hits"] == count
    assert producer["insert_waits"] > 0 and producer["peak"] <= budget  # backpressure across the link


@pytest.mark.timeout(180)
def test_torchrun_pair_across_hosts(hosts: netns.TwoHosts, tmp_path: Path) -> None:
    master = hosts.addresses[0]
    processes = []
    try:
        for rank in (0, 1):
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={rank}",
                "--nproc-per-node=1",
                f"--master-addr={master}",
                f"--master-port={PORT}",
                "-m",
                "launch.pair",
            ]
            env = netns.child_env({**SMALL_RUN, "KVBRIDGE_KV_TIMEOUT": "10"})
            processes.append(hosts.popen(rank, command, env, tmp_path, f"pair{rank}"))
        for process in processes:
            process.wait(timeout=160)
    finally:
        for process in processes:
            netns.kill_session(process)
    outputs = [((tmp_path / f"pair{r}.out").read_text(), (tmp_path / f"pair{r}.err").read_text()) for r in (0, 1)]
    explain = "\n".join(
        f"--- rank {r} exit {p.returncode}\n{out}\n{err[-4000:]}"
        for r, (p, (out, err)) in enumerate(zip(processes, outputs, strict=True))
    )
    assert [p.returncode for p in processes] == [0, 0], explain
    assert len(table_rows(outputs[1][0], "yes")) == NUM_PROMPTS, explain
    assert outputs[1][0].count("| transferred ") == NUM_PROMPTS, explain
    assert f"{NUM_PROMPTS}/{NUM_PROMPTS} sequences matching, {NUM_PROMPTS} hits" in outputs[0][0], explain


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layer, word", [("pipe", "receiving"), ("buffer", "selecting")])
def test_link_cut_mid_transfer_fails_both_sides_within_bound(
    hosts: netns.TwoHosts, tmp_path: Path, layer: str, word: str
) -> None:
    # Slow the producer's direction so that each 12 MiB item is a second on the wire: the cut then
    # lands inside a transfer, not between two.
    hosts.tc(
        0, "qdisc", "add", "dev", hosts.links[0], "root", "tbf", "rate", SLOW_RATE, "burst", "256kb", "latency", "100ms"
    )
    ip = hosts.addresses[0]
    target = f"{MODULE}:body_cut_{layer}"
    children = [hosts.spawn(rank, target, [rank, ip], tmp_path, f"rank{rank}") for rank in (0, 1)]
    with netns.reaping(*children):
        cut_index = _await_index(children[1], word, 2)
        time.sleep(0.4)  # into the transfer of item cut_index
        hosts.set_link(0, up=False)
        cut_at = time.monotonic()
        outcomes = [child.result(timeout=60) for child in children]
    bound = FAULT_TIMEOUT + SLACK
    print(
        f"link cut during item {cut_index}: "
        + "; ".join(
            f"rank {r} {o.get('error')} after {o['at'] - cut_at:.2f} s, close {o['close_seconds']:.2f} s"
            for r, o in enumerate(outcomes)
        )
    )
    for rank, outcome in enumerate(outcomes):
        assert outcome.get("error") is not None, f"rank {rank} never failed: {outcome}"
        assert outcome["error"] == "KVPeerLostError", (rank, outcome)
        assert outcome["at"] - cut_at <= bound, (rank, outcome["at"] - cut_at, outcome)
        assert outcome["close_seconds"] <= bound, (rank, outcome)
    consumer = outcomes[1]
    # Everything completed before the cut was checked bit for bit; the item in flight is an error, not a
    # hit and not a miss.
    assert consumer["done"] in (list(range(cut_index)), list(range(cut_index + 1))), (cut_index, consumer)
    assert not consumer.get("misses"), consumer


def _await_index(child: netns.Child, word: str, index: int) -> int:
    deadline = time.monotonic() + 60
    while True:
        lines = [line for line in child.stdout.read_text().splitlines() if line.startswith(word + " ")]
        if lines and int(lines[-1].split()[1]) >= index:
            return int(lines[-1].split()[1])
        if time.monotonic() > deadline or child.process.poll() is not None:
            raise AssertionError(f"{child.tag} did not reach item {index}:\n{child.logs()}")
        time.sleep(0.01)


def _qdisc_counters(hosts: netns.TwoHosts, host: int) -> dict[str, int]:
    text = hosts.tc(host, "-s", "qdisc", "show", "dev", hosts.links[host]).stdout
    match = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", text)
    assert match, text
    return {"bytes": int(match.group(1)), "packets": int(match.group(2)), "dropped": int(match.group(3))}


@pytest.mark.timeout(150)
def test_slow_lossy_link_still_bit_exact(hosts: netns.TwoHosts, tmp_path: Path) -> None:
    """A rate-limited link with a short queue: packets are dropped and retransmitted, data stays exact."""
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
            "400mbit",
            "burst",
            "32kb",
            "limit",
            "48kb",
        )
    ip = hosts.addresses[0]
    first, second = run_both(hosts, tmp_path, "body_pipe", ([0, ip], [1, ip]), timeout=130)
    assert first["items"] == len(pipe_stream(1)) and second["items"] == len(pipe_stream(0))
    counters = [_qdisc_counters(hosts, host) for host in (0, 1)]
    print("tbf counters", counters)
    assert all(c["bytes"] > 64 << 20 for c in counters), counters  # the traffic went through the shaper
    assert sum(c["dropped"] for c in counters) > 0, counters  # and lost packets on the way


@pytest.mark.timeout(150)
def test_netem_delay_and_loss_still_bit_exact(hosts: netns.TwoHosts, tmp_path: Path) -> None:
    probe = hosts.tc(
        0, "qdisc", "add", "dev", hosts.links[0], "root", "netem", "delay", "20ms", "loss", "2%", check=False
    )
    if probe.returncode != 0:
        pytest.skip(
            f"this kernel has no sch_netem (tc says: {probe.stderr.strip()}); "
            f"test_slow_lossy_link_still_bit_exact covers loss with tbf"
        )
    hosts.tc(1, "qdisc", "add", "dev", hosts.links[1], "root", "netem", "delay", "20ms", "loss", "2%")
    ip = hosts.addresses[0]
    first, second = run_both(hosts, tmp_path, "body_pipe", ([0, ip], [1, ip]), timeout=130)
    assert first["items"] == len(pipe_stream(1)) and second["items"] == len(pipe_stream(0))
    counters = [_qdisc_counters(hosts, host) for host in (0, 1)]
    assert sum(c["dropped"] for c in counters) > 0, counters
