"""A prefill instance and a decode instance that exchange KV caches: ``torchrun --nproc-per-node=2 -m launch.pair``.

Rank 0 (prefill) runs one forward pass over each prompt and ships its KV cache and last hidden state
through the connector. Rank 1 (decode) asks for the prompts in another (shuffled) order, generates
from the received KV without recomputing the prompt, and checks every sequence against its own greedy
generation from scratch. It prints a table and both ranks exit non-zero on any mismatch. The same
code runs as two separate launches, one per host::

    host A: torchrun --nnodes=2 --node-rank=0 --nproc-per-node=1 --master-addr=A --master-port=P -m launch.pair
    host B: torchrun --nnodes=2 --node-rank=1 --nproc-per-node=1 --master-addr=A --master-port=P -m launch.pair

Configuration is environment only. From torchrun: ``RANK`` (0 = prefill, 1 = decode), ``WORLD_SIZE``
(must be 2), ``MASTER_ADDR``; kvbridge uses ports ``MASTER_PORT+1 .. MASTER_PORT+4`` (KV data pipe
and its control channel, then this launcher's own small control pipe). ``KVBRIDGE_KV_*`` variables
set transfer options (see :meth:`kv_pipe.KVTransferConfig.from_env`), e.g. ``KVBRIDGE_KV_TIMEOUT``,
``KVBRIDGE_KV_BUFFER_SIZE``, ``KVBRIDGE_KV_CONNECT_TIMEOUT``; the shared secret comes from
``KVBRIDGE_KV_SECRET`` or a file named by ``KVBRIDGE_KV_SECRET_FILE`` (:mod:`connector.secret`).

With ``KVBRIDGE_KV_STORE`` (``kvbridge pair --store SPEC``) the KV goes through a store instead of a
pipe (:class:`lookup_buffer.StoreBuffer`): rank 0 writes every request's chunks into it, rank 1
reads them once rank 0 has said so on the control pipe. The store must be one both processes
reach: ``disk:PATH`` (one host) or ``redis://HOST:PORT``; ``memory`` alone is refused.
``KVBRIDGE_KV_CHUNK_SIZE`` (default 256) sets the tokens per stored object.

The workload:

=============================  =======  ==========================================================
variable                       default  meaning
=============================  =======  ==========================================================
KVBRIDGE_NUM_PROMPTS           16       number of prompts (requests)
KVBRIDGE_MAX_NEW_TOKENS        16       tokens generated greedily per prompt
KVBRIDGE_MODEL                 (unset)  local directory of a Hugging Face causal LM; unset: a
                                        seeded random 4-layer Llama built in-process
KVBRIDGE_SEED                  0        seed of the built-in weights, the prompts and the order
KVBRIDGE_MIN_PROMPT_LEN        5        shortest prompt, tokens
KVBRIDGE_MAX_PROMPT_LEN        300      longest prompt, tokens
KVBRIDGE_SELECT_TIMEOUT        10       seconds the decode side waits for one request's KV before
                                        counting a miss (and recomputing it)
KVBRIDGE_PEER_TIMEOUT          600      seconds a rank waits for the other to finish a stage
=============================  =======  ==========================================================

Exit status: 0 every sequence matched and every request was a hit; 1 the check failed;
2 the run failed (configuration, transfer, or the other rank failed or vanished).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import TypeVar

import torch

from connector import (
    ContiguousKV,
    KVRecvResult,
    KVRequest,
    recv_kv_caches_and_hidden_states,
    send_kv_caches_and_hidden_states,
)
from connector.secret import resolve_secret
from connector.transfer_state import KVConnectorConfig, build_kv_buffer
from kv_pipe import KVConfigError, KVProtocolError, KVTransferConfig, KVTransferError, TorchDistributedPipe
from launch.extras import needs_extra
from launch.model import (
    PrefillOutput,
    build_model,
    empty_prefill_like,
    greedy_continue,
    prefill,
    weights_digest,
)
from launch.table import format_table
from lookup_buffer import KVLookupBufferBase, SimpleBuffer, StoreBuffer

with needs_extra("pair"):
    from tqdm import tqdm
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

#: Port offset of the launcher's control pipe; the KV pipe uses offsets 0 and 1.
CONTROL_PORT_OFFSET = 2
EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR = 0, 1, 2
#: Per-request numbers the prefill side reports: seconds of prefill, seconds of send, bytes.
_STATS_COLUMNS = 3
_Closable = TypeVar("_Closable", TorchDistributedPipe, KVLookupBufferBase)
#: ContiguousKV packs a request's KV as [layers, batch 1, kv heads, tokens, head size].
STORE_TOKEN_DIM = 3


@dataclasses.dataclass(frozen=True)
class PairSettings:
    """The workload, read from ``KVBRIDGE_*`` variables (see the module docstring)."""

    num_prompts: int = 16
    max_new_tokens: int = 16
    model_dir: str | None = None
    seed: int = 0
    min_prompt_len: int = 5
    max_prompt_len: int = 300
    select_timeout: float = 10.0
    peer_timeout: float = 600.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PairSettings:
        env = os.environ if environ is None else environ
        defaults = cls()

        def number(name: str, default: float, kind: type, minimum: float) -> float:
            text = env.get("KVBRIDGE_" + name)
            if text is None:
                return default
            try:
                value = kind(text)
            except ValueError:
                raise KVConfigError(f"KVBRIDGE_{name} must be a {kind.__name__}, got {text!r}") from None
            if not value >= minimum:
                raise KVConfigError(f"KVBRIDGE_{name} must be >= {minimum}, got {text!r}")
            return value

        settings = cls(
            num_prompts=number("NUM_PROMPTS", defaults.num_prompts, int, 1),
            max_new_tokens=number("MAX_NEW_TOKENS", defaults.max_new_tokens, int, 1),
            model_dir=env.get("KVBRIDGE_MODEL") or None,
            seed=number("SEED", defaults.seed, int, 0),
            min_prompt_len=number("MIN_PROMPT_LEN", defaults.min_prompt_len, int, 1),
            max_prompt_len=number("MAX_PROMPT_LEN", defaults.max_prompt_len, int, 1),
            select_timeout=number("SELECT_TIMEOUT", defaults.select_timeout, float, 0),
            peer_timeout=number("PEER_TIMEOUT", defaults.peer_timeout, float, 1),
        )
        if settings.min_prompt_len > settings.max_prompt_len:
            raise KVConfigError(
                f"KVBRIDGE_MIN_PROMPT_LEN ({settings.min_prompt_len}) exceeds "
                f"KVBRIDGE_MAX_PROMPT_LEN ({settings.max_prompt_len})"
            )
        return settings

    def workload(self) -> torch.Tensor:
        """What both ranks must agree on, besides the weights."""
        return torch.tensor(
            [self.num_prompts, self.max_new_tokens, self.seed, self.min_prompt_len, self.max_prompt_len]
        )


_WORKLOAD_NAMES = ("NUM_PROMPTS", "MAX_NEW_TOKENS", "SEED", "MIN_PROMPT_LEN", "MAX_PROMPT_LEN")


def make_prompts(settings: PairSettings, vocab_size: int) -> list[torch.Tensor]:
    """Seeded random prompts of varied lengths; identical on both ranks."""
    generator = torch.Generator().manual_seed(settings.seed)
    lengths = torch.randint(
        settings.min_prompt_len, settings.max_prompt_len + 1, (settings.num_prompts,), generator=generator
    )
    return [torch.randint(0, vocab_size, (int(n),), generator=generator) for n in lengths]


def decode_order(settings: PairSettings) -> list[int]:
    """The order the decode side asks in: a seeded shuffle that differs from the prefill order."""
    order = torch.randperm(settings.num_prompts, generator=torch.Generator().manual_seed(settings.seed + 1))
    if settings.num_prompts > 1 and torch.equal(order, torch.arange(settings.num_prompts)):
        order = order.roll(1)
    return order.tolist()


@contextlib.contextmanager
def _stage(what: str) -> Iterator[None]:
    """Name the stage in the log when a transfer error ends it, so that a survivor says where it was."""
    try:
        yield
    except KVTransferError:
        logger.error("failed while %s", what)
        raise


def _receive(
    control: TorchDistributedPipe, timeout: float, dtype: torch.dtype, shape: tuple[int, ...], what: str
) -> torch.Tensor:
    with _stage(f"waiting for the other rank's {what}"):
        tensor = control.recv_tensor(timeout=timeout)
    if tensor is None or tensor.dtype != dtype or tuple(tensor.shape) != shape:
        got = None if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"
        raise KVProtocolError(f"the other rank sent {got} as its {what}, expected {shape} {dtype}")
    return tensor


def handshake(control: TorchDistributedPipe, digest: torch.Tensor, settings: PairSettings) -> None:
    """Exchange weights digest and workload; raise :class:`KVConfigError` on both ranks if they differ."""
    workload = settings.workload()
    with _stage("sending the weights digest and workload"):
        control.send_tensor(digest)
        control.send_tensor(workload)
        control.flush(timeout=settings.peer_timeout)
    peer_digest = _receive(control, settings.peer_timeout, digest.dtype, tuple(digest.shape), "weights digest")
    peer_workload = _receive(control, settings.peer_timeout, workload.dtype, tuple(workload.shape), "workload")
    if not torch.equal(peer_digest, digest):
        raise KVConfigError(
            f"the two ranks hold different model weights (SHA-256 {bytes(digest.tolist()).hex()[:16]}... here, "
            f"{bytes(peer_digest.tolist()).hex()[:16]}... there): give both the same KVBRIDGE_MODEL and KVBRIDGE_SEED"
        )
    differing = [
        f"KVBRIDGE_{name}={mine} here, {theirs} there"
        for name, mine, theirs in zip(_WORKLOAD_NAMES, workload.tolist(), peer_workload.tolist(), strict=True)
        if mine != theirs
    ]
    if differing:
        raise KVConfigError("the two ranks were given different workloads: " + "; ".join(differing))


def _check_capacity(config: KVTransferConfig, probe: PrefillOutput, prompts: list[torch.Tensor]) -> None:
    # The decode side asks in another order than the prefill side inserts, so everything must fit
    # at once; failing here is clearer than a full buffer timing out later.
    per_token = sum(t.nbytes for t in [*probe.keys, *probe.values]) + 9  # + int64 token + bool roi
    needed = sum(len(p) for p in prompts) * per_token + len(prompts) * probe.hidden.nbytes
    if needed > config.kv_buffer_size:
        raise KVConfigError(
            f"the workload's KV needs about {needed} bytes but kv_buffer_size is {config.kv_buffer_size}: "
            f"raise KVBRIDGE_KV_BUFFER_SIZE or lower KVBRIDGE_NUM_PROMPTS / KVBRIDGE_MAX_PROMPT_LEN"
        )


def run_prefill(
    settings: PairSettings,
    config: KVTransferConfig,
    buffer: KVLookupBufferBase,
    control: TorchDistributedPipe,
    model: PreTrainedModel,
    prompts: list[torch.Tensor],
) -> int:
    stored = isinstance(buffer, StoreBuffer)
    if not stored:  # a store's tiers bound themselves; a pipe's buffer must hold the whole batch
        _check_capacity(config, prefill(model, prompts[0][:1]), prompts)
    stats = torch.zeros(len(prompts), _STATS_COLUMNS, dtype=torch.float64)
    requests = []
    for index, tokens in enumerate(tqdm(prompts, desc="rank 0 prefill", unit="req")):
        start = time.perf_counter()
        state = prefill(model, tokens)
        stats[index, 0] = time.perf_counter() - start
        requests.append(KVRequest(tokens, ContiguousKV(state.keys, state.values), state.hidden))
    with _stage("sending KV into the lookup buffer"):
        send_results = send_kv_caches_and_hidden_states(buffer, requests)
        if stored:  # writes queued for slower tiers are made before the decode side is told to read
            buffer.close()
    for index, result in enumerate(send_results):
        stats[index, 1:] = torch.tensor([result.seconds, result.num_bytes], dtype=torch.float64)
    with _stage("sending the prefill results"):
        control.send_tensor(stats)
    logger.info("prefill side: %d requests prefilled and sent; waiting for the decode side", len(prompts))
    exit_code, matches, hits, misses = _receive(control, settings.peer_timeout, torch.int64, (4,), "result").tolist()
    if exit_code not in (EXIT_OK, EXIT_CHECK_FAILED) or not 0 <= min(matches, hits, misses) <= len(prompts):
        raise KVProtocolError(f"the decode side sent an invalid result {[exit_code, matches, hits, misses]}")
    print(
        f"[rank 0] decode side reports {matches}/{len(prompts)} sequences matching, {hits} hits, "
        f"{misses} misses; exit status {exit_code}",
        flush=True,
    )
    return exit_code


@dataclasses.dataclass
class _Outcome:
    """One request as the decode side saw it."""

    index: int
    prompt_tokens: int
    prefill_seconds: float  # on the prefill side
    received: KVRecvResult
    generated: list[int]
    reference: list[int] = dataclasses.field(default_factory=list)
    recompute_seconds: float = 0.0

    @property
    def match(self) -> bool:
        return self.generated == self.reference

    def failures(self) -> list[str]:
        found = []
        if not self.match:
            found.append(f"request {self.index}: generated {self.generated}, reference {self.reference}")
        if not self.received.hit:
            found.append(f"request {self.index}: sent but missed: {self.received.reason}")
        return found


def _receive_and_generate(
    settings: PairSettings,
    buffer: KVLookupBufferBase,
    model: PreTrainedModel,
    prompts: list[torch.Tensor],
    stats: torch.Tensor,
) -> list[_Outcome]:
    """Fetch every prompt's KV (shuffled order) and generate from it; recompute the misses."""
    probe = prefill(model, prompts[0][:1])
    order = decode_order(settings)
    states = {i: empty_prefill_like(probe, len(prompts[i])) for i in order}
    requests = [KVRequest(prompts[i], ContiguousKV(states[i].keys, states[i].values), states[i].hidden) for i in order]
    with _stage("receiving KV from the lookup buffer"):
        received = dict(
            zip(order, recv_kv_caches_and_hidden_states(buffer, requests, settings.select_timeout), strict=True)
        )
    outcomes = {}
    for index in tqdm(order, desc="rank 1 decode", unit="req"):
        state = states[index] if received[index].hit else prefill(model, prompts[index])
        generated = greedy_continue(model, state, settings.max_new_tokens)
        outcomes[index] = _Outcome(
            index,
            len(prompts[index]),
            prefill_seconds=float(stats[index, 0]),
            received=received[index],
            generated=generated,
        )
    return [outcomes[i] for i in range(len(prompts))]


def _compute_references(
    settings: PairSettings, model: PreTrainedModel, prompts: list[torch.Tensor], outcomes: list[_Outcome]
) -> None:
    """Greedy generation from scratch for every prompt, timing its prefill."""
    for outcome, tokens in zip(tqdm(outcomes, desc="rank 1 reference", unit="req"), prompts, strict=True):
        start = time.perf_counter()
        state = prefill(model, tokens)
        outcome.recompute_seconds = time.perf_counter() - start
        outcome.reference = greedy_continue(model, state, settings.max_new_tokens)


def _report(outcomes: list[_Outcome]) -> str:
    rows = [
        [
            o.index,
            o.prompt_tokens,
            "transferred" if o.received.hit else "miss, recomputed",
            o.received.num_bytes,
            f"{o.prefill_seconds * 1e3:.2f}",
            f"{o.received.seconds * 1e3:.2f}",
            f"{o.received.num_bytes / o.received.seconds / 1e9:.3f}" if o.received.hit else "-",
            f"{o.recompute_seconds * 1e3:.2f}",
            "yes" if o.match else "MISMATCH",
        ]
        for o in outcomes
    ]
    hits = [o.received for o in outcomes if o.received.hit]
    moved = sum(r.num_bytes for r in hits)
    transfer = sum(r.seconds for r in hits)
    prefill_total = sum(o.prefill_seconds for o in outcomes)
    summary = [
        len(outcomes),
        len(hits),
        len(outcomes) - len(hits),
        sum(o.prompt_tokens for o in outcomes),
        moved,
        f"{transfer:.4f}",
        f"{moved / transfer / 1e9:.3f}" if hits else "-",
        f"{prefill_total:.4f}",
        f"{sum(o.recompute_seconds for o in outcomes):.4f}",
        f"{prefill_total / transfer:.1f}x" if hits else "-",
        f"{sum(o.match for o in outcomes)}/{len(outcomes)}",
    ]
    return "\n".join(
        [
            format_table(
                [
                    "request",
                    "prompt tokens",
                    "KV",
                    "bytes",
                    "prefill ms (rank 0)",
                    "transfer ms (rank 1)",
                    "GB/s",
                    "recompute ms (rank 1)",
                    "match",
                ],
                rows,
            ),
            format_table(
                [
                    "requests",
                    "hits",
                    "misses",
                    "prompt tokens",
                    "bytes moved",
                    "transfer s",
                    "transfer GB/s",
                    "prefill s (rank 0)",
                    "recompute s (rank 1)",
                    "prefill / transfer",
                    "matches",
                ],
                [summary],
            ),
        ]
    )


def run_decode(
    settings: PairSettings,
    buffer: KVLookupBufferBase,
    control: TorchDistributedPipe,
    model: PreTrainedModel,
    prompts: list[torch.Tensor],
) -> int:
    # Sent once every request's KV is in the buffer (or the store): only then is it read.
    stats = _receive(control, settings.peer_timeout, torch.float64, (len(prompts), _STATS_COLUMNS), "prefill results")
    if not (torch.isfinite(stats).all() and (stats >= 0).all()):
        raise KVProtocolError("the prefill side sent invalid per-request numbers")
    outcomes = _receive_and_generate(settings, buffer, model, prompts, stats)
    _compute_references(settings, model, prompts, outcomes)
    print(_report(outcomes), flush=True)
    failures = [failure for outcome in outcomes for failure in outcome.failures()]
    for failure in failures:
        logger.error("check failed: %s", failure)
    exit_code = EXIT_CHECK_FAILED if failures else EXIT_OK
    matches, hits = sum(o.match for o in outcomes), sum(o.received.hit for o in outcomes)
    print(
        f"[rank 1] {'FAILED' if failures else 'OK'}: {matches}/{len(prompts)} sequences match their "
        f"recompute; exit status {exit_code}",
        flush=True,
    )
    with _stage("sending the result"):
        control.send_tensor(torch.tensor([exit_code, matches, hits, len(prompts) - hits]))
        control.flush(timeout=settings.peer_timeout)
    return exit_code


@contextlib.contextmanager
def _closing(resource: _Closable) -> Iterator[_Closable]:
    """Close ``resource`` on exit; after a failure, a close error is logged so that it cannot hide the
    failure itself (a dead peer makes every close report it again)."""
    try:
        yield resource
    except BaseException:
        try:
            resource.close()
        except KVTransferError as error:
            logger.info("closing after a failure: %s", error)
        raise
    resource.close()


def _store_identity(model: PreTrainedModel, digest: torch.Tensor, prompt: torch.Tensor) -> dict[str, str | int]:
    """What makes stored KV usable by the other rank: the weights and the KV's dtype and shape."""
    keys = prefill(model, prompt[:1]).keys
    return {
        "model": bytes(digest.tolist()).hex(),
        "kv_dtype": str(keys[0].dtype),
        "layout": "hf_contiguous",
        "layers": len(keys),
        "kv_heads": keys[0].shape[1],
        "head_size": keys[0].shape[-1],
        "tp": "0/1",
    }


def _check_shared(spec: str) -> None:
    if all(part.strip() == "memory" for part in spec.split(",")):
        raise KVConfigError(
            f"the pair's two processes cannot share the store {spec!r} (a memory tier is one "
            f"process's own): use --store disk:PATH or --store redis://HOST:PORT"
        )


def run(settings: PairSettings, config: KVConnectorConfig) -> int:
    """Run this rank's side of the pair; return the exit status."""
    if config.kv_store is not None:
        _check_shared(config.kv_store)
    transfer = config.transfer
    model = build_model(settings.model_dir, settings.seed)
    prompts = make_prompts(settings, model.config.vocab_size)
    digest = weights_digest(model)
    with contextlib.ExitStack() as stack:
        buffer: KVLookupBufferBase
        if config.kv_store is None:
            pipe = stack.enter_context(_closing(TorchDistributedPipe(transfer)))
            buffer = stack.enter_context(_closing(SimpleBuffer(pipe, transfer, buffer_config=config.buffer)))
        else:
            buffer = stack.enter_context(
                _closing(
                    build_kv_buffer(
                        config, identity=_store_identity(model, digest, prompts[0]), token_dim=STORE_TOKEN_DIM
                    )
                )
            )
        control = stack.enter_context(_closing(TorchDistributedPipe(transfer, port_offset=CONTROL_PORT_OFFSET)))
        handshake(control, digest, settings)
        if transfer.kv_rank == 0:
            return run_prefill(settings, transfer, buffer, control, model, prompts)
        return run_decode(settings, buffer, control, model, prompts)


def transfer_config(environ: Mapping[str, str] | None = None) -> KVTransferConfig:
    """This rank's transfer configuration: :meth:`KVTransferConfig.from_env`, with the secret taken from
    ``KVBRIDGE_KV_SECRET`` or the file ``KVBRIDGE_KV_SECRET_FILE`` names (:mod:`connector.secret`)."""
    return KVTransferConfig.from_env(environ, kv_secret=resolve_secret(environ))


def main() -> int:
    torch.set_num_threads(1)  # two ranks may share two cores: OpenMP spinning slows both 10-80x
    rank_text = os.environ.get("RANK", "?")
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank_text}] %(levelname)s %(name)s: %(message)s")
    try:
        if os.environ.get("WORLD_SIZE", "2") != "2":
            raise KVConfigError(f"the pair needs exactly 2 ranks, WORLD_SIZE is {os.environ['WORLD_SIZE']}")
        return run(PairSettings.from_env(), KVConnectorConfig.from_env(transfer_config()))
    except KVTransferError as error:
        logger.error("%s: %s", type(error).__name__, error)
        return EXIT_ERROR
    except Exception:
        logger.exception("the pair failed")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
