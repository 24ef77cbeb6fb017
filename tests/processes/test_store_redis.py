"""The Redis tier against a real redis-server (and a three-node Redis Cluster): objects written once,
many keys in one round trip, an evicted object is a miss, a dead or frozen server is a quick
KVStoreUnavailableError and the tiered store answers misses until it is back, Redis's own eviction
removes whole objects, and settings that cannot work are refused at start. Reads hand each value on
as soon as it is complete, over TCP or the server's Unix socket."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import random
import time

import pytest
import torch

from harness import procs, redis_servers
from harness.tensors import random_tensor, same_bits
from kv_store import (
    KVStoreConfigError,
    KVStoreError,
    KVStoreUnavailableError,
    MemoryTier,
    TieredStore,
    chunk_keys,
    decode_chunk,
    encode_chunk,
    namespace,
    open_store,
)
from kv_store.redis_tier import KEY_PREFIX, RedisTier

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(tmp_path):
    started = redis_servers.start_server(tmp_path / "redis")
    yield started
    started.kill()


@pytest.fixture(params=["tcp", "unix"])
def either_server(request, tmp_path):
    """A server reached over TCP on loopback, or over its Unix socket (its ``url`` says which)."""
    started = redis_servers.start_server(tmp_path / "redis", unix=request.param == "unix")
    yield started
    started.kill()


def key(index: int) -> bytes:
    return index.to_bytes(32, "little")


def watch_reader(tier: RedisTier, piece=None, after_receive=None) -> list[redis_servers.WatchedSocket]:
    """Every socket the tier's reader opens from now on, wrapped (see WatchedSocket)."""
    opened: list[redis_servers.WatchedSocket] = []
    dial = tier._reader._dial

    def watched_dial():
        opened.append(redis_servers.WatchedSocket(dial(), piece, after_receive))
        return opened[-1]

    tier._reader._dial = watched_dial
    return opened


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_an_object_is_written_once_by_the_first_writer(server):
    first, second = RedisTier(server.url), RedisTier(server.url)
    assert first.put(key(1), b"first")
    assert not second.put(key(1), b"second")
    assert second.get_many([key(1)]) == [b"first"]
    assert server.client().get(KEY_PREFIX + key(1)) == b"first"


def test_many_keys_are_read_and_checked_in_one_round_trip(server):
    tier = RedisTier(server.url)
    blobs = {key(i): os.urandom(100 + i) for i in range(0, 500, 2)}  # every other key
    for k, blob in blobs.items():
        tier.put(k, blob)
    sockets = watch_reader(tier)
    executed = []
    pipeline = tier._client.pipeline

    def counting_pipeline(**kwargs):
        pipe = pipeline(**kwargs)
        execute = pipe.execute
        pipe.execute = lambda *a, **kw: executed.append(1) or execute(*a, **kw)
        return pipe

    tier._client.pipeline = counting_pipeline
    wanted = [key(i) for i in range(500)]
    assert tier.get_many(wanted) == [blobs.get(k) for k in wanted]
    assert tier.contains_many(wanted) == [k in blobs for k in wanted]
    assert len(sockets) == 1 and sockets[0].sends == 1  # the reads
    assert len(executed) == 1  # the existence checks
    stats = tier.stats()
    assert (stats.hits, stats.misses) == (250, 250)


@pytest.mark.parametrize("unix", [False, True])
def test_open_store_reaches_redis_with_a_password(tmp_path, unix):
    server = redis_servers.start_server(tmp_path / "redis", password="pw", unix=unix)
    try:
        store = open_store(f"memory,{server.url}", redis_password="pw", redis_timeout=1.0)
        assert isinstance(store.tiers[1], RedisTier) and not store.tiers[1].cluster
        store.put(key(0), b"v")
        store.close()  # writes what is queued first
        assert server.client().get(KEY_PREFIX + key(0)) == b"v"
        with pytest.raises(KVStoreConfigError, match="refused the password"):
            open_store(f"memory,{server.url}")
    finally:
        server.kill()


def test_an_object_evicted_between_lookup_and_get_is_a_miss(server):
    tier = RedisTier(server.url)
    store = TieredStore([tier])
    for index in range(3):
        store.put(key(index), b"v%d" % index)
    assert store.lookup([key(0), key(1), key(2)]) == 3
    server.client().delete(KEY_PREFIX + key(1))  # what maxmemory eviction does
    assert store.get_many([key(0), key(1), key(2)]) == [b"v0", None, b"v2"]
    store.close()


def test_a_killed_server_is_unavailable_at_once_and_used_again_after_restart(server):
    tier = RedisTier(server.url, timeout=1.0, backoff=0.0)
    store = TieredStore([MemoryTier(1 << 20), tier])
    store.put(key(0), b"before")
    wait_until(lambda: tier.contains_many([key(0)]) == [True])
    server.kill()
    with pytest.raises(KVStoreUnavailableError, match="is down"):
        tier.get_many([key(0)])
    assert not tier.stats().up
    # The store keeps answering: the memory tier's hits, misses for the rest.
    assert store.lookup([key(0), key(1)]) == 1
    assert store.get_many([key(1), key(0)]) == [None, b"before"]
    assert store.stats().unavailable["redis"] == 2
    server.start()  # empty: nothing is persisted
    store.put(key(2), b"after")
    wait_until(lambda: server.client().get(KEY_PREFIX + key(2)) == b"after")
    assert tier.stats().up
    assert store.get_many([key(2)]) == [b"after"]
    store.close()


def test_a_frozen_server_times_out_and_is_then_skipped_without_waiting(server):
    tier = RedisTier(server.url, timeout=0.5, backoff=3600.0)
    tier.put(key(0), b"v")
    server.pause()
    try:
        with pytest.raises(KVStoreUnavailableError, match="is down"):
            tier.get_many([key(0)])
        # Within the back-off the call does not touch the network.
        tier._client.pipeline = None
        with pytest.raises(KVStoreUnavailableError, match="next try in"):
            tier.contains_many([key(0)])
        with pytest.raises(KVStoreUnavailableError, match="next try in"):
            tier.put(key(1), b"w")
    finally:
        server.resume()


def test_redis_eviction_never_leaves_part_of_an_object(tmp_path):
    server = redis_servers.start_server(tmp_path / "redis", "--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    try:
        tier = RedisTier(server.url)
        tokens = list(range(64))
        keys = [k.key for k in chunk_keys(namespace({"model": "m"}), list(range(64 * 100)), 64)]
        generator = torch.Generator().manual_seed(0)
        written = {}
        for index, chunk_key in enumerate(keys):
            tensors = [random_tensor(generator, torch.bfloat16, (2, 64, 4, 97)) for _ in range(2)]
            written[chunk_key] = tensors
            tier.put(chunk_key, encode_chunk(chunk_key, [t + 64 * index for t in tokens], tensors, None))
        stored = tier.get_many(keys)
        kept = [index for index, blob in enumerate(stored) if blob is not None]
        assert 0 < len(kept) < len(keys)  # Redis evicted some, kept some
        for index in kept:
            got = decode_chunk(stored[index], keys[index], [t + 64 * index for t in tokens], None)
            assert all(same_bits(a, b) for a, b in zip(got, written[keys[index]], strict=True))
    finally:
        server.kill()


def test_an_object_larger_than_proto_max_bulk_len_is_refused_at_start(tmp_path):
    server = redis_servers.start_server(tmp_path / "redis", "--proto-max-bulk-len", "1mb")
    try:
        tier = RedisTier(server.url)
        tier.check_object_size(1 << 20)
        with pytest.raises(KVStoreConfigError, match=r"proto-max-bulk-len \(1048576\)"):
            tier.check_object_size((1 << 20) + 1)
        # Not checked first: the write is refused and counted, the tier stays up.
        assert not tier.put(key(0), os.urandom((1 << 20) + 1))
        assert tier.stats().failed_writes == 1 and tier.stats().up
        assert tier.put(key(1), b"small")
    finally:
        server.kill()


def test_a_password_protected_server(tmp_path):
    server = redis_servers.start_server(tmp_path / "redis", password="store secret")
    try:
        with pytest.raises(KVStoreConfigError, match="refused the password"):
            RedisTier(server.url)
        with pytest.raises(KVStoreConfigError, match="refused the password"):
            RedisTier(server.url, password="wrong")
        tier = RedisTier(server.url, password="store secret")
        assert tier.put(key(0), b"v") and tier.get_many([key(0)]) == [b"v"]
    finally:
        server.kill()


def test_an_unreachable_server_or_a_bad_url_at_start():
    with pytest.raises(KVStoreUnavailableError, match="cannot reach redis"):
        RedisTier(f"redis://127.0.0.1:{procs.free_port(1)}", timeout=1.0)
    with pytest.raises(KVStoreConfigError, match="bad redis URL"):
        RedisTier("http://127.0.0.1:1")


def test_a_redis_cluster_spreads_objects_and_reads_them_across_slots(tmp_path):
    nodes = redis_servers.start_cluster(tmp_path / "cluster")
    try:
        tier = RedisTier(nodes[1].url, cluster=True)
        blobs = {key(i): os.urandom(64) for i in range(200)}
        assert all(tier.put(k, blob) for k, blob in blobs.items())
        assert not tier.put(key(0), b"again")
        wanted = [*blobs, key(999)]
        assert tier.get_many(wanted) == [*blobs.values(), None]
        assert tier.contains_many(wanted) == [True] * 200 + [False]
        assert all(node.client().dbsize() > 0 for node in nodes)
        tier.check_object_size(1 << 20)
        store = open_store(f"memory,redis+cluster://127.0.0.1:{nodes[2].port}")
        assert store.tiers[1].cluster and store.lookup(list(blobs)) == 200
        store.close()
    finally:
        for node in nodes:
            node.kill()


def test_a_dead_cluster_node_makes_the_tier_unavailable_until_it_is_back(tmp_path):
    nodes = redis_servers.start_cluster(tmp_path / "cluster")
    try:
        tier = RedisTier(nodes[0].url, cluster=True, timeout=1.0, backoff=0.0)
        keys = [key(i) for i in range(60)]
        for k in keys:
            tier.put(k, b"v")
        on_third = {stored[len(KEY_PREFIX) :] for stored in nodes[2].client().keys()}
        assert on_third and len(on_third) < len(keys)
        nodes[2].kill()
        with pytest.raises(KVStoreUnavailableError, match="is down"):
            tier.get_many(keys)
        assert not tier.stats().up
        nodes[2].start()  # rejoins the cluster, empty
        redis_servers.wait_cluster_ok(nodes)

        def answers() -> bool:
            try:
                return tier.get_many(keys) == [None if k in on_third else b"v" for k in keys]
            except KVStoreUnavailableError:
                return False

        wait_until(answers)
        assert tier.stats().up
    finally:
        for node in nodes:
            node.kill()


def test_a_full_redis_refuses_writes_counted_and_stays_up(tmp_path):
    server = redis_servers.start_server(tmp_path / "redis", "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    try:
        tier = RedisTier(server.url)
        written = [tier.put(key(i), os.urandom(100_000)) for i in range(60)]
        assert written[0] and not written[-1]
        stats = tier.stats()
        assert stats.failed_writes == written.count(False) and stats.up
        assert tier.get_many([key(0)])[0] is not None
    finally:
        server.kill()


# Reads of one server receive each value into a buffer of its announced length (kv_store.redis_reads).

ODD_SIZES = [0, 1, 2, 13, 65_535, 65_536, 65_537, (1 << 20) + 3, 3 * (1 << 20) + 7]


@pytest.mark.parametrize("pieces", ["whole", "cut up"])
def test_values_of_odd_sizes_and_misses_between_are_read_whole(either_server, pieces):
    tier = RedisTier(either_server.url)
    rng = random.Random(len(pieces))
    stored = {key(i): os.urandom(size) for i, size in enumerate(ODD_SIZES)}
    for k, blob in stored.items():
        assert tier.put(k, blob)
    wanted = [k for pair in zip(stored, [key(100 + i) for i in range(len(stored))], strict=True) for k in pair]
    rng.shuffle(wanted)
    if pieces == "cut up":  # replies split at arbitrary points, headers and CRLFs included
        watch_reader(tier, piece=lambda: rng.choice([1, 2, 3, 7, 4093, 65_536]))
    found = tier.get_many(wanted)
    assert found == [stored.get(k) for k in wanted]
    assert all(isinstance(blob, memoryview) and blob.readonly for blob in found if blob is not None)
    assert (tier.stats().hits, tier.stats().misses) == (len(stored), len(stored))
    assert tier.get_many(wanted[:3]) == [stored.get(k) for k in wanted[:3]]  # the connection is reused intact


def test_a_stored_object_read_into_a_buffer_decodes_bit_for_bit(either_server):
    tier = RedisTier(either_server.url)
    generator = torch.Generator().manual_seed(7)
    tokens = list(range(3, 67))
    chunk_key = chunk_keys(namespace({"model": "odd"}), tokens, 64)[0].key
    tensors = [
        random_tensor(generator, torch.bfloat16, (3, 5, 7, 129)),
        None,
        random_tensor(generator, torch.float32, (2, 1031)),
    ]
    assert tier.put(chunk_key, encode_chunk(chunk_key, tokens, tensors, b"k" * 32))
    (blob,) = tier.get_many([chunk_key])
    for copy in (False, True):
        got = decode_chunk(blob, chunk_key, tokens, b"k" * 32, copy=copy)
        assert all(same_bits(a, b) for a, b in zip(got, tensors, strict=True))


@pytest.mark.parametrize("unix", [False, True])
def test_a_database_other_than_0_and_a_password_reach_the_reader(tmp_path, unix):
    server = redis_servers.start_server(tmp_path / "redis", password="pw", unix=unix)
    try:
        tier = RedisTier(server.url + ("?db=3" if unix else "/3"), password="pw")
        assert tier._reader is not None and tier._reader.db == 3
        assert tier.put(key(0), b"in three")
        assert tier.get_many([key(0), key(1)]) == [b"in three", None]
        assert server.client().get(KEY_PREFIX + key(0)) is None  # not in database 0
    finally:
        server.kill()


def test_reads_from_many_threads_at_once_each_get_their_values(either_server):
    tier = RedisTier(either_server.url)
    stored = {key(i): os.urandom(50_000 + 4099 * i) for i in range(40)}
    for k, blob in stored.items():
        tier.put(k, blob)
    sockets = watch_reader(tier)

    def read(seed: int) -> bool:
        wanted = random.Random(seed).sample([*stored, key(999)], 12)
        return all(tier.get_many(wanted) == [stored.get(k) for k in wanted] for _ in range(5))

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert all(pool.map(read, range(24)))
    assert 1 <= len(sockets) <= 6  # connections are kept and shared, one call at a time each


def test_a_server_killed_in_the_middle_of_a_value_is_unavailable_then_used_after_restart(either_server):
    server = either_server
    tier = RedisTier(server.url, timeout=5.0, backoff=0.0)
    big = os.urandom(64 << 20)  # far more than the socket buffers hold: most of it dies with the server
    assert tier.put(key(0), big) and tier.put(key(1), b"small")

    def kill_once(received: int) -> None:
        if server.process.poll() is None:
            server.kill()

    sockets = watch_reader(tier, after_receive=kill_once)
    handed: list[tuple[int, bytes]] = []
    with pytest.raises(KVStoreUnavailableError, match="closed the connection in the middle of a reply|reset"):
        tier.get_each([key(1), key(0)], lambda index, blob: handed.append((index, bytes(blob))))
    assert 0 < sockets[0].received < len(big) and not tier.stats().up
    # The value complete before the server died was handed on, and counted; the one cut short was not.
    assert handed == [(0, b"small")] and (tier.stats().hits, tier.stats().misses) == (1, 0)
    with pytest.raises(KVStoreUnavailableError):
        tier.get_many([key(1)])  # nothing listens any more
    del tier._reader._dial  # unwatched: the hook would kill the new server too
    server.start()  # empty
    assert tier.put(key(2), b"after")
    assert tier.get_many([key(2), key(0)]) == [b"after", None]
    assert tier.stats().up


def test_each_value_is_handed_on_before_the_next_is_received(either_server):
    tier = RedisTier(either_server.url)
    stored = {key(i): os.urandom(size) for i, size in enumerate([3 << 20, (1 << 20) + 5, (2 << 20) + 1, 1 << 20])}
    for k, blob in stored.items():
        assert tier.put(k, blob)
    wanted = [key(2), key(9), key(0), key(1), key(3)]  # key(9): a miss, never handed on
    sockets = watch_reader(tier, piece=lambda: 4093)
    handed: list[tuple[int, bytes, int]] = []
    found = tier.get_each(wanted, lambda index, blob: handed.append((index, bytes(blob), sockets[0].received)))
    assert found == [stored.get(k) for k in wanted]
    assert [(index, blob) for index, blob, _ in handed] == [(i, stored[wanted[i]]) for i in (0, 2, 3, 4)]
    # Bytes received when each value was handed on: its own and those before it, not all of the next
    # one (at most a few headers and one receive of 4093 bytes beyond it).
    before = 0
    for (_, blob, received), later in zip(handed, [*handed[1:], None], strict=True):
        before += len(blob)
        assert received >= before
        if later is not None:
            assert received < before + len(later[1])
    assert (tier.stats().hits, tier.stats().misses) == (4, 1)


def test_a_tiered_store_hands_on_each_blob_and_promotes_it_as_redis_reads_it(either_server):
    memory, redis_tier = MemoryTier(1 << 30), RedisTier(either_server.url)
    store = TieredStore([memory, redis_tier])
    stored = {key(i): os.urandom(100_000 + 7 * i) for i in range(5)}
    for k, blob in stored.items():
        assert redis_tier.put(k, blob)
    assert memory.put(key(1), stored[key(1)])
    wanted = [key(3), key(1), key(50), key(0), key(4), key(2)]
    handed: dict[int, bytes] = {}

    def each(index: int, blob) -> None:
        assert index not in handed
        handed[index] = bytes(blob)

    assert store.get_many(wanted, each) == [stored.get(k) for k in wanted]
    assert handed == {i: stored[k] for i, k in enumerate(wanted) if k in stored}
    stats = store.stats()
    assert stats.promotions == 4 and (stats.tiers["redis"].hits, stats.tiers["redis"].misses) == (4, 1)
    assert memory.get_many([key(0), key(2), key(3), key(4)]) == [stored[key(i)] for i in (0, 2, 3, 4)]
    store.close()


def test_a_server_frozen_in_the_middle_of_a_value_times_out_and_is_read_again_when_it_thaws(server):
    tier = RedisTier(server.url, timeout=0.5, backoff=0.0)
    big = os.urandom(32 << 20)
    assert tier.put(key(0), big)
    paused = []

    def freeze_once(received: int) -> None:
        if not paused:
            server.pause()
            paused.append(received)

    watch_reader(tier, after_receive=freeze_once)
    try:
        with pytest.raises(KVStoreUnavailableError, match="is down.*timed out"):
            tier.get_many([key(0)])
        assert not tier.stats().up
    finally:
        server.resume()
    assert tier.get_many([key(0)]) == [big]  # on a new connection: the broken one was closed
    assert tier.stats().up


def test_a_value_longer_than_an_object_may_be_is_refused_and_the_connection_dropped(server):
    tier = RedisTier(server.url)
    tier.max_object_bytes = 1000
    server.client().set(KEY_PREFIX + key(0), os.urandom(1000))
    server.client().set(KEY_PREFIX + key(1), os.urandom(4 << 20))
    sockets = watch_reader(tier)
    with pytest.raises(KVStoreError, match=f"announced a value of {4 << 20} bytes, more than the 1000") as refused:
        tier.get_many([key(0), key(1)])
    assert not isinstance(refused.value, KVStoreUnavailableError) and tier.stats().up
    assert sockets[0].received < 1 << 20  # the long value was not received
    assert tier.get_many([key(0)]) == [server.client().get(KEY_PREFIX + key(0))]
    assert len(sockets) == 2


def test_an_error_reply_names_the_error(server):
    tier = RedisTier(server.url)
    server.client().rpush(KEY_PREFIX + key(0), b"a list, not an object")
    tier.put(key(1), b"v")
    with pytest.raises(KVStoreError, match="answered a GET with an error: WRONGTYPE"):
        tier.get_many([key(1), key(0)])
    assert tier.stats().up and tier.get_many([key(1)]) == [b"v"]


@pytest.mark.parametrize(
    ("reply", "named"),
    [
        (b"+OK\r\n", "sent b'\\+OK' where a GET's reply belongs"),
        (b":12\r\n", "where a GET's reply belongs"),
        (b"$abc\r\n", "sent b'\\$abc' where"),
        (b"$-2\r\n", "where a GET's reply belongs"),
        (b"$3\r\nabcdef\r\n", "longer than it announced"),
        (b"$1\r\na\r\n$1\r\nb\r\n", "bytes after the last reply"),
        (b"$" + b"9" * 5000, "a line of more than 4096 bytes"),
    ],
)
def test_a_reply_that_is_not_a_get_reply_is_refused_by_name(server, reply, named):
    tier = RedisTier(server.url)
    with redis_servers.CannedServer(reply) as canned:
        tier._reader.address = ("127.0.0.1", canned.port)
        with pytest.raises(KVStoreError, match=named) as refused:
            tier.get_many([key(0)])
    assert not isinstance(refused.value, KVStoreUnavailableError) and tier.stats().up


def test_a_server_down_at_start_is_a_tier_that_starts_down_and_is_used_once_it_answers(tmp_path, caplog):
    port = procs.free_port(1)
    url = f"redis://127.0.0.1:{port}"
    caplog.set_level(logging.INFO, logger="kv_store.redis_tier")
    # The scheduler's and the worker's tier of one instance: one line per change, not one per tier.
    tiers = [RedisTier(url, timeout=1.0, backoff=0.0, start_down=True) for _ in range(2)]
    assert not any(tier.stats().up for tier in tiers)
    for tier in tiers:
        with pytest.raises(KVStoreUnavailableError, match="is down"):
            tier.get_many([key(0)])
        with pytest.raises(KVStoreUnavailableError, match="is down"):
            tier.put(key(0), b"v")
    server = redis_servers.RedisServer(port, tmp_path / "redis", ["--proto-max-bulk-len", "2mb"])
    server.directory.mkdir()
    server.start()
    try:
        assert tiers[0].put(key(0), b"v") and tiers[1].get_many([key(0), key(1)]) == [b"v", None]
        assert all(tier.stats().up for tier in tiers)
        assert tiers[1].max_object_bytes == 2 << 20  # asked once the server answered
        messages = [record.getMessage() for record in caplog.records]
        assert sum(" is down (" in message for message in messages) == 1, messages
        assert messages.count(f"redis at {url} answers again") == 1, messages
    finally:
        server.kill()
    with pytest.raises(KVStoreUnavailableError, match="cannot reach redis"):
        RedisTier(url, timeout=1.0)  # without start_down: an error at start


def test_a_kept_connection_the_server_closed_is_replaced_not_failed(server):
    tier = RedisTier(server.url, timeout=1.0)
    sockets = watch_reader(tier)
    assert tier.get_many([key(0)]) == [None]  # one connection, kept
    server.kill()
    server.start()  # the same port, empty: the kept connection is closed at the other end
    assert tier.put(key(0), b"after a restart")
    assert tier.get_many([key(0)]) == [b"after a restart"]
    assert len(sockets) == 2 and tier.stats().up


def test_a_read_tries_the_server_even_within_the_back_off(server):
    """A read follows a lookup that found the keys: it must not fail a promised load unasked."""
    tier = RedisTier(server.url, timeout=0.5, backoff=3600.0)
    assert tier.put(key(0), b"v")
    server.pause()
    try:
        with pytest.raises(KVStoreUnavailableError, match="is down"):
            tier.contains_many([key(0)])
    finally:
        server.resume()
    with pytest.raises(KVStoreUnavailableError, match="next try in"):
        tier.contains_many([key(0)])
    assert tier.get_many([key(0)]) == [b"v"] and tier.stats().up
    assert tier.contains_many([key(0)]) == [True]  # up again: no back-off left
