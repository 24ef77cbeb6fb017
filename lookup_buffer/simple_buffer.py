"""SimpleBuffer: the lookup buffer over a kvbridge pipe with a ZeroMQ control channel.

Both sides construct ``SimpleBuffer(pipe, config)``; ``config.kv_role`` picks the side's class. The
producer binds the control channel at ``tcp://{kv_ip}:{kv_port + pipe.port_offset + 1}`` (so it
should be the side at ``kv_ip``, normally rank 0); the consumer connects there. Tensors only
travel on the pipe. The contract is in :mod:`lookup_buffer.base`, the wire formats in
:mod:`lookup_buffer.protocol`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from kv_pipe.base import KVPipeBase
from kv_pipe.config import KVTransferConfig
from kv_pipe.errors import KVConfigError
from lookup_buffer.base import BufferStats, KVLookupBufferBase, SelectResult
from lookup_buffer.config import BufferConfig
from lookup_buffer.consumer import BufferConsumer
from lookup_buffer.control import control_address
from lookup_buffer.errors import KVInvalidRequestError
from lookup_buffer.loans import LentTensor, Loan
from lookup_buffer.producer import BufferProducer
from lookup_buffer.protocol import MAX_WAIT_MS


class SimpleBuffer(KVLookupBufferBase):
    """A lookup buffer between one producer and one consumer process.

    ``SimpleBuffer(pipe, config)`` makes the side ``config.kv_role`` names: a
    :class:`SimpleProducerBuffer` (``kv_producer``) or a :class:`SimpleConsumerBuffer`
    (``kv_consumer``); ``kv_both`` is refused (one pipe carries entries one way), and so is a
    config without a role.

    Args:
        data_pipe: this side's pipe to the peer (its ``port_offset`` places the control channel,
            see :class:`kv_pipe.KVPipeBase`). Once constructed, the buffer owns it: :meth:`close`
            closes it, and nothing else may send or receive on it.
        config: ``kv_role`` picks the side; ``kv_buffer_size`` bounds the bytes the producer
            holds; ``kv_timeout`` bounds waits on a silent peer and is the default insert timeout.
        address: the control channel's ZeroMQ address (default: ``kv_port + port_offset + 1`` on
            ``kv_ip``, see :mod:`lookup_buffer.control`).
        buffer_config: what the producer does with entries nobody selects (default:
            :class:`~lookup_buffer.config.BufferConfig`'s defaults); a consumer holds no entries.

    Raises:
        KVConfigError: the role is not supported, or the control address cannot be bound.
    """

    def __new__(
        cls,
        data_pipe: KVPipeBase,
        config: KVTransferConfig,
        address: str | None = None,
        buffer_config: BufferConfig | None = None,
    ) -> SimpleBuffer:
        if cls is SimpleBuffer:
            sides = {"kv_producer": SimpleProducerBuffer, "kv_consumer": SimpleConsumerBuffer}
            if config.kv_role not in sides:
                raise KVConfigError(
                    f"SimpleBuffer needs kv_role 'kv_producer' or 'kv_consumer', got {config.kv_role!r}: "
                    f"give each direction its own pipe and buffer"
                )
            cls = sides[config.kv_role]
        return super().__new__(cls)

    def __init__(
        self,
        data_pipe: KVPipeBase,
        config: KVTransferConfig,
        address: str | None = None,
        buffer_config: BufferConfig | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self._data_pipe = data_pipe
        self._side = self._open(
            data_pipe, config, address or control_address(config, data_pipe.port_offset), buffer_config
        )

    @abc.abstractmethod
    def _open(
        self, data_pipe: KVPipeBase, config: KVTransferConfig, address: str, buffer_config: BufferConfig | None
    ) -> BufferProducer | BufferConsumer:
        """This side's end of the control channel and pipe."""

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor in the data pipe's fastest memory (:meth:`kv_pipe.KVPipeBase.empty`): on one host,
        a hit's tensors made here go to the consumer without a copy."""
        return self._data_pipe.empty(shape, dtype)

    @property
    def failure(self) -> Exception | None:
        return self._side.failure

    def stats(self) -> BufferStats:
        return self._side.stats()

    def close(self) -> None:
        self._side.close()


class SimpleProducerBuffer(SimpleBuffer):
    """The producer's side of a :class:`SimpleBuffer`: it inserts; a select is the consumer's."""

    _side: BufferProducer

    def _open(
        self, data_pipe: KVPipeBase, config: KVTransferConfig, address: str, buffer_config: BufferConfig | None
    ) -> BufferProducer:
        return BufferProducer(data_pipe, config, address, buffer_config=buffer_config)

    def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        key: torch.Tensor | LentTensor,
        value: torch.Tensor | LentTensor | None,
        hidden: torch.Tensor | LentTensor | None,
        timeout: float | None = None,
    ) -> Loan | None:
        seconds = self.config.kv_timeout if timeout is None else _seconds(timeout)
        return self._side.insert(input_tokens, roi, key, value, hidden, seconds)

    def unlend(self, loan: Loan) -> bool:
        return self._side.unlend(loan)

    def drop_select(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        timeout: float | None = None,
        borrow: bool = False,
        part: tuple[int, int, int] | None = None,
        span: tuple[int, int, int] | None = None,
    ) -> SelectResult:
        raise KVConfigError("drop_select() needs kv_role='kv_consumer'; this buffer is the producer's")


class SimpleConsumerBuffer(SimpleBuffer):
    """The consumer's side of a :class:`SimpleBuffer`: it selects; an insert is the producer's."""

    _side: BufferConsumer

    def _open(
        self, data_pipe: KVPipeBase, config: KVTransferConfig, address: str, buffer_config: BufferConfig | None
    ) -> BufferConsumer:
        return BufferConsumer(data_pipe, config, address)

    def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        key: torch.Tensor | LentTensor,
        value: torch.Tensor | LentTensor | None,
        hidden: torch.Tensor | LentTensor | None,
        timeout: float | None = None,
    ) -> Loan | None:
        raise KVConfigError("insert() needs kv_role='kv_producer'; this buffer is the consumer's")

    def drop_select(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        timeout: float | None = None,
        borrow: bool = False,
        part: tuple[int, int, int] | None = None,
        span: tuple[int, int, int] | None = None,
    ) -> SelectResult:
        seconds = 0.0 if timeout is None else _seconds(timeout)
        return self._side.drop_select(input_tokens, roi, seconds, borrow, part, span)


def _seconds(timeout: float) -> float:
    limit = MAX_WAIT_MS / 1000
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= limit:
        raise KVInvalidRequestError(f"timeout must be a number of seconds in [0, {limit:g}] or None, got {timeout!r}")
    return float(timeout)
