"""A full lookup buffer that evicts (``kv_evict_unclaimed``): the oldest entries nobody selected give way
to new inserts, never the reverse. The store alone, then a SimpleBuffer pair in two processes and a
BufferListener with a consumer over real pipes."""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from connector.transfer_state import KVConnectorConfig
from connector.vllm_settings import ConnectorSettings
from harness import buffer_procs as bodies
from harness import procs
from harness.tensors import random_tensor, same_bits
from kv_pipe import KVTransferConfig
from kv_pipe.errors import KVBufferFullError, KVConfigError
from lookup_buffer import BufferListener, SimpleBuffer, dial
from lookup_buffer import store as store_module
from lookup_buffer.config import BufferConfig
from lookup_buffer.loans import EVICTED, SENT, Loan
from lookup_buffer.matching import MatchKey, token_arrays
from lookup_buffer.producer import make_entry
from lookup_buffer.store import Entry, EntryStore, Part

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
EVICTING = BufferConfig(kv_evict_unclaimed=True)


def request(index: int, nbytes: int = 4096) -> list[torch.Tensor | None]:
    """``[tokens, roi, key, value, hidden]`` of request ``index``: random KV, tokens unique to it."""
    generator = torch.Generator().manual_seed(1000 + index)
    tokens = torch.randint(1, 1 << 40, (8,), generator=generator)
    tokens[0] = index + 1
    key = random_tensor(generator, torch.bfloat16, (2, nbytes // 8))  # nbytes / 2
    value = random_tensor(generator, torch.float32, (nbytes // 8,))  # nbytes / 2
    return [tokens, torch.ones(8, dtype=torch.bool), key, value, None]


def stored(index: int, nbytes: int = 4096) -> tuple[MatchKey, Entry, list]:
    """Request ``index`` as the store holds it, with a loan to watch what becomes of it."""
    given = request(index, nbytes)
    key, entry = make_entry(*given)
    entry.loan = Loan()
    return key, entry, given


def raw(index: int, nbytes: int) -> tuple[MatchKey, Entry]:
    """An entry of exactly ``nbytes`` random bytes under its own key, with a loan."""
    generator = torch.Generator().manual_seed(2000 + index)
    key = MatchKey(*token_arrays(torch.tensor([index + 1]), torch.ones(1, dtype=torch.bool)))
    return key, Entry((random_tensor(generator, torch.uint8, (nbytes,)),), nbytes, loan=Loan())


def same_entry(got: Entry | None, want: Entry) -> bool:
    return (
        got is not None
        and len(got.items) == len(want.items)
        and all(same_bits(a, b) for a, b in zip(got.items, want.items, strict=True))
    )


# ---------------------------------------------------------------------------------------------- the store


def _whole_and_newer(store: EntryStore) -> tuple[list, MatchKey, Entry, MatchKey, Entry]:
    """A splittable entry stored, then a newer one, then a quarter of the first taken: its three
    other quarters stay stored as parts."""
    whole_given = _splittable(0)
    whole_key, whole = make_entry(*whole_given)
    newer_key, newer = make_entry(*_splittable(1))
    store.put(whole_key, whole, timeout=0)
    time.sleep(0.001)  # a later monotonic time: the newer entry expires later
    store.put(newer_key, newer, timeout=0)
    taken = store.pop_part(whole_key, (1, 0, 1))
    assert same_bits(taken.items[1], whole_given[2][:, 0:1])
    return whole_given, whole_key, whole, newer_key, newer


def test_the_parts_of_a_split_entry_expire_and_are_evicted_as_old_as_the_entry() -> None:
    store = EntryStore(capacity_bytes=1 << 20, max_item_bytes=1 << 20, entry_timeout=100.0)
    _, whole_key, whole, newer_key, newer = _whole_and_newer(store)
    assert newer.expires > whole.expires
    entries, _ = store.expire(now=whole.expires)  # the whole entry's time: its parts go, the newer stays
    assert entries == 3 and store.counters().entries == 1
    assert store.pop_part(whole_key, (1, 1, 2)) is None
    assert store.pop(newer_key) is newer

    capacity = 2 * make_entry(*_splittable(0))[1].nbytes
    store = EntryStore(capacity_bytes=capacity, max_item_bytes=1 << 20, evict_unclaimed=True)
    given, whole_key, _, newer_key, newer = _whole_and_newer(store)
    # One byte more than the room left: the oldest stored, the second quarter, is evicted, not the newer entry.
    store.put(*raw(7, capacity - store.counters().bytes + 1), timeout=0)
    assert store.counters().evicted == 1
    assert store.pop_part(whole_key, (1, 1, 2)) is None
    assert same_bits(store.pop_part(whole_key, (1, 2, 3)).items[1], given[2][:, 2:3])
    assert store.pop(newer_key) is newer


def test_a_full_store_evicts_the_oldest_unclaimed_entries_for_new_ones() -> None:
    made = [stored(index) for index in range(5)]
    size = made[0][1].nbytes
    assert all(entry.nbytes == size for _, entry, _ in made)
    store = EntryStore(capacity_bytes=3 * size + size // 2, max_item_bytes=1 << 20, evict_unclaimed=True)
    for key, entry, _ in made:
        store.put(key, entry, timeout=0)  # never waits, never refused
    counters = store.counters()
    assert (counters.evicted, counters.entries, counters.bytes, counters.inserts, counters.rejected) == (
        2,
        3,
        3 * size,
        5,
        0,
    )
    assert [entry.loan.outcome for _, entry, _ in made] == [EVICTED, EVICTED, None, None, None]
    for key, _, _ in made[:2]:
        assert store.pop(key) is None  # evicted: a select misses
    for key, entry, given in made[2:]:
        got = store.pop(key)
        assert same_entry(got, entry)
        assert same_bits(got.items[1], given[2]) and same_bits(got.items[2], given[3])  # bit-exact
        assert got.loan.outcome is None  # its loan is the selecting consumer's to end
    counters = store.counters()
    assert (counters.evicted, counters.entries, counters.bytes) == (2, 0, 0)
    assert counters.peak_bytes <= 3 * size + size // 2


def test_a_large_entry_evicts_as_many_of_the_oldest_as_it_needs_and_no_more() -> None:
    store = EntryStore(capacity_bytes=1000, max_item_bytes=1000, evict_unclaimed=True)
    sizes = {"a": 300, "b": 200, "c": 250, "d": 150, "e": 450, "f": 100, "g": 600}
    made = {name: raw(index, size) for index, (name, size) in enumerate(sizes.items())}

    def put(name: str) -> None:
        store.put(made[name][0], made[name][1], timeout=0)

    def evicted() -> list[str]:
        return [name for name, (_, entry) in made.items() if entry.loan.outcome == EVICTED]

    for name in "abcd":  # 900 bytes
        put(name)
    assert evicted() == []
    put("e")  # 450 more: a (300) is not enough, a and b (500) are
    assert evicted() == ["a", "b"] and store.counters().bytes == 850
    put("f")  # fits as it is
    assert evicted() == ["a", "b"] and store.counters().bytes == 950
    with pytest.raises(KVBufferFullError, match="does not fit"):
        store.put(*raw(99, 1001), timeout=0)  # larger than the budget: refused at once, nothing evicted
    assert evicted() == ["a", "b"] and store.counters().rejected == 1
    put("g")  # 600 more: c, d and e go, f stays
    assert evicted() == ["a", "b", "c", "d", "e"]
    counters = store.counters()
    assert (counters.evicted, counters.entries, counters.bytes) == (5, 2, 700)
    for name in "abcde":
        assert store.pop(made[name][0]) is None
    for name in "fg":
        assert same_entry(store.pop(made[name][0]), made[name][1])


def test_a_popped_entry_is_never_evicted_and_one_key_stays_first_in_first_out() -> None:
    store = EntryStore(capacity_bytes=3000, max_item_bytes=3000, evict_unclaimed=True)
    taken_key, taken = raw(0, 1000)
    twin_key, older_twin = raw(1, 1000)
    _, newer_twin = raw(1, 1000)  # same key as older_twin
    store.put(taken_key, taken, timeout=0)
    store.put(twin_key, older_twin, timeout=0)
    store.put(twin_key, newer_twin, timeout=0)
    assert store.pop(taken_key) is taken  # selected: its bytes leave the budget at once
    others = [raw(index, 1000) for index in (2, 3)]
    for key, entry in others:
        store.put(key, entry, timeout=0)
    # Room for the first without eviction; the second evicts the oldest stored entry, the older twin.
    assert taken.loan.outcome is None and older_twin.loan.outcome == EVICTED and newer_twin.loan.outcome is None
    assert same_bits(taken.items[0], raw(0, 1000)[1].items[0])  # the taker's entry is intact
    assert store.pop(twin_key) is newer_twin and store.pop(twin_key) is None
    assert [store.pop(key) for key, _ in others] == [entry for _, entry in others]
    assert store.counters().evicted == 1


def test_without_eviction_a_full_store_still_refuses_after_its_timeout() -> None:
    store = EntryStore(capacity_bytes=2000, max_item_bytes=2000)  # the default: backpressure
    made = [raw(index, 1000) for index in range(3)]
    for key, entry in made[:2]:
        store.put(key, entry, timeout=0)
    with pytest.raises(KVBufferFullError, match="full"):
        store.put(*made[2], timeout=0.05)
    counters = store.counters()
    assert (counters.evicted, counters.entries, counters.rejected) == (0, 2, 1)
    assert [entry.loan.outcome for _, entry in made] == [None, None, None]


def test_evictions_are_logged_with_their_counts_at_most_once_per_interval(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(store_module, "EVICTION_LOG_INTERVAL", 3600.0)
    store = EntryStore(capacity_bytes=2000, max_item_bytes=2000, evict_unclaimed=True)
    with caplog.at_level(logging.WARNING, logger=store_module.__name__):
        for index in range(6):
            store.put(*raw(index, 1000), timeout=0)
        store.expire()
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # the first eviction; the next three wait for the interval
    assert "1 entries (1000 bytes)" in warnings[0] and "1 evicted in all" in warnings[0]
    caplog.clear()
    monkeypatch.setattr(store, "_next_eviction_log", 0.0)  # the interval has passed
    with caplog.at_level(logging.WARNING, logger=store_module.__name__):
        store.expire()  # the periodic call reports what the inserts did not
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "3 entries (3000 bytes)" in warnings[0] and "4 evicted in all" in warnings[0]


# ---------------------------------------------------------------------------------------------- the setting


def test_the_setting_is_validated_read_from_the_environment_and_on_in_the_vllm_connector() -> None:
    assert BufferConfig().kv_evict_unclaimed is False
    with pytest.raises(KVConfigError, match="kv_evict_unclaimed"):
        BufferConfig(kv_evict_unclaimed="yes")
    assert BufferConfig.from_env({"KVBRIDGE_KV_EVICT_UNCLAIMED": "true"}).kv_evict_unclaimed is True
    assert BufferConfig.from_env({"KVBRIDGE_KV_EVICT_UNCLAIMED": "0"}).kv_evict_unclaimed is False
    with pytest.raises(KVConfigError, match="KVBRIDGE_KV_EVICT_UNCLAIMED"):
        BufferConfig.from_env({"KVBRIDGE_KV_EVICT_UNCLAIMED": "maybe"})
    environment = {"KVBRIDGE_KV_EVICT_UNCLAIMED": "yes", "KVBRIDGE_KV_ENTRY_TIMEOUT": "7.5"}
    assert KVConnectorConfig.from_env(KVTransferConfig(), environment).buffer == BufferConfig(7.5, True)
    with pytest.raises(KVConfigError, match="kv_entry_timeout"):
        BufferConfig(kv_entry_timeout=math.inf)
    producer = ConnectorSettings.from_vllm("kv_producer", 20000, "cpu", {"kv_ip": HOST}, {})
    assert producer.buffer.kv_evict_unclaimed is True
    backpressure = ConnectorSettings.from_vllm(
        "kv_producer", 20000, "cpu", {"kv_evict_unclaimed": False, "kv_entry_timeout": 9}, {}
    )
    assert backpressure.buffer == BufferConfig(kv_entry_timeout=9, kv_evict_unclaimed=False)
    # A lookup buffer's settings are not the transport's: the pipe's config refuses them.
    with pytest.raises(TypeError, match="kv_evict_unclaimed"):
        KVTransferConfig(kv_evict_unclaimed=True)


# ---------------------------------------------------------------------------------------------- over pipes

BUDGET = 256 << 10  # room for 4 requests of CHUNK bytes, not 5
CHUNK = 60 << 10
ABANDONED, LIVE = 2, 4


def producer_evicts(buffer: SimpleBuffer, sync: dict) -> dict:
    for index in range(ABANDONED + LIVE):
        assert buffer.insert(*request(index, CHUNK), timeout=0) is None
    sync["inserted"].set()
    return {"evicted": buffer.stats().evicted}


def consumer_after_evictions(buffer: SimpleBuffer, sync: dict) -> dict:
    bodies.wait_event(sync, "inserted")
    outcome: dict[str, Any] = {"missed": [], "hit": []}
    for index in reversed(range(ABANDONED + LIVE)):  # the newest first
        want = request(index, CHUNK)
        got = buffer.drop_select(want[0], want[1], timeout=0)
        if got[0] is None:
            outcome["missed"].append(index)
        else:
            bodies.check_entry(got, want, f"request {index}")
            outcome["hit"].append(index)
    return outcome


def test_a_simple_buffer_pair_misses_the_evicted_entries_and_hits_the_newest() -> None:
    port = procs.free_port()
    sync = {name: mp.get_context("spawn").Event() for name in bodies.SYNC_EVENTS}
    changes = {"kv_buffer_size": BUDGET, "kv_evict_unclaimed": True}
    results = procs.new_queue()
    processes = [
        procs.start(bodies.run_side, (rank, port, body, changes, sync), results, rank)
        for rank, body in ((0, producer_evicts), (1, consumer_after_evictions))
    ]
    outcomes = procs.collect(processes, results, 100)
    producer, consumer = outcomes[0], outcomes[1]
    assert consumer["result"] == {"missed": [1, 0], "hit": [5, 4, 3, 2]}
    assert producer["result"] == {"evicted": ABANDONED}
    p, c = producer["stats"], consumer["stats"]
    assert (p["evicted"], p["inserts"], p["rejected"], p["entries"], p["bytes"]) == (ABANDONED, 6, 0, 0, 0)
    assert (p["hits"], p["misses"]) == (c["hits"], c["misses"]) == (LIVE, ABANDONED)
    assert producer["close_error"] is None and consumer["close_error"] is None


def test_a_listener_full_of_abandoned_entries_still_saves_and_serves_new_ones() -> None:
    """Prefills nobody decodes fill the budget; the next ones are saved at once (timeout 0) and a
    consumer gets them, while the abandoned ones it asks for are gone."""
    port = procs.free_port()
    budget = 1 << 20
    size = 200_000  # room for 5 requests
    producer = KVTransferConfig(kv_role="kv_producer", kv_ip=HOST, kv_port=port, kv_timeout=5.0, kv_buffer_size=budget)
    consumer = KVTransferConfig(kv_role="kv_consumer", kv_rank=1, kv_timeout=5.0, kv_buffer_size=budget)
    with BufferListener(producer, buffer_config=EVICTING) as listener, dial(consumer, HOST, port) as buffer:
        for index in range(16):  # abandoned
            listener.insert(*request(index, size), timeout=0)
        live = [request(100 + index, size) for index in range(2)]
        for given in live:
            listener.insert(*given, timeout=0)
        for given in live:
            bodies.check_entry(buffer.drop_select(given[0], given[1], timeout=0), given, "a live request")
        oldest, newest_abandoned = request(0, size), request(15, size)
        assert buffer.drop_select(oldest[0], oldest[1], timeout=0) == [None] * 5
        bodies.check_entry(
            buffer.drop_select(newest_abandoned[0], newest_abandoned[1], timeout=0),
            newest_abandoned,
            "the newest abandoned request",
        )
        stats = listener.stats()
        assert (stats.evicted, stats.inserts, stats.rejected, stats.hits) == (18 - 5, 18, 0, 3)
        assert stats.entries == 2 and stats.peak_bytes <= budget


def test_a_lent_entrys_loan_ends_evicted_so_its_memory_is_the_producers_again() -> None:
    """The vLLM producer's case: an evicted entry's loan ends, the others' stay until taken."""
    made = [stored(index, 2048) for index in range(4)]
    size = made[0][1].nbytes
    store = EntryStore(capacity_bytes=2 * size + size // 2, max_item_bytes=1 << 20, evict_unclaimed=True)
    for key, entry, _ in made:
        store.put(key, entry, timeout=0)
    assert [entry.loan.wait(0) for _, entry, _ in made] == [EVICTED, EVICTED, None, None]
    key, entry, _ = made[3]
    assert store.pop(key) is entry and entry.loan.end(SENT) and entry.loan.outcome == SENT
    assert made[2][1].loan.outcome is None  # still stored: still lent


# ------------------------------------------------------------------- selects for entries that are gone


def _splittable(index: int) -> list[torch.Tensor | None]:
    """``[tokens, roi, key, None, None]``: a random key of 4 heads along dimension 1, odd sizes."""
    generator = torch.Generator().manual_seed(3000 + index)
    tokens = torch.randint(1, 1 << 40, (7,), generator=generator)
    tokens[0] = index + 1
    return [tokens, torch.ones(7, dtype=torch.bool), random_tensor(generator, torch.float32, (3, 4, 37)), None, None]


def _select_in_thread(buffer: Any, given: list, **kwargs: Any) -> tuple[threading.Thread, list]:
    outcome: list = []
    thread = threading.Thread(
        target=lambda: outcome.append(buffer.drop_select(given[0], given[1], **kwargs)), daemon=True
    )
    thread.start()
    return thread, outcome


def test_selects_for_evicted_entries_miss_at_once_and_unrelated_ones_still_wait() -> None:
    """A select waiting for an entry that is evicted, and one that comes after the eviction, both miss
    at once although they would wait far longer than this test runs; a select for another key waits
    on and hits once its entry comes."""
    port = procs.free_port()
    size = 40_000
    producer = KVTransferConfig(
        kv_role="kv_producer", kv_ip=HOST, kv_port=port, kv_timeout=5.0, kv_buffer_size=3 * size + 2000
    )
    consumer = KVTransferConfig(kv_role="kv_consumer", kv_rank=1, kv_timeout=5.0, kv_buffer_size=1 << 20)
    forever = 3600.0
    with (
        BufferListener(producer, buffer_config=EVICTING) as listener,
        dial(consumer, HOST, port) as buffer,
        dial(consumer, HOST, port) as other,
    ):
        split = _splittable(0)
        listener.insert(*split, timeout=0)
        half = buffer.drop_select(split[0], split[1], timeout=0, part=(1, 0, 2))
        assert same_bits(half[2], split[2][:, 0:2])  # the other half stays stored, as a part
        unrelated = request(50, size)
        waiting_whole, whole_outcome = _select_in_thread(other, split, timeout=forever)  # never takes a part
        waiting_unrelated, unrelated_outcome = _select_in_thread(buffer, unrelated, timeout=forever)
        bodies.wait_until(lambda: listener.stats().pending == 2, "both selects wait")
        for index in range(4):  # the budget holds 3 and the half: the fourth evicts the half and the first
            listener.insert(*request(index, size), timeout=0)
        waiting_whole.join(60)
        assert not waiting_whole.is_alive() and whole_outcome == [[None] * 5]
        # An evicted entry's select that comes after the eviction misses at once too.
        assert listener.stats().evicted == 2
        evicted = request(0, size)
        assert buffer.drop_select(evicted[0], evicted[1], timeout=forever) == [None] * 5
        # The unrelated select still waits, and hits its entry once inserted.
        assert waiting_unrelated.is_alive() and listener.stats().pending == 1
        listener.insert(*unrelated, timeout=0)
        waiting_unrelated.join(60)
        assert not waiting_unrelated.is_alive()
        bodies.check_entry(unrelated_outcome[0], unrelated, "the unrelated request")
        # An entry inserted again under an evicted key is served as any other.
        listener.insert(*evicted, timeout=0)
        bodies.check_entry(buffer.drop_select(evicted[0], evicted[1], timeout=forever), evicted, "inserted again")


# ------------------------------------------------------------------- departures told to the inserter


def test_departures_of_copied_entries_are_told_in_order_and_lent_ones_never() -> None:
    """Each copied entry's key once it is no longer there to select, whatever took it: a select
    (a split entry at its first part), eviction, expiry, the store's end; a lent entry's end is its
    loan's outcome, and its copy out of the loan is not the inserter's copy."""
    sizes = {index: make_entry(*request(index, 2048))[1].nbytes for index in range(3)}
    store = EntryStore(capacity_bytes=3 * sizes[0], max_item_bytes=1 << 20, entry_timeout=100.0, evict_unclaimed=True)
    told: list[MatchKey] = []
    split: list[bool] = []
    store.watch_departures(lambda key, was_split: (told.append(key), split.append(was_split)))
    copies = [make_entry(*request(index, 2048)) for index in range(3)]
    duplicate = make_entry(*request(0, 2048))  # the same tokens as copies[0]: stored after it
    assert all(entry.tracked for _, entry in copies) and duplicate[1].tracked
    lent_key, lent, _ = stored(7, 2048)
    lent.tracked = False  # what make_entry makes of lent tensors
    for key, entry in copies:
        store.put(key, entry, timeout=0)
    store.put(lent_key, lent, timeout=0)  # evicts copies[0]
    assert told == [copies[0][0]]
    store.put(*duplicate, timeout=0)  # evicts copies[1]
    assert told == [copies[0][0], copies[1][0]]
    assert store.pop(copies[0][0]) is duplicate[1]  # taken by a select
    assert store.pop(lent_key) is lent and len(told) == 3  # a loan's entry: never told
    whole_key, whole = make_entry(*_splittable(0))
    store.put(whole_key, whole, timeout=0)
    store.pop_part(whole_key, (1, 0, 1))  # the first part taken: the whole is gone
    assert told[2:] == [copies[0][0], whole_key]
    assert store.counters().entries == 4  # copies[2] and three parts of the whole
    assert store.expire(now=time.monotonic() + 101)[0] == 4
    assert told[4:] == [copies[2][0]]  # the parts are not the inserter's entries
    last_key, last = make_entry(*request(5, 2048))
    store.put(last_key, last, timeout=0)
    store.stop(KVBufferFullError("closed"))
    assert told[5:] == [last_key] and len(told) == 6
    assert split == [False, False, False, True, False, False]  # only the whole a select split


def test_a_withdrawn_copy_is_the_oldest_copy_under_its_key_and_lent_entries_and_parts_stay() -> None:
    """``withdraw_copy`` takes the oldest tracked whole entry under its key, told as a departure and
    leaving a tombstone; an older lent entry under the same key, its loan, the parts of a split copy
    and other keys' copies stay."""
    store = EntryStore(capacity_bytes=1 << 20, max_item_bytes=1 << 20, entry_timeout=100.0)
    told: list[MatchKey] = []
    buried: list[MatchKey] = []
    store.watch_departures(lambda key, split: told.append(key))
    store.watch(buried.append)
    lent_key, lent, _ = stored(0, 2048)
    lent.tracked = False  # what make_entry makes of lent tensors
    first_key, first = make_entry(*request(0, 2048))  # the same tokens: copies under the lent entry's key
    second_key, second = make_entry(*request(0, 2048))
    other_key, other = make_entry(*request(1, 2048))
    for key, entry in ((lent_key, lent), (first_key, first), (second_key, second), (other_key, other)):
        store.put(key, entry, timeout=0)
    before = store.counters()
    assert not store.gone(first_key)
    assert store.withdraw_copy(second_key)  # whichever request is withdrawn, the oldest copy leaves
    assert (told, buried) == ([first_key], [first_key]) and store.gone(first_key)
    after = store.counters()
    assert (after.entries, after.bytes) == (before.entries - 1, before.bytes - first.nbytes)
    assert (after.expired, after.evicted) == (before.expired, before.evicted)
    assert lent.loan.outcome is None
    assert store.pop(first_key) is lent and store.pop(first_key) is second  # first in, first out as before
    assert not store.withdraw_copy(first_key)  # none left under it
    assert store.withdraw_copy(other_key) and not store.withdraw_copy(other_key)
    assert told == [first_key, second_key, other_key]
    whole_key, whole = make_entry(*_splittable(0))
    store.put(whole_key, whole, timeout=0)
    store.pop_part(whole_key, (1, 0, 1))
    assert not store.withdraw_copy(whole_key) and store.counters().entries == 3  # the parts stay
    assert not store.withdraw_copy(make_entry(*request(9, 2048))[0])  # a key never stored


def _split_copy(store: EntryStore, index: int, taken: Part) -> tuple[MatchKey, list, Entry, Entry]:
    """A tracked copy of :func:`_splittable` ``index`` stored, then split by a select of ``taken``:
    its key, the tensors given, the whole entry and the part taken."""
    given = _splittable(index)
    key, whole = make_entry(*given)
    assert whole.tracked
    store.put(key, whole, timeout=0)
    part = store.pop_part(key, taken)
    assert part is not None and same_bits(part.items[1], given[2].narrow(*taken[:2], taken[2] - taken[1]))
    return key, given, whole, part


def test_a_split_copys_parts_are_withdrawn_at_once_and_selects_of_them_miss() -> None:
    """``withdraw_split_copy`` takes every part left of a split copy: their bytes are free, a select
    of any of them finds none and the key's tombstone makes it miss at once; its departure was told
    once, when it was split."""
    store = EntryStore(capacity_bytes=1 << 20, max_item_bytes=1 << 20, entry_timeout=100.0)
    told: list[tuple[MatchKey, bool]] = []
    buried: list[MatchKey] = []
    store.watch_departures(lambda key, split: told.append((key, split)))
    store.watch(buried.append)
    key, _, whole, part = _split_copy(store, 0, (1, 2, 3))
    assert told == [(key, True)]
    held = store.counters()
    assert (held.entries, held.bytes) == (3, whole.nbytes - part.nbytes) and not store.gone(key)
    assert store.withdraw_split_copy(key)
    after = store.counters()
    assert (after.entries, after.bytes) == (0, 0)
    assert (after.expired, after.evicted) == (0, 0)
    assert told == [(key, True)] and buried == [key, key, key]  # each part's tombstone, under the copy's key
    assert store.gone(key)
    for left in ((1, 0, 1), (1, 1, 2), (1, 3, 4)):
        assert store.pop_part(key, left) is None
    assert not store.withdraw_split_copy(key) and not store.withdraw_copy(key)
    # A copy stored again under the key ends the tombstone, as after any departure.
    again_key, again = make_entry(*_splittable(0))
    store.put(again_key, again, timeout=0)
    assert not store.gone(key) and not store.withdraw_split_copy(key)  # whole: withdraw_copy's
    assert store.withdraw_copy(key) and store.counters().entries == 0


def test_the_oldest_split_copy_leaves_whole_copies_and_lent_parts_stay() -> None:
    """Two split copies, a whole copy and a split lent entry under one key: each withdrawal of a
    split copy takes the parts left of the oldest whose parts are not all taken, nothing else."""
    store = EntryStore(capacity_bytes=1 << 20, max_item_bytes=1 << 20, entry_timeout=100.0)
    first_key, first_given, _, _ = _split_copy(store, 0, (1, 0, 1))
    second_key, second_given, _, _ = _split_copy(store, 0, (1, 0, 2))  # another width: its own parts
    assert store.pop_part(first_key, (1, 1, 2)) is not None  # a part of the first copy taken by a select
    whole_key, whole = make_entry(*_splittable(0))
    store.put(whole_key, whole, timeout=0)
    lent_given = _splittable(0)
    lent_key, lent = make_entry(*lent_given)
    lent.tracked, lent.loan = False, Loan()  # what make_entry makes of lent tensors
    store.put(lent_key, lent, timeout=0)
    lent_part = store.pop_part(lent_key, (1, 1, 2))  # the whole copy is older: it is split, not the lent entry
    assert same_bits(lent_part.items[1], _splittable(0)[2].narrow(1, 1, 1))
    # Now under the key: the first copy's parts 2 and 3, the second's part 2, the third copy's parts
    # 0, 2 and 3 (split by that last select) and the lent entry, whole.
    assert store.counters().entries == 2 + 1 + 3 + 1
    assert store.withdraw_split_copy(first_key)
    assert store.counters().entries == 1 + 3 + 1
    assert store.pop_part(first_key, (1, 2, 3)) is not None  # the third copy's: the first one's are gone
    second_part = store.pop_part(second_key, (1, 2, 4))
    assert second_part is not None and same_bits(second_part.items[1], second_given[2].narrow(1, 2, 2))
    assert store.withdraw_split_copy(first_key)  # the third copy's parts 0 and 3
    assert not store.withdraw_split_copy(first_key)
    assert store.pop(lent_key) is lent and lent.loan.outcome is None
    assert store.counters().entries == 0
    assert same_bits(first_given[2], second_given[2])  # one prompt's copies: alike


def _race(calls: dict[Any, Callable[[], Any]]) -> dict[Any, Any]:
    """Run every call in a thread of its own, all released at once; their results by name."""
    barrier = threading.Barrier(len(calls))
    outcomes: dict[Any, Any] = {}

    def run(name: Any, call: Callable[[], Any]) -> None:
        barrier.wait(60)
        outcomes[name] = call()

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert outcomes.keys() == calls.keys()
    return outcomes


def test_a_withdrawal_racing_selects_leaves_each_select_its_part_whole_or_a_miss() -> None:
    """Selects in threads racing a withdrawal: each gets all of what it selects, bit-exact, or
    nothing; a split copy's parts leave all at once, so none is left once the withdrawal returned."""
    for index in range(40):
        store = EntryStore(capacity_bytes=1 << 20, max_item_bytes=1 << 20, entry_timeout=100.0)
        key, given, _, _ = _split_copy(store, index, (1, 0, 1))
        whole_key, whole = make_entry(*_splittable(index + 100))
        store.put(whole_key, whole, timeout=0)
        parts = [(1, 1, 2), (1, 2, 3), (1, 3, 4)]
        calls: dict[Any, Callable[[], Any]] = {part: functools.partial(store.pop_part, key, part) for part in parts}
        calls["withdraw split"] = functools.partial(store.withdraw_split_copy, key)
        calls["select whole"] = functools.partial(store.pop, whole_key)
        calls["withdraw whole"] = functools.partial(store.withdraw_copy, whole_key)
        outcomes = _race(calls)
        taken = [part for part in parts if outcomes[part] is not None]
        for part in taken:
            assert same_bits(outcomes[part].items[1], given[2].narrow(1, part[1], 1))
        assert outcomes["withdraw split"] == (len(taken) < len(parts))
        assert (outcomes["select whole"] is whole) != outcomes["withdraw whole"]
        assert outcomes["select whole"] in (whole, None)
        counters = store.counters()
        assert (counters.entries, counters.bytes) == (0, 0)
