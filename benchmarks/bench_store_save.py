"""The CPU a store save spends, stage by stage, against the least any design must spend.

A cold round of ``bench_store`` (store empty) saves every prompt it computes while the next one
computes on the same cores, so the save's CPU time is what it takes from the engine. No vLLM engine
here: a :class:`connector.vllm_store.StoreWorker` over caches of ``bench_store``'s KV shape (see
``benchmarks/bench_store_path.py``: 32 MiB per chunk of 256 tokens), saving ``--chunks`` chunks per
request (4: the 1,024-token documents of ``bench_store``, 128 MiB). CPU time is the measure
(``time.thread_time`` of the thread doing a stage, ``resource.getrusage`` of this process for a
whole save, ``/proc`` for redis-server's), not wall-clock time, which other work on the machine
stretches.

The floor, per request: one copy of the blocks into memory already touched and into new memory
(``torch.empty``: 4 KiB pages, which objects use; a NumPy array: huge pages), one BLAKE3 pass, and each tier's own
unavoidable write of the object: memory keeps it (nothing), disk one ``os.write``, Redis one
``sendall`` of a ``SET`` on a raw socket plus redis-server's CPU to receive and store it.

The stages: the gather of a request's chunks out of the paged caches
(:func:`connector.paged.gather_blocks`) into new memory (``torch.empty``), into kept memory, and
straight into the objects (:class:`kv_store.ChunkBuilder`: the alternative, which would hold vLLM's
blocks for the first touch of new memory), the objects' seal (the BLAKE3 pass),
:func:`kv_store.encode_chunk` of gathered chunks (a copy and the seal: what the store's put thread
does with the kept buffers its gather thread filled), each tier's ``put`` of the objects. Then whole saves
(:meth:`StoreWorker.save` until every tier holds the objects), per tier spec: the process's CPU and
redis-server's. Ratios are to the floor of the same tiers (medians of ``--repeat`` runs).

    python -m benchmarks.bench_store_save [--chunks 4] [--repeat 5]
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy
import torch
from blake3 import blake3

from benchmarks.bench_store_path import BLOCK_SIZE, CHUNK_SIZE, HEAD_SIZE, HEADS, LAYERS, LAYOUT_NAME, PER_CHUNK, worker
from connector.paged import gather_blocks
from connector.vllm_store import StoreSave
from connector.vllm_worker import find_layout
from harness import redis_servers
from kv_store import ChunkBuilder, chunk_keys, encode_chunk
from kv_store.disk import DiskTier
from kv_store.memory import MemoryTier
from kv_store.redis_tier import RedisTier


def thread_ms(step: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None) -> float:
    """The median CPU time of ``step`` on this thread (``setup`` before each, not counted)."""
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.thread_time()
        step()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def server_cpu(server: redis_servers.RedisServer) -> float:
    """redis-server's CPU seconds so far (utime + stime of /proc/PID/stat)."""
    fields = Path(f"/proc/{server.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def huge_page_empty(nbytes: int) -> numpy.ndarray:
    return numpy.empty(nbytes, dtype=numpy.uint8)  # NumPy madvises huge pages for large arrays


def floor_rows(
    chunk_bytes: int, chunks: int, repeat: int, scratch: Path, server: redis_servers.RedisServer
) -> dict[str, float]:
    source = [torch.randn(chunk_bytes // 4) for _ in range(chunks)]
    kept = [torch.empty_like(part) for part in source]

    def copy_into(targets: Callable[[], list[torch.Tensor]]) -> None:
        for target, part in zip(targets(), source, strict=True):
            target.copy_(part)

    def hash_all() -> None:
        for part in source:
            blake3(memoryview(part.numpy()).cast("B")).digest()

    def write_files() -> None:
        for index, part in enumerate(source):
            fd = os.open(scratch / f"floor-{index}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                os.write(fd, memoryview(part.numpy()).cast("B"))
            finally:
                os.close(fd)

    connection = socket.create_connection(("127.0.0.1", server.port))
    reply = bytearray(64)

    def send_sets() -> None:
        for index, part in enumerate(source):
            key = b"floor-%d" % index
            connection.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, chunk_bytes))
            connection.sendall(memoryview(part.numpy()).cast("B"))
            connection.sendall(b"\r\n")
            connection.recv_into(reply)

    def clear_floor_keys() -> None:
        server.client().delete(*[b"floor-%d" % index for index in range(chunks)])

    copy_into(lambda: kept)
    rows = {
        "copy into kept memory": thread_ms(lambda: copy_into(lambda: kept), repeat),
        "copy into new memory (torch.empty)": thread_ms(
            lambda: copy_into(lambda: [torch.empty_like(part) for part in source]), repeat
        ),
        "copy into new memory (huge pages)": thread_ms(
            lambda: copy_into(
                lambda: [torch.from_numpy(huge_page_empty(chunk_bytes)).view(torch.float32) for _ in source]
            ),
            repeat,
        ),
        "blake3": thread_ms(hash_all, repeat),
        "disk: os.write": thread_ms(write_files, repeat),
    }
    client, server_seconds = [], []
    for _ in range(repeat):
        clear_floor_keys()
        before_server, before = server_cpu(server), time.thread_time()
        send_sets()
        client.append(time.thread_time() - before)
        time.sleep(0.05)  # the server's CPU counters catch up
        server_seconds.append(server_cpu(server) - before_server)
    connection.close()
    clear_floor_keys()
    rows["redis: sendall"] = statistics.median(client) * 1e3
    rows["redis: redis-server receives"] = statistics.median(server_seconds) * 1e3
    return rows


def stage_rows(
    source: list[torch.Tensor], chunks: int, repeat: int, scratch: Path, server: redis_servers.RedisServer
) -> dict[str, float]:
    layout = find_layout(source[0], source[0].shape[0], BLOCK_SIZE, LAYOUT_NAME)
    ids = [torch.arange(c * PER_CHUNK, (c + 1) * PER_CHUNK) for c in range(chunks)]
    kept = [gather_blocks(source, layout, chunk) for chunk in ids]

    buffers = itertools.cycle(kept)

    def into_kept(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return next(buffers)

    tag = torch.arange(32, dtype=torch.uint8)
    tokens = list(range(chunks * CHUNK_SIZE))
    keys = [chunk.key for chunk in chunk_keys(b"n" * 32, tokens, CHUNK_SIZE)]
    blobs = [
        encode_chunk(key, tokens[c * CHUNK_SIZE : (c + 1) * CHUNK_SIZE], [kept[c], tag], None)
        for c, key in enumerate(keys)
    ]
    specs = [(kept[0].dtype, tuple(kept[0].shape)), (tag.dtype, tuple(tag.shape))]
    builders: list[ChunkBuilder] = []

    def new_builders() -> None:
        builders[:] = [
            ChunkBuilder(key, tokens[c * CHUNK_SIZE : (c + 1) * CHUNK_SIZE], specs, None) for c, key in enumerate(keys)
        ]

    def gather_into_objects() -> None:
        for builder, chunk in zip(builders, ids, strict=True):
            blocks = cast(list[torch.Tensor], builder.tensors)[0]
            gather_blocks(source, layout, chunk, lambda *_, blocks=blocks: blocks)

    rows = {
        "gather into new memory (torch.empty)": thread_ms(
            lambda: [gather_blocks(source, layout, chunk) for chunk in ids], repeat
        ),
        "gather into kept memory": thread_ms(
            lambda: [gather_blocks(source, layout, chunk, into_kept) for chunk in ids], repeat
        ),
        "gather into the objects (ChunkBuilder)": thread_ms(gather_into_objects, repeat, new_builders),
        "seal (blake3)": thread_ms(lambda: [builder.seal() for builder in builders], 1),
        "encode_chunk": thread_ms(
            lambda: [
                encode_chunk(key, tokens[c * CHUNK_SIZE : (c + 1) * CHUNK_SIZE], [kept[c], tag], None)
                for c, key in enumerate(keys)
            ],
            repeat,
        ),
    }
    memory = MemoryTier(4 << 30)
    rows["memory: put"] = thread_ms(
        lambda: [memory.put(key, blob) for key, blob in zip(keys, blobs, strict=True)], repeat, memory.close
    )
    disk = DiskTier(scratch / "stage-disk", 16 << 30)
    rows["disk: put"] = thread_ms(
        lambda: [disk.put(key, blob) for key, blob in zip(keys, blobs, strict=True)],
        repeat,
        lambda: [path.unlink() for path in (scratch / "stage-disk").rglob("*") if path.is_file()],
    )
    tier = RedisTier(f"redis://127.0.0.1:{server.port}")
    client, server_seconds = [], []
    for _ in range(repeat):
        server.client().flushdb()
        before_server, before = server_cpu(server), time.thread_time()
        for key, blob in zip(keys, blobs, strict=True):
            tier.put(key, blob)
        client.append(time.thread_time() - before)
        time.sleep(0.05)
        server_seconds.append(server_cpu(server) - before_server)
    tier.close()
    server.client().flushdb()
    rows["redis: put"] = statistics.median(client) * 1e3
    rows["redis: redis-server receives"] = statistics.median(server_seconds) * 1e3
    return rows


def whole_save_rows(
    source: list[torch.Tensor], chunks: int, repeat: int, scratch: Path, server: redis_servers.RedisServer
) -> dict[str, tuple[float, float]]:
    """Per tier spec: the process's CPU ms and redis-server's for one request's save, from
    ``save`` until every tier holds its objects (the worker closed: its queues written)."""
    specs = {
        "memory,disk": f"memory,disk:{scratch / 'save-disk'}",
        "memory,redis": f"memory,redis://127.0.0.1:{server.port}",
        "disk": f"disk:{scratch / 'save-disk-only'}",
        "redis": f"redis://127.0.0.1:{server.port}",
    }
    rows: dict[str, tuple[float, float]] = {}
    for name, spec in specs.items():
        ours, theirs = [], []
        for run in range(repeat + 1):  # the first run makes the worker's threads: not counted
            server.client().flushdb()
            side = worker(spec, source, None)
            tokens = [5 + (index * 7919 + run) % 30000 for index in range(chunks * CHUNK_SIZE)]
            before, before_server = process_cpu(), server_cpu(server)
            side.save([StoreSave(f"save-{run}", tokens, list(range(chunks * PER_CHUNK)), first_chunk=0)])
            while not side.take_finished_sending({f"save-{run}"}):
                time.sleep(0.01)
            side.flush()
            side.store.close()  # the slower tiers' queues written
            spent = process_cpu() - before
            time.sleep(0.05)
            if run:
                ours.append(spent)
                theirs.append(server_cpu(server) - before_server)
            side.close()
            for path in sorted(scratch.glob("save-disk*/**/*"), reverse=True):
                if path.is_file():
                    path.unlink()
        rows[name] = (statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3)
    return rows


def run(chunks: int, repeat: int) -> str:
    torch.set_num_threads(1)  # every copy on the thread that is timed, as in the store's threads
    generator = torch.Generator().manual_seed(0)
    shape = (chunks * PER_CHUNK, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    source = [torch.randn(shape, generator=generator) for _ in range(LAYERS)]
    chunk_bytes = LAYERS * PER_CHUNK * source[0][0].numel() * 4
    with tempfile.TemporaryDirectory(prefix="bench-store-save-") as name:
        scratch = Path(name)
        server = redis_servers.start_server(scratch / "redis")
        try:
            floor = floor_rows(chunk_bytes, chunks, repeat, scratch, server)
            stages = stage_rows(source, chunks, repeat, scratch, server)
            saves = whole_save_rows(source, chunks, repeat, scratch, server)
        finally:
            server.kill()
    base = floor["copy into kept memory"] + floor["blake3"]
    floors = {
        "memory,disk": base + floor["disk: os.write"],
        "memory,redis": base + floor["redis: sendall"] + floor["redis: redis-server receives"],
        "disk": base + floor["disk: os.write"],
        "redis": base + floor["redis: sendall"] + floor["redis: redis-server receives"],
    }
    lines = [
        f"{chunks} chunks of {CHUNK_SIZE} tokens per request, {chunk_bytes >> 20} MiB each; "
        f"CPU ms per request, medians of {repeat} runs",
        "| floor item | CPU ms |",
        "|---|---|",
        *(f"| {item} | {ms:.1f} |" for item, ms in floor.items()),
        "",
        "| stage | CPU ms |",
        "|---|---|",
        *(f"| {stage} | {ms:.1f} |" for stage, ms in stages.items()),
        "",
        "| whole save, tiers | this process CPU ms | redis-server CPU ms | floor CPU ms | x floor |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {ours:.1f} | {theirs:.1f} | {floors[name]:.1f} | {(ours + theirs) / floors[name]:.2f}x |"
            for name, (ours, theirs) in saves.items()
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=4, help="chunks per request (default 4: a 1,024-token prompt)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each stage (default 5)")
    args = parser.parse_args(argv)
    if args.chunks < 1 or args.repeat < 1:
        parser.error("--chunks and --repeat must be at least 1")
    print(run(args.chunks, args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
