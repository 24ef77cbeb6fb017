"""The connector: paged block gather/scatter, request validation, and send/recv over a real pipe + buffer."""

from __future__ import annotations

import time

import pytest
import torch

from connector import (
    FLASH_ATTN_LAYOUT,
    VLLM_CPU_LAYOUT,
    ContiguousKV,
    KVRequest,
    PagedKV,
    PagedKVCaches,
    PagedKVLayout,
    gather_blocks,
    recv_kv_caches_and_hidden_states,
    scatter_blocks,
    send_kv_caches_and_hidden_states,
)
from harness import procs
from harness.tensors import same_bits
from kv_pipe import KVConfigError, KVTransferConfig, TorchDistributedPipe
from kv_pipe.exported_memory import page_aligned_empty
from lookup_buffer import BufferStats, KVLookupBufferBase, SimpleBuffer

ALL_LAYOUTS = pytest.mark.parametrize("layout", [VLLM_CPU_LAYOUT, FLASH_ATTN_LAYOUT], ids=lambda x: x.name)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
NUM_LAYERS = 3
HEADS, BLOCK_SIZE, HEAD_SIZE = 3, 5, 7  # odd on purpose


def cache_shape(layout: PagedKVLayout, num_blocks: int, block_size: int = BLOCK_SIZE) -> tuple[int, ...]:
    if layout is VLLM_CPU_LAYOUT:
        return (num_blocks, HEADS, block_size, 2 * HEAD_SIZE)
    return (2, num_blocks, block_size, HEADS, HEAD_SIZE)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random values, never all zeros; float8 from float32 (there is no float8 randn)."""
    return (torch.randn(shape, generator=generator) * 3 + 0.5).to(dtype)


def random_caches(
    layout: PagedKVLayout,
    num_blocks: int,
    dtype: torch.dtype,
    seed: int,
    block_size: int = BLOCK_SIZE,
    num_layers: int = NUM_LAYERS,
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [random_tensor(cache_shape(layout, num_blocks, block_size), dtype, generator) for _ in range(num_layers)]


def block(cache: torch.Tensor, layout: PagedKVLayout, block_id: int) -> torch.Tensor:
    return cache.select(layout.block_dim, block_id)


def distinct_ids(count: int, num_blocks: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randperm(num_blocks, generator=generator)[:count]


@ALL_LAYOUTS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_round_trip_into_other_block_ids(layout: PagedKVLayout, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(7)
    source = random_caches(layout, num_blocks=11, dtype=dtype, seed=1)
    dest = random_caches(layout, num_blocks=13, dtype=dtype, seed=2)
    dest_before = [c.clone() for c in dest]
    src_ids = distinct_ids(4, 11, generator)
    dst_ids = distinct_ids(4, 13, generator)
    assert not torch.equal(src_ids, dst_ids)

    gathered = gather_blocks(source, layout, src_ids)
    assert gathered.shape == (NUM_LAYERS, *layout.block_shape(source[0], 4))
    scatter_blocks(dest, layout, dst_ids, gathered)

    for layer in range(NUM_LAYERS):
        for src, dst in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
            assert same_bits(block(dest[layer], layout, dst), block(source[layer], layout, src))
        untouched = [b for b in range(13) if b not in dst_ids.tolist()]
        for other in untouched:
            assert same_bits(block(dest[layer], layout, other), block(dest_before[layer], layout, other))


def _arranged(cache: torch.Tensor, layout: PagedKVLayout, arrangement: str) -> torch.Tensor:
    """The same values as ``cache`` in another memory arrangement."""
    if arrangement == "contiguous":
        return cache
    if arrangement == "inner dims transposed":  # a block is not one piece of memory
        return cache.transpose(-1, -2).contiguous().transpose(-1, -2)
    if arrangement == "blocks apart":  # every other block of a larger tensor: a run is not one piece
        wide = list(cache.shape)
        wide[layout.block_dim] *= 2
        spread = torch.empty(wide, dtype=cache.dtype).narrow(layout.block_dim, 0, wide[layout.block_dim])
        spread = spread.unfold(layout.block_dim, 1, 2).squeeze(-1)
        spread.copy_(cache)
        return spread
    assert arrangement == "outer dims apart"  # room for more blocks: the dims before them are strided
    longer = list(cache.shape)
    longer[layout.block_dim] += 3
    padded = torch.empty(longer, dtype=cache.dtype).narrow(layout.block_dim, 1, cache.shape[layout.block_dim])
    padded.copy_(cache)
    return padded


@ALL_LAYOUTS
@pytest.mark.parametrize("arrangement", ["contiguous", "inner dims transposed", "blocks apart", "outer dims apart"])
def test_paged_round_trip_whatever_the_memory_arrangement(layout: PagedKVLayout, arrangement: str) -> None:
    # Runs of consecutive ids on one side only, on both sides, and single blocks.
    src_ids, dst_ids = torch.tensor([3, 4, 5, 0, 7, 8, 1]), torch.tensor([8, 9, 2, 3, 4, 0, 6])
    source = [
        _arranged(cache, layout, arrangement)
        for cache in random_caches(layout, num_blocks=9, dtype=torch.bfloat16, seed=11)
    ]
    dest = [
        _arranged(cache, layout, arrangement)
        for cache in random_caches(layout, num_blocks=10, dtype=torch.bfloat16, seed=12)
    ]
    dest_before = [cache.clone() for cache in dest]
    gathered = gather_blocks(source, layout, src_ids)
    # The blocks a consumer writes may be a narrowed view of what arrived (a prefix it had already).
    skipped = gathered.narrow(1 + layout.block_dim, 2, len(src_ids) - 2)
    if arrangement != "contiguous":
        skipped = _arranged(skipped.contiguous(), PagedKVLayout("all", 1 + layout.block_dim, 0), arrangement)
    scatter_blocks(dest, layout, dst_ids[2:], skipped)
    for layer in range(NUM_LAYERS):
        for position, (src, dst) in enumerate(zip(src_ids.tolist(), dst_ids.tolist(), strict=True)):
            assert same_bits(block(gathered[layer], layout, position), block(source[layer], layout, src))
            expected = source[layer] if position >= 2 else dest_before[layer]
            assert same_bits(block(dest[layer], layout, dst), block(expected, layout, src if position >= 2 else dst))
        for other in set(range(10)) - set(dst_ids.tolist()):
            assert same_bits(block(dest[layer], layout, other), block(dest_before[layer], layout, other))


@ALL_LAYOUTS
def test_paged_round_trip_keeps_nan_and_negative_zero_bits(layout: PagedKVLayout) -> None:
    source = random_caches(layout, num_blocks=3, dtype=torch.float32, seed=3, num_layers=1)
    flat = source[0].view(-1)
    flat[0] = float("nan")
    flat[1] = -0.0
    flat.view(torch.int32)[2] = 0x7FC0_1234  # a NaN with a payload
    dest = random_caches(layout, num_blocks=3, dtype=torch.float32, seed=4, num_layers=1)
    scatter_blocks(dest, layout, torch.tensor([2, 0, 1]), gather_blocks(source, layout, torch.tensor([0, 1, 2])))
    assert same_bits(block(dest[0], layout, 2), block(source[0], layout, 0))


def test_paged_storage_pack_mismatch_load() -> None:
    layout = VLLM_CPU_LAYOUT
    tokens = torch.arange(100, 112)  # 12 tokens -> 3 blocks of 5
    producer = PagedKV(PagedKVCaches(random_caches(layout, 9, torch.bfloat16, seed=5), layout), [6, 2, 4])
    consumer_caches = random_caches(layout, 7, torch.bfloat16, seed=6)
    consumer = PagedKV(PagedKVCaches(consumer_caches, layout), torch.tensor([0, 5, 3], dtype=torch.int32))
    KVRequest(tokens, producer)  # validates the block count
    key, value = producer.pack()
    assert value is None
    assert consumer.mismatch(key, value) is None
    consumer.load(key, value)
    for layer in range(NUM_LAYERS):
        for src, dst in [(6, 0), (2, 5), (4, 3)]:
            assert same_bits(consumer_caches[layer][dst], producer.caches.caches[layer][src])


def test_paged_mismatch_reasons() -> None:
    layout = FLASH_ATTN_LAYOUT
    consumer = PagedKV(PagedKVCaches(random_caches(layout, 6, torch.float16, seed=8), layout), [1, 4])
    good = gather_blocks(random_caches(layout, 6, torch.float16, seed=9), layout, torch.tensor([0, 3]))
    assert consumer.mismatch(good, None) is None
    assert "no KV" in consumer.mismatch(None, None)
    assert "contiguous" in consumer.mismatch(good, good)
    assert "layer count 2" in consumer.mismatch(good[:2], None)
    assert "block count 1" in consumer.mismatch(good[:, :, :1], None)
    assert "dtype" in consumer.mismatch(good.to(torch.bfloat16), None)
    other_block_size = gather_blocks(
        random_caches(layout, 6, torch.float16, seed=9, block_size=4), layout, torch.tensor([0, 3])
    )
    assert "block shape" in consumer.mismatch(other_block_size, None)
    other_layout = gather_blocks(
        random_caches(VLLM_CPU_LAYOUT, 6, torch.float16, seed=9), VLLM_CPU_LAYOUT, torch.tensor([0, 3])
    )
    assert consumer.mismatch(other_layout, None) is not None


def test_contiguous_mismatch_reasons() -> None:
    generator = torch.Generator().manual_seed(10)
    keys = [random_tensor((1, 2, 9, 4), torch.float32, generator) for _ in range(NUM_LAYERS)]
    values = [random_tensor((1, 2, 9, 6), torch.float32, generator) for _ in range(NUM_LAYERS)]
    storage = ContiguousKV(keys, values)
    key, value = storage.pack()
    assert storage.mismatch(key, value) is None
    assert "no value" in storage.mismatch(key, None)
    assert "layer count 2" in storage.mismatch(key[:2], value[:2])
    assert "key shape" in storage.mismatch(key[:, :, :, :8], value)
    assert "value dtype" in storage.mismatch(key, value.double())


def test_request_validation_is_a_config_error() -> None:
    layout = VLLM_CPU_LAYOUT
    caches = PagedKVCaches(random_caches(layout, 4, torch.float32, seed=11), layout)
    with pytest.raises(KVConfigError, match="need 2 blocks"):
        KVRequest(torch.arange(7), PagedKV(caches, [0]))
    with pytest.raises(KVConfigError, match=r"\[0, 4\)"):
        PagedKV(caches, [0, 4])
    with pytest.raises(KVConfigError, match="distinct"):
        PagedKV(caches, [1, 1])
    with pytest.raises(KVConfigError, match="integer"):
        KVRequest(torch.arange(5.0), PagedKV(caches, [0]))
    with pytest.raises(KVConfigError, match="1-D"):
        KVRequest(torch.arange(10).view(2, 5), PagedKV(caches, [0, 1]))
    with pytest.raises(KVConfigError, match="layer 1"):
        PagedKVCaches([caches.caches[0], caches.caches[1][:2]], layout)
    with pytest.raises(KVConfigError, match="one key and one value"):
        ContiguousKV([torch.ones(2)], [])
    with pytest.raises(KVConfigError, match="needs dimensions"):
        PagedKVCaches([torch.ones(4, 5)], layout)


class _FixedEntryBuffer(KVLookupBufferBase):
    """Answers every select with one preset entry: lets a test hand the connector an entry that a
    correct buffer would never return (other tokens, a partial region)."""

    def __init__(self, entry: list[torch.Tensor | None]) -> None:
        self.entry = entry

    def insert(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("not used")

    def drop_select(
        self, input_tokens: torch.Tensor, roi: torch.Tensor, timeout: float | None = None, borrow: bool = False
    ) -> list:
        return list(self.entry)

    def stats(self) -> BufferStats:
        return BufferStats(role="kv_consumer")

    def close(self) -> None:
        return None


@pytest.mark.parametrize(
    ("tokens", "roi", "reason"),
    [
        (torch.tensor([1, 2, 9]), torch.ones(3, dtype=torch.bool), "tokens differ"),
        (torch.tensor([1, 2]), torch.ones(2, dtype=torch.bool), "tokens differ"),
        (torch.tensor([1, 2, 3]), torch.tensor([True, True, False]), "other token positions"),
    ],
)
def test_recv_never_uses_an_entry_for_other_tokens(tokens: torch.Tensor, roi: torch.Tensor, reason: str) -> None:
    generator = torch.Generator().manual_seed(12)
    sent = ContiguousKV(
        [random_tensor((2, 3, 4), torch.float32, generator) for _ in range(2)],
        [random_tensor((2, 3, 4), torch.float32, generator) for _ in range(2)],
    )
    key, value = sent.pack()
    dest = ContiguousKV([torch.zeros(2, 3, 4) for _ in range(2)], [torch.zeros(2, 3, 4) for _ in range(2)])
    buffer = _FixedEntryBuffer([tokens, roi, key, value, None])
    [result] = recv_kv_caches_and_hidden_states(buffer, [KVRequest(torch.tensor([1, 2, 3]), dest)])
    assert not result.hit and reason in result.reason
    assert all(torch.count_nonzero(t) == 0 for t in [*dest.keys, *dest.values])  # nothing written

    [result] = recv_kv_caches_and_hidden_states(
        _FixedEntryBuffer(
            [torch.tensor([1, 2, 3], dtype=torch.int32), torch.ones(3, dtype=torch.bool), key, value, None]
        ),
        [KVRequest(torch.tensor([1, 2, 3]), dest)],
    )
    assert result.hit and result.reason is None  # the same tokens in another integer dtype do match
    assert all(same_bits(d, s) for d, s in zip([*dest.keys, *dest.values], [*sent.keys, *sent.values], strict=True))


# --- over a real pipe and lookup buffer, in two processes -------------------------------------------

PRODUCER_BLOCKS, CONSUMER_BLOCKS, HIDDEN = 19, 23, 16


def _tokens(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 50_000, (length,), generator=torch.Generator().manual_seed(seed))


def _hidden(seed: int) -> torch.Tensor:
    return random_tensor((HIDDEN,), torch.float32, torch.Generator().manual_seed(seed))


def _contiguous(seed: int, num_tokens: int) -> ContiguousKV:
    generator = torch.Generator().manual_seed(seed)
    return ContiguousKV(
        [random_tensor((2, num_tokens, 4), torch.float16, generator) for _ in range(NUM_LAYERS)],
        [random_tensor((2, num_tokens, 4), torch.float16, generator) for _ in range(NUM_LAYERS)],
    )


#: name -> (tokens, producer block ids, consumer block ids); block size 5. Lengths 12, 5, 23, 1.
PAGED_REQUESTS = {
    "a": (_tokens(12, 1), [3, 17, 0], [22, 1, 9]),
    "b": (_tokens(5, 2), [5], [0]),
    "c": (_tokens(23, 3), [18, 1, 2, 11, 7], [4, 13, 2, 20, 6]),
    "one": (_tokens(1, 4), [9], [15]),
}
CONTIGUOUS_TOKENS = _tokens(9, 5)
#: Sent with 2 layers; the consumer has 3.
FEWER_LAYERS_TOKENS = _tokens(10, 6)
#: Sent with block size 4 (3 blocks); the consumer's block size 5 needs 2.
OTHER_BLOCK_SIZE_TOKENS = _tokens(10, 7)
#: Sent as float16; the consumer's caches are bfloat16.
OTHER_DTYPE_TOKENS = _tokens(6, 8)
#: Sent without a hidden state; the consumer asks for one.
NO_HIDDEN_TOKENS = _tokens(4, 9)
#: Never sent.
ABSENT_TOKENS = _tokens(8, 10)
NUM_SENT = len(PAGED_REQUESTS) + 5


def _buffer(port: int, rank: int) -> SimpleBuffer:
    config = KVTransferConfig(
        kv_role="kv_producer" if rank == 0 else "kv_consumer",
        kv_rank=rank,
        kv_port=port,
        kv_timeout=10,
        kv_connect_timeout=30,
        kv_buffer_size=64 << 20,
    )
    return SimpleBuffer(TorchDistributedPipe(config), config)


def _exported(caches: list[torch.Tensor]) -> PagedKVCaches:
    """Caches whose every block lies in whole pages, exported: all their requests can be lent."""
    aligned = [page_aligned_empty(cache.shape, cache.dtype).copy_(cache) for cache in caches]
    paged = PagedKVCaches(aligned, VLLM_CPU_LAYOUT)
    paged.export()
    return paged


def _connector_producer(port: int, lend: bool) -> tuple[list[int], list[str | None]]:
    layout = VLLM_CPU_LAYOUT
    caches = PagedKVCaches(random_caches(layout, PRODUCER_BLOCKS, torch.bfloat16, seed=20), layout)
    if lend:
        caches = _exported(list(caches.caches))
    requests = [
        KVRequest(tokens, PagedKV(caches, src), _hidden(i))
        for i, (tokens, src, _) in enumerate(PAGED_REQUESTS.values())
    ]
    requests.append(KVRequest(CONTIGUOUS_TOKENS, _contiguous(21, len(CONTIGUOUS_TOKENS)), _hidden(30)))
    two_layers = PagedKVCaches(random_caches(layout, 4, torch.bfloat16, seed=22, num_layers=2), layout)
    if lend:  # lent, and refused by the consumer's checks: it must give it back all the same
        two_layers = _exported(list(two_layers.caches))
    requests.append(KVRequest(FEWER_LAYERS_TOKENS, PagedKV(two_layers, [1, 3]), _hidden(31)))
    block_size_4 = PagedKVCaches(random_caches(layout, 4, torch.bfloat16, seed=23, block_size=4), layout)
    requests.append(KVRequest(OTHER_BLOCK_SIZE_TOKENS, PagedKV(block_size_4, [0, 2, 1]), _hidden(32)))
    half = PagedKVCaches(random_caches(layout, 4, torch.float16, seed=24), layout)
    requests.append(KVRequest(OTHER_DTYPE_TOKENS, PagedKV(half, [2, 3]), _hidden(33)))
    requests.append(KVRequest(NO_HIDDEN_TOKENS, PagedKV(caches, [12]), None))
    assert len(requests) == NUM_SENT
    with _buffer(port, 0) as buffer:
        results = send_kv_caches_and_hidden_states(buffer, requests, lend=lend)
        deadline = time.monotonic() + 30
        while buffer.stats().hits < NUM_SENT:  # keep serving until the consumer took everything
            assert time.monotonic() < deadline, f"consumer took only {buffer.stats().hits} entries"
            time.sleep(0.02)
        loans = [None if r.loan is None else r.loan.wait(30) for r in results]
    return [r.num_bytes for r in results], loans


def _connector_consumer(port: int) -> dict[str, tuple[bool, str | None, int]]:
    layout = VLLM_CPU_LAYOUT
    source = random_caches(layout, PRODUCER_BLOCKS, torch.bfloat16, seed=20)  # the producer's data
    dest = random_caches(layout, CONSUMER_BLOCKS, torch.bfloat16, seed=40)
    before = [c.clone() for c in dest]
    caches = PagedKVCaches(dest, layout)

    def paged(tokens: torch.Tensor, ids: list[int], hidden: bool = True) -> KVRequest:
        return KVRequest(tokens, PagedKV(caches, ids), torch.zeros(HIDDEN) if hidden else None)

    names = ["c", "absent", "one", "contiguous", "fewer layers", "a", "block size", "dtype", "no hidden", "b"]
    requests = {name: paged(tokens, dst) for name, (tokens, _, dst) in PAGED_REQUESTS.items()}
    contiguous = _contiguous(41, len(CONTIGUOUS_TOKENS))  # random destination, overwritten on the hit
    requests["contiguous"] = KVRequest(CONTIGUOUS_TOKENS, contiguous, torch.zeros(HIDDEN))
    requests["absent"] = paged(ABSENT_TOKENS, [10, 11])
    requests["fewer layers"] = paged(FEWER_LAYERS_TOKENS, [10, 11])
    requests["block size"] = paged(OTHER_BLOCK_SIZE_TOKENS, [10, 11])
    requests["dtype"] = paged(OTHER_DTYPE_TOKENS, [10, 11])
    requests["no hidden"] = paged(NO_HIDDEN_TOKENS, [10])
    with _buffer(port, 1) as buffer:
        results = recv_kv_caches_and_hidden_states(buffer, [requests[n] for n in names], timeout=2.0)
    outcome = dict(zip(names, results, strict=True))

    written = set()
    for i, (name, (_, src_ids, dst_ids)) in enumerate(PAGED_REQUESTS.items()):
        assert outcome[name].hit, outcome[name].reason
        assert same_bits(requests[name].hidden, _hidden(i))
        for layer in range(NUM_LAYERS):
            for src, dst in zip(src_ids, dst_ids, strict=True):
                assert same_bits(dest[layer][dst], source[layer][src]), (name, layer, src, dst)
        written.update(dst_ids)
    for layer in range(NUM_LAYERS):  # misses wrote nothing: blocks 10 and 11 are as they were
        for other in set(range(CONSUMER_BLOCKS)) - written:
            assert same_bits(dest[layer][other], before[layer][other]), (layer, other)
    sent = _contiguous(21, len(CONTIGUOUS_TOKENS))
    assert all(
        same_bits(d, s) for d, s in zip([*contiguous.keys, *contiguous.values], [*sent.keys, *sent.values], strict=True)
    )
    assert same_bits(requests["contiguous"].hidden, _hidden(30))
    return {name: (r.hit, r.reason, r.num_bytes) for name, r in outcome.items()}


def _connector_side(rank: int, port: int, lend: bool) -> object:
    return _connector_producer(port, lend) if rank == 0 else _connector_consumer(port)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("lend", [False, True], ids=["copied", "lent"])
def test_send_recv_over_pipe_and_buffer(lend: bool) -> None:
    port = procs.free_port(span=4)
    (sent_bytes, loans), outcome = procs.run_pair(_connector_side, (0, port, lend), (1, port, lend), timeout=80)
    # Lent: every request of the exported caches, whether the consumer took it or refused it.
    names = [*PAGED_REQUESTS, "contiguous", "fewer layers", "block size", "dtype", "no hidden"]
    lent = {*PAGED_REQUESTS, "fewer layers", "no hidden"} if lend else set()
    assert dict(zip(names, loans, strict=True)) == {name: "returned" if name in lent else None for name in names}
    hits = {name for name, (hit, _, _) in outcome.items() if hit}
    assert hits == {*PAGED_REQUESTS, "contiguous"}
    reasons = {name: reason for name, (_, reason, _) in outcome.items()}
    assert "no entry" in reasons["absent"]
    assert "layer count 2 received, 3 expected" in reasons["fewer layers"]
    assert "block count 3 received, 2 expected" in reasons["block size"]
    assert "dtype torch.float16 received, torch.bfloat16 expected" in reasons["dtype"]
    assert "no hidden state" in reasons["no hidden"]
    # Every byte the producer inserted for a hit arrived.
    assert outcome["a"][2] == sent_bytes[0] and outcome["contiguous"][2] == sent_bytes[len(PAGED_REQUESTS)]
    assert outcome["absent"][2] == 0


class _RecordingBuffer(_FixedEntryBuffer):
    """Keeps what was inserted, and hands out every tensor to fill from memory it remembers."""

    def __init__(self) -> None:
        super().__init__([])
        self.made: list[torch.Tensor] = []
        self.inserted: list[tuple] = []

    def empty(self, shape, dtype) -> torch.Tensor:
        tensor = torch.full(tuple(shape), 7, dtype=dtype)  # not what the gather writes
        self.made.append(tensor)
        return tensor

    def insert(self, input_tokens, roi, key, value, hidden, timeout=None) -> None:
        self.inserted.append((key, value))


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_send_fills_tensors_the_buffer_made(kind: str) -> None:
    """The producer gathers straight into the buffer's memory (on one host, the pipe's shared
    memory), so the payload needs no copy on its way to the pipe."""
    generator = torch.Generator().manual_seed(4)
    if kind == "paged":
        caches = random_caches(VLLM_CPU_LAYOUT, 6, torch.bfloat16, seed=4)
        ids = torch.tensor([4, 1, 2])
        kv = PagedKV(PagedKVCaches(caches, VLLM_CPU_LAYOUT), ids)
        expected = (gather_blocks(caches, VLLM_CPU_LAYOUT, ids), None)
        tokens = torch.arange(3 * BLOCK_SIZE)
    else:
        keys = [random_tensor((2, 3), torch.float16, generator) for _ in range(3)]
        values = [random_tensor((2, 3), torch.float16, generator) for _ in range(3)]
        kv = ContiguousKV(keys, values)
        expected = (torch.stack(keys), torch.stack(values))
        tokens = torch.arange(2)
    buffer = _RecordingBuffer()
    send_kv_caches_and_hidden_states(buffer, [KVRequest(tokens, kv)])
    [(key, value)] = buffer.inserted
    assert any(key is made for made in buffer.made), "the key was not made by the buffer"
    assert same_bits(key, expected[0])
    if expected[1] is None:
        assert value is None
    else:
        assert any(value is made for made in buffer.made) and same_bits(value, expected[1])
