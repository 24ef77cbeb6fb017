"""Host memory a process lets its same-host pipe peers read: its pages moved into shared memory in place.

A KV cache is allocated by its engine, in private memory that no other process can map. The only
copy a transfer between two caches on one host needs is the consumer copying the producer's blocks
straight into its own; for that the producer's cache pages must be shared. :func:`export_host_memory`
makes them so without moving the tensor: it copies the whole pages under the tensor's storage into
an anonymous shared-memory file (``memfd_create``) and maps that file over the very same addresses
(``mremap``), so every tensor and view over the storage keeps working, reading and writing the
shared pages. The file is sealed against shrinking and growing: a peer that maps it can never fault
on a page the exporter took away. It is also sealed against future writes (``F_SEAL_FUTURE_WRITE``,
Linux 5.1): through whatever descriptor it is opened, even read-write through ``/proc/PID/fd/FD``,
nobody can ``write`` it, punch holes in it or map it writable any more, while the exporter's own
mapping, made before the seal, keeps writing. A writable mapping anyone else made before the seal
would keep writing too, so nobody else may open the file until it is sealed: from its creation to
the seal (a few system calls, before any byte is copied in) the process is not dumpable, which
makes its ``/proc/PID/fd`` unopenable by processes without ``CAP_SYS_PTRACE`` (those may write the
process's memory anyway). Only then is the storage copied in, through the exporter's mapping, which
then moves over the storage. A kernel that cannot add that seal gets no export at all
(:class:`KVConfigError`; callers then copy).

A pipe peer maps the export read-only (:class:`PeerMemory`, through ``/proc/PID/fd/FD`` of a peer
the pipe already proved to be on this host), and only an export that carries every seal: it can read
the exporter's memory, never change it, and what it reads only the exporter can have written.
What it reads is steered only by offsets that are checked against the mapping here.

Only the whole pages inside the storage are exported: the partial pages at its ends may belong to
other allocations. An export keeps its storage alive for the rest of the process: were the storage
freed, whatever the allocator put at those addresses next would be readable by peers. It is meant
for memory that lives as long as the process anyway, an engine's KV caches.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import math
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from kv_pipe.errors import KVConfigError, KVProtocolError

_EXPORT_NAME = "kvbridge-export"
_PAGE = mmap.PAGESIZE
#: Linux 5.1: no new ``write``, hole punch or writable shared mapping through any descriptor; mappings
#: made before keep writing. Python's fcntl module may lack the constant.
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
#: Seals every export carries: its size can never change under a peer's mapping, and only the
#: exporter's own mapping can change its contents.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
_MAP_FAILED = ctypes.c_void_p(-1).value
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2  # the mapping moves to the address given, replacing what was there
_PR_GET_DUMPABLE, _PR_SET_DUMPABLE = 3, 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_libc.prctl.restype = ctypes.c_int
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


@dataclasses.dataclass(frozen=True)
class ExportDescriptor:
    """What a peer needs to map an export: the exporter's descriptor number, the file's inode (so
    that a reused descriptor number is never taken for the export) and its size."""

    fd: int
    inode: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class ExportedMemory:
    """Pages of this process shared with pipe peers: ``[address, address + nbytes)``."""

    address: int
    nbytes: int
    descriptor: ExportDescriptor
    storage: torch.UntypedStorage = dataclasses.field(compare=False, repr=False)  # never freed: see above

    def offset_of(self, address: int, nbytes: int) -> int | None:
        """The offset of ``[address, address + nbytes)`` in this export, or None if it lies outside."""
        if nbytes < 0 or address < self.address or address + nbytes > self.address + self.nbytes:
            return None
        return address - self.address


_exports: list[ExportedMemory] = []
_exports_lock = threading.Lock()


def export_host_memory(tensor: torch.Tensor) -> ExportedMemory:
    """Share the whole pages under ``tensor``'s storage with pipe peers, in place; the export that
    already covers them if there is one. Contents, addresses and every view are unchanged.

    Call it before other threads use the storage: a write during the move could be lost. Thread-safe.

    Raises:
        KVConfigError: the tensor is not in host memory, its storage holds no whole page, or the
            kernel refused (no ``memfd_create``, ``mmap`` or ``F_SEAL_FUTURE_WRITE``; the message
            says which). Nothing is exported then.
    """
    if tensor.device.type != "cpu":
        raise KVConfigError(f"only host memory can be exported, not {tensor.device}")
    storage = tensor.untyped_storage()
    start = -(-storage.data_ptr() // _PAGE) * _PAGE
    end = (storage.data_ptr() + storage.nbytes()) // _PAGE * _PAGE
    if end <= start:
        raise KVConfigError(f"a storage of {storage.nbytes()} bytes holds no whole page to export")
    with _exports_lock:
        for export in _exports:
            if export.address == start and export.nbytes == end - start:
                return export
            if export.address < end and start < export.address + export.nbytes:
                raise KVConfigError("the storage overlaps memory exported before, but not exactly")
        _check_write_seal()
        export = _move_into_shared_memory(start, end - start, storage)
        _exports.append(export)
    return export


def page_aligned_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A new host tensor that starts on a page boundary and fills whole pages, so that all of it can be
    exported (an export holds whole pages only)."""
    nbytes = math.prod(shape) * dtype.itemsize
    padded = torch.empty(-(-nbytes // _PAGE) * _PAGE + _PAGE, dtype=torch.uint8)
    start = -padded.data_ptr() % _PAGE
    return padded[start : start + nbytes].view(dtype).view(tuple(shape))


def find_exports(pieces: np.ndarray) -> tuple[tuple[ExportedMemory, ...], np.ndarray] | None:
    """Where each ``(address, nbytes)`` piece of an ``[n, 2]`` int64 array lies: the exports they
    touch, and per piece ``(index into those exports, offset in it)`` as an ``[n, 2]`` array; None
    unless every piece lies wholly in one export. Thread-safe."""
    with _exports_lock:
        exports = sorted(_exports, key=lambda export: export.address)
    if not exports or not len(pieces):
        return None
    starts = np.array([export.address for export in exports], dtype=np.int64)
    ends = starts + np.array([export.nbytes for export in exports], dtype=np.int64)
    index = np.searchsorted(starts, pieces[:, 0], side="right") - 1  # the last export starting at or before
    if index.min() < 0 or np.any(pieces[:, 0] + pieces[:, 1] > ends[index]) or pieces[:, 1].min() < 0:
        return None
    used, local = np.unique(index, return_inverse=True)
    return tuple(exports[i] for i in used), np.stack([local, pieces[:, 0] - starts[index]], axis=1)


def _add_seals(fd: int, seals: int) -> None:
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)


_write_seal_refusal: str | None = None  # None: not asked yet; "": the kernel seals; else why it cannot


def _check_write_seal() -> None:
    """KVConfigError unless the kernel can seal a memfd against future writes. Asked once, on a
    scratch memfd (the seal would forbid the exporter's own writable mapping), before anything is
    moved: an export that others could write is never made. Call it under ``_exports_lock``."""
    global _write_seal_refusal
    if _write_seal_refusal is None:
        try:
            fd = os.memfd_create(_EXPORT_NAME + "-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                _add_seals(fd, REQUIRED_SEALS)
            finally:
                os.close(fd)
            _write_seal_refusal = ""
        except OSError as exc:
            _write_seal_refusal = (
                "the kernel lacks it (Linux 5.1 or later has it)" if exc.errno == errno.EINVAL else str(exc)
            )
    if _write_seal_refusal:
        raise KVConfigError(
            f"host memory is not exported: it could not be sealed against writes by other processes "
            f"(F_SEAL_FUTURE_WRITE): {_write_seal_refusal}"
        )


def _move_into_shared_memory(address: int, nbytes: int, storage: torch.UntypedStorage) -> ExportedMemory:
    fd, mapped = _sealed_memfd(nbytes)
    # Nobody else can write the file now: the storage's bytes go in through the exporter's own
    # mapping, which then replaces the storage's pages (a moved mapping keeps writing: the seal
    # forbids only new writable ones).
    ctypes.memmove(mapped, address, nbytes)
    moved = _libc.mremap(mapped, nbytes, nbytes, _MREMAP_MAYMOVE | _MREMAP_FIXED, address)
    if moved != address:
        error = ctypes.get_errno()
        _libc.munmap(mapped, nbytes)
        os.close(fd)
        raise KVConfigError(f"cannot move {nbytes} bytes into shared memory: {os.strerror(error)}")
    # The descriptor stays open for the life of the process: peers map the export through it.
    return ExportedMemory(address, nbytes, ExportDescriptor(fd, os.fstat(fd).st_ino, nbytes), storage)


def _sealed_memfd(nbytes: int) -> tuple[int, int]:
    """A new memfd of ``nbytes`` carrying every seal, and the address of this process's writable
    mapping of it, made before the seals: the only one there will ever be. Until the seals, the
    process is not dumpable, so that nobody without CAP_SYS_PTRACE opens the file through
    /proc/PID/fd (and maps it writable, a mapping the seal would not undo)."""
    hidden = _libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 1  # else /proc/PID/fd is closed to others already
    if hidden and _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0):
        raise KVConfigError(
            f"host memory is not exported: the process cannot hide its descriptors while the "
            f"export is made: {os.strerror(ctypes.get_errno())}"
        )
    fd = mapped = None
    try:
        fd = os.memfd_create(_EXPORT_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, nbytes)
        _add_seals(fd, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)  # no page can be taken from under a mapping
        mapped = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if mapped in (None, _MAP_FAILED):
            mapped = None
            raise OSError(ctypes.get_errno(), "mmap of the shared memory failed")
        try:
            _add_seals(fd, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except OSError as exc:
            raise KVConfigError(
                f"host memory is not exported: it could not be sealed against writes by other "
                f"processes (F_SEAL_FUTURE_WRITE): {exc}"
            ) from exc
        return fd, mapped
    except BaseException as exc:
        if mapped is not None:
            _libc.munmap(mapped, nbytes)
        if fd is not None:
            os.close(fd)
        if isinstance(exc, OSError):
            raise KVConfigError(f"cannot move {nbytes} bytes into shared memory: {exc}") from exc
        raise
    finally:
        if hidden:
            _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)


def stat_peer_memfd(path: str, name: str) -> os.stat_result | None:
    """The status of ``path`` (a peer's ``/proc/PID/fd/FD``) if it is a regular memfd named ``name``,
    else None; OSError if it cannot be read. Only such a file is ever opened or mapped, never another
    file (or a FIFO, whose open would block) the peer has open under that number."""
    status = os.stat(path)
    if not os.readlink(path).startswith(f"/memfd:{name}") or not stat.S_ISREG(status.st_mode):
        return None
    return status


class PeerMemory:
    """A peer's export, mapped read-only here. Thread-safe; unmapped once this object has died."""

    def __init__(self, address: int, nbytes: int, descriptor: ExportDescriptor) -> None:
        self.address = address
        self.nbytes = nbytes
        self.descriptor = descriptor
        weakref.finalize(self, _libc.munmap, address, nbytes).atexit = False

    @classmethod
    def open(cls, pid: int, descriptor: ExportDescriptor) -> PeerMemory:
        """Map export ``descriptor`` of process ``pid``.

        Raises:
            KVProtocolError: the descriptor does not name a sealed kvbridge export of that inode and
                size in that process (or the process is gone).
        """
        path = f"/proc/{pid}/fd/{descriptor.fd}"
        try:
            if stat_peer_memfd(path, _EXPORT_NAME) is None:
                raise KVProtocolError(f"{path} is not a kvbridge export")
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise KVProtocolError(f"cannot open the peer's export {path}: {exc}") from exc
        try:
            opened = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if (
                (opened.st_ino, opened.st_size) != (descriptor.inode, descriptor.nbytes)
                or seals & REQUIRED_SEALS != REQUIRED_SEALS
                or descriptor.nbytes <= 0
            ):
                raise KVProtocolError(f"{path} is not the announced export of {descriptor.nbytes} bytes, sealed")
            address = _libc.mmap(None, descriptor.nbytes, mmap.PROT_READ, mmap.MAP_SHARED | mmap.MAP_POPULATE, fd, 0)
            if address in (None, _MAP_FAILED):
                raise KVProtocolError(f"cannot map {path}: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)
        return cls(address, descriptor.nbytes, descriptor)

    def address_of(self, offset: int, nbytes: int) -> int:
        """The local address of ``nbytes`` at ``offset``; KVProtocolError if they leave the export."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise KVProtocolError(f"{nbytes} bytes at offset {offset} leave the peer's export of {self.nbytes} bytes")
        return self.address + offset
