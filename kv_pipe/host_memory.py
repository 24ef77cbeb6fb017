"""Reusable host memory for received tensors.

Touching fresh pages costs more than the wire: a receive into a new buffer ran at ~2 GB/s here
against ~4.7 GB/s into a reused one (docs/performance.md), so large receive buffers are recycled.
A buffer goes back to the pool only when the *storage* of every tensor made from it has died: numpy
arrays own the memory and ``torch.from_numpy`` keeps the array alive exactly as long as the storage,
which a weakref finalizer on the array observes. Views the caller takes keep the storage, and so the
buffer, alive. The finalizer may run in any thread inside any lock, the pool's own included, so it
only notes the buffer; the next call of the pool takes it back.

A buffer may be allocated with *headroom*: its first bytes belong to the pool's user, never to a
tensor made from the rest, so the pipe can write a frame header there and send header and tensor as
one message without copying the tensor (see :meth:`HostMemoryPool.headroom`).
"""

from __future__ import annotations

import collections
import threading
import weakref

import numpy as np
import torch

#: Below this size malloc's own caching is as good as ours.
POOL_MIN_BYTES = 1 << 20


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to one of four sizes per power of two: at most 25% slack, few sizes."""
    step = 1 << max(nbytes.bit_length() - 3, 0)
    return (nbytes + step - 1) // step * step


class HostMemoryPool:
    """Hands out 1-D uint8 CPU tensors; recycles their memory when the caller drops them.

    Thread-safe. ``max_idle_bytes`` bounds the memory kept while nobody uses it.
    """

    def __init__(self, max_idle_bytes: int) -> None:
        self._max_idle_bytes = max_idle_bytes
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self._dropped: collections.deque[np.ndarray] = collections.deque()  # appended to by finalizers
        self._headroom: dict[int, int] = {}  # buffer address -> headroom, while a tensor uses the buffer

    def allocate(self, nbytes: int, headroom: int = 0) -> torch.Tensor:
        """A buffer of ``nbytes``; with ``headroom``, its first ``headroom`` bytes are the caller's to
        keep out of the tensors it makes from the buffer (see :meth:`headroom`)."""
        if nbytes < POOL_MIN_BYTES and not headroom:
            return torch.empty(nbytes, dtype=torch.uint8)
        size = size_class(nbytes)
        with self._lock:
            self._take_back()
            free = self._idle.get(size)
            if free:
                backing = free.pop()
                self._idle_bytes -= size
            else:
                backing = None
        if backing is None:
            backing = np.empty(size, dtype=np.uint8)
        view = backing[:nbytes]
        address = None
        if headroom:  # only then is the address needed: most buffers are for payloads
            address = view.ctypes.data
            self._headroom[address] = headroom
        weakref.finalize(view, self._drop, backing, address)
        return torch.from_numpy(view)

    def headroom(self, tensor: torch.Tensor) -> int:
        """The headroom in front of ``tensor``: that of its buffer if the buffer was allocated with one
        and ``tensor`` starts right after it, else 0. Thread-safe."""
        start = tensor.untyped_storage().data_ptr()
        headroom = self._headroom.get(start, 0)
        return headroom if tensor.data_ptr() - start == headroom else 0

    def _drop(self, backing: np.ndarray, address: int | None) -> None:
        if address is not None:
            # The buffer's memory may be freed from now on: another storage could start at its address.
            self._headroom.pop(address, None)
        self._dropped.append(backing)

    def _take_back(self) -> None:
        """Pool the buffers whose tensors died, within ``max_idle_bytes`` (hold ``_lock``)."""
        while self._dropped:
            backing = self._dropped.popleft()
            if self._idle_bytes + backing.nbytes <= self._max_idle_bytes:
                self._idle.setdefault(backing.nbytes, []).append(backing)
                self._idle_bytes += backing.nbytes

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            self._take_back()
            return self._idle_bytes
