"""``benchmarks/peer_generation_tests.py``: transformers' own generation tests under ``lossless``, on a stand-in.

transformers' test suite is not on PyPI (the sdist has no tests/generation, no tests/models) and is never copied
here, so the script is checked on a tiny stand-in checkout this test writes: the same layout
(``tests/generation/test_utils.py`` with a ``GenerationTesterMixin``, ``tests/models/<family>/test_modeling_<family>.py``
importing it relatively), our own test code, ddpatch's presets as the families' tiny models. Its tests compare
prompt lookup and an assistant against greedy, and skip stateful models the way transformers' do ("stateful").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "peer_generation_tests.py"

MIXIN = '''
import unittest

import torch

PROMPT = [[5, 9, 13, 21, 8, 5, 9, 13, 21, 8, 5, 9, 13, 5, 9, 13, 21]]


class GenerationTesterMixin:
    new_tokens = 16

    @property
    def all_generative_model_classes(self):  # transformers' testers list their classes through properties
        return ()

    def _greedy(self, model, **kwargs):
        ids = torch.tensor(PROMPT)
        out = model.generate(ids, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens, do_sample=False, **kwargs)
        return out[0, ids.shape[1]:].tolist()

    def _skip_if_stateful(self):
        if self.model_tester.stateful:
            self.skipTest("stateful models cannot roll their state back")

    def test_greedy_generate(self):
        model = self.model_tester.build()
        self.assertEqual(self._greedy(model), self._greedy(model))

    def test_prompt_lookup_decoding_matches_greedy_search(self):
        self._skip_if_stateful()
        model = self.model_tester.build()
        self.assertEqual(self._greedy(model, prompt_lookup_num_tokens=3), self._greedy(model))

    @unittest.skip(reason="stateful models are skipped by a decorator too")
    def test_greedy_generate_dict_outputs(self):
        model = self.model_tester.build()
        out = model.generate(torch.tensor(PROMPT), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        self.assertEqual(out.sequences.shape, (1, len(PROMPT[0]) + 4))

    def test_assisted_decoding_matches_greedy_search(self):
        self._skip_if_stateful()
        model, assistant = self.model_tester.build(), self.model_tester.build(seed=1)
        self.assertEqual(self._greedy(model, assistant_model=assistant), self._greedy(model))
'''

MODEL = '''
import unittest

from ...generation.test_utils import GenerationTesterMixin


class Tester:
    stateful = {stateful}

    def build(self, seed=0):
        {build}


class {name}ModelTest(GenerationTesterMixin, unittest.TestCase):
    def setUp(self):
        self.model_tester = Tester()
'''

FAMILIES = {
    "qwen3_5": (True, "from patcher.verify.models.presets import build_target\n        return build_target('tiny-qwen3_5', seed=seed)"),
    "llama": (False, "from patcher.verify.models.presets import build_target\n        return build_target('tiny-llama', seed=seed)"),
    "mamba": (True, "import torch\n        from transformers import MambaConfig, MambaForCausalLM\n        torch.manual_seed(seed)\n"
                    "        return MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=8)).eval()"),
}


#: the shapes of transformers' real files the script must survive: the mixin through a shared tester, two test classes
#: in one family, a file that does not import, a test that returns a value instead of running
SHARED_TESTER = '''
from .generation.test_utils import GenerationTesterMixin


class CausalLMModelTest(GenerationTesterMixin):
    pass
'''
MORE = {
    "lfm2": '''
import unittest

from ...causal_lm_tester import CausalLMModelTest
from ..llama.test_modeling_llama import Tester


class Lfm2ModelTest(CausalLMModelTest, unittest.TestCase):
    def setUp(self):
        self.model_tester = Tester()
''',
    "twoclass": '''
import unittest

from ...generation.test_utils import GenerationTesterMixin
from ..llama.test_modeling_llama import Tester


class TwoclassModelTest(GenerationTesterMixin, unittest.TestCase):
    def setUp(self):
        self.model_tester = Tester()


class TwoclassForVisionTest(TwoclassModelTest):
    def test_greedy_generate(self):
        self.assertEqual(1, 2)
''',
    "broken": '''
from transformers import NoSuchModelInThisRelease
from ...generation.test_utils import GenerationTesterMixin
''',
    "vacuous": '''
import unittest

from ...generation.test_utils import GenerationTesterMixin
from ..llama.test_modeling_llama import Tester


def is_flaky(max_attempts=5):
    return lambda test: test


class VacuousModelTest(GenerationTesterMixin, unittest.TestCase):
    def setUp(self):
        self.model_tester = Tester()

    @is_flaky
    def test_greedy_generate(self):
        self.assertEqual(1, 2)
''',
}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("transformers-checkout")
    for package in ("tests", "tests/generation", "tests/models"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    (root / "tests" / "generation" / "test_utils.py").write_text(MIXIN)
    (root / "tests" / "causal_lm_tester.py").write_text(SHARED_TESTER)
    for family, (stateful, build) in FAMILIES.items():
        folder = root / "tests" / "models" / family
        folder.mkdir()
        (folder / "__init__.py").write_text("")
        name = "".join(part.title() for part in family.split("_"))
        (folder / f"test_modeling_{family}.py").write_text(MODEL.format(stateful=stateful, build=build, name=name))
    for family, text in MORE.items():
        folder = root / "tests" / "models" / family
        folder.mkdir()
        (folder / "__init__.py").write_text("")
        (folder / f"test_modeling_{family}.py").write_text(text)
    return root


def peer(checkout: Path, *extra: str) -> tuple[int, str, dict]:
    out = checkout / f"peer{len(extra)}.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(checkout), "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=900)
    data = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, proc.stdout + proc.stderr, data.get("table", {})


def test_the_peer_suite_runs_the_checkouts_tests_under_lossless_with_the_stateful_skip_lifted(checkout):
    code, output, table = peer(checkout, *[a for f in FAMILIES for a in ("--family", f)])
    assert table["qwen3_5"] == {"test_greedy_generate": "pass", "test_prompt_lookup_decoding_matches_greedy_search": "pass",
                                "test_assisted_decoding_matches_greedy_search": "pass",
                                "test_greedy_generate_dict_outputs": "pass"}, output  # the decorator's skip lifted too
    assert set(table["llama"].values()) == {"pass"}, output
    assert table["mamba"]["test_prompt_lookup_decoding_matches_greedy_search"] == "refused", output
    assert code == 0 and "T2: test_greedy_generate" in output and "family" in output, output
    assert "12 results: 8 pass, 4 refused" in output and "refused tests/models/mamba/" in output, output  # refused on entry


def test_real_file_shapes_run_and_a_fail_is_never_hidden(checkout):
    """A family tested through a shared tester runs; a file that does not import is its family's ERROR and the others
    still run; a second test class's failure shows in the family's cell; a test that returns instead of running is
    vacuous, never a pass."""
    code, output, table = peer(checkout, "--family", "lfm2", "--family", "twoclass", "--family", "broken", "--family",
                               "vacuous", "--tests", "greedy_generate and not dict")
    assert table["lfm2"] == {"test_greedy_generate": "pass"}, output
    assert table["twoclass"] == {"test_greedy_generate": "FAIL"}, output  # one class passes, the other fails
    assert table["broken"] == {"collect": "ERROR"} and "NoSuchModelInThisRelease" in output, output
    assert table["vacuous"] == {"test_greedy_generate": "vacuous"} and "deprecated to return a value" in output, output
    assert code == 1 and "5 results: 1 ERROR, 1 FAIL, 2 pass, 1 vacuous" in output, output


def test_families_without_tests_are_bad_input(checkout):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(checkout), "--family", "nosuchfamily"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("ddpatch: error: no tests/models/") and "nosuchfamily" in proc.stderr


def test_its_control_without_lossless_fails_a_stateful_family(checkout):
    """The same run with the skip lifted and nothing recorded: the table can show a failure."""
    code, output, table = peer(checkout, "--no-lossless", "--family", "qwen3_5", "--tests", "prompt_lookup")
    assert table == {"qwen3_5": {"test_prompt_lookup_decoding_matches_greedy_search": "FAIL"}}, output
    assert code == 1


def test_a_folder_that_is_not_a_transformers_checkout_is_bad_input(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("ddpatch: error: ") and proc.stderr.count("\n") == 1
