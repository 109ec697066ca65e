"""A model folder that is not what its flag says is the user's input: one ``ddpatch: error:`` line, exit 2, before a
child starts (issue 42, item 8): a config without weights, a truncated or corrupt ``.safetensors``, a shard the index
names and the folder lacks, a target given as ``--draft`` and a drafter given as ``--target``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from patcher.cli import main
from patcher.verify.models.folders import FolderError, check_pair

ROOT = Path(__file__).resolve().parent.parent
PAIR = ROOT / "patcher" / "data" / "trained_pair"


@pytest.fixture()
def pair(tmp_path) -> tuple[Path, Path]:
    target, draft = tmp_path / "target", tmp_path / "draft"
    shutil.copytree(PAIR / "target", target)
    shutil.copytree(PAIR / "draft", draft)
    return target, draft


def test_the_shipped_pair_is_a_pair(pair):
    check_pair(*map(str, pair))


@pytest.mark.parametrize("damage, says", [
    ("no weights", "no weights (looked for model.safetensors"),
    ("truncated", "model.safetensors is truncated"),
    ("corrupt header", "model.safetensors is corrupt (its header is not JSON)"),
    ("no config", "no config.json (not a Hugging Face model folder)"),
    ("missing shard", "names 1 shard(s) the folder lacks: model-00002-of-00002.safetensors"),
])
def test_a_damaged_folder_is_named_with_what_is_wrong(pair, damage, says):
    target, _ = pair
    weights = target / "model.safetensors"
    if damage == "no weights":
        weights.unlink()
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "corrupt header":
        data = bytearray(weights.read_bytes())
        data[8:16] = b"\xff" * 8
        weights.write_bytes(bytes(data))
    elif damage == "no config":
        (target / "config.json").unlink()
    else:
        weights.rename(target / "model-00001-of-00002.safetensors")
        (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FolderError) as err:
        check_pair(str(target), None)
    assert str(err.value).startswith(f"--target {target}") and says in str(err.value), err.value


def test_each_model_in_the_others_place_is_named(pair):
    target, draft = pair
    with pytest.raises(FolderError, match=r"--draft .* is a Qwen3_5ForCausalLM, not a drafter"):
        check_pair(str(target), str(target))
    with pytest.raises(FolderError, match=r"--target .* is a drafter \(DFlashDraftModel\)"):
        check_pair(str(draft), str(draft))


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_verify_refuses_a_bad_folder_in_one_line_before_any_child(pair, fmt, tmp_path, monkeypatch):
    from patcher.verify.process import runner

    target, draft = pair
    (target / "model.safetensors").write_bytes(b"\x00" * 4)
    monkeypatch.setattr(runner, "_FreshChild", lambda *a, **k: pytest.fail("a child was started"))
    tree = ROOT / "vendored" / "ddtree"
    result = CliRunner().invoke(main, ["verify", str(tree), "--target", str(target), "--draft", str(draft), "--format", fmt])
    assert result.exit_code == 2, result.output
    if fmt == "json":
        payload = json.loads(result.stdout)
        assert payload["exit_code"] == 2 and "model.safetensors is truncated" in payload["error"]
    else:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("ddpatch: error: --target") and "truncated" in lines[0], lines


def test_what_only_the_loader_sees_is_still_the_folders_fault_not_a_crash():
    from patcher.verify.models.load import bad_folder

    with pytest.raises(ValueError, match=r"^--draft /x: cannot load it: OSError: no file named model.safetensors"):
        with bad_folder("--draft", "/x"):
            raise OSError("no file named model.safetensors")
    with pytest.raises(KeyError):  # the tree's own code failing is not the folder's fault
        with bad_folder("--draft", "/x"):
            raise KeyError("dflash_config")
