"""The GPU path's set-up, pinned on CPU: the device a pipe uses, the order in which both sides create
and connect their groups, who issues operations on NCCL, the same-GPU refusal, and the host-staged
block copies. Everything here runs without CUDA: CUDA is faked where the code must not touch the
calling thread's current device, and gloo stands in for NCCL where the order of operations is what
matters. ``tests/processes/test_cuda.py`` runs the real thing on a GPU."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import kv_pipe.device as devices
import kv_pipe.torch_distributed_pipe as pipe_module
from connector.paged import (
    FLASH_ATTN_LAYOUT,
    VLLM_CPU_LAYOUT,
    PagedKVLayout,
    gather_blocks,
    gather_indexed,
    scatter_blocks,
    scatter_indexed,
)
from harness import procs
from harness.tensors import random_tensor, same_bits
from kv_pipe import KVTransferConfig, TorchDistributedPipe, rendezvous
from kv_pipe.channel import TAG_FRAME, GroupChannel
from kv_pipe.errors import KVConfigError
from kv_pipe.protocol import Hello

UUID_A = bytes(range(16))
UUID_B = bytes(range(16, 32))


def config(rank: int, port: int, **changes) -> KVTransferConfig:
    values = dict(
        kv_rank=rank,
        kv_role="kv_producer" if rank == 0 else "kv_consumer",
        kv_port=port,
        kv_timeout=5.0,
        kv_connect_timeout=20.0,
        kv_shared_memory="off",
    )
    values.update(changes)
    return KVTransferConfig(**values)


def pipe_pair(port: int, **changes) -> tuple[TorchDistributedPipe | BaseException, ...]:
    """Both ends of a pipe, built at once in two threads of this process; an end that failed is its error."""
    ends: list[TorchDistributedPipe | BaseException | None] = [None, None]

    def build(rank: int) -> None:
        try:
            ends[rank] = TorchDistributedPipe(config(rank, port, **changes))
        except BaseException as exc:  # reported to the test
            ends[rank] = exc

    threads = [threading.Thread(target=build, args=(rank,), name=f"builder-{rank}") for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(end is not None for end in ends), "a pipe end neither connected nor failed within 60 s"
    return tuple(ends)


def close_all(*ends: object) -> None:
    closers = [threading.Thread(target=end.close) for end in ends if isinstance(end, TorchDistributedPipe)]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(30)


class _FakeCuda:
    """torch.cuda as a process with ``count`` GPUs would see it, whose current device must never be asked."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
        self.events: list[tuple] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", self._current_device)
        fake = self

        class Stream:
            def __init__(self, device: torch.device | None = None) -> None:
                fake.events.append(("stream", device))
                self.device = device

        @contextlib.contextmanager
        def device(which: torch.device):
            fake.events.append(("device", which))
            yield

        @contextlib.contextmanager
        def stream(which: Stream):
            fake.events.append(("current stream", which))
            yield

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "stream", stream)

    @staticmethod
    def _current_device() -> int:
        raise AssertionError("the pipe asked for the calling thread's current device")


# ---------------------------------------------------------------------------------- the device


def test_cuda_pipe_uses_the_configured_gpu_never_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeCuda(monkeypatch, count=4)
    chosen = devices.select_device(KVTransferConfig(kv_buffer_device="cuda", kv_device_index=2))
    assert chosen == torch.device("cuda", 2)


def test_one_visible_gpu_needs_no_index_several_do(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeCuda(monkeypatch, count=1)
    assert devices.select_device(KVTransferConfig(kv_buffer_device="cuda")) == torch.device("cuda", 0)
    _FakeCuda(monkeypatch, count=2)
    with pytest.raises(KVConfigError, match="needs kv_device_index"):
        devices.select_device(KVTransferConfig(kv_buffer_device="cuda"))
    with pytest.raises(KVConfigError, match="kv_device_index=5, but torch sees 2 GPU"):
        devices.select_device(KVTransferConfig(kv_buffer_device="cuda", kv_device_index=5))


def test_host_pipe_ignores_the_gpu_index() -> None:
    assert devices.select_device(KVTransferConfig(kv_device_index=3)) == torch.device("cpu")


def test_cuda_without_cuda_names_the_host_staged_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(KVConfigError, match="kv_buffer_device='cpu'"):
        devices.select_device(KVTransferConfig(kv_buffer_device="cuda"))


@pytest.mark.parametrize("value", [-1, True, "1", 1.0])
def test_config_refuses_a_bad_device_index(value: object) -> None:
    with pytest.raises(KVConfigError, match="kv_device_index"):
        KVTransferConfig(kv_device_index=value)


def test_from_env_takes_the_gpu_from_local_rank_for_cuda_pipes_only() -> None:
    env = {"RANK": "1", "LOCAL_RANK": "1", "KVBRIDGE_KV_BUFFER_DEVICE": "cuda"}
    assert KVTransferConfig.from_env(env).kv_device_index == 1
    assert KVTransferConfig.from_env({**env, "KVBRIDGE_KV_DEVICE_INDEX": "3"}).kv_device_index == 3
    assert KVTransferConfig.from_env({**env, "KVBRIDGE_KV_DEVICE_INDEX": "none"}).kv_device_index is None
    assert KVTransferConfig.from_env({"RANK": "1", "LOCAL_RANK": "1"}).kv_device_index is None


def test_pipe_streams_live_on_the_configured_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCuda(monkeypatch, count=4)
    gpu = torch.device("cuda", 3)
    streams = devices.pipe_streams(gpu)
    assert [event for event in fake.events if event[0] == "stream"] == [("stream", gpu)] * 3
    fake.events.clear()
    with streams.context("recv"):
        pass
    assert fake.events[0] == ("device", gpu)
    assert fake.events[1][0] == "current stream" and fake.events[1][1].device == gpu
    assert devices.pipe_streams(torch.device("cpu")).ready_event(torch.zeros(1)) is None


# ---------------------------------------------------------------------------------- group set-up


def test_nccl_groups_are_connected_eagerly_in_one_order_on_the_configured_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sides build the 0 -> 1 group, then the 1 -> 0 group, each connected on the spot on the
    configured device (eager_connect_single_device, what init_process_group's device_id does)."""
    _FakeCuda(monkeypatch, count=2)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the engine's setting: torch's default
    created: list[tuple] = []
    error_handling: list[str | None] = []  # the setting each group was constructed under

    class FakeNCCL:
        class Options:
            def __init__(self) -> None:
                self._timeout = None
                self.is_high_priority_stream = True

        def __init__(self, store: dist.Store, rank: int, size: int, options: FakeNCCL.Options) -> None:
            self.rank, self.size, self.timeout = rank, size, options._timeout
            created.append(("construct", rank, size, options._timeout.total_seconds()))
            error_handling.append(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))

        def eager_connect_single_device(self, device: torch.device) -> None:
            created.append(("connect", self.rank, device))

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    labels: list[tuple[int, str]] = []
    original = rendezvous._create_group

    def spy(store, rank, timeout, device, kv_ip, label):
        labels.append((rank, label))
        return original(store, rank, timeout, device, kv_ip, label)

    monkeypatch.setattr(rendezvous, "_create_group", spy)
    gpu = torch.device("cuda", 1)
    for rank in (0, 1):
        outgoing, incoming = rendezvous._create_groups(
            config(rank, 1, kv_buffer_device="cuda", kv_device_index=1), dist.HashStore(), gpu
        )
        assert isinstance(outgoing, FakeNCCL) and isinstance(incoming, FakeNCCL)
        assert created.index(("connect", rank, gpu)) >= 0
    assert labels == [(0, "0to1"), (0, "1to0"), (1, "0to1"), (1, "1to0")]
    per_rank = [[entry[0] for entry in created if entry[1] == rank] for rank in (0, 1)]
    assert per_rank == [["construct", "connect", "construct", "connect"]] * 2
    connects = [entry for entry in created if entry[0] == "connect"]
    assert connects == [("connect", 0, gpu)] * 2 + [("connect", 1, gpu)] * 2
    # The watchdog's timeout is later than the pipe's own bound (kv_timeout=5): the pipe aborts first.
    assert all(entry[2:] == (2, 10.0) for entry in created if entry[0] == "construct")
    # The pipe's groups leave errors to the pipe (no process tear-down); the engine's setting stays.
    assert error_handling == ["0"] * 4
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


class _RecordingGroup:
    """A group that notes every operation issued on it (and by which thread)."""

    def __init__(self, inner: dist.ProcessGroup, rank: int, label: str, log: list) -> None:
        self._inner, self._rank, self._label, self._log = inner, rank, label, log

    def send(self, tensors, peer, tag):
        self._log.append((self._rank, "send", self._label, tag, time.monotonic()))
        return self._inner.send(tensors, peer, tag)

    def recv(self, tensors, peer, tag):
        self._log.append((self._rank, "recv", self._label, tag, time.monotonic()))
        return self._inner.recv(tensors, peer, tag)


@pytest.mark.parametrize("secret", [None, "s3cret"], ids=["plain", "with-secret"])
def test_both_sides_create_and_prime_their_groups_in_one_order_before_any_frame(
    monkeypatch: pytest.MonkeyPatch, secret: str | None
) -> None:
    log: list[tuple] = []
    original = rendezvous._create_group

    def recording(store, rank, timeout, device, kv_ip, label):
        log.append((rank, "create", label, None, time.monotonic()))
        group = original(store, rank, timeout, device, kv_ip, label)
        log.append((rank, "created", label, None, time.monotonic()))
        return _RecordingGroup(group, rank, label, log)

    monkeypatch.setattr(rendezvous, "_create_group", recording)
    ends = pipe_pair(procs.free_port(), kv_secret=secret)
    try:
        assert all(isinstance(end, TorchDistributedPipe) for end in ends), ends
        ends[0].send_tensor(torch.arange(10))
        assert torch.equal(ends[1].recv_tensor(timeout=10), torch.arange(10))
        ends[1].send_tensor(torch.ones(3))
        assert torch.equal(ends[0].recv_tensor(timeout=10), torch.ones(3))
    finally:
        close_all(*ends)
    for rank in (0, 1):
        mine = [entry for entry in log if entry[0] == rank]
        assert [entry[1:3] for entry in mine[:4]] == [
            ("create", "0to1"),
            ("created", "0to1"),
            ("create", "1to0"),
            ("created", "1to0"),
        ]
        operations = [entry for entry in mine if entry[1] in ("send", "recv")]
        # The first operation on each group is its primer, 0 -> 1 first, on both sides.
        assert [entry[1:4] for entry in operations[:2]] == (
            [("send", "0to1", rendezvous._PRIMER_TAG), ("recv", "1to0", rendezvous._PRIMER_TAG)]
            if rank == 0
            else [("recv", "0to1", rendezvous._PRIMER_TAG), ("send", "1to0", rendezvous._PRIMER_TAG)]
        )
        first_frame = min(entry[4] for entry in operations if entry[3] == TAG_FRAME)
        assert max(entry[4] for entry in mine if entry[1] == "created") < first_frame
        # Each side sends only on its outgoing group and receives only on its incoming one.
        outgoing = "0to1" if rank == 0 else "1to0"
        assert {entry[2] for entry in operations if entry[1] == "send"} == {outgoing}
        assert {entry[2] for entry in operations if entry[1] == "recv"} == {"1to0" if rank == 0 else "0to1"}
    # Neither side began creating its second group before the other had created its first.
    created_first = max(entry[4] for entry in log if entry[1:3] == ("created", "0to1"))
    started_second = min(entry[4] for entry in log if entry[1:3] == ("create", "1to0"))
    assert created_first <= started_second + 0.5  # gloo's constructor returns once both ends are connected


def test_on_nccl_only_the_pipe_threads_issue_operations(monkeypatch: pytest.MonkeyPatch) -> None:
    """A channel that callers may not post on (NCCL's) sees every frame from the pipe's own threads,
    whatever the callers' timeouts; gloo stands in for NCCL."""
    threads: list[str] = []

    class NoCallers(GroupChannel):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.callers_may_post = False

        def post(self, tensor, tag):
            threads.append(threading.current_thread().name)
            return super().post(tensor, tag)

        def recv(self, tensor, tag):
            threads.append(threading.current_thread().name)
            return super().recv(tensor, tag)

    monkeypatch.setattr(pipe_module, "GroupChannel", NoCallers)
    ends = pipe_pair(procs.free_port())
    try:
        assert all(isinstance(end, TorchDistributedPipe) for end in ends), ends
        generator = torch.Generator().manual_seed(3)
        for round_trip in range(20):
            timeout = None if round_trip % 2 else 30.0
            data = random_tensor(generator, torch.float32, (round_trip * 1000 + 1,))
            ends[0].send_tensors([data, None], timeout=timeout)
            assert same_bits(ends[1].recv_tensor(timeout=timeout), data)
            assert ends[1].recv_tensor(timeout=timeout) is None
            ends[1].send_tensor(data[:5], timeout=timeout)
            assert same_bits(ends[0].recv_tensor(timeout=timeout), data[:5])
        ends[0].flush(timeout=10)
    finally:
        close_all(*ends)
    assert threads and all(name.endswith(("-send", "-recv")) for name in threads), sorted(set(threads))


def test_gloo_callers_still_send_and_receive_themselves(monkeypatch: pytest.MonkeyPatch) -> None:
    """On gloo the callers keep doing their own sends and receives (no thread hand-off per message)."""
    threads: list[str] = []

    class Recording(GroupChannel):
        def post(self, tensor, tag):
            threads.append(threading.current_thread().name)
            return super().post(tensor, tag)

    monkeypatch.setattr(pipe_module, "GroupChannel", Recording)
    ends = pipe_pair(procs.free_port())
    try:
        for _ in range(5):
            ends[0].send_tensor(torch.arange(100))
            assert torch.equal(ends[1].recv_tensor(), torch.arange(100))
    finally:
        close_all(*ends)
    assert "MainThread" in threads


# ---------------------------------------------------------------------------------- same GPU


def test_greeting_carries_the_gpu_identity() -> None:
    hello = Hello(frame_bytes=8192, max_in_flight=1 << 20, device="cuda", timeout_ms=5000, gpu_id=UUID_A)
    assert Hello.unpack(hello.pack()) == hello
    host = Hello(frame_bytes=8192, max_in_flight=1 << 20, device="cpu", timeout_ms=5000)
    assert Hello.unpack(host.pack()).gpu_id == b""
    assert devices.gpu_identity(torch.device("cpu")) == b""
    assert devices.describe_gpu(UUID_A) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_same_gpu_on_both_sides_is_refused_at_once_naming_the_host_staged_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "gpu_identity", lambda device: UUID_A)
    started = time.monotonic()
    ends = pipe_pair(procs.free_port())
    try:
        assert time.monotonic() - started < 10
        for end in ends:
            assert isinstance(end, KVConfigError), end
            message = str(end)
            assert "same GPU" in message and "GPU-00010203" in message
            assert "host-staged" in message and "kv_buffer_device='cpu'" in message
    finally:
        close_all(*ends)


def test_different_gpus_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    identities = {"builder-0": UUID_A, "builder-1": UUID_B}
    monkeypatch.setattr(devices, "gpu_identity", lambda device: identities[threading.current_thread().name])
    ends = pipe_pair(procs.free_port())
    try:
        assert all(isinstance(end, TorchDistributedPipe) for end in ends), ends
        ends[0].send_tensor(torch.arange(4))
        assert torch.equal(ends[1].recv_tensor(timeout=10), torch.arange(4))
    finally:
        close_all(*ends)


def test_check_distinct_gpus_ignores_host_pipes() -> None:
    host = Hello(frame_bytes=8192, max_in_flight=1 << 20, device="cpu", timeout_ms=5000)
    rendezvous.check_distinct_gpus(host, host)
    gpu = Hello(frame_bytes=8192, max_in_flight=1 << 20, device="cuda", timeout_ms=5000, gpu_id=UUID_A)
    with pytest.raises(KVConfigError, match="host-staged"):
        rendezvous.check_distinct_gpus(gpu, gpu)


# ---------------------------------------------------------------------------------- host-staged copies

#: Layouts of vLLM's GPU attention backends (blocks dimension, tokens-of-a-block dimension), as
#: ``(layout, per-layer shape with 6 blocks of 4 tokens)``.
GPU_LAYOUTS = [
    (FLASH_ATTN_LAYOUT, (2, 6, 4, 3, 8)),  # flash attention: [2, blocks, block_size, heads, dim]
    (PagedKVLayout("flashinfer", block_dim=0, block_size_dim=3), (6, 2, 3, 4, 8)),  # [blocks, 2, heads, bs, dim]
    (PagedKVLayout("flashinfer_nhd", block_dim=0, block_size_dim=2), (6, 2, 4, 3, 8)),  # [blocks, 2, bs, heads, dim]
    (PagedKVLayout("mla", block_dim=0, block_size_dim=1), (6, 4, 24)),  # MLA: [blocks, block_size, latent]
    (VLLM_CPU_LAYOUT, (6, 3, 4, 16)),
]


@pytest.mark.parametrize("layout, shape", GPU_LAYOUTS, ids=[layout.name for layout, _ in GPU_LAYOUTS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8])
def test_indexed_gather_and_scatter_match_the_host_copies_bit_for_bit(
    layout: PagedKVLayout, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """What runs on a GPU (one indexed copy per layer) gives the bits the host path gives."""
    generator = torch.Generator().manual_seed(7)
    caches = [random_tensor(generator, dtype, shape) for _ in range(3)]
    ids = torch.tensor([4, 0, 1, 2, 5])
    expected = gather_blocks(caches, layout, ids)
    out = torch.empty_like(expected)
    gather_indexed(caches, layout.block_dim, ids, out)
    assert same_bits(out, expected)
    on_host = [torch.zeros_like(cache) for cache in caches]
    indexed = [torch.zeros_like(cache) for cache in caches]
    scatter_blocks(on_host, layout, ids, expected)
    scatter_indexed(indexed, layout.block_dim, ids, expected)
    assert all(same_bits(a, b) for a, b in zip(on_host, indexed, strict=True))
    assert same_bits(gather_blocks(indexed, layout, ids), expected)


def test_gather_goes_straight_into_the_buffers_memory() -> None:
    """The blocks land in the memory ``empty`` makes (the pipe's), not in a tensor copied later."""
    made = []

    def empty(shape, dtype):
        made.append(torch.empty(tuple(shape), dtype=dtype))
        return made[-1]

    caches = [torch.arange(2 * 6 * 4 * 3 * 8, dtype=torch.float32).reshape(2, 6, 4, 3, 8) + layer for layer in range(2)]
    out = gather_blocks(caches, FLASH_ATTN_LAYOUT, torch.tensor([3, 1]), empty)
    assert out is made[0]
    assert torch.equal(out[1][:, 0], caches[1][:, 3])


def test_copy_between_one_device_is_a_plain_copy_and_pinning_needs_cuda() -> None:
    source = torch.arange(12, dtype=torch.int16)
    target = torch.empty_like(source)
    devices.copy_between(target, source)
    assert torch.equal(target, source)
    if not torch.cuda.is_available():
        assert devices.pin_host_memory(source.data_ptr(), source.nbytes) is False


# ---------------------------------------------------------------------------------- the GPU checks


def test_the_gpu_checks_load_here_and_skip_what_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """harness/cuda_checks.py (what scripts/gpu-check.sh runs) imports without a GPU, and its checks
    that need one say so in a dry run on the host."""
    from harness import cuda_checks

    monkeypatch.setenv("KVBRIDGE_CHECK_GPU", "cpu")
    assert cuda_checks.gpu() == torch.device("cpu")
    for check in (cuda_checks.check_same_gpu_refused, cuda_checks.check_nccl_two_gpus, cuda_checks.check_pair_on_gpu):
        with pytest.raises(cuda_checks.Skip):
            check()


def test_host_staged_benchmark_says_it_needs_cuda_and_exits_0(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: harness/cuda_checks.py runs the benchmark")
    command = [sys.executable, "-m", "benchmarks.bench_host_staged", "--sizes", "1M", "--iters", "1"]
    [result] = procs.run_commands([(command, {})], tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "needs a CUDA GPU" in result.stdout
