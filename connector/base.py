"""The connector contract: moving a batch of requests' KV caches through a lookup buffer.

The connector is framework-neutral. A caller describes each request as a :class:`KVRequest`: its
prompt tokens, where its KV lives (a :class:`KVStorage`) and optionally its last hidden state.

Producer (prefill side), :func:`connector.send_kv_caches_and_hidden_states`::

    send_kv_caches_and_hidden_states(buffer, requests, timeout=None, lend=False) -> list[KVSendResult]

packs each request's KV out of the caller's caches (a copy: the caches may be reused at once) and
inserts it into the lookup buffer under the request's tokens, with ``requests[i].hidden`` as the
hidden state. With ``lend=True``, a request whose KV lies in exported memory
(:meth:`connector.PagedKVCaches.export`) is lent instead of copied (:mod:`lookup_buffer.loans`): a
same-host consumer then copies the blocks straight into its own caches, the only copy. Its result
carries the :class:`~lookup_buffer.loans.Loan`: leave those blocks unchanged until it has ended.
The buffer keeps ``input_tokens`` and ``hidden`` by reference until the entry is
selected: do not modify them in place. Blocking: each insert waits at most ``timeout`` seconds for
room in the buffer (``None``: the buffer's ``kv_timeout``). Errors: :class:`kv_pipe.KVTransferError`
subclasses from the buffer propagate (e.g. :class:`kv_pipe.KVBufferFullError`).

Consumer (decode side), :func:`connector.recv_kv_caches_and_hidden_states`::

    recv_kv_caches_and_hidden_states(buffer, requests, timeout=None) -> list[KVRecvResult]

asks the buffer for each request's tokens (each ask waits at most ``timeout`` seconds for the entry
to appear; ``None``: not at all) and, on a hit, writes the KV into the caller's caches and the hidden
state into ``requests[i].hidden``. Lent KV is copied straight from the producer's memory and
released; a hit is reported only if the loan's stamp shows that the producer kept that memory
unchanged until the copy was done (else :class:`kv_pipe.KVPeerLostError`: the caches may hold
wrong bytes). It returns one result per request, in order: a hit means the caller may skip the
prefill of that request; a miss (with a reason, also logged) means it must compute it, from token
``num_tokens`` on (0, and nothing of the caller's memory written, unless a prefix was loaded: see
*Prefixes* below). A hit is only reported after the received tokens, region of interest, layer
count, block count, shapes and dtypes were all checked against what the caller expects. An entry
that was received but failed a check is consumed (the buffer drops what it selects).

Prefixes: from a buffer that answers with the longest prefix it holds
(:attr:`~lookup_buffer.KVLookupBufferBase.returns_prefixes`, e.g. a
:class:`~lookup_buffer.StoreBuffer`), an entry covering the first ``k`` of the request's ``n``
tokens is loaded into those ``k`` positions (:meth:`KVStorage.load_prefix`) and reported as a miss
with ``num_tokens=k``: the caller computes the tokens from ``k`` on. All ``n`` tokens found without
the hidden state the caller asked for (it was not stored) load all the KV and report ``num_tokens=n -
1``: the last token is computed again for its hidden state. From any other buffer a partial entry is a
plain miss and nothing is written.

Errors versus misses: a request that is absent or inconsistent with the caller's setup is a miss; a
caller whose own arguments are wrong (tokens not a 1-D integer tensor, block ids out of range or
too few for the tokens, layers of different shapes) gets :class:`kv_pipe.KVConfigError` when it
builds the request; a broken transport propagates as :class:`kv_pipe.KVTransferError`.

Neither function is thread-safe with respect to the caller's caches: the caller must not touch the
caches of the requests being moved until the call returns.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence

import torch

from kv_pipe.errors import KVConfigError
from lookup_buffer.loans import BorrowedTensor, LentTensor, Loan

#: Makes a new host tensor of a shape and dtype, as :func:`host_empty` does.
EmptyTensor = Callable[[Sequence[int], torch.dtype], torch.Tensor]


def host_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype)


class KVStorage(abc.ABC):
    """Where one request's KV lives in the caller's memory, for every layer.

    On the producer the storage is read (:meth:`pack`); on the consumer it is the destination
    (:meth:`mismatch`, then :meth:`load`).
    """

    @abc.abstractmethod
    def check_tokens(self, num_tokens: int) -> None:
        """Raise :class:`KVConfigError` if this storage cannot hold the KV of ``num_tokens`` tokens."""

    @abc.abstractmethod
    def pack(self, empty: EmptyTensor = host_empty) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The request's KV as the (key, value) pair stored in the lookup buffer: new tensors, made
        with ``empty(shape, dtype)`` (the buffer's :meth:`~lookup_buffer.KVLookupBufferBase.empty`,
        so that they need no further copy on their way)."""

    @abc.abstractmethod
    def mismatch(self, key: torch.Tensor | None, value: torch.Tensor | None) -> str | None:
        """Why a received (key, value) pair cannot be loaded here, or ``None`` when it can."""

    @abc.abstractmethod
    def load(self, key: torch.Tensor, value: torch.Tensor | None) -> None:
        """Write a received pair, for which :meth:`mismatch` returned ``None``, into the caller's memory."""

    def mismatch_prefix(self, key: torch.Tensor | None, value: torch.Tensor | None, num_tokens: int) -> str | None:
        """Why a received pair holding the KV of only the first ``num_tokens`` tokens cannot be loaded
        here (:meth:`load_prefix`), or ``None`` when it can. Here: always refused."""
        return f"{type(self).__name__} cannot load the KV of a prefix"

    def load_prefix(self, key: torch.Tensor, value: torch.Tensor | None, num_tokens: int) -> None:
        """Write a received pair holding the first ``num_tokens`` tokens, for which
        :meth:`mismatch_prefix` returned ``None``, into those tokens' places; the rest is left as is."""
        raise NotImplementedError

    @property
    def span(self) -> tuple[int, int, int] | None:
        """Consumer: the span of an entry this storage takes (``drop_select``'s ``span``: a range
        along one dimension, e.g. only some of its blocks), or None for all of it. :meth:`mismatch`
        and the loads then see only that span. None here."""
        return None

    def lend(self) -> tuple[LentTensor, LentTensor | None] | None:
        """The request's KV lent where it lies (:mod:`lookup_buffer.loans`), or None if it cannot be
        (then :meth:`pack` copies it). None here."""
        return None

    def load_borrowed(self, key: BorrowedTensor, value: torch.Tensor | None) -> None:
        """Like :meth:`load`, for a key borrowed from the producer's memory; here through a private copy."""
        self.load(key.to_tensor(), value)


@dataclasses.dataclass(frozen=True)
class KVRequest:
    """One request of a batch.

    Attributes:
        input_tokens: the prompt, a 1-D integer tensor; it is the lookup key (all positions).
        kv: where the request's KV is read from (producer) or written to (consumer).
        hidden: producer: the hidden state to send along (any tensor, or ``None``). Consumer: a
            destination tensor that a hit fills (shape and dtype must match what was sent), or
            ``None`` when the caller does not need a hidden state.
    """

    input_tokens: torch.Tensor
    kv: KVStorage
    hidden: torch.Tensor | None = None

    def __post_init__(self) -> None:
        tokens = self.input_tokens
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.numel() == 0:
            raise KVConfigError(f"input_tokens must be a non-empty 1-D tensor, got {tokens!r}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise KVConfigError(f"input_tokens must have an integer dtype, got {tokens.dtype}")
        self.kv.check_tokens(tokens.numel())

    @property
    def roi(self) -> torch.Tensor:
        """The region of interest sent to the buffer: every token of the prompt."""
        return torch.ones(self.input_tokens.numel(), dtype=torch.bool, device=self.input_tokens.device)


@dataclasses.dataclass(frozen=True)
class KVSendResult:
    """What inserting one request cost: bytes handed to the buffer and seconds spent; and, if its KV
    was lent, the loan (leave the request's KV unchanged until it has ended)."""

    num_bytes: int
    seconds: float
    loan: Loan | None = None
    #: Of ``seconds``: packing the KV out of the caches (a copy), or describing where it lies (lent).
    copy_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class KVRecvResult:
    """The outcome for one request on the consumer.

    Attributes:
        hit: the KV (and the hidden state, if asked for) was written into the caller's memory.
        reason: why it is a miss; ``None`` on a hit.
        num_bytes: bytes received for the request (0 when nothing arrived).
        seconds: time spent waiting for and receiving the entry, and writing it.
        wait_seconds: of ``seconds``, from the select sent until the entry's header (a lent entry's
            descriptor) arrived; for a buffer that does not say when the header arrived, until the
            select returned (a copied entry's bytes received included).
        receive_seconds: from the header until the entry's bytes were in hand, where the buffer says
            when the header arrived and the bytes came after it; None otherwise (a lent entry's bytes
            are read by the copy into the caller's memory).
        copy_seconds: writing the entry into the caller's memory (for a lent entry the only copy,
            straight out of the producer's memory); 0 on a miss.
        num_tokens: leading tokens whose KV was written into the caller's memory and need not be
            computed: all of them on a hit; on a miss 0, or the prefix loaded from a buffer that
            returns prefixes (see *Prefixes* above).
    """

    hit: bool
    reason: str | None
    num_bytes: int
    seconds: float
    wait_seconds: float = 0.0
    receive_seconds: float | None = None
    copy_seconds: float = 0.0
    num_tokens: int = 0
