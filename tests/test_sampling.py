"""Verification under sampling: both acceptance schemes, the logits oracle and the distributional test.

``vendored/dflash`` accepts a sampled block by speculative (rejection) sampling against the
draft's probabilities, as DFlash's newer upstream does; ``vendored/ddtree`` samples the
target's posterior at every node and keeps the draft tokens that match it. Both are exact,
so both must pass; a wrong acceptance rule must fail the distributional test, which the
logits oracle (it only sees the target's logits) cannot catch.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from patcher.verify.judge.distribution import chi_square_test, sampling_distribution

ROOT = Path(__file__).resolve().parent.parent
SAMPLED = ("--temperature", "0.8", "--seeds", "0", "--prompts", "2", "--max-new-tokens", "24", "--sampling-runs", "60")


def ddpatch(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "patcher.cli", *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def vendored_dflash_model():
    spec = importlib.util.spec_from_file_location("_vendored_dflash_model", ROOT / "vendored" / "dflash" / "dflash" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- the rule itself
P = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.2, 0.3, 0.3], [0.2, 0.2, 0.2, 0.2, 0.2]])
Q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1]])


def first_tokens(rule, trials: int = 1500) -> dict[int, int]:
    torch.manual_seed(0)
    counts: dict[int, int] = {}
    for _ in range(trials):
        drafted = torch.multinomial(Q, 1).view(-1)
        accepted, nxt = rule(drafted, Q, P)
        token = int(drafted[0]) if accepted >= 1 else int(nxt)
        counts[token] = counts.get(token, 0) + 1
    return counts


def test_speculative_sampling_commits_the_targets_distribution():
    rule = vendored_dflash_model().speculative_sampling
    verdict = chi_square_test(first_tokens(rule), {t: float(p) for t, p in enumerate(P[0])})
    assert verdict.passed, verdict.describe()


def test_a_wrong_acceptance_rule_fails_the_same_test():
    def accept_always(drafted, q, p):  # the classic mistake: the draft's own choice is never checked
        return drafted.shape[0], torch.multinomial(p[-1], 1)

    verdict = chi_square_test(first_tokens(accept_always), {t: float(p) for t, p in enumerate(P[0])})
    assert not verdict.passed and verdict.p_value < 1e-6


def test_vendored_sampling_filters_match_the_oracles_definition():
    model = vendored_dflash_model()
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 3
    for top_p, top_k in ((1.0, 0), (0.9, 0), (1.0, 7), (0.8, 12)):
        ours = model.sampling_probs(logits, 0.7, top_p, top_k)
        theirs = sampling_distribution(logits, 0.7, top_p if top_p < 1 else None, top_k or None)
        assert torch.allclose(ours, theirs, atol=1e-6), (top_p, top_k)


# ----------------------------------------------------------------------------- end to end
def patched(upstream: str, dest: Path) -> Path:
    proc = ddpatch("apply", ROOT / "vendored" / upstream, "--recipe", "qwen3_6-gdn", "--out", dest)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dest


def verify(tree: Path, *args) -> tuple[int, dict]:
    proc = ddpatch("verify", tree, "--format", "json", *SAMPLED, *args)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def checks_of(payload: dict) -> dict[str, dict]:
    return {c["check"]: c for m in payload["models"] for c in m["checks"]}


@pytest.mark.slow
def test_rejection_sampling_with_top_p_and_top_k_is_verified(tmp_path):
    code, payload = verify(patched("dflash", tmp_path / "dflash"), "--top-p", "0.95", "--top-k", "20")
    checks = checks_of(payload)
    assert code == 0, [c for c in checks.values() if not c["passed"]]
    assert checks["logits == from-scratch: dflash"]["passed"]
    dist = payload["models"][0]["methods"][0]["distribution"]
    assert dist["dof"] >= 3 and dist["samples"] == 60 and 0 < dist["p_value"] <= 1
    assert "lossless: dflash" not in checks, "sampled tokens have no greedy reference"


@pytest.mark.slow
def test_posterior_matching_on_the_tree_is_verified(tmp_path):
    code, payload = verify(patched("ddtree", tmp_path / "ddtree"), "--tree-budgets", "4")
    checks = checks_of(payload)
    assert code == 0, [c for c in checks.values() if not c["passed"]]
    for method in ("dflash", "ddtree_tb4"):
        assert checks[f"logits == from-scratch: {method}"]["passed"]
        assert checks[f"sampling distribution: {method}"]["passed"]
    # the scripted draft proposes from the target's own (sharpened) distribution: rollback is exercised under sampling
    assert payload["models"][0]["partial_acceptances"] > 0, payload["models"][0]["methods"]
    # the DDTree-shaped decoders take no top_p: they are not run under it, and the report says so
    code, payload = verify(payload["tree"], "--tree-budgets", "4", "--top-p", "0.9", "--sampling-runs", "0", "--max-new-tokens", "4")
    assert "takes no top_p" in checks_of(payload)["sampling options"]["evidence"]


@pytest.mark.slow
def test_a_wrong_acceptance_rule_passes_the_logits_oracle_and_fails_the_distribution(tmp_path):
    tree = patched("dflash", tmp_path / "dflash")
    source = tree / "dflash" / "model.py"
    text = source.read_text()
    assert "        if coins[i] * q < p:\n" in text
    source.write_text(text.replace("        if coins[i] * q < p:\n", "        if True:  # mutant: accept every draft token\n"))
    code, payload = verify(tree, "--sampling-runs", "100")
    checks = checks_of(payload)
    assert code == 1
    assert checks["logits == from-scratch: dflash"]["passed"], "the target's logits are still right"
    assert not checks["sampling distribution: dflash"]["passed"], checks["sampling distribution: dflash"]
