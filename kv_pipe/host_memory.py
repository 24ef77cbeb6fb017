"""Reusable host memory for received tensors.

Touching fresh pages costs more than the wire here (~2 GB/s against gloo's ~4.7 GB/s, see
shared/notes/transport-facts.md), so large receive buffers are recycled. A buffer goes back to
the pool only when the *storage* of every tensor made from it has died: numpy arrays own the memory
and ``torch.from_numpy`` keeps the array alive exactly as long as the storage, which a weakref
finalizer on the array observes. Views the caller takes keep the storage, and so the buffer, alive.

A pipe's receive frames and slots come back by a cheaper route (:class:`HandedOverBuffers`).
"""

from __future__ import annotations

import collections
import sys
import threading
import weakref

import numpy as np
import torch

from kv_pipe.protocol import size_class

#: Below this size malloc's own caching is as good as ours.
POOL_MIN_BYTES = 1 << 20


class HostMemoryPool:
    """Hands out 1-D uint8 CPU tensors; recycles their memory when the caller drops them.

    Thread-safe. ``max_idle_bytes`` bounds the memory kept while nobody uses it.
    """

    def __init__(self, max_idle_bytes: int) -> None:
        self._max_idle_bytes = max_idle_bytes
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> torch.Tensor:
        if nbytes < POOL_MIN_BYTES:
            return torch.empty(nbytes, dtype=torch.uint8)
        size = size_class(nbytes)
        with self._lock:
            free = self._idle.get(size)
            if free:
                backing = free.pop()
                self._idle_bytes -= size
            else:
                backing = None
        if backing is None:
            backing = np.empty(size, dtype=np.uint8)
        view = backing[:nbytes]
        weakref.finalize(view, self._release, backing)
        return torch.from_numpy(view)

    def _release(self, backing: np.ndarray) -> None:
        with self._lock:
            if self._idle_bytes + backing.nbytes <= self._max_idle_bytes:
                self._idle.setdefault(backing.nbytes, []).append(backing)
                self._idle_bytes += backing.nbytes

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle_bytes


class HandedOverBuffers:
    """Host receive buffers whose memory went to callers, taken back once every tensor over them has died.

    A receive frame whose inline tensor is handed to a caller whole, or a slot whose payload is,
    needs a replacement for the next receive. Taking the same buffer back costs less than a pool
    allocation (no new array, finalizer or byte view) and keeps the memory in the caches: a
    ping-pong of 768 KiB tensors took 14-22% less time one way, one of 1 MiB 3-8% less, and of 2 to
    8 MiB payloads 1-7% less (medians of paired rounds). Whether a caller still uses a buffer is
    read from the reference count of the numpy array that the buffer's byte view exports. Every
    tensor made from :meth:`hand_over`'s view holds an export of that array of its own:
    ``torch.frombuffer`` keeps the buffer object, and tensors derived from that one keep its
    storage. So the count is back at its value from before the hand over exactly when all of them
    have died.

    Keeps at most ``keep`` buffers; an older one is forgotten, and its memory freed (or pooled) once
    the caller's tensors die. Not thread-safe: one receiving thread at a time uses it.
    """

    def __init__(self, keep: int) -> None:
        # (buffer, the buffer's byte view, the exported array's reference count while idle)
        self._buffers: collections.deque[tuple[torch.Tensor, memoryview, int]] = collections.deque(maxlen=keep)

    def hand_over(self, buffer: torch.Tensor, buffer_bytes: memoryview, start: int, nbytes: int) -> memoryview:
        """Remember ``buffer`` and return a byte view of ``buffer_bytes[start:start + nbytes]`` for a caller.

        ``buffer_bytes`` must be a view of a numpy array over ``buffer``'s memory that nothing else
        exports, as :meth:`TorchDistributedPipe._host_bytes` makes it.
        """
        idle_refs = sys.getrefcount(buffer_bytes.obj)  # the very expression take_idle compares with it
        self._buffers.append((buffer, buffer_bytes, idle_refs))
        return memoryview(buffer_bytes.obj)[start : start + nbytes]  # a new export: counted while it lives

    def take_idle(self, nbytes: int) -> tuple[torch.Tensor, memoryview] | None:
        """A remembered buffer of ``nbytes`` that no caller's tensor uses any more, with its byte view, or None."""
        for index, (buffer, buffer_bytes, idle_refs) in enumerate(self._buffers):
            if buffer.numel() == nbytes and sys.getrefcount(buffer_bytes.obj) == idle_refs:
                del self._buffers[index]  # by position: removing by value would compare tensors
                return buffer, buffer_bytes
        return None

    @property
    def idle_bytes(self) -> int:
        """Bytes of the remembered buffers that no caller's tensor uses any more."""
        return sum(buffer.numel() for buffer, buffer_bytes, idle_refs in self._buffers
                   if sys.getrefcount(buffer_bytes.obj) == idle_refs)
