"""A decode TP rank's loads from several prefill TP ranks, or from part of one (:mod:`connector.tp_layout`).

:class:`Sources` names what one decode rank loads a request from: the prefill instance's address and
TP size, and the plan of :func:`connector.tp_layout.plan_sources`. The worker side uses it where it
used a single producer address: :class:`SourceConnections` (a consumer's
:class:`lookup_buffer.ProducerConnections`, extended) connects to every prefill rank of the plan and
hands the load a :class:`HeadGather`, which selects the request's entry from each of them (of one
rank, only the part of its heads this rank holds) and presents them as one entry of this rank's
shape. Gathered entries are not copied together: the key of several sources is a
:class:`~lookup_buffer.loans.BorrowedTensor` whose pieces lie in each source's memory (the prefill
rank's, when lent; else the received tensor's), in this rank's byte order, so the one copy into the
decode blocks puts every source's heads into their own slice of heads.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from connector.tp_layout import Source
from connector.vllm_loads import PRODUCER_LOAD_SHARE
from kv_pipe import cores
from kv_pipe.errors import KVConfigError, KVTransferError
from lookup_buffer.base import BufferStats, KVLookupBufferBase, SelectResult
from lookup_buffer.connections import Address, ProducerConnections, Ready
from lookup_buffer.errors import KVInvalidRequestError
from lookup_buffer.loans import BorrowedTensor, cut

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Sources:
    """What one decode rank loads a request from (hashable: a key of :class:`SourceConnections`).

    Attributes:
        host, port: the prefill instance's announced address; its TP rank q listens at ``port + q``.
        producer_tp: its TP size.
        plan: the prefill ranks and heads, in the order of the heads they fill.
        head_dim: the head dimension of an entry's key (one more than a block's).
        refused: why this decode rank cannot load from that instance (then nothing connects and
            each load fails with it), or None.
    """

    host: str
    port: int
    producer_tp: int
    plan: tuple[Source, ...]
    head_dim: int
    refused: str | None = None

    def address(self, source: Source) -> Address:
        return self.host, self.port + source.rank

    @property
    def addresses(self) -> list[Address]:
        return [self.address(source) for source in self.plan]


class SourceConnections:
    """A consumer's connections to prefill ranks: :class:`lookup_buffer.ProducerConnections` for a
    plain address, and for :class:`Sources` all of its ranks at once, as one :class:`HeadGather`.
    Thread-safe, never blocks (as ProducerConnections).

    Each connection :meth:`when_ready` hands out is one load's share of its producers: at most
    ``share`` of them per producer (per rank, for a gather) are out until their select returns; the
    loads beyond wait, without a thread, for one to return, in order per producer (a load waiting
    for one producer never holds up another producer's). So a producer that stops answering, its
    connection open (each select then waits for ``kv_timeout``), holds at most ``share`` load
    threads; and a gather, which takes a share of each of its ranks at once, never holds some
    while it waits for the others."""

    def __init__(self, connections: ProducerConnections, share: int = PRODUCER_LOAD_SHARE) -> None:
        self._connections = connections
        self._shares = _Shares(share)

    def when_ready(self, address: Address | Sources, ready: Ready) -> None:
        """As :meth:`ProducerConnections.when_ready`; for :class:`Sources`, once every rank it names is
        connected (the gather), or with the first error of one that is not. A connection comes as
        one select's share of its producers (see the class): ``ready`` may be called later, from the
        thread whose select freed the share."""
        if isinstance(address, Sources) and address.refused is not None:
            ready(KVConfigError(f"kvbridge: {address.refused}"))
            return
        addresses = address.addresses if isinstance(address, Sources) else [address]

        def connected(result: KVLookupBufferBase | Exception) -> None:
            if isinstance(result, Exception):
                ready(result)
            else:
                self._shares.take(addresses, lambda share: ready(_Shared(result, share)))

        self._connect(address, connected)

    def _connect(self, address: Address | Sources, ready: Ready) -> None:
        if not isinstance(address, Sources):
            self._connections.when_ready(address, ready)
            return
        results: dict[int, KVLookupBufferBase | Exception] = {}
        lock = threading.Lock()
        count = len(address.plan)

        def one_ready(index: int, result: KVLookupBufferBase | Exception) -> None:
            with lock:
                results[index] = result
                if len(results) < count:
                    return
            failed = next((result for _, result in sorted(results.items()) if isinstance(result, Exception)), None)
            ready(failed if failed is not None else HeadGather(address, [results[i] for i in range(count)]))

        for index, source_address in enumerate(address.addresses):
            self._connections.when_ready(source_address, lambda result, index=index: one_ready(index, result))

    def connected(self, address: Address | Sources) -> KVLookupBufferBase | None:
        """The open connection (for :class:`Sources`, the gather over every rank's), or None."""
        if not isinstance(address, Sources):
            return self._connections.connected(address)
        if address.refused is not None:
            return None
        buffers = [self._connections.connected(source) for source in address.addresses]
        return None if any(buffer is None for buffer in buffers) else HeadGather(address, buffers)

    def discard(self, address: Address | Sources, buffer: KVLookupBufferBase, error: BaseException) -> None:
        """Drop a connection that failed; of a gather, each rank's that failed (the one whose select
        raised, and any that knows it is dead)."""
        if isinstance(buffer, _Shared):
            buffer = buffer.buffer
        if not isinstance(address, Sources) or not isinstance(buffer, HeadGather):
            self._connections.discard(address, buffer, error)
            return
        for index, (source_address, source) in enumerate(zip(address.addresses, buffer.buffers, strict=True)):
            if index == buffer.failed_index or source.failure is not None:
                self._connections.discard(source_address, source, error)

    def __getattr__(self, name: str) -> Any:  # count, dialing, close, get: the connections'
        return getattr(self._connections, name)


class _Share:
    """One load's share of its producers, given back once (by its select, or by its connection's
    death if the load never selects). Lock-free: the garbage collector may give it back from
    within any code of this thread."""

    def __init__(self, shares: _Shares, addresses: list[Address]) -> None:
        self._shares, self._addresses = shares, addresses
        self._held = collections.deque([True])  # popped once: atomic

    def give_back(self) -> None:
        try:
            self._held.pop()
        except IndexError:
            return
        self._shares.give_back(self._addresses)


class _Shares:
    """How many loads of each producer hold a share, and the loads waiting for one (thread-safe).

    Requests and returns are queued without a lock and settled by whichever thread gets the lock
    next; one that does not get it leaves them to the holder, which looks again once it lets go.
    So a return never waits for the lock: the garbage collector may make one (:class:`_Shared`)
    while this very thread holds it."""

    def __init__(self, share: int) -> None:
        if share < 1:
            raise KVConfigError(f"kvbridge: a producer's share of the load threads must be at least 1, not {share}")
        self._share = share
        self._requests: collections.deque[tuple[list[Address], Callable[[_Share], None]]] = collections.deque()
        self._returns: collections.deque[list[Address]] = collections.deque()
        self._lock = threading.Lock()  # guards the two fields below
        self._taken: collections.Counter[Address] = collections.Counter()
        self._waiting: collections.deque[tuple[list[Address], Callable[[_Share], None]]] = collections.deque()

    def take(self, addresses: list[Address], granted: Callable[[_Share], None]) -> None:
        """Call ``granted`` with a share of every one of ``addresses`` once each has one free and no
        earlier load waits for it: at once, in this thread, when nothing else is settling shares;
        else from the thread that frees one, or that settles them."""
        self._requests.append((addresses, granted))
        self._settle()

    def give_back(self, addresses: list[Address]) -> None:
        self._returns.append(addresses)
        self._settle()

    def _settle(self) -> None:
        while (self._requests or self._returns) and self._lock.acquire(blocking=False):
            try:
                while self._returns:
                    self._taken.subtract(self._returns.popleft())
                while self._requests:
                    self._waiting.append(self._requests.popleft())
                grants = self._grant()
            finally:
                self._lock.release()
            for share, granted in grants:
                try:
                    granted(share)
                except Exception:  # a faulty callback must neither keep its share nor stop the others
                    logger.exception("kvbridge: a load given its producer's share failed")
                    share.give_back()

    def _grant(self) -> list[tuple[_Share, Callable[[_Share], None]]]:
        """Take the shares of the waiting loads that can go, in order per producer (under the lock)."""
        grants, blocked, still = [], set(), collections.deque()
        for addresses, granted in self._waiting:
            if blocked.isdisjoint(addresses) and all(self._taken[address] < self._share for address in addresses):
                self._taken.update(addresses)
                grants.append((_Share(self, addresses), granted))
            else:
                blocked.update(addresses)
                still.append((addresses, granted))
        self._waiting = still
        return grants


class _Shared(KVLookupBufferBase):
    """A connection handed to one load with its share of the producers: the share goes back when
    its select returns, or when this object dies (a load that never selects)."""

    def __init__(self, buffer: KVLookupBufferBase, share: _Share) -> None:
        self.buffer = buffer
        self._share = share
        weakref.finalize(self, share.give_back)

    def insert(self, *args: Any, **kwargs: Any) -> Any:
        return self.buffer.insert(*args, **kwargs)

    def drop_select(self, *args: Any, **kwargs: Any) -> SelectResult:
        try:
            return self.buffer.drop_select(*args, **kwargs)
        finally:
            self._share.give_back()

    @property
    def failure(self) -> Exception | None:
        return self.buffer.failure

    def stats(self) -> BufferStats:
        return self.buffer.stats()

    def close(self) -> None:
        return  # the connection belongs to SourceConnections


class HeadGather(KVLookupBufferBase):
    """The consumer end of one decode rank's :class:`Sources`: ``drop_select`` selects the entry
    from each prefill rank of the plan (naming the part of one rank's heads where it takes only
    some; of each, the span its caller names), and returns them as one entry of this rank's
    heads. A miss at any rank is a miss (the entries taken at the others are given back unread); a
    source's entry of another shape than planned raises
    :class:`~lookup_buffer.errors.KVInvalidRequestError` naming the rank. Consumer only; closing it
    closes nothing (the connections are :class:`SourceConnections`')."""

    def __init__(self, sources: Sources, buffers: Sequence[KVLookupBufferBase]) -> None:
        self.sources = sources
        self.buffers = list(buffers)
        self.failed_index: int | None = None  # the source whose select raised last

    def insert(self, *args: Any, **kwargs: Any) -> None:
        raise KVConfigError("kvbridge: a gather of prefill ranks only selects")

    def drop_select(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        timeout: float | None = None,
        borrow: bool = False,
        part: tuple[int, int, int] | None = None,
        span: tuple[int, int, int] | None = None,
    ) -> SelectResult:
        if part is not None:
            raise KVInvalidRequestError("kvbridge: a gather of prefill ranks selects its own parts")
        # A span (e.g. some blocks) is taken of each rank's entry, or of its part of the heads: the
        # producer narrows what it selects, so the two compose.
        spanned = {} if span is None else {"span": span}

        def select(index: int) -> SelectResult:
            source = self.sources.plan[index]
            named = spanned if source.part is None else {"part": (self.sources.head_dim, *source.part), **spanned}
            return self.buffers[index].drop_select(input_tokens, roi, timeout=timeout, borrow=borrow, **named)

        if len(self.buffers) == 1:
            self.failed_index = 0
            entry = select(0)
            self.failed_index = None
            return entry
        # The ranks' selects at once (their entries are saved in the same step): the others' each in
        # a thread of its own, the first here. Not in a pool: a gather's selects would queue behind
        # other gathers', each waiting up to its timeout, while this thread waits for them. Every
        # outcome is collected before anything is used or raised.
        others = [_aside(select, index) for index in range(1, len(self.buffers))]

        def outcome(index: int, future: concurrent.futures.Future | None) -> SelectResult | BaseException:
            try:
                return select(index) if future is None else future.result()
            except BaseException as exc:  # noqa: BLE001 - kept, raised once every select has ended
                return exc

        outcomes = [outcome(index, future) for index, future in enumerate([None, *others])]
        entries = [outcome for outcome in outcomes if not isinstance(outcome, BaseException)]
        failed = next((index for index, outcome in enumerate(outcomes) if isinstance(outcome, BaseException)), None)
        if failed is not None:
            self.failed_index = failed
            _forget(entries)
            raise outcomes[failed]
        self.failed_index = None
        missed = [self.sources.plan[index].rank for index, entry in enumerate(entries) if entry[0] is None]
        if missed:
            if len(missed) < len(entries):
                logger.warning(
                    "kvbridge: prefill TP ranks %s have no entry for these %d tokens, the others had: a miss",
                    missed,
                    input_tokens.numel(),
                )
            _forget(entries)
            return [None] * 5
        try:
            return [entries[0][0], entries[0][1], self._gathered(entries), None, None]
        except BaseException:
            _forget(entries)
            raise

    def _gathered(self, entries: list[SelectResult]) -> torch.Tensor | BorrowedTensor:
        """One key of this rank's heads from each source's (checked against the plan)."""
        dim = self.sources.head_dim
        keys = [entry[2] for entry in entries]
        first = keys[0]
        for source, entry, key in zip(self.sources.plan, entries, keys, strict=True):
            width = source.heads[1] - source.heads[0]
            if (
                entry[3] is not None
                or entry[4] is not None
                or key is None
                or len(key.shape) != len(first.shape)
                or len(key.shape) <= dim
                or key.dtype != first.dtype
                or key.shape[dim] != width
                or key.shape[:dim] != first.shape[:dim]
                or key.shape[dim + 1 :] != first.shape[dim + 1 :]
            ):
                shape = None if key is None else tuple(key.shape)
                raise KVInvalidRequestError(
                    f"kvbridge: prefill TP rank {source.rank} sent KV of shape {shape} "
                    f"{getattr(key, 'dtype', None)} (value {entry[3] is not None}, hidden {entry[4] is not None}); "
                    f"expected {width} heads along dimension {dim}, the other dimensions and the dtype of prefill "
                    f"TP rank {self.sources.plan[0].rank}'s {tuple(first.shape)} {first.dtype}, no value or hidden"
                )
        shape = (*first.shape[:dim], sum(key.shape[dim] for key in keys), *first.shape[dim + 1 :])
        pieces = [_pieces(key) for key in keys]
        if any(found is None for found in pieces):  # e.g. tensors on a GPU: one copy together
            parts = [key.to_tensor() if isinstance(key, BorrowedTensor) else key for key in keys]
            for key in keys:
                if isinstance(key, BorrowedTensor):
                    key.release()
            return torch.cat(parts, dim=dim)
        inner = math.prod(first.shape[dim + 1 :]) * first.dtype.itemsize
        rows = math.prod(first.shape[:dim])
        ordered = []
        for index, (key, found) in enumerate(zip(keys, pieces, strict=True)):
            row_bytes = key.shape[dim] * inner
            piece, offset, nbytes = cut(found[:, 1], np.arange(rows, dtype=np.int64) * row_bytes, row_bytes)
            row = (np.cumsum(nbytes) - nbytes) // row_bytes  # each row's sub-pieces hold exactly row_bytes
            ordered.append((row, np.full(len(row), index), np.stack([found[piece, 0] + offset, nbytes], axis=1)))
        row, source, parts = (np.concatenate(column) for column in zip(*ordered, strict=True))
        order = np.lexsort((np.arange(len(row)), source, row))  # row by row, each source's heads in turn
        borrowed = [key for key in keys if isinstance(key, BorrowedTensor)]
        return BorrowedTensor(tuple(shape), first.dtype, parts[order], list(keys), _Borrowings(borrowed))

    @property
    def failure(self) -> Exception | None:
        return next((buffer.failure for buffer in self.buffers if buffer.failure is not None), None)

    def stats(self) -> BufferStats:
        return BufferStats(role="kv_consumer", capacity_bytes=0)

    def close(self) -> None:
        return  # the connections belong to SourceConnections


def _aside(select: Callable[[int], SelectResult], index: int) -> concurrent.futures.Future | None:
    """``select(index)`` started in a thread of its own; None if no thread can start (the process is
    out of them): the caller then selects in its own thread, after the others have started."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(select(index))
        except BaseException as exc:  # noqa: BLE001 - the gather raises it
            future.set_exception(exc)

    try:
        cores.thread(run, "kvbridge-gather").start()
    except RuntimeError:
        logger.warning("kvbridge: no thread for the select from a prefill TP rank; it runs after the others")
        return None
    return future


class _Borrowings:
    """The borrowings of a gathered key's sources, released (or forgotten) together."""

    def __init__(self, borrowed: Sequence[BorrowedTensor]) -> None:
        self._borrowed = list(borrowed)

    def release(self) -> None:
        error: KVTransferError | None = None
        for key in self._borrowed:
            try:
                key.release()
            except KVTransferError as exc:
                error = error or exc
        if error is not None:
            raise error

    def forget(self) -> None:
        for key in self._borrowed:
            key.borrowing.forget()


def _pieces(key: torch.Tensor | BorrowedTensor) -> np.ndarray | None:
    """``(address, nbytes)`` pieces holding ``key``'s bytes in order, where this process can read them
    (a borrowed key, a contiguous tensor in host memory); else None."""
    if isinstance(key, BorrowedTensor):
        return key.pieces
    if key.device.type == "cpu" and key.is_contiguous():
        return np.array([[key.data_ptr(), key.numel() * key.element_size()]], dtype=np.int64)
    return None


def _forget(entries: list[SelectResult]) -> None:
    """Give back, unread, the borrowed items of entries that will not be used."""
    for entry in entries:
        for item in entry:
            if isinstance(item, BorrowedTensor):
                item.borrowing.forget()
