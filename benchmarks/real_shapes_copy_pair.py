"""A target and a DFlash drafter at Qwen3.6-27B's real per-layer sizes whose drafter *predicts*: a "copy" pair.

    python benchmarks/real_shapes_copy_pair.py --root /tmp/copypair                 # real sizes (8.1 GB target)
    python benchmarks/real_shapes_copy_pair.py --root /tmp/copypair --small --gain 10 --penalty 4 --spread 1 --recency 0
                                                                            # hidden 512, vocab 4096: seconds
    python benchmarks/real_shapes_copy_pair.py --root /tmp/copypair --stats-only    # the target's greedy runs only

A random drafter predicts nothing (every round accepts 1 token), so the judge rightly calls its acceptance
inconclusive, and training a drafter at these sizes is out of reach on a CPU: ``bench_real_shapes --judged`` judges
this pair instead. It is set by hand, with the same classes, sizes and streaming build as ``bench_real_shapes``
(``real_shapes_build``: ``text_config``, ``stream_init``: the model's own ``_init_weights`` one module at a time,
then a transform of that module before it is written; never the whole model in memory, no float32 copy; the peak
is the embedding held for the LM head):

Target (``Qwen3_5ForCausalLM``, ``text_config``: untied, bf16). The embedding rows are the seeded random init
(std 0.02) times a gain ``g = GAIN``; the LM head holds the same values (two tensors: ``tie_word_embeddings`` stays
False). Dimension ``d0`` (the last) is ``+c`` for every token and ``-c`` for the mask token (``vocab - 1``, the
drafter's ``mask_token_id``), whose other dimensions are 0; ``c = 0.02 g``, the scale of the other dimensions; row
``d0`` of every MLP down_proj and Gated DeltaNet out_proj is 0, so the residual's ``d0`` stays ``c``. The residual
stream is then led by the current token's embedding, and since the head is the embedding the greedy text *repeats*
the current token. Measured at the real sizes, the random layers alone do not make runs of a useful length: at
``g = 10`` their output wins every step (runs of 1), at ``g = 40`` the first token repeats for all 48 tokens (a
random layer's output hardly changes while one token repeats, so a run that lasts a few steps lasts for ever).
So the full-attention layer (every fourth) is set too (``penalise``): its values copy the normalised residual's
first ``kv x head_dim`` (1,024) dims and its o_proj writes them back times ``-REPEAT_PENALTY``; q and k read only
``d0`` into the rotary dims, so the attention weights fall off with distance (``RECENCY``): the more of the recent
past the current token fills, the more its own logit is pushed down, until the best of the others (set by the
random Gated DeltaNet layers and MLPs) wins. With ``RECENCY = 0`` (q = k = 0, a uniform mean over the prefix) the
runs grow with the position instead (measured: 2, 2, 3, 2, 4, 5, 7, 8, 8, 6, 10 on one prompt). To vary the
threshold from token to token, each row's share of its energy in the copied dims is scaled by a seeded
log-uniform factor in ``[1/ROW_SPREAD, ROW_SPREAD]`` (the row's norm kept, so no token is favoured as the next one).
The other weights stay random.

Drafter (the tree's ``DFlashDraftModel``, ``bench_real_shapes``' drafter config: 2 layers, block 16, 24 / 4 heads of
256). Layer 1's attention sends every block position to block position 0 (the anchor): for kv head ``k`` the key
reads only ``d0``, at head dim ``D/2 - 1`` (RoPE's lowest frequency: over a block the rotation is ~1e-3 rad), and
every query head reads ``-d0`` there; q_norm / k_norm make a one-dim vector ``±sqrt(D)``, and their weight ``QK_GAIN``
at that dim gives the anchor a score of ``QK_GAIN**2 sqrt(D)`` (64 at the real sizes) against 0 for the context (fc's
row ``d0`` is 0: its keys are 0) and ``-64`` for the masks. kv head ``k``'s values copy the normalised block's dims
``[kD, kD + D)``; o_proj writes the first query head of each group back onto those dims, times ``COPY_SCALE``.
Both MLPs' down_proj and layer 2's o_proj are 0, all norms 1. Block positions >= 1 then hold ``mask + s * anchor[:KD]``
whose product with the embedding (= the LM head) is largest for the anchor token: the drafter proposes the anchor at
every position, so a round accepts the rest of the target's current run (capped by the block): acceptance varies
from 1 to 16 as the run lengths do.

Chosen constants, from greedy run lengths of the real-size target (4 layers, vocab 248,320, seed 0) on 2 random
8-token prompts x 48 new tokens (``--sweep``, with a cache, bf16):

- uniform penalty (``RECENCY = 0``, ``ROW_SPREAD = 1``): g 10, penalty 4: every run 1; g 40: penalty 0: one run of
  48 per prompt; 16: runs 13-35; 64: mean 8.7; 100: mean 5.7; 140: mean 4.8, runs 1-11 whose length grows with
  the position (the reference decode's rounds: mean 5.3, from 2 to 12);
- ``GAIN = 40``, ``ROW_SPREAD = 2``, ``RECENCY = 0.3``: penalty 20: mean 5.7 but one prompt repeats one token from
  its 4th to its 48th; 20.5: see below; 21: mean 2.5, runs 1-11 (14 of 1, 15 of 2, 4 of 3, 3 of 5, 6, 8, 11);
  22: mean 2.0; 26: mean 1.6; 30 and up: nearly all 1. The runs are a chaotic function of the penalty (2 prompts
  are a small sample); ``REPEAT_PENALTY = 21`` is the value with runs spread widest without a stuck prompt.

``QK_GAIN = 2`` and ``COPY_SCALE = 1`` need no tuning: the drafter proposed the target's token at every position of
every run in every decode measured (acceptance = the run's remainder, capped at 16).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_shapes_build import DRAFT_BLOCK, DRAFT_LAYERS, QWEN3_6_27B, REAL_VOCAB, ROOT, stream_init, text_config  # noqa: E402

#: embedding gain (module docstring); chosen with ``main``'s ``--sweep`` at the real sizes
GAIN = 40.0
#: weight of the full-attention layer's "recently seen" penalty (``penalise``); chosen with ``--sweep``
REPEAT_PENALTY = 21.0
#: each embedding row's dims that the penalty copies are scaled by a seeded log-uniform factor in [1 / ROW_SPREAD,
#: ROW_SPREAD] and its other dims so as to keep the row's norm (1: all alike)
ROW_SPREAD = 2.0
#: per-rotary-pair score of the penalty's attention (0: uniform over the prefix)
RECENCY = 0.3
#: weight of q_norm / k_norm at the attending dimension (anchor score QK_GAIN**2 * sqrt(head_dim))
QK_GAIN = 2.0
#: scale of the copied anchor embedding in the drafter's residual
COPY_SCALE = 1.0
#: small sizes for a quick check of the construction (``--small``)
SMALL = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
             linear_conv_kernel_dim=4)
SMALL_VOCAB = 4096


def _with_transform(model, transform) -> None:
    """Make ``stream_init``'s ``model._init_weights(module)`` apply ``transform(name, module)`` after the init."""
    import torch

    names = {id(m): n for n, m in model.named_modules()}
    init = model._init_weights

    def init_then_transform(module) -> None:
        init(module)
        with torch.no_grad():
            transform(names[id(module)], module)

    model._init_weights = init_then_transform


# ----------------------------------------------------------------------------- the target
def _target_config(vocab: int, layers: int, dims: dict | None):
    config = text_config(vocab, layers)
    for key, value in (dims or {}).items():
        setattr(config, key, value)
    return config


def penalise(module, leaf: str, penalty: float, config, recency: float = 0.0) -> None:
    """Turn a full-attention layer's attention into ``-penalty`` x a recency-weighted mean of the normalised residual's
    first ``kv * head_dim`` dims: q and k read only ``d0`` (the same for every token), into the first half of each
    rotary pair, so the score of a key ``t`` positions back is ``recency`` x the sum over pairs of ``cos(w_j t)``
    (the weights fall off as a power of ``t``; ``recency`` 0: q = k = 0, a uniform mean over the prefix). The output
    gate reads 0 (sigmoid 1/2); v copies the dims, o_proj writes the first query head of each group back onto them."""
    import torch

    w = module.weight
    kv, heads, head_dim, d0 = config.num_key_value_heads, config.num_attention_heads, config.head_dim, config.hidden_size - 1
    half = int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0)) // 2
    if leaf in ("q_norm", "k_norm"):  # (1 + weight) x sqrt(head_dim / half) per entry; the score is scaled by head_dim**-0.5
        w.fill_(math.sqrt(recency * half / math.sqrt(head_dim)) - 1 if recency else 0)
        return
    w.zero_()
    rows = torch.arange(kv * head_dim)
    if leaf == "v_proj":
        w[rows, rows] = 1
    elif leaf == "o_proj":
        group = heads // kv
        w[rows, (rows // head_dim) * group * head_dim + rows % head_dim] = -2 * penalty
    elif recency and leaf in ("q_proj", "k_proj"):
        stride = 2 * head_dim if leaf == "q_proj" else head_dim  # q_proj interleaves each head's query and gate
        count = heads if leaf == "q_proj" else kv
        w[(torch.arange(count)[:, None] * stride + torch.arange(half)).flatten(), d0] = 1


def build_copy_target(dest: Path, vocab: int, layers: int, seed: int, gain: float, dims: dict | None = None,
                      penalty: float = REPEAT_PENALTY, spread: float = ROW_SPREAD, recency: float = RECENCY) -> dict:
    """Write the copy pair's target folder (config.json, model.safetensors) into ``dest``; returns what was built.
    ``dims`` overrides ``QWEN3_6_27B``'s sizes (``--small``)."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    start = time.perf_counter()
    config = _target_config(vocab, layers, dims)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    model.to(torch.bfloat16)
    model.config.architectures = [type(model).__name__]
    model.config.dtype = torch.bfloat16
    held: dict = {}

    def transform(name: str, module) -> None:
        if name == "model.embed_tokens":
            w = module.weight
            w.mul_(gain)
            if spread != 1:  # each row's share of its energy in the dims the penalty copies, the row's norm kept
                copied = config.num_key_value_heads * config.head_dim
                u = torch.rand(vocab, 1, generator=torch.Generator().manual_seed(seed + 11)) * 2 - 1
                m = torch.exp(u * math.log(spread))
                rest = ((config.hidden_size - m**2 * copied) / (config.hidden_size - copied)).clamp(min=0.01).sqrt()
                w[:, :copied].mul_(m.to(w.dtype))
                w[:, copied:].mul_(rest.to(w.dtype))
            c = gain * config.initializer_range
            w[:, -1] = c
            w[vocab - 1] = 0
            w[vocab - 1, -1] = -c
            held["embedding"] = w.detach()  # the LM head's values: kept past the module's return to meta, no copy
        elif name == "lm_head":
            module.weight.copy_(held.pop("embedding"))
        elif ".self_attn." in name and name.rsplit(".", 1)[1] in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            penalise(module, name.rsplit(".", 1)[1], penalty, config, recency)
        elif name.endswith(("mlp.down_proj", "linear_attn.out_proj")):
            module.weight[-1] = 0  # d0 stays c in the residual: the mask token's sign, the recency query's input

    _with_transform(model, transform)
    offset = stream_init(model, dest, seed)
    model.config.save_pretrained(dest)
    sizes = {k: getattr(config, k) for k in QWEN3_6_27B if hasattr(config, k)}
    return {"vocab": vocab, "layers": layers, "seed": seed, "gain": gain, "penalty": penalty, "row_spread": spread,
            "recency": recency,
            "mask_token_id": vocab - 1,
            "parameters": offset // 2,
            "bytes": offset, "build_seconds": round(time.perf_counter() - start, 1), **sizes}


# ----------------------------------------------------------------------------- the drafter
def drafter_class(tree: Path):
    """The tree's ``DFlashDraftModel``."""
    import importlib

    sys.path.insert(0, str(tree))
    try:
        return importlib.import_module("model").DFlashDraftModel
    finally:
        sys.path.remove(str(tree))


def build_copy_drafter(dest: Path, tree: Path, target_info: dict, seed: int) -> dict:
    """A drafter folder of the tree's ``DFlashDraftModel`` (``bench_real_shapes``' drafter config) whose weights copy
    the anchor token's embedding to every block position (module docstring)."""
    import torch

    start = time.perf_counter()
    cls = drafter_class(tree)
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    hidden, heads, kv, head_dim = (target_info[k] for k in keys)
    layers, vocab = target_info["layers"], target_info["vocab"]
    cfg = cls.config_class(vocab_size=vocab, hidden_size=hidden, intermediate_size=target_info["intermediate_size"],
                           num_hidden_layers=DRAFT_LAYERS, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                           max_position_embeddings=4096, tie_word_embeddings=False, layer_types=["full_attention"] * DRAFT_LAYERS)
    cfg.block_size = DRAFT_BLOCK
    cfg.num_target_layers = layers
    cfg.dflash_config = {"mask_token_id": vocab - 1, "target_layer_ids": sorted({1, layers - 2})}
    cfg.architectures = [cls.__name__]
    if kv * head_dim >= hidden:
        raise ValueError(f"the copied dims ({kv} x {head_dim}) must leave d0 = {hidden - 1} out")
    with torch.device("meta"):
        model = cls(cfg)
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    d0, u, group = hidden - 1, head_dim // 2 - 1, heads // kv

    def transform(name: str, module) -> None:
        parts = name.split(".")
        leaf = parts[-1]
        first = parts[:2] == ["layers", "0"]
        if name == "fc":
            module.weight[d0] = 0
        elif leaf in ("norm", "hidden_norm", "input_layernorm", "post_attention_layernorm"):
            module.weight.fill_(1)
        elif leaf in ("q_norm", "k_norm"):
            module.weight.fill_(1)
            if first:
                module.weight[u] = QK_GAIN
        elif leaf == "down_proj":
            module.weight.zero_()
        elif leaf == "o_proj" and not first:
            module.weight.zero_()
        elif first and leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = module.weight
            w.zero_()
            if leaf == "q_proj":
                w[torch.arange(heads) * head_dim + u, d0] = -1
            elif leaf == "k_proj":
                w[torch.arange(kv) * head_dim + u, d0] = 1
            elif leaf == "v_proj":
                w[torch.arange(kv * head_dim), torch.arange(kv * head_dim)] = 1
            else:  # o_proj: the first query head of group k back onto dims [k D, k D + D)
                rows = torch.arange(kv * head_dim)
                w[rows, (rows // head_dim) * group * head_dim + rows % head_dim] = COPY_SCALE

    _with_transform(model, transform)
    size = stream_init(model, dest, seed + 1)
    model.config.save_pretrained(dest)
    return {"layers": DRAFT_LAYERS, "block_size": DRAFT_BLOCK, "bytes": size, "parameters": size // 2, "qk_gain": QK_GAIN,
            "copy_scale": COPY_SCALE, "build_seconds": round(time.perf_counter() - start, 1)}


# ----------------------------------------------------------------------------- measuring
def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """Random prompts (seeded), never the mask token."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (length,), generator=g).tolist() for _ in range(count)]


def greedy(target, prompt: list[int], new_tokens: int) -> list[int]:
    """The target's greedy continuation, with a cache."""
    import torch
    from transformers import DynamicCache

    cache, ids, out = DynamicCache(config=target.config), torch.tensor([prompt]), []
    with torch.inference_mode():
        for _ in range(new_tokens):
            logits = target(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            ids = logits[:, -1:].argmax(-1)
            out.append(int(ids))
    return out


def runs(tokens: list[int]) -> list[int]:
    """Lengths of the maximal runs of one repeated token."""
    out: list[int] = []
    for i, t in enumerate(tokens):
        if i and t == tokens[i - 1]:
            out[-1] += 1
        else:
            out.append(1)
    return out


def run_stats(texts: list[list[int]]) -> dict:
    lengths = [n for text in texts for n in runs(text)]
    return {"runs": len(lengths), "mean_run": round(sum(lengths) / len(lengths), 2), "max_run": max(lengths),
            "histogram": {n: lengths.count(n) for n in sorted(set(lengths))},
            "distinct_tokens": len({t for text in texts for t in text})}


def scale_embedding(target, factor: float) -> None:
    """Multiply the embedding and the LM head by ``factor`` in place (the same as building with ``gain * factor``:
    every entry, ``c`` included, is proportional to the gain)."""
    import torch

    with torch.no_grad():
        target.get_input_embeddings().weight.mul_(factor)
        target.get_output_embeddings().weight.mul_(factor)


def set_penalty(target, penalty: float) -> None:
    """Rewrite the full-attention layers' o_proj for ``penalty`` in place."""
    import torch

    with torch.no_grad():
        for layer, kind in zip(target.model.layers, target.config.layer_types):
            if kind == "full_attention":
                penalise(layer.self_attn.o_proj, "o_proj", penalty, target.config)


def load_pair(target_dir: Path, draft_dir: Path | None, tree: Path):
    import torch
    from transformers import Qwen3_5ForCausalLM

    target = Qwen3_5ForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    draft = None if draft_dir is None else drafter_class(tree).from_pretrained(draft_dir, dtype=torch.bfloat16).eval()
    return target, draft


def acceptance(target, draft, info: dict, plist: list[list[int]], new_tokens: int) -> dict:
    """The from-scratch DFlash chain decode (``patcher.verify.judge.acceptance.reference_decode``) of every prompt."""
    sys.path.insert(0, str(ROOT))
    from patcher.verify.judge.acceptance.reference_decode import ScratchPair, decode

    pair = ScratchPair(target, draft, info["vocab"] - 1, DRAFT_BLOCK)
    rounds, texts, start = [], [], time.perf_counter()
    for p in plist:
        new, acc = decode(pair, p, "dflash", new_tokens)
        rounds += acc
        texts.append(new)
        print(json.dumps({"prompt": len(texts), "acceptance": acc, "seconds": round(time.perf_counter() - start, 1)}),
              file=sys.stderr, flush=True)
    return {"rounds": len(rounds), "mean_acceptance": round(sum(rounds) / len(rounds), 2), "per_round": rounds,
            "histogram": {n: rounds.count(n) for n in sorted(set(rounds))}, "decoded_run_stats": run_stats(texts),
            "seconds": round(time.perf_counter() - start, 1)}


def peak_rss_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("/tmp/copypair"), help="folder for the target, drafter and patched tree")
    ap.add_argument("--vocab", type=int, default=None, help=f"vocabulary (default {REAL_VOCAB}; {SMALL_VOCAB} with --small)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gain", type=float, default=GAIN, help="embedding gain g")
    ap.add_argument("--small", action="store_true", help="small sizes (hidden 512) for a quick check")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--penalty", type=float, default=REPEAT_PENALTY, help="repeat penalty of the full-attention layers")
    ap.add_argument("--spread", type=float, default=ROW_SPREAD, help="spread of the rows' share in the copied dims")
    ap.add_argument("--recency", type=float, default=RECENCY, help="per-pair score of the penalty's attention")
    ap.add_argument("--sweep", nargs="*", default=None, metavar="GAIN,PENALTY",
                    help="also measure the greedy run lengths at these settings (in memory, from the built target)")
    ap.add_argument("--reuse", action="store_true", help="keep folders already built under --root")
    ap.add_argument("--stats-only", action="store_true", help="no drafter, no decode: the target's run lengths")
    args = ap.parse_args(argv)
    import torch

    vocab = args.vocab or (SMALL_VOCAB if args.small else REAL_VOCAB)
    dims = SMALL if args.small else None
    tag = (f"L{args.layers}-V{vocab}-s{args.seed}-g{args.gain:g}-p{args.penalty:g}-r{args.spread:g}-a{args.recency:g}"
           + ("-small" if args.small else ""))
    target_dir, draft_dir, tree = args.root / f"target-{tag}", args.root / f"draft-{tag}", args.root / "tree"
    report: dict = {"threads": torch.get_num_threads()}
    if not tree.is_dir():
        subprocess.run([sys.executable, "-m", "patcher", "apply", str(ROOT / "vendored" / "ddtree"), "--out", str(tree)],
                       check=True, cwd=ROOT, capture_output=True)
    if args.reuse and (target_dir / "copy_pair.json").is_file():
        info = json.loads((target_dir / "copy_pair.json").read_text())
    else:
        info = build_copy_target(target_dir, vocab, args.layers, args.seed, args.gain, dims, args.penalty, args.spread,
                                 args.recency)
        (target_dir / "copy_pair.json").write_text(json.dumps(info, indent=1))
    report["target"] = info
    if not args.stats_only:
        if args.reuse and (draft_dir / "copy_pair.json").is_file():
            report["drafter"] = json.loads((draft_dir / "copy_pair.json").read_text())
        else:
            report["drafter"] = build_copy_drafter(draft_dir, tree, info, args.seed)
            (draft_dir / "copy_pair.json").write_text(json.dumps(report["drafter"], indent=1))
    report["peak_rss_gib_after_build"] = peak_rss_gib()
    start = time.perf_counter()
    target, draft = load_pair(target_dir, None if args.stats_only else draft_dir, tree)
    report["load_seconds"] = round(time.perf_counter() - start, 1)
    plist = prompts(vocab, args.prompts, args.prompt_len, args.seed + 7)
    sweep, now = {}, args.gain
    for setting in (args.sweep or []):
        g, penalty = (float(x) for x in setting.split(","))
        scale_embedding(target, g / now)
        set_penalty(target, penalty)
        now = g
        t0 = time.perf_counter()
        texts = [greedy(target, p, args.new_tokens) for p in plist]
        sweep[setting] = {**run_stats(texts), "seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps({setting: sweep[setting]}), file=sys.stderr, flush=True)
    scale_embedding(target, args.gain / now)
    set_penalty(target, args.penalty)
    if sweep:
        report["gain_sweep"] = sweep
    texts = [greedy(target, p, args.new_tokens) for p in plist]
    report["greedy"] = {**run_stats(texts), "texts": texts}
    if draft is not None:
        report["dflash"] = acceptance(target, draft, info, plist, args.new_tokens)
    report["peak_rss_gib"] = peak_rss_gib()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
