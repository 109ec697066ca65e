"""What one function of the tree is, read statically (``decoder_code`` puts a decoder and its helpers together):

* **lines**: the statements of the function (nested functions included) that the compiler gives code to (the
  line table of its code objects: docstrings, ``else:`` and ``global`` have none), counted once per statement;
* **branches** (``Arm``): each ``if``/``elif``/``else`` arm, loop body and loop ``else``, ``except`` handler, ``try``
  ``else``, ``match`` case and nested function body, with the names its test reads;
* where those names come from: the locals assigned from a parameter, directly or through a conversion
  (``uses_draft = block_size > 1``, ``stops = torch.tensor(stop_ids)``); what any other call returns is data;
* **sites** that can change tokens or caches: a model or drafter call, a cache call (``crop``, ``update``...) or a new
  cache, an edit of a cache's layers (``layer.keys = ...``, ``store[...] = ...`` on a cache tensor), a ddpatch
  runtime call (the sites a recipe step rewrote), a call with a cache.

Stdlib only (``ast`` and ``compile``); nothing of the tree is imported or run.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from .binding import ROLE_NAMES
from .decoders import CACHE_KEYWORDS
from .reach import Tree

#: cache methods that change what a cache holds (reading its length is no change)
CACHE_CALLS = ("crop", "update", "reorder_cache", "batch_select_indices", "batch_repeat_interleave", "reset", "trim",
               "lazy_initialization", "from_legacy_cache", "to_legacy_cache", "update_conv_state", "update_recurrent_state")
#: attributes that are a cache's per-layer storage: writing them (or into them) edits the cache by hand
LAYER_ATTRS = ("keys", "values", "key_cache", "value_cache", "layers", "conv_states", "recurrent_states", "ssm_states")
CACHE_NAME = re.compile(r"cache|past_key_values|past_kv|kv_", re.I)
MODEL_ANNOTATION = re.compile(r"Draft|DFlash|ForCausalLM|PreTrainedModel|nn\.Module|Model\b")
MODEL_GETTERS = ("get_input_embeddings", "get_output_embeddings", "get_decoder", "get_encoder")
RUNTIME = "_ddpatch_runtime"
#: roles whose parameters are modes the verifier may set for a run (the others carry its fixed inputs)
MODE_ROLES = ("block_size",)
#: roles that carry data rather than a choice: a branch on the model or the prompt is data-dependent
DATA_ROLES = ("draft", "target", "input_ids", "mask_token_id")


@dataclass
class Arm:
    kind: str  # if, elif, else, loop, loop-else, except, try-else, case, def
    line: int  # the line of its test (for else: its first statement)
    first: int
    last: int
    names: frozenset  # what its test reads (for else and elif: the tests before it too)
    test: str  # the test, as written (shortened)
    exits: bool = False  # its last statement leaves the block (return, raise, break, continue)


@dataclass
class Code:
    """One function of the tree."""

    key: tuple
    params: list
    statements: dict  # first line of an executable statement -> its own lines (a compound statement: its header)
    arms: list  # Arm
    sites: dict  # statement -> what in it can change tokens or caches
    calls: list  # (statement, callee key, call node)
    deps: dict  # name -> names its assignments read
    defaults: dict = field(default_factory=dict)
    annotations: dict = field(default_factory=dict)  # parameter -> annotation node
    node: ast.AST | None = None

    @property
    def where(self) -> str:
        return f"{self.key[0]}:{self.key[1]}"

    def arm_statements(self, arm: Arm) -> list[int]:
        return sorted(s for s in self.statements if arm.first <= s <= arm.last)

    def from_params(self, names) -> set:
        """The parameters ``names`` come from, directly or through the locals assigned from them."""
        seen, queue = set(), list(names)
        while queue:
            n = queue.pop()
            if n in seen:
                continue
            seen.add(n)
            queue += self.deps.get(n, ())
        return {p for p in self.params if p in seen}


# ----------------------------------------------------------------------------- one function
def names_in(node) -> set:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} if node is not None else set()


def _own_parts(stmt) -> list:
    """The expressions of a statement itself: a simple statement whole, a compound statement's header."""
    if isinstance(stmt, (ast.If, ast.While)):
        return [stmt.test]
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        return [stmt.target, stmt.iter]
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return list(stmt.items)
    if isinstance(stmt, ast.Match):
        return [stmt.subject]
    if isinstance(stmt, ast.ExceptHandler):
        return [stmt.type] if stmt.type is not None else []
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return list(stmt.decorator_list)
    if isinstance(stmt, (ast.Try, getattr(ast, "TryStar", ast.Try))):
        return []
    return [stmt]


def _own_lines(stmt) -> tuple:
    parts = [p for p in _own_parts(stmt) if hasattr(p, "lineno")]
    if not isinstance(stmt, (ast.If, ast.While, ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.Match, ast.ExceptHandler,
                             ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Try, getattr(ast, "TryStar", ast.Try))):
        return tuple(range(stmt.lineno, stmt.end_lineno + 1))
    first = min([stmt.lineno] + [p.lineno for p in parts])
    last = max([stmt.lineno] + [p.end_lineno for p in parts])
    return tuple(range(first, last + 1))


def _code_lines(tree: Tree, key, node) -> set:
    """The lines the compiler gives code to in the function (its nested code objects included)."""
    cache = tree.__dict__.setdefault("_compiled", {})
    if key[0] not in cache:
        mod = tree.module(key[0])
        try:
            cache[key[0]] = compile(mod.source, key[0], "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
            cache[key[0]] = None
    top = cache[key[0]]
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    stack, found = [top] if top is not None else [], None
    while stack and found is None:
        co = stack.pop()
        if co.co_name == node.name and co.co_firstlineno == first:
            found = co
            break
        stack += [c for c in co.co_consts if hasattr(c, "co_lines")]
    if found is None:  # no code object: count every statement
        return set(range(node.lineno, node.end_lineno + 1))
    lines, stack = set(), [found]
    while stack:
        co = stack.pop()
        lines |= {ln for _, _, ln in co.co_lines() if ln is not None}
        stack += [c for c in co.co_consts if hasattr(c, "co_lines")]
    return lines - {found.co_firstlineno, node.lineno}  # the function's own entry is its caller's line


def _is_elif(node: ast.If, lines: list) -> bool:
    return 0 < node.lineno <= len(lines) and lines[node.lineno - 1].lstrip().startswith("elif")


def short(node, width: int = 60) -> str:
    try:
        text = " ".join(ast.unparse(node).split())
    except Exception:
        return "?"
    return text if len(text) <= width else text[: width - 3] + "..."


def _arms(fn, source_lines: list) -> list:
    out, elifs = [], set()

    def span(body) -> tuple:
        return body[0].lineno, max(s.end_lineno for s in body)

    def add(kind, line, names, test, body):
        if body:
            first, last = span(body)
            exits = isinstance(body[-1], (ast.Return, ast.Raise, ast.Break, ast.Continue))
            out.append(Arm(kind, line, first, last, frozenset(names), test, exits))

    for node in ast.walk(fn):
        if node is fn:
            continue
        if isinstance(node, ast.If) and id(node) not in elifs:
            prior, cur, kind = set(), node, "if"
            while True:
                names = prior | names_in(cur.test)
                add(kind, cur.lineno, names, short(cur.test), cur.body)
                prior = names
                if len(cur.orelse) == 1 and isinstance(cur.orelse[0], ast.If) and _is_elif(cur.orelse[0], source_lines):
                    cur, kind = cur.orelse[0], "elif"
                    elifs.add(id(cur))
                    continue
                add("else", cur.orelse[0].lineno if cur.orelse else cur.lineno, prior, f"not ({short(cur.test, 50)})", cur.orelse)
                break
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            test = node.test if isinstance(node, ast.While) else node.iter
            add("loop", node.lineno, names_in(test), short(test), node.body)
            add("loop-else", node.orelse[0].lineno if node.orelse else node.lineno, names_in(test), short(test), node.orelse)
        elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            for h in node.handlers:
                add("except", h.lineno, set(), f"except {short(h.type) if h.type is not None else ''}".strip(), h.body)
            add("try-else", node.orelse[0].lineno if node.orelse else node.lineno, set(), "no exception", node.orelse)
        elif isinstance(node, ast.Match):
            for case in node.cases:
                add("case", case.pattern.lineno, names_in(node.subject) | names_in(case.guard), short(case.pattern), case.body)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            add("def", node.lineno, set(), f"def {node.name}", node.body)
    return sorted(out, key=lambda a: (a.first, -a.last))


#: calls whose result still carries what their arguments said (a conversion, a length): a local assigned from
#: ``len(stop_ids)`` or ``torch.tensor(stop_ids)`` still comes from ``stop_ids``; from any other call it is data
PURE_CALLS = ("bool", "int", "float", "str", "len", "min", "max", "abs", "tuple", "list", "set", "frozenset", "sorted",
              "isinstance", "getattr", "hasattr", "tensor", "as_tensor", "lower", "upper", "strip", "get")


def flow_names(value) -> set:
    """The names whose value flows into ``value``: what a call other than a conversion returns is data."""
    out, stack = set(), [value]
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Name):
            out.add(n.id)
            continue
        if isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name not in PURE_CALLS:
                continue
            stack += [*n.args, *(k.value for k in n.keywords)] + ([f.value] if isinstance(f, ast.Attribute) else [])
            continue
        stack += list(ast.iter_child_nodes(n))
    return out


def _stored(target) -> set:
    """The local a store writes: ``x``, the root of ``x[i]`` / ``x.a``, each of a tuple's."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_stored(e) for e in target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return _stored(target.value)
    root = root_name(target)
    return {root} if root else set()


def _deps(fn) -> dict:
    deps: dict = {}

    def flow(targets, value):
        for t in targets:
            for n in _stored(t):
                deps.setdefault(n, set()).update(flow_names(value))

    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            flow(node.targets, node.value)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            flow([node.target], node.value)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            flow([node.target], node.iter)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            flow([node.optional_vars], node.context_expr)
        elif isinstance(node, ast.NamedExpr):
            flow([node.target], node.value)
    return deps


def _params(fn) -> tuple[list, dict, dict]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = {p.arg: d for p, d in zip(positional[len(positional) - len(a.defaults):], a.defaults)}
    defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    params = [p.arg for p in (*positional, *a.kwonlyargs)]
    return params, defaults, {p.arg: p.annotation for p in (*positional, *a.kwonlyargs) if p.annotation is not None}


def analyse(tree: Tree, key) -> Code | None:
    """The static facts of the tree's function ``key`` (``(file, qualname)``), or None where it cannot be read."""
    node, mod = tree.function(key), tree.module(key[0])
    if node is None or mod is None:
        return None
    executable = _code_lines(tree, key, node)
    statements: dict = {}
    for sub in ast.walk(node):
        if sub is node or not isinstance(sub, (ast.stmt, ast.ExceptHandler)):
            continue
        own = _own_lines(sub)
        if executable & set(own):
            statements[sub.lineno] = own
    params, defaults, annotations = _params(node)
    code = Code(key, params, statements, _arms(node, mod.source.splitlines()), {}, [], _deps(node), defaults, annotations, node)
    return code


def root_name(node):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _chain_has_layer_attr(node) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute) and node.attr in LAYER_ATTRS:
            return node.attr
        node = node.value
    return None


def statement_sites(stmt, models: set, caches: set) -> list[str]:
    """What in one statement (its own expressions) can change tokens or caches."""
    out = []
    for part in _own_parts(stmt):
        for n in ast.walk(part):
            if isinstance(n, ast.Call):
                root, func = root_name(n.func), n.func
                attr = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                if root == RUNTIME:
                    out.append(f"a ddpatch runtime call ({short(func, 40)})")
                elif root in models:
                    out.append(f"a model call ({short(func, 40)})")
                elif attr in CACHE_CALLS:
                    out.append(f"a cache call (.{attr})")
                elif attr.endswith("Cache") and attr[:1].isupper():
                    out.append(f"a new cache ({attr})")
                elif any(k.arg in CACHE_KEYWORDS for k in n.keywords):
                    out.append(f"a call with a cache ({short(func, 40)})")
                elif attr.endswith("_") and not attr.endswith("__") and (root in caches or _chain_has_layer_attr(func.value)):
                    out.append(f"a cache-layer edit ({short(func, 40)})")
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for sub in ast.walk(t):
                    if not isinstance(sub, (ast.Attribute, ast.Subscript)) or not isinstance(getattr(sub, "ctx", None), ast.Store):
                        continue
                    if _chain_has_layer_attr(sub) or root_name(sub) in caches:
                        out.append(f"a cache-layer edit ({short(sub, 40)})")
    return list(dict.fromkeys(out))


def model_params(code: Code) -> set:
    """The parameters that hold the target or the drafter (by name, as the binding reads them, or annotation)."""
    names = set(ROLE_NAMES["draft"]) | set(ROLE_NAMES["target"])
    out = {p for p in code.params if p.lower() in names}
    for p, ann in code.annotations.items():
        text = ann.value if isinstance(ann, ast.Constant) and isinstance(ann.value, str) else short(ann, 200)
        if MODEL_ANNOTATION.search(text):
            out.add(p)
    return out


def _chain_of(value, roots: set, layer_attrs: bool) -> bool:
    """``value`` reads through one of ``roots`` (``cache.layers[i]``, ``getattr(layer, "keys")``, a tuple of those), or
    through a cache's per-layer storage (``layer.keys``) where ``layer_attrs``."""
    if isinstance(value, (ast.Tuple, ast.List)):
        return any(_chain_of(e, roots, layer_attrs) for e in value.elts)
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "getattr" and value.args:
        return _chain_of(value.args[0], roots, layer_attrs) or layer_attrs
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in MODEL_GETTERS:
        return _chain_of(value.func.value, roots, layer_attrs)
    if not isinstance(value, (ast.Name, ast.Attribute, ast.Subscript)):
        return False
    return root_name(value) in roots or (layer_attrs and _chain_has_layer_attr(value) is not None)


def aliases(code: Code, roots: set, of_caches: bool = False) -> set:
    """``roots`` and the locals that hold one of them or a part of one: a model's attribute or getter
    (``embed = target.get_input_embeddings()``); for caches (``of_caches``), the locals named like a cache and what is
    read out of a cache's layers (``for layer in cache.layers``, ``for store in (layer.keys, layer.values)``)."""
    out = set(roots)
    if of_caches:
        out |= {n for n in code.deps if CACHE_NAME.search(n)} | {p for p in code.params if CACHE_NAME.search(p)}
    pairs = []
    for node in ast.walk(code.node):
        if isinstance(node, ast.Assign):
            pairs += [(t, node.value) for t in node.targets]
        elif isinstance(node, (ast.For, ast.comprehension)):
            pairs.append((node.target, node.iter))
    grown = True
    while grown:
        grown = False
        for target, value in pairs:
            if isinstance(target, ast.Name) and target.id not in out and _chain_of(value, out, of_caches):
                out.add(target.id)
                grown = True
    return out
