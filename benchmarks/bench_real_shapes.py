"""`ddpatch verify --target DIR --scripted-draft` at Qwen3.6-27B's real per-layer sizes, on this machine.

    python benchmarks/bench_real_shapes.py                          # 4 layers, the real 248,320-token vocabulary
    python benchmarks/bench_real_shapes.py --vocab 32768            # the same layers, a smaller vocabulary
    python benchmarks/bench_real_shapes.py --vocab 8192 --layers 4 --json
    python benchmarks/bench_real_shapes.py --build-only             # only make (or find) the target folder
    python benchmarks/bench_real_shapes.py --vocab 32768 --profile  # where verify's time and memory go
    python benchmarks/bench_real_shapes.py --judged --judged-only   # acceptance judged, with a drafter that predicts

The target is a Qwen3.5-architecture hybrid (``Qwen3_5ForCausalLM``) with Qwen3.6-27B's text config
(``bench_rollback.QWEN3_6_27B``: hidden 5,120, MLP 17,408, 24 query / 4 KV heads of 256 with the output
gate, partial rotary 0.25, Gated DeltaNet with 16 QK / 48 V heads of 128), an untied LM head, in
bfloat16, with ``--layers`` layers (default 4: three Gated DeltaNet, then one full attention, as every
fourth layer of the real model) and a ``--vocab``-token vocabulary (default the real 248,320: 4.06 B
parameters, 8.1 GB). Weights are random, seeded, and made by the model class's own ``_init_weights``
one module at a time on a model that lives on the meta device: no float32 copy and never the whole
model in memory (the peak is the largest module, the 2.5 GB embedding); they are streamed into one
safetensors file. The folder is built once and kept (``--folder``, default /tmp/ddpatch-real-shapes),
named by its sizes and seed; a folder is complete only once its ``bench_real_shapes.json`` is written.

It then patches vendored/ddtree (``python -m patcher apply``) into a temporary folder and runs, as a
user would::

    python3 -m patcher verify TREE --target DIR --scripted-draft --dtype bfloat16 --format json --timeout T

and prints its wall time, CPU time (user + system, of the verify and every process it waited for: the
verifier's child) and peak RSS (the largest process of that tree: ``os.wait4``'s rusage), its exit code
and its verdict or error line. While it runs the tree's resident memory is sampled every second: the
run is stopped (SIGKILL to its process group) past ``--max-rss-gb`` or ``--time-limit``, so that a
hopeless run on a shared machine ends with figures instead of taking the machine with it.

``--judged`` also verifies with a real-shaped DFlash drafter (2 layers of the target's sizes, block 16), unscripted,
so that every method's acceptance is judged against the run's own reference (``JUDGED``: 2 prompts x 48 tokens,
budgets 8 and 16, greedy). A drafter with random weights predicts nothing and its acceptance can only be called
inconclusive, and none can be trained here, so by default the judged pair is ``real_shapes_copy_pair.py``'s: the same
classes and sizes, a target whose greedy text repeats its current token for a few steps, and a drafter whose weights
are set by hand to propose the anchor token at every block position (kept in its own folder, ``...-copy-...``).
``--judged-drafter random`` judges the random drafter on the scripted run's target instead.

``--profile`` runs the same verify in one process of its own (the verifier's ``worker.run``, imported as
``patcher.verify.child.worker``, on the same settings) with timing wrappers on the verifier's named steps
(``PROFILED``; a name this checkout lacks is listed as absent) and hooks on the target, and prints per
step: calls, seconds (inclusive: a step's time holds the steps it calls), the target forwards it ran
directly (count, tokens fed, logits rows computed, seconds in them and in the LM head), and how much it
raised the process's peak RSS. The figures are for the code in this checkout: rerun after a change.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_shapes_build import DRAFT_BLOCK, DRAFT_LAYERS, QWEN3_6_27B, REAL_VOCAB, ROOT, stream_init, text_config  # noqa: E402

MARKER = "bench_real_shapes.json"


# ----------------------------------------------------------------------------- the target folder
def folder_for(root: Path, vocab: int, layers: int, seed: int, kind: str = "random") -> Path:
    return root / f"qwen3_6-27b-{'shapes' if kind == 'random' else kind}-L{layers}-V{vocab}-s{seed}"


def build_target(dest: Path, vocab: int, layers: int, seed: int) -> dict:
    """Write the target folder (config.json, model.safetensors) into ``dest``; returns what was built."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    start = time.perf_counter()
    config = text_config(vocab, layers)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    model.to(torch.bfloat16)  # on the meta device: nothing is allocated
    model.config.architectures = [type(model).__name__]
    model.config.dtype = torch.bfloat16
    offset = stream_init(model, dest, seed)
    model.config.save_pretrained(dest)
    params = offset // 2
    return {"vocab": vocab, "layers": layers, "seed": seed, "parameters": params, "bytes": offset,
            "build_seconds": round(time.perf_counter() - start, 1), **QWEN3_6_27B}



def build_drafter(dest: Path, tree: Path, target_info: dict, seed: int) -> dict:
    """A drafter folder of the tree's own ``DFlashDraftModel`` class at the real sizes, random and seeded (it predicts
    nothing: its acceptance row measures the cost of judging, and says it cannot judge this drafter)."""
    import importlib
    import sys as _sys

    import torch

    start = time.perf_counter()
    _sys.path.insert(0, str(tree))
    try:
        cls = importlib.import_module("model").DFlashDraftModel
    finally:
        _sys.path.remove(str(tree))
    dims = QWEN3_6_27B
    layers = target_info["layers"]
    cfg = cls.config_class(vocab_size=target_info["vocab"], hidden_size=dims["hidden_size"], intermediate_size=dims["intermediate_size"],
                           num_hidden_layers=DRAFT_LAYERS, num_attention_heads=dims["num_attention_heads"],
                           num_key_value_heads=dims["num_key_value_heads"], head_dim=dims["head_dim"], max_position_embeddings=4096,
                           tie_word_embeddings=False, layer_types=["full_attention"] * DRAFT_LAYERS)
    cfg.block_size = DRAFT_BLOCK
    cfg.num_target_layers = layers
    cfg.dflash_config = {"mask_token_id": target_info["vocab"] - 1, "target_layer_ids": sorted({1, layers - 2})}
    cfg.architectures = [cls.__name__]
    with torch.device("meta"):
        model = cls(cfg)
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    size = stream_init(model, dest, seed + 1)
    model.config.save_pretrained(dest)
    return {"layers": DRAFT_LAYERS, "block_size": DRAFT_BLOCK, "bytes": size, "parameters": size // 2,
            "build_seconds": round(time.perf_counter() - start, 1)}


def copy_constants_match(info: dict) -> bool:
    """Whether a kept copy-pair target was built with ``real_shapes_copy_pair``'s present constants."""
    import real_shapes_copy_pair as pair

    wanted = {"gain": pair.GAIN, "penalty": pair.REPEAT_PENALTY, "row_spread": pair.ROW_SPREAD, "recency": pair.RECENCY}
    return all(info.get(k) == v for k, v in wanted.items())


def target_folder(root: Path, vocab: int, layers: int, seed: int, kind: str = "random") -> tuple[Path, dict, bool]:
    """The target folder for these sizes, built if it is not there yet: (folder, what it holds, built now). ``kind``
    "copy": the target of ``real_shapes_copy_pair`` (its drafter predicts), else random weights."""
    final = folder_for(root, vocab, layers, seed, kind)
    if (final / MARKER).is_file():
        info = json.loads((final / MARKER).read_text())
        if kind != "copy" or copy_constants_match(info):
            return final, info, False
    root.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=final.name + ".partial-", dir=root))
    if kind == "copy":
        from real_shapes_copy_pair import GAIN, build_copy_target

        info = build_copy_target(partial, vocab, layers, seed, GAIN)
    else:
        info = build_target(partial, vocab, layers, seed)
    (partial / MARKER).write_text(json.dumps(info, indent=1))
    if final.exists():  # an incomplete folder from a run that died
        import shutil

        shutil.rmtree(final)
    partial.rename(final)
    return final, info, True


# ----------------------------------------------------------------------------- the profile
#: (module of patcher.verify, attribute path): the steps ``--profile`` times.
PROFILED = (
    ("models.load", "load_real"), ("models.load", "greedy"), ("models.load", "multi_token_consistent"),
    ("judge.one_model", "verify_model"), ("judge.decode_loop", "never_emitted"), ("judge.drafter.verdict", "calibrated"),
    ("judge.drafter.verdict", "judge_or_skip"), ("judge.calibration", "calibrate"), ("subjects.binding", "call_generate"),
    ("models.script", "ScriptedDraft.__init__"), ("models.script", "ScriptedDraft._extend"),
    ("models.script", "ScriptedDraft._target_rows"), ("judge.logits", "reference_logits"), ("judge.logits", "judge_logits"),
    ("judge.drafter.recorder", "calibrate"), ("judge.drafter.verdict", "judge"), ("judge.drafter.recorder", "Reference.__init__"),
    ("judge.drafter.recorder", "reference_output"), ("judge.drafter.verdict", "_nearest"), ("judge.drafter.verdict", "_noise"),
    ("judge.drafter.verdict", "_output"), ("judge.neartie", "judge_ties"),
    ("judge.acceptance.pair_reference", "floor_for"), ("judge.acceptance.pair_reference", "in_run_floor"),
    ("judge.acceptance.pair_reference", "epsilon_of"), ("judge.acceptance.pair_reference", "prompt_entry"),
    ("judge.acceptance.verdict", "method_check"),
)


def profile_child(cfg: dict) -> dict:
    """Run the verifier's child in this process with the steps of ``PROFILED`` timed (``--profile``)."""
    import importlib
    import resource

    import torch

    sys.path.insert(0, str(ROOT))
    worker = importlib.import_module("patcher.verify.child.worker")
    stats: dict[str, dict] = {}
    stack: list[str] = []

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def row(name: str) -> dict:
        return stats.setdefault(name, {"calls": 0, "seconds": 0.0, "forwards": 0, "tokens": 0, "logits_rows": 0,
                                       "forward_s": 0.0, "head_s": 0.0, "peak_raised_gib": 0.0})

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            stack.append(name)
            before, start = peak(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()
                r = row(name)
                r["calls"] += 1
                r["seconds"] += time.perf_counter() - start
                r["peak_raised_gib"] += (peak() - before) / 2**30
        wrapper.__wrapped__ = fn
        return wrapper

    def module_of(name: str):
        try:
            return worker.sibling(name)
        except ImportError:
            return None

    absent = []
    for module_name, path in PROFILED:
        module = module_of(module_name)
        if module is None:
            absent.append(f"{module_name}.{path}")
            continue
        owner, _, attr = path.rpartition(".")
        holder = getattr(module, owner, None) if owner else module
        fn = getattr(holder, attr, None) if holder is not None else None
        if fn is None:
            absent.append(f"{module_name}.{path}")
            continue
        wrapped = timed(f"{module_name}.{path}", fn)
        setattr(holder, attr, wrapped)
        if not owner:  # ``from .models import greedy`` elsewhere: every module of the package that holds it
            for other in list(sys.modules.values()):
                if getattr(other, "__name__", "").startswith("patcher.verify.") and getattr(other, attr, None) is fn:
                    setattr(other, attr, wrapped)

    def hooked(target) -> None:
        head = target.get_output_embeddings()
        clock: dict = {}

        def before(module, args, kwargs):
            clock[module] = time.perf_counter()

        def after(module, args, kwargs, output):
            seconds = time.perf_counter() - clock.pop(module, time.perf_counter())
            r = row(stack[-1] if stack else "(outside)")
            if module is head:
                r["head_s"] += seconds
                return
            ids = args[0] if args else kwargs.get("input_ids")
            logits = getattr(output, "logits", None)
            r["forwards"] += 1
            r["forward_s"] += seconds
            r["tokens"] += int(ids.numel()) if ids is not None else 0
            r["logits_rows"] += int(logits.shape[0] * logits.shape[1]) if logits is not None else 0

        for module in (target, head):
            module.register_forward_pre_hook(before, with_kwargs=True)
            module.register_forward_hook(after, with_kwargs=True)

    models = module_of("models.load")
    load = models.load_real

    def load_and_hook(*args, **kwargs):
        loaded = load(*args, **kwargs)
        hooked(loaded[0])
        return loaded

    models.load_real = load_and_hook
    start = time.perf_counter()
    result = worker.run(cfg)
    total = time.perf_counter() - start
    checks = [{"check": c.get("check"), "passed": c.get("passed"), "evidence": (c.get("evidence") or "")[:160]}
              for m in result.get("models", []) for c in m.get("checks", [])]
    return {"seconds": round(total, 1), "cpu_s": round(time.process_time(), 1), "peak_rss_gib": round(peak() / 2**30, 2),
            "threads": torch.get_num_threads(), "steps": stats, "absent": absent, "checks": checks,
            "fatal": result.get("fatal") or result.get("crash")}


def run_profile(tree: Path, target: Path, time_limit: float, max_rss: float, draft: Path | None = None) -> dict:
    """The verify of ``run_verify`` (scripted, or judged with ``draft``) in one process, its steps timed."""
    sys.path.insert(0, str(ROOT))
    from patcher.verify.process.runner import child_config, child_env

    how = dict(draft=str(draft), **JUDGED_OPTIONS) if draft is not None else dict(scripted_draft=True)
    cfg = child_config(tree, target=str(target), dtype="bfloat16", **how)
    figures, stdout, stderr = watched([sys.executable, str(Path(__file__).resolve()), "--profile-child", json.dumps(cfg)],
                                      time_limit, max_rss, cwd=tempfile.gettempdir(), env=child_env())
    try:  # the profile is the last line; a child stopped early ends on one of the verifier's event lines
        found = json.loads(stdout.splitlines()[-1])
    except (ValueError, IndexError):
        found = None
    if isinstance(found, dict) and "steps" in found:
        return {**found, "outside": figures}
    return {"error": (figures["stopped"] or "the profile printed no result") + "\n" + stderr[-3000:], "outside": figures}


def print_profile(p: dict) -> None:
    if "error" in p:
        print(p["error"])
        return
    print(f"profile: {p['seconds']:.0f} s wall, {p['cpu_s']:.0f} s CPU, peak RSS {p['peak_rss_gib']:.2f} GiB, "
          f"{p['threads']} torch threads{'; ' + p['fatal'] if p.get('fatal') else ''}")
    print(f"  {'step':42} {'calls':>5} {'s (incl.)':>9} {'fwds':>5} {'tokens':>6} {'logit rows':>10} {'fwd s':>7} "
          f"{'head s':>7} {'+peak GiB':>9}")
    for name, r in sorted(p["steps"].items(), key=lambda kv: -kv[1]["seconds"]):
        print(f"  {name:42} {r['calls']:5} {r['seconds']:9.1f} {r['forwards']:5} {r['tokens']:6} {r['logits_rows']:10} "
              f"{r['forward_s']:7.1f} {r['head_s']:7.1f} {r['peak_raised_gib']:9.2f}")
    if p["absent"]:
        print("  absent in this checkout: " + ", ".join(p["absent"]))
    failed = [c for c in p["checks"] if not c["passed"]]
    print(f"  checks: {len(p['checks']) - len(failed)}/{len(p['checks'])} passed"
          + "".join(f"\n    FAIL {c['check']}: {c['evidence']}" for c in failed))


# ----------------------------------------------------------------------------- the verify
def patched_tree(dest: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "patcher", "apply", str(ROOT / "vendored" / "ddtree"), "--out", str(dest)],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"apply failed: {proc.stderr.strip()}")
    return dest


def process_tree(pid: int) -> dict[int, int]:
    """``pid`` and its descendants (the verifier's child leads a session of its own): pid -> resident bytes now."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        found[p] = rss.get(p, 0)
        todo += children.get(p, [])
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL every descendant of ``pid`` (a process group would miss the verifier's child, which leads a session
    of its own), then ``pid`` itself 15 s later unless it exited (ddpatch reports its child's death meanwhile)."""
    for p in reversed(list(process_tree(pid))[1:]):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for _ in range(150):
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def watched(command: list[str], time_limit: float, max_rss: float, **popen) -> tuple[dict, str, str]:
    """Run ``command``, sampling its process tree's memory; stopped past ``max_rss`` GiB or ``time_limit`` s.
    Returns (figures, stdout, stderr): wall, CPU and peak RSS from ``os.wait4``."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True, **popen)
    stopped, sampled_peak, timeline = None, 0, []
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        elapsed = time.perf_counter() - start
        now = sum(process_tree(proc.pid).values())
        sampled_peak = max(sampled_peak, now)
        if not timeline or elapsed - timeline[-1][0] >= 10:
            timeline.append((round(elapsed, 1), round(now / 2**30, 2)))
        if stopped is None and (now > max_rss * 2**30 or elapsed > time_limit + 60):
            stopped = (f"stopped by the benchmark at {elapsed:.0f} s: resident memory {now / 2**30:.1f} GiB > --max-rss-gb {max_rss:g}"
                       if now > max_rss * 2**30 else f"stopped by the benchmark past --time-limit {time_limit:g} s")
            kill_tree(proc.pid)
        time.sleep(1.0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    out.seek(0)
    err.seek(0)
    figures = {"exit_code": proc.returncode, "wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
               "user_s": round(usage.ru_utime, 1), "peak_rss_gib": round(usage.ru_maxrss * 1024 / 2**30, 2),
               "sampled_tree_peak_gib": round(sampled_peak / 2**30, 2), "rss_timeline_gib": timeline, "stopped": stopped}
    return figures, out.read(), err.read()


#: the judged-acceptance run's settings (a CPU's minutes): the drafter's block, two budgets, two prompts, as
#: ``patcher.api.verify`` options (``--profile --judged``) and as the verify command's flags
JUDGED_OPTIONS = dict(prompts=2, max_new_tokens=48, tree_budgets=[8, 16], greedy_only=True)
JUDGED = ["--prompts", str(JUDGED_OPTIONS["prompts"]), "--max-new-tokens", str(JUDGED_OPTIONS["max_new_tokens"]),
          "--tree-budgets", ",".join(map(str, JUDGED_OPTIONS["tree_budgets"])), "--greedy-only"]


def run_verify(tree: Path, target: Path, time_limit: float, max_rss: float, extra: list[str], draft: Path | None = None) -> dict:
    how = ["--draft", str(draft), *JUDGED] if draft is not None else ["--scripted-draft"]
    command = [sys.executable, "-m", "patcher", "verify", str(tree), "--target", str(target), *how,
               "--dtype", "bfloat16", "--format", "json", "--timeout", str(time_limit), *extra]
    figures, stdout, stderr = watched(command, time_limit, max_rss, cwd=ROOT)
    result = {"command": " ".join(command), **figures}
    errors = [line for line in stderr.splitlines() if line.startswith("ddpatch: error:")]
    result["error"] = errors[-1] if errors else None
    try:
        payload = json.loads(stdout)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        result["passed"] = payload.get("passed")
        models = payload.get("models") or payload.get("result", {}).get("models") or []
        result["checks"] = [{"check": c.get("check"), "passed": c.get("passed"), "evidence": (c.get("evidence") or "")[:200],
                             **({"verdict": c["verdict"]} if c.get("verdict") else {})} for m in models for c in m.get("checks", [])]
        result["methods"] = [{k: m.get(k) for k in ("method", "acceptance_mean", "acceptance_histogram", "identical_runs")}
                             for model in models for m in model.get("methods", [])]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=REAL_VOCAB, help=f"vocabulary size (default the real {REAL_VOCAB:,})")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4: 3 Gated DeltaNet + 1 attention)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/ddpatch-real-shapes"), help="where target folders are kept")
    parser.add_argument("--tree", type=Path, default=None, help="an already patched tree (default: vendored/ddtree, patched now)")
    parser.add_argument("--time-limit", type=float, default=3600.0, help="seconds: verify's --timeout (default 3600)")
    parser.add_argument("--max-rss-gb", type=float, default=20.0, help="stop the verify past this resident memory (GiB)")
    parser.add_argument("--verify-args", default="", help='more arguments for verify, one string: "--prompts 1"')
    parser.add_argument("--build-only", action="store_true", help="only make (or find) the target folder")
    parser.add_argument("--judged", action="store_true",
                        help="also verify with a real-shaped drafter (unscripted): acceptance judged against the run's own reference")
    parser.add_argument("--judged-only", action="store_true", help="with --judged: only the judged run, not the scripted one")
    parser.add_argument("--judged-drafter", choices=("copy", "random"), default="copy",
                        help="with --judged: the pair of real_shapes_copy_pair.py, whose hand-set drafter predicts (default; "
                             "its own target folder), or a random-weight drafter on the scripted run's target (it predicts "
                             "nothing: the acceptance rows say inconclusive)")
    parser.add_argument("--profile", action="store_true",
                        help="where the verify's time and memory go, step by step (with --judged: the judged verify's)")
    parser.add_argument("--profile-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    if args.profile_child:
        print(json.dumps(profile_child(json.loads(args.profile_child))))
        return 0

    scripted = not (args.judged and (args.judged_only or args.profile))
    copy = args.judged and args.judged_drafter == "copy"
    summary: dict = {}
    if scripted or not copy:
        target, info, built = target_folder(args.folder, args.vocab, args.layers, args.seed)
        summary.update(target=str(target), built_now=built, model=info)
    if copy:  # the judged verify's own pair: a target whose greedy text the hand-set drafter predicts
        judged_target, judged_info, judged_built = target_folder(args.folder, args.vocab, args.layers, args.seed, "copy")
    elif args.judged:
        judged_target, judged_info, judged_built = target, info, built
    if args.judged:
        summary.update(judged_target=str(judged_target), judged_built_now=judged_built, judged_model=judged_info)
    if not args.build_only:
        with tempfile.TemporaryDirectory(prefix="ddpatch-real-shapes-tree-") as tmp:
            tree = args.tree or patched_tree(Path(tmp) / "ddtree")
            draft = Path(tmp) / "draft" if args.judged else None
            if draft is not None and copy:
                from real_shapes_copy_pair import build_copy_drafter

                summary["drafter"] = {"kind": "copy", **build_copy_drafter(draft, tree, judged_info, args.seed)}
            elif draft is not None:
                summary["drafter"] = {"kind": "random", **build_drafter(draft, tree, judged_info, args.seed)}
            if args.profile and draft is not None:  # the judged verify's steps
                summary["profile"] = run_profile(tree, judged_target, args.time_limit, args.max_rss_gb, draft)
            elif args.profile:
                summary["profile"] = run_profile(tree, target, args.time_limit, args.max_rss_gb)
            else:
                if scripted:
                    summary["verify"] = run_verify(tree, target, args.time_limit, args.max_rss_gb, shlex.split(args.verify_args))
                if draft is not None:
                    summary["judged"] = run_verify(tree, judged_target, args.time_limit, args.max_rss_gb,
                                                   shlex.split(args.verify_args), draft)
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    for prefix in ("", "judged_"):
        m = summary.get(prefix + "model")
        if m is None or (prefix and summary["judged_target"] == summary.get("target")):
            continue
        built = summary[prefix + "built_now"]
        print(f"{'judged ' if prefix else ''}target {summary[prefix + 'target']} "
              f"({'built now in ' + str(m['build_seconds']) + ' s' if built else 'cached'}): {m['layers']} layers, hidden "
              f"{m['hidden_size']}, vocab {m['vocab']:,}, {m['parameters'] / 1e9:.2f} B parameters, {m['bytes'] / 1e9:.2f} GB bf16")
    for key in ("verify", "judged"):
        v = summary.get(key)
        if not v:
            continue
        if key == "judged":
            d = summary["drafter"]
            what = "hand-set to predict (real_shapes_copy_pair.py)" if d["kind"] == "copy" else "random weights"
            print(f"judged: a {d['layers']}-layer drafter of the real sizes, {what}, block {d['block_size']}, "
                  f"{d['parameters'] / 1e9:.2f} B parameters (built in {d['build_seconds']} s)")
        print(f"{key}: exit {v['exit_code']}, wall {v['wall_s']:.0f} s, CPU {v['cpu_s']:.0f} s, peak RSS {v['peak_rss_gib']:.2f} GiB "
              f"(whole tree sampled: {v['sampled_tree_peak_gib']:.2f} GiB)")
        for line in (v["stopped"], v["error"]):
            if line:
                print("  " + line)
        for c in v.get("checks", []):
            print(f"  {'PASS' if c['passed'] else 'FAIL'} {c['check']}: {c['evidence']}")
        for row in v.get("methods", []):
            print(f"  {row['method']}: acceptance {row['acceptance_mean']} {row['acceptance_histogram']}")
    if "profile" in summary:
        print_profile(summary["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
