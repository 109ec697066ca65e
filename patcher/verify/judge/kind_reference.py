"""What a DFlash2 or a DSpark drafter drafts at a round's start, and what a correct chain accepts from it.

Written from the kinds' public definitions (``patcher/verify/plumbing/drafter_kinds.py`` names them), one token
at a time and without the drafters' own code, so that a drafter's ``propose`` and a decoder's use of it can be
checked against it. Each function takes the drafter's output hidden states over the round's block (one from-scratch
forward: ``block_hidden_at``), the logits of those positions, the anchor (the last committed token) and the
drafter's weights read by name (``weights_of``):

- DFlash2 (``dflash2_draft``): block positions 1..; at each, the ``top_k`` highest logits are the candidates
  (equal logits: the smaller token first); each scores its logit plus ``sum_r pred[r] gate[r] succ[r]`` where
  ``pred`` is the predecessor codebook's row of the token chosen before it (the anchor first), ``gate`` the hidden
  projection of the position's hidden state and ``succ`` the candidate's successor codebook row; the best is taken.
- DSpark (``dspark_draft``): block positions 0.. when ``sample_from_anchor`` (``block_size`` tokens), else 1..;
  at each, the logits plus ``markov_w2 @ markov_w1[previous]`` (the anchor first, then the token just drafted),
  the argmax taken; with a confidence head, ``sigmoid(proj . [hidden; markov_w1[previous]] + b)`` rates the
  position, and the draft ends before the first one under ``p_min``.

``chain_at`` turns a draft and the target's greedy continuation into (the acceptance, the acceptances reachable
by a drafter within epsilon of this one), the shape ``reference_decode.chain_at`` has for DFlash.
"""

from __future__ import annotations

from .acceptance.reference_decode import reachable

#: state-dict name suffixes of the weights each kind's reference reads (llama.cpp's converter reads the same names)
NAMES = {
    "dflash2": {"pred": "candidate_selector.predecessor_codebook", "succ": "candidate_selector.successor_codebook",
                "gate": "candidate_selector.hidden_projection.weight"},
    "dspark": {"w1": "markov_head.markov_w1.weight", "w2": "markov_head.markov_w2.weight",
               "conf": "confidence_head.proj.weight", "conf_b": "confidence_head.proj.bias"},
}


def weights_of(draft, kind: str) -> dict:
    """The weights ``kind``'s reference reads, by name (float32, on the CPU); KeyError naming a missing one."""
    state = {k.removeprefix("model."): v for k, v in draft.state_dict().items()}
    out = {}
    for role, name in NAMES[kind].items():
        if name in state:
            out[role] = state[name].detach().float().cpu()
        elif not role.startswith("conf"):
            raise KeyError(f"the {kind} drafter has no {name}")
    return out


def block_hidden_at(pair, features, seq: list[int], s: int):
    """The drafter's output hidden states at every position of the round that starts at ``seq[s]`` (float32, CPU)."""
    import torch

    from .drafter.recorder import embedding_scale, reference_output

    with torch.inference_mode():
        noise = (pair.embed(pair._ids([seq[s]] + [pair.mask_id] * (pair.block_size - 1))) * embedding_scale(pair.draft)).to(pair.dtype)
        positions = torch.arange(s + pair.block_size, device=pair.device)[None]
        return reference_output(pair.draft, pair.roles, features[:, :s], noise, positions)


def logits_of(pair, hidden):
    import torch

    with torch.inference_mode():
        w = pair.head.weight
        return pair.head(hidden.to(w.device, w.dtype)).float().cpu()


def _candidates(row, top_k: int) -> list[int]:
    values = row.tolist()
    return sorted(range(len(values)), key=lambda t: (-values[t], t))[:top_k]


def dflash2_scores(hidden_i, logits_i, previous: int, w: dict, top_k: int) -> dict[int, float]:
    """candidate -> selector score at one block position, after ``previous``."""
    gate = [float(x) for x in (w["gate"] @ hidden_i.float())]
    pred = w["pred"][previous].tolist()
    out = {}
    for c in _candidates(logits_i, top_k):
        succ = w["succ"][c].tolist()
        out[c] = float(logits_i[c]) + sum(p * g * q for p, g, q in zip(pred, gate, succ))
    return out


def dflash2_draft(hidden, logits, anchor: int, w: dict, top_k: int) -> list[int]:
    """DFlash2's greedy draft: ``hidden``/``logits`` of block positions 1.. (one row per draft token)."""
    previous, out = int(anchor), []
    for i in range(hidden.shape[0]):
        scores = dflash2_scores(hidden[i], logits[i], previous, w, top_k)
        previous = max(scores, key=lambda c: (scores[c], -c))
        out.append(previous)
    return out


def dspark_row(logits_i, previous: int, w: dict):
    return logits_i.float() + w["w2"] @ w["w1"][previous]


def dspark_confidence(hidden_i, previous: int, w: dict) -> float:
    import torch

    feat = torch.cat([hidden_i.float(), w["w1"][previous]])
    return float(torch.sigmoid(w["conf"][0] @ feat + (w["conf_b"][0] if "conf_b" in w else 0.0)))


def dspark_draft(hidden, logits, anchor: int, w: dict, p_min: float = 0.0) -> list[int]:
    """DSpark's greedy draft: ``hidden``/``logits`` of its draft positions (all of the block anchor-first, else 1..)."""
    previous, out = int(anchor), []
    for i in range(hidden.shape[0]):
        if p_min > 0 and "conf" in w and dspark_confidence(hidden[i], previous, w) < p_min:
            break
        previous = int(dspark_row(logits[i], previous, w).argmax())
        out.append(previous)
    return out


def draft_rows(kind: str, sample_from_anchor: bool = True) -> slice:
    """The block positions that hold draft tokens, per kind."""
    return slice(0, None) if kind == "dspark" and sample_from_anchor else slice(1, None)


def chain_at(kind: str, hidden, logits, anchor: int, gold: list[int], w: dict, eps: float, *, top_k: int = 0,
             p_min: float = 0.0, hidden_eps: float = 0.0) -> tuple[int, list[int]]:
    """(the acceptance a correct chain reaches, the acceptances reachable within epsilon) for a round whose draft
    positions hold ``hidden``/``logits`` and whose target continues with ``gold`` (one gold token per draft row).
    ``eps``: the logits' epsilon; ``hidden_eps``: the hidden states' (it moves the selector's gate and the confidence).
    Along the agreeing prefix every previous token is gold's, so each position is judged after its gold predecessor."""
    draft = dflash2_draft(hidden, logits, anchor, w, top_k) if kind == "dflash2" else dspark_draft(hidden, logits, anchor, w, p_min)
    q = min(len(gold), hidden.shape[0])
    a = 0
    while a < min(q, len(draft)) and draft[a] == gold[a]:
        a += 1
    must, may = [], []
    for k in range(q):
        previous = int(anchor) if k == 0 else gold[k - 1]
        if kind == "dflash2":
            sure, maybe = _dflash2_margin(hidden[k], logits[k], previous, gold[k], w, top_k, eps, hidden_eps)
        else:
            sure, maybe = _dspark_margin(hidden[k], logits[k], previous, gold[k], w, eps, p_min, hidden_eps)
        must.append(sure)
        may.append(maybe)
    return a + 1, reachable(must, may)


def _dflash2_margin(hidden_i, logits_i, previous, g, w, top_k, eps, hidden_eps) -> tuple[bool, bool]:
    row = logits_i.float()
    ranked = _candidates(row, top_k + 1)
    edge = float(row[ranked[top_k]]) if len(ranked) > top_k else float("-inf")  # the best logit left out of the top-k
    inside = g in ranked[:top_k]
    kth = float(row[ranked[top_k - 1]])
    in_sure = inside and float(row[g]) - edge > 2 * eps
    in_may = inside or float(row[g]) >= kth - 2 * eps
    # the selector's slack: the logit's eps, plus the pair term's bound |sum_r pred succ dgate| <= hidden_eps sum_r |pred succ| |W_r|_1
    row_l1 = w["gate"].abs().sum(1)
    pred = w["pred"][previous]

    def slack(c):
        return eps + hidden_eps * float((pred * w["succ"][c]).abs() @ row_l1)

    pool = set(ranked) | {g}
    gate = w["gate"] @ hidden_i.float()
    score = {c: float(row[c]) + float((pred * gate * w["succ"][c]).sum()) for c in pool}
    rivals = [c for c in ranked[:top_k] if c != g]
    sure = in_sure and all(score[g] - score[c] > slack(g) + slack(c) for c in rivals)
    maybe = in_may and all(score[g] - score[c] >= -(slack(g) + slack(c)) for c in rivals)
    return sure, maybe


def _dspark_margin(hidden_i, logits_i, previous, g, w, eps, p_min, hidden_eps) -> tuple[bool, bool]:
    row = dspark_row(logits_i, previous, w)
    mine = float(row[g])
    row[g] = float("-inf")
    margin = mine - float(row.max())
    sure, maybe = margin > 2 * eps, margin >= -2 * eps
    if p_min > 0 and "conf" in w:
        c = dspark_confidence(hidden_i, previous, w)
        slack = hidden_eps * float(w["conf"][0][: hidden_i.shape[0]].abs().sum()) / 4  # sigmoid' <= 1/4
        sure = sure and c - slack >= p_min
        maybe = maybe and c + slack >= p_min
    return sure, maybe


def kind_of_model(draft) -> str:
    """The kind of a loaded drafter, from the heads it carries: ``dflash2`` (a candidate selector), ``dspark`` (a Markov
    head) or ``dflash``."""
    if getattr(draft, "candidate_selector", None) is not None:
        return "dflash2"
    return "dspark" if getattr(draft, "markov_head", None) is not None else "dflash"


def prompt_entry(pair, kind: str, prompt: list[int], greedy: list[int], horizon: int, eps: float, stop_ids=(), *,
                 hidden_eps: float = 0.0, p_min: float = 0.0) -> dict:
    """``pair_reference.prompt_entry``'s shape for a DFlash2 or DSpark drafter: at every start ``s`` before ``horizon``,
    the kind's chain acceptance (``chain_at``) and its reachable set, under the method named ``kind``. Starts past the
    end of ``greedy`` (a stop token) are never reached: they hold ``[1]``."""
    from .acceptance.pair_reference import context_features

    seq = list(prompt) + list(greedy)
    features = context_features(pair, seq)
    w = weights_of(pair.draft, kind)
    top_k = int(getattr(getattr(pair.draft, "candidate_selector", None), "top_k", 0) or 0)
    rows = draft_rows(kind, bool(getattr(pair.draft, "sample_from_anchor", True)))
    P = len(prompt)
    chain = {"at": [], "reachable": []}
    for s in range(horizon):
        if s + 1 >= len(greedy):
            chain["at"].append(1)
            chain["reachable"].append([1])
            continue
        hidden = block_hidden_at(pair, features, seq, P + s)
        h, lg = hidden[rows], logits_of(pair, hidden)[rows]
        gold = list(greedy[s + 1 : s + 1 + h.shape[0]])
        a, reach = chain_at(kind, h[: len(gold)], lg[: len(gold)], seq[P + s], gold, w, eps, top_k=top_k, p_min=p_min,
                            hidden_eps=hidden_eps)
        chain["at"].append(a)
        chain["reachable"].append(reach)
    return {"ids": list(prompt), "greedy": list(greedy), "methods": {kind: chain},
            "stop_at": next((j for j, t in enumerate(greedy) if t in set(stop_ids)), None)}
