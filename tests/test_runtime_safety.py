"""No silent path to a wrong commit (issue 21): threads, copies, missing or foreign layouts,
records cut behind the runtime's back, failed forwards, TF32, and host syncs per round.

Each test names the item it covers; each fails on the runtime before its fix. Exactness is
checked against a fresh cache that ran "prompt + kept tokens" from scratch (next logits).
"""

from __future__ import annotations

import copy
import pickle
import threading
import types
import warnings

import pytest
import torch

from runtime_support import ATOL, RTOL, depths, model, one_thread, prefill, tree_mask  # noqa: F401 (fixture)

from patcher import runtime as rt
from patcher.verify.models.presets import build_target

NAME = "tiny-qwen3_5"
PROMPT = torch.tensor([[1, 2, 3, 4, 5]])
BLOCK = torch.tensor([[6, 7, 8, 9]])
PARENTS = [-1, 0, 0, 1, 2, 4]


def chain_verify(m, cache, block=BLOCK, past=None):
    past = cache.get_seq_length() if past is None else past
    pos = torch.arange(past, past + block.shape[1])[None]
    return rt.verify_forward(m, block, position_ids=pos, past_key_values=cache, use_cache=True)


def tree_verify(m, cache, past, tokens, parents=PARENTS):
    return rt.verify_forward(m, tokens, position_ids=(past + torch.tensor(depths(parents)))[None],
                             attention_mask=tree_mask(parents, past), past_key_values=cache, use_cache=True)


def next_logits(m, cache, token=11):
    return m(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]


def assert_exact(m, cache, kept):
    ref = prefill(m, torch.cat([PROMPT, kept], dim=1))
    torch.testing.assert_close(next_logits(m, cache), next_logits(m, ref), atol=ATOL, rtol=RTOL)


def gdn(m):
    return [mod for _, mod in rt.hybrid_linear_modules(m)]


# ------------------------------------------------------------------------------------------
# item 1: one model, two threads
# ------------------------------------------------------------------------------------------


class _PauseA:
    """Holds thread A at the end of its forward (after every GDN layer ran) until B is done."""

    def __init__(self, m):
        self.a_thread = None
        self.reached, self.release = threading.Event(), threading.Event()
        self.handle = m.lm_head.register_forward_hook(self.hook)

    def hook(self, *_):
        if threading.current_thread() is self.a_thread:
            self.reached.set()
            assert self.release.wait(60)


def _in_thread_a(pause, target):
    errors = []

    def run():
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    pause.a_thread = threading.Thread(target=run)
    pause.a_thread.start()
    assert pause.reached.wait(60), errors
    return errors


def test_a_plain_forward_in_another_thread_never_reaches_the_verify():
    """Item 1: B's forward of the same model, while A's verify is inside its forward, runs the
    model's own forwards: it neither fills A's record nor sees A's closures."""
    m = model(NAME)
    with torch.inference_mode():
        other = prefill(m, torch.tensor([[9, 8, 7]]))
        expected = m(torch.tensor([[3, 2, 1, 4, 6]]), past_key_values=prefill(m, torch.tensor([[9, 8, 7]])),
                     use_cache=True).logits
    cache = prefill(m, PROMPT)
    pause = _PauseA(m)
    try:
        errors = _in_thread_a(pause, lambda: torch.inference_mode()(chain_verify)(m, cache))
        with torch.inference_mode():
            got = m(torch.tensor([[3, 2, 1, 4, 6]]), past_key_values=other, use_cache=True).logits
        pause.release.set()
        pause.a_thread.join(60)
    finally:
        pause.release.set()
        pause.handle.remove()
    assert not errors, errors
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    with torch.inference_mode():
        cache.crop(-2)
        assert_exact(m, cache, BLOCK[:, :2])
    assert all("forward" not in mod.__dict__ for mod in gdn(m)), "every dispatcher is gone"


@pytest.mark.parametrize("b_verifies", ["the model", "its backbone"])
def test_a_concurrent_verify_of_the_same_model_is_one_clear_error(b_verifies):
    """Item 1: a second thread's verify of a model under verify raises, and A's commit stays exact; also when B
    verifies through the backbone (``target.model``), which shares every layer with the model A verifies."""
    m = model(NAME)
    cache = prefill(m, PROMPT)
    other = prefill(m, torch.tensor([[9, 8, 7]]))
    pause = _PauseA(m)
    try:
        errors = _in_thread_a(pause, lambda: torch.inference_mode()(chain_verify)(m, cache))
        with pytest.raises(RuntimeError, match="another thread is verifying this model"), torch.inference_mode():
            chain_verify(m if b_verifies == "the model" else m.model, other)
        pause.release.set()
        pause.a_thread.join(60)
    finally:
        pause.release.set()
        pause.handle.remove()
    assert not errors, errors
    with torch.inference_mode():
        cache.crop(-1)
        assert_exact(m, cache, BLOCK[:, :3])
        chain_verify(m, other)  # once A is done, B may verify
    assert all("forward" not in mod.__dict__ for mod in gdn(m))


# ------------------------------------------------------------------------------------------
# item 2: copied and pickled caches
# ------------------------------------------------------------------------------------------


def test_a_deepcopy_crop_never_reaches_the_original():
    """Item 2: the copy's crop is bound to the copy; an uncommitted record does not travel."""
    m = model(NAME)
    with torch.inference_mode():
        cache = prefill(m, PROMPT)
        chain_verify(m, cache)
        twin = copy.deepcopy(cache)
        with pytest.raises(RuntimeError, match="copy"):
            twin.crop(-2)
        assert cache.get_seq_length() == PROMPT.shape[1] + BLOCK.shape[1], "the original was not cut"
        cache.crop(-2)
        assert_exact(m, cache, BLOCK[:, :2])


def test_a_committed_cache_copies_and_each_copy_commits_on_its_own():
    m = model(NAME)
    with torch.inference_mode():
        cache = prefill(m, PROMPT)
        chain_verify(m, cache)
        cache.crop(-1)  # committed: 3 of 4 kept
        twin = copy.deepcopy(cache)
        more = torch.tensor([[10, 12, 13]])
        chain_verify(m, twin, more)
        twin.crop(-2)
        chain_verify(m, cache, more)
        cache.crop(-1)
        assert_exact(m, twin, torch.cat([BLOCK[:, :3], more[:, :1]], dim=1))
        assert_exact(m, cache, torch.cat([BLOCK[:, :3], more[:, :2]], dim=1))


def test_a_recorded_cache_pickles_and_its_copy_refuses_an_uncommitted_record():
    """Item 2: pickling a recorded cache works (no local closures) and keeps no record to commit wrongly."""
    m = model(NAME)
    with torch.inference_mode():
        cache = prefill(m, PROMPT)
        chain_verify(m, cache)
        loaded = pickle.loads(pickle.dumps(cache))
        with pytest.raises(RuntimeError, match="copy"):
            loaded.crop(-1)
        cache.crop(-1)
        settled = pickle.loads(pickle.dumps(cache))
        assert_exact(m, settled, BLOCK[:, :3])


def test_two_caches_sharing_layers_are_refused():
    """Item 2: a linear layer owned by a recorded cache is not silently re-owned by another."""
    m = model(NAME)
    with torch.inference_mode():
        cache = prefill(m, PROMPT)
        chain_verify(m, cache)
        cache.crop(-1)
        shallow = copy.copy(cache)  # shares the layer objects
        with pytest.raises(RuntimeError, match="shared with another cache"):
            chain_verify(m, shallow)


# ------------------------------------------------------------------------------------------
# items 3 and 4: a layout the runtime cannot read
# ------------------------------------------------------------------------------------------


def test_a_config_without_layer_types_but_linear_layers_in_the_cache_raises():
    """Item 3: no layer_types means no stateful layer is found; the cache says otherwise."""
    m = build_target(NAME, seed=0)
    cache = prefill(m, PROMPT)
    m.config.get_text_config(decoder=True).layer_types = None
    with pytest.raises(RuntimeError, match="no layer_types"), torch.inference_mode():
        chain_verify(m, cache)


def test_a_cache_that_is_not_5x_raises():
    """Item 4: a cache without 5.x linear-attention layers: refused, not warned about."""
    m = model(NAME)
    legacy = types.SimpleNamespace(get_seq_length=lambda: 0, key_cache=[], value_cache=[])  # 4.x's shape
    with pytest.raises(RuntimeError, match="no transformers 5.x linear-attention layers"), torch.inference_mode():
        rt.verify_forward(m, BLOCK, past_key_values=legacy, use_cache=True)


# ------------------------------------------------------------------------------------------
# items 5 and 6: lengths that no longer match
# ------------------------------------------------------------------------------------------


def test_a_committed_record_is_checked_at_the_next_verify():
    """Item 5: a key/value cache cut by hand after the commit is caught at the next verify."""
    m = model(NAME)
    with torch.inference_mode():
        cache = prefill(m, PROMPT)
        chain_verify(m, cache)
        cache.crop(-1)
        for layer in cache.layers:
            if not hasattr(layer, "recurrent_states"):
                layer.keys, layer.values = layer.keys[..., :-1, :], layer.values[..., :-1, :]
        with pytest.raises(RuntimeError, match="committed for"):
            chain_verify(m, cache, past=cache.get_seq_length())


def _compact_by_hand(cache, past, keep):
    index = torch.tensor(keep)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.dim() < 2:
            continue
        for t in (layer.keys, layer.values):
            t.narrow(-2, past, len(keep)).copy_(t.narrow(-2, past, t.shape[-2] - past).index_select(-2, index))
    cache.crop(past + len(keep) - cache.layers[-1].get_seq_length())


def test_tree_commit_at_another_past_length_raises_or_warns_by_the_switch(monkeypatch):
    """Item 6, and the switch: ON_UNCERTAIN = "warn" turns the error into a RuntimeWarning."""
    m = model(NAME)
    decorated = rt.tree_commit("cache", "past", "keep")(_compact_by_hand)
    tokens = torch.tensor([[6, 7, 8, 9, 10, 12]])
    with torch.inference_mode():
        cache = prefill(m, PROMPT)
        tree_verify(m, cache, 5, tokens)
        with pytest.raises(RuntimeError, match="verify started at 5"):
            decorated(cache, 4, [0, 1])
        monkeypatch.setattr(rt.options, "ON_UNCERTAIN", "warn")
        cache = prefill(m, PROMPT)
        tree_verify(m, cache, 5, tokens)
        with pytest.warns(RuntimeWarning, match="verify started at 5"):
            decorated(cache, 4, [0, 1])


# ------------------------------------------------------------------------------------------
# item 7: a forward that raises mid-verify
# ------------------------------------------------------------------------------------------


def test_a_chain_verify_that_raises_leaves_a_cache_no_commit_accepts():
    m = model(NAME)
    with torch.inference_mode():
        cache = prefill(m, PROMPT)
        with pytest.raises(Exception):  # noqa: B017  (any failure inside the model: what follows is the point)
            rt.verify_forward(m, BLOCK, position_ids=torch.arange(9)[None], past_key_values=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="raised before it returned"):
            cache.crop(-1)


# ------------------------------------------------------------------------------------------
# item 8: warn once per cache, not once per process
# ------------------------------------------------------------------------------------------


def test_the_no_record_warning_is_once_per_cache():
    m = model(NAME)
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            cache = prefill(m, PROMPT)
            m(BLOCK, past_key_values=cache, use_cache=True)
            for _ in range(2):
                rt.crop_cache(cache, cache.get_seq_length() - 1)  # the same line, both caches
    ours = [w for w in caught if "no verify was recorded" in str(w.message)]
    assert len(ours) == 2, [str(w.message) for w in caught]


# ------------------------------------------------------------------------------------------
# item 9: TF32
# ------------------------------------------------------------------------------------------


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded (toward zero) to TF32's 10 mantissa bits, as a TF32 matmul reads it."""
    if x.dtype != torch.float32:
        return x
    return (x.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def _rounded(real):
    def call(*args, **kwargs):
        return real(*(_tf32(x) if isinstance(x, torch.Tensor) else x for x in args), **kwargs)

    return call


def _matmuls_in_tf32(monkeypatch) -> None:
    """Every matrix product a script can reach reads its float32 operands as TF32 does: ``@``, ``torch.matmul``,
    ``torch.bmm``/``mm``, ``torch.linalg.matmul``, their Tensor methods, ``torch.einsum``, ``torch.tensordot``."""
    for owner, names in ((torch.Tensor, ("__matmul__", "__rmatmul__", "matmul", "bmm", "mm")),
                         (torch, ("matmul", "bmm", "mm", "tensordot")), (torch.linalg, ("matmul",))):
        for name in names:
            monkeypatch.setattr(owner, name, _rounded(getattr(owner, name)))
    real_einsum = torch.einsum

    def einsum(equation, *operands):
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = tuple(operands[0])
        return real_einsum(equation, *(_tf32(x) for x in operands))

    monkeypatch.setattr(torch, "einsum", einsum)


def test_the_tf32_stand_in_rounds_every_matmul_form():
    """The stand-in above reaches each form (else the test below would pass on a matmul it does not see)."""
    import contextlib

    with pytest.MonkeyPatch.context() as mp:
        _matmuls_in_tf32(mp)
        a = torch.full((1, 2, 2), 1 + 2**-20)
        b = torch.ones(1, 2, 2)
        exact = torch.full((1, 2, 2), 2.0)
        for form in (lambda: a @ b, lambda: b.__rmatmul__(a), lambda: torch.matmul(a, b), lambda: a.matmul(b), lambda: torch.bmm(a, b),
                     lambda: a.bmm(b), lambda: torch.mm(a[0], b[0])[None], lambda: a[0].mm(b[0])[None],
                     lambda: torch.linalg.matmul(a, b), lambda: torch.einsum("bij,bjk->bik", a, b),
                     lambda: torch.tensordot(a[0], b[0], dims=1)[None]):
            assert torch.equal(form(), exact)
    with contextlib.nullcontext():
        assert not torch.equal(a @ b, exact)  # unpatched: float32 keeps the 2**-20


def test_the_cumulative_decay_is_exact_when_matmuls_run_in_tf32(monkeypatch):
    _matmuls_in_tf32(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    n, heads, d = 12, 2, 8
    key, value = torch.randn(1, n, heads, d, generator=gen), torch.randn(1, n, heads, d, generator=gen)
    g = -torch.rand(1, n, heads, generator=gen) * 3 - 0.1  # strong decay: e^G amplifies any rounding
    beta = torch.rand(1, n, heads, generator=gen)
    ancestors = torch.ones(n, n, dtype=torch.bool).tril()
    _, _, _, G = rt._delta_rule(key, value, g, beta, None, ancestors)
    expected = g.double().cumsum(1).transpose(1, 2)
    torch.testing.assert_close(G.double(), expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------
# item 10: host syncs and small host-to-device copies per round
# ------------------------------------------------------------------------------------------


#: what waits for the device when called on a CUDA tensor: a value read on the host (``.item()``, ``.tolist()``,
#: ``int()``/``bool()``/``float()``/``index``, so ``bool(t.any())`` too), a comparison that answers a Python
#: bool (``torch.equal``, ``allclose``), an output whose size depends on the data (``nonzero``, ``unique``,
#: ``masked_select``...), a copy to the host (``.cpu()``, ``.numpy()``, ``.to("cpu")``)
SYNC_METHODS = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__", "numpy", "cpu", "equal", "allclose",
                "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select")
SYNC_FUNCTIONS = ("equal", "allclose", "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select")


def _to_host(args, kwargs) -> bool:
    """``.to("cpu")`` named as such (the tests run on CPU, where ``.to(x.device)`` is a host device too: only the
    literal says that the code copies to the host whatever the device)."""
    device = kwargs.get("device", next((a for a in args if isinstance(a, str)), None))
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _counting(monkeypatch):
    """Count host syncs (``SYNC_METHODS``, ``SYNC_FUNCTIONS``, ``.to("cpu")``) and ``torch.tensor`` /
    ``as_tensor`` constructions made by runtime code; ``counts["by"]`` names each sync."""
    import sys

    counts = {"sync": 0, "tensor": 0, "by": []}

    def from_runtime() -> bool:
        frame = sys._getframe(2)
        return "runtime" in frame.f_code.co_filename and "patcher" in frame.f_code.co_filename

    def count_sync(name):
        counts["sync"] += 1
        frame = sys._getframe(2)
        counts["by"].append(f"{name} at {frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}")

    for owner, names in ((torch.Tensor, SYNC_METHODS), (torch, SYNC_FUNCTIONS)):
        for name in names:
            real = getattr(owner, name)

            def counted(*args, _real=real, _name=name, **kwargs):
                if from_runtime():
                    count_sync(_name)
                return _real(*args, **kwargs)

            monkeypatch.setattr(owner, name, counted)
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if from_runtime() and _to_host(args, kwargs):
            count_sync("to(cpu)")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    for name in ("tensor", "as_tensor"):
        real_tensor = getattr(torch, name)

        def tensor(*args, _real=real_tensor, **kwargs):
            if from_runtime():
                counts["tensor"] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, tensor)
    return counts


def test_a_round_makes_a_fixed_number_of_host_syncs_whatever_the_layers(monkeypatch):
    m = model(NAME)
    tokens = torch.tensor([[6, 7, 8, 9, 10, 12]])
    with torch.inference_mode():
        cache = prefill(m, PROMPT)
        tree_verify(m, cache, 5, tokens)  # warm-up: the once-per-model probes
        rt.compact_cache(cache, 5, [0, 1, 3])
        counts = _counting(monkeypatch)
        tree_verify(m, cache, 8, tokens)
        rt.compact_cache(cache, 8, [0, 2, 4])
        chain_verify(m, cache, BLOCK, past=11)
        cache.crop(-2)
    # one read of the tree mask per round, whatever the number of layers: its copy to the host, then the parents
    # (tolist) and the tree check (torch.equal) read that host copy; the kept indices come as a list
    assert counts["sync"] <= 3 and all(by.split(" at ")[1].startswith("tree.py:") for by in counts["by"]), counts["by"]
    # the plan's index tensors (two per depth, three more), the conv taps, the kept path and the
    # compaction index, once per round; never one per layer or per key/value tensor
    levels = max(depths(PARENTS)) + 1
    assert counts["tensor"] <= 2 * levels + 3 + 3, counts


# ------------------------------------------------------------------------------------------
# the version gate
# ------------------------------------------------------------------------------------------


def test_a_transformers_older_than_the_floor_is_refused_in_one_line(monkeypatch):
    import transformers

    from patcher.runtime import discovery, errors

    m = build_target(NAME, seed=0)
    for version, reason in (("5.4.0", "transformers#45513"), ("5.20.2", "cache.layers")):
        monkeypatch.setattr(transformers, "__version__", version)
        monkeypatch.setattr(errors, "_VERSION_CHECKED", [])
        discovery._MODEL_INFO.pop(m, None)
        with pytest.raises(rt.UnsupportedModelError, match=rf"transformers {version} is older than 5\.21\.0") as info:
            rt.hybrid_linear_modules(m)
        assert "\n" not in str(info.value) and reason in str(info.value)


def test_a_draft_handed_features_its_own_fc_already_projected_is_not_refused():
    """A fork projects the target's features itself first (``model.project_target_hidden(...)``: the draft's own fc
    and norm) and hands the draft what its fc gives (issue 49, kimwin2/MDFlash's shape): that width is read as it is;
    a width that is neither the fc's input nor its output is still refused in one line."""
    from patcher.runtime.probes import _check_draft_reads

    draft = torch.nn.Module()
    draft.fc = torch.nn.Linear(128, 64, bias=False)
    _check_draft_reads(draft, {"target_hidden": torch.zeros(1, 3, 128)})  # raw features: the fc's input
    _check_draft_reads(draft, {"target_hidden": torch.zeros(1, 3, 64)})  # already projected: the fc's output
    with pytest.raises(rt.UnsupportedModelError, match="give 96 features per token where the draft reads 128"):
        _check_draft_reads(draft, {"target_hidden": torch.zeros(1, 3, 96)})
