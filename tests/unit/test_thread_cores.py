"""The cores kvbridge's threads run on (kv_pipe.cores): a thread started from a thread pinned to one
core (as vLLM pins its engine thread) moves to the process's other cores, ``inherit`` keeps the
creator's core, an explicit list is honoured, a list outside the allowed cores is refused when the
settings are read, and with every core bound a thread may use all of them rather than stay beside
its pinned creator. A producer's listener, its ZeroMQ I/O thread and a connect attempt started from
a pinned thread run on the same cores.

Each test reads the affinity inside the started thread (``os.sched_getaffinity(0)``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from connector.vllm_settings import ConnectorSettings
from connector.vllm_store import StoreSettings
from harness.procs import free_port
from kv_pipe import cores
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVConfigError, KVPeerLostError
from kv_store import MemoryTier, PutResult, TieredStore
from lookup_buffer.connections import ProducerConnections
from lookup_buffer.listener import BufferListener

pytestmark = pytest.mark.timeout(120)

ALLOWED = cores.allowed_cores()
FIRST = min(ALLOWED)
#: What ``auto`` leaves a thread started from a thread pinned to FIRST (a one-core process: FIRST).
OTHERS = (ALLOWED - {FIRST}) or frozenset({FIRST})


def on_pinned_thread(core: int, body: Callable[[], Any]) -> Any:
    """Run ``body`` in a thread pinned to ``core`` (as vLLM pins its engine thread); return its result."""
    result: list[Any] = []

    def run() -> None:
        os.sched_setaffinity(0, {core})
        try:
            result.append(body())
        except BaseException as exc:  # handed to the test
            result.append(exc)

    pinned = threading.Thread(target=run, name="test-engine-thread")
    pinned.start()
    pinned.join(60)
    assert not pinned.is_alive() and result, "the pinned thread did not finish"
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def affinity_of_kvbridge_thread() -> frozenset[int]:
    """Start a kvbridge thread (:func:`kv_pipe.cores.thread`) and return the cores it runs on."""
    seen: list[frozenset[int]] = []
    started = cores.thread(lambda: seen.append(frozenset(os.sched_getaffinity(0))), "kvbridge-test")
    started.start()
    started.join(30)
    assert seen, "the kvbridge thread did not run"
    return seen[0]


def affinity_of_pool_thread() -> frozenset[int]:
    """The same for a thread of a kvbridge pool (:func:`kv_pipe.cores.executor`)."""
    pool = cores.executor(1, "kvbridge-test-pool")
    try:
        return pool.submit(lambda: frozenset(os.sched_getaffinity(0))).result(timeout=30)
    finally:
        pool.shutdown(wait=True)


@pytest.fixture
def process_cores(monkeypatch: pytest.MonkeyPatch) -> Callable[..., cores.ThreadCores]:
    """Give this process a fresh choice (the first thread a test starts makes it), without vLLM's
    variable from the environment."""

    def use(setting: cores.Setting, allowed: frozenset[int] | None = None, **environ: str) -> cores.ThreadCores:
        chosen = cores.ThreadCores(setting, allowed=allowed, environ=environ)
        monkeypatch.setattr(cores, "PROCESS", chosen)
        return chosen

    return use


def test_allowed_cores_are_the_process_cores_even_when_asked_from_a_pinned_thread() -> None:
    main = frozenset(os.sched_getaffinity(0))
    from_pinned = on_pinned_thread(FIRST, cores.allowed_cores.__wrapped__)
    assert main <= from_pinned  # not the pinned thread's one core
    assert from_pinned == ALLOWED


@pytest.mark.parametrize("started", [affinity_of_kvbridge_thread, affinity_of_pool_thread])
def test_auto_moves_a_thread_started_from_a_pinned_thread_to_the_other_allowed_cores(
    process_cores: Callable[..., cores.ThreadCores], started: Callable[[], frozenset[int]]
) -> None:
    process_cores(cores.AUTO)
    assert on_pinned_thread(FIRST, started) == OTHERS
    # The creator itself stays where vLLM put it; a thread started later, from anywhere, gets the same cores.
    assert on_pinned_thread(FIRST, lambda: frozenset(os.sched_getaffinity(0))) == {FIRST}
    assert started() == OTHERS


def test_a_store_tier_writer_thread_runs_off_the_creator_core(process_cores: Callable[..., cores.ThreadCores]) -> None:
    process_cores(cores.AUTO)
    seen: list[frozenset[int]] = []
    written = threading.Event()

    class RecordingTier(MemoryTier):
        name = "recording"

        def put(self, key: bytes, blob: Any) -> bool:
            seen.append(frozenset(os.sched_getaffinity(0)))
            written.set()
            return super().put(key, blob)

    def write() -> None:
        store = TieredStore([MemoryTier(1 << 20), RecordingTier(1 << 20)])
        try:
            assert store.put(b"k" * 32, os.urandom(1000)) is PutResult.STORED
            assert written.wait(30), "the slower tier's writer never wrote"
        finally:
            store.close()

    on_pinned_thread(FIRST, write)
    assert seen == [OTHERS]


def test_inherit_keeps_the_creator_core(process_cores: Callable[..., cores.ThreadCores]) -> None:
    process_cores(cores.INHERIT)
    assert on_pinned_thread(FIRST, affinity_of_kvbridge_thread) == {FIRST}


def test_an_explicit_list_is_honoured(process_cores: Callable[..., cores.ThreadCores]) -> None:
    last = max(ALLOWED)
    process_cores(cores.parse_setting(str(last)))
    assert on_pinned_thread(FIRST, affinity_of_kvbridge_thread) == {last}


def test_a_process_with_one_allowed_core_keeps_it(process_cores: Callable[..., cores.ThreadCores]) -> None:
    process_cores(cores.AUTO, allowed=frozenset({FIRST}))
    assert on_pinned_thread(FIRST, affinity_of_kvbridge_thread) == {FIRST}


def test_with_every_core_bound_a_thread_may_use_every_allowed_core(
    process_cores: Callable[..., cores.ThreadCores],
) -> None:
    # Rank 0 pinned to FIRST, rank 1 to every other core: no spare core, so the thread is not left
    # confined to its creator's core (beside a spinning poller) but may run on any allowed core.
    others = ",".join(map(str, sorted(ALLOWED - {FIRST}))) or str(FIRST)
    process_cores(cores.AUTO, VLLM_CPU_OMP_THREADS_BIND=f"{FIRST}|{others}")
    assert on_pinned_thread(FIRST, affinity_of_kvbridge_thread) == ALLOWED


def test_the_choice_is_made_once_per_process(process_cores: Callable[..., cores.ThreadCores]) -> None:
    chosen = process_cores(cores.AUTO)
    assert on_pinned_thread(FIRST, affinity_of_kvbridge_thread) == OTHERS
    # A kvbridge thread started by a kvbridge thread (already moved) keeps the first choice.
    assert on_pinned_thread(min(OTHERS), affinity_of_kvbridge_thread) == OTHERS
    cores.configure(cores.AUTO)  # the same setting again (a second connector in the process)
    assert cores.PROCESS is chosen
    cores.configure(cores.INHERIT)
    assert cores.PROCESS is not chosen
    assert on_pinned_thread(FIRST, affinity_of_kvbridge_thread) == {FIRST}


def test_a_forked_child_makes_its_own_choice(process_cores: Callable[..., cores.ThreadCores]) -> None:
    chosen = process_cores(cores.INHERIT)
    chosen.enter()  # the choice is made in the parent
    pid = os.fork()
    if pid == 0:  # the child: a fresh choice with the parent's setting
        os._exit(0 if cores.PROCESS is not chosen and cores.PROCESS.setting == cores.INHERIT else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert cores.PROCESS is chosen


def test_choose() -> None:
    four = frozenset(range(4))
    assert cores.choose(cores.AUTO, four, frozenset({0})) == {1, 2, 3}
    assert cores.choose(cores.AUTO, four, frozenset({2, 0})) == {1, 3}
    assert cores.choose(cores.AUTO, four, four) == four
    assert cores.choose(cores.AUTO, frozenset({5}), frozenset({5})) == {5}
    assert cores.choose(cores.INHERIT, four, frozenset({0})) is None
    assert cores.choose(frozenset({0, 3}), four, frozenset({0})) == {0, 3}


@pytest.mark.parametrize(
    ("bind", "bound"),
    [
        ("0", {0}),
        ("0-3|4-7", set(range(8))),
        ("5,2-4", {2, 3, 4, 5}),
        ("auto", set()),
        ("nobind", set()),
        (None, set()),
    ],
)
def test_vllm_bound_cores(bind: str | None, bound: set[int]) -> None:
    environ = {} if bind is None else {cores.VLLM_BIND_ENV: bind}
    assert cores.vllm_bound_cores(environ) == bound


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("auto", "auto"),
        ("inherit", "inherit"),
        ("1,3", {1, 3}),
        ("0-2,7", {0, 1, 2, 7}),
        (" 4 ", {4}),
        ([6, 2], {2, 6}),
    ],
)
def test_settings_parse(value: Any, expected: Any) -> None:
    assert cores.parse_setting(value, allowed=range(8)) == expected


@pytest.mark.parametrize("value", ["", "one", "1,,2", "3-1", "-1", [], [True], [1.0], [-2], 3, None, "AUTO"])
def test_a_malformed_setting_is_refused(value: Any) -> None:
    with pytest.raises(KVConfigError, match="kv_thread_cores must be 'auto', 'inherit' or a list of cores"):
        cores.parse_setting(value, allowed=range(8))


def test_a_list_outside_the_allowed_cores_is_refused_when_the_settings_are_read() -> None:
    outside = max(ALLOWED) + 1
    with pytest.raises(KVConfigError, match=rf"kv_thread_cores .* names cores \[{outside}\] this process may not use"):
        ConnectorSettings.from_vllm("kv_producer", 20000, "cpu", {"kv_thread_cores": f"{FIRST},{outside}"}, {})
    with pytest.raises(KVConfigError, match=rf"names cores \[{outside}\]"):
        StoreSettings.from_extra({"kv_store": "disk:/x", "kv_thread_cores": str(outside)}, environ={})


def test_the_connector_settings_carry_the_setting() -> None:
    assert ConnectorSettings.from_vllm("kv_producer", 20000, "cpu", {}, {}).thread_cores == cores.AUTO
    pinned = ConnectorSettings.from_vllm("kv_consumer", 20000, "cpu", {"kv_thread_cores": str(FIRST)}, {})
    assert pinned.thread_cores == {FIRST}
    store = StoreSettings.from_extra({"kv_store": "disk:/x", "kv_thread_cores": "inherit"}, environ={})
    assert store.thread_cores == cores.INHERIT
    assert StoreSettings.from_extra({"kv_store": "disk:/x"}, environ={}).thread_cores == cores.AUTO


def cores_of_task(tid: int) -> frozenset[int]:
    """A thread's affinity as the kernel reports it (also for native threads Python does not know)."""
    status = Path(f"/proc/self/task/{tid}/status").read_text()
    (listed,) = [line.split(":", 1)[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")]
    return cores.parse_cores(listed)


def zmq_io_threads() -> set[int]:
    return {
        int(task.name)
        for task in Path("/proc/self/task").iterdir()
        if (task / "comm").read_text().startswith("ZMQbg/IO")
    }


def test_a_listener_its_zmq_io_thread_and_a_connect_attempt_started_from_a_pinned_thread_move(
    process_cores: Callable[..., cores.ThreadCores],
) -> None:
    process_cores(cores.AUTO)
    port = free_port(1)
    config = KVTransferConfig(kv_role="kv_producer", kv_ip="127.0.0.1", kv_port=port, kv_buffer_size=1 << 22)
    dialed: list[frozenset[int]] = []
    dial_done = threading.Event()

    def dial(*_: object) -> object:
        dialed.append(frozenset(os.sched_getaffinity(0)))
        dial_done.set()
        raise KVPeerLostError("this test looks only at where the attempt ran")

    def start() -> tuple[BufferListener, ProducerConnections, frozenset[int]]:
        listener = BufferListener(config)
        connections = ProducerConnections(KVTransferConfig(kv_role="kv_consumer", kv_rank=1), connect=dial)
        connections.when_ready(("127.0.0.1", port), lambda _: None)
        return listener, connections, frozenset(os.sched_getaffinity(0))

    before = zmq_io_threads()
    listener, connections, creator_after = on_pinned_thread(FIRST, start)
    try:
        assert creator_after == {FIRST}  # the pinned creator stays where it was
        assert dial_done.wait(30)
        assert dialed == [OTHERS]
        (acceptor,) = [t for t in threading.enumerate() if t.name == f"kvbuf-listener-{port}"]
        assert acceptor.native_id is not None and cores_of_task(acceptor.native_id) == OTHERS
        (io_thread,) = zmq_io_threads() - before  # the listener socket's, started on the pinned thread
        assert cores_of_task(io_thread) == OTHERS
    finally:
        connections.close()
        listener.close()
