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
        results.append(KVSendResult(num_bytes=num_bytes, seconds=time.perf_counter() - start, loan=loan,
                                    copy_seconds=copied - start))
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
        selected = time.perf_counter()
        try:
            result = _receive_one(index, request, *entry)
        finally:
            release_all(entry)  # KVPeerLostError if the producer took its memory back meanwhile
        results.append(dataclasses.replace(result, seconds=time.perf_counter() - start,
                                           **_select_phases(entry, start, selected)))
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
    start = time.perf_counter()
    if isinstance(key, BorrowedTensor):
        request.kv.load_borrowed(key, value)
    else:
        request.kv.load(key, value)
    if request.hidden is not None:
        copy_between(request.hidden, hidden)
    return KVRecvResult(hit=True, reason=None, num_bytes=num_bytes, seconds=0.0,
                        copy_seconds=time.perf_counter() - start)
