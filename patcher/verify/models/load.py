"""Loading the models the verifier decodes with (a preset or local folders), and the target's
own greedy decoding, which is the oracle's reference."""

from __future__ import annotations

import contextlib
from pathlib import Path

from . import presets, prompts as prompt_files
from ..plumbing.events import emit

DRAFT_WINDOW = 16

#: Logit spread (std) the presets' target gets for sampled verification. Its random lm_head gives
#: a std of about 0.15, a next-token distribution so flat that a wrong acceptance rule cannot show
#: in a distributional test; a trained model's is peaked. Scaling lm_head keeps every argmax.
SAMPLING_LOGIT_STD = 3.0


def prepare_for_sampling(target, mask_token_id: int) -> None:
    """Peak the preset target's next-token distribution and make its mask token impossible, as in a
    trained model (upstream decoders strip mask tokens from their output)."""
    import torch

    head = target.get_output_embeddings()
    with torch.no_grad():
        probe = torch.arange(min(16, head.weight.shape[0] - 1))[None]
        std = float(target(probe, use_cache=False).logits.float().std())
        head.weight.mul_(SAMPLING_LOGIT_STD / max(std, 1e-6))

    def no_mask(module, args, output):
        # e^-40 below the least likely token: never drawn. Finite on purpose: logits of a dtype's
        # minimum would swamp any scale-relative comparison of logits (the runtime's mask probe).
        output = output.clone()
        output[..., mask_token_id] = output.amin(dim=-1) - 40.0
        return output

    head.register_forward_hook(no_mask)


def load_preset(name: str, seed: int, draft_classes: dict, block_size: int, default_init: bool = False, sampling: bool = False):
    """The preset's target and one drafter of each class in ``draft_classes`` (name -> class; a class that cannot be
    built from a scaled-down config is left out, its reason in the third value), and the mask id."""
    import torch

    target = presets.build_target(name, seed=seed, **({"default_init": True} if default_init else {}))
    drafts, notes = {}, {}
    for cls_name, cls in draft_classes.items():
        torch.manual_seed(seed + 1)
        try:
            # two layers, the first a sliding-window one as in Qwen3.6 drafters, with a window the prompts outgrow
            drafts[cls_name] = build_drafter(cls, target, block_size, presets.MASK_TOKEN_ID)
        except Exception as exc:  # a drafter class whose config the verifier cannot make up
            notes[cls_name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) else type(exc).__name__
    if sampling:
        prepare_for_sampling(target, presets.MASK_TOKEN_ID)
    return target, drafts, presets.MASK_TOKEN_ID, notes


#: Defaults for drafter config fields a class reads beyond DFlash's (DFlash2's selector and convolutions), by how
#: the field's name ends; a field named nowhere here is left unset.
FIELD_DEFAULTS = (("kernel_size", 2), ("group_size", 16), ("selector_rank", 8), ("_rank", 8), ("top_k", 8), ("num_candidates", 8))


def _fields_read(cls) -> list[str]:
    """String literals in the source of ``cls``'s module that look like config field names."""
    import ast
    import inspect

    try:
        source = inspect.getsource(inspect.getmodule(cls))
    except (OSError, TypeError):
        return []
    names = {n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and n.value.isidentifier() and n.value.islower()}
    return sorted(names)


def _construct(cls, cfg):
    """``cls(cfg)``, every parameter it leaves uninitialised (``nn.Parameter(torch.empty(...))``, which a checkpoint
    would fill: DFlash2's convolution kernels) made zeros, so that a built drafter is finite and the same every run."""
    import torch

    empty = torch.empty

    def zeros(*args, **kwargs):
        kwargs.pop("memory_format", None)
        return torch.zeros(*args, **kwargs)

    torch.empty = zeros
    try:
        return cls(cfg).eval()
    finally:
        torch.empty = empty


def build_drafter(cls, target, block_size: int, mask_token_id: int, num_layers: int = 2):
    """A drafter of ``cls`` fitting ``target``, from a scaled-down config: DFlash's fields, and for a class that needs
    more (DFlash2's ``conv_kernel_size``, ``selector_rank``...), small values for the fields its module reads."""
    cfg = presets.draft_config(target, cls.config_class, num_layers=num_layers, block_size=block_size, sliding_window=DRAFT_WINDOW)
    cfg.dflash_config = {**cfg.dflash_config, "mask_token_id": mask_token_id}
    try:
        return _construct(cls, cfg)
    except Exception as first:
        extra = {}
        for field in _fields_read(cls):
            value = next((v for end, v in FIELD_DEFAULTS if field.endswith(end)), None)
            if value is not None and getattr(cfg, field, None) is None and field not in cfg.dflash_config:
                extra[field] = value
        if not extra:
            raise first
        cfg.dflash_config = {**cfg.dflash_config, **extra}
        for key, value in extra.items():
            setattr(cfg, key, value)
        return _construct(cls, cfg)


def load_real(cfg: dict, draft_classes: dict, primary: str | None):
    """The ``--target`` folder, and the drafter: the ``--draft`` folder loaded with the tree's class its config names
    (``architectures``), else the primary; or, scripted, one drafter of each class. Returns (target, drafts, mask, notes)."""
    import torch

    for key in ("target", "draft"):
        if cfg.get(key) and not Path(cfg[key]).exists():
            raise FileNotFoundError(f"--{key} {cfg[key]} does not exist")
    dtype = getattr(torch, cfg.get("dtype") or "bfloat16")
    common = dict(dtype=dtype, local_files_only=True, trust_remote_code=bool(cfg.get("trust_remote_code")))
    if cfg.get("device_map"):
        common["device_map"] = cfg["device_map"]
    with bad_folder("--target", cfg["target"]):
        target = load_target(cfg["target"], cfg.get("attn_implementation"), common).eval()
    notes = {}
    if cfg.get("draft"):
        name = drafter_class_of(cfg["draft"], draft_classes, primary)
        with bad_folder("--draft", cfg["draft"]):
            drafts = {name: draft_classes[name].from_pretrained(cfg["draft"], attn_implementation=cfg.get("draft_attn_implementation")
                                                                or "sdpa", **common)}
        notes = {n: f"the --draft folder is a {name}" for n in draft_classes if n != name}
    else:
        drafts = {}
        for name, cls in draft_classes.items():
            try:
                drafts[name] = scripted_draft_for(target, cls, cfg["block_size"], dtype)
            except Exception as exc:
                notes[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if not cfg.get("device_map"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        target = target.to(device)
        drafts = {n: d.to(device) for n, d in drafts.items()}
    else:
        drafts = {n: d.to(target.get_input_embeddings().weight.device) for n, d in drafts.items()}
    first = next(iter(drafts.values()), None)
    return target, {n: d.eval() for n, d in drafts.items()}, getattr(first, "mask_token_id", None), notes


@contextlib.contextmanager
def bad_folder(flag: str, folder: str):
    """A folder the loader cannot read (no weights, a truncated or corrupt file) is the user's input: a ValueError
    naming it (one ``ddpatch: error:`` line, exit 2), never a crash of the verifier. The parent checked the folder
    already (``folders.check_pair``); this catches what only the loader sees."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, OSError) or "Safetensor" in type(exc).__name__ or "HeaderTooLarge" in str(exc):
            raise ValueError(f"{flag} {folder}: cannot load it: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from None
        raise


def drafter_class_of(folder: str, draft_classes: dict, primary: str | None) -> str:
    """The tree's drafter class a ``--draft`` folder is for: the first of its config's ``architectures`` the tree
    defines, else the primary class."""
    import json

    try:
        names = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        names = []
    found = next((n for n in names if n in draft_classes), None)
    if found is None and primary is None:
        raise ValueError(f"--draft {folder}: the tree defines no drafter class")
    return found or primary


#: The Auto classes a folder's ``architectures`` may map to, in the order transformers' pipelines try them.
AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForVision2Seq", "AutoModel")


def auto_class_for(config):
    """The first Auto class whose mapping holds one of the folder's ``architectures`` (else the first that maps its config)."""
    import transformers

    wanted = set(getattr(config, "architectures", None) or ())
    classes = [getattr(transformers, name) for name in AUTO_CLASSES if hasattr(transformers, name)]
    for auto in classes:
        mapped = auto._model_mapping.get(type(config), None) if type(config) in auto._model_mapping else None
        names = {c.__name__ for c in (mapped if isinstance(mapped, (list, tuple)) else [mapped]) if c is not None}
        if wanted & names:
            return auto, sorted(wanted & names)[0]
    for auto in classes:
        if type(config) in auto._model_mapping:
            return auto, None
    return classes[0], None


def load_target(folder: str, requested: str | None, common: dict):
    """The target through the Auto class that maps its ``architectures`` (causal LM, then image-text-to-text),
    with the requested attention implementation, else sdpa, else eager (``loaded_with`` says which)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=common.get("trust_remote_code", False))
    auto, arch = auto_class_for(config)
    tried, errors = [], []
    for attn in dict.fromkeys([requested or "sdpa", "sdpa", "eager"]):
        try:
            model = auto.from_pretrained(folder, attn_implementation=attn, **common)
        except (ValueError, ImportError) as exc:  # "does not support ... yet", a missing kernel package
            tried.append(attn)
            errors.append(str(exc).splitlines()[0][:200])
            continue
        model._ddpatch_loaded = {"auto_class": auto.__name__, "architecture": arch, "attn_implementation": attn,
                                 "attn_requested": requested or "sdpa", "fell_back_from": tried}
        return model
    raise ValueError(f"--target {folder}: no attention implementation loads it ({'; '.join(errors)})")


def loaded_with(target, cfg: dict) -> dict:
    """What the verdict was reached with: the report's header."""
    info = dict(getattr(target, "_ddpatch_loaded", {}))
    info.update(dtype=str(target.dtype).replace("torch.", ""), device=str(target.get_input_embeddings().weight.device),
                device_map=cfg.get("device_map") or None)
    info.setdefault("attn_implementation", getattr(target.config, "_attn_implementation", None))
    info["settings"] = {k: cfg.get(k) for k in ("block_size", "tree_budgets", "prompts", "max_new_tokens")}
    if cfg.get("prompt_records"):
        info["settings"]["prompts"] = len(cfg["prompt_records"])
    info["settings_from"] = cfg.get("settings_from") or {}
    return info


def scripted_draft_for(target, draft_cls, block_size: int, dtype):
    """A draft of the tree's own class that fits ``target`` (``--target DIR --scripted-draft``).

    Its weights do not matter: the scripted hook decides its proposals. Like the presets' draft
    it has two layers, the first a sliding-window one, and its mask token is the target's last
    vocabulary id.
    """
    import torch

    torch.manual_seed(1)
    return build_drafter(draft_cls, target, block_size, int(presets.text_config(target).vocab_size) - 1).to(dtype).eval()


def check_fit(target, draft) -> None:
    """A clear error when the draft was not made for this target."""
    tc = target.config.get_text_config(decoder=True)
    dc = draft.config
    problems = []
    if getattr(dc, "hidden_size", None) != tc.hidden_size:
        problems.append(f"hidden size {dc.hidden_size} vs target {tc.hidden_size}")
    ids = list(getattr(draft, "target_layer_ids", []) or [])
    if ids and max(ids) >= tc.num_hidden_layers:
        problems.append(f"target_layer_ids {ids} beyond the target's {tc.num_hidden_layers} layers")
    if getattr(draft, "mask_token_id", None) is not None and draft.mask_token_id >= tc.vocab_size:
        problems.append(f"mask token {draft.mask_token_id} outside the target's vocabulary of {tc.vocab_size}")
    if problems:
        raise ValueError("draft does not fit the target: " + "; ".join(problems))


# ----------------------------------------------------------------------------- the reference
def greedy(target, prompt, max_new_tokens: int, stop_ids=(), use_cache: bool = True, rows: list | None = None,
           hidden: list | None = None) -> list[int]:
    """The target's own greedy decoding, one token at a time (the oracle's reference). ``rows``: a list that receives
    the logits row (float32, CPU) that decided each token: the noise floor's token-by-token way, not computed again.
    ``hidden`` (with a cache): a list that receives each forward's hidden states, a forward for the last token too: the
    drafter oracle's token-by-token features (``drafter_oracle.calibrate``), the same forwards."""
    import torch
    from transformers import DynamicCache

    from .context import with_cache

    ids = prompt.clone()
    out: list[int] = []
    # greedy reads the last row: the LM head over the others (vocabulary x hidden each) would be wasted; the cached
    # prefill keeps them, so its last row is the one a token-by-token decode computes, bit for bit
    last = last_row_only(target)
    if max_new_tokens <= 0:
        return out
    states = {"output_hidden_states": True} if hidden is not None and use_cache else {}
    with torch.inference_mode():
        if use_cache:
            cache = DynamicCache(config=target.config)
            output = target(ids, **with_cache(target, cache), use_cache=True, **states)
            if states:
                hidden.append(output.hidden_states)
            logits = output.logits
        else:
            logits = target(ids, use_cache=False, **last).logits
        for _ in range(max_new_tokens):
            if rows is not None:
                rows.append(logits[0, -1].float().cpu())
            token = int(logits[0, -1].argmax())
            out.append(token)
            done = token in stop_ids or len(out) == max_new_tokens
            if done and not states:  # no forward for a token nobody reads
                break
            step = torch.tensor([[token]], device=ids.device)
            if use_cache:
                output = target(step, **with_cache(target, cache), use_cache=True, **last, **states)
                if states:
                    hidden.append(output.hidden_states)
                if done:
                    break
                logits = output.logits
            else:
                ids = torch.cat([ids, step], dim=1)
                logits = target(ids, use_cache=False, **last).logits
    return out


def last_row_only(target) -> dict:
    """``{"logits_to_keep": 1}`` where the target's forward takes it (transformers' causal LMs), else ``{}``."""
    import inspect

    try:
        takes = "logits_to_keep" in inspect.signature(target.forward).parameters
    except (TypeError, ValueError):
        takes = False
    return {"logits_to_keep": 1} if takes else {}


def multi_token_consistent(target, prompt, continuation: list[int]) -> tuple[bool, float]:
    """A multi-token forward from a cache must equal token-by-token decoding from it."""
    import torch
    from transformers import DynamicCache

    from .context import with_cache

    cont = torch.tensor([continuation], device=prompt.device)
    with torch.inference_mode():
        a = DynamicCache(config=target.config)
        target(prompt, **with_cache(target, a), use_cache=True)
        block = target(cont, **with_cache(target, a), use_cache=True).logits[0].float()
        b = DynamicCache(config=target.config)
        target(prompt, **with_cache(target, b), use_cache=True)
        steps = [target(cont[:, i : i + 1], **with_cache(target, b), use_cache=True).logits[0, -1].float() for i in range(cont.shape[1])]
    steps_t = torch.stack(steps)
    same = bool((block.argmax(-1) == steps_t.argmax(-1)).all())
    return same, float((block - steps_t).abs().max())


# ----------------------------------------------------------------------------- prompts
def random_prompts(n: int, length: int, seed: int, vocab_hi: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_hi, (1, length), generator=gen) for _ in range(n)]

BUILTIN_PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 100.",
)


def target_tokenizer(cfg: dict):
    """The ``--target`` folder's tokenizer, or None where it has none (or none that encodes)."""
    from transformers import AutoTokenizer

    if not any((Path(cfg["target"]) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        return None
    try:
        tok = AutoTokenizer.from_pretrained(cfg["target"], local_files_only=True, trust_remote_code=bool(cfg.get("trust_remote_code")))
    except (OSError, ValueError, TypeError):
        return None
    return tok if tok("a", return_tensors="pt").input_ids.numel() else None


def tokenized_prompts(cfg: dict, n: int, vocab: int, target=None):
    """(prompts, stop ids, how they were made): the ``--prompts-file`` records (``prompts.tokenize_records``: every
    one, checked against the target's context before any decodes), else the built-in prompts, through the target's
    tokenizer and its chat template; random ids if the folder has no tokenizer."""
    import torch

    tok = target_tokenizer(cfg)
    records = cfg.get("prompt_records")
    if records:
        if tok is None:
            raise ValueError(f"--prompts-file: the target folder {cfg['target']} has no tokenizer to read the prompts with")
        text_config = target.config.get_text_config(decoder=True) if target is not None else None
        max_context = getattr(text_config, "max_position_embeddings", None)
        ids = prompt_files.tokenize_records(records, tok, max_context, cfg["max_new_tokens"])
        note = f"{len(ids)} prompt(s) from {prompt_files.describe_source(cfg.get('prompts_source') or {})}; {prompt_files.template_note(tok)}"
        return [torch.tensor([i]) for i in ids], _stops(tok), note
    if tok is None:
        emit("progress", done=0, total=1, label="no tokenizer in the target folder: random token prompts")
        return random_prompts(n, cfg["prompt_len"], cfg["seeds"][0], vocab - 1), [], "random token ids (the target folder has no tokenizer)"
    out = []
    for text in BUILTIN_PROMPTS[:n]:
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        out.append(tok(text, return_tensors="pt").input_ids)
    return out, _stops(tok), f"{len(out)} built-in prompt(s); {prompt_files.template_note(tok)}"


def _stops(tok) -> list[int]:
    return [tok.eos_token_id] if tok.eos_token_id is not None else []
