"""Tensor helpers shared by the tests: random bits of any dtype, and bit-exact comparison."""

from __future__ import annotations

import threading
from typing import Any

import torch


def random_tensor(generator: torch.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bits of any dtype (not just valid numbers: NaN payloads must survive too)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal dtype, shape and bytes (so NaN == NaN and -0.0 != 0.0); two Nones are equal."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def as_received(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """What ``tensor`` arrives as through a pipe: its values, with no conjugate or negative bit and
    no autograd history."""
    return None if tensor is None else tensor.detach().resolve_conj().resolve_neg()


def exchange_both_ways(
    pipe: Any, mine: list[torch.Tensor | None], theirs: list[torch.Tensor | None], timeout: float
) -> int:
    """Send ``mine`` from a thread while receiving and checking ``theirs`` bit for bit; both
    directions run at once. Returns the bytes received; raises whatever the sender raised."""
    errors: list[BaseException] = []

    def send_all() -> None:
        try:
            for item in mine:
                pipe.send_tensor(item, timeout=timeout)
            pipe.flush(timeout=timeout)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    sender = threading.Thread(target=send_all)
    sender.start()
    received = 0
    for index, want in enumerate(theirs):
        got = pipe.recv_tensor(timeout=timeout)
        assert same_bits(got, want), f"item {index} differs"
        received += 0 if got is None else got.nbytes
    sender.join(2 * timeout)
    assert not sender.is_alive() and not errors, errors
    return received
