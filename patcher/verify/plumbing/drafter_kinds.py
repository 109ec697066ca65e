"""Which kind of drafter a checkpoint's ``config.json`` describes, from its fields alone (stdlib only).

The kinds ddpatch has a reference for:

- ``dflash``: a block of ``block_size`` positions (the anchor, then masks) read greedily at positions 1..;
- ``dflash2``: ``DFlash2DraftModel``, a DFlash drafter with grouped dynamic causal convolutions and a candidate
  selector (``selector_top_k > 0``, ``selector_rank``, ``conv_kernel_size``, ``conv_group_size``, in the config or
  its ``dflash_config``): each draft token is picked among the top-k of its position, scored with the token
  chosen before it;
- ``dspark``: ``DSparkDraftModel`` and its kin, a DFlash drafter with a semi-autoregressive Markov head
  (``markov_head_type`` vanilla), an optional confidence head (``has_confidence_head``) and ``sample_from_anchor``
  (the anchor-first block layout: ``block_size`` draft tokens instead of ``block_size - 1``).

Anything else that names itself a drafter of another lineage (EAGLE, Medusa, an MTP head), or a DSpark variant
the references do not model (a Markov head other than vanilla, a reduced draft vocabulary with a ``d2t`` map, an
EAGLE3-schema export), is a kind with no reference: ``DrafterKind.why`` says so and ``refusal`` words the one
line that verify and the referee print (exit 2) instead of a DFlash verdict. Both import this module: the
referee's modules import only the stdlib at module level, so this one does too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

#: The fields that tell DFlash2 apart (read from the top level or from ``dflash_config``).
DFLASH2_FIELDS = ("selector_top_k", "selector_rank", "conv_kernel_size", "conv_group_size")
#: The fields that tell DSpark apart.
DSPARK_FIELDS = ("markov_head_type", "markov_rank", "sample_from_anchor", "has_confidence_head", "draft_vocab_size")
#: Architecture names (substrings) of DSpark checkpoints: llama.cpp's converter registers these.
DSPARK_NAMES = ("DSpark",)
#: Architecture names (substrings) of drafters of other lineages, which no reference here models.
OTHER_NAMES = ("Eagle", "EAGLE", "Medusa", "Hydra", "MTP", "Mtp", "NextN")
#: EAGLE3-schema export fields (llama.cpp reads them as the 1+N bonus-anchor layout): not modelled.
EAGLE3_FIELDS = ("transformer_layer_config", "aux_hidden_state_layer_ids")


@dataclass(frozen=True)
class DrafterKind:
    """A drafter's kind, the fields that decided it (name -> value as the config holds it), and, when ddpatch has no
    reference for it, why not (``why``; empty when it has one)."""

    kind: str
    fields: dict = field(default_factory=dict)
    why: str = ""

    @property
    def supported(self) -> bool:
        return not self.why

    def found(self) -> str:
        return ", ".join(f"{k}={json.dumps(v)}" for k, v in self.fields.items()) or "no kind fields"

    def refusal(self, where: str) -> str:
        """The one line for a drafter of a kind with no reference (``where``: ``--draft FOLDER``)."""
        return (f"{where}: a {self.kind} drafter ({self.found()}): {self.why}; ddpatch judges DFlash, DFlash2 and DSpark "
                "(vanilla Markov head) drafters only, and gives no DFlash verdict for another kind")


#: The kinds whose acceptance verify's checks judge today. DFlash2's and DSpark's references exist
#: (``patcher/verify/judge/kind_reference.py``) but are not wired into the acceptance checks yet: verify refuses
#: those drafters in one line rather than judge them against DFlash's reference (a false red).
VERIFY_JUDGES = ("dflash",)


def verify_refusal(kind: DrafterKind, where: str) -> str | None:
    """The one line verify prints for a ``--draft`` of this kind, or None where verify judges it."""
    if not kind.supported:
        return kind.refusal(where)
    if kind.kind not in VERIFY_JUDGES:
        return (f"{where}: a {kind.kind} drafter ({kind.found()}): verify's acceptance checks judge DFlash drafters only "
                f"so far; a {kind.kind} drafter drafts otherwise, and a DFlash verdict on it would mean nothing")
    return None


#: The kinds ``ddpatch referee`` judges today. DFlash2's and DSpark's chain references are wired into the referee's
#: reference (``patcher/referee/reference.py``: ``kind_reference.prompt_entry``); neither has a tree reference (the
#: referee says "not judged" for DDTree with them). A DSpark drafter with a confidence head is refused: the engine
#: cuts its drafts at a threshold (``p_min``) of its own that the referee cannot read.
REFEREE_JUDGES = ("dflash", "dflash2", "dspark")
#: How the referee's lines name each kind's correct decoder.
KIND_NAMES = {"dflash": "DFlash", "dflash2": "DFlash2", "dspark": "DSpark"}


def referee_refusal(kind: DrafterKind, where: str) -> str | None:
    """The one line ``ddpatch referee`` prints for a ``--draft`` of this kind, or None where the referee judges it."""
    if not kind.supported:
        return kind.refusal(where)
    if kind.kind not in REFEREE_JUDGES:
        return (f"{where}: a {kind.kind} drafter ({kind.found()}): the referee's reference judges "
                f"{' and '.join(KIND_NAMES[k] for k in REFEREE_JUDGES)} drafters only so far; a {kind.kind} drafter drafts "
                "otherwise, and a DFlash verdict on it would mean nothing")
    if kind.kind == "dspark" and str(kind.fields.get("has_confidence_head", False)).lower() not in ("false", "0", "none"):
        return (f"{where}: a dspark drafter ({kind.found()}): its confidence head cuts each draft at the engine's own "
                "threshold (p_min), which the referee cannot read from the engine, so no reference acceptance is known; "
                "the referee judges DSpark drafters without a confidence head, and gives no DFlash verdict")
    return None


def _get(config: dict, name: str):
    inner = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    if name in config:
        return config[name]
    return inner.get(name)


def _int(value, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def kind_of(config: dict) -> DrafterKind:
    """The kind of the drafter whose ``config.json`` is ``config`` (a dict)."""
    archs = [a for a in (config.get("architectures") or []) if isinstance(a, str)]
    fields = {}
    if archs:
        fields["architectures"] = archs
    two = {n: _get(config, n) for n in DFLASH2_FIELDS if _get(config, n) is not None}
    spark = {n: _get(config, n) for n in DSPARK_FIELDS if _get(config, n) is not None}
    eagle3 = [n for n in EAGLE3_FIELDS if n in config]
    named_two = any("DFlash2" in a for a in archs)
    named_spark = any(any(s in a for s in DSPARK_NAMES) for a in archs)
    is_two = named_two or _int(two.get("selector_top_k")) > 0
    is_spark = named_spark or "markov_head_type" in spark or "markov_rank" in spark
    other = [a for a in archs if any(o in a for o in OTHER_NAMES) and not (named_two or named_spark)]
    if is_two and is_spark:
        return DrafterKind("mixed DFlash2/DSpark", {**fields, **two, **spark}, "it carries the fields of two kinds at once")
    if is_two:
        fields.update(two)
        if _int(two.get("selector_top_k")) <= 0:
            return DrafterKind("dflash2", fields, "a DFlash2DraftModel without selector_top_k > 0 has no selector to reference")
        missing = [n for n in DFLASH2_FIELDS if n not in two]
        if missing:
            return DrafterKind("dflash2", fields, f"its config lacks {', '.join(missing)}")
        return DrafterKind("dflash2", fields)
    if is_spark:
        fields.update(spark)
        for name in eagle3:
            fields[name] = "..."
        head = spark.get("markov_head_type", "vanilla")
        if head != "vanilla":
            return DrafterKind("dspark", fields, f"its Markov head is {head!r}, and the reference models the vanilla head only")
        vocab = _int(config.get("vocab_size"))
        if _int(spark.get("draft_vocab_size")) and vocab and _int(spark["draft_vocab_size"]) < vocab:
            return DrafterKind("dspark", fields, "a reduced draft vocabulary (draft_vocab_size with a d2t map) is not modelled")
        if eagle3:
            return DrafterKind("dspark", fields, "an EAGLE3-schema export (bonus-anchor layout) is not modelled")
        return DrafterKind("dspark", fields)
    if other:
        fields["architectures"] = archs
        return DrafterKind(other[0], fields, "no reference here models how it drafts")
    return DrafterKind("dflash", fields)


def kind_of_folder(folder) -> DrafterKind | None:
    """The kind of the drafter in ``folder`` (its ``config.json``), or None where there is no readable config."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return kind_of(config) if isinstance(config, dict) else None


def sample_from_anchor(config: dict) -> bool:
    """DSpark's block layout: anchor-first (``block_size`` draft tokens) unless the config says otherwise."""
    value = _get(config, "sample_from_anchor")
    return True if value is None else bool(value) and str(value).lower() != "false"
