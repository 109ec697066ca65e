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

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

from . import bridge, shipped
from .bridge import DEFAULT_RECIPE, engine_report, require_code
from .ci import BISECT_THRESHOLD, HUNK_LINES
from .engine.recipe import Recipe, builtin_recipes, load_recipe
from .errors import INPUT_ERRORS, CIError, EngineError, JournalError, RecipeError, RefereeError, VerifierCrash, VerifyError
from .results import ApplyResult, CIResult, Outcome, Refereed, Report, RevertResult, StepDoc
from .verify.models.presets import PRESETS

# The engine (and libcst), the verifier's runner and ci's history are imported by the functions
# that run them, so that importing this module, and ``ddpatch --help`` above it, stays cheap. Where the
# engine and the verifier meet (a check on verify's behalf, verify's decoders on check's) is ``patcher.bridge``.

__all__ = [
    "BISECT_THRESHOLD", "CIError", "DEFAULT_RECIPE", "EngineError", "HUNK_LINES", "INPUT_ERRORS", "JournalError", "PRESETS",
    "RecipeError", "VerifierCrash", "VerifyError", "apply", "check", "ci", "diff", "env", "generate_modes", "lossy_steps",
    "patch_builtin", "recipe_docs", "recipes", "referee", "revert", "run", "verify", "verify_generate", "workflow_template",
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
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    survey = "report" if select is not None else "require"
    recipe = select_steps(recipe, select, ignore)
    return engine_report(path, recipe, upstream=upstream, jobs=jobs, progress=progress, exclude=tuple(exclude or ()), survey=survey,
                         include_vendored=include_vendored)


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

    unpatched = bridge.unpatched(Path(path), original) if upstream_tests or original is not None else None  # bad input: before the run
    if prompts_file is not None:
        options.update(_prompts_options(prompts_file, options))
    if Path(path).is_dir() and not options.get("entries"):  # --entry names the decoders: the runner checks them
        not_torch = bridge.require_decoder(path, options.get("exclude") or ())
        if not_torch:  # an MLX port beside the torch decoders: never run as a torch decoder
            options["not_torch"] = {rel: f"{framework} code, not torch (imports {module})" for rel, (framework, module) in not_torch.items()}
    outcome = run_verify(Path(path), timeout=timeout, progress=progress, **options)
    bridge.settle_hints(outcome, Path(path), options.get("exclude") or ())
    if unpatched is not None:
        outcome.result.setdefault("checks", []).append(bridge.upstream_tests_row(Path(path), unpatched, timeout, progress))
    return outcome


def generate_modes() -> tuple[str, ...]:
    """The modes ``verify_generate`` runs (``verify --generate --mode``), in its order."""
    from .verify.judge.generate_mode import MODES

    return tuple(MODES)


def verify_generate(modes: Iterable[str], assistant: str | Path | None = None, **options) -> Outcome:
    """``verify --generate``: transformers' own speculative ``generate()`` under ``patcher.lossless``, in this process, judged
    against plain ``generate()`` (``patcher.verify.judge.generate_mode``; options: presets, target, seeds, temperature, ...)."""
    from .verify.judge.generate_mode import run_generate

    return run_generate(modes=list(modes), assistant=str(assistant) if assistant else None, **options)


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
    from .referee.run import referee as run_referee
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
    result = run_referee(engine, str(Path(target).expanduser().resolve()), str(Path(draft).expanduser().resolve()), records=records,
                         source=source, prompts=prompts, max_new_tokens=max_new_tokens, budgets=tuple(budgets), kind=kind,
                         api=engine_api, dtype=dtype, timeout_s=timeout, progress=progress, engine_dtype=engine_dtype)
    return Refereed(result)


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
