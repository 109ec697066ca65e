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
