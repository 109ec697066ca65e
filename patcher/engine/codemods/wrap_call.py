"""WrapCall: route the target's (or the drafter's) call through a runtime helper that takes the model first.

The call to wrap is picked by data flow (``flow.py``), never by a variable's name: with
``role = "target"`` the model whose cache is the target cache (the one a function holding
a drafter calls with ``past_key_values=``), with ``role = "drafter"`` the model given
``target_hidden=`` (or the draft cache). Only calls inside a decode loop are wrapped (or in
a helper of the module that is only called from inside loops); the prefill is left alone.

* ``verify-forward`` (``role = "target"``, ``helper = "verify_forward"``): on a hybrid
  target the verify must leave a record on the cache so that every later cut of that
  cache commits exactly the accepted tokens (the runtime makes the cache's own ``crop``
  commit it). ``target(ids, past_key_values=cache, ...)`` in the loop becomes
  ``_ddpatch_runtime.verify_forward(target, ids, past_key_values=cache, ...)``.
* ``draft-sliding-window`` (``role = "drafter"``, ``helper = "draft_forward"``): the draft
  call gets explicit sliding-window masks when flash-attn is not in use.

Statuses and the evidence each rests on:

* ``applied`` -- a call in a decode loop whose callee has the role (and not the other
  one) was wrapped.
* ``already-applied`` / ``fixed-upstream`` -- the call already goes through the helper
  (``already-applied`` with ddpatch's provenance line).
* ``fixed-upstream`` (drafter only) -- the drafter's class, found in the tree, builds its
  own sliding-window masks: its ``forward`` calls a sliding-window mask builder (a
  function whose name has both "sliding" and "mask", such as transformers'
  ``create_sliding_window_causal_mask``) AND hands its layers a mask picked per layer
  type (``attention_mask=<masks>[... attention_type ...]`` or ``[... layer_types ...]``).
  The class is the enclosing class for ``self``, the parameter's annotation, the class a
  local name is built from, or else every class in the tree whose ``forward`` takes
  ``target_hidden`` (all of them must have the evidence). Wrapping such a draft would
  mask it twice.
* ``fixed-upstream`` (drafter only) -- every windowed attention the drafter's class builds
  (through its layers: the classes whose ``__init__`` sets ``self.sliding_window``) builds
  its own sliding-window mask when it is given none: its ``forward`` assigns
  ``attention_mask`` under ``if attention_mask is None`` from a value that reads
  ``sliding_window`` (DFlash's newest drafter, causal on its sliding layers). Wrapping it
  would replace the mask the drafter was trained with; at run time ``draft_forward`` also
  leaves such a module (and any module handed a mask by its parent) alone.
* ``no-match`` -- an anchor where no call has the role: the target's verify is not found
  by data flow, so nothing makes the crops exact (verify-forward is the lossless step).
"""

from __future__ import annotations

import ast
import re

import libcst as cst

from .base import APPLIED, CACHE_KEYWORDS, FIXED_UPSTREAM, NO_MATCH, PATCHED, Example, Step, is_runtime_call, runtime_call
from .flow import ROLE_TRIGGER, DRAFTER, TARGET, Fn, ModelCall, ModuleFlow, is_role
from .drafter_methods import plain_methods
from .flow_prefilter import may_have_roles

_MASK_BUILDER = re.compile(r"sliding\w*mask|mask\w*sliding", re.I)
_PER_TYPE = re.compile(r"attention_type|layer_type")  # also layer_types


def _ast_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _ast_name(node.func)
    return ""


def masks_itself(cls: ast.ClassDef) -> str | None:
    """Evidence that a model class builds its own per-layer-type sliding-window masks, or None.

    Both must hold in the class's ``forward``: (a) some call hands a layer
    ``attention_mask=`` a value picked per layer type -- a subscript whose index reads
    ``attention_type`` / ``layer_type(s)``, directly or through a local name; (b) the class
    builds a sliding-window mask itself -- ``forward``, or a method it calls as
    ``self.<method>(...)``, calls a function whose name has "sliding" and "mask" or reads
    ``sliding_window``.
    """
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    forward = methods.get("forward")
    if forward is None:
        return None
    assigned: dict[str, list[ast.expr]] = {}
    for node in ast.walk(forward):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)

    def per_type(expr: ast.expr, seen: set) -> str | None:
        for node in ast.walk(expr):
            if isinstance(node, ast.Subscript) and _PER_TYPE.search(ast.unparse(node.slice)):
                return ast.unparse(node)
            if isinstance(node, ast.Name) and node.id in assigned and node.id not in seen:
                seen.add(node.id)
                for value in assigned[node.id]:
                    found = per_type(value, seen)
                    if found:
                        return found
        return None

    def builds_sliding(fn: ast.FunctionDef) -> str | None:
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and _MASK_BUILDER.search(_ast_name(node.func)):
                return _ast_name(node.func)
        return f"{cls.name}.{fn.name}" if "sliding_window" in ast.unparse(fn) else None

    chosen = None
    for node in ast.walk(forward):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "attention_mask":
                    chosen = chosen or per_type(kw.value, set())
    if chosen is None:
        return None
    helpers = [forward] + [
        methods[n.func.attr] for n in ast.walk(forward)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "self" and n.func.attr in methods
    ]
    builder = next((b for b in map(builds_sliding, helpers) if b), None)
    if builder is None:
        return None
    return f"`{cls.name}.forward` builds its sliding-window masks (`{builder}`) and gives each layer its type's mask (`{chosen}`)"


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _built_classes(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> list[ast.ClassDef]:
    """``cls`` and every class of the module its ``__init__`` builds, transitively (its layers, their attention)."""
    found, todo = {cls.name: cls}, [cls]
    while todo:
        init = _method(todo.pop(), "__init__")
        for node in ast.walk(init) if init is not None else ():
            name = _ast_name(node.func) if isinstance(node, ast.Call) else ""
            if name in classes and name not in found:
                found[name] = classes[name]
                todo.append(classes[name])
    return list(found.values())


def _is_none_test(test: ast.expr, name: str) -> bool:
    return any(
        isinstance(n, ast.Compare) and isinstance(n.left, ast.Name) and n.left.id == name
        and isinstance(n.ops[0], ast.Is) and isinstance(n.comparators[0], ast.Constant) and n.comparators[0].value is None
        for n in ast.walk(test)
    )


def builds_mask_when_none(cls: ast.ClassDef) -> str | None:
    """Evidence that an attention class builds its own sliding-window mask when none is passed, or None.

    Its ``forward`` takes ``attention_mask`` and, under ``if attention_mask is None ...:``,
    assigns ``attention_mask`` a value that reads ``sliding_window`` or calls a sliding-mask
    builder (DFlash's newest drafter: ``_attention_mask(q, k, is_causal=..., sliding_window=...)``).
    """
    forward = _method(cls, "forward")
    if forward is None or "attention_mask" not in [a.arg for a in forward.args.args + forward.args.kwonlyargs]:
        return None
    for node in ast.walk(forward):
        if isinstance(node, ast.If) and _is_none_test(node.test, "attention_mask"):
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "attention_mask" for t in stmt.targets)
                    and ("sliding_window" in ast.unparse(stmt.value) or _MASK_BUILDER.search(_ast_name(stmt.value)))
                ):
                    return f"`{cls.name}.forward` builds its own sliding-window mask when none is passed (`{ast.unparse(stmt.value)[:80]}`)"
    return None


def attention_masks_itself(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> str | None:
    """Evidence that every windowed attention the drafter ``cls`` builds masks itself when given no mask.

    The windowed attentions are the classes ``cls`` builds (through its layers) that set
    ``self.sliding_window`` -- the modules ``draft_forward`` would give a mask. Every one of
    them must have the evidence of ``builds_mask_when_none``: wrapping such a draft would
    replace the mask upstream's drafter builds for itself (causal on its sliding layers, say).
    """
    windowed = [
        c for c in _built_classes(cls, classes)
        if (init := _method(c, "__init__")) is not None and any(
            isinstance(n, ast.Attribute) and n.attr == "sliding_window" and isinstance(n.ctx, ast.Store) for n in ast.walk(init)
        )
    ]
    evidence = [builds_mask_when_none(c) for c in windowed]
    if not windowed or not all(evidence):
        return None
    return "; ".join(sorted(set(evidence)))


def drafter_classes(tree: ast.Module) -> dict[str, str]:
    """Classes whose ``forward`` takes ``target_hidden``, each with its self-masking evidence ("" if none)."""
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    out = {}
    for node in classes.values():
        forward = _method(node, "forward")
        if forward is not None and any(a.arg == "target_hidden" for a in forward.args.args + forward.args.kwonlyargs):
            out[node.name] = masks_itself(node) or attention_masks_itself(node, classes) or ""
    return out


def drafter_forwards(tree: ast.Module) -> dict[str, dict]:
    """Classes whose ``forward`` takes ``target_hidden``: the parameters a call of the model binds positionally
    (None when ``forward`` takes ``*args`` or positional-only ones) and the class's other methods."""
    out = {}
    for node in ast.walk(tree):
        forward = _method(node, "forward") if isinstance(node, ast.ClassDef) else None
        args = forward.args if forward is not None else None
        if args is None or not any(a.arg == "target_hidden" for a in args.args + args.kwonlyargs):
            continue
        params = None if args.vararg or args.posonlyargs else [a.arg for a in args.args[1:]]
        methods = sorted(n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name != "forward")
        out[node.name] = {"params": params, "methods": methods, "plain": plain_methods(node)}
    return out


def _keyword_arg(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(value=value, keyword=cst.Name(name), equal=cst.AssignEqual(
        whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))


class WrapCall(Step):
    ID = "wrap-call"
    DESCRIPTION = "Route the target's (or drafter's) call in a decode loop, found by data flow, through a runtime helper."
    TRIGGERS = ()
    PARAMS = {"role": "target", "helper": "verify_forward", "in_loop": True, "drafter_classes": {}, "drafter_forwards": {}}
    USES_RUNTIME = True
    EXAMPLES = (
        Example(
            """
            def generate(draft, model, ids, cache, draft_cache):
                out = model(ids, past_key_values=cache)
                while True:
                    hidden = draft(target_hidden=out.hidden_states, past_key_values=draft_cache)
                    out = model(ids, past_key_values=cache, use_cache=True)
            """,
            """
            import _ddpatch_runtime

            def generate(draft, model, ids, cache, draft_cache):
                out = model(ids, past_key_values=cache)
                while True:
                    hidden = draft(target_hidden=out.hidden_states, past_key_values=draft_cache)
                    out = _ddpatch_runtime.verify_forward(model, ids, past_key_values=cache, use_cache=True)
            """,
            "the target is the model that is not given target_hidden, whatever it is called; the prefill is not a verify",
            {"role": "target"},
        ),
        Example(
            """
            def generate(draft, model, ids, cache, draft_cache):
                out = model(ids, past_key_values=cache)
                while True:
                    hidden = draft(target_hidden=out.hidden_states, past_key_values=draft_cache)
                    out = model(ids, past_key_values=cache, use_cache=True)
            """,
            """
            import _ddpatch_runtime

            def generate(draft, model, ids, cache, draft_cache):
                out = model(ids, past_key_values=cache)
                while True:
                    hidden = _ddpatch_runtime.draft_forward(draft, target_hidden=out.hidden_states, past_key_values=draft_cache)
                    out = model(ids, past_key_values=cache, use_cache=True)
            """,
            "the drafter is the model given target_hidden=; its call in the loop gets the sliding-window masks",
            {"role": "drafter", "helper": "draft_forward"},
        ),
    )

    @classmethod
    def triggers(cls, params) -> tuple[str, ...]:
        return (ROLE_TRIGGER,)

    @classmethod
    def may_match(cls, tree: ast.Module, params) -> bool:
        return may_have_roles(tree)  # no role, no site (flow.py)

    @classmethod
    def scan_tree(cls, sources: dict[str, str], params) -> dict:
        """The tree's drafter classes and whether each builds its own sliding masks (for ``role = "drafter"``)."""
        if params["role"] != DRAFTER:
            return {}
        found: dict[str, str] = {}
        forwards: dict[str, dict] = {}
        for text in sources.values():
            if "target_hidden" not in text:
                continue
            try:
                tree = ast.parse(text)
            except (SyntaxError, ValueError, RecursionError):
                continue
            found.update(drafter_classes(tree))
            forwards.update(drafter_forwards(tree))
        return {"drafter_classes": found, "drafter_forwards": forwards}

    TREE_TRIGGER = "target_hidden"

    @classmethod
    def near_miss(cls, text: str, function: str, params: dict) -> str | None:
        """A model the decoder's class holds (``self.model(..., past_key_values=...)`` in a method), which data flow
        cannot name from that method: the class and what to do, for the anchor's no-match."""
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError):
            return None
        found = []
        for owner in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for method in (m for m in owner.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))):
                for call in (c for c in ast.walk(method) if isinstance(c, ast.Call)):
                    callee = ast.unparse(call.func)
                    if callee.startswith("self.") and any(k.arg in CACHE_KEYWORDS for k in call.keywords):
                        found.append((owner.name, method.name, callee, call.lineno))
        drafters = drafter_classes(tree)  # a drafter's own forward calling its layers is no verify
        found = [f for f in found if f[0] not in drafters]
        if not found:
            return None
        cls_name, method, callee, line = found[0]
        what = "the verify" if params["role"] == TARGET else "the draft call"
        helper = params["helper"]
        return (f"{what} looks like `{callee}(...)` in `{cls_name}.{method}` (line {line}), a model the class holds: data flow "
                f"reads one function, and `{cls_name}.{method}` calls no {'drafter' if params['role'] == TARGET else 'target'} "
                f"beside it, so ddpatch cannot route it; route it yourself, `_ddpatch_runtime.{helper}({callee}, ...)` "
                "(`apply --allow-partial` copies the runtime), then prove the tree with `ddpatch verify`")

    def __init__(self, context, **params) -> None:
        super().__init__(context, **params)
        self.flow: ModuleFlow | None = None
        self.wrap: dict[cst.Call, tuple[str, str, list[str] | None]] = {}
        self._tree: ast.Module | None = None
        self._module: cst.Module | None = None
        self._classes: dict[str, str] | None = None

    def visit_Module(self, node: cst.Module) -> bool:
        self._module = node
        self.flow = ModuleFlow(node)
        role = self.params["role"]
        for fn in self.flow.fns:
            if self._inside_drafter(fn):
                continue  # the drafter's own forward calling its layers is the drafter, not the decode loop
            plain, found = [], False  # a drafter method without attention answers for nothing: the drafter's own call must be found
            for mc in fn.model_calls:
                found = found or bool(role == DRAFTER and mc.wrapped and is_role(fn.role(mc.callee), role))
                # a target call that only goes through ``adopt_forward`` (target-cache-config) is
                # still a verify to record: in a decode loop it becomes ``verify_forward``, which adopts too
                upgrade = role == TARGET and mc.wrapped == "adopt_forward" and self.params["helper"] == "verify_forward"
                if not is_role(fn.role(mc.callee), role) or (mc.wrapped and not upgrade):
                    continue
                if role == TARGET and mc.cache is None:
                    continue
                if self.params["in_loop"] and not (mc.in_loop or self._only_called_in_loops(fn)):
                    continue
                if role == DRAFTER and self._plain(fn, mc):
                    plain.append(mc)  # a drafter's method that runs no attention (a projection and a norm): nothing windowed
                    continue
                found = True
                evidence = self._masks_itself(fn, mc) if role == DRAFTER else None
                keywords, refusal = self._positional(fn, mc) if role == DRAFTER and not evidence else (None, None)
                if evidence:
                    self.record(mc.call, FIXED_UPSTREAM, f"the drafter builds its own sliding-window masks: {evidence}", function=fn.name)
                elif refusal:
                    self.record(mc.call, NO_MATCH, refusal, function=fn.name)
                else:
                    # say where the call is, not what the loop is: `for layer in self.layers` is a loop, not the decode loop
                    where = f"in a loop of `{fn.name}`" if mc.in_loop or not self.params["in_loop"] else f"in `{fn.name}` (called only from loops)"
                    self.wrap[mc.call] = (mc.callee, where, keywords)
            if plain and not found:
                self.record(plain[0].call, NO_MATCH, f"the drafter is reached in `{fn.name}` only through `{plain[0].callee}(...)`, "
                            "which runs no attention; the call that runs its layers is not one data flow reads: route it through "
                            "`_ddpatch_runtime.draft_forward` by hand, then prove the tree with `ddpatch verify`", function=fn.name)
        return True

    def _positional(self, fn: Fn, mc: ModelCall) -> tuple[list[str] | None, str | None]:
        """For a drafter call with positional arguments: the parameter names they bind to (``draft_forward`` reads
        ``position_ids=`` and the cache by keyword), or why the call cannot be routed."""
        positional = [a for a in mc.call.args if a.keyword is None]
        forwards = {**(self.params["drafter_forwards"] or {}), **drafter_forwards(self._ast())}
        head, _, attr = mc.callee.partition(".")
        if head in ("self", "cls"):  # `self.draft(...)`: a model the class holds, called itself
            head, attr = mc.callee, ""
        name = self._drafter_class(fn, ModelCall(head, mc.call, mc.cache, mc.in_loop)) if attr else self._drafter_class(fn, mc)
        known = [forwards[name]] if name in forwards else list(forwards.values())
        if attr and attr != "forward" and any(attr in k["methods"] for k in known) or attr and not known:
            return None, (f"the drafter is called through its method `{mc.callee}(...)`: draft_forward routes a call of the drafter "
                          "model itself, and cannot give the windowed layers inside that method their sliding masks; route the "
                          "method's own model calls through `_ddpatch_runtime.draft_forward` by hand (`apply --allow-partial` "
                          "copies the runtime), then prove the tree with `ddpatch verify` (`--ignore draft-sliding-window` would "
                          "leave every drafter call of the tree unmasked, not this one only)")
        if not positional:
            return None, None
        params = {tuple(k["params"]) if k["params"] is not None else None for k in known}
        if len(params) != 1 or None in params or any(a.star for a in mc.call.args) or len(positional) > len(next(iter(params))):
            return None, (f"the drafter `{mc.callee}(...)` is called with positional arguments, and no one drafter class's "
                          "`forward` in the tree binds them: draft_forward reads position_ids= and the cache by keyword; "
                          "pass them by keyword")
        return list(next(iter(params))[: len(positional)]), None

    def _plain(self, fn: Fn, mc: ModelCall) -> bool:
        """``drafter.method(...)`` where every drafter class it may be has that method reaching no attention layer."""
        head, _, attr = mc.callee.partition(".")
        if not attr or "." in attr or head in ("self", "cls") or attr == "forward":
            return False
        forwards = {**(self.params["drafter_forwards"] or {}), **drafter_forwards(self._ast())}
        name = self._drafter_class(fn, ModelCall(head, mc.call, mc.cache, mc.in_loop))
        known = [forwards[name]] if name in forwards else list(forwards.values())
        return bool(known) and all(attr in k.get("plain", ()) for k in known)

    def _ast(self) -> ast.Module:
        if self._tree is None:
            try:
                self._tree = ast.parse(self._module.code)
            except (SyntaxError, ValueError, RecursionError):
                self._tree = ast.Module(body=[], type_ignores=[])
        return self._tree

    def _inside_drafter(self, fn: Fn) -> bool:
        """``fn`` is a method of a drafter class (one whose ``forward`` takes ``target_hidden``): the
        calls it makes (DFlash's ``for layer in self.layers: layer(target_hidden=...)``) run inside
        the drafter call that the decode loop makes, which is the one to wrap. Not a method that is
        itself a decode loop calling the drafter as ``self(...)`` (DDTree's ``spec_generate``): its
        target's verify and its own draft call are wrapped like any decoder's."""
        return bool(fn.owner) and fn.owner in self._drafter_classes() and not is_role(fn.role("self"), DRAFTER)

    def _only_called_in_loops(self, fn: Fn) -> bool:
        calls = list(self.flow.callers(fn))
        return bool(calls) and all(in_loop for _c, _call, in_loop in calls)

    def _drafter_class(self, fn: Fn, mc: ModelCall) -> str | None:
        if mc.callee in ("self",) and fn.owner:
            return fn.owner
        if mc.callee in fn.annotations:
            return fn.annotations[mc.callee].split(".")[-1] or None
        for value in fn.assigns.get(mc.callee, []):
            if isinstance(value, cst.Call):
                func = value.func
                if isinstance(func, cst.Attribute) and func.attr.value in ("from_pretrained", "from_config"):
                    func = func.value
                if isinstance(func, (cst.Name, cst.Attribute)):
                    return (func.value if isinstance(func, cst.Name) else func.attr.value)
        return None

    def _drafter_classes(self) -> dict[str, str]:
        """The drafter classes of the tree (``scan_tree``) and of this module, with their self-masking evidence."""
        if self._classes is None:
            self._classes = dict(self.params["drafter_classes"] or {})
            try:
                self._classes.update(drafter_classes(ast.parse(self._module.code)))
            except (SyntaxError, ValueError, RecursionError):
                pass
        return self._classes

    def _masks_itself(self, fn: Fn, mc: ModelCall) -> str | None:
        self._drafter_classes()
        name = self._drafter_class(fn, mc)
        if name in self._classes:
            return self._classes[name] or None
        candidates = list(self._classes.values())
        if candidates and all(candidates):
            return "; ".join(sorted(set(candidates)))
        return None

    def visit_Call(self, node: cst.Call) -> None:
        if is_runtime_call(node, self.params["helper"]):
            self.record(node, PATCHED, f"call already goes through `{self.params['helper']}`")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        wrapped = self.wrap.get(original_node)
        if wrapped is None:
            return updated_node
        callee, where, keywords = wrapped
        what = "the target" if self.params["role"] == TARGET else "the drafter"
        bound = f" (its positional arguments bound by keyword: {', '.join(keywords)})" if keywords else ""
        self.record(original_node, APPLIED, f"{what} `{callee}(...)` {where} -> `{self.params['helper']}({callee}, ...)`{bound}")
        if keywords:  # `draft(a, b, ...)` -> `draft(position_ids=a, ...)`: the same binding, by keyword
            args = list(updated_node.args)
            updated_node = updated_node.with_changes(args=[_keyword_arg(k, a.value).with_changes(comma=a.comma)
                                                           for k, a in zip(keywords, args)] + args[len(keywords):])
        if is_runtime_call(updated_node, "adopt_forward"):  # already model first: swap the helper, keep the arguments
            return runtime_call(self, self.params["helper"], updated_node.args).with_changes(
                whitespace_before_args=updated_node.whitespace_before_args
            )
        first = cst.Arg(updated_node.func)
        comma = updated_node.args[0].comma if updated_node.args else cst.MaybeSentinel.DEFAULT
        if isinstance(comma, cst.Comma):
            first = first.with_changes(comma=comma)  # keep one argument per line in a multi-line call
        return runtime_call(self, self.params["helper"], [first, *updated_node.args]).with_changes(
            whitespace_before_args=updated_node.whitespace_before_args
        )
