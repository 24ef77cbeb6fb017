"""Where a store hit's time goes in the vLLM connector, stage by stage, against the copy it must make.

No vLLM engine: a :class:`connector.vllm_store.StoreWorker` over per-layer caches of vLLM CPU's paged
layout with ``bench_store``'s KV shape (8 layers, 16 KV heads, blocks of 32 tokens, head size 128,
fp32: 4 MiB per block of all layers, 32 MiB per chunk of 256 tokens). It saves ``--chunks`` chunks,
then loads them from each tier of ``--tiers`` into a new worker (``memory``: its memory tier, filled
from the disk tier; ``disk``: the same directory; ``redis``: a redis-server started for the run, over
TCP on loopback; ``redis-unix``: the same server over its Unix socket), with and without a secret,
and times, per load:

* ``get_many``: the store read (one call for all chunks);
* ``verify + decode``: :func:`kv_store.decode_chunk` of every chunk (checksum, tag with a secret,
  header checks; the tensors view the object's bytes);
* ``scatter``: the copy of every chunk's blocks into the caches' (scattered) blocks;
* ``whole load``: ``StoreWorker.start_loads(inline=True)`` of the same chunks into other blocks,
  reported complete when it returns (what vLLM gets in a step that computes nothing else). It reads
  in a thread of its own and checks and writes each chunk while the next arrives, so it may take
  less than ``get_many`` plus the two stages after it;
* ``whole load, read then check``: the same load with the chunks checked and written only after
  all have arrived (the worker's reader replaced by one plain ``get_many``): what the overlap saves.
  The two alternate, one of each per repeat.

With ``redis`` or ``redis-unix``, more reads of the same objects frame the tier's ``get_many``: the
floor over TCP and over the Unix socket, one ``recv_into`` loop of the pipelined ``GET`` replies
from the same redis-server into one preallocated buffer (no client at all: the least any client can
do over that transport), and redis-py's own pipelined ``GET`` (its parser, with the tier's socket read
size), which the tier's reader (``kv_store/redis_reads.py``) avoids.

And per save: ``save (engine thread)`` (``wait_for_save``: the save handed to the gather thread),
``save (blocks kept for the gather thread)`` (until :meth:`StoreWorker.take_finished_sending` reports
the request, finished at once: vLLM keeps its blocks that long), ``save (to the fastest tier)``
(until :meth:`StoreWorker.flush`). Beside them, what the gather costs where it runs on the engine
thread instead: into kept buffers, into new memory each time (``torch.empty``: 4 KiB pages), and
straight into new objects (:class:`kv_store.ChunkBuilder`), the alternative the store's gather
thread does not take: the store keeps every object, so that memory is always new, and vLLM would
keep the blocks for its first touch; the gather thread copies into kept buffers instead. The
baseline, measured in the same run, is one copy of the same bytes between two warm tensors: the
least a load that writes every byte once can cost. Ratios are to it (medians of ``--repeat`` runs).

    python -m benchmarks.bench_store_path [--chunks 4] [--repeat 5] [--tiers memory,disk,redis,redis-unix]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import torch

from connector.paged import gather_blocks, scatter_blocks
from connector.vllm_store import StoreLoad, StoreSave, StoreSettings, StoreWorker
from connector.vllm_worker import find_layout
from harness import redis_servers
from harness.vllm_procs import store_identity
from kv_store import Blob, ChunkBuilder, KVStoreError, chunk_keys, decode_chunk
from kv_store.redis_tier import KEY_PREFIX, SOCKET_READ_BYTES

LAYERS, HEADS, BLOCK_SIZE, HEAD_SIZE = 8, 16, 32, 128
CHUNK_SIZE = 256
PER_CHUNK = CHUNK_SIZE // BLOCK_SIZE
LAYOUT_NAME = "CPU_ATTN/bench"


def worker(tiers: str, caches: list[torch.Tensor], secret: str | None) -> StoreWorker:
    environ = {"KVBRIDGE_KV_SECRET": secret} if secret else {}
    settings = StoreSettings.from_extra(
        {"kv_store": {"tiers": tiers, "chunk_size": CHUNK_SIZE, "memory_bytes": 4 << 30, "disk_bytes": 16 << 30}},
        environ=environ,
    )
    side = StoreWorker(settings, store_identity(LAYERS, BLOCK_SIZE, model="bench", layout="bench"))
    side.register(caches, find_layout(caches[0], caches[0].shape[0], BLOCK_SIZE, LAYOUT_NAME), LAYOUT_NAME)
    return side


def median_ms(step: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def load_stages(side: StoreWorker, tokens: list[int], chunks: int, repeat: int, round_: list[int]) -> dict[str, float]:
    """Each stage's median milliseconds for ``chunks`` chunks of ``tokens`` read by ``side``;
    every load is checked bit for bit against the blocks it was saved from."""
    caches = side._require_caches()
    keys = chunk_keys(side.namespace, tokens, CHUNK_SIZE)
    names = [key.key for key in keys]
    stages = {"get_many": median_ms(lambda: side.store.get_many(names), repeat)}
    blobs = side.store.get_many(names)
    if any(blob is None for blob in blobs):
        raise RuntimeError("a saved chunk was not found in the store")

    def decode_all() -> list[torch.Tensor]:
        return [
            decode_chunk(blob, key.key, tokens[key.start : key.stop], side.mac_key, copy=False)[0]
            for key, blob in zip(keys, blobs, strict=True)
        ]

    stages["verify + decode"] = median_ms(decode_all, repeat)
    decoded = decode_all()
    targets = [
        torch.arange(chunks * PER_CHUNK + 2 * c * PER_CHUNK, chunks * PER_CHUNK + (2 * c + 1) * PER_CHUNK)
        for c in range(chunks)
    ]  # every other chunk's worth of blocks: not one run

    def scatter_all() -> None:
        for blocks, ids in zip(decoded, targets, strict=True):
            scatter_blocks(caches.caches, caches.layout, ids, blocks)

    stages["scatter"] = median_ms(scatter_all, repeat)
    blocks = list(range(caches.num_blocks - chunks * PER_CHUNK, caches.num_blocks))

    def whole() -> float:
        round_[0] += 1
        load = StoreLoad(f"load-{round_[0]}", tokens, blocks, skip_blocks=0, stop_blocks=len(blocks))
        start = time.perf_counter()
        side.start_loads([load], {}, inline=True)
        seconds = time.perf_counter() - start
        if side.take_finished_loads(set()) != {load.req_id} or side.take_failed_blocks():
            raise RuntimeError("an inline load did not complete whole")
        return seconds

    overlapped = side._read
    times: dict[str, list[float]] = {"whole load": [], "whole load, read then check": []}
    for _ in range(repeat):
        for name in times:
            side._read = overlapped if name == "whole load" else types.MethodType(read_then_check, side)
            times[name].append(whole())
    side._read = overlapped
    stages.update((name, statistics.median(seconds) * 1e3) for name, seconds in times.items())
    return stages


def read_then_check(side: StoreWorker, req_id: str, keys: list[bytes]) -> Iterator[tuple[int, Blob | None]]:
    """``StoreWorker._read`` without its reading thread: every chunk arrives before the first is checked."""
    try:
        blobs = side.store.get_many(keys)
    except KVStoreError:
        blobs = [None] * len(keys)
    yield from enumerate(blobs)


def redis_read_rows(server: redis_servers.RedisServer, keys: list[bytes], repeat: int) -> list[tuple[str, str, float]]:
    """The floors (over TCP and over the Unix socket) and redis-py's pipelined GET of ``keys`` (the
    tier's names) from ``server``."""
    import redis

    client = redis.Redis.from_url(server.url, socket_read_size=SOCKET_READ_BYTES, socket_timeout=60)
    names = [KEY_PREFIX + key for key in keys]
    sizes = [client.strlen(name) for name in names]
    if not all(sizes):
        raise RuntimeError("a saved chunk is not in redis")
    request = b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name) for name in names)
    total = sum(len(b"$%d\r\n" % size) + size + 2 for size in sizes)
    into = memoryview(bytearray(total))
    rows = []
    tcp = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.settimeout(60)
    unix.connect(str(server.socket_path))
    for transport, sock in (("TCP on loopback", tcp), ("Unix socket", unix)):
        with sock:

            def floor(sock: socket.socket = sock) -> None:
                sock.sendall(request)
                got = 0
                while got < total:
                    got += sock.recv_into(into[got:])

            floor_ms = median_ms(floor, repeat)
        rows.append(
            (
                f"redis floor, {transport}: recv_into of the replies, no client",
                f"{total / floor_ms / 1e6:.2f}",
                floor_ms,
            )
        )

    def redis_py() -> list[bytes]:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        return pipe.execute()

    if [len(value) for value in redis_py()] != sizes:
        raise RuntimeError("redis-py read other values")
    redis_py_ms = median_ms(redis_py, repeat)
    client.close()
    return [*rows, ("get_many, redis through redis-py's parser", f"{sum(sizes) / redis_py_ms / 1e6:.2f}", redis_py_ms)]


def tier_rows(
    tier: str,
    side: StoreWorker,
    tokens: list[int],
    source: list[torch.Tensor],
    chunks: int,
    repeat: int,
    round_: list[int],
    label: str,
) -> list[tuple[str, str, float]]:
    """The load stages' rows of ``tier``, after checking the loaded blocks against ``source``'s."""
    stages = load_stages(side, tokens, chunks, repeat, round_)
    for layer, cache in enumerate(side._require_caches().caches):
        if not torch.equal(cache[-chunks * PER_CHUNK :], source[layer][: chunks * PER_CHUNK]):
            raise RuntimeError(f"a load from {tier} differs from what was saved")
    nbytes = chunks * PER_CHUNK * LAYERS * source[0][0].numel() * source[0].element_size()
    return [(f"{stage}, {tier}, {label}", f"{nbytes / ms / 1e6:.2f}", ms) for stage, ms in stages.items()]


def save_rows(
    saver: StoreWorker, tokens: list[int], chunks: int, when: str, label: str
) -> list[tuple[str, str, float]]:
    start = time.perf_counter()
    req_id = f"save-{when}"
    saver.save([StoreSave(req_id, tokens, list(range(chunks * PER_CHUNK)), first_chunk=0)])
    engine = time.perf_counter() - start
    while not saver.take_finished_sending({req_id}):  # vLLM's finished_req_ids: the request ended at once
        time.sleep(0.0005)
    gathered = time.perf_counter() - start
    saver.flush()
    stored = time.perf_counter() - start
    return [
        (f"save (engine thread), {when}, {label}", "-", engine * 1e3),
        (f"save (blocks kept for the gather thread), {when}, {label}", "-", gathered * 1e3),
        (f"save (to the fastest tier), {when}, {label}", "-", stored * 1e3),
    ]


def gather_rows(source: list[torch.Tensor], chunks: int, repeat: int) -> list[tuple[str, str, float]]:
    """The gather of ``chunks`` chunks on the engine thread, into kept buffers, into new ones
    (``torch.empty``), and into new objects (:class:`kv_store.ChunkBuilder`)."""
    layout = find_layout(source[0], source[0].shape[0], BLOCK_SIZE, LAYOUT_NAME)
    ids = [torch.arange(c * PER_CHUNK, (c + 1) * PER_CHUNK) for c in range(chunks)]
    kept = [gather_blocks(source, layout, chunk) for chunk in ids]  # the buffers exist from then on

    def into_objects() -> None:
        for chunk in ids:
            shape = (LAYERS, *layout.block_shape(source[0], PER_CHUNK))
            blocks = cast(list[torch.Tensor], ChunkBuilder(b"k", [], [(source[0].dtype, shape)], None).tensors)[0]
            gather_blocks(source, layout, chunk, lambda *_, blocks=blocks: blocks)

    return [
        (
            "gather in the step instead, into kept buffers",
            "-",
            median_ms(
                lambda: [
                    gather_blocks(source, layout, chunk, lambda *_, c=c: c) for chunk, c in zip(ids, kept, strict=True)
                ],
                repeat,
            ),
        ),
        (
            "gather in the step instead, into new buffers",
            "-",
            median_ms(lambda: [gather_blocks(source, layout, chunk) for chunk in ids], repeat),
        ),
        ("gather in the step instead, into new objects", "-", median_ms(into_objects, repeat)),
    ]


def run(chunks: int, repeat: int, tiers: list[str]) -> str:
    generator = torch.Generator().manual_seed(0)
    shape = (4 * chunks * PER_CHUNK, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    source = [torch.randn(shape, generator=generator) for _ in range(LAYERS)]
    chunk_bytes = LAYERS * PER_CHUNK * source[0][0].numel() * 4
    warm_from, warm_to = torch.randn(chunks * chunk_bytes // 4), torch.empty(chunks * chunk_bytes // 4)
    warm_to.copy_(warm_from)
    floor = median_ms(lambda: warm_to.copy_(warm_from), repeat)
    rows = [("one copy of the same bytes (baseline)", "-", floor), *gather_rows(source, chunks, repeat)]
    round_ = [0]
    with tempfile.TemporaryDirectory(prefix="bench-store-path-") as scratch:
        wants_redis = bool({"redis", "redis-unix"} & set(tiers))
        redis = redis_servers.start_server(Path(scratch) / "redis", unix=True) if wants_redis else None
        try:
            for secret in (None, "bench secret"):
                label = "with a secret" if secret else "no secret"
                shared = {
                    "disk": f"disk:{Path(scratch) / label}",
                    "redis": f"redis://127.0.0.1:{redis.port}" if redis else "",
                    "redis-unix": redis.url if redis else "",
                }
                saver = worker(
                    ",".join(["memory", shared["disk"]] + ([shared["redis"]] if redis else [])), source, secret
                )
                tokens = [5 + (index * 7919 + len(label)) % 30000 for index in range(chunks * CHUNK_SIZE)]
                rows += save_rows(saver, tokens, chunks, "first", label)  # a new worker's first save
                later = [5 + (index * 104729 + len(label)) % 30000 for index in range(chunks * CHUNK_SIZE)]
                rows += save_rows(saver, later, chunks, "later", label)
                saver.close()  # writes what its slower tiers have queued: no writes run while loads are timed
                shared["memory"] = f"memory,{shared['disk']}"
                if redis is not None and secret is None:
                    rows += redis_read_rows(
                        redis, [key.key for key in chunk_keys(saver.namespace, tokens, CHUNK_SIZE)], repeat
                    )
                for tier in tiers:
                    # A worker on this tier alone (memory: over disk, and filled from it first), so
                    # that every timed read reaches it.
                    side = worker(shared[tier], [cache.clone() for cache in source], secret)
                    try:
                        if tier == "memory":
                            side.store.get_many([key.key for key in chunk_keys(side.namespace, tokens, CHUNK_SIZE)])
                        rows += tier_rows(tier, side, tokens, source, chunks, repeat, round_, label)
                    finally:
                        side.close()
        finally:
            if redis is not None:
                redis.kill()
    lines = [
        f"{chunks} chunks of {CHUNK_SIZE} tokens, {chunk_bytes >> 20} MiB each; medians of {repeat} runs",
        "| stage | GB/s | ms | x baseline |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {rate} | {ms:.1f} | {ms / floor:.1f}x |" for name, rate, ms in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=4, help="chunks per load (default 4: a 1,024-token prompt)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each stage (default 5)")
    parser.add_argument(
        "--tiers", default="memory,disk,redis,redis-unix", help="tiers to load from, of memory,disk,redis,redis-unix"
    )
    args = parser.parse_args(argv)
    tiers = [tier.strip() for tier in args.tiers.split(",") if tier.strip()]
    if unknown := set(tiers) - {"memory", "disk", "redis", "redis-unix"}:
        parser.error(f"unknown tiers {sorted(unknown)}: choose from memory, disk, redis, redis-unix")
    if args.chunks < 1 or args.repeat < 1:
        parser.error("--chunks and --repeat must be at least 1")
    print(run(args.chunks, args.repeat, tiers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
