"""``ddpatch ci`` on small git repositories built on the fly.

The history moves DFlash-shaped code (written here, for the test; see vendored/README.md
for the idioms) through the kinds of drift upstream has shown: a file rename, a function
moved to another module, a changed signature, a fix upstreamed in another form, and a
change that breaks the recipe.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from cli_support import run as ddpatch

from patcher.ci.history import BISECT_THRESHOLD, run_ci
from patcher.ci.lock import update_lock_text
from patcher.ci.workflow import workflow_template
from patcher.errors import CIError
from patcher.engine.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
RECIPE = load_recipe("qwen3_6-gdn")
DFLASH_STEPS = ["target-cache-config", "input-embeddings", "crop-compat", "cpu-safe-timing", "attn-fallback",
                "lazy-datasets", "verify-forward", "draft-sliding-window"]

# ----------------------------------------------------------------------------- upstream-shaped sources
MODEL_HEAD = '''"""Block-diffusion draft and chain decoding (test fixture shaped like DFlash)."""
import time

import torch
from torch import nn
from transformers import DynamicCache


def _cuda_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def sample(logits, temperature=0.0):
    return logits.argmax(dim=-1)
'''

GENERATE = '''

@torch.inference_mode()
def dflash_generate(model, target, input_ids, max_new_tokens, stop_token_ids, temperature, block_size=None):
    block_size = block_size or model.block_size
    start, end = input_ids.shape[1], input_ids.shape[1] + max_new_tokens
    target_cache = DynamicCache()
    draft_cache = DynamicCache()
    out = target(input_ids, past_key_values=target_cache, use_cache=True)
    block = sample(out.logits[:, -1:], temperature)
    while start < end:
        hidden = model(noise_embedding=target.model.embed_tokens(block), past_key_values=draft_cache, use_cache=True)
        draft_cache.crop(start)
        block = sample(target.lm_head(hidden), temperature)
        out = target(block, past_key_values=target_cache, use_cache=True)
        start += block.shape[1]
        target_cache.crop(start)
    return out
'''

DRAFT = '''

class DFlashDraftModel(nn.Module):
    block_size = 4
'''

BENCHMARK = '''"""Benchmark (test fixture shaped like DFlash)."""
import importlib.util
import os

import torch
from datasets import load_dataset


def _prepare_dataset(name):
    return list(load_dataset(name, split="test"))


def _get_transformers_attn_impl():
    installed_flash_attn = importlib.util.find_spec("flash_attn") is not None
    if not installed_flash_attn:
        raise RuntimeError("flash_attn must be installed for the DFlash draft")
    attn_implementation = "flash_attention_2"
    return attn_implementation


def _run_transformers(args):
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return _get_transformers_attn_impl(), _prepare_dataset(args.dataset)
'''

# (3) dflash_generate moves into benchmark.py, which now needs the cache class and the sampler
MOVED_HEADER = 'from transformers import DynamicCache\n\nfrom model import sample\n'
# (4) arguments dropped: no stop tokens, greedy only
NEW_SIGNATURE = (GENERATE
                 .replace("def dflash_generate(model, target, input_ids, max_new_tokens, stop_token_ids, temperature, block_size=None):",
                          "def dflash_generate(model, target, input_ids, max_new_tokens, block_size=None):")
                 .replace(", temperature)", ")"))
# (5) upstream builds the target cache from the config itself, in a helper
HELPER = '''

def _target_cache(target):
    return DynamicCache(config=target.config)
'''
FIXED = HELPER + NEW_SIGNATURE.replace("    target_cache = DynamicCache()\n", "    target_cache = _target_cache(target)\n")
# (6) the verify forward moves out of the tree into an imported helper: verify-forward no longer matches
VERIFY = '''

from spec_kernels import verify as _verify  # a helper outside the tree: the verify call is no longer there to wrap
'''
BROKEN = VERIFY + FIXED.replace("        out = target(block, past_key_values=target_cache, use_cache=True)\n",
                                "        out = _verify(target, block, target_cache)\n")

# (message, files to write (None deletes))
HISTORY = [
    ("baseline: model/dflash.py", {
        "model/__init__.py": "from .dflash import DFlashDraftModel, dflash_generate\n",
        "model/dflash.py": MODEL_HEAD + GENERATE + DRAFT,
        "benchmark.py": BENCHMARK,
    }),
    ("rename model/dflash.py to model.py", {
        "model/__init__.py": None,
        "model/dflash.py": None,
        "model.py": MODEL_HEAD + GENERATE + DRAFT,
    }),
    ("move dflash_generate into benchmark.py", {
        "model.py": MODEL_HEAD + DRAFT,
        "benchmark.py": BENCHMARK.replace("from datasets import load_dataset\n", "from datasets import load_dataset\n" + MOVED_HEADER) + GENERATE,
    }),
    ("drop stop_token_ids and temperature", {
        "benchmark.py": BENCHMARK.replace("from datasets import load_dataset\n", "from datasets import load_dataset\n" + MOVED_HEADER) + NEW_SIGNATURE,
    }),
    ("build the target cache with its config", {
        "benchmark.py": BENCHMARK.replace("from datasets import load_dataset\n", "from datasets import load_dataset\n" + MOVED_HEADER) + FIXED,
    }),
    ("verify through a helper", {
        "benchmark.py": BENCHMARK.replace("from datasets import load_dataset\n", "from datasets import load_dataset\n" + MOVED_HEADER) + BROKEN,
    }),
]

EXPECTED = {  # per commit of HISTORY: the steps whose status is not `applied`
    0: {},
    1: {},
    2: {},
    3: {},
    4: {"target-cache-config": "fixed-upstream"},
    5: {"target-cache-config": "fixed-upstream", "verify-forward": "no-match"},
}


# ----------------------------------------------------------------------------- git helpers
def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=True)
    return proc.stdout


def make_repo(path: Path, history, fillers: int = 0) -> list[str]:
    """Commit each entry of ``history``; ``fillers`` unrelated commits after each. Returns the main commits' shas."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    shas = []
    day = 1
    for i, (message, files) in enumerate(history):
        for rel, text in files.items():
            target = path / rel
            if text is None:
                git(path, "rm", "-q", rel)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
                git(path, "add", rel)
        git(path, "commit", "-q", "-m", message, f"--date=2026-01-{day:02d}T12:00:00")
        shas.append(git(path, "rev-parse", "HEAD").strip())
        day += 1
        for k in range(fillers if i < len(history) - 1 else 0):
            (path / "README.md").write_text(f"notes {i}.{k}\n")
            git(path, "add", "README.md")
            git(path, "commit", "-q", "-m", f"docs {i}.{k}", f"--date=2026-01-{day:02d}T12:00:00")
            day += 1
    return shas


@pytest.fixture(scope="module")
def upstream(tmp_path_factory) -> tuple[Path, list[str]]:
    repo = tmp_path_factory.mktemp("ci") / "dflash"
    return repo, make_repo(repo, HISTORY)


@pytest.fixture(scope="module")
def linear(upstream):
    repo, shas = upstream
    return run_ci(RECIPE, repo, rev=shas[-1], since=shas[0])


def run(*args):
    """``ddpatch ci ARGS...`` in this process."""
    return ddpatch("ci", *args)


def statuses(ev) -> dict[str, str]:
    return {sid: ev.status(sid) for sid in ev.steps}


# ----------------------------------------------------------------------------- per-commit statuses and first changes
def test_each_commit_has_the_expected_status_per_step(upstream, linear):
    _repo, shas = upstream
    assert linear.commits == shas and not linear.bisected
    for i, sha in enumerate(shas):
        ev = linear.evals[sha]
        assert ev.upstream == "dflash", (i, ev.upstream)
        expected = {sid: EXPECTED[i].get(sid, "applied") for sid in DFLASH_STEPS}
        assert statuses(ev) == expected, f"commit {i} ({HISTORY[i][0]})"
    assert linear.exit_code == 1


def test_first_changes_name_the_commit_and_show_the_hunk(upstream, linear):
    _repo, shas = upstream
    found = {(f.step, f.before, f.after, f.commit.sha) for f in linear.findings}
    assert found == {
        ("target-cache-config", "applied", "fixed-upstream", shas[4]),
        ("verify-forward", "applied", "no-match", shas[5]),
    }
    cache = linear.first_change("target-cache-config")
    assert cache.previous.sha == shas[3]
    assert "-    target_cache = DynamicCache()" in cache.hunk and "+    target_cache = _target_cache(target)" in cache.hunk
    assert cache.hunk_files == ["benchmark.py"]
    broken = linear.first_change("verify-forward")
    assert broken.first and broken.commit.sha == shas[5]
    assert "+        out = _verify(target, block, target_cache)" in broken.hunk
    assert "-        out = target(block, past_key_values=target_cache, use_cache=True)" in broken.hunk
    anchor = broken.as_dict()["anchors"][0]
    assert anchor["function"] == "dflash_generate" and anchor["status"] == "no-match" and anchor["path"] == "benchmark.py"


def test_renames_moves_and_signature_changes_are_not_changes(upstream, linear):
    _repo, shas = upstream
    steps = {f.step for f in linear.findings if f.commit.sha in shas[1:4]}
    assert steps == set()
    # the anchor followed the function through the rename and the move
    where = [linear.evals[sha].steps["verify-forward"]["anchors"][0]["path"] for sha in shas[:4]]
    assert where == ["model/dflash.py", "model.py", "benchmark.py", "benchmark.py"]


@pytest.mark.slow
def test_bisection_finds_what_a_linear_scan_finds(tmp_path):
    repo = tmp_path / "long"
    shas = make_repo(repo, HISTORY, fillers=2)
    tip, base = git(repo, "rev-parse", "HEAD").strip(), shas[0]
    everything = run_ci(RECIPE, repo, rev=tip, since=base, bisect_threshold=None)
    bisected = run_ci(RECIPE, repo, rev=tip, since=base)
    n = len(everything.commits)
    assert n == 6 + 5 * 2 > BISECT_THRESHOLD
    assert len(everything.evals) == n and not everything.bisected
    assert bisected.bisected and len(bisected.evals) < n
    key = lambda r: [(f.step, f.before, f.after, f.previous.sha, f.commit.sha) for f in r.findings]  # noqa: E731
    assert key(bisected) == key(everything)
    assert bisected.first_change("target-cache-config").commit.sha == shas[4]
    assert bisected.first_change("verify-forward").commit.sha == shas[5]
    # every evaluated commit agrees with the linear scan
    for sha, ev in bisected.evals.items():
        assert statuses(ev) == statuses(everything.evals[sha])


@pytest.mark.slow
def test_merges_are_judged_against_the_real_parents(tmp_path):
    """A side branch with older code must not look like a change; a change on a merged branch is found there."""
    repo = tmp_path / "dag"
    (base,) = make_repo(repo, HISTORY[:1])
    fixed = MODEL_HEAD + HELPER + GENERATE.replace("    target_cache = DynamicCache()\n", "    target_cache = _target_cache(target)\n") + DRAFT
    broken = fixed.replace("        out = target(block, past_key_values=target_cache, use_cache=True)\n",
                           "        out = _verify(target, block, target_cache)\n") + VERIFY

    def commit(name: str, files: dict[str, str]) -> str:
        for rel, text in files.items():
            (repo / rel).write_text(text)
            git(repo, "add", rel)
        git(repo, "commit", "-q", "-m", name)
        return git(repo, "rev-parse", "HEAD").strip()

    git(repo, "checkout", "-q", "-b", "side", base)
    side = commit("side: notes", {"side.txt": "side\n"})  # still the baseline's code
    git(repo, "checkout", "-q", "main")
    fix = commit("fix the target cache", {"model/dflash.py": fixed})
    for k in range(3):
        commit(f"main {k}", {"main.txt": f"{k}\n"})
    git(repo, "checkout", "-q", "-b", "feature")
    commit("feature 0", {"feature.txt": "0\n"})
    brk = commit("verify through a helper", {"model/dflash.py": broken})
    commit("feature 1", {"feature.txt": "1\n"})
    git(repo, "checkout", "-q", "main")
    commit("main 3", {"main.txt": "3\n"})
    git(repo, "merge", "-q", "--no-ff", "-m", "merge side", "side")
    git(repo, "merge", "-q", "--no-ff", "-m", "merge feature", "feature")
    commit("main 4", {"main.txt": "4\n"})
    everything = run_ci(RECIPE, repo, since=base, bisect_threshold=None)
    bisected = run_ci(RECIPE, repo, since=base)
    assert len(everything.commits) == 13 and bisected.bisected and len(bisected.evals) < len(everything.evals)
    for result in (everything, bisected):
        found = [(f.step, f.before, f.after, f.commit.sha) for f in result.findings]
        assert found == [("target-cache-config", "applied", "fixed-upstream", fix), ("verify-forward", "applied", "no-match", brk)], found
        assert result.first_change("verify-forward").previous.sha == git(repo, "rev-parse", f"{brk}^").strip()
        assert side in everything.evals and result.exit_code == 1


@pytest.mark.slow
def test_bisection_blames_the_break_in_effect_at_the_tip(tmp_path):
    """Break, fix, break again: the change to blame is the second break, not the first (already undone)."""
    good = MODEL_HEAD + GENERATE + DRAFT
    bad = good.replace("noise_embedding=target.model.embed_tokens(block)", "noise_embedding=model.embed(block)")
    history = [("baseline", {**HISTORY[0][1], "model/dflash.py": good}),
               ("break: embed through the draft", {"model/dflash.py": bad}),
               ("fix: embed through the target again", {"model/dflash.py": good}),
               ("break again", {"model/dflash.py": bad})]
    repo = tmp_path / "flaky"
    shas = make_repo(repo, history, fillers=3)
    everything = run_ci(RECIPE, repo, since=shas[0], bisect_threshold=None)
    bisected = run_ci(RECIPE, repo, since=shas[0])
    assert len(bisected.commits) == 13 > BISECT_THRESHOLD and bisected.bisected and len(bisected.evals) < 13
    changes = [(f.before, f.after, f.commit.sha) for f in everything.findings if f.step == "input-embeddings"]
    assert changes == [("applied", "no-match", shas[1]), ("no-match", "applied", shas[2]), ("applied", "no-match", shas[3])]
    for result in (everything, bisected):
        blamed = result.change_in_effect("input-embeddings")
        assert (blamed.before, blamed.after, blamed.commit.sha) == ("applied", "no-match", shas[3])
        assert result.exit_code == 1
    sarif = json.loads(run("--recipe", "qwen3_6-gdn", "--repo", repo, "--since", shas[0], "--format", "sarif").output)
    (res,) = [r for r in sarif["runs"][0]["results"] if r["ruleId"] == "input-embeddings"]
    assert f"no-match since {shas[3][:7]}" in res["message"]["text"] and shas[1][:7] not in res["message"]["text"]


@pytest.mark.parametrize("history", ["GGBBGGBB", "GBBBGGGBBBBB", "G" * 40 + "B" * 43, "B" * 30 + "G" * 9, "G" * 20, "GB",
                                     "G" * 10 + "B" * 5 + "G" * 5 + "B" * 12])
def test_transitions_find_the_change_in_effect_at_the_tip(history):
    from patcher.ci.history import _transitions

    seen = {0, len(history) - 1}

    def status(i: int) -> str:
        seen.add(i)
        return history[i]

    found = _transitions(len(history), status, lambda: set(seen))
    assert all(b == a + 1 and history[a] != history[b] for a, b in found)
    last = max((i for i in range(1, len(history)) if history[i] != history[i - 1]), default=None)
    assert (found[-1][1] if found else None) == last
    assert len(seen) <= 2 + 2 * len(history).bit_length() * (1 + len(found))


# ----------------------------------------------------------------------------- the command line
def test_exit_codes(upstream, tmp_path):
    repo, shas = upstream
    green = run("--recipe", "qwen3_6-gdn", "--repo", repo, "--since", shas[3], "--rev", shas[4])
    assert green.exit_code == 0, green.output
    assert "OK: every step matches" in green.output
    assert "target-cache-config: applied -> fixed-upstream at " + shas[4][:7] in green.output
    red = run("--recipe", "qwen3_6-gdn", "--repo", repo, "--since", shas[4])
    assert red.exit_code == 1
    assert "verify-forward: applied -> no-match at " + shas[5][:7] in red.output
    assert "FAIL at " + shas[5][:7] + ": no-match: verify-forward" in red.output
    assert run("--recipe", "qwen3_6-gdn", "--repo", repo, "--rev", shas[3]).exit_code == 0  # one commit
    not_repo = tmp_path / "plain"
    not_repo.mkdir()
    for args, needle in [
        (["--repo", not_repo], "not a git repository"),
        (["--repo", tmp_path / "missing"], "does not exist"),
        (["--repo", repo, "--rev", "no-such-branch"], "unknown revision 'no-such-branch'"),
        (["--repo", repo, "--since", "0123456789abcdef0123"], "unknown revision"),
        (["--repo", repo, "--since", shas[5], "--rev", shas[0]], "not an ancestor"),
        (["--repo", repo, "--upstream", "nope"], "unknown upstream"),
        (["--repo", repo, "--recipe", "no-such-recipe"], "unknown recipe"),
        ([], "--repo is required"),
    ]:
        result = run("--recipe", "qwen3_6-gdn", *args) if "--recipe" not in args else run(*args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ddpatch: error:") and needle in lines[0], (args, lines)


def test_the_users_checkout_is_never_touched(upstream, tmp_path):
    source, shas = upstream
    repo = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", str(source), str(repo)], check=True, capture_output=True)
    git(repo, "checkout", "-q", shas[2])  # a detached HEAD in the middle of the range
    (repo / "model.py").write_text("# local edit\n")  # unstaged
    (repo / "scratch.py").write_text("x = 1\n")  # untracked
    (repo / "benchmark.py").write_text("# staged edit\n")
    git(repo, "add", "benchmark.py")
    (repo / "sub").mkdir()
    (repo / "sub" / "x.txt").write_text("untracked folder\n")

    def state():
        files = {p.relative_to(repo).as_posix(): p.read_bytes() for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts}
        index = (repo / ".git" / "index").read_bytes()
        return (git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain=v1", "--untracked-files=all"),
                git(repo, "for-each-ref"), git(repo, "worktree", "list", "--porcelain"), index, files)

    before = state()
    result = run("--recipe", "qwen3_6-gdn", "--repo", repo, "--since", shas[0], "--rev", "main", "--format", "json")
    assert result.exit_code == 1
    payload = json.loads(result.output)
    assert [c["commit"] for c in payload["commits"]] == shas  # read from the object store, not the dirty checkout
    # a folder inside the checkout names the same repository; paths stay relative to its top
    inner = run("--recipe", "qwen3_6-gdn", "--repo", repo / "sub", "--since", shas[0], "--rev", "main", "--format", "json")
    assert json.loads(inner.output)["findings"] == payload["findings"]
    assert state() == before
    assert not list((repo / ".git").glob("*.lock"))


def test_bare_repository(upstream, tmp_path):
    source, shas = upstream
    bare = tmp_path / "dflash.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(source), str(bare)], check=True, capture_output=True)
    result = run("--recipe", "qwen3_6-gdn", "--repo", bare, "--since", shas[3], "--format", "json")
    assert result.exit_code == 1
    payload = json.loads(result.output)
    assert payload["range"] == shas[3:] and payload["exit_code"] == 1 and not payload["passed"]
    tip = payload["commits"][-1]
    assert {s["id"]: s["status"] for s in tip["steps"]}["verify-forward"] == "no-match"
    assert [(f["step"], f["short"]) for f in payload["findings"]] == [("target-cache-config", shas[4][:7]), ("verify-forward", shas[5][:7])]


def test_forced_upstream_and_an_undetected_layout(tmp_path):
    # upstream renamed dflash_generate: the layout is no longer detected; forcing it reports the missing anchor
    renamed = [HISTORY[0], ("rename dflash_generate", {"model/dflash.py": MODEL_HEAD + GENERATE.replace("def dflash_generate", "def speculative_generate") + DRAFT})]
    repo = tmp_path / "renamed"
    shas = make_repo(repo, renamed)
    detected = run_ci(RECIPE, repo, since=shas[0])
    assert [e.upstream for e in detected.evaluated] == ["dflash", None]
    layout = [f for f in detected.findings if f.step == "(layout)"]
    assert len(layout) == 1 and layout[0].commit.sha == shas[1]
    forced = run_ci(RECIPE, repo, since=shas[0], upstream="dflash")
    tip = forced.tip
    assert forced.exit_code == 1 and tip.upstream == "dflash"
    assert set(tip.no_match) == {"target-cache-config", "input-embeddings", "crop-compat", "verify-forward", "draft-sliding-window"}
    assert tip.steps["verify-forward"]["anchors"][0]["message"] == "function `dflash_generate` is not defined anywhere in the tree"
    assert "dflash_generate" in tip.missing_anchors


# ----------------------------------------------------------------------------- reports
def test_junit_parses_and_has_a_suite_per_commit_and_a_case_per_step(upstream, tmp_path):
    repo, shas = upstream
    out = tmp_path / "r.xml"
    result = run("--recipe", "qwen3_6-gdn", "--repo", repo, "--since", shas[3], "--format", "junit", "--junit-file", out)
    assert result.exit_code == 1
    assert out.read_text() == result.output
    root = ET.fromstring(result.output.encode())
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert [s.get("id") for s in suites] == shas[3:]
    for suite in suites:
        cases = suite.findall("testcase")
        assert [c.get("name") for c in cases] == [s.id for s in RECIPE.steps]
        assert int(suite.get("tests")) == len(cases)
        assert int(suite.get("failures")) == len(suite.findall("testcase/failure"))
        assert suite.find("testcase[@name='tree-commit']/skipped") is not None
    last = suites[-1]
    failure = last.find("testcase[@name='verify-forward']/failure")
    assert failure is not None and failure.get("type") == "no-match" and "`dflash_generate` has no site" in failure.get("message")
    assert "in effect since: applied -> no-match at " + shas[5] in failure.text
    assert int(root.get("failures")) == 1 and int(root.get("tests")) == 3 * len(RECIPE.steps)


def test_sarif_is_2_1_0_with_rules_per_step_and_located_results(upstream):
    repo, shas = upstream
    result = run("--recipe", "qwen3_6-gdn", "--repo", repo, "--since", shas[3], "--format", "sarif")
    assert result.exit_code == 1
    log = json.loads(result.output)
    assert log["version"] == "2.1.0" and "sarif-2.1.0" in log["$schema"]
    (run_,) = log["runs"]
    driver = run_["tool"]["driver"]
    assert driver["name"] == "ddpatch" and [r["id"] for r in driver["rules"]] == [s.id for s in RECIPE.steps]
    for rule in driver["rules"]:
        assert rule["shortDescription"]["text"] and rule["fullDescription"]["text"]
    (res,) = run_["results"]
    assert res["ruleId"] == "verify-forward" and driver["rules"][res["ruleIndex"]]["id"] == "verify-forward"
    assert res["level"] == "error" and "no site" in res["message"]["text"] and shas[5][:7] in res["message"]["text"]
    loc = res["locations"][0]["physicalLocation"]
    assert loc["artifactLocation"]["uri"] == "benchmark.py" and loc["region"]["startLine"] >= 1
    assert run_["versionControlProvenance"][0]["revisionId"] == shas[5]
    _check_sarif_shape(log)


def _check_sarif_shape(log: dict) -> None:
    """The required properties of the SARIF 2.1.0 schema for the objects ddpatch writes."""
    assert set(log) >= {"version", "runs"}
    for run_ in log["runs"]:
        assert isinstance(run_["tool"]["driver"]["name"], str)
        for rule in run_["tool"]["driver"].get("rules", []):
            assert isinstance(rule["id"], str)
        for res in run_.get("results", []):
            assert isinstance(res["message"]["text"], str)
            assert res.get("level", "warning") in ("none", "note", "warning", "error")
            for loc in res.get("locations", []):
                phys = loc["physicalLocation"]
                assert isinstance(phys["artifactLocation"]["uri"], str)
                if "region" in phys:
                    assert isinstance(phys["region"]["startLine"], int) and phys["region"]["startLine"] >= 1
        for vcp in run_.get("versionControlProvenance", []):
            assert isinstance(vcp["repositoryUri"], str) and vcp["repositoryUri"]


def test_json_has_the_table_and_the_findings(upstream):
    repo, shas = upstream
    result = run("--recipe", "qwen3_6-gdn", "--repo", repo, "--since", shas[3], "--format", "json")
    payload = json.loads(result.output)
    assert payload["command"] == "ci" and payload["exit_code"] == result.exit_code == 1
    table = {c["commit"]: {s["id"]: s["status"] for s in c["steps"]} for c in payload["commits"]}
    assert list(table) == shas[3:]
    assert table[shas[4]]["target-cache-config"] == "fixed-upstream"
    assert table[shas[3]] == {sid: "applied" for sid in DFLASH_STEPS}
    (broken,) = [f for f in payload["findings"] if f["to"] == "no-match"]
    assert broken["step"] == "verify-forward" and broken["commit"] == shas[5] and broken["previous"] == shas[4] and broken["hunk"]


# ----------------------------------------------------------------------------- the lock file
def test_update_lock_rewrites_only_last_verified_and_only_when_green(upstream, tmp_path):
    repo, shas = upstream
    lock = tmp_path / "upstream.lock"
    shutil.copy(ROOT / "vendored" / "upstream.lock", lock)
    original = lock.read_text()
    red = run("--recipe", "qwen3_6-gdn", "--repo", repo, "--since", shas[3], "--update-lock", "--lock", lock)
    assert red.exit_code == 1 and "not updated" in red.output
    assert lock.read_text() == original
    green = run("--recipe", "qwen3_6-gdn", "--repo", repo, "--since", shas[3], "--rev", shas[4], "--update-lock", "--lock", lock)
    assert green.exit_code == 0, green.output
    new = lock.read_text()
    changed = [(a, b) for a, b in zip(original.splitlines(), new.splitlines()) if a != b]
    assert len(new.splitlines()) == len(original.splitlines()) and len(changed) == 1
    old_line, new_line = changed[0]
    assert old_line.startswith("last_verified = ") and new_line == f'last_verified = "{shas[4]}"'
    # it is the [dflash] table's line
    import tomllib

    assert tomllib.loads(new)["dflash"]["last_verified"] == shas[4]
    assert tomllib.loads(new)["ddtree"] == tomllib.loads(original)["ddtree"]
    missing = run("--recipe", "qwen3_6-gdn", "--repo", repo, "--update-lock", "--lock", tmp_path / "none.lock")
    assert missing.exit_code == 2 and "does not exist" in missing.stderr


def test_update_lock_text_inserts_a_missing_key_and_rejects_a_missing_table():
    text = '# header\n[a]\nname = "A"  # kept\n\n[b]\nname = "B"\n'
    assert update_lock_text(text, "a", "f" * 40) == '# header\n[a]\nname = "A"  # kept\nlast_verified = "' + "f" * 40 + '"\n\n[b]\nname = "B"\n'
    with pytest.raises(CIError, match=r"no \[c\] table"):
        update_lock_text(text, "c", "0" * 40)


# ----------------------------------------------------------------------------- the workflow template
def test_print_workflow():
    result = run("--print-workflow")
    assert result.exit_code == 0 and result.output == workflow_template()
    text = result.output
    for needle in ("schedule:", "cron:", "ddpatch ci", "--junit-file", "--sarif-file", "upload-sarif", "upload-artifact",
                   "liranringel/ddtree", "z-lab/dflash"):
        assert needle in text
    assert "\t" not in text  # YAML forbids tabs in indentation


# ----------------------------------------------------------------------------- --verify, once, on real decoding code
@pytest.mark.heavy
def test_verify_on_a_patched_commit(tmp_path, monkeypatch):
    from patcher.verify.process import runner

    files = {p.relative_to(ROOT / "vendored" / "dflash").as_posix(): p.read_text()
             for p in sorted((ROOT / "vendored" / "dflash").rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
    repo = tmp_path / "real"
    first, _ = make_repo(repo, [("dflash-shaped decoder", files), ("notes", {"NOTES.md": "notes\n"})])
    out = tmp_path / "verify.xml"
    monkeypatch.delenv(runner.WARM_ENV, raising=False)  # not the test session's warm verifier: ci starts its own
    monkeypatch.setattr(runner, "warm_stats", {"fresh": 0, "forked": 0, "refused": []})
    result = run("--recipe", "qwen3_6-gdn", "--repo", repo, "--since", first, "--verify", "--preset", "tiny-qwen3_5",
                 "--seeds", "0", "--prompts", "1", "--max-new-tokens", "16", "--block-size", "4", "--junit-file", out)
    assert result.exit_code == 0, result.output
    assert runner.warm_stats == {"fresh": 0, "forked": 2, "refused": []}, "each commit's verify forked from one warm verifier"
    assert "and verify passed" in result.output
    suite = ET.parse(out).getroot().find("testsuite")
    verify_cases = [c for c in suite.findall("testcase") if c.get("classname", "").endswith(".verify")]
    assert verify_cases and not suite.findall("testcase/failure")
    assert any("lossless" in c.get("name") for c in verify_cases)
