"""Tree structure: parents from a 4D tree mask, and the per-round plan every strategy reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch



@dataclass
class _TreePlan:
    parents: list[int]
    depth: list[int]
    # path-batched layout
    path_index: torch.Tensor  # [P * D] node index per (path, step), padded with the path's last node
    node_slot: torch.Tensor  # [L] flat (path, step) slot holding each node
    n_paths: int
    path_len: int
    # node-recurrent layout, one entry per depth: (nodes, parent slot in the previous depth)
    levels: list[tuple[torch.Tensor, torch.Tensor]]
    inverse_order: torch.Tensor  # [L] position of each node in the depth-major concatenation


def tree_parents_from_mask(attention_mask: torch.Tensor) -> list[int]:
    """Parents of the verify nodes from a 4D tree mask ``[1, 1, L, past + L]``.

    Visible is ``True`` for a bool mask, and "not a large negative" for an additive float mask.
    The parent of node ``i`` is the largest ``j < i`` it can see (the root, node 0, has -1).
    The mask must be exactly "prefix + ancestors + itself" for every node, else ValueError.
    """
    if attention_mask.dim() != 4 or attention_mask.shape[0] != 1:
        raise ValueError(f"ddpatch: a tree verify needs a [1, 1, L, past+L] mask, got {tuple(attention_mask.shape)}")
    L = attention_mask.shape[-2]
    window = attention_mask[0, 0, :, -L:]
    if window.dtype == torch.bool:
        visible = window
    else:
        visible = window > torch.finfo(window.dtype).min / 2
    visible = visible.to("cpu")
    idx = torch.arange(L)
    lower = idx[None, :] < idx[:, None]
    parents = torch.where(visible & lower, idx[None, :].expand(L, L), torch.full((L, L), -1)).amax(dim=1)
    parent_list = parents.tolist()
    eye = torch.eye(L, dtype=torch.bool)
    expected = eye.clone()
    for i in range(1, L):
        p = parent_list[i]
        if p < 0:
            raise ValueError(f"ddpatch: tree node {i} sees no earlier node; node 0 must be the root of every node")
        expected[i] |= expected[p]
    if not torch.equal(visible, expected):
        bad = int((visible != expected).any(dim=1).nonzero()[0])
        raise ValueError(
            f"ddpatch: the 4D mask is not a tree mask (node {bad} must see exactly its ancestors and itself)"
        )
    return parent_list


def _tree_plan(parents: list[int], device) -> _TreePlan:
    L = len(parents)
    depth = [0] * L
    children: list[list[int]] = [[] for _ in range(L)]
    for i in range(1, L):
        depth[i] = depth[parents[i]] + 1
        children[parents[i]].append(i)
    # Path-batched: one row per leaf, root first.
    leaves = [i for i in range(L) if not children[i]]
    paths = []
    for leaf in leaves:
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    D = max(len(p) for p in paths)
    flat, slot = [], [0] * L
    for row, path in enumerate(paths):
        for step, node in enumerate(path):
            slot[node] = row * D + step  # any path holding the node gives the same output
        flat.extend(path + [path[-1]] * (D - len(path)))  # tail padding never reaches earlier steps
    # Node-recurrent: nodes grouped by depth; each refers to its parent's slot in the previous depth.
    by_depth: list[list[int]] = [[] for _ in range(max(depth) + 1)]
    for i in range(L):
        by_depth[depth[i]].append(i)
    position = {}
    levels = []
    order = []
    for d, nodes in enumerate(by_depth):
        parent_slots = [0] if d == 0 else [position[parents[i]] for i in nodes]
        position = {node: k for k, node in enumerate(nodes)}
        levels.append(
            (torch.tensor(nodes, device=device), torch.tensor(parent_slots, device=device))
        )
        order.extend(nodes)
    inverse = [0] * L
    for k, node in enumerate(order):
        inverse[node] = k
    return _TreePlan(
        parents=parents,
        depth=depth,
        path_index=torch.tensor(flat, device=device),
        node_slot=torch.tensor(slot, device=device),
        n_paths=len(paths),
        path_len=D,
        levels=levels,
        inverse_order=torch.tensor(inverse, device=device),
    )


def _on_device(plan: _TreePlan, name: str, device, build) -> torch.Tensor:
    """``build()`` (a CPU tensor) on ``device``, made once per round and plan: the per-layer loop
    then finds it there, with no host-to-device copy per layer."""
    cache = plan.__dict__.setdefault("_per_device", {})
    key = (name, str(torch.device(device)) if device is not None else "cpu")
    if key not in cache:
        tensor = build()
        cache[key] = tensor if device is None else tensor.to(device)
    return cache[key]


def _tree_taps(plan: _TreePlan, kernel: int, device=None) -> torch.Tensor:
    """``[N, kernel]`` columns of ``cat(window[kernel], tree[N])`` each node's conv reads: its
    nearest ancestors and itself (last), then the committed window's last columns."""
    return _on_device(plan, f"taps{kernel}", device, lambda: _build_taps(plan, kernel))


def _build_taps(plan: _TreePlan, kernel: int) -> torch.Tensor:
    rows = []
    for node in range(len(plan.parents)):
        row, j = [], node
        while len(row) < kernel and j >= 0:
            row.append(kernel + j)
            j = plan.parents[j]
        row += range(kernel - 1, kernel - 1 - (kernel - len(row)), -1)
        rows.append(row[::-1])
    return torch.tensor(rows)


def _tree_ancestors(plan: _TreePlan, device=None) -> torch.Tensor:
    """``[N, N]`` bool: ``[i, j]`` when j is i or one of its ancestors."""
    return _on_device(plan, "ancestors", device, lambda: _build_ancestors(plan))


def _build_ancestors(plan: _TreePlan) -> torch.Tensor:
    n = len(plan.parents)
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[plan.parents[i]]
    return anc

