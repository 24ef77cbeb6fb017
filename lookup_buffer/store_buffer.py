"""StoreBuffer: a lookup buffer whose transport is a :class:`kv_store.TieredStore`, not a pipe.

The producer cuts each entry into chunks of ``chunk_size`` tokens and stores one object per chunk
(:func:`kv_store.encode_chunk`) under its content key (:func:`kv_store.chunk_keys`); the hidden
state travels in the object of the entry's final chunk. A chunk already stored is not encoded or
written again, so prompts sharing a prefix share its objects.

The consumer gets the LONGEST STORED PREFIX of its query: one :meth:`kv_store.TieredStore.lookup`
for all chunk keys, then one :meth:`~kv_store.TieredStore.get_many` for the leading chunks found.
Selecting does not consume anything (other consumers, and later requests with the same prefix, find
the same objects); the store evicts by its own capacity. The returned ``roi`` selects exactly the
positions found, a prefix of the query's (see *Partial hits* in :mod:`lookup_buffer.base`), and
the hidden state comes only when the whole query was found. An object that is missing, damaged,
foreign (another key or tokens) or unauthenticated ends the prefix before its chunk: it is counted
and treated as a miss of that chunk, never loaded.

Layout of the tensors: ``key`` and ``value`` (``value`` may be None, e.g. paged blocks) hold the
entry's tokens along dimension ``token_dim``, ``block_size`` tokens per index there: 1 for
contiguous KV (:class:`connector.ContiguousKV` packs ``[layers, *per-layer shape]``, so its
``token_dim`` is the per-layer token dimension + 1), the block size for paged KV (blocks along
``1 + layout.block_dim``; the final block may be partly filled). ``chunk_size`` must then be a
multiple of ``block_size``, so that a chunk is whole blocks.

Only region-of-interest masks that select a prefix of the tokens (all of them included) are
supported; ``part`` selects and lending are not (a store has no peer memory to lend from).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence

import torch

from kv_pipe.errors import KVConfigError
from kv_store import (
    ChunkKey,
    KVStoreObjectError,
    PutResult,
    TieredStore,
    chunk_keys,
    decode_chunk,
    encode_chunk,
    namespace,
)
from lookup_buffer.base import BufferStats, KVLookupBufferBase, SelectResult
from lookup_buffer.errors import KVInvalidRequestError
from lookup_buffer.loans import LentTensor, Loan

logger = logging.getLogger(__name__)

#: Bumped when the meaning of a chunk's tensors changes, so that old objects are never read as new.
CHUNK_LAYOUT_VERSION = 1
_ROLES = ("kv_producer", "kv_consumer", "kv_both")


class StoreBuffer(KVLookupBufferBase):
    """A lookup buffer over ``store``; see the module docstring.

    Args:
        store: the store; the buffer owns it (:meth:`close` closes it).
        role: ``kv_producer`` (insert), ``kv_consumer`` (drop_select) or ``kv_both``.
        identity: what makes stored KV usable here (model, KV dtype and layout, layers, KV heads,
            head size, tensor-parallel part ...), digested into the keys' namespace
            (:func:`kv_store.namespace`) together with ``token_dim`` and ``block_size``: buffers with
            another identity never see these objects.
        token_dim: the dimension of ``key`` and ``value`` that runs over tokens (or blocks).
        chunk_size: tokens per stored object.
        block_size: tokens per index along ``token_dim`` (1: contiguous KV).
        mac_key: :func:`kv_store.mac_key_from_secret` of the shared secret: objects are signed, and
            objects without a valid signature are refused. None: checksum only.

    Raises:
        KVConfigError: a bad role, chunk size, block size or token dimension.
    """

    #: A select may answer with a prefix of the query (:mod:`lookup_buffer.base`, *Partial hits*).
    returns_prefixes = True

    def __init__(
        self,
        store: TieredStore,
        role: str,
        identity: Mapping[str, str | int],
        *,
        token_dim: int,
        chunk_size: int = 256,
        block_size: int = 1,
        mac_key: bytes | None = None,
    ) -> None:
        if role not in _ROLES:
            raise KVConfigError(f"StoreBuffer needs kv_role in {_ROLES}, got {role!r}")
        for name, number, minimum in (
            ("token_dim", token_dim, 0),
            ("chunk_size", chunk_size, 1),
            ("block_size", block_size, 1),
        ):
            if isinstance(number, bool) or not isinstance(number, int) or number < minimum:
                raise KVConfigError(f"{name} must be an integer >= {minimum}, got {number!r}")
        if chunk_size % block_size:
            raise KVConfigError(
                f"kv_chunk_size ({chunk_size}) must be a multiple of the KV block size "
                f"({block_size}): a stored chunk holds whole blocks"
            )
        self.role = role
        self.chunk_size = chunk_size
        self.token_dim = token_dim
        self.block_size = block_size
        self._store = store
        self._mac_key = mac_key
        self._namespace = namespace(
            {
                **identity,
                "store_buffer.layout_version": CHUNK_LAYOUT_VERSION,
                "store_buffer.token_dim": token_dim,
                "store_buffer.block_size": block_size,
            }
        )
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("inserts", "hits", "misses", "transferred_bytes", "bad_messages"), 0)
        self._closed = False

    # --- producer ------------------------------------------------------------------------------

    def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        key: torch.Tensor | LentTensor,
        value: torch.Tensor | LentTensor | None,
        hidden: torch.Tensor | LentTensor | None,
        timeout: float | None = None,
    ) -> Loan | None:
        """Store the entry's chunks that are not stored yet; the store's writes are bounded by its
        tiers, so ``timeout`` is not used. Returns None (nothing is lent)."""
        if self.role == "kv_consumer":
            raise KVConfigError("insert() needs kv_role 'kv_producer' or 'kv_both'; this buffer is 'kv_consumer'")
        tokens = self._prefix_tokens(input_tokens, roi)
        for name, tensor in (("key", key), ("value", value), ("hidden", hidden)):
            if tensor is not None and not isinstance(tensor, torch.Tensor):
                raise KVInvalidRequestError(f"a StoreBuffer stores tensors, got a {type(tensor).__name__} as {name}")
        units = math.ceil(len(tokens) / self.block_size)
        for name, tensor in (("key", key), ("value", value)):
            if tensor is None and name == "key":
                raise KVInvalidRequestError("key must be a tensor")
            if tensor is not None and (tensor.dim() <= self.token_dim or tensor.shape[self.token_dim] != units):
                raise KVInvalidRequestError(
                    f"{name} of shape {tuple(tensor.shape)} must hold {units} entries along dimension "
                    f"{self.token_dim} for {len(tokens)} tokens in blocks of {self.block_size}"
                )
        keys = self._keys(tokens)
        stored = self._store.lookup([chunk.key for chunk in keys])  # leading chunks need no encoding
        written = 0
        for index, chunk in enumerate(keys[stored:], start=stored):
            tensors = [self._units(tensor, chunk) for tensor in (key, value)]
            tensors.append(hidden if index == len(keys) - 1 else None)
            blob = encode_chunk(chunk.key, tokens[chunk.start : chunk.stop], tensors, self._mac_key)
            if self._store.put(chunk.key, blob) in (PutResult.STORED, PutResult.QUEUED):
                written += len(blob)
        self._count(inserts=1, transferred_bytes=written)
        return None

    def _units(self, tensor: torch.Tensor | None, chunk: ChunkKey) -> torch.Tensor | None:
        if tensor is None:
            return None
        first = chunk.start // self.block_size
        return tensor.narrow(self.token_dim, first, math.ceil(chunk.stop / self.block_size) - first)

    # --- consumer ------------------------------------------------------------------------------

    def drop_select(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        timeout: float | None = None,
        borrow: bool = False,
        part: tuple[int, int, int] | None = None,
        span: tuple[int, int, int] | None = None,
    ) -> SelectResult:
        """The longest stored prefix of the query's selected tokens, or five None when not even its
        first chunk is stored. Not consumed. The store answers at once: what is stored is there, so
        ``timeout`` is not waited. ``borrow`` is ignored (nothing is lent); ``part`` and ``span`` are refused."""
        if self.role == "kv_producer":
            raise KVConfigError("drop_select() needs kv_role 'kv_consumer' or 'kv_both'; this buffer is 'kv_producer'")
        if part is not None or span is not None:
            raise KVInvalidRequestError("a StoreBuffer does not select parts or spans of entries")
        tokens = self._prefix_tokens(input_tokens, roi)
        keys = self._keys(tokens)
        found = self._store.lookup([chunk.key for chunk in keys])
        blobs = self._store.get_many([chunk.key for chunk in keys[:found]]) if found else []
        chunks: list[list[torch.Tensor | None]] = []
        for chunk, blob in zip(keys, blobs, strict=False):
            tensors = self._decode(chunk, tokens, blob, chunks[0] if chunks else None)
            if tensors is None:
                break
            chunks.append(tensors)
        if not chunks:
            self._count(misses=1)
            return [None] * 5
        stop = keys[len(chunks) - 1].stop
        key, value = (
            None if chunks[0][slot] is None else torch.cat([tensors[slot] for tensors in chunks], dim=self.token_dim)
            for slot in (0, 1)
        )
        hidden = chunks[-1][2] if len(chunks) == len(keys) else None
        found_roi = torch.zeros(input_tokens.numel(), dtype=torch.bool)
        found_roi[:stop] = True
        self._count(hits=1, transferred_bytes=sum(len(blob) for blob in blobs[: len(chunks)]))
        return [input_tokens, found_roi, key, value, hidden]

    def _decode(
        self, chunk: ChunkKey, tokens: list[int], blob: bytes | None, first: list[torch.Tensor | None] | None
    ) -> list[torch.Tensor | None] | None:
        """The chunk's ``[key, value, hidden]``, or None (logged, and counted when refused) if it
        cannot extend the prefix: gone since the lookup, refused, or unlike the chunks before it."""
        if blob is None:  # evicted between lookup and get: a plain miss of this chunk
            return None
        try:
            tensors = decode_chunk(blob, chunk.key, tokens[chunk.start : chunk.stop], self._mac_key)
        except KVStoreObjectError as error:
            reason = str(error)
        else:
            reason = self._inconsistency(chunk, tensors, first)
            if reason is None:
                return tensors
        self._count(bad_messages=1)
        logger.warning(
            "stored chunk of tokens [%d, %d) refused, the prefix ends before it: %s", chunk.start, chunk.stop, reason
        )
        return None

    def _inconsistency(
        self, chunk: ChunkKey, tensors: list[torch.Tensor | None], first: list[torch.Tensor | None] | None
    ) -> str | None:
        if len(tensors) != 3 or tensors[0] is None:
            return f"{len(tensors)} tensors, expected key, value and hidden"
        first_index = chunk.start // self.block_size
        units = math.ceil(chunk.stop / self.block_size) - first_index
        reference = first or tensors
        for slot, name in ((0, "key"), (1, "value")):
            tensor, like = tensors[slot], reference[slot]
            if (tensor is None) != (like is None):
                return f"{name} present in one chunk and not in another"
            if tensor is None or like is None:
                continue
            if tensor.dim() <= self.token_dim or tensor.shape[self.token_dim] != units:
                return f"{name} of shape {tuple(tensor.shape)} does not hold {units} entries along {self.token_dim}"
            if tensor.dtype != like.dtype or _without(tensor.shape, self.token_dim) != _without(
                like.shape, self.token_dim
            ):
                return f"{name} {tuple(tensor.shape)} {tensor.dtype} unlike the first chunk's"
        return None

    # --- both ----------------------------------------------------------------------------------

    def _prefix_tokens(self, input_tokens: torch.Tensor, roi: torch.Tensor) -> list[int]:
        """The token ids the roi selects, which must be a non-empty prefix of ``input_tokens``."""
        if not isinstance(input_tokens, torch.Tensor) or input_tokens.dim() != 1 or input_tokens.numel() == 0:
            raise KVInvalidRequestError(f"input_tokens must be a non-empty 1-D tensor, got {input_tokens!r}")
        if input_tokens.is_floating_point() or input_tokens.is_complex() or input_tokens.dtype == torch.bool:
            raise KVInvalidRequestError(f"input_tokens must have an integer dtype, got {input_tokens.dtype}")
        if not isinstance(roi, torch.Tensor) or roi.dtype != torch.bool or roi.shape != input_tokens.shape:
            raise KVInvalidRequestError("roi must be a bool tensor of the shape of input_tokens")
        selected = int(roi.sum())
        if selected == 0 or not bool(roi[:selected].all()):
            raise KVInvalidRequestError(
                "a StoreBuffer supports only a roi that selects a non-empty prefix of the tokens (all of them included)"
            )
        return input_tokens[:selected].tolist()

    def _keys(self, tokens: list[int]) -> list[ChunkKey]:
        return chunk_keys(self._namespace, tokens, self.chunk_size)

    def _count(self, **increments: int) -> None:
        with self._lock:
            for name, amount in increments.items():
                self._counts[name] += amount

    @property
    def store(self) -> TieredStore:
        """The store (its own counters: :meth:`kv_store.TieredStore.stats`)."""
        return self._store

    def stats(self) -> BufferStats:
        """``inserts``: entries inserted; ``hits``: selects that found at least their first chunk
        (a prefix or all); ``misses``: selects that found nothing; ``bad_messages``: stored objects
        refused (damaged, foreign, unauthenticated); ``transferred_bytes``: bytes of the objects
        written (producer) and read (consumer). Nothing is held by the buffer itself."""
        with self._lock:
            counts = dict(self._counts)
        return BufferStats(role=self.role, **counts)

    def close(self) -> None:
        """Close the store: writes still queued for slower tiers are made first, within the store's
        bound (:meth:`kv_store.TieredStore.close`). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._store.close()


def _without(shape: Sequence[int], dim: int) -> tuple[int, ...]:
    return tuple(size for index, size in enumerate(shape) if index != dim)
