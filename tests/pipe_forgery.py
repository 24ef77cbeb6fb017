"""A hostile pipe peer: it runs the real rendezvous, then sends hand-made frames on its groups."""

from __future__ import annotations

import torch

from kv_pipe import KVTransferConfig, rendezvous, shared_memory
from kv_pipe.protocol import HEADER_BYTES, HOST_FRAME_BYTES, Hello
from kv_pipe.torch_distributed_pipe import TAG_FRAME


def connect_as_forger(config: KVTransferConfig, port_offset: int = 0) -> rendezvous.Connection:
    """The connection a real host pipe with ``config`` would have, shared-memory segments included
    (the peer maps the forger's), with no pipe threads behind it."""
    hello = Hello(frame_bytes=HOST_FRAME_BYTES, max_in_flight=config.kv_buffer_size, device="cpu",
                  timeout_ms=round(config.kv_timeout * 1000))
    device = torch.device("cpu")
    connection = rendezvous.connect(config, config.kv_port + port_offset, hello, device)
    connection.shared = shared_memory.establish(connection.outgoing, connection.incoming, config.kv_rank,
                                                config.kv_shared_memory, config.kv_buffer_size, device)
    return connection


def send_records(connection: rendezvous.Connection, records: dict[int, list[int]]) -> None:
    """Send one frame holding header ``words`` at each byte offset of ``records``."""
    frame = torch.zeros(HOST_FRAME_BYTES, dtype=torch.uint8)
    for start, words in records.items():
        frame[start : start + HEADER_BYTES] = torch.tensor(words, dtype=torch.int64).view(torch.uint8)
    connection.outgoing.send([frame], 1 - connection_rank(connection), TAG_FRAME).wait()


def connection_rank(connection: rendezvous.Connection) -> int:
    return connection.outgoing.rank()


def drain_until_dropped(connection: rendezvous.Connection) -> BaseException:
    """Receive the peer's frames until its side of the connection goes away; return how it ended
    (bounded by the group's timeout, kv_timeout)."""
    frame = torch.zeros(HOST_FRAME_BYTES, dtype=torch.uint8)
    peer = 1 - connection_rank(connection)
    while True:
        try:
            connection.incoming.recv([frame], peer, TAG_FRAME).wait()
        except RuntimeError as exc:
            return exc
