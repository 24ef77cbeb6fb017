"""The checks of the GPU path, runnable without pytest (a bare GPU machine may have torch and nothing
else): ``tests/processes/test_cuda.py`` runs each one under pytest (``pytest -m cuda``), and
``scripts/gpu-check.sh`` runs them all through :func:`main`, which prints one table.

Each check is a function that returns a short note for the table, raises :class:`Skip` when the
machine cannot run it (one GPU where it needs two), and raises anything else on failure. Two-process
checks spawn both sides (:mod:`harness.procs`); both run on the GPU given by ``KVBRIDGE_CHECK_GPU``
(default 0), so one GPU is enough for all but the NCCL pair.

Needs only torch, numpy, pyzmq and msgspec (what kvbridge itself imports).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import torch

from connector import (
    KVRequest,
    PagedKV,
    PagedKVCaches,
    recv_kv_caches_and_hidden_states,
    send_kv_caches_and_hidden_states,
)
from connector.paged import FLASH_ATTN_LAYOUT, VLLM_CPU_LAYOUT, PagedKVLayout, gather_blocks, scatter_blocks
from harness import procs
from kv_pipe import KVConfigError, KVPeerLostError, KVTransferConfig, TorchDistributedPipe
from lookup_buffer import SimpleBuffer

#: Layouts of vLLM's GPU attention backends, as (layout, per-layer shape with 40 blocks of 16 tokens).
GPU_LAYOUTS = [
    (FLASH_ATTN_LAYOUT, (2, 40, 16, 4, 64)),  # flash attention, triton: [2, blocks, block_size, heads, dim]
    (PagedKVLayout("flashinfer_hnd", block_dim=0, block_size_dim=3), (40, 2, 4, 16, 64)),  # [blocks, 2, heads, bs, dim]
    (PagedKVLayout("flashinfer_nhd", block_dim=0, block_size_dim=2), (40, 2, 16, 4, 64)),  # [blocks, 2, bs, heads, dim]
    (PagedKVLayout("mla", block_dim=0, block_size_dim=1), (40, 16, 576)),  # MLA: [blocks, block_size, latent + rope]
    (VLLM_CPU_LAYOUT, (40, 4, 16, 128)),  # vLLM's CPU layout on a GPU tensor: blocks first
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8]


class Skip(Exception):
    """The check cannot run on this machine (the reason says why)."""


def gpu() -> torch.device:
    """The GPU the checks use (``KVBRIDGE_CHECK_GPU``, default 0). ``KVBRIDGE_CHECK_GPU=cpu`` runs the
    checks' own logic on the host instead (a dry run of the checks, not of the GPU path)."""
    which = os.environ.get("KVBRIDGE_CHECK_GPU", "0")
    return torch.device("cpu") if which == "cpu" else torch.device("cuda", int(which))


def _needs_cuda() -> None:
    if gpu().type != "cuda":
        raise Skip("a dry run on the host")


def _random(generator: torch.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bits of ``dtype`` on the host (every bit pattern, NaNs included: compared as bits)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _config(rank: int, port: int, **changes) -> KVTransferConfig:
    values = dict(
        kv_rank=rank,
        kv_role="kv_producer" if rank == 0 else "kv_consumer",
        kv_port=port,
        kv_timeout=20.0,
        kv_connect_timeout=60.0,
        kv_buffer_size=512 << 20,
        kv_device_index=gpu().index,
    )
    values.update(changes)
    return KVTransferConfig(**values)


def _two_sides(target: Callable, port: int, *args: object, timeout: float = 120) -> dict[int, object]:
    results = procs.new_queue()
    processes = [procs.start(target, (rank, port, *args), results, rank) for rank in (0, 1)]
    return procs.collect(processes, results, timeout=timeout)


# ---------------------------------------------------------------------------------- the pipe

#: (dtype, shape, transposed): small ones inline, 1 MiB and more through shared memory or payloads.
PIPE_CASES = [
    (torch.float32, (7,), False),
    (torch.bfloat16, (1024, 300), False),
    (torch.float16, (512, 1024), True),  # not contiguous: sent as its values
    (torch.float8_e4m3fn, (3 << 20,), False),
    (torch.int64, (1 << 20,), False),
    (torch.uint8, (0,), False),
    (torch.bfloat16, (64 << 20,), False),  # 128 MiB
]


def _pipe_case(index: int) -> torch.Tensor:
    dtype, shape, transposed = PIPE_CASES[index]
    tensor = _random(torch.Generator().manual_seed(100 + index), dtype, shape)
    return tensor.t() if transposed else tensor


def _host_staged_pipe_side(rank: int, port: int, shared_memory: str) -> dict[str, object]:
    """Rank 0 sends each case from the GPU; rank 1 checks it arrived in host memory, bit-exact, and
    sends it back from its GPU; rank 0 checks the echo."""
    device = gpu()
    with TorchDistributedPipe(_config(rank, port, kv_shared_memory=shared_memory)) as pipe:
        started = time.perf_counter()
        for index in range(len(PIPE_CASES)):
            if rank == 0:
                sent = _pipe_case(index).to(device)
                pipe.send_tensors([sent, None], timeout=60)
                echo = pipe.recv_tensor(timeout=60)
                assert echo.device.type == "cpu" and _same_bits(echo, _pipe_case(index).contiguous()), index
            else:
                received = pipe.recv_tensor(timeout=60)
                assert pipe.recv_tensor(timeout=60) is None
                assert received.device.type == "cpu", received.device
                assert _same_bits(received, _pipe_case(index).contiguous()), f"case {index} arrived changed"
                pipe.send_tensor(received.to(device), timeout=60)
        pipe.flush(timeout=60)
        return {
            "seconds": time.perf_counter() - started,
            "shared": pipe.uses_shared_memory,
            "pinned": len(pipe._pinned),
        }


def check_pipe_host_staged() -> str:
    """The pipe's contract on CUDA tensors in host-staged mode (a CPU pipe, GPU tensors on both
    sides): every case both ways, bit-exact, over shared memory and over gloo."""
    notes = []
    for mode in ("on", "off"):
        results = _two_sides(_host_staged_pipe_side, procs.free_port(), mode)
        assert results[0]["shared"] == (mode == "on"), results
        pinned = min(results[0]["pinned"], results[1]["pinned"])
        notes.append(
            f"{'shared memory' if mode == 'on' else 'gloo'}: {results[0]['seconds']:.1f} s"
            + (f", segments pinned: {'yes' if pinned == 2 else 'no'}" if mode == "on" else "")
        )
    return "; ".join(notes)


# ---------------------------------------------------------------------------------- paged copies


def check_paged_layouts() -> str:
    """Gather and scatter on vLLM's GPU cache layouts, bit-exact against the host path: on the GPU,
    host-staged into pinned and pageable host memory, and back from both."""
    device = gpu()
    count = 0
    for layout, shape in GPU_LAYOUTS:
        for dtype in DTYPES:
            generator = torch.Generator().manual_seed(count)
            host_caches = [_random(generator, dtype, shape) for _ in range(3)]
            gpu_caches = [cache.to(device) for cache in host_caches]
            ids = torch.randperm(shape[layout.block_dim], generator=generator)[:17]
            expected = gather_blocks(host_caches, layout, ids)
            on_gpu = gather_blocks(gpu_caches, layout, ids)
            assert on_gpu.device == device and _same_bits(on_gpu, expected), (layout.name, dtype)
            in_device_memory = gather_blocks(
                gpu_caches, layout, ids, lambda s, d: torch.empty(tuple(s), dtype=d, device=device)
            )
            assert _same_bits(in_device_memory, expected), (layout.name, dtype)
            for pinned in (True, False):
                staged = gather_blocks(
                    gpu_caches,
                    layout,
                    ids,
                    lambda s, d, p=pinned and device.type == "cuda": torch.empty(tuple(s), dtype=d, pin_memory=p),
                )
                assert staged.device.type == "cpu" and _same_bits(staged, expected), (layout.name, dtype, pinned)
                targets = [torch.zeros_like(cache) for cache in gpu_caches]
                scatter_blocks(targets, layout, ids, staged)
                host_targets = [torch.zeros_like(cache) for cache in host_caches]
                scatter_blocks(host_targets, layout, ids, expected)
                assert all(_same_bits(a, b) for a, b in zip(targets, host_targets, strict=True)), (layout.name, dtype)
            # A part of the received blocks, not contiguous (a load that skips the blocks vLLM has).
            part = expected.narrow(1 + layout.block_dim, 3, 14)
            targets = [torch.zeros_like(cache) for cache in gpu_caches]
            scatter_blocks(targets, layout, ids[3:], part)
            host_targets = [torch.zeros_like(cache) for cache in host_caches]
            scatter_blocks(host_targets, layout, ids[3:], part)
            assert all(_same_bits(a, b) for a, b in zip(targets, host_targets, strict=True)), (layout.name, dtype)
            count += 1
    return f"{len(GPU_LAYOUTS)} layouts x {len(DTYPES)} dtypes"


# ---------------------------------------------------------------------------------- the connector

CONNECTOR_LAYERS = 4
CONNECTOR_SHAPE = (2, 64, 16, 4, 64)  # flash attention: 64 blocks of 16 tokens
#: (prompt length, producer's blocks, consumer's blocks) per request.
CONNECTOR_REQUESTS = [
    (16 * 3, [5, 6, 7], [0, 1, 2]),
    (16 * 5, [63, 1, 30, 2, 8], [10, 40, 11, 41, 12]),
    (16 * 1, [9], [63]),
    (16 * 8, list(range(20, 28)), [50, 49, 48, 47, 46, 45, 44, 43]),
]


def _connector_caches(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [_random(generator, torch.bfloat16, CONNECTOR_SHAPE) for _ in range(CONNECTOR_LAYERS)]


def _tokens(index: int, length: int) -> torch.Tensor:
    return torch.arange(length, dtype=torch.int64) * 7 + index


def _hidden(index: int) -> torch.Tensor:
    return _random(torch.Generator().manual_seed(900 + index), torch.bfloat16, (256,))


def _connector_side(rank: int, port: int) -> str:
    device = gpu()
    config = _config(rank, port, kv_buffer_size=256 << 20)
    layout = FLASH_ATTN_LAYOUT
    if rank == 0:
        caches = PagedKVCaches([cache.to(device) for cache in _connector_caches(1)], layout)
        requests = [
            KVRequest(_tokens(i, n), PagedKV(caches, src), _hidden(i).to(device))
            for i, (n, src, _) in enumerate(CONNECTOR_REQUESTS)
        ]
        with SimpleBuffer(TorchDistributedPipe(config), config) as buffer:
            started = time.perf_counter()
            results = send_kv_caches_and_hidden_states(buffer, requests)
            deadline = time.monotonic() + 60
            while buffer.stats().hits < len(requests):
                assert time.monotonic() < deadline, f"the consumer took {buffer.stats().hits} entries"
                time.sleep(0.02)
        return f"{sum(r.num_bytes for r in results) / 2**20:.1f} MiB sent in {time.perf_counter() - started:.2f} s"
    before = _connector_caches(2)
    caches = PagedKVCaches([cache.to(device) for cache in before], layout)
    hidden = [torch.zeros(256, dtype=torch.bfloat16, device=device) for _ in CONNECTOR_REQUESTS]
    requests = [
        KVRequest(_tokens(i, n), PagedKV(caches, dst), hidden[i]) for i, (n, _, dst) in enumerate(CONNECTOR_REQUESTS)
    ]
    with SimpleBuffer(TorchDistributedPipe(config), config) as buffer:
        results = recv_kv_caches_and_hidden_states(buffer, requests, timeout=60)
    assert all(result.hit for result in results), [result.reason for result in results]
    source = _connector_caches(1)
    expected = [cache.clone() for cache in before]
    for i, (_, src, dst) in enumerate(CONNECTOR_REQUESTS):
        scatter_blocks(expected, layout, torch.tensor(dst), gather_blocks(source, layout, torch.tensor(src)))
        assert _same_bits(hidden[i], _hidden(i)), f"request {i}: hidden state changed"
    for layer, (got, want) in enumerate(zip(caches.caches, expected, strict=True)):
        assert _same_bits(got, want), f"layer {layer}: the consumer's cache differs (wrong or missing blocks)"
    return "ok"


def check_connector_one_gpu() -> str:
    """Two processes on one GPU move a batch's paged KV (flash-attention layout, bf16) and hidden
    states through the connector in host-staged mode; the consumer's caches are checked block by block."""
    results = _two_sides(_connector_side, procs.free_port())
    return f"{len(CONNECTOR_REQUESTS)} requests, {results[0]}"


# ---------------------------------------------------------------------------------- NCCL


def _same_gpu_side(rank: int, port: int) -> str:
    started = time.monotonic()
    try:
        TorchDistributedPipe(_config(rank, port, kv_buffer_device="cuda"))
    except KVConfigError as exc:
        assert "host-staged" in str(exc), exc
        return f"{time.monotonic() - started:.1f} s: {str(exc)[:60]}"
    raise AssertionError("two NCCL pipe ends on one GPU connected")


def check_same_gpu_refused() -> str:
    """Two NCCL pipe ends on one GPU are refused at once, naming the host-staged mode (the GPU's
    UUID travels in the greeting)."""
    _needs_cuda()
    results = _two_sides(_same_gpu_side, procs.free_port(), timeout=60)
    return results[0]


def _nccl_side(rank: int, port: int) -> dict[str, object]:
    device = torch.device("cuda", rank)
    with TorchDistributedPipe(_config(rank, port, kv_buffer_device="cuda", kv_device_index=rank)) as pipe:
        assert pipe.device == device
        for index in range(len(PIPE_CASES)):
            if rank == 0:
                pipe.send_tensor(_pipe_case(index).to(device), timeout=60)
                echo = pipe.recv_tensor(timeout=60)
                assert echo.device == device and _same_bits(echo, _pipe_case(index).contiguous()), index
            else:
                received = pipe.recv_tensor(timeout=60)
                assert received.device == device and _same_bits(received, _pipe_case(index).contiguous()), index
                pipe.send_tensor(received, timeout=60)
        pipe.flush(timeout=60)
    return {"ok": True}


def check_nccl_two_gpus() -> str:
    """An NCCL pipe between GPU 0 and GPU 1: every case both ways, bit-exact."""
    _needs_cuda()
    if torch.cuda.device_count() < 2:
        raise Skip("needs two GPUs")
    _two_sides(_nccl_side, procs.free_port())
    return "ok"


def _nccl_victim_side(rank: int, port: int, results: object) -> dict[str, object]:
    """An NCCL pipe end whose peer (rank 0) is killed while payloads flow: rank 1 must raise
    KVPeerLostError within its bound and live on, its GPU usable (no NCCL work left behind)."""
    device = torch.device("cuda", rank)
    pipe = TorchDistributedPipe(_config(rank, port, kv_buffer_device="cuda", kv_device_index=rank, kv_timeout=5.0))
    payload = _random(torch.Generator().manual_seed(rank), torch.bfloat16, (16 << 20,)).to(device)
    results.put((rank, "ready", os.getpid()))
    if rank == 0:
        while True:  # until killed
            pipe.send_tensor(payload, timeout=60)
    try:
        while True:
            pipe.recv_tensor(timeout=60)
    except KVPeerLostError as exc:
        error = f"{type(exc).__name__}: {str(exc)[:80]}"
    torch.cuda.synchronize(device)  # the device holds no pipe work any more
    probe = torch.ones(4, device=device).sum().item()
    pipe.close()
    return {"error": error, "probe": probe}


def check_nccl_killed_peer() -> str:
    """A peer killed mid-transfer on NCCL: KVPeerLostError within kv_timeout plus slack, and the
    survivor's process and GPU live on (the NCCL watchdog does not tear the process down)."""
    _needs_cuda()
    if torch.cuda.device_count() < 2:
        raise Skip("needs two GPUs")
    port = procs.free_port()
    results = procs.new_queue()
    processes = [procs.start(_nccl_victim_side, (rank, port, results), results, rank) for rank in (0, 1)]
    try:
        pids = {}
        while len(pids) < 2:
            slot, kind, value = results.get(timeout=120)
            if kind != "ready":
                raise AssertionError(f"rank {slot} did not start: {value}")
            pids[slot] = value
        time.sleep(2.0)  # payloads flow
        os.kill(pids[0], signal.SIGKILL)
        killed_at = time.monotonic()
        outcome = procs.collect(processes[1:], results, timeout=60)[1]
        detected_after = time.monotonic() - killed_at
    finally:
        procs.reap(processes)
    assert outcome["error"].startswith("KVPeerLostError"), outcome
    assert outcome["probe"] == 4.0, outcome
    assert detected_after < 2 * 5.0 + 10, f"the survivor took {detected_after:.1f} s"
    return f"KVPeerLostError after {detected_after:.1f} s, survivor alive"


def _nccl_idle_side(rank: int, port: int) -> dict[str, object]:
    """Rank 1 keeps its NCCL pipe idle while the engine-style ``torch.cuda.synchronize()`` runs; it
    must return at once, not at the peer's next frame (keepalives are kv_timeout / 4 = 5 s apart)."""
    device = torch.device("cuda", rank)
    with TorchDistributedPipe(_config(rank, port, kv_buffer_device="cuda", kv_device_index=rank)) as pipe:
        if rank == 0:
            pipe.send_tensor(_pipe_case(1).to(device), timeout=60)
            assert pipe.recv_tensor(timeout=60) is None  # rank 1 is done
            return {"ok": True}
        assert _same_bits(pipe.recv_tensor(timeout=60), _pipe_case(1))
        time.sleep(1.0)  # idle: the pipe's threads wait for the next frame
        waits = []
        for _ in range(3):
            started = time.monotonic()
            torch.cuda.synchronize(device)
            waits.append(time.monotonic() - started)
        pipe.send_tensor(None, timeout=60)
        pipe.flush(timeout=60)
    return {"longest synchronize": max(waits)}


def check_nccl_idle_synchronize() -> str:
    """An engine's device-wide ``torch.cuda.synchronize()`` while an NCCL pipe is idle returns at
    once: the pipe posts an NCCL receive only for a payload a frame announced."""
    _needs_cuda()
    if torch.cuda.device_count() < 2:
        raise Skip("needs two GPUs")
    longest = _two_sides(_nccl_idle_side, procs.free_port())[1]["longest synchronize"]
    # Keepalives are 5 s apart: a receive posted blind would hold the synchronize for seconds.
    assert longest < 1.0, f"torch.cuda.synchronize() took {longest:.2f} s on an idle pipe"
    return f"longest synchronize {longest * 1000:.1f} ms"


def check_pair_on_gpu() -> str:
    """``kvbridge pair`` with its model on the GPU."""
    raise Skip("launch/pair.py has no device option: its model runs on the CPU")


CHECKS: dict[str, Callable[[], str]] = {
    "pipe, host-staged, CUDA tensors": check_pipe_host_staged,
    "paged gather/scatter, GPU layouts": check_paged_layouts,
    "connector, 2 processes on 1 GPU": check_connector_one_gpu,
    "NCCL on one GPU refused": check_same_gpu_refused,
    "NCCL pipe, 2 GPUs": check_nccl_two_gpus,
    "NCCL peer killed: KVPeerLostError, alive": check_nccl_killed_peer,
    "NCCL idle: cuda.synchronize() at once": check_nccl_idle_synchronize,
    "kvbridge pair on the GPU": check_pair_on_gpu,
}


# ---------------------------------------------------------------------------------- the table


def _run_pytest(paths: list[str], timeout: float) -> tuple[str, str]:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return "skipped", "pytest is not installed"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *paths]
    try:
        finished = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=procs.REPO)
    except subprocess.TimeoutExpired:
        return "FAILED", f"over {timeout:.0f} s"
    lines = [line for line in finished.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else finished.stderr.strip()[-200:]
    if finished.returncode != 0:
        print(finished.stdout[-6000:], finished.stderr[-2000:], sep="\n", file=sys.stderr)
    return ("passed" if finished.returncode == 0 else "FAILED"), summary.strip("= ")


def _run_benchmark(timeout: float) -> tuple[str, str]:
    command = [sys.executable, "-m", "benchmarks.bench_host_staged", "--summary"]
    try:
        finished = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=procs.REPO)
    except subprocess.TimeoutExpired:
        return "FAILED", f"over {timeout:.0f} s"
    if finished.returncode != 0:
        print(finished.stdout[-4000:], finished.stderr[-4000:], sep="\n", file=sys.stderr)
        return "FAILED", (finished.stderr.strip().splitlines() or ["?"])[-1][:100]
    print(finished.stdout, file=sys.stderr)
    summary = [line for line in finished.stdout.splitlines() if line.startswith("summary:")]
    return "passed", summary[-1].removeprefix("summary:").strip() if summary else "no summary line"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-pytest", action="store_true", help="leave out the CPU unit tests")
    parser.add_argument("--no-bench", action="store_true", help="leave out the host-staged benchmark")
    arguments = parser.parse_args(argv)
    if gpu().type == "cpu":
        card = f"the host (a dry run of the checks), torch {torch.__version__}"
    elif not torch.cuda.is_available():
        print("no CUDA device visible to torch: nothing to check here", file=sys.stderr)
        return 2
    else:
        props = torch.cuda.get_device_properties(gpu().index)
        card = (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}"
        )
    rows: list[tuple[str, str, str, str]] = []
    if not arguments.no_pytest:
        started = time.perf_counter()
        outcome, note = _run_pytest(["tests/processes/test_gpu_setup.py"], timeout=240)
        rows.append(("CPU set-up tests (test_gpu_setup.py)", outcome, f"{time.perf_counter() - started:.0f} s", note))
    for name, check in CHECKS.items():
        started = time.perf_counter()
        try:
            outcome, note = "passed", check()
        except Skip as skip:
            outcome, note = "skipped", str(skip)
        except BaseException as exc:  # every failure goes into the table
            traceback.print_exc()
            outcome, note = "FAILED", (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:100]
        rows.append((name, outcome, f"{time.perf_counter() - started:.0f} s", note))
    if not arguments.no_bench:
        started = time.perf_counter()
        outcome, note = _run_benchmark(timeout=180)
        rows.append(("host-staged rate vs plain D2H copy", outcome, f"{time.perf_counter() - started:.0f} s", note))
    print(f"\nkvbridge GPU check on {card}\n")
    header = ("check", "result", "time", "notes")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
    for row in [header, tuple("-" * width for width in widths), *rows]:
        print("| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) + " |")
    return 1 if any(row[1] == "FAILED" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
