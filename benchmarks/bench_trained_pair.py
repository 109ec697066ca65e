"""Acceptance and speed of a patched DDTree tree on the trained tiny pair (patcher/data/trained_pair).

    python benchmarks/bench_trained_pair.py                  # patches vendored/ddtree into a temporary folder
    python benchmarks/bench_trained_pair.py --tree /tmp/x    # an already patched tree
    python benchmarks/bench_trained_pair.py --json --repeats 3

On the pair's held-out prompts (metadata.json), greedy, float32, CPU: per method (DFlash, DDTree at each
budget) the mean acceptance and its histogram, and for the target's own greedy loop (the tree's
dflash_generate at block_size=1, the baseline DFlash's benchmark uses) and each method the tokens per
second, the speedup, and the speedup divided by the mean acceptance: the share of the ideal speedup
that the decode loop keeps (1.0 is the limit: every round would cost one greedy step). Times are the
decoder calls only (models loaded, one warm-up call per method first), the median of --repeats passes
over all prompts, in wall seconds and in this process's CPU seconds (steadier on a shared machine).
Every output is checked against the baseline's tokens, and each mean acceptance is printed next to
the one ddpatch's from-scratch reference decode reached (acceptance_floor.json), where it has one.
Plain transformers greedy decoding (``generate``-free, with a cache) is timed too, for reference.

Goals (issue 31, reported, never asserted): DFlash mean acceptance >= 3.0 at block 8; DDTree above
DFlash at every budget >= 8; the best method faster than target greedy on the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAIR = ROOT / "patcher" / "data" / "trained_pair"


def patched_tree(dest: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "patcher.cli", "apply", str(ROOT / "vendored" / "ddtree"), "--out", str(dest)],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"bench_trained_pair: ddpatch apply failed:\n{proc.stdout}{proc.stderr}")
    return dest


def load(tree: Path, pair: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from patcher.verify.subjects import decoders, methods
    from patcher.verify.plumbing.events import error_summary

    loaded = methods.load(tree, decoders.plan(tree), [8], error_summary)
    by_label = {m.decoder["label"]: m.fn for m in loaded.methods if m.fn is not None}
    fns = {"dflash_generate": by_label["dflash"], "ddtree_generate": by_label.get("ddtree"), "DFlashDraftModel": loaded.drafters[loaded.primary]}
    target = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=torch.float32, local_files_only=True).eval()
    draft = fns["DFlashDraftModel"].from_pretrained(pair / "draft", dtype=torch.float32, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(pair / "target", local_files_only=True)
    return fns, target, draft, tok


def reference_acceptance(pair: Path, n_prompts: int, new: int, block: int) -> dict:
    """Per method, the mean acceptance of ddpatch's from-scratch reference decode (the stored floor file)."""
    from patcher.verify.judge.acceptance.floor import FLOOR_FILE
    from patcher.verify.judge.acceptance.reference_decode import walk

    path = pair / FLOOR_FILE
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if data["settings"]["block_size"] != block or data["settings"]["max_new_tokens"] < new:
        return {}
    out = {}
    for method in data["prompts"][0]["methods"]:
        rounds = [a for p in data["prompts"][:n_prompts] for a in walk(p["methods"][method]["at"], new, p["stop_at"] if p["stop_at"] is not None and p["stop_at"] < new else None)]
        out[method] = round(sum(rounds) / len(rounds), 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--tree", type=Path, default=None, help="a patched DDTree tree (default: patch vendored/ddtree into a temporary folder)")
    ap.add_argument("--pair", type=Path, default=PAIR, help="the pair's folder (target/, draft/, metadata.json)")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (default: all 8)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--budgets", default="8,16,32", help="DDTree budgets, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over the prompts (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a tiny model spends more on hand-offs than on matmuls)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",") if b]

    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    from patcher.verify.subjects.binding import call_generate
    from patcher.verify.models.load import greedy

    with tempfile.TemporaryDirectory(prefix="bench-pair-") as tmp:
        tree = args.tree.resolve() if args.tree else patched_tree(Path(tmp) / "ddtree")
        fns, target, draft, tok = load(tree, args.pair)
        meta = json.loads((args.pair / "metadata.json").read_text())
        prompts = [tok(p, return_tensors="pt").input_ids for p in meta["held_out_prompts"][: args.prompts]]
        mask = draft.mask_token_id
        methods = [("target greedy (block_size=1)", fns["dflash_generate"], 1, None), ("dflash", fns["dflash_generate"], args.block_size, None)]
        methods += [(f"ddtree_tb{b}", fns["ddtree_generate"], args.block_size, b) for b in budgets]

        def one(fn, block, budget, ids):
            c0 = time.process_time()
            new, acc, wall = call_generate(fn, model=draft, target=target, input_ids=ids, mask_token_id=mask, max_new_tokens=args.max_new_tokens,
                                           block_size=block, stop_token_ids=[], tree_budget=budget, strict=False)
            return new, acc, wall, time.process_time() - c0

        def hf_greedy(ids):
            c0, t0 = time.process_time(), time.perf_counter()
            new = greedy(target, ids, args.max_new_tokens)
            return new, time.perf_counter() - t0, time.process_time() - c0

        for _, fn, block, budget in methods:  # warm-up
            one(fn, block, budget, prompts[0])
        hf_greedy(prompts[0])
        load_before = os.getloadavg()
        rows = {name: {"wall": [], "cpu": [], "acceptance": [], "tokens": 0, "lossless": True} for name, *_ in methods}
        hf = {"wall": [], "cpu": []}
        for rep in range(args.repeats):
            totals = {name: [0.0, 0.0] for name, *_ in methods}
            hf_total = [0.0, 0.0]
            for ids in prompts:
                base = None
                for name, fn, block, budget in methods:
                    new, acc, wall, cpu = one(fn, block, budget, ids)
                    base = new if base is None else base
                    totals[name][0] += wall
                    totals[name][1] += cpu
                    if rep == 0:
                        rows[name]["tokens"] += len(new)
                        rows[name]["lossless"] &= new == base
                        if block > 1:
                            rows[name]["acceptance"] += acc
                new, wall, cpu = hf_greedy(ids)
                hf_total[0] += wall
                hf_total[1] += cpu
            for name, (wall, cpu) in totals.items():
                rows[name]["wall"].append(wall)
                rows[name]["cpu"].append(cpu)
            hf["wall"].append(hf_total[0])
            hf["cpu"].append(hf_total[1])
        load_after = os.getloadavg()

    reference = reference_acceptance(args.pair, args.prompts, args.max_new_tokens, args.block_size)
    base_name = methods[0][0]
    base = rows[base_name]
    tokens = base["tokens"]

    def rate(row, key):
        return tokens / statistics.median(row[key])

    out_rows = []
    hf_row = {"method": "transformers greedy (cache)", "tokens": tokens,
              "seconds": round(statistics.median(hf["wall"]), 3), "cpu_seconds": round(statistics.median(hf["cpu"]), 3),
              "tokens_per_s": round(tokens / statistics.median(hf["wall"]), 1), "tokens_per_cpu_s": round(tokens / statistics.median(hf["cpu"]), 1)}
    for name, row in rows.items():
        r = {"method": name, "tokens": row["tokens"], "lossless": row["lossless"],
             "seconds": round(statistics.median(row["wall"]), 3), "cpu_seconds": round(statistics.median(row["cpu"]), 3),
             "tokens_per_s": round(rate(row, "wall"), 1), "tokens_per_cpu_s": round(rate(row, "cpu"), 1)}
        if row["acceptance"]:
            acc = row["acceptance"]
            hist: dict[str, int] = {}
            for a in sorted(acc):
                hist[str(a)] = hist.get(str(a), 0) + 1
            mean = sum(acc) / len(acc)
            r.update(mean_acceptance=round(mean, 3), acceptance_histogram=hist, rounds=len(acc),
                     reference_acceptance=reference.get(name),
                     speedup=round(rate(row, "wall") / rate(base, "wall"), 3), speedup_cpu=round(rate(row, "cpu") / rate(base, "cpu"), 3))
            r["speedup_per_acceptance"] = round(r["speedup"] / mean, 3)
            r["speedup_cpu_per_acceptance"] = round(r["speedup_cpu"] / mean, 3)
            r["speedup_vs_transformers_greedy"] = round(rate(row, "wall") / (tokens / statistics.median(hf["wall"])), 3)
        out_rows.append(r)
    drafted = [r for r in out_rows if "mean_acceptance" in r]
    dflash = next(r for r in drafted if r["method"] == "dflash")
    best = max(drafted, key=lambda r: r["speedup"])
    goals = {
        "dflash_mean_acceptance_at_least_3": dflash["mean_acceptance"] >= 3.0 if args.block_size == 8 else None,
        "ddtree_above_dflash_at_every_budget_from_8": all(r["mean_acceptance"] > dflash["mean_acceptance"]
                                                          for r in drafted if r["method"].startswith("ddtree_tb") and int(r["method"][9:]) >= 8),
        "best_wall_clock_speedup_above_1": best["speedup"] > 1.0,
    }
    payload = {"tree": str(args.tree or "vendored/ddtree, patched by ddpatch apply"), "pair": str(args.pair), "device": "cpu",
               "dtype": "float32", "threads": args.threads, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "block_size": args.block_size, "repeats": args.repeats, "load_average": {"before": [round(x, 2) for x in load_before],
               "after": [round(x, 2) for x in load_after]}, "baseline": base_name, "methods": out_rows, "transformers_greedy": hf_row,
               "best": best["method"], "goals": goals}
    if args.json:
        print(json.dumps(payload, indent=1))
        return 0
    print(f"trained pair · {len(prompts)} prompts x {args.max_new_tokens} new tokens · block {args.block_size} · float32 CPU, "
          f"{args.threads} thread(s) · median of {args.repeats} · load {load_before[0]:.1f} -> {load_after[0]:.1f}")
    print(f"{'method':<30} {'accept':>6} {'(ref)':>6} {'tok/s':>7} {'tok/cpu-s':>9} {'speedup':>8} {'cpu':>6} {'/accept':>8}  histogram")
    for r in out_rows:
        ref = f"{r['reference_acceptance']:.2f}" if r.get("reference_acceptance") is not None else "-"
        if "mean_acceptance" in r:
            print(f"{r['method']:<30} {r['mean_acceptance']:>6.2f} {ref:>6} {r['tokens_per_s']:>7.1f} {r['tokens_per_cpu_s']:>9.1f} "
                  f"{r['speedup']:>7.2f}x {r['speedup_cpu']:>5.2f}x {r['speedup_per_acceptance']:>8.2f}  "
                  + " ".join(f"{k}:{v}" for k, v in r["acceptance_histogram"].items()) + ("" if r["lossless"] else "  LOSSY"))
        else:
            print(f"{r['method']:<30} {'-':>6} {'-':>6} {r['tokens_per_s']:>7.1f} {r['tokens_per_cpu_s']:>9.1f} {'1.00x':>8} {'1.00x':>6}")
    print(f"{hf_row['method']:<30} {'-':>6} {'-':>6} {hf_row['tokens_per_s']:>7.1f} {hf_row['tokens_per_cpu_s']:>9.1f}")
    for goal, met in goals.items():
        print(f"goal {goal}: {'met' if met else 'NOT met' if met is not None else 'n/a'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
