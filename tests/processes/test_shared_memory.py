"""The same-host path: which path is chosen, what is left behind, who can open the segments or reach
the local socket, and the copies into shared memory.

The pipe's behaviour on this path (every dtype, None, order, backpressure, timeouts, peer loss) is
covered by tests/processes/test_pipe.py, which runs every test on both paths.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from harness import procs
from harness.tensors import random_tensor, same_bits
from kv_pipe import KVTransferConfig, TorchDistributedPipe, parallel_copy, shared_memory
from kv_pipe.errors import KVPeerLostError, KVProtocolError, KVTransferError
from kv_pipe.protocol import SHARED_DATA_START, SHARED_REGION_ALIGN
from kv_pipe.shared_memory import RegionAllocator


def config(rank: int, port: int, mode: str, **changes) -> KVTransferConfig:
    values = dict(
        kv_rank=rank,
        kv_port=port,
        kv_timeout=3.0,
        kv_connect_timeout=30.0,
        kv_shared_memory=mode,
        kv_buffer_size=64 << 20,
    )
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


def _kvbridge_socket_names() -> list[str]:
    """Names of kvbridge's local sockets (abstract Unix sockets, shown with a leading @)."""
    with open("/proc/net/unix") as table:
        return [line.split()[-1] for line in table if "@kvbridge-" in line]


def body_socket_names(rank: int, port: int) -> dict[str, str]:
    """What connecting to each kvbridge socket name gives once the same-host path is up."""
    import socket as sockets

    with TorchDistributedPipe(config(rank, port, "on")) as pipe:
        outcomes = {}
        for name in _kvbridge_socket_names():
            with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as sock:
                try:
                    sock.connect(b"\0" + name[1:].encode())
                    outcomes[name] = "connected"
                except OSError as exc:
                    outcomes[name] = type(exc).__name__
        pipe.send_tensor(torch.ones(3))
        assert pipe.recv_tensor(timeout=30).tolist() == [1.0, 1.0, 1.0]
        return outcomes


def _connect_and_prove(name: bytes, proof: bytes, results) -> None:
    """A child process that connects to the local socket ``name`` and sends ``proof``."""
    import socket as sockets

    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as sock:
        sock.connect(name)
        sock.sendall(proof)
        results.put(sock.recv(1))  # waits until the listener closes or answers


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
            report["offset"] = lent.data_ptr() - pipe._state.shared.own.address if pipe.uses_shared_memory else None
            pipe.send_tensor(lent)
            assert pipe.recv_tensor(timeout=30) is None  # the peer dropped its tensor (FREED went first)
            if pipe.uses_shared_memory:
                # Still held here: its region must not be lent again.
                again = pipe.empty(shape, dtype)
                report["held_region_reused"] = again.data_ptr() == lent.data_ptr()
                del lent, again
                third = pipe.empty(shape, dtype)  # now both are gone: the first region is free again
                report["freed_region_reused"] = third.data_ptr() - pipe._state.shared.own.address == report["offset"]
                unsent = pipe.empty((5 << 20,), torch.uint8)
                used = pipe._state.shared.used_bytes
                del unsent  # never sent: its region comes back at once
                report["unsent_released"] = pipe._state.shared.used_bytes == used - (5 << 20)
                del third
            pipe.send_tensor(None)
            return report
        got = pipe.recv_tensor(timeout=30)
        assert same_bits(got, want)
        report["offset"] = got.data_ptr() - pipe._state.shared.peer.address if pipe.uses_shared_memory else None
        del got
        pipe.send_tensor(None)
        assert pipe.recv_tensor(timeout=30) is None
        return report


def body_tensor_dies_while_the_pipe_is_busy(rank: int, port: int) -> bool:
    """A received tensor whose last reference goes while another thread holds the pipe's lock (in
    the pipe, that thread may be waiting for a lock this one holds): its finalizer must not wait,
    and the region still goes back to the peer."""
    import threading

    with TorchDistributedPipe(config(rank, port, "on")) as pipe:
        if rank == 0:
            pipe.send_tensor(torch.ones(1 << 18))  # 1 MiB: through shared memory
            assert pipe.recv_tensor(timeout=30) is None
            deadline = time.monotonic() + 30
            while pipe._state.shared.used_bytes:  # FREED arrives with the None or just after
                assert time.monotonic() < deadline, "the region never came back"
                time.sleep(0.01)
            return True
        received = pipe.recv_tensor(timeout=30)
        held, release = threading.Event(), threading.Event()

        def hold_the_lock() -> None:
            with pipe._state.lock:
                held.set()
                release.wait(30)

        holder = threading.Thread(target=hold_the_lock)
        holder.start()
        held.wait(30)
        del received  # its finalizer runs here, while the other thread holds the lock
        release.set()
        holder.join(30)
        pipe.send_tensor(None)
        return True


def body_long_payload_over_the_socket(rank: int, port: int) -> str:
    """A payload that streams over the local socket for longer than kv_timeout (no region free for
    it), steadily, is the peer's sign of life: the next frame is not mistaken for a peer gone silent.
    The sender thread streams it, not the caller."""
    from kv_pipe import channel

    mib = 1 << 20
    with TorchDistributedPipe(config(rank, port, "on", kv_timeout=2.0)) as pipe:
        if rank == 0:
            write = channel.SocketChannel._write

            def slow_write(self, data):  # 256 KiB every 20 ms: about 13 MB/s
                for start in range(0, len(data), 256 << 10):
                    write(self, data[start : start + (256 << 10)])
                    if len(data) > mib:
                        time.sleep(0.02)

            channel.SocketChannel._write = slow_write
            pipe.send_tensor(torch.ones(40 * mib, dtype=torch.uint8))  # a region; rank 1 keeps it
            assert pipe.recv_tensor(timeout=30) is None
            pipe.send_tensor(torch.full((30 * mib,), 7, dtype=torch.uint8))  # no room left: over the socket
            # ... by the sender thread: the caller waits for no wire (its timeout bounds only credit).
            assert pipe._sender.sent_messages < pipe._sender.queued_messages, "the caller streamed the payload itself"
            pipe.flush(timeout=60)
            time.sleep(1.0)
            pipe.send_tensor(torch.arange(5))
            assert pipe.recv_tensor(timeout=30) is None
            return "sent"
        first = pipe.recv_tensor(timeout=30)
        pipe.send_tensor(None)
        second = pipe.recv_tensor(timeout=60)
        assert bool((second == 7).all()) and bool((first == 1).all())
        assert torch.equal(pipe.recv_tensor(timeout=30), torch.arange(5))
        pipe.send_tensor(None)
        return "received"


def body_regions_come_back_without_traffic(rank: int, port: int) -> dict:
    """Regions whose tensors die come back with no message to carry them, long before a keepalive
    would (kv_timeout=60 s: one every 15 s): after one tensor dies alone, after several die while a
    return is already scheduled, and after a steady exchange both ways (where messages take them
    along and the sender thread looks less often)."""
    mib = 1 << 20
    waits = {}
    with TorchDistributedPipe(config(rank, port, "on", kv_timeout=60.0)) as pipe:

        def wait_until_all_back(phase: str) -> None:
            started = time.monotonic()
            while pipe._state.shared.used_bytes:
                assert time.monotonic() - started < 10, f"{phase}: regions still held after 10 s"
                time.sleep(0.002)
            waits[phase] = time.monotonic() - started

        if rank == 0:
            pipe.send_tensor(torch.ones(mib, dtype=torch.uint8))
            wait_until_all_back("one tensor dies alone")
            for value in range(4):
                pipe.send_tensor(torch.full((mib,), value, dtype=torch.uint8))
            wait_until_all_back("several die, one after another")
            for _ in range(300):
                pipe.send_tensor(torch.ones(mib, dtype=torch.uint8))
                assert pipe.recv_tensor(timeout=30).numel() == mib
            wait_until_all_back("after an exchange both ways")
            pipe.send_tensor(None)
            assert pipe.recv_tensor(timeout=30) is None
            return waits
        first = pipe.recv_tensor(timeout=30)
        del first
        several = [pipe.recv_tensor(timeout=30) for _ in range(4)]
        for index in range(4):  # the first rings the sender thread; the others die while it waits
            del several[0]
            time.sleep(0.0004 * index)
        for _ in range(300):
            received = pipe.recv_tensor(timeout=30)
            pipe.send_tensor(received)
        del received
        assert pipe.recv_tensor(timeout=30) is None
        pipe.send_tensor(None)
        return waits


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
@pytest.mark.parametrize(
    "modes, expected",
    [
        (("auto", "auto"), ("shared memory", "shared memory")),
        (("on", "on"), ("shared memory", "shared memory")),
        (("off", "off"), ("transport", "transport")),
        (("auto", "off"), ("transport", "transport")),
    ],
)
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
                [
                    sys.executable,
                    "-c",
                    "import os, sys\nos.setgid(65534); os.setuid(65534)\n"
                    "for path in sys.argv[1:]:\n"
                    "    try:\n        os.open(path, os.O_RDONLY)\n        print('opened', path)\n"
                    "    except OSError as exc:\n        print('refused', exc.errno)\n",
                    *mappings,
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
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
    assert (first, second, third) == (
        SHARED_DATA_START,
        SHARED_DATA_START + SHARED_REGION_ALIGN,
        SHARED_DATA_START + 4 * SHARED_REGION_ALIGN,
    )
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


@pytest.mark.timeout(60)
def test_nobody_can_connect_to_the_local_socket_once_the_pipe_is_up():
    """The listening name exists only while the two sides connect: afterwards the connected sockets
    still show it (/proc/net/unix), but nobody can connect to it."""
    port = procs.free_port()
    for outcomes in procs.run_pair(body_socket_names, (0, port), (1, port), timeout=50):
        assert outcomes, "no kvbridge socket seen: the test would prove nothing"
        assert set(outcomes.values()) == {"ConnectionRefusedError"}, outcomes


@pytest.mark.timeout(60)
def test_the_local_socket_turns_away_everyone_but_the_peer_process_with_the_nonce():
    """Only the announced peer process that read the nonce in this side's segment is accepted: this
    process, with the right nonce but the wrong pid, and the peer's pid with a wrong nonce are not."""
    import socket as sockets

    nonce = os.urandom(32)
    name = b"\0kvbridge-test-" + os.urandom(8).hex().encode()
    results, outcomes = procs.new_queue(), procs.new_queue()  # both kept alive for the children

    def listen():
        listener = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
        listener.bind(name)
        listener.listen(4)
        return listener

    # The peer process, but with a wrong nonce: turned away, and the deadline passes.
    listener = listen()
    liar = procs.start(_connect_and_prove, (name, os.urandom(32), results), outcomes, 0)
    try:
        shared_memory._SOCKET_SETUP_SECONDS, saved = 2.0, shared_memory._SOCKET_SETUP_SECONDS
        with pytest.raises(OSError):
            shared_memory._accept_peer(listener, liar.pid, nonce)
    finally:
        shared_memory._SOCKET_SETUP_SECONDS = saved
        listener.close()
        procs.reap([liar])
    # A stranger (this process) with the right nonce first, then the real peer: only the peer is taken.
    listener = listen()
    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as stranger:
        stranger.connect(name)
        stranger.sendall(nonce)
        friend = procs.start(_connect_and_prove, (name, nonce, results), outcomes, 0)
        try:
            accepted = shared_memory._accept_peer(listener, friend.pid, nonce)
            assert shared_memory._peer_pid(accepted) == friend.pid
            assert stranger.recv(1) == b""  # the stranger's connection was closed
            accepted.close()
        finally:
            listener.close()
            procs.reap([friend])


@pytest.mark.parametrize(
    "nbytes", [0, 1, 4097, parallel_copy.PARALLEL_MIN_BYTES - 1, parallel_copy.PARALLEL_MIN_BYTES, (16 << 20) + 12345]
)
def test_parallel_copy_is_bit_exact_at_every_size(nbytes: int):
    generator = torch.Generator().manual_seed(nbytes)
    source = torch.randint(0, 256, (nbytes + 16,), dtype=torch.uint8, generator=generator)
    target = torch.randint(0, 256, (nbytes + 16,), dtype=torch.uint8, generator=generator)
    guard = target[nbytes + 3 :].clone()
    parallel_copy.copy_bytes(target.data_ptr() + 3, source.data_ptr() + 5, nbytes)  # odd alignment
    assert torch.equal(target[3 : nbytes + 3], source[5 : nbytes + 5])
    assert torch.equal(target[nbytes + 3 :], guard)  # not one byte past the end


@pytest.mark.parametrize("sizes", [[4096] * 3, [256 << 10] * 40, [1, 3 << 20, 5, 300 << 10, 4097] * 6])
def test_many_copies_spread_over_threads_are_bit_exact(sizes: list[int]):
    """Copies of uneven sizes out of one buffer into another in reverse order: each lands whole, in
    its place, and nothing between them is touched."""
    generator = torch.Generator().manual_seed(len(sizes))
    gap = 7
    total = sum(sizes) + gap * (len(sizes) + 1)
    source = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=generator)
    target = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=generator)
    expected = target.clone()
    copies, start = [], gap
    for nbytes in sizes:
        place = total - start - nbytes  # mirrored: the copies do not line up with their sources
        copies.append((target.data_ptr() + place, source.data_ptr() + start, nbytes))
        expected[place : place + nbytes] = source[start : start + nbytes]
        start += nbytes + gap
    parallel_copy.copy_many(copies)
    assert torch.equal(target, expected)


@pytest.mark.timeout(60)
def test_parallel_copy_works_in_a_forked_child():
    """A child forked after the helpers started has none: it starts its own (no torch in the child:
    OpenMP does not survive a fork)."""
    import ctypes

    nbytes = 9 << 20
    parallel_copy.copy_bytes(
        ctypes.addressof(ctypes.create_string_buffer(nbytes)),
        ctypes.addressof(ctypes.create_string_buffer(nbytes)),
        nbytes,
    )
    pid = os.fork()
    if pid == 0:
        try:
            source = ctypes.create_string_buffer(os.urandom(nbytes), nbytes)
            target = ctypes.create_string_buffer(nbytes)
            parallel_copy.copy_bytes(ctypes.addressof(target), ctypes.addressof(source), nbytes)
            os._exit(0 if target.raw == source.raw else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child's copy did not finish")


@pytest.mark.timeout(90)
def test_a_received_tensor_may_die_while_another_thread_holds_the_pipe():
    port = procs.free_port()
    assert procs.run_pair(body_tensor_dies_while_the_pipe_is_busy, (0, port), (1, port), timeout=80) == (True, True)


@pytest.mark.timeout(120)
def test_a_long_payload_over_the_socket_keeps_the_peer_alive_and_its_caller_free():
    port = procs.free_port()
    assert procs.run_pair(body_long_payload_over_the_socket, (0, port), (1, port), timeout=110) == ("sent", "received")


@pytest.mark.timeout(120)
def test_regions_come_back_without_traffic_long_before_a_keepalive():
    port = procs.free_port()
    waits, _ = procs.run_pair(body_regions_come_back_without_traffic, (0, port), (1, port), timeout=110)
    assert len(waits) == 3, waits
