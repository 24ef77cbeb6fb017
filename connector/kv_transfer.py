"""Send a batch of requests' KV into a lookup buffer, and receive it back into the caller's caches.

The contract (blocking, errors, hit versus miss) is stated in :mod:`connector.base`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import torch

from connector.base import KVRecvResult, KVRequest, KVSendResult
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
        roi = request.roi
        loan = buffer.insert(request.input_tokens, roi, key, value, request.hidden, timeout=timeout)
        num_bytes = _nbytes(request.input_tokens, roi, key, value, request.hidden)
        results.append(KVSendResult(num_bytes=num_bytes, seconds=time.perf_counter() - start, loan=loan))
    return results


def _mismatch(
    request: KVRequest,
    tokens: torch.Tensor,
    roi: torch.Tensor | None,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    hidden: torch.Tensor | None,
) -> str | None:
    """Why a received entry must not be used for ``request``, or ``None``."""
    expected = request.input_tokens
    if tokens.shape != expected.shape or not torch.equal(tokens.cpu().long(), expected.cpu().long()):
        return "the entry's tokens differ from the request's"
    if roi is None or not torch.equal(roi.cpu().bool(), request.roi.cpu()):
        return "the entry covers other token positions than the request"
    reason = request.kv.mismatch(key, value)
    if reason is not None or request.hidden is None:
        return reason
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
    for index, request in enumerate(requests):
        start = time.perf_counter()
        entry = buffer.drop_select(request.input_tokens, request.roi, timeout=timeout, borrow=True)
        try:
            result = _receive_one(index, request, *entry)
        finally:
            release_all(entry)  # KVPeerLostError if the producer took its memory back meanwhile
        results.append(dataclasses.replace(result, seconds=time.perf_counter() - start))
    return results


def _receive_one(index: int, request: KVRequest, tokens: torch.Tensor | None, roi: torch.Tensor | None,
                 key: torch.Tensor | BorrowedTensor | None, value: torch.Tensor | BorrowedTensor | None,
                 hidden: torch.Tensor | BorrowedTensor | None) -> KVRecvResult:
    """Check one selected entry against ``request`` and load it on a hit (``seconds`` left 0)."""
    # Only the key is ever lent by this connector; a peer that lends the others gets them copied.
    value, hidden = (item.to_tensor() if isinstance(item, BorrowedTensor) else item for item in (value, hidden))
    if tokens is None:
        reason = f"no entry for these {request.input_tokens.numel()} tokens within the timeout"
    else:
        reason = _mismatch(request, tokens, roi, key, value, hidden)
    num_bytes = _nbytes(tokens, roi, key, value, hidden)
    if reason is not None:
        logger.warning("batch item %d (%d tokens): miss: %s", index, request.input_tokens.numel(), reason)
        return KVRecvResult(hit=False, reason=reason, num_bytes=num_bytes, seconds=0.0)
    if isinstance(key, BorrowedTensor):
        request.kv.load_borrowed(key, value)
    else:
        request.kv.load(key, value)
    if request.hidden is not None:
        request.hidden.copy_(hidden)
    return KVRecvResult(hit=True, reason=None, num_bytes=num_bytes, seconds=0.0)
