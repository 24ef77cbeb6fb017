"""The lookup buffer contract.

A lookup buffer sits on top of a tensor pipe (:mod:`kv_pipe`) and lets the consumer (decode side)
fetch the KV cache of a request by its tokens, in any order, from the producer (prefill side), which
inserts entries as it finishes them. Upper layers (the connector) only rely on what this module
states.

Matching rule
-------------
An entry is ``[input_tokens, roi, key, value, hidden]``; ``roi`` is a boolean mask over
``input_tokens`` that says which positions ``key``/``value`` cover. Let *positions* be the indices
where ``roi`` is True. An entry matches a query ``(input_tokens, roi)`` iff both select the same
positions AND the tokens at those positions are identical (compared as integers, whatever their
integer dtype). Tokens outside the selected positions, and the lengths of the token tensors, play
no part. Consequences:

* A query whose selected tokens are a strict prefix of a buffered entry's does NOT match it, and
  vice versa: a shorter request never takes a longer request's entry (a prefix rule would).
* Two entries with equal positions and tokens are served first-in first-out.
* Lookup is O(1) in the number of buffered entries (a hash of positions and tokens, then an exact
  comparison: the hash alone is never trusted).

Lending
-------
On one host the producer can lend an entry instead of copying it (:mod:`lookup_buffer.loans`): it
inserts :class:`~lookup_buffer.loans.LentTensor` items, which say where the bytes lie in its
exported memory, and must leave that memory unchanged until the :class:`~lookup_buffer.loans.Loan`
that ``insert`` returns has ended. A consumer that selects with ``borrow=True`` over a same-host
pipe receives :class:`~lookup_buffer.loans.BorrowedTensor` items, copies the bytes itself, and
releases them; any other consumer receives ordinary tensors, copied by the producer when selected.

Partial hits
------------
The ``roi`` returned by :meth:`KVLookupBufferBase.drop_select` is authoritative: callers must use
it, not their own. A buffer whose :attr:`~KVLookupBufferBase.returns_prefixes` is False (the
pipe's buffers) only returns exact matches, as the matching rule above says. A buffer whose
``returns_prefixes`` is True (:class:`lookup_buffer.store_buffer.StoreBuffer`) answers with the
longest prefix of the query it holds: the returned roi then selects positions ``[0, k)`` of the
query's tokens for some ``k`` up to the query's own prefix, ``key``/``value`` cover exactly those
``k`` tokens, and ``hidden`` comes only when all of the query was found. Such a buffer accepts only
a roi that selects a prefix of the tokens (``KVInvalidRequestError`` otherwise) and may leave the
entry in place (selecting does not drop it).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from types import TracebackType

import torch

from lookup_buffer.loans import BorrowedTensor, LentTensor, Loan

#: What :meth:`KVLookupBufferBase.drop_select` returns: input_tokens, roi, key, value, hidden.
SelectResult = list[torch.Tensor | BorrowedTensor | None]


@dataclasses.dataclass(frozen=True)
class BufferStats:
    """Counters of one side of a lookup buffer, taken at one moment.

    Producer and consumer count hits, misses and waits alike (the producer tells the consumer
    whether a select waited, in the header of its outcome), so both sides agree once every
    select has returned.
    """

    role: str
    #: Entries held now (producer; 0 on the consumer).
    entries: int = 0
    #: Bytes held now: sum of ``nbytes`` of every tensor of every held entry (producer).
    bytes: int = 0
    #: Most bytes ever held at once (producer); never above ``capacity_bytes``.
    peak_bytes: int = 0
    #: The byte budget (``kv_buffer_size``).
    capacity_bytes: int = 0
    #: Entries stored (producer).
    inserts: int = 0
    #: Inserts that had to wait for room (producer).
    insert_waits: int = 0
    #: Inserts waiting for room now (producer).
    inserts_blocked: int = 0
    #: Inserts refused with KVBufferFullError: too large, or the buffer stayed full (producer).
    rejected: int = 0
    #: Entries dropped because no consumer selected them within ``kv_entry_timeout`` (producer).
    expired: int = 0
    #: Entries nobody had selected, evicted (oldest first) to make room for newer ones in a full
    #: budget (producer, with ``kv_evict_unclaimed``).
    evicted: int = 0
    #: Selects answered with an entry.
    hits: int = 0
    #: Selects answered "not there" after their wait.
    misses: int = 0
    #: Selects that found nothing at first and waited for an insert (then hit or missed).
    waits: int = 0
    #: Selects waiting now (producer: parked waits; consumer: calls in flight).
    pending: int = 0
    #: Payload bytes of hits sent (producer) or received (consumer).
    transferred_bytes: int = 0
    #: Control messages the producer refused (malformed, unknown version, hostile).
    bad_messages: int = 0


class KVLookupBufferBase(abc.ABC):
    """A keyed, bounded buffer of KV entries shared by a producer and a consumer process.

    One side is the producer (``kv_role='kv_producer'``: :meth:`insert`), the other the consumer
    (``kv_role='kv_consumer'``: :meth:`drop_select`); calling the other side's method raises
    :class:`kv_pipe.KVConfigError`. Every error is a :class:`kv_pipe.KVTransferError`; a miss is
    a normal result, never an exception, and an error is never reported as a miss.
    """

    #: Whether :meth:`drop_select` may answer with a prefix of the query (see *Partial hits*).
    returns_prefixes: bool = False

    @abc.abstractmethod
    def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        key: torch.Tensor | LentTensor,
        value: torch.Tensor | LentTensor | None,
        hidden: torch.Tensor | LentTensor | None,
        timeout: float | None = None,
    ) -> Loan | None:
        """Producer: store an entry until a consumer selects it.

        ``input_tokens`` is a 1-D integer tensor, ``roi`` a 1-D bool tensor of the same length that
        selects at least one position; ``key`` is a tensor of any shape and dtype; ``value`` and
        ``hidden`` are tensors or None (e.g. paged layouts keep K and V in one tensor). The buffer
        keeps references to key, value and hidden (no copy): the caller must not modify them
        afterwards. Bytes charged: the sum of ``nbytes`` of all five, lent or not.

        Any of key, value and hidden may be lent (see *Lending* above): the call then returns the
        entry's :class:`~lookup_buffer.loans.Loan`, and None otherwise.

        When the entry does not fit in the byte budget: with ``kv_evict_unclaimed``, the oldest
        entries no consumer has selected yet are evicted until it fits (their loans end
        ``evicted``; a select for them misses), and the call never waits; without it (the
        default), the call blocks until selects or expiry free enough room, at most ``timeout``
        seconds (``None``: ``kv_timeout``). Thread-safe.

        Raises:
            KVBufferFullError: the budget stayed full for ``timeout`` (without eviction), or the
                entry alone is larger than the budget (at once); the entry was not stored.
            KVInvalidRequestError: the arguments break the contract above.
            KVPeerLostError / KVPipeClosedError / KVProtocolError: the consumer died or closed,
                or the buffer was closed (also wakes an insert blocked on a full buffer).
        """

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Producer: a new tensor to fill and then :meth:`insert` (as key, value or hidden), in
        memory the buffer sends fastest; a plain ``torch.empty`` here. Do not modify it once inserted."""
        return torch.empty(tuple(shape), dtype=dtype)

    def unlend(self, loan: Loan) -> bool:
        """Producer: end ``loan`` by copying its entry's lent bytes into memory of this buffer's own,
        if nobody has selected the entry yet: the lent memory is the caller's again, and the entry
        stays selectable (:data:`~lookup_buffer.loans.COPIED`). Returns whether it did; False also
        for a buffer that does not lend. Thread-safe; blocks for the copy."""
        return False

    @abc.abstractmethod
    def drop_select(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        timeout: float | None = None,
        borrow: bool = False,
        part: tuple[int, int, int] | None = None,
        span: tuple[int, int, int] | None = None,
    ) -> SelectResult:
        """Consumer: take the entry matching ``(input_tokens, roi)`` out of the producer's buffer.

        With ``borrow=True`` a lent item may come as a :class:`~lookup_buffer.loans.BorrowedTensor`:
        copy its bytes out, then release it (``release_all(result)``); the producer takes back
        what is not released within its ``kv_timeout``, and the release then raises.

        With ``part=(dim, start, stop)`` only that part of an entry is taken: each of its tensors
        narrowed to ``[start, stop)`` along dimension ``dim``. The producer splits the entry into
        equal parts of that width and keeps the others, each for a select naming it (e.g. the
        decode TP ranks that each take some of a prefill rank's KV heads); a part select never takes
        a whole entry's place, nor a whole select a part. The width must divide the tensors' size
        there and ``start`` be a multiple of it, else the producer refuses the select.

        With ``span=(dim, start, stop)`` only that range of the entry (of its part, with ``part``)
        travels, each tensor narrowed to ``[start, stop)`` along ``dim`` (e.g. the blocks of a
        transfer prefix that the consumer does not hold yet); the rest of the entry is dropped
        with it. The producer refuses a span that some tensor of the entry does not have, and
        keeps the entry.

        Returns ``[input_tokens, roi, key, value, hidden]`` of the entry (the producer's tensors,
        bit-exact, on the pipe's device; the entry is removed from the producer: "drop"), or five
        ``None`` on a miss. If no entry matches yet, the producer holds the request up to
        ``timeout`` seconds (``None``: 0, answer at once) and answers as soon as a matching entry is
        inserted; a miss after the timeout is a normal result. Thread-safe: many threads may
        select at once, each gets exactly its own entry.

        Raises:
            KVInvalidRequestError: the arguments break the contract of :meth:`insert`, or ``part``
                or ``span`` is not ``(dim, start, stop)`` with ``0 <= start < stop``.
            KVPeerLostError: the producer died or did not answer within ``timeout + kv_timeout``.
            KVPipeClosedError: this buffer was closed (also wakes a waiting call), or the
                producer closed its side.
            KVProtocolError: the producer refused the select (another protocol version or
                ``kv_secret``, a select that is not of its session, or too many selects waiting
                there) or sent something inconsistent; the message says which.
        """

    @property
    def failure(self) -> Exception | None:
        """Why this buffer can no longer serve (its peer died or closed, or it was closed), once it
        knows; None while it is usable. Thread-safe, never blocks. A pool of connections uses it to
        replace a dead connection before a request finds it dead."""
        return None

    @abc.abstractmethod
    def stats(self) -> BufferStats:
        """A snapshot of this side's counters. Thread-safe, never blocks on the peer."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving and close the data pipe (the buffer owns it). Idempotent.

        Wakes every waiting :meth:`insert` / :meth:`drop_select` with KVPipeClosedError. The
        producer drops entries nobody selected (logged). Bounded by a few ``kv_timeout``; raises
        the first pipe failure (e.g. the peer died) that no other call has reported yet.
        """

    def __enter__(self) -> KVLookupBufferBase:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
