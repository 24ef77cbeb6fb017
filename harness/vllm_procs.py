"""Helpers of the vLLM tests: a tiny model made on the spot, engine settings, and engine processes.

Engine bodies run in spawned processes (vLLM keeps global state per process, e.g. its KV
connector, so every engine gets its own process). Everything here is bounded by timeouts, and
:class:`Engines` kills whatever it started when the test ends.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import random
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
VOCAB = 1024
MAX_TOKENS = 8
#: Prompt lengths: shorter than a block, around one and two blocks (k * 32 + 1 included), longer.
PROMPT_LENGTHS = (7, 31, 32, 33, 64, 65, 100, 200)
#: Index of the prompt that appears twice in :func:`test_prompts`.
DUPLICATED = 6
#: Small enough that the 200-token prompt is prefilled in chunks on both engines.
MAX_NUM_BATCHED_TOKENS = 96

_CTX = mp.get_context("spawn")


# ---------------------------------------------------------------------- model and prompts


def make_tiny_llama(path: Path, with_tokenizer: bool = False, max_positions: int = 512) -> str:
    """Save a random 2-layer Llama (1.7 M parameters) into ``path``; optionally a word-level tokenizer
    (:func:`word`) with a chat template, for the OpenAI chat endpoint. ``max_positions`` bounds
    vLLM's ``--max-model-len``."""
    return _make_llama(
        path, layers=2, heads=4, kv_heads=2, head_dim=64, max_positions=max_positions, with_tokenizer=with_tokenizer
    )


def make_heavy_kv_llama(path: Path, max_positions: int = 2048) -> str:
    """A random Llama whose KV is heavy (8 layers x 16 KV heads x 128: 128 KiB per token in fp32) and
    whose body is light, with the word-level tokenizer: the benchmarks' serving model."""
    return _make_llama(
        path, layers=8, heads=16, kv_heads=16, head_dim=128, max_positions=max_positions, with_tokenizer=True
    )


def _make_llama(
    path: Path, *, layers: int, heads: int, kv_heads: int, head_dim: int, max_positions: int, with_tokenizer: bool
) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    if with_tokenizer:
        save_word_tokenizer(path)
    return str(path)


#: Token ids 0-2 are the special tokens; 3 and 4 frame a chat message.
SPECIALS = ("<s>", "</s>", "<unk>")


def word(token_id: int) -> str:
    """The text of token ``token_id`` (>= 3) in the tiny tokenizer: one word per token."""
    return f"w{token_id}"


def save_word_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {**{token: i for i, token in enumerate(SPECIALS)}, **{word(i): i for i in range(len(SPECIALS), VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}w3 {{ m['content'] }} {% endfor %}w4"
    tokenizer.save_pretrained(path)


def make_prompts(seed: int = 0) -> list[list[int]]:
    """One random prompt per length of :data:`PROMPT_LENGTHS`, then a duplicate of one of them."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]
    return prompts + [list(prompts[DUPLICATED])]


def transfer_prefix(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


# ---------------------------------------------------------------------- engine settings


#: The connector class and module vLLM loads; :func:`kv_transfer_config` takes another pair, e.g.
#: :data:`CORRUPTING_CONNECTOR`.
KVBRIDGE_CONNECTOR = ("KVBridgeConnector", "connector.vllm_v1")
CORRUPTING_CONNECTOR = ("CorruptingKVBridgeConnector", "harness.corrupting_connector")


def kv_transfer_config(
    role: str,
    port: int,
    module_path: bool = True,
    connector: tuple[str, str] = KVBRIDGE_CONNECTOR,
    failure_policy: str = "recompute",
    **extra: Any,
) -> dict[str, Any]:
    """``module_path=False`` leaves the module out: vLLM then finds the class through kvbridge's plugin.
    ``failure_policy="fail"`` makes vLLM fail a request whose load failed, rather than recompute it."""
    config: dict[str, Any] = {
        "kv_connector": connector[0],
        "kv_role": role,
        "kv_port": port,
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": {
            "kv_ip": "127.0.0.1",
            "kv_timeout": 5.0,
            "kv_connect_timeout": 120.0,
            "kv_buffer_size": 64 << 20,
            "kv_load_timeout": 5.0,
            **extra,
        },
    }
    if module_path:
        config["kv_connector_module_path"] = connector[1]
    return config


def engine_kwargs(model: str, transfer: dict[str, Any] | None = None) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=64 << 20,
        seed=0,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    )
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    return kwargs


def engine_env(core: int, multiprocess: bool = False) -> dict[str, str]:
    """Environment of one engine process, pinned to ``core`` (two engines on two cores)."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }


# ---------------------------------------------------------------------- engine bodies (child processes)


def _llm(kwargs: dict[str, Any]):
    from vllm import LLM

    return LLM(**kwargs)


def _generate(
    llm, prompts: list[list[int]], max_tokens: int, transfer_params: list[dict[str, Any] | None] | None = None
) -> list[dict[str, Any]]:
    """Greedy outputs of ``prompts``; ``transfer_params[i]`` goes with prompt i as its kv_transfer_params."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            extra_args={"kv_transfer_params": kv} if kv is not None else None,
        )
        for kv in transfer_params or [None] * len(prompts)
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [_summary(o) for o in outputs]


def _generate_with_aborts(
    llm, prompts: list[list[int]], max_tokens: int, abort: list[int], abort_after_steps: int, timeout: float = 120
) -> list[dict[str, Any] | None]:
    """Step the engine by hand and abort the requests ``abort`` after ``abort_after_steps`` steps;
    returns the outputs in prompt order, None for aborted requests."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    ids = [f"stepped-{index}" for index in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
    finished: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    steps = 0
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests not finished within {timeout} s")
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
        if steps == abort_after_steps:
            engine.abort_request([ids[index] for index in abort])
    return [None if index in abort else _summary(finished[request_id]) for index, request_id in enumerate(ids)]


def _summary(output: Any) -> dict[str, Any]:
    return {
        "tokens": list(output.outputs[0].token_ids),
        "cached": output.num_cached_tokens,
        "finish": output.outputs[0].finish_reason,
        "params": output.kv_transfer_params,
    }


def _run_batch(
    llm,
    batch: list[list[int]] | dict[str, Any],
    max_tokens: int,
    transfer_params: list[dict[str, Any] | None] | None = None,
) -> list[dict[str, Any] | None]:
    """A batch is a list of prompts, or ``{"prompts", "abort", "abort_after_steps"}``."""
    if isinstance(batch, dict):
        return _generate_with_aborts(llm, batch["prompts"], max_tokens, batch["abort"], batch["abort_after_steps"])
    return _generate(llm, batch, max_tokens, transfer_params)


def _connector_totals() -> dict[str, float] | None:
    """The worker-side connector's counters, or None when the worker runs in another process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return dict(get_kv_transfer_group().total_stats().data) if has_kv_transfer_group() else None


def _entries_left() -> int | None:
    """Entries still held by this process's lookup buffer (producer, single-process engine)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group().buffer_stats().entries if has_kv_transfer_group() else None


def _shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def reference_body(model: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """A plain engine without connector: the expected tokens."""
    llm = _llm(engine_kwargs(model))
    try:
        return _generate(llm, prompts, MAX_TOKENS)
    finally:
        _shutdown(llm)


def producer_body(
    model: str,
    transfer: dict[str, Any],
    batches: list[Any],
    prefilled: Flag,
    consumer_done: Flag,
    timeout: float,
    announce: Any = None,
) -> dict[str, Any]:
    """Prefill each batch (max_tokens=1), put the outputs' kv_transfer_params (per batch) into the
    queue ``announce`` if given, set ``prefilled``, stay up until the consumer is done."""
    llm = _llm(engine_kwargs(model, transfer))
    try:
        outputs = [_run_batch(llm, batch, 1) for batch in batches]
        if announce is not None:
            announce.put([[o["params"] if o is not None else None for o in batch] for batch in outputs])
        prefilled.set()
        if not consumer_done.wait(timeout):
            raise TimeoutError(f"the consumer did not finish within {timeout} s")
        return {"outputs": outputs, "stats": _connector_totals(), "entries_left": _entries_left()}
    finally:
        _shutdown(llm)


def consumer_body(
    model: str,
    transfer: dict[str, Any],
    batches: list[Any],
    prefilled: Flag,
    consumer_done: Flag,
    timeout: float,
    kill_pid: int | None = None,
    announced: Any = None,
) -> dict[str, Any]:
    """Wait for the producer's prefill, then decode each batch, with the producer's
    kv_transfer_params taken from the queue ``announced`` if given (as a proxy passes them on).
    With ``kill_pid``, SIGKILL that process (the producer) after the first batch, mid-run."""
    llm = _llm(engine_kwargs(model, transfer))
    try:
        if not prefilled.wait(timeout):
            raise TimeoutError(f"the producer did not prefill within {timeout} s")
        params = announced.get(timeout=timeout) if announced is not None else [None] * len(batches)
        outputs = []
        for index, batch in enumerate(batches):
            if index == 1 and kill_pid is not None:
                os.kill(kill_pid, 9)
            outputs.append(_run_batch(llm, batch, MAX_TOKENS, params[index]))
        return {"outputs": outputs, "stats": _connector_totals()}
    finally:
        consumer_done.set()
        _shutdown(llm)


def late_producer_body(
    model: str, transfer: dict[str, Any], prompt: list[int], go: Flag, consumer_done: Flag, timeout: float
) -> dict[str, Any]:
    """Start, wait for ``go``, then prefill ``prompt`` (its entry reaches the buffer late); stay up
    until the consumer is done."""
    llm = _llm(engine_kwargs(model, transfer))
    try:
        if not go.wait(timeout):
            raise TimeoutError(f"the consumer did not ask for the prefill within {timeout} s")
        (output,) = _generate(llm, [prompt], 1)
        if not consumer_done.wait(timeout):
            raise TimeoutError(f"the consumer did not finish within {timeout} s")
        return {"output": output, "stats": _connector_totals(), "entries_left": _entries_left()}
    finally:
        _shutdown(llm)


def late_consumer_body(
    model: str,
    transfer: dict[str, Any],
    streams: list[list[int]],
    stream_tokens: int,
    prompt: list[int],
    waiting_steps: int,
    go: Flag,
    consumer_done: Flag,
    timeout: float,
) -> dict[str, Any]:
    """Decode ``streams``; once each has a token, add ``prompt`` announced as saved although the
    producer has not prefilled it yet; step ``waiting_steps`` times, then set ``go`` (the producer
    prefills) and step until everything finished. Returns the output token counts after each step
    since the late request came (streams first, the late request last) and the outputs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _llm(engine_kwargs(model, transfer))
    try:
        engine = llm.llm_engine
        stream_params = SamplingParams(temperature=0, max_tokens=stream_tokens, ignore_eos=True, detokenize=False)
        ids = [f"stream-{index}" for index in range(len(streams))]
        for request_id, stream in zip(ids, streams, strict=True):
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=stream), stream_params)
        announced = {"kvbridge": {"prefix_tokens": transfer_prefix(prompt)}}
        late_params = SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            detokenize=False,
            extra_args={"kv_transfer_params": announced},
        )
        counts = dict.fromkeys([*ids, "late"], 0)
        finished: dict[str, Any] = {}
        history: list[list[int]] = []
        deadline = time.monotonic() + timeout
        while engine.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests not finished within {timeout} s")
            for output in engine.step():
                counts[output.request_id] = len(output.outputs[0].token_ids)
                if output.finished:
                    finished[output.request_id] = _summary(output)
            if not history:
                if not all(counts[i] for i in ids):
                    continue  # the streams are not decoding yet
                engine.add_request("late", TokensPrompt(prompt_token_ids=prompt), late_params)
            history.append([counts[i] for i in ids] + [counts["late"]])
            if len(history) == waiting_steps + 1:
                go.set()
        return {
            "history": history,
            "late": finished["late"],
            "streams": [finished[i] for i in ids],
            "stats": _connector_totals(),
        }
    finally:
        consumer_done.set()
        _shutdown(llm)


# ---------------------------------------------------------------------- process management


def _run(body: Callable[..., Any], name: str, env: dict[str, str], results: Any, kwargs: dict[str, Any]) -> None:
    os.environ.update(env)  # before vLLM is imported: it reads its environment at import
    os.setpgid(0, 0)  # its own process group, so the test can reap vLLM's EngineCore/Worker with it
    try:
        results.put((name, "ok", body(**kwargs)))
    except BaseException:  # report everything, including SystemExit, to the test
        results.put((name, "error", traceback.format_exc()))


class Flag:
    """A one-way "it happened" flag shared with spawned processes, polled, without locks.

    multiprocessing.Event is unusable here: its ``set`` waits for every sleeping waiter to wake,
    so a waiter that was SIGKILLed (as the producer in the kill test) would hang the setter forever.
    """

    def __init__(self) -> None:
        self._value = _CTX.RawValue("b", 0)

    def set(self) -> None:
        self._value.value = 1

    def is_set(self) -> bool:
        return bool(self._value.value)

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.is_set():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True


class Engines:
    """Engine processes of one test: started with :meth:`start`, results read with :meth:`wait`,
    all killed on exit. A process that dies without a result fails the wait at once."""

    def __init__(self) -> None:
        self._results = _CTX.Queue()
        self._processes: dict[str, mp.Process] = {}
        self._outcomes: dict[str, Any] = {}

    def event(self) -> Flag:
        return Flag()

    def queue(self) -> Any:
        return _CTX.Queue()

    def start(self, name: str, body: Callable[..., Any], env: dict[str, str], **kwargs: Any) -> mp.Process:
        process = _CTX.Process(target=_run, args=(body, name, env, self._results, kwargs), name=name, daemon=False)
        process.start()
        self._processes[name] = process
        return process

    def wait(self, names: list[str], timeout: float) -> dict[str, Any]:
        """Results of ``names``; raises AssertionError with the child's traceback, or on timeout."""
        deadline = time.monotonic() + timeout
        while any(name not in self._outcomes for name in names):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [n for n in names if n not in self._outcomes]
                raise AssertionError(f"engine processes {missing} did not finish within {timeout} s")
            try:
                name, status, value = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [n for n in names if n not in self._outcomes and not self._processes[n].is_alive()]
                if dead and self._results.empty():
                    codes = {n: self._processes[n].exitcode for n in dead}
                    raise AssertionError(f"engine processes died without a result: {codes}") from None
                continue
            if status == "error":
                raise AssertionError(f"engine process {name} failed:\n{value}")
            self._outcomes[name] = value
        return {name: self._outcomes[name] for name in names}

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self._processes.values():
            process.join(timeout=10)
            # Whatever is left of the engine's process group (an EngineCore or Worker the engine
            # did not stop, or the engine itself) is killed: nothing outlives the test.
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.join(timeout=10)
        self._results.close()


# ---------------------------------------------------------------------- worker-side bodies (no engine)

#: Fake paged caches in vLLM's CPU layout ``[blocks, heads, block_size, 2 * head_size]``, odd sizes.
FAKE_BLOCKS, FAKE_HEADS, FAKE_BLOCK_SIZE, FAKE_HEAD_SIZE, FAKE_LAYERS = 9, 3, 4, 5, 3


def fake_caches(seed: int, block_size: int = FAKE_BLOCK_SIZE) -> list[Any]:
    """Random per-layer caches (never zeros), the same for the same seed in every process."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    shape = (FAKE_BLOCKS, FAKE_HEADS, block_size, 2 * FAKE_HEAD_SIZE)
    return [torch.randn(shape, generator=generator) * 3 + 0.5 for _ in range(FAKE_LAYERS)]


def fake_worker(
    role: str,
    port: int,
    block_size: int,
    caches: list[Any],
    options: dict[str, Any],
    listener_factory: Callable[..., Any] | None = None,
    dialer: Callable[..., Any] | None = None,
):
    """A connected WorkerSide over ``caches`` (by default over kvbridge's listener and dialer)."""
    from connector import compat
    from connector.vllm_settings import ConnectorSettings
    from connector.vllm_worker import WorkerSide, find_layout

    extra = {"kv_ip": "127.0.0.1", "kv_timeout": 3.0, "kv_connect_timeout": 60.0, "kv_buffer_size": 1 << 20, **options}
    settings = ConnectorSettings.from_vllm(role, port, "cpu", extra)
    identity = compat.KVLayoutInfo(
        version=compat.VERSION,
        role=role,
        model="fake",
        dtype="",
        block_size=block_size,
        num_layers=0,
        block_shape=(),
        layout="",
        tp_size=1,
        tp_rank=0,
    )
    worker = WorkerSide(settings, identity, port_offset=0, listener_factory=listener_factory, dialer=dialer)
    worker.connect(caches, find_layout(caches[0], FAKE_BLOCKS, block_size, "CPU_ATTN/fake"))
    return worker


def store_identity(
    num_layers: int,
    block_size: int,
    model: str = "fake",
    layout: str = "x",
    tp_rank: int = 0,
    tp_size: int = 1,
    total_kv_heads: int = 0,
    head_size: int = 0,
) -> Any:
    """The compatibility identity of a ``kv_both`` store worker over fp32 caches (one rank unless
    told; heads and head size 0: not known)."""
    from connector import compat

    return compat.KVLayoutInfo(
        version=compat.VERSION,
        role="kv_both",
        model=model,
        dtype="float32",
        block_size=block_size,
        num_layers=num_layers,
        block_shape=(),
        layout=layout,
        tp_size=tp_size,
        tp_rank=tp_rank,
        total_kv_heads=total_kv_heads,
        head_size=head_size,
    )


def load_and_wait(worker: Any, specs: list[Any], timeout: float) -> set[int]:
    """Start ``specs`` and poll the worker as vLLM does, each step, until every load (drains
    excepted) was reported finished; return the failed blocks, checking that each load's failed
    blocks came no later than its report and that nothing is reported twice."""
    waiting = {spec.req_id for spec in specs if not spec.drain}
    worker.start_loads(specs)
    failed: set[int] = set()
    deadline = time.monotonic() + timeout
    while waiting:
        if time.monotonic() > deadline:
            raise TimeoutError(f"loads {sorted(waiting)} not reported within {timeout} s")
        finished = worker.take_finished_loads()
        failed |= worker.take_failed_blocks()
        if not finished <= waiting:
            raise AssertionError(f"loads reported twice or unknown: {sorted(finished - waiting)}")
        waiting -= finished
        time.sleep(0.01)
    if worker.take_finished_loads() or worker.take_failed_blocks():
        raise AssertionError("a load was reported after every load had finished")
    return failed


def worker_producer_body(
    port: int, saves: list[Any], saved: Any, done: Any, timeout: float, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Save ``saves`` from :func:`fake_caches` (seed 1, in whole pages: every block can be lent)
    under inference mode, as vLLM does; set ``saved``; serve until ``done``, then until every saved
    request's blocks were returned (vLLM holds them all: the worker reports them finished sending)."""
    import torch

    from kv_pipe.exported_memory import page_aligned_empty

    caches = [page_aligned_empty(cache.shape, cache.dtype).copy_(cache) for cache in fake_caches(1)]
    worker = fake_worker("kv_producer", port, FAKE_BLOCK_SIZE, caches, extra or {})
    try:
        with torch.inference_mode():  # as in vLLM's model runner
            worker.save(saves)
        outcomes = worker.take_save_outcomes()
        worker.hold([spec.req_id for spec in saves] + ["never saved"])
        early = worker.take_finished_sending()  # lent blocks are still out: nothing to return yet
        saved.set()
        if not done.wait(timeout):
            raise TimeoutError(f"the consumer did not finish within {timeout} s")
        returned = set(early)
        deadline = time.monotonic() + timeout
        while len(returned) < len(saves) and time.monotonic() < deadline:
            returned |= worker.take_finished_sending()
            time.sleep(0.01)
        return {
            "stats": worker.total_stats().data,
            "entries_left": worker.buffer_stats().entries,
            "outcomes": outcomes,
            "early": early,
            "returned": returned,
        }
    finally:
        worker.close()


def worker_consumer_body(
    port: int, steps: list[tuple[str, Any]], saved: Any, done: Any, timeout: float
) -> dict[str, Any]:
    """Run ``steps`` on caches :func:`fake_caches` (seed 2): ``("load", [LoadSpec...])`` records the
    failed blocks; ``("corrupt", bool)`` makes the worker's lookup buffer hand out noise from then on
    (the negative control, :class:`harness.fault_injection.CorruptingBuffer`). Returns the caches."""
    from harness.fault_injection import CorruptingBuffer
    from lookup_buffer import dial

    buffers: list[CorruptingBuffer] = []

    def corruptible(settings: Any, host: str, producer_port: int, on_connect: Any) -> CorruptingBuffer:
        buffers.append(CorruptingBuffer(dial(settings.bridge, host, producer_port, on_connect), enabled=False))
        return buffers[-1]

    worker = fake_worker(
        "kv_consumer", port, FAKE_BLOCK_SIZE, fake_caches(2), {"kv_load_timeout": 0.5}, dialer=corruptible
    )
    try:
        if not saved.wait(timeout):
            raise TimeoutError(f"the producer did not save within {timeout} s")
        failed = []
        for kind, arg in steps:
            if kind == "load":
                failed.append(sorted(load_and_wait(worker, arg, timeout)))
            else:
                buffers[0].enabled = arg
        # Drains run in the background and report nothing to vLLM: wait for them to be counted.
        drains = sum(spec.drain for kind, arg in steps if kind == "load" for spec in arg)
        deadline = time.monotonic() + timeout
        while worker.total_stats().data["drained"] < drains and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"failed": failed, "stats": worker.total_stats().data, "caches": [c.numpy() for c in worker.caches]}
    finally:
        done.set()
        worker.close()


def worker_mismatch_producer_body(port: int, block_size: int, done: Any, timeout: float) -> list[str]:
    """Listen with ``block_size`` until ``done``; return the warnings logged about refused consumers."""
    with _captured_warnings() as warnings:
        worker = fake_worker("kv_producer", port, block_size, fake_caches(1, block_size), {})
        try:
            if not done.wait(timeout):
                raise TimeoutError(f"the consumer did not finish within {timeout} s")
        finally:
            worker.close()
    return warnings


def worker_mismatch_consumer_body(port: int, block_size: int, done: Any, timeout: float) -> dict[str, Any]:
    """Load once with ``block_size`` from a producer using another; return the failed blocks and warnings."""
    from connector.transfer_plan import LoadSpec

    with _captured_warnings() as warnings:
        worker = fake_worker("kv_consumer", port, block_size, fake_caches(2, block_size), {"kv_load_timeout": 1.0})
        try:
            failed = load_and_wait(worker, [LoadSpec("m", list(range(1, 1 + block_size)), [0], 0, wait=True)], timeout)
        finally:
            done.set()
            worker.close()
    return {"failed": sorted(failed), "warnings": warnings}


@contextlib.contextmanager
def _captured_warnings() -> Iterator[list[str]]:
    """The messages of WARNING and above logged in this process meanwhile."""
    import logging

    messages: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Capture(logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        yield messages
    finally:
        logging.getLogger().removeHandler(handler)


def worker_reconnecting_consumer_body(
    port: int,
    first: Any,
    lost: Any,
    second: Any,
    first_saved: Any,
    first_loaded: Any,
    killed: Any,
    second_saved: Any,
    timeout: float,
) -> dict[str, Any]:
    """Load ``first`` (saved by the first producer), then, once that producer was killed, ``lost``
    (fails: nothing listens, or the connection is found dead), then, once a restarted producer saved it,
    ``second``, retrying while the connection is being made again. No restart of this worker."""
    worker = fake_worker("kv_consumer", port, FAKE_BLOCK_SIZE, fake_caches(2), {"kv_load_timeout": 5.0})
    try:
        if not first_saved.wait(timeout):
            raise TimeoutError(f"the first producer did not save within {timeout} s")
        failed_first = sorted(load_and_wait(worker, [first], timeout))
        connections_before = worker.connections
        first_loaded.set()
        if not killed.wait(timeout):
            raise TimeoutError(f"the first producer was not killed within {timeout} s")
        failed_lost = sorted(load_and_wait(worker, [lost], timeout))
        if not second_saved.wait(timeout):
            raise TimeoutError(f"the restarted producer did not save within {timeout} s")
        attempts = 0
        deadline = time.monotonic() + timeout
        while True:  # loads fail at once while the backoff of the failed attempts lasts
            attempts += 1
            if not load_and_wait(worker, [second], timeout):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no load from the restarted producer within {timeout} s ({attempts} attempts)")
            time.sleep(0.2)
        return {
            "failed": [failed_first, failed_lost],
            "attempts": attempts,
            "connections_before": connections_before,
            "connections_after": worker.connections,
            "stats": worker.total_stats().data,
            "caches": [c.numpy() for c in worker.caches],
        }
    finally:
        worker.close()


def worker_killed_producer_body(port: int, connected: Any, kill: Any, timeout: float) -> None:
    """Listen, then SIGKILL this process when told: a producer dying without a goodbye."""
    fake_worker("kv_producer", port, FAKE_BLOCK_SIZE, fake_caches(1), {})
    connected.set()
    if kill.wait(timeout):
        os.kill(os.getpid(), 9)
    raise TimeoutError(f"not told to die within {timeout} s")


def worker_orphan_consumer_body(
    port: int, specs: list[Any], connected: Any, kill: Any, timeout: float
) -> dict[str, Any]:
    """Connect (a load of an entry nobody saved: a miss), have the producer killed, then load ``specs``
    one by one; report what failed."""
    from connector.transfer_plan import LoadSpec

    worker = fake_worker("kv_consumer", port, FAKE_BLOCK_SIZE, fake_caches(2), {"kv_load_timeout": 10.0})
    try:
        if not connected.wait(timeout):
            raise TimeoutError(f"the producer did not start within {timeout} s")
        if load_and_wait(worker, [LoadSpec("unsaved", [7] * FAKE_BLOCK_SIZE, [0], 0)], timeout) != {0}:
            raise AssertionError("the connecting load did not miss")
        if worker.connections != 1:
            raise AssertionError(f"{worker.connections} connections after the first load")
        kill.set()
        failed = []
        for spec in specs:
            failed.append(sorted(load_and_wait(worker, [spec], timeout)))
        return {"failed": failed, "stats": worker.total_stats().data, "caches": [c.numpy() for c in worker.caches]}
    finally:
        worker.close()
