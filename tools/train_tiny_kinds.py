"""``tools/train_tiny_pair.py --kind dflash2|dspark``: a DFlash2 or a DSpark drafter for an existing pair's target.

Not a script of its own: ``train_tiny_pair.py`` imports it for ``--kind``. The target (and its tokenizer) of
``--out`` is kept; the drafter is ddpatch's own definition (``patcher/verify/models/drafters.py``), distilled on the
target's greedy continuations the way the DFlash drafter is (``train_tiny_pair.block_batch``), with each kind's own
head trained beside the block's cross-entropy:

- DFlash2: the convolutions through the block loss; the selector by a cross-entropy over each position's top-k
  candidates, scored after the gold token before it (the anchor first), where the gold token is among them;
- DSpark: the Markov head inside the block loss (each position's logits plus the bias of the gold token before it);
  anchor-first (``sample_from_anchor``, the default) block position j predicts token anchor + j + 1, else position
  j >= 1 predicts anchor + j; ``--confidence-head``: a confidence head by binary cross-entropy on whether the
  position's Markov argmax is the gold token.

The drafter goes to ``--out``/``draft_<name>`` with the target's tokenizer, and ``--out``/``draft_<name>/reference.json``
holds the mean acceptance of the kind's from-scratch chain reference (``patcher/verify/judge/kind_reference.py``) on
the held-out prompts of ``metadata.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def kind_name(args) -> str:
    if args.kind == "dspark":
        return "dspark" + ("_conf" if args.confidence_head else "") + ("_bonus" if args.no_sample_from_anchor else "")
    return args.kind


def kind_config(base, args):
    cfg = base
    extra = {"dflash2": {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4},
             "dspark": {"markov_head_type": "vanilla", "markov_rank": 16, "sample_from_anchor": not args.no_sample_from_anchor,
                        "has_confidence_head": bool(args.confidence_head)}}[args.kind]
    cfg.architectures = ["DFlash2DraftModel" if args.kind == "dflash2" else "DSparkDraftModel"]
    if args.kind == "dflash2":
        cfg.dflash_config = {**cfg.dflash_config, **extra}
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def losses(draft, kind: str, head, out, labels, nxt, batch: int, anchors: int, size: int, weights):
    """(the loss, top-1 agreement of the drafted token) of one batch."""
    import torch
    from torch.nn import functional as F

    hid = out.view(batch, anchors, size, -1)
    logits = head(out).view(batch, anchors, size, -1)
    lab = labels.view(batch, anchors, size)
    if kind == "dflash2":
        lg, gold, prev, h = logits[:, :, 1:], lab[:, :, 1:], lab[:, :, :-1], hid[:, :, 1:]
        ce = F.cross_entropy(lg.flatten(0, 2), gold.flatten(), reduction="none").view_as(gold)
        sel = draft.candidate_selector
        unary, cand = lg.topk(sel.top_k, dim=-1)
        pair = ((sel.predecessor_codebook[prev] * sel.hidden_projection(h))[..., None, :] * sel.successor_codebook[cand]).sum(-1)
        scores = unary.detach() + pair
        hit = cand == gold[..., None]
        inside = hit.any(-1)
        sel_ce = F.cross_entropy(scores.flatten(0, 2), hit.float().argmax(-1).flatten(), reduction="none").view_as(gold)
        loss = ((ce + sel_ce * inside) * weights).sum(-1).mean() / weights.sum()
        chosen = cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
        return loss, float((chosen == gold).float().mean())
    if draft.sample_from_anchor:
        lg, gold, prev, h = logits, nxt.view(batch, anchors, size), lab, hid
    else:
        lg, gold, prev, h = logits[:, :, 1:], lab[:, :, 1:], lab[:, :, :-1], hid[:, :, 1:]
    row = draft.markov_logits(lg, prev)
    w = weights if row.shape[2] == weights.numel() else torch.exp(-torch.arange(row.shape[2]) / 4.0)
    ce = F.cross_entropy(row.flatten(0, 2), gold.flatten(), reduction="none").view_as(gold)
    loss = (ce * w).sum(-1).mean() / w.sum()
    right = (row.argmax(-1) == gold).float()
    if draft.confidence_head is not None:
        conf = draft.confidence(h, prev).clamp(1e-6, 1 - 1e-6)
        loss = loss + F.binary_cross_entropy(conf, right.detach())
    return loss, float(right.mean())


def train_kind(args, tp) -> None:
    """Train the ``--kind`` drafter for ``--out``'s target (``tp``: the ``train_tiny_pair`` module)."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    sys.path.insert(0, str(ROOT))
    from patcher.verify.models.drafters import CLASSES

    torch.set_num_threads(args.threads)
    t0, c0 = time.time(), time.process_time()
    out, name = Path(args.out), kind_name(args)
    shape = tp.shape_of(args)

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.0f}s] {msg}", flush=True)

    tok = PreTrainedTokenizerFast.from_pretrained(out / "target")
    mask_id = tok.convert_tokens_to_ids(tp.MASK)
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32, local_files_only=True).eval()
    train_files, _ = tp.stdlib_files(args.seed)
    texts, size = [], 0
    for path in train_files:
        if size >= args.corpus_mb * 1e6:
            break
        texts.append(tp.read(path))
        size += len(texts[-1])
    stream = torch.tensor([t for text in texts for t in tok(text).input_ids + [tok.eos_token_id]], dtype=torch.long)
    seqs, feats = tp.distill_set(target, stream, args.distill, args.seed, log, shape.target_layer_ids)
    torch.manual_seed(args.seed + 3)
    cfg = kind_config(tp.draft_config(mask_id, shape), args)
    draft = CLASSES[cfg.architectures[0]](cfg)
    draft.config._attn_implementation = "sdpa"
    for p in target.parameters():
        p.requires_grad_(False)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    block = shape.block
    weights = torch.exp(-(torch.arange(1, block) - 1) / args.gamma)
    gen = torch.Generator().manual_seed(args.seed + 4)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    steps = args.draft_steps or 600
    draft.train()
    hist = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = tp.lr_at(step, steps, 3e-3, min(50, max(1, steps // 10)))
        rows = torch.randint(0, seqs.shape[0], (args.draft_batch,), generator=gen)
        s, f = seqs[rows][:, :-1], feats[rows][:, :-1]  # one token kept back: anchor-first labels reach anchor + block
        blk, labels, position_ids, mask = tp.block_batch(s, args.anchors, gen, mask_id, block)
        nxt = seqs[rows].gather(1, position_ids[:, s.shape[1]:] + 1)
        hidden = draft(position_ids=position_ids, attention_mask=mask, noise_embedding=embed(blk), target_hidden=f)
        loss, top1 = losses(draft, args.kind, head, hidden, labels, nxt, args.draft_batch, args.anchors, block, weights)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        hist.append((float(loss.detach()), top1))
        if step % 50 == 0 or step == steps - 1:
            n = min(50, len(hist))
            log(f"{name} step {step}/{steps} loss {sum(h[0] for h in hist[-n:]) / n:.3f} "
                f"top-1 {sum(h[1] for h in hist[-n:]) / n:.3f}")
    draft.eval()
    folder = out / f"draft_{name}"
    draft.save_pretrained(folder)
    tok.save_pretrained(folder)
    n = min(50, len(hist))
    meta = {"class": cfg.architectures[0], "kind": args.kind, "block_size": block, "layers": shape.draft_layers,
            "steps": steps, "batch": args.draft_batch, "anchors_per_sequence": args.anchors, "distillation_sequences": args.distill,
            "final_loss": round(sum(h[0] for h in hist[-n:]) / n, 4), "final_top1": round(sum(h[1] for h in hist[-n:]) / n, 4),
            "training_seconds": round(time.time() - t0, 1), "training_cpu_seconds": round(time.process_time() - c0, 1),
            "bytes": (folder / "model.safetensors").stat().st_size,
            "command": "python tools/train_tiny_pair.py " + " ".join(sys.argv[1:])}
    meta["reference"] = reference_acceptance(target, draft, out, args)
    (folder / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    log(f"done: {json.dumps(meta)}")


def reference_acceptance(target, draft, out: Path, args, new: int = 48) -> dict:
    """The mean acceptance of the kind's from-scratch chain reference on the held-out prompts (greedy, float32)."""
    import torch
    from transformers import PreTrainedTokenizerFast

    from patcher.verify.judge import kind_reference as kr
    from patcher.verify.judge.acceptance.pair_reference import context_features
    from patcher.verify.judge.acceptance.reference_decode import ScratchPair, walk

    tok = PreTrainedTokenizerFast.from_pretrained(out / "target")
    prompts = json.loads((out / "metadata.json").read_text())["held_out_prompts"]
    kind = "dflash2" if hasattr(draft, "candidate_selector") else "dspark"
    w = kr.weights_of(draft, kind)
    rows = kr.draft_rows(kind, getattr(draft, "sample_from_anchor", False))
    pair = ScratchPair(target, draft, draft.mask_token_id, draft.block_size)
    means = []
    for text in prompts:
        seq = tok(text).input_ids
        P = len(seq)
        with torch.inference_mode():
            for _ in range(new + draft.block_size + 1):
                seq.append(int(target(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        feats = context_features(pair, seq)
        at = []
        for s in range(new):
            hidden = kr.block_hidden_at(pair, feats, seq, P + s)
            h, lg = hidden[rows], kr.logits_of(pair, hidden)[rows]
            gold = seq[P + s + 1: P + s + 1 + h.shape[0]]
            draft_tokens = (kr.dflash2_draft(h, lg, seq[P + s], w, draft.candidate_selector.top_k) if kind == "dflash2"
                            else kr.dspark_draft(h, lg, seq[P + s], w))
            a = 0
            while a < len(draft_tokens) and draft_tokens[a] == gold[a]:
                a += 1
            at.append(a + 1)
        rounds = walk(at, new)
        means.append(sum(rounds) / len(rounds))
    return {"prompts": len(means), "new_tokens": new, "mean_acceptance": round(sum(means) / len(means), 3),
            "per_prompt": [round(m, 2) for m in means]}
