"""What the vLLM connector moves, and the per-request work items its scheduler side hands to its workers.

What moves: the *transfer prefix* of a prompt of n tokens, ``(n - 1) // block_size * block_size``
tokens, i.e. the whole blocks before the last prompt token. Both sides compute it from the prompt
alone, so the producer's entry and the consumer's lookup agree, including for prompts of
``k * block_size + 1`` tokens. The last prompt token is never loaded: vLLM must compute at least
one token to sample from, and a prompt that fits in one block transfers nothing.

Matching: by token content. A producer's ``request_finished`` announces the prefix it saved and
where it waits as ``kv_transfer_params = {"kvbridge": {"prefix_tokens": N, "host": H, "port": P,
"engine_id": E, "tp_size": T}}`` (N is 0 when its save failed or never happened; ``H:P`` is the
producer's ``kv_ip:kv_port``, where its TP rank r listens at ``P + r``; ``E`` its vLLM engine id,
for logs; ``T`` its TP size). A router passes that on to the decode request, which then claims
exactly that prefix (nothing when N is 0), connects to the ranks of ``H:P`` whose KV heads each of
its own TP ranks holds (:mod:`connector.tp_layout`) if it is not connected yet, and waits for the
entries there.
Without an announcement (offline use) the consumer claims the transfer prefix but only takes an
entry that is already in the buffer of its configured producer (``kv_ip:kv_port``).

This module does not import vLLM (the worker side and its tests stay light).
"""

from __future__ import annotations

import dataclasses

#: Key of kvbridge's entry in ``kv_transfer_params`` (request input and RequestOutput field).
PARAMS_KEY = "kvbridge"


def transfer_prefix_len(num_prompt_tokens: int, block_size: int) -> int:
    """Tokens of a prompt whose KV is transferred: the whole blocks before its last token."""
    return max(num_prompt_tokens - 1, 0) // block_size * block_size


@dataclasses.dataclass(frozen=True)
class SaveSpec:
    """Producer: insert the KV of ``block_ids`` under ``token_ids`` (one block per block_size tokens)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """Consumer: fetch the entry of ``token_ids``, whose blocks go to ``block_ids`` (the request's
    blocks of the transfer prefix), except the first ``skip_blocks``: vLLM's own prefix cache
    already holds them. When it holds them all, the entry is only drained.

    ``wait``: the producer announced this entry (``kv_transfer_params``), so it is worth waiting
    up to ``kv_load_timeout`` for it; otherwise only an entry already in the buffer is taken, and
    a request sent to the decode instance alone never stalls its engine.

    ``producer``: the (host, port) the announcement named, or None for the configured producer.
    ``producer_tp``: that producer's TP size as announced, or None (not announced: the consumer's
    ``kv_producer_tp_size``, by default its own TP size).
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip_blocks: int
    wait: bool = False
    producer: tuple[str, int] | None = None
    producer_tp: int | None = None

    @property
    def drain(self) -> bool:
        return self.skip_blocks >= len(self.block_ids)
