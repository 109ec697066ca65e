"""The probe ``lossless`` runs on entry: can it serve this model exactly? Decided by what the model does.

Once per model class, configuration, dtype, device type and transformers release (``VERDICTS``), on the
model itself, through its own ``generate()`` (so every family gets the inputs transformers builds for it),
greedy, on a short seeded prompt (``PROMPT`` random ids, then ``DRAFT`` generated tokens t1 .. tk):

1. **token by token**: plain greedy ``generate()``: the logits that pick t1 .. tk, each from a one-token forward
   on the cache; the cache it returns shows the layout each layer really has; then one prompt-lookup
   ``generate()`` under the recording: transformers' own speculative loop must run on it;
2. **multi-token on a cache**: ``generate()`` continued from the cache of the prompt over t1 .. t(k-1) at once,
   the forward a speculative verify runs; its last logits must equal step 1's;
3. **the noise floor**: the same sequence from scratch (one multi-token forward, no cache): how far a
   multi-token and a one-token forward round apart in this dtype, on this model, with no cache involved;
4. **the commit**: under the recording, step 2 again, then ``cache.crop`` back into it, then the next token:
   its logits must equal step 1's at that position.

Refused, in one ``UnsupportedModelError`` line: a cache that is not transformers' layered cache (xLSTM,
RWKV keep their own), a stateful layer the runtime finds no mixer for, a layer class it does not know, a
plain or speculative ``generate()`` or a continuation from its cache that transformers itself cannot run, a step 2 or
step 4 further from step 1 than ``MULTIPLE`` times the floor (never less than one unit in the last place of
the largest logit). In float32 the floor is about 1e-7 and the families refused on it miss by 1e-3 or more
(docs/models.md); in bfloat16 an inexactness below the dtype's own rounding cannot be seen, and is no larger
than what plain greedy decoding itself mixes (its prefill is a multi-token forward, its decoding one-token).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import time
from dataclasses import dataclass

from .forwards import _install, _uninstall, family

PROMPT, DRAFT = 6, 5
#: how many noise floors a multi-token cached forward may be from token-by-token decoding
MULTIPLE = 4.0
VERDICTS: dict = {}


@dataclass(frozen=True)
class Verdict:
    """What the probe found: ``reason`` is None when ``lossless`` serves the model."""

    reason: str | None
    floor: float | None = None  # max |from scratch - token by token| (logits)
    error: float | None = None  # max |multi-token on the cache - token by token|
    commit_error: float | None = None  # max |after a recorded verify cut back - token by token|
    seconds: float = 0.0


def refusal(model) -> str | None:
    """Why ``lossless`` must refuse ``model`` (one line naming the family), or None when it serves it."""
    return probe(model).reason


def probe(model) -> Verdict:
    """The probe's verdict for ``model``, run once per class, configuration, dtype, device and release."""
    key = _key(model)
    verdict = VERDICTS.get(key)
    if verdict is None:
        start = time.perf_counter()
        verdict = _judge(model)
        verdict = Verdict(verdict.reason, verdict.floor, verdict.error, verdict.commit_error, time.perf_counter() - start)
        VERDICTS[key] = verdict
    return verdict


def _key(model) -> tuple:
    import transformers

    config = getattr(model, "config", None)
    try:
        text = config.to_dict() if config is not None else {}
    except Exception:  # a config that cannot say: one verdict per instance
        text = {"id": id(model)}
    for name in ("_name_or_path", "transformers_version", "architectures", "name_or_path"):
        text.pop(name, None)
    digest = hashlib.sha256(json.dumps(text, sort_keys=True, default=str).encode()).hexdigest()[:16]
    weight = _weight(model)
    where = (str(weight.dtype), weight.device.type) if weight is not None else (None, None)
    return (type(model).__module__, type(model).__qualname__, digest, *where, transformers.__version__)


def _weight(model):
    try:
        return model.get_input_embeddings().weight
    except Exception:
        return next(iter(model.parameters()), None)


def _refuse(model, why: str) -> Verdict:
    return Verdict(f"ddpatch: {family(model)}: {why}; speculative generate() stays refused")


def _judge(model) -> Verdict:
    import torch

    from patcher import runtime as rt

    try:
        modules = rt.hybrid_linear_modules(model)
    except rt.UnsupportedModelError as exc:
        return Verdict(str(exc))
    training = {module: module.training for module in model.modules()}  # as they were, submodule by submodule
    model.eval()
    try:
        with torch.no_grad():
            return _behaviour(model, modules)
    finally:
        for module, mode in training.items():
            module.training = mode


def _behaviour(model, modules) -> Verdict:
    import torch
    import transformers

    weight = _weight(model)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, max(2, min(vocab, 1000)), (1, PROMPT), generator=gen).to(weight.device)
    step = _Generate(model)
    try:
        plain = step(prompt, new=DRAFT)
    except Exception as exc:
        return _refuse(model, f"plain greedy generate() fails on it ({_line(exc)}), so lossless cannot check it")
    cache = step.cache_of(plain)
    layout = _layout(model, cache, modules)
    if layout is not None:
        return _refuse(model, layout)
    if cache is None:
        return Verdict(None)  # no cache: generate() runs no speculative mode on it, nothing to roll back
    sequence, decoded = plain.sequences, plain.logits  # decoded[i] picks t(i+1), after t1 .. ti one at a time
    saved = _install(model, record=True)
    try:  # transformers' own speculative loop must accept it (5.23: "assisted decoding requires a cache")
        step(sequence, new=2, prompt_lookup_num_tokens=2)
    except Exception as exc:
        return _refuse(model, f"transformers' own speculative generate() fails on it ({_line(exc)})")
    finally:
        _uninstall(*saved)
    try:
        multi = step(sequence[:, :-1], cache=step.cache_of(step(prompt)))
    except Exception as exc:
        return _refuse(model, f"transformers cannot continue generate() from its returned cache ({_line(exc)}), "
                              "so lossless cannot check its multi-token forward")
    scratch = step(sequence[:, :-1])
    reference = decoded[-1]
    floor = float((scratch.logits[-1] - reference).abs().max())
    ulp = float(torch.finfo(weight.dtype).eps * reference.abs().max()) if weight.dtype.is_floating_point else 0.0
    tolerance = MULTIPLE * max(floor, ulp, 1e-30)
    error = float((multi.logits[-1] - reference).abs().max())
    dtype = str(weight.dtype).replace("torch.", "")
    if error > tolerance:
        return Verdict(
            f"ddpatch: {family(model)}: on transformers {transformers.__version__} a multi-token step of generate() on a "
            f"non-empty cache (what a speculative verify runs) is not exact (max |dlogit| {error:.2g} against token-by-token "
            f"decoding, {error / max(floor, ulp, 1e-30):.2g}x the {dtype} noise floor {max(floor, ulp):.1g}): speculative "
            "generate() would decode other tokens than greedy, so it stays refused", floor, error)
    try:
        committed = _committed(model, step, prompt, sequence, decoded)
    except Exception as exc:
        return _refuse(model, f"ddpatch's runtime cannot commit its cache ({_line(exc)})")
    if committed > tolerance:
        return Verdict(
            f"ddpatch: {family(model)}: the runtime's commit of its cache is not exact (max |dlogit| {committed:.2g} after "
            f"a recorded verify was cut back, tolerance {tolerance:.1g}); speculative generate() stays refused",
            floor, error, committed)
    return Verdict(None, floor, error, committed)


def _committed(model, step, prompt, sequence, decoded) -> float:
    """Step 4: a recorded verify of t1 .. t(k-1), cut back to keep ``keep`` of them, then t(keep+1)."""
    keep = (DRAFT - 1) // 2
    saved = _install(model, record=True)
    try:
        cache = step.cache_of(step(prompt))
        step(sequence[:, :-1], cache=cache)
        cache.crop(-(DRAFT - 1 - keep))
        after = step(sequence[:, : PROMPT + keep + 1], cache=cache)
    finally:
        _uninstall(*saved)
    return float((after.logits[-1] - decoded[keep + 1]).abs().max())


def _layout(model, cache, modules) -> str | None:
    """Why the cache's real layout cannot be committed exactly, or None."""
    from patcher.runtime.caches import _is_linear_layer

    layers = getattr(cache, "layers", None)
    if cache is not None and not isinstance(layers, list):
        if getattr(model, "_is_stateful", False) or modules or not _is_layered(cache):
            return (f"it keeps its state in a cache of its own ({type(cache).__name__}), not in transformers' cache "
                    "layers, so ddpatch cannot roll it back")
        return None
    layers = layers or []
    known = {i for i, _ in modules}
    for i, layer in enumerate(layers):
        # a linear-attention cache layer nothing wrote (5.21 gives NemotronH's MLP and MoE blocks one) holds nothing
        if _is_linear_layer(layer) and i not in known and _holds_state(layer):
            return f"layer {i}'s cache ({type(layer).__name__}) keeps a state, but ddpatch finds no module that updates it"
    stray = sorted(i for i in known if i >= len(layers) or not _is_linear_layer(layers[i]))
    if stray:
        return f"layer {stray[0]}'s cache ({type(layers[stray[0]]).__name__ if stray[0] < len(layers) else 'none'}) holds no state its config says it has"
    return None


def _holds_state(layer) -> bool:
    """Whether plain greedy decoding wrote a state into this linear-attention cache layer."""
    flags = getattr(layer, "has_previous_state", None)
    if isinstance(flags, dict) and any(flags.values()):
        return True
    stores = [getattr(layer, name, None) or {} for name in ("conv_states", "recurrent_states")]
    return any(value is not None and getattr(value, "numel", lambda: 1)() and bool(value.any())
               for store in stores for value in store.values())


def _is_layered(cache) -> bool:
    return hasattr(cache, "get_seq_length") and hasattr(cache, "crop")


class _Generate:
    """Greedy ``generate()`` calls of the probe: one new token unless told, raw logits, the cache returned."""

    def __init__(self, model):
        self.model = model
        from patcher.runtime.discovery import _cache_keyword

        # the parameter annotated with a cache type: cache_params= (Mamba up to 5.23), cache= (5.24+)
        self.keyword = _cache_keyword(model) or (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values")
        config = model.generation_config
        eos = config.eos_token_id
        self.pad = config.pad_token_id if config.pad_token_id is not None else (
            (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0)

    def __call__(self, ids, new: int = 1, cache=None, **mode):
        import torch

        extra = {self.keyword: cache, **mode} if cache is not None else dict(mode)
        # an explicit mask: without one generate() masks every prompt id equal to the pad id as padding
        extra["attention_mask"] = torch.ones_like(ids)
        with _quiet():
            return self.model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1,
                                       use_cache=True, return_dict_in_generate=True, output_logits=True,
                                       pad_token_id=self.pad, **extra)

    @staticmethod
    def cache_of(output):
        for name in ("cache", "past_key_values", "cache_params"):
            value = getattr(output, name, None)
            if value is not None:
                return value
        return None


@contextlib.contextmanager
def _quiet():
    """generate()'s advice (sampling flags in a checkpoint's generation config, deprecations) is for the user's
    own calls, not the probe's."""
    import warnings

    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(level)


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
