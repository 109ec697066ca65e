"""TargetCacheConfig: build the target's cache from the target's own config.

On transformers 5.x a hybrid (Gated DeltaNet + attention) model needs
``DynamicCache(config=...)`` so that its linear layers get ``LinearAttentionLayer``
slots; a bare ``DynamicCache()`` fails in ``get_conv_state`` with an IndexError.
The config must be that of the model that *owns* the cache: a draft cache given the
target's config breaks (``LinearAttentionLayer`` has no ``update``).

Ownership is decided by data flow, not by variable names: a cache belongs to the
model whose call receives it as ``past_key_values=``. ``DynamicCache`` is matched by
qualified name, so aliases (``from transformers import DynamicCache as DC``) and
``transformers.DynamicCache()`` are found and a local class of that name is not.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from .base import APPLIED, FIXED_UPSTREAM, PATCHED, RUNTIME_MODULE, Example, Step, ast_calls, ast_dotted, code, dotted, keyword

CACHE_CLASSES = ("transformers.DynamicCache", "transformers.cache_utils.DynamicCache")


@dataclass
class _Scope:
    creations: dict[str, list[cst.Call]] = field(default_factory=dict)  # var -> DynamicCache(...) calls
    other_sources: dict[str, cst.BaseExpression] = field(default_factory=dict)  # var -> non-cache call
    receivers: dict[str, list[tuple[str, cst.Call]]] = field(default_factory=dict)  # var -> (callee, call)
    inline: list[tuple[str, cst.Call]] = field(default_factory=list)  # (callee, DynamicCache call)


class _Flow(cst.CSTVisitor):
    """Collects, per function, where caches are created and which calls receive them."""

    def __init__(self, step: "TargetCacheConfig") -> None:
        super().__init__()
        self.step = step
        self.scopes: dict[cst.CSTNode, _Scope] = {}
        self.stack: list[_Scope] = []

    def _enter(self, node: cst.CSTNode) -> None:
        scope = _Scope()
        self.scopes[node] = scope
        self.stack.append(scope)

    def visit_Module(self, node: cst.Module) -> None:
        self._enter(node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._enter(node)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.stack.pop()

    def visit_Assign(self, node: cst.Assign) -> None:
        if len(node.targets) != 1 or not isinstance(node.targets[0].target, cst.Name):
            return
        var = node.targets[0].target.value
        if self.step.is_cache_call(node.value):
            self.stack[-1].creations.setdefault(var, []).append(node.value)
        elif isinstance(node.value, cst.Call):
            self.stack[-1].other_sources[var] = node.value

    def visit_Call(self, node: cst.Call) -> None:
        arg = keyword(node, "past_key_values")
        callee = dotted(node.func)
        if callee is not None and callee.startswith(RUNTIME_MODULE + ".") and node.args:
            callee = dotted(node.args[0].value)  # verify_forward(target, ...) calls target
        if arg is None or callee is None:
            return
        if isinstance(arg.value, cst.Name):
            self.stack[-1].receivers.setdefault(arg.value.value, []).append((callee, node))
        elif self.step.is_cache_call(arg.value):
            self.stack[-1].inline.append((callee, arg.value))


def _config_arg(owner: str) -> cst.Arg:
    return cst.Arg(
        keyword=cst.Name("config"),
        value=cst.parse_expression(f"{owner}.config"),
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )


class TargetCacheConfig(Step):
    ID = "target-cache-config"
    DESCRIPTION = "Give the target model's DynamicCache the target's config; leave draft caches bare."
    TRIGGERS = (r"DynamicCache",)
    PARAMS = {"target_names": ["target"]}
    NEEDS_SCOPE = True
    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider)
    EXAMPLES = (
        Example(
            """
            from transformers import DynamicCache
            def generate(model, target, ids):
                cache_t = DynamicCache()
                cache_d = DynamicCache()
                target(ids, past_key_values=cache_t)
                model(ids, past_key_values=cache_d)
            """,
            """
            from transformers import DynamicCache
            def generate(model, target, ids):
                cache_t = DynamicCache(config=target.config)
                cache_d = DynamicCache()
                target(ids, past_key_values=cache_t)
                model(ids, past_key_values=cache_d)
            """,
            "the cache passed to the target gets its config; the draft's stays bare",
        ),
        Example(
            """
            class DynamicCache: ...
            def generate(target, ids):
                cache = DynamicCache()
                target(ids, past_key_values=cache)
            """,
            """
            class DynamicCache: ...
            def generate(target, ids):
                cache = DynamicCache()
                target(ids, past_key_values=cache)
            """,
            "a local class called DynamicCache is not transformers' and is left alone",
        ),
    )

    @classmethod
    def triggers(cls, params) -> tuple[str, ...]:
        names = "|".join(re.escape(n) for n in params["target_names"])
        return (r"DynamicCache", rf"(?:{names})\b")  # no \b in front (see Step.triggers); ast decides

    @classmethod
    def may_match(cls, tree: ast.Module, params) -> bool:
        # every site needs a target call given `past_key_values=`, or a cache given `config=<target>...`
        def is_target(name: str | None) -> bool:
            return name is not None and any(name == t or name.endswith("." + t) for t in params["target_names"])

        for call in ast_calls(tree):
            for kw in call.keywords:
                if kw.arg == "past_key_values":
                    callee = ast_dotted(call.func)
                    if callee is not None and callee.startswith(RUNTIME_MODULE + ".") and call.args:
                        callee = ast_dotted(call.args[0])
                    if is_target(callee):
                        return True
                elif kw.arg == "config" and is_target((ast_dotted(kw.value) or "").split(".")[0]):
                    return True
        return False

    def __init__(self, context, **params) -> None:
        super().__init__(context, **params)
        self.rewrites: dict[cst.Call, tuple[cst.Call, str]] = {}
        self.marks: list[tuple[cst.CSTNode, str, str, str | None]] = []

    def is_cache_call(self, node: cst.BaseExpression) -> bool:
        if not isinstance(node, cst.Call):
            return False
        names = self.get_metadata(QualifiedNameProvider, node.func, set())
        return any(q.name in CACHE_CLASSES for q in names)

    def _is_target(self, callee: str) -> bool:
        return any(callee == t or callee.endswith("." + t) for t in self.params["target_names"])

    def visit_Module(self, node: cst.Module) -> bool:
        flow = _Flow(self)
        node.visit(flow)
        for scope_node, scope in flow.scopes.items():
            fn = scope_node.name.value if isinstance(scope_node, cst.FunctionDef) else None
            self._decide(scope, fn)
        return True

    def _decide(self, scope: _Scope, fn: str | None) -> None:
        pairs = [(var, call, [c for c, _ in scope.receivers.get(var, [])]) for var, calls in scope.creations.items() for call in calls]
        pairs += [(None, call, [callee]) for callee, call in scope.inline]
        for _var, call, owners in pairs:
            targets = [o for o in owners if self._is_target(o)]
            others = [o for o in owners if not self._is_target(o)]
            config = keyword(call, "config")
            if targets and not others:
                owner = targets[0]
                if not call.args:
                    new = call.with_changes(args=[_config_arg(owner)])
                    self.rewrites[call] = (new, f"cache passed to `{owner}` now built with config={owner}.config")
                elif config is not None and code(config.value) == f"{owner}.config":
                    self.marks.append((call, PATCHED, f"cache for `{owner}` already has config={owner}.config", fn))
                elif config is not None:
                    self.marks.append((call, FIXED_UPSTREAM, f"cache for `{owner}` built with config={code(config.value)}", fn))
            elif others and not targets and config is not None:
                head = (dotted(config.value) or "").split(".")[0]
                if self._is_target(head):
                    new = call.with_changes(args=[a for a in call.args if a is not config])
                    self.rewrites[call] = (
                        new,
                        f"cache passed to `{others[0]}` must not carry the target's config (LinearAttentionLayer has no update)",
                    )
        for var, receivers in scope.receivers.items():
            if var in scope.creations or var not in scope.other_sources:
                continue
            for callee, call in receivers:
                if self._is_target(callee):
                    source = code(scope.other_sources[var])
                    self.marks.append((call, FIXED_UPSTREAM, f"target cache comes from `{source}`", fn))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        for node, status, message, fn in self.marks:
            self.record(node, status, message, function=fn)
        return updated_node

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        hit = self.rewrites.get(original_node)
        if hit is None:
            return updated_node
        new, message = hit
        self.record(original_node, APPLIED, message)
        return updated_node.with_changes(args=new.args)
