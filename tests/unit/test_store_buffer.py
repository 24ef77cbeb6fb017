"""The lookup buffer over a store: chunked inserts, the longest stored prefix on select (bit-exact,
never wrong KV), and the connector loading such a prefix into the caller's caches."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from connector import (
    VLLM_CPU_LAYOUT,
    ContiguousKV,
    KVRequest,
    PagedKV,
    PagedKVCaches,
    recv_kv_caches_and_hidden_states,
    send_kv_caches_and_hidden_states,
    transfer_state,
)
from connector.transfer_state import KVConnectorConfig, build_kv_buffer
from harness.tensors import random_tensor, same_bits
from kv_pipe import KVConfigError, KVTransferConfig
from kv_store import MemoryTier, TieredStore, mac_key_from_secret
from lookup_buffer import KVInvalidRequestError, StoreBuffer
from lookup_buffer.base import BufferStats, KVLookupBufferBase, SelectResult

pytestmark = pytest.mark.timeout(120)

CHUNK = 16
LAYERS, HEADS, HEAD_SIZE = 3, 2, 5
IDENTITY = {"model": "test-model", "kv_dtype": "bfloat16", "layers": LAYERS}
#: ContiguousKV packs [layers, 1, heads, tokens, head size]: tokens along dimension 3.
TOKEN_DIM = 3


class RecordingTier(MemoryTier):
    """A memory tier that remembers every object written, in order, and counts its round trips."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__(capacity_bytes=1 << 30)
        self.written: list[tuple[bytes, bytes]] = []
        self.calls = {"contains_many": 0, "get_many": 0}

    def put(self, key: bytes, blob: bytes) -> bool:
        stored = super().put(key, blob)
        if stored:
            self.written.append((key, blob))
        return stored

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self.calls["get_many"] += 1
        return super().get_many(keys)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        self.calls["contains_many"] += 1
        return super().contains_many(keys)


def buffer(tier: RecordingTier, role: str = "kv_both", **options) -> StoreBuffer:
    settings = {"identity": IDENTITY, "token_dim": TOKEN_DIM, "chunk_size": CHUNK, **options}
    return StoreBuffer(TieredStore([tier]), role, **settings)


def tokens(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50_000, (count,), generator=torch.Generator().manual_seed(seed))


def entry(count: int, seed: int = 1, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """Random packed contiguous key, value and a hidden state for ``count`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    key, value = (random_tensor(generator, dtype, (LAYERS, 1, HEADS, count, HEAD_SIZE)) for _ in range(2))
    return key, value, random_tensor(generator, dtype, (7,))


def full(count: int) -> torch.Tensor:
    return torch.ones(count, dtype=torch.bool)


def prefix_roi(count: int, found: int) -> torch.Tensor:
    roi = torch.zeros(count, dtype=torch.bool)
    roi[:found] = True
    return roi


@pytest.mark.parametrize("count", [1, CHUNK - 1, CHUNK, 2 * CHUNK + 5, 4 * CHUNK])
def test_an_entry_comes_back_bit_exact_with_its_hidden_state(count: int) -> None:
    tier = RecordingTier()
    store = buffer(tier)
    prompt = tokens(count)
    key, value, hidden = entry(count)
    assert store.insert(prompt, full(count), key, value, hidden) is None
    assert len(tier.written) == -(-count // CHUNK)  # one object per chunk, a partial last one included
    found_tokens, roi, got_key, got_value, got_hidden = store.drop_select(prompt, full(count))
    assert torch.equal(found_tokens, prompt) and torch.equal(roi, full(count))
    assert same_bits(got_key, key) and same_bits(got_value, value) and same_bits(got_hidden, hidden)
    # Not consumed: the same query finds it again.
    assert same_bits(store.drop_select(prompt, full(count))[2], key)
    stats = store.stats()
    assert (stats.inserts, stats.hits, stats.misses, stats.bad_messages) == (1, 2, 0, 0)


def test_a_longer_query_finds_the_stored_prefix_in_one_lookup_and_one_read() -> None:
    tier = RecordingTier()
    store = buffer(tier)
    stored = 2 * CHUNK + 7
    prompt = tokens(stored + 20)
    key, value, hidden = entry(stored)
    store.insert(prompt[:stored], full(stored), key, value, hidden)
    tier.calls = dict.fromkeys(tier.calls, 0)
    result = store.drop_select(prompt, full(len(prompt)))
    assert tier.calls == {"contains_many": 1, "get_many": 1}
    # The partial third chunk of the stored entry is not a chunk of the longer query: two chunks.
    assert torch.equal(result[1], prefix_roi(len(prompt), 2 * CHUNK))
    assert same_bits(result[2], key[:, :, :, : 2 * CHUNK]) and same_bits(result[3], value[:, :, :, : 2 * CHUNK])
    assert result[4] is None  # the hidden state only comes with the whole query
    # A query that is a prefix itself (roi over its first tokens) finds all of it.
    shorter = store.drop_select(prompt, prefix_roi(len(prompt), stored))
    assert torch.equal(shorter[1], prefix_roi(len(prompt), stored)) and same_bits(shorter[4], hidden)


def test_a_query_diverging_inside_the_second_chunk_finds_the_first() -> None:
    store = buffer(RecordingTier())
    prompt = tokens(3 * CHUNK)
    key, value, hidden = entry(3 * CHUNK)
    store.insert(prompt, full(len(prompt)), key, value, hidden)
    other = prompt.clone()
    other[CHUNK + CHUNK // 2] += 1
    result = store.drop_select(other, full(len(other)))
    assert torch.equal(result[1], prefix_roi(len(other), CHUNK))
    assert same_bits(result[2], key[:, :, :, :CHUNK]) and same_bits(result[3], value[:, :, :, :CHUNK])
    first_token_differs = prompt.clone()
    first_token_differs[0] += 1
    assert store.drop_select(first_token_differs, full(len(prompt))) == [None] * 5
    assert store.stats().misses == 1


def test_a_corrupt_second_chunk_ends_the_prefix_at_the_first() -> None:
    tier = RecordingTier()
    store = buffer(tier)
    prompt = tokens(3 * CHUNK + 3)
    key, value, hidden = entry(len(prompt))
    store.insert(prompt, full(len(prompt)), key, value, hidden)
    second_key, second_blob = tier.written[1]
    flipped = bytearray(second_blob)
    flipped[-5] ^= 0x40  # a payload bit
    reader_tier = RecordingTier()
    for object_key, blob in tier.written:
        reader_tier.put(object_key, bytes(flipped) if object_key == second_key else blob)
    reader = buffer(reader_tier, "kv_consumer")
    result = reader.drop_select(prompt, full(len(prompt)))
    assert torch.equal(result[1], prefix_roi(len(prompt), CHUNK))
    assert same_bits(result[2], key[:, :, :, :CHUNK]) and result[4] is None
    assert reader.stats().bad_messages == 1 and reader.stats().hits == 1


def test_another_identity_or_secret_finds_nothing() -> None:
    tier = RecordingTier()
    prompt = tokens(40)
    buffer(tier, "kv_producer").insert(prompt, full(40), *entry(40))
    other_model = buffer(tier, "kv_consumer", identity={**IDENTITY, "model": "another-model"})
    assert other_model.drop_select(prompt, full(40)) == [None] * 5
    other_layout = buffer(tier, "kv_consumer", token_dim=2)
    assert other_layout.drop_select(prompt, full(40)) == [None] * 5
    # Same namespace, but the reader demands signed objects: unsigned ones are refused, counted.
    signed_reader = buffer(tier, "kv_consumer", mac_key=mac_key_from_secret("s3cret"))
    assert signed_reader.drop_select(prompt, full(40)) == [None] * 5
    assert signed_reader.stats().bad_messages == 1


def test_signed_objects_are_read_with_the_same_secret() -> None:
    tier = RecordingTier()
    mac = mac_key_from_secret("s3cret")
    prompt = tokens(20)
    key, value, hidden = entry(20)
    buffer(tier, "kv_producer", mac_key=mac).insert(prompt, full(20), key, value, hidden)
    assert same_bits(buffer(tier, "kv_consumer", mac_key=mac).drop_select(prompt, full(20))[2], key)
    assert buffer(tier, "kv_consumer", mac_key=mac_key_from_secret("other")).drop_select(prompt, full(20)) == [None] * 5


def test_stored_chunks_are_not_written_again_and_prefixes_are_shared() -> None:
    tier = RecordingTier()
    store = buffer(tier)
    prompt = tokens(2 * CHUNK + 4)
    key, value, hidden = entry(len(prompt))
    store.insert(prompt, full(len(prompt)), key, value, hidden)
    written = store.stats().transferred_bytes
    store.insert(prompt, full(len(prompt)), key, value, hidden)
    assert len(tier.written) == 3 and store.stats().transferred_bytes == written
    longer = torch.cat([prompt[: 2 * CHUNK], tokens(CHUNK, seed=9)])
    other_key, other_value, other_hidden = entry(len(longer), seed=5)
    store.insert(longer, full(len(longer)), other_key, other_value, other_hidden)
    assert len(tier.written) == 4  # only its own third chunk
    result = store.drop_select(longer, full(len(longer)))
    # The shared chunks hold the first prompt's KV (the same for the same tokens in a real model).
    assert same_bits(result[2][:, :, :, : 2 * CHUNK], key[:, :, :, : 2 * CHUNK])
    assert same_bits(result[2][:, :, :, 2 * CHUNK :], other_key[:, :, :, 2 * CHUNK :])
    assert same_bits(result[4], other_hidden)


def test_paged_blocks_in_chunks_of_whole_blocks() -> None:
    block, blocks_per_chunk = 4, 2
    count = 2 * block * blocks_per_chunk + 3  # the last block partly filled
    generator = torch.Generator().manual_seed(4)
    # vLLM CPU blocks packed: [layers, blocks, heads, block size, 2 * head size]; blocks along dimension 1.
    blocks = random_tensor(generator, torch.float16, (LAYERS, -(-count // block), HEADS, block, 2 * HEAD_SIZE))
    store = buffer(RecordingTier(), token_dim=1, block_size=block, chunk_size=block * blocks_per_chunk)
    prompt = tokens(count)
    store.insert(prompt, full(count), blocks, None, None)
    result = store.drop_select(prompt, full(count))
    assert same_bits(result[2], blocks) and result[3] is None and result[4] is None
    longer = torch.cat([prompt, tokens(5, seed=3)])
    prefix = store.drop_select(longer, full(len(longer)))
    assert torch.equal(prefix[1], prefix_roi(len(longer), 2 * block * blocks_per_chunk))
    assert same_bits(prefix[2], blocks[:, : 2 * blocks_per_chunk])
    with pytest.raises(KVConfigError, match="multiple of the KV block size"):
        buffer(RecordingTier(), token_dim=1, block_size=block, chunk_size=block * blocks_per_chunk + 1)


def test_what_a_store_buffer_refuses() -> None:
    store = buffer(RecordingTier())
    prompt = tokens(10)
    key, value, hidden = entry(10)
    holes = full(10)
    holes[3] = False
    with pytest.raises(KVInvalidRequestError, match="prefix"):
        store.drop_select(prompt, holes)
    with pytest.raises(KVInvalidRequestError, match="prefix"):
        store.insert(prompt, holes, key, value, hidden)
    with pytest.raises(KVInvalidRequestError, match="parts"):
        store.drop_select(prompt, full(10), part=(2, 0, 1))
    with pytest.raises(KVInvalidRequestError, match="entries along dimension 3"):
        store.insert(prompt, full(10), key[:, :, :, :9], value, hidden)
    with pytest.raises(KVConfigError, match="kv_producer"):
        buffer(RecordingTier(), "kv_consumer").insert(prompt, full(10), key, value, hidden)
    with pytest.raises(KVConfigError, match="kv_consumer"):
        buffer(RecordingTier(), "kv_producer").drop_select(prompt, full(10))
    with pytest.raises(KVConfigError, match="kv_role"):
        buffer(RecordingTier(), "decode")


# --- the connector over it ----------------------------------------------------------------------


def contiguous_request(prompt: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> KVRequest:
    """A decode-side request: destinations filled with a marker, so untouched positions show."""
    shape = (1, HEADS, len(prompt), HEAD_SIZE)
    keys = [torch.full(shape, 7.0, dtype=dtype) for _ in range(LAYERS)]
    values = [torch.full(shape, 7.0, dtype=dtype) for _ in range(LAYERS)]
    return KVRequest(prompt, ContiguousKV(keys, values), torch.full((7,), 7.0, dtype=dtype))


def sent_request(prompt: torch.Tensor, seed: int) -> KVRequest:
    key, value, hidden = entry(len(prompt), seed)
    return KVRequest(prompt, ContiguousKV(list(key), list(value)), hidden)


def test_the_connector_loads_a_stored_prefix_and_says_how_many_tokens() -> None:
    tier = RecordingTier()
    producer, consumer = buffer(tier, "kv_producer"), buffer(tier, "kv_consumer")
    whole, short = tokens(2 * CHUNK + 9), tokens(CHUNK + 3, seed=8)
    sent = [sent_request(whole[: CHUNK + 5], seed=1), sent_request(whole, seed=2)]
    send_kv_caches_and_hidden_states(producer, sent[:1])
    longer = contiguous_request(whole)
    unknown = contiguous_request(short)
    first = recv_kv_caches_and_hidden_states(consumer, [longer, unknown])
    assert not first[0].hit and first[0].num_tokens == CHUNK and "first 16 of 41" in first[0].reason
    sent_keys = sent[0].kv.keys
    for layer in range(LAYERS):
        assert same_bits(longer.kv.keys[layer][:, :, :CHUNK], sent_keys[layer][:, :, :CHUNK])
        assert same_bits(longer.kv.values[layer][:, :, :CHUNK], sent[0].kv.values[layer][:, :, :CHUNK])
        assert bool((longer.kv.keys[layer][:, :, CHUNK:] == 7).all())  # the rest left as it was
    assert bool((longer.hidden == 7).all())
    assert (first[1].hit, first[1].num_tokens) == (False, 0)
    send_kv_caches_and_hidden_states(producer, sent[1:])
    [again] = recv_kv_caches_and_hidden_states(consumer, [longer])
    assert again.hit and again.num_tokens == len(whole)
    # The first chunk is the first prompt's (stored first); the rest the second's.
    assert same_bits(longer.kv.keys[1][:, :, CHUNK:], sent[1].kv.keys[1][:, :, CHUNK:])
    assert same_bits(longer.hidden, sent[1].hidden)


def test_all_tokens_found_without_their_hidden_state_leave_the_last_token_to_compute() -> None:
    tier = RecordingTier()
    producer, consumer = buffer(tier, "kv_producer"), buffer(tier, "kv_consumer")
    prompt = tokens(3 * CHUNK)
    send_kv_caches_and_hidden_states(producer, [sent_request(prompt, seed=3)])
    # A prompt ending where a stored one's second chunk ends: that chunk holds no hidden state.
    request = contiguous_request(prompt[: 2 * CHUNK])
    [result] = recv_kv_caches_and_hidden_states(consumer, [request])
    assert not result.hit and result.num_tokens == 2 * CHUNK - 1
    assert same_bits(request.kv.keys[0], sent_request(prompt, seed=3).kv.keys[0][:, :, : 2 * CHUNK])


def test_the_connector_loads_a_paged_prefix_into_the_first_blocks() -> None:
    block = 4
    generator = torch.Generator().manual_seed(6)
    shape = (10, HEADS, block, 2 * HEAD_SIZE)
    source = PagedKVCaches([random_tensor(generator, torch.float16, shape) for _ in range(LAYERS)], VLLM_CPU_LAYOUT)
    target = PagedKVCaches([torch.zeros(shape, dtype=torch.float16) for _ in range(LAYERS)], VLLM_CPU_LAYOUT)
    tier = RecordingTier()
    options = {"token_dim": 1, "block_size": block, "chunk_size": 2 * block}
    producer, consumer = buffer(tier, "kv_producer", **options), buffer(tier, "kv_consumer", **options)
    prompt = tokens(4 * block + 1)
    send_kv_caches_and_hidden_states(producer, [KVRequest(prompt[: 3 * block], PagedKV(source, [5, 1, 7]))])
    request = KVRequest(prompt, PagedKV(target, [0, 2, 4, 6, 8]))
    [result] = recv_kv_caches_and_hidden_states(consumer, [request])
    assert not result.hit and result.num_tokens == 2 * block
    for layer in range(LAYERS):
        assert same_bits(target.caches[layer][[0, 2]], source.caches[layer][[5, 1]])
        assert bool((target.caches[layer][[4, 6, 8]] == 0).all())


class _PartialBuffer(KVLookupBufferBase):
    """A pipe-style buffer (no prefixes) whose select answers with a prefix roi."""

    def __init__(self, answer: SelectResult) -> None:
        self.answer = answer

    def insert(self, *args, **kwargs) -> None:
        raise AssertionError

    def drop_select(self, *args, **kwargs) -> SelectResult:
        return self.answer

    def stats(self) -> BufferStats:
        return BufferStats(role="kv_consumer")

    def close(self) -> None:
        pass


def test_a_partial_entry_from_a_buffer_without_prefixes_stays_a_miss() -> None:
    prompt = tokens(CHUNK + 4)
    key, value, hidden = entry(CHUNK)
    request = contiguous_request(prompt)
    [result] = recv_kv_caches_and_hidden_states(
        _PartialBuffer([prompt, prefix_roi(len(prompt), CHUNK), key, value, hidden]), [request]
    )
    assert (result.hit, result.num_tokens) == (False, 0)
    assert "other token positions" in result.reason
    assert all(bool((tensor == 7).all()) for tensor in [*request.kv.keys, *request.kv.values])


# --- one entry point ------------------------------------------------------------------------------


def test_the_transfer_group_over_a_disk_store_is_built_once_and_shut_down(tmp_path) -> None:
    config = KVConnectorConfig(
        KVTransferConfig(kv_role="kv_both", kv_secret="s3cret"), kv_store=f"disk:{tmp_path}", kv_chunk_size=CHUNK
    )
    assert not transfer_state.has_kv_transfer_group()
    with pytest.raises(KVConfigError, match="not initialized"):
        transfer_state.get_kv_transfer_group()
    with pytest.raises(KVConfigError, match="identity"):
        transfer_state.ensure_kv_transfer_initialized(config)
    try:
        group = transfer_state.ensure_kv_transfer_initialized(config, identity=IDENTITY, token_dim=TOKEN_DIM)
        assert isinstance(group, StoreBuffer) and group.chunk_size == CHUNK
        assert transfer_state.ensure_kv_transfer_initialized(config) is group
        assert transfer_state.get_kv_transfer_group() is group and transfer_state.has_kv_transfer_group()
        prompt = tokens(CHUNK + 3)
        key, value, hidden = entry(len(prompt))
        group.insert(prompt, full(len(prompt)), key, value, hidden)
    finally:
        transfer_state.ensure_kv_transfer_shutdown()
    assert not transfer_state.has_kv_transfer_group()
    # Another process's buffer over the same directory and secret reads it back.
    with build_kv_buffer(config, identity=IDENTITY, token_dim=TOKEN_DIM) as reader:
        result = reader.drop_select(prompt, full(len(prompt)))
        assert same_bits(result[2], key) and same_bits(result[3], value) and same_bits(result[4], hidden)


def test_a_pipe_buffer_for_both_roles_is_refused_before_any_pipe() -> None:
    with pytest.raises(KVConfigError, match="kv_both"):
        build_kv_buffer(KVConnectorConfig(KVTransferConfig(kv_role="kv_both", kv_connect_timeout=1)))
    with pytest.raises(KVConfigError, match="kv_store"):
        KVConnectorConfig(kv_store=" ")
