"""Send a batch of requests' KV into a lookup buffer, and receive it back into the caller's caches.

The contract (blocking, errors, hit versus miss) is stated in :mod:`connector.base`.

Device-generic: KV and hidden states may live on a GPU while the buffer's memory is host memory
(the host-staged mode). Each crosses once, into the buffer's memory on the producer and into the
caller's tensors on the consumer, and every copy is done when the call returns
(:func:`kv_pipe.device.copy_between`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import torch

from connector.base import EmptyTensor, KVRecvResult, KVRequest, KVSendResult
from kv_pipe.device import copy_between
from lookup_buffer import KVLookupBufferBase
from lookup_buffer.loans import BorrowedTensor, LentTensor, release_all

logger = logging.getLogger(__name__)


def _nbytes(*tensors: torch.Tensor | LentTensor | BorrowedTensor | None) -> int:
    return sum(tensor.nbytes for tensor in tensors if tensor is not None)


def send_kv_caches_and_hidden_states(
    buffer: KVLookupBufferBase, requests: Sequence[KVRequest], timeout: float | None = None, lend: bool = False
) -> list[KVSendResult]:
    """Insert every request's KV and hidden state into ``buffer``; see :mod:`connector.base`."""
    results = []
    for request in requests:
        start = time.perf_counter()
        lent = request.kv.lend() if lend else None
        key, value = lent or request.kv.pack(buffer.empty)
        copied = time.perf_counter()
        roi = request.roi
        hidden = _in_buffer_memory(request.hidden, buffer.empty)
        loan = buffer.insert(request.input_tokens, roi, key, value, hidden, timeout=timeout)
        num_bytes = _nbytes(request.input_tokens, roi, key, value, hidden)
        results.append(
            KVSendResult(
                num_bytes=num_bytes, seconds=time.perf_counter() - start, loan=loan, copy_seconds=copied - start
            )
        )
    return results


def _in_buffer_memory(tensor: torch.Tensor | None, empty: EmptyTensor) -> torch.Tensor | None:
    """``tensor`` itself if it lies where the buffer keeps its tensors, else a copy there (a GPU
    tensor and a host buffer: copied now, not when the pipe sends it, and the GPU memory is free)."""
    if tensor is None or tensor.device.type == "cpu":
        return tensor
    staged = empty(tensor.shape, tensor.dtype)
    if staged.device == tensor.device:
        return tensor
    copy_between(staged, tensor)
    return staged


def _found_tokens(request: KVRequest, tokens: torch.Tensor, roi: torch.Tensor | None, prefixes: bool) -> int | str:
    """How many leading tokens of ``request`` the received entry covers, or why it must not be used:
    all of them, or (from a buffer that returns prefixes) a non-empty prefix."""
    expected = request.input_tokens
    if tokens.shape != expected.shape or not torch.equal(tokens.cpu().long(), expected.cpu().long()):
        return "the entry's tokens differ from the request's"
    if roi is not None and roi.shape == expected.shape:
        roi = roi.cpu().bool()
        selected = int(roi.sum())
        if selected == expected.numel() or (prefixes and selected > 0 and bool(roi[:selected].all())):
            return selected
    return "the entry covers other token positions than the request"


def _hidden_mismatch(request: KVRequest, hidden: torch.Tensor | None) -> str | None:
    if request.hidden is None:
        return None
    if hidden is None:
        return "no hidden state was received"
    if hidden.shape != request.hidden.shape or hidden.dtype != request.hidden.dtype:
        return (
            f"hidden state {tuple(hidden.shape)} {hidden.dtype} received, "
            f"{tuple(request.hidden.shape)} {request.hidden.dtype} expected"
        )
    return None


def recv_kv_caches_and_hidden_states(
    buffer: KVLookupBufferBase, requests: Sequence[KVRequest], timeout: float | None = None
) -> list[KVRecvResult]:
    """Select every request's entry from ``buffer`` into the caller's memory; see :mod:`connector.base`."""
    results = []
    # A buffer that does not say it returns prefixes (one of duck type included) gives exact matches only.
    prefixes = getattr(buffer, "returns_prefixes", False) is True
    for index, request in enumerate(requests):
        start = time.perf_counter()
        # A span only where the storage names one: buffers that do not take spans keep working.
        spanned = {} if request.kv.span is None else {"span": request.kv.span}
        entry = buffer.drop_select(request.input_tokens, request.roi, timeout=timeout, borrow=True, **spanned)
        selected = time.perf_counter()
        try:
            result = _receive_one(index, request, prefixes, *entry)
        finally:
            release_all(entry)  # KVPeerLostError if the producer took its memory back meanwhile
        results.append(
            dataclasses.replace(result, seconds=time.perf_counter() - start, **_select_phases(entry, start, selected))
        )
    return results


def _select_phases(entry: object, start: float, selected: float) -> dict[str, float | None]:
    """The select's time (``start`` to ``selected``) split at the arrival of the entry's header,
    where the buffer's result says when that was (an ``arrived`` attribute, a ``perf_counter``
    time; see :class:`connector.base.KVRecvResult`)."""
    arrived = getattr(entry, "arrived", None)
    if not isinstance(arrived, float) or not start <= arrived <= selected:
        return {"wait_seconds": selected - start}
    lent = any(isinstance(item, BorrowedTensor) for item in entry)  # type: ignore[attr-defined]
    return {"wait_seconds": arrived - start, "receive_seconds": None if lent else selected - arrived}


def _receive_one(
    index: int,
    request: KVRequest,
    prefixes: bool,
    tokens: torch.Tensor | None,
    roi: torch.Tensor | None,
    key: torch.Tensor | BorrowedTensor | None,
    value: torch.Tensor | BorrowedTensor | None,
    hidden: torch.Tensor | BorrowedTensor | None,
) -> KVRecvResult:
    """Check one selected entry against ``request`` and load it, or the prefix it holds where
    ``prefixes`` (the buffer returns prefixes); ``seconds`` left 0."""
    # Only the key is ever lent by this connector; a peer that lends the others gets them copied.
    value, hidden = (item.to_tensor() if isinstance(item, BorrowedTensor) else item for item in (value, hidden))
    num_tokens = request.input_tokens.numel()
    num_bytes = _nbytes(tokens, roi, key, value, hidden)
    found: int | str = f"no entry for these {num_tokens} tokens within the timeout"
    if tokens is not None:
        found = _found_tokens(request, tokens, roi, prefixes)
    if isinstance(found, str):
        return _miss(index, request, found, num_bytes)
    if found < num_tokens:
        if isinstance(key, BorrowedTensor):
            key = key.to_tensor()
        reason = request.kv.mismatch_prefix(key, value, found)
        if reason is not None:
            return _miss(index, request, reason, num_bytes)
        start = time.perf_counter()
        request.kv.load_prefix(key, value, found)
        return _miss(
            index,
            request,
            f"only the first {found} of {num_tokens} tokens were found",
            num_bytes,
            loaded=found,
            copy_seconds=time.perf_counter() - start,
        )
    reason = request.kv.mismatch(key, value)
    hidden_reason = _hidden_mismatch(request, hidden)
    if reason is not None or (hidden_reason is not None and not (prefixes and hidden is None)):
        return _miss(index, request, reason or hidden_reason, num_bytes)
    start = time.perf_counter()
    if isinstance(key, BorrowedTensor):
        request.kv.load_borrowed(key, value)
    else:
        request.kv.load(key, value)
    if hidden_reason is not None:  # all the KV, not the hidden state: the last token is computed again
        return _miss(
            index,
            request,
            "all tokens were found but not their hidden state",
            num_bytes,
            loaded=num_tokens - 1,
            copy_seconds=time.perf_counter() - start,
        )
    if request.hidden is not None:
        copy_between(request.hidden, hidden)
    return KVRecvResult(
        hit=True,
        reason=None,
        num_bytes=num_bytes,
        seconds=0.0,
        copy_seconds=time.perf_counter() - start,
        num_tokens=num_tokens,
    )


def _miss(
    index: int, request: KVRequest, reason: str, num_bytes: int, loaded: int = 0, copy_seconds: float = 0.0
) -> KVRecvResult:
    logger.warning("batch item %d (%d tokens): miss: %s", index, request.input_tokens.numel(), reason)
    return KVRecvResult(
        hit=False, reason=reason, num_bytes=num_bytes, seconds=0.0, copy_seconds=copy_seconds, num_tokens=loaded
    )
