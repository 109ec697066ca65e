"""Acceptance power: do the planted tree bugs move acceptance away from what a correct tree reaches on a pair?

    python benchmarks/bench_acceptance_power.py --pair b                       # tests/data/pair_b, its block size
    python benchmarks/bench_acceptance_power.py --pair shipped --budgets 8,16 --dtype bfloat16
    python benchmarks/bench_acceptance_power.py --pair b --trees vendored,upstream --json

For a pair (``shipped``: patcher/data/trained_pair; ``b``: tests/data/pair_b; or a folder with ``target/``,
``draft/`` and ``metadata.json``), greedy, on the first ``--prompts`` of its held-out prompts:

- ddpatch's from-scratch reference (``reference_decode``): per method its own decode (``decode``), and at every
  start ``s`` the acceptance a correct tree reaches (``Positions``, with the set reachable within ε, ε as
  ``acceptance.epsilon`` makes it for this pair at this dtype) and the per-prompt ``floor``;
- the correct tree and each mutant of ``tests/tree_mutants.py`` (patched ``vendored/ddtree``, or the real DDTree
  HEAD from ``../shared/upstream/ddtree.bundle``), through the tree's own ``dflash_generate`` /
  ``ddtree_generate`` (as ``tools/train_tiny_pair.py --measure`` does).

Per tree, mutant and method it prints the mean acceptance, the reference decode's, whether every output token equals
the target's greedy one, the prompts whose judged mean (rounds that start a block or more before the end) is below
the floor, the judged rounds that differ from the reference at the same start (above or below every acceptance a
correct tree may reach there) and the first of them. Nothing is asserted: it measures what a judge could see.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAIRS = {"shipped": ROOT / "patcher" / "data" / "trained_pair", "b": ROOT / "tests" / "data" / "pair_b"}


def verifier_module(*names: str):
    """The verifier's module under its new path (``patcher/verify/judge/...``) or its old one."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {names}")


# ----------------------------------------------------------------------------- the pair and the reference
def load_pair(pair: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "vendored" / "dflash"))
    from dflash.model import DFlashDraftModel  # the class the pair was trained with: the reference drives it

    dt = getattr(torch, dtype)
    target = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=dt, local_files_only=True).eval()
    draft = DFlashDraftModel.from_pretrained(pair / "draft", dtype=dt, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(pair / "target", local_files_only=True)
    return target, draft, tok


def reference(target, draft, prompts: list[list[int]], methods: list[str], n: int, block: int, log) -> dict:
    """Per prompt: the target's greedy continuation, and per method the reference decode's rounds, the reference
    acceptance and the reachable set at every start, and the floor over the judged starts."""
    import torch

    rd = verifier_module("patcher.verify.judge.acceptance.reference_decode", "patcher.verify.judge.reference_decode", "patcher.verify.reference_decode")
    acc = verifier_module("patcher.verify.judge.acceptance", "patcher.verify.acceptance")
    greedy = verifier_module("patcher.verify.models.load", "patcher.verify.models").greedy
    pair = rd.ScratchPair(target, draft, draft.mask_token_id, block)
    conts = [greedy(target, torch.tensor([p]), n + block - 1) for p in prompts]  # Positions reads a block past the end
    eps = acc.epsilon(target, draft, prompts[0], conts[0], draft.mask_token_id, block)["logits"]
    horizon = acc.horizon_of(n, block)
    out = []
    for i, (prompt, cont) in enumerate(zip(prompts, conts)):
        pos = rd.Positions(pair, prompt, cont, methods, n, eps)
        entry = {"greedy": cont[:n], "methods": {}}
        for m in methods:
            new, rounds = rd.decode(pair, prompt, m, n)
            entry["methods"][m] = {"rounds": rounds, "exact": new == cont[: len(new)], "at": pos.reference[m],
                                   "reachable": pos.reachable[m], "floor": rd.floor(pos.reachable[m], horizon)}
        out.append(entry)
        log(f"reference: prompt {i + 1}/{len(prompts)}")
    return {"epsilon": eps, "horizon": horizon, "prompts": out}


# ----------------------------------------------------------------------------- a tree's own decoders
def run_tree(tree: Path, pair: Path, target, dtype: str, prompts: list[list[int]], methods: list[str], n: int,
             block: int) -> dict:
    """Per method: per prompt the new tokens and the acceptance of each round."""
    import torch

    from tree_mutants import import_tree

    dflash_generate, ddtree_generate, draft_class = import_tree(tree)
    draft = draft_class.from_pretrained(pair / "draft", dtype=getattr(torch, dtype), local_files_only=True).eval()
    out = {}
    for m in methods:
        runs = []
        for p in prompts:
            ids = torch.tensor([p])
            kw = dict(model=draft, target=target, input_ids=ids, mask_token_id=draft.mask_token_id, max_new_tokens=n,
                      block_size=block, stop_token_ids=None, temperature=0.0)
            res = dflash_generate(**kw) if m == "dflash" else ddtree_generate(**kw, tree_budget=int(m.rsplit("tb", 1)[1]))
            runs.append({"tokens": res.output_ids[0, len(p):].tolist(), "rounds": [int(a) for a in res.acceptance_lengths]})
        out[m] = runs
    return out


# ----------------------------------------------------------------------------- the comparison
def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def compare(runs: list[dict], ref: dict, m: str) -> dict:
    """One method of one tree against the reference: means, exactness, floor, and the judged rounds that differ."""
    rd = verifier_module("patcher.verify.judge.acceptance.reference_decode", "patcher.verify.judge.reference_decode", "patcher.verify.reference_decode")
    horizon, rows, first, ref_rows = ref["horizon"], [], None, []
    above = below = differ = judged = 0
    below_floor = []
    for i, (run, rp) in enumerate(zip(runs, ref["prompts"])):
        gold, r = rp["greedy"], rp["methods"][m]
        diverge = next((k for k, (a, b) in enumerate(zip(run["tokens"], gold)) if a != b), min(len(run["tokens"]), len(gold)))
        s, mine = 0, []
        for k, a in enumerate(run["rounds"]):
            if s >= horizon or s >= diverge:  # the last rounds may be cut; past a divergence the starts differ
                break
            mine.append(a)
            judged += 1
            reach = r["reachable"][s]
            if a != r["at"][s]:
                differ += 1
                if first is None:
                    first = {"prompt": i, "round": k, "start": s, "accepted": a, "reference": r["at"][s], "reachable": reach}
            above += a > max(reach)
            below += a < min(reach)
            s += a
        if mine and _mean(mine) < r["floor"] - 1e-9:
            below_floor.append(i)
        rows.append(mine)
        ref_rows.append(rd.walk(r["at"], horizon))
    every = [a for run in runs for a in run["rounds"]]
    ref_every = [a for rp in ref["prompts"] for a in rp["methods"][m]["rounds"]]
    return {"mean": round(_mean(every), 3), "reference_mean": round(_mean(ref_every), 3),
            "judged_mean": round(_mean([a for x in rows for a in x]), 3),
            "reference_judged_mean": round(_mean([a for x in ref_rows for a in x]), 3),
            "per_prompt": [{"judged_mean": round(_mean(x), 3), "floor": round(rp["methods"][m]["floor"], 3)}
                           for x, rp in zip(rows, ref["prompts"])],
            "exact": all(run["tokens"] == rp["greedy"] for run, rp in zip(runs, ref["prompts"])),
            "prompts_below_floor": below_floor, "judged_rounds": judged, "rounds_differing": differ,
            "rounds_above_reachable": int(above), "rounds_below_reachable": int(below), "first_difference": first,
            "rounds": [run["rounds"] for run in runs]}


def seen(row: dict) -> str:
    """What a judge holding this reference sees: the mean below the floor, a round outside the reachable set, or nothing."""
    out = []
    if row["prompts_below_floor"]:
        out.append(f"mean<floor x{len(row['prompts_below_floor'])}")
    if row["rounds_above_reachable"]:
        out.append(f"round>reach x{row['rounds_above_reachable']}")
    if row["rounds_below_reachable"]:
        out.append(f"round<reach x{row['rounds_below_reachable']}")
    return ", ".join(out) or "nothing"


# ----------------------------------------------------------------------------- main
def trees_for(kinds: list[str], tmp: Path, bundle: Path, log):
    """(kind, patched tree, catalog) for each kind; a kind whose tree cannot be made is left out, said so."""
    import tree_mutants as tm

    for kind in kinds:
        tree = tm.patched_vendored(tmp / kind) if kind == "vendored" else tm.patched_upstream(tmp / kind, bundle)
        if tree is None:
            log(f"{kind}: {bundle} is absent: left out")
            continue
        yield kind, tree, tm.CATALOGS[kind]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--pair", default="b", help="shipped, b, or a folder with target/, draft/ and metadata.json")
    ap.add_argument("--trees", default="vendored", help="vendored, upstream (the real DDTree HEAD), or both comma-separated")
    ap.add_argument("--mutants", default="", help="mutant names, comma-separated (default: all; 'none': the correct tree only)")
    ap.add_argument("--prompts", type=int, default=4, help="held-out prompts of the pair's metadata.json")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=None, help="default: the drafter's own (its config's block_size)")
    ap.add_argument("--budgets", default="8,16", help="DDTree budgets, comma-separated")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--bundle", type=Path, default=None, help="the real DDTree's git bundle (default: ../shared/upstream/ddtree.bundle)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    pair = PAIRS.get(args.pair, Path(args.pair))
    if not (pair / "draft" / "config.json").is_file() or not (pair / "metadata.json").is_file():
        print(f"bench_acceptance_power: error: {pair} is not a pair folder (target/, draft/, metadata.json)", file=sys.stderr)
        return 2

    for path in (ROOT, ROOT / "tests"):
        sys.path.insert(0, str(path))
    import tree_mutants as tm

    known = {m.name for catalog in tm.CATALOGS.values() for m in catalog} | {"none"}
    unknown = sorted(set(args.mutants.split(",")) - known - {""})
    trees = sorted(set(args.trees.split(",")) - set(tm.CATALOGS))
    if unknown or trees:
        what = (f"no mutant {', '.join(unknown)} (known: {', '.join(sorted(known))})" if unknown else
                f"no tree {', '.join(trees)} (known: {', '.join(tm.CATALOGS)})")
        print(f"bench_acceptance_power: error: {what}", file=sys.stderr)
        return 2

    import torch

    torch.set_num_threads(args.threads)
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.0f}s] {msg}", file=sys.stderr, flush=True)

    target, draft, tok = load_pair(pair, args.dtype)
    block = args.block_size or int(draft.config.block_size)
    meta = json.loads((pair / "metadata.json").read_text())
    prompts = [tok(p).input_ids for p in meta["held_out_prompts"][: args.prompts]]
    budgets = [int(b) for b in args.budgets.split(",") if b]
    tree_methods = [f"ddtree_tb{b}" for b in budgets]
    methods = ["dflash"] + tree_methods
    ref = reference(target, draft, prompts, methods, args.max_new_tokens, block, log)
    wanted = set(args.mutants.split(",")) - {""}
    result = {"pair": str(pair.resolve().relative_to(ROOT) if pair.resolve().is_relative_to(ROOT) else pair), "dtype": args.dtype, "block_size": block, "budgets": budgets, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "epsilon": ref["epsilon"], "horizon": ref["horizon"],
              "reference": {m: {"mean": round(_mean([a for p in ref["prompts"] for a in p["methods"][m]["rounds"]]), 3),
                                "exact": all(p["methods"][m]["exact"] for p in ref["prompts"]),
                                "floors": [round(p["methods"][m]["floor"], 3) for p in ref["prompts"]]}
                            for m in methods},
              "trees": {}}

    with tempfile.TemporaryDirectory(prefix="acceptance-power-") as tmp:
        for kind, tree, catalog in trees_for(args.trees.split(","), Path(tmp), args.bundle or tm.BUNDLE, log):
            rows = {}
            chosen = [m for m in catalog if not wanted or m.name in wanted]
            for mutant in [None] + chosen:
                name = "correct" if mutant is None else mutant.name
                subject = tree if mutant is None else tm.plant(tree, mutant, Path(tmp) / f"{kind}-{name}")
                ms = methods if mutant is None or "dflash" in mutant.methods else tree_methods
                start = time.time()
                runs = run_tree(subject, pair, target, args.dtype, prompts, ms, args.max_new_tokens, block)
                rows[name] = {"what": "" if mutant is None else mutant.what, "expect": "" if mutant is None else mutant.expect,
                              "seconds": round(time.time() - start, 1),
                              "methods": {m: compare(runs[m], ref, m) for m in ms}}
                log(f"{kind} {name}: " + ", ".join(f"{m} {r['mean']:.2f}" for m, r in rows[name]["methods"].items()))
            result["trees"][kind] = rows
    result["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(result) if args.json else table(result))
    return 0


def table(result: dict) -> str:
    ref = result["reference"]
    lines = [f"pair {result['pair']}: {result['dtype']}, block {result['block_size']}, {result['prompts']} prompts x "
             f"{result['max_new_tokens']} new tokens, epsilon {result['epsilon']:.2e} (logits), judged starts < "
             f"{result['horizon']}; reference decode: " + ", ".join(
                 f"{m} {r['mean']:.2f}{'' if r['exact'] else ' (NOT exact)'}" for m, r in ref.items())]
    for kind, rows in result["trees"].items():
        lines += ["", f"{kind}:", "| mutant | method | mean | reference | judged | reference judged | exact | judge sees "
                  "| rounds differing | first difference (start: new tokens before the round) |", "|---" * 10 + "|"]
        for name, row in rows.items():
            for m, r in row["methods"].items():
                f = r["first_difference"]
                first = "-" if f is None else (f"prompt {f['prompt']}, round {f['round'] + 1}, start {f['start']}: "
                                               f"{f['accepted']} vs {f['reference']}")
                lines.append(f"| {name} | {m} | {r['mean']:.2f} | {r['reference_mean']:.2f} | {r['judged_mean']:.2f} | "
                             f"{r['reference_judged_mean']:.2f} | {'yes' if r['exact'] else 'NO'} | {seen(r)} | "
                             f"{r['rounds_differing']}/{r['judged_rounds']} | {first} |")
    lines.append(f"\n{result['seconds']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
