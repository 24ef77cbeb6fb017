"""Pipelined ``GET`` of large values from one Redis server (over TCP or a Unix socket), each value
received straight into a buffer of its announced length, and handed to the caller as soon as it is
complete (``each``): the caller checks and copies one value while the next is still arriving.

redis-py's own parser (without hiredis) receives a bulk reply in pieces, joins them and slices the
result, copying a value of tens of MiB several times in Python; hiredis still copies it from its
buffer into a new ``bytes``. Here the socket writes each value once, with ``recv_into``, into the
memory that is returned (as a read-only ``memoryview``): the least any client can do. The memory is
a NumPy array, not a ``bytearray``: it is not zeroed first, and NumPy asks for huge pages for large
arrays, so the kernel maps a value of tens of MiB with far fewer page faults (a ``bytearray`` made
these reads about half again as slow). Only replies to ``GET`` are parsed (RESP2
bulk strings, the nil bulk string, and error replies, which are raised).

Every receive waits at most the connection's timeout. A connection is used by one call at a time and
closed after any error (its stream is then at an unknown point): a server that closed the connection
or does not answer raises :class:`ConnectionError` / :class:`TimeoutError` (the caller marks the
server down), a value longer than the caller's bound, an error reply, or anything that is not a reply
to ``GET`` raises :class:`KVStoreError` naming it.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable, Sequence

import numpy

from kv_store.base import KVStoreError

#: Bytes of reply header (and of small values) received at once.
_HEADER_BYTES = 1 << 16
#: The longest header or error line accepted; Redis's are far shorter.
_MAX_LINE = 4096


def _command(*parts: bytes) -> bytes:
    """One command in RESP: an array of bulk strings."""
    return b"".join([b"*%d\r\n" % len(parts), *(b"$%d\r\n%s\r\n" % (len(part), part) for part in parts)])


class _Connection:
    """One socket to the server, authenticated and on its database."""

    def __init__(self, sock: socket.socket, where: str) -> None:
        self.sock = sock
        self.where = where
        self._buffer = bytearray(_HEADER_BYTES)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0  # the received bytes not parsed yet

    def close(self) -> None:
        self.sock.close()

    def stale(self) -> bool:
        """Whether an idle connection has something to read: the server closed it (a restart, its
        ``timeout``) or sent what nobody asked for. Either way it cannot carry a request."""
        poller = select.poll()  # not select(): a process may have more than 1024 descriptors
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(0))

    def _receive(self, into: memoryview) -> int:
        count = self.sock.recv_into(into)
        if not count:
            raise ConnectionError(f"redis at {self.where} closed the connection in the middle of a reply")
        return count

    def _fill(self) -> None:
        """Receive more header bytes after the unparsed ones."""
        if self._start:
            left = self._end - self._start
            self._buffer[:left] = self._view[self._start : self._end]
            self._start, self._end = 0, left
        self._end += self._receive(self._view[self._end :])

    def _line(self) -> bytes:
        while (stop := self._buffer.find(b"\r\n", self._start, self._end)) < 0:
            if self._end - self._start > _MAX_LINE:
                raise KVStoreError(f"redis at {self.where} sent a line of more than {_MAX_LINE} bytes without an end")
            self._fill()
        line = bytes(self._view[self._start : stop])
        self._start = stop + 2
        return line

    def _value(self, length: int) -> memoryview:
        """The next ``length`` bytes and the CRLF after them."""
        view = memoryview(numpy.empty(length, numpy.uint8))
        have = min(length, self._end - self._start)
        view[:have] = self._view[self._start : self._start + have]
        self._start += have
        while have < length:
            have += self._receive(view[have:])
        while self._end - self._start < 2:
            self._fill()
        if self._view[self._start : self._start + 2] != b"\r\n":
            raise KVStoreError(f"redis at {self.where} sent a value longer than it announced")
        self._start += 2
        return view.toreadonly()

    def simple(self, *parts: bytes) -> bytes:
        """Send the command ``parts`` and return its status reply (``+OK``: ``b"OK"``)."""
        self.sock.sendall(_command(*parts))
        line = self._line()
        if line.startswith(b"+"):
            return line[1:]
        raise KVStoreError(f"redis at {self.where} refused {parts[0].decode()}: {line.decode(errors='replace')}")

    def get_many(
        self, keys: Sequence[bytes], max_bytes: int, each: Callable[[int, memoryview], None] | None
    ) -> list[memoryview | None]:
        self.sock.sendall(b"".join(_command(b"GET", key) for key in keys))
        values: list[memoryview | None] = []
        for index in range(len(keys)):
            line = self._line()
            kind, rest = line[:1], line[1:]
            if kind == b"-":
                raise KVStoreError(
                    f"redis at {self.where} answered a GET with an error: {rest.decode(errors='replace')}"
                )
            if kind != b"$" or not (rest.isdigit() or rest == b"-1"):
                raise KVStoreError(f"redis at {self.where} sent {line[:80]!r} where a GET's reply belongs")
            length = int(rest)
            if length > max_bytes:
                raise KVStoreError(
                    f"redis at {self.where} announced a value of {length} bytes, more than the "
                    f"{max_bytes} bytes an object may have"
                )
            values.append(None if length < 0 else self._value(length))
            if each is not None and values[-1] is not None:
                each(index, values[-1])
        if self._start != self._end:
            raise KVStoreError(f"redis at {self.where} sent {self._end - self._start} bytes after the last reply")
        return values


class BulkReader:
    """Reads values from the Redis server at ``address`` (``(host, port)``, or the path of its Unix
    socket), database ``db``, on connections of its own kept between calls; thread-safe (a call takes
    an idle connection or opens one)."""

    def __init__(
        self, address: tuple[str, int] | str, db: int, username: str | None, password: str | None, timeout: float
    ) -> None:
        self.address, self.db = address, db
        self.where = address if isinstance(address, str) else f"{address[0]}:{address[1]}"
        self._username, self._password = username, password
        self.timeout = timeout
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def _dial(self) -> socket.socket:
        if not isinstance(self.address, str):
            sock = socket.create_connection(self.address, timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.address)
        except BaseException:
            sock.close()
            raise
        return sock

    def _open(self) -> _Connection:
        connection = _Connection(self._dial(), self.where)
        try:
            if self._password is not None:
                user = [self._username.encode()] if self._username else []
                connection.simple(b"AUTH", *user, self._password.encode())
            if self.db:
                connection.simple(b"SELECT", b"%d" % self.db)
        except BaseException:
            connection.close()
            raise
        return connection

    def get_many(
        self, keys: Sequence[bytes], max_bytes: int, each: Callable[[int, memoryview], None] | None = None
    ) -> list[memoryview | None]:
        """The value of each key, ``None`` where there is none. A value longer than ``max_bytes`` is
        refused (:class:`KVStoreError`), not received. ``each(index, value)`` is called with each value
        found as soon as it is complete, before the next is received (on this thread; what it raises
        ends the call, and closes the connection)."""
        with self._lock:
            if self._closed:
                raise KVStoreError(f"the reader of redis at {self.where} is closed")
            connection = self._idle.pop() if self._idle else None
        if connection is not None and connection.stale():
            connection.close()
            connection = None
        if connection is None:
            connection = self._open()
        try:
            values = connection.get_many(keys, max_bytes, each)
        except BaseException:
            connection.close()
            raise
        with self._lock:
            if not self._closed:
                self._idle.append(connection)
                return values
        connection.close()
        return values

    def close(self) -> None:
        """Close the idle connections now and the busy ones when their call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
