"""A store worker's gathers held at their start until a test opens them, and what the store holds
of a prompt: for tests of the blocks vLLM keeps while a save copies them out."""

from __future__ import annotations

import threading

import pytest
import torch

import connector.vllm_store as vllm_store
from connector.paged import gather_blocks
from connector.vllm_store import StoreWorker
from kv_store import chunk_keys, decode_chunk

WAIT = 30.0  # seconds a held gather waits for its gate before it fails


class GatherGate:
    """Holds every gather at its start until opened; ``started`` tells that one began."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.started = threading.Event()

    def gather(self, *args: object, **kwargs: object) -> torch.Tensor:
        self.started.set()
        assert self.opened.wait(WAIT), "the gate was never opened"
        return gather_blocks(*args, **kwargs)


def hold_gathers(monkeypatch: pytest.MonkeyPatch) -> GatherGate:
    """Hold every store gather of the test at its start (open the gate before the test ends)."""
    gate = GatherGate()
    monkeypatch.setattr(vllm_store, "gather_blocks", gate.gather)
    return gate


def stored_chunks(worker: StoreWorker, tokens: list[int], chunk_size: int) -> list[torch.Tensor | None]:
    """Each full chunk of ``tokens`` as ``worker``'s store holds it (decoded and checked), None
    where it holds none."""
    keys = chunk_keys(worker.namespace, tokens, chunk_size)
    blobs = worker.store.get_many([key.key for key in keys])
    return [
        None if blob is None else decode_chunk(blob, key.key, tokens[key.start : key.stop], worker.mac_key)[0]
        for key, blob in zip(keys, blobs, strict=True)
    ]
