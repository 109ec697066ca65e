"""Planted bugs that keep every output token exact and only change acceptance (issue 43).

Ten tree-construction bugs of DDTree and one drafter-side bug of DFlash and DDTree, each as edits of a
**patched** tree (``ddpatch apply`` first: the edits are written against its text):

- ``VENDORED``: edits of ``vendored/ddtree`` patched (``patched_vendored``);
- ``UPSTREAM``: the same bugs as edits of the real DDTree HEAD patched (``patched_upstream``: cloned at run
  time from ``../shared/upstream/ddtree.bundle``; no line of it is kept here, only the short strings an edit
  replaces).

The target verifies every tree node, so a tree built wrong still commits only the target's greedy tokens;
what changes is how many a round commits. Some bugs lower it (the tree misses the target's path), some raise
it (the tree holds more, or other, nodes than the algorithm picks): a correct judge fails both, the second
kind only round by round (``expect`` says which way the mean is expected to move, from issue 43; the
benchmark, ``benchmarks/bench_acceptance_power.py``, measures it).
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT.parent / "shared" / "upstream" / "ddtree.bundle"


@dataclass(frozen=True)
class Edit:
    file: str  # relative to the tree
    old: str  # must occur exactly once in the patched file
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # one line
    edits: tuple[Edit, ...]
    methods: tuple[str, ...] = ("ddtree",)  # the decoders whose acceptance it changes
    expect: str = "lower"  # the mean's expected direction: lower, higher, either

    @property
    def files(self) -> list[str]:
        return sorted({e.file for e in self.edits})


def _m(name, what, file, *pairs, methods=("ddtree",), expect="lower") -> Mutant:
    return Mutant(name, what, tuple(Edit(file, old, new) for old, new in pairs), methods, expect)


# ----------------------------------------------------------------------------- vendored/ddtree, patched
_V = "ddtree.py"
VENDORED = [
    _m("wrong-depth-logits", "the tree reads depth d from block position d - 1 (the root's own output at depth 1)", _V,
       ("target.lm_head(draft_hidden[0, 1:, :])", "target.lm_head(draft_hidden[0, :-1, :])")),
    _m("heap-min-first", "the frontier pops its least likely node first", _V,
       ("= heapq.heappop(frontier)", "= frontier.pop(frontier.index(max(frontier)))")),
    _m("accept-one-short", "the walk drops the last accepted node (the target's token after it commits instead)", _V,
       ("    return path, token\n", "    return (path[:-1], choices[path[-2]]) if len(path) > 1 else (path, token)\n")),
    _m("budget-plus-one", "the tree gets one node more than its budget", _V,
       ("else tree_budget\n", "else tree_budget + 1\n"), expect="higher"),
    _m("per-depth-score", "a node's score is its own depth's log-probability, not its path's", _V,
       ("offer(scores[parent] + ranked_logprobs[depth - 1][rank + 1]", "offer(ranked_logprobs[depth - 1][rank + 1]"),
       ("offer(scores[node] + ranked_logprobs[depth][0]", "offer(ranked_logprobs[depth][0]"), expect="higher"),
    _m("child-at-parent-depth", "a node's first child is scored with its parent's depth's log-probabilities", _V,
       ("offer(scores[node] + ranked_logprobs[depth][0]", "offer(scores[node] + ranked_logprobs[depth - 1][0]"),
       expect="higher"),
    _m("first-child-only", "the walk follows a node's first child only, never a sibling", _V,
       ("while token in child_maps[path[-1]]:", "while child_maps[path[-1]] and token == next(iter(child_maps[path[-1]])):")),
    _m("half-budget", "the tree gets half its budget", _V,
       ("else tree_budget\n", "else max(1, tree_budget // 2)\n")),
    _m("logits-not-logprobs", "nodes are scored by summed raw logits, not log-probabilities", _V,
       ("torch.log_softmax(draft_logits.float(), dim=-1).topk(", "draft_logits.float().topk("), expect="either"),
    _m("best-child-skipped", "a node's children start at its second most likely token", _V,
       ("offer(scores[node] + ranked_logprobs[depth][0], depth + 1, 0, node)",
        "offer(scores[node] + ranked_logprobs[depth][1], depth + 1, 1, node)")),
]

#: the drafter-side bug: the drafter's context loses the prefill's features (zeros where the prompt's are), as in
#: an engine whose prefill does not fill the drafter's context
_PREFILL_V = ("extract_context_feature(prefill.hidden_states, model.target_layer_ids)\n",
              "extract_context_feature(prefill.hidden_states, model.target_layer_ids).zero_()\n")
VENDORED_DRAFTER = Mutant(
    "prefill-features-lost", "the drafter's context holds zeros where the prompt's target features belong",
    (Edit("dflash.py", *_PREFILL_V), Edit("ddtree.py", *_PREFILL_V)), methods=("dflash", "ddtree"))

# ----------------------------------------------------------------------------- the real DDTree HEAD, patched
_U = "ddtree.py"
UPSTREAM = [
    _m("wrong-depth-logits", "the tree reads depth d from block position d - 1 (the root's own output at depth 1)", _U,
       (")[:, -draft_horizon:, :])", ")[:, :draft_horizon, :])")),
    _m("heap-min-first", "the heap pops its least likely node first", _U,
       ("= heapq.heappop(heap)", "= heap.pop(heap.index(max(heap)))")),
    _m("accept-one-short", "the walk drops the last accepted node (the target's token after it commits instead)", _U,
       ("    return accepted_indices, next_token\n",
        "    if len(accepted_indices) > 1:\n"
        "        return accepted_indices[:-1], int(posterior_tokens[accepted_indices[-2]])\n"
        "    return accepted_indices, next_token\n")),
    _m("budget-plus-one", "the tree gets one node more than its budget", _U,
       ("max(tree_budget, 0)", "max(tree_budget + 1, 0)"), expect="higher"),
    _m("per-depth-score", "a node's score is its own depth's log-probability, not its path's", _U,
       ("sibling_logw = logw - float(top_log_probs_np[depth - 1, rank]) + ", "sibling_logw = "),
       ("child_logw = logw + ", "child_logw = "), expect="higher"),
    _m("child-at-parent-depth", "a node's first child is scored with its parent's depth's log-probabilities", _U,
       ("child_logw = logw + float(top_log_probs_np[depth, 0])", "child_logw = logw + float(top_log_probs_np[depth - 1, 0])"),
       expect="higher"),
    _m("first-child-only", "the walk follows a node's first child only, never a sibling", _U,
       ("while next_token in child_maps[current_index]:",
        "while child_maps[current_index] and next_token == next(iter(child_maps[current_index])):")),
    _m("half-budget", "the tree gets half its budget", _U,
       ("max(tree_budget, 0)", "max(tree_budget // 2, 1)")),
    _m("logits-not-logprobs", "nodes are scored by summed raw logits, not log-probabilities", _U,
       ("(top_logits - log_z)", "(top_logits + 0 * log_z)"), expect="either"),
    _m("best-child-skipped", "a node's children start at its second most likely token", _U,
       ("child_ranks = ranks + (0,)", "child_ranks = ranks + (1,)"),
       ("float(top_log_probs_np[depth, 0])", "float(top_log_probs_np[depth, 1])"),
       ("depth + 1, 0, child_logw)", "depth + 1, 1, child_logw)")),
]
_PREFILL_U = ("extract_context_feature(output.hidden_states, model.target_layer_ids)\n",
              "extract_context_feature(output.hidden_states, model.target_layer_ids).zero_()\n")
UPSTREAM_DRAFTER = Mutant(
    "prefill-features-lost", "the drafter's context holds zeros where the prompt's target features belong",
    (Edit("dflash.py", *_PREFILL_U), Edit("ddtree.py", *_PREFILL_U)), methods=("dflash", "ddtree"))

CATALOGS = {"vendored": VENDORED + [VENDORED_DRAFTER], "upstream": UPSTREAM + [UPSTREAM_DRAFTER]}


# ----------------------------------------------------------------------------- making the trees
def _apply(src: Path, out: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "patcher", "apply", str(src), "--out", str(out)], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"ddpatch apply {src} exited {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    return out


def patched_vendored(out: Path) -> Path:
    """``vendored/ddtree`` patched by ``ddpatch apply`` into ``out``."""
    return _apply(ROOT / "vendored" / "ddtree", Path(out))


def patched_upstream(out: Path, bundle: Path = BUNDLE) -> Path | None:
    """The real DDTree HEAD, cloned from ``bundle`` and patched into ``out``; None where the bundle is absent."""
    if not Path(bundle).is_file():
        return None
    with tempfile.TemporaryDirectory(prefix="ddtree-head-") as tmp:
        src = Path(tmp) / "ddtree"
        subprocess.run(["git", "clone", "-q", str(bundle), str(src)], check=True, capture_output=True)
        return _apply(src, Path(out))


def plant(tree: Path, mutant: Mutant, out: Path) -> Path:
    """A copy of the patched ``tree`` at ``out`` with ``mutant``'s edits; an edit whose text is not found exactly once
    is an error (the tree moved on: the catalog needs updating)."""
    out = Path(shutil.copytree(tree, out))
    for e in mutant.edits:
        path = out / e.file
        text = path.read_text()
        if text.count(e.old) != 1:
            raise ValueError(f"{mutant.name}: {e.file} holds {e.old!r} {text.count(e.old)} time(s), not once")
        path.write_text(text.replace(e.old, e.new))
    return out


#: a tree's top-level modules: generic names that every DDTree-shaped tree defines
TREE_MODULES = {"model", "dflash", "ddtree", "_ddpatch_runtime"}


def import_tree(tree: Path):
    """The tree's own ``dflash_generate``, ``ddtree_generate`` and ``DFlashDraftModel``. The tree's modules share
    generic names with other trees' (``model``, ``dflash``): they are imported with the tree first on ``sys.path``
    and taken out of ``sys.modules`` afterwards, where whatever held those names before is put back."""
    def ours(name: str) -> bool:
        return name.split(".")[0] in TREE_MODULES

    before = {n: m for n, m in sys.modules.items() if ours(n)}
    for name in before:
        del sys.modules[name]
    sys.path.insert(0, str(tree))
    try:
        ddtree, dflash, model = (importlib.import_module(n) for n in ("ddtree", "dflash", "model"))
        return dflash.dflash_generate, ddtree.ddtree_generate, model.DFlashDraftModel
    finally:
        sys.path.remove(str(tree))
        for name in [n for n in sys.modules if ours(n)]:
            del sys.modules[name]
        sys.modules.update(before)


#: the decoders a mutant's copy renames, so that every mutant is a decoder of its own in one tree
DECODERS = ("ddtree_generate", "dflash_generate")


def plant_together(tree: Path, mutants: list[Mutant], out: Path) -> dict[str, str]:
    """A copy of the patched ``tree`` at ``out`` holding every mutant beside the correct code: each mutant's files as
    copies (``ddtree_<name>.py``) with its edits, their decoders renamed (``ddtree_generate__<name>``), so that one
    verify judges them all, each decoder on its own. Returns decoder function -> mutant name."""
    out = Path(shutil.copytree(tree, out))
    names = {}
    for mutant in mutants:
        ident = mutant.name.replace("-", "_")
        for file in mutant.files:
            text = (out / file).read_text()
            for e in (e for e in mutant.edits if e.file == file):
                if text.count(e.old) != 1:
                    raise ValueError(f"{mutant.name}: {file} holds {e.old!r} {text.count(e.old)} time(s), not once")
                text = text.replace(e.old, e.new)
            for fn in DECODERS:
                if f"def {fn}(" in text:
                    text = text.replace(f"def {fn}(", f"def {fn}__{ident}(")
                    names[f"{fn}__{ident}"] = mutant.name
            (out / f"{Path(file).stem}_{ident}.py").write_text(text)
    return names
