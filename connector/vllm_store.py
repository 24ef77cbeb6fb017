"""The storage tier inside vLLM: ``kv_role="kv_both"`` with a ``kv_store`` setting.

Such an instance stores the KV of every prompt it computes in a :class:`kv_store.TieredStore`, in
chunks of ``chunk_size`` tokens, and loads from the store whatever prefix of a new prompt any
instance stored::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_store": {"tiers": "memory,disk:/var/cache/kv", "chunk_size": 256}}}'

Scheduler side (:class:`StoreScheduler`): a new request's prompt is cut into chunks
(:func:`kv_store.chunk_keys`), one :meth:`kv_store.TieredStore.lookup` of every TP rank's keys
says how many leading chunks are stored for all ranks (each rank stores its own object of a
chunk, and vLLM fails a block any rank fails to load), and the stored prefix beyond vLLM's own
prefix cache is claimed as an asynchronous load, never past the whole blocks before the prompt's
last token (vLLM computes that one: :func:`connector.transfer_plan.transfer_prefix_len`). Once a
prompt is computed, its full chunks from the first one the lookup did not find for every rank are
handed to the workers to save (a rank that holds one already writes nothing).

Worker side (:class:`StoreWorker`): a load reads its chunks in one :meth:`~kv_store.TieredStore.get_many`
in a load thread (:class:`connector.vllm_loads.LoadTracker`), or within the step when the step
computes nothing else (:attr:`StoreMetadata.load_inline`: no request waits for it, and vLLM learns of
the load in the same step instead of polling for it in empty steps that compete with the load for
the cores); the read runs in a thread of its own, and each chunk, as soon as it has arrived (while
the next is still being received), is decoded and verified (:func:`kv_store.decode_chunk`: key, tokens, checksum, tag
with a secret; then dtype, shape and the worker's layout) and its blocks are copied from the
object's bytes straight into the blocks vLLM allocated. A chunk that is missing
or fails a check has its blocks reported as load errors: vLLM recomputes them or fails the request
(``kv_load_failure_policy``); wrong KV is never written. A save is handed over in ``wait_for_save``
and copied out of vLLM's blocks by a gather thread (one gather per chunk, into host buffers kept for
the next saves: :class:`StagingPool`), then built into objects (:class:`kv_store.ChunkBuilder`: one
copy, no join), hashed and put by a put thread (bounded: a save that
finds the queue full is dropped and counted); the engine thread copies nothing. vLLM keeps the
blocks meanwhile: the scheduler delays the free of every request with a save, and each worker
reports it finished sending once its gather is done (:meth:`StoreWorker.take_finished_sending`); a
preempted request's gather is cancelled or waited for in ``handle_preemptions``
(:meth:`StoreWorker.preempt`).

Keys: the namespace digests the identity of :mod:`connector.compat` from vLLM's configuration
(model, KV dtype, block size, layers, KV heads per rank, head size, vLLM's KV cache layout, format
version, TP rank and size) and the worker's full layout (block shape, attention backend and its
interior variant), which only the worker knows once its caches are registered: each worker tells
the scheduler its namespace (:class:`StoreHandshake`, through vLLM's handshake metadata, before
the first request), so instances of one model with other attention layouts keep apart on one
store (``kv_both``, and P/D with the store alike). Each object also carries a digest of that
layout, checked on load.

Tiers: ``memory`` lives in each worker process (a cache in front of the shared tiers, filled by
saves and by reads); the scheduler's lookups ask the shared tiers (``disk:PATH``, ``redis://``,
``redis+cluster://``), so a spec needs at least one of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from connector import compat
from connector.paged import PagedKVCaches, PagedKVLayout, gather_blocks, scatter_blocks
from connector.secret import SECRET_FILE_KEY, read_secret_file, refuse_inline_secret, resolve_secret
from connector.transfer_plan import transfer_prefix_len
from connector.vllm_loads import LoadTicket, LoadTracker
from connector.vllm_stats import STORE_LOAD_ERRORS, STORE_TIER_UP, KVBridgeStats
from kv_pipe import cores
from kv_pipe.errors import KVConfigError
from kv_store import (
    Blob,
    ChunkBuilder,
    ChunkKey,
    KVStoreError,
    KVStoreObjectError,
    PutResult,
    StoreTier,
    TieredStore,
    TierStats,
    chunk_keys,
    decode_chunk,
    mac_key_from_secret,
    namespace,
    open_store,
)
from kv_store.keys import KEY_BYTES

logger = logging.getLogger(__name__)

#: The ``kv_connector_extra_config`` key that turns a ``kv_both`` instance into a storage tier.
STORE_KEY = "kv_store"
#: Where the Redis password comes from: this variable, or the file named by the ``_FILE`` one.
PASSWORD_ENV = "KVBRIDGE_STORE_PASSWORD"
PASSWORD_FILE_ENV = "KVBRIDGE_STORE_PASSWORD_FILE"
#: Saves waiting for their blocks' gather, their encoding and put, at most.
SAVE_QUEUE_DEPTH = 16
#: Seconds ``handle_preemptions`` waits for a preempted request's gather under way (then its save is dropped).
PREEMPT_WAIT_SECONDS = 10.0
#: Host buffers of one chunk's blocks kept for later saves (see :class:`StagingPool`).
STAGING_CHUNKS = 4
#: How often a load waiting for its store read looks whether the reading thread still runs.
READ_POLL_SECONDS = 1.0
#: Version of the chunk contents (one tensor of all layers' blocks, then the layout digest).
FORMAT_VERSION = 1

_STORE_DEFAULTS: dict[str, Any] = {
    "tiers": None,
    "chunk_size": 256,
    "memory_bytes": 1 << 30,
    "disk_bytes": 16 << 30,
    "queue_depth": 64,
    "redis_timeout": 2.0,
    "redis_password_file": None,
}


def wants_store(kv_role: str, extra: Any) -> bool:
    """Whether vLLM's transfer config asks for the storage tier (``kv_both`` with ``kv_store``)."""
    return kv_role == "kv_both" and has_store(extra)


def has_store(extra: Any) -> bool:
    """Whether ``kv_connector_extra_config`` has a ``kv_store`` entry (with any role)."""
    return isinstance(extra, Mapping) and STORE_KEY in extra


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """The ``kv_store`` setting (a tier spec string, or a dict with ``tiers`` and the options below)."""

    tiers: str
    chunk_size: int = 256
    memory_bytes: int = 1 << 30
    disk_bytes: int = 16 << 30
    queue_depth: int = 64
    redis_timeout: float = 2.0
    redis_password: str | None = dataclasses.field(default=None, repr=False)
    secret: str | None = dataclasses.field(default=None, repr=False)
    thread_cores: cores.Setting = cores.AUTO

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> StoreSettings:
        """Parse ``kv_connector_extra_config``; raise KVConfigError naming a bad key (never a secret)."""
        environ = os.environ if environ is None else environ
        refuse_inline_secret(extra, "kv_connector_extra_config")
        unknown = sorted(set(extra) - {STORE_KEY, SECRET_FILE_KEY, cores.SETTING_KEY})
        if unknown:
            raise KVConfigError(
                f"kv_role 'kv_both' with kv_store takes only kv_store, {cores.SETTING_KEY} and {SECRET_FILE_KEY} "
                f"in kv_connector_extra_config, got {unknown}"
            )
        raw = extra[STORE_KEY]
        options = dict(_STORE_DEFAULTS)
        if isinstance(raw, str):
            options["tiers"] = raw
        elif isinstance(raw, Mapping):
            if "redis_password" in raw:
                raise KVConfigError(
                    "kv_store.redis_password is refused: vLLM's command line and logs would show it; "
                    f"set {PASSWORD_ENV} or {PASSWORD_FILE_ENV}, or kv_store.redis_password_file"
                )
            bad = sorted(set(raw) - set(_STORE_DEFAULTS))
            if bad:
                raise KVConfigError(f"unknown kv_store keys {bad}; known: {sorted(_STORE_DEFAULTS)}")
            options.update(raw)
        else:
            raise KVConfigError(f"kv_store must be a tier spec string or a mapping, got a {type(raw).__name__}")
        tiers = options["tiers"]
        if not isinstance(tiers, str) or not tiers.strip():
            raise KVConfigError(f"kv_store.tiers must be a tier spec such as 'memory,disk:/path', got {tiers!r}")
        if any("@" in part for part in tiers.split(",")):
            raise KVConfigError(f"kv_store.tiers must not carry credentials in a URL; set {PASSWORD_ENV}")
        if not shared_tiers(tiers):
            raise KVConfigError(
                f"kv_store.tiers {tiers!r} needs a disk or Redis tier: a memory tier lives in one "
                "worker process and the scheduler cannot look it up"
            )
        for name in ("chunk_size", "memory_bytes", "disk_bytes", "queue_depth"):
            value = options[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KVConfigError(f"kv_store.{name} must be a positive integer, got {value!r}")
        timeout = options["redis_timeout"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise KVConfigError(f"kv_store.redis_timeout must be a positive number of seconds, got {timeout!r}")
        password_file = options["redis_password_file"] or environ.get(PASSWORD_FILE_ENV)
        password = environ.get(PASSWORD_ENV) or (read_secret_file(password_file) if password_file else None)
        return cls(
            tiers=tiers,
            chunk_size=options["chunk_size"],
            memory_bytes=options["memory_bytes"],
            disk_bytes=options["disk_bytes"],
            queue_depth=options["queue_depth"],
            redis_timeout=float(timeout),
            redis_password=password,
            secret=resolve_secret(environ, extra.get(SECRET_FILE_KEY)),
            thread_cores=cores.parse_setting(extra.get(cores.SETTING_KEY, cores.AUTO)),
        )

    def open(self, spec: str | None = None) -> TieredStore:
        """The store of ``spec`` (default: all tiers), each tier counting the bytes it reads and writes."""
        tiers: list[CountedTier] = []
        try:
            for part in (self.tiers if spec is None else spec).split(","):
                # A store of one tier starts no writer thread: only its tier is kept.
                # A Redis down at start is a tier that starts down: the instance serves, recomputing.
                single = open_store(
                    part,
                    memory_bytes=self.memory_bytes,
                    disk_bytes=self.disk_bytes,
                    redis_password=self.redis_password,
                    redis_timeout=self.redis_timeout,
                    redis_start_down=True,
                )
                tiers.append(CountedTier(single.tiers[0]))
            return TieredStore(tiers, queue_depth=self.queue_depth)
        except BaseException:
            for tier in tiers:
                tier.close()
            raise


class CountedTier(StoreTier):
    """A tier that counts the bytes of the blobs it returns and stores (the tiers count the rest)."""

    def __init__(self, tier: StoreTier) -> None:
        self.tier = tier
        self.name = tier.name
        self._lock = threading.Lock()
        self.bytes_read = self.bytes_written = 0

    def get_many(self, keys: Sequence[bytes]) -> list[Blob | None]:
        return self.get_each(keys, lambda index, blob: None)

    def get_each(self, keys: Sequence[bytes], each: Callable[[int, Blob], None]) -> list[Blob | None]:
        def counted(index: int, blob: Blob) -> None:
            with self._lock:
                self.bytes_read += len(blob)
            each(index, blob)

        return self.tier.get_each(keys, counted)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.tier.contains_many(keys)

    def put(self, key: bytes, blob: bytes) -> bool:
        stored = self.tier.put(key, blob)
        if stored:
            with self._lock:
                self.bytes_written += len(blob)
        return stored

    def stats(self) -> TierStats:
        return self.tier.stats()

    def close(self) -> None:
        self.tier.close()


def shared_tiers(spec: str) -> str:
    """The tiers of ``spec`` that every process of an instance sees (all but ``memory``)."""
    return ",".join(part.strip() for part in spec.split(",") if part.strip() and part.strip() != "memory")


def config_identity(vllm_config: Any, kv_cache_config: Any, tp_rank: int, tp_size: int) -> compat.KVLayoutInfo:
    """What makes stored KV compatible, as both the scheduler and the worker know it from vLLM's
    configuration (the worker's caches add their layout: :meth:`StoreWorker.register`)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise KVConfigError(f"kvbridge's store needs one KV cache group (all layers full attention), got {len(groups)}")
    spec = groups[0].kv_cache_spec
    model = vllm_config.model_config
    layout = f"{type(spec).__name__}/{kv_cache_config.kv_cache_layout or ''}"
    return compat.KVLayoutInfo(
        version=compat.VERSION,
        role="kv_both",
        model=model.model,
        dtype=str(spec.dtype),
        block_size=spec.block_size,
        num_layers=len(groups[0].layer_names),
        block_shape=(),
        layout=layout,
        tp_size=tp_size,
        tp_rank=tp_rank,
        total_kv_heads=model.get_total_num_kv_heads(),
        head_size=spec.head_size,
        latent=bool(model.use_mla),
    )


def identity_namespace(identity: compat.KVLayoutInfo) -> bytes:
    """The store namespace of ``identity`` (:func:`kv_store.namespace`), with the chunk format version."""
    fields: dict[str, str | int] = {}
    for name, value in msgspec.structs.asdict(identity).items():
        if isinstance(value, bool):
            value = int(value)
        fields[name] = value if isinstance(value, (str, int)) else str(value)
    fields["store_format"] = FORMAT_VERSION
    return namespace(fields)


# ---------------------------------------------------------------------- scheduler side


@dataclasses.dataclass(frozen=True)
class StoreLoad:
    """Load the chunks of ``token_ids`` (the prompt up to the end of the last chunk needed) into
    ``block_ids`` (the request's blocks from its first one), block positions ``skip_blocks`` up to
    ``stop_blocks`` (the first ones are in vLLM's prefix cache already)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip_blocks: int
    stop_blocks: int


@dataclasses.dataclass(frozen=True)
class StoreSave:
    """Save the full chunks of ``token_ids`` from chunk ``first_chunk`` on, out of ``block_ids``
    (the request's blocks from its first one)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    first_chunk: int


@dataclasses.dataclass
class StoreMetadata(KVConnectorMetadata):
    """One step's work for the workers. Pickled by vLLM between its processes (never networked)."""

    loads: list[StoreLoad] = dataclasses.field(default_factory=list)
    saves: list[StoreSave] = dataclasses.field(default_factory=list)
    #: Claimed requests whose allocation this connector does not plan for: reported failed at once.
    refused: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    #: The step computes nothing: the workers load in it, and report the loads in the same step,
    #: rather than in a thread (no other request waits for the step; see StoreWorker.start_loads).
    load_inline: bool = False
    #: Requests with a save that vLLM preempted: their blocks may be written once handle_preemptions returns.
    preempted: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class StoreHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler at start: the namespace of its objects, which digests its
    caches' real layout (attention backend, interior variant, block shape), known only to it."""

    tp_rank: int
    namespace: bytes
    layout: str  # for the log


@dataclasses.dataclass
class _Prompt:
    tokens: list[int]
    chunks: int  # full chunks
    keys: list[bytes]  # of the full chunks, every TP rank's object of chunk 0, then of chunk 1, ...
    stored: int = 0  # leading chunks whose objects the last lookup found for every TP rank
    claim: tuple[int, int] | None = None  # (tokens claimed, vLLM's computed tokens), until allocated


class StoreScheduler:
    """Claims stored prefixes and plans saves. Not thread-safe: vLLM calls it from one thread.

    ``spaces`` holds the namespace of each TP rank, in rank order: each rank stores its own object
    of a chunk, and a chunk is claimed only when every rank's object is there, since a rank that
    finds its part missing fails the whole load."""

    def __init__(
        self, settings: StoreSettings, block_size: int, spaces: Sequence[bytes] | None, store: TieredStore
    ) -> None:
        if settings.chunk_size % block_size:
            raise KVConfigError(
                f"kv_store.chunk_size ({settings.chunk_size}) must be a multiple of vLLM's block size "
                f"({block_size}): chunks are made of whole blocks"
            )
        self.settings = settings
        self.block_size = block_size
        #: None until the workers tell theirs (:meth:`adopt_handshakes`).
        self.namespaces: tuple[bytes, ...] | None = None
        if spaces is not None:
            self.set_namespaces(spaces)
        self.store = store
        self._prompts: dict[str, _Prompt] = {}  # until the request finishes or its prompt is saved
        self._loads: list[StoreLoad] = []
        self._refused: dict[str, list[int]] = {}
        self._loaded: set[str] = set()  # one load attempt per request
        self._saving: set[str] = set()  # requests with a save: vLLM keeps their blocks once finished
        #: Whether prompts are saved (a P/D decode instance saves none).
        self.plans_saves = True

    def set_namespaces(self, spaces: Sequence[bytes]) -> None:
        """Look up the objects of the namespaces ``spaces``, one per TP rank in rank order."""
        if not spaces or any(not isinstance(space, bytes) or len(space) != KEY_BYTES for space in spaces):
            raise KVConfigError(f"kvbridge store: expected one {KEY_BYTES}-byte namespace per TP rank, got {spaces!r}")
        self.namespaces = tuple(spaces)

    def adopt_handshakes(self, handshakes: Mapping[int, Any], tp_size: int) -> None:
        """Take the namespaces the workers derived from their caches (vLLM hands the scheduler
        every worker's :meth:`StoreWorker.handshake`, by TP rank, before the first request)."""
        ranks = sorted(handshakes)
        if ranks != list(range(tp_size)) or not all(
            isinstance(handshakes[rank], StoreHandshake) and handshakes[rank].tp_rank == rank for rank in ranks
        ):
            raise KVConfigError(
                f"kvbridge store: expected the store layout of each of {tp_size} TP ranks from the "
                f"workers, got {dict(handshakes)!r}"
            )
        self.set_namespaces([handshakes[rank].namespace for rank in ranks])
        logger.info(
            "kvbridge store: keys of %d TP ranks, layouts %s",
            tp_size,
            sorted({handshakes[rank].layout for rank in ranks}),
        )

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Stored tokens of ``request``'s prompt beyond the ``num_computed_tokens`` vLLM holds: one
        lookup of its full chunks per call (vLLM asks again while the request cannot be scheduled)."""
        tokens = request.prompt_token_ids
        if tokens is None:  # prompt embeddings: no token key
            return 0
        if self.namespaces is None:
            raise KVConfigError(
                "kvbridge store: a lookup before the workers told their store layouts "
                "(vLLM passes them to set_xfer_handshake_metadata at start)"
            )
        prompt = self._prompts.get(request.request_id)
        if prompt is None:
            chunk = self.settings.chunk_size
            chunks = len(tokens) // chunk
            ranks = [chunk_keys(space, tokens[: chunks * chunk], chunk) for space in self.namespaces] if chunks else []
            keys = [rank_keys[index].key for index in range(chunks) for rank_keys in ranks]
            prompt = self._prompts[request.request_id] = _Prompt(list(tokens), chunks, keys)
        try:
            # One lookup of every rank's objects: a chunk counts once all of them are found.
            prompt.stored = self.store.lookup(prompt.keys) // len(self.namespaces) if prompt.keys else 0
        except KVStoreError as exc:
            logger.warning("kvbridge store: lookup of request %s failed: %s", request.request_id, exc)
            prompt.stored = 0
        if request.request_id in self._loaded or request.num_preemptions > 0:
            return 0
        stored = min(prompt.stored * self.settings.chunk_size, transfer_prefix_len(len(tokens), self.block_size))
        if stored <= num_computed_tokens:
            prompt.claim = None
            return 0
        prompt.claim = (stored, num_computed_tokens)
        return stored - num_computed_tokens

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        prompt = self._prompts.get(request.request_id)
        claim = prompt.claim if prompt is not None else None
        self._loaded.add(request.request_id)
        if (
            claim is None
            or claim[0] - claim[1] != num_external_tokens
            or claim[1] % self.block_size
            or len(block_ids) < claim[0] // self.block_size
        ):
            # vLLM adjusted the claim in a way this plan does not cover: its blocks fail, none is written.
            logger.warning(
                "kvbridge store: unexpected allocation for %s (%d external tokens, claim %s, %d blocks)",
                request.request_id,
                num_external_tokens,
                claim,
                len(block_ids),
            )
            self._refused[request.request_id] = list(block_ids)
            return
        stop, local = claim
        end = -(-stop // self.settings.chunk_size) * self.settings.chunk_size
        self._loads.append(
            StoreLoad(
                req_id=request.request_id,
                token_ids=prompt.tokens[:end],
                block_ids=list(block_ids[: stop // self.block_size]),
                skip_blocks=local // self.block_size,
                stop_blocks=stop // self.block_size,
            )
        )

    def build_meta(self, scheduler_output: Any, block_ids_of: Callable[[str], Sequence[int]]) -> StoreMetadata:
        """This step's loads and the saves of the prompts this step completes."""
        meta = StoreMetadata(
            loads=self._loads,
            refused=self._refused,
            load_inline=bool(self._loads) and not scheduler_output.num_scheduled_tokens,
        )
        self._loads, self._refused = [], {}
        meta.preempted = sorted(self._saving.intersection(scheduler_output.preempted_req_ids or ()))
        computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        chunk = self.settings.chunk_size
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            prompt = self._prompts.get(req_id)
            if prompt is None or req_id not in computed:
                continue
            end = prompt.chunks * chunk
            if computed[req_id] + scheduled < end:
                continue  # not all full chunks computed yet (chunked prefill)
            del self._prompts[req_id]
            if prompt.stored < prompt.chunks and self.plans_saves:
                self._saving.add(req_id)
                meta.saves.append(
                    StoreSave(
                        req_id=req_id,
                        token_ids=prompt.tokens[:end],
                        block_ids=list(block_ids_of(req_id)[: end // self.block_size]),
                        first_chunk=prompt.stored,
                    )
                )
        return meta

    def request_finished(self, request: Any) -> tuple[bool, None]:
        """Forget the request. A request with a save keeps its blocks (True) until every worker
        reports it finished sending (:meth:`StoreWorker.take_finished_sending`: its gather is done,
        which it is in practice by then); any other's are free at once."""
        held = request.request_id in self._saving
        self._saving.discard(request.request_id)
        self._prompts.pop(request.request_id, None)
        self._refused.pop(request.request_id, None)
        self._loaded.discard(request.request_id)
        self._loads = [load for load in self._loads if load.req_id != request.request_id]
        return held, None


# ---------------------------------------------------------------------- worker side


@dataclasses.dataclass
class StoreStats:
    """A worker's store counters since its start."""

    chunks_loaded: int = 0
    bytes_loaded: int = 0
    chunks_failed: int = 0  # missing or refused by a check: their blocks were load errors
    chunks_saved: int = 0  # in the store's fastest tier (the slower ones have them queued)
    chunks_present: int = 0  # already there: nothing written
    bytes_saved: int = 0
    saves_dropped: int = 0  # the save queue was full, or no tier took the chunk nor will
    chunks_queued: int = 0  # the fastest tier was full: only the slower tiers' queues have them


class StagingPool:
    """Host buffers that saves gather chunks into, kept for the next saves. vLLM keeps a request's
    blocks until its gather is done, and a new buffer's first touch (the kernel mapping, and for
    huge pages compacting, its pages) costs several times the copy into it: into a kept buffer the
    gather is one warm copy, and the blocks go back to vLLM at once. At most ``keep`` idle buffers
    are kept; more saves at once allocate."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``shape`` and ``dtype``: an idle one if one fits, else a new one."""
        shape = tuple(shape)
        with self._lock:
            for index, buffer in enumerate(self._idle):
                if buffer.shape == shape and buffer.dtype == dtype:
                    return self._idle.pop(index)
        return torch.empty(shape, dtype=dtype)

    def give_back(self, buffer: torch.Tensor) -> None:
        """``buffer`` (from :meth:`empty`) is read no more: a later save may reuse it."""
        with self._lock:
            if len(self._idle) < self._keep:
                self._idle.append(buffer)


@dataclasses.dataclass(frozen=True)
class _SavedChunk:
    """One chunk of a save: its key and its blocks, gathered into a staging buffer."""

    key: ChunkKey
    blocks: torch.Tensor


@dataclasses.dataclass(eq=False)
class _Gather:
    """One request's save, from ``wait_for_save`` until its blocks are copied out (``done``)."""

    spec: StoreSave
    started: bool = False
    dropped: bool = False  # preempted: not started, or not waited for; nothing is stored
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


class StoreWorker:
    """One TP rank's loads and saves. Hooks are called from vLLM's model-runner thread."""

    def __init__(self, settings: StoreSettings, identity: compat.KVLayoutInfo) -> None:
        self.settings = settings
        self.identity = identity
        #: Digests ``identity``, then (from :meth:`register` on) the caches' real layout too.
        self.namespace = identity_namespace(identity)
        self.mac_key = mac_key_from_secret(settings.secret)
        self.store = settings.open()
        self._tiers = [cast(CountedTier, tier) for tier in self.store.tiers]
        self._caches: PagedKVCaches | None = None
        self._layout_tag = torch.zeros(0, dtype=torch.uint8)
        self._layout = ""
        self._tracker = LoadTracker()
        # Gathers run apart from the puts, so that a slow tier holds no request's blocks.
        self._gatherer = cores.executor(1, "kvbridge-store-gather")
        self._saver = cores.executor(1, "kvbridge-store-save")
        self._gather_lock = threading.Lock()  # guards each _Gather's started and dropped
        # Requests with a save whose blocks vLLM keeps until take_finished_sending reports them (engine
        # thread only), and those of them vLLM finished.
        self._gathers: dict[str, _Gather] = {}
        self._finished: set[str] = set()
        self._saves_pending = threading.BoundedSemaphore(SAVE_QUEUE_DEPTH)
        self._staging = StagingPool(STAGING_CHUNKS)
        self._lock = threading.Lock()  # guards _stats and the interval's numbers below
        self._stats = StoreStats()
        self._load_seconds: list[float] = []
        self._save_seconds: list[float] = []
        self._load_errors: dict[str, int] = {}
        # Per tier, its cumulative numbers at the last take_stats (the interval reports the change).
        self._reported: dict[str, dict[str, int]] = {}

    def register(self, caches: Sequence[torch.Tensor], layout: PagedKVLayout, layout_name: str) -> None:
        self._caches = PagedKVCaches(list(caches), layout)
        full = msgspec.structs.replace(
            self.identity,
            block_shape=layout.block_shape(caches[0], 1),
            layout=f"{self.identity.layout}/{layout_name}/{layout.name}",
        )
        digest = hashlib.sha256(msgspec.msgpack.encode(full)).digest()
        self._layout_tag = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
        self._layout = full.layout
        self.namespace = identity_namespace(full)
        logger.info(
            "kvbridge store ready (TP rank %d of %d): tiers %s, chunks of %d tokens",
            self.identity.tp_rank,
            self.identity.tp_size,
            self.settings.tiers,
            self.settings.chunk_size,
        )

    def handshake(self) -> StoreHandshake:
        """This rank's namespace for the scheduler's lookups (after :meth:`register`)."""
        self._require_caches()
        return StoreHandshake(tp_rank=self.identity.tp_rank, namespace=self.namespace, layout=self._layout)

    # ------------------------------------------------------------------ loads

    def start_loads(
        self, loads: Iterable[StoreLoad], refused: Mapping[str, Sequence[int]], inline: bool = False
    ) -> None:
        """Start ``loads`` in load threads, or with ``inline`` run them here, in vLLM's step: for a
        step that computes nothing, so that no request waits, vLLM learns of them in this step's
        ``get_finished``, and no thread competes with vLLM's next (empty) steps for the cores."""
        for load in loads:
            ticket = self._tracker.begin(load.req_id, load.block_ids[load.skip_blocks : load.stop_blocks])
            job = lambda ticket, load=load: self._load(load, ticket)
            if inline:
                self._tracker.run_here(ticket, job)
            else:
                self._tracker.run(ticket, job)
        for req_id, block_ids in refused.items():
            self._tracker.finish(self._tracker.begin(req_id, block_ids), block_ids)

    def take_finished_loads(self, finished_req_ids: Iterable[str]) -> set[str]:
        return self._tracker.take_finished(finished_req_ids)

    def take_failed_blocks(self) -> set[int]:
        return self._tracker.take_failed_blocks()

    def _load(self, load: StoreLoad, ticket: LoadTicket) -> set[int]:
        start = time.perf_counter()
        try:
            return self._read_and_write(load, ticket)
        finally:
            with self._lock:
                self._load_seconds.append(time.perf_counter() - start)

    def _read_and_write(self, load: StoreLoad, ticket: LoadTicket) -> set[int]:
        """Read, check and write the chunks of ``load``; returns the blocks that failed."""
        caches = self._require_caches()
        outside = [block for block in load.block_ids if not 0 <= block < caches.num_blocks]
        if outside:  # never from vLLM; a write there would land outside the caches
            logger.error(
                "kvbridge store: load of request %s names blocks %s outside the cache's %d blocks",
                load.req_id,
                outside,
                caches.num_blocks,
            )
            self._add(chunks_failed=1)
            with self._lock:
                self._load_errors["block out of range"] = self._load_errors.get("block out of range", 0) + 1
            return set(ticket.block_ids)
        per_chunk = self.settings.chunk_size // caches.block_size
        first, last = load.skip_blocks // per_chunk, -(-load.stop_blocks // per_chunk)
        keys = chunk_keys(self.namespace, load.token_ids, self.settings.chunk_size)[first:last]
        failed: set[int] = set()
        for position, blob in self._read(load.req_id, [key.key for key in keys]):
            index, key = first + position, keys[position]
            lo, hi = max(index * per_chunk, load.skip_blocks), min((index + 1) * per_chunk, load.stop_blocks)
            targets = load.block_ids[lo:hi]
            problem = "missing" if blob is None else None
            blocks = None
            if blob is not None:
                try:
                    # Views of the blob: the scatter below is the one copy, into vLLM's blocks.
                    blocks = self._check(
                        decode_chunk(blob, key.key, load.token_ids[key.start : key.stop], self.mac_key, copy=False),
                        per_chunk,
                    )
                except KVStoreObjectError as exc:
                    problem = exc.reason
            if blocks is None:
                problem = problem or "other layout"
                logger.warning(
                    "kvbridge store: chunk %d of request %s not loaded (%s): blocks %s fail",
                    index,
                    load.req_id,
                    problem,
                    targets,
                )
                failed.update(targets)
                self._add(chunks_failed=1)
                with self._lock:
                    self._load_errors[problem] = self._load_errors.get(problem, 0) + 1
                continue
            if ticket.cancelled.is_set():
                return set(ticket.block_ids)
            part = blocks.narrow(1 + caches.layout.block_dim, lo - index * per_chunk, hi - lo)
            scatter_blocks(caches.caches, caches.layout, torch.tensor(targets, dtype=torch.int64), part)
            self._add(chunks_loaded=1, bytes_loaded=part.numel() * part.element_size())
        return failed

    def _read(self, req_id: str, keys: list[bytes]) -> Iterator[tuple[int, Blob | None]]:
        """Each key's position and blob (``None``: missing, or the read failed), in the order the
        store reads them: the store reads in a thread of its own, so that a chunk is checked and
        written while the next is still arriving; what it found before failing is still given."""
        arrived: queue.SimpleQueue[tuple[int, Blob] | list[Blob | None] | BaseException] = queue.SimpleQueue()

        def read() -> None:
            try:
                arrived.put(self.store.get_many(keys, lambda index, blob: arrived.put((index, blob))))
            except BaseException as exc:  # handed to the load, which raises what is not a store error
                arrived.put(exc)

        reader = cores.thread(read, "kvbridge-store-read")
        reader.start()
        given: set[int] = set()
        while True:
            try:
                item = arrived.get(timeout=READ_POLL_SECONDS)
            except queue.Empty:
                # The read is bounded by its tiers' timeouts and always ends with an answer.
                if reader.is_alive() or not arrived.empty():
                    continue
                raise RuntimeError("the store read ended without an answer") from None
            if isinstance(item, tuple):
                given.add(item[0])
                yield item
                continue
            if isinstance(item, KVStoreError):
                logger.warning("kvbridge store: load of request %s failed: %s", req_id, item)
                item = [None] * len(keys)
            elif isinstance(item, BaseException):
                raise item
            yield from ((index, blob) for index, blob in enumerate(item) if index not in given)
            return

    def _check(self, tensors: list[torch.Tensor | None], per_chunk: int) -> torch.Tensor | None:
        """The chunk's blocks if they fit this worker's caches and layout, else None."""
        caches = self._require_caches()
        first = caches.caches[0]
        expected = (len(caches.caches), *caches.layout.block_shape(first, per_chunk))
        if len(tensors) != 2 or tensors[0] is None or tensors[1] is None:
            return None
        blocks, tag = tensors
        if blocks.dtype != first.dtype or tuple(blocks.shape) != expected or not torch.equal(tag, self._layout_tag):
            return None
        return blocks

    # ------------------------------------------------------------------ saves

    def save(self, saves: Iterable[StoreSave]) -> None:
        """Save the chunks of ``saves``: their blocks are copied out by a gather thread, then encoded
        and put in the background, while vLLM keeps the request's blocks (its scheduler delays their
        free: :meth:`StoreScheduler.request_finished`; this worker reports the request in
        :meth:`take_finished_sending` once its gather is done, and waits for it or cancels it in
        :meth:`preempt`). The engine thread copies nothing."""
        for spec in saves:
            job = self._gathers[spec.req_id] = _Gather(spec)
            if not self._saves_pending.acquire(blocking=False):
                self._drop(job, "save queue full")
                continue
            try:
                self._gatherer.submit(self._gather, job)
            except BaseException:  # closing: the slot is free again
                self._drop(job, "closing")
                self._saves_pending.release()
                raise

    def preempt(self, req_ids: Iterable[str], timeout: float = PREEMPT_WAIT_SECONDS) -> None:
        """vLLM preempted ``req_ids`` and may write their blocks once this returns (its
        ``handle_preemptions``): a gather not started is cancelled (the save is dropped), one under
        way is waited for; one still under way after ``timeout`` is dropped once done, whatever it
        read. The requests stay held: their next finish is reported as for any other."""
        for req_id in req_ids:
            job = self._gathers.get(req_id)
            if job is None or job.done.is_set():
                continue
            with self._gather_lock:
                cancel = job.dropped = not job.started
            if cancel:
                self._drop(job, "preempted before its blocks were copied")
                self._saves_pending.release()
            elif not job.done.wait(timeout):
                with self._gather_lock:
                    job.dropped = True
                logger.error(
                    "kvbridge store: the blocks of preempted request %s were still being copied after %g s; "
                    "its save is dropped",
                    req_id,
                    timeout,
                )

    def take_finished_sending(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Requests that vLLM finished (``finished_req_ids``, from this or an earlier step) and whose
        blocks no save reads any more, each once: vLLM frees their blocks then."""
        self._finished.update(req_id for req_id in finished_req_ids if req_id in self._gathers)
        done = {req_id for req_id in self._finished if self._gathers[req_id].done.is_set()}
        for req_id in done:
            self._finished.discard(req_id)
            del self._gathers[req_id]
        return done

    def holds(self, req_id: str) -> bool:
        """Whether vLLM keeps ``req_id``'s blocks for a save of this worker once it finishes."""
        return req_id in self._gathers

    def held_requests(self) -> int:
        """Requests whose blocks vLLM keeps for a save of this worker (until reported finished sending)."""
        return len(self._gathers)

    def _drop(self, job: _Gather, why: str) -> None:
        per_chunk = self.settings.chunk_size // self._require_caches().block_size
        self._add(saves_dropped=len(job.spec.block_ids) // per_chunk - job.spec.first_chunk)
        logger.warning("kvbridge store: %s: request %s not stored", why, job.spec.req_id)
        job.done.set()

    def _gather(self, job: _Gather) -> None:
        """Copy the chunks of ``job`` out of vLLM's blocks (one gather per chunk, into a kept staging
        buffer), then hand them to the saver thread, which builds, hashes and stores their objects."""
        with self._gather_lock:
            if job.dropped:  # cancelled by a preemption, which freed the slot
                return
            job.started = True
        spec = job.spec
        handed_over = False
        try:
            caches = self._require_caches()
            per_chunk = self.settings.chunk_size // caches.block_size
            ids = spec.block_ids[spec.first_chunk * per_chunk :]
            keys = chunk_keys(self.namespace, spec.token_ids, self.settings.chunk_size)[spec.first_chunk :]
            chunks = [
                self._gather_chunk(caches, key, ids[start : start + per_chunk])
                for key, start in zip(keys, range(0, len(ids) - per_chunk + 1, per_chunk), strict=True)
            ]
            with self._gather_lock:
                dropped = job.dropped
                job.done.set()
            if dropped:  # preempted, and not waited for long enough: the blocks may be another request's
                self._add(saves_dropped=len(chunks))
                for chunk in chunks:
                    self._staging.give_back(chunk.blocks)
                return
            self._saver.submit(self._put, spec, chunks)
            handed_over = True
        except Exception:
            logger.exception("kvbridge store: copying the blocks of request %s failed", spec.req_id)
        finally:
            job.done.set()
            if not handed_over:
                self._saves_pending.release()

    def _gather_chunk(self, caches: PagedKVCaches, key: ChunkKey, block_ids: list[int]) -> _SavedChunk:
        blocks = gather_blocks(
            caches.caches, caches.layout, torch.tensor(block_ids, dtype=torch.int64), self._staging.empty
        )
        return _SavedChunk(key, blocks)

    def _build(self, token_ids: list[int], chunk: _SavedChunk) -> Blob:
        """The sealed object of ``chunk``: its blocks copied once into the object's own memory
        (:class:`kv_store.ChunkBuilder`), the staging buffer given back, one hash pass."""
        key = chunk.key
        builder = ChunkBuilder(
            key.key,
            token_ids[key.start : key.stop],
            [(chunk.blocks.dtype, tuple(chunk.blocks.shape)), (self._layout_tag.dtype, tuple(self._layout_tag.shape))],
            self.mac_key,
        )
        blocks, tag = cast(list[torch.Tensor], builder.tensors)  # both specs are tensors
        blocks.copy_(chunk.blocks)
        tag.copy_(self._layout_tag)
        self._staging.give_back(chunk.blocks)
        return builder.seal()

    def _put(self, spec: StoreSave, chunks: list[_SavedChunk]) -> None:
        try:
            for chunk in chunks:
                start = time.perf_counter()
                blob = self._build(spec.token_ids, chunk)
                try:
                    stored = self.store.put(chunk.key.key, blob)
                except KVStoreError as exc:
                    logger.warning("kvbridge store: put of request %s failed: %s", spec.req_id, exc)
                    self._add(saves_dropped=1)
                    continue
                finally:
                    with self._lock:
                        self._save_seconds.append(time.perf_counter() - start)
                if stored is PutResult.STORED:
                    self._add(chunks_saved=1, bytes_saved=chunk.blocks.numel() * chunk.blocks.element_size())
                elif stored is PutResult.QUEUED:
                    self._add(chunks_queued=1)
                elif stored is PutResult.PRESENT:
                    self._add(chunks_present=1)
                else:
                    self._add(saves_dropped=1)
        except Exception:
            logger.exception("kvbridge store: save of request %s failed", spec.req_id)
        finally:
            self._saves_pending.release()

    # ------------------------------------------------------------------ the rest

    def stats(self) -> StoreStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    def take_stats(self) -> KVBridgeStats:
        """The store's numbers since the last call, for vLLM's metrics: per tier the change of its
        counters and, where it changed (or on the first call), whether it is up; load errors per
        reason; each load's and each chunk save's seconds."""
        store = self.store.stats()
        data: dict[str, Any] = {STORE_TIER_UP: {}}
        for tier in self._tiers:
            counts = store.tiers[tier.name]
            now = {
                "store_hit_chunks": counts.hits,
                "store_miss_chunks": counts.misses,
                "store_read_bytes": tier.bytes_read,
                "store_written_bytes": tier.bytes_written,
                "store_evictions": counts.evictions,
                "store_failed_writes": counts.failed_writes,
                "store_dropped_writes": store.dropped_writes.get(tier.name, 0),
                STORE_TIER_UP: int(counts.up),
            }
            before = self._reported.get(tier.name)
            self._reported[tier.name] = now
            for name, value in now.items():
                if name == STORE_TIER_UP:
                    if before is None or before[name] != value:
                        data[name][tier.name] = value
                elif value != (before or {}).get(name, 0):
                    data.setdefault(name, {})[tier.name] = value - (before or {}).get(name, 0)
        with self._lock:
            data["store_load_seconds"], self._load_seconds = self._load_seconds, []
            data["store_save_seconds"], self._save_seconds = self._save_seconds, []
            data[STORE_LOAD_ERRORS], self._load_errors = self._load_errors, {}
        return KVBridgeStats.from_data(data)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every save handed over so far is put (the fastest tier written)."""
        self._gatherer.submit(lambda: None).result(timeout=timeout)
        self._saver.submit(lambda: None).result(timeout=timeout)

    def close(self) -> None:
        self._tracker.close()
        self._gatherer.shutdown(wait=True)  # vLLM still holds the blocks of the gathers pending
        self._saver.shutdown(wait=True)
        self.store.close()

    def _add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def _require_caches(self) -> PagedKVCaches:
        if self._caches is None:
            raise KVConfigError("kvbridge store: the KV caches are not registered yet")
        return self._caches
