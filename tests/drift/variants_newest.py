"""Variants in the shape of DFlash's newest upstream (after 44947fb, which ``vendored/dflash`` is shaped like).

Each ``shape_*`` below is one thing the newest ``dflash/model.py`` does, written for this project from its
description (no upstream code): ``_make_cache(config)`` with a bare ``activate_past_recording()`` and
``_crop_to`` (a 5.x count), ``F.embedding`` on the target's embedding weight times a scale, a last block
shortened to what is left, rejection sampling over a drafter's own candidates (``draft_indices``), and
DFlash2 (a drafter subclass whose ``propose()`` picks the block among the top-k of its logits with a low-rank
selector, with grouped dynamic causal convolutions in each layer). ``newest`` puts them together. Every
variant keeps the vendored decoder's signature; ``semantics.decode_unpatched`` decodes a drafter subclass too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from . import transforms as t
from .variants import BY_NAME, FL, VARIANTS, Variant, _read, build_draft_masks_itself, claims_draft_masks_itself

BENCH = "dflash/benchmark.py"
CHAIN = "dflash/chain.py"
DD, TREE = "dflash.py", "ddtree.py"  # the DDTree tree's copy of DFlash's decoder, and its tree decoder


# ---------------------------------------------------------------- F.embedding on the target's weight, with a scale


RAW_EMBED = '''def _raw_input_embeddings(target, input_ids, scale: float = 1.0):
    """The block's embeddings read straight off the target's embedding matrix (no module call), times ``scale``."""
    return F.embedding(input_ids, target.get_input_embeddings().weight) * scale


'''


def shape_embed_weight(root: Path) -> None:
    t.edit(root, FL, ("from torch import nn\n", "from torch import nn\nfrom torch.nn import functional as F\n"))
    t.insert_before(root, FL, "def _cuda_time() -> float:\n", RAW_EMBED)
    t.edit(
        root, FL,
        ("noise_embedding=target.model.embed_tokens(block),",
         'noise_embedding=_raw_input_embeddings(target, block, float(getattr(model.config, "input_embedding_scale", 1.0))),'),
    )


def claims_embed_weight(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "F.embedding(input_ids, target.get_input_embeddings().weight) * scale" in text
    assert "noise_embedding=_raw_input_embeddings(target, block," in text and ".embed_tokens" not in text


def shape_embed_weight_ddtree(root: Path) -> None:
    for rel in (DD, TREE):
        t.edit(root, rel, ("import torch\n", "import torch\nimport torch.nn.functional as F\n"))
        t.edit(root, rel, ("noise_embedding = target.model.embed_tokens(block_output_ids)",
                           "noise_embedding = F.embedding(block_output_ids, target.get_input_embeddings().weight) * embed_scale"))
        t.edit(root, rel, ("    past_key_values_draft = DynamicCache()\n",
                           '    past_key_values_draft = DynamicCache()\n    embed_scale = float(getattr(model.config, "input_embedding_scale", 1.0))\n'))


def claims_embed_weight_ddtree(root: Path, original: Path) -> None:
    for rel in (DD, TREE):
        text = _read(root, rel)
        assert "F.embedding(block_output_ids, target.get_input_embeddings().weight) * embed_scale" in text
        assert "embed_tokens" not in text


# ---------------------------------------------------------------- _make_cache(config) and _crop_to (a 5.x count)


MAKE_CACHE = '''def _make_cache(config):
    """A cache laid out for the model whose ``config`` this is, recording its past so that it can roll back."""
    cache = DynamicCache(config=config)
    cache.activate_past_recording()
    return cache


def _crop_to(cache, length):
    """Keep the first ``length`` tokens (transformers 5.x: crop takes how many to remove, negative)."""
    remove = cache.get_seq_length() - length
    cache.crop(-remove)


'''


def shape_make_cache(root: Path) -> None:
    t.insert_before(root, FL, "def _cuda_time() -> float:\n", MAKE_CACHE)
    t.edit(
        root, FL,
        ("    target_cache = DynamicCache()\n    draft_cache = DynamicCache()\n",
         "    target_cache = _make_cache(target.config)\n    draft_cache = _make_cache(model.config)\n"),
        ("            draft_cache.crop(start)\n", "            _crop_to(draft_cache, start)\n"),
        ("        target_cache.crop(start)\n", "        _crop_to(target_cache, start)\n"),
    )


def claims_make_cache(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "cache = DynamicCache(config=config)\n    cache.activate_past_recording()\n" in text
    assert "target_cache = _make_cache(target.config)" in text and "draft_cache = _make_cache(model.config)" in text
    assert "cache.crop(-remove)" in text and "_crop_to(target_cache, start)" in text and "_crop_to(draft_cache, start)" in text
    assert "DynamicCache()" not in text and ".crop(start)" not in text


# ---------------------------------------------------------------- rejection sampling with draft_indices


OLD_SPECULATIVE = '''    coins = torch.rand(draft_tokens.shape[0], device=draft_probs.device)
    for i, token in enumerate(draft_tokens.tolist()):
        p, q = target_probs[i, token], draft_probs[i, token]
        if coins[i] * q < p:
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0.0)
'''

# a drafter may give its probabilities over its own candidates only: ``draft_probs[i, j]`` is then the
# probability of token ``draft_indices[i, j]`` (q is zero off the candidates)
NEW_SPECULATIVE = '''    coins = torch.rand(draft_tokens.shape[0], device=draft_probs.device)
    for i, token in enumerate(draft_tokens.tolist()):
        if draft_indices is None:
            q = draft_probs[i, token]
        else:
            q = draft_probs[i][draft_indices[i] == token].sum()
        p = target_probs[i, token]
        if coins[i] * q < p:
            continue
        if draft_indices is None:
            residual = (target_probs[i] - draft_probs[i]).clamp_min(0.0)
        else:
            residual = target_probs[i].index_add(0, draft_indices[i], -draft_probs[i]).clamp_min(0.0)
'''

OLD_DRAFT_SAMPLED = '''            if sampled:
                draft_probs = sampling_probs(draft_logits[0], temperature, top_p, top_k)
                block[:, 1:] = _draw(draft_probs)
'''

# the sampled draft keeps its distribution as (probabilities, token ids) over its candidates, best first:
# the top_k when top_k > 0, else every token
NEW_DRAFT_SAMPLED = '''            if sampled:
                dense = sampling_probs(draft_logits[0], temperature, top_p, top_k)
                kept = top_k if 0 < top_k < dense.shape[-1] else dense.shape[-1]
                draft_probs, draft_indices = dense.topk(kept, dim=-1)
                block[:, 1:] = draft_indices.gather(-1, _draw(draft_probs)[:, None]).T
'''

OLD_REJECT = "            run, next_token = speculative_sampling(block[0, 1:], draft_probs, target_probs)\n"
NEW_REJECT = "            run, next_token = speculative_sampling(block[0, 1:], draft_probs, target_probs, draft_indices)\n"


def shape_draft_indices(root: Path) -> None:
    t.edit(
        root, FL,
        ("    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor\n) -> tuple[int, torch.Tensor]:",
         "    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,\n"
         "    draft_indices: Optional[torch.Tensor] = None,\n) -> tuple[int, torch.Tensor]:"),
        (OLD_SPECULATIVE, NEW_SPECULATIVE),
        ("        if block_size > 1:\n            hidden = model(\n",
         "        draft_indices = None\n        if block_size > 1:\n            hidden = model(\n"),
        (OLD_DRAFT_SAMPLED, NEW_DRAFT_SAMPLED),
        (OLD_REJECT, NEW_REJECT),
    )


def claims_draft_indices(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "draft_indices: Optional[torch.Tensor] = None," in text
    assert "residual = target_probs[i].index_add(0, draft_indices[i], -draft_probs[i])" in text
    assert "draft_probs, draft_indices = dense.topk(kept, dim=-1)" in text and NEW_REJECT in text


# ---------------------------------------------------------------- DFlash2: a drafter that proposes its block itself


DFLASH2 = '''

class GroupedDynamicCausalConv(nn.Module):
    """A short causal convolution over the block's positions whose taps are a learned base plus a
    per-position, per-group correction predicted from the hidden state."""

    def __init__(self, hidden_size: int, lags: int, group: int):
        super().__init__()
        self.lags, self.group = lags, group
        base = torch.zeros(lags, hidden_size)
        base[0] = 1.0  # starts as the identity
        self.base = nn.Parameter(base)
        self.predict = nn.Linear(hidden_size, lags * (hidden_size // group), bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # out[t] = sum over lags of (base[lag] + predicted tap[t, lag]) * x[t - lag], one tap per group of channels
        batch, length, width = x.shape
        taps = self.predict(x).reshape(batch, length, self.lags, width // self.group, 1)
        chunks = x.reshape(batch, length, width // self.group, self.group)
        out = torch.zeros_like(chunks)
        for lag in range(self.lags):
            past = chunks if lag == 0 else torch.cat([torch.zeros_like(chunks[:, :lag]), chunks[:, :-lag]], dim=1)
            out = out + (self.base[lag].reshape(width // self.group, self.group).to(x.dtype) + taps[:, :, lag]) * past
        return out.reshape(batch, length, width)


class CandidateSelector(nn.Module):
    """Proposes the block one position at a time among the top-k of the drafter's logits: each candidate's
    logit plus a low-rank score between the token before it and the candidate, through two small
    codebooks and a projection of the drafter's hidden state. Greedy, or sampled at ``temperature``."""

    def __init__(self, config):
        super().__init__()
        rank = int(getattr(config, "selector_rank", 8))
        self.top_k = int(getattr(config, "selector_top_k", 4))
        self.before = nn.Embedding(config.vocab_size, rank)
        self.after = nn.Embedding(config.vocab_size, rank)
        self.query = nn.Linear(config.hidden_size, rank, bias=False)

    def forward(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor, temperature: float):
        """(tokens [b, n], candidates [b, n, k], probabilities over the candidates [b, n, k] or None if greedy)."""
        top, candidates = logits.float().topk(self.top_k, dim=-1)
        query = self.query(hidden).float()
        previous, tokens, rows = anchor_ids, [], []
        for i in range(hidden.shape[1]):
            pair = torch.einsum("br,bkr->bk", self.before(previous).float() * query[:, i], self.after(candidates[:, i]).float())
            scores = top[:, i] + pair
            if temperature > 0:
                probs = torch.softmax(scores / temperature, dim=-1)
                choice = torch.multinomial(probs, 1)[:, 0]
                rows.append(probs)
            else:
                choice = scores.argmax(dim=-1)
            previous = candidates[:, i].gather(-1, choice[:, None])[:, 0]
            tokens.append(previous)
        return torch.stack(tokens, dim=1), candidates, torch.stack(rows, dim=1) if rows else None


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2: a grouped dynamic causal convolution before each layer's attention and MLP, and a candidate
    selector that proposes the block (``propose``) in place of the argmax of the output head's logits."""

    def __init__(self, config) -> None:
        super().__init__(config)
        lags, group = int(getattr(config, "conv_kernel_size", 3)), int(getattr(config, "conv_group_size", 8))
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicCausalConv(config.hidden_size, lags, group)
            layer.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, lags, group)
        self.candidate_selector = CandidateSelector(config)
        self.post_init()

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, output_head: nn.Module, temperature: float):
        return self.candidate_selector(hidden, output_head(hidden), anchor_ids, temperature)
'''

OLD_LAYER_FORWARD = '''        mixed, _ = self.self_attn(
            self.input_layernorm(hidden_states),
'''

OLD_LAYER_MLP = "        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))\n"

OLD_DRAFT_GREEDY = '''            draft_logits = target.lm_head(hidden[:, 1:])
            if sampled:
'''

NEW_DRAFT_BRANCH = '''            if isinstance(model, DFlash2DraftModel):
                proposal, candidates, candidate_probs = model.propose(hidden[:, 1:], block[:, 0], target.lm_head, temperature)
                block[:, 1:] = proposal
                if sampled:
                    draft_probs, draft_indices = candidate_probs[0], candidates[0]
            elif sampled:
'''


def shape_dflash2(root: Path) -> None:
    shape_draft_indices(root)  # DFlash2's sampled proposals come with their candidates: the rejection needs them
    t.edit(
        root, FL,
        ("        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)\n",
         "        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)\n"
         "        self.attention_conv = self.mlp_conv = None  # DFlash2 sets them\n"),
        (OLD_LAYER_FORWARD,
         "        normed = self.input_layernorm(hidden_states)\n"
         "        mixed, _ = self.self_attn(\n"
         "            normed if self.attention_conv is None else self.attention_conv(normed),\n"),
        (OLD_LAYER_MLP,
         "        normed = self.post_attention_layernorm(hidden_states)\n"
         "        return hidden_states + self.mlp(normed if self.mlp_conv is None else self.mlp_conv(normed))\n"),
        (OLD_DRAFT_GREEDY, "            draft_logits = target.lm_head(hidden[:, 1:])\n" + NEW_DRAFT_BRANCH),
    )
    path = root / FL
    path.write_text(path.read_text(encoding="utf-8") + DFLASH2, encoding="utf-8")


def claims_dflash2(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "\nclass DFlash2DraftModel(DFlashDraftModel):\n" in text
    assert "\nclass CandidateSelector(nn.Module):\n" in text and "\nclass GroupedDynamicCausalConv(nn.Module):\n" in text
    assert "def propose(self, hidden" in text and "if isinstance(model, DFlash2DraftModel):" in text
    assert "model.propose(hidden[:, 1:], block[:, 0], target.lm_head, temperature)" in text
    claims_draft_indices(root, original)


# ---------------------------------------------------------------- the last block shortened to what is left


def shape_last_block(root: Path) -> None:
    t.edit(
        root, FL,
        ("    sequence = torch.full((1, max_length + block_size), mask_token_id,",
         "    sequence = torch.full((1, max_length + 1), mask_token_id,"),
        ("    while start < max_length:\n        block = sequence[:, start : start + block_size].clone()\n",
         "    while start + 1 < max_length:\n"
         "        verify_size = min(block_size, max_length - start)  # the last block: only what is left\n"
         "        block = sequence[:, start : start + verify_size].clone()\n"),
        ("        if block_size > 1:\n            hidden = model(\n", "        if verify_size > 1:\n            hidden = model(\n"),
        ("                position_ids=positions[:, draft_cache.get_seq_length() : start + block_size],\n",
         "                position_ids=positions[:, draft_cache.get_seq_length() : start + verify_size],\n"),
        ("            position_ids=positions[:, start : start + block_size],\n",
         "            position_ids=positions[:, start : start + verify_size],\n"),
        ("        if sampled and block_size > 1:\n", "        if sampled and verify_size > 1:\n"),
        ("        acceptance_lengths.append(run + 1)\n\n        start += run + 1\n",
         "        produced = min(run + 1, max_length - start - 1)\n"
         "        acceptance_lengths.append(produced)\n\n        start += produced\n"),
        ("            context = extract_context_feature(out.hidden_states, model.target_layer_ids)[:, : run + 1]\n",
         "            context = extract_context_feature(out.hidden_states, model.target_layer_ids)[:, :produced]\n"),
    )


def claims_last_block(root: Path, original: Path) -> None:
    text = _read(root, FL)
    assert "verify_size = min(block_size, max_length - start)" in text and "while start + 1 < max_length:" in text
    assert "produced = min(run + 1, max_length - start - 1)" in text and "(1, max_length + 1)" in text
    assert "start : start + block_size" not in text


# ---------------------------------------------------------------- torch imported lazily in the benchmark


OLD_SET_DEVICE = '''    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .model import DFlashDraftModel, dflash_generate

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
'''

# three lazy spellings: `from torch import cuda` in the function, `import torch` in a helper, and a timer
# that imports the function itself
NEW_SET_DEVICE = '''    import torch
    from torch import cuda
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .model import DFlashDraftModel, dflash_generate

    cuda.set_device(_local_rank())
'''

LAZY_HELPERS = '''def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def _wall_time() -> float:
    """Seconds, once the GPU has finished what it was given (torch is imported here, not by the module)."""
    from torch.cuda import synchronize

    synchronize()
    return time.perf_counter()


'''


def shape_lazy_bench(root: Path) -> None:
    t.edit(root, BENCH, ("import statistics\n", "import statistics\nimport time\n"), (OLD_SET_DEVICE, NEW_SET_DEVICE))
    t.insert_before(root, BENCH, "def _run_transformers(", LAZY_HELPERS)
    t.edit(
        root, BENCH,
        ("    results = _run_transformers(args)\n",
         "    started = _wall_time()\n    results = _run_transformers(args)\n"
         '    print(f"ran in {_wall_time() - started:.0f} s")\n'),
    )


def module_level_imports(text: str) -> set[str]:
    """The top-level packages a module imports when it is imported (its module-level import statements)."""
    import ast

    names = set()
    for node in ast.parse(text).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def claims_lazy_bench(root: Path, original: Path) -> None:
    text = _read(root, BENCH)
    assert {"torch", "transformers"}.isdisjoint(module_level_imports(text))
    assert "    from torch import cuda\n" in text and "    cuda.set_device(_local_rank())\n" in text
    assert "    from torch.cuda import synchronize\n\n    synchronize()\n" in text


# ---------------------------------------------------------------- a second decoder, in another file


CHAIN_HEADER = '''"""A second chain decoder, kept beside the package's own: the same loop under another name."""

from types import SimpleNamespace
from typing import Optional

import torch
from torch import nn
from transformers import DynamicCache

from .model import _cuda_time, _draw, extract_context_feature, sample, sampling_probs, speculative_sampling


'''


def shape_second_decoder(root: Path) -> None:
    text = _read(root, FL)
    begin = text.index("@torch.inference_mode()\ndef dflash_generate(")
    end = text.index("# ---------------------------------------------------------------- draft model")
    decoder = t.replace(text[begin:end], "def dflash_generate(", "def chain_generate(", where=FL)
    (root / CHAIN).write_text(CHAIN_HEADER + decoder.rstrip() + "\n", encoding="utf-8")


def claims_second_decoder(root: Path, original: Path) -> None:
    chain, model = _read(root, CHAIN), _read(root, FL)
    assert "def chain_generate(" in chain and "def dflash_generate(" in model and "def dflash_generate(" not in chain
    assert chain.count("DynamicCache()") == 2 and "target.model.embed_tokens(block)" in chain


# ---------------------------------------------------------------- the newest upstream, every shape at once


def together(*parts: Callable) -> Callable:
    """Run each of ``parts`` (shapes, or claims) in turn with the same arguments."""
    def run(*args) -> None:
        for part in parts:
            part(*args)

    return run


#: 5.x-native caches, embeddings and crops; but the bare activate_past_recording() breaks 5.25's GDN forward
MAKE_CACHE_STATUSES = {"target-cache-config": "fixed-upstream", "crop-compat": "applied", "verify-forward": "applied"}
EMBED_STATUSES = {"input-embeddings": "fixed-upstream"}
TIMING_STATUSES = {"cpu-safe-timing": "applied"}

VARIANTS_NEWEST = [
    Variant(
        "embed-weight", "newest upstream", "dflash", shape_embed_weight, claims_embed_weight,
        statuses=EMBED_STATUSES,
        summary="`F.embedding(ids, target.get_input_embeddings().weight) * scale` embeds the block (no module call)",
    ),
    Variant(
        "embed-weight-ddtree", "newest upstream", "ddtree", shape_embed_weight_ddtree, claims_embed_weight_ddtree,
        summary="the same in both DDTree decoders (the drafter's own `spec_generate` keeps its `embed_tokens`)",
    ),
    Variant(
        "make-cache", "newest upstream", "dflash", shape_make_cache, claims_make_cache,
        statuses=MAKE_CACHE_STATUSES,
        summary="`_make_cache(config)`: `DynamicCache(config=config)` + bare `activate_past_recording()`, "
        "called with `target.config` and `model.config`; both crops through `_crop_to` (a 5.x count)",
    ),
    Variant(
        "draft-indices", "newest upstream", "dflash", shape_draft_indices, claims_draft_indices,
        summary="rejection sampling takes the draft's probabilities over its candidates (`draft_indices`)",
    ),
    Variant(
        "dflash2", "newest upstream", "dflash", shape_dflash2, claims_dflash2,
        summary="a `DFlash2DraftModel(DFlashDraftModel)` subclass: candidate selector over the top-k, grouped "
        "dynamic causal convolutions, `propose()`; the decoder branches on `isinstance`",
    ),
    Variant(
        "last-block-short", "newest upstream", "dflash", shape_last_block, claims_last_block,
        summary="`verify_size = min(block_size, max_length - start)`, `produced = min(run + 1, max_length - start - 1)`",
    ),
    Variant(
        "lazy-torch-bench", "newest upstream", "dflash", shape_lazy_bench, claims_lazy_bench,
        statuses=TIMING_STATUSES,
        summary="the benchmark imports torch only inside functions (`from torch import cuda`, `from torch.cuda import synchronize`)",
    ),
    Variant(
        "second-decoder", "newest upstream", "dflash", shape_second_decoder, claims_second_decoder,
        summary="a copy of the decode loop as `chain_generate` in `dflash/chain.py`, beside `dflash_generate`",
    ),
    Variant(
        "newest", "newest upstream", "dflash",
        together(shape_embed_weight, shape_make_cache, shape_dflash2, shape_last_block, shape_lazy_bench, build_draft_masks_itself),
        together(claims_embed_weight, claims_make_cache, claims_dflash2, claims_last_block, claims_lazy_bench,
                 claims_draft_masks_itself),
        statuses={**EMBED_STATUSES, **MAKE_CACHE_STATUSES, **TIMING_STATUSES, "draft-sliding-window": "fixed-upstream"},
        summary="every shape above but the second decoder, together, with a drafter that masks itself (`draft-masks-itself`)",
    ),
]

VARIANTS.extend(VARIANTS_NEWEST)
BY_NAME.update({v.name: v for v in VARIANTS_NEWEST})
