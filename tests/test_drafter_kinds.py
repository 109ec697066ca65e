"""Drafter kinds (issue 51): a DFlash2 or DSpark drafter is told from its config, a kind with no reference is refused
in one line, and the DFlash2/DSpark references draft, start by start, what the drafters' own ``propose`` drafts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from patcher.verify.plumbing.drafter_kinds import kind_of, kind_of_folder, sample_from_anchor

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "patcher" / "data" / "trained_pair" / "target"
DFLASH = {"architectures": ["DFlashDraftModel"], "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 4, 6]}}
DFLASH2 = {"architectures": ["DFlash2DraftModel"], "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 4, 6],
                                                                       "conv_kernel_size": 3, "conv_group_size": 16,
                                                                       "selector_rank": 8, "selector_top_k": 4}}
DSPARK = {"architectures": ["DSparkDraftModel"], "markov_head_type": "vanilla", "markov_rank": 8, "sample_from_anchor": True,
          "has_confidence_head": True, "vocab_size": 1024, "target_layer_ids": [1, 4, 6], "mask_token_id": 1}


def test_kinds_from_config_fields():
    assert kind_of(DFLASH).kind == "dflash" and kind_of(DFLASH).supported
    assert kind_of(DFLASH2).kind == "dflash2" and kind_of(DFLASH2).supported
    # the selector alone makes DFlash2, whatever the class is called (llama.cpp: selector_top_k > 0)
    renamed = {**DFLASH2, "architectures": ["MyForkDraftModel"]}
    assert kind_of(renamed).kind == "dflash2"
    assert kind_of({**DFLASH, "dflash_config": {**DFLASH["dflash_config"], "selector_top_k": 0}}).kind == "dflash"
    assert kind_of(DSPARK).kind == "dspark" and kind_of(DSPARK).supported
    assert kind_of({"architectures": ["Qwen3DSparkModel"]}).kind == "dspark"
    assert sample_from_anchor(DSPARK) and not sample_from_anchor({**DSPARK, "sample_from_anchor": False})
    assert sample_from_anchor({"architectures": ["DSparkDraftModel"]})  # the DFlash-lineage default


@pytest.mark.parametrize("config, kind, says", [
    ({**DSPARK, "markov_head_type": "gated"}, "dspark", "'gated'"),
    ({**DSPARK, "draft_vocab_size": 256}, "dspark", "d2t"),
    ({**DSPARK, "transformer_layer_config": {}}, "dspark", "EAGLE3"),
    ({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000}, "LlamaForCausalLMEagle3", "no reference"),
    ({"architectures": ["DFlash2DraftModel"], "dflash_config": {"selector_top_k": 4}}, "dflash2", "conv_kernel_size"),
    ({**DFLASH2, "markov_rank": 8}, "mixed DFlash2/DSpark", "two kinds"),
])
def test_kinds_without_a_reference_are_refused_in_one_line(config, kind, says):
    found = kind_of(config)
    assert not found.supported and found.kind == kind
    line = found.refusal("--draft D")
    assert "\n" not in line and line.startswith("--draft D: a ") and says in line and "no DFlash verdict" in line
    assert "architectures=" in line  # the fields it found are named


def _folder(tmp_path, config):
    from safetensors.torch import save_file
    import torch

    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"fc.weight": torch.zeros(2, 2)}, str(folder / "model.safetensors"))
    return folder


def test_verify_refuses_a_kind_without_reference_before_judging(tmp_path):
    from patcher.verify.models.folders import FolderError, check_pair

    folder = _folder(tmp_path, {**DSPARK, "markov_head_type": "gated"})
    assert kind_of_folder(folder).kind == "dspark"
    with pytest.raises(FolderError, match=r"a dspark drafter \(.*markov_head_type=\"gated\".*\): its Markov head is 'gated'"):
        check_pair(None, str(folder))
    (tmp_path / "b").mkdir()
    check_pair(None, str(_folder(tmp_path / "b", DFLASH)))  # DFlash passes the folder check
    (tmp_path / "c").mkdir()  # DSpark has a reference, not yet wired into verify's acceptance checks: no DFlash verdict
    with pytest.raises(FolderError, match=r"a dspark drafter .*judge DFlash drafters only so far"):
        check_pair(None, str(_folder(tmp_path / "c", DSPARK)))


def test_verify_cli_says_one_line_and_exits_2(tmp_path):
    import subprocess
    import sys

    folder = _folder(tmp_path, {"architectures": ["MedusaModel"], "dflash_config": {}})
    tree = ROOT / "vendored" / "dflash"
    run = subprocess.run([sys.executable, "-m", "patcher", "verify", str(tree), "--target", str(TARGET), "--draft", str(folder)],
                         capture_output=True, text=True, cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("ddpatch: error:")]
    assert len(errors) == 1 and "a MedusaModel drafter" in errors[0] and "no DFlash verdict" in errors[0], run.stderr


# ----------------------------------------------------------------------------- references against propose
@pytest.fixture(scope="module")
def pair_bits():
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32, local_files_only=True).eval()
    prompt = [4, 466, 260, 321, 941, 385, 900, 14, 270, 528, 831, 693, 616, 15, 200, 4]
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(20):
            seq.append(int(target(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return target, prompt, seq


def _drafter(kind: str, **extra):
    import torch
    from transformers import Qwen3Config

    from patcher.verify.models.drafters import CLASSES

    torch.manual_seed(1)
    cfg = Qwen3Config(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False)
    cfg.block_size, cfg.num_target_layers = 6, 8
    cfg.dflash_config = {"mask_token_id": 1, "target_layer_ids": [1, 4, 6], **extra}
    for k, v in extra.items():
        setattr(cfg, k, v)
    draft = CLASSES[kind](cfg).eval()
    with torch.no_grad():  # seeded weights large enough that the selector / Markov head / convolutions change choices
        for name, p in draft.named_parameters():
            if any(s in name for s in ("codebook", "hidden_projection", "markov_w", "kernel_projection", "confidence")):
                p.copy_(torch.randn_like(p) * (0.6 if "kernel_projection" not in name else 0.05))
    return draft


def _starts(target, draft, prompt, seq):
    import torch

    from patcher.verify.judge.kind_reference import block_hidden_at, logits_of
    from patcher.verify.judge.acceptance.pair_reference import context_features
    from patcher.verify.judge.acceptance.reference_decode import ScratchPair

    pair = ScratchPair(target, draft, 1, draft.block_size)
    feats = context_features(pair, seq)
    for s in range(len(prompt), len(seq) - draft.block_size):
        hidden = block_hidden_at(pair, feats, seq, s)
        yield s, hidden, logits_of(pair, hidden), torch


def test_dflash2_reference_is_propose_start_by_start(pair_bits):
    from patcher.verify.judge.kind_reference import dflash2_draft, weights_of

    target, prompt, seq = pair_bits
    draft = _drafter("DFlash2DraftModel", conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4)
    w = weights_of(draft, "dflash2")
    blind = {**w, "pred": w["pred"][[seq[0]] * w["pred"].shape[0]]}  # scored without its predecessor: always the same row
    starts = differ_blind = differ_argmax = 0
    for s, hidden, logits, torch in _starts(target, draft, prompt, seq):
        with torch.inference_mode():
            path, cand, _ = draft.propose(hidden[None, 1:], torch.tensor([seq[s]]), target.lm_head, 0.0)
        mine = dflash2_draft(hidden[1:], logits[1:], seq[s], w, 4)
        assert path[0].tolist() == mine, f"start {s}"
        assert all(t in c for t, c in zip(mine, cand[0].tolist()))
        differ_blind += dflash2_draft(hidden[1:], logits[1:], seq[s], blind, 4) != mine
        differ_argmax += logits[1:].argmax(-1).tolist() != mine
        starts += 1
    assert starts >= 10 and differ_blind > 0 and differ_argmax > 0, (starts, differ_blind, differ_argmax)


@pytest.mark.parametrize("anchor_first", [True, False])
def test_dspark_reference_is_propose_start_by_start(pair_bits, anchor_first):
    from patcher.verify.judge.kind_reference import draft_rows, dspark_confidence, dspark_draft, weights_of

    target, prompt, seq = pair_bits
    draft = _drafter("DSparkDraftModel", markov_rank=8, sample_from_anchor=anchor_first, has_confidence_head=True)
    w = weights_of(draft, "dspark")
    rows = draft_rows("dspark", anchor_first)
    assert draft.draft_positions() == rows
    cut = differ_plain = 0
    for s, hidden, logits, torch in _starts(target, draft, prompt, seq):
        h, lg = hidden[rows], logits[rows]
        assert h.shape[0] == (draft.block_size if anchor_first else draft.block_size - 1)
        p_min = dspark_confidence(h[2], seq[s] if False else dspark_draft(h, lg, seq[s], w)[1], w) + 1e-4  # cuts at the 3rd
        with torch.inference_mode():
            tokens, conf, kept = draft.propose(h[None], torch.tensor([seq[s]]), target.lm_head, 0.0, p_min=p_min)
        full = dspark_draft(h, lg, seq[s], w)
        assert tokens[0].tolist() == full, f"start {s}"
        mine = dspark_draft(h, lg, seq[s], w, p_min)
        assert tokens[0, : int(kept[0])].tolist() == mine and len(mine) <= 2, f"start {s}"
        cut += len(mine) < len(full)
        differ_plain += lg.argmax(-1).tolist() != full
    assert cut > 0 and differ_plain > 0


# ----------------------------------------------------------------------------- the referee and drafter kinds
@pytest.mark.parametrize("config, says, fields", [
    (DSPARK, "its confidence head cuts each draft at the engine's own threshold", "has_confidence_head=true"),
    ({**DSPARK, "markov_head_type": "gated"}, "its Markov head is 'gated'", "markov_head_type=\"gated\""),
    ({"architectures": ["MedusaModel"], "dflash_config": {}}, "a MedusaModel drafter", "architectures=[\"MedusaModel\"]"),
    ({"architectures": ["DFlash2DraftModel"], "dflash_config": {"selector_top_k": 4}}, "lacks selector_rank, conv_kernel_size", "selector_top_k=4"),
])
def test_the_referee_refuses_a_kind_it_does_not_judge_in_one_line_before_any_request(tmp_path, config, says, fields):
    from click.testing import CliRunner

    from patcher.cli import main

    folder = _folder(tmp_path, config)
    result = CliRunner().invoke(main, ["referee", "--engine", "http://127.0.0.1:9", "--target", str(TARGET), "--draft", str(folder)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ddpatch: error:"), lines
    assert says in lines[0] and fields in lines[0] and "DFlash verdict" in lines[0], lines[0]
    assert "127.0.0.1" not in lines[0]  # refused from the config alone: the engine was never asked


def test_the_referee_judges_dflash2_and_dspark_without_a_confidence_head_where_verify_does_not_yet():
    from patcher.verify.plumbing.drafter_kinds import referee_refusal, verify_refusal

    plain = {**DSPARK, "has_confidence_head": False}
    for config in (DFLASH, DFLASH2, plain, {k: v for k, v in DSPARK.items() if k != "has_confidence_head"}):
        assert referee_refusal(kind_of(config), "--draft D") is None, config
    for config in (DFLASH2, plain):
        assert "judge DFlash drafters only so far" in verify_refusal(kind_of(config), "--draft D")
    assert "p_min" in referee_refusal(kind_of(DSPARK), "--draft D")


def _proposed(draft, hidden, anchor: int, head) -> list[int]:
    """The drafter's own ``propose`` (greedy) over a round's block output ``hidden``."""
    import torch

    rows = draft.draft_positions() if hasattr(draft, "draft_positions") else slice(1, None)
    with torch.inference_mode():
        return draft.propose(hidden[None, rows], torch.tensor([anchor]), head, 0.0)[0][0].tolist()


def _own_path(pair, draft, prompt, first: int, length: int):
    """New tokens that a drafter's own ``propose`` drafts round after round, every draft taken whole: along them a
    correct chain of its kind accepts the whole draft at each of those round starts."""

    from patcher.verify.judge.kind_reference import block_hidden_at
    from patcher.verify.judge.acceptance.pair_reference import context_features

    got, starts = [first], [0]
    while len(got) < length:
        seq = list(prompt) + got
        got += _proposed(draft, block_hidden_at(pair, context_features(pair, seq), seq, len(seq) - 1), seq[-1], pair.head)
        starts.append(len(got) - 1)
    return got, starts[:-1]


@pytest.mark.parametrize("cls, extra, kind", [
    ("DFlash2DraftModel", dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4), "dflash2"),
    ("DSparkDraftModel", dict(markov_rank=8, sample_from_anchor=True, has_confidence_head=False), "dspark"),
    ("DSparkDraftModel", dict(markov_rank=8, sample_from_anchor=False, has_confidence_head=False), "dspark"),
])
def test_the_referees_kind_reference_is_the_drafters_own_chain_start_by_start(pair_bits, tmp_path, cls, extra, kind):
    from patcher.referee.reference import along, load_pair
    from patcher.verify.judge.kind_reference import block_hidden_at
    from patcher.verify.judge.acceptance.pair_reference import context_features, prompt_entry
    from patcher.verify.judge.acceptance.reference_decode import ScratchPair

    target, prompt, seq = pair_bits
    made = _drafter(cls, **extra)
    made.config.architectures = [cls]
    made.save_pretrained(tmp_path / "d2")
    _, draft = load_pair(str(TARGET), str(tmp_path / "d2"))  # the referee's own loading: the class from the config's kind
    assert type(draft).__name__ == cls
    pair = ScratchPair(target, draft, 1, draft.block_size)
    got, starts = _own_path(pair, draft, prompt, seq[len(prompt)], 18)
    ref = along(target, draft, prompt, got, (8,), 1e-3)
    assert ref.kind == kind and list(ref.methods) == [kind]  # no tree reference: DDTree is not judged
    full = list(prompt) + got
    feats = context_features(pair, full)
    P = len(prompt)
    q = draft.block_size if getattr(draft, "sample_from_anchor", False) else draft.block_size - 1  # DSpark anchor-first: 8
    for s in range(len(got) - 1):
        path = _proposed(draft, block_hidden_at(pair, feats, full, P + s), full[P + s], target.lm_head)
        assert len(path) == q
        gold = got[s + 1 : s + 1 + q]
        a = 0
        while a < len(gold) and path[a] == gold[a]:
            a += 1
        assert ref.chain["at"][s] == a + 1, f"start {s}"
        assert a + 1 in ref.chain["reachable"][s], f"start {s}"
    assert all(ref.chain["at"][s] == min(q, len(got) - 1 - s) + 1 for s in starts)
    # DFlash's argmax chain along the same tokens accepts less: judged by it, a correct engine of this kind reads "above"
    dflash = prompt_entry(pair, prompt, got, ["dflash"], len(got), 1e-3)["methods"]["dflash"]["at"]
    assert sum(dflash[s] for s in starts) < sum(ref.chain["at"][s] for s in starts), (dflash, ref.chain["at"])


DFLASH2_SHIPPED = ROOT / "patcher" / "data" / "trained_pair" / "draft_dflash2"


@pytest.mark.parametrize("lossy", [False, True])
def test_the_referee_judges_the_shipped_dflash2_drafter_by_its_own_chain(monkeypatch, lossy):
    """A made-up engine whose counters are a correct DFlash2's along its tokens passes, named as DFlash2's; one that
    accepts nothing loses acceptance; DDTree is not judged (no tree reference for DFlash2)."""
    from test_referee import MadeUpEngine

    from patcher.referee import engines, run
    from patcher.referee.counters import Acceptance
    from patcher.referee.reference import load_pair
    from patcher.report.referee import referee_text

    engine = MadeUpEngine(*load_pair(str(TARGET), str(DFLASH2_SHIPPED)), "")
    if lossy:
        made = engine.generate

        def generate(prompt, n):
            out = made(prompt, n)
            out.acceptance = Acceptance(drafted=None, accepted=0, rounds=n - 2, rounds_exact=True, source="made up")
            return out

        engine.generate = generate
    monkeypatch.setattr(engines, "connect", lambda *a, **k: engine)
    result = run.referee("http://made-up", str(TARGET), str(DFLASH2_SHIPPED), prompts=2, max_new_tokens=24, budgets=(8,))
    v = result["verdict"]
    assert result["drafter_kind"] == "dflash2" and result["ddtree"] == {8: None}
    assert all(r["identical"] and r["reference"] > 2 for r in result["per_prompt"]), result["per_prompt"]
    if lossy:
        assert not v["passed"] and v["kind"] == "loses acceptance" and "where a correct DFlash2 accepts" in v["line"], v
    else:
        assert v["passed"] and v["kind"] == "exact" and v["line"].startswith("the engine reaches a correct DFlash2's"), v
        assert all(r["engine"] == pytest.approx(r["reference"]) for r in result["per_prompt"])
    text = referee_text(result)
    assert "a correct DFlash2" in text and "DDTree: not judged (no tree reference for a DFlash2 drafter)" in text, text


def test_the_shipped_dflash2_drafter_accepts_several_tokens_a_round_as_its_reference_json_says():
    """The shipped DFlash2 drafter (tools/train_tiny_pair.py --kind dflash2): its reference chain accepts more than 2
    tokens a round on the held-out prompts, and two prompts' figures of reference.json come out again from scratch."""
    import torch

    from patcher.referee.reference import load_pair
    from patcher.verify.judge.kind_reference import prompt_entry
    from patcher.verify.judge.acceptance.reference_decode import ScratchPair, walk

    meta = json.loads((DFLASH2_SHIPPED / "reference.json").read_text())
    assert meta["class"] == "DFlash2DraftModel" and meta["bytes"] == (DFLASH2_SHIPPED / "model.safetensors").stat().st_size
    assert sum(p.stat().st_size for p in DFLASH2_SHIPPED.iterdir()) < 2.1e6
    ref = meta["reference"]
    assert ref["mean_acceptance"] > 2 and ref["prompts"] == 8, ref
    target, draft = load_pair(str(TARGET), str(DFLASH2_SHIPPED))
    tok_prompts = json.loads((TARGET.parent / "metadata.json").read_text())["held_out_prompts"]
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(DFLASH2_SHIPPED)
    pair = ScratchPair(target, draft, draft.mask_token_id, draft.block_size)
    new = ref["new_tokens"]
    for i in (0, 2):
        seq = tok(tok_prompts[i]).input_ids
        P = len(seq)
        with torch.inference_mode():
            for _ in range(new + draft.block_size + 1):
                seq.append(int(target(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        at = prompt_entry(pair, "dflash2", seq[:P], seq[P:], new, 0.0)["methods"]["dflash2"]["at"]
        rounds = walk(at, new)
        assert sum(rounds) / len(rounds) == pytest.approx(ref["per_prompt"][i], abs=0.006), (i, rounds)
        if i == 2:  # start by start, the trained drafter's own propose accepts what the reference says
            from patcher.verify.judge.kind_reference import block_hidden_at
            from patcher.verify.judge.acceptance.pair_reference import context_features

            feats = context_features(pair, seq)
            for s in range(new):
                path = _proposed(draft, block_hidden_at(pair, feats, seq, P + s), seq[P + s], target.lm_head)
                gold = seq[P + s + 1 : P + s + 1 + len(path)]
                a = next((k for k, (x, y) in enumerate(zip(path, gold)) if x != y), len(path))
                assert at[s] == a + 1, f"start {s}"
            assert max(at) > 5, at
