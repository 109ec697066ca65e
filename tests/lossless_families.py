"""The model families ``lossless`` is checked on, built the way transformers builds them, tiny and seeded.

Every family of docs/models.md and every family transformers ships with a stateful cache, in up to three
shapes:

* ``default``: the configuration class's own defaults, shrunk in size only: the widths (hidden size, heads,
  experts, state sizes, vocabulary) are set small, the layer pattern is the default one, cut after the layer
  where the last kind of layer first appears (at least ``MIN_LAYERS``). NemotronH's default puts a MoE block
  before its first attention layer; Bamba's and GraniteMoeHybrid's default has no attention layer at all;
* ``preset``: ddpatch's own preset (``patcher.verify.models.presets``), where there is one;
* ``real``: a pattern a published checkpoint uses, where the default and the preset both miss its shape
  (NemotronH: ``-`` (MLP) and ``E`` (MoE) blocks before the first ``*`` (attention); Bamba: attention layers
  among Mamba2 ones, where its default has none).

Weights are seeded and drawn so that state matters (``make_state_matter``), and the mask token's
``lm_head`` row is zero, as for the presets. A family this transformers does not ship is left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the widths every family's defaults are shrunk to (only the fields its configuration has)
SMALL = dict(
    vocab_size=64, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, moe_shared_expert_intermediate_size=16,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, num_experts_per_token=2,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
    n_groups=2, mamba_n_groups=2, chunk_size=16, mamba_chunk_size=16, max_position_embeddings=512,
    pad_token_id=None, bos_token_id=None, eos_token_id=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
    qk_head_dim=16, v_head_dim=16, linear_head_dim=16, linear_num_heads=4, mamba_d_ssm=128, time_step_rank=8,
    index_head_dim=16, index_n_heads=2, num_expert_group=1, topk_group=1, n_group=1, shared_intermediate_size=32,
    router_hidden_size=16, attention_hidden_size=128, attention_head_dim=32, mamba_dt_rank=8, embedding_dim=64,
    num_heads=4, context_length=512, lru_width=64, model_max_length=512, ple_embed_dim=16, hc_lowrank=8,
    index_topk=256, q_lora_rank=32,
)
#: what one family's defaults need besides SMALL (a constraint between its widths, or a tiny-size bug)
FAMILY_SIZES = {
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=2, state_size=16),
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=1),
    "zamba2": dict(n_mamba_heads=8, mamba_headdim=16, num_query_groups=2, kv_channels=16, adapter_rank=8, mamba_ngroups=1),
    "zamba": dict(n_mamba_heads=2),
    "zaya": dict(num_experts_per_tok=1),
    "rwkv": dict(attention_hidden_size=64, intermediate_size=128, rescale_every=0),
    "xlstm": dict(qk_dim_factor=1.0),  # its own cache has the wrong shape for qk != v dims at this size
    "kimi_linear": dict(num_key_value_heads=4, q_lora_rank=None),
    "bailing_hybrid": dict(num_key_value_heads=4, q_lora_rank=None),
    "glm_moe_dsa": dict(num_key_value_heads=4, head_dim=8),
    "deepseek_v3": dict(num_key_value_heads=4, n_group=1, topk_group=1, head_dim=8),
}
MIN_LAYERS = {"zamba": 9}  # its shared attention block is tied across two hybrid layers
INDEX_LISTS = ("hybrid_layer_ids", "full_attn_idxs", "attn_layer_indices", "time_step_limit")
#: NemotronH's published layouts: M Mamba2, - MLP, E MoE, * attention (the 8B pattern, then a MoE one)
NEMOTRON_REAL = "M-M-M-M*-M-ME"
_NEMOTRON_BLOCKS = {"M": "mamba", "-": "mlp", "E": "moe", "*": "attention"}


@dataclass(frozen=True)
class Family:
    model_type: str  # the configuration's model_type (a text config's, for composite models)
    preset: str | None = None  # ddpatch's preset of this family
    in_docs: bool = False  # listed in docs/models.md
    extra: dict = field(default_factory=dict)  # shape name -> configuration overrides of that shape


FAMILIES = {f.model_type: f for f in (
    Family("qwen3_5_text", "tiny-qwen3_5", True), Family("qwen3_5_moe_text", "tiny-qwen3_5-moe", True),
    Family("qwen3_next", "tiny-qwen3-next", True), Family("olmo_hybrid", "tiny-olmo-hybrid", True),
    Family("kimi_linear", "tiny-kimi-linear", True),
    Family("nemotron_h", "tiny-nemotron-h", True, {"real": {"layers_block_type": [_NEMOTRON_BLOCKS[c] for c in NEMOTRON_REAL]}}),
    Family("granitemoehybrid", "tiny-granitemoehybrid", True), Family("falcon_h1", "tiny-falcon-h1", True),
    Family("lfm2", "tiny-lfm2", True), Family("gpt_oss", "tiny-gpt-oss", True), Family("glm_moe_dsa", "tiny-glm-moe-dsa", True),
    Family("deepseek_v3", "tiny-deepseek-v3", True), Family("llama", "tiny-llama", True), Family("qwen3", "tiny-qwen3", True),
    Family("qwen4_exp_text", "tiny-qwen4-exp", True), Family("glm5_next_text", "tiny-glm5-next", True),
    Family("bailing_hybrid"), Family("bamba", extra={"real": {"num_hidden_layers": 4, "attn_layer_indices": [2]}}), Family("falcon_mamba"), Family("inkling_text"), Family("inkling2_text"),
    Family("inkling2_loop_text"), Family("jamba"), Family("lara_mini"), Family("lfm2_moe"), Family("lfm3"),
    Family("mamba"), Family("mamba2"), Family("zamba"), Family("zamba2"), Family("zaya"), Family("xlstm"), Family("rwkv"),
    Family("recurrent_gemma"),
)}


def shipped(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def shapes(model_type: str) -> list[str]:
    family = FAMILIES[model_type]
    return ["default"] + (["preset"] if family.preset else []) + list(family.extra)


def build(model_type: str, shape: str = "default", seed: int = 0):
    """The family's model in ``shape``, seeded, float32, eval mode, on CPU."""
    import torch

    from patcher.verify.models.presets import MASK_TOKEN_ID, build_target, make_state_matter

    family = FAMILIES[model_type]
    if shape == "preset":
        return build_target(family.preset, seed=seed)
    cls = _model_class(model_type)
    config = default_config(model_type, **family.extra.get(shape, {}))
    torch.manual_seed(seed)
    model = cls(config)
    make_state_matter(model, seed)
    with torch.no_grad():
        model.get_output_embeddings().weight[MASK_TOKEN_ID].zero_()
    return model.eval()


def default_config(model_type: str, **overrides):
    """The configuration class's defaults, shrunk in size (SMALL, FAMILY_SIZES), the layer pattern cut short."""
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]()
    text = defaults.get_text_config(decoder=True)
    fields = text.to_dict()
    sizes = {**SMALL, **FAMILY_SIZES.get(model_type.removesuffix("_text"), {})}
    small = {k: v for k, v in sizes.items() if k in fields}
    n = fields.get("num_hidden_layers")
    if n:
        keep = min(n, max(MIN_LAYERS.get(model_type, 2), _pattern_prefix(text, fields, n)))
        small["num_hidden_layers"] = keep
        for key, value in fields.items():
            if isinstance(value, list) and key not in INDEX_LISTS:
                if len(value) == n:
                    small[key] = value[:keep]
            elif isinstance(value, list):
                small[key] = [i for i in value if not isinstance(i, int) or i < keep] if key != "time_step_limit" else value
        if "num_blocks" in fields:
            small["num_blocks"] = keep
    small.update(overrides)
    if "layers_block_type" in overrides:  # a pattern of its own: its length is the depth
        small["num_hidden_layers"] = len(overrides["layers_block_type"])
        small.pop("layer_types", None)
        fields.pop("layer_types", None)
    return type(text)(**{**fields, **small})


def _pattern_prefix(text, fields: dict, n: int) -> int:
    """Layers up to the one where the last kind of layer (its layer type and every per-layer setting) first appears."""
    columns = [v for k, v in fields.items() if isinstance(v, list) and len(v) == n and k not in INDEX_LISTS
               and not all(isinstance(x, int) for x in v)]
    layer_types = getattr(text, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) == n:
        columns.append(layer_types)
    if not columns:
        return n
    first: dict = {}
    for i, kind in enumerate(zip(*columns)):
        first.setdefault(kind, i)
    return max(first.values()) + 1


def _model_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(
        model_type.removesuffix("_text"))
    if name is None:
        raise LookupError(f"transformers has no causal-LM class for {model_type}")
    return getattr(transformers, name)
