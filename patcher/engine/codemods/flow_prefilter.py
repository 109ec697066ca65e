"""The prefilter of the data-flow steps, on the stdlib ``ast``: whether a module could hold a drafter
or a target at all (``flow.ModuleFlow`` decides, on LibCST, which names do)."""

from __future__ import annotations

import ast

from .base import RUNTIME_MODULE, ast_dotted, ast_inside, ast_nodes


def may_have_roles(tree) -> bool:
    """Whether a stdlib ``ast`` module could hold a drafter or a target (the steps' ``may_match``).

    A call with ``target_hidden=``, a call through the runtime, a function calling two
    different models with ``past_key_values=`` (a drafter fed another model's features), or
    one model with a cache and a parameter given that model's features positionally.
    Several steps ask about the same tree: the answer is kept on it.
    """
    known = tree.__dict__.get("_ddpatch_roles")
    if known is None:
        known = tree._ddpatch_roles = _roles(tree)
    return known


def _roles(tree) -> bool:
    model_calls = []  # calls with past_key_values= on something other than self/cls
    for call in ast_nodes(tree, ast.Call):
        if any(k.arg == "target_hidden" for k in call.keywords):
            return True
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == RUNTIME_MODULE:
            return True
        if any(k.arg == "past_key_values" for k in call.keywords) and (ast_dotted(func) or "self").split(".")[0] not in ("self", "cls"):
            model_calls.append(call)
    if not model_calls:
        return False  # no function of the file calls a model with a cache (most files: a function is not walked at all)
    for fn in ast_nodes(tree, ast.FunctionDef, ast.AsyncFunctionDef):
        calls = [c for c in model_calls if _within(c, fn)]
        if not calls:
            continue
        every = [c for c in ast.walk(fn) if isinstance(c, ast.Call)]
        callees = {ast_dotted(c.func) for c in calls} - {None}
        # a drafter given the features positionally with no cache (`model.topk_generate(hidden, ...)`): a parameter's call
        params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs} - {"self", "cls"}
        with_cache = {id(c) for c in calls}
        positional = [c for c in every if c.args and id(c) not in with_cache and (ast_dotted(c.func) or ".").split(".")[0] in params]
        if len(callees) < 2 and not positional:
            continue
        assigned: dict[str, list] = {}
        for node in ast.walk(fn):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    name = ast_dotted(target)
                    if name:
                        assigned.setdefault(name, []).append(node.value)
        for call in calls if len(callees) >= 2 else ():
            callee = ast_dotted(call.func)
            if callee and any(_ast_fed(arg, callee, callees, assigned, 6, set()) for arg in
                              [*call.args, *(k.value for k in call.keywords if k.arg != "past_key_values")]):
                return True
        for call in positional:
            callee = ast_dotted(call.func)
            others = {c for c in callees if c.split(".")[0] != callee.split(".")[0]} | {callee}
            if len(others) > 1 and any(_ast_fed(arg, callee, others, assigned, 6, set()) for arg in call.args):
                return True
    return False


def _within(node: ast.AST, fn: ast.AST) -> bool:
    """Whether ``node`` is inside function ``fn`` (as ``ast.walk(fn)`` would reach it), by source spans: the
    ``def`` line to the end of the body, or one of its decorators (which lie above the ``def`` line)."""
    return ast_inside(node, fn) or any(ast_inside(node, d) for d in fn.decorator_list)


def _ast_fed(expr, callee: str, models: set, assigned: dict, depth: int, seen: set) -> bool:
    """``ModuleFlow._fed_features`` on the stdlib ``ast``, for the prefilter (it may say True more often)."""
    others = models - {callee}
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Attribute) and node.attr == "embed_tokens":
            if (ast_dotted(node.value) or ".").split(".")[0] in others:
                return True
        if isinstance(node, ast.Attribute) and node.attr == "hidden_states":
            base = ast_dotted(node.value)
            producers = {ast_dotted(v.func) for v in assigned.get(base, []) if isinstance(v, ast.Call)}
            if producers & others:
                return True
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get_input_embeddings":
                if (ast_dotted(func.value) or ".").split(".")[0] in others:
                    return True
            if ast_dotted(func) in models:
                continue  # another model's output is not what it was fed
        if isinstance(node, ast.Name) and depth and node.id in assigned and node.id not in seen:
            seen.add(node.id)
            if any(_ast_fed(v, callee, models, assigned, depth - 1, seen) for v in assigned[node.id]):
                return True
        stack.extend(ast.iter_child_nodes(node))
    return False
