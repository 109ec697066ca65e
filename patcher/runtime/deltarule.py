"""The gated delta rule as pure tensor math (no cache, no module): one chunk over a tree or a chain."""

from __future__ import annotations


import torch



def _delta_rule(key, value, g, beta, initial_state, ancestors, query=None, l2norm=False, scale=None):
    """The gated delta rule over a tree (a chain is the tree whose ancestors are all earlier
    tokens) in one chunk, float32. Returns (output or None, k, u, G) with k normalised and
    expanded to the value heads, u the delta-corrected values, G the path-cumulative log decay,
    all ``[B, H, N, ...]``."""
    n_k, n_v = key.shape[2], value.shape[2]
    if n_v != n_k:  # grouped value heads: each key head serves n_v // n_k consecutive value heads
        key = key.repeat_interleave(n_v // n_k, dim=2)
        if query is not None:
            query = query.repeat_interleave(n_v // n_k, dim=2)
    k, v, b, gl = (x.transpose(1, 2).float() for x in (key, value, beta, g))
    if l2norm:
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    anc = ancestors.to(k.device)
    # Path-cumulative log decay, summed elementwise: as a matmul (gl @ anc.T) it would run in TF32
    # when a script turns TF32 on, and g rounded to 10 mantissa bits gives percent-level errors
    # once exponentiated.
    G = (gl.unsqueeze(-2) * anc.to(gl.dtype)).sum(-1)  # [B, H, N]
    rel = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~anc, float("-inf")).exp()
    system = (b.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * rel).tril(-1)  # solve ignores the diagonal
    rhs = v * b.unsqueeze(-1)
    s0 = None if initial_state is None else initial_state.float()
    if s0 is not None:
        rhs = rhs - (b * G.exp()).unsqueeze(-1) * (k @ s0)
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = None
    if query is not None:
        q = query.transpose(1, 2).float()
        if l2norm:
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
        out = ((q @ k.transpose(-1, -2)) * rel) @ u
        if s0 is not None:
            out = out + G.exp().unsqueeze(-1) * (q @ s0)
    return out, k, u, G


def _closed_form_state(k, u, G, s0, path: torch.Tensor) -> torch.Tensor:
    """The recurrent state after the last node of ``path`` (root first), from ``_delta_rule``'s terms."""
    last = path[-1:]
    G_last = G.index_select(-1, last)  # [B, H, 1]
    weights = (G_last - G.index_select(-1, path)).exp().unsqueeze(-1)
    state = (k.index_select(2, path) * weights).transpose(-1, -2) @ u.index_select(2, path)
    if s0 is not None:
        state = state + G_last.exp().unsqueeze(-1) * s0
    return state


_CAUSAL: dict = {}


def _causal(n: int, device) -> torch.Tensor:
    """The ancestor matrix of a chain of ``n`` tokens (cached: a commit needs one per round)."""
    key = (n, str(device))
    mask = _CAUSAL.get(key)
    if mask is None:
        mask = _CAUSAL[key] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return mask

