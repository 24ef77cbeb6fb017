"""The tensor pipe, exercised by two real processes over gloo."""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from harness import procs
from harness.pipe_forgery import connect_as_forger, drain_until_dropped, send_records
from harness.tensors import as_received, exchange_both_ways, random_tensor, same_bits
from kv_pipe import KVTransferConfig, TorchDistributedPipe
from kv_pipe.channel import TAG_FRAME
from kv_pipe.errors import (
    KVConfigError,
    KVPeerLostError,
    KVPipeClosedError,
    KVProtocolError,
    KVTimeoutError,
    KVTransferError,
)
from kv_pipe.protocol import DTYPE_TO_CODE, HEADER_BYTES, HOST_FRAME_BYTES, MAX_NDIM
from kv_pipe.wire import INLINE_VIEW_MIN_BYTES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OLD_VLLM_NONE_SENTINEL = -150886311
INLINE_CAPACITY = HOST_FRAME_BYTES - HEADER_BYTES  # tensors up to this size travel inside their frame


#: Set by the ``payload_path`` fixture; the pair's processes inherit it.
_PATH_VARIABLE = "PIPE_TEST_SHARED_MEMORY"
#: The payload path on which frames travel over gloo and payloads on groups of their own, posted
#: only behind their frames: NCCL's layout (:mod:`kv_pipe.channel`), run on gloo.
SPLIT = "split"


_PATH_IDS = {"on": "shared-memory", "off": "transport", SPLIT: SPLIT}


def also_split(test):
    """Run ``test`` on the split channel too (besides the shared-memory and transport paths)."""
    test.payload_paths = ("on", "off", SPLIT)
    return test


def split_only(test):
    """Run ``test`` on the split channel alone."""
    test.payload_paths = (SPLIT,)
    return test


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test runs on both payload paths, through shared memory and over the transport, unless
    marked :func:`also_split` or :func:`split_only`."""
    paths = getattr(metafunc.function, "payload_paths", ("on", "off"))
    metafunc.parametrize("payload_path", paths, ids=[_PATH_IDS[path] for path in paths], indirect=True)


@pytest.fixture(autouse=True)
def payload_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(_PATH_VARIABLE, request.param)
    return request.param


def config(rank: int, port: int, **changes) -> KVTransferConfig:
    path = os.environ.get(_PATH_VARIABLE, "auto")
    values = dict(
        kv_rank=rank,
        kv_role="kv_producer" if rank == 0 else "kv_consumer",
        kv_port=port,
        kv_timeout=5.0,
        kv_connect_timeout=30.0,
        kv_shared_memory="off" if path == SPLIT else path,
    )
    values.update(changes)
    return KVTransferConfig(**values)


def open_pipe(cfg: KVTransferConfig) -> TorchDistributedPipe:
    """The pipe of a test's process, on the payload path the test runs on."""
    return TorchDistributedPipe(cfg, split=os.environ.get(_PATH_VARIABLE) == SPLIT)


def dtype_cases() -> list[tuple[torch.dtype, tuple[int, ...]]]:
    # INLINE_CAPACITY // 8 + 1 elements: inside the frame (itemsize 1, 2, 4) or a payload after it (8, 16).
    shapes = [
        (),
        (0,),
        (1,),
        (7,),
        (3, 5),
        (2, 0, 3),
        (1, 1, 1, 1, 1, 1, 1, 1, 3),
        (INLINE_CAPACITY // 8 + 1,),
        (33, 17, 129),
    ]
    return [(dtype, shape) for dtype in DTYPE_TO_CODE for shape in shapes]


def tensor_stream(seed: int) -> list[torch.Tensor | None]:
    """Every dtype in odd shapes, None, the old vLLM None sentinel, and non-contiguous views."""
    generator = torch.Generator().manual_seed(seed)
    items: list[torch.Tensor | None] = [random_tensor(generator, d, s) for d, s in dtype_cases()]
    items += [None, torch.tensor(OLD_VLLM_NONE_SENTINEL), torch.full((4,), float(OLD_VLLM_NONE_SENTINEL)), None]
    base = random_tensor(generator, torch.float32, (20, 30))
    items += [base.t(), base[::3, 1::2], base[5], torch.randn(4, 4, dtype=torch.complex64, generator=generator).conj()]
    # Contiguous tensors whose memory is not their values as it stands (a negative view), or that
    # autograd tracks.
    items += [
        torch._neg_view(random_tensor(generator, torch.float32, (3, 5))),
        random_tensor(generator, torch.float32, (6,)).requires_grad_(),
    ]
    return items


# ---------------------------------------------------------------- bodies run in the child processes


def body_every_dtype(rank: int, port: int) -> int:
    """Both sides send the same stream at the same time and check what they receive."""
    expected = tensor_stream(seed=1234)
    with open_pipe(config(rank, port)) as pipe:
        unsendable = [
            [1, 2, 3],
            torch.randn(4, 4).to_sparse(),
            torch.zeros([1] * (MAX_NDIM + 1)),
            torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
        ]
        for item in unsendable:
            with pytest.raises(KVTransferError):
                pipe.send_tensor(item)
        for item in expected:
            pipe.send_tensor(item)
        for index, want in enumerate(expected):
            got = pipe.recv_tensor(timeout=30)
            want = as_received(want)
            assert same_bits(got, want), f"item {index}: sent {want!r}, received {got!r}"
    return len(expected)


def body_random_stress(rank: int, port: int, count: int) -> int:
    """Hundreds of random tensors both ways at once, from two threads per side, with Nones."""

    def stream(seed: int) -> list[torch.Tensor | None]:
        rng = random.Random(seed)
        generator = torch.Generator().manual_seed(seed)
        dtypes = list(DTYPE_TO_CODE)
        out: list[torch.Tensor | None] = []
        for _ in range(count):
            if rng.random() < 0.15:
                out.append(None)
                continue
            ndim = rng.randint(0, 4)
            dtype = rng.choice(dtypes)
            shape = tuple(rng.choice([0, 1, 2, 3, 17, 64, 301]) for _ in range(ndim))
            while torch.Size(shape).numel() * dtype.itemsize > 1 << 22:
                shape = shape[1:]
            if rng.random() < 0.05:
                shape = (rng.randint(1 << 18, 1 << 20),)  # up to 16 MiB (complex128)
            out.append(random_tensor(generator, dtype, shape))
        return out

    cfg = config(rank, port, kv_buffer_size=40 << 20)  # a few large items fill it: credit flow is exercised
    with open_pipe(cfg) as pipe:
        exchange_both_ways(pipe, stream(seed=rank), stream(seed=1 - rank), timeout=30)
    return count


def body_concurrent_senders(rank: int, port: int, threads: int, per_thread: int) -> int:
    with open_pipe(config(rank, port)) as pipe:
        if rank == 0:

            def send(thread_id: int) -> None:
                for seq in range(per_thread):
                    pipe.send_tensor(torch.tensor([thread_id, seq, thread_id * 1000 + seq]))

            workers = [threading.Thread(target=send, args=(t,)) for t in range(threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(60)
            pipe.flush(timeout=30)
            assert pipe.recv_tensor(timeout=30).item() == 1  # wait for the peer's verdict before closing
            return 0
        next_seq = [0] * threads
        for _ in range(threads * per_thread):
            thread_id, seq, check = pipe.recv_tensor(timeout=30).tolist()
            assert seq == next_seq[thread_id], "per-thread FIFO order broken"
            assert check == thread_id * 1000 + seq
            next_seq[thread_id] += 1
        pipe.send_tensor(torch.tensor(1))
        return sum(next_seq)


def body_large(rank: int, port: int, nbytes: int) -> str:
    generator = torch.Generator().manual_seed(99)
    tensor = torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, generator=generator)
    with open_pipe(config(rank, port, kv_buffer_size=nbytes + (1 << 20), kv_timeout=20)) as pipe:
        if rank == 0:
            pipe.send_tensor(tensor)
            pipe.flush(timeout=60)
            assert pipe.recv_tensor(timeout=60).item() == 1
            return "sent"
        got = pipe.recv_tensor(timeout=60)
        assert torch.equal(got, tensor)
        pipe.send_tensor(torch.tensor(1))
        return "received"


def body_frame_boundaries(rank: int, port: int) -> int:
    """Sizes around the inline area's edges, both ways at once. Every received tensor is kept until
    the end: none may be overwritten by the frames and payloads that follow it."""
    half = INLINE_CAPACITY // 2
    sizes = [
        1,
        half - 1,
        half,
        half + 1,
        INLINE_CAPACITY - 1,
        INLINE_CAPACITY,
        INLINE_CAPACITY + 1,
        2 * INLINE_CAPACITY,
    ] * 3
    streams = []
    for seed in (rank, 1 - rank):
        generator = torch.Generator().manual_seed(seed)
        streams.append(
            [random_tensor(generator, torch.uint8, (size,)) for size in sizes]
            + [random_tensor(generator, torch.float32, (INLINE_CAPACITY // 4,))]
        )
    mine, theirs = streams
    with open_pipe(config(rank, port, kv_buffer_size=64 << 20)) as pipe:
        sender = threading.Thread(target=lambda: [pipe.send_tensor(item, timeout=30) for item in mine])
        sender.start()
        kept = [pipe.recv_tensor(timeout=30) for _ in theirs]
        sender.join(60)
        pipe.flush(timeout=30)
        for index, (got, want) in enumerate(zip(kept, theirs, strict=True)):
            assert same_bits(got, want), f"item {index} ({want.nbytes} bytes) changed after it was received"
        large = [got for got in kept if got.nbytes >= half]
        assert len({got.untyped_storage().data_ptr() for got in large}) == len(large), "two tensors share memory"
        # Over the transport a payload has a buffer of its own, and an inline item from half the
        # frame on is a view of the frame it arrived in.
        held_bytes = sum(got.nbytes if got.nbytes > INLINE_CAPACITY else HOST_FRAME_BYTES for got in large)
        received = len(kept)
        del kept, large, got
        if os.environ[_PATH_VARIABLE] == "off":  # those buffers go back to the pool once the caller drops them
            assert pipe._state.wire._memory.idle_bytes >= held_bytes, "received buffers were not recycled"
        pipe.send_tensor(None)  # with shared memory, behind the regions the dropped tensors held
        assert pipe.recv_tensor(timeout=30) is None  # the peer has checked too before either side closes
        if pipe.uses_shared_memory:  # every region this side filled came back
            assert pipe._state.shared.used_bytes == 0, "shared-memory regions were not given back"
    return received


def batch_stream(seed: int) -> list[list[torch.Tensor | None]]:
    """Batches for send_tensors: every dtype and odd shape, Nones, 2,000 tiny tensors (more records
    than one frame holds), sizes around a record's inline room, and payloads behind small records."""
    generator = torch.Generator().manual_seed(seed)
    singles = tensor_stream(seed)
    tiny = [random_tensor(generator, torch.int16, (index % 7,)) for index in range(2000)]
    header = random_tensor(generator, torch.int64, (300,))
    half = INLINE_CAPACITY // 2
    sizes = [half - 1, half, INLINE_CAPACITY - 600, INLINE_CAPACITY - 512, INLINE_CAPACITY, INLINE_CAPACITY + 1]
    around = [random_tensor(generator, torch.uint8, (size,)) for size in sizes]
    return [
        singles[:40],
        [None],
        tiny,
        [],
        [header, *around],
        singles[40:],
        [header, None, around[-1], header],
        [random_tensor(generator, torch.float64, (3, 3))],
    ]


def body_batches(rank: int, port: int) -> int:
    """Both sides send batches (and single tensors between them) while receiving the peer's; every
    received item is kept to the end: none may be overwritten by later frames."""
    mine, theirs = batch_stream(seed=rank), batch_stream(seed=1 - rank)
    with open_pipe(config(rank, port, kv_buffer_size=64 << 20)) as pipe:

        def send_all() -> None:
            for batch in mine:
                pipe.send_tensors(batch, timeout=30)
                pipe.send_tensor(torch.tensor(len(batch)), timeout=30)

        sender = threading.Thread(target=send_all)
        sender.start()
        kept = []
        for batch in theirs:
            kept.append([pipe.recv_tensor(timeout=30) for _ in batch])
            assert pipe.recv_tensor(timeout=30).item() == len(batch), "a batch lost or gained items"
        sender.join(60)
        assert not sender.is_alive()
        pipe.flush(timeout=30)
        for number, (got_batch, want_batch) in enumerate(zip(kept, theirs, strict=True)):
            for index, (got, want) in enumerate(zip(got_batch, want_batch, strict=True)):
                want = as_received(want)
                assert same_bits(got, want), f"batch {number} item {index}: sent {want!r}, received {got!r}"
        pipe.send_tensor(None)
        assert pipe.recv_tensor(timeout=30) is None  # the peer has checked too before either side closes
    return sum(len(batch) for batch in kept)


def body_concurrent_batches(rank: int, port: int, threads: int, batches: int) -> int:
    """Batches from several threads arrive whole: no other thread's item comes between a batch's items;
    a batch larger than the budget is sent item by item and still arrives in order."""
    budget = 8 << 20
    with open_pipe(config(rank, port, kv_buffer_size=budget)) as pipe:
        if rank == 0:

            def send(thread_id: int) -> None:
                generator = torch.Generator().manual_seed(thread_id)
                for number in range(batches):
                    size = [1, 5, 3000, 200_000][number % 4]
                    pipe.send_tensors(
                        [
                            torch.tensor([thread_id, number, index, size])
                            if index % 2 == 0
                            else random_tensor(generator, torch.uint8, (size,))
                            for index in range(6)
                        ]
                    )

            workers = [threading.Thread(target=send, args=(t,)) for t in range(threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(60)
            oversized = [torch.full((3 << 20,), index, dtype=torch.uint8) for index in range(4)]
            pipe.send_tensors(oversized, timeout=30)
            pipe.flush(timeout=30)
            assert pipe.recv_tensor(timeout=30).item() == 1  # wait for the peer's verdict before closing
            return 0
        next_number = [0] * threads
        for _ in range(threads * batches):
            thread_id, number, index, size = pipe.recv_tensor(timeout=30).tolist()
            assert (number, index) == (next_number[thread_id], 0), "batch order broken"
            for index in range(1, 6):
                item = pipe.recv_tensor(timeout=30)
                if index % 2 == 0:
                    assert item.tolist() == [thread_id, number, index, size], "another item came between"
                else:
                    assert item.numel() == size
            next_number[thread_id] += 1
        for index in range(4):
            item = pipe.recv_tensor(timeout=30)
            assert item.numel() == 3 << 20 and item[0] == index and item[-1] == index
        pipe.send_tensor(torch.tensor(1))
        return sum(next_number)


def body_timeouts_and_idle(rank: int, port: int) -> str:
    """recv timeouts leave the pipe usable; an idle pipe outlives kv_timeout many times over."""
    kv_timeout = 1.0
    with open_pipe(config(rank, port, kv_timeout=kv_timeout)) as pipe:
        if rank == 1:
            start = time.monotonic()
            with pytest.raises(KVTimeoutError):
                pipe.recv_tensor(timeout=0.3)
            assert 0.25 < time.monotonic() - start < 5
            pipe.send_tensor(torch.tensor(7))  # tell rank 0 the timeout happened
            assert pipe.recv_tensor(timeout=30).item() == 8  # arrives after > 4 x kv_timeout of idling
            pipe.send_tensor(torch.tensor(9))
            return "ok"
        assert pipe.recv_tensor(timeout=30).item() == 7
        time.sleep(4 * kv_timeout + 0.5)
        pipe.send_tensor(torch.tensor(8))
        assert pipe.recv_tensor(timeout=30).item() == 9
        return "ok"


def body_short_timeouts_beside_a_long_kv_timeout(rank: int, port: int) -> str:
    """A caller's timeout holds however seldom frames come: with kv_timeout=20 a live, idle peer
    sends a keepalive every 5 s, and a receive on the groups cannot end before a frame does. Each
    round, a caller without a timeout takes an item (receiving itself there), and at once a caller
    with 0.5 s finds nothing: it must leave the waiting to the receiver thread and return on time.
    Then long and short waits alternate with the peer's items."""
    with open_pipe(config(rank, port, kv_timeout=20.0)) as pipe:
        if rank == 1:
            for attempt in range(3):
                assert pipe.recv_tensor().item() == attempt
                start = time.monotonic()
                with pytest.raises(KVTimeoutError):
                    pipe.recv_tensor(timeout=0.5)
                took = time.monotonic() - start
                assert took < 2.5, f"attempt {attempt}: a 0.5 s timeout took {took:.1f} s"
                pipe.send_tensor(torch.tensor(attempt))
            for index in range(20):
                item = pipe.recv_tensor(timeout=None if index % 2 else 0.5 + 0.1 * index)
                assert item.item() == index
            pipe.send_tensor(None)
            return "ok"
        for attempt in range(3):
            pipe.send_tensor(torch.tensor(attempt))
            assert pipe.recv_tensor(timeout=60).item() == attempt
        for index in range(20):
            time.sleep(0.1 if index % 3 == 0 else 0.0)
            pipe.send_tensor(torch.tensor(index))
        assert pipe.recv_tensor(timeout=60) is None
        return "ok"


def body_mismatched_timeouts(rank: int, port: int) -> str:
    """Sides with different kv_timeout: the idle pipe outlives the shorter one several times over
    (keepalives follow the shorter timeout; following one's own would let the peer's receive fail)."""
    with open_pipe(config(rank, port, kv_timeout=12.0 if rank == 0 else 1.0)) as pipe:
        time.sleep(4.5)
        pipe.send_tensor(torch.tensor(rank))
        assert pipe.recv_tensor(timeout=30).item() == 1 - rank
        pipe.send_tensor(None)
        assert pipe.recv_tensor(timeout=30) is None  # both sides are done before either closes
    return "ok"


def body_run_ahead(rank: int, port: int, count: int) -> str:
    """While the receiving user is away, the pipe keeps taking frames in: the sender hands all of
    them to the wire long before the user is back, even right after that user received itself."""
    generator = torch.Generator().manual_seed(11)
    items = [random_tensor(generator, torch.int32, (17 + index,)) for index in range(count)]
    with open_pipe(config(rank, port, kv_timeout=4.0)) as pipe:
        if rank == 0:
            time.sleep(0.5)  # the peer's user waits in recv_tensor: the peer's receiver thread hands it the role
            pipe.send_tensor(torch.tensor(-2))
            time.sleep(0.2)  # meanwhile that user receives on the transport itself
            pipe.send_tensor(torch.tensor(-1))
            assert pipe.recv_tensor(timeout=30).item() == -1  # the peer received in its own thread
            start = time.monotonic()
            for item in items:
                pipe.send_tensor(item, timeout=30)
            pipe.flush(timeout=3.0)  # the peer's user sleeps 6 s: its pipe, not its user, took these
            assert time.monotonic() - start < 4.0, "the sends waited for the peer's user"
            pipe.send_tensor(None)
            assert pipe.recv_tensor(timeout=30) is None
            return "sent"
        assert pipe.recv_tensor().item() == -2
        assert pipe.recv_tensor().item() == -1
        pipe.send_tensor(torch.tensor(-1))
        time.sleep(6.0)
        for index, item in enumerate(items):
            assert same_bits(pipe.recv_tensor(timeout=30), item), f"item {index}"
        assert pipe.recv_tensor(timeout=30) is None
        pipe.send_tensor(None)
        return "received"


def body_mixed_receivers(rank: int, port: int, count: int) -> str:
    """A caller waiting without a timeout beside callers with short timeouts: the short ones still
    time out on time, every item reaches exactly one caller, and closing the pipe ends the long wait
    with KVPipeClosedError."""
    kv_timeout = 2.0
    generator = torch.Generator().manual_seed(7)
    items = [random_tensor(generator, torch.float32, (1 + index % 5, 300 + index)) for index in range(count)]
    with open_pipe(config(rank, port, kv_timeout=kv_timeout)) as pipe:
        if rank == 0:
            for index, item in enumerate(items):
                pipe.send_tensor(item)
                time.sleep(0.05 if index % 10 == 0 else 0.0)  # gaps: both kinds of caller get their turn
            pipe.flush(timeout=30)
            assert pipe.recv_tensor(timeout=60).item() == count  # the peer's count before closing
            return "sent"
        got: list[torch.Tensor] = []
        overruns: list[float] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def long_waiter() -> None:
            try:
                while True:
                    tensor = pipe.recv_tensor()
                    with lock:
                        got.append(tensor)
            except KVPipeClosedError:
                pass
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        def short_waiter() -> None:
            while True:
                with lock:
                    if len(got) >= count:
                        return
                start = time.monotonic()
                try:
                    tensor = pipe.recv_tensor(timeout=0.2)
                except KVTimeoutError:
                    overruns.append(time.monotonic() - start - 0.2)
                    continue
                with lock:
                    got.append(tensor)

        threads = [threading.Thread(target=long_waiter)] + [threading.Thread(target=short_waiter) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads[1:]:
            thread.join(60)
        pipe.send_tensor(torch.tensor(len(got)))
        pipe.flush(timeout=30)
        assert not errors, errors
        assert len(got) == count
        remaining = {tuple(item.shape): item for item in items}
        for tensor in got:
            assert same_bits(tensor, remaining.pop(tuple(tensor.shape)))
        assert overruns and max(overruns) < 1.0, overruns  # a short timeout is never held up by the long waiter
    # close() (ours, answered by the peer) ended the long waiter's blocking recv.
    threads[0].join(3 * kv_timeout)
    assert not threads[0].is_alive() and not errors, errors
    return "received"


def body_simultaneous_sends(rank: int, port: int) -> int:
    """Both sides send at once with nobody receiving for a while: the background receivers must take
    the frames, or both senders would wait for each other."""
    generator = torch.Generator().manual_seed(rank)
    mine = [random_tensor(generator, torch.uint8, (size,)) for size in (9000, 1 << 20, 3 << 20, 100_000) * 5]
    generator = torch.Generator().manual_seed(1 - rank)
    theirs = [random_tensor(generator, torch.uint8, (size,)) for size in (9000, 1 << 20, 3 << 20, 100_000) * 5]
    with open_pipe(config(rank, port, kv_buffer_size=64 << 20)) as pipe:
        for item in mine:
            pipe.send_tensor(item, timeout=30)
        pipe.flush(timeout=30)
        for index, want in enumerate(theirs):
            assert same_bits(pipe.recv_tensor(timeout=30), want), f"item {index} differs"
    return len(theirs)


def body_backpressure(rank: int, port: int) -> int:
    """A slow reader bounds the writer: send_tensor blocks, times out cleanly, and nothing is lost."""
    budget = 1 << 20
    with open_pipe(config(rank, port, kv_buffer_size=budget)) as pipe:
        item = torch.arange(64 << 10, dtype=torch.int32)  # 256 KiB: four fit in the budget
        if rank == 0:
            with pytest.raises(KVTransferError, match="max_tensor_bytes"):
                pipe.send_tensor(torch.empty(budget, dtype=torch.uint8))  # alone larger than the budget
            for _ in range(3):
                pipe.send_tensor(item)
            with pytest.raises(KVTimeoutError):  # the reader takes nothing yet
                pipe.send_tensor(item, timeout=0.5)
                pipe.send_tensor(item, timeout=0.5)
            pipe.send_tensor(torch.tensor(-1))  # "go": small enough to fit
            sent = 0
            for _ in range(40):
                pipe.send_tensor(item + sent, timeout=30)
                sent += 1
            pipe.flush(timeout=30)
            assert pipe.recv_tensor(timeout=30).item() == sent
            return sent
        time.sleep(1.5)
        received = []
        while True:
            got = pipe.recv_tensor(timeout=30)
            if got.numel() == 1:
                break
            received.append(got)
        assert len(received) in (3, 4)  # the timed-out send may or may not have been queued
        for offset in range(40):
            assert torch.equal(pipe.recv_tensor(timeout=30), item + offset)
        pipe.send_tensor(torch.tensor(40))
        return 40


def body_credit_in_turn(rank: int, port: int) -> dict:
    """Rank 0 keeps the budget full with a stream of small tensors from one thread, then sends a
    large one from another; rank 1 takes one item a millisecond. The large one must get its credit
    in turn, before the small ones sent after it began to wait, not once the stream has ended."""
    small, count, started_after = 16 << 10, 400, 100  # 64 KiB int32 tensors; the budget holds 64
    large = random_tensor(torch.Generator().manual_seed(5), torch.float32, (3 << 18,))  # 3 MiB
    with open_pipe(config(rank, port, kv_buffer_size=4 << 20, kv_timeout=20)) as pipe:
        if rank == 0:
            sent = 0
            streaming = threading.Event()

            def stream() -> None:
                nonlocal sent
                for index in range(count):
                    pipe.send_tensor(torch.full((small,), index, dtype=torch.int32), timeout=30)
                    sent = index + 1
                    if sent == started_after:
                        streaming.set()

            thread = threading.Thread(target=stream)
            thread.start()
            assert streaming.wait(30)
            before = sent
            pipe.send_tensor(large, timeout=30)
            thread.join(60)
            assert not thread.is_alive()
            pipe.send_tensor(None)
            pipe.flush(timeout=30)
            return {"small ones sent before the large one": before}
        order = []
        while (item := pipe.recv_tensor(timeout=30)) is not None:
            if item.numel() == small:
                assert bool((item == item[0]).all())
                order.append(int(item[0]))
            else:
                assert same_bits(item, large)
                order.append("large")
            time.sleep(0.001)
        position = order.index("large")
        assert order[:position] + order[position + 1 :] == list(range(count)), "small ones lost or reordered"
        return {"small ones received before the large one": position}


def body_sent_from_where_it_lies(rank: int, port: int) -> dict:
    """Rank 0 sends tensors it filled in pipe memory, each twice (a buffer sent again), and one
    whose caller owns the bytes in front of it; rank 1 checks each and sends the large inline ones
    back as it received them. Each side reports which tensors went as a frame posted from the
    tensor's own memory (its header in front of it), and rank 0 that nothing it holds changed."""
    generator = torch.Generator().manual_seed(31)
    cases = [
        (torch.float32, (INLINE_CAPACITY // 4,)),  # fills a frame's inline area
        (torch.bfloat16, (3, 100_003)),  # inline, from the size a received one is a view
        (torch.uint8, (INLINE_VIEW_MIN_BYTES - 1,)),  # inline, below that size
        (torch.float64, (INLINE_CAPACITY // 8 + 1,)),
    ]  # a payload after its frame
    wants = [random_tensor(generator, dtype, shape) for dtype, shape in cases]
    echoed = 2
    posted_frames = set()
    with open_pipe(config(rank, port, kv_buffer_size=32 << 20)) as pipe:
        post = pipe._state.channel.post

        def recording_post(tensor: torch.Tensor, tag: int):
            if tag == TAG_FRAME:
                posted_frames.add(tensor.data_ptr())
            return post(tensor, tag)

        pipe._state.channel.post = recording_post
        if rank == 0:
            filled = [pipe.empty(want.shape, want.dtype).copy_(want) for want in wants]
            for tensor in filled:
                pipe.send_tensor(tensor)
                pipe.send_tensor(tensor)
            whole = random_tensor(generator, torch.float32, (128 + INLINE_CAPACITY // 8,))
            front = whole[:128].clone()
            pipe.send_tensor(whole[128:])  # its caller's bytes lie right in front of it
            pipe.flush(timeout=30)
            for want in wants[:echoed]:
                assert same_bits(pipe.recv_tensor(timeout=30), want)
            assert same_bits(whole[:128], front), "the pipe wrote into its caller's memory"
            for tensor, want in zip(filled, wants, strict=True):
                assert same_bits(tensor, want), "a sent tensor changed"
            return {"in place": [tensor.data_ptr() - HEADER_BYTES in posted_frames for tensor in filled]}
        received = []
        for want in wants:
            for _ in range(2):
                received.append(pipe.recv_tensor(timeout=30))
                assert same_bits(received[-1], want)
        assert pipe.recv_tensor(timeout=30).numel() == INLINE_CAPACITY // 8
        echoes = received[: 2 * echoed : 2]
        for tensor in echoes:
            pipe.send_tensor(tensor)
        pipe.flush(timeout=30)
        return {"echoes in place": [tensor.data_ptr() - HEADER_BYTES in posted_frames for tensor in echoes]}


def body_close_orderly(rank: int, port: int) -> str:
    pipe = open_pipe(config(rank, port))
    if rank == 0:
        for value in range(5):
            pipe.send_tensor(torch.tensor(value))
        pipe.close()
        with pytest.raises(KVPipeClosedError):
            pipe.send_tensor(torch.tensor(0))
        return "closed"
    assert [pipe.recv_tensor(timeout=30).item() for _ in range(5)] == list(range(5))
    with pytest.raises(KVPipeClosedError, match="peer closed"):
        pipe.recv_tensor(timeout=30)
    with pytest.raises(KVPipeClosedError):
        pipe.send_tensor(torch.tensor(0))
    pipe.close()
    return "saw close"


def body_victim(rank: int, port: int, results) -> None:
    """Rank 0 gets killed by the test; rank 1 reports how its calls failed and how fast."""
    pipe = open_pipe(config(rank, port, kv_timeout=2.0))
    if rank == 0:
        results.put(("ready", os.getpid()))
        while True:  # keep a large transfer going until killed
            pipe.send_tensor(torch.randn(4 << 20))
    outcome = {}
    start = time.monotonic()
    try:
        while True:
            pipe.recv_tensor(timeout=60)
    except KVTransferError as exc:
        outcome["recv_error"] = (type(exc).__name__, str(exc), time.monotonic() - start)
    try:
        pipe.send_tensor(torch.ones(3))
        pipe.flush(timeout=30)
    except KVTransferError as exc:
        outcome["send_error"] = type(exc).__name__
    pipe.close()
    results.put(("outcome", outcome))


def body_with_default_group(rank: int, port: int) -> str:
    """The pipe beside an initialised default group, both carrying traffic at once."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port + 2}", rank=rank, world_size=2)
    try:
        with open_pipe(config(rank, port)) as pipe:
            for step in range(20):
                pipe.send_tensor(torch.full((1000,), float(rank * 100 + step)))
                total = torch.tensor([float(rank + 1)])
                dist.all_reduce(total)
                assert total.item() == 3.0
                got = pipe.recv_tensor(timeout=30)
                assert torch.equal(got, torch.full((1000,), float((1 - rank) * 100 + step)))
            assert dist.get_world_size() == 2  # the default group is untouched
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return "ok"


def body_version_mismatch(rank: int, port: int) -> str:
    import kv_pipe.protocol

    if rank == 1:
        kv_pipe.protocol.PROTOCOL_VERSION = 999  # pretend to be a future kvbridge
    with pytest.raises(KVProtocolError, match="version"):
        open_pipe(config(rank, port))
    return "refused"


def body_auth(rank: int, port: int, secrets: tuple) -> str:
    """Both sides either connect and talk, or both refuse with an authentication error."""
    cfg = config(rank, port, kv_secret=secrets[rank])
    if secrets[0] != secrets[1]:
        with pytest.raises(KVProtocolError, match="authentication failed"):
            open_pipe(cfg)
        return "refused"
    with open_pipe(cfg) as pipe:
        pipe.send_tensor(torch.tensor([rank]))
        assert pipe.recv_tensor(timeout=30).item() == 1 - rank
    return "served"


class _SlowReadingStore:
    """A rendezvous store whose reads lag: this side reads the peer's answers late."""

    def __init__(self, store) -> None:
        self._store = store

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        time.sleep(0.5)
        return self._store.get(key)


def body_auth_slow_peer(rank: int, port: int) -> str:
    """Rank 0 hosts the rendezvous store and may refuse first; a rank 1 that reads its answer late
    must still get the authentication error, not a lost connection."""
    if rank == 1:
        from kv_pipe import rendezvous

        authenticate = rendezvous.authenticate_store
        rendezvous.authenticate_store = lambda store, *args: authenticate(_SlowReadingStore(store), *args)
    with pytest.raises(KVProtocolError, match="authentication failed"):
        open_pipe(config(rank, port, kv_secret=None if rank == 0 else "s3cret"))
    return "refused"


def body_hostile_header(rank: int, port: int) -> str:
    """Rank 1 hand-crafts a frame announcing a 1 TiB tensor; rank 0 must refuse it, not allocate."""
    from kv_pipe import protocol

    if rank == 1:
        connection = connect_as_forger(config(rank, port))
        send_records(
            connection,
            {
                0: protocol.encode_header(
                    protocol.FrameHeader(
                        kind=protocol.FrameKind.TENSOR,
                        seq=0,
                        consumed=0,
                        want_credit=False,
                        dtype=torch.uint8,
                        shape=(1 << 40,),
                        nbytes=1 << 40,
                    )
                )
            },
        )
        drain_until_dropped(connection)
        return "sent"
    pipe = open_pipe(config(rank, port))
    with pytest.raises(KVProtocolError, match="refused before allocating"):
        pipe.recv_tensor(timeout=30)
    return "refused"


class _RecordingGroup:
    """A process group that records which operations this side runs on it."""

    def __init__(self, group, log: list[str], name: str) -> None:
        self._group, self._log, self._name = group, log, name

    def send(self, tensors, dst, tag):
        self._log.append(f"{self._name}:send")
        return self._group.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        self._log.append(f"{self._name}:recv")
        return self._group.recv(tensors, src, tag)

    def rank(self) -> int:
        return self._group.rank()


def body_one_group_per_direction(rank: int, port: int) -> list[str]:
    """Traffic both ways, large and small: the operations each group of this side carried."""
    from kv_pipe import rendezvous

    log: list[str] = []
    connect = rendezvous.connect

    def recording_connect(*args, **kwargs):
        connection = connect(*args, **kwargs)
        assert connection.outgoing is not connection.incoming
        connection.outgoing = _RecordingGroup(connection.outgoing, log, "outgoing")
        connection.incoming = _RecordingGroup(connection.incoming, log, "incoming")
        return connection

    rendezvous.connect = recording_connect
    generator = torch.Generator().manual_seed(rank)
    with open_pipe(config(rank, port, kv_timeout=1.0, kv_buffer_size=8 << 20)) as pipe:
        setup = sorted(set(log))
        log.clear()
        for size in (3, 5000, INLINE_CAPACITY + 1, 3 << 20):
            pipe.send_tensors([random_tensor(generator, torch.uint8, (size,)), None])
            assert pipe.recv_tensor(timeout=30).numel() == size
            assert pipe.recv_tensor(timeout=30) is None
        time.sleep(0.6)  # keepalives too
        return setup, sorted(set(log)), pipe.uses_shared_memory


class _CompletionRecordingGroup(_RecordingGroup):
    """A group that also records when each receive posted on it completed, and can be aborted."""

    def recv(self, tensors, src, tag):
        work = super().recv(tensors, src, tag)
        log = self._log
        name = self._name

        class _Work:
            def wait(self, *args, **kwargs):
                done = work.wait(*args, **kwargs)
                log.append(f"{name}:arrived")
                return done

        return _Work()

    def abort(self) -> None:
        self._group.abort()


def body_payload_receives_only_behind_frames(rank: int, port: int) -> dict[str, object]:
    """Split: each payload receive is posted only after a frame arrived (announcing it), and an idle
    pipe posts none. The receive side's record: frame and payload receives, posted and arrived."""
    from kv_pipe import rendezvous

    log: list[str] = []
    connect = rendezvous.connect

    def recording_connect(*args, **kwargs):
        connection = connect(*args, **kwargs)
        assert connection.payloads is not None, "a split pipe has payload groups"
        connection.incoming = _CompletionRecordingGroup(connection.incoming, log, "frames")
        connection.payloads = (
            connection.payloads[0],
            _CompletionRecordingGroup(connection.payloads[1], log, "payloads"),
        )
        return connection

    rendezvous.connect = recording_connect
    generator = torch.Generator().manual_seed(rank)
    sizes = (3, 5000, 3 << 20)  # elements: up to 12 MiB
    # The log is kept from the connection on: the peer's first payload may arrive before open_pipe returns here.
    with open_pipe(config(rank, port, kv_timeout=1.0, kv_buffer_size=32 << 20)) as pipe:
        for size in sizes:
            sent = random_tensor(generator, torch.float32, (size,))
            pipe.send_tensors([sent, None])
            got = pipe.recv_tensor(timeout=30)
            assert got.shape == (size,)
            assert pipe.recv_tensor(timeout=30) is None
        pipe.flush(timeout=30)
        time.sleep(0.5)  # the peer's last items are in
        busy = list(log)
        log.clear()
        time.sleep(1.5)  # idle: keepalives only, several kv_timeout/4 apart
        idle = list(log)
    misplaced = [
        index
        for index, entry in enumerate(busy)
        if entry == "payloads:recv" and (index == 0 or busy[index - 1] not in ("frames:arrived", "payloads:arrived"))
    ]
    return {
        "payload receives": busy.count("payloads:recv"),
        "misplaced": misplaced,
        "idle payload operations": [entry for entry in idle if entry.startswith("payloads")],
        "idle frames arrived": idle.count("frames:arrived") > 0,
    }


def body_bug_in_a_transfer_thread(rank: int, port: int) -> str:
    """A bug in the receiver thread reaches the caller as itself, not as a lost peer, and fails the pipe."""
    pipe = open_pipe(config(rank, port))
    if rank == 1:

        def broken_read_inline(start, header):
            raise TypeError("a bug in the pipe")

        pipe._state.wire.read_inline = broken_read_inline
        with pytest.raises(TypeError, match="a bug in the pipe"):
            # The bug is in place: rank 0 may send. Its answer can come, and the receiver thread
            # fail the pipe, before this send returns, which then reports it.
            pipe.send_tensor(None)
            pipe.recv_tensor(timeout=30)
        with pytest.raises(TypeError):  # the pipe is failed: every later call says so
            pipe.send_tensor(torch.ones(2))
        pipe.send_tensor  # noqa: B018 - the pipe object stays usable for close()
        try:
            pipe.close()
        except TypeError:
            pass
        return "surfaced"
    assert pipe.recv_tensor(timeout=30) is None
    pipe.send_tensor(torch.ones(3))
    pipe.flush(timeout=30)
    with pytest.raises(KVTransferError):  # the failed side stops answering: the peer sees it go
        pipe.recv_tensor(timeout=30)
    _close_quietly(pipe)
    return "peer saw it"


def body_bug_while_sending(rank: int, port: int, where: str) -> str:
    """A bug while a frame's headers are made (by a caller sending itself, or by the sender thread)
    fails the pipe: it reaches that caller, a caller waiting to receive and close() as itself, and
    nothing is left holding the pipe."""
    pipe = open_pipe(config(rank, port))
    if rank == 1:
        assert pipe.recv_tensor(timeout=30) is None
        with pytest.raises(KVTransferError):  # the failed side stops answering: the peer sees it go
            pipe.recv_tensor(timeout=30)
        _close_quietly(pipe)
        return "peer saw it"

    def broken_frame_headers(unit, freed=0):
        raise TypeError("a bug in the pipe")

    pipe.send_tensor(None)
    pipe.flush(timeout=30)
    waiting: list[BaseException] = []

    def receive() -> None:
        try:
            pipe.recv_tensor(timeout=30)
        except BaseException as exc:  # noqa: BLE001 - what the waiting caller sees is the point
            waiting.append(exc)

    receiver = threading.Thread(target=receive)
    receiver.start()
    time.sleep(0.2)  # the receiving caller waits
    pipe._sender._frame_headers = broken_frame_headers
    if where == "sender thread":
        pipe._state.turns.may_send_here = lambda tensors, deadline: False  # the unit goes through the queue
        pipe.send_tensor(torch.ones(2))
        with pytest.raises(TypeError, match="a bug in the pipe"):
            pipe.flush(timeout=30)
    else:
        with pytest.raises(TypeError, match="a bug in the pipe"):
            pipe.send_tensor(torch.ones(2))
    receiver.join(40)
    assert len(waiting) == 1 and isinstance(waiting[0], TypeError), waiting
    with pytest.raises(TypeError):
        pipe.send_tensor(torch.ones(2))
    assert pipe._sender.role.acquire(timeout=5), "the send role was left taken"
    pipe._sender.role.release()
    return "surfaced"


def body_peer_closes_while_a_send_waits_for_credit(rank: int, port: int) -> str:
    """A sender waiting for credit learns at once that the peer closed: none will come."""
    pipe = open_pipe(config(rank, port, kv_buffer_size=1 << 20, kv_timeout=30.0))
    item = torch.ones(300_000, dtype=torch.uint8)  # three fill the budget
    if rank == 1:
        assert pipe.recv_tensor(timeout=30) is None
        time.sleep(1.0)  # rank 0 runs out of credit meanwhile; nothing is taken here
        pipe.close()
        return "closed"
    pipe.send_tensor(None)
    for _ in range(3):
        pipe.send_tensor(item, timeout=30)
    with pytest.raises(KVPipeClosedError):  # not a timeout, and not a hang without one
        pipe.send_tensor(item)
    _close_quietly(pipe)
    return "told"


def _close_quietly(pipe: TorchDistributedPipe) -> None:
    try:
        pipe.close()
    except KVTransferError:
        pass  # the failure was reported already


def body_tampered_rendezvous(rank: int, port: int, secret: str | None) -> tuple[str, str]:
    """Each rank tries to connect while a stranger tampers with the store; returns how it ended."""
    from kv_pipe import rendezvous

    if rank == 1:  # let the stranger win the race to the groups' store keys
        create_groups = rendezvous._create_groups

        def late_create_groups(*args):
            time.sleep(1.5)
            return create_groups(*args)

        rendezvous._create_groups = late_create_groups
    try:
        with open_pipe(config(rank, port, kv_secret=secret, kv_timeout=3.0, kv_connect_timeout=20.0)):
            return ("connected", "")
    except KVTransferError as exc:
        return (type(exc).__name__, str(exc))


def stranger_tampering(port: int, how: str) -> str:
    """A process without the secret that reaches the rendezvous store and tampers with it."""
    import datetime

    import torch.distributed as dist

    from kv_pipe.config import local_address_towards

    deadline = time.monotonic() + 30
    while True:
        try:
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                world_size=None,
                is_master=False,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=20),
            )
            break
        except (RuntimeError, OSError):
            assert time.monotonic() < deadline, "the rendezvous never listened"
            time.sleep(0.05)
    if how == "arrivals":
        store.add("kvbridge/arrivals", 1)
        return "bumped"
    # Hijack the groups: take rank 1's place in them before rank 1 gets there.
    store.wait(["kvbridge/hello/0"])
    groups = []
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=10)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards("127.0.0.1"))]
    for prefix in ("kvbridge/group/0to1", "kvbridge/group/1to0"):
        try:
            groups.append(dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 1, 2, options))
        except RuntimeError as exc:
            return f"hijack failed: {exc}"
    time.sleep(5)  # hold the connections while rank 0 decides
    return "hijacked"


# ---------------------------------------------------------------- tests


@also_split
@pytest.mark.timeout(120)
def test_every_dtype_and_odd_shapes_bit_exact_both_directions():
    port = procs.free_port()
    counts = procs.run_pair(body_every_dtype, (0, port), (1, port), timeout=100)
    assert counts[0] == counts[1] == len(tensor_stream(1234)) > len(DTYPE_TO_CODE) * 9


@also_split
@pytest.mark.timeout(180)
def test_random_stress_both_directions_with_none():
    port = procs.free_port()
    assert procs.run_pair(body_random_stress, (0, port, 400), (1, port, 400), timeout=160) == (400, 400)


@also_split
@pytest.mark.timeout(120)
def test_concurrent_senders_keep_per_thread_order():
    port = procs.free_port()
    assert procs.run_pair(body_concurrent_senders, (0, port, 4, 100), (1, port, 4, 100), timeout=100)[1] == 400


@also_split
@pytest.mark.timeout(120)
def test_batches_arrive_item_by_item_bit_exact():
    port = procs.free_port()
    expected = sum(len(batch) for batch in batch_stream(seed=0))
    assert procs.run_pair(body_batches, (0, port), (1, port), timeout=100) == (expected, expected)


@also_split
@pytest.mark.timeout(120)
def test_batches_from_several_threads_arrive_whole():
    port = procs.free_port()
    assert procs.run_pair(body_concurrent_batches, (0, port, 4, 40), (1, port, 4, 40), timeout=100) == (0, 160)


@also_split
@pytest.mark.timeout(120)
def test_tensors_around_the_inline_frame_size_stay_intact():
    port = procs.free_port()
    assert procs.run_pair(body_frame_boundaries, (0, port), (1, port), timeout=100) == (25, 25)


@also_split
@pytest.mark.timeout(240)
def test_large_tensor_256_mib():
    port = procs.free_port()
    assert procs.run_pair(body_large, (0, port, 256 << 20), (1, port, 256 << 20), timeout=220) == ("sent", "received")


@also_split
@pytest.mark.timeout(120)
def test_recv_timeout_then_continue_and_long_idle():
    port = procs.free_port()
    assert procs.run_pair(body_timeouts_and_idle, (0, port), (1, port), timeout=100) == ("ok", "ok")


@also_split
@pytest.mark.timeout(120)
def test_a_short_timeout_holds_while_keepalives_are_seconds_apart():
    port = procs.free_port()
    assert procs.run_pair(body_short_timeouts_beside_a_long_kv_timeout, (0, port), (1, port), timeout=100) == (
        "ok",
        "ok",
    )


@also_split
@pytest.mark.timeout(120)
def test_a_waiter_without_timeout_beside_short_timeouts():
    port = procs.free_port()
    assert procs.run_pair(body_mixed_receivers, (0, port, 120), (1, port, 120), timeout=100) == ("sent", "received")


@also_split
@pytest.mark.timeout(120)
def test_sides_with_different_kv_timeouts_stay_connected_while_idle():
    port = procs.free_port()
    assert procs.run_pair(body_mismatched_timeouts, (0, port), (1, port), timeout=100) == ("ok", "ok")


@also_split
@pytest.mark.timeout(120)
def test_sender_runs_ahead_while_the_receiving_user_is_away():
    port = procs.free_port()
    assert procs.run_pair(body_run_ahead, (0, port, 200), (1, port, 200), timeout=100) == ("sent", "received")


@also_split
@pytest.mark.timeout(120)
def test_simultaneous_sends_both_ways_do_not_wait_for_each_other():
    port = procs.free_port()
    assert procs.run_pair(body_simultaneous_sends, (0, port), (1, port), timeout=100) == (20, 20)


@also_split
@pytest.mark.timeout(120)
def test_backpressure_blocks_sender_without_loss():
    port = procs.free_port()
    assert procs.run_pair(body_backpressure, (0, port), (1, port), timeout=100) == (40, 40)


@also_split
@pytest.mark.timeout(120)
def test_a_large_send_waiting_for_credit_is_not_overtaken_by_a_stream_of_small_ones():
    port = procs.free_port()
    sender, receiver = procs.run_pair(body_credit_in_turn, (0, port), (1, port), timeout=100)
    before = sender["small ones sent before the large one"]
    overtaken = receiver["small ones received before the large one"] - before
    # Only small sends already under way when the large one began to wait may go ahead of it: one,
    # or a few more if this thread was descheduled on its way into the pipe (the stream gets one
    # in a millisecond). Out of turn, all 300 that followed would come first.
    assert overtaken <= 8, (before, overtaken)


@pytest.mark.timeout(120)
def test_pipe_memory_is_sent_from_where_it_lies_and_nothing_else_is_written(payload_path: str):
    """Over the transport, a large inline tensor in pipe memory (from ``empty``, or received) goes
    as one frame with its header written in front of it: no copy. The same-host path sends frames
    from its own buffer (its payloads lie in shared memory instead)."""
    port = procs.free_port()
    sender, receiver = procs.run_pair(body_sent_from_where_it_lies, (0, port), (1, port), timeout=100)
    over_the_transport = payload_path == "off"
    assert sender == {"in place": [over_the_transport, over_the_transport, False, False]}, sender
    assert receiver == {"echoes in place": [over_the_transport, over_the_transport]}, receiver


@also_split
@pytest.mark.timeout(120)
def test_orderly_close_drains_then_reports_closed():
    port = procs.free_port()
    assert procs.run_pair(body_close_orderly, (0, port), (1, port), timeout=100) == ("closed", "saw close")


@also_split
@pytest.mark.timeout(120)
def test_peer_killed_mid_transfer_gives_peer_lost_within_bound():
    port = procs.free_port()
    results = procs.new_queue()
    victim = procs.start(body_victim, (0, port, results), results, 0)
    survivor = procs.start(body_victim, (1, port, results), results, 1)
    try:
        kind, victim_pid = results.get(timeout=60)
        assert kind == "ready"
        time.sleep(1.0)  # let large transfers flow
        os.kill(victim_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        kind, outcome = results.get(timeout=60)
        assert kind == "outcome"
        detected_after = time.monotonic() - killed_at
    finally:
        procs.reap([victim, survivor])
    name, message, _ = outcome["recv_error"]
    assert name == "KVPeerLostError", outcome
    assert "lost" in message
    assert outcome["send_error"] in ("KVPeerLostError",), outcome
    assert detected_after < 2.0 * 2 + 10  # kv_timeout=2: the bound, plus process-start slack on a busy box


@pytest.mark.timeout(120)
def test_pipe_beside_existing_default_group():
    port = procs.free_port(span=4)
    assert procs.run_pair(body_with_default_group, (0, port), (1, port), timeout=100) == ("ok", "ok")


@pytest.mark.timeout(120)
def test_protocol_version_mismatch_is_refused_clearly():
    port = procs.free_port()
    assert procs.run_pair(body_version_mismatch, (0, port), (1, port), timeout=100) == ("refused", "refused")


@also_split
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "secrets, outcome",
    [
        (("s3cret", "s3cret"), "served"),
        (("s3cret", "guess"), "refused"),
        (("s3cret", None), "refused"),
        ((None, "s3cret"), "refused"),
    ],
)
def test_shared_secret_serves_friends_and_refuses_strangers(secrets, outcome):
    port = procs.free_port()
    assert procs.run_pair(body_auth, (0, port, secrets), (1, port, secrets), timeout=100) == (outcome, outcome)


@pytest.mark.timeout(60)
def test_refusal_reaches_a_peer_that_reads_late():
    port = procs.free_port()
    assert procs.run_pair(body_auth_slow_peer, (0, port), (1, port), timeout=50) == ("refused", "refused")


def test_rendezvous_listens_only_on_kv_ip():
    import socket as socket_module

    port = procs.free_port()
    holder = {}
    thread = threading.Thread(target=lambda: holder.setdefault("error", _expect_no_peer(port)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    listening = ""
    while time.monotonic() < deadline and f":{port} " not in listening:
        listening = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout
        time.sleep(0.1)
    lines = [line for line in listening.splitlines() if f":{port} " in line]
    assert lines and all("127.0.0.1:" in line for line in lines), lines
    with socket_module.socket() as probe:  # nothing answers on the wildcard address's other interfaces
        assert probe.connect_ex(("127.0.0.2", port)) != 0
    thread.join(20)
    assert isinstance(holder.get("error"), KVPeerLostError)


def _expect_no_peer(port: int) -> BaseException | None:
    try:
        TorchDistributedPipe(config(0, port, kv_connect_timeout=3.0))
    except BaseException as exc:
        return exc
    return None


@pytest.mark.timeout(120)
def test_header_claiming_huge_tensor_is_refused_before_allocation():
    port = procs.free_port()
    assert procs.run_pair(body_hostile_header, (0, port), (1, port), timeout=100) == ("refused", "sent")


@pytest.mark.timeout(60)
def test_no_peer_gives_clear_error_within_connect_timeout():
    port = procs.free_port()
    start = time.monotonic()
    with pytest.raises(KVPeerLostError, match="no peer"):
        TorchDistributedPipe(config(1, port, kv_connect_timeout=2.0))
    assert time.monotonic() - start < 30


@pytest.mark.timeout(180)
def test_launch_under_torchrun(tmp_path):
    script = tmp_path / "torchrun_body.py"
    script.write_text(
        "import torch\n"
        "from kv_pipe import KVTransferConfig, TorchDistributedPipe\n"
        "cfg = KVTransferConfig.from_env(kv_timeout=10.0, kv_connect_timeout=60.0)\n"
        "assert cfg.kv_role == ('kv_producer' if cfg.kv_rank == 0 else 'kv_consumer')\n"
        "with TorchDistributedPipe(cfg) as pipe:\n"
        "    pipe.send_tensor(torch.full((3, 3), float(cfg.kv_rank)))\n"
        "    got = pipe.recv_tensor(timeout=60)\n"
        "    assert torch.equal(got, torch.full((3, 3), float(1 - cfg.kv_rank))), got\n"
        "import sys\n"
        "sys.stdout.write(f'rank {cfg.kv_rank} ok\\n')  # one write: the two ranks share stdout\n"
        "sys.stdout.flush()\n"
    )
    port = procs.free_port()
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(script),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0 ok" in result.stdout and "rank 1 ok" in result.stdout


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(kv_role="prefill"), "kv_role"),
        (dict(kv_rank=2), "kv_rank"),
        (dict(kv_rank=True), "kv_rank"),
        (dict(kv_parallel_size=3), "kv_parallel_size"),
        (dict(kv_port=0), "kv_port"),
        (dict(kv_port=70000), "kv_port"),
        (dict(kv_port="8000"), "kv_port"),
        (dict(kv_buffer_size=100), "kv_buffer_size"),
        (dict(kv_buffer_size=1.5e9), "kv_buffer_size"),
        (dict(kv_buffer_device="tpu"), "kv_buffer_device"),
        (dict(kv_timeout=0), "kv_timeout"),
        (dict(kv_timeout=float("inf")), "kv_timeout"),
        (dict(kv_connect_timeout=-1), "kv_connect_timeout"),
        (dict(kv_ip=""), "kv_ip"),
        (dict(kv_secret=""), "kv_secret"),
    ],
)
def test_bad_config_values_name_the_field(changes, field):
    with pytest.raises(KVConfigError, match=field):
        KVTransferConfig(**changes)


def test_config_from_env_maps_torchrun_variables():
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": "29500",
        "KVBRIDGE_KV_BUFFER_SIZE": "123456",
        "KVBRIDGE_KV_TIMEOUT": "7.5",
    }
    cfg = KVTransferConfig.from_env(env)
    assert (cfg.kv_rank, cfg.kv_role, cfg.kv_ip, cfg.kv_port) == (1, "kv_consumer", "10.1.2.3", 29501)
    assert (cfg.kv_buffer_size, cfg.kv_timeout) == (123456, 7.5)
    assert KVTransferConfig.from_env({"RANK": "0"}).kv_role == "kv_producer"
    overridden = KVTransferConfig.from_env({**env, "KVBRIDGE_KV_ROLE": "kv_both", "KVBRIDGE_KV_PORT": "4000"})
    assert (overridden.kv_role, overridden.kv_port) == ("kv_both", 4000)
    with pytest.raises(KVConfigError, match="KVBRIDGE_KV_TIMEOUT"):
        KVTransferConfig.from_env({"KVBRIDGE_KV_TIMEOUT": "soon"})
    with pytest.raises(KVConfigError, match="unknown"):
        KVTransferConfig.from_dict({"kv_rank": 0, "kv_bufer_size": 1})


def test_unsendable_tensors_are_refused_before_queueing():
    from kv_pipe.protocol import check_sendable

    with pytest.raises(KVTransferError, match="quantized"):
        check_sendable(torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8))
    with pytest.raises(KVTransferError, match="strided"):
        check_sendable(torch.randn(4, 4).to_sparse())
    with pytest.raises(KVTransferError, match="torch.Tensor"):
        check_sendable([1, 2, 3])


def test_header_codec_round_trips_in_a_reused_frame():
    """Every kind, dtype and rank decodes to what was packed, in one frame written over and over:
    words an earlier, longer header left behind must not survive into a shorter one."""
    from kv_pipe.protocol import MAX_NDIM, FrameHeader, FrameKind, decode_header, pack_header

    generator = random.Random(7)
    frame = memoryview(bytearray(HEADER_BYTES))
    inline_capacity = HOST_FRAME_BYTES - HEADER_BYTES
    headers = [
        FrameHeader(
            kind,
            seq=generator.randrange(1 << 40),
            consumed=generator.randrange(1 << 50),
            want_credit=generator.random() < 0.5,
            freed=4096 * generator.randrange(0, 9),
        )
        for kind in FrameKind
        if kind not in (FrameKind.TENSOR, FrameKind.FREED)
    ]
    headers.append(
        FrameHeader(
            FrameKind.FREED,
            seq=0,
            consumed=5,
            want_credit=False,
            dtype=torch.int64,
            shape=(3,),
            nbytes=24,
            inline=True,
            more=True,
        )
    )
    for dtype in DTYPE_TO_CODE:
        for ndim in (MAX_NDIM, 0, 7, 1, 3):  # long before short: stale shape words would be caught
            shape = tuple(generator.choice((1, 1, 2, 3)) for _ in range(ndim))
            if ndim == 7:
                shape = (0,) + shape[1:]
            nbytes = math.prod(shape) * dtype.itemsize
            inline = nbytes <= inline_capacity
            headers.append(
                FrameHeader(
                    FrameKind.TENSOR,
                    seq=generator.randrange(1 << 40),
                    consumed=0,
                    want_credit=True,
                    dtype=dtype,
                    shape=shape,
                    nbytes=nbytes,
                    inline=inline,
                    place=0 if inline or not nbytes else 4096 * generator.randrange(1, 9),
                    freed=4096 * generator.randrange(0, 9),
                )
            )
    for header in headers:
        pack_header(header, frame)
        assert decode_header(frame, max_nbytes=1 << 62, inline_capacity=inline_capacity, shared_bytes=1 << 62) == header


@pytest.mark.timeout(60)
def test_the_pipe_never_sends_on_a_group_it_receives_on(payload_path: str):
    """NCCL runs a communicator's sends and receives to one peer on one stream: a receive kept posted
    would hold every later send behind it. Each side must send on one group and receive on another.
    On the same-host path the groups carry the set-up only: frames go over the local socket."""
    port = procs.free_port()
    reports = procs.run_pair(body_one_group_per_direction, (0, port), (1, port), timeout=50)
    both = ["incoming:recv", "outgoing:send"]
    shared = payload_path == "on"
    assert reports == ((both, [] if shared else both, shared),) * 2, reports


@split_only
@pytest.mark.timeout(60)
def test_split_pipe_posts_a_payload_receive_only_behind_its_frame_and_none_while_idle():
    """NCCL's layout: a receive kept posted on NCCL would stay in the device's queue while the pipe
    is idle and outlive a dead peer; only an announced payload may have one."""
    port = procs.free_port()
    reports = procs.run_pair(body_payload_receives_only_behind_frames, (0, port), (1, port), timeout=50)
    expected = {"payload receives": 3, "misplaced": [], "idle payload operations": [], "idle frames arrived": True}
    assert reports == (expected, expected), reports


@pytest.mark.timeout(60)
def test_a_bug_in_a_transfer_thread_surfaces_as_itself():
    port = procs.free_port()
    assert procs.run_pair(body_bug_in_a_transfer_thread, (0, port), (1, port), timeout=50) == (
        "peer saw it",
        "surfaced",
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("where", ["caller", "sender thread"])
def test_a_bug_while_sending_surfaces_as_itself_to_every_caller(where: str):
    port = procs.free_port()
    outcome = procs.run_pair(body_bug_while_sending, (0, port, where), (1, port, where), timeout=80)
    assert outcome == ("surfaced", "peer saw it"), outcome


@also_split
@pytest.mark.timeout(90)
def test_a_sender_waiting_for_credit_is_told_when_the_peer_closes():
    port = procs.free_port()
    assert procs.run_pair(body_peer_closes_while_a_send_waits_for_credit, (0, port), (1, port), timeout=80) == (
        "told",
        "closed",
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how, secret", [("arrivals", None), ("hijack groups", "s3cret")])
def test_a_stranger_tampering_with_the_rendezvous_store_is_refused_clearly(how, secret):
    """A stranger who reaches the store bumps its arrival counter, or takes rank 1's place in the
    groups (their connection addresses travel through the unauthenticated store). Both ranks must
    end with an error that names the cause within the bounds, never connected to the stranger."""
    port = procs.free_port()
    results = procs.new_queue()
    processes = [procs.start(body_tampered_rendezvous, (0, port, secret), results, 0)]
    try:
        if how == "arrivals":  # from this process, so that it lands before rank 1 arrives
            stranger = stranger_tampering(port, how)
        else:
            processes.append(procs.start(stranger_tampering, (port, how), results, 2))
        processes.append(procs.start(body_tampered_rendezvous, (1, port, secret), results, 1))
        outcomes = procs.collect(processes, results, timeout=80)
    finally:
        procs.reap(processes)
    (kind0, message0), (kind1, message1) = outcomes[0], outcomes[1]
    assert kind0 != "connected" and kind1 != "connected", outcomes
    if how == "arrivals":
        assert stranger == "bumped"
        assert kind1 == "KVPeerLostError" and "already served a pair" in message1, outcomes
    else:
        assert outcomes[2] == "hijacked", outcomes
        assert kind0 == "KVProtocolError" and "authentication failed" in message0, outcomes
        assert kind1 in ("KVPeerLostError", "KVProtocolError"), outcomes
