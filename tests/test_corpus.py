"""The whole recipe, in diff mode, over real trees: the installed transformers and torch packages, and vendored/.

Real trees, thousands of files nobody wrote for ddpatch: the run must not crash on any
file (a file that is not valid Python may be skipped, nothing else), every reported site
must be one its step is meant to match (checked on the source line of every site, and on
the syntax tree for a sample), the counts must stay in plausible bounds, and the two
prefilters must not lose a site (checked on a sample of the files they turned away).

The whole packages take minutes (``slow``, run by ``.ci/run``). The fast tier runs the same
tests on a fixed sample of each (``corpus_support.SAMPLE``, a few seconds): a file for every
kind of site the whole scan finds, files each prefilter turns away, and the hybrid model's own
modeling and cache files. ``vendored`` is our own upstream-shaped DDTree and DFlash code: the
one corpus with a decode loop, so the only one with ``verify-forward``, ``draft-sliding-window``
and ``tree-commit`` sites.

Exact sites are data, per release (``tests/data/corpus_sites/``, written and reviewed with
``python3 tests/corpus_support.py``): on a release that was measured, the sample has exactly its
recorded sites per file and the whole package exactly its recorded count per kind; on another
release that test skips, naming the command that measures it, and only the bounds hold. The
version matrix (``.ci/matrix``) runs this file on each release it was measured on.
"""

from __future__ import annotations

import ast
import random
import re
import warnings
from collections import Counter

import pytest

from corpus_support import RECIPE, VENDORED, installed_release, package_root, recorded, recorded_vendored, sample_tree
from corpus_support import sites_per_file, sites_per_kind
from patcher.engine.codemods import CODEMODS
from patcher.engine.codemods.base import ast_dotted
from patcher.engine.files import read_source
from patcher.engine.pipeline import discover, prefilter, prefilter_tree, run_recipe, transform_source

SPECS = [(spec, CODEMODS[spec.codemod]) for spec in RECIPE.steps]

#: Sites per step and status in a whole package, on every release of the range: measured on
#: transformers 5.21.0 to 5.25.0 and torch 2.6.0 to 2.15.0 (tests/data/corpus_sites/), with room for
#: a patch release; a step that starts matching far more (or nothing) needs a look.
BOUNDS = {
    "transformers": {
        ("input-embeddings", "applied"): (1, 20),
        ("input-embeddings", "fixed-upstream"): (100, 300),
        ("cpu-safe-timing", "applied"): (1, 10),
        ("cpu-safe-timing", "fixed-upstream"): (1, 10),
        # 5.x counts (pi0's `crop(n - get_seq_length())`, `crop(-n)`): left alone since crops are read by meaning
        ("crop-compat", "fixed-upstream"): (1, 10),
        # transformers' own `<cache>.activate_past_recording(...)` (generate()'s MTP and assistant caches) go through record_past
        ("crop-compat", "applied"): (1, 10),
        ("lazy-datasets", "fixed-upstream"): (1, 5),
    },
    "torch": {
        ("cpu-safe-timing", "applied"): (50, 200),
        ("cpu-safe-timing", "fixed-upstream"): (1, 30),
    },
}

#: The steps whose syntax-tree check (test_sampled_sites_on_the_syntax_tree) only ``vendored`` reaches.
DECODE_LOOP_CHECKS = {"verify-forward|applied", "draft-sliding-window|applied", "crop-compat|applied"}

SKIP_RECEIVER = re.compile(r"(?:self|cls)\.(?:model\.embed_tokens|get_input_embeddings\(\)|language_model\.embed_tokens)")
#: What the source at a site starts with (the site's column), per step.
SHAPES = {
    "input-embeddings": re.compile(r"[\w.()\[\]]*?\.(?:model\.embed_tokens|get_input_embeddings\(\)|language_model\.embed_tokens)|[\w.]+\([^()]*\)\.get_input_embeddings\(\)"),
    # a device-only statement, or a timing event's constructor (built through the runtime's stand-in)
    "cpu-safe-timing": re.compile(r"(?:torch\.cuda\.|cuda\.)?(?:synchronize|set_device|reset_peak_memory_stats|reset_max_memory_allocated"
                                  r"|reset_accumulated_memory_stats|Event)\(|_ddpatch_runtime\.cuda_event\("),
    # self.cache.crop(-n) too; and a cache's past recording, which goes through record_past
    "crop-compat": re.compile(r"[\w.]+\.(?:crop|activate_past_recording)\(|_ddpatch_runtime\.(?:crop_cache|record_past)\("),
    "draft-sliding-window": re.compile(r"[\w.]+\s*\(|_ddpatch_runtime\.draft_forward\("),
    "verify-forward": re.compile(r"[\w.]+\s*\(|_ddpatch_runtime\.verify_forward\("),
    "lazy-datasets": re.compile(r"(?:from\s+datasets\b|import\s+datasets\b)"),
    # a hard requirement (raise, a forced implementation), or upstream's own choice at run time
    "attn-fallback": re.compile(r"raise\b|\w*attn_implementation\s*=|\(?\s*\"flash_attention_2\" if\b"),
    "target-cache-config": re.compile(r"[\w.]*DynamicCache\(|[\w.]*target\("),
    "tree-commit": re.compile(r"def compact_dynamic_cache\("),
}


@pytest.fixture(scope="module", params=[pytest.param("transformers", marks=pytest.mark.heavy),
                                        pytest.param("torch", marks=pytest.mark.heavy), "transformers-sample", "torch-sample",
                                        "vendored"])
def corpus(request, tmp_path_factory):
    """(name, root, report): a whole package, its sample (``name`` ends in ``-sample``), or vendored/."""
    if request.param == "vendored":
        return request.param, VENDORED, run_recipe(RECIPE, VENDORED, include_vendored=True)
    package, _, sample = request.param.partition("-")
    if sample:
        root = sample_tree(package, tmp_path_factory.mktemp(request.param))
        return request.param, root, run_recipe(RECIPE, root, include_vendored=True)
    root = package_root(package)
    return request.param, root, run_recipe(RECIPE, root, jobs=2, include_vendored=True)


def _parse(text: str) -> ast.Module | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


def test_no_file_crashes(corpus):
    _name, root, report = corpus
    for f in report.skipped:
        if f.error.startswith("cannot parse"):
            assert _parse((root / f.path).read_text()) is None, f"{f.path} is valid Python: {f.error}"
        else:
            assert f.error.startswith("cannot read"), f"{f.path}: {f.error}"


def test_site_counts_are_plausible(corpus):
    """Bounds that hold on every release: the kinds a package's sites may have, and how many of each
    a whole package has; vendored/ has a site of every anchored step of the recipe (it was written to; a step with
    no anchors, removed-cache-api, is for code vendored/ does not have)."""
    name, _root, report = corpus
    if name == "vendored":
        assert {s.step for f in report.files for s in f.sites} == {spec.id for spec in RECIPE.steps if spec.anchors}
        return
    if name.endswith("-sample"):
        kinds = {k for sites in sites_per_file(report).values() for k in sites}
        assert kinds <= {f"{s}|{st}" for s, st in BOUNDS[name.removesuffix("-sample")]}, kinds
        return
    counts = Counter((s.step, s.status) for f in report.files for s in f.sites)
    assert set(counts) <= set(BOUNDS[name]), f"sites of an unexpected kind: {set(counts) - set(BOUNDS[name])}"
    for key, (low, high) in BOUNDS[name].items():
        assert low <= counts[key] <= high, f"{key}: {counts[key]} sites, expected {low}..{high}"


def test_sites_are_the_ones_recorded_for_this_release(corpus):
    """The exact sites, from tests/data/corpus_sites/: per file for a sample and vendored/, per kind for
    a whole package. Skips (naming the command that measures it) on a release never measured."""
    name, _root, report = corpus
    if name == "vendored":
        assert sites_per_file(report) == recorded_vendored()
        return
    package = name.removesuffix("-sample")
    data = recorded(package)
    if data is None:
        pytest.skip(f"no sites recorded for {package} {installed_release(package)}: "
                    f"python3 tests/corpus_support.py --write {package}, then review the diff")
    if name.endswith("-sample"):
        assert sites_per_file(report) == data["sample"]
    else:
        assert sites_per_kind(report) == data["package_sites"]


def test_every_site_is_what_its_step_matches(corpus):
    _name, root, report = corpus
    for f in report.files:
        if not f.sites:
            continue
        lines = f.original.splitlines()
        for site in f.sites:
            rest = lines[site.line - 1][site.column - 1:]
            assert SHAPES[site.step].match(rest), f"{f.path}:{site.line}: {site.step} {site.status} at {rest!r}"
            if site.step == "input-embeddings":
                assert not SKIP_RECEIVER.match(rest), f"{f.path}:{site.line}: the model's own `self`: {rest!r}"
            if site.step == "cpu-safe-timing":
                assert not re.match(r"torch\.(?!cuda\.)", rest), f"{f.path}:{site.line}: not torch.cuda: {rest!r}"


class _Tree:
    """A file's stdlib ast, indexed by where nodes start."""

    def __init__(self, text: str) -> None:
        self.at: dict[tuple[int, int], list[ast.AST]] = {}
        self.loops: list[ast.AST] = []
        for node in ast.walk(_parse(text)):
            if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
                self.loops.append(node)
            if hasattr(node, "lineno"):
                self.at.setdefault((node.lineno, node.col_offset + 1), []).append(node)

    def node(self, site, *kinds: type) -> ast.AST:
        found = [n for n in self.at.get((site.line, site.column), []) if isinstance(n, kinds)]
        assert found, f"{site.path}:{site.line}:{site.column}: no {'/'.join(k.__name__ for k in kinds)} starts there"
        return found[0]

    def in_loop(self, node: ast.AST) -> bool:
        return any((loop.lineno, loop.col_offset) <= (node.lineno, node.col_offset)
                   and (node.end_lineno, node.end_col_offset) <= (loop.end_lineno, loop.end_col_offset) for loop in self.loops)


def test_sampled_sites_on_the_syntax_tree(corpus):
    """A closer look at a sample of sites: the syntax the step is about, not just the text. vendored/
    reaches every check (its sites are fewer than the sample's size, so all are looked at)."""
    name, _root, report = corpus
    sites = [(f, s) for f in report.files for s in f.sites]
    trees: dict[str, _Tree] = {}
    checked = set()
    for f, site in random.Random(0).sample(sites, min(60, len(sites))):
        tree = trees.get(f.path) or trees.setdefault(f.path, _Tree(f.original))
        if site.step in ("draft-sliding-window", "verify-forward") and site.status == "applied":
            call = tree.node(site, ast.Call)
            assert any(k.arg in ("past_key_values", "cache") for k in call.keywords), f"{f.path}:{site.line}: no cache passed"
            assert tree.in_loop(call), f"{f.path}:{site.line}: not in a loop"
        elif site.step == "input-embeddings":
            tree.node(site, ast.Attribute, ast.Call)
        elif site.step == "cpu-safe-timing":
            found = tree.node(site, ast.Expr, ast.Call)
            call = found.value if isinstance(found, ast.Expr) else found
            assert isinstance(call, ast.Call), f"{f.path}:{site.line}: not a call"
            if isinstance(found, ast.Call):  # a value, not a statement: only an event is built through the runtime
                assert (ast_dotted(call.func) or "").endswith("Event"), f"{f.path}:{site.line}: {ast.unparse(call)}"
        elif site.step == "crop-compat" and site.status == "applied":
            call = tree.node(site, ast.Call)
            assert isinstance(call.func, ast.Attribute), f"{f.path}:{site.line}: not a method call"
            if call.func.attr == "crop":  # a 4.x length: one positional argument
                assert len(call.args) == 1 and not call.keywords, f"{f.path}:{site.line}: {ast.unparse(call)}"
            else:  # a past recording, whatever its arguments
                assert call.func.attr == "activate_past_recording", f"{f.path}:{site.line}: {ast.unparse(call)}"
        else:
            continue
        checked.add(f"{site.step}|{site.status}")
    if name == "vendored":
        assert DECODE_LOOP_CHECKS <= checked, f"checks vendored/ never reached: {DECODE_LOOP_CHECKS - checked}"


def test_prefilters_lose_no_site(corpus):
    """On a sample of files a prefilter turned a step away from, the step finds nothing there."""
    _name, root, _report = corpus
    rng = random.Random(0)
    paths = discover(root, RECIPE, include_vendored=True)[0]
    rng.shuffle(paths)
    by_ast, by_text = [], []
    for path in paths:
        try:
            text = read_source(path)
        except ValueError:
            continue
        if text.count("\n") > 1500:  # LibCST takes seconds on those
            continue
        passed = prefilter(text, SPECS)
        kept = prefilter_tree(text, passed) if passed else []
        if len(kept) < len(passed) and len(by_ast) < 10:
            by_ast.append((path, text, [s for s in SPECS if s not in kept]))
        elif not passed and len(by_text) < 4:
            by_text.append((path, text, SPECS))
        if len(by_ast) == 10 and len(by_text) == 4:
            break
    assert by_ast and by_text
    for path, text, dropped in by_ast + by_text:
        _new, sites, _ = transform_source(text, dropped, in_package=False)
        assert not sites, f"{path.relative_to(root)}: a prefilter turned away {sorted({s.step for s in sites})}"
