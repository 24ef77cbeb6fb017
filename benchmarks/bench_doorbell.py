"""The floor of a same-host message path without gloo: shared memory plus an eventfd doorbell.

kvbridge's pipe moves same-host payloads through shared memory, but every message still costs a
gloo frame and two thread hand-offs. This benchmark measures what a Python design that signals
through the kernel's cheapest wake-up instead could do at best, so that a redesign is judged
against a floor and not a hope. Two processes ping-pong a message of each size through one shared
segment (each side owns a half); one-way time = round trip / 2, median of the rounds:

* ``memcpy``: copying the message once, in one process (the copy every design pays).
* ``doorbell``: the caller copies the payload into its half, writes the sequence number and wakes
  the peer's eventfd; the peer, blocked in ``read`` on its eventfd, checks the sequence number and
  sampled words through a view (no second copy). No threads.
* ``doorbell + threads``: the same, but each side hands every message to a background thread
  and back (a ``threading.Condition`` each way), as the pipe's sender and receiver threads do.
* ``raw gloo``: send/recv on a ProcessGroupGloo, the baseline of the other benchmarks.

Every round checks sampled words of every message; the last round checks every byte.

    python -m benchmarks.bench_doorbell [--sizes 4K,64K,1M,16M] [--iters 7] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import mmap
import os
import socket
import statistics
import struct
import tempfile
import threading
import time

import torch

from benchmarks.measure import (
    label,
    parse_sizes,
    raw_group,
    run_two_ranks,
    timed,
    timed_round_trips,
    warmup_count,
)
from harness.procs import free_port

DESIGNS = ("doorbell", "doorbell + threads", "raw gloo")
_SEQUENCE = struct.Struct("<Q")
_HEADER = 64  # the sequence word, then the payload from a cache line on


class Doorbell:
    """One side of the segment: its own half to write, the peer's half to read, two eventfds."""

    def __init__(self, segment: mmap.mmap, rank: int, half: int, mine: int, theirs: int) -> None:
        self.segment = segment
        self.half = half
        self.out = rank * half
        self.into = (1 - rank) * half
        self.mine, self.theirs = mine, theirs
        self.buffer = torch.frombuffer(segment, dtype=torch.uint8)
        self.sent = self.received = 0  # sequence numbers: each direction has its own

    def send(self, payload: torch.Tensor) -> None:
        self.sent += 1
        self.buffer[self.out + _HEADER : self.out + _HEADER + payload.numel()].copy_(payload)
        _SEQUENCE.pack_into(self.segment, self.out, self.sent)
        os.eventfd_write(self.theirs, 1)

    def receive(self, nbytes: int) -> torch.Tensor:
        os.eventfd_read(self.mine)
        got = _SEQUENCE.unpack_from(self.segment, self.into)[0]
        if got != self.received + 1:
            raise AssertionError(f"sequence {got} after {self.received}")
        self.received = got
        return self.buffer[self.into + _HEADER : self.into + _HEADER + nbytes]  # a view: no copy


class Handoff:
    """A background thread that does the doorbell's work, each message handed over with a Condition."""

    def __init__(self, doorbell: Doorbell) -> None:
        self.doorbell = doorbell
        self.cond = threading.Condition()
        self.outgoing: list[torch.Tensor] = []
        self.incoming: list[torch.Tensor] = []
        self.receive_sizes: list[int] = []
        self.stop = False
        self.threads = [
            threading.Thread(target=self._send_loop, daemon=True),
            threading.Thread(target=self._receive_loop, daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _send_loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.outgoing or self.stop)
                if not self.outgoing:  # stopped, with everything sent
                    return
                payload = self.outgoing.pop(0)
            self.doorbell.send(payload)

    def _receive_loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.receive_sizes or self.stop)
                if self.stop:
                    return
                nbytes = self.receive_sizes.pop(0)
            view = self.doorbell.receive(nbytes)
            with self.cond:
                self.incoming.append(view)
                self.cond.notify_all()

    def send(self, payload: torch.Tensor) -> None:
        with self.cond:
            self.outgoing.append(payload)
            self.cond.notify_all()

    def expect(self, nbytes: int) -> None:
        with self.cond:
            self.receive_sizes.append(nbytes)
            self.cond.notify_all()

    def receive(self) -> torch.Tensor:
        with self.cond:
            self.cond.wait_for(lambda: self.incoming)
            return self.incoming.pop(0)

    def close(self) -> None:
        """Between messages (no receive pending): the sender sends what it holds, then both end."""
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        for thread in self.threads:
            thread.join(5)


def _check(got: torch.Tensor, want: torch.Tensor, full: bool) -> None:
    if full:
        ok = torch.equal(got, want)
    else:
        step = max(1, want.numel() // 64)
        ok = torch.equal(got[::step], want[::step]) and bool(got[-1] == want[-1])
    if not ok:
        raise AssertionError("the bytes received differ from the bytes sent")


class Trip:
    """One message each way at one size, by each design; ``full`` checks every byte."""

    def __init__(self, rank: int, nbytes: int, doorbell: Doorbell, group: object) -> None:
        self.rank, self.nbytes, self.doorbell, self.group = rank, nbytes, doorbell, group
        self.mine = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank))
        self.peer = torch.randint(
            0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1 - rank)
        )
        self.inbox = torch.empty(nbytes, dtype=torch.uint8)

    def by_doorbell(self, full: bool) -> None:
        if self.rank == 0:
            self.doorbell.send(self.mine)
            _check(self.doorbell.receive(self.nbytes), self.peer, full)
        else:
            _check(self.doorbell.receive(self.nbytes), self.peer, full)
            self.doorbell.send(self.mine)

    def by_threads(self, handoff: Handoff, full: bool) -> None:
        handoff.expect(self.nbytes)
        if self.rank == 0:
            handoff.send(self.mine)
            _check(handoff.receive(), self.peer, full)
        else:
            _check(handoff.receive(), self.peer, full)
            handoff.send(self.mine)

    def by_gloo(self, full: bool) -> None:
        peer = 1 - self.rank
        if self.rank == 0:
            self.group.send([self.mine], peer, 0).wait()  # type: ignore[attr-defined]
            self.group.recv([self.inbox], peer, 0).wait()  # type: ignore[attr-defined]
        else:
            self.group.recv([self.inbox], peer, 0).wait()  # type: ignore[attr-defined]
            self.group.send([self.mine], peer, 0).wait()  # type: ignore[attr-defined]
        _check(self.inbox, self.peer, full)


def _swap_eventfds(rank: int, path: str) -> tuple[int, int]:
    """This process's eventfd, and the peer's, passed over a Unix socket (SCM_RIGHTS)."""
    mine = os.eventfd(0)
    if rank == 0:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(path)
            server.listen(1)
            connection, _ = server.accept()
    else:
        connection = socket.socket(socket.AF_UNIX)
        for _ in range(600):
            try:
                connection.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.05)
    with connection:
        socket.send_fds(connection, [b"x"], [mine])
        _, (theirs,), _, _ = socket.recv_fds(connection, 1, 1)
    return mine, theirs


def _worker(rank: int, port: int, path: str, sizes: list[int], iters: int, rounds: int, results: object) -> None:
    torch.set_num_threads(1)
    half = _HEADER + max(sizes)
    with open(path, "r+b") as file:
        segment = mmap.mmap(file.fileno(), 2 * half)
    doorbell = Doorbell(segment, rank, half, *_swap_eventfds(rank, path + ".sock"))
    group, store = raw_group(rank, port)
    table: dict[int, dict[str, list[float]]] = {}
    for nbytes in sizes:
        trip = Trip(rank, nbytes, doorbell, group)
        count, warmup = timed_round_trips(nbytes, iters), warmup_count(nbytes)
        samples: dict[str, list[float]] = {design: [] for design in DESIGNS}
        for round_index in range(rounds):
            full = round_index == rounds - 1
            samples["doorbell"] += timed(functools.partial(trip.by_doorbell, full), count, warmup, 0.5)
            handoff = Handoff(doorbell)
            samples["doorbell + threads"] += timed(
                functools.partial(trip.by_threads, handoff, full), count, warmup, 0.5
            )
            handoff.close()
            samples["raw gloo"] += timed(functools.partial(trip.by_gloo, full), count, warmup, 0.5)
        table[nbytes] = samples
    group.barrier().wait()
    if rank == 0:
        results.put(table)  # type: ignore[attr-defined]
    del store


def memcpy_seconds(nbytes: int, iters: int) -> float:
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    target = torch.empty_like(source)
    times = timed(functools.partial(target.copy_, source), timed_round_trips(nbytes, iters), warmup_count(nbytes))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("4K,64K,1M,16M"))
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    half = _HEADER + max(args.sizes)
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="kvbridge-bench-") as file:
        os.ftruncate(file.fileno(), 2 * half)
        try:
            table = run_two_ranks(_worker, (free_port(), file.name, args.sizes, args.iters, args.rounds))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file.name + ".sock")
    _print(table, {nbytes: memcpy_seconds(nbytes, args.iters) for nbytes in args.sizes})


def _print(table: dict[int, dict[str, list[float]]], memcpy: dict[int, float]) -> None:
    columns = ("memcpy", *DESIGNS)
    print("One-way time per message (median), and the ratio of raw gloo's time to each design's")
    print("| size | " + " | ".join(columns) + " | " + " | ".join(f"{d} / gloo" for d in DESIGNS[:2]) + " |")
    print("|---" * (1 + len(columns) + 2) + "|")
    for nbytes, samples in table.items():
        medians = {design: statistics.median(times) for design, times in samples.items()}
        cells = [_cell(nbytes, memcpy[nbytes])] + [_cell(nbytes, medians[design]) for design in DESIGNS]
        ratios = [f"{medians['raw gloo'] / medians[design]:.2f}x" for design in DESIGNS[:2]]
        print(f"| {label(nbytes)} | " + " | ".join(cells + ratios) + " |")


def _cell(nbytes: int, seconds: float) -> str:
    time_text = f"{seconds * 1e6:.0f} us"
    return time_text if nbytes < 1 << 20 else f"{time_text} ({nbytes / seconds / 1e9:.2f} GB/s)"


if __name__ == "__main__":
    main()
