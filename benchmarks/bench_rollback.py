"""Per-round cost of the lossless verify/commit helper (patcher/runtime.py) on tiny CPU presets.

Not a test: it prints medians over repeats (time.perf_counter, after warm-up) for

* chain: ``verify_forward`` + ``crop_cache`` (lossless) against a plain verify + a crop of the
  attention layers only (today's lossy behaviour); the aim is <= 1.3x;
* tree: ``verify_forward`` with a 4D tree mask, node-recurrent and path-batched, against a
  plain flat tree verify (lossy: GDN layers mix sibling branches); the aim is <= 2x.
  The commit (``compact_cache``) is timed separately.

Usage: python benchmarks/bench_rollback.py [--repeats 15] [--presets tiny-qwen3_5,tiny-qwen3-next]

How to read it: the chain commit re-runs each GDN module once on the kept tokens, so the
chain ratio is about 1 + (GDN share of a verify). In these tiny presets the GDN modules are
most of a verify (on the torch fallback every GDN call pads to a 64-token chunk and pays
~1-2 ms of Python/op overhead), so the CPU ratio is pessimistic. Node-recurrent costs (depth)
GDN calls per layer; path-batched one call on (#leaves x depth) tokens, padded per row.

What changes on GPU with flash-linear-attention and causal-conv1d (not measured here): the
replay is a handful of small kernels per GDN layer, next to a verify dominated by attention
and MLP matmuls of a real model; path-batched becomes one fla chunk call per layer whose
cost hardly grows with the number of rows, while node-recurrent pays (depth) launch-bound
calls per layer (hence "auto" picks path-batched on CUDA).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patcher import runtime as rt  # noqa: E402
from patcher.presets import build_target  # noqa: E402


def median_ms(variants, setup, repeats, warmup=3):
    """Median wall time (ms) of each ``fn(state)`` in ``variants``; the variants are interleaved
    in every repeat so that machine noise hits them alike. ``setup()`` builds a fresh state."""
    times = {name: [] for name in variants}
    for i in range(warmup + repeats):
        for name, fn in variants.items():
            state = setup()
            t0 = time.perf_counter()
            fn(state)
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(elapsed * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def prefilled(model, prompt):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(prompt, past_key_values=cache, use_cache=True)
    return cache


def naive_crop(cache, length):
    drop = cache.get_seq_length() - length
    if drop > 0:
        for layer in cache.layers:
            if hasattr(layer, "keys"):
                layer.crop(-drop)


def tree_mask(parents, past):
    L = len(parents)
    mask = torch.full((1, 1, L, past + L), torch.finfo(torch.float32).min)
    mask[..., :past] = 0
    for i in range(L):
        j = i
        while j >= 0:
            mask[0, 0, i, past + j] = 0
            j = parents[j]
    return mask


def random_tree(n, max_depth, rng):
    """DDTree-like shape: a best-first tree, bushy near the root, bounded depth."""
    parents, depth = [-1], [0]
    for i in range(1, n):
        candidates = [j for j in range(max(0, i - 4), i) if depth[j] < max_depth] or [0]
        p = rng.choice(candidates)
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents, depth


def bench_chain(model, prompt, block_size, repeats):
    p = prompt.shape[1]
    block = torch.randint(0, 60, (1, block_size))
    pos = torch.arange(p, p + block_size)[None]
    base = prefilled(model, prompt)
    keep = block_size // 2  # a partial acceptance, so there is something to roll back

    def setup():
        return copy.deepcopy(base)

    def verify_plain(cache):
        model(block, position_ids=pos, past_key_values=cache, use_cache=True, output_hidden_states=True)

    def naive_round(cache):
        verify_plain(cache)
        naive_crop(cache, p + keep)

    def verify_hybrid(cache):
        rt.verify_forward(
            model, block, position_ids=pos, past_key_values=cache, use_cache=True, output_hidden_states=True
        )

    def lossless_round(cache):
        verify_hybrid(cache)
        rt.crop_cache(cache, p + keep)

    def commit_only_setup():
        cache = copy.deepcopy(base)
        verify_hybrid(cache)
        return cache

    rounds = median_ms({"naive": naive_round, "lossless": lossless_round}, setup, repeats)
    commit = median_ms({"commit": lambda c: rt.crop_cache(c, p + keep)}, commit_only_setup, repeats)["commit"]
    return rounds["naive"], rounds["lossless"], commit


def bench_tree(model, prompt, n_nodes, max_depth, repeats, rng):
    p = prompt.shape[1]
    parents, depth = random_tree(n_nodes, max_depth, rng)
    tokens = torch.randint(0, 60, (1, n_nodes))
    pos = (p + torch.tensor(depth))[None]
    mask = tree_mask(parents, p)
    base = prefilled(model, prompt)
    deepest = max(range(n_nodes), key=lambda i: depth[i])
    keep = []
    node = deepest
    while node >= 0:
        keep.append(node)
        node = parents[node]
    keep = keep[::-1]

    def setup():
        return copy.deepcopy(base)

    def flat(cache):
        model(
            tokens, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True,
            output_hidden_states=True,
        )

    def hybrid(strategy):
        def run(cache):
            rt.TREE_STRATEGY = strategy
            rt.verify_forward(
                model, tokens, position_ids=pos, attention_mask=mask, past_key_values=cache,
                use_cache=True, output_hidden_states=True,
            )
        return run

    def commit_setup():
        cache = copy.deepcopy(base)
        hybrid("node")(cache)
        return cache

    results = median_ms({"flat": flat, "node": hybrid("node"), "path": hybrid("path")}, setup, repeats)
    results["commit"] = median_ms({"c": lambda c: rt.compact_cache(c, p, keep)}, commit_setup, repeats)["c"]
    rt.TREE_STRATEGY = "auto"
    results["auto"] = "path" if rt._use_path_batched(rt._tree_plan(parents, "cpu"), "cpu") else "node"
    leaves = n_nodes - len({q for q in parents if q >= 0})
    results["shape"] = f"{n_nodes}n/d{max(depth) + 1}/{leaves}l"
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--presets", default="tiny-qwen3_5,tiny-qwen3-next")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps the timings steadier)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU float32, medians of {args.repeats}")
    with torch.inference_mode():
        for name in args.presets.split(","):
            model = build_target(name, seed=0)
            prompt = torch.randint(0, 60, (1, args.prompt))
            print(f"\n== {name} (prompt {args.prompt}) ==")
            print(f"{'chain block':>12} | {'naive round':>11} | {'lossless round':>14} | {'commit':>7} | ratio")
            for block in (8, 16):
                naive, lossless, commit = bench_chain(model, prompt, block, args.repeats)
                print(f"{block:>12} | {naive:9.2f}ms | {lossless:12.2f}ms | {commit:5.2f}ms | {lossless / naive:.2f}x")
            print(
                f"{'tree':>16} | {'flat verify':>11} | {'node-rec':>9} | {'path-bat':>9} | "
                f"{'node/flat':>9} | {'path/flat':>9} | auto | commit"
            )
            for n, depth in ((8, 6), (16, 8), (32, 8), (64, 12)):
                r = bench_tree(model, prompt, n, depth, args.repeats, rng)
                print(
                    f"{r['shape']:>16} | {r['flat']:9.2f}ms | {r['node']:7.2f}ms | {r['path']:7.2f}ms | "
                    f"{r['node'] / r['flat']:8.2f}x | {r['path'] / r['flat']:8.2f}x | {r['auto']} | {r['commit']:.2f}ms"
                )


if __name__ == "__main__":
    main()
