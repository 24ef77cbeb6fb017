"""ZeroMQ plumbing of the control channel: its address, hardened sockets, a pollable doorbell, and the
endpoint each side's control thread owns.

Port: the producer binds ``tcp://{kv_ip}:{kv_port + port_offset + 1}`` (the pipe of the same
``port_offset`` uses ``kv_port + port_offset``), on that address only.
"""

from __future__ import annotations

import ipaddress
import os
import threading
from collections.abc import Iterator

import zmq

from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVConfigError

#: Messages ZeroMQ queues per peer before dropping (ROUTER) or refusing (DEALER): bounds the memory
#: a flood can take together with ZMQ_MAXMSGSIZE.
HIGH_WATER_MARK = 256


def control_address(config: KVTransferConfig, port_offset: int) -> str:
    port = config.kv_port + port_offset + 1
    if not 1 <= port <= 65535:
        raise KVConfigError(f"control port kv_port + port_offset + 1 = {port} is not a valid port")
    return f"tcp://{control_host(config.kv_ip)}:{port}"


def control_host(host: str) -> str:
    """``host`` as it goes into a ZeroMQ tcp address (an IPv6 address in brackets)."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    except ValueError:
        pass  # a host name
    return host


def open_socket(
    context: zmq.Context, kind: int, address: str, max_message_bytes: int, bind: bool, monitored: bool = False
) -> zmq.Socket:
    """A socket bound (producer) or connected (consumer) to ``address``, with memory bounds set.
    ``monitored``: its events go to ``sock.get_monitor_socket()`` from before it binds or connects.

    Raises:
        KVConfigError: the address cannot be bound (not local, or in use).
    """
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
    sock.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
    sock.setsockopt(zmq.IPV6, int(address.startswith("tcp://[")))
    if monitored:
        sock.get_monitor_socket()
    try:
        if bind:
            sock.bind(address)
        else:
            sock.connect(address)
    except zmq.ZMQError as exc:
        if monitored:
            close_monitor(sock)
        sock.close(linger=0)
        verb = "bind" if bind else "connect"
        raise KVConfigError(
            f"lookup buffer: cannot {verb} the control channel at {address} ({exc}); kv_ip must be an "
            f"address of the producer's host and kv_port + port_offset + 1 must be free"
        ) from exc
    return sock


def close_monitor(sock: zmq.Socket) -> None:
    """Stop monitoring ``sock`` and close its monitor socket (else its context's term() would wait
    for it forever)."""
    monitor = sock.get_monitor_socket()
    sock.disable_monitor()
    monitor.close(linger=0)


class Doorbell:
    """A file descriptor that zmq.Poller can watch, rung from any thread.

    ``ring`` makes it readable; ``clear`` makes it unreadable again. Never clearing it makes a
    level-triggered "this happened" flag that wakes every poller, now and later. Ringing a closed
    doorbell does nothing (its descriptor number may already belong to someone else).
    """

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        return self._read_fd

    def ring(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write_fd, b"\0")
            except BlockingIOError:
                pass  # the pipe is full, so it is readable already

    def clear(self) -> None:
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._read_fd)
                os.close(self._write_fd)


class Endpoint:
    """A control thread's end of the channel: one socket in a ZeroMQ context of its own, and a doorbell
    other threads ring to wake the control thread's :meth:`wait`.

    Any thread may :meth:`send`; only the owning thread waits and receives. ZeroMQ sockets are not
    thread-safe, so the socket is touched only under a lock, and the owner sleeps on the socket's
    notification descriptor (``ZMQ_FD``) instead of polling the socket itself: a sender never meets a
    poll in progress, and a select goes out from its caller's thread without waking anyone.
    :meth:`close` once the owning thread has stopped.

    Raises:
        KVConfigError: the address cannot be bound (see :func:`open_socket`).
    """

    def __init__(self, kind: int, address: str, max_message_bytes: int, bind: bool) -> None:
        self.doorbell = Doorbell()
        self._context = zmq.Context(io_threads=1)
        try:
            self._socket = open_socket(self._context, kind, address, max_message_bytes, bind)
        except BaseException:
            self._context.term()
            self.doorbell.close()
            raise
        self._socket_lock = threading.Lock()
        #: The address bound or connected, with the port the kernel chose for a ``*`` port.
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT) if bind else address
        self._poller = zmq.Poller()
        self._poller.register(self._socket.getsockopt(zmq.FD), zmq.POLLIN)
        self._poller.register(self.doorbell.fileno(), zmq.POLLIN)

    def wait(self, timeout_ms: int) -> None:
        """Sleep until a message may have arrived or the doorbell rings, at most ``timeout_ms``.
        Clears the doorbell before the caller looks at what rang it, so that a later ring wakes the
        next wait. The caller then takes every message waiting (:meth:`received`, :meth:`routed`)."""
        # ZMQ_FD is readable while the socket has unprocessed events, not while a message waits: a
        # message already taken in makes it unreadable, hence the look at ZMQ_EVENTS first.
        with self._socket_lock:
            waiting = self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN
        if not waiting:
            self._poller.poll(timeout_ms)
        self.doorbell.clear()

    def send(self, frames: list[bytes]) -> None:
        """Send a message without blocking. Any thread.

        Raises:
            zmq.Again: the message cannot be queued (the high-water mark, or no peer to route it to).
            zmq.ZMQError: another failure of the socket.
        """
        with self._socket_lock:
            if self._socket.closed:
                raise zmq.ZMQError(zmq.ENOTSOCK, "the control channel is closed")
            self._socket.send_multipart(frames, zmq.NOBLOCK)
            # Sending may take in an arriving message and leave ZMQ_FD unreadable: wake the owner.
            waiting = self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN
        if waiting:
            self.doorbell.ring()

    def received(self, limit: int) -> Iterator[list[bytes]]:
        """Up to ``limit`` messages already waiting, without blocking, each as its frames."""
        for _ in range(limit):
            try:
                with self._socket_lock:
                    frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            yield frames

    def routed(self, limit: int) -> Iterator[tuple[bytes, list[bytes]]]:
        """Up to ``limit`` messages already waiting on this ROUTER socket, without blocking: each as
        the sender's identity and the frames that follow it."""
        for identity, *frames in self.received(limit):
            yield identity, frames

    def close(self) -> None:
        with self._socket_lock:
            self._socket.close(linger=0)
        self._context.term()
        self.doorbell.close()
