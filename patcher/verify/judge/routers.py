"""Routing flips told from bugs: mixture-of-experts routers under half-precision rounding.

A mixture-of-experts layer sends each token to the top-k experts of its router's logits. The
decoder's multi-token verify and the from-scratch reference compute the same token two exact
ways; in bfloat16 they round differently, and where two experts' scores lie within that
rounding the two computations pick different experts. From there the token's hidden state,
and every later logit that reads it, part by far more than the noise floor: a **routing flip**,
with no bug anywhere (transformers' routers: ``(router_logits, weights, expert ids)``).

The reference therefore follows the decoder's discrete choices where, and only where, they are
ties under this rounding. ``reference`` runs the from-scratch forward, finds the first site
(committed position, router) in causal order where the two choices of experts differ, and
compares the two router logits there: within the router's tolerance (``MULTIPLE`` x its floor,
measured by ``calibration`` the same two ways as the logits' floor), the router's inputs agree up
to rounding and the choice is a tie, so the reference takes the decoder's experts at that site
and runs again; further apart, the router's input already differs, which rounding does not
explain: the site is reported and not followed (the logits oracle then fails the run). At most
``MAX_FLIPS`` sites per run are followed.

Assumed: a router's choice is a function of its logits (true of every transformers router: the
top-k of the logits, their softmax or sigmoid, with a fixed bias or group limit). Not covered:
other discrete choices (a sparse-attention indexer's top-k tokens), which stay unfollowed.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

#: followed sites per run, at most: a run needing more is reported as such (not followed further), and a check that
#: failed only on such runs is inconclusive in that dtype (``inconclusive``). ``DDPATCH_VERIFY_MAX_ROUTING_FLIPS``
#: lowers it for a run (the tests reach the inconclusive verdict with 0).
MAX_FLIPS = 16


def max_flips() -> int:
    import os

    value = os.environ.get("DDPATCH_VERIFY_MAX_ROUTING_FLIPS", "")
    return int(value) if value.strip().isdigit() else MAX_FLIPS


_TOLERANCE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> router-logit tolerance (calibration)
_FOLLOWING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> handles of the standing follower
_DECODES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> the calls of its last recorded decode


def routers(model) -> list[tuple[str, object]]:
    """``(name, module)`` of the model's top-k routers, in the model's order (hence causal within a token)."""
    import torch

    found = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(getattr(module, "top_k", None), int) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            found.append((name, module))
    return found


def _as_route(output):
    """``(logits, weights, expert ids)`` of a router's output, or None when it is not one."""
    import torch

    if not (isinstance(output, tuple) and len(output) == 3 and all(isinstance(t, torch.Tensor) for t in output)):
        return None
    logits, weights, ids = output
    if ids.dtype.is_floating_point or ids.dim() != 2 or logits.dim() != 2 or logits.shape[0] != ids.shape[0]:
        return None
    return output


def set_tolerance(model, tolerance: float | None) -> None:
    """The router-logit tolerance ``calibration`` measured on ``model`` (None: no routers)."""
    try:
        if tolerance is None:
            _TOLERANCE.pop(model, None)
        else:
            _TOLERANCE[model] = tolerance
    except TypeError:  # not weak-referenceable: no following
        pass


def tolerance_of(model) -> float | None:
    try:
        return _TOLERANCE.get(model)
    except TypeError:
        return None


class Trace:
    """Router hooks that keep every router call's ``(logits, weights, expert ids)``, per top-level forward.

    ``take()`` returns what the routers did since the last ``take()``: ``{router name: [route, ...]}``
    (a router called once per forward: one route, its rows the forward's tokens)."""

    def __init__(self, model):
        self.routers = routers(model)
        self.order = {name: i for i, (name, _) in enumerate(self.routers)}
        self._routes: dict = {}
        self._handles: list = []

    def __enter__(self):
        for name, module in self.routers:
            self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, name):
        def hook(module, args, output):
            route = _as_route(output)
            if route is not None:
                self._routes.setdefault(name, []).append(tuple(t.detach().clone() for t in route))

        return hook

    def take(self) -> dict:
        routes, self._routes = self._routes, {}
        return routes


@contextlib.contextmanager
def follow(model, sequence, sites: dict):
    """Within: a from-scratch forward of ``model`` over ``sequence`` (or a prefix of it; batch 1, no cache)
    takes the expert choices ``sites`` gives: ``{(position, router name): (weights, expert ids)}``."""
    handles = _install(model, sequence, sites)
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _install(model, sequence, sites: dict) -> list:
    from transformers.cache_utils import Cache

    sequence = list(sequence)
    state = {"on": False}
    by_router: dict = {}
    for (position, name), choice in sites.items():
        by_router.setdefault(name, []).append((position, choice))

    def before(module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        state["on"] = (not any(isinstance(v, Cache) for v in kwargs.values()) and not kwargs.get("use_cache", False) and ids is not None
                       and ids.dim() == 2 and ids.shape[0] == 1 and ids[0].tolist() == sequence[: ids.shape[1]])

    def make(name):
        def hook(module, args, output):
            route = _as_route(output)
            if not state["on"] or route is None:
                return None
            logits, weights, ids = route
            weights, ids = weights.clone(), ids.clone()
            for position, (w, i) in by_router.get(name, ()):
                if position < ids.shape[0]:
                    weights[position] = w.to(weights.device, weights.dtype)
                    ids[position] = i.to(ids.device, ids.dtype)
            return logits, weights, ids

        return hook

    handles = [model.register_forward_pre_hook(before, with_kwargs=True)]
    handles += [module.register_forward_hook(make(name)) for name, module in routers(model) if name in by_router]
    return handles


def stand(model, sequence, sites: dict) -> None:
    """Leave ``follow(model, sequence, sites)`` on until ``release(model)``: the other from-scratch references
    of the same decode (the drafter oracle's features) read the same experts as the logits reference."""
    release(model)
    if sites:
        try:
            _FOLLOWING[model] = _install(model, sequence, sites)
        except TypeError:
            pass


def release(model) -> None:
    """Take a standing follower off ``model`` (a new decode starts)."""
    try:
        handles = _FOLLOWING.pop(model, None)
    except TypeError:
        handles = None
    for h in handles or ():
        h.remove()


@dataclass
class Flips:
    """The routing flips of one run: the sites followed, and the first one that could not be."""
    tolerance: float
    followed: list = field(default_factory=list)  # position, router, decoder's experts, reference's, |Δ router logits|
    unexplained: dict | None = None  # the first flip whose router logits differ by more than the tolerance
    too_many: bool = False

    def describe(self, prompt_len: int) -> str:
        parts = []
        if self.followed:
            f = self.followed[0]
            parts.append(f"{len(self.followed)} routing flip(s) followed (ties under rounding: router |Δ| <= "
                         f"{self.tolerance:.1e}); first at new token {f['position'] + 1 - prompt_len}, {f['router']}: "
                         f"experts {f['decoder']} in the decode, {f['reference']} from scratch, router |Δ| {f['delta']:.1e}")
        if self.unexplained:
            u = self.unexplained
            parts.append(f"routing differs at new token {u['position'] + 1 - prompt_len}, {u['router']} (experts {u['decoder']} "
                         f"in the decode, {u['reference']} from scratch) with router |Δ| {u['delta']:.1e} > {self.tolerance:.1e}: "
                         "the router's input already differs, not a tie")
        if self.too_many:
            parts.append(f"more than {max_flips()} routing flips: not followed further")
        return "; ".join(parts)

    def as_dict(self) -> dict:
        return {"tolerance": self.tolerance, "followed": self.followed, "unexplained": self.unexplained, "too_many": self.too_many}


def rows(routes: dict, pairs: list[tuple[int, int]]) -> dict:
    """``{(position, router): (logits, weights, expert ids)}`` of one forward's routes (``Trace.take()``), for the
    ``(row, position)`` pairs given: row ``row`` of the forward is the token at ``position``."""
    out = {}
    for name, recorded in routes.items():
        logits, weights, ids = recorded[-1]
        for row, position in pairs:
            if row < ids.shape[0]:
                out[(position, name)] = (logits[row], weights[row], ids[row])
    return out


def decoder_rows(calls: list[dict], committed) -> dict:
    """The decoder's routing at its committed tokens: ``committed(call)`` gives the (row, position) pairs of a
    recorded forward whose context is the final sequence; the latest forward of a position wins."""
    out = {}
    for call in calls:
        if call.get("routes"):
            out.update(rows(call["routes"], committed(call)))
    return out


def largest_delta(decoded: dict, reference: dict) -> float:
    """The largest |Δ router logits| over the sites both hold."""
    return max((float((decoded[s][0].float().cpu() - reference[s][0].float().cpu()).abs().max()) for s in decoded if s in reference),
               default=0.0)


def _first_flip(decoded: dict, reference: dict, order: dict, skip) -> tuple | None:
    flips = [site for site, (_, _, ids) in decoded.items() if site not in skip and site in reference
             and sorted(ids.tolist()) != sorted(reference[site][2].tolist())]
    return min(flips, key=lambda s: (s[0], order.get(s[1], 0))) if flips else None


def reference(model, sequence, decoded: dict, tolerance: float):
    """(from-scratch logits over ``sequence``, ``Flips``, the sites followed, the reference's routing rows): the
    reference follows the decoder's experts at the flips that are ties under this rounding (module docstring)."""
    import torch

    order = {name: i for i, (name, _) in enumerate(routers(model))}
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([list(sequence)], device=device)
    sites: dict = {}
    flips = Flips(tolerance)
    while True:
        with Trace(model) as trace, follow(model, sequence, sites), torch.inference_mode():
            logits = model(ids, use_cache=False).logits[0].float().cpu()
        scratch = rows(trace.take(), list(enumerate(range(len(sequence)))))
        site = _first_flip(decoded, scratch, order, sites)
        if site is None:
            break
        mine, theirs = decoded[site], scratch[site]
        delta = float((mine[0].float().cpu() - theirs[0].float().cpu()).abs().max())
        entry = {"position": site[0], "router": site[1], "decoder": sorted(mine[2].tolist()),
                 "reference": sorted(theirs[2].tolist()), "delta": delta}
        if delta > tolerance:
            flips.unexplained = entry
            break
        if len(sites) >= max_flips():
            flips.too_many = True
            break
        sites[site] = (mine[1], mine[2])
        flips.followed.append(entry)
    return logits, flips, sites, scratch


def remember(model, calls: list[dict]) -> None:
    """The calls (with their ``routes``) of the decode just recorded on ``model`` (``logits.LogitsRecorder``)."""
    try:
        _DECODES[model] = calls
    except TypeError:
        pass


def following_reference(model, sequence, committed):
    """The from-scratch logits over ``sequence`` that follow the last recorded decode's ties (``reference``), with a
    ``routing`` attribute (``Flips``), left standing for the decode's other references (``stand``); None where there
    is nothing to follow (no router tolerance, no decode, or none of its tokens committed to ``sequence``).
    ``committed(call, final)`` gives the rows of a recorded call whose context is ``final``."""
    release(model)
    tolerance = tolerance_of(model)
    try:
        calls = _DECODES.get(model) if tolerance is not None else None
    except TypeError:
        calls = None
    if not calls:
        return None
    final = list(sequence)
    decoded = decoder_rows(calls, lambda call: [(i, call["positions"][i]) for i in committed(call, final)])
    if not decoded:
        return None
    logits, flips, sites, _ = reference(model, final, decoded, tolerance)
    stand(model, final, sites)
    logits.routing = flips
    return logits


def unfollowable(runs: list[dict]) -> bool:
    """Whether every run of a method that a check failed hit more routing flips than ``MAX_FLIPS`` (and no router
    input that already differed): the reference could not follow them all, so in this dtype the run is neither
    shown exact nor shown lossy. A run with an unexplained flip, or failed with no routing at all, is a real failure."""
    failed = [r for r in runs if "error" in r or not r.get("logits", {}).get("passed", True)
              or r.get("ties", {}).get("kind") == "loss" or not r.get("drafter", {}).get("passed", True)]
    routing = [(r.get("logits") or {}).get("routing") or {} for r in failed]
    return bool(failed) and all(f.get("too_many") and not f.get("unexplained") for f in routing)


def inconclusive(check: dict, runs: list[dict], dtype: str, command: str) -> dict:
    """``check`` marked inconclusive in this dtype, naming the float32 command, when it failed only on runs whose
    routing flips could not all be followed (``unfollowable``); else unchanged. Never in float32, where the
    reference is exact and a flip is no tie."""
    if check.get("passed") or check.get("skipped") or dtype == "float32" or not unfollowable(runs):
        return check
    return {**check, "inconclusive": True, "float32_command": command,
            "evidence": f"inconclusive in {dtype}: more than {max_flips()} routing flips (ties under this rounding) in a run, "
                        f"not all followed; judge it in float32: {command}; {check.get('evidence', '')}"}
