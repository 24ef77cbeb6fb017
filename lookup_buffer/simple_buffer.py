"""SimpleBuffer: the lookup buffer over a kvbridge pipe with a ZeroMQ control channel.

Both sides construct ``SimpleBuffer(pipe, config)``; ``config.kv_role`` picks the side. The
producer binds the control channel at ``tcp://{kv_ip}:{kv_port + pipe.port_offset + 1}`` (so it
should be the side at ``kv_ip``, normally rank 0); the consumer connects there. Tensors only
travel on the pipe. The contract is in :mod:`lookup_buffer.base`, the wire formats in
:mod:`lookup_buffer.protocol`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv_pipe.base import KVPipeBase
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVConfigError
from lookup_buffer.base import BufferStats, KVLookupBufferBase, SelectResult
from lookup_buffer.consumer import BufferConsumer
from lookup_buffer.control import control_address
from lookup_buffer.errors import KVInvalidRequestError
from lookup_buffer.loans import LentTensor, Loan
from lookup_buffer.producer import BufferProducer
from lookup_buffer.protocol import MAX_WAIT_MS


class SimpleBuffer(KVLookupBufferBase):
    """A lookup buffer between one producer and one consumer process.

    Args:
        data_pipe: this side's pipe to the peer (its ``port_offset`` places the control channel,
            see :class:`kv_pipe.KVPipeBase`). Once constructed, the buffer owns it: :meth:`close`
            closes it, and nothing else may send or receive on it.
        config: ``kv_role`` is ``kv_producer`` or ``kv_consumer`` (``kv_both`` is refused: one
            pipe carries entries one way); ``kv_buffer_size`` bounds the bytes the producer holds;
            ``kv_timeout`` bounds waits on a silent peer and is the default insert timeout.
        address: the control channel's ZeroMQ address (default: ``kv_port + port_offset + 1`` on
            ``kv_ip``, see :mod:`lookup_buffer.control`).

    Raises:
        KVConfigError: the role is not supported, or the control address cannot be bound.
    """

    def __init__(self, data_pipe: KVPipeBase, config: KVTransferConfig, address: str | None = None) -> None:
        config.validate()
        address = address or control_address(config, data_pipe.port_offset)
        self.config = config
        self._data_pipe = data_pipe
        self._side: BufferProducer | BufferConsumer
        if config.kv_role == "kv_producer":
            self._side = BufferProducer(data_pipe, config, address)
        elif config.kv_role == "kv_consumer":
            self._side = BufferConsumer(data_pipe, config, address)
        else:
            raise KVConfigError(
                f"SimpleBuffer needs kv_role 'kv_producer' or 'kv_consumer', got {config.kv_role!r}: "
                f"give each direction its own pipe and buffer"
            )

    def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        key: torch.Tensor | LentTensor,
        value: torch.Tensor | LentTensor | None,
        hidden: torch.Tensor | LentTensor | None,
        timeout: float | None = None,
    ) -> Loan | None:
        if not isinstance(self._side, BufferProducer):
            raise KVConfigError(f"insert() needs kv_role='kv_producer'; this buffer is {self.config.kv_role!r}")
        seconds = self.config.kv_timeout if timeout is None else _seconds(timeout)
        return self._side.insert(input_tokens, roi, key, value, hidden, seconds)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor in the data pipe's fastest memory (:meth:`kv_pipe.KVPipeBase.empty`): on one host,
        a hit's tensors made here go to the consumer without a copy."""
        return self._data_pipe.empty(shape, dtype)

    def unlend(self, loan: Loan) -> bool:
        return isinstance(self._side, BufferProducer) and self._side.unlend(loan)

    def drop_select(self, input_tokens: torch.Tensor, roi: torch.Tensor, timeout: float | None = None,
                    borrow: bool = False, part: tuple[int, int, int] | None = None) -> SelectResult:
        if not isinstance(self._side, BufferConsumer):
            raise KVConfigError(f"drop_select() needs kv_role='kv_consumer'; this buffer is {self.config.kv_role!r}")
        seconds = 0.0 if timeout is None else _seconds(timeout)
        return self._side.drop_select(input_tokens, roi, seconds, borrow, part)

    @property
    def failure(self) -> Exception | None:
        return self._side.failure

    def stats(self) -> BufferStats:
        return self._side.stats()

    def close(self) -> None:
        self._side.close()


def _seconds(timeout: float) -> float:
    limit = MAX_WAIT_MS / 1000
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= limit:
        raise KVInvalidRequestError(f"timeout must be a number of seconds in [0, {limit:g}] or None, got {timeout!r}")
    return float(timeout)
