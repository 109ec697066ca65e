"""Large trees (issue 39, item 6): folders that look vendored are reported and not parsed, unless
they hold a decoder; the prefilters and the call graph that make a large tree fast lose nothing.

Behaviour, not timing: ``benchmarks/bench_large_tree.py`` has the figures (docs/performance.md).
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import warnings
from pathlib import Path

import libcst as cst
import libcst.matchers as m
import pytest
from cli_support import run
from hypothesis import given
from hypothesis import strategies as st
from libcst.codemod import CodemodContext

from patcher.engine import pipeline
from patcher.engine.codemods import CODEMODS
from patcher.engine.codemods.base import RUNTIME_MODULE, Step, ast_dotted
from patcher.engine.codemods.flow_prefilter import _ast_fed, may_have_roles
from patcher.engine.prefilter import _Trigger
from patcher.engine.recipe import load_recipe
from patcher.engine.vendored import vendored_reason

ROOT = Path(__file__).resolve().parent.parent
VENDORED = ROOT / "vendored"
RECIPE = load_recipe("qwen3_6-gdn")
#: A file LibCST cannot parse, which the text prefilter lets through (``.crop(``): parsed, it is a skipped file.
BROKEN = "def f(cache):\n    cache.crop(3\n"


pytestmark = pytest.mark.usefixtures("journal_home")  # DDPATCH_HOME in the test's tmp_path (tests/conftest.py)


def fork(tmp_path: Path, extra: dict[str, str], decoder_at: str = "") -> Path:
    """vendored/ddtree (at ``decoder_at`` inside the tree) plus ``extra`` files."""
    root = tmp_path / "fork"
    shutil.copytree(VENDORED / "ddtree", root / decoder_at, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, text in extra.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


# ----------------------------------------------------------------------------- vendored folders
@pytest.mark.parametrize("layout, folder, reason", [
    ({"third_party/pkg/broken.py": BROKEN}, "third_party", "named third_party"),
    ({"src/_vendor/pkg/broken.py": BROKEN}, "src/_vendor", "named _vendor"),
    ({"libs/pkg/broken.py": BROKEN, "libs/pkg/pyproject.toml": "[project]\nname = 'pkg'\n"}, "libs/pkg", "has its own pyproject.toml"),
    ({"libs/pkg/sub/broken.py": BROKEN, "libs/pkg/setup.py": "from setuptools import setup\nsetup()\n"}, "libs/pkg",
     "has its own setup.py"),
    ({"deps/pkg/broken.py": BROKEN, "deps/pkg-1.0.dist-info/METADATA": "Name: pkg\n"}, "deps", "holds pkg-1.0.dist-info"),
])
def test_a_vendored_folder_is_listed_and_not_parsed(tmp_path, layout, folder, reason):
    root = fork(tmp_path, layout)
    report = pipeline.run_recipe(RECIPE, root)
    assert [(v.path, v.reason, v.left_out) for v in report.vendored] == [(folder, reason, True)]
    assert report.vendored[0].files == sum(pipeline.covers(RECIPE, rel) for rel in layout)  # the recipe leaves setup.py out
    assert not report.skipped, [f.error for f in report.skipped]  # the broken file was never parsed
    assert not [f for f in report.files if f.path.startswith(folder + "/")]
    assert report.upstream == "ddtree" and not report.no_match

    everything = pipeline.run_recipe(RECIPE, root, include_vendored=True)  # the same tree, every folder checked
    assert not everything.vendored
    assert [f.error.split(":")[0] for f in everything.skipped] == ["cannot parse"]


def test_check_says_what_it_left_out_in_text_and_json(tmp_path):
    root = fork(tmp_path, {"third_party/pkg/broken.py": BROKEN, "third_party/pkg/more.py": "x = 1\n"})
    text = run("check", root)
    assert text.exit_code == 1  # pending changes, as on vendored/ddtree alone; the folder is not a finding
    assert "left out 1 folder(s) that look vendored (2 file(s), no decoder in them; --include-vendored checks them): " \
           "third_party/ (named third_party)" in text.output
    payload = json.loads(run("check", root, "--format", "json").stdout)
    assert payload["vendored"] == [{"path": "third_party", "reason": "named third_party", "files": 2, "checked": False, "decoder": None}]
    assert not [f for f in payload["files"] if f["error"]]

    again = json.loads(run("check", root, "--include-vendored", "--format", "json").stdout)
    assert again["vendored"] == [] and [f["path"] for f in again["files"] if f["error"]] == ["third_party/pkg/broken.py"]
    (root / "pyproject.toml").write_text("[tool.ddpatch]\ninclude-vendored = true\n")
    configured = json.loads(run("check", root, "--format", "json").stdout)
    assert configured["vendored"] == [] and [f["path"] for f in configured["files"] if f["error"]] == ["third_party/pkg/broken.py"]


def test_vendored_and_excluded_folders_are_reported_side_by_side(tmp_path):
    """A vendored package's ordinary code (`def f(): ...`, `_()`) holds no decoder signal, whatever patterns the steps
    scan the tree with; what --exclude leaves out has its own line and JSON keys beside the vendored folders."""
    root = fork(tmp_path, {"third_party/pkg/util.py": "def f():\n    return _()\n\n\nf()\n",
                           "analysis/plot.py": "import torch\n\n\ndef sync():\n    torch.cuda.synchronize()\n"})
    text = run("check", root, "--exclude", "analysis")
    assert "left out 1 folder(s) that look vendored (1 file(s), no decoder in them; --include-vendored checks them): " \
           "third_party/ (named third_party)" in text.output
    assert "left out (--exclude analysis): 1 file(s): analysis/plot.py" in text.output
    payload = json.loads(run("check", root, "--exclude", "analysis", "--format", "json").stdout)
    assert payload["vendored"] == [{"path": "third_party", "reason": "named third_party", "files": 1, "checked": False, "decoder": None}]
    assert payload["exclude"] == ["analysis"] and payload["excluded"] == [{"path": "analysis/plot.py", "by": "--exclude analysis"}]


def test_include_vendored_in_a_config_file_must_be_a_boolean(tmp_path):
    root = fork(tmp_path, {"pyproject.toml": '[tool.ddpatch]\ninclude-vendored = "yes"\n'})
    out = run("check", root)
    assert out.exit_code == 2 and "include-vendored must be true or false" in out.output


@pytest.mark.parametrize("at", ["third_party/ddtree", "external", "vendor/forks/ddtree"])
def test_a_decoder_in_a_folder_that_looks_vendored_is_checked(tmp_path, at):
    """The whole decoder lives where a vendored package would: the folder is checked, and says why."""
    root = fork(tmp_path, {}, decoder_at=at)
    report = pipeline.run_recipe(RECIPE, root)
    assert report.upstream == "ddtree" and not report.no_match
    assert {f.path for f in report.changed} >= {f"{at}/ddtree.py", f"{at}/dflash.py"}
    folder = at.split("/")[0]
    [entry] = report.vendored
    assert (entry.path, entry.left_out) == (folder, False)
    assert entry.decoder.startswith("defines ") and entry.decoder.endswith(".py")
    text = run("check", root).output
    assert f"checked {folder}/ although it looks vendored" in text


def test_a_drafter_in_a_folder_that_looks_vendored_is_checked(tmp_path):
    """No marker function there, but the drafter's ``target_hidden``: its sites are still found."""
    root = fork(tmp_path, {})
    (root / "third_party").mkdir()
    shutil.move(root / "model", root / "third_party" / "model")
    (root / "ddtree.py").write_text((root / "ddtree.py").read_text().replace("from model", "from third_party.model"))
    (root / "dflash.py").write_text((root / "dflash.py").read_text().replace("from model", "from third_party.model"))
    report = pipeline.run_recipe(RECIPE, root)
    [entry] = report.vendored
    assert not entry.left_out and entry.decoder.startswith("uses target_hidden in third_party/model/")
    assert "third_party/model/dflash.py" in {f.path for f in report.changed}


def test_the_tree_itself_never_looks_vendored(tmp_path):
    root = tmp_path / "third_party"
    shutil.copytree(VENDORED / "ddtree", root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "pyproject.toml").write_text("[project]\nname = 'fork'\n")
    report = pipeline.run_recipe(RECIPE, root)
    assert not report.vendored and report.upstream == "ddtree" and report.changed


def test_what_makes_a_folder_look_vendored():
    assert vendored_reason("Third_Party", [], []) == "named Third_Party"
    assert vendored_reason("site-packages", [], ["six.py"]) == "named site-packages"
    assert vendored_reason("lib", ["six-1.16.0.dist-info", "six"], []) == "holds six-1.16.0.dist-info"
    assert vendored_reason("tool", [], ["setup.cfg", "tool.py"]) == "has its own setup.cfg"
    for name in ("model", "src", "scripts", "benchmarks", "analysis"):
        assert vendored_reason(name, ["ddtree.egg-info"], ["__init__.py", "utils.py"]) is None


# ----------------------------------------------------------------------------- the pipeline's stages
def test_a_worker_pools_results_are_kept_for_the_next_run_in_this_process(tmp_path, monkeypatch):
    """``_map_files`` sends the files the text prefilter let through to workers, and keeps what they
    found: a second run in this process neither parses them nor starts a pool."""
    root = fork(tmp_path, {})
    pipeline._ANALYSED.clear()
    monkeypatch.setattr(pipeline, "POOL_MIN_FILES", 2)  # a pool for vendored/ddtree's five files
    first = pipeline.run_recipe(RECIPE, root, jobs=2)
    assert len(pipeline._ANALYSED) == 5  # ddtree.py, dflash.py, benchmark.py, model/dflash.py, model/utils.py

    def not_again(*args, **kwargs):
        raise AssertionError("analysed again")

    monkeypatch.setattr(pipeline, "analyse", not_again)
    monkeypatch.setattr(pipeline, "ProcessPoolExecutor", not_again)
    for jobs in (2, 1):
        again = pipeline.run_recipe(RECIPE, root, jobs=jobs)
        assert [(f.path, f.patched, [(s.step, s.line, s.status, s.message) for s in f.sites]) for f in again.files] == \
               [(f.path, f.patched, [(s.step, s.line, s.status, s.message) for s in f.sites]) for f in first.files]


def test_each_file_gets_its_own_result_with_copies_a_pool_and_a_full_memo(tmp_path, monkeypatch):
    """Files with the same text share one analysis; with a pool, each other file takes the next worker
    result, even when the memo drops entries during the run (a wrong pairing swaps texts)."""
    root = fork(tmp_path, {"zz/timing.py": "import torch\n\n\ndef wait():\n    torch.cuda.synchronize()\n"})  # new, after the copies
    for copy in ("copy_a", "copy_b"):
        for name in ("ddtree.py", "dflash.py", "benchmark.py"):
            (root / copy).mkdir(exist_ok=True)
            shutil.copyfile(root / name, root / copy / name)
    def results(report):
        return {f.path: (f.patched, [(s.step, s.line, s.status, s.path) for s in f.sites]) for f in report.files}

    pipeline._ANALYSED.clear()
    expected = results(pipeline.run_recipe(RECIPE, root, jobs=1))  # one file after the other
    pipeline._ANALYSED.clear()
    pipeline.run_recipe(RECIPE, root / "model", jobs=1)  # known before the run: model/'s texts
    monkeypatch.setattr(pipeline, "POOL_MIN_FILES", 2)
    monkeypatch.setattr(pipeline, "_MEMO_SIZE", 1)
    assert results(pipeline.run_recipe(RECIPE, root, jobs=2)) == expected
    for name in ("ddtree.py", "dflash.py", "benchmark.py", "zz/timing.py"):
        assert expected[name][0]
    # copies in one kind of folder patch alike; a folder without __init__.py imports the runtime
    # package-first (engine/packages.py), the root's file imports it plainly: nothing else differs
    assert expected["copy_a/ddtree.py"][0] == expected["copy_b/ddtree.py"][0]
    plain = expected["ddtree.py"][0].replace("import _ddpatch_runtime\n", "", 1)
    folder = expected["copy_a/ddtree.py"][0].replace(
        "try:\n    from . import _ddpatch_runtime\nexcept ImportError:  # run as a script, not as pkg.mod\n"
        "    import _ddpatch_runtime\n", "", 1)
    assert plain == folder != expected["copy_a/ddtree.py"][0]


def test_only_the_files_the_text_prefilter_lets_through_go_on(tmp_path, monkeypatch):
    root = fork(tmp_path, {"toolkit/plain.py": "def area(w, h):\n    return w * h\n"})
    seen = []
    pipeline._ANALYSED.clear()
    real = pipeline.analyse
    monkeypatch.setattr(pipeline, "analyse", lambda text, *rest: seen.append(text) or real(text, *rest))
    report = pipeline.run_recipe(RECIPE, root, jobs=1)
    assert "def area(w, h):\n    return w * h\n" not in seen
    assert "toolkit/plain.py" in {f.path for f in report.files}  # read, and its functions known
    assert len(seen) == 5


# ----------------------------------------------------------------------------- the text prefilter's literal words
TRIGGERS = sorted({t for spec in RECIPE.steps for t in CODEMODS[spec.codemod].triggers({**CODEMODS[spec.codemod].PARAMS, **spec.params})})
PIECES = sorted({w for t in TRIGGERS for w in re.findall(r"[A-Za-z_]+", t)} | {"(", ")", ".", " ", "\n", "\\", "self", "x", "import ", "from "})


def test_plain_word_triggers_are_tested_as_words():
    words = {t: _Trigger(t).words for t in TRIGGERS}
    assert words["DynamicCache"] == ["DynamicCache"]
    [guard] = [t for t in TRIGGERS if t.startswith("synchronize")]
    assert words[guard] == ["synchronize(", "set_device(", "reset_peak_memory_stats(", "reset_max_memory_allocated(",
                            "reset_accumulated_memory_stats(", "Event(", "cuda_event("]
    assert all(words[t] is None for t in TRIGGERS if "\\s" in t or "\\b" in t or "(?" in t)


@given(st.lists(st.sampled_from(PIECES), max_size=40).map("".join))
def test_a_trigger_finds_what_its_regex_finds(text):
    for pattern in TRIGGERS:
        assert _Trigger(pattern).found(text) == (re.search(pattern, text) is not None), pattern


# ----------------------------------------------------------------------------- may_have_roles, against its walk of every function
def walked_roles(tree) -> bool:
    """``may_have_roles`` as it was written first: every function walked (the oracle of its fast path)."""
    for call in ast.walk(tree):
        if isinstance(call, ast.Call):
            if any(k.arg == "target_hidden" for k in call.keywords):
                return True
            func = call.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == RUNTIME_MODULE:
                return True
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        every = [c for c in ast.walk(fn) if isinstance(c, ast.Call)]
        calls = [c for c in every if any(k.arg == "past_key_values" for k in c.keywords)
                 and (ast_dotted(c.func) or "self").split(".")[0] not in ("self", "cls")]
        if not calls:
            continue
        callees = {ast_dotted(c.func) for c in calls} - {None}
        # a drafter given the features positionally with no cache: a parameter's call (issue 39)
        params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs} - {"self", "cls"}
        positional = [c for c in every if c.args and c not in calls and (ast_dotted(c.func) or ".").split(".")[0] in params]
        if len(callees) < 2 and not positional:
            continue
        assigned: dict[str, list] = {}
        for node in ast.walk(fn):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    name = ast_dotted(target)
                    if name:
                        assigned.setdefault(name, []).append(node.value)
        for call in calls if len(callees) >= 2 else ():
            callee = ast_dotted(call.func)
            if callee and any(_ast_fed(arg, callee, callees, assigned, 6, set()) for arg in
                              [*call.args, *(k.value for k in call.keywords if k.arg != "past_key_values")]):
                return True
        for call in positional:
            callee = ast_dotted(call.func)
            others = {c for c in callees if c.split(".")[0] != callee.split(".")[0]} | {callee}
            if len(others) > 1 and any(_ast_fed(arg, callee, others, assigned, 6, set()) for arg in call.args):
                return True
    return False


SHAPES = {
    "two models, one fed the other's hidden states": """
def decode(target, draft, ids, cache, dcache):
    out = target(ids, past_key_values=cache)
    h = out.hidden_states
    return draft(h, past_key_values=dcache)
""",
    "the same, in a method of a class nested in a function": """
def build():
    class Loop:
        def step(self, target, draft, ids, c, d):
            out = target(ids, past_key_values=c)
            return draft(out.hidden_states, past_key_values=d)
    return Loop
""",
    "the two calls in a decorator and a default": """
def outer(target, draft, ids, c, d):
    @register(target(ids, past_key_values=c).hidden_states)
    def inner(x=draft(target(ids, past_key_values=c).hidden_states, past_key_values=d)):
        return x
    return inner
""",
    "the two calls in a module-level function's decorator only": """
@hook(draft(target.model.embed_tokens(ids), past_key_values=d), target(ids, past_key_values=c))
def step():
    pass
""",
    "two models, neither fed the other": """
def run(a, b, ids, c, d):
    a(ids, past_key_values=c)
    b(ids, past_key_values=d)
""",
    "one model with a cache, a drafter given its features positionally": """
def generate(target, model, ids, c):
    out = target(ids, past_key_values=c, output_hidden_states=True)
    hidden = out.hidden_states
    return model.topk_generate(hidden, 4)
""",
    "one model twice": "def run(m, ids, c):\n    m(ids, past_key_values=c)\n    m(m(ids).hidden_states, past_key_values=c)\n",
    "self's own calls": "class A:\n    def f(self, ids, c):\n        h = self.a(ids, past_key_values=c).hidden_states\n        return self.b(h, past_key_values=c)\n",
}


@pytest.mark.parametrize("shape", SHAPES)
def test_may_have_roles_agrees_with_walking_every_function(shape):
    assert may_have_roles(ast.parse(SHAPES[shape])) == walked_roles(ast.parse(SHAPES[shape]))


def test_may_have_roles_agrees_on_every_file_of_vendored_and_the_fixtures():
    said = []
    for path in sorted([*VENDORED.rglob("*.py"), *(ROOT / "tests" / "fixtures").rglob("*.py*")]):
        if path.suffix not in (".py", ".out"):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                text = path.read_text()
                fast, walked = may_have_roles(ast.parse(text)), walked_roles(ast.parse(text))
            except SyntaxError:
                continue
        assert fast == walked, path
        said.append(fast)
    assert True in said and False in said


# ----------------------------------------------------------------------------- the call graph behind an anchor's helpers
def test_the_call_graph_reaches_helpers_through_names_methods_modules_and_nested_functions():
    from patcher.engine.classify import _CallGraph

    texts = {
        "decode.py": "import utils\nfrom helpers import other\n\ndef decode(x):\n    def inner():\n        return step(x)\n"
                     "    return utils.crop_it(x) + Loop().run(x)\n\nclass Loop:\n    def run(self, x):\n        return self.commit(x)\n"
                     "    def commit(self, x):\n        return x\n",
        "utils.py": "def crop_it(x):\n    return x\n\ndef step(x):\n    return unrelated.run(x)\n",
        "other.py": "def commit(x):\n    return finish(x)\n\ndef finish(x):\n    return x\n\ndef run(y):\n    return y\n",
    }
    where: dict[str, list[str]] = {}
    for path, text in texts.items():
        for name in re.findall(r"def (\w+)", text):
            where.setdefault(name, []).append(path)
    graph = _CallGraph(where, texts)
    assert graph.calls("decode") == {"inner", "crop_it", "step"}  # Loop().run is not a name the file binds
    assert graph.calls("run") == {"commit"}  # self.commit, in decode.py; other.py's run calls nothing of the tree
    assert graph.reach("decode", stop={"crop_it"}) == ["inner", "step"]
    assert graph.reach("run", stop=set()) == ["commit", "finish"]  # commit is defined in two files: both count


# ----------------------------------------------------------------------------- the steps skip LibCST's matcher-decorator scan only when it finds nothing
def test_a_step_with_matcher_decorators_keeps_them():
    class Decorated(Step):
        ID = "decorated-test-step"

        @m.visit(m.Name("x"))
        def saw_x(self, node: cst.Name) -> None:
            self.sites.append(node)

    for _ in range(2):  # the second instance is built after the first was looked at
        step = Decorated(CodemodContext())
        cst.parse_module("x = y + x\n").visit(step)
        assert len(step.sites) == 2 and step._extra_visit_funcs
