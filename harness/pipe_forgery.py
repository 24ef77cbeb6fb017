"""A hostile pipe peer: it runs the real rendezvous, then sends hand-made frames on the pipe's channel
(its groups, or the local socket of the same-host path)."""

from __future__ import annotations

import torch

from kv_pipe import KVTransferConfig, rendezvous, shared_memory
from kv_pipe.channel import TAG_FRAME, Channel, GroupChannel, SocketChannel
from kv_pipe.protocol import HEADER_BYTES, HOST_FRAME_BYTES, Hello


def connect_as_forger(config: KVTransferConfig, port_offset: int = 0) -> rendezvous.Connection:
    """The connection a real host pipe with ``config`` would have, shared-memory segments and local
    socket included (the peer maps the forger's segment), with no pipe threads behind it; its
    ``channel`` carries frames as the pipe's would."""
    hello = Hello(
        frame_bytes=HOST_FRAME_BYTES,
        max_in_flight=config.kv_buffer_size,
        device="cpu",
        timeout_ms=round(config.kv_timeout * 1000),
    )
    device = torch.device("cpu")
    connection = rendezvous.connect(config, config.kv_port + port_offset, hello, device)
    connection.shared = shared_memory.establish(
        connection.outgoing, connection.incoming, config.kv_rank, config.kv_shared_memory, config.kv_buffer_size, device
    )
    connection.channel = (
        SocketChannel(connection.shared.connection, silence=config.kv_timeout)
        if connection.shared is not None
        else GroupChannel(connection.outgoing, connection.incoming, 1 - config.kv_rank)
    )
    return connection


def send_records(connection: rendezvous.Connection, records: dict[int, list[int]]) -> None:
    """Send one frame holding header ``words`` at each byte offset of ``records``."""
    frame = torch.zeros(HOST_FRAME_BYTES, dtype=torch.uint8)
    for start, words in records.items():
        frame[start : start + HEADER_BYTES] = torch.tensor(words, dtype=torch.int64).view(torch.uint8)
    channel: Channel = connection.channel
    channel.send(frame, TAG_FRAME)


def drain_until_dropped(connection: rendezvous.Connection) -> BaseException:
    """Receive the peer's frames until its side of the connection goes away; return how it ended
    (bounded by kv_timeout)."""
    frame = torch.zeros(HOST_FRAME_BYTES, dtype=torch.uint8)
    while True:
        try:
            connection.channel.recv(frame, TAG_FRAME)
        except (RuntimeError, OSError) as exc:
            return exc
