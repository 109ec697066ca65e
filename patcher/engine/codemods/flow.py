"""Data flow inside one module: which name holds the target, the drafter, and which cache.

Steps that pick a call or a cache (``target-cache-config``, ``crop-compat``, ``wrap-call``)
decide by what flows where, never by how a variable is spelled:

* the **drafter** is a model called with ``target_hidden=`` (the target's hidden states),
  or given another model's embeddings or hidden states (``target.model.embed_tokens(...)``,
  ``target.get_input_embeddings()(...)``, ``out.hidden_states`` of another model's call),
  also positionally (``draft(hidden, ...)``, ``model.topk_generate(hidden, ...)``), or called with
  a cache already known to be the draft's, or passed to ``_ddpatch_runtime.draft_forward``;
* the **target** is the other model that a function holding a drafter calls with
  ``past_key_values=`` (or one passed to ``_ddpatch_runtime.verify_forward`` or ``adopt_forward``, or called
  with a cache already known to be the target's). A function with no drafter in sight
  names no target: a plain ``model(ids, past_key_values=cache)`` (transformers' own
  generation code is full of them) is nobody's target, unless ``seeds`` name it (a parameter
  callers elsewhere in the tree hand the target) or ``loaded_targets`` and it is a causal LM
  loaded in the function (``flow_tree.py``);
* the **target cache** is what the target receives as ``past_key_values=``, the **draft
  cache** what the drafter receives; any other cache-looking name (built by a ``*Cache(...)``
  call, a parameter called ``past_key_values`` or annotated as a cache, a receiver of
  ``.get_seq_length()``) is a plain cache.

Roles cross function boundaries inside the module in both directions: an argument gets the
roles of the parameter it binds to, and a parameter the roles of every argument bound to it
(iterated to a fixed point). ``v = factory(...)`` with a module function that returns a
``*Cache(...)`` makes ``v`` a cache, and the factory's creation is judged per call site.
A name that ends up both target and drafter is ambiguous and counts as neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import libcst as cst

from .base import CACHE_KEYWORDS, RUNTIME_MODULE, cache_keyword, dotted, keyword
from .flow_tree import holds_model, loaded_causal_lm, seeded_params

TARGET = "target"
DRAFTER = "drafter"
TARGET_CACHE = "target-cache"
DRAFT_CACHE = "draft-cache"
CACHE = "cache"
#: A model called with a cache, whose role is not known yet (a helper's parameter).
MODEL = "model"

#: Text a file needs for any role to exist in it (the steps' text prefilter).
ROLE_TRIGGER = r"target_hidden|embed_tokens|get_input_embeddings|hidden_states|" + RUNTIME_MODULE

#: Runtime wrappers that call their first argument: which role that argument has.
WRAPPERS = {"verify_forward": TARGET, "adopt_forward": TARGET, "draft_forward": DRAFTER}


@dataclass
class ModelCall:
    callee: str  # dotted name of the model called
    call: cst.Call  # the call node (the runtime wrapper's call when wrapped)
    cache: cst.BaseExpression | None  # what it receives as past_key_values=
    in_loop: bool
    wrapped: str | None = None  # runtime wrapper name, when already wrapped
    positional: bool = False  # a drafter found by the features it is given positionally, with no cache keyword


@dataclass(eq=False)
class Fn:
    node: cst.FunctionDef
    name: str
    owner: str | None  # enclosing class name
    params: list[str]  # positional order, self included
    kwonly: list[str]
    annotations: dict[str, str]
    assigns: dict[str, list[cst.BaseExpression]] = field(default_factory=dict)
    model_calls: list[ModelCall] = field(default_factory=list)
    #: calls of a parameter or a loaded model with positional arguments and no cache: drafters if fed features
    feature_calls: list[ModelCall] = field(default_factory=list)
    drafter_calls: list[str] = field(default_factory=list)
    local_calls: list[tuple["Fn", cst.Call, bool]] = field(default_factory=list)  # (callee, call, in_loop)
    returns: list[cst.BaseExpression] = field(default_factory=list)
    seq_length_receivers: set[str] = field(default_factory=set)
    roles: dict[str, set[str]] = field(default_factory=dict)
    #: parameter -> roles it only has because a caller passed something with them
    received: dict[str, set[str]] = field(default_factory=dict)
    #: var -> (factory, call) for ``var = factory(...)`` with a module function
    factory_uses: dict[str, list[tuple["Fn", cst.Call]]] = field(default_factory=dict)
    augments: dict[int, str] = field(default_factory=dict)  #: id of ``k`` in ``assigns`` for ``n += k`` -> the operator

    def role(self, name: str | None) -> set[str]:
        return self.roles.get(name, set()) if name else set()

    def add(self, name: str | None, *roles: str) -> bool:
        if not name:
            return False
        have = self.roles.setdefault(name, set())
        new = set(roles) - have
        have |= new
        return bool(new)

    @property
    def has_drafter(self) -> bool:
        return any(DRAFTER in r and TARGET not in r for r in self.roles.values())


def is_role(roles: set[str], role: str) -> bool:
    """``roles`` say ``role`` and not its opposite (a name that is both is ambiguous)."""
    opposite = {TARGET: DRAFTER, DRAFTER: TARGET, TARGET_CACHE: DRAFT_CACHE, DRAFT_CACHE: TARGET_CACHE}.get(role)
    return role in roles and opposite not in roles


def _param_names(node: cst.FunctionDef) -> tuple[list[str], list[str], dict[str, str]]:
    p = node.params
    positional = [x.name.value for x in [*p.posonly_params, *p.params]]
    kwonly = [x.name.value for x in p.kwonly_params]
    annotations = {}
    for x in [*p.posonly_params, *p.params, *p.kwonly_params]:
        if x.annotation is not None:
            ann = x.annotation.annotation
            if isinstance(ann, cst.SimpleString):
                annotations[x.name.value] = ann.evaluated_value if isinstance(ann.evaluated_value, str) else ""
            else:
                annotations[x.name.value] = dotted(ann) or ""
    return positional, kwonly, annotations


def names_in(expr: cst.CSTNode) -> Iterator[str]:
    """Every dotted name (and each of its prefixes) read in ``expr``."""
    found: list[str] = []

    class _V(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> bool:
            name = dotted(node)
            if name is None:
                return True
            parts = name.split(".")
            found.extend(".".join(parts[: i + 1]) for i in range(len(parts)))
            return False

        def visit_Name(self, node: cst.Name) -> None:
            found.append(node.value)

        def visit_Lambda(self, node: cst.Lambda) -> bool:
            return False

    expr.visit(_V())
    return iter(found)


class _Collect(cst.CSTVisitor):
    """Facts of one function body; nested functions and classes are collected on their own."""

    def __init__(self, flow: "ModuleFlow", fn: Fn) -> None:
        super().__init__()
        self.flow = flow
        self.fn = fn
        self.loops = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def _loop_in(self, node) -> None:
        self.loops += 1

    def _loop_out(self, node) -> None:
        self.loops -= 1

    visit_For = visit_While = _loop_in
    leave_For = leave_While = _loop_out

    def _assign(self, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        name = dotted(target)
        if name is not None:
            self.fn.assigns.setdefault(name, []).append(value)

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._assign(t.target, node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:
            self._assign(node.target, node.value)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._assign(node.target, node.value)  # ``n += k`` keeps what n was and adds k's flow (an offset, to crop-compat)
        self.fn.augments[id(node.value)] = type(node.operator).__name__

    def visit_Return(self, node: cst.Return) -> None:
        if node.value is not None:
            self.fn.returns.append(node.value)

    def visit_Call(self, node: cst.Call) -> None:
        fn = self.fn
        name = dotted(node.func)
        in_loop = self.loops > 0
        if name and name.endswith(".get_seq_length") and isinstance(node.func, cst.Attribute):
            if dotted(node.func.value):
                fn.seq_length_receivers.add(dotted(node.func.value))
        wrapper = None
        callee = name
        if name and name.startswith(RUNTIME_MODULE + ".") and name.split(".", 1)[1] in WRAPPERS and node.args:
            wrapper = name.split(".", 1)[1]
            callee = dotted(node.args[0].value)
        local = self.flow.resolve(fn, name) if name and not wrapper else None
        if local is not None:
            fn.local_calls.append((local, node, in_loop))
            return
        if callee is None:
            return
        drafts = keyword(node, "target_hidden") is not None
        if drafts:
            fn.drafter_calls.append(callee)
        cache = cache_keyword(node)
        if cache is not None or wrapper or drafts:
            fn.model_calls.append(ModelCall(callee, node, cache.value if cache else None, in_loop, wrapper))
        elif any(a.keyword is None and not a.star for a in node.args) and callee.split(".")[0] not in ("self", "cls"):
            fn.feature_calls.append(ModelCall(callee, node, None, in_loop, positional=True))


class ModuleFlow:
    """Roles of names in every function of a module (see the module docstring)."""

    def __init__(self, module: cst.Module, is_cache_call: Callable[[cst.BaseExpression], bool] | None = None,
                 seeds: dict[str, list] | None = None, loaded_targets: bool = False) -> None:
        self.is_cache_call = is_cache_call or _looks_like_cache_call
        self.seeds = seeds or {}
        self.loaded_targets = loaded_targets
        self.fns: list[Fn] = []
        self.by_node: dict[cst.FunctionDef, Fn] = {}
        self.by_name: dict[str, list[Fn]] = {}
        self.classes: dict[str, cst.ClassDef] = {}
        self._gather(module.body, None)
        for fn in self.fns:
            fn.node.body.visit(_Collect(self, fn))
        self._infer()

    # -- collection -----------------------------------------------------------------
    def _gather(self, body: Iterable[cst.CSTNode], owner: str | None) -> None:
        for stmt in body:
            if isinstance(stmt, cst.FunctionDef):
                positional, kwonly, annotations = _param_names(stmt)
                fn = Fn(stmt, stmt.name.value, owner, positional, kwonly, annotations)
                self.fns.append(fn)
                self.by_node[stmt] = fn
                self.by_name.setdefault(stmt.name.value, []).append(fn)
                self._gather(_block(stmt), None)
            elif isinstance(stmt, cst.ClassDef):
                self.classes.setdefault(stmt.name.value, stmt)
                self._gather(_block(stmt), stmt.name.value)
            elif isinstance(stmt, (cst.If, cst.Try, cst.With)):
                self._gather(_block(stmt), owner)

    def resolve(self, caller: Fn, name: str | None) -> Fn | None:
        """The module function a call spelled ``name`` reaches, if exactly one."""
        if not name:
            return None
        parts = name.split(".")
        if len(parts) == 1:
            found = [f for f in self.by_name.get(name, []) if f.owner is None]
        elif len(parts) == 2 and parts[0] in ("self", "cls") and caller.owner:
            found = [f for f in self.by_name.get(parts[1], []) if f.owner == caller.owner]
        else:
            return None
        return found[0] if len(found) == 1 else None

    @staticmethod
    def bind(callee: Fn, call: cst.Call, method_call: bool) -> list[tuple[str, cst.BaseExpression]]:
        """(parameter, argument) pairs of a call to a module function."""
        params = callee.params[1:] if method_call and callee.owner else callee.params
        out = []
        i = 0
        for arg in call.args:
            if arg.star:
                return out  # *args / **kwargs: the rest cannot be bound
            if arg.keyword is None:
                if i < len(params):
                    out.append((params[i], arg.value))
                i += 1
            elif arg.keyword.value in callee.params or arg.keyword.value in callee.kwonly:
                out.append((arg.keyword.value, arg.value))
        return out

    # -- inference --------------------------------------------------------------------
    def _infer(self) -> None:
        for fn in self.fns:
            for p in fn.params + fn.kwonly:
                ann = fn.annotations.get(p, "")
                if p.startswith("past_key_values") or ann.split(".")[-1].endswith("Cache"):
                    fn.add(p, CACHE)
            for p in seeded_params(fn, self.seeds):  # callers elsewhere in the tree hand it the target
                fn.add(p, TARGET)
                fn.received.setdefault(p, set()).add(TARGET)
        for _ in range(12):
            changed = False
            for fn in self.fns:
                changed |= self._local(fn)
            for fn in self.fns:
                changed |= self._across(fn)
            if not changed:
                break

    def _local(self, fn: Fn) -> bool:
        changed = False
        for callee in fn.drafter_calls:
            changed |= fn.add(callee, DRAFTER)
        for name in fn.seq_length_receivers:
            changed |= fn.add(name, CACHE)
        for var, values in fn.assigns.items():
            if any(self.is_cache_call(v) for v in values):
                changed |= fn.add(var, CACHE)
        if not fn.has_drafter:
            # models held in local names (a model's own submodules, `self.x(...)`, are layers, not a
            # drafter and a target), and only where a second one is called with a cache too
            local = [m for m in fn.model_calls if m.callee.split(".")[0] not in ("self", "cls")]
            with_cache = {m.callee for m in local if m.cache is not None}
            for mc in local:
                if mc.cache is None or len(with_cache - {mc.callee}) == 0 or fn.role(mc.callee) & {TARGET, DRAFTER}:
                    continue
                if self._fed_features(fn, mc):
                    changed |= fn.add(mc.callee, DRAFTER)
        for mc in fn.feature_calls:  # a drafter given the features positionally, with no cache keyword
            if mc not in fn.model_calls and holds_model(fn, mc.callee.split(".")[0]) and self._fed_features(fn, mc, True):
                changed |= fn.add(mc.callee, DRAFTER)
                fn.model_calls.append(mc)
        for mc in fn.model_calls if self.loaded_targets and not fn.has_drafter else ():  # a causal LM loaded here
            if mc.cache is not None and loaded_causal_lm(fn, mc.callee):
                changed |= fn.add(mc.callee, TARGET)
        for mc in fn.model_calls:
            cache = dotted(mc.cache) if mc.cache is not None else None
            if mc.wrapped:
                changed |= fn.add(mc.callee, WRAPPERS[mc.wrapped])
            if cache:
                changed |= fn.add(cache, CACHE)
            roles, cache_roles = fn.role(mc.callee), fn.role(cache)
            if is_role(roles, DRAFTER):
                changed |= fn.add(cache, DRAFT_CACHE)
            elif is_role(roles, TARGET):
                changed |= fn.add(cache, TARGET_CACHE)
            elif is_role(cache_roles, DRAFT_CACHE):
                changed |= fn.add(mc.callee, DRAFTER)
            elif is_role(cache_roles, TARGET_CACHE):
                changed |= fn.add(mc.callee, TARGET)
            elif fn.has_drafter and mc.cache is not None:
                changed |= fn.add(mc.callee, TARGET)
                changed |= fn.add(cache, TARGET_CACHE)
            elif mc.cache is not None:
                changed |= fn.add(mc.callee, MODEL)
        if fn.has_drafter:  # a model a helper calls with a cache, in a function that holds the drafter
            for name, roles in list(fn.roles.items()):
                if MODEL in roles and not roles & {TARGET, DRAFTER}:
                    changed |= fn.add(name, TARGET)
        return changed

    def _fed_features(self, fn: Fn, mc: ModelCall, other_heads: bool = False) -> bool:
        """Whether the call gives its model another model's embeddings or hidden states.

        That is what a drafter takes (DFlash: the target's embedding of the block and its
        hidden states); a verify takes token ids. Names are followed through the function's
        assignments, but not into another model call's arguments (its output is not the
        features it was given).
        """
        models = {m.callee for m in fn.model_calls}
        # the features must be those of another model called with a cache in this function
        # (with other_heads, not of the model's own head: `target.lm_head(out.hidden_states)` is no drafter)
        others = {m.callee for m in fn.model_calls if m.cache is not None and m.callee != mc.callee
                  and not (other_heads and m.callee.split(".")[0] == mc.callee.split(".")[0])}

        def producer(name: str) -> str | None:
            for value in fn.assigns.get(name, []):
                if isinstance(value, cst.Call) and dotted(value.func) in models:
                    return dotted(value.func)
            return None

        def reads(expr: cst.CSTNode, depth: int, seen: set) -> bool:
            found = []

            class _V(cst.CSTVisitor):
                def visit_Attribute(self, node: cst.Attribute) -> bool:
                    base = dotted(node.value)
                    if node.attr.value == "embed_tokens" and base and base.split(".")[0] in others:
                        found.append(node)
                    if node.attr.value == "hidden_states" and base and producer(base) in others:
                        found.append(node)
                    return True

                def visit_Call(self, node: cst.Call) -> bool:
                    func = node.func
                    if isinstance(func, cst.Attribute) and func.attr.value == "get_input_embeddings":
                        base = dotted(func.value)
                        if base and base.split(".")[0] in others:
                            found.append(node)
                    return dotted(func) not in models  # another model's output is not what it was fed

                def visit_Name(self, node: cst.Name) -> None:
                    if depth and node.value in fn.assigns and node.value not in seen:
                        seen.add(node.value)
                        for value in fn.assigns[node.value]:
                            if reads(value, depth - 1, seen):
                                found.append(node)

            expr.visit(_V())
            return bool(found)

        return any(reads(arg.value, 6, set()) for arg in mc.call.args if arg.keyword is None or arg.keyword.value not in CACHE_KEYWORDS)

    def _across(self, fn: Fn) -> bool:
        changed = False
        for callee, call, _loop in fn.local_calls:
            method = isinstance(call.func, cst.Attribute)
            for param, arg in self.bind(callee, call, method):
                name = dotted(arg)
                if name is None:
                    continue
                # a callee gives back only what it found itself: a factory called with the
                # target and with the drafter must not make either of them both
                mine = fn.role(name)
                theirs = callee.role(param) - callee.received.get(param, set())
                if theirs - mine:
                    changed |= fn.add(name, *theirs)
                new = mine - callee.role(param)
                if new:
                    callee.received.setdefault(param, set()).update(new)
                    changed |= callee.add(param, *new)
        for var, values in fn.assigns.items():
            for value in values:
                if isinstance(value, cst.Call):
                    factory = self.resolve(fn, dotted(value.func))
                    if factory is not None and self.creations(factory):
                        uses = fn.factory_uses.setdefault(var, [])
                        if all(c is not value for _f, c in uses):
                            uses.append((factory, value))
                        changed |= fn.add(var, CACHE)
        return changed

    # -- queries ----------------------------------------------------------------------
    def creations(self, fn: Fn) -> list[cst.Call]:
        """``*Cache(...)`` calls a function returns, directly or through a local name."""
        out = []
        for value in fn.returns:
            if self.is_cache_call(value):
                out.append(value)
            else:
                name = dotted(value)
                out += [v for v in fn.assigns.get(name, []) if self.is_cache_call(v)] if name else []
        return out

    def roles_of(self, fn: Fn, expr: cst.CSTNode, env: dict[str, set[str]] | None = None, _seen=None) -> set[str]:
        """Roles of every name ``expr`` reads, following local assignments (``env`` overrides)."""
        seen = _seen if _seen is not None else set()
        out: set[str] = set()
        for name in names_in(expr):
            if env is not None and name in env:
                out |= env[name]
                continue
            out |= fn.role(name)
            if name not in seen and name in fn.assigns:
                seen.add(name)
                for value in fn.assigns[name]:
                    out |= self.roles_of(fn, value, env, seen)
        if isinstance(expr, cst.Call):
            helper = self.resolve(fn, dotted(expr.func))
            if helper is not None:  # a helper's result carries what its arguments carry
                for _p, arg in self.bind(helper, expr, isinstance(expr.func, cst.Attribute)):
                    out |= self.roles_of(fn, arg, env, seen)
        return out

    def enclosing(self, node: cst.CSTNode) -> Fn | None:
        for fn in self.fns:
            if fn.node is node:
                return fn
        return None

    def callers(self, callee: Fn) -> Iterator[tuple[Fn, cst.Call, bool]]:
        for fn in self.fns:
            for c, call, in_loop in fn.local_calls:
                if c is callee:
                    yield fn, call, in_loop


def _block(node) -> list:
    body = getattr(node, "body", None)
    stmts = list(body.body) if isinstance(body, (cst.IndentedBlock, cst.SimpleStatementSuite)) else []
    for extra in ("orelse", "finalbody"):
        part = getattr(node, extra, None)
        if part is not None and hasattr(part, "body"):
            stmts += _block(part)
    for handler in getattr(node, "handlers", ()) or ():
        stmts += _block(handler)
    return stmts


def _looks_like_cache_call(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Call) and (dotted(node.func) or "").split(".")[-1].endswith("Cache")
