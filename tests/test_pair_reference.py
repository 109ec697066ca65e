"""Acceptance for any pair (issue 43): the reference a run computes for itself must equal the stored floor where both
exist (the shipped pair), start by start, method by method; and a run picks the stored floor only where it covers the
run (its prompts, dtype, block size and budgets), this run's reference otherwise."""

from __future__ import annotations

import pytest
import torch

from patcher.verify.judge.acceptance import floor as acceptance, pair_reference
from patcher.verify.models.load import greedy
from patcher.verify.models.trained import FOLDER_PRESETS


@pytest.fixture(scope="module")
def shipped():
    from transformers import AutoModelForCausalLM

    from patcher.referee.reference import shipped_drafter_class

    t_dir, d_dir = FOLDER_PRESETS["trained-qwen3_5"]
    stored, why = acceptance.find({"target": str(t_dir), "draft": str(d_dir)})
    assert stored is not None, why
    target = AutoModelForCausalLM.from_pretrained(t_dir, dtype=torch.float32, local_files_only=True).eval()
    draft = shipped_drafter_class().from_pretrained(d_dir, dtype=torch.float32, local_files_only=True).eval()
    st = stored["settings"]
    prompts = [p["ids"] for p in stored["prompts"]]
    refs = [greedy(target, torch.tensor([p]), st["max_new_tokens"], tuple(st["stop_token_ids"])) for p in prompts]
    return stored, target, draft, prompts, refs


def test_this_runs_reference_equals_the_stored_floor_on_the_shipped_pair(shipped):
    stored, target, draft, prompts, refs = shipped
    st = stored["settings"]
    data = pair_reference.in_run_floor(target, draft, prompts, refs, block_size=st["block_size"], budgets=st["budgets"],
                                       max_new_tokens=st["max_new_tokens"], stop_ids=st["stop_token_ids"],
                                       output_tolerance=stored["epsilon"]["output_tolerance"], dtype="float32")
    h = acceptance.horizon_of(st["max_new_tokens"], st["block_size"])
    compared = 0
    for mine, theirs, ref in zip(data["prompts"], stored["prompts"], refs):
        assert mine["greedy"] == theirs["greedy"][: len(ref)]
        for method, entry in theirs["methods"].items():
            for s in range(min(h, len(ref) - 1)):
                assert (mine["methods"][method]["at"][s], mine["methods"][method]["reachable"][s]) == \
                       (entry["at"][s], entry["reachable"][s]), (method, s)
                compared += 1
    assert compared == len(prompts) * len(st["budgets"] + [0]) * h  # every start of every method of every prompt


def test_a_run_takes_the_stored_floor_only_where_it_covers_the_run(shipped):
    stored, target, draft, prompts, refs = shipped
    from patcher.verify.judge.drafter.recorder import DrafterCalibration

    cal = DrafterCalibration("float32", {"features": 1e-6, "output": 1e-6}, {"features": 1e-4, "output": 1e-4})
    tensors = [torch.tensor([p]) for p in prompts[:2]]
    cfg = {"block_size": 8, "max_new_tokens": 24, "stop_token_ids": stored["settings"]["stop_token_ids"], "temperature": 0.0}
    data, why = pair_reference.floor_for(stored, "", cfg, "float32", target, draft, cal, tensors, refs[:2], [8])
    assert data is stored and why == ""
    for changed, says in ((dict(cfg, block_size=4), "block size 8"), (cfg, "no stored floor for tree budget 12")):
        data, why = pair_reference.floor_for(stored, "", changed, "float32", target, draft, cal, tensors,
                                              [r[:24] for r in refs[:2]], [12] if changed is cfg else [8])
        assert data is not stored and data["in_run"] and says in data["instead_of_stored"], data.get("instead_of_stored")
    other = [torch.tensor([prompts[1]]), torch.tensor([prompts[0]])]
    data, _ = pair_reference.floor_for(stored, "", cfg, "float32", target, draft, cal, other, [refs[1][:24], refs[0][:24]], [8])
    assert data["in_run"] and data["instead_of_stored"] == "the run's prompts are not the stored floor's"
    data, why = pair_reference.floor_for(None, "no stored floor for this drafter", cfg, "float32", target, draft, None, tensors,
                                         refs[:2], [8])
    assert data is None and "cannot drive this drafter" in why


def test_the_heads_largest_row_norm_is_read_a_chunk_at_a_time(monkeypatch):
    """epsilon's ``|LM head row|_1``: no float32 copy of the whole head (a real one is 5 GB), the same figure to the bit,
    and computed again once the head changes."""
    from patcher.verify.judge.acceptance import reference_decode

    torch.manual_seed(0)
    head = torch.nn.Linear(48, 1000, bias=False).to(torch.bfloat16)
    whole = float(head.weight.detach().float().abs().sum(-1).max())
    monkeypatch.setattr(reference_decode, "ROW_CHUNK", 7)  # 143 chunks, the last one short
    assert reference_decode.max_row_l1(head) == whole
    with torch.no_grad():
        head.weight[999] = 3.0  # the last row, in the short chunk
    assert reference_decode.max_row_l1(head) == float(head.weight[999].detach().float().abs().sum()) > whole
