"""Draw the import graph of ``patcher/`` and check its layering.

    python tools/import_graph.py            # the graph, top down, one line per package; exit 1 on a violation
    python tools/import_graph.py --modules  # one line per module
    python tools/import_graph.py --dot      # Graphviz DOT of the module graph (pipe to `dot -Tsvg`)
    python tools/import_graph.py --json     # edges, cycles and violations as JSON

Every ``import`` counts, at module level or inside a function (a lazy import is still a
dependency). The checks:

* no import cycle between modules, nor between packages;
* each package imports only packages in lower layers (``LAYERS``, top first) or itself, and of
  those only the ones ``MAY_IMPORT`` lists (the engine, verify and ci never render);
* every module of the ``runtime`` package imports only the stdlib and torch at module level,
  transformers only inside a function (it is copied into patched trees, whose code runs
  transformers anyway), and its own modules only relatively (the copy has no ``patcher``);
  its modules stay under ``RUNTIME_MAX_LINES`` lines;
* the verifier's child modules (all of ``patcher.verify`` but the parent's folder, ``process/``) import nothing of
  ``patcher`` outside ``patcher.verify`` (they import each other by ordinary relative imports, which it sees);
* a shared leaf (``SHARED_LEAVES``: ``verify/check.py``, the one ``Check`` type) imports only the stdlib;
* the ``referee`` imports only the stdlib at module level (``STDLIB_AT_TOP``: torch only inside a function);
* no module is over ``MAX_LINES`` lines;
* each subpackage's ``__init__`` is a docstring of two lines: what it is for, what it may import.

Only the stdlib is used, so it runs anywhere the checkout is.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "patcher"
#: Top first. A package may import packages of lower layers only (and itself).
LAYERS = [
    ("__main__",),
    ("cli",),
    ("commands",),
    ("api", "config"),
    ("ci",),
    ("referee", "bridge"),
    ("engine", "verify"),
    ("lossless",),
    ("generation",),
    ("report",),
    ("results", "errors", "env"),
    ("check",),
    ("__init__",),
]
#: What each package may import besides itself (what its ``__init__`` says): a lower layer is not
#: enough; the engine, verify and ci return plain results and never render them.
MAY_IMPORT = {
    "__main__": {"cli"},
    "cli": {"commands", "__init__"},  # the click group and its wiring: every command is in commands, and goes through api
    "commands": {"api", "config", "report", "results", "errors", "env", "__init__"},  # every command (a module each, or per small
    # group) and what they share (base); they call api and render with report, and reach no engine nor verify of their own
    "config": {"engine", "errors", "__init__"},  # settings from ddpatch.toml / [tool.ddpatch]; the default recipe
    "api": {"ci", "referee", "bridge", "engine", "verify", "results", "errors", "env", "__init__"},
    "bridge": {"engine", "verify", "results", "errors"},  # where the engine and verify meet (check on verify's behalf, verify's
    # decoders on check's), so that neither imports the other and api only calls
    "ci": {"engine", "verify", "results", "errors", "__init__"},
    "engine": {"results", "errors", "__init__"},
    "verify": {"check", "results", "errors", "lossless", "__init__"},  # lossless: for `verify --generate`
    "referee": {"verify", "results", "errors", "__init__"},  # engines' clients and counters (stdlib HTTP, no torch on import);
    # verify: the reference decoders, imported inside functions
    "report": {"results", "check", "env", "__init__"},  # env: the verify header names where transformers stands; check: rows read as Checks
    "results": {"__init__"},
    "check": set(),  # patcher/verify/check.py: the one Check type (stdlib only; see SHARED_LEAVES)
    "errors": set(),
    "env": set(),  # installed versions against the tested ranges (stdlib; torch inside a function)
    "__init__": set(),
    "runtime": set(),
    "lossless": {"generation", "runtime", "__init__"},  # the documented name of generate() made exact (a callable module)
    "generation": {"runtime", "__init__"},  # transformers' generate() made exact: the runtime's one in-process user
}
#: (importer, imported) edges allowed against the layering: ``patcher.lossless`` is the package's API name,
#: resolved lazily by ``patcher/__init__``'s ``__getattr__`` (``import patcher`` imports no torch).
LAZY_EXPORTS = {("__init__", "lossless")}
STANDALONE = ("runtime",)  # imports nothing of patcher, and nothing imports it as code
IN_PROCESS = ("lossless", "generation")  # ...but these, which run it in the user's own process (generate() made exact)
#: The line between the verifier's two processes is a folder: ``verify/process/`` is the parent (it starts the child,
#: reads its events, tells how it died, merges the results) and may import outside ``patcher.verify``; every other
#: module may run in the child (``verify/child/`` is its entry), so it imports nothing of patcher outside it.
PARENT_FOLDER = "patcher.verify.process"
#: ... and one module outside that folder that runs in the CLI's process: ``verify --generate`` (in process).
PARENT_ONLY = ("patcher.verify.judge.generate_mode",)
#: Modules that lie inside a package's folder but are a unit of their own on the bottom layer: the verifier's child
#: loads ``patcher/verify`` as a private package, so the one ``Check`` type that its oracles make and the renderers
#: read lies there; it imports only the stdlib (checked), and ``results`` re-exports it for the renderers.
SHARED_LEAVES = {"patcher.verify.check": "check"}
#: patcher.verify's own floors, top first: a sub-package imports only lower floors (or itself)
VERIFY_FLOORS = [("process",), ("child",), ("judge",), ("subjects", "models"), ("plumbing",)]
MAX_LINES = 500
RUNTIME_MAX_LINES = 400  # the runtime is read by the users whose trees carry it
RUNTIME_ALLOWED = {"torch"}
#: ... and, inside a function only (with a fallback), what every patched tree runs with anyway.
RUNTIME_LAZY = {"transformers"}
#: Packages that import only the stdlib at module level (the referee talks HTTP; importing it loads no torch), and
#: what they may import inside a function.
STDLIB_AT_TOP = {"referee": {"torch", "transformers"}}


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(modules of ``patcher`` that ``name`` imports, top-level names of everything else it imports)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]
    inside, outside = set(), set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                targets.append(sub if sub in known else mod)
        for t in targets:
            if t == PACKAGE or t.startswith(PACKAGE + "."):
                while t not in known and "." in t:
                    t = t.rpartition(".")[0]
                if t != name:
                    inside.add(t)
            else:
                outside.add(t.split(".")[0])
    return inside, outside


def unit(module: str) -> str:
    """The package a module belongs to: ``patcher.engine.codemods.crop`` -> ``engine``; ``patcher`` -> ``__init__``."""
    if module in SHARED_LEAVES:
        return SHARED_LEAVES[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def floor_of(module: str) -> str | None:
    """The sub-package of ``patcher.verify`` a module lies in (``judge``), or None for the package itself."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in {f for fl in VERIFY_FLOORS for f in fl}) else None


def verify_floor_violation(a: str, b: str) -> str | None:
    """Why ``a`` may not import ``b`` inside patcher.verify (its floors point down), or None."""
    fa, fb = floor_of(a), floor_of(b)
    level = {f: i for i, names in enumerate(VERIFY_FLOORS) for f in names}
    if fa is None or fb is None or fa == fb:
        return None
    if fa not in level or fb not in level:
        return f"{fa if fa not in level else fb} has no floor in VERIFY_FLOORS (add it to tools/import_graph.py)"
    if level[fb] <= level[fa]:
        return f"verify's {fa} (floor {level[fa]}) may import only lower floors, not {fb} (floor {level[fb]})"
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one node (or a self-loop), via Tarjan."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def analyse(root: Path = ROOT) -> dict:
    known = modules(root)
    graph: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for name, path in known.items():
        graph[name], external[name] = imports(name, path, known)
    layer_of = {u: i for i, names in enumerate(LAYERS) for u in names}
    packages: dict[str, set[str]] = {}
    violations: list[str] = []
    for a, targets in graph.items():
        ua = unit(a)
        packages.setdefault(ua, set())
        for b in targets:
            ub = unit(b)
            if ub != ua:
                packages[ua].add(ub)
            if (ua, ub) in LAZY_EXPORTS or (ua in IN_PROCESS and ub in STANDALONE):
                pass
            elif (ua in STANDALONE or ub in STANDALONE) and ua != ub:
                violations.append(f"{a} imports {b}: runtime stands alone (stdlib and torch only; it is copied into patched trees)")
            elif ub == "cli" and ua != "__main__":
                violations.append(f"{a} imports {b}: nothing imports the CLI")
            elif ub != ua and (ua not in layer_of or ub not in layer_of):
                missing = ua if ua not in layer_of else ub
                violations.append(f"{a} imports {b}: {missing} has no place in LAYERS (add it to tools/import_graph.py)")
            elif ub != ua and layer_of[ub] <= layer_of[ua]:
                violations.append(f"{a} imports {b}: {ua} (layer {layer_of[ua]}) may import only lower layers, not {ub} (layer {layer_of[ub]})")
            elif ub != ua and ub not in MAY_IMPORT.get(ua, set()):
                violations.append(f"{a} imports {b}: {ua} may import only {', '.join(sorted(MAY_IMPORT.get(ua, ()))) or 'nothing of patcher'}")
            in_parent = a.startswith(PARENT_FOLDER + ".") or a in PARENT_ONLY
            if ua == "verify" and not in_parent and ub not in ("verify", *SHARED_LEAVES.values()):
                violations.append(f"{a} imports {b}: the verifier's child modules import nothing of patcher outside patcher.verify")
            if ua == ub == "verify":
                why = verify_floor_violation(a, b)
                if why:
                    violations.append(f"{a} imports {b}: {why}")
    runtime = f"{PACKAGE}.runtime"
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for name in sorted(k for k in known if k == runtime or k.startswith(runtime + ".")):
        tree = ast.parse(known[name].read_text(encoding="utf-8"))
        top_level = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        top_level |= {(n.module or "").split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and not n.level}
        for ext in sorted(external.get(name, ())):
            lazy_ok = ext in RUNTIME_LAZY and ext not in top_level
            if ext not in stdlib and ext not in RUNTIME_ALLOWED and not lazy_ok:
                violations.append(f"{name} imports {ext}: only the stdlib and torch (transformers only inside a function)")
        absolute = sorted({(n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level
                           and (n.module or "").split(".")[0] == PACKAGE}
                          | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                             if a.name.split(".")[0] == PACKAGE})
        violations += [f"{name} imports {a} absolutely: the runtime's own modules are imported relatively "
                       "(a patched tree has its copy, not patcher)" for a in absolute]
        lines = len(known[name].read_text(encoding="utf-8").splitlines())
        if lines > RUNTIME_MAX_LINES:
            violations.append(f"{name}: {lines} lines (over {RUNTIME_MAX_LINES}, the runtime's limit)")
    for name in sorted(k for k in known if unit(k) in STDLIB_AT_TOP):
        tree = ast.parse(known[name].read_text(encoding="utf-8"))
        top_level = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        top_level |= {(n.module or "").split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and not n.level}
        for ext in sorted(external.get(name, ())):
            if ext in stdlib:
                continue
            if ext in top_level or ext not in STDLIB_AT_TOP[unit(name)]:
                where = "at module level" if ext in top_level else "anywhere"
                violations.append(f"{name} imports {ext} {where}: {unit(name)} imports only the stdlib at module level"
                                  f" ({', '.join(sorted(STDLIB_AT_TOP[unit(name)]))} inside a function)")
    for name in sorted(SHARED_LEAVES):
        if name in known:
            violations += [f"{name} imports {ext}: a shared leaf imports only the stdlib (the child and the renderers load it)"
                           for ext in sorted(external.get(name, ())) if ext not in stdlib]
            violations += [f"{name} imports {b}: a shared leaf imports nothing of patcher" for b in sorted(graph.get(name, ()))]
    for name, path in known.items():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            violations.append(f"{name}: {lines} lines (over {MAX_LINES})")
        if path.name == "__init__.py" and name != PACKAGE and unit(name) not in STANDALONE:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=True) or ""
            text = [l for l in doc.splitlines() if l.strip()]
            if len(text) != 2 or "import" not in text[1].lower():
                violations.append(f"{name}/__init__.py: its docstring must be two lines, what the package is for and what it may import")
    module_cycles = cycles(graph)
    package_cycles = cycles(packages)
    violations += [f"import cycle between modules: {' -> '.join(c)}" for c in module_cycles]
    violations += [f"import cycle between packages: {' -> '.join(c)}" for c in package_cycles]
    return {"modules": {k: sorted(v) for k, v in graph.items()}, "packages": {k: sorted(v) for k, v in packages.items()},
            "module_cycles": module_cycles, "package_cycles": package_cycles, "violations": violations}


def text(result: dict, by_module: bool) -> str:
    out = []
    order = [u for names in LAYERS for u in names] + list(STANDALONE)
    if by_module:
        for u in order:
            for m in sorted(k for k in result["modules"] if unit(k) == u):
                deps = [d[len(PACKAGE) + 1:] or PACKAGE for d in result["modules"][m]]
                out.append(f"{m[len(PACKAGE) + 1:] or PACKAGE:<32} -> {', '.join(deps) or '(nothing of patcher)'}")
    else:
        for i, names in enumerate(LAYERS):
            for u in names:
                if u in result["packages"]:
                    out.append(f"layer {i}  {u:<9} -> {', '.join(sorted(result['packages'][u], key=lambda d: order.index(d) if d in order else len(order))) or '(nothing of patcher)'}")
        for u in STANDALONE:
            out.append(f"alone    {u:<9} -> {', '.join(result['packages'].get(u, [])) or '(nothing of patcher: stdlib and torch)'}")
    out.append("")
    out.append("cycles: none" if not result["module_cycles"] and not result["package_cycles"] else "cycles: FOUND")
    out += [f"VIOLATION: {v}" for v in result["violations"]] or ["layering: every import points down"]
    return "\n".join(out) + "\n"


def dot(result: dict) -> str:
    lines = ["digraph patcher {", "  rankdir=TB; node [shape=box, fontname=monospace];"]
    for u in {unit(m) for m in result["modules"]}:
        mods = sorted(m for m in result["modules"] if unit(m) == u)
        lines.append(f'  subgraph "cluster_{u}" {{ label="{u}";')
        lines += [f'    "{m}";' for m in mods]
        lines.append("  }")
    for a, targets in sorted(result["modules"].items()):
        lines += [f'  "{a}" -> "{b}";' for b in targets]
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", action="store_true", help="one line per module instead of per package")
    parser.add_argument("--dot", action="store_true", help="Graphviz DOT of the module graph")
    parser.add_argument("--json", action="store_true", help="edges, cycles and violations as JSON")
    args = parser.parse_args(argv)
    result = analyse()
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    elif args.dot:
        sys.stdout.write(dot(result))
    else:
        sys.stdout.write(text(result, args.modules))
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
