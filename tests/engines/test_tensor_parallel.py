"""Tensor parallelism: prefill and decode instances of different TP sizes (connector/tp_layout.py).

Unit level: the head plan, the compatibility check, part selects in the lookup buffer (the split of
an entry, its loans, the wire format), the gather of several prefill ranks' entries. Connector
level: fake TP workers, one process per rank, over real kvbridge pipes; each rank holds its slice
of KV heads of one single-rank cache, and every decode rank must end up with exactly its heads of
it, moving no others. With real vLLM engines: tests/serving/test_tensor_parallel_engines.py.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

import numpy as np
import pytest
import torch

from connector import compat, tp_layout
from connector.paged import PagedKVLayout
from connector.tp_layout import Source, plan_sources
from connector.tp_sources import HeadGather, Sources
from connector.transfer_plan import LoadSpec, SaveSpec
from harness import vllm_procs as vp
from harness.procs import free_port
from kv_pipe.errors import KVConfigError, KVProtocolError
from lookup_buffer import protocol
from lookup_buffer.errors import KVInvalidRequestError
from lookup_buffer.loans import RETURNED, TAKEN_BACK, BorrowedTensor, LentTensor, cut
from lookup_buffer.matching import token_arrays
from lookup_buffer.producer import make_entry
from lookup_buffer.store import EntryStore

# ====================================================================== the head plan


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "expected"),
    [
        (1, 1, [[Source(0, None, (0, 8))]]),
        (2, 2, [[Source(0, None, (0, 4))], [Source(1, None, (0, 4))]]),
        (1, 2, [[Source(0, (0, 4), (0, 4))], [Source(0, (4, 8), (0, 4))]]),
        (2, 1, [[Source(0, None, (0, 4)), Source(1, None, (4, 8))]]),
        (
            2,
            4,
            [
                [Source(0, (0, 2), (0, 2))],
                [Source(0, (2, 4), (0, 2))],
                [Source(1, (0, 2), (0, 2))],
                [Source(1, (2, 4), (0, 2))],
            ],
        ),
        (
            4,
            2,
            [[Source(0, None, (0, 2)), Source(1, None, (2, 4))], [Source(2, None, (0, 2)), Source(3, None, (2, 4))]],
        ),
        (1, 8, [[Source(0, (rank, rank + 1), (0, 1))] for rank in range(8)]),
    ],
)
def test_each_decode_rank_loads_exactly_its_heads(prefill_tp: int, decode_tp: int, expected: list) -> None:
    plans = [plan_sources(8, prefill_tp, decode_tp, rank) for rank in range(decode_tp)]
    assert plans == expected
    # Every head of the model lands once, on the decode rank that holds it.
    for rank, plan in enumerate(plans):
        wanted = tp_layout.heads_of_rank(8, decode_tp, rank)
        got = []
        for source in plan:
            start = tp_layout.heads_of_rank(8, prefill_tp, source.rank)[0]
            part = source.part or (0, tp_layout.local_heads(8, prefill_tp))
            got += range(start + part[0], start + part[1])
        assert got == list(range(*wanted))


def test_equal_tp_sizes_pair_rank_to_rank_even_with_replicated_heads_or_a_latent_cache() -> None:
    assert plan_sources(2, 4, 4, 3) == [Source(3, None, (0, 1))]  # 2 KV heads over 4 ranks: replicated
    assert plan_sources(0, 2, 2, 1, latent=True) == [Source(1, None, (0, 1))]
    assert plan_sources(0, 2, 2, 0, has_heads=False) == [Source(0, None, (0, 1))]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (
            dict(total_heads=8, prefill_tp=2, decode_tp=3),
            "TP sizes must be equal or divide one another (prefill TP 2, decode TP 3)",
        ),
        (dict(total_heads=0, prefill_tp=1, decode_tp=2, latent=True), "MLA-style KV cache"),
        (
            dict(total_heads=2, prefill_tp=1, decode_tp=4),
            "2 KV heads are replicated across TP ranks (prefill TP 1, decode TP 4)",
        ),
        (dict(total_heads=2, prefill_tp=4, decode_tp=2), "replicated across TP ranks (prefill TP 4, decode TP 2)"),
        (dict(total_heads=8, prefill_tp=1, decode_tp=2, has_heads=False), "no head dimension"),
    ],
)
def test_unsupported_pairings_are_refused_naming_the_case_and_both_tp_sizes(kwargs: dict, named: str) -> None:
    with pytest.raises(KVConfigError) as error:
        plan_sources(decode_rank=0, **kwargs)
    assert named in str(error.value)


def test_the_head_dimension_of_cpu_and_flash_caches() -> None:
    assert tp_layout.find_head_dim((9, 2, 32, 128), 0, 2, 2) == 1  # vLLM CPU, even when heads == 2
    assert tp_layout.find_head_dim((2, 9, 32, 2, 64), 1, 2, 2) == 3  # flash attention: not the K/V dimension
    assert tp_layout.find_head_dim((9, 32, 576), 0, 1, None) is None  # MLA: one latent per token


@pytest.mark.parametrize("heads", [2, 4, None])
def test_the_head_dimension_comes_after_a_kv_dimension_of_the_same_size(heads: int | None) -> None:
    # Blocks first, then K/V ([blocks, 2, block_size, heads, head_size] and [blocks, 2, heads,
    # block_size, head_size]): the K/V dimension is never taken for the heads, so a rank holding 2
    # heads finds the same head dimension as one holding 4 and the two TP sizes pair.
    size = heads or 4
    assert tp_layout.find_head_dim((9, 2, 32, size, 64), 0, 2, heads) == 3
    assert tp_layout.find_head_dim((9, 2, size, 32, 64), 0, 3, heads) == 2


# ====================================================================== the compatibility check


def info(**changes: Any) -> compat.KVLayoutInfo:
    """A rank of a model with 8 KV heads of size 64 in vLLM CPU blocks; TP 1 unless changed."""
    tp = changes.get("tp_size", 1)
    values = dict(
        version=compat.VERSION,
        role="kv_producer",
        model="m",
        dtype="torch.float32",
        block_size=32,
        num_layers=2,
        block_shape=(1, 8 // tp, 32, 128),
        layout="CPU_ATTN/vec",
        tp_size=tp,
        tp_rank=0,
        total_kv_heads=8,
        head_size=64,
        head_dim=1,
    )
    values.update(changes)
    return compat.KVLayoutInfo(**values)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (1, 8), (2, 2)])
def test_tp_sizes_that_divide_one_another_pair(prefill_tp: int, decode_tp: int) -> None:
    prefill, decode = info(tp_size=prefill_tp), info(role="kv_consumer", tp_size=decode_tp, tp_rank=decode_tp - 1)
    compat.check_compatible(prefill, compat.decode(compat.encode(decode)))
    compat.check_compatible(decode, compat.decode(compat.encode(prefill)))


@pytest.mark.parametrize(
    ("consumer", "named"),
    [
        (dict(tp_size=3, total_kv_heads=12, block_shape=(1, 4, 32, 128)), "total_kv_heads: this side 8, peer 12"),
        (dict(tp_size=4, total_kv_heads=12, block_shape=(1, 3, 32, 128)), "total_kv_heads: this side 8, peer 12"),
        (dict(head_size=128, block_shape=(1, 8, 32, 256)), "head_size: this side 64, peer 128"),
        (
            dict(tp_size=2, block_shape=(1, 4, 64, 128), block_size=64),
            "block_shape (apart from its KV heads): this side (1, 8, 32, 128), peer (1, 4, 64, 128)",
        ),
        (dict(tp_size=2, num_layers=3), "num_layers: this side 2, peer 3"),
    ],
)
def test_what_must_match_is_refused_with_both_sides_values(consumer: dict, named: str) -> None:
    with pytest.raises(KVConfigError) as error:
        compat.check_compatible(info(), info(role="kv_consumer", **consumer))
    assert named in str(error.value)


@pytest.mark.parametrize(
    ("producer", "consumer", "named"),
    [
        (
            dict(tp_size=2, total_kv_heads=6, block_shape=(1, 3, 32, 128)),
            dict(tp_size=3, total_kv_heads=6, block_shape=(1, 2, 32, 128)),
            "tp_size: this side 2, peer 3: TP sizes must be equal or divide one another (prefill TP 2, decode TP 3)",
        ),
        (
            dict(total_kv_heads=2, block_shape=(1, 2, 32, 128)),
            dict(tp_size=4, total_kv_heads=2, block_shape=(1, 1, 32, 128)),
            "tp_size: this side 1, peer 4: 2 KV heads are replicated across TP ranks (prefill TP 1, decode TP 4)",
        ),
        (
            dict(total_kv_heads=0, head_dim=-1, latent=True, block_shape=(1, 32, 576)),
            dict(tp_size=2, total_kv_heads=0, head_dim=-1, latent=True, block_shape=(1, 32, 576)),
            "tp_size: this side 1, peer 2: an MLA-style KV cache (one latent per token, the same on every TP rank) "
            "needs equal TP sizes on both sides (prefill TP 1, decode TP 2)",
        ),
    ],
)
def test_tp_pairings_that_cannot_work_are_refused_at_connection_naming_the_case(
    producer: dict, consumer: dict, named: str
) -> None:
    prefill, decode = info(**producer), info(role="kv_consumer", **consumer)
    for local, peer in ((prefill, decode), (decode, prefill)):
        with pytest.raises(KVConfigError) as error:
            compat.check_compatible(local, compat.decode(compat.encode(peer)))
        assert named.split(": ", 2)[2] in str(error.value)  # the case, with both TP sizes
    with pytest.raises(KVConfigError) as error:
        compat.check_compatible(prefill, decode)
    assert named in str(error.value)


@pytest.mark.parametrize(
    "changes",
    [
        dict(block_shape=(1, 3, 32, 128)),  # 3 heads in a block, 8 over 1 rank
        dict(tp_size=3, block_shape=(1, 2, 32, 128)),  # 8 heads cannot split over 3 ranks
        dict(head_dim=7),
        dict(head_dim=1, latent=True),
        dict(total_kv_heads=-1),
    ],
)
def test_a_peer_whose_head_fields_contradict_each_other_is_refused(changes: dict) -> None:
    with pytest.raises(KVProtocolError, match="inconsistent peer message"):
        compat.decode(compat.encode(info(**changes)))


# ====================================================================== part selects in the lookup buffer


def _key(shape: tuple[int, ...] = (2, 3, 4, 3, 10)) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)


def _entry(key: torch.Tensor | LentTensor, first: int = 0) -> tuple[Any, Any]:
    tokens = torch.arange(first, first + 6)
    return make_entry(tokens, torch.ones(6, dtype=torch.bool), key, None, None)


def test_a_part_select_splits_the_entry_once_and_each_part_goes_to_its_own_select() -> None:
    store = EntryStore(1 << 20, 1 << 20)
    key = _key()
    match_key, entry = _entry(key)
    store.put(match_key, entry, 0)
    second = store.pop_part(match_key, (2, 2, 4))
    assert torch.equal(second.items[1], key[:, :, 2:4])
    assert store.pop(match_key) is None  # a whole select never takes a part
    assert store.pop_part(match_key, (2, 1, 2)) is None  # nor a part select of another width
    assert store.counters().entries == 1 and store.counters().bytes == entry.nbytes - second.nbytes
    first = store.pop_part(match_key, (2, 0, 2))
    assert torch.equal(first.items[1], key[:, :, 0:2]) and store.pop_part(match_key, (2, 0, 2)) is None
    assert store.counters().entries == 0 and store.counters().bytes == 0
    assert first.items[0] is not second.items[0]  # each part's header is stamped for its own select


@pytest.mark.parametrize("part", [(2, 1, 3), (2, 0, 3), (5, 0, 1), (2, 4, 5)])
def test_a_part_that_does_not_divide_the_entry_is_refused_and_leaves_it(part: tuple[int, int, int]) -> None:
    store = EntryStore(1 << 20, 1 << 20)
    match_key, entry = _entry(_key())
    store.put(match_key, entry, 0)
    with pytest.raises(KVInvalidRequestError, match="equal parts"):
        store.pop_part(match_key, part)
    assert store.pop(match_key) is entry


def _lent_key(key: torch.Tensor) -> tuple[LentTensor, torch.Tensor]:
    from kv_pipe.exported_memory import export_host_memory, page_aligned_empty

    memory = page_aligned_empty(key.shape, key.dtype).copy_(key)
    export_host_memory(memory)
    lent = LentTensor.over(key.shape, key.dtype, [(memory.data_ptr(), memory.numel() * 4)])
    assert lent is not None
    return lent, memory


def test_a_lent_entry_splits_into_lent_parts_whose_loans_end_the_entrys() -> None:
    key = _key()
    lent, memory = _lent_key(key)
    store = EntryStore(1 << 20, 1 << 20)
    match_key, entry = _entry(lent)
    store.put(match_key, entry, 0)
    part = store.pop_part(match_key, (2, 1, 2))
    assert isinstance(part.items[1], LentTensor) and part.loan in entry.loan.children
    copy = part.items[1].materialize(lambda shape, dtype: torch.empty(tuple(shape), dtype=dtype))
    assert torch.equal(copy, key[:, :, 1:2])
    part.loan.end(RETURNED)
    assert entry.loan.outcome is None  # three parts are still lent
    # The owner needs the blocks: every part still stored leaves the store, and the entry's loan ends.
    assert entry.loan.take_back(1.0) and entry.loan.outcome == TAKEN_BACK
    assert store.counters().entries == 0 and store.pop_part(match_key, (2, 0, 1)) is None
    del memory


def test_a_split_lent_entry_past_its_lease_has_its_parts_copied_into_the_buffer() -> None:
    key = _key()
    lent, memory = _lent_key(key)
    store = EntryStore(1 << 20, 1 << 20)
    match_key, entry = _entry(lent)
    store.put(match_key, entry, 0)
    store.pop_part(match_key, (2, 0, 2)).loan.end(RETURNED)
    assert store.unlend(entry.loan, lambda shape, dtype: torch.empty(tuple(shape), dtype=dtype)) == match_key
    assert entry.loan.outcome == RETURNED  # the part taken was returned, the other copied
    memory.fill_(-1.0)  # the blocks are vLLM's again
    rest = store.pop_part(match_key, (2, 2, 4))
    assert rest.loan is None and torch.equal(rest.items[1], key[:, :, 2:4])


def test_a_span_of_a_part_is_taken_after_the_split_and_the_other_parts_stay_whole() -> None:
    store = EntryStore(1 << 20, 1 << 20)
    key = _key()
    match_key, entry = _entry(key)
    store.put(match_key, entry, 0)
    # Blocks [1, 3) of heads [0, 2): the other half of the heads stays stored with all its blocks.
    first = store.pop_part(match_key, (2, 0, 2), span=(1, 1, 3))
    assert torch.equal(first.items[1], key[:, 1:3, 0:2])
    assert first.nbytes < entry.nbytes // 2 and store.counters().entries == 1
    with pytest.raises(KVInvalidRequestError, match="does not fit"):
        store.pop_part(match_key, (2, 2, 4), span=(1, 2, 4))  # past the last block: refused, left
    second = store.pop_part(match_key, (2, 2, 4))
    assert torch.equal(second.items[1], key[:, :, 2:4]) and store.counters().entries == 0


@pytest.mark.parametrize("span", [(1, 0, 4), (5, 0, 1), (1, 2, 2)])
def test_a_span_that_does_not_fit_the_entry_is_refused_and_leaves_it(span: tuple[int, int, int]) -> None:
    store = EntryStore(1 << 20, 1 << 20)
    match_key, entry = _entry(_key())
    store.put(match_key, entry, 0)
    with pytest.raises(KVInvalidRequestError, match="does not fit"):
        store.pop(match_key, span)
    with pytest.raises(KVInvalidRequestError, match="does not fit"):
        store.pop_part(match_key, (2, 0, 2), span)
    assert store.counters().entries == 1 and store.pop(match_key) is entry


def test_a_span_of_a_lent_entry_is_lent_under_its_loan_which_ends_with_it() -> None:
    key = _key()
    lent, memory = _lent_key(key)
    store = EntryStore(1 << 20, 1 << 20)
    match_key, entry = _entry(lent)
    store.put(match_key, entry, 0)
    taken = store.pop(match_key, (1, 2, 3))
    assert isinstance(taken.items[1], LentTensor) and taken.loan is entry.loan
    assert taken.items[1].nbytes == key[:, 2:3].nbytes
    copy = taken.items[1].materialize(lambda shape, dtype: torch.empty(tuple(shape), dtype=dtype))
    assert torch.equal(copy, key[:, 2:3])
    taken.loan.end(RETURNED)
    assert entry.loan.outcome == RETURNED and store.counters().entries == 0  # nothing of it stays lent
    del memory


def test_lent_tensors_narrow_like_torch_over_any_pieces() -> None:
    rng = np.random.default_rng(0)
    for _ in range(100):
        shape = tuple(int(size) for size in rng.integers(1, 5, size=rng.integers(1, 5)))
        tensor = torch.arange(math.prod(shape), dtype=torch.int32).reshape(shape)
        cuts = sorted({0, tensor.numel() * 4, *rng.integers(0, tensor.numel() * 4, size=4).tolist()})
        pieces = np.array([[tensor.data_ptr() + a, b - a] for a, b in zip(cuts, cuts[1:], strict=False)])
        places = np.stack([np.zeros(len(pieces), dtype=np.int64), pieces[:, 0] - tensor.data_ptr()], axis=1)
        lent = LentTensor(shape, torch.int32, pieces, (), places)
        dim = int(rng.integers(0, len(shape)))
        start = int(rng.integers(0, shape[dim]))
        length = int(rng.integers(1, shape[dim] - start + 1))
        narrowed = lent.narrow(dim, start, length)
        out = torch.empty(narrowed.shape, dtype=torch.int32)
        BorrowedTensor(narrowed.shape, torch.int32, narrowed.pieces, [], None).copy_to(
            [(out.data_ptr(), out.numel() * 4)]
        )
        assert torch.equal(out, tensor.narrow(dim, start, length))
        assert np.array_equal(narrowed.places[:, 1] + tensor.data_ptr(), narrowed.pieces[:, 0])
    with pytest.raises(ValueError):
        cut(np.array([4, 4]), np.array([6]), 4)


def test_a_part_select_travels_in_a_versioned_checked_select_request() -> None:
    tokens, roi = token_arrays(torch.arange(4), torch.ones(4, dtype=torch.bool))
    signer = protocol.ControlSigner(None)
    request = protocol.select_request(
        7, tokens, roi, 0, session=b"s" * protocol.SESSION_BYTES, counter=1, part=(2, 4, 8)
    )
    decoded, _, _ = protocol.decode_request(signer, protocol.encode_request(signer, request))
    assert decoded.part == (2, 4, 8) and protocol.PROTOCOL_VERSION == 8
    whole = protocol.select_request(7, tokens, roi, 0, session=b"s" * protocol.SESSION_BYTES, counter=1)
    assert protocol.decode_request(signer, protocol.encode_request(signer, whole))[0].part is None
    for bad in ((2, 4, 4), (2, -1, 3), (99, 0, 1), (2, 0, 1 << 40)):
        with pytest.raises(ValueError):
            protocol.select_request(7, tokens, roi, 0, part=bad)
        forged = protocol.encode_request(
            signer,
            protocol.SelectRequest(
                v=protocol.PROTOCOL_VERSION,
                request_id=7,
                session=b"s" * protocol.SESSION_BYTES,
                counter=1,
                tokens=tokens.tobytes(),
                roi=roi.astype(np.uint8).tobytes(),
                wait_ms=0,
                part=bad,
            ),
        )
        with pytest.raises(protocol.MessageError, match="part"):
            protocol.decode_request(signer, forged)


# ====================================================================== gathering several prefill ranks


class _Scripted:
    """A connection to one prefill rank that answers with ``key`` (None: a miss)."""

    def __init__(self, key: torch.Tensor | None) -> None:
        self.key, self.parts, self.spans = key, [], []
        self.failure = None

    def drop_select(
        self,
        tokens: torch.Tensor,
        roi: torch.Tensor,
        timeout: float | None = None,
        borrow: bool = False,
        part: tuple[int, int, int] | None = None,
        span: tuple[int, int, int] | None = None,
    ) -> list[Any]:
        self.parts.append(part)
        self.spans.append(span)
        return [None] * 5 if self.key is None else [tokens, roi, self.key, None, None]


def _gather(keys: list[torch.Tensor | None], plan: tuple[Source, ...]) -> tuple[HeadGather, list[_Scripted]]:
    buffers = [_Scripted(key) for key in keys]
    return HeadGather(Sources("h", 1, 2, plan, head_dim=2), buffers), buffers


def test_a_gather_presents_each_ranks_heads_in_this_ranks_byte_order_without_copying_them() -> None:
    full = _key((2, 3, 4, 3, 10))
    halves = [full[:, :, :2].contiguous(), full[:, :, 2:].contiguous()]
    gather, buffers = _gather(halves, (Source(0, None, (0, 2)), Source(1, None, (2, 4))))
    tokens = torch.arange(5)
    entry = gather.drop_select(tokens, torch.ones(5, dtype=torch.bool), timeout=1, borrow=True)
    key = entry[2]
    assert isinstance(key, BorrowedTensor) and tuple(key.shape) == tuple(full.shape)
    assert torch.equal(key.to_tensor(), full) and [b.parts for b in buffers] == [[None], [None]]
    key.release()


def test_a_gather_misses_when_any_rank_misses_and_names_a_rank_that_sent_another_shape() -> None:
    full = _key((2, 3, 4, 3, 10))
    plan = (Source(0, None, (0, 2)), Source(1, None, (2, 4)))
    gather, _ = _gather([full[:, :, :2].contiguous(), None], plan)
    assert gather.drop_select(torch.arange(5), torch.ones(5, dtype=torch.bool)) == [None] * 5
    gather, _ = _gather([full[:, :, :2].contiguous(), full[:, :, :3].contiguous()], plan)
    with pytest.raises(KVInvalidRequestError, match="prefill TP rank 1 sent KV of shape"):
        gather.drop_select(torch.arange(5), torch.ones(5, dtype=torch.bool))


def test_a_decode_rank_with_a_part_of_one_rank_names_it_in_its_select() -> None:
    part = _key((2, 3, 1, 3, 10))
    gather, (buffer,) = _gather([part], (Source(0, (1, 2), (0, 1)),))
    entry = gather.drop_select(torch.arange(5), torch.ones(5, dtype=torch.bool))
    assert entry[2] is part and buffer.parts == [(2, 1, 2)] and buffer.spans == [None]
    # A span the caller names is asked of each rank, with the part of its heads: they compose.
    gather.drop_select(torch.arange(5), torch.ones(5, dtype=torch.bool), span=(1, 1, 3))
    assert buffer.parts[-1] == (2, 1, 2) and buffer.spans[-1] == (1, 1, 3)


# ====================================================================== fake TP workers over real pipes

#: The single-rank cache: blocks of HEADS KV heads; sizes that collide with no other dimension.
HEADS, HEAD_SIZE, BLOCK, BLOCKS, LAYERS = 8, 5, 3, 9, 3
TOKENS = {name: list(range(start, start + n)) for name, start, n in (("a", 10, 6), ("b", 30, 9), ("c", 50, 3))}
SAVES = [SaveSpec("a", TOKENS["a"], [3, 6]), SaveSpec("b", TOKENS["b"], [1, 4, 7]), SaveSpec("c", TOKENS["c"], [2])]
#: Where each saved request goes on the decode side, and how many of its blocks vLLM already holds.
TARGETS = {"a": ([0, 5], 0), "b": ([6, 8, 1], 1), "c": ([4], 0)}


def single_rank_cache(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn((BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE), generator=generator) * 3 + 0.5 for _ in range(LAYERS)]


def rank_caches(seed: int, tp: int, rank: int) -> list[torch.Tensor]:
    """TP rank ``rank``'s slice of heads of :func:`single_rank_cache`, in page-aligned (lendable) memory."""
    from kv_pipe.exported_memory import page_aligned_empty

    start, stop = tp_layout.heads_of_rank(HEADS, tp, rank)
    return [
        page_aligned_empty((BLOCKS, stop - start, BLOCK, 2 * HEAD_SIZE), torch.float32).copy_(cache[:, start:stop])
        for cache in single_rank_cache(seed)
    ]


def tp_worker(role: str, port: int, tp: int, rank: int, caches: list[torch.Tensor], options: dict[str, Any]) -> Any:
    """A connected WorkerSide of TP rank ``rank`` of ``tp`` (as vllm_v1 builds it), over kvbridge's pipes."""
    from connector.vllm_settings import ConnectorSettings, listen_port_offset
    from connector.vllm_worker import WorkerSide

    extra = {"kv_ip": "127.0.0.1", "kv_timeout": 3.0, "kv_connect_timeout": 60.0, "kv_buffer_size": 1 << 20, **options}
    settings = ConnectorSettings.from_vllm(role, port, "cpu", extra)
    identity = compat.KVLayoutInfo(
        version=compat.VERSION,
        role=role,
        model="fake",
        dtype="",
        block_size=BLOCK,
        num_layers=0,
        block_shape=(),
        layout="",
        tp_size=tp,
        tp_rank=rank,
        total_kv_heads=HEADS,
        head_size=HEAD_SIZE,
    )
    worker = WorkerSide(settings, identity, listen_port_offset(rank))
    worker.connect(caches, PagedKVLayout("CPU_ATTN/fake", block_dim=0, block_size_dim=2))
    return worker


def tp_producer_body(
    port: int, tp: int, rank: int, lend: bool, saved: Any, done: list[Any], timeout: float
) -> dict[str, Any]:
    """Prefill TP rank ``rank``: save SAVES, serve until every decode rank is done, then until vLLM
    would have every block back."""
    worker = tp_worker("kv_producer", port, tp, rank, rank_caches(1, tp, rank), {"kv_lend_blocks": lend})
    try:
        with torch.inference_mode():
            worker.save(SAVES)
        loans = dict(worker._kept)
        outcomes = worker.take_save_outcomes()
        worker.hold([spec.req_id for spec in SAVES])
        saved.set()
        if not all(flag.wait(timeout) for flag in done):
            raise TimeoutError(f"the decode ranks did not finish within {timeout} s")
        returned: set[str] = set()
        deadline = time.monotonic() + timeout
        while len(returned) < len(SAVES) and time.monotonic() < deadline:
            returned |= worker.take_finished_sending()
            time.sleep(0.01)
        buffer = worker.buffer_stats()
        return {
            "outcomes": outcomes,
            "returned": returned,
            "entries_left": buffer.entries,
            "hits": buffer.hits,
            "loans": {req_id: None if loan is None else loan.outcome for req_id, loan in loans.items()},
            "sent_bytes": buffer.transferred_bytes,
            "stats": worker.total_stats().data,
        }
    finally:
        worker.close()


def tp_consumer_body(
    port: int,
    tp: int,
    rank: int,
    producer_tp: int | None,
    saved: list[Any],
    done: Any,
    timeout: float,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Decode TP rank ``rank``: load every request of SAVES (announced with ``producer_tp``)."""
    with vp._captured_warnings() as warnings:
        worker = tp_worker(
            "kv_consumer", port, tp, rank, rank_caches(2, tp, rank), {"kv_load_timeout": 5.0, **(options or {})}
        )
        try:
            if not all(flag.wait(timeout) for flag in saved):
                raise TimeoutError(f"the prefill ranks did not save within {timeout} s")
            loads = [
                LoadSpec(
                    spec.req_id,
                    spec.token_ids,
                    TARGETS[spec.req_id][0],
                    TARGETS[spec.req_id][1],
                    wait=True,
                    producer=("127.0.0.1", port),
                    producer_tp=producer_tp,
                )
                for spec in SAVES
            ]
            failed = sorted(vp.load_and_wait(worker, loads, timeout))
            return {
                "failed": failed,
                "stats": worker.total_stats().data,
                "connections": worker.connections,
                "caches": [cache.numpy() for cache in worker.caches],
                "warnings": list(warnings),
            }
        finally:
            done.set()
            worker.close()


def run_tp(
    prefill_tp: int,
    decode_tp: int,
    lend: bool = True,
    announced: int | None = -1,
    consumer_options: dict[str, Any] | None = None,
    decode_ranks: list[int] | None = None,
    timeout: float = 90,
) -> tuple[list[dict], list[dict]]:
    """Prefill ranks and decode ranks, one process each; the decode ranks' loads name the prefill
    TP size (``announced``, -1: the real one)."""
    port = free_port(span=max(prefill_tp, decode_tp))
    decode_ranks = list(range(decode_tp)) if decode_ranks is None else decode_ranks
    with vp.Engines() as engines:
        saved = [engines.event() for _ in range(prefill_tp)]
        done = [engines.event() for _ in decode_ranks]
        for rank in range(prefill_tp):
            engines.start(
                f"prefill{rank}",
                tp_producer_body,
                {},
                port=port,
                tp=prefill_tp,
                rank=rank,
                lend=lend,
                saved=saved[rank],
                done=done,
                timeout=timeout - 20,
            )
        for index, rank in enumerate(decode_ranks):
            engines.start(
                f"decode{rank}",
                tp_consumer_body,
                {},
                port=port,
                tp=decode_tp,
                rank=rank,
                producer_tp=prefill_tp if announced == -1 else announced,
                saved=saved,
                done=done[index],
                timeout=timeout - 20,
                options=consumer_options,
            )
        names = [f"prefill{rank}" for rank in range(prefill_tp)] + [f"decode{rank}" for rank in decode_ranks]
        results = engines.wait(names, timeout=timeout)
    return [results[f"prefill{r}"] for r in range(prefill_tp)], [results[f"decode{r}"] for r in decode_ranks]


def _bits(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint32)


def _key_bytes(spec: SaveSpec, heads: int, skip: int = 0) -> int:
    """Bytes of ``heads`` KV heads of the request's blocks, but its first ``skip``."""
    return LAYERS * (len(spec.block_ids) - skip) * heads * BLOCK * 2 * HEAD_SIZE * 4


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "lend"),
    [
        (1, 2, True),
        (1, 2, False),
        (2, 1, True),
        (2, 1, False),
        (2, 4, True),
        (2, 2, True),
    ],
    ids=["1to2-lent", "1to2-copied", "2to1-lent", "2to1-copied", "2to4-lent", "2to2-lent"],
)
def test_decode_ranks_get_exactly_their_heads_of_the_single_rank_cache_bit_exact(
    prefill_tp: int, decode_tp: int, lend: bool
) -> None:
    prefills, decodes = run_tp(prefill_tp, decode_tp, lend)
    source, before = single_rank_cache(1), single_rank_cache(2)
    decode_heads = tp_layout.local_heads(HEADS, decode_tp)
    for rank, decode in enumerate(decodes):
        assert decode["failed"] == [], decode["warnings"]
        start, stop = tp_layout.heads_of_rank(HEADS, decode_tp, rank)
        for layer, got in enumerate(decode["caches"]):
            expected = before[layer][:, start:stop].numpy().copy()
            for spec in SAVES:
                targets, skip = TARGETS[spec.req_id]
                expected[targets[skip:]] = source[layer][spec.block_ids[skip:], start:stop].numpy()
            assert np.array_equal(_bits(got), _bits(expected)), (rank, layer)
        # Only its heads moved: each request's tokens and roi, and its heads' share of the blocks it
        # did not hold.
        moved = sum(9 * len(spec.token_ids) + _key_bytes(spec, decode_heads, TARGETS[spec.req_id][1]) for spec in SAVES)
        assert decode["stats"]["loaded_bytes"] == moved and decode["stats"]["load_hits"] == len(SAVES)
        sources = max(prefill_tp // decode_tp, 1)
        assert decode["connections"] == sources
    prefill_heads = tp_layout.local_heads(HEADS, prefill_tp)
    for prefill in prefills:
        # Every entry (or every part of it) was taken, every lent block given back, nothing held.
        assert prefill["outcomes"] == ({spec.req_id for spec in SAVES}, set())
        assert prefill["returned"] == {spec.req_id for spec in SAVES} and prefill["entries_left"] == 0
        # Lent: every decode rank copied its heads straight out of the prefill rank's blocks.
        assert set(prefill["loans"].values()) == ({RETURNED} if lend else {None})
        assert prefill["hits"] == len(SAVES) * max(decode_tp // prefill_tp, 1)
        saved = sum(9 * len(spec.token_ids) + _key_bytes(spec, prefill_heads) for spec in SAVES)
        # Each byte a decode rank lacked sent once, and none of the blocks it held.
        sent = sum(9 * len(spec.token_ids) + _key_bytes(spec, prefill_heads, TARGETS[spec.req_id][1]) for spec in SAVES)
        assert prefill["stats"]["saved_bytes"] == saved and prefill["sent_bytes"] == sent < saved


@pytest.mark.timeout(120)
def test_a_decode_rank_expecting_another_prefill_tp_size_is_refused_naming_both() -> None:
    # The prefill instance runs at TP 1; the decode loads are not told (kv_producer_tp_size unset: its own, 2).
    _, (decode,) = run_tp(1, 2, lend=False, announced=None, decode_ranks=[0])
    assert decode["failed"] == sorted(
        {block for spec in SAVES for block in TARGETS[spec.req_id][0][TARGETS[spec.req_id][1] :]}
    )
    assert any(
        "is TP rank 0 of 1; this decode rank (TP rank 0 of 2) loads from TP rank 0 of 2" in warning
        for warning in decode["warnings"]
    ), decode["warnings"]
    assert decode["stats"]["load_hits"] == 0


@pytest.mark.timeout(120)
def test_kv_producer_tp_size_tells_unannounced_loads_the_prefill_tp_size() -> None:
    prefills, decodes = run_tp(2, 1, announced=None, consumer_options={"kv_producer_tp_size": 2})
    assert decodes[0]["failed"] == [] and decodes[0]["stats"]["load_hits"] == len(SAVES)
    assert all(prefill["entries_left"] == 0 for prefill in prefills)


@pytest.mark.timeout(120)
def test_a_pairing_that_cannot_work_fails_its_loads_at_once_naming_the_case() -> None:
    # Announced as TP 3 for a decode instance at TP 2: nothing is dialed, every load fails with why.
    _, (decode,) = run_tp(1, 2, lend=False, announced=3, decode_ranks=[1], timeout=60)
    assert decode["failed"] and decode["stats"]["load_hits"] == 0 and decode["connections"] == 0
    assert any(
        "TP sizes must be equal or divide one another (prefill TP 3, decode TP 2)" in warning
        for warning in decode["warnings"]
    ), decode["warnings"]


# ====================================================================== kvbridge serve


def serve_plan(*options: str, serve_args: tuple[str, ...] = (), cores: list[int] | None = None) -> list[Any]:
    from launch import serve

    args = serve.parser().parse_args(["/models/tiny", "--kv-port", "15000", *options])
    return serve.plan(args, ["--dtype", "float32", *serve_args], {}, kv_budget=8 << 30, cores=cores)


def test_serve_gives_each_kind_of_instance_its_tp_size_and_ports_and_cores_per_rank() -> None:
    import json

    from launch import serve

    instances = serve_plan(
        "--prefill-instances", "2", "--prefill-tp", "2", "--decode-tp", "1", cores=[0, 1, 2, 3, 4, 5]
    )
    commands = {i.name: i.command for i in instances}
    tp = {name: command[command.index("--tensor-parallel-size") + 1] for name, command in commands.items()}
    assert tp == {"prefill-0": "2", "prefill-1": "2", "decode": "1"}
    transfers = {
        name: json.loads(command[command.index("--kv-transfer-config") + 1]) for name, command in commands.items()
    }
    # Prefill instances' ranks listen on consecutive ports, instances TP ports apart.
    assert [transfers[name]["kv_port"] for name in ("prefill-0", "prefill-1", "decode")] == [15000, 15002, 15000]
    assert transfers["decode"]["kv_connector_extra_config"]["kv_producer_tp_size"] == 2
    assert "kv_producer_tp_size" not in transfers["prefill-0"]["kv_connector_extra_config"]
    # 5 TP ranks on 6 cores: one each; the ranks of an instance are separated by "|".
    assert [i.env[serve.BIND_ENV] for i in instances] == ["0|1", "2|3", "4"]
    # vLLM sizes the KV cache per TP rank: the budget is split over the 5 ranks.
    sizes = {command[command.index("--kv-cache-memory-bytes") + 1] for command in commands.values()}
    assert sizes == {str((8 << 30) // 2 // 5 // (1 << 20) * (1 << 20))}


def test_serve_shares_cores_round_robin_between_tp_ranks_when_there_are_too_few() -> None:
    from launch import serve

    instances = serve_plan("--prefill-tp", "2", "--decode-tp", "2", cores=[0, 1])
    assert [i.env[serve.BIND_ENV] for i in instances] == ["0|1", "0|1"]


@pytest.mark.parametrize(
    ("options", "serve_args", "named"),
    [
        (("--prefill-tp", "2", "--decode-tp", "3"), (), "--prefill-tp 2 and --decode-tp 3: one TP size must divide"),
        (("--decode-tp", "2"), ("-tp", "2"), "--decode-tp and --tensor-parallel-size after -- both set TP sizes"),
    ],
)
def test_serve_refuses_tp_sizes_it_cannot_pair(
    options: tuple[str, ...], serve_args: tuple[str, ...], named: str
) -> None:
    with pytest.raises(KVConfigError) as error:
        serve_plan(*options, serve_args=serve_args)
    assert named in str(error.value)


# ====================================================================== the benchmark


@pytest.mark.timeout(240)
@pytest.mark.parametrize("copied", [False, True], ids=["lent", "copied"])
def test_bench_tp_reports_bytes_and_time_per_request_of_each_pairing(tmp_path: Any, copied: bool) -> None:
    import sys

    from harness import procs

    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_tp",
        "--pairs",
        "1:1,1:2,2:1",
        "--tokens",
        "64",
        "--layers",
        "2",
        "--requests",
        "2",
        *(["--copied"] if copied else []),
    ]
    [result] = procs.run_commands([(command, {})], tmp_path, timeout=220)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
        for line in result.stdout.splitlines()
        if line.startswith("| ") and "->" in line.split("|")[1]
    }
    # 64 tokens x 2 layers x 8 heads x 2 x 128 x 2 bytes = 512 KiB of KV per request, and its tokens and roi
    # (0.6 KiB) once per decode rank: a decode rank of two moves half the heads.
    moved = {pair: (cells[0], cells[1]) for pair, cells in rows.items() if pair != "prefill TP -> decode TP"}
    assert moved == {
        "1 -> 1": ("512.6 KiB", "512.6 KiB"),
        "1 -> 2": ("256.6 KiB", "513.1 KiB"),
        "2 -> 1": ("512.6 KiB", "512.6 KiB"),
    }
    assert all(re.fullmatch(r"[0-9.]+ ms", rows[pair][2]) for pair in moved)
