"""``patcher.lossless`` on every family as transformers builds it: served exactly, or refused on entry in one line.

The families and shapes are ``tests/lossless_families.py``'s: each family's own default layer pattern shrunk in
size, ddpatch's preset, NemotronH's real pattern. ``tools/lossless_matrix.py --write`` records, per transformers
release, what every shape does in every mode (tests/data/lossless_families/<release>.json), and the docs' tables
are written from that data. Here, on the installed release: the docs say what the data says, and every shape
still does what the data says: the probe's verdict (served, or refused with the recorded line) and, for a
served shape, prompt lookup (the target's cache cut back every round) exact over 32 new tokens; every mode on
the families of the reported bugs (slow).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import lossless_docs  # noqa: E402
import lossless_families as lf  # noqa: E402
import lossless_matrix as lm  # noqa: E402

RELEASE = lm.release()
DATA = lm.load(RELEASE)
#: the torch the data was recorded with (the README's pin). On another torch (the matrix's stack cells) a family may
#: go another way for reasons of torch's own (on torch 2.6, plain greedy generate() of two MoE families fails inside
#: transformers: "scatter(): Expected dtype int64 for index"; a refusal's measured figures differ): there the test
#: checks what holds on any torch, served exactly or refused on entry in one line, not the recorded verdict.
RECORDED_TORCH = "2.13"


def _same_torch() -> bool:
    import torch

    return torch.__version__.split("+")[0].rsplit(".", 1)[0] == RECORDED_TORCH
#: the mode run live on every served shape: prompt lookup cuts the target's cache back every round (all of MODES
#: are in the data; the slow test runs them all on the families of the reported bugs, test_lossless_probe.py a
#: stateful assistant on NemotronH)
LIVE_MODES = ("prompt-lookup",)
#: the families of the bugs this checks (issue 38): every mode, live
EVERY_MODE = ("nemotron_h", "zaya", "qwen3_5_text")


def test_the_data_covers_this_release_and_the_docs_say_what_it_says():
    assert DATA is not None, f"no recorded run for transformers {RELEASE}: PYTHONPATH=. python tools/lossless_matrix.py --write"
    stale = [str(path.relative_to(ROOT)) for path, text in lossless_docs.expected().items() if path.read_text() != text]
    assert not stale, f"{stale} differ from tests/data/lossless_families/: python3 tools/lossless_matrix.py --docs"


def test_the_docs_check_fails_when_a_cell_is_edited(tmp_path, monkeypatch):
    """The check above can fail: a copy of docs/models.md whose first verdict was edited by hand."""
    copy = tmp_path / "models.md"
    text = lossless_docs.MODELS_MD.read_text()
    copy.write_text(text.replace("**served, exact**", "served", 1))
    monkeypatch.setattr(lossless_docs, "MODELS_MD", copy)
    assert lossless_docs.expected()[copy] != copy.read_text()


SHIPPED = [mt for mt in lf.FAMILIES if lf.shipped(mt)]


#: a figure in a refusal's reason (``1.2``, ``1.9e+06x``, ``6e-07``): measured on this machine's CPU kernels, so it moves
#: between machines with the same torch (the noise floor is 6e-07 on one CPU and 7e-07 on another); the words stay
FIGURE = re.compile(r"\d+(\.\d+)?(e[+-]?\d+)?")


def _words(reason: str | None) -> str | None:
    return None if reason is None else FIGURE.sub("#", reason)


def _check_shape(model_type: str, shape: str, modes) -> None:
    from patcher import runtime as rt
    from patcher.lossless import lossless

    recorded = (DATA or {}).get(model_type, {}).get(shape)
    assert recorded is not None, f"{model_type}/{shape} is not in the data for transformers {RELEASE}"
    live = lm.run_shape(model_type, shape, modes=modes)
    same = _same_torch()
    if same or recorded["verdict"] not in ("served", "refused"):
        assert (live["verdict"], _words(live.get("reason"))) == (recorded["verdict"], _words(recorded.get("reason"))), live
    else:
        assert live["verdict"] in ("served", "refused"), live
    if live["verdict"] == "served":
        if same:
            assert live["modes"] == {m: recorded["modes"][m] for m in modes}
        assert all(lm.acceptable(v) for v in live["modes"].values()), live["modes"]
    elif live["verdict"] == "refused":
        model = lf.build(model_type, shape)
        with pytest.raises(rt.UnsupportedModelError) as err:
            with lossless(model):
                pass
        line = str(err.value)
        assert "\n" not in line and line.startswith("ddpatch: ") and (not same or _words(line) == _words(recorded["reason"]))
        assert "forward" not in vars(model), "a refused model was left with the recording forward"


@pytest.mark.parametrize("model_type", SHIPPED)
def test_every_family_is_served_exactly_or_refused_on_entry_in_one_line(model_type):
    for shape in lf.shapes(model_type):
        _check_shape(model_type, shape, LIVE_MODES)


@pytest.mark.heavy
@pytest.mark.parametrize("model_type", [mt for mt in EVERY_MODE if mt in SHIPPED])
def test_the_families_of_the_reported_bugs_are_exact_in_every_mode(model_type):
    for shape in lf.shapes(model_type):
        _check_shape(model_type, shape, lm.MODES)


def test_nemotron_h_is_built_with_blocks_before_its_first_attention_layer():
    """The shapes that crashed every generate() (issue 38): a MoE or MLP block ahead of the first attention layer."""
    default = lf.build("nemotron_h").config.layer_types
    real = lf.build("nemotron_h", "real").config.layer_types
    for types in (default, real):
        first = next(i for i, t in enumerate(types) if t in ("full_attention", "attention"))
        assert {"moe", "mlp"} & set(types[:first]), types
    assert "moe" in real and "mlp" in real
