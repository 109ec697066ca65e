"""Calling upstream's decoders: each parameter is bound to a role by its name, else its
annotation, else its position in upstream's own signature."""

from __future__ import annotations

import inspect
import time
from pathlib import Path

#: What the verifier passes, by role, and the names forks give each role. A parameter is bound
#: by its name, else by its annotation, else by its position in upstream's own signature.
ROLE_NAMES = {
    "draft": ("model", "draft", "draft_model", "drafter", "dflash_model", "spec_model", "assistant_model"),
    "target": ("target", "target_model", "verifier", "base_model", "target_lm", "llm"),
    "input_ids": ("input_ids", "ids", "prompt_ids", "prompt", "tokens", "input_tokens"),
    "mask_token_id": ("mask_token_id", "mask_id", "mask_token"),
    "max_new_tokens": ("max_new_tokens", "max_tokens", "new_tokens", "num_new_tokens", "max_gen_len"),
    "block_size": ("block_size", "block_len", "block_length", "draft_length", "gamma"),
    "stop_token_ids": ("stop_token_ids", "stop_ids", "stop_tokens", "eos_token_ids", "eos_ids"),
    "temperature": ("temperature", "temp"),
    "top_p": ("top_p",),
    "top_k": ("top_k",),
    "tree_budget": ("tree_budget", "budget", "node_budget", "tree_size", "num_tree_nodes"),
    "return_stats": ("return_stats", "with_stats"),
    "rejection_sampling": ("rejection_sampling",),
}

#: Upstream's positional orders: DDTree and DFlash before 2026-04, and DFlash's model.py since.
UPSTREAM_ORDERS = (
    ("draft", "target", "input_ids", "mask_token_id", "max_new_tokens", "block_size", "stop_token_ids", "temperature", "tree_budget"),
    ("draft", "target", "input_ids", "max_new_tokens", "stop_token_ids", "temperature", "block_size", "mask_token_id", "return_stats"),
)

REQUIRED_ROLES = ("draft", "target", "input_ids", "max_new_tokens")
#: words in a function's name that say it generates (a decoder that calls its length something of its own)
GENERATES = ("generate", "decode", "spec", "sample")
#: a drafter's own decoding method (``DFlashDraftModel.spec_generate``): the drafter is ``self``
METHOD_ROLES = ("target", "input_ids", "max_new_tokens")
#: a target-only decoder (a fork's ``target_generate``): no drafter in sight
TARGET_ROLES = ("target", "input_ids", "max_new_tokens")


class BindError(TypeError):
    """The verifier cannot tell what one of the decoder's parameters means."""


class NeedsArgument(BindError):
    """A required parameter the verifier has no value for (a checkpoint, a dataset): the decoder is not verified, and
    the report names the parameter and how to give it; never a guess that the decoder then fails on."""

    def __init__(self, fn, name: str, why: str = "") -> None:
        self.parameter = name
        where = f"{getattr(fn, '__name__', fn)}{_where(fn)}"
        super().__init__(
            f"needs {name!r}{' (' + why + ')' if why else ''}: cannot call {where} without it, and the verifier has no value "
            f"for it; give it with a wrapper that calls {getattr(fn, '__name__', fn)} with {name}=..., picked with --entry FILE:WRAPPER "
            f"([tool.ddpatch] entry), or leave the file out with --exclude FILE")


class NotADecoder(BindError):
    """A routine that runs a model with a cache in a loop but generates nothing (no max_new_tokens: a calibration or
    profiling loop): named and left out, never failed."""


def _role_by_annotation(annotation) -> str | None:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    if "Draft" in text or "DFlash" in text:
        return "draft"
    if "ForCausalLM" in text or "PreTrainedModel" in text:
        return "target"
    return None


def kind_of(fn, drafter_method: bool = False) -> str:
    """``tree`` (it takes a tree budget), ``chain`` (a drafter, as a parameter or as ``self``) or ``target``
    (target-only: a reference decoder of the tree's own); BindError when the verifier cannot call it."""
    if drafter_method:  # ``fn`` is the class's function: ``self`` (the drafter) is bound at call time
        import functools

        roles = set(bind_roles(functools.partial(fn, None) if not inspect.ismethod(fn) else fn, METHOD_ROLES).values())
        return "tree" if "tree_budget" in roles else "chain"
    try:
        roles = set(bind_roles(fn).values())
    except BindError as exc:
        try:
            roles = set(bind_roles(fn, TARGET_ROLES).values())
        except BindError:
            raise exc from None
        if "draft" in roles:
            raise
        return "target"
    return "tree" if "tree_budget" in roles else "chain"


_BOUND: dict = {}  # (function, bound to an instance, required roles) -> roles: a decoder is called hundreds of times


def bind_roles(fn, required=REQUIRED_ROLES) -> dict[str, str]:
    """Parameter name -> role for ``fn``; raises BindError naming the parameter it cannot bind."""
    key = (getattr(fn, "__func__", fn), hasattr(fn, "__self__"), tuple(required))
    try:
        return dict(_BOUND[key])
    except (KeyError, TypeError):
        pass
    roles = _bind_roles(fn, required)
    try:
        _BOUND[key] = dict(roles)
    except TypeError:  # an unhashable callable
        pass
    return roles


def _bind_roles(fn, required) -> dict[str, str]:
    try:
        params = [p for p in inspect.signature(fn).parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError) as exc:
        raise BindError(f"cannot read the signature of {getattr(fn, '__qualname__', fn)}: {exc}") from None
    by_name = {alias: role for role, aliases in ROLE_NAMES.items() for alias in aliases}
    roles: dict[str, str] = {}
    for p in params:
        role = by_name.get(p.name.lower())
        if role is None and p.annotation is not inspect.Parameter.empty:
            role = _role_by_annotation(p.annotation)
        if role is not None and role not in roles.values():
            roles[p.name] = role
    # the rest by position: the upstream order that agrees best with what the names told
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def agreement(order):
        return sum(1 for i, p in enumerate(positional) if i < len(order) and roles.get(p.name) == order[i])

    if "draft" not in required:  # no drafter in this signature: the positional orders start after it
        orders = tuple(o[1:] for o in UPSTREAM_ORDERS)
    else:
        orders = UPSTREAM_ORDERS
    order = max(orders, key=agreement)
    # never guess: a parameter of no known name is bound by position only where it is required and every parameter
    # named before and after it sits where upstream's order has its role (upstream's signature with one name changed);
    # one with a default keeps it (TAPS's joint_checkpoint=None, 8th, is no tree budget)
    upstream_shaped = all(roles[p.name] == order[i] for i, p in enumerate(positional) if p.name in roles and i < len(order))
    for i, p in enumerate(positional):
        if (p.name not in roles and upstream_shaped and p.default is inspect.Parameter.empty and i < len(order)
                and order[i] not in roles.values()):
            roles[p.name] = order[i]
    missing = [r for r in required if r not in roles.values()]
    name = getattr(fn, "__name__", "") or ""
    if missing == ["max_new_tokens"] and not any(w in name.lower() for w in GENERATES):
        raise NotADecoder(f"not a decoder: {name}{_where(fn)} takes no max_new_tokens (it runs a model with a cache in a loop "
                          f"but generates nothing: a calibration or profiling routine); if it is a decoder, pick it with "
                          f"--entry and name its parameters as upstream does")
    for p in params:
        if p.name not in roles and p.default is inspect.Parameter.empty:
            raise NeedsArgument(fn, p.name)
    if missing:
        raise BindError(f"cannot call {name}{_where(fn)}: no parameter takes the {', '.join(missing)} (the verifier passes "
                        f"{', '.join(ROLE_NAMES)}, each by one of upstream's names); pick a wrapper that does with --entry, or "
                        f"leave the file out with --exclude FILE")
    return roles


def unsupported_sampling(fn, sampling: dict | None, required=REQUIRED_ROLES) -> list[str]:
    """The requested sampling options that ``fn`` has no parameter for."""
    taken = set(bind_roles(fn, required).values())
    return [k for k in ("temperature", "top_p", "top_k") if (sampling or {}).get(k) is not None and k not in taken]


def _where(fn) -> str:
    try:
        return f" ({Path(inspect.getsourcefile(fn)).name}:{inspect.getsourcelines(fn)[1]})"
    except (TypeError, OSError):
        return ""


def required_for(kind: str, drafter_method: bool) -> tuple[str, ...]:
    return METHOD_ROLES if drafter_method else TARGET_ROLES if kind == "target" else REQUIRED_ROLES


def call_generate(fn, *, model, target, input_ids, mask_token_id, max_new_tokens, block_size, stop_token_ids,
                  tree_budget=None, sampling: dict | None = None, strict: bool = True, required=REQUIRED_ROLES,
                  extra: dict | None = None):
    """Call a decoder of any layout or fork (``dflash_generate``, ``ddtree_generate``, a drafter's method, a
    target-only loop), bound by its signature. ``extra``: more keyword arguments by parameter name (a mode run's
    ``trim_kv=True``); a name the decoder does not take is a BindError."""
    values = dict(
        draft=model, target=target, input_ids=input_ids, mask_token_id=mask_token_id, max_new_tokens=max_new_tokens,
        block_size=block_size, stop_token_ids=stop_token_ids, temperature=0.0, tree_budget=tree_budget, return_stats=True,
    )
    for key, value in (sampling or {}).items():
        if value is not None:
            values[key] = value
    roles = bind_roles(fn, required)
    unsupported = unsupported_sampling(fn, sampling, required)
    if unsupported and strict:
        raise BindError(f"{getattr(fn, '__name__', fn)} takes no {', '.join(unsupported)} parameter")
    kwargs = {name: values[role] for name, role in roles.items() if role in values and (values[role] is not None or role == "stop_token_ids")}
    if extra:
        unknown = [k for k in extra if k not in inspect.signature(fn).parameters]
        if unknown:
            raise BindError(f"{getattr(fn, '__name__', fn)} takes no {', '.join(unknown)} parameter")
        kwargs.update(extra)
    positional_only = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.POSITIONAL_ONLY]
    args = [kwargs.pop(name) for name in positional_only if name in kwargs]
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    elapsed = time.perf_counter() - start
    if hasattr(result, "output_ids"):
        output_ids, n_in = result.output_ids, getattr(result, "num_input_tokens", input_ids.shape[1])
        acceptance = list(getattr(result, "acceptance_lengths", []) or [])
    else:
        output_ids, n_in, acceptance = result, input_ids.shape[1], []
    new = [int(t) for t in output_ids[0, n_in:].tolist()]
    return new, [int(a) for a in acceptance], elapsed
