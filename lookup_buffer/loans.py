"""Entries lent where they lie: a same-host consumer copies the producer's memory itself, then gives it back.

A producer whose KV lives in exported host memory (:mod:`kv_pipe.exported_memory`) need not copy it
out to insert it. It inserts a :class:`LentTensor`, which says where the bytes lie, and gets a
:class:`Loan`. A consumer on the same host that asks to borrow (``drop_select(..., borrow=True)``)
receives a :class:`BorrowedTensor` over its read-only mapping of that memory, copies the bytes where
it wants them, and releases it; only then, or once the producer gave up on it, is the loan over and
the memory the producer's again. A consumer that cannot borrow (another host, or one that did not
ask) gets an ordinary tensor: the producer copies the lent bytes into the data pipe's memory when
the entry is selected, and the loan is over as soon as they are copied.

While its loan lasts, the producer must not change the lent memory.

A borrower must know, once it has copied, that the loan held all along: the producer takes back
what is not released within ``kv_timeout``. Asking would cost a round trip per entry. Instead each
loan lent out has a word in the producer's :class:`LoanTable`, exported like the memory it lends,
holding the loan's random stamp; the producer clears the word *before* it ends the loan. The
borrower reads the word *after* its copy: if it still holds the stamp, every byte it copied was
read while the loan held: on x86 stores become visible in the order they were made and loads are
not reordered with later loads. (On weaker memory models, ARM's, this ordering rests on the locks
both sides cross between the copy and the word; that is not verified.) The release itself is then
sent without waiting for an answer.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import secrets
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kv_pipe.errors import KVTransferError
from kv_pipe.exported_memory import ExportedMemory, PeerMemory, export_host_memory, find_exports, page_aligned_empty
from kv_pipe.parallel_copy import copy_pieces
from lookup_buffer.errors import KVEntryTakenBackError

#: How a loan ended.
RETURNED = "returned"  # the borrower gave them back (copied, or refused by its checks)
SENT = "sent"  # the bytes were copied into the data pipe for a consumer that does not borrow
EXPIRED = "expired"  # no consumer selected the entry within kv_entry_timeout
RECLAIMED = "reclaimed"  # a consumer borrowed it and did not give it back within kv_timeout
DROPPED = "dropped"  # the buffer closed, or failed, or the borrowing consumer was lost
EVICTED = "evicted"  # nobody had selected it when the full buffer made room for a newer entry
COPIED = "copied"  # nobody had selected it when its lender asked for the memory back: the entry now holds a copy
TAKEN_BACK = "taken back"  # the producer needed the memory again before the loan ended (Loan.take_back)

#: ``(address, nbytes)`` pieces that, read one after another, hold a tensor's bytes.
Pieces = Sequence[tuple[int, int]]
#: Loans a producer process has lent out at once, at most; beyond, entries are copied, not lent.
MAX_LOANS_OUT = 4096


class LoanTable:
    """Producer, one per process: a stamp word per loan lent out, exported so that borrowers can check
    it. Thread-safe."""

    def __init__(self, slots: int = MAX_LOANS_OUT) -> None:
        self.words = page_aligned_empty((slots,), torch.int64)
        self.words.zero_()
        self.export = export_host_memory(self.words)
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    def take(self) -> tuple[int, int] | None:
        """A free slot, now holding a fresh stamp: ``(slot, stamp)``; None if all are taken."""
        stamp = secrets.randbits(63) | 1  # never 0, the word of no loan
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        self.words[slot] = stamp
        return slot, stamp

    def clear(self, slot: int) -> None:
        """Clear a slot's stamp (before its loan ends) and free it."""
        self.words[slot] = 0
        with self._lock:
            self._free.append(slot)


_table: LoanTable | None = None
_table_lock = threading.Lock()


def loan_table() -> LoanTable:
    """This process's loan table, made on first use."""
    global _table
    with _table_lock:
        if _table is None:
            _table = LoanTable()
        return _table


class Loan:
    """The producer's handle on the memory of one lent entry. Thread-safe.

    The buffer that stores the entry tells the loan what happens to it: :meth:`stored_in` (how to
    take the entry out of its store), then at most one of :meth:`begin_copy` (the entry is copied
    for a consumer that does not borrow) and :meth:`lend_out` (a consumer borrows it, under a stamp
    word of the :class:`LoanTable`), then :meth:`end`. The owner of the memory may
    :meth:`take_back` the loan at any time.
    """

    def __init__(self) -> None:
        self._ended = threading.Event()
        self._outcome: str | None = None
        self._lock = threading.Lock()
        self._withdraw: Callable[[], object] | None = None
        self._slot: int | None = None  # its stamp word in the loan table while lent out
        self._copying = False
        self._taking_back = False
        self._parent: Loan | None = None  # a part's loan: the loan of the entry it was divided from
        self._children: tuple[Loan, ...] = ()  # a divided entry's loan: the loans of its parts

    @property
    def outcome(self) -> str | None:
        """How the loan ended (:data:`RETURNED`, :data:`SENT`, ...), or None while it lasts."""
        return self._outcome

    def wait(self, timeout: float | None = None) -> str | None:
        """Block until the loan has ended, at most ``timeout`` seconds; its outcome, or None."""
        self._ended.wait(timeout)
        return self._outcome

    def stored_in(self, withdraw: Callable[[], object]) -> None:
        """Buffer: the entry is stored; ``withdraw()`` takes it out of the store if it is still there."""
        with self._lock:
            self._withdraw = withdraw

    def begin_copy(self) -> bool:
        """Buffer: the entry is about to be copied out (then ended :data:`SENT`); False if the loan
        ended or is being taken back: nothing may be read from it any more."""
        with self._lock:
            if self._outcome is not None or self._taking_back:
                return False
            self._copying = True
            return True

    def lend_out(self, slot: int) -> bool:
        """Buffer: a borrower gets the entry under the stamp in ``slot`` of the loan table, which
        :meth:`end` clears and frees; False (the slot is left to the caller) if the loan ended or is
        being taken back: the borrower must not get it."""
        with self._lock:
            if self._outcome is not None or self._taking_back:
                return False
            self._slot = slot
            return True

    def end(self, outcome: str) -> bool:
        """End the loan with ``outcome`` unless it already ended; whether this call ended it. A loan
        lent out has its stamp cleared first, so that a borrower that copies after this sees that it
        must not use what it copied. A divided loan ends only through its parts (:meth:`divide`)."""
        with self._lock:
            if self._outcome is not None or self._children:
                return False
            slot, self._slot = self._slot, None
            self._withdraw = None  # the store's entry is gone, or soon will be
            if slot is not None:
                loan_table().clear(slot)
            self._outcome = outcome
            parent = self._parent
        self._ended.set()
        if parent is not None:
            parent._part_ended()
        return True

    @property
    def children(self) -> tuple[Loan, ...]:
        """The loans of the parts this loan's entry was divided into (:meth:`divide`); empty if it was not."""
        return self._children

    def divide(self, count: int) -> list[Loan] | None:
        """Store: the entry is divided into ``count`` parts, each stored and selected on its own
        (a select of part of an entry, e.g. of some KV heads): one new loan per part. This loan then
        ends once all of theirs have ended (with their outcome, if all ended alike, else
        :data:`TAKEN_BACK` or :data:`RETURNED` where any ended so, else the last one's), and
        :meth:`take_back` takes all of them back. None, and nothing divided, if this loan has ended, is being taken
        back, or its entry is being copied or lent out."""
        with self._lock:
            if (
                self._outcome is not None
                or self._taking_back
                or self._copying
                or self._slot is not None
                or self._children
                or count < 1
            ):
                return None
            children = tuple(Loan() for _ in range(count))
            for child in children:
                child._parent = self
            self._children = children
            self._withdraw = None  # the whole entry leaves its store: its parts are withdrawn one by one
            return list(children)

    def _part_ended(self) -> None:
        """One of this loan's parts ended: end this loan once all have."""
        outcomes = [child.outcome for child in self._children]
        if any(outcome is None for outcome in outcomes):
            return
        if len(set(outcomes)) == 1:
            outcome = outcomes[0]
        else:
            outcome = next((kind for kind in (TAKEN_BACK, RETURNED) if kind in outcomes), outcomes[-1])
        with self._lock:
            if self._outcome is not None:
                return
            self._outcome = outcome
        self._ended.set()

    def take_back(self, timeout: float) -> bool:
        """Owner: end the loan now, whatever stage it is in, because the memory is about to change.

        An entry still stored leaves its store; one lent out has its stamp cleared (its borrower's
        release then fails with :class:`KVEntryTakenBackError`, whatever it copied is not used); one
        being copied out is waited for, at most ``timeout`` seconds, then ended all the same: the
        copy may still read the memory, but cannot end the loan, so the buffer never uses it.
        Returns True once nobody reads the memory any more, False if a copy out did not finish in time.
        """
        with self._lock:
            if self._outcome is not None:
                return True
            self._taking_back = True
            copying, withdraw, children = self._copying, self._withdraw, self._children
        if children:  # every part, each at whatever stage it is (this loan ends with the last one)
            return all([child.take_back(timeout) for child in children])
        if copying:
            if self._ended.wait(timeout):
                return True
            self.end(TAKEN_BACK)
            return False
        if withdraw is not None:
            withdraw()
        self.end(TAKEN_BACK)
        return True


@dataclasses.dataclass(frozen=True, eq=False)
class LentTensor:
    """Producer: a tensor of ``shape`` and ``dtype`` whose bytes lie, in order, in ``pieces``
    (``[n, 2]`` int64: address, bytes) of exported memory; ``exports`` holds each export they touch
    and ``places`` says, per piece, which one (its index) and where in it (an offset). Made by
    :meth:`over`."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: np.ndarray
    exports: tuple[ExportedMemory, ...]
    places: np.ndarray

    @classmethod
    def over(cls, shape: Sequence[int], dtype: torch.dtype, pieces: Pieces | np.ndarray) -> LentTensor | None:
        """The lent tensor over ``pieces``, or None unless each lies in an export (in its whole pages:
        the ends of an exported storage are not exported) or there are none. ValueError if they do
        not hold the tensor's bytes exactly."""
        shape = tuple(int(size) for size in shape)
        pieces = np.array(pieces, dtype=np.int64).reshape(-1, 2)
        if int(pieces[:, 1].sum()) != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"pieces of {int(pieces[:, 1].sum())} bytes for a {shape} {dtype} tensor")
        found = find_exports(pieces)
        if found is None:
            return None
        return cls(shape, dtype, pieces, *found)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def narrow(self, dim: int, start: int, length: int) -> LentTensor:
        """The lent tensor of ``[start, start + length)`` along dimension ``dim`` (as ``torch.narrow``),
        over the same memory: a part of an entry selected on its own (e.g. some of its KV heads).
        ValueError if that range is not within the tensor."""
        if not 0 <= dim < len(self.shape) or start < 0 or length < 1 or start + length > self.shape[dim]:
            raise ValueError(f"[{start}, {start + length}) of dimension {dim} of a {self.shape} tensor")
        inner = math.prod(self.shape[dim + 1 :]) * self.dtype.itemsize  # bytes of one index along dim
        starts = np.arange(math.prod(self.shape[:dim]), dtype=np.int64) * (self.shape[dim] * inner) + start * inner
        index, offset, nbytes = cut(self.pieces[:, 1], starts, length * inner)
        pieces = np.stack([self.pieces[index, 0] + offset, nbytes], axis=1)
        places = np.stack([self.places[index, 0], self.places[index, 1] + offset], axis=1)
        shape = (*self.shape[:dim], length, *self.shape[dim + 1 :])
        return LentTensor(shape, self.dtype, pieces, self.exports, places)

    def materialize(self, empty: Callable[[Sequence[int], torch.dtype], torch.Tensor]) -> torch.Tensor:
        """A copy of the bytes in a new tensor made by ``empty(shape, dtype)`` (contiguous)."""
        tensor = empty(self.shape, self.dtype)
        copy_pieces([(tensor.data_ptr(), self.nbytes)], self.pieces)
        return tensor


def cut(sizes: np.ndarray, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte ranges ``[start, start + length)``, for each of ``starts``, of a stream made of pieces of
    ``sizes`` bytes one after another, as the sub-pieces that hold them, range by range in order:
    ``(piece index, offset in that piece, bytes)`` of each (int64 arrays). ValueError if a range
    leaves the stream."""
    sizes = np.asarray(sizes, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.cumsum(sizes)
    begins = ends - sizes
    total = int(ends[-1]) if len(ends) else 0
    if len(starts) and (length < 0 or int(starts.min()) < 0 or int(starts.max()) + length > total):
        raise ValueError(
            f"byte ranges of {length} bytes from {int(starts.min())} to {int(starts.max())} of a stream of {total}"
        )
    low = np.searchsorted(ends, starts, side="right")  # the first piece ending after the range's start
    high = np.searchsorted(begins, starts + length, side="left")  # past the last piece starting before its end
    counts = np.maximum(high - low, 0)
    ranges = np.repeat(np.arange(len(starts), dtype=np.int64), counts)
    firsts = np.repeat(np.cumsum(counts) - counts, counts)
    piece = np.repeat(low, counts) + np.arange(int(counts.sum()), dtype=np.int64) - firsts
    first_byte = np.maximum(begins[piece], starts[ranges])
    last_byte = np.minimum(ends[piece], starts[ranges] + length)
    keep = last_byte > first_byte
    return piece[keep], (first_byte - begins[piece])[keep], (last_byte - first_byte)[keep]


class Borrowing:
    """Consumer: one borrowed entry, released once (by any of its tensors). Thread-safe.

    ``stamp_address`` is where this side maps the loan's word in the producer's :class:`LoanTable`;
    ``give_back()`` has the release sent (without waiting for anything).
    """

    def __init__(self, stamp_address: int, stamp: int, give_back: Callable[[], None], mapping: PeerMemory) -> None:
        self._word = ctypes.c_int64.from_address(stamp_address)
        self._stamp = stamp
        self._give_back = give_back
        self._mapping = mapping  # keeps the word mapped
        self._lock = threading.Lock()
        self._released = False

    def forget(self) -> None:
        """Give the entry back unused; nothing if it was released already."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._give_back()

    def release(self) -> None:
        """Check that the loan held until now, and give the entry back. Later calls return at once.

        Raises:
            KVEntryTakenBackError: the producer had taken the memory back (the borrow outlived its
                ``kv_timeout``, or the producer needed the memory): what was copied may be wrong.
        """
        with self._lock:
            if self._released:
                return
            self._released = True
        held = self._word.value == self._stamp  # after every copy out of the loan: see the module's docstring
        self._give_back()
        if not held:
            raise KVEntryTakenBackError(
                "lookup buffer: the producer took back a lent entry before it was released "
                "(the borrow outlived its kv_timeout, or the producer needed the memory): "
                "what was copied from it may be wrong"
            )


class BorrowedTensor:
    """Consumer: a tensor's bytes in the producer's memory, mapped read-only here, in ``pieces``
    (local addresses, each checked to lie in the mapping). Copy them out, then :meth:`release`."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        pieces: np.ndarray,
        memories: Sequence[PeerMemory],
        borrowing: Borrowing,
    ) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.pieces = pieces  # [n, 2] int64: local address, bytes
        self._memories = tuple(memories)  # keep the mappings while this tensor lives
        self.borrowing = borrowing

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def dim(self) -> int:
        return len(self.shape)

    def slice_pieces(self, start: int, nbytes: int) -> np.ndarray:
        """The pieces (``[n, 2]``) that hold bytes ``[start, start + nbytes)`` of the tensor
        (ValueError if that leaves the tensor)."""
        if start < 0 or nbytes < 0 or start + nbytes > self.nbytes:
            raise ValueError(f"bytes [{start}, {start + nbytes}) of a tensor of {self.nbytes}")
        ends = np.cumsum(self.pieces[:, 1])
        begins = ends - self.pieces[:, 1]
        low, high = np.maximum(begins, start), np.minimum(ends, start + nbytes)
        keep = low < high
        return np.stack([self.pieces[keep, 0] + low[keep] - begins[keep], high[keep] - low[keep]], axis=1)

    def copy_to(self, targets: Pieces | np.ndarray) -> None:
        """Copy the bytes into ``targets`` (local ``(address, nbytes)`` pieces holding as many bytes)."""
        copy_pieces(targets, self.pieces)

    def to_tensor(self) -> torch.Tensor:
        """A private copy of the bytes as an ordinary tensor."""
        tensor = torch.empty(self.shape, dtype=self.dtype)
        self.copy_to([(tensor.data_ptr(), self.nbytes)])
        return tensor

    def release(self) -> None:
        """Release the entry this tensor belongs to (:meth:`Borrowing.release`), once its bytes are copied."""
        self.borrowing.release()


def release_all(items: Sequence[object]) -> None:
    """Release every borrowed entry among ``items`` (a drop_select result); the first error is raised
    once all were released."""
    error: KVTransferError | None = None
    for item in items:
        if isinstance(item, BorrowedTensor):
            try:
                item.release()
            except KVTransferError as exc:
                error = error or exc
    if error is not None:
        raise error
