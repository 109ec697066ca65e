"""The drift suite: code that has drifted the way real forks drift must end lossless or loudly no-match.

Every variant in ``tests/drift/variants.py`` is a copy of ``vendored/ddtree`` or
``vendored/dflash`` rewritten at test time by small code transformations (reformatting,
renames, aliased imports, helpers, the seed's sed, annotations, DFlash's 5.x-native style).
For each variant:

* the unpatched copy is what it claims to be, and still decodes the target's greedy tokens
  on a pure-attention model (so the transform kept what the code does);
* ``apply`` either exits 0, and then ``verify`` must pass on tiny-qwen3_5 and
  tiny-qwen3_5-vlm (**apply exits 0 => lossless**: a green status that ships wrong tokens is
  the failure this suite exists for), or exits 2, and then ``check`` exits 2 with a no-match
  that names its file and function;
* the outcome is the one recorded for it in ``tests/drift/README.md``, so that a change
  either way (a new false no-match, or a no-match that became silent) is caught.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from drift import outcome, semantics
from drift import transforms as t
from drift.variants import BY_NAME, LOSSLESS, VARIANTS, VENDORED, all_parse

# DDPATCH_DRIFT_ONLY=name,name runs only those variants (a quick loop while fixing one of them)
_ONLY = {n for n in os.environ.get("DDPATCH_DRIFT_ONLY", "").split(",") if n}
PARAMS = [pytest.param(v, id=v.name) for v in VARIANTS if not _ONLY or v.name in _ONLY]


def _record(variant, **fields) -> None:
    """With DDPATCH_DRIFT_RECORD=FILE, append what happened to FILE (JSON lines) for the report table."""
    path = os.environ.get("DDPATCH_DRIFT_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"variant": variant.name, **fields}) + "\n")


@pytest.fixture(scope="module")
def applied(tmp_path_factory):
    """``applied(variant) -> (src, out, apply report)``, each variant built and applied once per module."""
    base = tmp_path_factory.mktemp("drift")
    done: dict[str, tuple[Path, Path, outcome.Report]] = {}

    def run(variant):
        if variant.name not in done:
            src = variant.make(base / variant.name / "src")
            out = base / variant.name / "out"
            done[variant.name] = (src, out, outcome.apply(src, out, base / "home"))
        return done[variant.name]

    run.home = base / "home"
    return run


# ---------------------------------------------------------------- the unpatched variant


@pytest.mark.parametrize("variant", PARAMS)
def test_variant_is_what_it_claims(variant, tmp_path):
    root = variant.make(tmp_path / variant.name)
    all_parse(root)
    variant.claims(root, variant.original)


@pytest.mark.parametrize("variant", PARAMS)
def test_unpatched_variant_still_decodes_on_full_attention(variant, tmp_path):
    """On tiny-qwen3 (no recurrent state) the unpatched code is exact: a transform that broke it shows here."""
    root = variant.make(tmp_path / variant.name)
    runs = semantics.decode_unpatched(root, variant.base)
    for method, (expected, got) in runs.items():
        assert got == expected, f"{variant.name}: the unpatched {method} decoder no longer decodes greedily; the transform broke it"


# ---------------------------------------------------------------- what ddpatch does with it


@pytest.mark.parametrize("variant", PARAMS)
def test_apply_outcome_is_the_recorded_one(variant, applied):
    src, out, rep = applied(variant)
    _record(variant, apply=rep.exit_code, statuses=rep.statuses, no_match=rep.no_match_sites(), error=rep.error)
    assert rep.exit_code in (0, 2), f"apply exited {rep.exit_code}: {rep.error or rep.raw[-1500:]}"
    if rep.exit_code == 0:
        assert LOSSLESS in variant.expected, (
            f"apply exits 0 where README.md records {[str(e) for e in variant.expected]}: statuses {rep.statuses}"
        )
        for step, status in variant.statuses.items():
            assert rep.statuses.get(step) == status, f"{step}: {rep.statuses.get(step)}, expected {status}"
        return
    # a no-match stops apply before anything is written, and check says the same, naming the site
    assert not out.exists() or not any(out.iterdir()), "apply wrote files although a step is no-match"
    chk = outcome.check(src, applied.home)
    _record(variant, check=chk.exit_code, check_no_match=chk.no_match_sites())
    assert chk.exit_code == 2, f"apply exits 2 but check exits {chk.exit_code}: {chk.error or chk.statuses}"
    sites = chk.sites("no-match")
    assert sites or chk.error, "check exits 2 without a no-match or an error line"
    for site in sites:
        assert outcome.names_site(site), f"a no-match that names no site: {site}"
    wanted = [e for e in variant.expected if e != LOSSLESS]
    assert any(outcome.matches(s, e) for s in sites for e in wanted), (
        f"{variant.name}: expected {[str(e) for e in variant.expected]}, got no-match {chk.no_match_sites()}"
        + (f", error {chk.error}" if chk.error else "")
    )


@pytest.mark.slow
@pytest.mark.parametrize("variant", PARAMS)
def test_apply_exit_0_means_lossless(variant, applied):
    src, out, rep = applied(variant)
    if rep.exit_code != 0:
        pytest.skip(f"apply exited {rep.exit_code}: nothing was written, nothing to verify")
    result = outcome.verify(out)
    _record(variant, verify=result.describe())
    assert result.passed, f"FALSE GREEN: apply exited 0 with statuses {rep.statuses}, but verify: {result.describe()}"
    missing = outcome.required_lossless(variant.base) - result.lossless
    assert not missing, f"verify passed without checking {sorted(missing)}: a pass that proves nothing"


# ---------------------------------------------------------------- the 5.x-native draft's own masks


WINDOW = 5
BLOCK = 4


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_native_draft_masks_equal_draft_forward_windowing(impl, tmp_path):
    """The 5.x-native draft builds its own per-layer-type masks over a config-built cache that
    records its past; round after round (past the window, with the native crops) it must
    equal the vendored draft run through ``draft_forward`` on a bare cache: windowed layers
    see ``q - k < window``, full layers everything."""
    from transformers import DynamicCache

    from patcher.verify.presets import build_target, draft_config
    from patcher.runtime import draft_forward

    native_cls = semantics.load_draft_class(BY_NAME["native-5x"].make(tmp_path / "native"), "dflash")
    vendored_cls = semantics.load_draft_class(VENDORED / "dflash", "dflash")
    target = build_target("tiny-qwen3", seed=0)
    cfg = draft_config(target, vendored_cls.config_class, num_layers=2, block_size=BLOCK, sliding_window=WINDOW)
    torch.manual_seed(0)
    reference = vendored_cls._from_config(cfg, attn_implementation=impl).eval()
    native = native_cls._from_config(cfg, attn_implementation=impl).eval()
    native.load_state_dict(reference.state_dict())
    assert [layer.self_attn.layer_type for layer in native.layers] == ["sliding_attention", "full_attention"]

    width = len(reference.target_layer_ids) * cfg.hidden_size
    gen = torch.Generator().manual_seed(1)
    ref_cache, plain_cache = DynamicCache(), DynamicCache()
    native_cache = DynamicCache(config=native.config)
    native_cache.activate_past_recording()
    draft_from, start, unmasked_differs = 0, 6, False
    with torch.inference_mode():
        for accepted in (1, 4, 2, 3, 4, 1, 2, 4):
            ctx = torch.randn(1, start - draft_from, width, generator=gen)
            noise = torch.randn(1, BLOCK, cfg.hidden_size, generator=gen)
            kw = dict(target_hidden=ctx, noise_embedding=noise, position_ids=torch.arange(draft_from, start + BLOCK)[None], use_cache=True)
            want = draft_forward(reference, past_key_values=ref_cache, **kw)
            got = native(past_key_values=native_cache, **kw)
            plain = reference(past_key_values=plain_cache, **kw)
            assert torch.allclose(got, want, atol=1e-5), f"round at start={start}: the native draft's masks differ from draft_forward"
            unmasked_differs |= not torch.allclose(plain, want, atol=1e-4)
            ref_cache.crop(-BLOCK)
            plain_cache.crop(-BLOCK)
            native_cache.crop(start - native_cache.get_seq_length())
            draft_from, start = start, start + accepted
    assert start > 2 * WINDOW and native_cache.layers[0].is_sliding
    assert unmasked_differs, "the context outgrew the window yet an unmasked draft gives the same output: the test cannot fail"


# ---------------------------------------------------------------- the transforms fail loudly


def test_a_transform_whose_anchor_is_gone_fails_loudly(tmp_path):
    root = tmp_path / "ddtree"
    shutil.copytree(VENDORED / "ddtree", root, ignore=shutil.ignore_patterns("__pycache__"))
    text = (root / "dflash.py").read_text()
    (root / "dflash.py").write_text(text.replace("DynamicCache()", "DynamicCache( )"))
    with pytest.raises(t.DriftAnchorError, match="occurs 0 times"):
        BY_NAME["seed-sed"].build(root)
    with pytest.raises(t.DriftAnchorError, match="no function"):
        t.rename(root, "dflash.py", ["no_such_function"], {"target": "model"})
    with pytest.raises(t.DriftAnchorError, match="made 0 edits"):
        t.transform(root, "model/utils.py", lambda: t.RenameNames(["sample"], {"nothing": "else"}))


def test_readme_records_every_variant():
    readme = (Path(__file__).parent / "drift" / "README.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in readme.splitlines() if line.startswith("| `")}
    missing = {v.name for v in VARIANTS} - rows
    assert not missing, f"tests/drift/README.md has no expected-outcome row for {sorted(missing)}"
