"""Worker side of the vLLM connector: what every TP rank's worker shares, whatever its role.

It runs in each vLLM worker (one per TP rank) and needs no vLLM import: vLLM-specific plumbing
lives in :mod:`connector.vllm_v1`, so the workers can be driven directly by tests.

``WorkerSide(settings, identity, port_offset)`` makes the worker of the role ``settings`` name: a
:class:`connector.vllm_producer_worker.ProducerWorker` (``kv_producer``: the listener, saves, lent
blocks, taking entries back), a :class:`connector.vllm_consumer_worker.ConsumerWorker`
(``kv_consumer``: connections to producers, loads), or both in one (``kv_both``). Each has only its
role's methods; this class holds what they share: the caches, the layout handshake, and the stats.

Connections: each new one first exchanges both sides' KV layouts (:mod:`connector.compat`): an
incompatible pair is refused with an error naming every difference.

Failure policy: a load that cannot complete (no entry within ``kv_load_timeout``, an entry that
fails the checks, a producer that cannot be reached or died) writes nothing vLLM could trust and
reports the request's blocks through ``take_failed_blocks``, in the step that reports the request
finished receiving; vLLM then recomputes them (``kv_load_failure_policy="recompute"``) or fails the
request (``"fail"``). A connection that fails is dropped; the next load that names its producer
connects again (after a backoff when connecting keeps failing), so a restarted producer is used
again without restarting the consumer. A save that fails is reported by ``take_save_outcomes``, and
the request announced with 0 tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch

from connector import compat, tp_layout
from connector.base import KVRequest
from connector.paged import PagedKV, PagedKVCaches, PagedKVLayout
from connector.transfer_stats import TransferStats
from connector.vllm_settings import ConnectorSettings
from kv_pipe.base import KVPipeBase
from kv_pipe.errors import KVConfigError
from lookup_buffer import BufferListener, dial
from lookup_buffer.base import BufferStats, KVLookupBufferBase
from lookup_buffer.connections import Address
from lookup_buffer.listener import OnConnect
from lookup_buffer.store import EntryStore

logger = logging.getLogger(__name__)

#: Opens the producer's listener: (settings, port offset, on_connect) -> its buffer.
ListenerFactory = Callable[[ConnectorSettings, int, OnConnect], KVLookupBufferBase]
#: Connects a consumer to the producer at (host, port): (settings, host, port, on_connect) -> its buffer.
Dialer = Callable[[ConnectorSettings, str, int, OnConnect | None], KVLookupBufferBase]

#: Requests saved by a copy, and requests taken back, that a worker remembers at most each (a
#: request vLLM preempted and then aborted before its next save is never held nor reported).
MAX_REMEMBERED = 10_000

#: What a worker holds now, exported as gauges. Each returns to 0 once nothing is in flight:
#: ``connections`` (consumers connected to this producer, or producers this consumer uses),
#: ``entries_held`` and ``bytes_buffered`` (the producer's stored entries, lent or copied),
#: ``loans_out`` and ``blocks_lent`` (saved requests whose blocks vLLM keeps for kvbridge, and how
#: many blocks), ``loads_in_flight`` (the consumer's loads not reported to vLLM yet).
GAUGES = ("connections", "entries_held", "bytes_buffered", "loans_out", "blocks_lent", "loads_in_flight")


#: Per-request phases, one value per event (histograms). Producer: ``save_copy_seconds`` (of a save,
#: packing the blocks into the buffer's memory, or describing where they lie when lent) and
#: ``entry_wait_seconds`` (an entry from its store until a select took it). Consumer, per hit:
#: ``load_entry_wait_seconds`` (the select sent until the entry's header or lent descriptor arrived),
#: ``load_receive_seconds`` (the header until a copied entry's bytes were in hand; where the buffer
#: says when the header arrived) and ``load_copy_seconds`` (the write into vLLM's blocks).
PHASES = (
    "save_copy_seconds",
    "entry_wait_seconds",
    "load_entry_wait_seconds",
    "load_receive_seconds",
    "load_copy_seconds",
)


@dataclasses.dataclass
class Observations:
    """Per-event values since the last report (histograms), and the change of each gauge of :data:`GAUGES`."""

    transfer_seconds: list[float] = dataclasses.field(default_factory=list)  # per save or load
    load_wait_seconds: list[float] = dataclasses.field(default_factory=list)  # claim to blocks written
    gauges: dict[str, int] = dataclasses.field(default_factory=dict)
    phases: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # by name of PHASES

    def is_empty(self) -> bool:
        return not (
            self.transfer_seconds or self.load_wait_seconds or any(self.gauges.values()) or any(self.phases.values())
        )


def find_layout(cache: torch.Tensor, num_blocks: int, block_size: int, name: str) -> PagedKVLayout:
    """The paged layout of a per-layer cache tensor: its first dimension of ``num_blocks`` entries
    counts blocks, the next one of ``block_size`` entries counts tokens.

    Raises KVConfigError when the tensor has no such dimensions (e.g. an attention backend that
    splits vLLM's blocks into smaller kernel blocks).
    """
    shape = tuple(cache.shape)
    block_dim = next((d for d, size in enumerate(shape) if size == num_blocks), None)
    if block_dim is not None:
        size_dim = next((d for d, size in enumerate(shape) if size == block_size and d != block_dim), None)
        if size_dim is not None:
            return PagedKVLayout(name, block_dim=block_dim, block_size_dim=size_dim)
    raise KVConfigError(
        f"kvbridge cannot find the block dimension ({num_blocks} blocks of {block_size} tokens) "
        f"in a KV cache tensor of shape {shape} (layout {name})"
    )


class WorkerSide:
    """One TP rank's end of the transfer; ``WorkerSide(...)`` makes the class of its role (see the
    module docstring). Methods are called from vLLM's model-runner thread.

    Args:
        settings: transport and connector settings; ``settings.bridge.kv_role`` picks the class.
        identity: this instance's KV description; :meth:`connect` fills in ``num_layers``,
            ``block_shape``, ``dtype`` and ``layout`` from the real caches.
        port_offset: the TP rank's port offset (:func:`connector.vllm_settings.listen_port_offset`):
            a producer listens at ``kv_port + port_offset``, a consumer connects to the named
            producer's port plus it.
        listener_factory / dialer: how to open the transport (the defaults are kvbridge's
            BufferListener and dial, over TorchDistributedPipe).

    Raises:
        KVConfigError: a role without a worker (None).
    """

    def __new__(cls, settings: ConnectorSettings, *args: Any, **kwargs: Any) -> WorkerSide:
        if cls is WorkerSide:
            from connector.vllm_consumer_worker import ConsumerWorker
            from connector.vllm_producer_worker import DualWorker, ProducerWorker

            roles: dict[str | None, type[WorkerSide]] = {
                "kv_producer": ProducerWorker,
                "kv_consumer": ConsumerWorker,
                "kv_both": DualWorker,
            }
            if settings.bridge.kv_role not in roles:
                raise KVConfigError(
                    f"a kvbridge worker needs a kv_role, one of {sorted(roles)}, got {settings.bridge.kv_role!r}"
                )
            cls = roles[settings.bridge.kv_role]
        return super().__new__(cls)

    def __init__(
        self,
        settings: ConnectorSettings,
        identity: compat.KVLayoutInfo,
        port_offset: int,
        listener_factory: ListenerFactory | None = None,
        dialer: Dialer | None = None,
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.port_offset = port_offset
        self._listener_factory = listener_factory or _default_listener
        self._dialer = dialer or _default_dialer
        self._caches: PagedKVCaches | None = None
        self._reported_gauges = dict.fromkeys(GAUGES, 0)
        self._interval = TransferStats()
        self._observed = Observations()
        self._total = TransferStats()
        self._stats_lock = threading.Lock()  # stats are read by tests/loggers from other threads

    # ------------------------------------------------------------------ setup

    def connect(self, caches: Sequence[torch.Tensor], layout: PagedKVLayout) -> None:
        """Register the caches and open the transport: a producer starts listening (returns at
        once), a consumer gets ready to connect to producers as loads name them.

        Raises:
            KVConfigError: the listening address cannot be bound.
        """
        self._caches = PagedKVCaches(list(caches), layout)
        first = self._caches.caches[0]
        if first.device.type == "cuda" and self.settings.bridge.kv_device_index is None:
            # The worker's GPU, never the current device of whichever thread builds a pipe later.
            bridge = self.settings.bridge.replace(kv_device_index=first.device.index)
            self.settings = dataclasses.replace(self.settings, bridge=bridge)
        block_shape = layout.block_shape(first, 1)
        self.identity = msgspec.structs.replace(
            self.identity,
            num_layers=len(caches),
            block_shape=block_shape,
            dtype=str(first.dtype),
            layout=layout.name,
            **self._head_fields(block_shape, layout),
        )
        self._open()
        logger.info(
            "kvbridge %s (TP rank %d of %d) ready: %d layers, blocks of %s %s (heads along dimension %d)",
            self.identity.role,
            self.identity.tp_rank,
            self.identity.tp_size,
            len(caches),
            block_shape,
            first.dtype,
            self.identity.head_dim,
        )

    def _open(self) -> None:
        """Open this role's transport, once the caches are registered (each role adds its own)."""

    def _close(self) -> None:
        """Close this role's transport (each role adds its own)."""

    def _identity_towards(self, address: Address | None) -> compat.KVLayoutInfo:
        """What this worker says it is on a connection it accepted (``address`` None) or dialed."""
        return self.identity

    def _expected_peer(self, address: Address | None) -> tuple[int, int] | None:
        """The prefill (TP size, TP rank) a connection to ``address`` must reach; None: any."""
        return None

    def _head_fields(self, block_shape: tuple[int, ...], layout: PagedKVLayout) -> dict[str, int]:
        """This rank's KV heads in a block (:class:`compat.KVLayoutInfo` fields): the head dimension
        and, when vLLM did not give it (tests), the model's head count as this rank's times the TP
        size. A latent cache has none; a cache whose head dimension cannot be found gets -1 (then
        only equal TP sizes pair)."""
        identity = self.identity
        if identity.latent:
            return {"head_dim": -1}
        heads = tp_layout.local_heads(identity.total_kv_heads, identity.tp_size) if identity.total_kv_heads else None
        head_dim = tp_layout.find_head_dim(block_shape, layout.block_dim, layout.block_size_dim, heads)
        if head_dim is None:
            logger.warning(
                "kvbridge: no dimension of %s KV heads in a block of shape %s (layout %s): only an "
                "instance of the same TP size can pair with this one",
                heads,
                block_shape,
                layout.name,
            )
            return {"head_dim": -1}
        return {
            "head_dim": head_dim,
            "total_kv_heads": identity.total_kv_heads or block_shape[head_dim] * identity.tp_size,
        }

    def _check_peer(self, pipe: KVPipeBase, address: Address | None = None) -> compat.KVLayoutInfo:
        """On each new connection: exchange layouts; KVConfigError names every difference. A consumer
        also checks that the producer at ``address`` is the prefill rank it dialed for
        (:meth:`producer_address`)."""
        peer = compat.exchange(pipe, self._identity_towards(address), timeout=self.settings.bridge.kv_timeout)
        expected = self._expected_peer(address)
        if expected is not None and (peer.tp_size, peer.tp_rank) != expected:
            host, port = address
            raise KVConfigError(
                f"kvbridge: the prefill instance at {host}:{port} is TP rank {peer.tp_rank} of {peer.tp_size}; this "
                f"decode rank (TP rank {self.identity.tp_rank} of {self.identity.tp_size}) loads from TP rank "
                f"{expected[1]} of {expected[0]} there (the prefill TP size its kv_transfer_params announced, else "
                f"kv_producer_tp_size, else this instance's own)"
            )
        logger.info(
            "kvbridge %s (TP rank %d of %d) connected to a %s peer (TP rank %d of %d)",
            self.identity.role,
            self.identity.tp_rank,
            self.identity.tp_size,
            peer.role,
            peer.tp_rank,
            peer.tp_size,
        )
        return peer

    def close(self) -> None:
        self._close()
        total = self.total_stats()
        if not total.is_empty():
            logger.info("kvbridge totals: %s", total.reduce())

    # ------------------------------------------------------------------ stats

    def take_stats(self) -> tuple[TransferStats, Observations] | None:
        """Counters and observations since the last call, or None when nothing happened."""
        gauges = self.gauges()
        self._report_buffer()
        with self._stats_lock:
            for name, value in gauges.items():
                change = value - self._reported_gauges[name]
                if change:
                    self._observed.gauges[name] = self._observed.gauges.get(name, 0) + change
                    self._reported_gauges[name] = value
            if self._interval.is_empty() and self._observed.is_empty():
                return None
            interval, self._interval = self._interval, TransferStats()
            observed, self._observed = self._observed, Observations()
            return interval, observed

    def _report_buffer(self) -> None:
        """Add what the lookup buffer counted since the last report to the stats (a producer's)."""

    def buffer_stats(self) -> BufferStats | None:
        """The producer's lookup buffer counters (e.g. entries still held); None on a consumer."""
        return None

    def gauges(self) -> dict[str, int]:
        """The current value of each of :data:`GAUGES`."""
        gauges = dict.fromkeys(GAUGES, 0)
        self._gauges(gauges)
        return gauges

    def _gauges(self, gauges: dict[str, int]) -> None:
        """Set this role's gauges in ``gauges`` (each role adds its own)."""

    @property
    def connections(self) -> int:
        """Connections open now: consumers connected to this producer, or producers this consumer uses."""
        return self.gauges()["connections"]

    def total_stats(self) -> TransferStats:
        """Counters since the start (a copy)."""
        with self._stats_lock:
            return self._total.copy()

    def _add(self, **counts: float) -> None:
        with self._stats_lock:
            self._interval.add(**counts)
            self._total.add(**counts)

    def _observe(
        self, transfer_seconds: float | None = None, load_wait_seconds: float | None = None, **phases: float | None
    ) -> None:
        """Record one event's values (None: not observed); ``phases`` by name of :data:`PHASES`."""
        with self._stats_lock:
            if transfer_seconds is not None:
                self._observed.transfer_seconds.append(transfer_seconds)
            if load_wait_seconds is not None:
                self._observed.load_wait_seconds.append(load_wait_seconds)
            for name, value in phases.items():
                if name not in PHASES:
                    raise KeyError(f"unknown kvbridge phase {name!r}")
                if value is not None:
                    self._observed.phases.setdefault(name, []).append(value)

    # ------------------------------------------------------------------ helpers

    @property
    def caches(self) -> list[torch.Tensor]:
        """The registered per-layer caches (empty before :meth:`connect`)."""
        return list(self._caches.caches) if self._caches is not None else []

    def _require_caches(self) -> PagedKVCaches:
        if self._caches is None:
            raise KVConfigError("kvbridge: KV caches were not registered")
        return self._caches


def remember(requests: dict[str, Any], req_id: str, value: Any = None) -> None:
    """Add ``req_id`` (with ``value``) to ``requests`` as the newest, forgetting the oldest beyond
    :data:`MAX_REMEMBERED`."""
    requests.pop(req_id, None)
    requests[req_id] = value
    while len(requests) > MAX_REMEMBERED:
        requests.pop(next(iter(requests)))


def entry_store(buffer: KVLookupBufferBase | None) -> EntryStore | None:
    """The producer's entry store behind ``buffer`` (a BufferListener's, or a SimpleBuffer's
    producer's), whose taken entries' waits the stats report; None for any other buffer."""
    for owner in (buffer, getattr(buffer, "_side", None)):
        store = getattr(owner, "_store", None)
        if isinstance(store, EntryStore):
            return store
    return None


def kv_request(token_ids: Sequence[int], kv: PagedKV) -> KVRequest:
    return KVRequest(input_tokens=torch.tensor(token_ids, dtype=torch.int64), kv=kv)


def _default_listener(settings: ConnectorSettings, port_offset: int, on_connect: OnConnect) -> KVLookupBufferBase:
    return BufferListener(settings.bridge, port_offset, on_connect, buffer_config=settings.buffer)


def _default_dialer(
    settings: ConnectorSettings, host: str, port: int, on_connect: OnConnect | None
) -> KVLookupBufferBase:
    return dial(settings.bridge, host, port, on_connect)
