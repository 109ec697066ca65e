"""The block-diffusion draft: a few Qwen3 decoder layers that denoise a block of masks.

Each layer's queries come from the block being denoised; its keys and values come from the
block *and* from a projection of the target's hidden states (the context). The context K/V
of already-committed tokens is kept in the draft's own cache, so every round only projects
the context that the last verification added.
"""

from typing import Optional

import math

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

from .utils import build_target_layer_ids, extract_context_feature, sample


# (cos, sin) as produced by Qwen3RotaryEmbedding, each [batch, seq, head_dim]
RotaryPair = tuple[torch.Tensor, torch.Tensor]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # cos/sin arrive as [batch, seq, head_dim]; broadcast them over the head axis
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class Qwen3DFlashAttention(nn.Module):
    """Queries from the noisy block; keys and values from the context followed by the block."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # eager attention reads the GQA group count off the module
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = 1.0 / math.sqrt(self.head_dim)
        self.attention_dropout = config.attention_dropout
        # Diffusion denoising: every block position sees the whole block, so no causal mask.
        self.is_causal = False

        q_width = config.num_attention_heads * self.head_dim
        kv_width = config.num_key_value_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_width, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=bias)
        self.o_proj = nn.Linear(q_width, config.hidden_size, bias=bias)
        # Qwen3 normalises queries and keys per head, before RoPE
        head_eps = config.rms_norm_eps
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=head_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=head_eps)

        layer_types = getattr(config, "layer_types", None) or []
        is_sliding = layer_idx < len(layer_types) and layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, -1, self.head_dim).transpose(1, 2)

    def forward(
        self, hidden_states: torch.Tensor, target_hidden: torch.Tensor, position_embeddings: RotaryPair,
        attention_mask: Optional[torch.Tensor] = None, past_key_values: Optional[Cache] = None, **kwargs,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        batch, q_len, _ = hidden_states.shape
        # context first, then the block: the cache must end with the block so that a crop
        # back to the committed length drops exactly the noise positions
        kv_source = torch.cat([target_hidden, hidden_states], dim=1)

        query = self.q_norm(self._heads(self.q_proj(hidden_states)))
        key = self.k_norm(self._heads(self.k_proj(kv_source)))
        value = self._heads(self.v_proj(kv_source))

        cos, sin = position_embeddings
        query = _rotate(query, cos[:, -q_len:], sin[:, -q_len:])
        key = _rotate(key, cos, sin)

        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx, {"sin": sin, "cos": cos})

        impl = self.config._attn_implementation
        attend = eager_attention_forward if impl in (None, "eager") else ALL_ATTENTION_FUNCTIONS[impl]
        attn_output, attn_weights = attend(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        return self.o_proj(attn_output.reshape(batch, q_len, -1)), attn_weights


class Qwen3DFlashDecoderLayer(GradientCheckpointingLayer):
    """A pre-norm Qwen3 block whose attention also reads the target context."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        width, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Qwen3RMSNorm(width, eps=eps)
        self.self_attn = Qwen3DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(width, eps=eps)
        self.mlp = Qwen3MLP(config)

    def forward(
        self, hidden_states: torch.Tensor, target_hidden: torch.Tensor, position_embeddings: RotaryPair,
        attention_mask: Optional[torch.Tensor] = None, past_key_values: Optional[Cache] = None, **kwargs,
    ) -> torch.Tensor:
        # the context was already normalised by the model's hidden_norm, only the block is
        attn_out, _ = self.self_attn(
            self.input_layernorm(hidden_states), target_hidden, position_embeddings,
            attention_mask=attention_mask, past_key_values=past_key_values, **kwargs,
        )
        hidden_states = hidden_states + attn_out
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """Draft model; its output goes through the *target's* lm_head to become draft logits."""

    config_class = Qwen3Config
    _no_split_modules = ["Qwen3DFlashDecoderLayer"]

    def __init__(self, config) -> None:
        super().__init__(config)
        self.config = config
        dflash_config = getattr(config, "dflash_config", None) or {}
        layer_ids = dflash_config.get("target_layer_ids")
        if layer_ids is None:
            # checkpoints without an explicit list use the evenly spread default
            layer_ids = build_target_layer_ids(config.num_target_layers, config.num_hidden_layers)
        self.target_layer_ids = list(layer_ids)
        self.mask_token_id = dflash_config.get("mask_token_id")
        self.block_size = config.block_size

        width, eps = config.hidden_size, config.rms_norm_eps
        # the concatenated target layers are squeezed back to one hidden state per token
        self.fc = nn.Linear(width * len(self.target_layer_ids), width, bias=False)
        self.hidden_norm = Qwen3RMSNorm(width, eps=eps)
        self.layers = nn.ModuleList(Qwen3DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(width, eps=eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(
        self, position_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
        noise_embedding: Optional[torch.Tensor] = None, target_hidden: Optional[torch.Tensor] = None,
        past_key_values: Optional[Cache] = None, use_cache: bool = False, **kwargs,
    ) -> torch.Tensor:
        """Denoise ``noise_embedding``; ``position_ids`` span the new context and then the block."""
        context = self.hidden_norm(self.fc(target_hidden))
        rope = self.rotary_emb(noise_embedding, position_ids)
        cache = past_key_values if use_cache else None
        x = noise_embedding
        for block in self.layers:
            x = block(x, context, rope, attention_mask=attention_mask, past_key_values=cache, **kwargs)
        return self.norm(x)

    @torch.inference_mode()
    def spec_generate(
        self, target, input_ids: torch.LongTensor, max_new_tokens: int,
        stop_token_ids: Optional[list[int]], temperature: float,
    ) -> torch.LongTensor:
        """Chain speculative decoding with this draft; returns prompt + generated ids."""
        self.eval()
        device = target.device
        width = self.block_size
        prompt_len = input_ids.shape[1]
        limit = prompt_len + max_new_tokens
        tokens = torch.full((1, limit + width), self.mask_token_id, dtype=torch.long, device=device)
        tokens[:, :prompt_len] = input_ids
        positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0)
        stops = None if stop_token_ids is None else torch.tensor(stop_token_ids, device=device)

        target_cache = DynamicCache()
        draft_cache = DynamicCache()

        prefill = target(input_ids, position_ids=positions[:, :prompt_len], past_key_values=target_cache,
                         use_cache=True, logits_to_keep=1, output_hidden_states=True)
        tokens[:, prompt_len] = sample(prefill.logits[:, -1], temperature)
        context = extract_context_feature(prefill.hidden_states, self.target_layer_ids)

        start = prompt_len
        while start < limit:
            block = tokens[:, start : start + width].clone()
            hidden = self(
                position_ids=positions[:, draft_cache.get_seq_length() : start + width],
                noise_embedding=target.model.embed_tokens(block),
                target_hidden=context,
                past_key_values=draft_cache,
                use_cache=True,
            )
            draft_cache.crop(start)
            block[:, 1:] = sample(target.lm_head(hidden[:, 1:]), temperature)

            verify = target(block, position_ids=positions[:, start : start + width], past_key_values=target_cache,
                            use_cache=True, output_hidden_states=True)
            choice = sample(verify.logits, temperature)
            agree = (block[:, 1:] == choice[:, :-1]).long().cumprod(dim=1)
            taken = int(agree.sum()) + 1

            tokens[:, start : start + taken] = block[:, :taken]
            tokens[:, start + taken] = choice[:, taken - 1]
            context = extract_context_feature(verify.hidden_states, self.target_layer_ids)[:, :taken]
            start += taken
            target_cache.crop(start)

            if stops is not None and torch.isin(tokens[0, start - taken + 1 : start + 1], stops).any():
                break

        out = tokens[:, : min(start + 1, limit)]
        if stops is not None:
            hits = torch.isin(out[0, prompt_len:], stops).nonzero()
            if hits.numel():
                out = out[:, : prompt_len + int(hits[0, 0]) + 1]
        return out


__all__ = ["DFlashDraftModel", "Qwen3DFlashAttention", "Qwen3DFlashDecoderLayer"]
