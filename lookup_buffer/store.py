"""The producer's entries: first-in first-out per match key, bounded in bytes and in age, thread-safe.

One store may serve several connections (a producer with many consumers): :meth:`EntryStore.pop`
is atomic, so an entry goes to exactly one select.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time

import torch

from kv_pipe.errors import KVBufferFullError, KVTransferError
from lookup_buffer.errors import fresh_error
from lookup_buffer.loans import DROPPED, EXPIRED, LentTensor, Loan
from lookup_buffer.matching import MatchKey


class Entry:
    """One inserted request: the tensors a hit sends (or lent tensors, with their ``loan``), and the
    bytes it is charged for."""

    __slots__ = ("items", "nbytes", "largest", "expires", "loan", "lent")

    def __init__(self, items: tuple[torch.Tensor | LentTensor, ...], nbytes: int, loan: Loan | None = None,
                 lent: tuple[bool, bool, bool] = (False, False, False)) -> None:
        self.items = items
        self.lent = lent  # which of key, value and hidden are lent
        self.nbytes = nbytes
        self.largest = max(item.nbytes for item in items)  # a lent item may be copied into one message too
        self.expires = math.inf  # set when stored
        self.loan = loan


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


class EntryStore:
    """Entries by :class:`MatchKey`; ``put`` blocks while the byte budget is full.

    ``max_item_bytes`` bounds each single tensor (what the data pipe can carry in one message).
    Waiting inserts are woken in no particular order (a large entry may wait behind small ones).
    An entry not popped within ``entry_timeout`` seconds is dropped by the next :meth:`expire`.
    """

    def __init__(self, capacity_bytes: int, max_item_bytes: int, entry_timeout: float = math.inf) -> None:
        self._capacity = capacity_bytes
        self._max_item = max_item_bytes
        self._entry_timeout = entry_timeout
        self._cond = threading.Condition()
        self._entries: dict[MatchKey, collections.deque[Entry]] = {}
        # Every stored entry in insertion order, which is also expiry order (one timeout for all).
        # A popped entry leaves it at once: the store must hold no tensor it no longer counts.
        self._by_age: collections.OrderedDict[Entry, MatchKey] = collections.OrderedDict()
        self._expired = 0
        self._count = 0
        self._bytes = 0
        self._peak = 0
        self._inserts = 0
        self._insert_waits = 0
        self._blocked = 0
        self._rejected = 0
        self._error: KVTransferError | None = None

    def put(self, key: MatchKey, entry: Entry, timeout: float) -> None:
        """Store ``entry``, waiting at most ``timeout`` seconds for room.

        Raises:
            KVBufferFullError: the entry (or one of its tensors) is too large, or no room came in time.
            KVTransferError: the store was stopped (the error given to :meth:`stop`).
        """
        deadline = time.monotonic() + timeout
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
            entry.expires = time.monotonic() + self._entry_timeout
            self._entries.setdefault(key, collections.deque()).append(entry)
            self._by_age[entry] = key
            self._count += 1
            self._bytes += entry.nbytes
            self._peak = max(self._peak, self._bytes)
            self._inserts += 1
            self._insert_waits += waited

    def pop(self, key: MatchKey) -> Entry | None:
        """Remove and return the oldest entry under ``key``, or None; frees its bytes."""
        with self._cond:
            queue = self._entries.get(key)
            if not queue:
                return None
            entry = queue.popleft()
            self._forget(key, queue, entry)
            return entry

    def expire(self, now: float | None = None) -> tuple[int, int]:
        """Drop every entry stored longer than ``entry_timeout``; return the entries and bytes dropped."""
        now = time.monotonic() if now is None else now
        entries = nbytes = 0
        with self._cond:
            while self._by_age and next(iter(self._by_age)).expires <= now:
                entry, key = self._by_age.popitem(last=False)
                queue = self._entries[key]
                # One timeout for all: the oldest entry of the store is the oldest of its key.
                if queue.popleft() is not entry:
                    raise AssertionError("lookup buffer store: entries of one key out of insertion order")
                self._forget(key, queue, entry)
                if entry.loan is not None:
                    entry.loan.end(EXPIRED)
                self._expired += 1
                entries += 1
                nbytes += entry.nbytes
        return entries, nbytes

    def _forget(self, key: MatchKey, queue: collections.deque[Entry], entry: Entry) -> None:
        """Account for ``entry`` just taken off ``queue`` (under the lock)."""
        self._by_age.pop(entry, None)
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
            for entry in self._by_age:
                if entry.loan is not None:
                    entry.loan.end(DROPPED)
            self._entries.clear()
            self._by_age.clear()
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
            )
