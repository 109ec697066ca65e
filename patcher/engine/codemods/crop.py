"""CropCompat: give every cache crop the meaning its author wrote, on every transformers.

Upstream written for transformers 4.x calls ``crop(n)`` with ``n >= 0`` meaning "keep the
first n tokens". On 5.x that raises ValueError for every model: crop now takes a negative
count of tokens to drop. ``_ddpatch_runtime.crop_cache(cache, n)`` keeps the 4.x meaning
on both. A crop already written for 5.x must keep *its* meaning: rewriting a count into
``crop_cache`` would read a count of 0 ("drop nothing") as "keep nothing".

So the step reads each crop's argument (data flow inside the module, ``flow.py``):

* a **5.x count**: a negative literal or ``-(...)``; ``x - <cache>.get_seq_length()``;
  a local name or a helper parameter computed only that way (a parameter through every
  call of the helper in the module);
* a **4.x length**: anything else that reads no ``get_seq_length()`` and no count, and a cache's
  length itself (``n = cache.get_seq_length()`` ... ``cache.crop(n)``: 5.x would raise on a count above 0);
* **ambiguous**: a mix of the two (a name assigned both ways, a helper called with both),
  or an expression that reads ``get_seq_length()`` in another form (``len - n``).

``n += k`` is an offset: it keeps what ``n`` is (only an offset read from a cache's length mixes a length
with a count), and a model call's output (the logits an accepted count is drawn from) is no arithmetic of
the positions it was given, so the reading never follows into a model call's arguments.

Only receivers that are caches by data flow are touched: a name built by a ``*Cache(...)``
call or a cache factory of the module, given to a model as ``past_key_values=``, a
parameter called ``past_key_values`` or annotated as a cache, one that ``.get_seq_length()``
is called on, or a helper parameter bound to a cache. ``image.crop(box)`` is left alone.

Statuses and the evidence each rests on:

* ``applied`` -- a crop whose argument is a 4.x length became ``crop_cache(cache, n)``.
* ``already-applied`` / ``fixed-upstream`` -- the crop goes through ``crop_cache``
  (``already-applied`` with ddpatch's provenance line).
* ``fixed-upstream`` -- the crop's argument is a 5.x count, seen at the crop itself (a
  helper's crop is judged inside the helper, which the engine follows from the anchor).
  Left alone: it is exact because a verify recorded by ``verify_forward`` makes the
  cache's own ``crop`` commit the recurrent state, which the ``verify-forward`` step
  guarantees (a recipe run that cannot wrap the target's verify is a no-match there).
* ``no-match`` -- a site with the reason for an ambiguous argument; an anchor with no
  crop at all.

Past recording (what makes a crop of a linear layer legal) changed between releases too:
5.21 to 5.24 take ``activate_past_recording()`` with no argument; 5.25 takes a count
(``recurrent_states_to_keep=N``), and its Gated DeltaNet forward fails (``min(None, seq_len)``)
after a bare call. So every ``<cache>.activate_past_recording(...)`` (a receiver that is a cache
by data flow, in the anchor or a cache helper such as ``_new_cache``) becomes
``_ddpatch_runtime.record_past(<cache>, ...)``, which calls what the installed release takes
(``applied``; ``already-applied`` once it goes through ``record_past``). ``is_recording_past``
is the same on every release of the range and is left alone.
"""

from __future__ import annotations

import libcst as cst

from .base import (APPLIED, FIXED_UPSTREAM, NO_MATCH, PATCHED, Example, FunctionStack, Step, code, dotted, is_runtime_call, runtime_call,
                   site_positions)
from .flow import CACHE, DRAFT_CACHE, TARGET_CACHE, Fn, ModuleFlow

COUNT = "a 5.x count"
LENGTH = "a 4.x length"
AMBIGUOUS = "ambiguous"


def _seq_length_call(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "get_seq_length"


def _reads_seq_length(node: cst.CSTNode, opaque: frozenset = frozenset()) -> bool:
    """Whether ``node`` calls ``get_seq_length()``, outside the model calls in ``opaque`` (ids): a model's output is
    tokens or hidden states, not arithmetic of the positions it was given."""
    found = []

    class _V(cst.CSTVisitor):
        def visit_Call(self, n: cst.Call) -> bool:
            if _seq_length_call(n):
                found.append(n)
                return False
            return id(n) not in opaque

    node.visit(_V())
    return bool(found)


def _short(node: cst.CSTNode, limit: int = 60) -> str:
    """``node``'s code on one line, cut to ``limit`` characters: a message names a value, it does not quote a block."""
    text = " ".join(code(node).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


#: Links of a data-flow chain a message shows: the first ones and the last ones, the middle elided.
CHAIN_LINKS = 4
#: The longest reason a crop's no-match gives (its site says where; the chain says why, once).
REASON_CHARS = 700


def _elide(why: str) -> str:
    """A reading's chain (``a <- b <- ... <- cause``) with its middle links left out, and cut to ``REASON_CHARS``."""
    links = why.split(" <- ")
    if len(links) > CHAIN_LINKS + 1:
        half = CHAIN_LINKS // 2
        links = links[:half] + [f"({len(links) - CHAIN_LINKS - 1} more)"] + links[-half - 1:]
    text = " <- ".join(links)
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 1] + "…"


def _combine(kinds: set[str]) -> str:
    return kinds.pop() if len(kinds) == 1 else AMBIGUOUS


class CropCompat(FunctionStack, Step):
    ID = "crop-compat"
    DESCRIPTION = "Rewrite a 4.x `cache.crop(length)` to `_ddpatch_runtime.crop_cache(cache, length)`; leave 5.x counts alone."
    TRIGGERS = ("crop|past_recording|record_past", r"\.\s*crop\s*\(|crop_cache\s*\(|\.\s*activate_past_recording\s*\(|record_past\s*\(")
    PARAMS = {"helper": "crop_cache", "recording_helper": "record_past"}
    USES_RUNTIME = True
    EXAMPLES = (
        Example(
            """
            def step(target, ids, start):
                cache = DynamicCache()
                target(ids, past_key_values=cache)
                cache.crop(start)
            """,
            """
            import _ddpatch_runtime

            def step(target, ids, start):
                cache = DynamicCache()
                target(ids, past_key_values=cache)
                _ddpatch_runtime.crop_cache(cache, start)
            """,
            "a 4.x length keeps its meaning on 5.x",
        ),
        Example(
            """
            def rollback(cache, n):
                cache.crop(n - cache.get_seq_length())
            """,
            """
            def rollback(cache, n):
                cache.crop(n - cache.get_seq_length())
            """,
            "already a 5.x count (0 drops nothing): left alone, fixed-upstream",
        ),
        Example(
            """
            def _crop(cache, n):
                remove = cache.get_seq_length() - n
                cache.crop(-remove)
            """,
            """
            def _crop(cache, n):
                remove = cache.get_seq_length() - n
                cache.crop(-remove)
            """,
            "an upstream crop helper with the native negative count: fixed-upstream",
        ),
        Example(
            """
            def _new_cache(model):
                cache = DynamicCache(config=model.config)
                cache.activate_past_recording()
                return cache
            """,
            """
            import _ddpatch_runtime

            def _new_cache(model):
                cache = DynamicCache(config=model.config)
                _ddpatch_runtime.record_past(cache)
                return cache
            """,
            "past recording as the installed release takes it (a bare call breaks 5.25's GDN forward)",
        ),
        Example(
            "def thumbnail(image, box):\n    return image.crop(box)\n",
            "def thumbnail(image, box):\n    return image.crop(box)\n",
            "not a cache: left alone",
        ),
    )

    def __init__(self, context, **params) -> None:
        super().__init__(context, **params)
        self.flow: ModuleFlow | None = None
        self._fns: list[Fn | None] = [None]
        self._decisions: dict[cst.Call, tuple[str, str]] = {}
        self._module: cst.Module | None = None

    def visit_Module(self, node: cst.Module) -> bool:
        self.flow = ModuleFlow(node)
        self._module = node
        return True

    # -- what a crop means --------------------------------------------------------------
    def meaning(self, fn: Fn, expr: cst.BaseExpression, seen: frozenset = frozenset()) -> tuple[str, str]:
        """(kind, why) of a crop argument ``expr`` read in ``fn``.

        Values are followed through the function's assignments and its helpers' parameters, never into a model
        call: its output (logits, hidden states, the tokens drawn from them) is no arithmetic of the positions
        it was given. An ambiguous ``why`` is a chain: ``a (line 9) <- b (line 7) <- ... <- cause``."""
        if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
            return COUNT, f"`{_short(expr)}` is negative"
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Subtract) and _seq_length_call(expr.right):
            return COUNT, f"`{_short(expr)}` counts from the cache's length"
        if isinstance(expr, cst.Integer):
            return LENGTH, f"`{code(expr)}` is a length"
        if _seq_length_call(expr) or isinstance(expr, cst.Call) and dotted(expr.func) == "int" and len(expr.args) == 1 \
                and _seq_length_call(expr.args[0].value):
            # a cache's length, read before: cropping back to it is 4.x (5.x raises on a count above 0)
            return LENGTH, f"`{_short(expr)}` is a cache's length"
        name = dotted(expr)
        if name is not None:
            return self._name_meaning(fn, name, seen)
        opaque = _model_calls(fn)
        if _reads_seq_length(expr, opaque):
            return AMBIGUOUS, f"`{_short(expr)}` reads get_seq_length() but is not `x - cache.get_seq_length()`"
        kinds = set()
        for sub in _names(expr, opaque):
            kind, why = self._name_meaning(fn, sub, seen)
            if kind != LENGTH:
                return AMBIGUOUS, why if kind == AMBIGUOUS else f"`{_short(expr)}` computes with {why}"
            kinds.add(kind)
        if _has_minus(expr):
            return AMBIGUOUS, f"`{_short(expr)}` negates part of the argument"
        return LENGTH, f"`{_short(expr)}` is a length"

    def _name_meaning(self, fn: Fn, name: str, seen: frozenset) -> tuple[str, str]:
        key = (id(fn), name)
        if key in seen:
            return LENGTH, f"`{name}`"
        seen = seen | {key}
        # `n += k` keeps what n is: an offset to a length is a length, to a count a count. Only an offset read from a
        # cache's length (`n -= cache.get_seq_length()`) turns one into the other: that one counts as an assignment.
        mixing = [v for v in fn.assigns.get(name, []) if id(v) in fn.augments and self._reads_length(fn, v, seen)]
        if any(id(v) not in fn.augments for v in fn.assigns.get(name, [])) or mixing:
            values = [v for v in fn.assigns[name] if id(v) not in fn.augments]
            results = [self.meaning(fn, v, seen) for v in values]
            values, results = values + mixing, results + [(AMBIGUOUS, "an offset read from a cache's length")] * len(mixing)
            kind = _combine({k for k, _ in results})
            if kind == AMBIGUOUS:
                return AMBIGUOUS, f"`{name}` is {self._assignments(name, values, results)}"
            return kind, f"`{name}`: " + results[0][1]
        if name in fn.params or name in fn.kwonly:
            results, calls = [], []
            for caller, call, _loop in self.flow.callers(fn):
                for param, arg in self.flow.bind(fn, call, isinstance(call.func, cst.Attribute)):
                    if param == name:
                        results.append(self.meaning(caller, arg, seen))
                        calls.append(arg)
            if not results:
                return LENGTH, f"`{name}` (a parameter: 4.x code passes lengths)"
            kind = _combine({k for k, _ in results})
            if kind == AMBIGUOUS:
                return AMBIGUOUS, f"parameter `{name}` is {self._given(calls, results, 'given')} by its callers"
            return kind, f"parameter `{name}`, given " + results[0][1]
        return LENGTH, f"`{name}`"

    def _reads_length(self, fn: Fn, expr: cst.BaseExpression, seen: frozenset) -> bool:
        """Whether ``expr`` is computed from a cache's length, through the function's own assignments."""
        opaque = _model_calls(fn)
        if _reads_seq_length(expr, opaque):
            return True
        for sub in _names(expr, opaque):
            key = (id(fn), sub)
            if key not in seen and any(self._reads_length(fn, v, seen | {key}) for v in fn.assigns.get(sub, [])):
                return True
        return False

    def _assignments(self, name: str, values: list, results: list[tuple[str, str]]) -> str:
        """What the assignments of ``name`` are, with their lines: "assigned a 4.x length (line 7): `n`; a 5.x count
        (line 9): `-k`"; where one of them is ambiguous in itself, the chain to the cause, once."""
        return self._given(values, results, "assigned")

    def _given(self, values: list, results: list[tuple[str, str]], verb: str) -> str:
        lines = self._lines(values)
        for v, (kind, why), line in zip(values, results, lines):
            if kind != AMBIGUOUS:
                continue
            # the first ambiguous value carries the reason; the others add nothing to it
            if why.startswith("an offset"):
                return f"moved by an offset read from a cache's length{line}: `{_short(v)}`"
            if dotted(v) is None and why.startswith(f"`{_short(v)}`"):
                return f"{verb}{line}: {why}"
            return f"{verb} `{_short(v)}`{line} <- {why}"
        parts = [f"{kind}{line}: `{_short(v)}`" for v, (kind, _why), line in zip(values, results, lines)]
        return f"{verb} " + "; ".join(parts)

    def _lines(self, nodes: list) -> list[str]:
        """`` (line N)`` for each node of the module being read (computed on this rare no-match path only)."""
        if self._module is None:
            return [""] * len(nodes)
        positions = site_positions(self._module, nodes)
        return [f" (line {positions[n].start.line})" if n in positions else "" for n in nodes]

    # -- sites --------------------------------------------------------------------------
    def _receiver(self, node: cst.Call) -> str | None:
        func = node.func
        fn = self._fns[-1]
        if fn is None or not (isinstance(func, cst.Attribute) and func.attr.value == "crop"):
            return None
        if len(node.args) != 1 or node.args[0].keyword is not None or node.args[0].star:
            return None
        receiver = dotted(func.value)
        if receiver and fn.role(receiver) & {CACHE, TARGET_CACHE, DRAFT_CACHE}:
            return receiver
        return None

    def _recording_receiver(self, node: cst.Call) -> str | None:
        func = node.func
        fn = self._fns[-1]
        if fn is None or not (isinstance(func, cst.Attribute) and func.attr.value == "activate_past_recording"):
            return None
        receiver = dotted(func.value)
        if receiver and fn.role(receiver) & {CACHE, TARGET_CACHE, DRAFT_CACHE}:
            return receiver
        return None

    def visit_Call(self, node: cst.Call) -> None:
        if is_runtime_call(node, self.params["helper"]):
            self.record(node, PATCHED, "crop already goes through the runtime helper")
            return
        if is_runtime_call(node, self.params["recording_helper"]):
            self.record(node, PATCHED, "past recording already goes through the runtime helper")
            return
        receiver = self._receiver(node)
        if receiver is None:
            return
        kind, why = self.meaning(self._fns[-1], node.args[0].value)
        self._decisions[node] = (kind, why)
        if kind == COUNT:
            self.record(node, FIXED_UPSTREAM, f"`{receiver}.crop(...)` already takes a 5.x count ({why}); left alone")
        elif kind == AMBIGUOUS:
            self.record(node, NO_MATCH, f"cannot tell whether `{receiver}.crop(...)` takes a 5.x count or a 4.x length: {_elide(why)}; "
                                        "write the crop by hand as one of the two (`crop_cache(cache, length)`, or `cache.crop(-count)`)")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        recording = self._recording_receiver(original_node)
        if recording is not None:
            receiver = original_node.func.value
            self.record(
                original_node, APPLIED,
                f"`{recording}.activate_past_recording(...)` -> `{self.params['recording_helper']}({recording}, ...)`: "
                "5.25 needs a count there (a bare call breaks its GDN forward), 5.21-5.24 take none",
            )
            return runtime_call(self, self.params["recording_helper"], [cst.Arg(receiver), *updated_node.args]).with_changes(
                lpar=updated_node.lpar, rpar=updated_node.rpar
            )
        decision = self._decisions.get(original_node)
        if decision is None or decision[0] != LENGTH:
            return updated_node
        receiver = original_node.func.value
        self.record(original_node, APPLIED, f"`{code(receiver)}.crop(...)` -> `crop_cache({code(receiver)}, ...)`: {decision[1]}")
        return runtime_call(self, self.params["helper"], [cst.Arg(receiver), updated_node.args[0].with_changes(comma=cst.MaybeSentinel.DEFAULT)]).with_changes(
            lpar=updated_node.lpar, rpar=updated_node.rpar
        )


def _model_calls(fn: Fn) -> frozenset:
    """Ids of ``fn``'s model calls: a value read from one is opaque to a crop argument's reading."""
    return frozenset(id(mc.call) for mc in fn.model_calls)


def _names(expr: cst.CSTNode, opaque: frozenset = frozenset()) -> list[str]:
    out: list[str] = []

    class _V(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> bool:
            name = dotted(node)
            if name is not None:
                out.append(name)
                return False
            return True

        def visit_Name(self, node: cst.Name) -> None:
            out.append(node.value)

        def visit_Call(self, node: cst.Call) -> bool:
            if id(node) in opaque:
                return False
            for arg in node.args:  # `len(path)`: the positional arguments, not the function's name
                if arg.keyword is None:
                    arg.value.visit(self)
            if isinstance(node.func, cst.Attribute):
                node.func.value.visit(self)
            return False

        def visit_Subscript(self, node: cst.Subscript) -> bool:
            node.value.visit(self)  # `x[:, :-1]`: the indices are not the value
            return False

    expr.visit(_V())
    return out


def _has_minus(expr: cst.CSTNode) -> bool:
    found = []

    class _V(cst.CSTVisitor):  # the sign of the value itself: not inside calls or indices
        def visit_UnaryOperation(self, node: cst.UnaryOperation) -> None:
            if isinstance(node.operator, cst.Minus):
                found.append(node)

        def visit_Call(self, node: cst.Call) -> bool:
            return False

        def visit_Subscript(self, node: cst.Subscript) -> bool:
            return False

    expr.visit(_V())
    return bool(found)
