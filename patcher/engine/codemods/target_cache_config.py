"""TargetCacheConfig: build the target's cache from the target's own config, and only the target's.

On transformers 5.x a hybrid (Gated DeltaNet + attention) model needs
``DynamicCache(config=...)`` so that its linear layers get ``LinearAttentionLayer``
slots; a bare ``DynamicCache()`` fails in ``get_conv_state`` with an IndexError.
The config must be that of the model that *owns* the cache: a draft cache given the
target's config breaks (``LinearAttentionLayer`` has no ``update``).

Ownership follows data flow (``patcher/engine/codemods/flow.py``), never names: a cache
belongs to the model whose call receives it as ``past_key_values=``, across the module's
own helpers (a cache built in a factory function is judged at every call of the
factory). ``DynamicCache`` is matched by qualified name, so aliases and
``transformers.DynamicCache()`` are found and a local class of that name is not. What
carries the target's config is also read by data flow: any argument that reads the
target (``target.config``, ``getattr(target, "config", None)``, the seed's
``target.config if hasattr(target, "config") else None``, ``**kwargs`` built from it,
a helper given the target).

Statuses and the evidence each rests on:

* ``applied`` -- a bare cache that only the target receives gets ``config=<target>.config``
  (in the factory, when the cache comes from one that only the target's cache uses);
  a cache that only the drafter receives loses every argument that reads the target.
* ``already-applied`` / ``fixed-upstream`` -- the target's cache is built with
  ``config=<target>.config`` (``already-applied`` with ddpatch's provenance line), or
  with another expression that reads the target and nothing of the drafter; a shared
  factory gives each cache its own model's config; a config factory of another file
  (``flow_factories``: ``create_generation_cache(target.config)``) is given the target's config.
* ``applied`` (at run time) -- where the code does not say which cache is the target's
  (one factory returning both bare caches, a shared bare factory, caches kept in a dict or
  a namespace, ``DynamicCache() if ... else ...``, a cache from a call ddpatch cannot read),
  every call of the target with a cache goes through the runtime:
  ``_ddpatch_runtime.adopt_forward(target, ...)`` (``verify_forward`` in a decode loop does
  the same). At the target's first use the runtime gives a cache built without a config the
  target's layer layout, before any state is written, and refuses in one line a cache that
  already holds state or was built for another model. The status rests on that object
  check, not on reading which name is whose.
* ``already-applied`` -- every such call already goes through ``adopt_forward`` or
  ``verify_forward``.
* ``no-match`` (a site with the reason) -- a target cache with a config that does not
  read the target, positional arguments, a shared factory that gives the drafter's cache
  the target's config, or one cache given to both models (the runtime cannot undo what
  the other model wrote). An anchor with no site at all is a ``no-match`` too.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from .base import (APPLIED, FIXED_UPSTREAM, NO_MATCH, PATCHED, UNCLASSIFIED, Example, Step, code, dotted, is_runtime_call, keyword,
                   runtime_call)
from .flow import ROLE_TRIGGER, DRAFT_CACHE, DRAFTER, TARGET, TARGET_CACHE, Fn, ModuleFlow, is_role
from .flow_factories import config_factories, unread_cache_source
from .flow_prefilter import may_have_roles
from .flow_tree import may_have_targets, target_seeds

CACHE_CLASSES = ("transformers.DynamicCache", "transformers.cache_utils.DynamicCache")
#: The runtime helpers that lay a target's cache out at its first use (``verify_forward`` adopts too).
ADOPTERS = ("adopt_forward", "verify_forward")


def _config_arg(owner: str) -> cst.Arg:
    return cst.Arg(
        keyword=cst.Name("config"),
        value=cst.parse_expression(f"{owner}.config"),
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )


@dataclass
class _Use:
    """One way a cache creation reaches a model: its role, and the names it reads in that context."""

    role: str | None  # TARGET_CACHE / DRAFT_CACHE / None (ambiguous or unknown)
    owner: str | None  # the name of the receiving model as the creation's code can spell it
    env: dict[str, set[str]] | None  # parameter roles at a factory's call site
    fn: Fn  # the function the creation's code is in


class TargetCacheConfig(Step):
    ID = "target-cache-config"
    DESCRIPTION = "Give the target model's DynamicCache the target's config; keep the target's config off draft caches."
    TRIGGERS = (r"DynamicCache",)
    #: ``seeds``: parameters of the tree's functions that callers elsewhere hand the target; ``factories``: functions
    #: of other files that build ``DynamicCache(config=...)`` from a parameter (``scan_tree``)
    PARAMS: dict = {"seeds": {}, "factories": {}}
    #: every file that calls something: the callers that hand a decoder its target are found in them by name
    TREE_TRIGGER = r"\w\("
    NEEDS_SCOPE = True
    USES_RUNTIME = False  # per file: True once a target call goes through the runtime (``_adoptions``)
    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider)
    EXAMPLES = (
        Example(
            """
            from transformers import DynamicCache
            def generate(model, target, ids, hidden):
                cache_t = DynamicCache()
                cache_d = DynamicCache()
                target(ids, past_key_values=cache_t)
                model(target_hidden=hidden, past_key_values=cache_d)
            """,
            """
            from transformers import DynamicCache
            def generate(model, target, ids, hidden):
                cache_t = DynamicCache(config=target.config)
                cache_d = DynamicCache()
                target(ids, past_key_values=cache_t)
                model(target_hidden=hidden, past_key_values=cache_d)
            """,
            "the drafter is the model given target_hidden; the other model's cache gets its config",
        ),
        Example(
            """
            from transformers import DynamicCache
            def generate(draft, model, ids):
                out = model(ids, past_key_values=DynamicCache(config=model.config))
                draft(target_hidden=out.hidden_states, past_key_values=DynamicCache(config=model.config))
            """,
            """
            from transformers import DynamicCache
            def generate(draft, model, ids):
                out = model(ids, past_key_values=DynamicCache(config=model.config))
                draft(target_hidden=out.hidden_states, past_key_values=DynamicCache())
            """,
            "roles by data flow, not names: here `model` is the target, and its config comes off the draft's cache",
        ),
        Example(
            """
            class DynamicCache: ...
            def generate(model, target, ids, hidden):
                cache = DynamicCache()
                target(ids, past_key_values=cache)
                model(target_hidden=hidden)
            """,
            """
            class DynamicCache: ...
            def generate(model, target, ids, hidden):
                cache = DynamicCache()
                target(ids, past_key_values=cache)
                model(target_hidden=hidden)
            """,
            "a local class called DynamicCache is not transformers' and is left alone",
        ),
        Example(
            """
            from transformers import DynamicCache
            def generate(model, target, ids):
                caches = {"target": DynamicCache(), "draft": DynamicCache()}
                out = target(ids, past_key_values=caches["target"])
                model(target_hidden=out.hidden_states, past_key_values=caches["draft"])
            """,
            """
            from transformers import DynamicCache
            import _ddpatch_runtime

            def generate(model, target, ids):
                caches = {"target": DynamicCache(), "draft": DynamicCache()}
                out = _ddpatch_runtime.adopt_forward(target, ids, past_key_values=caches["target"])
                model(target_hidden=out.hidden_states, past_key_values=caches["draft"])
            """,
            "no name says which cache is the target's: the runtime lays the one the target gets out for it at first use",
        ),
    )

    @classmethod
    def triggers(cls, params) -> tuple[str, ...]:
        made = "".join("|" + re.escape(name) for name in sorted(params.get("factories") or {}))
        return (r"DynamicCache" + made, ROLE_TRIGGER + r"|past_key_values|cache\s*=")

    @classmethod
    def may_match(cls, tree: ast.Module, params) -> bool:
        # no role, no site (flow.py); a target no drafter names, or a bare cache given to a model (a note)
        return may_have_roles(tree) or may_have_targets(tree, params.get("seeds") or {})

    @classmethod
    def scan_tree(cls, sources: dict[str, str], params) -> dict:
        """The tree's functions that callers hand the target beside a decoder (``flow_tree.target_seeds``)."""
        found = {"seeds": target_seeds(sources), "factories": config_factories(sources)}
        return {key: value for key, value in found.items() if value}

    @classmethod
    def near_miss(cls, text: str, function: str, params: dict) -> str | None:
        return unread_cache_source(text, function)

    def __init__(self, context, **params) -> None:
        super().__init__(context, **params)
        self.rewrites: dict[cst.Call, tuple[list[cst.Arg], str]] = {}
        self.marks: list[tuple[cst.CSTNode, str, str, str | None]] = []
        self.adopt: dict[cst.Call, tuple[str, str, str]] = {}  # target call -> (callee, cache code, function)
        self._bare_shared: set[int] = set()  # ids of bare creations a shared factory makes for both models
        self._routed: set[tuple[str, str]] = set()  # (function, cache code) whose target calls go through the runtime

    def is_cache_call(self, node: cst.BaseExpression) -> bool:
        if not isinstance(node, cst.Call):
            return False
        names = self.get_metadata(QualifiedNameProvider, node.func, set())
        return any(q.name in CACHE_CLASSES for q in names) or self._factory_of(node) is not None

    def _factory_of(self, call: cst.Call) -> list | None:
        """The config factory of another file ``call`` calls (``flow_factories``), by the name it is imported under."""
        factories = self.params["factories"]
        for q in self.get_metadata(QualifiedNameProvider, call.func, set()) if factories else ():
            if "." in q.name and q.name.rsplit(".", 1)[-1] in factories:
                return factories[q.name.rsplit(".", 1)[-1]]
        return None

    def _through_factory(self, flow: ModuleFlow, call: cst.Call, uses: list[_Use], factory: list, target: bool) -> None:
        """A cache a config factory of another file builds: judged by the argument its parameter is given here."""
        index, param, where = factory
        fn, made = uses[0].fn.name, code(call.func)
        given = [a.value for a in call.args if a.keyword is not None and a.keyword.value == param]
        positional = [a.value for a in call.args if a.keyword is None and not a.star]
        arg = given[0] if given else positional[index] if index < len(positional) else None
        if arg is None:
            self.marks.append((call, NO_MATCH, f"`{code(call)}`: `{made}` ({where}) builds the cache from its `{param}`, "
                                               "and this call gives it none ddpatch can read", fn))
            return
        reads = set().union(*(flow.roles_of(u.fn, arg, u.env) for u in uses))
        if target and is_role(reads, TARGET) and DRAFTER not in reads:
            self.marks.append((call, FIXED_UPSTREAM, f"target cache built from the target's config: `{code(call)}`, and `{made}` "
                                                     f"({where}) builds `DynamicCache(config=...)` from its `{param}`", fn))
        elif target:
            self.marks.append((call, NO_MATCH, f"target cache built by `{code(call)}`: `{made}` ({where}) builds it from "
                                               f"`{code(arg)}`, which is not the target's config by data flow; give it "
                                               "`<target>.config`", fn))
        elif TARGET in reads:
            self.marks.append((call, NO_MATCH, f"the drafter's cache is built from the target's config: `{code(call)}` "
                                               f"(`{made}`, {where}); give it the drafter's config", fn))

    def visit_Module(self, node: cst.Module) -> bool:
        flow = ModuleFlow(node, self.is_cache_call, seeds=self.params["seeds"], loaded_targets=True)
        for call, uses in self._creations(flow).items():
            self._decide(flow, call, uses)
        self._adoptions(flow)
        self._unclassified(flow)
        for fn in flow.fns:
            self._unseen_sources(flow, fn)
        return True

    def _unclassified(self, flow: ModuleFlow) -> None:
        """A bare cache given to a model that nothing says is the target or the drafter: left alone, and said so."""
        said: set[int] = set()
        for fn in flow.fns:
            for mc in fn.model_calls:
                roles = fn.role(mc.callee)
                if mc.cache is None or is_role(roles, TARGET) or is_role(roles, DRAFTER) or mc.wrapped:
                    continue
                name = dotted(mc.cache)
                made = [mc.cache] if flow.is_cache_call(mc.cache) else fn.assigns.get(name, []) if name else []
                if name and fn.role(name) & {TARGET_CACHE, DRAFT_CACHE}:
                    continue
                for creation in made:
                    if flow.is_cache_call(creation) and not creation.args and id(creation) not in said:
                        said.add(id(creation))
                        self.marks.append((creation, UNCLASSIFIED, (
                            f"left alone: `{code(creation)}` is given to `{mc.callee}(...)` in `{fn.name}`, and nothing says whether "
                            f"`{mc.callee}` is the target (no drafter in `{fn.name}`, no caller that hands it the target beside a "
                            f"decoder, not loaded there as a causal LM); a bare cache fails on a hybrid target (get_conv_state): "
                            f"build it with config={mc.callee}.config if `{mc.callee}` is the target"), fn.name))

    # -- caches whose owner the code does not say: the runtime lays them out -------------
    def _adoptions(self, flow: ModuleFlow) -> None:
        """Route every call of the target with a cache that no creation here answers for through the runtime."""
        for fn in flow.fns:
            for mc in fn.model_calls:
                if mc.cache is None or not is_role(fn.role(mc.callee), TARGET) or mc.wrapped not in (None, *ADOPTERS):
                    continue
                if not self._untraced(flow, fn, mc.cache, set()):
                    continue
                if DRAFT_CACHE in fn.role(dotted(mc.cache)):
                    self.marks.append((mc.call, NO_MATCH, f"one cache `{code(mc.cache)}` is given to both the target and the drafter", fn.name))
                    continue
                self._routed.add((fn.name, code(mc.cache)))
                self.USES_RUNTIME = True
                if mc.wrapped:
                    self.marks.append((mc.call, PATCHED, f"the target's call goes through `{mc.wrapped}`, which lays its cache out for it", fn.name))
                else:
                    self.adopt[mc.call] = (mc.callee, code(mc.cache), fn.name)

    def _untraced(self, flow: ModuleFlow, fn: Fn, expr: cst.BaseExpression, seen: set) -> bool:
        """Whether the cache ``expr`` comes from no creation that a status here rests on.

        A ``DynamicCache(...)`` call, or a name assigned one, or a factory's result, is decided
        where it is built -- except a bare cache that a shared factory builds for both models.
        Anything else (a subscript, a namespace attribute, a tuple unpacked from a call, a
        conditional expression, a call ddpatch cannot read) is untraced, and so is a parameter
        bound to an untraced argument by a caller in this module.
        """
        if flow.is_cache_call(expr):
            return id(expr) in self._bare_shared
        if isinstance(expr, cst.Call) and dotted(expr.func) in flow.classes:
            return False  # a class of this module (a local `DynamicCache`, say) is not transformers' cache
        name = dotted(expr)
        if name is None or (fn, name) in seen:
            return name is None
        seen.add((fn, name))
        values = fn.assigns.get(name, [])
        if values:
            if name in fn.factory_uses:
                return any(id(c) in self._bare_shared for f, _call in fn.factory_uses[name] for c in flow.creations(f))
            return any(self._untraced(flow, fn, v, seen) for v in values)
        if name in fn.params + fn.kwonly:
            callers = list(flow.callers(fn))
            if not callers:
                return False  # the caller of the anchor hands it in: a site of theirs, not ours
            for caller, call, _loop in callers:
                for param, arg in flow.bind(fn, call, isinstance(call.func, cst.Attribute)):
                    if param == name and self._untraced(flow, caller, arg, seen):
                        return True
            return False
        return True

    # -- where each creation goes ------------------------------------------------------
    def _creations(self, flow: ModuleFlow) -> dict[cst.Call, list[_Use]]:
        out: dict[cst.Call, list[_Use]] = {}
        factories = {fn: flow.creations(fn) for fn in flow.fns}
        made_in_factory = {id(c) for calls in factories.values() for c in calls}
        for fn in flow.fns:
            for var, values in fn.assigns.items():
                for value in values:
                    if flow.is_cache_call(value) and id(value) not in made_in_factory:
                        out.setdefault(value, []).append(self._use(fn, fn.role(var), self._owner(fn, var), None))
            for mc in fn.model_calls:
                if mc.cache is not None and flow.is_cache_call(mc.cache):
                    roles = fn.role(mc.callee)
                    role = TARGET_CACHE if is_role(roles, TARGET) else DRAFT_CACHE if is_role(roles, DRAFTER) else None
                    out.setdefault(mc.cache, []).append(_Use(role, mc.callee, None, fn))
            for var, uses in fn.factory_uses.items():
                for factory, call in uses:
                    env = {p: flow.roles_of(fn, arg) for p, arg in flow.bind(factory, call, isinstance(call.func, cst.Attribute))}
                    roles = fn.role(var)
                    owner = next((p for p, r in env.items() if is_role(r, TARGET)), None) if is_role(roles, TARGET_CACHE) else None
                    for creation in factories[factory]:
                        out.setdefault(creation, []).append(self._use(factory, roles, owner, env))
        return out

    @staticmethod
    def _use(fn: Fn, roles: set[str], owner: str | None, env) -> _Use:
        role = TARGET_CACHE if is_role(roles, TARGET_CACHE) else DRAFT_CACHE if is_role(roles, DRAFT_CACHE) else None
        if TARGET_CACHE in roles and DRAFT_CACHE in roles:
            role = "both"
        return _Use(role, owner, env, fn)

    @staticmethod
    def _owner(fn: Fn, var: str) -> str | None:
        """The target as ``fn`` spells it: the model its call gives ``var`` to, else the one target name in ``fn``."""
        for mc in fn.model_calls:
            if mc.cache is not None and dotted(mc.cache) == var and is_role(fn.role(mc.callee), TARGET):
                return mc.callee
        names = {n for n, r in fn.roles.items() if is_role(r, TARGET)}
        names = {n for n in names if not any(n.startswith(m + ".") for m in names)}
        return names.pop() if len(names) == 1 else None

    # -- the decision -------------------------------------------------------------------
    def _decide(self, flow: ModuleFlow, call: cst.Call, uses: list[_Use]) -> None:
        fn = uses[0].fn.name
        roles = {u.role for u in uses}
        if "both" in roles or {TARGET_CACHE, DRAFT_CACHE} <= roles:
            if len(uses) > 1 and "both" not in roles:
                self._shared_factory(flow, call, uses)
            else:
                self.marks.append((call, NO_MATCH, "one cache is given to both the target and the drafter", fn))
            return
        if roles == {TARGET_CACHE}:
            self._target(flow, call, uses)
        elif roles == {DRAFT_CACHE}:
            self._draft(flow, call, uses)

    def _reads(self, flow: ModuleFlow, use: _Use, arg: cst.Arg) -> set[str]:
        return flow.roles_of(use.fn, arg.value, use.env)

    def _target(self, flow: ModuleFlow, call: cst.Call, uses: list[_Use]) -> None:
        fn = uses[0].fn.name
        if self._factory_of(call) is not None:
            return self._through_factory(flow, call, uses, self._factory_of(call), target=True)
        owners = {u.owner for u in uses}
        owner = owners.pop() if len(owners) == 1 else None
        config = keyword(call, "config")
        if not call.args:
            if owner is None:
                self.marks.append((call, NO_MATCH, "bare target cache, but no one name holds the target where it is built", fn))
            else:
                self.rewrites[call] = ([_config_arg(owner)], f"cache passed to the target `{owner}` now built with config={owner}.config")
            return
        if config is not None and owner is not None and code(config.value) == f"{owner}.config":
            self.marks.append((call, PATCHED, f"cache for the target `{owner}` already has config={owner}.config", fn))
            return
        reads = [set().union(*(self._reads(flow, u, a) for u in uses)) for a in call.args]
        carried = [a for a, r in zip(call.args, reads) if is_role(r, TARGET)]
        wrong = [a for a, r in zip(call.args, reads) if DRAFTER in r]
        if any(a.keyword is None and not a.star for a in call.args):
            self.marks.append((call, NO_MATCH, f"target cache built with positional arguments `{code(call)}`", fn))
        elif carried and not wrong:
            self.marks.append((call, FIXED_UPSTREAM, f"target cache built from the target's config: `{code(call)}`", fn))
        else:
            why = "the drafter's" if wrong else "not the target's (by data flow)"
            self.marks.append((call, NO_MATCH, f"target cache built with a config that is {why}: `{code(call)}`", fn))

    def _draft(self, flow: ModuleFlow, call: cst.Call, uses: list[_Use]) -> None:
        if self._factory_of(call) is not None:
            return self._through_factory(flow, call, uses, self._factory_of(call), target=False)
        bad = [a for a in call.args if any(TARGET in self._reads(flow, u, a) for u in uses)]
        if bad:
            keep = [a for a in call.args if a not in bad]
            if keep:
                keep[-1] = keep[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            self.rewrites[call] = (
                keep,
                f"the draft's cache must not carry the target's config (LinearAttentionLayer has no update): dropped `{', '.join(code(a.with_changes(comma=cst.MaybeSentinel.DEFAULT)) for a in bad)}`",
            )

    def _shared_factory(self, flow: ModuleFlow, call: cst.Call, uses: list[_Use]) -> None:
        fn = uses[0].fn.name
        if not call.args:
            # the drafter's cache stays bare; the target's is laid out by the runtime at its first use
            self._bare_shared.add(id(call))
            return
        target_ok = all(any(is_role(self._reads(flow, u, a), TARGET) for a in call.args) for u in uses if u.role == TARGET_CACHE)
        draft_ok = all(not any(TARGET in self._reads(flow, u, a) for a in call.args) for u in uses if u.role == DRAFT_CACHE)
        if target_ok and draft_ok:
            self.marks.append((call, FIXED_UPSTREAM, f"`{fn}` builds each cache from its own model's config: `{code(call)}`", fn))
        elif not draft_ok:
            self.marks.append((call, NO_MATCH, f"`{fn}` gives the drafter's cache the target's config: `{code(call)}`", fn))
        else:
            self.marks.append((call, NO_MATCH, f"`{fn}` does not give the target's cache the target's config: `{code(call)}`", fn))

    def _unseen_sources(self, flow: ModuleFlow, fn: Fn) -> None:
        """A target cache that comes out of a call ddpatch cannot read, and that no target call
        carries through the runtime: no status can rest on it."""
        adopted = {cache for where, cache in self._routed if where == fn.name}
        for var, values in fn.assigns.items():
            if not is_role(fn.role(var), TARGET_CACHE) or var in fn.factory_uses or var in adopted:
                continue
            for value in values:
                if isinstance(value, cst.Call) and not flow.is_cache_call(value):
                    self.marks.append((value, NO_MATCH, f"the target's cache comes from `{code(value.func)}(...)`, which is not transformers' DynamicCache nor a factory ddpatch can read here", fn.name))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        for node, status, message, fn in self.marks:
            self.record(node, status, message, function=fn)
        return updated_node

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        adopted = self.adopt.get(original_node)
        if adopted is not None:
            callee, cache, fn = adopted
            self.record(
                original_node, APPLIED,
                f"the code does not say that `{cache}` is the target's alone: `{callee}(...)` goes through `adopt_forward`, "
                "which gives a cache built without a config the target's layer layout at its first use (and refuses, in "
                "one line, a cache another model already used)",
                function=fn,
            )
            if any(is_runtime_call(updated_node, helper) for helper in ADOPTERS):
                return updated_node  # an earlier step already routed it through a helper that adopts
            first = cst.Arg(updated_node.func)
            comma = updated_node.args[0].comma if updated_node.args else cst.MaybeSentinel.DEFAULT
            if isinstance(comma, cst.Comma):
                first = first.with_changes(comma=comma)
            return runtime_call(self, "adopt_forward", [first, *updated_node.args]).with_changes(
                whitespace_before_args=updated_node.whitespace_before_args
            )
        hit = self.rewrites.get(original_node)
        if hit is None:
            return updated_node
        args, message = hit
        fn = self.function
        self.record(original_node, APPLIED, message, function=fn)
        return updated_node.with_changes(args=args)
