"""Tiny, seeded, offline target models for the verifier and the tests.

Every preset is built from a config with seeded random weights: nothing is downloaded.
Two things make a tiny hybrid model able to expose a state-rollback bug:

* the Gated DeltaNet decay is drawn so that state matters (``A`` uniform in
  [0.01, 0.1], a per-token decay of about 0.9). With transformers' default draw the
  state is forgotten within one token and a broken rollback looks lossless;
* the mask token can never be the target's greedy choice (its ``lm_head`` row is
  zero while other logits are random), because upstream decoders strip mask tokens
  from their output.

torch and transformers are imported inside the functions so that importing this
module (for ``--help`` or a preset list) stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

VOCAB = 64
HIDDEN = 64
MASK_TOKEN_ID = VOCAB - 1
#: The decay draw that makes the recurrent state matter (see module docstring).
STATEFUL_A_RANGE = (0.01, 0.1)


def _text_fields(layer_types: list[str]) -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        layer_types=layer_types,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )


def _gdn_fields() -> dict[str, Any]:
    return dict(
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )


# four Gated DeltaNet layers and two full-attention layers, interleaved like Qwen3.5's 3:1 pattern
HYBRID_LAYERS = ["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"]


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = _text_fields(["full_attention"] * 4)
    return Qwen3ForCausalLM(Qwen3Config(**fields, sliding_window=None, use_sliding_window=False))


def _qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_text_fields(HYBRID_LAYERS), **_gdn_fields()))


def _qwen3_5_vlm():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN)
    config = Qwen3_5Config(text_config={**_text_fields(HYBRID_LAYERS), **_gdn_fields()}, vision_config=vision)
    return Qwen3_5ForConditionalGeneration(config)


def _moe_fields() -> dict[str, Any]:
    return dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def _qwen3_5_moe():
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    return Qwen3_5MoeForCausalLM(
        Qwen3_5MoeTextConfig(**_text_fields(HYBRID_LAYERS), **_gdn_fields(), **_moe_fields())
    )


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM(
        Qwen3NextConfig(**_text_fields(HYBRID_LAYERS), **_gdn_fields(), **_moe_fields(), decoder_sparse_step=1)
    )


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    build: Callable[[], Any] = field(repr=False)
    hybrid: bool = True


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny-qwen3_5", "Qwen3_5ForCausalLM, 6 layers (4 Gated DeltaNet + 2 full attention)", _qwen3_5),
        Preset("tiny-qwen3_5-vlm", "Qwen3_5ForConditionalGeneration (nested text model), same text stack", _qwen3_5_vlm),
        Preset("tiny-qwen3_5-moe", "Qwen3_5MoeForCausalLM, hybrid layers with a 4-expert MoE", _qwen3_5_moe),
        Preset("tiny-qwen3-next", "Qwen3NextForCausalLM, fused GDN projections, 4-expert MoE", _qwen3_next),
        Preset("tiny-qwen3", "Qwen3ForCausalLM, full attention only (the control)", _qwen3, hybrid=False),
    )
}


def gated_deltanet_modules(model) -> list:
    """The Gated DeltaNet token mixers of ``model`` (any module with ``A_log`` and ``layer_idx``)."""
    return [m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "layer_idx")]


def make_state_matter(model, seed: int, low: float = STATEFUL_A_RANGE[0], high: float = STATEFUL_A_RANGE[1]) -> int:
    """Redraw every GDN layer's ``A`` uniformly in [low, high]; returns how many layers were changed."""
    import torch

    gen = torch.Generator().manual_seed(seed + 7919)
    layers = gated_deltanet_modules(model)
    with torch.no_grad():
        for module in layers:
            a = torch.empty(module.A_log.shape, dtype=torch.float32).uniform_(low, high, generator=gen)
            module.A_log.copy_(a.log().to(module.A_log.dtype))
    return len(layers)


def build_target(name: str, seed: int = 0, dtype: str = "float32"):
    """Build the preset's target with seeded weights, in eval mode, on CPU."""
    import torch

    try:
        preset = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
    torch.manual_seed(seed)
    model = preset.build()
    make_state_matter(model, seed)
    with torch.no_grad():
        model.get_output_embeddings().weight[MASK_TOKEN_ID].zero_()
    model = model.to(getattr(torch, dtype)).eval()
    return model


def text_config(model):
    """The decoder text config, also for composite (vision-language) configs."""
    return model.config.get_text_config(decoder=True)


def draft_config(target, config_class, num_layers: int = 1, block_size: int = 4, sliding_window: int | None = None):
    """A DFlash-style draft config that fits ``target``: same hidden size and vocab, conditioned on
    ``num_layers`` target layers, with ``dflash_config`` carrying the mask token and layer ids."""
    tc = text_config(target)
    n_target = tc.num_hidden_layers
    layer_ids = [min(n_target - 1, 1 + i * max(1, (n_target - 2) // max(1, num_layers))) for i in range(num_layers)]
    layer_types = ["full_attention"] * num_layers
    extra: dict[str, Any] = {}
    if sliding_window is not None:
        layer_types = ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
        extra = dict(sliding_window=sliding_window, use_sliding_window=True)
    cfg = config_class(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        layer_types=layer_types,
        **extra,
    )
    cfg.block_size = block_size
    cfg.num_target_layers = n_target
    cfg.dflash_config = {"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": layer_ids}
    return cfg
