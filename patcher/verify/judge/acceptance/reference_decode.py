"""ddpatch's own from-scratch DFlash and DDTree decoders, and the acceptance a correct tree reaches.

Nothing here keeps a cache. Every round recomputes the target's features over the committed
sequence (one forward, no cache), runs the drafter over the whole committed context
(``drafter.recorder.reference_output``), reads the block's proposals through the target's LM head,
and verifies them with fresh target forwards:

- chain (DFlash): the block's argmax proposals; the target's greedy choice after each one, from
  one forward over ``committed + proposals``; the agreeing prefix, then the target's token;
- tree (DDTree): the ``budget`` highest-scoring nodes of the per-position tree (a node is a token
  per depth, its score the sum of the drafter's log-probabilities along its path), picked one at
  a time from the children of the nodes already picked (no heap); then, from the root, the
  target's greedy token after the path so far (one forward each) while the tree holds it.

A greedy target makes every round a function of the committed length alone: a round that starts
after ``s`` new tokens sees the same context, block and target choices in every correct decoder.
``Positions`` evaluates each method at every start ``s`` once, with the set of acceptances a
drafter within ``epsilon`` (in logits) of this one could reach there; ``floor`` walks them.
"""

from __future__ import annotations

from ..drafter.recorder import embedding_scale, reference_output, roles_of


#: Rows of the LM head converted to float32 at once by ``max_row_l1`` (a real 248,320 x 5,120 head is 5 GB in float32).
ROW_CHUNK = 8192


def max_row_l1(head) -> float:
    """The largest L1 norm of an LM head's rows (``|Δlogit| <= |Δhidden|_max x |row|_1``), in float32, a chunk of rows
    at a time: no float32 copy of the whole head. Remembered on the weight until it changes (its ``_version``)."""
    import torch

    w = head.weight
    seen = getattr(w, "_ddpatch_max_row_l1", None)
    if seen is not None and seen[0] == w._version:
        return seen[1]
    with torch.no_grad():
        best = max(float(w[i:i + ROW_CHUNK].detach().float().abs().sum(-1).max()) for i in range(0, w.shape[0], ROW_CHUNK))
    w._ddpatch_max_row_l1 = (w._version, best)
    return best


class ScratchPair:
    """The target and the drafter, driven from scratch (float32, no cache)."""

    def __init__(self, target, draft, mask_id: int, block_size: int):
        self.target, self.draft, self.mask_id, self.block_size = target, draft, int(mask_id), int(block_size)
        self.embed, self.head = target.get_input_embeddings(), target.get_output_embeddings()
        self.device = self.embed.weight.device
        self.layer_ids = list(draft.target_layer_ids)
        self.roles = roles_of(draft)
        self.dtype = next(draft.parameters()).dtype

    def _ids(self, seq):
        import torch

        return torch.tensor([list(seq)], device=self.device)

    def target_choices(self, seq) -> list[int]:
        """The target's greedy token after every prefix of ``seq`` (one forward, no cache)."""
        import torch

        with torch.inference_mode():
            return self.target(self._ids(seq), use_cache=False).logits[0].argmax(-1).tolist()

    def draft_logits(self, seq, s: int):
        """The drafter's logits for block positions 1.. of the round that starts at ``seq[s]``: context = the
        target's features (``hidden_states[layer_id + 1]``) of ``seq[:s]``, block = ``[seq[s], mask, ...]``."""
        import torch

        with torch.inference_mode():
            hs = self.target(self._ids(seq[:s]), use_cache=False, output_hidden_states=True).hidden_states
            features = torch.cat([hs[i + 1][0].to(self.device) for i in self.layer_ids], -1)[None].to(self.dtype)
            noise = (self.embed(self._ids([seq[s]] + [self.mask_id] * (self.block_size - 1))) * embedding_scale(self.draft)).to(self.dtype)
            positions = torch.arange(s + self.block_size, device=self.device)[None]
            out = reference_output(self.draft, self.roles, features, noise, positions)
            w = self.head.weight
            return self.head(out[1:].to(w.device, w.dtype)).float().cpu()


# ----------------------------------------------------------------------------- the tree
class _Later:
    """A path's tie-break key for a min-heap: among equal scores the path whose tokens read smaller wins
    (``max`` over ``(score, tuple(-t for t in path))``, as the exhaustive pick ordered them)."""

    __slots__ = ("key",)

    def __init__(self, path: tuple):
        self.key = tuple(-t for t in path)

    def __lt__(self, other: "_Later") -> bool:
        return other.key < self.key


def best_nodes(logprobs, budget: int) -> dict[tuple, float]:
    """The ``budget`` highest-scoring nodes of the implicit tree over ``logprobs`` [depth, vocab]:
    path (tuple of tokens) -> score, in the order picked. A child never scores above its parent, and siblings are
    ranked, so the best node left is the best child of a picked node or the next sibling of one: the frontier holds
    one of each (at most twice the budget), however wide the vocabulary (upstream budgets reach 1024)."""
    import heapq

    depth, width = logprobs.shape[0], min(budget, logprobs.shape[1])
    top = []  # per depth: (logprob, token), best first; equal logprobs: the smaller token first
    for d in range(depth):
        values, tokens = logprobs[d].topk(width)
        top.append(sorted(zip(values.tolist(), tokens.tolist()), key=lambda vt: (-vt[0], vt[1])))
    picked: dict[tuple, float] = {}
    frontier: list = []

    def push(parent: tuple, base: float, i: int) -> None:
        d = len(parent)
        if d < depth and i < width:
            lp, tok = top[d][i]
            path = parent + (tok,)
            heapq.heappush(frontier, (-(base + lp), _Later(path), path, base, i))

    push((), 0.0, 0)
    while frontier and len(picked) < budget:
        neg, _, path, base, i = heapq.heappop(frontier)
        picked[path] = -neg
        push(path[:-1], base, i + 1)  # its next sibling
        push(path, -neg, 0)  # its best child
    return picked


# ----------------------------------------------------------------------------- the decoders
def chain_round(pair: ScratchPair, seq: list[int], s: int) -> list[int]:
    """One DFlash round from scratch: the committed tokens it adds (accepted proposals, then the target's)."""
    proposal = pair.draft_logits(seq, s).argmax(-1).tolist()
    choices = pair.target_choices(seq[: s + 1] + proposal)[s:]
    a = 0
    while a < len(proposal) and proposal[a] == choices[a]:
        a += 1
    return proposal[:a] + [choices[a]]


def tree_round(pair: ScratchPair, seq: list[int], s: int, budget: int) -> list[int]:
    """One DDTree round from scratch: follow the target's greedy tokens down the tree of the best nodes."""
    import torch

    nodes = best_nodes(torch.log_softmax(pair.draft_logits(seq, s), -1), budget)
    path: tuple = ()
    while True:
        token = pair.target_choices(seq[: s + 1] + list(path))[-1]
        if path + (token,) not in nodes:
            return list(path) + [token]
        path += (token,)


def decode(pair: ScratchPair, prompt: list[int], method: str, max_new_tokens: int, stop_ids=()) -> tuple[list[int], list[int]]:
    """(new tokens, acceptance per round) of ``method`` (``dflash`` or ``ddtree_tbB``), greedy, from scratch.
    Like upstream's loops: the prefill decides the first token; a round starting at committed length
    ``start`` runs while ``start < prompt + max_new_tokens`` and ends the decode if it commits a stop token."""
    seq = list(prompt) + [pair.target_choices(prompt)[-1]]
    start, limit, acceptance = len(prompt), len(prompt) + max_new_tokens, []
    while start < limit:
        fresh = chain_round(pair, seq, start) if method == "dflash" else tree_round(pair, seq, start, budget_of(method))
        seq = seq[: start + 1] + fresh
        start += len(fresh)
        acceptance.append(len(fresh))
        if set(fresh) & set(stop_ids):
            break
    new = seq[len(prompt) : limit]
    stop = next((i for i, t in enumerate(new) if t in set(stop_ids)), None)
    return (new if stop is None else new[: stop + 1]), acceptance


def budget_of(method: str) -> int:
    return int(method.rsplit("tb", 1)[1])


# ----------------------------------------------------------------------------- every start, within epsilon
def reachable(must: list[bool], may: list[bool]) -> list[int]:
    """Acceptances (committed tokens, 1..len+1) a round can end with when the first ``j`` proposals survive iff
    all of them may and the next one need not: ``must[k]``/``may[k]`` say whether the (k+1)-th surely / possibly does."""
    out = []
    for j in range(len(may) + 1):
        if all(may[:j]) and (j == len(may) or not must[j]):
            out.append(j + 1)
    return out


def chain_at(logits, gold: list[int], eps: float) -> tuple[int, list[int]]:
    """(the acceptance from scratch, the acceptances reachable by logits within ``eps``) of a chain whose
    block positions hold ``logits`` and whose target continues with ``gold``."""
    taken = logits.argmax(-1).tolist()
    a = 0
    while a < len(gold) and taken[a] == gold[a]:
        a += 1
    must, may = [], []
    for k, g in enumerate(gold):
        row = logits[k].clone()
        mine = float(row[g])
        row[g] = float("-inf")
        margin = mine - float(row.max())  # > 0: g is the argmax
        must.append(margin > 2 * eps)
        may.append(margin >= -2 * eps)
    return a + 1, reachable(must, may)


def tree_at(logits, gold: list[int], budget: int, eps: float) -> tuple[int, list[int]]:
    """The same for a tree of ``budget`` nodes. The path node of depth k (gold[:k]) is in the tree iff fewer than
    ``budget`` nodes come before it: its k - 1 ancestors always do, its descendants never (a child never scores
    above its parent), any other node when it scores higher. Within ``eps`` in logits a depth-d score moves by
    at most 2 eps d, so two scores closer than 4 eps (block - 1) may swap."""
    import torch

    logprobs = torch.log_softmax(logits, -1)
    q = len(gold)
    ranked = list(best_nodes(logprobs, budget + q + 1).items())  # enough to count the unrelated nodes up to budget
    nodes = dict(ranked[:budget])
    a = 0
    while a < q and tuple(gold[: a + 1]) in nodes:
        a += 1
    slack = 4 * eps * q
    path = logprobs[torch.arange(q), torch.tensor(gold)].cumsum(0).tolist()
    # per ranked node: its depth, and how many of its first tokens it shares with the gold path
    lengths = torch.tensor([len(n) for n, _ in ranked])
    shared = torch.tensor([next((i for i, (x, g) in enumerate(zip(n, gold)) if x != g), min(len(n), q)) for n, _ in ranked])
    scores = torch.tensor([s for _, s in ranked], dtype=torch.float64)
    must, may = [], []
    for k in range(1, q + 1):
        related = (shared >= k) | ((lengths <= k) & (shared == lengths))  # a descendant (or itself), or an ancestor
        others = scores[~related]
        room = budget - (k - 1)  # places left for it and the unrelated nodes before it
        must.append(int((others >= path[k - 1] - slack).sum()) < room)
        may.append(int((others > path[k - 1] + slack).sum()) < room)
    return a + 1, reachable(must, may)


class Positions:
    """Per method, the from-scratch acceptance and the reachable set at every start ``s`` (new tokens committed
    before the round) of one prompt's greedy continuation ``greedy`` (which must reach ``block_size`` past the end)."""

    def __init__(self, pair: ScratchPair, prompt: list[int], greedy: list[int], methods: list[str], max_new_tokens: int, eps: float):
        self.reference: dict[str, list[int]] = {m: [] for m in methods}
        self.reachable: dict[str, list[list[int]]] = {m: [] for m in methods}
        seq = list(prompt) + list(greedy)
        P, q = len(prompt), pair.block_size - 1
        for s in range(max_new_tokens):
            logits = pair.draft_logits(seq, P + s)
            gold = greedy[s + 1 : s + 1 + q]
            for m in methods:
                a, reach = chain_at(logits, gold, eps) if m == "dflash" else tree_at(logits, gold, budget_of(m), eps)
                self.reference[m].append(a)
                self.reachable[m].append(reach)


def walk(acceptance_at: list[int], n: int, stop_at: int | None = None, *, engine: bool = False) -> list[int]:
    """The rounds of a decode of ``n`` new tokens that accepts ``acceptance_at[s]`` at start ``s``: the one reference
    walk, for verify's decoders and the referee's engines (``engine``).

    Counted as upstream's loops count (``engine=False``): every round runs its whole block until ``n`` tokens are
    decided. Counted as an engine counts (``engine=True``): the prefill decides the first token, a round commits at
    most the ``n - 1 - s`` tokens left, and where fewer than two are left the engine decodes plainly (no round)."""
    s, out = 0, []
    while (n - 1 - s >= 2) if engine else (s < n):
        a = min(acceptance_at[s], n - 1 - s) if engine else acceptance_at[s]
        out.append(a)
        if stop_at is not None and s < stop_at <= s + a:
            break
        s += a
    return out


def floor(reachable_at: list[list[int]], n: int, stop_at: int | None = None, *, engine: bool = False,
          lowest: bool = True) -> float | None:
    """The lowest (``lowest=False``: the highest) mean acceptance of any decode of ``n`` new tokens whose round at
    start ``s`` accepts one of ``reachable_at[s]``, its rounds counted as ``walk`` counts them (``engine``). Exact:
    over every start, for each number of tokens a decode from there commits, the most (fewest) rounds that commit
    it. None: no round at all (an engine's decode of fewer than three tokens)."""
    pick = max if lowest else min
    best: dict[int, dict[int, int]] = {}  # start -> {tokens committed from there: most (fewest) rounds}
    for s in range(n - 1, -1, -1):
        left = n - 1 - s
        if engine and left < 2:
            best[s] = {0: 0}
            continue
        ends: dict[int, int] = {}
        for a in (sorted({min(x, left) for x in reachable_at[s]}) if engine else reachable_at[s]):
            last = (stop_at is not None and s < stop_at <= s + a) or (not engine and s + a >= n)
            for tokens, rounds in ({0: 0} if last else best[s + a]).items():
                key = tokens + a
                ends[key] = pick(ends[key], rounds + 1) if key in ends else rounds + 1
        best[s] = ends
    means = [t / r for t, r in best[0].items() if r]
    return (min if lowest else max)(means) if means else None
