"""Tiny, seeded, offline target models for the verifier and the tests.

Every preset is built from a config with seeded random weights: nothing is downloaded.
Two things make a tiny hybrid model able to expose a state-rollback bug:

* the Gated DeltaNet decay is drawn so that state matters (``A`` uniform in
  [0.01, 0.1], a per-token decay of about 0.9). With transformers' default draw the
  state is forgotten within one token and a broken rollback looks lossless;
* the other stateful families get draws of the same intent (``make_state_matter``): Mamba2
  ``dt`` in [0.5, 1], ``D = 0``, a larger input projection and conv; LFM2 a scaled
  short-conv input projection; KDA the same ``A`` range;
* the mask token can never be the target's greedy choice (its ``lm_head`` row is
  zero while other logits are random), because upstream decoders strip mask tokens
  from their output.

torch and transformers are imported inside the functions so that importing this
module (for ``--help`` or a preset list) stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .trained import FOLDER_PRESETS, load_folder_target

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


#: the vocabulary of tiny-qwen3_5-wide: 48 x HIDDEN, the ratio of a real model's vocabulary to its hidden size
#: (Qwen3.6-27B: 248,320 / 5,120 = 48.5), where a draft scripted in hidden space loses its margins
WIDE_VOCAB = 48 * HIDDEN


def _qwen3_5_wide():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**_text_fields(HYBRID_LAYERS), "vocab_size": WIDE_VOCAB}, **_gdn_fields()))


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


# --------------------------------------------------------------------------------------------
# Other families with a published DFlash drafter, and the stateful families transformers ships
# --------------------------------------------------------------------------------------------
# Every model type below was checked to build and run on transformers 5.23. Layer counts are
# the smallest that still interleave each family's layer kinds.


def _mla_fields() -> dict[str, Any]:  # DeepSeek-V3-style multi-head latent attention
    return dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = _text_fields(["full_attention"] * 4)
    del fields["layer_types"]
    return LlamaForCausalLM(LlamaConfig(**fields))


#: gpt-oss's sliding window in the tiny preset: short, so a verify crosses it within a few rounds.
GPT_OSS_WINDOW = 8


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    fields = _text_fields(["sliding_attention", "full_attention"] * 2)
    return GptOssForCausalLM(
        GptOssConfig(**fields, sliding_window=GPT_OSS_WINDOW, num_local_experts=4, num_experts_per_tok=2)
    )


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    fields = _text_fields(["full_attention"] * 3)
    del fields["layer_types"], fields["head_dim"]
    fields["num_key_value_heads"] = 4
    return DeepseekV3ForCausalLM(
        DeepseekV3Config(
            **fields, **_mla_fields(), moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, first_k_dense_replace=1,
        )
    )


def _glm_moe_dsa():
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    fields = _text_fields(["indexed_attention"] * 3)
    fields.update(num_key_value_heads=4, head_dim=8)
    # index_topk >= the context: on 5.23 a selecting indexer makes a multi-token forward differ from
    # token-by-token decoding (row i depends on later tokens), so no reference could be exact
    return GlmMoeDsaForCausalLM(
        GlmMoeDsaConfig(
            **fields, **_mla_fields(), moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            index_topk=256, index_head_dim=16, index_n_heads=2, first_k_dense_replace=1,
        )
    )


LINEAR_FULL = ["linear_attention", "full_attention"] * 2


def _olmo_hybrid():
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    fields = _text_fields(LINEAR_FULL)
    del fields["head_dim"]
    return OlmoHybridForCausalLM(OlmoHybridConfig(**fields, **_gdn_fields()))


def _kimi_linear():
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    fields = _text_fields(LINEAR_FULL)
    del fields["head_dim"]
    fields["num_key_value_heads"] = 4
    mla = _mla_fields()
    del mla["q_lora_rank"]
    return KimiLinearForCausalLM(
        KimiLinearConfig(
            **fields, **mla, moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
            linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
        )
    )


def _mamba2_fields(prefix: str) -> dict[str, Any]:
    return {f"{prefix}n_heads": 8, f"{prefix}d_state": 16, f"{prefix}d_head": 16, f"{prefix}chunk_size": 16}


def _nemotron_h():
    from transformers import NemotronHConfig, NemotronHForCausalLM

    fields = _text_fields(["mamba", "attention", "mamba", "attention"])
    del fields["num_hidden_layers"], fields["layer_types"]
    return NemotronHForCausalLM(
        NemotronHConfig(
            **fields, layers_block_type=["mamba", "attention", "mamba", "attention"], ssm_state_size=16,
            mamba_num_heads=8, mamba_head_dim=16, n_groups=2, chunk_size=16,
        )
    )


def _granitemoehybrid():
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    fields = _text_fields(["mamba", "attention"] * 2)
    del fields["head_dim"]
    return GraniteMoeHybridForCausalLM(
        GraniteMoeHybridConfig(
            **fields, **_mamba2_fields("mamba_"), num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=64,
        )
    )


def _falcon_h1():
    from transformers import FalconH1Config, FalconH1ForCausalLM

    fields = _text_fields(["hybrid"] * 3)
    del fields["layer_types"]  # every Falcon-H1 layer runs Mamba2 and attention in parallel
    return FalconH1ForCausalLM(
        FalconH1Config(**fields, **_mamba2_fields("mamba_"), mamba_d_ssm=128, ssm_out_multiplier=8.0, attention_out_multiplier=0.25)
    )


def _lfm2():
    from transformers import Lfm2Config, Lfm2ForCausalLM

    fields = _text_fields(["conv", "full_attention"] * 2)
    del fields["head_dim"]
    return Lfm2ForCausalLM(Lfm2Config(**fields))


def _qwen4_exp():
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    # no per-layer n-gram embeddings (ple_layer_ids): only the Gated DeltaNet state and the indexer
    fields = _text_fields(["linear_attention", "indexed_attention"] * 2)
    return Qwen4ExpForCausalLM(
        Qwen4ExpTextConfig(
            **fields, **_gdn_fields(), **_moe_fields(), indexer_n_heads=2, indexer_kv_heads=1,
            indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=1,
        )
    )


def _glm5_next():
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    fields = _text_fields(["linear_attention"] * 3 + ["indexed_attention"])
    fields.update(num_key_value_heads=4, head_dim=8)
    mla = dict(_mla_fields(), qk_rope_head_dim=0, qk_nope_head_dim=16)  # its DSA layers take no RoPE
    text = dict(
        fields, **mla, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, index_topk=256,
        index_head_dim=16, index_n_heads=2, index_kpool=4, linear_head_dim=16, linear_num_heads=4,
    )
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=HIDDEN,
                  projection_intermediate_size=64)
    return Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=vision))


# --------------------------------------------------------------------------------------------
# State that matters
# --------------------------------------------------------------------------------------------
#: Mamba2's per-token step size in the presets (the decay is exp(-A * dt)).
MAMBA2_DT_RANGE = (0.5, 1.0)
#: The per-channel conv's weight spread in the Mamba2 presets (some families init it at 0.02).
MAMBA2_CONV_STD = 0.3
#: How much the presets scale a Mamba2 input projection.
MAMBA2_INPUT_SCALE = 3.0
#: How much the presets scale a short convolution's input projection (LFM2's B, C and x).
SHORT_CONV_INPUT_SCALE = 8.0


def _is_mamba2(module) -> bool:
    return all(hasattr(module, name) for name in ("A_log", "D", "dt_bias", "in_proj"))


def _draw_mamba2(module, gen) -> None:
    """dt in [0.5, 1] (its projection rows zeroed, the bias set), no skip (D = 0), a larger input projection."""
    import torch

    heads = module.dt_bias.shape[0]
    dt = torch.empty(heads).uniform_(*MAMBA2_DT_RANGE, generator=gen)
    module.dt_bias.copy_(torch.log(torch.expm1(dt)).to(module.dt_bias.dtype))  # softplus^-1
    module.D.zero_()
    weight = module.in_proj.weight
    weight.mul_(MAMBA2_INPUT_SCALE)
    weight[-heads:].zero_()  # the last `heads` outputs are dt: it comes from dt_bias alone
    if module.in_proj.bias is not None:
        module.in_proj.bias[-heads:].zero_()
    conv = getattr(module, "conv1d", None)
    if conv is not None and conv.weight.std() < MAMBA2_CONV_STD:
        # x, B and C each pass the conv: an 0.02-std init makes their product (the output) vanish
        conv.weight.mul_(MAMBA2_CONV_STD / conv.weight.std())


def _draw_decay(module, gen) -> None:
    """Gated DeltaNet / KDA: ``A`` uniform in STATEFUL_A_RANGE (a per-token decay of about 0.9)."""
    import torch

    a = torch.empty(module.A_log.shape, dtype=torch.float32).uniform_(*STATEFUL_A_RANGE, generator=gen)
    module.A_log.copy_(a.log().to(module.A_log.dtype))


def _is_short_conv(module) -> bool:
    return type(module).__name__.endswith("ShortConv") and hasattr(module, "in_proj")


def stateful_modules(model) -> list:
    """Modules whose parameters set how long a token stays in a recurrent/conv state."""
    return [m for m in model.modules() if hasattr(m, "A_log") or _is_short_conv(m)]


def make_state_matter(model, seed: int) -> int:
    """Redraw the state parameters of every stateful mixer so that a broken rollback changes the
    greedy output (see the module docstring); returns how many modules were changed."""
    import torch

    gen = torch.Generator().manual_seed(seed + 7919)
    changed = 0
    with torch.no_grad():
        for module in stateful_modules(model):
            if _is_mamba2(module):
                _draw_mamba2(module, gen)
            elif _is_short_conv(module):
                module.in_proj.weight.mul_(SHORT_CONV_INPUT_SCALE)
            else:
                _draw_decay(module, gen)
            changed += 1
    return changed


def gated_deltanet_modules(model) -> list:
    """The Gated DeltaNet token mixers of ``model`` (any module with ``A_log`` and ``layer_idx``)."""
    return [m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "layer_idx")]


def _mid_qwen3_5():
    """A mid-size random hybrid for benchmarks (about 133 M parameters): big enough that matmuls
    and the Gated DeltaNet kernel, not Python overhead, dominate a CPU forward."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    fields = _text_fields(["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"])
    fields.update(hidden_size=1024, intermediate_size=3072, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    gdn = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_num_key_heads=8, linear_num_value_heads=16)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**fields, **gdn))


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    build: Callable[[], Any] = field(repr=False)
    hybrid: bool = True  # has state a crop cannot roll back: the code-shape-only control must fail
    #: Why ddpatch must refuse this model (a word its one-line refusal contains); None: served exactly.
    refusal: str | None = None
    #: (target, draft) folders of a trained pair: verified through ``--target``/``--draft`` (trained.py), unscripted.
    folders: tuple | None = None


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny-qwen3_5", "Qwen3_5ForCausalLM, 6 layers (4 Gated DeltaNet + 2 full attention)", _qwen3_5),
        Preset("tiny-qwen3_5-vlm", "Qwen3_5ForConditionalGeneration (nested text model), same text stack", _qwen3_5_vlm),
        Preset("tiny-qwen3_5-wide", f"tiny-qwen3_5 with a {WIDE_VOCAB:,}-token vocabulary, 48 x its hidden size as in real "
               "models", _qwen3_5_wide),
        Preset("mid-qwen3_5", "Qwen3_5ForCausalLM, 8 layers (6 Gated DeltaNet + 2 full attention), hidden 1024, "
               "~133 M parameters: for benchmarks", _mid_qwen3_5),
        Preset("tiny-qwen3_5-moe", "Qwen3_5MoeForCausalLM, hybrid layers with a 4-expert MoE", _qwen3_5_moe),
        Preset("tiny-qwen3-next", "Qwen3NextForCausalLM, fused GDN projections, 4-expert MoE", _qwen3_next),
        Preset("tiny-qwen3", "Qwen3ForCausalLM, full attention only (the control)", _qwen3, hybrid=False),
        Preset("tiny-llama", "LlamaForCausalLM, full attention only", _llama, hybrid=False),
        Preset("tiny-gpt-oss", f"GptOssForCausalLM, sliding (window {GPT_OSS_WINDOW}) / full attention, sinks, MoE",
               _gpt_oss, hybrid=False),
        Preset("tiny-deepseek-v3", "DeepseekV3ForCausalLM, multi-head latent attention, MoE", _deepseek_v3, hybrid=False),
        Preset("tiny-glm-moe-dsa", "GlmMoeDsaForCausalLM, indexed (sparse) attention, top-4 indexer", _glm_moe_dsa,
               hybrid=False),
        Preset("tiny-olmo-hybrid", "OlmoHybridForCausalLM, Gated DeltaNet / full attention", _olmo_hybrid),
        Preset("tiny-kimi-linear", "KimiLinearForCausalLM, Kimi Delta Attention / MLA", _kimi_linear),
        Preset("tiny-nemotron-h", "NemotronHForCausalLM, Mamba2 (`mixer`) / attention", _nemotron_h),
        Preset("tiny-granitemoehybrid", "GraniteMoeHybridForCausalLM, Mamba2 (`mamba`) / attention, MoE",
               _granitemoehybrid),
        Preset("tiny-falcon-h1", "FalconH1ForCausalLM, Mamba2 and attention in parallel in every layer", _falcon_h1),
        Preset("tiny-lfm2", "Lfm2ForCausalLM, gated short convolution / full attention", _lfm2),
        Preset("tiny-qwen4-exp", "Qwen4ExpForCausalLM, Gated DeltaNet / indexed attention; hyper-connection hidden "
               "states a DFlash draft cannot read (refused)", _qwen4_exp, refusal="hyper-connection"),
        Preset("tiny-glm5-next", "Glm5NextForConditionalGeneration: ignores a 4D mask, 4D hyper-connection hidden "
               "states (refused)", _glm5_next, refusal="hyper-connection"),
        Preset("trained-qwen3_5", "trained pair: Qwen3_5ForCausalLM, 8 layers (6 Gated DeltaNet + 2 full attention), "
               "and its DFlash drafter (block 8), from patcher/data/trained_pair; not scripted",
               lambda: load_folder_target("trained-qwen3_5"), folders=FOLDER_PRESETS["trained-qwen3_5"]),
    )
}


def build_target(name: str, seed: int = 0, dtype: str = "float32", default_init: bool = False):
    """Build the preset's target with seeded weights, in eval mode, on CPU.

    ``default_init`` keeps transformers' own initialisation of the state parameters (no
    ``make_state_matter``): the control on which a broken rollback can look lossless."""
    import torch

    try:
        preset = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
    if preset.folders:  # trained weights: nothing is redrawn
        return preset.build().to(getattr(torch, dtype)).eval()
    torch.manual_seed(seed)
    model = preset.build()
    if not default_init:
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
