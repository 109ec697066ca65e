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
* the outcome is the one recorded for it in ``tests/drift/README.md`` and ``variants.py``,
  exactly (one outcome per variant, and for a no-match exactly its sites), so that a change
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
from drift.variants import BY_NAME, LOSSLESS, NOT_A_DECODER, VARIANTS, VENDORED, NoMatch, Variant, all_parse


def only_variants(value: str) -> set[str]:
    """DDPATCH_DRIFT_ONLY=name,name runs only those variants (a quick loop while fixing one of
    them). A name that is no variant is an error, not a filter that silently skips everything."""
    names = {n.strip() for n in value.split(",") if n.strip()}
    unknown = sorted(names - set(BY_NAME))
    if unknown:
        raise pytest.UsageError(f"DDPATCH_DRIFT_ONLY names no variant {unknown}; variants: {', '.join(BY_NAME)}")
    return names


_ONLY = only_variants(os.environ.get("DDPATCH_DRIFT_ONLY", ""))
PARAMS = [pytest.param(v, id=v.name) for v in VARIANTS if not _ONLY or v.name in _ONLY]
#: the variants whose recorded outcome is lossless: only those have a patched tree to verify (a no-match
#: variant's apply writes nothing, which test_apply_outcome_is_the_recorded_one checks)
LOSSLESS_PARAMS = [p for p in PARAMS if p.values[0].lossless]


def _runs_here(variant) -> None:
    """Skip, saying why, a variant whose unpatched code needs a newer transformers than this one (it is
    still built, claimed and applied here: those are static; the matrix runs it on the releases it needs)."""
    import transformers

    from patcher.env import release

    if variant.min_transformers and release(transformers.__version__) < release(variant.min_transformers):
        pytest.skip(f"{variant.name} is code written for transformers {variant.min_transformers}+; this is {transformers.__version__}")


def _record(variant, **fields) -> None:
    """With DDPATCH_DRIFT_RECORD=FILE, append what happened to FILE (JSON lines) for the report table."""
    path = os.environ.get("DDPATCH_DRIFT_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"variant": variant.name, **fields}) + "\n")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """``made(variant) -> root``: each variant's unpatched copy, built once per module (per xdist
    worker) and only read from then on (claims, the unpatched decode, apply's source)."""
    base = tmp_path_factory.mktemp("drift-src")
    roots: dict[str, Path] = {}

    def make(variant):
        if variant.name not in roots:
            roots[variant.name] = variant.make(base / variant.name)
        return roots[variant.name]

    return make


@pytest.fixture(scope="module")
def applied(tmp_path_factory, made):
    """``applied(variant) -> (src, out, apply report)``, each variant applied once per module."""
    base = tmp_path_factory.mktemp("drift")
    done: dict[str, tuple[Path, Path, outcome.Report]] = {}

    def run(variant):
        if variant.name not in done:
            src = made(variant)
            out = base / variant.name / "out"
            done[variant.name] = (src, out, outcome.apply(src, out, base / "home"))
        return done[variant.name]

    run.home = base / "home"
    return run


# ---------------------------------------------------------------- the unpatched variant


@pytest.mark.parametrize("variant", PARAMS)
def test_variant_is_what_it_claims(variant, made):
    root = made(variant)
    all_parse(root)
    variant.claims(root, variant.original)


#: the variants with a decoder to run (not-a-decoder's no-match is checked by test_apply_outcome_is_the_recorded_one)
DECODER_PARAMS = [p for p in PARAMS if p.values[0].expected != NOT_A_DECODER]


@pytest.mark.parametrize("variant", DECODER_PARAMS)
def test_unpatched_variant_still_decodes_on_full_attention(variant, made):
    """On tiny-qwen3 (no recurrent state) the unpatched code is exact: a transform that broke it shows here."""
    _runs_here(variant)
    import transformers

    from patcher.env import release

    if variant.unpatched_min_transformers and release(transformers.__version__) < release(variant.unpatched_min_transformers):
        pytest.skip(f"{variant.name}'s unpatched code is written for transformers {variant.unpatched_min_transformers}+ "
                    f"(this is {transformers.__version__}); its patched tree runs here (test_apply_exit_0_means_lossless)")
    root = made(variant)
    runs = semantics.decode_unpatched(root, variant.base)
    for method, (expected, got) in runs.items():
        assert got == expected, f"{variant.name}: the unpatched {method} decoder no longer decodes greedily; the transform broke it"


# ---------------------------------------------------------------- what ddpatch does with it


@pytest.mark.parametrize("variant", PARAMS)
def test_apply_outcome_is_the_recorded_one(variant, applied):
    src, out, rep = applied(variant)
    _record(variant, apply=rep.exit_code, statuses=rep.statuses, no_match=rep.no_match_sites(), error=rep.error)
    if variant.expected == NOT_A_DECODER:  # one line, exit 2, no step's status: check says the same
        chk = outcome.check(src, applied.home)
        for run in (rep, chk):
            assert run.exit_code == 2 and (run.error or "").startswith("no DDTree/DFlash decoder found in"), run.raw[-800:]
            assert not run.statuses, "a tree with no decoder got step statuses"
        assert not out.exists() or not any(out.iterdir()), "apply wrote files into a tree that is not a decoder's"
        return
    assert rep.exit_code in (0, outcome.EXIT_NO_MATCH), f"apply exited {rep.exit_code}: {rep.error or rep.raw[-1500:]}"
    if rep.exit_code == 0:
        assert variant.lossless, (
            f"{variant.name}: apply exits 0 (and writes) where README.md records {variant.describe_expected()}: "
            f"statuses {rep.statuses}"
        )
        assert not rep.sites("no-match"), "apply exits 0 with a no-match site"
        for step, status in variant.statuses.items():
            assert rep.statuses.get(step) == status, f"{step}: {rep.statuses.get(step)}, expected {status}"
        return
    assert not variant.lossless, (
        f"{variant.name}: recorded lossless, but apply exits {rep.exit_code} with no-match {rep.no_match_sites()}"
        + (f", error {rep.error}" if rep.error else "")
    )
    # a no-match stops apply before anything is written, and check says the same, naming the site
    assert not out.exists() or not any(out.iterdir()), "apply wrote files although a step is no-match"
    chk = outcome.check(src, applied.home)
    _record(variant, check=chk.exit_code, check_no_match=chk.no_match_sites())
    assert chk.exit_code == rep.exit_code, f"apply exits {rep.exit_code} but check exits {chk.exit_code}: {chk.error or chk.statuses}"
    assert not chk.error and not rep.error, f"an error line instead of a no-match: {chk.error or rep.error}"
    sites = chk.sites("no-match")
    for site in sites:
        assert outcome.names_site(site), f"a no-match that names no site: {site}"
    assert chk.no_match_sites() == rep.no_match_sites(), "check and apply disagree on the no-match sites"
    problems = outcome.unexpected_no_matches(sites, variant.expected)
    assert not problems, f"{variant.name}: expected exactly {variant.describe_expected()}; {'; '.join(problems)}"

@pytest.mark.heavy
@pytest.mark.parametrize("variant", LOSSLESS_PARAMS)
def test_apply_exit_0_means_lossless(variant, applied):
    _runs_here(variant)
    src, out, rep = applied(variant)
    assert rep.exit_code == 0, f"{variant.name} is recorded lossless, but apply exited {rep.exit_code}: nothing to verify"
    result = outcome.verify(out)
    _record(variant, verify=result.describe())
    assert result.passed, f"FALSE GREEN: apply exited 0 with statuses {rep.statuses}, but verify: {result.describe()}"
    missing = outcome.required_lossless(variant.base, variant.methods) - result.lossless
    assert not missing, f"verify passed without checking {sorted(missing)}: a pass that proves nothing"
    # lossless only means something where blocks were accepted in part (the rollback had work to do)
    unexercised = outcome.required_lossless(variant.base, variant.methods) - result.partial
    assert not unexercised, f"no partial acceptance in {sorted(unexercised)}: the rollback was never exercised there"


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

    from patcher.verify.models.presets import build_target, draft_config
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


# ---------------------------------------------------------------- the table itself is exact


def test_a_no_match_expectation_is_exact():
    """What the outcome test relies on: a no-match matches its own site only."""
    site = {"step": "target-cache-config", "path": "dflash/model.py", "function": "dflash_generate"}
    assert outcome.matches(site, NoMatch("target-cache-config", "dflash/model.py", "dflash_generate"))
    assert outcome.matches(site, NoMatch("target-cache-config", "model.py", "dflash_generate"))
    for wrong in (NoMatch("verify-forward", "dflash/model.py", "dflash_generate"),
                  NoMatch("target-cache-config", "dflash/model.py", "_new_cache"),
                  NoMatch("target-cache-config", "el.py", "dflash_generate"),
                  NoMatch("target-cache-config", None, "dflash_generate")):
        assert not outcome.matches(site, wrong), wrong
    gone = {"step": "tree-commit", "path": None, "function": "compact_dynamic_cache"}
    assert outcome.matches(gone, NoMatch("tree-commit", None, "compact_dynamic_cache"))
    with pytest.raises(ValueError):
        NoMatch("tree-commit", "", "compact_dynamic_cache")  # "" would be a suffix of every path
    expected = (NoMatch("target-cache-config", "dflash/model.py", "dflash_generate"),)
    assert outcome.unexpected_no_matches([site], expected) == []
    extra = {"step": "verify-forward", "path": "dflash/model.py", "function": "dflash_generate"}
    assert outcome.unexpected_no_matches([site, extra], expected) == ["extra: verify-forward at dflash/model.py:dflash_generate"]
    assert outcome.unexpected_no_matches([], expected) == [f"missing: {expected[0]}"]


def test_every_variant_has_exactly_one_outcome():
    for v in VARIANTS:
        assert v.lossless or v.expected == NOT_A_DECODER or all(isinstance(e, NoMatch) for e in v.expected), v.name
    with pytest.raises(ValueError, match="one outcome"):
        Variant("both", "x", "dflash", lambda root: None, lambda root, original: None,
                expected=(LOSSLESS, NoMatch("target-cache-config", "dflash/model.py", "dflash_generate")))


def test_a_typo_in_drift_only_is_an_error():
    with pytest.raises(pytest.UsageError, match="names no variant"):
        only_variants("native-5x,native5x")
    assert only_variants("native-5x, seed-sed") == {"native-5x", "seed-sed"} and only_variants("") == set()


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
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[-2].strip()
            for line in readme.splitlines() if line.startswith("| `")}
    missing = {v.name for v in VARIANTS} - set(rows)
    assert not missing, f"tests/drift/README.md has no expected-outcome row for {sorted(missing)}"
    for v in VARIANTS:  # the README's last column says the same outcome as variants.py
        said = rows[v.name]
        if v.lossless:
            assert said.startswith(("lossless", "as `native-5x`")), f"{v.name}: README says {said!r}"
        elif v.expected == NOT_A_DECODER:
            assert said.startswith(NOT_A_DECODER), f"{v.name}: README says {said!r}"
        else:
            assert said.startswith("no-match") and " or " not in said, f"{v.name}: README says {said!r}"
            for e in v.expected:
                assert f"{e.step}" in said and f"{e.function}" in said, f"{v.name}: README's {said!r} lacks {e}"
