"""The Python API: what each ``ddpatch`` command does, as a function that returns a plain result
object (``patcher.results``). The CLI is a thin layer over it; so can a notebook or a CI script be.

    from patcher import api
    from patcher.report.diff import diff_text

    report = api.check("upstream/", recipe="qwen3_6-gdn")   # a Report; nothing is written
    print([(s.spec.id, s.status) for s in report.steps])
    print(diff_text(report))
    result = api.apply("upstream/", recipe="qwen3_6-gdn", out="patched/")
    outcome = api.verify("patched/", presets=["tiny-qwen3_5"])
    print(outcome.passed)

Bad input raises one of ``INPUT_ERRORS`` with a one-line message; ``verify`` raises
``VerifyError`` (bad input, a timeout) or ``VerifierCrash`` (ddpatch's own failure), never a
verdict; a failed check is ``outcome.passed == False``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

from . import shipped
from .ci import BISECT_THRESHOLD, HUNK_LINES
from .engine.recipe import Recipe, builtin_recipes, load_recipe
from .errors import INPUT_ERRORS, CIError, EngineError, JournalError, RecipeError, RefereeError, VerifierCrash, VerifyError
from .results import ApplyResult, CIResult, Outcome, Refereed, Report, RevertResult, StepDoc
from .verify.models.presets import PRESETS

# The engine (and libcst), the verifier's runner and ci's history are imported by the functions
# that run them, so that importing this module, and ``ddpatch --help`` above it, stays cheap.

DEFAULT_RECIPE = "qwen3_6-gdn"

__all__ = [
    "BISECT_THRESHOLD", "CIError", "DEFAULT_RECIPE", "EngineError", "HUNK_LINES", "INPUT_ERRORS", "JournalError", "PRESETS",
    "RecipeError", "VerifierCrash", "VerifyError", "apply", "check", "ci", "diff", "env", "lossy_steps", "patch_builtin",
    "recipe_docs", "recipes", "revert", "run", "verify", "workflow_template",
]


# ----------------------------------------------------------------------------- recipes
def recipes() -> list[Recipe]:
    """The built-in recipes, by name."""
    return [load_recipe(name) for name in sorted(builtin_recipes())]


def recipe_docs(name: str) -> tuple[Recipe, list[StepDoc]]:
    """A recipe and, per step, what its codemod matches and writes, with its examples."""
    from .engine.codemods import CODEMODS

    r = load_recipe(name)
    docs = []
    for s in r.steps:
        cls = CODEMODS[s.codemod]
        params = {**cls.PARAMS, **s.params}
        docs.append(StepDoc(s, cls.DESCRIPTION, params, [e.clean() for e in cls.EXAMPLES if e.fits(params)]))
    return r, docs


def select_steps(recipe: Recipe, select: Iterable[str] | str | None = None, ignore: Iterable[str] | str | None = None) -> Recipe:
    """``recipe`` with only the steps ``select`` names, less those ``ignore`` names (ids, or comma-separated)."""
    ids = {s.id for s in recipe.steps}
    chosen = list(recipe.steps)
    for flag, value in (("--select", select), ("--ignore", ignore)):
        if value is not None:
            names = {v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()}
            if not names:
                raise RecipeError(f"{flag}: no step id given; known: {', '.join(s.id for s in recipe.steps)}")
            unknown = names - ids
            if unknown:
                raise RecipeError(f"{flag}: unknown step(s) {', '.join(sorted(unknown))}; known: {', '.join(s.id for s in recipe.steps)}")
            chosen = [s for s in chosen if (s.id in names) == (flag == "--select")]
    if not chosen:
        raise RecipeError("no steps left to run after --select/--ignore")
    return replace(recipe, steps=tuple(chosen))


def lossy_steps(report: Report, recipe: Recipe) -> list[str]:
    """The recipe's lossless steps that apply to the report's tree (a decoder layout the recipe detected)
    but were left out by --select/--ignore."""
    if report.upstream is None:
        return []
    ran = {s.spec.id for s in report.steps} | {s.id for s in report.recipe.steps}
    specs = {s.id: s for s in recipe.steps}
    return [sid for sid in recipe.lossless if sid not in ran and specs[sid].applies_to(report.upstream)]


# ----------------------------------------------------------------------------- apply / diff / check
def run(path: str | Path, recipe: str | Recipe = DEFAULT_RECIPE, select=None, ignore=None, upstream: str | None = None,
        jobs: int = 0, progress: Callable[[int, int], None] | None = None, exclude: Iterable[str] = (),
        include_vendored: bool = False) -> Report:
    """Run a recipe over ``path`` and return its report; nothing is written. ``jobs=0``: one per CPU.

    ``exclude``: ``--exclude`` patterns (files and folders left out, said in the report). A tree with none
    of the recipe's decoders is refused in one line (``engine.survey``), unless ``select`` or ``upstream``
    says what to run on it. ``include_vendored``: also check the folders that look like copies of
    third-party packages; by default they are listed in ``Report.vendored`` and not parsed (docs/usage.md).
    """
    from .engine.pipeline import run_recipe

    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    survey = "report" if select is not None else "require"
    recipe = select_steps(recipe, select, ignore)
    return run_recipe(recipe, Path(path), upstream=upstream, jobs=jobs or os.cpu_count() or 1, progress=progress,
                      exclude=tuple(exclude or ()), survey=survey, include_vendored=include_vendored, list_decoders=decoders_verify_finds)


def decoders_verify_finds(root: Path, exclude: tuple[str, ...]) -> dict[str, str]:
    """File -> the decoders ``verify`` finds in it (``patcher.verify.subjects.decoders``, stdlib ``ast``; nothing is imported from
    the tree): the engine may not import the verifier, so the API hands this to it, and check's ``decoders:`` line names
    what verify runs."""
    from .verify.subjects.decoders import inventory

    out: dict[str, list[str]] = {}
    for d in inventory(root, tuple(exclude)).decoders:
        out.setdefault(d.file, []).append(f"`{d.qualname}`" + (f" (through `{d.loop}`)" if d.loop else ""))
    return {file: "verify finds " + ", ".join(names) for file, names in out.items()}


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


def check(path: str | Path, recipe: str | Recipe = DEFAULT_RECIPE, **options) -> Report:
    """Each step's status; a site ``apply`` would rewrite is ``pending``. Nothing is written."""
    from .engine.classify import mark_pending

    report = run(path, recipe, **options)
    require_code(report)
    mark_pending(report)
    return report


def diff(path: str | Path, recipe: str | Recipe = DEFAULT_RECIPE, **options) -> Report:
    """The report ``apply`` would write (``patcher.report.diff.diff_text`` gives its unified diff). Nothing is written."""
    return check(path, recipe, **options)


def apply(path: str | Path, recipe: str | Recipe = DEFAULT_RECIPE, out: str | Path | None = None, force: bool = False,
          allow_partial: bool = False, allow_lossy: bool = True, **options) -> ApplyResult:
    """Rewrite ``path`` in place (journalled, atomic), or a copy of it under ``out``.

    A no-match step or a skipped file blocks every write unless ``allow_partial``; the
    report's ``applied`` sites are then ``pending``. So does a selection that leaves out a
    lossless step (``lossy_steps``) unless ``allow_lossy``.
    """
    from .engine import journal
    from .engine.classify import mark_pending
    from .engine.write import refuse_unwritable, write_report

    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    report = run(path, recipe, **options)
    require_code(report)
    lossy = lossy_steps(report, recipe)
    if out is None:
        refuse_unwritable(report)  # a read-only file is skipped, like one that cannot be parsed
    blocked = bool(report.no_match or report.skipped or report.blocking_imports) and not allow_partial or bool(lossy and not allow_lossy)
    written: list[str] = []
    dest = None
    if blocked:
        mark_pending(report)
    else:
        base = report.root if report.root.is_dir() else report.root.parent
        if out is not None:
            dest = prepare_out(report.root, Path(out), force)
        elif report.changed:
            journal.record(base, {f.path: f.encoded() for f in report.changed}, report.recipe.label)
        written = write_report(report, dest)
    return ApplyResult(report, written, dest, blocked, lossy)


def prepare_out(root: Path, out: Path, force: bool, hint: str = "use --force to write into it") -> Path:
    """A copy of ``root`` at ``out`` (outside it; new or empty unless ``force``) to patch instead of ``root``."""
    out = out.resolve()
    if out == root or out.is_relative_to(root) and root.is_dir():
        raise ValueError(f"--out {out} must be outside the tree being patched")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} exists and is not empty ({hint})")
    if root.is_dir():
        shutil.copytree(root, out, symlinks=True, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    else:
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root, out / root.name)
    return out


def revert(path: str | Path, force: bool = False) -> RevertResult:
    """Undo the latest in-place apply on ``path``, byte for byte; returns the files restored (and, with
    ``force``, the later edits it overwrote, each kept as ``<file>.orig``)."""
    from .engine import journal

    path = Path(path)
    if not path.exists():
        raise ValueError(f"path does not exist: {path}")
    return journal.revert(path.resolve(), force=force)


def vendored_root() -> Path:
    """The built-in upstream-shaped code (``vendored/``), of the checkout or of the install (``patcher.shipped``)."""
    root = shipped("vendored")
    if not root.is_dir():
        raise ValueError(f"the built-in upstream-shaped code is missing from this install ({root}); reinstall ddpatch")
    return root


def patch_builtin(upstream: str, dest: Path) -> Report:
    """Copy the built-in ``vendored/<upstream>`` tree to ``dest`` (new or empty) and patch it there."""
    from .engine.write import write_report

    source = vendored_root() / upstream
    dest = prepare_out(source, Path(dest), force=False, hint="give --out a new or empty folder")
    report = run(dest, DEFAULT_RECIPE, jobs=1)
    write_report(report, dest)
    return report


# ----------------------------------------------------------------------------- verify
def env(with_device: bool = True) -> dict:
    """Python, torch, transformers, accelerate, libcst and the optional kernels, each with whether it is
    inside ddpatch's tested range, and the device (which imports torch). See ``patcher.env``."""
    from .env import environment

    return environment(with_device=with_device)


def workflow_template() -> str:
    """A GitHub Actions workflow that runs ``ddpatch ci`` on a schedule."""
    from .ci.workflow import workflow_template

    return workflow_template()


def verify(path: str | Path, timeout: float = 600.0, progress: Callable[[dict], None] | None = None, upstream_tests: bool = False,
           original: str | Path | None = None, prompts_file: str | Path | None = None, **options) -> Outcome:
    """Run the tree's own decoders in a child process and judge them (options: the keys of ``patcher.verify.process.runner.DEFAULTS``,
    ``target``/``draft`` folders, ``scripted_draft``, ``temperature``, ...). ``upstream_tests``: also run the tree's own
    tests before and after the patch (the unpatched tree: ``original``, else the in-place apply's journal).
    ``prompts_file``: decode the models with a tokenizer on these prompts (``patcher.verify.models.prompts``); the
    first ``prompts`` of them, else its default."""
    from .verify.process.runner import run_verify

    unpatched = _unpatched(Path(path), original) if upstream_tests or original is not None else None  # bad input: before the run
    if prompts_file is not None:
        options.update(_prompts_options(prompts_file, options))
    if Path(path).is_dir() and not options.get("entries"):  # --entry names the decoders: the runner checks them
        not_torch = require_decoder(path, options.get("exclude") or ())
        if not_torch:  # an MLX port beside the torch decoders: never run as a torch decoder
            options["not_torch"] = {rel: f"{framework} code, not torch (imports {module})" for rel, (framework, module) in not_torch.items()}
    outcome = run_verify(Path(path), timeout=timeout, progress=progress, **options)
    settle_hints(outcome, Path(path), options.get("exclude") or ())
    if unpatched is not None:
        from .verify.subjects.upstream_tests import upstream_tests_row

        outcome.result.setdefault("checks", []).append(upstream_tests_row(Path(path), unpatched, _steps_by_file, timeout, progress))
    return outcome


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
        report = check(tree, exclude=exclude)
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


def _prompts_options(prompts_file: str | Path, options: dict) -> dict:
    """``prompt_records`` and ``prompts_source`` for the child, read and checked here: bad input is one line before any
    child starts. A random preset decodes random token ids (it has no tokenizer): a file needs a model that reads text."""
    from .verify.models.prompts import PromptsFileError, verify_options
    from .verify.models.trained import FOLDER_PRESETS

    presets = options.get("presets") or ()
    if not options.get("target") and presets and not any(p in FOLDER_PRESETS for p in presets):
        raise VerifyError(f"--prompts-file needs a model that reads text: --target DIR, or the {', '.join(FOLDER_PRESETS)} preset "
                          f"(a default verify runs it); {', '.join(presets)} "
                          f"{'decode' if len(presets) > 1 else 'decodes'} random token ids (no tokenizer)")
    try:
        return verify_options(prompts_file, options.get("prompts"))
    except PromptsFileError as exc:
        raise VerifyError(str(exc)) from None


# ----------------------------------------------------------------------------- referee
def referee(engine: str, target: str | Path, draft: str | Path, *, prompts_file: str | Path | None = None, prompts: int | None = None,
            max_new_tokens: int = 64, budgets=(8, 16), kind: str | None = None, engine_api: str | None = None,
            dtype: str = "float32", timeout: float = 120.0, progress: Callable[[str], None] | None = None,
            engine_dtype: str | None = None) -> Refereed:
    """A running engine's speculative decoding beside ddpatch's from-scratch reference, the same pair on the same prompts
    (``patcher.referee.run``). Bad input (an engine that does not answer or reports no counters, a pair whose tokenizer is
    not the engine's, a prompt over the context, a bad folder or prompts file) raises one of ``INPUT_ERRORS``."""
    from .referee.run import referee as run
    from .verify.models.prompts import PromptsFileError, verify_options

    for flag, folder in (("--target", target), ("--draft", draft)):
        if not Path(folder).expanduser().is_dir():
            raise RefereeError(f"{flag} {folder} is not a folder")
    records = source = None
    if prompts_file is not None:
        try:
            read = verify_options(prompts_file, prompts)
        except PromptsFileError as exc:
            raise RefereeError(str(exc)) from None
        records, source = read["prompt_records"], read["prompts_source"]
    result = run(engine, str(Path(target).expanduser().resolve()), str(Path(draft).expanduser().resolve()), records=records,
                 source=source, prompts=prompts, max_new_tokens=max_new_tokens, budgets=tuple(budgets), kind=kind, api=engine_api,
                 dtype=dtype, timeout_s=timeout, progress=progress, engine_dtype=engine_dtype)
    return Refereed(result)


# ----------------------------------------------------------------------------- verify --upstream-tests
def _unpatched(path: Path, original: str | Path | None):
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


def _steps_by_file(before: Path, after: Path) -> dict[str, list[str]]:
    """Per file the recipe rewrites in ``before``, the steps with a site there (``check``), narrowed to those the patched
    file's provenance line names when it names any of them (an apply with --select/--ignore)."""
    from .engine.files import read_provenance
    from .results import APPLIED, PENDING

    try:
        report = check(before, jobs=1)
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


def require_decoder(path: str | Path, exclude: Iterable[str] = ()) -> dict[str, tuple[str, str]]:
    """Before a verifier starts: a tree with none of the default recipe's decoders is refused in the one line check gives
    (a serving engine named as such), as check, diff and apply refuse it; ``--entry`` names decoders by hand instead.
    Returns the files that are not torch code (file -> (framework, module)): verify leaves them out, as apply does."""
    from .engine.files import defined_functions
    from .engine.pipeline import discover
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


# ----------------------------------------------------------------------------- ci
def ci(recipe: str | Recipe, repo: str | Path, rev: str = "HEAD", since: str | None = None, upstream: str | None = None,
       verify: dict | None = None, verify_timeout: float = 600.0, jobs: int = 1, all_commits: bool = False,
       hunk_lines: int = HUNK_LINES, lock: str | Path | None = None, update_lock: bool = False,
       progress: Callable[[str], None] | None = None) -> CIResult:
    """Evaluate ``recipe`` on upstream commits and find where each step's status changed.

    ``verify``: options for ``verify`` on each evaluated commit (None: no verify).
    ``update_lock``: record a green tip in ``lock`` (default ``ddpatch-upstream.lock`` in the working folder, created if missing).
    """
    from .ci.history import run_ci
    from .ci.lock import apply_lock, default_lock_path

    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    lock_file = None
    if update_lock:
        lock_file = Path(lock or default_lock_path()).expanduser()
        if lock is not None and not lock_file.is_file():  # the default one is created beside the fork
            raise CIError(f"--lock {lock_file} does not exist")
    if verify is not None:
        unknown = [p for p in verify.get("presets") or () if p not in PRESETS]
        if unknown:
            raise CIError(f"--preset: unknown preset(s) {', '.join(unknown)}; known: {', '.join(sorted(PRESETS))}")
    result = run_ci(recipe, repo, rev=rev, since=since, upstream=upstream, verify=verify, verify_timeout=verify_timeout,
                    jobs=max(1, jobs), bisect_threshold=None if all_commits else BISECT_THRESHOLD, hunk_lines=hunk_lines,
                    progress=progress)
    if lock_file is not None:
        apply_lock(result, lock_file)
    return result
