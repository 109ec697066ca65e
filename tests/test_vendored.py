"""The upstream-shaped code in ``vendored/`` really decodes, and still carries the idioms the recipe targets.

Unpatched, that code cannot run here (transformers 5.23, CPU): ``DynamicCache.crop`` rejects a
positive length, ``torch.cuda.synchronize`` needs a GPU and ``datasets`` is not installed. The
tests therefore run it under three in-process shims instead of editing the sources, and a
separate group of tests checks that the sources still contain those idioms, so that nobody
"fixes" the vendored code by accident and leaves the codemods nothing to do.

The vendored packages use generic top-level names (``model``, ``dflash``, ``ddtree``); they are
imported with their folder on ``sys.path`` and removed from ``sys.modules`` straight after.
"""

from __future__ import annotations

import ast
import importlib
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, Qwen3Config

from patcher.verify.models.presets import MASK_TOKEN_ID, build_target, draft_config

VENDORED = Path(__file__).resolve().parents[1] / "vendored"
DDTREE_DIR = VENDORED / "ddtree"
DFLASH_DIR = VENDORED / "dflash"
GENERIC_MODULES = ("model", "dflash", "ddtree", "benchmark")

SEEDS = (0, 1, 2)
PROMPT_LEN = 8
NEW_TOKENS = 24
BLOCK = 4
BUDGETS = (4, 8)


# ---------------------------------------------------------------- shims and imports


def _crop_accepting_lengths(original):
    """``crop(n)`` with ``n > 0`` meant "keep n tokens" before transformers 5.23; map it onto the new API."""

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            tokens_to_remove = min(0, tokens_to_remove - self.get_seq_length())
        original(self, tokens_to_remove)

    return crop


def _offline_load_dataset(*args, **kwargs):
    raise RuntimeError("the tests never load a real dataset")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the models are tiny: extra intra-op threads only add synchronisation, badly so on a busy machine
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def shims():
    fake_datasets = types.ModuleType("datasets")
    fake_datasets.load_dataset = _offline_load_dataset
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "synchronize", lambda device=None: None)
        mp.setattr(DynamicCache, "crop", _crop_accepting_lengths(DynamicCache.crop))
        mp.setitem(sys.modules, "datasets", fake_datasets)
        yield


def _is_generic(name: str) -> bool:
    return name.split(".")[0] in GENERIC_MODULES


@contextmanager
def vendored_on_path(folder: Path):
    """Import from ``folder`` as if it were the working directory, leaving sys.modules as it was."""
    saved = {name: module for name, module in sys.modules.items() if _is_generic(name)}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))
        for name in [name for name in sys.modules if _is_generic(name)]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def ddtree_code(shims):
    with vendored_on_path(DDTREE_DIR):
        return types.SimpleNamespace(
            ddtree=importlib.import_module("ddtree"),
            dflash=importlib.import_module("dflash"),
            model=importlib.import_module("model"),
        )


@pytest.fixture(scope="module")
def dflash_code(shims):
    with vendored_on_path(DFLASH_DIR):
        return types.SimpleNamespace(model=importlib.import_module("dflash.model"))


# ---------------------------------------------------------------- targets, drafts, references


def greedy_reference(target, prompt: torch.Tensor, steps: int) -> list[int]:
    """The target's own greedy continuation, without any cache: the ground truth."""
    ids = prompt
    with torch.no_grad():
        for _ in range(steps):
            next_id = target(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    return ids[0].tolist()


@pytest.fixture(scope="module")
def cases():
    out = []
    for seed in SEEDS:
        target = build_target("tiny-qwen3", seed)
        gen = torch.Generator().manual_seed(1000 + seed)
        prompt = torch.randint(0, MASK_TOKEN_ID, (1, PROMPT_LEN), generator=gen)
        # long enough for the oracle draft, which looks up to a block past the last new token
        reference = greedy_reference(target, prompt, NEW_TOKENS + max(BUDGETS) + BLOCK)
        out.append(types.SimpleNamespace(seed=seed, target=target, prompt=prompt, reference=reference))
    return out


def make_draft(draft_class, case, attn_implementation: str | None = None):
    torch.manual_seed(case.seed + 500)
    config = draft_config(case.target, Qwen3Config, num_layers=1, block_size=BLOCK)
    if attn_implementation is None:
        return draft_class(config).eval()
    # set_attn_implementation() refuses here: its source heuristic looks for AttentionInterface.get_interface
    return draft_class._from_config(config, attn_implementation=attn_implementation).eval()


def expected_ids(case) -> torch.Tensor:
    return torch.tensor([case.reference[: PROMPT_LEN + NEW_TOKENS]])


@contextmanager
def oracle(draft, case, rank_plan=None):
    """Make ``draft`` propose the target's greedy continuation.

    The draft's output is replaced by hidden states that the target's lm_head maps onto
    chosen logits (a least-squares solve). With ``rank_plan``, position p puts the true
    token at rank ``rank_plan[p]`` (0, 1, or None for absent) so that acceptance is partial.
    """
    weight = case.target.lm_head.weight.detach()

    def wanted_logits(position: int) -> torch.Tensor:
        logits = torch.zeros(weight.shape[0])
        truth = case.reference[position] if position < len(case.reference) else 0
        rank = 0 if rank_plan is None else rank_plan.get(position, 0)
        decoy = (truth + 1 + position) % MASK_TOKEN_ID
        if decoy == truth:
            decoy = (decoy + 1) % MASK_TOKEN_ID
        if rank == 0:
            logits[truth] = 10.0
        elif rank == 1:
            logits[decoy], logits[truth] = 10.0, 9.0
        else:
            logits[decoy] = 10.0
        return logits

    def hook(module, args, kwargs, output):
        positions = kwargs["position_ids"][0, -output.shape[1] :].tolist()
        targets = torch.stack([wanted_logits(p) for p in positions], dim=1)
        hidden = torch.linalg.lstsq(weight, targets).solution.T
        return hidden.unsqueeze(0).to(output.dtype)

    handle = draft.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def partial_rank_plan(seed: int) -> dict[int, int | None]:
    """True token at rank 0, 1 or absent with probabilities 0.6, 0.25, 0.15."""
    gen = torch.Generator().manual_seed(seed + 77)
    draws = torch.rand(PROMPT_LEN + NEW_TOKENS + 2 * BLOCK + max(BUDGETS), generator=gen).tolist()
    return {p: 0 if u < 0.6 else 1 if u < 0.85 else None for p, u in enumerate(draws)}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


# ---------------------------------------------------------------- DDTree-shaped code: tree pieces


def test_build_tree_picks_the_most_likely_nodes(ddtree_code):
    """Best-first expansion returns exactly the ``budget`` highest-scoring nodes of the implicit tree."""
    gen = torch.Generator().manual_seed(3)
    depth, vocab, budget = 3, 5, 7
    logits = torch.randn(depth, vocab, generator=gen) * 2
    tokens, depths, parents, child_maps, visibility = ddtree_code.ddtree.build_ddtree_tree(logits, budget)

    assert len(tokens) == len(depths) == budget and len(parents) == len(child_maps) == budget + 1
    logprobs = torch.log_softmax(logits, dim=-1)
    scores = [0.0]
    for node in range(1, budget + 1):
        parent = parents[node]
        assert parent < node and (parent == 0 or depths[parent - 1] + 1 == depths[node - 1])
        assert child_maps[parent][int(tokens[node - 1])] == node
        scores.append(scores[parent] + float(logprobs[depths[node - 1] - 1, tokens[node - 1]]))
        ancestors = {node}
        walk = node
        while walk:
            walk = parents[walk]
            ancestors.add(walk)
        assert visibility[node].nonzero().flatten().tolist() == sorted(ancestors)

    # brute force over every node of the implicit tree (all token sequences up to ``depth``)
    every = []
    frontier = [0.0]
    for d in range(depth):
        frontier = [s + float(lp) for s in frontier for lp in logprobs[d]]
        every.extend(frontier)
    best = sorted(every, reverse=True)[:budget]
    assert sorted(scores[1:], reverse=True) == pytest.approx(best, abs=1e-5)


def _tree_verify(ddtree_code, case, draft_logits, budget):
    """Prefill the prompt, then verify a tree built from ``draft_logits``; returns the pieces."""
    tree = ddtree_code.ddtree
    tokens, depths, parents, child_maps, visibility = tree.build_ddtree_tree(draft_logits, budget)
    cache = DynamicCache()
    with torch.no_grad():
        case.target(case.prompt, past_key_values=cache, use_cache=True)
        root = case.reference[PROMPT_LEN]
        ids, positions, mask = tree.compile_ddtree_tree(
            root, PROMPT_LEN, tokens, depths, visibility, PROMPT_LEN, torch.float32, torch.device("cpu")
        )
        out = case.target(ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True)
    return types.SimpleNamespace(ids=ids, positions=positions, mask=mask, logits=out.logits[0], parents=parents)


def _path_to(parents, node):
    path = [node]
    while path[-1]:
        path.append(parents[path[-1]])
    return path[::-1]


def test_tree_mask_on_a_chain_equals_a_causal_forward(ddtree_code, cases):
    case = cases[0]
    chain = case.reference[PROMPT_LEN + 1 : PROMPT_LEN + BLOCK]
    # one dominant token per depth: the heap always prefers the next depth over a sibling
    draft_logits = torch.full((BLOCK - 1, MASK_TOKEN_ID + 1), -30.0)
    draft_logits[torch.arange(BLOCK - 1), torch.tensor(chain)] = 30.0
    verified = _tree_verify(ddtree_code, case, draft_logits, BLOCK - 1)

    assert verified.mask.shape == (1, 1, BLOCK, PROMPT_LEN + BLOCK)
    assert set(verified.mask.unique().tolist()) == {0.0, torch.finfo(torch.float32).min}
    assert verified.positions[0].tolist() == list(range(PROMPT_LEN, PROMPT_LEN + BLOCK))
    with torch.no_grad():
        causal = case.target(torch.tensor([case.reference[: PROMPT_LEN + BLOCK]])).logits[0, PROMPT_LEN:]
    torch.testing.assert_close(verified.logits, causal, atol=1e-4, rtol=1e-4)


def test_tree_mask_isolates_branches(ddtree_code, cases):
    """Each node's logits equal a plain forward over prompt + its root-to-node path only."""
    case = cases[1]
    draft_logits = torch.randn(BLOCK - 1, MASK_TOKEN_ID + 1, generator=torch.Generator().manual_seed(5))
    verified = _tree_verify(ddtree_code, case, draft_logits, 8)
    assert max(verified.parents.count(p) for p in set(verified.parents)) > 1, "the tree should branch"

    ids = verified.ids[0].tolist()
    for node in range(len(ids)):
        path_ids = case.prompt[0].tolist() + [ids[i] for i in _path_to(verified.parents, node)]
        with torch.no_grad():
            alone = case.target(torch.tensor([path_ids])).logits[0, -1]
        torch.testing.assert_close(verified.logits[node], alone, atol=1e-4, rtol=1e-4)

    # the same tree under a plain causal mask mixes siblings: the check above can fail
    cache = DynamicCache()
    with torch.no_grad():
        case.target(case.prompt, past_key_values=cache, use_cache=True)
        flat = case.target(verified.ids, position_ids=verified.positions, past_key_values=cache, use_cache=True)
    assert not torch.allclose(flat.logits[0], verified.logits, atol=1e-3)


def test_follow_and_compact(ddtree_code, cases):
    tree = ddtree_code.ddtree
    child_maps = [{5: 1, 7: 2}, {9: 3}, {}, {}]
    assert tree.follow_verified_tree(child_maps, torch.tensor([7, 0, 4, 0])) == ([0, 2], 4)
    assert tree.follow_verified_tree(child_maps, torch.tensor([5, 9, 0, 11])) == ([0, 1, 3], 11)
    assert tree.follow_verified_tree(child_maps, torch.tensor([6, 0, 0, 0])) == ([0], 6)

    cache = DynamicCache()
    keys = torch.arange(2 * 10 * 3, dtype=torch.float32).view(1, 2, 10, 3)
    for layer_idx in range(2):
        cache.update(keys.clone() + layer_idx, -keys.clone(), layer_idx)
    tree.compact_dynamic_cache(cache, 6, [0, 2, 3])
    kept = list(range(6)) + [6 + 0, 6 + 2, 6 + 3]
    for layer_idx, layer in enumerate(cache.layers):
        torch.testing.assert_close(layer.keys, keys[:, :, kept] + layer_idx)
        torch.testing.assert_close(layer.values, -keys[:, :, kept])
    tree.compact_dynamic_cache(cache, 4, [])
    assert cache.get_seq_length() == 4


# ---------------------------------------------------------------- DDTree-shaped code: decoding


def test_draft_attention_backends_agree(ddtree_code, cases):
    case = cases[0]
    sdpa = make_draft(ddtree_code.model.DFlashDraftModel, case, "sdpa")
    eager = make_draft(ddtree_code.model.DFlashDraftModel, case, "eager")
    assert (sdpa.config._attn_implementation, eager.config._attn_implementation) == ("sdpa", "eager")
    hidden = sdpa.config.hidden_size * len(sdpa.target_layer_ids)
    inputs = dict(
        position_ids=torch.arange(PROMPT_LEN + BLOCK)[None],
        noise_embedding=torch.randn(1, BLOCK, sdpa.config.hidden_size),
        target_hidden=torch.randn(1, PROMPT_LEN, hidden),
    )
    with torch.no_grad():
        torch.testing.assert_close(sdpa(**inputs), eager(**inputs), atol=1e-5, rtol=1e-5)


def test_random_draft_decodes_exactly_greedy(ddtree_code, cases):
    ddtree, dflash = ddtree_code.ddtree, ddtree_code.dflash
    for case in cases:
        draft = make_draft(ddtree_code.model.DFlashDraftModel, case)
        args = (draft, case.target, case.prompt, MASK_TOKEN_ID, NEW_TOKENS)
        runs = {
            "autoregressive": dflash.dflash_generate(*args, block_size=1, stop_token_ids=None),
            "ddtree, block 1": ddtree.ddtree_generate(*args, block_size=1, stop_token_ids=None),
            "dflash": dflash.dflash_generate(*args, block_size=BLOCK, stop_token_ids=None),
        }
        for budget in BUDGETS:
            runs[f"ddtree@{budget}"] = ddtree.ddtree_generate(
                *args, block_size=BLOCK, stop_token_ids=None, tree_budget=budget
            )
        for name, run in runs.items():
            assert torch.equal(run.output_ids, expected_ids(case)), (case.seed, name)
            assert run.num_output_tokens == NEW_TOKENS
            assert sum(run.acceptance_lengths) >= NEW_TOKENS - 1
        assert torch.equal(draft.spec_generate(case.target, case.prompt, NEW_TOKENS, None, 0.0), expected_ids(case))


def test_oracle_draft_is_accepted_and_stays_lossless(ddtree_code, cases):
    ddtree, dflash = ddtree_code.ddtree, ddtree_code.dflash
    for case in cases:
        draft = make_draft(ddtree_code.model.DFlashDraftModel, case)
        args = (draft, case.target, case.prompt, MASK_TOKEN_ID, NEW_TOKENS, BLOCK, None)
        with oracle(draft, case):
            runs = {"dflash": dflash.dflash_generate(*args)}
            for budget in BUDGETS:
                runs[f"ddtree@{budget}"] = ddtree.ddtree_generate(*args, tree_budget=budget)
        for name, run in runs.items():
            assert torch.equal(run.output_ids, expected_ids(case)), (case.seed, name)
            assert mean(run.acceptance_lengths) > 1.5, (case.seed, name, run.acceptance_lengths)


def test_partially_right_draft_favours_the_tree(ddtree_code, cases):
    """With the true token often at rank 1, a tree recovers acceptances a chain loses."""
    ddtree, dflash = ddtree_code.ddtree, ddtree_code.dflash
    chain_tau, tree_tau = [], []
    for case in cases:
        draft = make_draft(ddtree_code.model.DFlashDraftModel, case)
        args = (draft, case.target, case.prompt, MASK_TOKEN_ID, NEW_TOKENS, BLOCK, None)
        with oracle(draft, case, partial_rank_plan(case.seed)):
            chain = dflash.dflash_generate(*args)
            tree = ddtree.ddtree_generate(*args, tree_budget=max(BUDGETS))
        for name, run in (("dflash", chain), ("ddtree", tree)):
            assert torch.equal(run.output_ids, expected_ids(case)), (case.seed, name)
        chain_tau.append(mean(chain.acceptance_lengths))
        tree_tau.append(mean(tree.acceptance_lengths))
    assert mean(tree_tau) > mean(chain_tau) > 1.0, (chain_tau, tree_tau)


# ---------------------------------------------------------------- DFlash-shaped code


def test_dflash_package_exports_lazily(shims):
    with vendored_on_path(DFLASH_DIR):
        package = importlib.import_module("dflash")
        assert "dflash.model" not in sys.modules
        assert package.DFlashDraftModel is sys.modules["dflash.model"].DFlashDraftModel
        assert package.dflash_generate is sys.modules["dflash.model"].dflash_generate
        assert "dflash.benchmark" not in sys.modules
        with pytest.raises(AttributeError):
            package.not_a_name  # noqa: B018


def test_dflash_package_decodes_exactly_greedy(dflash_code, cases):
    model = dflash_code.model
    for case in cases:
        draft = make_draft(model.DFlashDraftModel, case)
        plain = model.dflash_generate(draft, case.target, case.prompt, NEW_TOKENS, None, 0.0)
        assert torch.equal(plain, expected_ids(case)), case.seed
        baseline = model.dflash_generate(draft, case.target, case.prompt, NEW_TOKENS, None, 0.0, block_size=1)
        assert torch.equal(baseline, expected_ids(case)), case.seed
        assert torch.equal(draft.spec_generate(case.target, case.prompt, NEW_TOKENS, None, 0.0), expected_ids(case))

        with oracle(draft, case):
            stats = model.dflash_generate(draft, case.target, case.prompt, NEW_TOKENS, None, 0.0, return_stats=True)
        assert torch.equal(stats.output_ids, expected_ids(case)), case.seed
        assert stats.num_output_tokens == NEW_TOKENS
        assert mean(stats.acceptance_lengths) > 1.5, stats.acceptance_lengths


# ---------------------------------------------------------------- the idioms are still there


def _source(path: Path) -> str:
    return path.read_text()


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"no function {name}")


def _called_unguarded(function: ast.FunctionDef, dotted: str) -> bool:
    """The call is a top-level statement of the function body, i.e. not guarded by an ``if``."""
    return any(
        isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and ast.unparse(stmt.value.func) == dotted
        for stmt in function.body
    )


def test_all_vendored_python_parses():
    files = sorted(VENDORED.rglob("*.py"))
    assert len(files) >= 9
    for path in files:
        compile(_source(path), str(path), "exec")


@pytest.mark.parametrize(
    ("relative", "needles"),
    [
        ("ddtree/dflash.py", ["DynamicCache()", ".model.embed_tokens(", "past_key_values_target.crop(start)",
                              "past_key_values_draft.crop(start)"]),
        ("ddtree/ddtree.py", ["DynamicCache()", ".model.embed_tokens(", "past_key_values_draft.crop(start)",
                              "from dflash import dflash_generate, cuda_time",
                              "from model import DFlashDraftModel, sample, extract_context_feature",
                              "for layer in past_key_values.layers:", 'getattr(layer, "keys", None)',
                              "past_key_values.crop(past_length + len(keep_current_indices))",
                              "past_key_values.crop(past_length)", "return dflash_generate("]),
        ("ddtree/model/dflash.py", ["config_class = Qwen3Config", 'dflash_config.get("target_layer_ids")',
                                    '"sliding_attention"', "past_key_values.update(", "ALL_ATTENTION_FUNCTIONS",
                                    "DynamicCache()", ".model.embed_tokens(", "draft_cache.crop(start)",
                                    "target_cache.crop(start)"]),
        ("ddtree/benchmark.py", ['draft_attn_implementation = "flash_attention_2"', "def has_flash_attn()",
                                 'raise RuntimeError("flash_attn must be installed', "torch.cuda.set_device(",
                                 "DFlashDraftModel.from_pretrained(", "dtype=torch.bfloat16",
                                 "block_size=1"]),
        ("dflash/dflash/model.py", ["DynamicCache()", "target.model.embed_tokens(", "draft_cache.crop(start)",
                                    "target_cache.crop(start)", "def _cuda_time()"]),
    ],
)
def test_idioms_are_present(relative, needles):
    text = _source(VENDORED / relative)
    missing = [needle for needle in needles if needle not in text]
    assert not missing, f"{relative} lost idioms the recipe targets: {missing}"
    if "DynamicCache()" in needles:
        assert text.count("DynamicCache()") >= 2, "a bare cache for the target and one for the draft"


@pytest.mark.parametrize(
    ("relative", "function", "call"),
    [
        ("ddtree/dflash.py", "cuda_time", "torch.cuda.synchronize"),
        ("dflash/dflash/model.py", "_cuda_time", "torch.cuda.synchronize"),
        ("ddtree/benchmark.py", "main", "torch.cuda.set_device"),
    ],
)
def test_cuda_calls_are_unguarded(relative, function, call):
    tree = ast.parse(_source(VENDORED / relative))
    assert _called_unguarded(_function(tree, function), call)


def test_datasets_import_is_module_level_in_ddtree_and_lazy_in_dflash():
    utils = ast.parse(_source(DDTREE_DIR / "model" / "utils.py"))
    top_level = [n for n in utils.body if isinstance(n, ast.ImportFrom) and n.module == "datasets"]
    assert [alias.name for n in top_level for alias in n.names] == ["load_dataset"]
    users = {
        f.name for f in ast.walk(utils) if isinstance(f, ast.FunctionDef)
        for n in ast.walk(f) if isinstance(n, ast.Name) and n.id == "load_dataset"
    }
    assert users == {"load_and_process_dataset"}

    benchmark = ast.parse(_source(DFLASH_DIR / "dflash" / "benchmark.py"))
    assert not any(isinstance(n, ast.ImportFrom) and n.module == "datasets" for n in benchmark.body)
    inner = _function(benchmark, "_prepare_dataset")
    assert any(isinstance(n, ast.ImportFrom) and n.module == "datasets" for n in ast.walk(inner))


def test_ddtree_model_package_needs_datasets():
    """Until the recipe moves the import, ``model`` cannot be imported without ``datasets``."""
    with vendored_on_path(DDTREE_DIR), pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "datasets", None)  # None in sys.modules makes the import fail
        with pytest.raises(ImportError):
            importlib.import_module("model.utils")
