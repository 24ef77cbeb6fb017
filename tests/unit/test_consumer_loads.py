"""The vLLM connector's consumer worker against producers that cannot be reached, and its drains:
a producer being dialed, or whose circuit is open, holds no load thread and delays no other
producer's loads; its own loads are reported once each, their blocks failed; a drain runs off the
engine's thread.

Fakes only (a scripted dialer and lookup buffers), no transport. Nothing measures time: every wait
is on an event, with a timeout that only guards against hangs; the connections' clock is the test's.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from connector.tp_layout import Source
from connector.tp_sources import HeadGather, SourceConnections, Sources
from connector.transfer_plan import LoadSpec
from connector.vllm_loads import LOAD_THREADS, PRODUCER_LOAD_SHARE
from harness import vllm_procs as vp
from harness.dialing import WAIT, Dialer, Gate, Told
from kv_pipe.errors import KVPeerLostError
from lookup_buffer import connections as connections_module
from lookup_buffer.connections import FIRST_BACKOFF
from lookup_buffer.loans import BorrowedTensor

DEAD, ALIVE = ("10.0.0.66", 9000), ("10.0.0.7", 9000)
CONFIGURED = ("127.0.0.1", 1)  # the fake worker's own kv_ip:kv_port


class Buffer:
    """A consumer's lookup buffer answering each select by the request's first token: the blocks
    in ``hits`` (taken once), else a miss; a select whose token has a gate waits for it first."""

    def __init__(
        self, hits: dict[int, torch.Tensor] | None = None, gates: dict[int, threading.Event] | None = None
    ) -> None:
        self.hits, self.gates = dict(hits or {}), gates or {}
        self.selected: list[int] = []
        self.entered = threading.Event()  # a select reached the buffer
        self.failure: Exception | None = None
        self.closed = threading.Event()

    def drop_select(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        timeout: float | None = None,
        borrow: bool = False,
        span: tuple[int, int, int] | None = None,
    ) -> list:
        first = int(input_tokens[0])
        self.selected.append(first)
        self.entered.set()
        gate = self.gates.get(first)
        if gate is not None and not gate.wait(WAIT):
            raise KVPeerLostError("the test never opened the gate")
        blocks = self.hits.pop(first, None)
        if blocks is None:
            return [None] * 5
        if span is not None:  # as a producer does: only that range of the entry
            blocks = blocks.narrow(span[0], span[1], span[2] - span[1])
        return [input_tokens.clone(), roi.clone(), blocks, None, None]

    def close(self) -> None:
        self.closed.set()
        for gate in self.gates.values():
            gate.set()


def blocks(seed: int, count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (vp.FAKE_LAYERS, count, vp.FAKE_HEADS, vp.FAKE_BLOCK_SIZE, 2 * vp.FAKE_HEAD_SIZE)
    return torch.randn(shape, generator=generator)


def tokens(first: int, count: int = 1) -> list[int]:
    """The tokens of ``count`` fake blocks, the first one being ``first``."""
    return list(range(first, first + count * vp.FAKE_BLOCK_SIZE))


def consumer(dialer: Dialer):
    def dial(settings: object, host: str, port: int, on_connect: object) -> object:
        return dialer(settings, host, port, on_connect)

    return vp.fake_worker(
        "kv_consumer", 1, vp.FAKE_BLOCK_SIZE, vp.fake_caches(2), {"kv_load_timeout": 1.0}, dialer=dial
    )


class Reports:
    """What the worker reported, poll after poll (as vLLM asks each step: finished, then failed blocks)."""

    def __init__(self, worker: object) -> None:
        self.worker = worker
        self.polls: list[tuple[set[str], set[int]]] = []

    def poll(self, finished_req_ids: set[str] | None = None) -> tuple[set[str], set[int]]:
        report = (self.worker.take_finished_loads(finished_req_ids or set()), self.worker.take_failed_blocks())
        self.polls.append(report)
        return report

    def until(self, req_ids: set[str]) -> None:
        deadline = time.monotonic() + WAIT  # a hang guard, not a timing claim
        while not req_ids <= self.finished():
            assert time.monotonic() < deadline, (
                f"{req_ids - self.finished()} never reported; got {[p for p in self.polls if p != (set(), set())]}"
            )
            self.poll()
            time.sleep(0.005)

    def finished(self) -> set[str]:
        return set().union(*(finished for finished, _ in self.polls))

    def reported(self) -> list[str]:
        return [req_id for finished, _ in self.polls for req_id in finished]

    def failed_with(self, req_id: str) -> set[int]:
        """The failed blocks of the poll that reported ``req_id`` (a failed load's blocks come in it)."""
        (failed,) = [failed for finished, failed in self.polls if req_id in finished]
        return failed


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The connections' monotonic clock (backoffs), moved by the test only."""
    now = [1000.0]
    monkeypatch.setattr(connections_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def no_dial_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name == "kvbuf-dial"]


def test_loads_naming_an_unreachable_producer_never_delay_another_producers_loads(clock: list[float]) -> None:
    stuck = Gate(KVPeerLostError("no producer answered at 10.0.0.66:9000"))
    alive_blocks = blocks(7, 2)
    alive = Buffer({100: alive_blocks})
    dialer = Dialer({DEAD: [stuck], ALIVE: [alive]})
    worker = consumer(dialer)
    reports = Reports(worker)
    dead = [
        LoadSpec(f"dead{i}", tokens(10 + i), [i % vp.FAKE_BLOCKS], 0, wait=True, producer=DEAD)
        for i in range(LOAD_THREADS + 4)
    ]
    try:
        worker.start_loads(dead)  # returns while the attempt to reach the dead producer is blocked
        assert stuck.entered.wait(WAIT)
        worker.start_loads([LoadSpec("alive", tokens(100, 2), [5, 6], 0, wait=True, producer=ALIVE)])
        reports.until({"alive"})
        # Loaded while the dead producer's one attempt is still blocked on the test's gate.
        assert not stuck.left.is_set()
        assert not reports.finished() & {spec.req_id for spec in dead}  # still waiting for their connection
        assert reports.failed_with("alive") == set()
        for layer in range(vp.FAKE_LAYERS):
            assert torch.equal(worker.caches[layer][[5, 6]], alive_blocks[layer])
        assert dialer.count(DEAD) == 1  # one attempt for all of its loads
        stuck.opened.set()  # the attempt fails
        reports.until({spec.req_id for spec in dead})
        assert sorted(reports.reported()) == sorted(["alive"] + [spec.req_id for spec in dead])  # each once
        for spec in dead:
            assert set(spec.block_ids) <= reports.failed_with(spec.req_id)  # failed in the poll reporting it
        stats = worker.total_stats().data
        assert (stats["load_errors"], stats["load_hits"]) == (len(dead), 1)
        assert dialer.count(DEAD) == 1 and dialer.count(ALIVE) == 1
    finally:
        stuck.opened.set()
        worker.close()
    assert no_dial_threads()


def test_while_a_producers_circuit_is_open_its_loads_fail_at_once_then_exactly_one_attempt_is_made(
    clock: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    first = Gate(KVPeerLostError("no producer answered at 10.0.0.66:9000"))
    half_open = Gate(None)
    back = Buffer({200: blocks(3, 1)})
    half_open.outcome = back
    dialer = Dialer({DEAD: [first, half_open], ALIVE: [Buffer({300: blocks(4, 1)})]})
    worker = consumer(dialer)
    reports = Reports(worker)
    try:
        worker.start_loads([LoadSpec("first", tokens(10), [0], 0, wait=True, producer=DEAD)])
        assert first.entered.wait(WAIT)
        first.opened.set()
        reports.until({"first"})
        assert reports.failed_with("first") == {0}
        # Open: loads fail at once, without an attempt, each reported once with its blocks.
        with caplog.at_level(logging.WARNING, logger="connector.vllm_worker"):
            open_loads = [
                LoadSpec(f"open{i}", tokens(20 + i), [1 + i % 4], 0, wait=True, producer=DEAD)
                for i in range(LOAD_THREADS + 2)
            ]
            worker.start_loads(open_loads)
            reports.until({spec.req_id for spec in open_loads})
        for spec in open_loads:
            assert set(spec.block_ids) <= reports.failed_with(spec.req_id)
        assert dialer.count(DEAD) == 1
        why = [r.getMessage() for r in caplog.records if "open0" in r.getMessage()]
        assert why and "10.0.0.66:9000" in why[0] and "no producer answered" in why[0]
        assert f"next attempt in {FIRST_BACKOFF:.1f} s" in why[0]
        # Half-open after the backoff: exactly one attempt; the other loads wait for it without a
        # thread, and another producer's loads go ahead meanwhile.
        clock[0] += FIRST_BACKOFF
        waiting = [LoadSpec("half0", tokens(200), [5], 0, producer=DEAD)]  # a hit
        waiting += [
            LoadSpec(f"half{i}", tokens(40 + i), [6 + i % 3], 0, producer=DEAD)  # misses
            for i in range(1, LOAD_THREADS + 2)
        ]
        worker.start_loads(waiting)
        assert half_open.entered.wait(WAIT)
        worker.start_loads([LoadSpec("other", tokens(300), [8], 0, producer=ALIVE)])
        reports.until({"other"})
        assert not half_open.left.is_set() and not reports.finished() & {spec.req_id for spec in waiting}
        assert dialer.count(DEAD) == 2
        half_open.opened.set()  # the producer is back
        reports.until({spec.req_id for spec in waiting})
        assert 5 not in set().union(*(failed for _, failed in reports.polls))  # the hit
        for spec in waiting[1:]:
            assert set(spec.block_ids) <= reports.failed_with(spec.req_id)
        assert dialer.count(DEAD) == 2 and len(back.selected) == len(waiting)
        assert sorted(reports.reported()) == sorted(
            ["first", "other"] + [s.req_id for s in open_loads] + [s.req_id for s in waiting]
        )
    finally:
        first.opened.set()
        half_open.opened.set()
        worker.close()
    assert no_dial_threads()


def test_a_load_finished_by_vllm_while_waiting_for_its_connection_reports_no_failed_blocks(clock: list[float]) -> None:
    stuck = Gate(KVPeerLostError("no producer answered"))
    worker = consumer(Dialer({DEAD: [stuck]}))
    reports = Reports(worker)
    try:
        worker.start_loads(
            [
                LoadSpec("aborted", tokens(10), [3], 0, wait=True, producer=DEAD),
                LoadSpec("kept", tokens(11), [4], 0, wait=True, producer=DEAD),
            ]
        )
        assert stuck.entered.wait(WAIT)
        assert reports.poll({"aborted"}) == (set(), set())  # vLLM finished it; it is still waiting
        stuck.opened.set()
        reports.until({"aborted", "kept"})
        assert 3 not in set().union(*(failed for _, failed in reports.polls))  # maybe another request's now
        assert reports.failed_with("kept") == {4}
        assert sorted(reports.reported()) == ["aborted", "kept"]
    finally:
        stuck.opened.set()
        worker.close()


def test_closing_the_worker_completes_the_loads_waiting_for_a_connection(clock: list[float]) -> None:
    stuck = Gate(Buffer())
    worker = consumer(Dialer({DEAD: [stuck]}))
    worker.start_loads([LoadSpec(f"w{i}", tokens(10 + i), [i], 0, wait=True, producer=DEAD) for i in range(3)])
    assert stuck.entered.wait(WAIT)
    closer = threading.Thread(target=worker.close, name="test-close")
    closer.start()
    try:
        reports = Reports(worker)
        reports.until({"w0", "w1", "w2"})  # told while the attempt is still blocked
        assert not stuck.left.is_set()
    finally:
        stuck.opened.set()
        closer.join(WAIT)
    assert not closer.is_alive()
    assert stuck.outcome.closed.is_set()  # the connection made after close is closed
    assert no_dial_threads()


def test_a_drain_does_not_hold_the_engine_thread(clock: list[float]) -> None:
    held = threading.Event()
    buffer = Buffer({100: blocks(1, 1), 101: blocks(2, 1), 102: blocks(3, 2)}, gates={101: held})
    dialer = Dialer({ALIVE: [buffer]})
    worker = consumer(dialer)
    reports = Reports(worker)
    try:
        worker.start_loads([LoadSpec("first", tokens(100), [0], 0, producer=ALIVE)])  # connects
        reports.until({"first"})
        # vLLM holds every block of this one: its entry is only taken and dropped.
        worker.start_loads([LoadSpec("drain", tokens(101), [1], 1, producer=ALIVE)])
        assert buffer.entered.wait(WAIT)
        deadline = time.monotonic() + WAIT
        while 101 not in buffer.selected:
            assert time.monotonic() < deadline, "the drain never selected"
            time.sleep(0.005)
        # start_loads returned while the drain's select is held; a load goes ahead meanwhile.
        worker.start_loads([LoadSpec("next", tokens(102, 2), [2, 3], 0, producer=ALIVE)])
        reports.until({"next"})
        assert reports.failed_with("next") == set()
        assert not held.is_set() and worker.total_stats().data["drained"] == 0
        held.set()
        while worker.total_stats().data["drained"] != 1:
            assert time.monotonic() < deadline, "the drain never completed"
            time.sleep(0.005)
        assert "drain" not in reports.finished()  # a drain reports nothing to vLLM
        for _ in range(3):
            assert reports.poll() == (set(), set())
        assert buffer.hits == {} and dialer.count(ALIVE) == 1
    finally:
        held.set()
        worker.close()


def test_a_drain_never_connects(clock: list[float]) -> None:
    dialer = Dialer({ALIVE: [Buffer()]})
    worker = consumer(dialer)
    try:
        worker.start_loads([LoadSpec("drain", tokens(101), [1], 1, producer=ALIVE)])
        assert dialer.count(ALIVE) == 0 and worker.connections == 0
        assert worker.take_finished_loads() == set()
    finally:
        worker.close()


def test_a_producer_that_stops_answering_holds_at_most_its_share_of_the_load_threads(clock: list[float]) -> None:
    """A producer dead with its connection open (no reset: every select waits) holds at most
    PRODUCER_LOAD_SHARE load threads; another producer's loads run meanwhile, and the loads beyond
    the share wait without a thread, then each is reported once."""
    silent = Buffer(gates={10 + i: threading.Event() for i in range(LOAD_THREADS + 4)})
    alive_blocks = blocks(8, 2)
    alive = Buffer({100: alive_blocks})
    dialer = Dialer({DEAD: [silent], ALIVE: [alive]})
    worker = consumer(dialer)
    reports = Reports(worker)
    dead = [
        LoadSpec(f"dead{i}", tokens(10 + i), [i % vp.FAKE_BLOCKS], 0, wait=True, producer=DEAD)
        for i in range(LOAD_THREADS + 4)
    ]
    try:
        worker.start_loads(dead)
        deadline = time.monotonic() + WAIT  # a hang guard, not a timing claim
        while len(silent.selected) < PRODUCER_LOAD_SHARE:
            assert time.monotonic() < deadline, f"only {len(silent.selected)} selects reached the silent producer"
            time.sleep(0.005)
        worker.start_loads([LoadSpec("alive", tokens(100, 2), [5, 6], 0, wait=True, producer=ALIVE)])
        reports.until({"alive"})
        assert reports.failed_with("alive") == set()
        for layer in range(vp.FAKE_LAYERS):
            assert torch.equal(worker.caches[layer][[5, 6]], alive_blocks[layer])
        assert len(silent.selected) == PRODUCER_LOAD_SHARE  # the others wait, without a thread
        assert not reports.finished() & {spec.req_id for spec in dead}
        for gate in silent.gates.values():  # the selects end (misses): the waiting loads run in turn
            gate.set()
        reports.until({spec.req_id for spec in dead})
        assert sorted(reports.reported()) == sorted(["alive"] + [spec.req_id for spec in dead])  # each once
        assert sorted(silent.selected) == [10 + i for i in range(len(dead))]
        stats = worker.total_stats().data
        assert (stats["load_misses"], stats["load_hits"]) == (len(dead), 1)
    finally:
        for gate in silent.gates.values():
            gate.set()
        worker.close()
    assert no_dial_threads()


class _Rank:
    """A connection to one prefill rank whose selects all wait at ``barrier`` before answering its
    quarter of the heads."""

    def __init__(self, key: torch.Tensor, barrier: threading.Barrier) -> None:
        self.key, self.barrier, self.failure = key, barrier, None

    def drop_select(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        timeout: float | None = None,
        borrow: bool = False,
        part: tuple[int, int, int] | None = None,
    ) -> list:
        self.barrier.wait()
        return [input_tokens.clone(), roi.clone(), self.key, None, None]


def test_gathers_from_four_ranks_in_every_load_thread_select_from_all_ranks_at_once() -> None:
    """Every load thread gathers from 4 prefill ranks at once: each rank's select of each gather
    runs at the same time as all the others (they all wait for one another here), none waits for a
    thread another gather holds; each gather gets its ranks' heads, bit-exact."""
    ranks = 4
    full = torch.randn((2, 3, 2 * ranks, 3, 10), generator=torch.Generator().manual_seed(9))
    quarters = [full[:, :, 2 * rank : 2 * rank + 2].contiguous() for rank in range(ranks)]
    plan = tuple(Source(rank, None, (2 * rank, 2 * rank + 2)) for rank in range(ranks))
    barrier = threading.Barrier(LOAD_THREADS * ranks, timeout=WAIT)  # a hang guard, not a timing claim
    gathered: list = []
    errors: list = []

    def load() -> None:
        gather = HeadGather(Sources("h", 1, ranks, plan, head_dim=2), [_Rank(key, barrier) for key in quarters])
        try:
            entry = gather.drop_select(torch.arange(5), torch.ones(5, dtype=torch.bool), timeout=WAIT)
            key = entry[2]
            gathered.append(key.to_tensor() if isinstance(key, BorrowedTensor) else key)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load, name="kvbridge-load") for _ in range(LOAD_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * WAIT)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == [] and len(gathered) == LOAD_THREADS
    assert all(torch.equal(key, full) for key in gathered)


class _Connections:
    """ProducerConnections' stand-in: every producer is connected, to a buffer that misses at once."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, int], Buffer] = {}

    def when_ready(self, address: tuple[str, int], ready: object) -> None:
        ready(self.connected(address))

    def connected(self, address: tuple[str, int]) -> Buffer:
        return self.buffers.setdefault(address, Buffer())


def test_a_gather_takes_a_share_of_each_of_its_ranks_at_once_and_in_turn_with_single_loads() -> None:
    """Shares of one load each: a gather waits for all its ranks' shares without holding any; a
    later load of one of its ranks waits behind it; a connection dropped unused gives its share back."""
    first, second = ("h", 1), ("h", 2)
    sources = Sources("h", 1, 2, (Source(0, None, (0, 1)), Source(1, None, (1, 2))), head_dim=2)
    connections = SourceConnections(_Connections(), share=1)
    single, gather, later = Told(), Told(), Told()
    connections.when_ready(first, single)
    assert single.done.is_set()
    connections.when_ready(sources, gather)
    connections.when_ready(second, later)
    assert not gather.done.is_set() and not later.done.is_set()  # the gather waits for the first rank
    select = torch.arange(5), torch.ones(5, dtype=torch.bool)
    assert single.wait().drop_select(*select, timeout=0) == [None] * 5  # gives the first rank's share back
    assert isinstance(gather.wait().buffer, HeadGather) and not later.done.is_set()
    assert gather.wait().drop_select(*select, timeout=0) == [None] * 5
    assert later.wait().buffer is connections.connected(second)
    unused = Told()
    connections.when_ready(second, unused)
    assert not unused.done.is_set()
    later.results.clear()  # the load that took it never selects: its connection dies unused
    del later
    gc.collect()
    assert unused.done.is_set()
