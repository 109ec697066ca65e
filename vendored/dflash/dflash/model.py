"""DFlash for transformers: the block-diffusion draft model and the chain decoding loop.

The draft denoises a block ``[last committed token, mask, mask, ...]`` in one non-causal
pass. Its keys and values cover the block and a projection of the target's hidden states
for every committed token; the target's own ``lm_head`` turns its output into proposals.
"""

import time
from types import SimpleNamespace
from typing import Optional

import torch
from torch import nn
from transformers import DynamicCache, Qwen3Config
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)


# ---------------------------------------------------------------- helpers


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced conditioning layers, away from the first and the last two target layers."""
    first, last = 1, max(1, num_target_layers - 3)
    if num_draft_layers == 1:
        return [(first + last) // 2]
    return [first + (last - first) * i // (num_draft_layers - 1) for i in range(num_draft_layers)]


def extract_context_feature(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    # hidden_states[0] is the embedding output, layer i is at i + 1
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    if temperature < 1e-5:
        return logits.argmax(dim=-1)
    return _draw(sampling_probs(logits, temperature, top_p, top_k))


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The distribution a token is drawn from: temperature, then the ``top_k`` best, then the
    smallest set of best tokens holding ``top_p`` of the mass (nucleus)."""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth_best = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        ranked, order = probs.sort(dim=-1, descending=True)
        mass_before = ranked.cumsum(dim=-1) - ranked
        ranked = ranked.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, ranked)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _draw(probs: torch.Tensor) -> torch.Tensor:
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).view(probs.shape[:-1])


def speculative_sampling(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> tuple[int, torch.Tensor]:
    """Accept a drafted block so that every committed token is distributed as the target's own sample.

    The speculative sampling rule (Leviathan et al., 2023; Chen et al., 2023): draft token
    ``x`` at position ``i`` (drawn from ``q_i``) survives with probability
    ``min(1, p_i(x) / q_i(x))``; the first rejected one is replaced by a draw from the
    residual ``max(0, p_i - q_i)`` renormalised, and when all survive one more token comes
    from ``p`` after the block. ``draft_probs`` is ``[n, vocab]``, ``target_probs`` is
    ``[n + 1, vocab]``. Returns the number accepted and the token that follows them.
    """
    coins = torch.rand(draft_tokens.shape[0], device=draft_probs.device)
    for i, token in enumerate(draft_tokens.tolist()):
        p, q = target_probs[i, token], draft_probs[i, token]
        if coins[i] * q < p:
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: nothing to correct
            residual = target_probs[i]
        return i, _draw(residual / residual.sum())
    return draft_tokens.shape[0], _draw(target_probs[-1])


def _cuda_time() -> float:
    # the GPU runs ahead of Python; wait for it so that stage times mean something
    torch.cuda.synchronize()
    now = time.perf_counter()
    return now


# ---------------------------------------------------------------- decoding


@torch.inference_mode()
def dflash_generate(
    model: "DFlashDraftModel", target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
    stop_token_ids: Optional[list[int]], temperature: float,
    block_size: Optional[int] = None, mask_token_id: Optional[int] = None, return_stats: bool = False,
    top_p: float = 1.0, top_k: int = 0,
):
    """Greedy or sampled chain speculative decoding for a batch of one prompt.

    Greedy decoding keeps the draft tokens that equal the target's argmax. Sampled decoding
    (``temperature > 0``, with ``top_p`` / ``top_k``) draws the block from the draft's
    distribution and accepts it by speculative (rejection) sampling against the target's,
    so the output is distributed as the target's own sampling.

    Returns the prompt plus generated ids, or with ``return_stats`` a namespace that also
    holds timings and the per-round acceptance lengths.
    """
    sampled = temperature >= 1e-5
    block_size = block_size or model.block_size
    mask_token_id = model.mask_token_id if mask_token_id is None else mask_token_id
    device = target.device
    prompt_len = input_ids.shape[1]
    max_length = prompt_len + max_new_tokens

    sequence = torch.full((1, max_length + block_size), mask_token_id, dtype=torch.long, device=device)
    sequence[:, :prompt_len] = input_ids
    positions = torch.arange(sequence.shape[1], device=device)[None]
    stops = torch.tensor(stop_token_ids, device=device) if stop_token_ids else None

    target_cache = DynamicCache()
    draft_cache = DynamicCache()

    prefill_start = _cuda_time() if return_stats else None
    first = target(
        input_ids,
        position_ids=positions[:, :prompt_len],
        past_key_values=target_cache,
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=block_size > 1,
    )
    sequence[:, prompt_len] = sample(first.logits[:, -1], temperature, top_p, top_k)
    context = extract_context_feature(first.hidden_states, model.target_layer_ids) if block_size > 1 else None
    time_to_first_token = _cuda_time() - prefill_start if return_stats else None
    decode_start = _cuda_time() if return_stats else None

    acceptance_lengths = []
    start = prompt_len
    while start < max_length:
        block = sequence[:, start : start + block_size].clone()
        if block_size > 1:
            hidden = model(
                position_ids=positions[:, draft_cache.get_seq_length() : start + block_size],
                noise_embedding=target.model.embed_tokens(block),
                target_hidden=context,
                past_key_values=draft_cache,
                use_cache=True,
            )
            draft_cache.crop(start)
            draft_logits = target.lm_head(hidden[:, 1:])
            if sampled:
                draft_probs = sampling_probs(draft_logits[0], temperature, top_p, top_k)
                block[:, 1:] = _draw(draft_probs)
            else:
                block[:, 1:] = sample(draft_logits, temperature)

        out = target(
            block,
            position_ids=positions[:, start : start + block_size],
            past_key_values=target_cache,
            use_cache=True,
            output_hidden_states=block_size > 1,
        )
        if sampled and block_size > 1:
            target_probs = sampling_probs(out.logits[0], temperature, top_p, top_k)
            run, next_token = speculative_sampling(block[0, 1:], draft_probs, target_probs)
        else:
            target_choice = sample(out.logits, temperature, top_p, top_k)
            run = (block[:, 1:] == target_choice[:, :-1]).int().cumprod(dim=-1).sum().item()
            next_token = target_choice[:, run]
        sequence[:, start : start + run + 1] = block[:, : run + 1]
        sequence[:, start + run + 1] = next_token
        acceptance_lengths.append(run + 1)

        start += run + 1
        target_cache.crop(start)
        if block_size > 1:
            context = extract_context_feature(out.hidden_states, model.target_layer_ids)[:, : run + 1]
        if stops is not None and torch.isin(sequence[0, start - run : start + 1], stops).any():
            break

    output_ids = sequence[:, : min(start + 1, max_length)]
    if stops is not None:
        stop_at = torch.isin(output_ids[0, prompt_len:], stops).nonzero()
        if len(stop_at):
            output_ids = output_ids[:, : prompt_len + stop_at[0].item() + 1]

    if not return_stats:
        return output_ids

    generated = output_ids.shape[1] - prompt_len
    elapsed = _cuda_time() - decode_start
    return SimpleNamespace(
        output_ids=output_ids,
        num_input_tokens=prompt_len,
        num_output_tokens=generated,
        time_to_first_token=time_to_first_token,
        time_per_output_token=elapsed / max(generated, 1),
        acceptance_lengths=acceptance_lengths,
    )


# ---------------------------------------------------------------- draft model


class Qwen3DFlashAttention(nn.Module):
    """Queries from the block, keys/values from [context; block], no causal mask."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = 1.0 / self.head_dim**0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False

        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.sliding_window = config.sliding_window if kinds[layer_idx] == "sliding_attention" else None

    def forward(
        self, hidden_states, target_hidden, position_embeddings, attention_mask=None, past_key_values=None, **kwargs
    ):
        batch, q_len = hidden_states.shape[:2]
        both = torch.cat([target_hidden, hidden_states], dim=1)

        def split_heads(x):
            return x.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

        q = self.q_norm(split_heads(self.q_proj(hidden_states)))
        k = self.k_norm(split_heads(self.k_proj(both)))
        v = split_heads(self.v_proj(both))
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        q = q * cos[:, :, -q_len:] + rotate_half(q) * sin[:, :, -q_len:]
        k = k * cos + rotate_half(k) * sin

        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx, {"cos": cos, "sin": sin})

        implementation = self.config._attn_implementation or "eager"
        if implementation == "eager":
            attention = eager_attention_forward
        else:
            attention = ALL_ATTENTION_FUNCTIONS[implementation]
        out, weights = attention(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        return self.o_proj(out.reshape(batch, q_len, -1)), weights


class Qwen3DFlashDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = Qwen3DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, hidden_states, target_hidden, position_embeddings, attention_mask=None, past_key_values=None, **kwargs
    ):
        mixed, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            target_hidden,
            position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            **kwargs,
        )
        hidden_states = hidden_states + mixed
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The draft network; proposals come from running its output through the target's lm_head."""

    config_class = Qwen3Config
    _no_split_modules = ["Qwen3DFlashDecoderLayer"]

    def __init__(self, config) -> None:
        super().__init__(config)
        self.config = config
        dflash_config = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = dflash_config.get("target_layer_ids") or build_target_layer_ids(
            config.num_target_layers, config.num_hidden_layers
        )
        self.mask_token_id = dflash_config.get("mask_token_id")
        self.block_size = config.block_size
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layers = nn.ModuleList([Qwen3DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.fc = nn.Linear(hidden * len(self.target_layer_ids), hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=eps)
        self.norm = Qwen3RMSNorm(hidden, eps=eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(
        self, position_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
        noise_embedding: Optional[torch.Tensor] = None, target_hidden: Optional[torch.Tensor] = None,
        past_key_values: Optional[Cache] = None, use_cache: bool = False, **kwargs,
    ) -> torch.Tensor:
        context = self.hidden_norm(self.fc(target_hidden))
        rope = self.rotary_emb(noise_embedding, position_ids)
        cache = past_key_values if use_cache else None
        out = noise_embedding
        # each layer is called with the context by keyword, as upstream's drafter does: the call looks
        # like a drafter call (target_hidden=) inside the drafter's own forward, which a recipe must
        # leave alone (the decode loop's drafter call is the one to route)
        for layer in self.layers:
            out = layer(
                out,
                target_hidden=context,
                position_ids=position_ids,
                position_embeddings=rope,
                attention_mask=attention_mask,
                past_key_values=cache,
                **kwargs,
            )
        return self.norm(out)

    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int], temperature: float):
        self.eval()
        return dflash_generate(self, target, input_ids, max_new_tokens, stop_token_ids, temperature)
