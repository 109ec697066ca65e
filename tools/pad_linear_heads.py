"""A copy of a Qwen3.5 (Gated DeltaNet + attention) checkpoint whose linear-attention heads are zero-padded
to a wider head dimension, computing the same function up to the one shared epsilon (below).

vLLM's CPU Gated DeltaNet kernel takes head dims 64 or 128 only; the shipped trained target has 32. The
padded copy is for serving it there (tests/test_engine_vllm.py, docs/engines.md):

    python3 tools/pad_linear_heads.py patcher/data/trained_pair/target /tmp/target-hd64 --head-dim 64

Why the copy is the same model (every step follows the layer's own forward in transformers' qwen3_5):

- ``in_proj_qkv`` rows, the depthwise ``conv1d`` channels over them, and ``in_proj_z`` rows gain zero rows
  at the end of every head (q and k heads of ``linear_key_head_dim``, v and z heads of
  ``linear_value_head_dim``); the conv of a zero channel is zero, and its SiLU too. ``out_proj`` gains zero
  columns at the same places, so the padded outputs are never read.
- The L2 norms of q and k see the same sum of squares. The recurrent state's padded rows and columns stay
  zero. The one change is the kernel's query scale ``head_k_dim ** -0.5``: the output is
  ``sqrt(old_k / new_k)`` times the original.
- The gated RMS norm then sees a variance smaller by ``f = (old_k / new_k) * (old_v / new_v)`` (the scale
  squared, and the mean over zero-padded entries). With its epsilon multiplied by ``f`` too, the
  normalised value is ``sqrt(new_v / old_v)`` times the original; its weight times ``sqrt(old_v / new_v)``
  undoes that. This norm runs with a variance far below its epsilon here, so the epsilon must scale.
- The epsilon is ``rms_norm_eps``, which the model's other RMS norms read too (one config value for all, in
  transformers and in vLLM): theirs is the one change that is not exact. On the shipped target the logits
  move by up to 0.0044 and every greedy token stays; with the other norms' epsilon put back, by float32
  rounding alone (tests/test_engine_vllm.py measures both).

Only the linear-attention layers change (A_log, dt_bias, in_proj_a/b are per head, and the head counts
stay). The drafter is not touched: it reads the target's hidden states, which the copy keeps.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SUPPORTED = ("qwen3_5_text", "qwen3_5")


def _pad_rows(weight: torch.Tensor, heads: int, old: int, new: int) -> torch.Tensor:
    """``weight``'s first axis is ``heads`` blocks of ``old`` rows: each block gets ``new - old`` zero rows after it."""
    shaped = weight.reshape(heads, old, *weight.shape[1:])
    pad = torch.zeros(heads, new - old, *weight.shape[1:], dtype=weight.dtype)
    return torch.cat([shaped, pad], dim=1).reshape(heads * new, *weight.shape[1:])


def _pad_qkv(weight: torch.Tensor, cfg: dict, new: int) -> torch.Tensor:
    """The q, k and v blocks of the fused projection (or of the conv's channels), each head padded."""
    nk, nv, dk, dv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    q, k, v = torch.split(weight, [nk * dk, nk * dk, nv * dv], dim=0)
    return torch.cat([_pad_rows(q, nk, dk, new), _pad_rows(k, nk, dk, new), _pad_rows(v, nv, dv, new)], dim=0)


def text_config(config: dict) -> dict:
    """The config that holds the linear-attention sizes (a multimodal config nests it under ``text_config``)."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def padded_tensors(tensors: dict[str, torch.Tensor], cfg: dict, new: int) -> dict[str, torch.Tensor]:
    nv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    out, touched = {}, 0
    for name, t in tensors.items():
        if ".linear_attn." not in name:
            out[name] = t
            continue
        leaf = name.split(".linear_attn.", 1)[1]
        if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
            t = _pad_qkv(t, cfg, new)
        elif leaf == "in_proj_z.weight":
            t = _pad_rows(t, nv, dv, new)
        elif leaf == "out_proj.weight":
            t = _pad_rows(t.t(), nv, dv, new).t().contiguous()
        elif leaf == "norm.weight":
            t = torch.cat([t, torch.zeros(new - dv, dtype=t.dtype)]) * math.sqrt(dv / new)
        elif leaf not in ("A_log", "dt_bias", "in_proj_a.weight", "in_proj_b.weight"):
            raise ValueError(f"{name}: a linear-attention weight this tool does not know how to pad")
        touched += 1
        out[name] = t.contiguous()
    if not touched:
        raise ValueError("no linear-attention weights (*.linear_attn.*) in the checkpoint")
    return out


def pad_checkpoint(src: Path, dst: Path, head_dim: int = 64) -> dict:
    """Write the padded copy of the model folder ``src`` to ``dst`` (created; tokenizer and other files copied).
    Returns what changed."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    cfg = text_config(config)
    if config.get("model_type") not in SUPPORTED and cfg.get("model_type") not in SUPPORTED:
        raise ValueError(f"{src}: model_type {config.get('model_type')!r}, not one of {SUPPORTED}")
    old_k, old_v = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if head_dim < max(old_k, old_v):
        raise ValueError(f"--head-dim {head_dim} is below the model's ({old_k}, {old_v}): this tool only widens")
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{src}: no *.safetensors")
    factor = (old_k / head_dim) * (old_v / head_dim)
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy2(path, dst / path.name)
    for path in weights:
        save_file(padded_tensors(load_file(str(path)), cfg, head_dim), str(dst / path.name), metadata={"format": "pt"})
    old_eps = cfg["rms_norm_eps"]
    cfg.update(linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, rms_norm_eps=old_eps * factor)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"head_dim": [old_k, old_v, head_dim], "rms_norm_eps": [old_eps, cfg["rms_norm_eps"]],
            "gated_norm_weight_scale": math.sqrt(old_v / head_dim)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)
    try:
        summary = pad_checkpoint(args.src, args.dst, args.head_dim)
    except (OSError, ValueError, KeyError) as exc:
        print(f"pad_linear_heads: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
