"""Paged KV caches: a request's KV is a list of whole blocks inside one cache tensor per layer.

Blocks are moved whole and their interior is never interpreted: vLLM's CPU layout stores K
transposed inside a block (see docs/architecture.md), and other backends use other interiors, so
slicing single tokens out of a block would corrupt K. All that is assumed is which dimension counts
blocks and which one counts the tokens of a block.

Index operations run on an integer view of the same element size, which copies the bits exactly
and works for every dtype (CPU ``index_copy_`` has no float8 kernel).

Caches on a GPU are gathered and scattered on that GPU (one indexed copy per layer). When the
tensor on the other side lives elsewhere (the host-staged mode: GPU caches, a host pipe), the blocks
cross between host and GPU in one copy: gathered on the GPU, then copied once into the buffer's host
memory (the pipe's shared-memory segment, pinned for it); received in host memory, copied once to
the GPU and scattered there. These run on a stream of the calling thread's own, after the work it
queued before, and are done when the call returns (:func:`kv_pipe.device.staged_copies`), so the
engine's streams never wait for them and vLLM may use the blocks as soon as a load is reported.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np
import torch

from connector.base import EmptyTensor, KVStorage, host_empty
from kv_pipe.device import copy_between, staged_copies
from kv_pipe.errors import KVConfigError
from kv_pipe.exported_memory import export_host_memory
from kv_pipe.parallel_copy import copy_many
from lookup_buffer.loans import BorrowedTensor, LentTensor

_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclasses.dataclass(frozen=True)
class PagedKVLayout:
    """Where blocks and tokens sit in a per-layer paged cache tensor.

    Attributes:
        name: for messages only.
        block_dim: the dimension indexed by block id.
        block_size_dim: the dimension holding the tokens of one block (its size is the block size).
    """

    name: str
    block_dim: int
    block_size_dim: int

    def check_cache(self, cache: torch.Tensor) -> None:
        """Raise :class:`KVConfigError` unless ``cache`` has both dimensions this layout names."""
        if max(self.block_dim, self.block_size_dim) >= cache.dim():
            raise KVConfigError(
                f"paged layout {self.name!r} needs dimensions {self.block_dim} (blocks) and "
                f"{self.block_size_dim} (tokens of a block), got a cache of shape {tuple(cache.shape)}"
            )

    def block_shape(self, cache: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
        """Shape of ``num_blocks`` blocks of ``cache`` gathered along :attr:`block_dim`."""
        shape = list(cache.shape)
        shape[self.block_dim] = num_blocks
        return tuple(shape)


#: vLLM CPU attention: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, K transposed inside a block.
VLLM_CPU_LAYOUT = PagedKVLayout("vllm_cpu", block_dim=0, block_size_dim=2)
#: Flash attention on GPU: ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
FLASH_ATTN_LAYOUT = PagedKVLayout("flash_attn", block_dim=1, block_size_dim=2)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_BITS_DTYPES[tensor.element_size()])


def _runs(block_ids: torch.Tensor) -> np.ndarray:
    """``(position, first block id, count)`` of each run of consecutive ids in ``block_ids``, as an
    ``[n, 3]`` int64 array."""
    ids = block_ids.cpu().numpy().astype(np.int64, copy=False)
    if not len(ids):
        return np.zeros((0, 3), dtype=np.int64)
    starts = np.flatnonzero(np.diff(ids, prepend=ids[0] - 2) != 1)
    counts = np.diff(starts, append=len(ids))
    return np.stack([starts, ids[starts], counts], axis=1)


def gather_blocks(
    caches: Sequence[torch.Tensor], layout: PagedKVLayout, block_ids: torch.Tensor, empty: EmptyTensor | None = None
) -> torch.Tensor:
    """Copy the blocks ``block_ids`` (in that order) of every layer into one new tensor.

    Returns a tensor of shape ``[num_layers, *layout.block_shape(cache, len(block_ids))]`` with the
    caches' dtype, made by ``empty(shape, dtype)`` (default: ``torch.empty`` on the caches' device).
    Where ``empty`` makes it on another device than the caches' (GPU caches, host memory), the blocks
    are gathered on the caches' device and cross once.
    """
    first = caches[0]
    shape = (len(caches), *layout.block_shape(first, len(block_ids)))
    if empty is None:
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
    else:
        out = empty(shape, first.dtype)
    if first.device.type == "cpu":
        staged = out if out.device.type == "cpu" else torch.empty(shape, dtype=first.dtype)
        _copy_runs(
            [(staged[layer], cache) for layer, cache in enumerate(caches)], layout.block_dim, _runs(block_ids).tolist()
        )
        if staged is not out:
            copy_between(out, staged)
        return out
    with staged_copies(first.device):
        staged = out if out.device == first.device else torch.empty(shape, dtype=first.dtype, device=first.device)
        gather_indexed(caches, layout.block_dim, block_ids, staged)
        if staged is not out:
            out.copy_(staged, non_blocking=True)  # the one crossing; done when the block ends
    return out


def scatter_blocks(
    caches: Sequence[torch.Tensor], layout: PagedKVLayout, block_ids: torch.Tensor, blocks: torch.Tensor
) -> None:
    """Write ``blocks`` (as returned by :func:`gather_blocks`) into blocks ``block_ids`` of ``caches``.

    ``blocks[layer]`` is indexed along ``layout.block_dim`` in the order of ``block_ids``; the caller
    has checked shapes and dtypes. ``blocks`` may lie on another device than the caches (host memory
    received for GPU caches): it then crosses once, and is scattered on the caches' device.
    """
    first = caches[0]
    if first.device.type == "cpu":
        if blocks.device.type != "cpu":
            host = torch.empty(blocks.shape, dtype=blocks.dtype)
            copy_between(host, blocks)
            blocks = host
        runs = _runs(block_ids)[:, [1, 0, 2]].tolist()
        _copy_runs([(cache, blocks[layer]) for layer, cache in enumerate(caches)], layout.block_dim, runs)
        return
    with staged_copies(first.device):
        staged = blocks if blocks.device == first.device else blocks.to(first.device, non_blocking=True)
        scatter_indexed(caches, layout.block_dim, block_ids, staged)


def gather_indexed(caches: Sequence[torch.Tensor], dim: int, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """``out[layer] = caches[layer]`` at ``block_ids`` along ``dim``: one indexed copy per layer on the
    caches' device (all of ``out`` and the caches on one device), bit-exact for every dtype."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64).to(caches[0].device, non_blocking=True)
    for layer, cache in enumerate(caches):
        torch.index_select(_bits(cache), dim, ids, out=_bits(out[layer]))


def scatter_indexed(caches: Sequence[torch.Tensor], dim: int, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """``caches[layer]`` at ``block_ids`` along ``dim`` = ``blocks[layer]``: one indexed copy per
    layer on the caches' device (``blocks`` there too), bit-exact for every dtype."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64).to(caches[0].device, non_blocking=True)
    for layer, cache in enumerate(caches):
        _bits(cache).index_copy_(dim, ids, _bits(blocks[layer]))


def _copy_runs(pairs: list[tuple[torch.Tensor, torch.Tensor]], dim: int, runs: list[tuple[int, int, int]]) -> None:
    """For each ``(target, source)`` pair, copy each run ``(target index, source index, count)`` of
    consecutive blocks along ``dim``.

    Where both sides hold each block as one piece of host memory, the run's bytes are found by
    address arithmetic (narrowing a tensor per run and layer cost as much as the copies themselves)
    and the copies are spread over several threads; elsewhere torch's strided copy runs.
    """
    copies = []
    for target, source in pairs:
        target_pieces, source_pieces = _block_pieces(target, dim), _block_pieces(source, dim)
        if target_pieces is None or source_pieces is None:
            # An integer view of the same element size copies the bits exactly, for every dtype.
            target_bits, source_bits = _bits(target), _bits(source)
            for target_index, source_index, count in runs:
                target_bits.narrow(dim, target_index, count).copy_(source_bits.narrow(dim, source_index, count))
            continue
        (target_starts, block_bytes), (source_starts, _) = target_pieces, source_pieces
        copies.extend(
            (target_start + target_index * block_bytes, source_start + source_index * block_bytes, count * block_bytes)
            for target_start, source_start in zip(target_starts, source_starts, strict=True)
            for target_index, source_index, count in runs
        )
    copy_many(copies)


def _block_pieces(tensor: torch.Tensor, dim: int) -> tuple[list[int], int] | None:
    """``(addresses, block bytes)`` if ``tensor`` is in host memory and, for each index of the
    dimensions before ``dim`` (one address each, in order), its blocks along ``dim`` lie back to back,
    each one piece of memory; else None."""
    if tensor.device.type != "cpu":
        return None
    element = tensor.element_size()
    inner = 1  # elements of one block
    for size, stride in zip(reversed(tensor.shape[dim + 1 :]), reversed(tensor.stride()[dim + 1 :]), strict=True):
        if size != 1 and stride != inner:
            return None
        inner *= size
    if tensor.shape[dim] > 1 and tensor.stride(dim) != inner:
        return None
    starts = [tensor.data_ptr()]
    for size, stride in zip(tensor.shape[:dim], tensor.stride()[:dim], strict=True):
        starts = [start + index * stride * element for start in starts for index in range(size)]
    return starts, inner * element


@dataclasses.dataclass(frozen=True)
class PagedKVCaches:
    """The per-layer cache tensors of one model, all of one shape, dtype and device.

    Raises :class:`KVConfigError` on construction when they are not.
    """

    caches: Sequence[torch.Tensor]
    layout: PagedKVLayout

    def __post_init__(self) -> None:
        if len(self.caches) == 0:
            raise KVConfigError("paged KV needs at least one layer's cache tensor")
        first = self.caches[0]
        self.layout.check_cache(first)
        for layer, cache in enumerate(self.caches):
            if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
                raise KVConfigError(
                    f"paged cache of layer {layer} is {tuple(cache.shape)} {cache.dtype} on {cache.device}, "
                    f"layer 0 is {tuple(first.shape)} {first.dtype} on {first.device}"
                )

    @property
    def num_blocks(self) -> int:
        return self.caches[0].shape[self.layout.block_dim]

    @property
    def block_size(self) -> int:
        return self.caches[0].shape[self.layout.block_size_dim]

    @functools.cached_property
    def block_starts(self) -> tuple[np.ndarray, int] | None:
        """The address of block 0 of every layer (and index of the dimensions before the blocks'),
        in order, and a block's bytes; None unless each block is one piece of host memory. Computed
        once: the caches never move (exporting them keeps their addresses)."""
        starts = []
        for cache in self.caches:
            found = _block_pieces(cache, self.layout.block_dim)
            if found is None:
                return None
            starts += found[0]
        return np.array(starts, dtype=np.int64), found[1]

    def export(self) -> None:
        """Share the caches' memory with same-host pipe peers, in place
        (:func:`kv_pipe.exported_memory.export_host_memory`), so that a request's blocks can be lent
        instead of copied. Call it once, before the caches are in use; they then stay allocated for
        the life of the process. Raises :class:`KVConfigError` if they are not in host memory."""
        for cache in self.caches:
            export_host_memory(cache)


@dataclasses.dataclass(frozen=True)
class PagedKV(KVStorage):
    """A request's KV held in blocks ``block_ids`` (in token order) of shared paged caches.

    The blocks must cover exactly the request's tokens: ``ceil(num_tokens / block_size)`` of them.
    The producer and the consumer use their own block ids; only the blocks' contents travel, as one
    tensor of shape ``[num_layers, *block_shape]`` in the buffer's key slot (the value slot is None).
    """

    caches: PagedKVCaches
    block_ids: Sequence[int] | torch.Tensor

    def __post_init__(self) -> None:
        ids = torch.as_tensor(self.block_ids)
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise KVConfigError(f"block_ids must be a 1-D sequence of integers, got {self.block_ids!r}")
        ids = ids.to(device="cpu", dtype=torch.int64)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.caches.num_blocks):
            raise KVConfigError(f"block ids must lie in [0, {self.caches.num_blocks}), got {ids.tolist()}")
        if len(torch.unique(ids)) != len(ids):
            raise KVConfigError(f"block ids of one request must be distinct, got {ids.tolist()}")
        # The dataclass is frozen so that nobody swaps the ids after they were checked.
        object.__setattr__(self, "block_ids", ids)

    def check_tokens(self, num_tokens: int) -> None:
        needed = math.ceil(num_tokens / self.caches.block_size)
        if len(self.block_ids) != needed:
            raise KVConfigError(
                f"{num_tokens} tokens need {needed} blocks of {self.caches.block_size}, "
                f"got {len(self.block_ids)} block ids"
            )

    def pieces(self) -> np.ndarray | None:
        """The request's blocks as ``(address, nbytes)`` pieces (an ``[n, 2]`` int64 array), in the
        byte order of :meth:`pack`'s tensor (a run of consecutive blocks is one piece); None unless
        each block of every layer is one piece of host memory."""
        found = self.caches.block_starts
        if found is None:
            return None
        starts, block_bytes = found
        runs = _runs(self.block_ids)
        firsts = starts[:, None] + runs[None, :, 1] * block_bytes
        sizes = np.broadcast_to(runs[None, :, 2] * block_bytes, firsts.shape)
        return np.stack([firsts.reshape(-1), sizes.reshape(-1)], axis=1)

    def lend(self) -> tuple[LentTensor, None] | None:
        """The request's blocks lent where they lie, if the caches are exported (see
        :meth:`PagedKVCaches.export`) and every block lies in whole exported pages; else None."""
        pieces = self.pieces()
        if pieces is None:
            return None
        first = self.caches.caches[0]
        shape = (len(self.caches.caches), *self.caches.layout.block_shape(first, len(self.block_ids)))
        lent = LentTensor.over(shape, first.dtype, pieces)
        return None if lent is None else (lent, None)

    def pack(self, empty: EmptyTensor = host_empty) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Straight into the buffer's memory: from GPU caches into a host pipe's memory, one copy
        # after a gather on the GPU (host-staged); on a CUDA pipe, a gather into its device memory.
        return gather_blocks(self.caches.caches, self.caches.layout, self.block_ids, empty), None

    def mismatch(self, key: torch.Tensor | None, value: torch.Tensor | None) -> str | None:
        if key is None:
            return "no KV blocks were received"
        if value is not None:
            return "received contiguous KV (a value tensor), expected paged blocks"
        layout = self.caches.layout
        first = self.caches.caches[0]
        if key.dim() != first.dim() + 1:
            return f"received a {key.dim()}-D tensor, paged blocks of layout {layout.name!r} are {first.dim() + 1}-D"
        if key.shape[0] != len(self.caches.caches):
            return f"layer count {key.shape[0]} received, {len(self.caches.caches)} expected"
        if key.shape[1 + layout.block_dim] != len(self.block_ids):
            return f"block count {key.shape[1 + layout.block_dim]} received, {len(self.block_ids)} expected"
        expected = layout.block_shape(first, len(self.block_ids))
        if tuple(key.shape[1:]) != expected:
            return f"block shape {tuple(key.shape[1:])} received, {expected} expected"
        if key.dtype != first.dtype:
            return f"dtype {key.dtype} received, {first.dtype} expected"
        return None

    def load(self, key: torch.Tensor, value: torch.Tensor | None) -> None:
        scatter_blocks(self.caches.caches, self.caches.layout, self.block_ids, key)

    def _first_blocks(self, num_tokens: int) -> PagedKV:
        """The request's first blocks, those holding its first ``num_tokens`` tokens."""
        return PagedKV(self.caches, self.block_ids[: math.ceil(num_tokens / self.caches.block_size)])

    def mismatch_prefix(self, key: torch.Tensor | None, value: torch.Tensor | None, num_tokens: int) -> str | None:
        if num_tokens % self.caches.block_size:
            return f"a prefix of {num_tokens} tokens ends inside a block of {self.caches.block_size}"
        return self._first_blocks(num_tokens).mismatch(key, value)

    def load_prefix(self, key: torch.Tensor, value: torch.Tensor | None, num_tokens: int) -> None:
        self._first_blocks(num_tokens).load(key, value)

    def load_borrowed(self, key: BorrowedTensor, value: torch.Tensor | None) -> None:
        pieces = self.pieces()
        if pieces is None:
            self.load(key.to_tensor(), value)
        else:
            key.copy_to(pieces)  # the one copy: the producer's blocks straight into these
