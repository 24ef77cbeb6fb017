"""The same-host payload path: which path is chosen, what is left behind, who can open the segments.

The pipe's behaviour on this path (every dtype, None, order, backpressure, timeouts, peer loss) is
covered by tests/test_pipe.py, which runs every test on both paths.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from kv_pipe import KVTransferConfig, TorchDistributedPipe
from kv_pipe.errors import KVPeerLostError, KVProtocolError, KVTransferError
from kv_pipe.protocol import SHARED_DATA_START, SHARED_REGION_ALIGN
from kv_pipe.shared_memory import RegionAllocator
from tests import procs
from tests.tensors import random_tensor, same_bits


def config(rank: int, port: int, mode: str, **changes) -> KVTransferConfig:
    values = dict(kv_rank=rank, kv_port=port, kv_timeout=3.0, kv_connect_timeout=30.0, kv_shared_memory=mode,
                  kv_buffer_size=64 << 20)
    values.update(changes)
    return KVTransferConfig(**values)


def _segment_fds(pid: int) -> list[str]:
    """This process's open descriptors that are kvbridge segments."""
    links = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            continue
    return [link for link in links if "kvbridge-pipe" in link]


def _segment_mappings(pid: int) -> list[str]:
    """Paths under /proc/PID/map_files of this process's mappings of kvbridge segments."""
    paths = []
    for name in os.listdir(f"/proc/{pid}/map_files"):
        path = f"/proc/{pid}/map_files/{name}"
        try:
            if "kvbridge-pipe" in os.readlink(path):
                paths.append(path)
        except OSError:
            continue
    return paths


# ---------------------------------------------------------------- bodies run in the child processes


def body_path(rank: int, port: int, modes: tuple[str, str]) -> object:
    """Connect with this rank's mode; report the path, or the refusal."""
    try:
        pipe = TorchDistributedPipe(config(rank, port, modes[rank]))
    except KVTransferError as exc:
        return ("refused", str(exc))
    with pipe:
        generator = torch.Generator().manual_seed(rank)
        mine = random_tensor(generator, torch.float32, (1 << 19,))  # 2 MiB: a payload
        theirs = random_tensor(torch.Generator().manual_seed(1 - rank), torch.float32, (1 << 19,))
        try:
            pipe.send_tensor(mine)
            assert same_bits(pipe.recv_tensor(timeout=30), theirs)
            pipe.send_tensor(None)
            assert pipe.recv_tensor(timeout=30) is None
        except KVPeerLostError:
            return ("peer lost", "")
        return ("shared memory" if pipe.uses_shared_memory else "transport", "")


def body_watched(rank: int, port: int, events) -> None:
    """Rank 0 streams payloads to rank 1 until one of them is killed; both report their pid first."""
    pipe = TorchDistributedPipe(config(rank, port, "on", kv_timeout=2.0))
    events.put(("pid", rank, os.getpid()))
    generator = torch.Generator().manual_seed(5)
    outcome = "ended"
    try:
        while True:
            if rank == 0:
                pipe.send_tensor(random_tensor(generator, torch.uint8, (3 << 20,)), timeout=30)
            else:
                pipe.recv_tensor(timeout=30)
    except KVPeerLostError:
        outcome = "peer lost"
    events.put(("outcome", rank, outcome))


def body_lent(rank: int, port: int, mode: str) -> dict:
    """Rank 0 fills tensors the pipe lent it and sends them; rank 1 checks them and reports where they lie."""
    pipe = TorchDistributedPipe(config(rank, port, mode))
    report = {}
    with pipe:
        shape, dtype = (3, 1 << 18), torch.float32  # 3 MiB: a payload
        want = random_tensor(torch.Generator().manual_seed(9), dtype, shape)
        if rank == 0:
            lent = pipe.empty(shape, dtype)
            lent.copy_(want)
            report["offset"] = lent.data_ptr() - pipe._shared.own.address if pipe.uses_shared_memory else None
            pipe.send_tensor(lent)
            assert pipe.recv_tensor(timeout=30) is None  # the peer dropped its tensor (FREED went first)
            if pipe.uses_shared_memory:
                # Still held here: its region must not be lent again.
                again = pipe.empty(shape, dtype)
                report["held_region_reused"] = again.data_ptr() == lent.data_ptr()
                del lent, again
                third = pipe.empty(shape, dtype)  # now both are gone: the first region is free again
                report["freed_region_reused"] = third.data_ptr() - pipe._shared.own.address == report["offset"]
                unsent = pipe.empty((5 << 20,), torch.uint8)
                used = pipe._shared.used_bytes
                del unsent  # never sent: its region comes back at once
                report["unsent_released"] = pipe._shared.used_bytes == used - (5 << 20)
                del third
            pipe.send_tensor(None)
            return report
        got = pipe.recv_tensor(timeout=30)
        assert same_bits(got, want)
        report["offset"] = got.data_ptr() - pipe._shared.peer.address if pipe.uses_shared_memory else None
        del got
        pipe.send_tensor(None)
        assert pipe.recv_tensor(timeout=30) is None
        return report


# ---------------------------------------------------------------- tests


@pytest.mark.timeout(120)
def test_a_lent_tensor_is_sent_without_a_copy_and_its_region_comes_back_only_when_both_sides_dropped_it():
    port = procs.free_port()
    sender, receiver = procs.run_pair(body_lent, (0, port, "on"), (1, port, "on"), timeout=100)
    assert sender["offset"] == receiver["offset"] is not None, (sender, receiver)  # the peer's view is the lent region
    assert sender["held_region_reused"] is False and sender["freed_region_reused"] is True, sender
    assert sender["unsent_released"] is True, sender


@pytest.mark.timeout(120)
def test_empty_gives_sendable_memory_on_the_transport_path_too():
    port = procs.free_port()
    sender, receiver = procs.run_pair(body_lent, (0, port, "off"), (1, port, "off"), timeout=100)
    assert sender == {"offset": None} and receiver == {"offset": None}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("modes, expected", [
    (("auto", "auto"), ("shared memory", "shared memory")),
    (("on", "on"), ("shared memory", "shared memory")),
    (("off", "off"), ("transport", "transport")),
    (("auto", "off"), ("transport", "transport")),
])
def test_the_path_chosen_is_the_one_expected(modes, expected):
    port = procs.free_port()
    outcomes = procs.run_pair(body_path, (0, port, modes), (1, port, modes), timeout=100)
    assert tuple(path for path, _ in outcomes) == expected, outcomes


@pytest.mark.timeout(120)
def test_shared_memory_required_by_one_side_and_refused_by_the_other_fails_clearly():
    port = procs.free_port()
    outcomes = procs.run_pair(body_path, (0, port, ("on", "off")), (1, port, ("on", "off")), timeout=100)
    assert outcomes[0][0] == "refused" and "same-host path could not be set up" in outcomes[0][1], outcomes
    assert outcomes[1][0] in ("refused", "peer lost"), outcomes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [0, 1])
def test_no_segment_survives_and_nobody_else_can_open_one(victim: int):
    """While the pipe runs, no descriptor of either side refers to a segment (so nobody can open one
    through /proc/PID/fd) and a process of another user cannot open their mappings; after a SIGKILL
    of either side, /dev/shm holds nothing new and the survivor reports the lost peer."""
    shm_before = set(os.listdir("/dev/shm"))
    port = procs.free_port()
    results, events = procs.new_queue(), procs.new_queue()
    processes = [procs.start(body_watched, (rank, port, events), results, rank) for rank in (0, 1)]
    try:
        pids = {}
        while len(pids) < 2:
            kind, rank, pid = events.get(timeout=60)
            assert kind == "pid"
            pids[rank] = pid
        time.sleep(0.5)  # payloads flow through the segments
        for pid in pids.values():
            assert _segment_fds(pid) == [], "a segment's descriptor stayed open"
            mappings = _segment_mappings(pid)
            assert mappings, "no segment is mapped: the test would prove nothing"
            stranger = subprocess.run(
                [sys.executable, "-c", "import os, sys\nos.setgid(65534); os.setuid(65534)\n"
                 "for path in sys.argv[1:]:\n"
                 "    try:\n        os.open(path, os.O_RDONLY)\n        print('opened', path)\n"
                 "    except OSError as exc:\n        print('refused', exc.errno)\n", *mappings],
                capture_output=True, text=True, timeout=30)
            assert stranger.returncode == 0, stranger.stderr
            assert "opened" not in stranger.stdout and stranger.stdout.count("refused") == len(mappings)
        os.kill(pids[victim], signal.SIGKILL)
        deadline = time.monotonic() + 30
        survivor = None
        while survivor is None:
            assert time.monotonic() < deadline, "the survivor never reported"
            kind, rank, outcome = events.get(timeout=30)
            if kind == "outcome" and rank != victim:
                survivor = outcome
        assert survivor == "peer lost"
    finally:
        procs.reap(processes)
    # multiprocessing's own semaphores (sem.mp-*) come and go with the test's queues.
    left = {name for name in set(os.listdir("/dev/shm")) - shm_before if not name.startswith("sem.mp-")}
    assert not left, f"left in /dev/shm: {left}"


def test_region_allocator_reuses_merges_and_refuses_what_it_never_gave():
    end = SHARED_DATA_START + 10 * SHARED_REGION_ALIGN
    allocator = RegionAllocator(SHARED_DATA_START, end)
    first = allocator.allocate(1)
    second = allocator.allocate(3 * SHARED_REGION_ALIGN)
    third = allocator.allocate(SHARED_REGION_ALIGN + 1)
    assert (first, second, third) == (SHARED_DATA_START, SHARED_DATA_START + SHARED_REGION_ALIGN,
                                      SHARED_DATA_START + 4 * SHARED_REGION_ALIGN)
    assert allocator.allocate(5 * SHARED_REGION_ALIGN) is None  # 4 pages are left
    allocator.release(second)
    allocator.release(first)  # merged with the region after it: 4 pages in one piece
    assert allocator.allocate(4 * SHARED_REGION_ALIGN) == SHARED_DATA_START
    with pytest.raises(KVProtocolError, match="never gave"):
        allocator.release(second)  # a region inside another, never handed out as such
    with pytest.raises(KVProtocolError, match="never gave"):
        allocator.release(12345)
    allocator.release(third)
    allocator.release(SHARED_DATA_START)
    assert allocator.used_bytes == 0
    assert allocator.allocate(end - SHARED_DATA_START) == SHARED_DATA_START  # everything merged back
