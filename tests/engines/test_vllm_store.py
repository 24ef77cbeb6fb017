"""The storage tier inside vLLM: a ``kv_both`` instance stores what it computes, and a new instance
on the same store loads it, with vLLM's real engine in process on the tiny random Llama.

Each instance's greedy tokens are compared with a plain engine's; loads are counted by the
connector's own store counters (blocks written from stored chunks), not by vLLM's hit counter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from connector.transfer_plan import transfer_prefix_len
from connector.vllm_store import (
    StoreLoad,
    StoreSave,
    StoreScheduler,
    StoreSettings,
    StoreWorker,
    identity_namespace,
)
from connector.vllm_worker import find_layout
from harness import store_procs as sp
from harness import vllm_procs as vp
from harness.vllm_fakes import make_request, new_req_data, poll_until_reported, scheduler_output
from kv_pipe import cores
from kv_pipe.errors import KVConfigError
from kv_store import chunk_keys

CHUNK = sp.CHUNK_SIZE
#: Prompts of about 3-4 chunks, among them one of exactly 4 chunks (its last block is vLLM's to compute).
PROMPT_LENGTHS = (200, 241, 4 * CHUNK)
#: Bytes of one block of every layer of the tiny Llama: 2 layers x 2 KV heads x 32 tokens x (K + V of 64) x fp32.
BLOCK_BYTES = 2 * 2 * vp.BLOCK_SIZE * 2 * 64 * 4


# ---------------------------------------------------------------------- settings


def test_settings_from_a_spec_string_or_a_mapping(tmp_path: Path) -> None:
    plain = StoreSettings.from_extra({"kv_store": f"disk:{tmp_path}"}, environ={})
    assert (plain.tiers, plain.chunk_size, plain.redis_password, plain.secret) == (f"disk:{tmp_path}", 256, None, None)
    password = tmp_path / "password"
    password.write_text("hunter2\n")
    password.chmod(0o600)
    full = StoreSettings.from_extra(
        {
            "kv_store": {
                "tiers": f"memory,disk:{tmp_path}",
                "chunk_size": 64,
                "memory_bytes": 5 << 20,
                "redis_password_file": str(password),
            }
        },
        environ={"KVBRIDGE_KV_SECRET": "s3"},
    )
    assert (full.chunk_size, full.memory_bytes, full.redis_password, full.secret) == (64, 5 << 20, "hunter2", "s3")
    from_env = StoreSettings.from_extra({"kv_store": "redis://127.0.0.1:1"}, environ={"KVBRIDGE_STORE_PASSWORD": "pw"})
    assert from_env.redis_password == "pw"
    assert "pw" not in repr(from_env)


@pytest.mark.parametrize(
    ("store", "named"),
    [
        ({"tiers": "disk:/x", "redis_password": "pw"}, "redis_password"),
        ("redis://:pw@127.0.0.1:6379", "credentials"),
        ("memory", "disk or Redis"),
        ({"tiers": "disk:/x", "chunk_size": 0}, "chunk_size"),
        ({"tiers": "disk:/x", "chunk": 64}, "unknown kv_store keys"),
        (["disk:/x"], "spec string or a mapping"),
    ],
)
def test_settings_errors_name_the_setting(store: object, named: str) -> None:
    with pytest.raises(KVConfigError, match=named):
        StoreSettings.from_extra({"kv_store": store}, environ={})


def test_store_settings_take_no_transfer_options() -> None:
    with pytest.raises(KVConfigError, match="kv_ip"):
        StoreSettings.from_extra({"kv_store": "disk:/x", "kv_ip": "127.0.0.1"}, environ={})


# ---------------------------------------------------------------------- scheduler side

B = vp.BLOCK_SIZE
SPACE = identity_namespace(vp.store_identity(2, B, model="m"))


def _scheduler(tmp_path: Path) -> StoreScheduler:
    settings = StoreSettings.from_extra({"kv_store": {"tiers": f"disk:{tmp_path}", "chunk_size": CHUNK}}, environ={})
    return StoreScheduler(settings, B, [SPACE], settings.open())


def test_chunks_must_be_whole_blocks(tmp_path: Path) -> None:
    settings = StoreSettings.from_extra({"kv_store": {"tiers": f"disk:{tmp_path}", "chunk_size": B + 16}}, environ={})
    with pytest.raises(KVConfigError, match="multiple of vLLM's block size"):
        StoreScheduler(settings, B, [SPACE], settings.open())


def test_scheduler_claims_stored_chunks_up_to_the_blocks_before_the_last_token(tmp_path: Path) -> None:
    side = _scheduler(tmp_path)
    tokens = list(range(100, 100 + 4 * CHUNK))  # 4 full chunks; the last token's block is vLLM's
    request = make_request("r", tokens)
    assert side.num_new_matched_tokens(request, 0) == 0
    keys = chunk_keys(SPACE, tokens, CHUNK)
    for key in keys[:3]:
        side.store.put(key.key, b"x")
    assert side.num_new_matched_tokens(request, 0) == 3 * CHUNK
    assert side.num_new_matched_tokens(request, B) == 3 * CHUNK - B  # vLLM's prefix cache holds one block
    side.store.put(keys[3].key, b"x")
    assert side.num_new_matched_tokens(request, B) == len(tokens) - B - B
    side.after_alloc(request, list(range(10, 18)), len(tokens) - 2 * B)
    meta = side.build_meta(scheduler_output([], {}), lambda req_id: [])
    assert meta.loads == [StoreLoad("r", tokens, list(range(10, 17)), skip_blocks=1, stop_blocks=7)]
    assert meta.load_inline  # the step computes nothing else: the worker loads in it
    assert side.num_new_matched_tokens(request, B) == 0  # one load per request
    side.store.close()


def test_loads_run_in_the_step_only_when_it_computes_nothing_else(tmp_path: Path) -> None:
    side = _scheduler(tmp_path)
    tokens = list(range(100, 100 + 2 * CHUNK + 1))
    for key in chunk_keys(SPACE, tokens, CHUNK):
        side.store.put(key.key, b"x")
    other = make_request("running", list(range(5, 50)))
    for name in ("a", "b"):
        request = make_request(name, tokens)
        assert side.num_new_matched_tokens(request, 0) == 2 * CHUNK
        side.after_alloc(request, list(range(10, 20)), 2 * CHUNK)
    busy = side.build_meta(scheduler_output([new_req_data(other, [1, 2], 0)], {"running": 45}), lambda r: [1, 2])
    assert [load.req_id for load in busy.loads] == ["a", "b"] and not busy.load_inline  # others wait for the step
    idle = side.build_meta(scheduler_output([], {}), lambda req_id: [])
    assert idle.loads == [] and not idle.load_inline  # nothing to load
    side.store.close()


def test_scheduler_saves_the_unstored_full_chunks_once_the_prompt_is_computed(tmp_path: Path) -> None:
    side = _scheduler(tmp_path)
    tokens = list(range(7, 7 + 3 * CHUNK + 5))
    side.store.put(chunk_keys(SPACE, tokens, CHUNK)[0].key, b"x")
    request = make_request("r", tokens)
    assert side.num_new_matched_tokens(request, 0) == CHUNK
    side.after_alloc(request, list(range(20, 27)), CHUNK)
    blocks = list(range(20, 27))
    first = side.build_meta(scheduler_output([new_req_data(request, blocks, CHUNK)], {"r": 96}), lambda r: blocks)
    assert first.saves == []  # chunked prefill: the third chunk is not computed yet
    second = side.build_meta(scheduler_output([], {"r": 101}, cached=_cached("r", CHUNK + 96)), lambda r: blocks)
    assert second.saves == [StoreSave("r", tokens[: 3 * CHUNK], blocks[:6], first_chunk=1)]
    third = side.build_meta(scheduler_output([], {"r": 1}, cached=_cached("r", len(tokens))), lambda r: blocks)
    assert third.saves == []  # saved once
    side.store.close()


def test_an_allocation_the_plan_does_not_cover_is_refused_whole(tmp_path: Path) -> None:
    """vLLM waits for every asynchronous claim: one that cannot be loaded as planned is handed to
    the worker to report failed, and no block of it is written."""
    side = _scheduler(tmp_path)
    tokens = list(range(3, 3 + 2 * CHUNK + 1))
    for key in chunk_keys(SPACE, tokens, CHUNK):
        side.store.put(key.key, b"x")
    request = make_request("r", tokens)
    assert side.num_new_matched_tokens(request, 0) == 2 * CHUNK
    side.after_alloc(request, [4, 5, 6], 2 * CHUNK - B)  # fewer external tokens than claimed
    meta = side.build_meta(scheduler_output([], {}), lambda req_id: [])
    assert meta.loads == [] and meta.refused == {"r": [4, 5, 6]}
    side.store.close()


def _cached(req_id: str, computed: int):
    from harness.vllm_fakes import cached_data

    return cached_data([req_id], [computed])


# ---------------------------------------------------------------------- worker side

FB = vp.FAKE_BLOCK_SIZE
FAKE_CHUNK = 2 * FB


def _worker(
    path: Path | str, caches: list[torch.Tensor], layout_name: str = "CPU_ATTN/vec", environ: dict | None = None
) -> StoreWorker:
    tiers = path if isinstance(path, str) else f"memory,disk:{path}"
    settings = StoreSettings.from_extra({"kv_store": {"tiers": tiers, "chunk_size": FAKE_CHUNK}}, environ=environ or {})
    identity = vp.store_identity(len(caches), FB)
    worker = StoreWorker(settings, identity)
    worker.register(caches, find_layout(caches[0], vp.FAKE_BLOCKS, FB, layout_name), layout_name)
    return worker


def _load(worker: StoreWorker, load: StoreLoad) -> set[int]:
    worker.start_loads([load], {})
    polls = poll_until_reported(worker, {load.req_id})
    return set().union(*(failed for _, failed in polls))


def test_worker_round_trip_is_bit_exact_and_writes_only_the_claimed_blocks(tmp_path: Path) -> None:
    tokens = list(range(50, 50 + 3 * FAKE_CHUNK + 1))
    source = vp.fake_caches(1)
    saver = _worker(tmp_path, source)
    saver.save([StoreSave("s", tokens[: 3 * FAKE_CHUNK], [3, 7, 1, 5, 0, 8], first_chunk=0)])
    saver.flush()
    saver.close()
    assert saver.stats().chunks_saved == 3
    target = vp.fake_caches(2)
    before = [cache.clone() for cache in target]
    loader = _worker(tmp_path, target)  # a new worker: reads the disk tier
    # Blocks 0 (vLLM's prefix cache) and 5 (past the claim) are not written.
    load = StoreLoad("l", tokens[: 3 * FAKE_CHUNK], [2, 4, 6, 8, 0, 1], skip_blocks=1, stop_blocks=5)
    assert _load(loader, load) == set()
    for layer, cache in enumerate(target):
        for src, dst in zip([7, 1, 5, 0], [4, 6, 8, 0], strict=True):
            assert torch.equal(cache[dst], source[layer][src])
        for untouched in (2, 1, 3, 5, 7):
            assert torch.equal(cache[untouched], before[layer][untouched])
    stats = loader.stats()
    assert (stats.chunks_loaded, stats.chunks_failed) == (3, 0)
    assert stats.bytes_loaded == 4 * len(target) * target[0][0].numel() * 4
    loader.close()


def test_each_saved_object_keeps_its_own_blocks_when_vllm_writes_them_again(tmp_path: Path) -> None:
    """The blocks are gathered straight into each object: an object stored in the memory tier must
    not change when vLLM reuses the blocks for the next request, nor when the next save runs."""
    source = vp.fake_caches(1)
    saver = _worker(tmp_path, source)
    prompts = [list(range(start, start + 2 * FAKE_CHUNK)) for start in (10, 500, 900)]
    blocks = [3, 7, 1, 5]
    saved = []
    for seed, tokens in enumerate(prompts):
        saved.append([cache.clone() for cache in source])
        saver.save([StoreSave(f"s{tokens[0]}", tokens, blocks, first_chunk=0)])
        saver.flush()
        generator = torch.Generator().manual_seed(100 + seed)
        for cache in source:  # the next request computes into the same blocks
            cache.copy_(torch.randn(cache.shape, generator=generator, dtype=cache.dtype))
    assert saver.stats().chunks_saved == 2 * len(prompts)
    for tokens, before in zip(prompts, saved, strict=True):  # from the saver's own memory tier
        assert _load(saver, StoreLoad(f"l{tokens[0]}", tokens, [2, 4, 6, 8], skip_blocks=0, stop_blocks=4)) == set()
        for layer, cache in enumerate(saver._require_caches().caches):
            for src, dst in zip(blocks, [2, 4, 6, 8], strict=True):
                assert torch.equal(cache[dst], before[layer][src])
    assert saver.store.stats().tiers["memory"].hits == 2 * len(prompts)
    saver.close()


def _stored(path: Path, tokens: list[int], block_ids: list[int]) -> list[torch.Tensor]:
    """The caches whose blocks ``block_ids`` a worker stored as the chunks of ``tokens`` under ``path``."""
    source = vp.fake_caches(1)
    saver = _worker(path, source)
    saver.save([StoreSave("s", tokens, block_ids, first_chunk=0)])
    saver.flush()
    saver.close()
    return source


def test_an_inline_load_is_complete_and_reported_when_start_loads_returns(tmp_path: Path) -> None:
    tokens = list(range(60, 60 + 2 * FAKE_CHUNK))
    source = _stored(tmp_path, tokens, [3, 7, 1, 5])
    target = vp.fake_caches(2)
    before = [cache.clone() for cache in target]
    loader = _worker(tmp_path, target)
    good = StoreLoad("good", tokens, [2, 4, 6, 8], skip_blocks=1, stop_blocks=4)
    missing = StoreLoad("missing", list(range(900, 900 + 2 * FAKE_CHUNK)), [0, 5], skip_blocks=0, stop_blocks=2)
    loader.start_loads([good, missing], {"refused": [1]}, inline=True)
    # No poll loop: vLLM's get_finished right after start_load_kv, in the same step, sees them all.
    assert loader.take_finished_loads(set()) == {"good", "missing", "refused"}
    assert loader.take_failed_blocks() == {0, 5, 1}
    for layer, cache in enumerate(target):
        for src, dst in zip([7, 1, 5], [4, 6, 8], strict=True):
            assert torch.equal(cache[dst], source[layer][src])
        for untouched in (0, 1, 2, 3, 5, 7):
            assert torch.equal(cache[untouched], before[layer][untouched])
    assert (loader.stats().chunks_loaded, loader.stats().chunks_failed) == (2, 1)
    loader.close()


def test_a_load_naming_a_block_outside_the_cache_fails_whole_and_writes_nothing(tmp_path: Path) -> None:
    tokens = list(range(50, 50 + 2 * FAKE_CHUNK))
    _stored(tmp_path, tokens, [3, 7, 1, 5])
    target = vp.fake_caches(2)
    before = [cache.clone() for cache in target]
    loader = _worker(tmp_path, target)
    outside = target[0].shape[0]  # one past the last block
    load = StoreLoad("l", tokens, [2, 4, 6, outside], skip_blocks=0, stop_blocks=4)
    assert _load(loader, load) == {2, 4, 6, outside}
    assert all(torch.equal(cache, old) for cache, old in zip(target, before, strict=True))
    assert loader.stats().chunks_loaded == 0
    loader.close()


def test_workers_share_chunks_through_redis_with_the_password_from_the_environment(tmp_path: Path) -> None:
    from harness import redis_servers

    server = redis_servers.start_server(tmp_path / "redis", password="pw-7")
    try:
        tiers = f"memory,{server.url}"
        with pytest.raises(KVConfigError):  # no password: refused at start, naming the setting
            _worker(tiers, vp.fake_caches(1))
        environ = {"KVBRIDGE_STORE_PASSWORD": "pw-7"}
        tokens = list(range(40, 40 + 2 * FAKE_CHUNK))
        source = vp.fake_caches(1)
        saver = _worker(tiers, source, environ=environ)
        saver.save([StoreSave("s", tokens, [8, 2, 6, 0], first_chunk=0)])
        saver.flush()
        saver.close()  # drains the queue to Redis
        target = vp.fake_caches(2)
        loader = _worker(tiers, target, environ=environ)  # its memory tier is empty: Redis serves
        assert _load(loader, StoreLoad("l", tokens, [1, 3, 5, 7], skip_blocks=0, stop_blocks=4)) == set()
        for layer, cache in enumerate(target):
            for src, dst in zip([8, 2, 6, 0], [1, 3, 5, 7], strict=True):
                assert torch.equal(cache[dst], source[layer][src])
        loader.close()
    finally:
        server.kill()


def test_redis_killed_between_the_lookup_and_the_load_fails_the_claimed_blocks(tmp_path: Path) -> None:
    """The one window a dead store costs a promised load: vLLM then recomputes those blocks under
    "recompute" and fails the request under "fail". Once the tier is down, lookups miss."""
    from harness import redis_servers

    server = redis_servers.start_server(tmp_path / "redis")
    try:
        tokens = list(range(30, 30 + 2 * FAKE_CHUNK))
        saver = _worker(server.url, vp.fake_caches(1))
        saver.save([StoreSave("s", tokens, [8, 2, 6, 0], first_chunk=0)])
        saver.flush()
        saver.close()
        target = vp.fake_caches(2)
        before = [cache.clone() for cache in target]
        loader = _worker(server.url, target)
        keys = [key.key for key in chunk_keys(loader.namespace, tokens, FAKE_CHUNK)]
        assert loader.store.lookup(keys) == 2  # what the scheduler's lookup found: both chunks claimed
        server.kill()
        assert _load(loader, StoreLoad("l", tokens, [1, 3, 5, 7], skip_blocks=0, stop_blocks=4)) == {1, 3, 5, 7}
        assert all(torch.equal(cache, old) for cache, old in zip(target, before, strict=True))
        data = loader.take_stats().data
        assert data["store_load_errors"] == {"missing": 2} and data["store_tier_up"] == {"redis": 0}
        assert loader.store.lookup(keys) == 0  # down: a miss, nothing more is claimed
        loader.close()
    finally:
        server.kill()


def test_redis_killed_in_the_middle_of_a_load_keeps_the_chunks_that_arrived_whole(tmp_path: Path) -> None:
    """Over the server's Unix socket: each chunk is checked and written as soon as it has arrived,
    so the chunk before the one the server died in is loaded bit for bit; the rest fail, unwritten."""
    from harness import redis_servers

    server = redis_servers.start_server(tmp_path / "redis", unix=True)
    try:
        tokens = list(range(70, 70 + 3 * FAKE_CHUNK))
        source = vp.fake_caches(1)
        saver = _worker(server.url, source)
        saver.save([StoreSave("s", tokens, [8, 2, 6, 0, 4, 1], first_chunk=0)])
        saver.flush()
        saver.close()
        target = vp.fake_caches(2)
        before = [cache.clone() for cache in target]
        loader = _worker(server.url, target)
        reader = loader.store.tiers[0].tier._reader
        assert reader.where == str(server.socket_path)
        first = server.client().strlen(next(iter(server.client().keys())))  # every chunk's object is this long
        dial = reader._dial

        def kill_in_the_second(received: int) -> None:
            if received > first + first // 2:
                server.kill()
                # What the reader meets once it has drained what the server sent before it died
                # (these objects are small enough for the socket's buffer to hold all of them).
                raise ConnectionResetError("the server died in the middle of the second chunk")

        reader._dial = lambda: redis_servers.WatchedSocket(dial(), lambda: 500, kill_in_the_second)
        load = StoreLoad("l", tokens, [3, 5, 7, 2, 4, 6], skip_blocks=0, stop_blocks=6)
        assert _load(loader, load) == {7, 2, 4, 6}
        for layer, cache in enumerate(target):
            for src, dst in zip([8, 2], [3, 5], strict=True):
                assert torch.equal(cache[dst], source[layer][src])
            for untouched in (0, 1, 2, 4, 6, 7, 8):
                assert torch.equal(cache[untouched], before[layer][untouched])
        data = loader.take_stats().data
        assert data["store_load_errors"] == {"missing": 2} and data["store_tier_up"] == {"redis": 0}
        assert (loader.stats().chunks_loaded, loader.stats().chunks_failed) == (1, 2)
        loader.close()
    finally:
        server.kill()


@pytest.mark.parametrize("change", ["other secret", "other layout", "missing", "corrupted"])
def test_a_chunk_that_fails_a_check_is_a_load_error_and_writes_nothing(tmp_path: Path, change: str) -> None:
    tokens = list(range(9, 9 + 2 * FAKE_CHUNK))
    saver = _worker(tmp_path, vp.fake_caches(1), environ={"KVBRIDGE_KV_SECRET": "one"})
    saver.save([StoreSave("s", tokens, [3, 7, 1, 5], first_chunk=0 if change != "missing" else 1)])
    saver.flush()
    saver.close()
    if change == "corrupted":
        victim = next(f for f in tmp_path.rglob("*") if f.is_file() and not f.name.startswith("."))
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0x10
        victim.write_bytes(bytes(data))
    target = vp.fake_caches(2)
    before = [cache.clone() for cache in target]
    secret = "two" if change == "other secret" else "one"
    layout = "CPU_ATTN/amx" if change == "other layout" else "CPU_ATTN/vec"
    loader = _worker(tmp_path, target, layout_name=layout, environ={"KVBRIDGE_KV_SECRET": secret})
    failed = _load(loader, StoreLoad("l", tokens, [2, 4, 6, 8], skip_blocks=0, stop_blocks=4))
    bad = {2, 4, 6, 8} if change in ("other secret", "other layout") else {2, 4} if change == "missing" else None
    if bad is None:  # one of the two chunks, whichever file was hit
        assert failed in ({2, 4}, {6, 8})
        bad = failed
    assert failed == bad
    for layer, cache in enumerate(target):
        for block in bad:
            assert torch.equal(cache[block], before[layer][block])
    assert loader.stats().chunks_failed == len(bad) // 2
    loader.close()


def test_worker_stats_carry_each_tier_the_latencies_and_load_errors_per_interval(tmp_path: Path) -> None:
    tokens = list(range(70, 70 + 3 * FAKE_CHUNK))
    source = vp.fake_caches(1)
    chunk_bytes = 2 * len(source) * source[0][0].numel() * 4  # two blocks of every layer, float32
    saver = _worker(tmp_path, source)
    saver.save([StoreSave("s", tokens[: 2 * FAKE_CHUNK], [3, 7, 1, 5], first_chunk=0)])
    saver.flush()
    saved = saver.take_stats().data
    saver.close()  # writes the disk tier
    assert len(saved["store_save_seconds"]) == 2 and saved["store_load_seconds"] == []
    assert saved["store_written_bytes"]["memory"] > 2 * chunk_bytes
    assert saved["store_tier_up"] == {"memory": 1, "disk": 1}
    target = vp.fake_caches(2)
    loader = _worker(tmp_path, target)  # its memory tier is empty: the disk serves
    first = loader.take_stats()
    assert first.data["store_tier_up"] == {"memory": 1, "disk": 1} and not first.data["store_read_bytes"]
    # The third chunk was never saved: a miss in both tiers, its blocks a load error.
    assert _load(loader, StoreLoad("l", tokens, [2, 4, 6, 8, 0, 1], skip_blocks=0, stop_blocks=6)) == {0, 1}
    data = loader.take_stats().data
    assert data["store_hit_chunks"] == {"disk": 2}
    assert data["store_miss_chunks"] == {"memory": 3, "disk": 1}
    assert data["store_read_bytes"] == {"disk": saved["store_written_bytes"]["memory"]}
    assert data["store_written_bytes"] == {"memory": saved["store_written_bytes"]["memory"]}  # copied up
    assert data["store_load_errors"] == {"missing": 1}
    assert len(data["store_load_seconds"]) == 1 and data["store_save_seconds"] == []
    assert data["store_tier_up"] == {}  # unchanged since the last interval
    # Again: the memory tier serves now.
    assert _load(loader, StoreLoad("m", tokens[: 2 * FAKE_CHUNK], [8, 3, 5, 7], skip_blocks=0, stop_blocks=4)) == set()
    again = loader.take_stats()
    assert again.data["store_hit_chunks"] == {"memory": 2} and again.data["store_miss_chunks"] == {}
    assert again.data["store_read_bytes"] == {"memory": data["store_read_bytes"]["disk"]}
    assert loader.take_stats().is_empty()
    loader.close()


def test_a_full_memory_tier_reports_its_evictions(tmp_path: Path) -> None:
    tokens = list(range(5, 5 + 3 * FAKE_CHUNK))
    source = vp.fake_caches(3)
    chunk_bytes = 2 * len(source) * source[0][0].numel() * 4
    settings = StoreSettings.from_extra(
        {
            "kv_store": {
                "tiers": f"memory,disk:{tmp_path}",
                "chunk_size": FAKE_CHUNK,
                "memory_bytes": chunk_bytes * 3 // 2,
            }
        },
        environ={},
    )
    identity = vp.store_identity(len(source), FB)
    worker = StoreWorker(settings, identity)
    worker.register(source, find_layout(source[0], vp.FAKE_BLOCKS, FB, "CPU_ATTN/vec"), "CPU_ATTN/vec")
    worker.save([StoreSave("s", tokens, [3, 7, 1, 5, 0, 8], first_chunk=0)])
    worker.flush()
    data = worker.take_stats().data
    worker.close()
    # Each chunk makes room by evicting the one before: the memory tier holds one at a time.
    assert data["store_evictions"] == {"memory": 2}


# ---------------------------------------------------------------------- engines


def _prompts() -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(7)
    prompts = [rng.integers(5, vp.VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    # Shares only its first chunk with the first prompt.
    shared = prompts[0][:CHUNK] + rng.integers(5, vp.VOCAB, 150).tolist()
    return prompts, shared


def _loaded_blocks(prompt: list[int], stored_chunks: int) -> int:
    return min(stored_chunks * CHUNK, transfer_prefix_len(len(prompt), vp.BLOCK_SIZE)) // vp.BLOCK_SIZE


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vp.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _reference_and_a_storing_instance(
    tiny_model: str, spec: str, prompts: list[list[int]], shared: list[int]
) -> tuple[list[list[int]], dict]:
    """One plain engine's tokens for ``prompts`` and ``shared``, and the results of instance "a",
    which serves ``prompts`` and stores them in ``spec``; both engines side by side."""
    with vp.Engines() as engines:
        engines.start("reference", vp.reference_body, vp.engine_env(0), model=tiny_model, prompts=prompts + [shared])
        engines.start(
            "a",
            sp.store_body,
            vp.engine_env(1),
            model=tiny_model,
            transfer=sp.store_transfer_config(spec),
            batches=[prompts],
        )
        results = engines.wait(["reference", "a"], timeout=300)
    return [o["tokens"] for o in results["reference"]], results


def test_a_new_instance_loads_what_another_stored(tiny_model: str, tmp_path: Path) -> None:
    prompts, shared = _prompts()
    store = tmp_path / "store"
    spec = f"disk:{store}"
    reference, results = _reference_and_a_storing_instance(tiny_model, spec, prompts, shared)
    a = results["a"]
    assert [o["tokens"] for o in a["outputs"][0]] == reference[:3]
    assert a["stats"]["chunks_saved"] == sum(len(p) // CHUNK for p in prompts)
    assert a["stats"]["chunks_loaded"] == 0

    # B: a new instance on the same directory; "fail" turns any load error into a failed request.
    # vLLM's own prefix cache is off, so every reused block comes from the store.
    with vp.Engines() as engines:
        engines.start(
            "b",
            sp.store_body,
            vp.engine_env(0),
            model=tiny_model,
            transfer=sp.store_transfer_config(spec, failure_policy="fail"),
            batches=[prompts, [shared]],
            prefix_caching=False,
        )
        b = engines.wait(["b"], timeout=300)["b"]
    assert [o["tokens"] for o in b["outputs"][0] + b["outputs"][1]] == reference
    assert all(o["finish"] == "length" for o in b["outputs"][0] + b["outputs"][1])
    blocks = sum(_loaded_blocks(p, len(p) // CHUNK) for p in prompts) + _loaded_blocks(shared, 1)
    assert b["stats"]["bytes_loaded"] == blocks * BLOCK_BYTES
    assert b["stats"]["chunks_loaded"] == sum(-(-_loaded_blocks(p, len(p) // CHUNK) // 2) for p in prompts) + 1
    assert b["stats"]["chunks_failed"] == 0
    # The shared prompt's own full chunks after the first one were stored by B.
    assert b["stats"]["chunks_saved"] == len(shared) // CHUNK - 1

    # A corrupted object: its chunk is a load error, recomputed under "recompute": same tokens.
    victim = max((f for f in store.rglob("*") if f.is_file() and not f.name.startswith(".")), key=lambda f: f.name)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with vp.Engines() as engines:
        engines.start(
            "c",
            sp.store_body,
            vp.engine_env(0),
            model=tiny_model,
            transfer=sp.store_transfer_config(spec),
            batches=[prompts + [shared]],
            prefix_caching=False,
        )
        c = engines.wait(["c"], timeout=300)["c"]
    assert [o["tokens"] for o in c["outputs"][0]] == reference
    # Every prompt's stored chunks are claimed; the first chunk is the first and the last prompt's
    # both, so a damaged first chunk fails twice.
    claimed = sum(-(-_loaded_blocks(p, len(p) // CHUNK) // 2) for p in prompts + [shared])
    failed = c["stats"]["chunks_failed"]
    assert failed in (1, 2) and c["stats"]["chunks_loaded"] == claimed - failed


def test_instances_split_into_scheduler_and_worker_processes_share_the_store(tiny_model: str, tmp_path: Path) -> None:
    """vLLM's multiprocess mode on the loading instance: the scheduler's lookups and the worker's
    loads and saves run in two processes (the plan crosses pickled); its tokens equal a plain
    engine's under "fail"."""
    prompts, shared = _prompts()
    spec = f"disk:{tmp_path / 'store'}"
    reference, _ = _reference_and_a_storing_instance(tiny_model, spec, prompts, shared)
    with vp.Engines() as engines:
        engines.start(
            "b",
            sp.store_body,
            vp.engine_env(0, multiprocess=True),
            model=tiny_model,
            transfer=sp.store_transfer_config(spec, failure_policy="fail"),
            batches=[prompts + [shared]],
            prefix_caching=False,
        )
        (outputs,) = engines.wait(["b"], timeout=300)["b"]["outputs"]
    assert [o["tokens"] for o in outputs] == reference
    # No prefix cache on B: what vLLM counts as cached came from the store.
    assert [o["cached"] for o in outputs] == [_loaded_blocks(p, len(p) // CHUNK) * vp.BLOCK_SIZE for p in prompts] + [
        CHUNK
    ]


def test_an_instance_outlives_its_redis_down_at_start_killed_and_restarted(tiny_model: str, tmp_path: Path) -> None:
    """One instance on a Redis of its own, under "fail": any chunk claimed and then not loaded would
    fail a request, so a store that is down must be a miss at lookup. Redis is down at start, then
    up (stored, then hit), killed (every request still served, recomputed; "down" said once, the
    tier down), restarted on the same port, empty (stored and hit again, the tier up)."""
    from harness import procs, redis_servers

    prompts, _ = _prompts()
    server = redis_servers.RedisServer(procs.free_port(1), tmp_path / "redis", [])
    server.directory.mkdir()
    stored_chunks = sum(len(p) // CHUNK for p in prompts)
    claimed_chunks = sum(-(-_loaded_blocks(p, len(p) // CHUNK) // 2) for p in prompts)
    with vp.Engines() as engines:
        rounds, answers = engines.queue(), engines.queue()
        engines.start("reference", vp.reference_body, vp.engine_env(0), model=tiny_model, prompts=prompts)
        engines.start(
            "instance",
            sp.store_rounds_body,
            vp.engine_env(1),
            model=tiny_model,
            transfer=sp.store_transfer_config(server.url, failure_policy="fail"),
            prompts=prompts,
            rounds=rounds,
            answers=answers,
            timeout=600,
        )
        reference = [o["tokens"] for o in engines.wait(["reference"], timeout=300)["reference"]]

        def serve() -> dict:
            rounds.put(True)
            answer = answers.get(timeout=300)
            assert answer["tokens"] == reference and set(answer["finish"]) == {"length"}
            return answer

        def downs(answer: dict) -> int:
            return sum(f"redis at {server.url} is down (" in line for line in answer["log"])

        def ups(answer: dict) -> int:
            return answer["log"].count(f"redis at {server.url} answers again")

        def serve_until_stored() -> dict:
            """Rounds until the tier's back-off let it try again and it stored every chunk."""
            for _ in range(20):
                answer = serve()
                if server.client().dbsize() == stored_chunks:
                    return answer
            raise AssertionError(f"redis holds {server.client().dbsize()} of {stored_chunks} chunks")

        try:
            started_down = serve()
            assert not started_down["up"] and downs(started_down) == 1 and ups(started_down) == 0
            assert started_down["stats"]["chunks_loaded"] == 0

            server.start()
            stored = serve_until_stored()
            assert stored["up"] and downs(stored) == 1 and ups(stored) == 1
            hit = serve()
            assert hit["stats"]["chunks_loaded"] == stored["stats"]["chunks_loaded"] + claimed_chunks
            assert hit["stats"]["chunks_failed"] == 0

            server.kill()
            for _ in range(2):
                dead = serve()
                assert not dead["up"] and downs(dead) == 2 and ups(dead) == 1  # one line for the outage
                assert dead["stats"]["chunks_loaded"] == hit["stats"]["chunks_loaded"]
                assert dead["stats"]["chunks_failed"] == 0  # never claimed, so never failed

            server.start()  # the same port, empty
            back = serve_until_stored()
            assert back["up"] and ups(back) == 2 and downs(back) == 2
            again = serve()
            assert again["stats"]["chunks_loaded"] == back["stats"]["chunks_loaded"] + claimed_chunks
            assert again["stats"]["chunks_failed"] == 0
        finally:
            rounds.put(False)
            server.kill()
        engines.wait(["instance"], timeout=300)


@pytest.mark.timeout(900)
def test_the_store_threads_of_a_worker_bound_to_core_0_run_on_the_other_cores(tiny_model: str, tmp_path: Path) -> None:
    """vLLM binds its worker (compute threads and main thread) to core 0; the store's gather and save
    threads, started from the worker's engine thread, run on the process's other cores."""
    allowed = cores.allowed_cores()
    rng = np.random.default_rng(23)
    prompts = [rng.integers(5, vp.VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    with vp.Engines() as engines:
        engines.start("reference", vp.reference_body, vp.engine_env(1), model=tiny_model, prompts=prompts)
        engines.start(
            "store",
            sp.worker_process_store_body,
            vp.engine_env(0),
            model=tiny_model,
            transfer=sp.store_transfer_config(f"disk:{tmp_path / 'store'}"),
            prompts=prompts,
        )
        results = engines.wait(["reference", "store"], timeout=840)
    assert [o["tokens"] for o in results["store"]["outputs"]] == [o["tokens"] for o in results["reference"]]
    threads = results["store"]["threads"]
    assert threads["main"] == [0]
    others = sorted(allowed - {0}) or [0]  # a one-core process has nowhere else to go
    for prefix in ("kvbridge-store-gather", "kvbridge-store-save"):
        named = {name: cpus for name, cpus in threads.items() if name.startswith(prefix)}
        assert named, f"no {prefix} thread in the worker: {sorted(threads)}"
        assert all(cpus == others for cpus in named.values()), named
