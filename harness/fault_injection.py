"""Faults the tests inject into kvbridge from outside the product.

* :class:`CorruptingBuffer` wraps a lookup buffer and hands out every selected entry with its key
  replaced by noise (shape and dtype kept): every check on tokens, shapes and dtypes passes, only
  the KV is wrong. The negative control of every "bit-exact" and "same tokens" check.
* :class:`LosingBuffer` wraps a lookup buffer and silently loses one insert: the consumer must
  report that request as a miss and compute it itself.
* Run as a module, the pair launcher with one fault, under torchrun like ``launch.pair``::

      torchrun --nproc-per-node=2 -m harness.fault_injection corrupt-kv | lose-insert=I | crash-rank=R

  ``corrupt-kv``: the decode rank loads noise; ``lose-insert=I``: the prefill rank's I-th insert
  (0-based, prompt order) is lost; ``crash-rank=R``: rank R dies abruptly after the handshake.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from kv_pipe import TorchDistributedPipe
from lookup_buffer import BufferStats, KVLookupBufferBase, SimpleBuffer
from lookup_buffer.base import SelectResult
from lookup_buffer.loans import Loan

logger = logging.getLogger(__name__)


class _Wrapper(KVLookupBufferBase):
    """Passes everything on to ``inner``."""

    def __init__(self, inner: KVLookupBufferBase) -> None:
        self.inner = inner

    def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None,
        hidden: torch.Tensor | None,
        timeout: float | None = None,
    ) -> Loan | None:
        return self.inner.insert(input_tokens, roi, key, value, hidden, timeout)

    def drop_select(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        timeout: float | None = None,
        borrow: bool = False,
        span: tuple[int, int, int] | None = None,
    ) -> SelectResult:
        return self.inner.drop_select(input_tokens, roi, timeout, borrow, span=span)

    @property
    def failure(self) -> Exception | None:
        return self.inner.failure

    def stats(self) -> BufferStats:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


class CorruptingBuffer(_Wrapper):
    """Selected entries come with a key of seeded noise while ``enabled``."""

    def __init__(self, inner: KVLookupBufferBase, enabled: bool = True, seed: int = 0) -> None:
        super().__init__(inner)
        self.enabled = enabled
        self._generator = torch.Generator().manual_seed(seed)

    def drop_select(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        timeout: float | None = None,
        borrow: bool = False,
        span: tuple[int, int, int] | None = None,
    ) -> SelectResult:
        entry = super().drop_select(input_tokens, roi, timeout, span=span)  # never borrowed: the key is replaced
        key = entry[2]
        if self.enabled and key is not None:
            entry[2] = (torch.randn(key.shape, generator=self._generator) * 3 + 0.5).to(key.dtype)
        return entry


class LosingBuffer(_Wrapper):
    """Insert number ``lost`` (0-based) returns as if stored, but nothing is stored."""

    def __init__(self, inner: KVLookupBufferBase, lost: int) -> None:
        super().__init__(inner)
        self.lost = lost
        self._inserts = 0

    def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None,
        hidden: torch.Tensor | None,
        timeout: float | None = None,
    ) -> Loan | None:
        index, self._inserts = self._inserts, self._inserts + 1
        if index == self.lost:
            logger.warning("fault injection: insert %d is lost", index)
            return None
        return super().insert(input_tokens, roi, key, value, hidden, timeout)


def _install(fault: str) -> None:
    """Patch :mod:`launch.pair` so that this rank suffers ``fault`` (see the module docstring)."""
    from launch import pair

    name, _, arg = fault.partition("=")
    rank = int(os.environ["RANK"])
    if name == "corrupt-kv" and rank == 1:
        pair.SimpleBuffer = lambda pipe, config, **kept: CorruptingBuffer(SimpleBuffer(pipe, config, **kept))
    elif name == "lose-insert" and rank == 0:
        pair.SimpleBuffer = lambda pipe, config, **kept: LosingBuffer(SimpleBuffer(pipe, config, **kept), int(arg))
    elif name == "crash-rank" and rank == int(arg):
        handshake = pair.handshake

        def handshake_then_die(
            control: TorchDistributedPipe, digest: torch.Tensor, settings: pair.PairSettings
        ) -> None:
            handshake(control, digest, settings)
            logger.warning("fault injection: rank %d dies now", rank)
            os._exit(pair.EXIT_ERROR)

        pair.handshake = handshake_then_die
    elif name not in ("corrupt-kv", "lose-insert", "crash-rank"):
        raise SystemExit(f"unknown fault {fault!r}")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit("usage: python -m harness.fault_injection corrupt-kv | lose-insert=I | crash-rank=R")
    logging.basicConfig(
        level=logging.INFO, format=f"[rank {os.environ.get('RANK', '?')}] %(levelname)s %(name)s: %(message)s"
    )
    _install(argv[0])
    from launch import pair

    return pair.main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
