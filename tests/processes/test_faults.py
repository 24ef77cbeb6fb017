"""SIGKILL of the producer or the consumer, during a long random workload or during connection setup.

Two real processes run a seeded workload through SimpleBuffer: entries of random sizes (bytes to
MiB), inserted and selected out of order, under a byte budget that keeps the producer waiting for
the consumer. The test kills one side at a seeded random point and checks that

* the survivor raises a KVTransferError subclass (a lost peer, never a miss) within the bound;
* every request that completed before is bit-exact (checksums recomputed here, in the test
  process, from the seed), none is reported twice, and none both missing and present;
* recovery works the documented way: the survivor closes its buffer and builds a new one on the
  same ports, and a restarted peer connects to it; a restarted peer facing a survivor that still
  holds its broken buffer is refused with a clear error.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from harness import buffer_procs as buffer_bodies
from harness import procs
from kv_pipe import KVTransferConfig, TorchDistributedPipe, rendezvous
from kv_pipe.errors import KVTransferError
from lookup_buffer import SimpleBuffer

KV_TIMEOUT = 2.0
CONNECT_TIMEOUT = 4.0
#: What a process may take beyond the configured bound on this busy 2-core machine.
SLACK = 5.0
COUNT = 150
#: Entries are inserted and selected in random orders within windows of this many; one window
#: always fits in the budget, so the orders cannot deadlock, but the producer keeps waiting for room.
WINDOW = 6
BUDGET = 20 << 20
_SIZES = (1, 100, 4 << 10, 200 << 10, 1 << 20, 3 << 20)
_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.uint8, torch.int64)


# ---------------------------------------------------------------- the workload


def workload_request(seed: int, index: int) -> list[torch.Tensor | None]:
    """Request ``index``: unique selected tokens, random roi, KV of random dtype and size (bytes to MiB)."""
    rng = random.Random(seed * 1_000_003 + index)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    length = rng.randint(1, 40)
    tokens = torch.randint(1, 1 << 40, (length,), generator=generator)
    roi = torch.rand(length, generator=generator) < 0.7
    roi[0] = True
    tokens[0] = index  # the selected tokens differ between the requests
    dtype = rng.choice(_DTYPES)
    elements = max(1, rng.choice(_SIZES) // dtype.itemsize)
    key = buffer_bodies.random_tensor(generator, dtype, (elements,))
    value = buffer_bodies.random_tensor(generator, dtype, (elements,)) if rng.random() < 0.5 else None
    hidden = buffer_bodies.random_tensor(generator, torch.float32, (int(roi.sum()), 3)) if rng.random() < 0.5 else None
    return [tokens, roi, key, value, hidden]


def checksum(items: list[torch.Tensor | None]) -> str:
    digest = hashlib.sha256()
    for item in items:
        if item is None:
            digest.update(b"none;")
            continue
        digest.update(f"{item.dtype}{tuple(item.shape)};".encode())
        digest.update(item.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def orders(seed: int, count: int) -> tuple[list[int], list[int]]:
    """The producer's insert order and the consumer's select order: shuffled differently per window."""
    rng = random.Random(seed)
    inserts, selects = [], []
    for start in range(0, count, WINDOW):
        window = list(range(start, min(start + WINDOW, count)))
        inserts += rng.sample(window, len(window))
        selects += rng.sample(window, len(window))
    return inserts, selects


def config(rank: int, port: int, connect_timeout: float = CONNECT_TIMEOUT) -> KVTransferConfig:
    return KVTransferConfig(
        kv_role="kv_producer" if rank == 0 else "kv_consumer",
        kv_rank=rank,
        kv_port=port,
        kv_timeout=KV_TIMEOUT,
        kv_connect_timeout=connect_timeout,
        kv_buffer_size=BUDGET,
    )


# ---------------------------------------------------------------- one side (a spawned process)


def _build(rank: int, port: int, connect_timeout: float) -> SimpleBuffer:
    cfg = config(rank, port, connect_timeout)
    return SimpleBuffer(TorchDistributedPipe(cfg), cfg)


def _run_workload(buffer: SimpleBuffer, rank: int, seed: int, count: int, conn: Connection) -> None:
    inserts, selects = orders(seed, count)
    if rank == 0:
        for index in inserts:
            buffer.insert(*workload_request(seed, index), timeout=30)
        # Stay up until the consumer has taken everything (a dead consumer fails inserts and this wait).
        deadline = time.monotonic() + 60
        while buffer.stats().hits < count:
            assert time.monotonic() < deadline, "the consumer did not take every entry"
            buffer.insert(
                torch.tensor([-1]), torch.ones(1, dtype=torch.bool), torch.zeros(1), None, None, timeout=30
            )  # a probe that raises once the consumer is gone
            time.sleep(0.05)
        return
    for index in selects:
        want = workload_request(seed, index)
        got = buffer.drop_select(want[0], want[1], timeout=30)
        if got[0] is None:
            conn.send(("miss", index))
        else:
            conn.send(("hit", index, checksum(got)))


def _close(buffer: SimpleBuffer) -> dict:
    start = time.monotonic()
    try:
        buffer.close()
        error = None
    except KVTransferError as exc:
        error = type(exc).__name__
    return {"close_error": error, "close_seconds": time.monotonic() - start}


#: Where a side kills itself during setup: on entering this method.
SETUP_STAGES = {
    "rendezvous": (rendezvous, "authenticate_store"),  # the store is up, the greetings exchanged
    "group": (rendezvous, "_create_groups"),  # authenticated, gloo not connected yet
    "buffer": (SimpleBuffer, "__init__"),  # the pipe is up, the buffer not built yet
}


def _die_on_entry(owner: Any, name: str) -> None:
    def sigkill_self(*args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(owner, name, sigkill_self)


def side(conn: Connection, rank: int, port: int, seed: int, count: int, after_failure: str, die_at: str = "") -> dict:
    """Build this side's buffer and run the workload; report progress and the failure it sees.

    ``after_failure``: ``rebuild`` closes the broken buffer and runs a short second workload on a
    new one on the same ports; ``hold`` keeps the broken buffer open (the test kills the process).
    ``die_at``: a key of SETUP_STAGES where this process SIGKILLs itself.
    """
    if die_at:
        _die_on_entry(*SETUP_STAGES[die_at])
    outcome: dict[str, Any] = {"phase": "setup"}
    conn.send(("setup",))
    buffer = None
    try:
        buffer = _build(rank, port, CONNECT_TIMEOUT)
        outcome["phase"] = "workload"
        conn.send(("ready",))
        _run_workload(buffer, rank, seed, count, conn)
        outcome["phase"] = "finished"
    except KVTransferError as exc:
        outcome.update(error=type(exc).__name__, message=str(exc), at=time.monotonic())
    conn.send(("failed" if "error" in outcome else "finished", outcome.get("error")))
    if after_failure == "hold":
        time.sleep(120)  # keep the broken buffer and its ports; the test kills this process
    if buffer is not None:
        outcome.update(_close(buffer))
    if after_failure == "rebuild" and "error" in outcome:
        conn.send(("rebuilding",))
        again = _build(rank, port, connect_timeout=30)
        _run_workload(again, rank, seed + 1000, WINDOW * 2, conn)
        outcome["rebuilt"] = _close(again)
    return outcome


def restarted(conn: Connection, rank: int, port: int, seed: int, count: int) -> dict:
    """A restarted side: connect on the same ports and run a workload; report how it was refused, if it was."""
    start = time.monotonic()
    stage = "connect"
    try:
        buffer = _build(rank, port, CONNECT_TIMEOUT)
        stage = "first call"
        _run_workload(buffer, rank, seed, count, conn)
    except KVTransferError as exc:
        return {"refused": type(exc).__name__, "stage": stage, "message": str(exc), "seconds": time.monotonic() - start}
    return {"refused": None, **_close(buffer)}


# ---------------------------------------------------------------- the driver


class Side:
    """A spawned side with its progress connection and result queue."""

    def __init__(self, target: Any, rank: int, args: tuple) -> None:
        reader, writer = procs._CTX.Pipe(duplex=False)
        self.results = procs.new_queue()
        self.process = procs.start(target, (writer, rank, *args), self.results, rank)
        writer.close()
        self.conn = reader
        self.rank = rank
        self.events: list[tuple] = []

    def read(self, until: Any, timeout: float) -> tuple:
        """Read progress events until one satisfies ``until``; return it."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"rank {self.rank}: no matching event within {timeout} s; got {self.events[-5:]}")
            if self.conn.poll(min(remaining, 0.5)):
                try:
                    event = self.conn.recv()
                except (EOFError, OSError):
                    raise AssertionError(f"rank {self.rank} exited; events {self.events[-5:]}") from None
                self.events.append(event)
                if until(event):
                    return event

    def drain(self) -> None:
        """Take every event still in the connection (the process may be dead)."""
        try:
            while self.conn.poll(0):
                self.events.append(self.conn.recv())
        except (EOFError, OSError):
            pass

    def result(self, timeout: float) -> dict:
        return procs.collect([self.process], self.results, timeout, expect=1)[self.rank]

    def kill(self) -> float:
        os.kill(self.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        self.process.join(10)
        self.drain()
        return killed_at


def check_hits(events: list[tuple], seed: int) -> list[int]:
    """Each hit is bit-exact (checksum recomputed from the seed), reported once, and never a miss."""
    hits = [event[1] for event in events if event[0] == "hit"]
    misses = [event[1] for event in events if event[0] == "miss"]
    assert not misses, f"misses reported while the producer was alive or dying: {misses}"
    assert len(hits) == len(set(hits)), f"a request was reported twice: {hits}"
    for event in events:
        if event[0] == "hit":
            assert event[2] == checksum(workload_request(seed, event[1])), f"request {event[1]} is not bit-exact"
    return hits


def assert_lost_peer_within(outcome: dict, since: float, bound: float) -> None:
    assert outcome.get("error") == "KVPeerLostError", outcome
    assert outcome["at"] - since <= bound, (outcome["at"] - since, bound, outcome)


# ---------------------------------------------------------------- tests


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [0, 1], ids=["producer", "consumer"])
@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_during_workload_then_survivor_rebuilds(victim: int, seed: int) -> None:
    rng = random.Random(seed * 10 + victim)
    kill_after = rng.randint(WINDOW, COUNT // 2)  # completed selects before the kill: the rest takes a second
    port = procs.free_port()
    sides = [Side(side, rank, (port, seed, COUNT, "rebuild")) for rank in (0, 1)]
    survivor = sides[1 - victim]
    replacement = None
    try:
        sides[1].read(lambda e: e[0] == "hit" and len(sides[1].events) >= kill_after + 2, timeout=60)
        time.sleep(rng.uniform(0, 0.02))  # anywhere in the next transfers
        killed_at = sides[victim].kill()
        # The replacement starts once the survivor has closed its broken buffer and is rebuilding.
        survivor.read(lambda e: e[0] == "rebuilding", timeout=KV_TIMEOUT + SLACK + 30)
        replacement = Side(restarted, victim, (port, seed + 1000, WINDOW * 2))
        outcome = survivor.result(timeout=90)
        again = replacement.result(timeout=60)
    finally:
        procs.reap([s.process for s in sides] + ([replacement.process] if replacement else []))
    survivor.drain()
    if victim == 0:  # the consumer survived: its events before and after its rebuild
        cut = next(i for i, event in enumerate(survivor.events) if event[0] == "rebuilding")
        before, after = survivor.events[:cut], survivor.events[cut:]
    else:  # the consumer died: its replacement selected from the rebuilt producer
        replacement.drain()
        before, after = sides[1].events, replacement.events
    assert len(check_hits(before, seed)) >= kill_after
    assert outcome["phase"] == "workload", outcome
    assert_lost_peer_within(outcome, killed_at, KV_TIMEOUT + SLACK)
    assert outcome["close_seconds"] <= KV_TIMEOUT + SLACK, outcome
    # Recovery: the survivor's new buffer on the same ports served a restarted peer, bit for bit.
    assert again["refused"] is None, again
    assert outcome["rebuilt"]["close_error"] is None, outcome
    assert sorted(check_hits(after, seed + 1000)) == list(range(WINDOW * 2))
    print(
        f"killed rank {victim} after {kill_after} selects: survivor {outcome['error']} after "
        f"{outcome['at'] - killed_at:.2f} s, close {outcome['close_seconds']:.2f} s; rebuilt and served"
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", [0, 1], ids=["producer", "consumer"])
@pytest.mark.parametrize("stage", ["random", *SETUP_STAGES])
def test_sigkill_during_connection_setup(victim: int, stage: str) -> None:
    """The victim dies at a seeded random moment after it starts connecting, or on entering a stage."""
    seed = 3
    port = procs.free_port()
    die_at = "" if stage == "random" else stage
    sides = [Side(side, rank, (port, seed, COUNT, "close", die_at if rank == victim else "")) for rank in (0, 1)]
    survivor = sides[1 - victim]
    try:
        if stage == "random":
            for s in sides:
                s.read(lambda e: e[0] == "setup", timeout=60)
            time.sleep(random.Random(seed * 10 + victim).uniform(0, 0.3))
            killed_at = sides[victim].kill()
        else:
            sides[victim].process.join(60)
            killed_at = time.monotonic()
            assert sides[victim].process.exitcode == -signal.SIGKILL, sides[victim].process.exitcode
        outcome = survivor.result(timeout=CONNECT_TIMEOUT + KV_TIMEOUT + SLACK + 30)
    finally:
        procs.reap([s.process for s in sides])
    survivor.drain()
    if victim == 0:
        check_hits(sides[1].events, seed)
    expected_phase = {"rendezvous": "setup", "group": "setup", "buffer": "workload"}.get(stage)
    assert outcome["phase"] == expected_phase or (stage == "random" and outcome["phase"] in ("setup", "workload")), (
        outcome
    )
    assert outcome.get("error") == "KVPeerLostError", outcome
    bound = (CONNECT_TIMEOUT if outcome["phase"] == "setup" else 0) + KV_TIMEOUT + SLACK
    assert outcome["at"] - killed_at <= bound, (outcome["at"] - killed_at, outcome)
    print(
        f"rank {victim} killed during setup ({stage}): survivor {outcome['error']} in phase {outcome['phase']} "
        f"after {outcome['at'] - killed_at:.2f} s: {outcome['message'][:150]}"
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", [0, 1], ids=["producer", "consumer"])
def test_restart_against_a_survivor_still_holding_its_broken_buffer_is_refused(victim: int) -> None:
    seed = 4
    port = procs.free_port()
    sides = [Side(side, rank, (port, seed, COUNT, "hold")) for rank in (0, 1)]
    survivor = sides[1 - victim]
    replacement = None
    try:
        sides[1].read(lambda e: e[0] == "hit" and len(sides[1].events) >= WINDOW + 2, timeout=60)
        sides[victim].kill()
        survivor.read(lambda e: e[0] == "failed", timeout=KV_TIMEOUT + SLACK)
        replacement = Side(restarted, victim, (port, seed + 1000, WINDOW))
        again = replacement.result(timeout=CONNECT_TIMEOUT + 2 * KV_TIMEOUT + SLACK + 20)
    finally:
        procs.reap([s.process for s in sides] + ([replacement.process] if replacement else []))
    print(f"restarted rank {victim}: {again}")
    # Not served and not a miss: refused, at connection or at its first call, within the bound.
    assert again["refused"] in ("KVPeerLostError", "KVProtocolError"), again
    assert re.search("no peer|already served a pair|lost|failed", again["message"]), again
    assert again["seconds"] <= CONNECT_TIMEOUT + 2 * KV_TIMEOUT + SLACK, again
    assert not [event for event in replacement.events if event[0] == "hit"], replacement.events
