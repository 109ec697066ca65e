"""Every decoder a tree holds, found by what it does, and every drafter class it defines.

A *decode loop* is a function that drives a model with a cache round after round: inside a
``while`` or ``for`` loop it calls something with a cache (``past_key_values=``, ``cache=``,
``past_key_value=``) that is not the loop's own variable (a drafter's ``forward`` runs its layers
that way and is no decoder). Names do not matter: ``dflash_generate``, ``caddtree_generate``,
``eagle3_generate``, a target-only ``target_generate`` and a drafter's ``spec_generate`` method are
all found. A decode loop the verifier cannot call (its parameters are a helper's: caches, state)
is reached through the functions of the tree that call it (``dflash_generate`` calling
``_decode_rounds``). ``--entry FILE:FUNCTION`` (``[tool.ddpatch] entry``) picks decoders by hand.

A *drafter class* is a class whose ``forward`` takes the target's features (``target_hidden`` or a
spelling forks use) and a noise embedding, or that is named as upstream names its drafters
(``...DraftModel``), or a subclass of one (DFlash2's ``DFlash2DraftModel``); a name defined twice (DFlash's ``model.py`` and ``model_mlx.py``) is one drafter, the child takes the
definition that imports.

Static (``ast``), stdlib only: the parent uses it to check ``--entry`` and to report coverage, the
child to import what it runs. Nothing is imported from the tree here.
"""

from __future__ import annotations

import ast
import fnmatch
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .binding import ROLE_NAMES

CACHE_KEYWORDS = ("past_key_values", "cache", "past_key_value")
#: the names a drafter's forward gives the target's features (``drafter_oracle.ROLES``)
FEATURE_NAMES = ("target_hidden", "target_hidden_states", "context_features")
NOISE_NAMES = ("noise_embedding", "noise_embeds", "inputs_embeds")
NOT_DECODERS = ("forward", "_forward", "__call__")
#: folders never searched (tests of the tree, build output, ddpatch's own runtime copies)
SKIP_PARTS = ("tests", "test", "build", "__pycache__", "_ddpatch_runtime", "site-packages", "node_modules")
#: what upstream calls its decoders: the first chain and the first tree decoder with these names are
#: ``dflash`` and ``ddtree`` in the report, as they always were
CANONICAL = {"dflash": ("dflash_generate", "_dflash_generate"), "ddtree": ("ddtree_generate",)}
#: the files upstream's layouts keep those decoders in
UPSTREAM_FILES = ("dflash/model.py", "dflash/benchmark.py", "dflash.py", "ddtree.py", "benchmark.py")
LOOKED_FOR = ("looked for functions that run a model with a cache (past_key_values= or cache=) round after round in a loop, "
              "as dflash_generate and ddtree_generate do, and for the functions that call them")


@dataclass
class Decoder:
    file: str  # relative to the tree, posix
    module: str  # dotted module name
    qualname: str  # "f" or "Class.f"
    line: int
    loop: str | None = None  # the decode loop it reaches, where that is another function
    label: str = ""  # method label in the report: dflash, ddtree, or a name of its own
    same_as: str | None = None  # a decoder with the same code, verified in its place
    patched: bool = False  # the file imports ddpatch's runtime copy
    verified: bool | None = None  # set by the child
    reason: str = ""  # why it is not verified

    @property
    def function(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def cls(self) -> str | None:
        return self.qualname.rsplit(".", 1)[0] if "." in self.qualname else None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.qualname}"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Inventory:
    decoders: list[Decoder] = field(default_factory=list)
    drafters: list[dict] = field(default_factory=list)  # {"file", "module", "name", "bases", "line"}
    unparsed: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)  # the Python files --exclude left out

    def as_dict(self) -> dict:
        return {"decoders": [d.as_dict() for d in self.decoders], "drafters": self.drafters, "unparsed": self.unparsed}


# ----------------------------------------------------------------------------- reading the tree
def python_files(tree: Path, exclude: tuple[str, ...] = (), left: list | None = None, skip: dict | None = None):
    """The tree's Python files a decoder may live in; ``left`` receives the ones ``--exclude`` left out; ``skip``
    (file -> why) names more to leave out: code that is not torch (the engine's survey finds it)."""
    for path in sorted(tree.rglob("*.py")):
        rel = path.relative_to(tree)
        if any(part.startswith(".") or part in SKIP_PARTS for part in rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        if skip and rel.as_posix() in skip:
            continue
        if any(excluded(rel, glob) for glob in exclude):
            if left is not None:
                left.append(rel.as_posix())
            continue
        yield path, rel


def excluded(rel: Path, pattern: str) -> bool:
    """``--exclude PATTERN`` as check reads it (patcher.engine.pipeline.exclude_globs): a pattern without ``/`` is a
    file or folder name anywhere (``analysis``, ``profile_*.py``), one with ``/`` a path from the tree's root
    (``scripts/old/``, ``tools/*.py``); a folder takes everything under it."""
    pattern = pattern.strip().removeprefix("./").rstrip("/")
    if not pattern:
        return False
    if "/" not in pattern:
        return any(fnmatch.fnmatch(part, pattern) for part in rel.parts)
    posix = rel.as_posix()
    return fnmatch.fnmatch(posix, pattern) or fnmatch.fnmatch(posix, pattern + "/*")


def dotted(rel: Path) -> str:
    name = ".".join(rel.with_suffix("").parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _callee(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _carries_cache(call: ast.Call) -> bool:
    return any(k.arg in CACHE_KEYWORDS and not (isinstance(k.value, ast.Constant) and k.value.value is None)
               for k in call.keywords)


class _Body(ast.NodeVisitor):
    """One function's own body (nested functions and classes left out): its calls, and whether a call
    with a cache runs inside a loop on something other than the loop's variable."""

    def __init__(self):
        self.calls: set[str] = set()
        self.loop_targets: list[set[str]] = []
        self.decodes = False

    def visit_FunctionDef(self, node):  # nested: not this function's body
        return

    visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = visit_FunctionDef

    def _loop(self, node, targets: set[str]):
        self.loop_targets.append(targets)
        self.generic_visit(node)
        self.loop_targets.pop()

    def visit_While(self, node):
        self._loop(node, set())

    def visit_For(self, node):
        self._loop(node, {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)})

    def visit_Call(self, node):
        name = _callee(node)
        if name:
            self.calls.add(name)
        if self.loop_targets and _carries_cache(node):
            base = node.func.value if isinstance(node.func, ast.Attribute) else node.func
            own = base.id if isinstance(base, ast.Name) else None
            if not any(own in targets for targets in self.loop_targets):
                self.decodes = True
        self.generic_visit(node)


def _functions(module: ast.Module):
    """(qualname, node, class node or None) of module-level functions and methods of module-level classes."""
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node, None
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item, node


def _params(node) -> list[str]:
    a = node.args
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def _is_drafter_class(node: ast.ClassDef) -> bool:
    """Its forward takes the target's features and a noise embedding, or it is named as upstream names its drafters
    (``DFlashDraftModel``, ``...DraftModel``: a fork that renames the features' parameter keeps its drafter)."""
    forward = next((f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == "forward"), None)
    params = _params(forward) if forward is not None else []
    by_name = node.name.endswith("DraftModel") and forward is not None
    return by_name or (any(p in FEATURE_NAMES for p in params) and any(p in NOISE_NAMES for p in params))


def _base_names(node: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases]


def _binds(params: list[str], is_method: bool) -> bool:
    """Whether the verifier can bind a function with these parameters by name (binding.ROLE_NAMES): a model
    and the prompt. Positional binding in the child may still do more; this only picks entry points."""
    names = {p.lower() for p in params}
    has = lambda role: bool(names & set(ROLE_NAMES[role]))  # noqa: E731
    return has("input_ids") and (has("target") or has("draft") or is_method)


def inventory(tree: Path, exclude: tuple[str, ...] = (), skip: dict | None = None) -> Inventory:
    """Every decoder (entry points into a decode loop) and drafter class of ``tree`` (``skip``: files left out, why)."""
    found = Inventory()
    info = {}  # (file, qualname) -> facts
    for path, rel in python_files(tree, exclude, found.excluded, skip):
        try:
            text = path.read_text(encoding="utf-8")
            module = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            found.unparsed.append(rel.as_posix())
            continue
        patched = "_ddpatch_runtime" in text
        for node in module.body:
            if isinstance(node, ast.ClassDef):
                found.drafters.append({"file": rel.as_posix(), "module": dotted(rel), "name": node.name,
                                       "bases": _base_names(node), "line": node.lineno, "drafter": _is_drafter_class(node)})
        for qualname, node, cls in _functions(module):
            body = _Body()
            for stmt in node.body:
                body.visit(stmt)
            info[(rel.as_posix(), qualname)] = {
                "module": dotted(rel), "line": node.lineno, "params": _params(node), "calls": body.calls,
                "decodes": body.decodes and node.name not in NOT_DECODERS, "is_method": cls is not None, "patched": patched,
                "code": ast.dump(ast.Module(body=node.body, type_ignores=[])),
            }
    found.drafters = _drafter_classes(found.drafters)
    drafter_names = {d["name"] for d in found.drafters}
    entries: dict[tuple[str, str], str | None] = {}
    for key, f in info.items():
        if not f["decodes"]:
            continue
        owner = key[1].split(".")[0] if f["is_method"] else None
        method_ok = owner in drafter_names  # a drafter's own method: the verifier calls it on the drafter it built
        if _binds(f["params"], f["is_method"]) and (not f["is_method"] or method_ok):
            entries.setdefault(key, None)
            continue
        callers = [k for k, g in info.items() if key[1].split(".")[-1] in g["calls"] and k != key
                   and _binds(g["params"], g["is_method"]) and (not g["is_method"] or k[1].split(".")[0] in drafter_names)]
        for k in callers:
            entries.setdefault(k, key[1])
        if not callers:
            entries.setdefault(key, None)
    for (file, qualname), loop in sorted(entries.items(), key=lambda kv: (kv[0][0].count("/"), kv[0])):
        f = info[(file, qualname)]
        found.decoders.append(Decoder(file=file, module=f["module"], qualname=qualname, line=f["line"],
                                      loop=loop if loop != qualname else None, patched=f["patched"]))
    _label(found.decoders, info)
    return found


def _drafter_classes(classes: list[dict]) -> list[dict]:
    """The classes that are drafters: their forward takes the target's features, or they subclass one."""
    names = {c["name"] for c in classes if c["drafter"]}
    grown = True
    while grown:
        grown = False
        for c in classes:
            if c["name"] not in names and set(c["bases"]) & names:
                names.add(c["name"])
                grown = True
    return [{k: v for k, v in c.items() if k != "drafter"} for c in classes if c["name"] in names]


def _label(decoders: list[Decoder], info: dict) -> None:
    """Report labels, and duplicates of the same code (verified once: through the canonical one, else the first)."""
    seen_code: dict[str, Decoder] = {}
    taken: set[str] = set()
    for canonical, names in CANONICAL.items():
        for name in names:
            candidates = [d for d in decoders if not d.label and d.cls is None and d.function == name]
            # upstream's own file first (a fork's alpha_1/ copy sorts before dflash/ and is not the one its users mean)
            match = next((d for d in candidates if d.file in UPSTREAM_FILES), None) or next(iter(candidates), None)
            if match is not None:
                match.label = canonical
                taken.add(canonical)
                break
    counts: dict[str, int] = {}
    for d in decoders:
        counts[d.function] = counts.get(d.function, 0) + 1
    for d in decoders:
        if not d.label:
            base = d.qualname if d.cls else d.function
            d.label = base if counts[d.function] == 1 and base not in taken else f"{base}@{d.file}"
            taken.add(d.label)
    # copies of the same code are verified once, through the canonical decoder where one is a copy
    # (dflash_generate, not a renamed duplicate in a file sorted before it)
    for d in sorted(decoders, key=lambda d: d.label not in CANONICAL):
        code = _with_helpers(d.file, d.qualname, info)
        if code in seen_code and d.cls is None:
            d.same_as = seen_code[code].label
        else:
            seen_code.setdefault(code, d)


def _with_helpers(file: str, qualname: str, info: dict) -> str:
    """A decoder's code for telling copies apart: its own body and the bodies of the functions of its file it calls,
    transitively. Two files' ``ddtree_generate`` with the same body are no copies when the tree builder each calls
    in its own file differs."""
    local = {q: f for (fl, q), f in info.items() if fl == file and "." not in q}
    seen, todo, parts = set(), [qualname], []
    while todo:
        q = todo.pop()
        if q in seen or (file, q) not in info:
            continue
        seen.add(q)
        parts.append(info[(file, q)]["code"] if q == qualname else f"{q}:{info[(file, q)]['code']}")  # a renamed copy is a copy
        todo += sorted(n for n in info[(file, q)]["calls"] if n in local)
    return "\n".join(sorted(parts[1:]) + parts[:1])


def parse_entry(spec: str) -> tuple[str, str]:
    """``FILE:FUNCTION`` (``FUNCTION`` may be ``Class.method``) -> (file, qualname); ValueError on bad input."""
    if ":" not in spec:
        raise ValueError(f"--entry {spec!r}: expected FILE:FUNCTION, e.g. dflash/model.py:dflash_generate")
    file, qualname = spec.rsplit(":", 1)
    if not file.endswith(".py") or not qualname:
        raise ValueError(f"--entry {spec!r}: expected FILE:FUNCTION, e.g. dflash/model.py:dflash_generate")
    return Path(file).as_posix().lstrip("./") if file.startswith("./") else Path(file).as_posix(), qualname


def pick(tree: Path, found: Inventory, entries: list[str]) -> list[Decoder]:
    """The decoders named by ``--entry`` (found or not: a function the scan did not call a decoder is taken as given);
    ValueError naming a file or function that is not in the tree."""
    picked = []
    for spec in entries:
        file, qualname = parse_entry(spec)
        known = next((d for d in found.decoders if d.file == file and d.qualname == qualname), None)
        if known is not None:
            picked.append(known)
            continue
        path = tree / file
        if not path.is_file():
            raise ValueError(f"--entry {spec}: no file {file} in {tree}")
        module = ast.parse(path.read_text(encoding="utf-8"))
        node = next((n for q, n, _ in _functions(module) if q == qualname), None)
        if node is None:
            raise ValueError(f"--entry {spec}: {file} defines no function {qualname}")
        picked.append(Decoder(file=file, module=dotted(Path(file)), qualname=qualname, line=node.lineno,
                              label=qualname.replace(".", "_"), patched="_ddpatch_runtime" in path.read_text(encoding="utf-8")))
    return picked


def plan(tree: Path, entries: list[str] | None = None, exclude: tuple[str, ...] = (), skip: dict | None = None) -> dict:
    """What the child verifies: the decoders (picked, or every distinct one found, the ones in files ddpatch patched
    first), the ones left out with their reason, and the drafter classes. Plain data (it crosses to the child as JSON).
    No count leaves a decoder out: the runner spreads them over parallel children."""
    found = inventory(tree, exclude, skip)
    if entries:
        chosen = pick(tree, found, entries)
        keys = {(d.file, d.qualname) for d in chosen}
        for d in found.decoders:
            if (d.file, d.qualname) not in keys:
                d.verified, d.reason, d.same_as = False, "not picked (--entry)", d.same_as or "--entry"
    else:
        chosen = []
        for d in found.decoders:
            if d.same_as:
                d.verified, d.reason = False, f"the same code as {d.same_as}, verified in its place"
            else:
                chosen.append(d)
        chosen.sort(key=lambda d: not d.patched)  # stable: the patched files' decoders first, each group in scan order
    others = [d for d in found.decoders if d not in chosen]
    return {"decoders": [d.as_dict() for d in chosen], "left_out": [d.as_dict() for d in others],
            "drafters": found.drafters, "unparsed": found.unparsed, "excluded": found.excluded, "not_torch": dict(skip or {})}
