"""cpu-safe-timing on a decoder that times itself with CUDA events and memory statistics (issue 42, item 8).

Unpatched, such a decoder fails on CPU at ``torch.cuda.Event(enable_timing=True)`` ("Tried to instantiate dummy base
class Event") or at ``torch.cuda.reset_peak_memory_stats()``; patched, it runs on CPU and times itself on the host
clock, and where CUDA is available it gets the very ``torch.cuda.Event`` it built before (the same numbers).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from patcher import api

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "guard-call"

DECODER = '''
import time

import torch
from transformers import DynamicCache


def _stage(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.reset_peak_memory_stats()
    start.record()
    out = fn()
    end.record()
    torch.cuda.synchronize()
    return out, start.elapsed_time(end) / 1000, torch.cuda.max_memory_allocated()


def dflash_generate(model, target, input_ids, max_new_tokens, block_size):
    target_cache = DynamicCache()
    draft_cache = DynamicCache()
    out, prefill_s, _peak = _stage(lambda: target(input_ids, past_key_values=target_cache, output_hidden_states=True))
    start = input_ids.shape[1]
    while start < max_new_tokens:
        block = input_ids[:, -block_size:]
        model(target_hidden=out.hidden_states[-1], noise_embedding=target.get_input_embeddings()(block), past_key_values=draft_cache)
        draft_cache.crop(start)
        out = target(block, past_key_values=target_cache, output_hidden_states=True)
        start += 1
        target_cache.crop(start)
    return out, prefill_s
'''


def _load(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def patched(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPATCH_HOME", str(tmp_path / "home"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "dflash.py").write_text(textwrap.dedent(DECODER).lstrip())
    result = api.apply(src, out=tmp_path / "out", jobs=1)
    timing = next(s for s in result.report.steps if s.spec.id == "cpu-safe-timing")
    assert timing.status == "applied", timing
    monkeypatch.syspath_prepend(str(tmp_path / "out"))
    _forget_runtime()  # another test of this worker may have imported a runtime copy of its own under the same name
    yield tmp_path / "out"
    _forget_runtime()


def _forget_runtime() -> None:
    for name in [m for m in sys.modules if m == "_ddpatch_runtime" or m.startswith("_ddpatch_runtime.")]:
        del sys.modules[name]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the unpatched failure is the CPU one")
def test_unpatched_the_timer_fails_on_cpu_and_patched_it_times_on_the_host_clock(patched, tmp_path):
    src = _load(tmp_path / "src" / "dflash.py", "unpatched_dflash")
    # a CPU build of torch fails at the Event; a CUDA build on a machine without a GPU fails one call earlier
    with pytest.raises(RuntimeError, match="dummy base class Event|invalid argument to reset_peak_memory_stats"):
        src._stage(lambda: None)
    out = _load(patched / "dflash.py", "patched_dflash")
    value, seconds, peak = out._stage(lambda: sum(range(20000)))
    assert value == sum(range(20000)) and 0 <= seconds < 5 and peak == 0


def test_where_cuda_is_available_the_decoder_gets_the_same_event(patched, monkeypatch):
    """The GPU path, on a machine without one: with CUDA said available, `cuda_event` builds `torch.cuda.Event` with
    the very arguments the decoder gave, so a GPU run times itself as it did before it was patched."""
    made = []

    class Event:
        def __init__(self, *args, **kwargs):
            made.append((args, kwargs))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    import _ddpatch_runtime

    event = _ddpatch_runtime.cuda_event(enable_timing=True, blocking=False)
    assert isinstance(event, Event) and made == [((), {"enable_timing": True, "blocking": False})]


def test_the_stand_in_refuses_an_elapsed_time_before_both_records(patched):
    import _ddpatch_runtime

    start, end = _ddpatch_runtime.timing.WallClockEvent(enable_timing=True), _ddpatch_runtime.timing.WallClockEvent(enable_timing=True)
    start.record()
    with pytest.raises(RuntimeError, match="recorded"):
        start.elapsed_time(end)


def test_a_module_that_keeps_torch_lazy_still_imports_without_torch(tmp_path):
    """The events of a lazy-torch module go through a runtime imported where they are built (the runtime imports
    torch): the patched module still imports where torch cannot be imported."""
    tree = tmp_path / "tree"
    tree.mkdir()
    from fixture_support import run_codemod

    from patcher.engine.files import runtime_sources

    patched, _sites, _ = run_codemod("guard-call", (FIXTURES / "cuda_events_lazy.py").read_text())
    (tree / "profiler.py").write_text(patched)

    (tree / "_ddpatch_runtime").mkdir()
    for name, text in runtime_sources().items():
        (tree / "_ddpatch_runtime" / name).write_text(text)
    blocked = ("import importlib.abc, sys\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path, target=None):\n"
               "        if name.split('.')[0] == 'torch':\n"
               "            raise ModuleNotFoundError(name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "import profiler\n")
    done = subprocess.run([sys.executable, "-c", blocked], cwd=tree, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    timed = subprocess.run([sys.executable, "-c", "import profiler; print(profiler.profile(lambda: None, True) >= 0)"],
                           cwd=tree, capture_output=True, text=True, timeout=300)
    assert timed.returncode == 0 and timed.stdout.strip() == "True", timed.stderr[-800:]
