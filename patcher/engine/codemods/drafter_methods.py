"""Which of a drafter class's own methods reach no attention layer: a call of one is no draft-side window site.

A fork calls a method of its drafter beside the drafter itself (``model.project_target_hidden(hidden)``: the
drafter's ``fc`` and an RMSNorm over the target's features), then the drafter on the next line. ``draft_forward``
routes a call of the drafter model; a method that runs no attention has no sliding window to mask, so its call is
no site of ``draft-sliding-window``. A method counts as *plain* only where that is read from the class itself:

* every submodule it calls (``self.fc(...)``) is built in ``__init__`` by a class named as a projection, a norm, an
  embedding (rotary included), dropout, an activation or a convolution (``PLAIN``);
* it reads no submodule built as a container or a block of layers (``ModuleList``, ``...Attention``, ``...Layer``,
  ``...Decoder``, ...: ``HOLDS_LAYERS``), even to hand it to a function;
* it does not call the drafter (``self(...)``, ``self.forward``), ``super()``, or hand ``self`` itself to a function;
* the class's other methods it calls are plain by the same rule.

Anything else (a submodule not built in ``__init__``, a method inherited from a base class) may reach attention,
and the call stays a site (``wrap_call`` names it).
"""

from __future__ import annotations

import ast
import re

PLAIN = re.compile(r"(Linear|Norm|LayerNorm|RMSNorm|Embedding|Dropout|Identity|Conv\w*|GELU|SiLU|ReLU|Tanh|Sigmoid|Softmax)$")
HOLDS_LAYERS = re.compile(r"ModuleList|ModuleDict|Sequential|Attention|Attn|Layer|Decoder|Block|Transformer|Model|Mixer")
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _built(cls: ast.ClassDef) -> dict[str, str]:
    """``self.X`` assigned in ``__init__`` -> the name of the class that built it ("" for a value that is no call)."""
    init = next((n for n in cls.body if isinstance(n, _FUNCTIONS) and n.name == "__init__"), None)
    out: dict[str, str] = {}
    for node in ast.walk(init) if init is not None else ():
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    func = node.value.func if isinstance(node.value, ast.Call) else None
                    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                    out[target.attr] = name
    return out


def plain_methods(cls: ast.ClassDef) -> list[str]:
    """The methods of ``cls`` (other than ``forward`` and ``__init__``) that reach no attention layer (module docstring)."""
    methods = {n.name: n for n in cls.body if isinstance(n, _FUNCTIONS)}
    built = _built(cls)
    verdicts: dict[str, bool] = {}

    def plain(name: str, seen: frozenset) -> bool:
        if name in verdicts:
            return verdicts[name]
        fn = methods[name]
        selves = {id(n.value) for n in ast.walk(fn) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                  and n.value.id == "self"}
        ok = True
        for node in ast.walk(fn):
            if isinstance(node, ast.Name) and node.id == "self" and id(node) not in selves:
                ok = False  # `self(...)`, or the drafter handed to a function
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super":
                ok = False
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                attr = node.attr
                if attr in methods:
                    ok = attr not in ("forward", "__call__") and attr not in seen and plain(attr, seen | {name})
                elif HOLDS_LAYERS.search(built.get(attr, "")):
                    ok = False
                elif attr not in built and _called(fn, node):
                    ok = False  # a submodule not built here (inherited, set elsewhere): it may hold attention
                elif attr in built and _called(fn, node) and not PLAIN.search(built[attr]):
                    ok = False
            if not ok:
                break
        verdicts[name] = ok
        return ok

    return sorted(m for m in methods if m not in ("forward", "__init__", "__call__") and plain(m, frozenset()))


def _called(fn: ast.AST, attr: ast.Attribute) -> bool:
    return any(isinstance(c, ast.Call) and c.func is attr for c in ast.walk(fn))
