"""A drift variant that verifies through the target's backbone and its own LM head (issue 42 item 5).

Forks often skip the ``ForCausalLM`` wrapper: they run ``target.model(...)`` (the decoder stack,
which returns hidden states and no logits) and apply ``target.lm_head`` themselves to the rows they
want. Written for this suite from ``vendored/ddtree``; no fork's code is copied. The prefill and
every verify of both decoders (the tree's, under its 4D mask, and the chain's) go through the backbone.
"""

from __future__ import annotations

from pathlib import Path

from . import transforms as t
from .variants import BY_NAME, VARIANTS, Variant, _read

TREE = "ddtree.py"
DD = "dflash.py"

_PREFILL = (
    "    prefill = target(input_ids, position_ids=position_ids[:, :prompt_len], past_key_values=past_key_values_target,\n"
    "                     use_cache=True, logits_to_keep=1, output_hidden_states={flag})\n"
    "    output_ids[:, prompt_len] = sample(prefill.logits[:, -1], temperature)\n"
)
_PREFILL_BACKBONE = (
    "    prefill = target.model(input_ids, position_ids=position_ids[:, :prompt_len],\n"
    "                           past_key_values=past_key_values_target, use_cache=True, output_hidden_states={flag})\n"
    "    output_ids[:, prompt_len] = sample(target.lm_head(prefill.last_hidden_state[:, -1]), temperature)\n"
)


def build_backbone(root: Path) -> None:
    t.edit(
        root, TREE,
        (_PREFILL.format(flag="True"), _PREFILL_BACKBONE.format(flag="True")),
        ("        verify = target(tree_ids, position_ids=tree_positions, attention_mask=tree_mask, use_cache=True,\n"
         "                        past_key_values=past_key_values_target, output_hidden_states=True)\n"
         "        posterior = sample(verify.logits[0], temperature)\n",
         "        verify = target.model(tree_ids, position_ids=tree_positions, attention_mask=tree_mask, use_cache=True,\n"
         "                              past_key_values=past_key_values_target, output_hidden_states=True)\n"
         "        node_rows = torch.arange(tree_ids.shape[1], device=device)\n"
         "        posterior = sample(target.lm_head(verify.last_hidden_state[0, node_rows]), temperature)\n"),
    )
    t.edit(
        root, DD,
        (_PREFILL.format(flag="uses_draft"), _PREFILL_BACKBONE.format(flag="uses_draft")),
        ("        verify = target(block_output_ids, position_ids=position_ids[:, window], use_cache=True,\n"
         "                        past_key_values=past_key_values_target, output_hidden_states=uses_draft)\n"
         "        posterior = sample(verify.logits, temperature)\n",
         "        verify = target.model(block_output_ids, position_ids=position_ids[:, window], use_cache=True,\n"
         "                              past_key_values=past_key_values_target, output_hidden_states=uses_draft)\n"
         "        posterior = sample(target.lm_head(verify.last_hidden_state), temperature)\n"),
    )


def claims_backbone(root: Path, original: Path) -> None:
    for rel in (TREE, DD):
        text = _read(root, rel)
        assert text.count("= target.model(") == 2 and "target(" not in text.replace("target.model(", "")
        assert "prefill.logits" not in text and "verify.logits" not in text
        assert text.count("target.lm_head(") >= 2
    assert "attention_mask=tree_mask" in _read(root, TREE).split("verify = target.model(")[1].split("\n")[0]


BACKBONE = [
    Variant(
        "backbone-lm-head", "forks", "ddtree", build_backbone, claims_backbone,
        statuses={"verify-forward": "applied"},
        summary="the prefill and every verify call the backbone, `target.model(..., attention_mask=tree_mask)`, "
                "then the fork's own `target.lm_head(out.last_hidden_state[0, rows])`",
    ),
]

VARIANTS.extend(BACKBONE)
BY_NAME.update({v.name: v for v in BACKBONE})
