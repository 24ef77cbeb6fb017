"""Tensor helpers shared by the tests: random bits of any dtype, and bit-exact comparison."""

from __future__ import annotations

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
