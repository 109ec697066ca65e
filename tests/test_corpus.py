"""The whole recipe, in diff mode, over the installed transformers and torch packages.

Real trees, thousands of files nobody wrote for ddpatch: the run must not crash on any
file (a file that is not valid Python may be skipped, nothing else), every reported site
must be one its step is meant to match (checked on the source line of every site, and on
the syntax tree for a sample), the counts must stay in plausible bounds, and the two
prefilters must not lose a site (checked on a sample of the files they turned away).

The whole packages take minutes (``slow``, run by ``.ci/run``). The fast tier runs the same
tests on a fixed sample of each (``SAMPLE``, 2.5 s): a file for every kind of site the whole
scan finds, files each prefilter turns away, and the hybrid model's own modeling and cache
files; on the versions it was measured on, every sample file has exactly its recorded sites.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import shutil
import random
import re
import warnings
from collections import Counter
from pathlib import Path

import pytest

from patcher.engine.codemods import CODEMODS
from patcher.engine.files import read_source
from patcher.engine.pipeline import discover, prefilter, prefilter_tree, run_recipe, transform_source
from patcher.engine.recipe import load_recipe

RECIPE = load_recipe("qwen3_6-gdn")
SPECS = [(spec, CODEMODS[spec.codemod]) for spec in RECIPE.steps]

#: Sites per step and status: measured on transformers 5.23.0 and torch 2.13.0, with room
#: for a patch release; a step that starts matching far more (or nothing) needs a look.
BOUNDS = {
    "transformers": {
        ("input-embeddings", "applied"): (1, 20),
        ("input-embeddings", "fixed-upstream"): (100, 300),
        ("cpu-safe-timing", "applied"): (1, 10),
        ("cpu-safe-timing", "fixed-upstream"): (1, 10),
        # 5.x counts (pi0's `crop(n - get_seq_length())`, `crop(-n)`): left alone since crops are read by meaning
        ("crop-compat", "fixed-upstream"): (1, 10),
        ("lazy-datasets", "fixed-upstream"): (1, 5),
    },
    "torch": {
        ("cpu-safe-timing", "applied"): (50, 200),
        ("cpu-safe-timing", "fixed-upstream"): (1, 30),
    },
}

#: The fast tier's sample: paths inside each package, chosen on transformers 5.23.0 and torch 2.13.0.
SAMPLE = {
    "transformers": [
        "modelcard.py", "integrations/neftune.py", "models/shieldgemma2/modeling_shieldgemma2.py", "integrations/deepgemm.py",
        "distributed/pipeline_parallel.py", "models/pi0/modeling_pi0.py", "models/kosmos2/modeling_kosmos2.py",
        # turned away by the syntax-tree prefilter
        "integrations/sdpa_paged.py", "models/jev/modeling_jev.py", "integrations/eager_paged.py",
        # the hybrid model and the cache ddpatch patches code for: no site of its own
        "models/qwen3_5/modeling_qwen3_5.py", "models/qwen3_5/configuration_qwen3_5.py", "cache_utils.py",
    ],
    "torch": [
        "_inductor/codegen/rocm/rocm_benchmark_request.py", "_vendor/quack/bench/bench_utils.py", "autograd/profiler_legacy.py",
        "_inductor/codegen/mtia/device_op_overrides.py", "mps/event.py",  # turned away by the syntax-tree prefilter
        "nn/modules/linear.py", "utils/benchmark/utils/timer.py",
    ],
}
#: Every site of the sample, per file (step|status: count); each package's ``__init__.py`` next to
#: a sample file comes with it (it decides how the runtime is imported).
SAMPLE_SITES = {
    "transformers": {
        "modelcard.py": {"lazy-datasets|fixed-upstream": 1},
        "distributed/pipeline_parallel.py": {"cpu-safe-timing|fixed-upstream": 1},
        "integrations/deepgemm.py": {"cpu-safe-timing|applied": 1},
        "integrations/neftune.py": {"input-embeddings|fixed-upstream": 4},
        "models/kosmos2/modeling_kosmos2.py": {"input-embeddings|applied": 2},
        "models/pi0/modeling_pi0.py": {"input-embeddings|fixed-upstream": 2, "crop-compat|fixed-upstream": 1},
        "models/shieldgemma2/modeling_shieldgemma2.py": {"input-embeddings|fixed-upstream": 1},
    },
    "torch": {
        "_inductor/codegen/rocm/rocm_benchmark_request.py": {"cpu-safe-timing|applied": 1},
        "_vendor/quack/bench/bench_utils.py": {"cpu-safe-timing|applied": 5},
        "autograd/profiler_legacy.py": {"cpu-safe-timing|fixed-upstream": 1},
    },
}
MEASURED = {"transformers": "5.23.0", "torch": "2.13.0"}

SKIP_RECEIVER = re.compile(r"(?:self|cls)\.(?:model\.embed_tokens|get_input_embeddings\(\)|language_model\.embed_tokens)")
#: What the source at a site starts with (the site's column), per step.
SHAPES = {
    "input-embeddings": re.compile(r"[\w.()\[\]]*?\.(?:model\.embed_tokens|get_input_embeddings\(\)|language_model\.embed_tokens)|[\w.]+\([^()]*\)\.get_input_embeddings\(\)"),
    "cpu-safe-timing": re.compile(r"(?:torch\.cuda\.|cuda\.)?(?:synchronize|set_device)\("),
    "crop-compat": re.compile(r"[\w.]+\.crop\(|_ddpatch_runtime\.crop_cache\("),  # self.cache.crop(-n) too
    "draft-sliding-window": re.compile(r"[\w.]+\s*\(|_ddpatch_runtime\.draft_forward\("),
    "verify-forward": re.compile(r"[\w.]+\s*\(|_ddpatch_runtime\.verify_forward\("),
    "lazy-datasets": re.compile(r"(?:from\s+datasets\b|import\s+datasets\b)"),
    "attn-fallback": re.compile(r"raise\b|\w*attn_implementation\s*=|\(?\s*\"flash_attention_2\" if importlib"),
    "target-cache-config": re.compile(r"[\w.]*DynamicCache\(|[\w.]*target\("),
    "tree-commit": re.compile(r"def compact_dynamic_cache\("),
}


def package_root(name: str) -> Path:
    return Path(importlib.util.find_spec(name).submodule_search_locations[0])


def sample_tree(name: str, dest: Path) -> Path:
    root = package_root(name)
    for rel in SAMPLE[name]:
        if not (root / rel).is_file():
            continue  # another release moved it; what is left is still scanned
        for src in (root / rel, (root / rel).parent / "__init__.py"):
            if src.is_file():
                (dest / src.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dest / src.relative_to(root))
    return dest


@pytest.fixture(scope="module", params=[pytest.param("transformers", marks=pytest.mark.slow),
                                        pytest.param("torch", marks=pytest.mark.slow), "transformers-sample", "torch-sample"])
def corpus(request, tmp_path_factory):
    """(name, root, report): a whole package, or its sample (``name`` ends in ``-sample``)."""
    package, _, sample = request.param.partition("-")
    if sample:
        root = sample_tree(package, tmp_path_factory.mktemp(request.param))
        return request.param, root, run_recipe(RECIPE, root)
    root = package_root(package)
    return request.param, root, run_recipe(RECIPE, root, jobs=2)


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
    name, _root, report = corpus
    if name.endswith("-sample"):
        name = name.removesuffix("-sample")
        found = {f.path: dict(Counter(f"{s.step}|{s.status}" for s in f.sites)) for f in report.files if f.sites}
        if importlib.metadata.version(name).split("+")[0] == MEASURED[name]:
            assert found == SAMPLE_SITES[name]
        else:  # another release: the kinds are still those of the whole package's bounds
            assert {k for sites in found.values() for k in sites} <= {f"{s}|{st}" for s, st in BOUNDS[name]}, found
        return
    counts = Counter((s.step, s.status) for f in report.files for s in f.sites)
    assert set(counts) <= set(BOUNDS[name]), f"sites of an unexpected kind: {set(counts) - set(BOUNDS[name])}"
    for key, (low, high) in BOUNDS[name].items():
        assert low <= counts[key] <= high, f"{key}: {counts[key]} sites, expected {low}..{high}"


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
    """A closer look at a sample of sites: the syntax the step is about, not just the text."""
    _name, _root, report = corpus
    sites = [(f, s) for f in report.files for s in f.sites]
    trees: dict[str, _Tree] = {}
    for f, site in random.Random(0).sample(sites, min(60, len(sites))):
        tree = trees.get(f.path) or trees.setdefault(f.path, _Tree(f.original))
        if site.step in ("draft-sliding-window", "verify-forward") and site.status == "applied":
            call = tree.node(site, ast.Call)
            assert any(k.arg == "past_key_values" for k in call.keywords)
            assert tree.in_loop(call), f"{f.path}:{site.line}: not in a loop"
        elif site.step == "input-embeddings":
            tree.node(site, ast.Attribute, ast.Call)
        elif site.step == "cpu-safe-timing":
            assert isinstance(tree.node(site, ast.Expr).value, ast.Call)
        elif site.step == "crop-compat" and site.status == "applied":
            call = tree.node(site, ast.Call)
            assert isinstance(call.func, ast.Attribute) and call.func.attr == "crop" and len(call.args) == 1


def test_prefilters_lose_no_site(corpus):
    """On a sample of files a prefilter turned a step away from, the step finds nothing there."""
    _name, root, _report = corpus
    rng = random.Random(0)
    paths = discover(root, RECIPE)[0]
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
