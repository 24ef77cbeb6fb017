"""The consumer's end of a connection to a producer's :class:`lookup_buffer.BufferListener`."""

from __future__ import annotations

import collections
import logging
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from kv_pipe import TorchDistributedPipe, auth
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVConfigError, KVPeerLostError, KVProtocolError, KVTransferError
from lookup_buffer.control import close_monitor, control_host, open_socket
from lookup_buffer.listener import OnConnect, PipeFactory
from lookup_buffer.protocol import (
    MAX_REFUSAL_BYTES,
    ConnectReply,
    ControlSigner,
    decode_connect_answer,
    encode_connect_request,
)
from lookup_buffer.simple_buffer import SimpleBuffer

logger = logging.getLogger(__name__)


def dial(
    config: KVTransferConfig,
    host: str,
    port: int,
    on_connect: OnConnect | None = None,
    timeout: float | None = None,
    pipe_factory: PipeFactory = TorchDistributedPipe,
) -> SimpleBuffer:
    """Connect to the producer listening at ``host:port`` and return this consumer's buffer
    (``drop_select`` from it; closing it ends the connection, the producer's entries stay).

    ``config`` gives the consumer's settings (``kv_buffer_size``, ``kv_timeout``, ``kv_secret``,
    ``kv_shared_memory``); its ``kv_ip``, ``kv_port``, ``kv_rank`` and ``kv_role`` are replaced.
    ``on_connect`` runs on the new pipe before the buffer starts (raising refuses the producer).
    Blocks at most about twice ``timeout`` (default ``kv_timeout``): once for the producer's
    answer, once for the pipe.

    Raises:
        KVPeerLostError: no producer answered at ``host:port`` in time, or it vanished while the
            connection was set up, or it is busy.
        KVProtocolError: the producer refused (another protocol version or ``kv_secret``) or
            answered something invalid.
        KVConfigError: the producer refused this consumer's ``kv_buffer_size`` (smaller than its own).
    """
    timeout = config.kv_timeout if timeout is None else timeout
    reply = _ask_for_connection(config, host, port, timeout)
    consumer = config.replace(
        kv_role="kv_consumer", kv_rank=1, kv_ip=host, kv_port=reply.store_port, kv_connect_timeout=timeout
    )
    pipe = pipe_factory(consumer)
    try:
        if on_connect is not None:
            on_connect(pipe)
        return SimpleBuffer(pipe, consumer, address=f"tcp://{control_host(host)}:{reply.control_port}")
    except BaseException:
        try:
            pipe.close()
        except KVTransferError as exc:  # keep the original error, which says more
            logger.debug("lookup buffer: closing a connection that failed to start: %s", exc)
        raise


def _ask_for_connection(config: KVTransferConfig, host: str, port: int, timeout: float) -> ConnectReply:
    signer = ControlSigner(config.kv_secret)
    nonce = auth.new_nonce()
    address = f"tcp://{control_host(host)}:{port}"
    context = zmq.Context(io_threads=1)
    try:
        sock = open_socket(context, zmq.DEALER, address, MAX_REFUSAL_BYTES, bind=False, monitored=True)
        started = time.monotonic()
        try:
            sock.send(encode_connect_request(signer, nonce, config.kv_buffer_size), zmq.NOBLOCK)
            events = _Events(sock.get_monitor_socket(), started)
            if not events.wait_for_answer(sock, timeout):
                raise KVPeerLostError(
                    f"lookup buffer: no producer answered at {address} within {timeout:g} s "
                    f"({events.likely_cause()}); this side's connection: {events}"
                )
            answer = decode_connect_answer(signer, sock.recv(zmq.NOBLOCK))
        finally:
            close_monitor(sock)
            sock.close(linger=0)
    finally:
        context.term()
    if not isinstance(answer, ConnectReply):
        errors = {"busy": KVPeerLostError, "failed": KVPeerLostError, "config": KVConfigError}
        error = errors.get(answer.reason, KVProtocolError)
        raise error(
            f"lookup buffer: the producer at {address} refused the connection ({answer.reason}): {answer.message}"
        )
    if answer.nonce != nonce:
        raise KVProtocolError(f"lookup buffer: the producer at {address} answered another connect request")
    return answer


#: The socket events a failed dial reports (a diagnostic of "no producer answered").
_EVENTS = {
    zmq.EVENT_CONNECTED: "connected",
    zmq.EVENT_CONNECT_DELAYED: "connect in progress",
    zmq.EVENT_CONNECT_RETRIED: "connect retried",
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "handshake done",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (protocol)",
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_CLOSED: "closed",
}


class _Events:
    """A failed dial's diagnostic: what its TCP connection did (its socket monitor's events), each
    event's count and when it first came after the request was queued."""

    def __init__(self, monitor: zmq.Socket, started: float) -> None:
        self._monitor = monitor
        self._started = started
        self._counts: collections.Counter[str] = collections.Counter()
        self._first: dict[str, float] = {}

    def wait_for_answer(self, sock: zmq.Socket, timeout: float) -> bool:
        """Wait at most ``timeout`` for ``sock`` to have an answer, noting the events meanwhile."""
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            ready = dict(poller.poll(max(0, round(left * 1000))))
            if self._monitor in ready:
                self._take()
            if sock in ready:
                return True
            if left <= 0:
                self._take()
                return False

    def _take(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            name = _EVENTS.get(event["event"], f"event {event['event']}")
            self._counts[name] += 1
            self._first.setdefault(name, time.monotonic() - self._started)

    def likely_cause(self) -> str:
        """What the events say about the other side, for the error's reader."""
        if self._counts["handshake done"]:
            return (
                "a ZeroMQ peer took the connection but never answered the request: a producer whose control "
                "thread is stuck or overloaded, or not a producer"
            )
        if self._counts["connected"]:
            # A listener's greeting is sent by its process's ZeroMQ I/O thread: no greeting within the
            # timeout means that process did not run, or the port is not a ZeroMQ listener's.
            return (
                "a process holds the port but never sent ZeroMQ's greeting: not a producer, or a producer "
                "stopped or given no CPU (instances sharing cores in separate sessions or cgroups, see "
                "docs/failure-behaviour.md)"
            )
        return "nothing accepted the connection: not started, restarting, or not listening there"

    def __str__(self) -> str:
        if not self._counts:
            return "no socket event at all (its I/O thread never started a connect)"
        return ", ".join(
            f"{name} {count}x (first at +{self._first[name]:.3f} s)" for name, count in self._counts.items()
        )
