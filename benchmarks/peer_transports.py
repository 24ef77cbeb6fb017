"""The transports bench_peers compares, and the worker process (one per rank) that times them.

Every transport moves a message of N bytes between two processes (memcpy: within rank 0) from and
into host buffers allocated once and reused:

* memcpy: ``torch`` ``copy_`` with one thread, in rank 0 alone: the ceiling of any copy.
* raw gloo: ``ProcessGroupGloo`` send/recv into a reused buffer; ping-pong, one-way = round trip / 2.
* the kvbridge pipe with payloads over the transport, sent from the pipe's own memory
  (``pipe.empty``), and with payloads through shared memory (the same-host path; across hosts it
  does not exist), sent from the plain buffer: ping-pong, one-way = round trip / 2.
* Mooncake's transfer engine (TCP transport, P2P handshake) and NIXL (UCX backend, DRAM to DRAM):
  one completed write from rank 0's buffer into rank 1's. No one reads the target meanwhile, and
  rank 1 is not told.
* NIXL as a message: the same writes, each with a notification, ping-pong like the pipe (rank 1 is
  told by the notification and writes the bytes it received back): one-way = round trip / 2.

A transport that cannot be imported or started on either side is reported with the reason, never
dropped. All transports are timed in the same processes, in alternating rounds, and the bytes each
one moves are checked against the random payload once per size.

Run by bench_peers: ``python -m benchmarks.peer_transports RESULT_FILE JSON_ARGS``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch

from benchmarks.measure import label, raw_group, timed, timed_round_trips, warmup_count
from kv_pipe import KVTransferConfig, TorchDistributedPipe

PEERS_HINT = "not installed: pip install 'kvbridge[peers]'"
ANOTHER_HOST = "n/a (another host)"
#: Seconds a pipe receive or a NIXL write may take before the benchmark fails.
STEP_TIMEOUT = 120.0
#: Seconds a round of a one-sided transport may take while rank 1 serves its writes.
SERVE_TIMEOUT = 600.0
_DATA_TAG, _CONTROL_TAG = 0, 1

Step = Callable[[], "torch.Tensor | None"]


class Unavailable(Exception):
    """The transport cannot run here; the message (shown in the table) says why."""


def import_peer(module: str, top: str):
    """Import a peer's module; Unavailable saying how to get it, or why it does not load."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == top or (exc.name or "").startswith(top + "."):
            raise Unavailable(PEERS_HINT) from exc
        raise Unavailable(f"cannot load: {exc}") from exc
    except (ImportError, OSError) as exc:  # e.g. a shared library the wheel links is missing
        raise Unavailable(f"cannot load: {exc}") from exc


@dataclasses.dataclass
class Context:
    """One rank's side of the run: the raw group and its store (also the control channel) and the buffers."""

    rank: int
    ip: str  # rank 0's address: the store, the raw group and the pipes meet there
    own_ip: str  # the address this process is reached at (Mooncake's engine announces it)
    port: int
    across_hosts: bool
    group: torch.distributed.ProcessGroup
    store: torch.distributed.TCPStore
    source: torch.Tensor  # rank 0 sends from it
    target: torch.Tensor  # rank 1 receives into it, and rank 0 receives echoes and copies into it
    write_rounds: int = 0

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def exchange(self, value: int = 0) -> int:
        """Swap an integer with the peer: also the barrier that starts every round."""
        mine, theirs = torch.tensor([value], dtype=torch.int64), torch.empty(1, dtype=torch.int64)
        if self.rank == 0:
            self.group.send([mine], self.peer, _CONTROL_TAG).wait()
            self.group.recv([theirs], self.peer, _CONTROL_TAG).wait()
        else:
            self.group.recv([theirs], self.peer, _CONTROL_TAG).wait()
            self.group.send([mine], self.peer, _CONTROL_TAG).wait()
        return int(theirs)

    def end_writes(self, progress: Callable[[], object] | None) -> None:
        """Rank 0 has made its last write of a one-sided round: rank 1, calling ``progress`` over and
        over meanwhile if given, returns once it knows. (Blocked in gloo, it could not progress, and a
        gloo receive cannot be polled: its work never reports completion before ``wait``.)"""
        if progress is None:
            return
        self.write_rounds += 1
        key = f"writes-ended/{self.write_rounds}"
        if self.rank == 0:
            self.store.set(key, "")
            return
        checked = time.monotonic()
        deadline = checked + SERVE_TIMEOUT
        while True:
            progress()
            now = time.monotonic()
            if now - checked > 1e-3:  # a store request costs rank 0 (the store's host) a little CPU
                if self.store.check([key]):
                    return
                if now > deadline:
                    raise RuntimeError(f"rank 0 did not end its writes within {SERVE_TIMEOUT:g} s")
                checked = now

    def swap(self, key: str, value: str | bytes) -> bytes:
        """Publish ``value`` under ``key`` and return what the peer published under it."""
        self.store.set(f"{key}/{self.rank}", value)
        return self.store.get(f"{key}/{self.peer}")


class Transport:
    """A row of the table. Subclasses give ``name`` and :meth:`prepare`; the rest is optional."""

    name: str
    one_sided = False  # rank 0 alone times it (one completed write or copy); else both ping-pong
    lands_on = 1  # for one-sided ones: the rank whose ``target`` the bytes land in

    def open(self, ctx: Context) -> None:
        """Local set-up: import, start, register buffers. Raise Unavailable to be reported."""

    def connect(self, ctx: Context) -> None:
        """Meet the peer (both sides opened)."""

    def prepare(self, ctx: Context, nbytes: int) -> Step | None:
        """This rank's step for messages of ``nbytes`` (None where a one-sided transport's rank 1 idles).
        A two-sided step returns the tensor this rank received."""
        raise NotImplementedError

    def progress(self) -> Callable[[], object] | None:
        """What a rank calls over and over while it waits for the end of a one-sided round, so that
        writes into it complete (None: nothing, it waits blocked)."""
        return None

    def close(self) -> None:
        """Undo :meth:`open` and :meth:`connect` (also after a failed open)."""


class Memcpy(Transport):
    name = "memcpy (torch, 1 thread)"
    one_sided = True
    lands_on = 0

    def prepare(self, ctx: Context, nbytes: int) -> Step | None:
        source, target = ctx.source[:nbytes], ctx.target[:nbytes]
        return (lambda: target.copy_(source)) if ctx.rank == 0 else None


class RawGloo(Transport):
    name = "raw gloo"

    def prepare(self, ctx: Context, nbytes: int) -> Step | None:
        source, target, group, peer = ctx.source[:nbytes], ctx.target[:nbytes], ctx.group, ctx.peer

        def round_trip() -> torch.Tensor:
            if ctx.rank == 0:
                group.send([source], peer, _DATA_TAG).wait()
            group.recv([target], peer, _DATA_TAG).wait()
            if ctx.rank == 1:
                group.send([target], peer, _DATA_TAG).wait()
            return target

        return round_trip


class Pipe(Transport):
    """A kvbridge pipe on its own port; ``shared``: the same-host path, else payloads over the transport."""

    def __init__(self, shared: bool) -> None:
        self.shared = shared
        self.name = "kvbridge (shared memory)" if shared else "kvbridge (transport)"
        self.pipe: TorchDistributedPipe | None = None

    def open(self, ctx: Context) -> None:
        if self.shared and ctx.across_hosts:
            raise Unavailable(ANOTHER_HOST)

    def connect(self, ctx: Context) -> None:
        # Across hosts the pipe chooses for itself ("auto") and must choose the transport.
        mode = "on" if self.shared else ("auto" if ctx.across_hosts else "off")
        config = KVTransferConfig(
            kv_rank=ctx.rank,
            kv_ip=ctx.ip,
            kv_port=ctx.port + (4 if self.shared else 2),
            kv_buffer_size=2 * ctx.source.nbytes + (1 << 20),
            kv_shared_memory=mode,
            kv_timeout=60.0,
            kv_connect_timeout=120.0,
        )
        self.pipe = TorchDistributedPipe(config)
        if self.pipe.uses_shared_memory != self.shared:
            raise AssertionError(
                f"{self.name}: kv_shared_memory={mode!r} gave uses_shared_memory={self.pipe.uses_shared_memory}"
            )

    def prepare(self, ctx: Context, nbytes: int) -> Step | None:
        pipe, source = self.pipe, ctx.source[:nbytes]
        if not self.shared:
            # The transport path sends a tensor in the pipe's own memory (pipe.empty, which the lookup
            # buffer fills) without a copy, every time. A lent shared-memory region goes in place only
            # once, so the same-host path, resending one tensor, is timed with its one copy.
            source = pipe.empty((nbytes,), torch.uint8).copy_(source)

        def round_trip() -> torch.Tensor:
            if ctx.rank == 0:
                pipe.send_tensor(source)
                return pipe.recv_tensor(timeout=STEP_TIMEOUT)
            received = pipe.recv_tensor(timeout=STEP_TIMEOUT)
            pipe.send_tensor(received)
            return received

        return round_trip

    def close(self) -> None:
        if self.pipe is not None:
            self.pipe.close()


class Mooncake(Transport):
    name = "Mooncake TE (tcp)"
    one_sided = True

    def __init__(self) -> None:
        self.engine = None
        self.registered = 0

    def open(self, ctx: Context) -> None:
        engine_module = import_peer("mooncake.engine", "mooncake")
        self.engine = engine_module.TransferEngine()
        status = self.engine.initialize(ctx.own_ip, "P2PHANDSHAKE", "tcp", "")
        if status != 0:
            raise Unavailable(f"failed to start: initialize returned {status}")
        buffer = self._buffer(ctx)
        status = self.engine.register_memory(buffer.data_ptr(), buffer.nbytes)
        if status != 0:
            raise Unavailable(f"failed to start: register_memory returned {status}")
        self.registered = buffer.data_ptr()

    @staticmethod
    def _buffer(ctx: Context) -> torch.Tensor:
        return ctx.source if ctx.rank == 0 else ctx.target

    def connect(self, ctx: Context) -> None:
        where = f"{ctx.own_ip}:{self.engine.get_rpc_port()} {self.registered}"
        self.peer_session, peer_address = ctx.swap("mooncake", where).decode().split()
        self.peer_address = int(peer_address)

    def prepare(self, ctx: Context, nbytes: int) -> Step | None:
        if ctx.rank == 1:
            return None
        engine, session, source, target = self.engine, self.peer_session, ctx.source.data_ptr(), self.peer_address

        def write() -> None:
            status = engine.transfer_sync_write(session, source, target, nbytes)
            if status != 0:
                raise RuntimeError(f"Mooncake transfer_sync_write of {nbytes} bytes returned {status}")

        return write

    def close(self) -> None:
        if self.registered:
            self.engine.unregister_memory(self.registered)
            self.registered = 0


class Nixl(Transport):
    """NIXL without its progress thread: that thread polls without pause (the Python API sets no delay)
    and would take most of a core from every other transport for the whole run on a small host.
    Instead rank 1 polls for progress during NIXL's own rounds only (a write over TCP needs the
    target's progress; over shared memory it does not)."""

    name = "NIXL (UCX)"
    tag = "nixl"  # names its agents and what it swaps through the store
    one_sided = True

    def __init__(self) -> None:
        self.agent = None
        self.registration = None
        self.peer_name: str | None = None
        self.handle = None

    def _buffers(self, ctx: Context) -> list[torch.Tensor]:
        return [ctx.source if ctx.rank == 0 else ctx.target]

    def open(self, ctx: Context) -> None:
        api = import_peer("nixl._api", "nixl")
        try:
            config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            self.agent = api.nixl_agent(f"kvbridge-bench-{self.tag}-{ctx.rank}", config)
            self.registration = self.agent.register_memory(self._buffers(ctx))
        except Exception as exc:  # NIXL reports a backend that does not start as a plain exception
            raise Unavailable(f"failed to start: {exc}") from exc

    def connect(self, ctx: Context) -> None:
        self.peer_name = self.agent.add_remote_agent(ctx.swap(f"{self.tag}-metadata", self.agent.get_agent_metadata()))
        self.peer_address = int(ctx.swap(f"{self.tag}-address", str(ctx.target.data_ptr())))

    def _new_write(self, source: torch.Tensor, nbytes: int, notification: bytes = b""):
        """A handle that writes ``nbytes`` of ``source`` into the peer's target (the last one released)."""
        self._release_handle()
        local = self.agent.get_xfer_descs([(source.data_ptr(), nbytes, 0)], "DRAM")
        remote = self.agent.get_xfer_descs([(self.peer_address, nbytes, 0)], "DRAM")
        self.handle = self.agent.initialize_xfer("WRITE", local, remote, self.peer_name, notification)
        return self.handle

    def prepare(self, ctx: Context, nbytes: int) -> Step | None:
        if ctx.rank == 1:
            return None
        agent, handle = self.agent, self._new_write(ctx.source, nbytes)

        def write() -> None:
            _complete(agent, handle, agent.transfer(handle), nbytes)

        return write

    def progress(self) -> Callable[[], object] | None:
        return self.agent.get_new_notifs  # progresses the UCX worker

    def _release_handle(self) -> None:
        if self.handle is not None:
            self.agent.release_xfer_handle(self.handle)
            self.handle = None

    def close(self) -> None:
        if self.agent is None:
            return
        self._release_handle()
        if self.peer_name is not None:
            self.agent.remove_remote_agent(self.peer_name)
        if self.registration is not None:
            self.agent.deregister_memory(self.registration)


class NixlMessage(Nixl):
    """NIXL writes that tell their target, ping-pong: rank 0 writes its source into rank 1's target
    with a notification; rank 1, told, writes that target back into rank 0's target, with one."""

    name = "NIXL (UCX), told, ping-pong"
    tag = "nixl-told"
    one_sided = False

    def _buffers(self, ctx: Context) -> list[torch.Tensor]:
        return [ctx.source, ctx.target]

    def prepare(self, ctx: Context, nbytes: int) -> Step | None:
        agent, target = self.agent, ctx.target[:nbytes]
        handle = self._new_write(ctx.source if ctx.rank == 0 else ctx.target, nbytes, b"m")

        def told() -> None:
            deadline = time.monotonic() + STEP_TIMEOUT
            while not any(agent.get_new_notifs().values()):  # the peer is the agent's only one
                if time.monotonic() > deadline:
                    raise RuntimeError(f"NIXL: no notification of a {nbytes}-byte write within {STEP_TIMEOUT:g} s")

        def round_trip() -> torch.Tensor:
            if ctx.rank == 1:
                told()
            _complete(agent, handle, agent.transfer(handle, b"m"), nbytes)
            if ctx.rank == 0:
                told()
            return target

        return round_trip


def _complete(agent, handle, state: str, nbytes: int) -> None:
    """Progress a posted NIXL transfer until it is done; RuntimeError if it fails or takes too long."""
    deadline = time.monotonic() + STEP_TIMEOUT
    while state != "DONE":
        if state == "ERR" or time.monotonic() > deadline:
            raise RuntimeError(f"NIXL write of {nbytes} bytes ended in state {state!r}")
        state = agent.check_xfer_state(handle)


def transports() -> list[Transport]:
    """Every transport, in table order."""
    return [Memcpy(), RawGloo(), Pipe(shared=False), Pipe(shared=True), Mooncake(), Nixl(), NixlMessage()]


def payload(nbytes: int) -> torch.Tensor:
    """The random message of ``nbytes``: the same on both ranks, different for every size."""
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))


def start(ctx: Context, transport: Transport) -> str | None:
    """Open ``transport`` on both sides and connect it; the reason it cannot run (rank 0's first), or None."""
    try:
        transport.open(ctx)
        mine = ""
    except Unavailable as exc:
        mine = str(exc)
    theirs = ctx.swap(f"open/{transport.name}", mine).decode()
    reason = (mine, theirs)[ctx.rank] or (theirs, mine)[ctx.rank]
    if reason:
        transport.close()
        return reason
    transport.connect(ctx)
    return None


def check_bytes(ctx: Context, transport: Transport, step: Step | None, nbytes: int, expected: torch.Tensor) -> None:
    """Move one message with every receiving buffer cleared first; both ranks check what they received."""
    if transport.one_sided:
        if ctx.rank == transport.lands_on:
            ctx.target[:nbytes].zero_()
        ctx.exchange()
        if ctx.rank == 0:
            step()
        ctx.end_writes(transport.progress())
        ctx.exchange()
        good = ctx.rank != transport.lands_on or torch.equal(ctx.target[:nbytes], expected)
    else:
        ctx.target[:nbytes].zero_()
        ctx.exchange()
        good = torch.equal(step(), expected)
    peer_good = ctx.exchange(int(good))
    if not (good and peer_good):
        wrong = [rank for rank, ok in ((ctx.rank, good), (ctx.peer, peer_good)) if not ok]
        raise AssertionError(f"{transport.name} delivered wrong bytes at {label(nbytes)} (checked on rank {wrong})")


def run(
    rank: int, ip: str, own_ip: str, port: int, sizes: list[int], rounds: int, iters: int, across_hosts: bool
) -> dict:
    """Time every transport at every size; rank 0 returns the medians, both the transports' states."""
    torch.set_num_threads(1)  # memcpy's ceiling is one thread's, and spinning OpenMP threads slow the peer
    group, store = raw_group(rank, port, ip)
    largest = max(sizes)
    ctx = Context(
        rank,
        ip,
        own_ip,
        port,
        across_hosts,
        group,
        store,
        source=torch.zeros(largest, dtype=torch.uint8),
        target=torch.zeros(largest, dtype=torch.uint8),
    )
    every = transports()
    medians: dict[str, dict[str, float]] = {}
    try:
        reasons = {transport.name: start(ctx, transport) for transport in every}
        live = [transport for transport in every if reasons[transport.name] is None]
        for nbytes in sizes:
            expected = payload(nbytes)
            ctx.source[:nbytes].copy_(expected)
            steps = {transport.name: transport.prepare(ctx, nbytes) for transport in live}
            count, warmup = timed_round_trips(nbytes, iters), warmup_count(nbytes)
            samples: dict[str, list[float]] = {transport.name: [] for transport in live}
            for round_index in range(rounds):
                for transport in live:
                    ctx.exchange()  # both ranks start each transport's round together
                    if rank == 0 or not transport.one_sided:
                        per_message = 1.0 if transport.one_sided else 0.5
                        samples[transport.name] += timed(steps[transport.name], count, warmup, per_message)
                    if transport.one_sided:
                        ctx.end_writes(transport.progress())
                if rank == 0:
                    print("step", json.dumps({"size": label(nbytes), "round": round_index}), flush=True)
            for transport in live:
                check_bytes(ctx, transport, steps[transport.name], nbytes, expected)
                if rank == 0:
                    medians.setdefault(transport.name, {})[str(nbytes)] = statistics.median(samples[transport.name])
    finally:
        for transport in every:
            transport.close()
    return {
        "order": [transport.name for transport in every],
        "unavailable": reasons,
        "seconds": medians,
        "messages": {str(nbytes): timed_round_trips(nbytes, iters) for nbytes in sizes},
    }


def main(result_file: str, args_json: str) -> None:
    try:
        outcome, code = {"value": run(**json.loads(args_json))}, 0
    except BaseException:  # reported to bench_peers, which fails with it
        outcome, code = {"error": traceback.format_exc()}, 1
    partial = result_file + ".partial"
    with open(partial, "w") as out:
        json.dump(outcome, out)
    os.replace(partial, result_file)
    sys.stdout.flush()
    sys.stderr.flush()
    # NIXL's agent (1.5.1) crashes the interpreter's teardown with SIGSEGV, even once deleted;
    # everything is closed and written by now, so leave without running it.
    os._exit(code)


if __name__ == "__main__":
    main(*sys.argv[1:3])
