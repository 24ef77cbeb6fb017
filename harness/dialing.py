"""A scripted dialer for ProducerConnections and the consumer worker: each attempt pops its outcome
(a connection, an exception, or a gate the test opens); nothing measures time."""

from __future__ import annotations

import dataclasses
import threading

from kv_pipe.errors import KVPeerLostError

WAIT = 30.0  # a hang guard, never a timing claim


class FakeBuffer:
    """A connection: ``failure`` is None while it is usable."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.failure: Exception | None = None
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


@dataclasses.dataclass
class Gate:
    """An attempt that blocks until the test opens it, then ends with ``outcome``."""

    outcome: object
    entered: threading.Event = dataclasses.field(default_factory=threading.Event)
    opened: threading.Event = dataclasses.field(default_factory=threading.Event)
    left: threading.Event = dataclasses.field(default_factory=threading.Event)


class Dialer:
    """Scripted attempts per address: each pops the next outcome (a buffer, an exception to raise,
    or a :class:`Gate`); counts the attempts and the threads they ran in."""

    def __init__(self, script: dict[tuple[str, int], list[object]]) -> None:
        self.script = script
        self.calls: list[tuple[str, int]] = []
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, config: object, host: str, port: int, on_connect: object) -> FakeBuffer:
        with self._lock:
            self.calls.append((host, port))
            self.threads.add(threading.current_thread().name)
            outcome = self.script[(host, port)].pop(0)
        if isinstance(outcome, Gate):
            gate = outcome
            gate.entered.set()
            try:
                if not gate.opened.wait(WAIT):
                    raise KVPeerLostError("the test never opened the gate")
                outcome = gate.outcome
            finally:
                gate.left.set()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def count(self, address: tuple[str, int]) -> int:
        with self._lock:
            return self.calls.count(address)


class Told:
    """A when_ready callback that records what it was told, and in which thread."""

    def __init__(self) -> None:
        self.results: list[object] = []
        self.threads: list[str] = []
        self.done = threading.Event()

    def __call__(self, result: object) -> None:
        self.results.append(result)
        self.threads.append(threading.current_thread().name)
        self.done.set()

    def wait(self) -> object:
        assert self.done.wait(WAIT), "never told"
        assert len(self.results) == 1, f"told {len(self.results)} times"
        return self.results[0]
