"""The verifier's child process: imports the patched tree, loads the models, decodes, checks.

It runs in its own process (``python -m patcher.verify_worker``), started by
``ddpatch verify`` with a timeout, because it executes upstream code: the tree's
generic module names (``model``, ``dflash``) stay out of the CLI's ``sys.path``, a hang
or crash cannot take the CLI with it, and nothing is written: bytecode writing is off,
the working directory is a temporary folder, and models load with
``local_files_only=True``.

It prints one JSON object per line: ``{"event": "progress", ...}`` while it works and a
final ``{"event": "result", ...}``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENTRY_POINTS = ("dflash_generate", "ddtree_generate", "DFlashDraftModel")

#: (text found in an error, recipe step that fixes it)
HINTS = (
    ("No module named 'datasets'", "lazy-datasets"),
    ("no attribute 'embed_tokens'", "input-embeddings"),
    ("get_conv_state", "target-cache-config"),
    ("list index out of range", "target-cache-config"),
    ("has no attribute 'update'", "target-cache-config (a draft cache was given the target's config)"),
    ("positive value", "crop-compat"),
    ("does not track past states", "crop-compat"),
    ("Torch not compiled with CUDA", "cpu-safe-timing"),
    ("CUDA", "cpu-safe-timing"),
    ("flash_attn", "attn-fallback"),
)


def emit(event: str, **payload: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **payload}) + "\n")
    sys.stdout.flush()


def hint_for(message: str) -> str | None:
    for needle, step in HINTS:
        if needle in message:
            return step
    return None


def error_summary(exc: BaseException) -> dict:
    """The exception, its last frame, and the recipe step it points at."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    message = f"{type(exc).__name__}: {exc}".strip()
    return {
        "error": message.splitlines()[0][:500],
        "frame": f"{last.filename}:{last.lineno} in {last.name}" if last else None,
        "hint": hint_for(message + "".join(traceback.format_tb(exc.__traceback__))),
    }


# ----------------------------------------------------------------------------- the tree
def find_entry_points(tree: Path) -> dict[str, str]:
    """Module name defining each entry point, from a static scan (nothing is imported)."""
    found: dict[str, str] = {}
    for path in sorted(tree.rglob("*.py")):
        rel = path.relative_to(tree)
        if any(part.startswith(".") or part in ("tests", "build", "__pycache__") for part in rel.parts):
            continue
        try:
            module = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        names = {n.name for n in module.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        dotted = ".".join(rel.with_suffix("").parts)
        if dotted.endswith(".__init__"):
            dotted = dotted[: -len(".__init__")]
        for name in ENTRY_POINTS:
            if name in names:
                found.setdefault(name, dotted)
    return found


def import_entry_points(tree: Path, modules: dict[str, str]) -> dict[str, Any]:
    sys.path.insert(0, str(tree))
    return {name: getattr(importlib.import_module(module), name) for name, module in modules.items()}


# ----------------------------------------------------------------------------- models
DRAFT_WINDOW = 16


def load_preset(name: str, seed: int, draft_cls, block_size: int):
    import torch

    from .presets import MASK_TOKEN_ID, build_target, draft_config

    target = build_target(name, seed=seed)
    torch.manual_seed(seed + 1)
    # two layers, the first a sliding-window one as in Qwen3.6 drafters, with a window the prompts outgrow
    cfg = draft_config(target, draft_cls.config_class, num_layers=2, block_size=block_size, sliding_window=DRAFT_WINDOW)
    draft = draft_cls(cfg).eval()
    return target, draft, MASK_TOKEN_ID


def load_real(cfg: dict, draft_cls):
    import torch
    from transformers import AutoModelForCausalLM

    for key in ("target", "draft"):
        if not Path(cfg[key]).exists():
            raise FileNotFoundError(f"--{key} {cfg[key]} does not exist")
    dtype = getattr(torch, cfg.get("dtype") or "bfloat16")
    common = dict(dtype=dtype, local_files_only=True, trust_remote_code=bool(cfg.get("trust_remote_code")))
    if cfg.get("device_map"):
        common["device_map"] = cfg["device_map"]
    target = AutoModelForCausalLM.from_pretrained(
        cfg["target"], attn_implementation=cfg.get("attn_implementation") or "sdpa", **common
    ).eval()
    draft = draft_cls.from_pretrained(cfg["draft"], attn_implementation=cfg.get("draft_attn_implementation") or "sdpa", **common)
    if not cfg.get("device_map"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        target, draft = target.to(device), draft.to(device)
    else:
        draft = draft.to(target.get_input_embeddings().weight.device)
    return target, draft.eval(), getattr(draft, "mask_token_id", None)


def check_fit(target, draft) -> None:
    """A clear error when the draft was not made for this target."""
    tc = target.config.get_text_config(decoder=True)
    dc = draft.config
    problems = []
    if getattr(dc, "hidden_size", None) != tc.hidden_size:
        problems.append(f"hidden size {dc.hidden_size} vs target {tc.hidden_size}")
    ids = list(getattr(draft, "target_layer_ids", []) or [])
    if ids and max(ids) >= tc.num_hidden_layers:
        problems.append(f"target_layer_ids {ids} beyond the target's {tc.num_hidden_layers} layers")
    if getattr(draft, "mask_token_id", None) is not None and draft.mask_token_id >= tc.vocab_size:
        problems.append(f"mask token {draft.mask_token_id} outside the target's vocabulary of {tc.vocab_size}")
    if problems:
        raise ValueError("draft does not fit the target: " + "; ".join(problems))


# ----------------------------------------------------------------------------- the reference
def greedy(target, prompt, max_new_tokens: int, stop_ids=(), use_cache: bool = True) -> list[int]:
    """The target's own greedy decoding, one token at a time (the oracle's reference)."""
    import torch
    from transformers import DynamicCache

    ids = prompt.clone()
    out: list[int] = []
    with torch.inference_mode():
        if use_cache:
            cache = DynamicCache(config=target.config)
            logits = target(ids, past_key_values=cache, use_cache=True).logits
        else:
            logits = target(ids, use_cache=False).logits
        for _ in range(max_new_tokens):
            token = int(logits[0, -1].argmax())
            out.append(token)
            if token in stop_ids:
                break
            step = torch.tensor([[token]], device=ids.device)
            if use_cache:
                logits = target(step, past_key_values=cache, use_cache=True).logits
            else:
                ids = torch.cat([ids, step], dim=1)
                logits = target(ids, use_cache=False).logits
    return out


def multi_token_consistent(target, prompt, continuation: list[int]) -> tuple[bool, float]:
    """A multi-token forward from a cache must equal token-by-token decoding from it."""
    import torch
    from transformers import DynamicCache

    cont = torch.tensor([continuation], device=prompt.device)
    with torch.inference_mode():
        a = DynamicCache(config=target.config)
        target(prompt, past_key_values=a, use_cache=True)
        block = target(cont, past_key_values=a, use_cache=True).logits[0].float()
        b = DynamicCache(config=target.config)
        target(prompt, past_key_values=b, use_cache=True)
        steps = [target(cont[:, i : i + 1], past_key_values=b, use_cache=True).logits[0, -1].float() for i in range(cont.shape[1])]
    steps_t = torch.stack(steps)
    same = bool((block.argmax(-1) == steps_t.argmax(-1)).all())
    return same, float((block - steps_t).abs().max())


# ----------------------------------------------------------------------------- calling upstream
def call_generate(fn, *, model, target, input_ids, mask_token_id, max_new_tokens, block_size, stop_token_ids, tree_budget=None):
    """Call a dflash_generate / ddtree_generate of either upstream layout by keyword."""
    params = inspect.signature(fn).parameters
    kwargs = dict(
        model=model,
        target=target,
        input_ids=input_ids,
        mask_token_id=mask_token_id,
        max_new_tokens=max_new_tokens,
        block_size=block_size,
        stop_token_ids=stop_token_ids,
        temperature=0.0,
        tree_budget=tree_budget,
        return_stats=True,
    )
    kwargs = {k: v for k, v in kwargs.items() if k in params and (v is not None or k == "stop_token_ids")}
    start = time.perf_counter()
    result = fn(**kwargs)
    elapsed = time.perf_counter() - start
    if hasattr(result, "output_ids"):
        output_ids, n_in = result.output_ids, getattr(result, "num_input_tokens", input_ids.shape[1])
        acceptance = list(getattr(result, "acceptance_lengths", []) or [])
    else:
        output_ids, n_in, acceptance = result, input_ids.shape[1], []
    new = [int(t) for t in output_ids[0, n_in:].tolist()]
    return new, [int(a) for a in acceptance], elapsed


@dataclass
class MethodStats:
    name: str
    tokens: int = 0
    seconds: float = 0.0
    acceptance: list[int] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)

    def as_dict(self, baseline: "MethodStats | None") -> dict:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        out = {
            "method": self.name,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_s": round(tps, 2),
            "identical_runs": sum(r["verdict"]["identical"] for r in self.runs),
            "runs": self.runs,
        }
        if self.acceptance:
            hist: dict[int, int] = {}
            for a in self.acceptance:
                hist[a] = hist.get(a, 0) + 1
            out["acceptance_mean"] = round(sum(self.acceptance) / len(self.acceptance), 3)
            out["acceptance_histogram"] = {str(k): v for k, v in sorted(hist.items())}
        if baseline is not None and baseline.seconds and self.seconds and baseline.tokens:
            out["speedup"] = round((self.tokens / self.seconds) / (baseline.tokens / baseline.seconds), 3)
        return out


# ----------------------------------------------------------------------------- one model
def verify_model(label: str, cfg: dict, fns: dict, target, draft, mask_token_id, is_preset: bool, prompts) -> dict:
    import torch

    from .oracle import ScriptedDraft, compare

    checks: list[dict] = []
    block_size = cfg["block_size"]
    budgets = cfg["tree_budgets"]
    stop_ids = cfg.get("stop_token_ids") or None
    max_new = cfg["max_new_tokens"]
    device = target.get_input_embeddings().weight.device
    prompts = [p.to(device) for p in prompts]

    # (d) the reference itself is sound on this transformers version
    ref0 = greedy(target, prompts[0], min(max_new, 16), stop_ids or ())
    nocache = greedy(target, prompts[0], min(max_new, 16), stop_ids or (), use_cache=False)
    v = compare(nocache, ref0)
    checks.append({"check": "cached greedy == no-cache greedy", "passed": v.identical, "evidence": v.describe()})
    same, diff = multi_token_consistent(target, prompts[0], ref0[: min(6, len(ref0))] or [0])
    checks.append(
        {
            "check": "multi-token forward == token-by-token",
            "passed": same,
            "evidence": f"argmax {'equal' if same else 'DIFFERS'}, max |logit diff| {diff:.2e}",
        }
    )

    methods = [("dflash", fns.get("dflash_generate"), None)]
    if fns.get("ddtree_generate") is not None:
        methods += [(f"ddtree_tb{b}", fns["ddtree_generate"], b) for b in budgets]
    methods = [m for m in methods if m[1] is not None]

    def run(name, fn, budget, prompt, reference, seed):
        hook = None
        if is_preset:
            script = ScriptedDraft(target, prompt[0].tolist() + reference, seed=seed, forbidden=[mask_token_id])
            hook = script.attach(draft)
        try:
            return call_generate(
                fn, model=draft, target=target, input_ids=prompt, mask_token_id=mask_token_id,
                max_new_tokens=max_new, block_size=block_size, stop_token_ids=stop_ids, tree_budget=budget,
            )
        finally:
            if hook is not None:
                hook.remove()

    # (b) warm-up
    warm_ok, warm_error = True, None
    try:
        for name, fn, budget in methods:
            run(name, fn, budget, prompts[0][:, :4], greedy(target, prompts[0][:, :4], max_new, stop_ids or ()), seed=-1)
    except Exception as exc:  # the patched code failed to run at all
        warm_ok, warm_error = False, error_summary(exc)
    checks.append({"check": "warms up", "passed": warm_ok, "evidence": warm_error or "every method ran once", **(warm_error or {})})
    if not warm_ok:
        return {"model": label, "checks": checks, "methods": []}

    baseline = MethodStats("target greedy (block_size=1)")
    stats = {name: MethodStats(name) for name, _, _ in methods}
    total = len(prompts) * (1 + len(methods))
    done = 0
    for p_index, prompt in enumerate(prompts):
        reference = greedy(target, prompt, max_new, stop_ids or ())
        seed = cfg["seeds"][p_index % len(cfg["seeds"])] * 1000 + p_index
        new, _, secs = call_generate(
            fns["dflash_generate"], model=draft, target=target, input_ids=prompt, mask_token_id=mask_token_id,
            max_new_tokens=max_new, block_size=1, stop_token_ids=stop_ids,
        )
        baseline.tokens += len(new)
        baseline.seconds += secs
        baseline.runs.append({"prompt": p_index, "verdict": compare(reference, new).as_dict()})
        done += 1
        emit("progress", done=done, total=total, label=f"{label}: prompt {p_index + 1} baseline")
        for name, fn, budget in methods:
            try:
                new, acceptance, secs = run(name, fn, budget, prompt, reference, seed)
            except Exception as exc:
                err = error_summary(exc)
                stats[name].runs.append({"prompt": p_index, "verdict": compare(reference, []).as_dict(), **err})
                continue
            st = stats[name]
            st.tokens += len(new)
            st.seconds += secs
            st.acceptance += acceptance
            verdict = compare(reference, new)
            st.runs.append({"prompt": p_index, "verdict": verdict.as_dict(), "description": verdict.describe()})
            done += 1
            emit("progress", done=done, total=total, label=f"{label}: prompt {p_index + 1} {name}")

    for name, st in stats.items():
        bad = [r for r in st.runs if not r["verdict"]["identical"]]
        if bad:
            first = bad[0]
            evidence = f"{len(bad)}/{len(st.runs)} runs differ; prompt {first['prompt']}: " + (
                first.get("description") or first.get("error", "failed")
            )
        else:
            evidence = f"{len(st.runs)}/{len(st.runs)} runs token-identical"
        checks.append({"check": f"lossless: {name}", "passed": not bad and bool(st.runs), "evidence": evidence})
    partial = [a for st in stats.values() for a in st.acceptance if 1 < a < block_size]
    return {
        "model": label,
        "checks": checks,
        "baseline": baseline.as_dict(None),
        "methods": [st.as_dict(baseline) for st in stats.values()],
        "partial_acceptances": len(partial),
        "plumbing_figures": is_preset,
    }


def random_prompts(n: int, length: int, seed: int, vocab_hi: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_hi, (1, length), generator=gen) for _ in range(n)]


BUILTIN_PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 100.",
)


def tokenized_prompts(cfg: dict, n: int, vocab: int):
    """The built-in prompts through the target's tokenizer; random ids if the folder has none."""
    from transformers import AutoTokenizer

    tok = None
    if any((Path(cfg["target"]) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        try:
            tok = AutoTokenizer.from_pretrained(cfg["target"], local_files_only=True, trust_remote_code=bool(cfg.get("trust_remote_code")))
        except (OSError, ValueError, TypeError):
            tok = None
    if tok is None or tok("a", return_tensors="pt").input_ids.numel() == 0:
        emit("progress", done=0, total=1, label="no tokenizer in the target folder: random token prompts")
        return random_prompts(n, cfg["prompt_len"], cfg["seeds"][0], vocab - 1), []
    out = []
    for text in BUILTIN_PROMPTS[:n]:
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        out.append(tok(text, return_tensors="pt").input_ids)
    return out, [tok.eos_token_id] if tok.eos_token_id is not None else []


# ----------------------------------------------------------------------------- main
TINY_PARAMS = 50_000_000


def single_thread_for_tiny_models() -> None:
    """On tiny models thread hand-offs cost more than the matmuls: measured 8 ms against
    60-150 ms per decode step on a busy 2-core machine."""
    import torch

    torch.set_num_threads(1)


def run(cfg: dict) -> dict:
    import torch
    import transformers

    tree = Path(cfg["tree"]).resolve()
    env = {"transformers": transformers.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    result: dict[str, Any] = {"tree": str(tree), "environment": env, "checks": [], "models": []}
    modules = find_entry_points(tree)
    missing = [n for n in ("dflash_generate", "DFlashDraftModel") if n not in modules]
    if missing:
        result["fatal"] = f"{tree} is not a DDTree/DFlash tree: no {', '.join(missing)} found"
        return result
    try:
        fns = import_entry_points(tree, modules)
        result["checks"].append({"check": "loads", "passed": True, "evidence": ", ".join(f"{k} from {v}" for k, v in modules.items())})
    except Exception as exc:
        err = error_summary(exc)
        result["checks"].append({"check": "loads", "passed": False, "evidence": err["error"], **err})
        return result
    draft_cls = fns["DFlashDraftModel"]
    if not cfg.get("target"):
        single_thread_for_tiny_models()
    if cfg.get("target"):
        target, draft, mask = load_real(cfg, draft_cls)
        if sum(p.numel() for p in target.parameters()) < TINY_PARAMS:
            single_thread_for_tiny_models()
        check_fit(target, draft)
        vocab = target.config.get_text_config(decoder=True).vocab_size
        prompts, stops = tokenized_prompts(cfg, cfg["prompts"], min(vocab, mask if mask is not None else vocab))
        cfg = {**cfg, "stop_token_ids": stops}
        emit("progress", done=0, total=1, label="loaded " + Path(cfg["target"]).name)
        result["models"].append(verify_model(Path(cfg["target"]).name, cfg, fns, target, draft, mask, False, prompts))
    else:
        for preset in cfg["presets"]:
            target, draft, mask = load_preset(preset, cfg["seeds"][0], draft_cls, cfg["block_size"])
            check_fit(target, draft)
            prompts = random_prompts(cfg["prompts"] * len(cfg["seeds"]), cfg["prompt_len"], cfg["seeds"][0], mask)
            result["models"].append(verify_model(preset, cfg, fns, target, draft, mask, True, prompts))
    return result


def main() -> int:
    cfg = json.loads(sys.stdin.read())
    try:
        result = run(cfg)
    except (FileNotFoundError, ValueError) as exc:
        result = {"fatal": str(exc).splitlines()[0]}
    except Exception as exc:
        result = {"fatal": "verifier crashed: " + error_summary(exc)["error"], "trace": traceback.format_exc()[-4000:]}
    emit("result", result=result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
