"""ddpatch's own DFlash2 and DSpark drafters: small definitions shaped on their public descriptions, so that a tiny
drafter of each kind can be built from a config with seeded weights, trained (``tools/train_tiny_pair.py``) and
judged. No upstream code: written here from what DFlash2's public ``DFlash2DraftModel`` and llama.cpp's converter
and graph say each checkpoint holds (the tensor names below are the ones that converter reads).

Both extend the DFlash drafter ddpatch ships (``vendored/dflash``):

- ``DFlash2DraftModel``: in every layer two grouped dynamic causal convolutions (``attention_conv``, ``mlp_conv``,
  each a ``base_kernel`` [2, kernel, hidden] and a ``kernel_projection`` of the normed input to 2 x kernel x
  groups taps): side 0 convolves the normed input of the attention (or MLP), side 1 its output, over the block's
  positions, causally, a block at a time; and a ``candidate_selector`` (``predecessor_codebook``,
  ``successor_codebook`` [vocab, rank], ``hidden_projection`` hidden -> rank). ``propose`` walks the lattice.
- ``DSparkDraftModel``: a Markov head (``markov_head.markov_w1`` [vocab, rank], ``markov_w2`` rank -> vocab) adds a
  bias from the token drafted before to each position's logits, an optional ``confidence_head.proj``
  ([hidden; w1[previous]] -> 1, sigmoid) rates each draft token, and ``sample_from_anchor`` reads the anchor's own
  position too. ``propose`` drafts greedily (or sampled) and cuts at ``p_min``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import torch
from torch import nn

_MODULE = "_ddpatch_drafters_dflash"


def dflash_module():
    """The shipped DFlash-shaped drafter module (``vendored/dflash``), imported under a private name."""
    if _MODULE not in sys.modules:
        package = Path(__file__).resolve().parents[2]  # patcher/: a wheel's data/vendored, else the checkout's vendored/
        folder = next((p for p in (package / "data" / "vendored", package.parent / "vendored") if p.is_dir()),
                      package / "data" / "vendored") / "dflash" / "dflash"
        spec = importlib.util.spec_from_file_location(_MODULE, folder / "__init__.py", submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[_MODULE] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{_MODULE}.model")


def field(config, name: str, default=None):
    inner = getattr(config, "dflash_config", None) or {}
    value = getattr(config, name, None)
    return value if value is not None else inner.get(name, default)


class GroupedDynamicConv(nn.Module):
    """Causal convolution over a block's positions, per channel group: the tap of lag ``l`` at position ``t`` is
    ``base_kernel[side, l]`` plus the group's coefficient predicted from the normed input at ``t``."""

    def __init__(self, hidden: int, kernel: int, group: int, block: int):
        super().__init__()
        self.kernel, self.group, self.block = kernel, group, block
        base = torch.zeros(2, kernel, hidden)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)

    def coefficients(self, normed: torch.Tensor) -> torch.Tensor:
        b, n, _ = normed.shape
        return self.kernel_projection(normed).view(b, n, 2, self.kernel, -1)  # [b, n, side, lag, group]

    def apply(self, x: torch.Tensor, coeff: torch.Tensor, side: int) -> torch.Tensor:
        b, n, h = x.shape
        blk = n if n <= self.block else self.block
        taps = coeff[:, :, side].repeat_interleave(self.group, dim=-1) + self.base_kernel[side].to(x.dtype)  # [b, n, lag, h]
        xb, tb = x.view(b, n // blk, blk, h), taps.view(b, n // blk, blk, self.kernel, h)
        out = xb * tb[:, :, :, 0]
        for lag in range(1, min(self.kernel, blk)):
            out = out + torch.nn.functional.pad(xb[:, :, :-lag], (0, 0, lag, 0)) * tb[:, :, :, lag]
        return out.reshape(b, n, h)


def _conv_layer_forward(self, hidden_states, target_hidden, position_embeddings, attention_mask=None,
                        past_key_values=None, **kwargs):
    normed = self.input_layernorm(hidden_states)
    coeff = self.attention_conv.coefficients(normed)
    mixed, _ = self.self_attn(self.attention_conv.apply(normed, coeff, 0), target_hidden, position_embeddings,
                              attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
    hidden_states = hidden_states + self.attention_conv.apply(mixed, coeff, 1)
    normed = self.post_attention_layernorm(hidden_states)
    coeff = self.mlp_conv.coefficients(normed)
    return hidden_states + self.mlp_conv.apply(self.mlp(self.mlp_conv.apply(normed, coeff, 0)), coeff, 1)


class CandidateSelector(nn.Module):
    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def lattice(self, hidden, logits, anchor_ids):
        """(candidates [b, n, k], scores [b, n, k_prev, k]): row ``p`` of position ``i`` scores each candidate of
        ``i`` after candidate ``p`` of ``i - 1`` (position 0: after the anchor, every row alike)."""
        unary, cand = logits.float().topk(self.top_k, dim=-1)
        gate = self.hidden_projection(hidden).float()  # [b, n, r]
        succ = self.successor_codebook[cand].float()  # [b, n, k, r]
        pred = torch.cat([self.predecessor_codebook[anchor_ids][:, None, None].expand(-1, 1, self.top_k, -1),
                          self.predecessor_codebook[cand[:, :-1]]], dim=1).float()  # [b, n, k_prev, r]
        pair = torch.einsum("bipr,bir,bikr->bipk", pred, gate, succ)
        return cand, unary[:, :, None, :] + pair

    def walk(self, cand, scores, temperature: float = 0.0):
        b, n, k = cand.shape
        prev = torch.zeros(b, dtype=torch.long)
        tokens, rows = [], []
        for i in range(n):
            s = scores[torch.arange(b), i, prev]  # [b, k]
            if temperature > 0:
                probs = torch.softmax(s / temperature, -1)
                prev = torch.multinomial(probs, 1)[:, 0]
                rows.append(probs)
            else:
                prev = s.argmax(-1)
            tokens.append(cand[torch.arange(b), i, prev])
        return torch.stack(tokens, 1), torch.stack(rows, 1) if rows else None


def _base():
    return dflash_module().DFlashDraftModel


class DFlash2DraftModel(_base()):
    """DFlash2: grouped dynamic causal convolutions in every layer and a candidate selector (see the module)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        kernel, group = int(field(config, "conv_kernel_size", 3)), int(field(config, "conv_group_size", 16))
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicConv(config.hidden_size, kernel, group, config.block_size)
            layer.mlp_conv = GroupedDynamicConv(config.hidden_size, kernel, group, config.block_size)
            layer.forward = types.MethodType(_conv_layer_forward, layer)
        self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size, int(field(config, "selector_rank", 16)),
                                                    int(field(config, "selector_top_k", 4)))
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, GroupedDynamicConv):
            with torch.no_grad():
                module.base_kernel.zero_()
                module.base_kernel[:, 0] = 1.0
                module.kernel_projection.weight.zero_()

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, output_head: nn.Module, temperature: float = 0.0):
        """(path [b, n], candidates [b, n, k], per-position probabilities over the candidates or None when greedy)
        for the block positions in ``hidden`` (positions 1.. of the block) after ``anchor_ids`` [b]."""
        cand, scores = self.candidate_selector.lattice(hidden, output_head(hidden), anchor_ids)
        path, probs = self.candidate_selector.walk(cand, scores, temperature)
        return path, cand, probs


class DSparkDraftModel(_base()):
    """DSpark: a vanilla Markov head, an optional confidence head, ``sample_from_anchor`` (see the module)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        rank = int(field(config, "markov_rank", 16))
        self.sample_from_anchor = bool(field(config, "sample_from_anchor", True))
        self.markov_head = nn.Module()
        self.markov_head.markov_w1 = nn.Embedding(config.vocab_size, rank)
        self.markov_head.markov_w2 = nn.Linear(rank, config.vocab_size, bias=False)
        if field(config, "has_confidence_head", False):
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(config.hidden_size + rank, 1)
        else:
            self.confidence_head = None
        self.post_init()

    def draft_positions(self) -> slice:
        """The block positions that hold draft tokens: all of them anchor-first, else 1.."""
        return slice(0, None) if self.sample_from_anchor else slice(1, None)

    def markov_logits(self, logits: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        return logits + self.markov_head.markov_w2(self.markov_head.markov_w1(previous))

    def confidence(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        feat = torch.cat([hidden, self.markov_head.markov_w1(previous).to(hidden.dtype)], -1)
        return torch.sigmoid(self.confidence_head.proj(feat))[..., 0]

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, output_head: nn.Module, temperature: float = 0.0,
                p_min: float = 0.0):
        """(tokens [b, n], confidences [b, n] or None, kept [b]) for the draft positions in ``hidden`` (the block's
        ``draft_positions()``), each drafted after the one before (the anchor first); ``kept`` cuts each row at its
        first confidence under ``p_min`` (no cut without a confidence head or with ``p_min`` 0)."""
        logits = output_head(hidden).float()
        prev, tokens, confs = anchor_ids, [], []
        for i in range(hidden.shape[1]):
            if self.confidence_head is not None:
                confs.append(self.confidence(hidden[:, i], prev).float())
            row = self.markov_logits(logits[:, i], prev)
            prev = torch.multinomial(torch.softmax(row / temperature, -1), 1)[:, 0] if temperature > 0 else row.argmax(-1)
            tokens.append(prev)
        tokens = torch.stack(tokens, 1)
        conf = torch.stack(confs, 1) if confs else None
        kept = torch.full((tokens.shape[0],), tokens.shape[1])
        if conf is not None and p_min > 0:
            low = conf < p_min
            kept = torch.where(low.any(1), low.float().argmax(1), kept)
        return tokens, conf, kept


CLASSES = {"DFlash2DraftModel": DFlash2DraftModel, "DSparkDraftModel": DSparkDraftModel}
