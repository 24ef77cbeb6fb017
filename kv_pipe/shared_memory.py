"""The same-host path: payloads through shared memory, frames over a local socket.

Two pipe ends on one host need not push their bytes through the kernel's TCP stack. Each side owns
an *outgoing segment*: an anonymous shared-memory file (``memfd_create``) that only it writes. A
payload is copied once into a free region of the sender's segment; its frame, still sent over the
transport, names the region (``place``), and the receiver's tensor is a view of that region, with no
second copy. When the receiver's last reference to the tensor dies, the region's offset goes back
to the sender with the next frame (in its first header, or a ``FREED`` record for several) and is
reused. Frames travel over a Unix stream socket between
the two processes (:class:`kv_pipe.channel.SocketChannel`) instead of the groups, with the same
records, credit, keepalives, ordering and checks, so the pipe's guarantees do not change.

Establishing it (:func:`establish`, collective, after the groups are connected and authenticated):

1. Each side creates its segment, writes a fresh random nonce at its start, and sends over its
   outgoing group what the peer needs to map it: the kernel's boot id, its network namespace, its
   pid, the file descriptor and the size.
2. A side whose peer reports the same boot id and network namespace opens ``/proc/PID/fd/FD``
   (only the same user can, and only while the owner keeps the descriptor open), checks that it is a
   regular file of the announced size, maps it, and sends back the nonce it read there. A different
   network namespace counts as another host: containers on one machine are kept apart on purpose.
3. Each side compares the echo with its nonce: only a peer that really mapped this segment can
   know it. Then both close their descriptors. The segments have no name anywhere: a SIGKILL of
   either side at any moment leaves nothing behind, and nobody else can open them any more.
4. Rank 0 listens on a random name in the abstract Unix namespace (it belongs to the network
   namespace and to no file system); rank 1 connects and sends the nonce it read in rank 0's
   segment, and each side checks that the process at the other end (``SO_PEERCRED``) is the peer.
   Rank 0 then closes the listener: nobody can connect to the name any more. Both sides agree on
   the outcome over the groups; without the socket there is no same-host path.

A peer can write into its own segment at any time, so it can change only bytes it was allowed to
send; everything that steers the receiver (offsets, sizes, dtypes) arrives in frames that are
validated before use.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import math
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from kv_pipe import auth
from kv_pipe.errors import KVProtocolError, KVTransferError
from kv_pipe.exported_memory import stat_peer_memfd
from kv_pipe.parallel_copy import copy_bytes
from kv_pipe.protocol import SHARED_DATA_START, SHARED_REGION_ALIGN
from kv_pipe.rendezvous import swap_bytes

logger = logging.getLogger(__name__)

#: The largest segment a pipe end creates (address space only: pages are touched as they are used).
MAX_SEGMENT_BYTES = 1 << 30
_SEGMENT_NAME = "kvbridge-pipe"
# States of a lent region: not sent yet; sent; sent and given back by the peer while the caller's
# tensor lives; sent and the caller's tensor died while the peer holds it.
_LENT_UNSENT, _LENT_SENT, _LENT_PEER_DONE, _LENT_CALLER_DONE = range(4)
_TAG = 8  # the tag of the exchange over the groups; frames and authentication use others
_DESCRIPTOR_WORDS = 8
_SOCKET_NAME_BYTES = 64
_SOCKET_SETUP_SECONDS = 10.0
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _boot_id() -> int:
    """This kernel's boot id, as a number: equal on both sides only on one host."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as file:
            return int.from_bytes(hashlib.blake2b(file.read().strip(), digest_size=7).digest(), "little")
    except OSError:
        return 0


def _net_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


class Segment:
    """An anonymous shared-memory file mapped into this process, as a uint8 numpy array.

    The mapping holds no descriptor (Python's ``mmap`` would keep a duplicate open, through which
    the segment could be opened again): it is made by torch's file mapping, which closes its
    descriptor once mapped, and is unmapped when the last array or tensor over it has died.
    """

    def __init__(self, path: str, nbytes: int) -> None:
        self.nbytes = nbytes
        mapped = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self.array = mapped.numpy()  # keeps ``mapped``, and so the mapping, alive
        self.address = mapped.data_ptr()

    @classmethod
    def create(cls, nbytes: int) -> tuple[Segment, int]:
        """A new segment of ``nbytes`` and its open descriptor (the caller closes it)."""
        fd = os.memfd_create(_SEGMENT_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            return cls(f"/proc/self/fd/{fd}", nbytes), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open_peer(cls, pid: int, fd: int, nbytes: int) -> Segment:
        """Map the peer's segment through ``/proc``; raise OSError if it is not what was announced."""
        path = f"/proc/{pid}/fd/{fd}"
        status = stat_peer_memfd(path, _SEGMENT_NAME)
        if status is None or status.st_size != nbytes:
            raise OSError(f"{path} is not a kvbridge shared-memory segment of {nbytes} bytes")
        try:
            return cls(path, nbytes)
        except RuntimeError as exc:  # torch reports a failed open or mmap so
            raise OSError(f"cannot map {path}: {exc}") from exc


class RegionAllocator:
    """First-fit allocation of aligned regions of a segment. Thread-safe."""

    def __init__(self, start: int, end: int) -> None:
        self._free: list[tuple[int, int]] = [(start, end)]  # sorted, disjoint [start, end) runs
        self._used: dict[int, int] = {}  # start -> end of every region handed out
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> int | None:
        """The start of a free region of at least ``nbytes``, or None if none is free."""
        size = -(-nbytes // SHARED_REGION_ALIGN) * SHARED_REGION_ALIGN
        with self._lock:
            for index, (start, end) in enumerate(self._free):
                if end - start >= size:
                    if end - start == size:
                        del self._free[index]
                    else:
                        self._free[index] = (start + size, end)
                    self._used[start] = start + size
                    return start
        return None

    def release(self, start: int) -> None:
        """Give a region back; KVProtocolError if ``start`` is not a region handed out."""
        with self._lock:
            end = self._used.pop(start, None)
            if end is None:
                raise KVProtocolError(f"peer freed shared-memory offset {start}, which this side never gave it")
            index = 0
            while index < len(self._free) and self._free[index][0] < start:
                index += 1
            self._free.insert(index, (start, end))
            # Merge with the neighbours so that large regions stay available.
            if index + 1 < len(self._free) and self._free[index][1] == self._free[index + 1][0]:
                self._free[index] = (start, self._free.pop(index + 1)[1])
            if index > 0 and self._free[index - 1][1] == self._free[index][0]:
                self._free[index - 1] = (self._free[index - 1][0], self._free.pop(index)[1])

    def largest_free(self) -> int:
        """The size of the largest free region."""
        with self._lock:
            return max((end - start for start, end in self._free), default=0)

    def region_bytes(self, start: int) -> int:
        """The size of the region handed out at ``start`` (0 if none was)."""
        with self._lock:
            return self._used.get(start, start) - start

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(end - start for start, end in self._used.items())


class SharedMemoryLink:
    """One pipe end's view of both segments: its own (written) and the peer's (read through views).

    A region of this side's segment is either *placed*: filled by a copy when its payload is sent,
    and free again once the peer gives it back; or *lent*: handed to the caller as a tensor to fill
    (:meth:`lend`), sent without a copy, and free again once the peer has given it back AND the
    caller's tensor has died, so that neither side ever sees the region reused under its tensor.
    """

    def __init__(self, own: Segment, peer: Segment, connection: socket.socket, peer_pid: int) -> None:
        self.own = own
        self.peer = peer
        self.connection = connection  # the local socket that carries frames (kv_pipe.channel)
        self.peer_pid = peer_pid  # checked over the local socket (SO_PEERCRED)
        self.allocator = RegionAllocator(SHARED_DATA_START, own.nbytes)
        self._lent: dict[int, int] = {}  # place of a lent region -> its _LENT_* state
        # Finalizers only append here (atomic): they may run inside any critical section, even this
        # class's own, so they take no lock; the regions are settled at the next call.
        self._died: collections.deque[int] = collections.deque()
        self._lock = threading.Lock()

    @property
    def peer_bytes(self) -> int:
        """Size of the peer's segment as mapped here (0: none): bounds every place a frame names."""
        return self.peer.nbytes

    def place(self, nbytes: int) -> int:
        """Where a payload of ``nbytes`` goes in this side's segment, or 0 if no region is free (it
        then follows its frame over the socket)."""
        self._settle_deaths()
        return self.allocator.allocate(nbytes) or 0

    def write(self, place: int, flat: torch.Tensor) -> None:
        """Copy a contiguous host payload into this side's segment at ``place``."""
        copy_bytes(self.own.address + place, flat.data_ptr(), flat.numel())

    def lend(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor over a free region of this side's segment, or None if none is free."""
        nbytes = math.prod(shape) * dtype.itemsize
        place = self.place(nbytes)
        if not place:
            return None
        region = self.own.array[place : place + nbytes]
        with self._lock:
            self._lent[place] = _LENT_UNSENT
        weakref.finalize(region, self._died.append, place).atexit = False
        return torch.from_numpy(region).view(dtype).reshape(shape)

    def room_for(self, tensors: list[torch.Tensor]) -> bool:
        """Whether these payloads can all go through this side's segment now (lent ones already lie
        there); other threads may take the room meanwhile."""
        self._settle_deaths()
        with self._lock:
            needed = sum(
                -(-tensor.nbytes // SHARED_REGION_ALIGN) * SHARED_REGION_ALIGN
                for tensor in tensors
                if self._lent.get(tensor.data_ptr() - self.own.address) != _LENT_UNSENT
            )
        return needed <= self.allocator.largest_free()

    def take_lent(self, data: torch.Tensor) -> int:
        """The place of ``data`` if it is exactly a lent region not sent yet (now marked sent), else 0."""
        place = data.data_ptr() - self.own.address
        self._settle_deaths()
        with self._lock:
            if self._lent.get(place) != _LENT_UNSENT or data.nbytes > self.allocator.region_bytes(place):
                return 0
            self._lent[place] = _LENT_SENT
        return place

    def release(self, places: list[int]) -> None:
        """The peer gave these regions back; KVProtocolError for one it never had."""
        self._settle_deaths()
        for place in places:
            with self._lock:
                state = self._lent.get(place)
                if state == _LENT_UNSENT or state == _LENT_PEER_DONE:
                    raise KVProtocolError(f"peer freed shared-memory offset {place}, which it does not hold")
                if state == _LENT_SENT:
                    self._lent[place] = _LENT_PEER_DONE  # free once the caller's tensor dies too
                    continue
                if state == _LENT_CALLER_DONE:
                    del self._lent[place]
            self.allocator.release(place)

    @property
    def used_bytes(self) -> int:
        """Bytes of this side's segment in use: placed or lent, and not given back yet."""
        self._settle_deaths()
        return self.allocator.used_bytes

    def _settle_deaths(self) -> None:
        """Free, or mark, the lent regions whose local tensors have died since the last call."""
        while self._died:
            place = self._died.popleft()
            with self._lock:
                if self._lent[place] == _LENT_SENT:
                    self._lent[place] = _LENT_CALLER_DONE  # free once the peer gives it back too
                    continue
                del self._lent[place]
            self.allocator.release(place)

    def view(
        self, place: int, dtype: torch.dtype, shape: tuple[int, ...], on_free: Callable[[int], None]
    ) -> torch.Tensor:
        """A tensor over the peer's segment at ``place``; ``on_free(place)`` runs once it has died."""
        nbytes = math.prod(shape) * dtype.itemsize
        region = self.peer.array[place : place + nbytes]
        # torch.from_numpy keeps ``region`` alive exactly as long as the tensor's storage, so the
        # finalizer runs when the last tensor, view or array over it has gone.
        weakref.finalize(region, on_free, place).atexit = False  # nobody to tell at exit
        return torch.from_numpy(region).view(dtype).reshape(shape)


def establish(
    outgoing: dist.ProcessGroup, incoming: dist.ProcessGroup, rank: int, mode: str, budget: int, device: torch.device
) -> SharedMemoryLink | None:
    """Set up the same-host path with the peer, over the connected groups (both sides call this).

    Returns None when the path is off or not possible (another host, a CUDA pipe, no /proc access);
    ``mode="on"`` turns that into a :class:`KVTransferError`. Transport errors propagate as
    RuntimeError, like any other operation on the groups.
    """
    peer = 1 - rank
    own = nonce = fd = None
    wanted = mode != "off" and device.type == "cpu"
    if wanted:
        try:
            own, fd = Segment.create(min(budget + SHARED_DATA_START, MAX_SEGMENT_BYTES))
            nonce = auth.new_nonce()
            own.array[: len(nonce)] = np.frombuffer(nonce, dtype=np.uint8)
        except OSError as exc:
            logger.info("pipe rank %d: no shared-memory segment (%s): payloads go over the transport", rank, exc)
            own = None
    try:
        mine = np.zeros(_DESCRIPTOR_WORDS, dtype=np.int64)
        mine[:6] = (
            1 if own else 0,
            _boot_id(),
            _net_namespace(),
            os.getpid(),
            fd if own else -1,
            own.nbytes if own else 0,
        )
        theirs = np.frombuffer(swap_bytes(outgoing, incoming, peer, mine.tobytes(), device, _TAG), dtype=np.int64)
        offered, boot_id, namespace, pid, peer_fd, peer_nbytes = (int(word) for word in theirs[:6])
        peer_segment, echo = None, bytes(auth.NONCE_BYTES)
        if (
            wanted
            and offered
            and (boot_id, namespace) == (_boot_id(), _net_namespace())
            and SHARED_DATA_START < peer_nbytes <= MAX_SEGMENT_BYTES
        ):
            try:
                peer_segment = Segment.open_peer(pid, peer_fd, peer_nbytes)
                echo = peer_segment.array[: auth.NONCE_BYTES].tobytes()
            except OSError as exc:
                logger.info("pipe rank %d: cannot map the peer's segment (%s)", rank, exc)
        peer_echo = swap_bytes(outgoing, incoming, peer, echo, device, _TAG)
    finally:
        if fd is not None:
            os.close(fd)  # mapped on both sides by now, or never going to be
    sends_shared = own is not None and hmac.compare_digest(peer_echo, nonce)
    both_ways = sends_shared and peer_segment is not None
    connection = _connect_socket(outgoing, incoming, rank, pid, nonce, echo, device) if both_ways else None
    if mode == "on" and connection is None:
        raise KVTransferError(
            f"pipe rank {rank}: kv_shared_memory='on' but the same-host path could not be set up "
            f"(the peer is on another host or network namespace, or /proc/PID/fd is not accessible)"
        )
    if connection is None:
        return None
    return SharedMemoryLink(own, peer_segment, connection, pid)


def _connect_socket(
    outgoing: dist.ProcessGroup,
    incoming: dist.ProcessGroup,
    rank: int,
    peer_pid: int,
    nonce: bytes,
    echo: bytes,
    device: torch.device,
) -> socket.socket | None:
    """The local socket between the two processes, or None (on both sides) if it cannot be made.

    Rank 0 listens on a random name in the abstract Unix namespace, which belongs to the network
    namespace both sides share and leaves nothing in any file system. Rank 1 connects and proves
    itself with the nonce it read in rank 0's segment; rank 0 also checks the connecting process id
    against the peer's, and so does rank 1. Strangers are turned away; whatever happens, both sides
    agree on the outcome over the groups.
    """
    peer = 1 - rank
    sock = listener = None
    name = b""
    try:
        if rank == 0:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            name = b"\0kvbridge-" + secrets.token_hex(16).encode()
            listener.bind(name)
            listener.listen(4)
    except OSError as exc:
        logger.info("pipe rank %d: no local socket (%s)", rank, exc)
        listener = None
    theirs = swap_bytes(
        outgoing, incoming, peer, name.ljust(_SOCKET_NAME_BYTES, b"\0")[:_SOCKET_NAME_BYTES], device, _TAG
    )
    try:
        if rank == 0 and listener is not None:
            sock = _accept_peer(listener, peer_pid, nonce)
        elif rank == 1 and theirs.rstrip(b"\0"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            sock.settimeout(_SOCKET_SETUP_SECONDS)
            sock.connect(b"\0" + theirs[1:].rstrip(b"\0"))
            if _peer_pid(sock) != peer_pid:
                raise OSError("the local socket leads to another process than the peer")
            sock.sendall(echo)
    except OSError as exc:
        logger.info("pipe rank %d: no local socket (%s)", rank, exc)
        if sock is not None:
            sock.close()
        sock = None
    finally:
        if listener is not None:
            listener.close()
    agreed = swap_bytes(outgoing, incoming, peer, b"\1" if sock is not None else b"\0", device, _TAG)
    if sock is not None and agreed != b"\1":
        sock.close()
        sock = None
    return sock


def _accept_peer(listener: socket.socket, peer_pid: int, nonce: bytes) -> socket.socket:
    """Accept the peer's connection, turning away any other process; OSError past the deadline."""
    deadline = time.monotonic() + _SOCKET_SETUP_SECONDS
    while True:
        listener.settimeout(max(0.0, deadline - time.monotonic()))
        sock, _ = listener.accept()
        try:
            sock.settimeout(max(0.0, deadline - time.monotonic()))
            proof = bytearray()
            while len(proof) < len(nonce):
                chunk = sock.recv(len(nonce) - len(proof))
                if not chunk:
                    break
                proof += chunk
            if _peer_pid(sock) == peer_pid and hmac.compare_digest(bytes(proof), nonce):
                return sock
        except OSError:
            pass
        logger.warning("pipe rank 0: turned away a process that is not the peer from the local socket")
        sock.close()


def _peer_pid(sock: socket.socket) -> int:
    pid, _, _ = _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
    return pid
