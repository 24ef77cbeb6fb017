"""Tensor parallelism: how KV heads are split over TP ranks, and what a decode rank loads from which
prefill rank.

vLLM splits a model's KV heads over its TP ranks in order: with H KV heads and TP size t (t dividing
H), rank r holds heads ``[r * H / t, (r + 1) * H / t)``, each rank's cache a ``[..., H / t, ...]``
slice of the single-rank cache along its head dimension. With fewer KV heads than ranks (``t > H``)
each head is *replicated* on ``t / H`` ranks, rank r holding head ``r * H // t``; an MLA-style
cache has no heads at all (one latent per token, the same on every rank).

A prefill instance at TP size P and a decode instance at TP size D, one dividing the other:

* **P = D**: decode rank r loads prefill rank r's entry, all of it (as before TP sizes could differ;
  replicated heads and latent caches included: both ranks hold the same thing).
* **P > D** (e.g. 2 -> 1): decode rank r gathers the entries of prefill ranks ``r * P / D`` to
  ``(r + 1) * P / D - 1``, whole, each written straight into its slice of heads of the decode
  blocks.
* **P < D** (e.g. 1 -> 2): decode rank r takes part of prefill rank ``r * P // D``'s entry: the
  ``H / D`` heads it holds. The select names that part (:meth:`lookup_buffer.KVLookupBufferBase.drop_select`
  ``part``): the producer splits its entry into ``D / P`` parts of heads, one per decode rank, so
  only the heads a decode rank needs move to it, lent or copied.

Different TP sizes with replicated heads (``H < max(P, D)``) or a latent cache are refused (a
prefill rank's entry would have to go to several decode ranks, or a decode rank would need a head
several prefill ranks hold); so are TP sizes where neither divides the other.

Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kv_pipe.errors import KVConfigError


@dataclasses.dataclass(frozen=True)
class Source:
    """What a decode rank loads from one prefill rank.

    Attributes:
        rank: the prefill TP rank (it listens at the announced port plus ``rank``).
        part: the heads ``[start, stop)`` of that rank's entry to take, or None for all of them.
        heads: where they go: heads ``[start, stop)`` of the decode rank's blocks.
    """

    rank: int
    part: tuple[int, int] | None
    heads: tuple[int, int]


def local_heads(total_heads: int, tp_size: int) -> int:
    """KV heads each rank holds (vLLM's rule: at least one, replicated when there are fewer heads than ranks)."""
    return max(1, total_heads // tp_size)


def heads_of_rank(total_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """The model's KV heads ``[start, stop)`` that TP rank ``rank`` holds."""
    if tp_size > total_heads:
        head = rank * total_heads // tp_size
        return head, head + 1
    share = total_heads // tp_size
    return rank * share, (rank + 1) * share


def tp_refusal(total_heads: int, latent: bool, has_heads: bool, prefill_tp: int, decode_tp: int) -> str | None:
    """Why a prefill instance at TP size ``prefill_tp`` cannot feed a decode instance at ``decode_tp``
    (a model with ``total_heads`` KV heads; ``latent``: an MLA-style cache; ``has_heads``: the
    cache's head dimension is known), or None when it can."""
    if prefill_tp == decode_tp:
        return None
    sizes = f"prefill TP {prefill_tp}, decode TP {decode_tp}"
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        return f"TP sizes must be equal or divide one another ({sizes})"
    if latent:
        return (
            f"an MLA-style KV cache (one latent per token, the same on every TP rank) needs equal TP sizes "
            f"on both sides ({sizes})"
        )
    if not has_heads:
        return f"the KV cache has no head dimension kvbridge knows of, so TP sizes must be equal ({sizes})"
    if total_heads < max(prefill_tp, decode_tp):
        return (
            f"{total_heads} KV heads are replicated across TP ranks ({sizes}): different TP sizes need at "
            f"least as many KV heads as the larger TP size"
        )
    return None


def plan_sources(
    total_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int, latent: bool = False, has_heads: bool = True
) -> list[Source]:
    """The prefill ranks decode rank ``decode_rank`` loads from, in the order of the heads they fill.

    Raises:
        KVConfigError: the pairing is refused (:func:`tp_refusal`), naming both TP sizes.
    """
    if prefill_tp < 1 or decode_tp < 1 or not 0 <= decode_rank < decode_tp:
        raise KVConfigError(
            f"kvbridge: decode TP rank {decode_rank} of {decode_tp} cannot load from a prefill "
            f"instance at TP size {prefill_tp}"
        )
    refusal = tp_refusal(total_heads, latent, has_heads, prefill_tp, decode_tp)
    if refusal is not None:
        raise KVConfigError(f"kvbridge: {refusal}")
    if prefill_tp == decode_tp:
        count = local_heads(total_heads, decode_tp) if has_heads and not latent else 1
        return [Source(decode_rank, None, (0, count))]
    want_start, want_stop = heads_of_rank(total_heads, decode_tp, decode_rank)
    sources = []
    for rank in range(prefill_tp):
        start, stop = heads_of_rank(total_heads, prefill_tp, rank)
        low, high = max(start, want_start), min(stop, want_stop)
        if low >= high:
            continue
        part = None if (low, high) == (start, stop) else (low - start, high - start)
        sources.append(Source(rank, part, (low - want_start, high - want_start)))
    return sources


def find_head_dim(shape: Sequence[int], block_dim: int, block_size_dim: int, heads: int | None) -> int | None:
    """The head dimension of a per-layer paged cache of ``shape``: the last dimension after the
    block dimension, other than the tokens of a block and the last one (the head size), whose size
    is ``heads`` (any, when None). None if there is none (an MLA-style cache: one latent per token).
    The last: a K/V dimension after the blocks comes before the heads, and may have as many entries.

    vLLM CPU ``[blocks, heads, block_size, 2 * head_size]``: 1; flash attention
    ``[2, blocks, block_size, heads, head_size]``: 3; FlashInfer ``[blocks, 2, block_size, heads,
    head_size]``: 3.
    """
    for dim in reversed(range(block_dim + 1, len(shape) - 1)):
        if dim != block_size_dim and (heads is None or shape[dim] == heads):
            return dim
    return None
