"""The producer's entries: first-in first-out per match key, bounded in bytes and in age, thread-safe.

One store may serve several connections (a producer with many consumers): :meth:`EntryStore.pop`
is atomic, so an entry goes to exactly one select.

When the byte budget is full, a store made with ``evict_unclaimed`` makes room for a new entry by
evicting the oldest entries nobody has selected yet; one without it makes the insert wait.

An entry that leaves unselected (evicted, expired, taken back or withdrawn by its owner) leaves a tombstone of its
match key for :data:`TOMBSTONE_SECONDS`: a select waiting for that key, or coming soon after, is
answered a miss at once (:meth:`EntryStore.gone`) instead of holding its consumer for its whole wait.
Watchers (:meth:`EntryStore.watch`) are told each such key.

An entry inserted with bytes of its own (not lent) is *tracked*: its inserter may need to know once it
is no longer there to be selected, whatever took it (a select, eviction, expiry, the store's end), so
that it does not send a consumer after it, and may withdraw it once it will send none
(:meth:`EntryStore.withdraw_copy`). Departure watchers (:meth:`EntryStore.watch_departures`) are told
the key of each tracked entry that leaves; a store's tracked entries under one key leave in the order
they were stored. A tracked entry that a select splits into parts leaves when its first part is
taken (its watchers are told it was split); the parts left are still its inserter's to withdraw
(:meth:`EntryStore.withdraw_split_copy`): all at once, so that a select of a part gets it or misses.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

import torch

from kv_pipe.errors import KVBufferFullError, KVTransferError
from kv_pipe.failure import fresh_error
from lookup_buffer.errors import KVInvalidRequestError
from lookup_buffer.loans import COPIED, DROPPED, EVICTED, EXPIRED, LentTensor, Loan
from lookup_buffer.matching import MatchKey

logger = logging.getLogger(__name__)

#: At most one warning about evictions per this many seconds; it counts every eviction since the last.
EVICTION_LOG_INTERVAL = 10.0
#: How many waits of taken entries :meth:`EntryStore.take_waits` keeps between calls.
TAKEN_WAITS_KEPT = 4096
#: How long a select for the key of an entry that left unselected misses at once, and how many such
#: keys are remembered (the oldest are forgotten first). Inserting under the key again ends it at once.
TOMBSTONE_SECONDS = 30.0
TOMBSTONES_KEPT = 4096


#: A part of an entry that a select may take on its own: ``(dim, start, stop)``, every tensor of the
#: entry narrowed to ``[start, stop)`` along dimension ``dim`` (e.g. some of the KV heads of paged
#: blocks, for a decode instance with more TP ranks than the prefill instance).
Part = tuple[int, int, int]


class Entry:
    """One inserted request: the tensors a hit sends (or lent tensors, with their ``loan``), and the
    bytes it is charged for."""

    __slots__ = ("items", "nbytes", "largest", "expires", "order", "loan", "lent", "stored", "tracked", "copy_part")

    def __init__(
        self,
        items: tuple[torch.Tensor | LentTensor, ...],
        nbytes: int,
        loan: Loan | None = None,
        lent: tuple[bool, bool, bool] = (False, False, False),
        tracked: bool = False,
    ) -> None:
        self.items = items
        self.lent = lent  # which of key, value and hidden are lent
        self.nbytes = nbytes
        self.largest = max(item.nbytes for item in items)  # a lent item may be copied into one message too
        self.expires = math.inf  # set when stored
        # Its place in the age order among entries that expire at the same time, set when stored:
        # the store's count of puts then, and 0 (a whole entry) or which part of a split one plus 1.
        self.order = (0, 0)
        self.stored: float | None = None  # time.monotonic() when first stored (kept by a copy of it)
        self.loan = loan
        self.tracked = tracked  # its departure is told to the departure watchers (see the module docstring)
        self.copy_part = False  # a part of a tracked entry that was split (withdrawn with its other parts)


@dataclasses.dataclass(frozen=True)
class StoreCounters:
    entries: int
    bytes: int
    peak_bytes: int
    capacity_bytes: int
    inserts: int
    insert_waits: int
    inserts_blocked: int
    rejected: int
    expired: int
    evicted: int


class EntryStore:
    """Entries by :class:`MatchKey`, within a byte budget of ``capacity_bytes``.

    ``max_item_bytes`` bounds each single tensor (what the data pipe can carry in one message).
    An entry not popped within ``entry_timeout`` seconds is dropped by the next :meth:`expire`.

    When an entry does not fit: with ``evict_unclaimed``, ``put`` evicts the oldest stored entries
    (never one already popped) until it fits, and their loans end :data:`~lookup_buffer.loans.EVICTED`;
    without it, ``put`` blocks until pops or expiry free enough room. Waiting inserts are woken in no
    particular order (a large entry may wait behind small ones).
    """

    def __init__(
        self, capacity_bytes: int, max_item_bytes: int, entry_timeout: float = math.inf, evict_unclaimed: bool = False
    ) -> None:
        self._capacity = capacity_bytes
        self._max_item = max_item_bytes
        self._entry_timeout = entry_timeout
        self._evict_unclaimed = evict_unclaimed
        self._cond = threading.Condition()
        self._entries: dict[MatchKey, collections.deque[Entry]] = {}
        # Every stored entry, with its key. A popped entry leaves it at once: the store must hold no
        # tensor it no longer counts.
        self._stored: dict[Entry, MatchKey | tuple[MatchKey, Part]] = {}
        # The age order of what _stored holds, by Entry.order (and of entries that left it, skipped
        # when found first; only numbers, never an entry's tensors): expiry, then insertion, order
        # (one timeout for all); the parts of a split entry where the entry was, so that they expire
        # and are evicted as old as it.
        self._ages: list[tuple[float, int, int]] = []
        self._by_order: dict[tuple[int, int], Entry] = {}
        self._puts = itertools.count()
        self._expired = 0
        self._evicted = 0
        self._unlogged_evictions = (0, 0)  # entries and bytes evicted since the last warning
        self._next_eviction_log = -math.inf
        self._count = 0
        self._bytes = 0
        self._peak = 0
        self._inserts = 0
        self._insert_waits = 0
        self._blocked = 0
        self._rejected = 0
        self._error: KVTransferError | None = None
        # Seconds each popped entry waited since it was stored, until taken by take_waits (bounded:
        # nobody may ever take them).
        self._waits: collections.deque[float] = collections.deque(maxlen=TAKEN_WAITS_KEPT)
        # Digests of the match keys of entries that left unselected, oldest first, with when they are
        # forgotten. A digest, not the key: a long prompt's key is megabytes, and a collision only
        # makes a select miss.
        self._tombstones: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._watchers: list[Callable[[MatchKey], object]] = []
        self._departure_watchers: list[Callable[[MatchKey, bool], object]] = []

    def put(self, key: MatchKey, entry: Entry, timeout: float) -> None:
        """Store ``entry``: evicting the oldest unclaimed entries to make room (``evict_unclaimed``),
        else waiting at most ``timeout`` seconds for room.

        Raises:
            KVBufferFullError: the entry (or one of its tensors) is too large, or no room came in time.
            KVTransferError: the store was stopped (the error given to :meth:`stop`).
        """
        deadline = time.monotonic() + timeout
        try:
            self._put(key, entry, deadline, timeout)
        finally:
            self._log_evictions()

    def _put(self, key: MatchKey, entry: Entry, deadline: float, timeout: float) -> None:
        with self._cond:
            if entry.nbytes > self._capacity or entry.largest > self._max_item:
                self._rejected += 1
                raise KVBufferFullError(
                    f"entry of {entry.nbytes} bytes (largest tensor {entry.largest}) does not fit: the "
                    f"lookup buffer holds {self._capacity} bytes (kv_buffer_size), one tensor at most "
                    f"{self._max_item}; not stored"
                )
            waited = False
            while self._error is None and self._bytes + entry.nbytes > self._capacity:
                if self._evict_unclaimed and self._stored:
                    # Every byte counted is a stored entry's (a popped one leaves the budget at
                    # once), so evicting makes room for any entry within the capacity; the wait
                    # below serves a store that does not evict.
                    self._evict_oldest()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._rejected += 1
                    raise KVBufferFullError(
                        f"lookup buffer full: {self._bytes} of {self._capacity} bytes held by {self._count} "
                        f"entries for {timeout:g} s; entry of {entry.nbytes} bytes not stored"
                    )
                waited = True
                self._blocked += 1
                try:
                    self._cond.wait(remaining)
                finally:
                    self._blocked -= 1
            if self._error is not None:
                raise fresh_error(self._error)
            now = time.monotonic()
            entry.expires = now + self._entry_timeout
            if entry.stored is None:
                entry.stored = now
            entry.order = (next(self._puts), 0)
            self._keep(key, entry)
            self._tombstones.pop((key[0] if isinstance(key, tuple) else key).digest, None)
            self._peak = max(self._peak, self._bytes)
            self._inserts += 1
            self._insert_waits += waited

    def pop(self, key: MatchKey, span: Part | None = None) -> Entry | None:
        """Remove and return the oldest entry under ``key``, or None; frees its bytes. With ``span``,
        only that span of it is returned (:func:`narrow_entry`): the rest is nobody's.

        Raises:
            KVInvalidRequestError: the oldest entry has no such span (nothing changed).
        """
        with self._cond:
            queue = self._entries.get(key)
            if not queue:
                return None
            if span is not None:
                check_span([item.shape for item in queue[0].items[1:]], span)
            entry = queue.popleft()
            self._forget(key, queue, entry)
            self._departed(key, entry)
            if entry.stored is not None:
                self._waits.append(time.monotonic() - entry.stored)
            return entry if span is None else narrow_entry(entry, span)

    def pop_part(self, key: MatchKey, part: Part, span: Part | None = None) -> Entry | None:
        """Remove and return ``part`` of an entry under ``key`` (with ``span``, only that span of the
        part, as :meth:`pop`), or None; frees its bytes.

        A part left by an earlier split comes first. Else the oldest whole entry under ``key`` is
        split (:func:`split_entry`) into equal parts of ``part``'s width: this one is returned, the
        others are stored under ``(key, their part)``, each selectable on its own, with the entry's
        expiry and place in the age order (they expire, and are evicted, as old as it) and, if it
        was lent, a loan of its own (the entry's loan ends once all of theirs have). Whole-entry
        selects never take a part, nor part selects of another width.

        Raises:
            KVInvalidRequestError: the oldest entry cannot be split so, or its part has no such
                span (nothing changed).
        """
        part = tuple(part)
        with self._cond:
            sub = (key, part)
            queue = self._entries.get(sub)
            if queue:
                if span is not None:
                    check_span([item.shape for item in queue[0].items[1:]], span)
                entry = queue.popleft()
                self._forget(sub, queue, entry)
            else:
                queue = self._entries.get(key)
                if not queue:
                    return None
                whole = queue[0]
                if span is not None:
                    dim, start, stop = _check_split(whole, part)
                    check_span(
                        [(*item.shape[:dim], stop - start, *item.shape[dim + 1 :]) for item in whole.items[1:]], span
                    )
                parts = split_entry(whole, part)
                if parts is None:  # its owner is taking it back: it leaves the store
                    return None
                queue.popleft()
                self._forget(key, queue, whole)
                self._departed(key, whole, split=True)  # its first part is taken: the whole is no longer there
                entry = None
                for index, (piece_part, piece) in enumerate(parts):
                    piece.expires, piece.stored, piece.order = whole.expires, whole.stored, (whole.order[0], index + 1)
                    piece.copy_part = whole.tracked
                    if piece_part == part:
                        entry = piece
                    else:
                        self._keep((key, piece_part), piece)
            if entry.stored is not None:
                self._waits.append(time.monotonic() - entry.stored)
            return entry if span is None else narrow_entry(entry, span)

    def _keep(self, key: MatchKey | tuple[MatchKey, Part], entry: Entry) -> None:
        """Store ``entry`` under ``key``, charged its bytes (under the lock): a whole entry under its
        match key, a part of a split entry under the key and its part."""
        self._entries.setdefault(key, collections.deque()).append(entry)
        self._stored[entry] = key
        self._by_order[entry.order] = entry
        heapq.heappush(self._ages, (entry.expires, *entry.order))
        if entry.loan is not None:
            entry.loan.stored_in(lambda: self.withdraw(entry))
        self._count += 1
        self._bytes += entry.nbytes

    def take_waits(self) -> list[float]:
        """Seconds each entry taken by :meth:`pop` since the last call had waited since it was stored
        (first stored: an entry copied out of its loan counts from the lent entry's store); the
        newest :data:`TAKEN_WAITS_KEPT` at most."""
        with self._cond:
            waits = list(self._waits)
            self._waits.clear()
            return waits

    def withdraw(self, entry: Entry) -> bool:
        """Remove ``entry`` if it is still stored (its owner takes it back); whether it was."""
        with self._cond:
            key = self._stored.get(entry)
            if key is None:
                return False
            self._take_out(key, entry)
            return True

    def withdraw_copy(self, key: MatchKey) -> bool:
        """Remove the oldest tracked entry stored whole under ``key`` (its inserter will send no
        consumer after it); whether there was one. Lent entries and the parts of split ones stay
        (:meth:`withdraw_split_copy` withdraws those).

        Tracked entries under one key are alike to a select, and leave in the order they were
        stored: the one removed is the oldest, whichever request the inserter withdraws, and its
        departure is told as any other. It leaves a tombstone, as an entry taken back does.
        """
        with self._cond:
            entry = next((entry for entry in self._entries.get(key, ()) if entry.tracked), None)
            if entry is None:
                return False
            self._take_out(key, entry)
            return True

    def withdraw_split_copy(self, key: MatchKey) -> bool:
        """Remove every part still stored of the oldest tracked entry that a select split under
        ``key`` (its inserter will send no consumer after them); whether one had parts left.

        Split tracked entries under one key are alike, as whole ones are: the one removed is the
        oldest whose parts are not all taken. Its parts leave at once, under the lock: a select of
        a part gets it before, or finds none after (a tombstone makes it miss at once, as after a
        whole entry's withdrawal). Nothing is told to the departure watchers: the entry left when
        it was split.
        """
        with self._cond:
            parts = [
                (sub, entry)
                for sub, queue in self._entries.items()
                if isinstance(sub, tuple) and sub[0] == key
                for entry in queue
                if entry.copy_part
            ]
            if not parts:
                return False
            oldest = min(entry.order[0] for _, entry in parts)
            for sub, entry in parts:
                if entry.order[0] == oldest:
                    self._take_out(sub, entry)
            return True

    def _take_out(self, key: MatchKey | tuple[MatchKey, Part], entry: Entry) -> None:
        """Remove ``entry``, stored under ``key``, for its owner (under the lock)."""
        queue = self._entries[key]
        queue.remove(entry)
        self._forget(key, queue, entry)
        self._departed(key, entry)
        self._bury(key)

    def watch(self, watcher: Callable[[MatchKey], object]) -> None:
        """Call ``watcher`` with the match key of every entry that leaves unselected (evicted, expired,
        taken back), under the store's lock: it must neither block nor call the store."""
        with self._cond:
            self._watchers.append(watcher)

    def unwatch(self, watcher: Callable[[MatchKey], object]) -> None:
        with self._cond:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def watch_departures(self, watcher: Callable[[MatchKey, bool], object]) -> None:
        """Call ``watcher`` with the match key of every tracked entry (see the module docstring) once
        it leaves the store: taken by a select (a split entry when its first part is), evicted,
        expired, withdrawn, or dropped by :meth:`stop`; and whether it was split (its other parts
        are stored still). Under the store's lock: it must neither block nor call the store."""
        with self._cond:
            self._departure_watchers.append(watcher)

    def _departed(self, key: MatchKey | tuple[MatchKey, Part], entry: Entry, split: bool = False) -> None:
        """Tell the departure watchers that ``entry``, under ``key``, left (under the lock): ``split``,
        when a select split it."""
        if entry.tracked:
            for watcher in self._departure_watchers:
                watcher(key[0] if isinstance(key, tuple) else key, split)

    def gone(self, key: MatchKey) -> bool:
        """Whether an entry under ``key`` left unselected within :data:`TOMBSTONE_SECONDS` and none
        was inserted under it since: a select for it that found nothing should miss at once."""
        with self._cond:
            forgotten = self._tombstones.get(key.digest)
            return forgotten is not None and forgotten > time.monotonic()

    def _bury(self, key: MatchKey | tuple[MatchKey, Part]) -> None:
        """Leave a tombstone of an entry (or a part of one) that left unselected, under the lock."""
        key = key[0] if isinstance(key, tuple) else key
        now = time.monotonic()
        self._tombstones[key.digest] = now + TOMBSTONE_SECONDS
        self._tombstones.move_to_end(key.digest)
        while self._tombstones and (
            len(self._tombstones) > TOMBSTONES_KEPT or next(iter(self._tombstones.values())) <= now
        ):
            self._tombstones.popitem(last=False)
        for watcher in self._watchers:
            watcher(key)

    def unlend(self, loan: Loan, empty: Callable[[Sequence[int], torch.dtype], torch.Tensor]) -> MatchKey | None:
        """Replace the stored entry lent under ``loan`` (of a split entry: each of its parts still
        stored) by a copy of its bytes in tensors made by ``empty``, and end the loan
        :data:`~lookup_buffer.loans.COPIED`: its memory is the lender's again, and the entry can
        still be selected. Returns the entry's key (selects waiting for it must be told), or None
        when no entry of that loan is stored (selected, or gone).

        The entry leaves the store while its bytes are copied: a select meanwhile waits for it, or
        misses if it does not wait. It comes back as the newest entry, charged as before; if the
        budget has no room for it by then, it is dropped (counted as evicted).
        """
        if loan.children:  # a split entry: each of its parts still stored
            keys = [self.unlend(child, empty) for child in loan.children]
            return next((key for key in keys if key is not None), None)
        with self._cond:
            found = next((item for item in self._stored.items() if item[0].loan is loan), None)
            if found is None:
                return None
            entry, key = found
            queue = self._entries[key]
            queue.remove(entry)
            self._forget(key, queue, entry)
        if not loan.begin_copy():  # its owner is taking it back: nothing may be read from it
            self._lost(key)
            return None
        try:
            items = tuple(item.materialize(empty) if isinstance(item, LentTensor) else item for item in entry.items)
        except BaseException:
            loan.end(DROPPED)
            self._lost(key)
            raise
        if not loan.end(COPIED):  # taken back during the copy: its bytes may have changed
            return None
        copy = Entry(items, entry.nbytes)
        copy.stored = entry.stored
        try:
            self.put(key, copy, timeout=0)
        except KVTransferError:
            with self._cond:
                self._evicted += 1
            self._lost(key)
            return None
        return key[0] if isinstance(key, tuple) else key  # a part's entry: waiting selects wait under its key

    def _lost(self, key: MatchKey | tuple[MatchKey, Part]) -> None:
        """An entry taken out to be copied did not come back: selects waiting for it must be told."""
        with self._cond:
            self._bury(key)

    def expire(self, now: float | None = None) -> tuple[int, int]:
        """Drop every entry stored longer than ``entry_timeout``; return the entries and bytes dropped."""
        now = time.monotonic() if now is None else now
        entries = nbytes = 0
        with self._cond:
            while (entry := self._oldest()) is not None and entry.expires <= now:
                key = self._stored[entry]
                queue = self._entries[key]
                # Usually the first of its key; not always: a copy of an unlent part is newer than
                # the parts of an older entry split after it.
                queue.remove(entry)
                self._forget(key, queue, entry)
                self._departed(key, entry)
                if entry.loan is not None:
                    entry.loan.end(EXPIRED)
                self._bury(key)
                self._expired += 1
                entries += 1
                nbytes += entry.nbytes
        self._log_evictions()  # called periodically: the last evictions are reported within the interval
        return entries, nbytes

    def _evict_oldest(self) -> None:
        """Drop the oldest stored entry to make room for a new one (under the lock); its loan ends
        :data:`~lookup_buffer.loans.EVICTED`."""
        entry = self._oldest()
        key = self._stored[entry]
        queue = self._entries[key]
        queue.remove(entry)  # usually its key's first (see expire)
        self._forget(key, queue, entry)
        self._departed(key, entry)
        if entry.loan is not None:
            entry.loan.end(EVICTED)
        self._bury(key)
        self._evicted += 1
        entries, nbytes = self._unlogged_evictions
        self._unlogged_evictions = (entries + 1, nbytes + entry.nbytes)

    def _oldest(self) -> Entry | None:
        """The stored entry that expires first, or None (under the lock)."""
        while self._ages and self._ages[0][1:] not in self._by_order:
            heapq.heappop(self._ages)
        return self._by_order[self._ages[0][1:]] if self._ages else None

    def _log_evictions(self) -> None:
        """Warn about evictions not reported yet, at most once per :data:`EVICTION_LOG_INTERVAL`."""
        if not self._unlogged_evictions[0]:  # the common case, without the lock (checked again under it)
            return
        now = time.monotonic()
        with self._cond:
            entries, nbytes = self._unlogged_evictions
            if not entries or now < self._next_eviction_log:
                return
            self._unlogged_evictions = (0, 0)
            self._next_eviction_log = now + EVICTION_LOG_INTERVAL
            total, capacity = self._evicted, self._capacity
        logger.warning(
            "lookup buffer full (kv_buffer_size %d bytes): %d entries (%d bytes) that no consumer had "
            "selected were evicted, oldest first, to make room for new ones (%d evicted in all)",
            capacity,
            entries,
            nbytes,
            total,
        )

    def _forget(self, key: MatchKey, queue: collections.deque[Entry], entry: Entry) -> None:
        """Account for ``entry`` just taken off ``queue`` (under the lock)."""
        del self._stored[entry]
        del self._by_order[entry.order]
        if len(self._ages) > 2 * len(self._stored) + 1024:  # entries that left linger in the heap
            self._ages = [age for age in self._ages if age[1:] in self._by_order]
            heapq.heapify(self._ages)
        if not queue:
            del self._entries[key]
        self._count -= 1
        self._bytes -= entry.nbytes
        self._cond.notify_all()

    def stop(self, error: KVTransferError) -> tuple[int, int]:
        """Refuse further puts with ``error``, wake waiting ones, drop every entry.

        Returns the number of entries and bytes dropped.
        """
        with self._cond:
            if self._error is None:
                self._error = error
            dropped = self._count, self._bytes
            for entry, key in sorted(self._stored.items(), key=lambda item: item[0].order):
                self._departed(key, entry)
                if entry.loan is not None:
                    entry.loan.end(DROPPED)
            self._entries.clear()
            self._stored.clear()
            self._ages.clear()
            self._by_order.clear()
            self._count = 0
            self._bytes = 0
            self._cond.notify_all()
            return dropped

    def counters(self) -> StoreCounters:
        with self._cond:
            return StoreCounters(
                entries=self._count,
                bytes=self._bytes,
                peak_bytes=self._peak,
                capacity_bytes=self._capacity,
                inserts=self._inserts,
                insert_waits=self._insert_waits,
                inserts_blocked=self._blocked,
                rejected=self._rejected,
                expired=self._expired,
                evicted=self._evicted,
            )


def split_entry(entry: Entry, part: Part) -> list[tuple[Part, Entry]] | None:
    """``entry`` divided into equal parts of ``part``'s width along its dimension (``part`` among
    them): every tensor of the entry narrowed there, lent ones over the same memory, each part with
    a copy of the hit header and its share of the entry's bytes. None if the entry's loan can no
    longer be divided (its owner is taking it back).

    Raises:
        KVInvalidRequestError: no such split: a tensor without that dimension or of another size
            there than the key, a width that does not divide it, a start not at a multiple of it.
    """
    dim, start, stop = _check_split(entry, part)
    header, *items = entry.items
    width = stop - start
    count = items[0].shape[dim] // width
    loans: list[Loan | None] = [None] * count
    if entry.loan is not None:
        divided = entry.loan.divide(count)
        if divided is None:
            return None
        loans = list(divided)
    share = entry.nbytes // count
    parts = []
    for index, loan in enumerate(loans):
        narrowed = tuple(item.narrow(dim, index * width, width) for item in items)
        nbytes = entry.nbytes - share * (count - 1) if index == 0 else share
        parts.append(
            (
                (dim, index * width, index * width + width),
                Entry((header.clone(), *narrowed), nbytes, loan=loan, lent=entry.lent),
            )
        )
    return parts


def _check_split(entry: Entry, part: Part) -> Part:
    """``part``, if :func:`split_entry` can divide ``entry`` by it; else KVInvalidRequestError."""
    dim, start, stop = part
    items = entry.items[1:]
    width = stop - start
    size = items[0].shape[dim] if dim < len(items[0].shape) else 0
    if (
        width < 1
        or size == 0
        or size % width
        or start % width
        or stop > size
        or any(dim >= len(item.shape) or item.shape[dim] != size for item in items)
    ):
        shapes = ", ".join(str(tuple(item.shape)) for item in items)
        raise KVInvalidRequestError(
            f"a select of [{start}, {stop}) along dimension {dim} cannot take part of an "
            f"entry of tensors {shapes}: it must divide every one of them there into "
            f"equal parts"
        )
    return part


def check_span(shapes: Sequence[Sequence[int]], span: Part) -> None:
    """KVInvalidRequestError unless every tensor of an entry (of these ``shapes``) has ``span``'s
    range ``[start, stop)`` along its dimension."""
    dim, start, stop = span
    if not 0 <= start < stop or any(dim >= len(shape) or stop > shape[dim] for shape in shapes):
        raise KVInvalidRequestError(
            f"a select of the span [{start}, {stop}) along dimension {dim} does not fit an "
            f"entry of tensors {', '.join(str(tuple(shape)) for shape in shapes)}"
        )


def narrow_entry(entry: Entry, span: Part) -> Entry:
    """What a select of ``span`` of ``entry`` (out of the store, checked by :func:`check_span`) is
    sent: every tensor narrowed to that range (lent ones over the same memory, under the same loan),
    charged only those bytes (and the tokens')."""
    dim, start, stop = span
    header, *items = entry.items
    narrowed = tuple(item.narrow(dim, start, stop - start) for item in items)
    nbytes = entry.nbytes - sum(item.nbytes for item in items) + sum(item.nbytes for item in narrowed)
    return Entry((header, *narrowed), nbytes, loan=entry.loan, lent=entry.lent)
