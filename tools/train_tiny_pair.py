"""Train the tiny target/drafter pair shipped in ``patcher/data/trained_pair`` (CPU only, seeded).

1. a byte-level BPE tokenizer (``tokenizers``) on the running interpreter's standard library sources;
2. the target, a ``Qwen3_5ForCausalLM`` hybrid (3 Gated DeltaNet layers then 1 full-attention layer,
   twice), by plain next-token cross-entropy on that corpus;
3. the drafter, ``vendored/dflash``'s ``DFlashDraftModel`` (block 8), on the target's own greedy
   continuations (distillation), the DFlash way: blocks anchored at random positions, each block the
   anchor's token then mask tokens, seeing the target's features strictly before its anchor, attending
   bidirectionally inside itself and never to another block; block position 0 carries no loss, position
   k is weighted exp(-(k-1)/gamma). The target's embeddings and LM head are shared and frozen (the drafter
   has none of its own).

    python tools/train_tiny_pair.py                          # the shipped pair (about 20 min, see metadata.json)
    python tools/train_tiny_pair.py --steps 5 --out /tmp/p   # a smoke run
    python tools/train_tiny_pair.py --measure /tmp/x         # acceptance of a patched tree on the held-out prompts
    python tools/train_tiny_pair.py --floor                  # (re)write acceptance_floor.json (training ends with it)

``--layers``, ``--hidden``, ``--vocab``, ``--block``, ``--draft-layers`` and ``--target-layer-ids`` make a pair of
another shape (their defaults are the shipped pair's, so the plain command still reproduces it); ``--no-floor``
leaves ``acceptance_floor.json`` out (a pair that verify has never seen: ``tests/data/pair_b``).

``--measure TREE`` loads the folders the way ``ddpatch verify --target --draft`` does (``from_pretrained``,
float32), imports TREE's own ``dflash_generate`` / ``ddtree_generate`` and reports the mean acceptance on the
held-out prompts of ``metadata.json``, checking that every output equals the target's greedy decoding.

``--floor`` runs ddpatch's from-scratch reference decoders (``patcher/verify/judge/acceptance/reference_decode.py``) on the
held-out prompts and writes ``acceptance_floor.json`` beside the two folders: what ``ddpatch verify``'s
``acceptance: METHOD`` checks compare a patched tree with (``patcher/verify/judge/acceptance/verdict.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "patcher" / "data" / "trained_pair"
EOS, MASK = "<|endoftext|>", "<|mask|>"
SKIP_DIRS = {"test", "tests", "site-packages", "idlelib", "__pycache__", "lib2to3", "tkinter", "turtledemo", "ensurepip"}

SEQ = 128
PROMPT = 32  # distillation: a corpus prompt, then the target's greedy continuation
LAYER_KINDS = {"linear": "linear_attention", "full": "full_attention"}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The pair's shapes. The defaults are the shipped pair's (small enough that it fits 12 MB in float32 and
    trains on 2 CPU cores): changing one changes what the plain command reproduces."""

    vocab: int = 1024
    hidden: int = 128
    layers: tuple = ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + ("full_attention",)
    block: int = 8
    draft_layers: int = 3
    target_layer_ids: tuple = (1, 4, 6)  # hidden_states[i + 1], DFlash's convention


def shape_of(args) -> Shape:
    """The shape the options ask for (``--layers linear,full,linear,full``); a bad one is a usage error."""
    layers = tuple(LAYER_KINDS.get(k, k) for k in args.layers.split(",")) if args.layers else Shape.layers
    ids = tuple(int(i) for i in args.target_layer_ids.split(",")) if args.target_layer_ids else Shape.target_layer_ids
    shape = Shape(vocab=args.vocab, hidden=args.hidden, layers=layers, block=args.block or Shape.block,
                  draft_layers=args.draft_layers, target_layer_ids=ids)
    bad = [k for k in layers if k not in LAYER_KINDS.values()]
    if bad or not layers or any(not 0 <= i < len(layers) for i in ids) or shape.block < 2 or shape.block > SEQ - PROMPT:
        print(f"train_tiny_pair: error: a bad shape: {shape}", file=sys.stderr)
        sys.exit(2)
    return shape


def stdlib_files(seed: int) -> tuple[list[Path], list[Path]]:
    """The interpreter's standard library ``.py`` files (tests and GUI code left out), seeded-shuffled;
    one in twenty is held out for the prompts."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        files += [Path(folder) / n for n in sorted(names) if n.endswith(".py")]
    files.sort(key=lambda p: str(p.relative_to(root)))
    random.Random(seed).shuffle(files)
    held = max(1, len(files) // 20)
    return files[held:], files[:held]


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


# ----------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], out: Path, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS, MASK], min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(out)
    return fast


# ----------------------------------------------------------------------------- target
def target_config(shape: Shape):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=3 * shape.hidden,
        num_hidden_layers=len(shape.layers), layer_types=list(shape.layers), num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_conv_kernel_dim=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=0, bos_token_id=None, pad_token_id=None,
    )


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def windows(stream, count: int, length: int, gen):
    import torch

    starts = torch.randint(0, stream.numel() - length - 1, (count,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def train_target(stream, steps: int, batch: int, seed: int, log, shape: Shape):
    import torch
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(target_config(shape))
    gen = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, 3e-3, min(10, max(1, steps // 10)))
        x = windows(stream, batch, SEQ, gen)
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step % 10 == 0 or step == steps - 1:
            log(f"target step {step}/{steps} loss {sum(losses[-10:]) / len(losses[-10:]):.3f}")
    return model.eval(), losses


# ----------------------------------------------------------------------------- distillation data
def greedy_batch(model, prompts, new: int):
    """Batched greedy decoding with the cache (all prompts have the same length, no padding)."""
    import torch
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        logits = model(prompts, past_key_values=cache, use_cache=True).logits[:, -1]
        out = [logits.argmax(-1)]
        for _ in range(new - 1):
            logits = model(out[-1][:, None], past_key_values=cache, use_cache=True).logits[:, -1]
            out.append(logits.argmax(-1))
    return torch.cat([prompts, torch.stack(out, 1)], 1)


def distill_set(model, stream, count: int, seed: int, log, layer_ids):
    """``count`` sequences: a corpus prompt of PROMPT tokens, then the target's greedy continuation to SEQ,
    and the target's features (hidden_states[i + 1] for i in ``layer_ids``) over the whole sequence."""
    import torch

    gen = torch.Generator().manual_seed(seed + 2)
    seqs, feats = [], []
    for start in range(0, count, 128):
        prompts = windows(stream, min(128, count - start), PROMPT, gen)
        seq = greedy_batch(model, prompts, SEQ - PROMPT)
        with torch.no_grad():
            hs = model(seq, output_hidden_states=True, use_cache=False).hidden_states
        seqs.append(seq)
        feats.append(torch.cat([hs[i + 1] for i in layer_ids], -1))
        log(f"distillation sequences {start + len(prompts)}/{count}")
    return torch.cat(seqs), torch.cat(feats)


# ----------------------------------------------------------------------------- drafter
def draft_class():
    sys.path.insert(0, str(ROOT / "vendored" / "dflash"))
    from dflash.model import DFlashDraftModel

    return DFlashDraftModel


def draft_config(mask_id: int, shape: Shape):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=3 * shape.hidden,
        num_hidden_layers=shape.draft_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=2048, tie_word_embeddings=False, layer_types=["full_attention"] * shape.draft_layers,
    )
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size = shape.block
    cfg.num_target_layers = len(shape.layers)
    cfg.dflash_config = {"mask_token_id": mask_id, "target_layer_ids": list(shape.target_layer_ids)}
    return cfg


def block_batch(seqs, anchors_per_seq: int, gen, mask_id: int, block: int):
    """Anchors (drawn among the continuation's positions), the blocks' tokens and positions, the labels,
    and the attention mask [blocks x (context + blocks)]."""
    import torch

    b, length = seqs.shape
    lo, hi = PROMPT, length - block  # anchor = a committed token of the continuation, labels inside the sequence
    anchors = torch.stack([torch.randperm(hi - lo + 1, generator=gen)[:anchors_per_seq] + lo for _ in range(b)])
    offsets = torch.arange(block)
    pos = (anchors[:, :, None] + offsets).reshape(b, -1)  # [b, m * block]
    labels = seqs.gather(1, pos)
    blocks = labels.clone().view(b, anchors_per_seq, block)
    blocks[:, :, 1:] = mask_id
    q = anchors_per_seq * block
    ctx_visible = torch.arange(length)[None, None, :] < anchors.repeat_interleave(block, 1)[:, :, None]  # strictly before
    ids = torch.arange(anchors_per_seq).repeat_interleave(block)
    same_block = (ids[:, None] == ids[None, :]).expand(b, q, q)
    mask = torch.cat([ctx_visible, same_block], dim=2)[:, None]  # True: may attend
    position_ids = torch.cat([torch.arange(length).expand(b, length), pos], 1)
    return blocks.view(b, q), labels, position_ids, mask


def train_draft(target, seqs, feats, steps: int, batch: int, anchors: int, gamma: float, mask_id: int, seed: int, log,
                shape: Shape):
    import torch

    torch.manual_seed(seed + 3)
    cls = draft_class()
    draft = cls(draft_config(mask_id, shape))
    size = shape.block
    draft.config._attn_implementation = "sdpa"
    for p in target.parameters():
        p.requires_grad_(False)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    weights = torch.exp(-(torch.arange(1, size) - 1) / gamma)
    gen = torch.Generator().manual_seed(seed + 4)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    draft.train()
    losses, accs = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, 3e-3, min(50, max(1, steps // 10)))
        rows = torch.randint(0, seqs.shape[0], (batch,), generator=gen)
        block, labels, position_ids, mask = block_batch(seqs[rows], anchors, gen, mask_id, size)
        out = draft(position_ids=position_ids, attention_mask=mask, noise_embedding=embed(block), target_hidden=feats[rows])
        logits = head(out).view(batch, anchors, size, -1)[:, :, 1:]  # position 0 (the anchor) has no loss
        gold = labels.view(batch, anchors, size)[:, :, 1:]
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 2), gold.flatten(), reduction="none").view_as(gold)
        loss = (ce * weights).sum(-1).mean() / weights.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        accs.append(float((logits.argmax(-1) == gold).float().mean()))
        if step % 50 == 0 or step == steps - 1:
            n = min(50, len(losses))
            log(f"draft step {step}/{steps} loss {sum(losses[-n:]) / n:.3f} top-1 {sum(accs[-n:]) / n:.3f}")
    return draft.eval(), losses, accs


# ----------------------------------------------------------------------------- main
def held_out_prompts(files: list[Path], tok, n: int, length: int, seed: int) -> list[str]:
    """``n`` prompts of ``length`` tokens from held-out files, each starting at a line start."""
    rng = random.Random(seed + 5)
    prompts: list[str] = []
    for path in files * 4:
        if len(prompts) == n:
            break
        lines = read(path).splitlines(keepends=True)
        if len(lines) < 40:
            continue
        start = rng.randrange(0, len(lines) - 30)
        ids = tok("".join(lines[start : start + 30])).input_ids[:length]
        if len(ids) == length:
            prompts.append(tok.decode(ids))
    return prompts


def tail(xs: list[float]) -> float:
    """The mean of the last 20 values (a training loss)."""
    return round(sum(xs[-20:]) / max(1, len(xs[-20:])), 4)


def train(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    t0, c0 = time.time(), time.process_time()
    shape = shape_of(args)
    out = Path(args.out)
    (out / "target").mkdir(parents=True, exist_ok=True)
    (out / "draft").mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:6.0f}s] {msg}", flush=True)

    train_files, held = stdlib_files(args.seed)
    texts, size = [], 0
    for path in train_files:
        if size >= args.corpus_mb * 1e6:
            break
        texts.append(read(path))
        size += len(texts[-1])
    if args.reuse_target:  # the target of an earlier run of the same command: only the drafter is trained
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(out / "target")
    else:
        tok = train_tokenizer(texts, out / "target", shape.vocab)
    mask_id = tok.convert_tokens_to_ids(MASK)
    stream = torch.tensor([t for text in texts for t in tok(text).input_ids + [tok.eos_token_id]], dtype=torch.long)
    log(f"tokenizer: vocab {len(tok)}, corpus {len(texts)} files, {size / 1e6:.1f} MB, {stream.numel()} tokens")

    meta_path = out / "metadata.json"
    if args.reuse_target:
        target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32, local_files_only=True).eval()
        previous = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        target_meta = previous.get("target", {"steps": args.steps})
        t_time, t_cpu = previous.get("target_seconds"), previous.get("target_cpu_seconds")
    else:
        target, t_losses = train_target(stream, args.steps, args.batch, args.seed, log, shape)
        target.save_pretrained(out / "target")
        t_time, t_cpu = round(time.time() - t0, 1), round(time.process_time() - c0, 1)
        target_meta = {"class": "Qwen3_5ForCausalLM", "layer_types": list(shape.layers), "hidden": shape.hidden, "steps": args.steps,
                       "batch": args.batch, "seq": SEQ, "tokens_seen": args.steps * args.batch * SEQ,
                       "final_loss": tail(t_losses)}
    held_stream = torch.tensor([t for p in held[:10] for t in tok(read(p)).input_ids + [0]], dtype=torch.long)
    with torch.no_grad():
        x = windows(held_stream, 8, SEQ, torch.Generator().manual_seed(9))
        target_meta["held_out_loss"] = round(float(target(x, labels=x).loss), 4)
    meta_path.write_text(json.dumps({"target": target_meta, "target_seconds": t_time, "target_cpu_seconds": t_cpu}, indent=1) + "\n")
    log(f"target saved; held-out loss {target_meta['held_out_loss']:.3f}")

    seqs, feats = distill_set(target, stream, args.distill, args.seed, log, shape.target_layer_ids)
    draft_steps = args.draft_steps if args.draft_steps is not None else (args.steps if args.steps < 20 else 1500)
    draft, d_losses, d_accs = train_draft(target, seqs, feats, draft_steps, args.draft_batch, args.anchors, args.gamma,
                                          mask_id, args.seed, log, shape)
    draft.save_pretrained(out / "draft")
    tok.save_pretrained(out / "draft")  # a checkpoint-shaped folder: config, weights, tokenizer
    meta = {
        "corpus": f"the Python {sys.version.split()[0]} standard library sources ({len(texts)} files, "
                  f"{size / 1e6:.1f} MB; tests and GUI packages left out; 1 in 20 files held out)",
        "seed": args.seed, "torch_threads": args.threads,
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "vocab": len(tok), "eos": EOS, "mask": MASK, "mask_id": mask_id},
        "target": target_meta,
        "draft": {"class": "DFlashDraftModel", "block_size": shape.block, "layers": shape.draft_layers,
                  "target_layer_ids": list(shape.target_layer_ids),
                  "steps": draft_steps, "batch": args.draft_batch, "anchors_per_sequence": args.anchors,
                  "loss_decay_gamma": args.gamma, "distillation_sequences": args.distill,
                  "distillation": f"{PROMPT}-token corpus prompts, the target's greedy continuation to {SEQ} tokens",
                  "final_loss": tail(d_losses), "final_top1": tail(d_accs)},
        "held_out_prompts": held_out_prompts(held, tok, 8, 48, args.seed),
        "target_seconds": t_time, "target_cpu_seconds": t_cpu,
        "training_seconds": None if args.reuse_target else round(time.time() - t0, 1),
        "training_cpu_seconds": None if args.reuse_target else round(time.process_time() - c0, 1),
        "command": "python tools/train_tiny_pair.py " + " ".join(sys.argv[1:]),
    }
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    log(f"done in {time.time() - t0:.0f} s -> {out}")


# ----------------------------------------------------------------------------- measure
def measure(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    tree = Path(args.measure).resolve()
    sys.path.insert(0, str(tree))
    from ddtree import ddtree_generate
    from dflash import dflash_generate
    from model import DFlashDraftModel

    meta = json.loads((out / "metadata.json").read_text())
    block = args.block or meta["draft"]["block_size"]
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32, local_files_only=True).eval()
    draft = DFlashDraftModel.from_pretrained(out / "draft", dtype=torch.float32, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(out / "target", local_files_only=True)
    prompts = [tok(p, return_tensors="pt").input_ids for p in meta["held_out_prompts"]]
    sys.path.insert(0, str(ROOT))
    from patcher.verify.models.load import greedy

    def call(name, budget, ids):
        kw = dict(model=draft, target=target, input_ids=ids, mask_token_id=draft.mask_token_id, max_new_tokens=args.new,
                  block_size=block, stop_token_ids=[], temperature=0.0)
        if budget is None:
            return dflash_generate(**kw)
        return ddtree_generate(**kw, tree_budget=budget)

    figures = {}
    refs = [greedy(target, p, args.new) for p in prompts]
    for name, budget in [("dflash", None)] + [(f"ddtree_tb{b}", b) for b in args.budgets]:
        lengths, exact, start = [], True, time.time()
        for ids, ref in zip(prompts, refs):
            res = call(name, budget, ids)
            new = res.output_ids[0, ids.shape[1]:].tolist()
            exact &= new == ref[: len(new)] and len(new) == len(ref)
            lengths += list(res.acceptance_lengths)
        figures[name] = {"mean_acceptance": round(sum(lengths) / len(lengths), 3), "rounds": len(lengths),
                         "lossless": bool(exact), "seconds": round(time.time() - start, 1)}
        print(name, figures[name], flush=True)
    return figures


# ----------------------------------------------------------------------------- the acceptance floor
FLOOR_BUDGETS = [4, 8, 16, 32]
FLOOR_NEW = 64


def write_floor(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    from patcher.verify.judge.acceptance import floor as acceptance

    out = Path(args.out)
    t0, c0 = time.time(), time.process_time()
    meta = json.loads((out / "metadata.json").read_text())
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32, local_files_only=True).eval()
    draft = draft_class().from_pretrained(out / "draft", dtype=torch.float32, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(out / "target", local_files_only=True)
    texts = meta["held_out_prompts"]
    data = acceptance.measure(
        target, draft, out / "target", out / "draft", [tok(p).input_ids for p in texts], texts,
        block_size=meta["draft"]["block_size"],
        budgets=args.floor_budgets, max_new_tokens=args.floor_new, stop_ids=[tok.eos_token_id],
        command="python tools/train_tiny_pair.py --floor" + (f" --out {args.out}" if Path(args.out) != DEFAULT_OUT else "")
        + (f" --floor-new {args.floor_new}" if args.floor_new != FLOOR_NEW else "")
        + (f" --floor-budgets {','.join(map(str, args.floor_budgets))}" if args.floor_budgets != FLOOR_BUDGETS else ""),
        progress=lambda msg: print(f"[{time.time() - t0:6.0f}s] {msg}", flush=True))
    data["seconds"], data["cpu_seconds"] = round(time.time() - t0, 1), round(time.process_time() - c0, 1)
    (out / acceptance.FLOOR_FILE).write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {out / acceptance.FLOOR_FILE} in {data['seconds']} s ({data['cpu_seconds']} CPU s); "
          f"epsilon {data['epsilon']['logits']:.2e} in logits", flush=True)
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the shipped pair: 1)")
    ap.add_argument("--steps", type=int, default=200, help="target steps (also the drafter's when below 20: a smoke run)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--corpus-mb", type=float, default=6.0)
    ap.add_argument("--distill", type=int, default=1024, help="distillation sequences")
    ap.add_argument("--draft-steps", type=int, default=None)
    ap.add_argument("--draft-batch", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=16, help="blocks per sequence")
    ap.add_argument("--gamma", type=float, default=4.0, help="loss decay exp(-(k-1)/gamma)")
    ap.add_argument("--reuse-target", action="store_true", help="keep --out's target (and tokenizer): train the drafter only")
    ap.add_argument("--floor", action="store_true", help="only (re)write acceptance_floor.json for --out's pair")
    ap.add_argument("--measure", metavar="TREE", default=None, help="a patched DDTree tree: measure acceptance instead of training")
    ap.add_argument("--block", type=int, default=None, help="the drafter's block size (default 8; --measure: the pair's own)")
    ap.add_argument("--vocab", type=int, default=Shape.vocab, help="BPE vocabulary of the tokenizer and both models")
    ap.add_argument("--hidden", type=int, default=Shape.hidden, help="hidden size of both models")
    ap.add_argument("--layers", default=None, help="the target's layer types, comma-separated: linear, full "
                                                   "(default: linear x3 then full, twice)")
    ap.add_argument("--draft-layers", type=int, default=Shape.draft_layers)
    ap.add_argument("--target-layer-ids", default=None, help="the drafter's target layers, comma-separated (default 1,4,6)")
    ap.add_argument("--no-floor", action="store_true", help="train without writing acceptance_floor.json")
    ap.add_argument("--new", type=int, default=64, help="--measure: new tokens per prompt")
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    ap.add_argument("--budgets", type=ints, default=[8, 16, 32])
    ap.add_argument("--floor-new", type=int, default=FLOOR_NEW, help="the floor's new tokens per prompt (the shipped pair: %(default)s)")
    ap.add_argument("--floor-budgets", type=ints, default=FLOOR_BUDGETS,
                    help="the floor's tree budgets (the shipped pair: 4,8,16,32)")
    ap.add_argument("--kind", choices=("dflash", "dflash2", "dspark"), default="dflash",
                    help="dflash2/dspark: train that drafter for --out's target into --out/draft_KIND (tools/train_tiny_kinds.py)")
    ap.add_argument("--confidence-head", action="store_true", help="--kind dspark: with a confidence head")
    ap.add_argument("--no-sample-from-anchor", action="store_true", help="--kind dspark: the bonus-anchor layout")
    args = ap.parse_args(argv)
    if args.kind != "dflash":
        import train_tiny_kinds

        train_tiny_kinds.train_kind(args, sys.modules[__name__])
    elif args.measure:
        figures = measure(args)
        print(json.dumps(figures))
    elif args.floor:
        write_floor(args)
    else:
        train(args)
        if not args.no_floor:
            write_floor(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
