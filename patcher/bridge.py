"""Where the recipe engine and the verifier meet, so that neither imports the other and the API only calls.

Each way across, once:

* engine <- verify: the decoders ``verify`` finds, for check's ``decoders:`` line (``decoders_verify_finds``);
  every engine run of the API and of this module hands it to the pipeline (``engine_report``);
* verify <- engine: the default recipe's ``check`` of a tree (``check_tree``), which a failing row's hint
  (``settle_hints``) and ``verify --upstream-tests``' steps per file (``steps_by_file``) are judged by;
  the engine's survey before a verifier starts (``require_decoder``), and the apply journal that holds an
  in-place apply's unpatched tree (``unpatched``).

The engine and the verifier are imported inside the functions, as the API imports them: importing this
module stays cheap (``ddpatch --help`` imports no libcst and no torch).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

from .errors import INPUT_ERRORS, EngineError, VerifyError
from .results import Outcome, Report

#: the recipe ``check`` runs when none is named (``api.DEFAULT_RECIPE`` is this one)
DEFAULT_RECIPE = "qwen3_6-gdn"


# ----------------------------------------------------------------------------- engine <- verify
def decoders_verify_finds(root: Path, exclude: tuple[str, ...]) -> dict[str, str]:
    """File -> the decoders ``verify`` finds in it (``patcher.verify.subjects.decoders``, stdlib ``ast``; nothing is imported from
    the tree): the engine may not import the verifier, so the bridge hands this to it, and check's ``decoders:`` line names
    what verify runs."""
    from .verify.subjects.decoders import inventory

    out: dict[str, list[str]] = {}
    for d in inventory(root, tuple(exclude)).decoders:
        out.setdefault(d.file, []).append(f"`{d.qualname}`" + (f" (through `{d.loop}`)" if d.loop else ""))
    return {file: "verify finds " + ", ".join(names) for file, names in out.items()}


def engine_report(path: str | Path, recipe, *, jobs: int = 0, survey: str = "require", **options) -> Report:
    """The recipe ``recipe`` (a loaded ``Recipe``) run over ``path`` by the engine's pipeline, with verify's decoders at hand;
    nothing is written. ``jobs=0``: one per CPU; ``options``: ``run_recipe``'s (upstream, progress, exclude, include_vendored)."""
    from .engine.pipeline import run_recipe

    return run_recipe(recipe, Path(path), jobs=jobs or os.cpu_count() or 1, survey=survey, list_decoders=decoders_verify_finds,
                      **options)


def require_code(report: Report) -> None:
    """A tree with none of the recipe's code is bad input: say so in one line."""
    from .engine.survey import looked_for

    if report.upstream is not None or report.changed or report.skipped or report.decoders:
        return
    if any(site for step in report.steps for site in step.sites):
        return
    family = report.recipe.decoders or report.recipe.name
    raise EngineError(f"no {family} decoder found in {report.root} (looked for {looked_for(report.recipe)}), and no step found "
                      "a site; pass --upstream NAME to check it as that layout")


# ----------------------------------------------------------------------------- verify <- engine
def check_tree(tree: Path, exclude: Iterable[str] = (), jobs: int = 0) -> Report:
    """The default recipe's ``check`` of ``tree``, as ``api.check(tree, exclude=..., jobs=...)`` gives it: each step's sites,
    a site ``apply`` would rewrite ``pending``. Bad input raises one of ``INPUT_ERRORS``."""
    from .engine.classify import mark_pending
    from .engine.recipe import load_recipe

    report = engine_report(tree, load_recipe(DEFAULT_RECIPE), jobs=jobs, exclude=tuple(exclude or ()))
    require_code(report)
    mark_pending(report)
    return report


#: steps whose fix lies where a value is made, not where it fails (a cache built without the target's config fails in
#: the forward it is handed to): a hint names them where they touched the failing function; the others, the line
DATA_FLOW_STEPS = ("target-cache-config", "crop-compat", "verify-forward", "tree-commit", "draft-sliding-window")


def settle_hints(outcome: Outcome, tree: Path, exclude=()) -> None:
    """A failing row's hint names a recipe step only where that step touched the failing code: a line the error's
    frames in the tree passed through (for a data-flow step, their function), whether the site is written or pending.
    An error in code no step wrote (a drafter's own config field, a fork's helper) is not blamed on the step whose
    words its message happens to contain."""
    rows = [r for r in outcome.checks if r.get("hint") and r.get("tree_frames")]
    rows += [r["then"] for r in outcome.checks if isinstance(r.get("then"), dict) and r["then"].get("hint") and r["then"].get("tree_frames")]
    if not rows or not tree.is_dir():
        return
    try:
        report = check_tree(tree, exclude)
    except INPUT_ERRORS:
        return
    steps = {s.spec.id: s for s in report.steps}
    for row in rows:
        step = steps.get(row["hint"].split(" ", 1)[0])
        if step is None:  # not a step's name ("none: the tree imports ddpatch"): it stands
            continue
        if step.spec.id in DATA_FLOW_STEPS:
            here = {(f, fn) for f, _, fn in row["tree_frames"]}
            touched = {(s.path, (s.function or "<module>").rsplit(".", 1)[-1]) for s in step.sites}
        else:
            here = {(f, line) for f, line, _ in row["tree_frames"]}
            touched = {(s.path, s.line) for s in step.sites}
        if here & touched:
            continue
        where = ", ".join(f"{f}:{line} in {fn}" for f, line, fn in row["tree_frames"][-2:])
        row["hint"] = None
        row["not_a_step"] = f"no recipe step touched {where}: the tree's own code (or what it was given) fails there"
        row["evidence"] = f"{row.get('evidence', '')}; {row['not_a_step']}".lstrip("; ")


def require_decoder(path: str | Path, exclude: Iterable[str] = ()) -> dict[str, tuple[str, str]]:
    """Before a verifier starts: a tree with none of the default recipe's decoders is refused in the one line check gives
    (a serving engine named as such), as check, diff and apply refuse it; ``--entry`` names decoders by hand instead.
    Returns the files that are not torch code (file -> (framework, module)): verify leaves them out, as apply does."""
    from .engine.files import defined_functions
    from .engine.pipeline import discover
    from .engine.recipe import load_recipe
    from .engine.survey import NotADecoderTree, refuse, survey

    recipe = load_recipe(DEFAULT_RECIPE)
    root = Path(path).resolve()
    paths, _, _ = discover(root, recipe, exclude=tuple(exclude))
    texts, defined = {}, set()
    for p in paths:
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        texts[p.relative_to(root).as_posix()] = text
        defined.update(defined_functions(text))
    found = survey(texts, recipe, recipe.detect_upstream(defined))
    if not found.decoders:
        try:
            refuse(found, recipe, root)
        except NotADecoderTree as exc:
            raise VerifyError(str(exc)) from None
    return dict(found.not_torch)


# ----------------------------------------------------------------------------- verify --upstream-tests
def unpatched(path: Path, original: str | Path | None):
    """The tree ``verify --upstream-tests`` runs the tests on before the patch: ``--original``, else ``path`` with the
    original bytes its latest in-place apply journalled. A tree written by ``apply --out`` has no journal: bad input."""
    import base64
    import json

    from .engine import journal
    from .verify.subjects.upstream_tests import Unpatched

    if original is not None:
        source = Path(original).expanduser().resolve()
        if not source.is_dir():
            raise VerifyError(f"--original {original} is not a directory")
        if path.is_dir() and source == path.resolve():
            raise VerifyError(f"--original {original} is the patched tree itself; give the unpatched one")
        return Unpatched(source, None, str(source))
    entry = journal.latest(path.resolve()) if path.is_dir() else None
    if entry is None:
        raise VerifyError(f"--upstream-tests: no in-place apply of {path} is on record (journals under {journal.home() / 'journals'}), "
                          f"so its unpatched tree is unknown; for a tree written by `ddpatch apply SRC --out {path}`, pass --original SRC")
    files = json.loads(entry.read_text())["files"]
    bad = [f["path"] for f in files if Path(f["path"]).is_absolute() or ".." in Path(f["path"]).parts]
    if bad:
        raise VerifyError(f"--upstream-tests: the journal {entry} names a file outside the tree: {bad[0]!r}")
    return Unpatched(path.resolve(), {f["path"]: None if f["original"] is None else base64.b64decode(f["original"]) for f in files},
                     f"the in-place apply's journal {entry.name}")


def steps_by_file(before: Path, after: Path) -> dict[str, list[str]]:
    """Per file the recipe rewrites in ``before``, the steps with a site there (``check_tree``), narrowed to those the patched
    file's provenance line names when it names any of them (an apply with --select/--ignore)."""
    from .engine.files import read_provenance
    from .results import APPLIED, PENDING

    try:
        report = check_tree(before, jobs=1)
    except INPUT_ERRORS:
        return {}
    out: dict[str, list[str]] = {}
    for step in report.steps:
        for site in step.sites:
            if site.status in (APPLIED, PENDING) and step.spec.id not in out.setdefault(site.path, []):
                out[site.path].append(step.spec.id)
    for rel, steps in out.items():
        named = read_provenance((after / rel).read_text(errors="replace")) if (after / rel).is_file() else set()
        out[rel] = [s for s in steps if s in named] or steps
    return out


def upstream_tests_row(tree: Path, before, timeout: float, progress: Callable[[dict], None] | None = None) -> dict:
    """``verify --upstream-tests``' row: the tree's own tests on ``before`` (``unpatched``) and on ``tree``, a test that
    turned red named by the steps that wrote its file (``steps_by_file``)."""
    from .verify.subjects.upstream_tests import upstream_tests_row as row

    return row(tree, before, steps_by_file, timeout, progress)
