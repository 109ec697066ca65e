"""Per-round cost of the lossless verify/commit (patcher/runtime.py) against today's lossy round.

Not a test: it prints medians over repeats (time.perf_counter after warm-up; the variants are
interleaved in every repeat so that machine noise hits them alike) for

* chain: ``verify_forward`` + the cache's own ``crop(-n)`` (lossless: it commits the recorded
  verify) against a plain verify + a crop of the attention layers only (today's lossy round);
  aim <= 1.10x. The commit alone is timed too; aim <= 10 % of a verify (``commit_share``);
* tree: ``verify_forward`` with a 4D tree mask, with the strategy the runtime picks, against a
  plain flat verify of the same nodes (lossy: GDN layers mix sibling branches); aim <= 1.3x at
  8, 16, 32 and 64 nodes. The commit (``compact_cache``) is timed separately;
* the bytes the fast path keeps per verify token for Qwen3.6-27B's dimensions (computed, not
  measured: no weights are downloaded).

    python benchmarks/bench_rollback.py                       # tiny presets + mid-qwen3_5, CPU
    python benchmarks/bench_rollback.py --json                # the same figures, one JSON object
    python benchmarks/bench_rollback.py --generic             # also the generic module replay
    python benchmarks/bench_rollback.py --commit-variants     # one GDN layer: replay vs closed form vs stored states
    python benchmarks/bench_rollback.py --presets qwen3_6-27b-slice --device cuda --dtype bfloat16

``qwen3_6-27b-slice`` is one Qwen3.6-27B-sized Gated DeltaNet layer and one attention layer with
random weights (benchmarks/gpu_check.sh runs it on a GPU).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import inspect
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patcher import runtime as rt  # noqa: E402
from patcher.verify.models.presets import build_target  # noqa: E402

DEFAULT_PRESETS = "tiny-qwen3_5,tiny-qwen3-next,mid-qwen3_5"
CHAIN_BLOCKS = (8, 16)
TREE_SHAPES = ((8, 6), (16, 8), (32, 8), (64, 12))  # (nodes, max depth)

#: Qwen3.6-27B's text config (Qwen/Qwen3.6-27B config.json, ``text_config``; the values as
#: published with the model, transcribed here: nothing is downloaded). 48 of the 64 layers are
#: Gated DeltaNet (full attention every 4th layer); weights are bfloat16, the recurrent state
#: float32 (``mamba_ssm_dtype``).
QWEN3_6_27B = dict(
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    full_attention_interval=4,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)


def bytes_per_token_qwen3_6_27b() -> dict:
    """What a verify keeps per verify token for the commit, over all GDN layers of Qwen3.6-27B."""
    c = QWEN3_6_27B
    gdn_layers = c["num_hidden_layers"] - c["num_hidden_layers"] // c["full_attention_interval"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_dim = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    heads = c["linear_num_value_heads"]
    bf16, f32 = 2, 4
    # chain: references to the pre-conv inputs and to the kernel's q, k, v (bf16), g (f32), beta (bf16)
    chain = conv_dim * bf16 + conv_dim * bf16 + heads * f32 + heads * bf16
    # tree: pre-conv inputs (bf16), normalised keys and delta-corrected values per value head (f32), G (f32)
    tree = conv_dim * bf16 + heads * (c["linear_key_head_dim"] + c["linear_value_head_dim"]) * f32 + heads * f32
    # for comparison: one float32 recurrent state per token (the "select a stored state" design)
    state = heads * c["linear_key_head_dim"] * c["linear_value_head_dim"] * f32
    generic = c["hidden_size"] * bf16  # the generic replay keeps the GDN module's input
    return {
        "gdn_layers": gdn_layers,
        "chain": chain * gdn_layers,
        "tree": tree * gdn_layers,
        "per_position_state_alternative": state * gdn_layers,
        "generic_module_replay": generic * gdn_layers,
    }


def build_slice_27b(dtype, device="cpu"):
    """One Qwen3.6-27B-sized GDN layer + one attention layer, random weights, tiny vocabulary
    (built on ``device``: initialising 0.9 B parameters on a CPU takes a while)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    c = {k: v for k, v in QWEN3_6_27B.items() if k not in ("num_hidden_layers", "full_attention_interval")}
    config = Qwen3_5TextConfig(
        **c, vocab_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log"):
                m.A_log.copy_(torch.empty(m.A_log.shape).uniform_(0.01, 0.1, generator=gen).log().to(m.A_log.device))
    return model.to(dtype).eval()


class Timer:
    """CUDA: wall time around synchronised calls. CPU: this thread's CPU time by default
    (``--clock cpu``; with one torch thread all the work runs in it), which other processes on
    a shared machine disturb far less than wall time; ``--clock wall`` for wall time."""

    def __init__(self, device, clock="cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.now = time.thread_time if clock == "cpu" and not self.cuda else time.perf_counter

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def median_ms(self, variants, setup, repeats, warmup=3):
        """Median wall time (ms) of each ``fn(state)``; ``setup()`` builds a fresh state (not timed)."""
        times = {name: [] for name in variants}
        for i in range(warmup + repeats):
            for name, fn in variants.items():
                state = setup()
                self.sync()
                t0 = self.now()
                fn(state)
                self.sync()
                if i >= warmup:
                    times[name].append((self.now() - t0) * 1e3)
        return {name: statistics.median(ts) for name, ts in times.items()}


def prefilled(model, prompt):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(prompt, past_key_values=cache, use_cache=True)
    return cache


def naive_crop(cache, drop):
    """Today's lossy round: only key/value layers are cut back."""
    if drop > 0:
        for layer in cache.layers:
            if isinstance(getattr(layer, "keys", None), torch.Tensor) and not hasattr(layer, "recurrent_states"):
                type(layer).crop(layer, -drop)


def tree_mask(parents, past, dtype, device):
    L = len(parents)
    mask = torch.full((1, 1, L, past + L), torch.finfo(dtype).min, dtype=dtype)
    mask[..., :past] = 0
    for i in range(L):
        j = i
        while j >= 0:
            mask[0, 0, i, past + j] = 0
            j = parents[j]
    return mask.to(device)


def random_tree(n, max_depth, rng):
    """DDTree-like shape: a best-first tree, bushy near the root, bounded depth."""
    parents, depth = [-1], [0]
    for i in range(1, n):
        candidates = [j for j in range(max(0, i - 4), i) if depth[j] < max_depth] or [0]
        p = rng.choice(candidates)
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents, depth


def bench_chain(model, prompt, block_size, timer, repeats, vocab):
    device = prompt.device
    p = prompt.shape[1]
    block = torch.randint(0, vocab, (1, block_size), device=device)
    pos = torch.arange(p, p + block_size, device=device)[None]
    base = prefilled(model, prompt)
    keep = block_size // 2  # a partial acceptance, so there is something to roll back
    drop = block_size - keep

    def setup():
        return copy.deepcopy(base)

    def verify_plain(cache):
        model(block, position_ids=pos, past_key_values=cache, use_cache=True, output_hidden_states=True)

    def verify_recorded(cache):
        rt.verify_forward(model, block, position_ids=pos, past_key_values=cache, use_cache=True, output_hidden_states=True)

    def naive_round(cache):
        verify_plain(cache)
        naive_crop(cache, drop)

    def lossless_round(cache):
        verify_recorded(cache)
        cache.crop(-drop)  # the cache's own crop commits the recorded verify

    def verified():
        cache = copy.deepcopy(base)
        verify_recorded(cache)
        return cache

    rounds = timer.median_ms({"naive": naive_round, "lossless": lossless_round, "verify": verify_recorded}, setup, repeats)
    rounds["commit"] = timer.median_ms({"c": lambda c: c.crop(-drop)}, verified, repeats)["c"]
    return rounds


def bench_tree(model, prompt, n_nodes, max_depth, timer, repeats, rng, vocab, generic):
    device, dtype = prompt.device, model.dtype
    p = prompt.shape[1]
    parents, depth = random_tree(n_nodes, max_depth, rng)
    tokens = torch.randint(0, vocab, (1, n_nodes), device=device)
    pos = (p + torch.tensor(depth, device=device))[None]
    mask = tree_mask(parents, p, dtype, device)
    base = prefilled(model, prompt)
    node = max(range(n_nodes), key=lambda i: depth[i])
    keep = []
    while node >= 0:
        keep.append(node)
        node = parents[node]
    keep = keep[::-1]

    def setup():
        return copy.deepcopy(base)

    def flat(cache):
        model(tokens, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True,
              output_hidden_states=True)

    def recorded(strategy):
        def run(cache):
            rt.TREE_STRATEGY = strategy
            try:
                rt.verify_forward(model, tokens, position_ids=pos, attention_mask=mask, past_key_values=cache,
                                  use_cache=True, output_hidden_states=True)
            finally:
                rt.TREE_STRATEGY = "auto"
        return run

    variants = {"flat": flat, "auto": recorded("auto")}
    if generic:
        variants.update(node=recorded("node"), path=recorded("path"))
    results = timer.median_ms(variants, setup, repeats)

    def verified():
        cache = copy.deepcopy(base)
        recorded("auto")(cache)
        return cache

    results["commit"] = timer.median_ms({"c": lambda c: rt.compact_cache(c, p, keep)}, verified, repeats)["c"]
    modules = rt.hybrid_linear_modules(model)
    if modules and all(rt._fast_enabled(m) for _, m in modules):
        results["strategy"] = "onepass"
    else:
        results["strategy"] = "path" if rt._use_path_batched(rt._tree_plan(parents, "cpu"), device) else "node"
    leaves = n_nodes - len({q for q in parents if q >= 0})
    results["shape"] = f"{n_nodes}n/d{max(depth) + 1}/{leaves}l"
    return results


def _layer_variants(chunk, recurrent, n_k, n_v, tokens, a, device):
    """One layer's tensors and its ways to commit ``a`` of ``tokens`` verified tokens (each a call timed alone)."""
    d = 128
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, tokens, n_k, d, generator=gen).to(device) for _ in range(2))
    v = torch.randn(1, tokens, n_v, d, generator=gen).to(device)
    g = (-torch.rand(1, tokens, n_v, generator=gen) * 0.1).to(device)
    b = torch.rand(1, tokens, n_v, generator=gen).to(device)
    s0 = (torch.randn(1, n_v, d, d, generator=gen) * 0.1).to(device)
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    pre = [x[:, :a] for x in (q, k, v, g, b)]
    causal = torch.ones(a, a, dtype=torch.bool, device=device).tril()

    def closed():
        _, kk, u, G = rt._delta_rule(pre[1], pre[2], pre[3], pre[4], s0, causal, l2norm=True)
        return rt._closed_form_state(kk, u, G, s0, torch.arange(a, device=device))

    variants = {
        f"the verify's kernel on {tokens} tokens (torch fallback, padded to 64)":
            lambda: chunk(q, k, v, g=g, beta=b, initial_state=s0, **kw),
        f"replay: the module's kernel, one chunk of {a}":
            lambda: chunk(*pre[:3], g=pre[3], beta=pre[4], initial_state=s0, chunk_size=a, **kw),
        "replay: the module's kernel, padded to 64 (its default)":
            lambda: chunk(*pre[:3], g=pre[3], beta=pre[4], initial_state=s0, **kw),
        "replay: token by token (recurrent kernel)":
            lambda: recurrent(*pre[:3], g=pre[3], beta=pre[4], initial_state=s0, **kw),
        "replay: closed form incl. solving the prefix (runtime 'closed')": closed,
        f"store a state per token ({tokens} copies, a lower bound)": lambda: [s0.clone() for _ in range(tokens)],
    }
    return variants, closed, s0, pre, kw


def commit_variants(timer, repeats, device, log, tokens=16, kept=8):
    """One GDN layer's ways to commit 8 of 16 verified tokens (mid and Qwen3.6-27B head counts)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    chunk = inspect.unwrap(mq.torch_chunk_gated_delta_rule)
    recurrent = inspect.unwrap(mq.torch_recurrent_gated_delta_rule)
    a = kept
    table = {}
    for label, n_k, n_v in (("mid (16 heads)", 8, 16), ("Qwen3.6-27B (48 heads)", 16, 48)):
        variants, closed, s0, pre, kw = _layer_variants(chunk, recurrent, n_k, n_v, tokens, a, device)
        times = timer.median_ms({n: (lambda _state, f=f: f()) for n, f in variants.items()}, lambda: None, repeats)
        reference = chunk(*pre[:3], g=pre[3], beta=pre[4], initial_state=s0, chunk_size=a, **kw)[1]
        error = float((closed() - reference).abs().max())
        table[label] = {"ms": times, "closed_vs_kernel_max_abs_diff": error}
        log(f"\n-- commit of {a} of {tokens} tokens, one GDN layer, {label}: state "
            f"{s0.numel() * 4 / 2**20:.1f} MiB, closed form vs kernel max |diff| {error:.1e}")
        for name, ms in times.items():
            log(f"{ms:9.2f} ms  {name}")
    return table


def run_preset(name, args, rng, log):
    dtype = getattr(torch, args.dtype)
    if name == "qwen3_6-27b-slice":
        model = build_slice_27b(dtype, args.device)
    else:
        model = build_target(name, seed=0, dtype=args.dtype)
    model = model.to(args.device)
    vocab = min(60, model.config.get_text_config(decoder=True).vocab_size - 1)
    prompt = torch.randint(0, vocab, (1, args.prompt), device=args.device)
    timer = Timer(args.device, args.clock)
    out = {"chain": {}, "tree": {}, "chain_generic": {}, "chain_replay": {}}
    log(f"\n== {name} (prompt {args.prompt}, {args.device}, {args.dtype}) ==")
    log(f"chain replay: {args.chain_replay} (first = the row, 'auto' = {rt._chain_replay_mode(args.device)} here)")
    log(f"{'chain block':>12} | {'naive round':>11} | {'lossless round':>14} | {'verify':>8} | {'commit':>8} | ratio | commit/verify")
    for block in CHAIN_BLOCKS:
        for i, mode in enumerate(args.chain_replay.split(",")):
            rt.GDN_CHAIN_REPLAY = mode
            try:
                r = bench_chain(model, prompt, block, timer, args.repeats, vocab)
            finally:
                rt.GDN_CHAIN_REPLAY = "auto"
            out["chain_replay"].setdefault(mode, {})[str(block)] = r
            label = f"{block}" if i == 0 else f"({mode})"
            log(f"{label:>12} | {r['naive']:9.2f}ms | {r['lossless']:12.2f}ms | {r['verify']:6.2f}ms | "
                f"{r['commit']:6.3f}ms | {r['lossless'] / r['naive']:.2f}x | {100 * r['commit'] / r['verify']:.1f} %")
        out["chain"][str(block)] = out["chain_replay"][args.chain_replay.split(",")[0]][str(block)]
        if args.generic:
            rt.GDN_FAST_PATH = False
            try:
                g = bench_chain(model, prompt, block, timer, args.repeats, vocab)
            finally:
                rt.GDN_FAST_PATH = True
            out["chain_generic"][str(block)] = g
            log(f"{'(generic)':>12} | {g['naive']:9.2f}ms | {g['lossless']:12.2f}ms | {g['verify']:6.2f}ms | "
                f"{g['commit']:6.3f}ms | {g['lossless'] / g['naive']:.2f}x | {100 * g['commit'] / g['verify']:.1f} %")
    log(f"{'tree':>16} | {'flat verify':>11} | {'recorded':>9} | {'ratio':>6} | strategy | commit"
        + (" | node/flat | path/flat" if args.generic else ""))
    for n, depth in TREE_SHAPES:
        r = bench_tree(model, prompt, n, depth, timer, args.repeats, rng, vocab, args.generic)
        out["tree"][str(n)] = r
        extra = f" | {r['node'] / r['flat']:8.2f}x | {r['path'] / r['flat']:8.2f}x" if args.generic else ""
        log(f"{r['shape']:>16} | {r['flat']:9.2f}ms | {r['auto']:7.2f}ms | {r['auto'] / r['flat']:5.2f}x | "
            f"{r['strategy']:>8} | {r['commit']:.3f}ms{extra}")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--presets", default=DEFAULT_PRESETS)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps the timings steadier)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="CPU runs: this thread's CPU time (default, steadier on a shared machine) or wall time")
    parser.add_argument("--chain-replay", default="auto",
                        help="comma-separated GDN_CHAIN_REPLAY modes to time (auto, closed, kernel); the first is reported")
    parser.add_argument("--generic", action="store_true", help="also time the generic module replay / tree strategies")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--commit-variants", action="store_true",
                        help="only time one GDN layer's ways to commit (replay, closed form, stored states)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    torch.manual_seed(0)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    clock = "wall" if args.clock == "wall" or torch.device(args.device).type == "cuda" else "thread CPU"
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device} {args.dtype}, "
        f"medians of {args.repeats}, {clock} time")
    results = {}
    if args.commit_variants:
        with torch.inference_mode():
            table = commit_variants(Timer(args.device, args.clock), args.repeats, args.device, log)
        if args.json:
            print(json.dumps({"commit_variants": table}, indent=1, sort_keys=True))
        return
    with torch.inference_mode():
        for name in args.presets.split(","):
            results[name] = run_preset(name, args, rng, log)
    bpt = bytes_per_token_qwen3_6_27b()
    log(
        f"\nQwen3.6-27B, bytes kept per verify token over its {bpt['gdn_layers']} GDN layers: chain "
        f"{bpt['chain'] / 2**20:.2f} MiB, tree {bpt['tree'] / 2**20:.2f} MiB (a stored float32 state per token "
        f"would be {bpt['per_position_state_alternative'] / 2**20:.0f} MiB; the generic replay keeps "
        f"{bpt['generic_module_replay'] / 2**20:.2f} MiB and re-runs the projections)"
    )
    if args.json:
        summary = {
            "chain_ratio": {
                p: {b: round(r["lossless"] / r["naive"], 3) for b, r in res["chain"].items()} for p, res in results.items()
            },
            "tree_ratio": {
                p: {n: round(r["auto"] / r["flat"], 3) for n, r in res["tree"].items()} for p, res in results.items()
            },
            "chain_ratio_by_replay": {
                p: {m: {b: round(r["lossless"] / r["naive"], 3) for b, r in by.items()} for m, by in res["chain_replay"].items()}
                for p, res in results.items()
            },
            "tree_strategy": {p: {n: r["strategy"] for n, r in res["tree"].items()} for p, res in results.items()},
            "commit_share": {
                p: {
                    **{f"chain_{b}": round(r["commit"] / r["verify"], 4) for b, r in res["chain"].items()},
                    **{f"tree_{n}": round(r["commit"] / r["auto"], 4) for n, r in res["tree"].items()},
                }
                for p, res in results.items()
            },
            "bytes_per_token_qwen3_6_27b": bpt,
            "ms": results,
            "environment": {
                "torch": torch.__version__, "device": args.device, "dtype": args.dtype,
                "threads": torch.get_num_threads(), "repeats": args.repeats, "prompt": args.prompt, "clock": clock,
                "fla": importlib.util.find_spec("fla") is not None,
            },
        }
        print(json.dumps(summary, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
