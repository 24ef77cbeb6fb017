"""The model the pair runs: a Hugging Face causal LM, and the inference steps the pair needs.

Greedy decoding here means: the next token is the argmax of the logits, with no logits processors
and no stop token, for exactly the requested number of tokens. The prefill side and the decode side
call the same functions; the only thing that differs between a transferred request and a
recomputed one is where the KV cache and the last hidden state come from.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from launch.extras import needs_extra

with needs_extra("pair"):
    from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedModel

#: The built-in model: a small Llama with seeded random weights (nothing is downloaded).
BUILTIN_LLAMA = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    # No special tokens: greedy decoding must never stop early or treat a token specially.
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


def build_model(model_dir: str | None, seed: int) -> PreTrainedModel:
    """Load the causal LM in ``model_dir`` (local files only), or build the seeded built-in Llama.

    float32, eval mode. The same ``seed`` gives the same weights in every process.
    """
    torch.manual_seed(seed)
    if model_dir:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    else:
        model = LlamaForCausalLM(LlamaConfig(**BUILTIN_LLAMA)).to(torch.float32)
    return model.train(False)  # inference mode: dropout off


def weights_digest(model: PreTrainedModel) -> torch.Tensor:
    """SHA-256 over every parameter and buffer (names, shapes, dtypes and bytes), as 32 uint8."""
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)


@dataclasses.dataclass
class PrefillOutput:
    """A prompt's KV cache (one key and one value tensor per layer) and its last hidden state."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden: torch.Tensor


@torch.inference_mode()
def prefill(model: PreTrainedModel, tokens: torch.Tensor) -> PrefillOutput:
    """One forward pass over the 1-D prompt ``tokens``."""
    out = model.base_model(input_ids=tokens.view(1, -1), use_cache=True)
    cache = out.past_key_values
    return PrefillOutput(
        keys=[layer.keys for layer in cache.layers],
        values=[layer.values for layer in cache.layers],
        hidden=out.last_hidden_state[0, -1].clone(),
    )


def empty_prefill_like(template: PrefillOutput, num_tokens: int) -> PrefillOutput:
    """Uninitialised tensors shaped like ``template`` but for ``num_tokens`` tokens.

    The token dimension of a transformers KV tensor is the second to last.
    """

    def resized(tensor: torch.Tensor) -> torch.Tensor:
        shape = list(tensor.shape)
        shape[-2] = num_tokens
        return torch.empty(shape, dtype=tensor.dtype)

    return PrefillOutput(
        keys=[resized(k) for k in template.keys],
        values=[resized(v) for v in template.values],
        hidden=torch.empty_like(template.hidden),
    )


@torch.inference_mode()
def greedy_continue(model: PreTrainedModel, state: PrefillOutput, num_new_tokens: int) -> list[int]:
    """Greedy-decode ``num_new_tokens`` tokens after a prompt whose prefill produced ``state``.

    The first token comes from the last hidden state; every later one from feeding only the
    previous token, with ``state``'s KV as the cache (which is not modified).
    """
    cache = DynamicCache(ddp_cache_data=list(zip(state.keys, state.values, strict=True)), config=model.config)
    logits = model.get_output_embeddings()(state.hidden.view(1, 1, -1))
    generated: list[int] = []
    while True:
        next_token = logits[0, -1].argmax()
        generated.append(int(next_token))
        if len(generated) == num_new_tokens:
            return generated
        logits = model(input_ids=next_token.view(1, 1), past_key_values=cache, use_cache=True).logits


def greedy_generate(model: PreTrainedModel, tokens: torch.Tensor, num_new_tokens: int) -> list[int]:
    """Greedy generation from scratch: prefill ``tokens`` here, then :func:`greedy_continue`."""
    return greedy_continue(model, prefill(model, tokens), num_new_tokens)
