"""The tree's decoders and drafter classes, imported and bound: what a verify runs.

``decoders.plan`` found them statically; here each decoder's module is imported, the function (or
the drafter's method) resolved, its parameters bound (``binding``) and its kind read off them:
``chain`` (a drafter, one block per round), ``tree`` (it takes a tree budget: one method per budget)
or ``target`` (target-only: no drafter in sight). Each chain or tree decoder runs once with every
drafter class the tree defines (``DFlashDraftModel``, ``DFlash2DraftModel``, a fork's subclass), so
that every drafter path of the decoder runs (``isinstance(model, DFlash2DraftModel)`` branches).
A decoder that cannot be imported or bound is kept, with the reason, for the coverage row.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

from ..check import Check
from .binding import BindError, NeedsArgument, NotADecoder, bind_roles, kind_of, required_for
from .needs import needed

#: decoders a verify runs at most per drafter class beyond the first (each costs a full set of decodes)
TAKES_TEMPERATURE = ("temperature", "temp")


@dataclass
class Method:
    name: str  # the report's label: dflash, ddtree_tb4, dflash[DFlash2DraftModel], target_generate ...
    decoder: dict  # the plan's decoder (file, qualname, label, ...)
    fn: object | None  # None for a drafter's method: resolved on the drafter it runs with
    kind: str  # chain | tree | target
    budget: int | None = None
    drafter: str | None = None  # the drafter class it runs with (None: target-only)
    drafter_method: bool = False

    @property
    def where(self) -> str:
        return f"{self.decoder['file']}:{self.decoder['qualname']}"

    def callable_for(self, draft):
        return getattr(draft, self.decoder["qualname"].rsplit(".", 1)[1]) if self.drafter_method else self.fn

    def required(self) -> tuple[str, ...]:
        return required_for(self.kind, self.drafter_method)

    def takes_temperature(self, draft=None) -> bool:
        fn = self.callable_for(draft) if self.drafter_method else self.fn
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return False
        return any(p.lower() in TAKES_TEMPERATURE for p in params)


@dataclass
class Loaded:
    methods: list  # Method
    drafters: dict  # class name -> class (the first definition that imports)
    primary: str | None  # the drafter class the baseline and target-only methods use
    decoders: list  # the plan's decoders, each with verified / reason filled in
    problems: list  # (what, error summary) for the loads check
    drafter_notes: list  # "DFlashDraftModel (dflash/model_mlx.py): its module does not import: ..."


def _import(tree: Path, module: str):
    """The tree's module ``module`` (dotted from the tree's root), imported as the tree's own code imports it: a tree
    whose root is a package (``site-packages/dflash``: its root has ``__init__.py``, its modules import each other and
    ddpatch's runtime relatively) is imported as that package (``dflash.model``); any other tree from its root."""
    package = root_package(tree)
    if package is None:
        if str(tree) not in sys.path:
            sys.path.insert(0, str(tree))
        return importlib.import_module(module)
    return importlib.import_module(package if module in ("", "__init__") else f"{package}.{module}")


def package_name(tree: Path) -> str:
    """The name a package tree is imported under: the one its own modules import it by (``from dflash.model import``
    in a module at its root), else its folder's name (``--out`` may name it anything: a relative import does not care),
    else a name of ours."""
    import re

    own = {p.stem for p in tree.glob("*.py")} | {p.name for p in tree.iterdir() if (p / "__init__.py").is_file()}
    pattern = re.compile(r"^[ \t]*(?:from|import)[ \t]+([A-Za-z_]\w*)\.(\w+)", re.MULTILINE)
    for path in sorted(tree.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for name, sub in pattern.findall(text):
            if sub in own and name not in own and name not in sys.modules and name not in sys.stdlib_module_names:
                return name
    return tree.name if tree.name.isidentifier() else "ddpatch_tree"


def root_package(tree: Path) -> str | None:
    """The package name a tree whose root has ``__init__.py`` is imported under (registered once, from the tree's
    folder, before any installed package of that name), or None for a tree imported from its root."""
    tree = Path(tree).resolve()
    if not (tree / "__init__.py").is_file():
        return None
    if tree in _PACKAGES:
        return _PACKAGES[tree]
    name = package_name(tree)
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, tree / "__init__.py", submodule_search_locations=[str(tree)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    try:
        spec.loader.exec_module(package)
    except BaseException:
        del sys.modules[name]
        raise
    _PACKAGES[tree] = name
    return name


_PACKAGES: dict = {}  # a package tree's folder -> the name it was imported under


def _resolve(module, qualname: str):
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def load(tree: Path, plan: dict, budgets: list[int], error_summary) -> Loaded:
    drafters, notes, problems = {}, [], []
    where: dict[tuple[str, str], str] = {}  # (file, class name) -> its key in ``drafters``: classes resolve by module
    # a class whose method is a decoder is the one of that method's module, even where another module defines its name
    owners = {(d["file"], d["qualname"].rsplit(".", 1)[0]) for d in plan["decoders"] if "." in d["qualname"]}
    for spec in plan["drafters"]:
        key = spec["name"]
        if key in drafters:  # a name defined twice (model.py and model_mlx.py) is one drafter, unless a decoder is its own
            if (spec["file"], key) not in owners:
                continue
            key = f"{key}@{spec['file']}"
        try:
            drafters[key] = getattr(_import(tree, spec["module"]), spec["name"])
            where[(spec["file"], spec["name"])] = key
        except Exception as exc:
            notes.append(f"{spec['name']} ({spec['file']}): its module does not import: {error_summary(exc)['error']}")
    # the base drafter class first (DFlashDraftModel before DFlash2DraftModel(DFlashDraftModel))
    order = sorted(drafters, key=lambda n: sum(issubclass(drafters[n], c) for c in drafters.values()))
    primary = order[0] if order else None
    methods, decoders = [], []
    for d in plan["decoders"]:
        d = dict(d)
        decoders.append(d)
        try:
            module = _import(tree, d["module"])
            obj = _resolve(module, d["qualname"])
        except Exception as exc:
            err = error_summary(exc)
            problems.append((d, err))
            d.update(verified=False, reason=f"does not import: {err['error']}")
            continue
        owner = d["qualname"].rsplit(".", 1)[0] if "." in d["qualname"] else None
        owner = where.get((d["file"], owner), owner)  # the class of the decoder's own module
        drafter_method = owner is not None and owner in drafters and drafters[owner].__module__ == module.__name__
        if owner is not None and not drafter_method:
            d.update(verified=False, reason=f"a method of {owner}, which is no drafter class: the verifier cannot build its instance "
                                            "(verify the function that builds it, with --entry)")
            continue
        try:
            kind = kind_of(obj, drafter_method=drafter_method)
            call = functools.partial(obj, None) if drafter_method else obj
            needs = needed(obj, set(bind_roles(call, required_for(kind, drafter_method))))
            if needs:
                raise NeedsArgument(obj, needs[0][0], needs[0][1])
        except BindError as exc:
            d.update(verified=False, reason=str(exc), not_decoder=isinstance(exc, NotADecoder),
                     needs=getattr(exc, "parameter", None))
            continue
        if kind != "target" and not drafters:
            d.update(verified=False, reason="the tree defines no drafter class that imports (a class whose forward takes "
                                            "target_hidden and a noise embedding)")
            continue
        classes = [None] if kind == "target" else [n for n in order if not drafter_method or issubclass(drafters[n], drafters[owner])]
        if kind != "target" and not drafter_method:  # a decoder that calls what only some drafter classes define runs with those
            unfit = unfit_classes(obj, {n: drafters[n] for n in classes})
            if unfit:
                d["not_with"] = unfit
                classes = [n for n in classes if n not in unfit] or classes
        for cls_name in classes:
            suffix = "" if cls_name in (None, primary) or (drafter_method and cls_name == owner) else f"[{cls_name}]"
            for budget in (budgets if kind == "tree" else [None]):
                name = d["label"] + (f"_tb{budget}" if budget is not None else "") + suffix
                methods.append(Method(name, d, None if drafter_method else obj, kind, budget, cls_name or primary if kind != "target"
                                      else None, drafter_method))
        d.update(verified=True, reason="", kind=kind)
    for d in plan.get("left_out", []):
        decoders.append(dict(d))
    return Loaded(methods, drafters, primary, decoders, problems, notes)


def unfit_classes(fn, classes: dict) -> dict[str, str]:
    """The drafter classes a decoder cannot run with, and why: it calls a method on its drafter parameter
    (``model.propose(...)``) that some of the tree's drafter classes define and these do not. A DFlash2-only decoder is
    never run with the plain ``DFlashDraftModel`` (its failure would say nothing about the decoder)."""
    import ast
    import textwrap

    try:
        from .binding import bind_roles

        param = next((name for name, role in bind_roles(fn).items() if role == "draft"), None)
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (BindError, OSError, TypeError, SyntaxError):
        return {}
    if param is None:
        return {}
    checks = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in ("isinstance", "hasattr", "getattr") and n.args and isinstance(n.args[0], ast.Name)
              and n.args[0].id == param]
    if checks:  # it asks what its drafter is (DFlash's newest: `if isinstance(model, DFlash2DraftModel)`): it runs with each
        return {}
    called = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and isinstance(n.func.value, ast.Name) and n.func.value.id == param}
    specific = {a for a in called if any(callable(getattr(c, a, None)) for c in classes.values())
                and not all(callable(getattr(c, a, None)) for c in classes.values())}
    out = {}
    for name, cls in classes.items():
        missing = sorted(a for a in specific if not callable(getattr(cls, a, None)))
        if missing:
            owners = sorted(n for n, c in classes.items() if all(callable(getattr(c, a, None)) for a in missing))
            out[name] = f"it calls {param}.{missing[0]}(), which only {', '.join(owners) or 'another class'} defines"
    return out


def load_rows(plan: dict, loaded: Loaded) -> list[dict]:
    """``loads`` for the tree (which decoders and drafter classes imported), and for each decoder that did not import
    a failing ``loads: LABEL`` row of its own, with the error and its hint: the decoders that did are still run."""
    failed = {(d["file"], d["qualname"]): err for d, err in loaded.problems}
    ok = [f"{d['qualname']} from {d['module']}" for d in plan["decoders"] if (d["file"], d["qualname"]) not in failed]
    ok += [f"{n} from {c.__module__}" for n, c in loaded.drafters.items()]
    if not failed:
        return [Check.of("loads", passed=True, evidence=", ".join(ok)).to_json()]
    (d0, err0), *_ = loaded.problems
    rows = [Check.of("loads", **{"passed": False, **err0, "evidence": (
        f"{len(failed)} of {len(plan['decoders'])} decoder(s) did not import: "
        + "; ".join(f"{d['file']}:{d['qualname']}: {err['error']}" for d, err in loaded.problems)
        + (f"; the others are judged below ({', '.join(ok)})" if ok else ""))}).to_json()]
    for d, err in loaded.problems:
        rows.append(Check.of(f"loads: {d.get('label') or d['qualname']}", **{
            "passed": False, **err, "evidence": f"{d['file']}:{d['qualname']}: {err['error']}",
            "decoder": {"file": d["file"], "function": d["qualname"], "kind": None, "drafter": None}}).to_json())
    return rows


def coverage_check(decoders: list[dict], unparsed: list[str], notes: list[str], excluded: list[str] | None = None,
                   exclude_source: str | None = None, not_torch: dict | None = None) -> dict:
    """``decoders: N found, M verified``: a decoder left out of a file that ddpatch patched is a finding, unless the
    user left it out (``--entry``) or it is the same code as one verified (``same_as``)."""
    verified = [d for d in decoders if d.get("verified")]
    routines = [d for d in decoders if d.get("not_decoder")]  # a calibration loop: named, left out, never failed
    left = [d for d in decoders if not d.get("verified") and not d.get("not_decoder")]
    finding = [d for d in left if d.get("patched") and not d.get("same_as")]
    text = f"{len(decoders)} found, {len(verified)} verified"
    if verified:
        text += " (" + ", ".join(f"{d['label']} = {d['file']}:{d['qualname']}" + (f", loop in {d['loop']}" if d.get("loop") else "")
                                 for d in verified) + ")"
    if left:
        text += "; not verified: " + "; ".join(f"{d['file']}:{d['qualname']} ({d.get('reason') or 'not run'})" for d in left)
    if routines:
        text += "; left out, not decoders (no max_new_tokens: they generate nothing): " + "; ".join(
            f"{d['file']}:{d['qualname']}" for d in routines)
    if notes:
        text += "; drafter classes not run: " + "; ".join(notes)
    unfit = [f"{d['label']} not with {cls} ({why})" for d in verified for cls, why in (d.get("not_with") or {}).items()]
    if unfit:
        text += "; " + "; ".join(unfit)
    if unparsed:
        text += f"; {len(unparsed)} file(s) not parsed: {', '.join(unparsed[:5])}"
    if excluded:
        text += f"; --exclude left out {len(excluded)} file(s): {', '.join(excluded[:5])}" + (", ..." if len(excluded) > 5 else "")
        if exclude_source:
            text += f" ({exclude_source})"
    if not_torch:
        text += "; left out, not torch code: " + "; ".join(f"{f} ({why})" for f, why in sorted(not_torch.items()))
    check = Check.of("decoders", passed=bool(verified) and not finding, evidence=text, decoders=decoders,
                     excluded=list(excluded or []), not_torch=dict(not_torch or {})).to_json()
    if finding:
        check["evidence"] = (f"{len(finding)} decoder(s) in files ddpatch patched were not verified: "
                             + "; ".join(f"{d['file']}:{d['qualname']}" for d in finding) + f"; {text}")
    return check
