#!/usr/bin/env python3
"""transformers' own speculative ``generate()`` on a Qwen3.5 hybrid is not lossless: a standalone reproduction.

Depends only on torch and transformers (no ddpatch, nothing downloaded), so it can be attached to an
upstream report as it is. It builds a tiny seeded Qwen3.5 hybrid from a config (4 Gated DeltaNet + 2 full
attention layers; the GDN decay ``A`` is drawn in [0.01, 0.1], a per-token decay of about 0.9, so that the
recurrent state matters: with the default draw the state is forgotten within a token and a wrong rollback
hides), then, per prompt, in float32 on CPU:

* plain greedy ``generate()``: the reference;
* greedy ``generate(prompt_lookup_num_tokens=3)`` and ``generate(assistant_model=...)`` (a tiny seeded
  full-attention Qwen3 with the same vocabulary): speculative decoding, which must give the same tokens;
* at the first divergent new token, the margin by which the target's OWN from-scratch forward (no cache,
  over the shared prefix) prefers the reference's token to the speculative one; and the float32 noise floor:
  the largest |logit difference| between plain ``generate()``'s cached logits and a from-scratch forward over
  the same sequence. A margin far above the floor is not rounding: the speculative run fed the target a
  wrong recurrent state.

Exit status: 1 the loss reproduces (some mode diverges), 0 native ``generate()`` is exact in every mode run,
2 this transformers release refuses the speculative modes on stateful models (5.23 and older:
"assisted generation is not supported with stateful models"), 3 something else failed.

``--with-fix`` first applies the candidate fix (``apply_candidate_fix``: record one more recurrent state than
there are draft tokens); with it, every run here is token-identical.

    python3 benchmarks/repro_native_assisted_generate.py [--json] [--with-fix] [--new-tokens 24] [--prompts 2]
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys

import torch
import transformers

VOCAB = 64
#: the last id never wins a greedy choice (its lm_head row is zeroed), as in ddpatch's presets
MASK_TOKEN_ID = VOCAB - 1
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"]
LOOKUP_TOKENS = 3
MODES = ("prompt-lookup", "assistant")


def _fields(layer_types):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                tie_word_embeddings=False, layer_types=layer_types, eos_token_id=None, pad_token_id=None,
                bos_token_id=None)


def build_target(seed: int = 0):
    """The tiny Qwen3.5 hybrid, seeded (the same weights as ddpatch's ``tiny-qwen3_5`` preset)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(**_fields(LAYER_TYPES), linear_conv_kernel_dim=4, linear_key_head_dim=16,
                               linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    model = Qwen3_5ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed + 7919)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log"):  # a Gated DeltaNet layer: decay exp(-A * dt) near 0.9, state matters
                a = torch.empty(module.A_log.shape, dtype=torch.float32).uniform_(0.01, 0.1, generator=gen)
                module.A_log.copy_(a.log().to(module.A_log.dtype))
        model.get_output_embeddings().weight[MASK_TOKEN_ID].zero_()
    return model.to(torch.float32).eval()


def build_assistant(seed: int = 100):
    """A tiny full-attention Qwen3 with the target's vocabulary (no state of its own), drafting LOOKUP_TOKENS
    tokens every round: a random assistant is unsure of its tokens, and with the default confidence threshold
    (0.4) it would stop after one token, which hides the bug (see ``--with-fix``)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**_fields(["full_attention"] * 4), sliding_window=None,
                                         use_sliding_window=False)).to(torch.float32).eval()
    model.generation_config.num_assistant_tokens = LOOKUP_TOKENS
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.0
    return model


def repeated_prompt(seed: int) -> torch.Tensor:
    """A prompt whose n-grams repeat, so that prompt lookup finds candidates."""
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, MASK_TOKEN_ID, (5,), generator=gen)
    return torch.cat([motif, motif, motif[:3], motif, motif[:4]])[None]


def greedy(model, ids, new_tokens: int, **kwargs) -> list[int]:
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


# The same computation as ddpatch's `verify --generate` native-control row (patcher/verify/judge/generate_mode.py,
# `native_divergence`), duplicated on purpose: this script must run without ddpatch installed, so that it can be
# attached to a transformers report. Keep the two in step.
@torch.no_grad()
def first_divergence(model, prompt: list[int], expected: list[int], got: list[int]) -> dict | None:
    """None when ``got == expected``; else the first divergent new token (0-based), both tokens, and the margin
    ``z[expected] - z[got]`` of the target's own from-scratch forward (no cache) over the shared prefix."""
    i = next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    if i is None:
        if len(expected) == len(got):
            return None
        i = min(len(expected), len(got))
    row = {"new_token": i, "expected": expected[i] if i < len(expected) else None,
           "got": got[i] if i < len(got) else None, "margin": None, "from_scratch_argmax": None}
    if row["expected"] is not None and row["got"] is not None:
        device = model.get_input_embeddings().weight.device
        z = model(torch.tensor([prompt + expected[:i]], device=device), use_cache=False).logits[0, -1].float()
        row["from_scratch_argmax"] = int(z.argmax())
        row["margin"] = float(z[row["expected"]] - z[row["got"]])
    return row


@torch.no_grad()
def noise_floor(model, ids, new_tokens: int) -> float:
    """max |plain generate()'s cached logits - one from-scratch forward's| over the new positions: two exact
    computations of the same logits, so the float rounding a real divergence must stand clear of."""
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    cached = torch.stack([step[0] for step in out.logits]).float()  # [new, vocab]: logits that chose new token k
    scratch = model(out.sequences, use_cache=False).logits[0, ids.shape[1] - 1:-1].float()
    return float((cached - scratch).abs().max())


def apply_candidate_fix() -> None:
    """The fix this reproduction points at (``--with-fix``): record one more recurrent state than there are draft
    tokens. ``_assisted_decoding`` calls ``cache.activate_past_recording(recurrent_states_to_keep=k)`` with k = the
    number of draft tokens; a verify forward over the last token and k candidates (k + 1 tokens) then keeps the
    state from before the forward plus the states after its last k - 1 tokens, so ``crop(-k)`` (every candidate
    rejected) restores the state from BEFORE the forward: one token too far back (after a prefill, the empty state)."""
    from transformers import cache_utils

    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    if mixin is None or "recurrent_states_to_keep" not in inspect.signature(mixin.activate_past_recording).parameters:
        raise SystemExit(f"--with-fix: transformers {transformers.__version__} records no recurrent-state history to fix")
    original = mixin.activate_past_recording

    def activate_past_recording(self, recurrent_states_to_keep=None):
        return original(self, None if recurrent_states_to_keep is None else recurrent_states_to_keep + 1)

    mixin.activate_past_recording = activate_past_recording


def refused(exc: Exception) -> bool:
    return isinstance(exc, ValueError) and "stateful" in str(exc)


def run(new_tokens: int, prompts: int, modes) -> dict:
    target = build_target(0)
    assistant = build_assistant() if "assistant" in modes else None
    mode_kwargs = {"prompt-lookup": {"prompt_lookup_num_tokens": LOOKUP_TOKENS}, "assistant": {"assistant_model": assistant}}
    result = {"transformers": transformers.__version__, "torch": torch.__version__, "dtype": "float32",
              "new_tokens": new_tokens, "model": "Qwen3_5ForCausalLM, 4 Gated DeltaNet + 2 full attention, seeded",
              "runs": []}
    for p in range(prompts):
        ids = repeated_prompt(p)
        reference = greedy(target, ids, new_tokens)
        floor = noise_floor(target, ids, new_tokens)
        for mode in modes:
            run_ = {"prompt": p, "mode": mode, "noise_floor": floor}
            try:
                got = greedy(target, ids, new_tokens, **mode_kwargs[mode])
            except Exception as exc:  # noqa: BLE001 - a refusal is an outcome, anything else is reported
                run_.update(status="refused" if refused(exc) else "error", error=f"{type(exc).__name__}: {exc}")
            else:
                div = first_divergence(target, ids[0].tolist(), reference, got)
                run_.update(status="exact" if div is None else "diverges", divergence=div)
            result["runs"].append(run_)
    statuses = {r["status"] for r in result["runs"]}
    result["outcome"] = ("error" if "error" in statuses else "lossy" if "diverges" in statuses
                         else "refused" if "refused" in statuses else "exact")
    return result


EXIT = {"lossy": 1, "exact": 0, "refused": 2, "error": 3}


def describe(result: dict) -> str:
    lines = [f"transformers {result['transformers']}, torch {result['torch']}, {result['dtype']}, CPU; "
             f"{result['model']}; {result['new_tokens']} new tokens"
             + ("; with the candidate fix (one more recurrent state recorded)" if result.get("with_fix") else "")]
    for r in result["runs"]:
        head = f"prompt {r['prompt']} {r['mode']:>13}: "
        if r["status"] == "exact":
            lines.append(head + f"token-identical to plain greedy generate() (noise floor {r['noise_floor']:.1e})")
        elif r["status"] == "diverges":
            d = r["divergence"]
            margin = (f"; from-scratch margin {d['margin']:.2e} for the greedy token (from-scratch argmax {d['from_scratch_argmax']}),"
                      f" noise floor {r['noise_floor']:.1e}" if d["margin"] is not None else "")
            lines.append(head + f"diverges at new token {d['new_token']}: greedy {d['expected']}, speculative {d['got']}" + margin)
        else:
            lines.append(head + f"{r['status']}: {r['error']}")
    verdict = {"lossy": "REPRODUCED: speculative generate() is not token-identical to greedy generate()",
               "exact": "not reproduced: speculative generate() is token-identical to greedy generate()",
               "refused": f"transformers {result['transformers']} refuses speculative generate() on stateful models",
               "error": "a run failed (see above)"}[result["outcome"]]
    return "\n".join(lines + [verdict])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--with-fix", action="store_true",
                        help="first patch transformers' recording to keep one more recurrent state (the candidate fix)")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    if args.with_fix:
        apply_candidate_fix()
    result = run(args.new_tokens, args.prompts, modes)
    result["with_fix"] = args.with_fix
    print(json.dumps(result, indent=2) if args.json else describe(result))
    return EXIT[result["outcome"]]


if __name__ == "__main__":
    sys.exit(main())
