"""Contiguous KV: one key tensor and one value tensor per layer, owned by a single request."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from connector.base import EmptyTensor, KVStorage, host_empty
from kv_pipe.errors import KVConfigError


def _check_layers(name: str, tensors: Sequence[torch.Tensor]) -> None:
    first = tensors[0]
    for layer, tensor in enumerate(tensors):
        if tensor.shape != first.shape or tensor.dtype != first.dtype:
            raise KVConfigError(
                f"{name} of layer {layer} is {tuple(tensor.shape)} {tensor.dtype}, "
                f"layer 0 is {tuple(first.shape)} {first.dtype}"
            )


def _mismatch(name: str, received: torch.Tensor | None, expected: Sequence[torch.Tensor]) -> str | None:
    if received is None:
        return f"no {name} tensor was received"
    if received.dim() == 0 or received.shape[0] != len(expected):
        return f"layer count {received.shape[0] if received.dim() else 0} received, {len(expected)} expected"
    if received.shape[1:] != expected[0].shape:
        return f"{name} shape {tuple(received.shape[1:])} received, {tuple(expected[0].shape)} expected"
    if received.dtype != expected[0].dtype:
        return f"{name} dtype {received.dtype} received, {expected[0].dtype} expected"
    return None


def _token_dim(received: torch.Tensor, expected: torch.Tensor, num_tokens: int) -> int | None:
    """The one per-layer dimension where ``received`` (a ``[layers, ...]`` stack holding ``num_tokens``
    tokens) is shorter than ``expected`` (one layer): the tokens' dimension. None if there is not
    exactly one such dimension, of size ``num_tokens``, with every other dimension equal."""
    if received.dim() != expected.dim() + 1:
        return None
    differing = [
        dim for dim, (got, want) in enumerate(zip(received.shape[1:], expected.shape, strict=True)) if got != want
    ]
    if len(differing) != 1 or received.shape[1 + differing[0]] != num_tokens:
        return None
    return differing[0]


def _prefix_mismatch(
    name: str, received: torch.Tensor | None, expected: Sequence[torch.Tensor], num_tokens: int
) -> str | None:
    if received is None:
        return f"no {name} tensor was received"
    if received.dim() == 0 or received.shape[0] != len(expected):
        return f"layer count {received.shape[0] if received.dim() else 0} received, {len(expected)} expected"
    if received.dtype != expected[0].dtype:
        return f"{name} dtype {received.dtype} received, {expected[0].dtype} expected"
    if _token_dim(received, expected[0], num_tokens) is None:
        return (
            f"{name} shape {tuple(received.shape[1:])} received is not the first {num_tokens} tokens of "
            f"{tuple(expected[0].shape)}"
        )
    return None


@dataclasses.dataclass(frozen=True)
class ContiguousKV(KVStorage):
    """A request's own per-layer ``keys`` and ``values`` (any shape, the same for every layer).

    Producer: the tensors are read. Consumer: they are destinations that a hit overwrites, so their
    shapes (which include the number of tokens) must be those the producer sent. They travel as
    ``[num_layers, *shape]`` stacks in the buffer's key and value slots.
    """

    keys: Sequence[torch.Tensor]
    values: Sequence[torch.Tensor]

    def __post_init__(self) -> None:
        if len(self.keys) == 0 or len(self.keys) != len(self.values):
            raise KVConfigError(
                f"contiguous KV needs one key and one value tensor per layer, got {len(self.keys)} keys "
                f"and {len(self.values)} values"
            )
        _check_layers("key", self.keys)
        _check_layers("value", self.values)

    def check_tokens(self, num_tokens: int) -> None:
        # The token dimension of an arbitrary per-layer shape is unknown here; the consumer's
        # shape check covers it.
        return None

    def pack(self, empty: EmptyTensor = host_empty) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.keys[0].device.type != "cpu":  # a buffer's memory is host memory
            return torch.stack(list(self.keys)), torch.stack(list(self.values))
        key = empty((len(self.keys), *self.keys[0].shape), self.keys[0].dtype)
        value = empty((len(self.values), *self.values[0].shape), self.values[0].dtype)
        return torch.stack(list(self.keys), out=key), torch.stack(list(self.values), out=value)

    def mismatch(self, key: torch.Tensor | None, value: torch.Tensor | None) -> str | None:
        return _mismatch("key", key, self.keys) or _mismatch("value", value, self.values)

    def load(self, key: torch.Tensor, value: torch.Tensor | None) -> None:
        assert value is not None  # mismatch() rejected a missing value
        for layer, (key_dest, value_dest) in enumerate(zip(self.keys, self.values, strict=True)):
            key_dest.copy_(key[layer])
            value_dest.copy_(value[layer])

    def mismatch_prefix(self, key: torch.Tensor | None, value: torch.Tensor | None, num_tokens: int) -> str | None:
        # The token dimension is the one dimension where the received stack is shorter.
        return _prefix_mismatch("key", key, self.keys, num_tokens) or _prefix_mismatch(
            "value", value, self.values, num_tokens
        )

    def load_prefix(self, key: torch.Tensor, value: torch.Tensor | None, num_tokens: int) -> None:
        assert value is not None  # mismatch_prefix() rejected a missing value
        for received, destinations in ((key, self.keys), (value, self.values)):
            dim = _token_dim(received, destinations[0], num_tokens)
            assert dim is not None  # mismatch_prefix() checked it
            for layer, destination in enumerate(destinations):
                destination.narrow(dim, 0, num_tokens).copy_(received[layer])
