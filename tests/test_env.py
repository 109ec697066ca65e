"""``ddpatch env`` and the tested-range status (patcher/env.py), and where the verify report shows it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from patcher import env as penv
from patcher.cli import main
from patcher.report.json_report import verify_payload
from patcher.results import Outcome

LOW, HIGH = penv.TESTED_RANGES["transformers"]


@pytest.mark.parametrize(
    "version, status",
    [
        (f"{LOW}.0", "inside"),
        ("5.23.0", "inside"),
        ("5.25.0", "inside"),
        ("5.25.7", "inside"),
        ("5.20.2", "below"),
        ("5.7.0", "below"),
        ("4.57.6", "below"),
        (f"{HIGH}.0", "above"),
        (f"{HIGH}.0.dev0", "above"),
        ("6.0.0", "above"),
        (None, "not installed"),
    ],
)
def test_transformers_range_status(version, status):
    assert penv.tested_range_status("transformers", version) == status


def test_local_and_patch_suffixes_count_as_their_release():
    assert penv.release("2.13.0+cpu") == (2, 13, 0)
    assert penv.release("5.25") == (5, 25, 0)
    assert penv.tested_range_status("torch", "2.13.0+cu128") == "inside"
    assert penv.tested_range_status("torch", "2.5.1") == "below"


def test_a_package_without_a_declared_range_is_untested():
    assert penv.tested_range_status("flash-attn", "2.8.3") == "untested"
    assert penv.tested_range_status("flash-attn", None) == "not installed"


def test_not_a_version_is_one_clear_error():
    with pytest.raises(ValueError, match="not a version"):
        penv.release("banana")


def _fake_versions(monkeypatch, **versions):
    real = penv.installed_version
    names = {dist: label for label, dist, _ in penv.PACKAGES}
    monkeypatch.setattr(penv, "installed_version",
                        lambda dist: versions[names[dist]] if names.get(dist) in versions else real(dist))


def test_environment_lists_every_package_with_its_status(monkeypatch):
    # every version given, so the columns' widths do not depend on what is installed (torch 2.15.0 is narrower)
    monkeypatch.setattr(penv.platform, "python_version", lambda: "3.11.7")
    _fake_versions(monkeypatch, **{"torch": "2.13.0+cpu", "transformers": "5.25.0", "accelerate": "1.16.0", "libcst": "1.9.0",
                                   "fla": None, "causal-conv1d": "1.5.2", "flash-attn": None})
    info = penv.environment(with_device=False)
    rows = {c["name"]: c for c in info["components"]}
    assert list(rows) == ["python", "torch", "transformers", "accelerate", "libcst", "fla", "causal-conv1d", "flash-attn"]
    assert rows["transformers"] == {"name": "transformers", "version": "5.25.0", "optional": False, "status": "inside",
                                    "tested_range": f"{LOW} <= transformers < {HIGH}"}
    assert rows["fla"]["status"] == "not installed" and rows["fla"]["optional"]
    assert rows["causal-conv1d"]["status"] == "untested" and rows["causal-conv1d"]["version"] == "1.5.2"
    text = penv.environment_text(info)
    assert "fla            -           not installed (optional)" in text
    assert "causal-conv1d  1.5.2       installed, untested (optional)" in text


def test_a_transformers_below_the_range_makes_the_environment_untested(monkeypatch):
    _fake_versions(monkeypatch, transformers="5.20.2")
    info = penv.environment(with_device=False)
    assert not info["inside_tested_range"]
    assert "BELOW the tested range" in penv.environment_text(info)
    _fake_versions(monkeypatch, transformers=None)
    info = penv.environment(with_device=False)
    assert not info["inside_tested_range"]
    assert "NOT INSTALLED" in penv.environment_text(info)


def test_a_missing_optional_kernel_keeps_the_environment_tested(monkeypatch):
    monkeypatch.setattr(penv.platform, "python_version", lambda: "3.11.7")
    _fake_versions(monkeypatch, torch="2.13.0+cpu", transformers="5.24.0", accelerate="1.13.0",
                   libcst="1.8.6", fla=None, **{"causal-conv1d": None, "flash-attn": None})
    assert penv.environment(with_device=False)["inside_tested_range"] is True
    _fake_versions(monkeypatch, torch="2.5.1", transformers="5.24.0", accelerate="1.13.0",
                   libcst="1.8.6", fla=None, **{"causal-conv1d": None, "flash-attn": None})
    assert penv.environment(with_device=False)["inside_tested_range"] is False  # torch below 2.6


def test_the_tested_ranges_are_the_measured_ones():
    """Literal expectations: what CI runs (.ci/run, .ci/matrix; docs/transformers.md gives the figures):
    Python 3.11 and 3.13, torch 2.6.0 to 2.15.0, accelerate 1.1.0 and 1.16.0, libcst 1.5.0 and 1.9.0."""
    for name, version, status in (("python", "3.10.14", "below"), ("python", "3.11.0", "inside"),
                                  ("python", "3.13.1", "inside"), ("python", "3.14.0", "above"),
                                  ("torch", "2.5.1", "below"), ("torch", "2.6.0", "inside"),
                                  ("torch", "2.15.0", "inside"), ("torch", "2.16.0", "above"),
                                  ("accelerate", "1.0.0", "below"), ("accelerate", "1.1.0", "inside"),
                                  ("accelerate", "1.16.0", "inside"), ("accelerate", "1.17.0", "above"),
                                  ("libcst", "1.4.0", "below"), ("libcst", "1.5.0", "inside"),
                                  ("libcst", "1.9.0", "inside"), ("libcst", "1.10.0", "above"),
                                  ("transformers", "5.20.2", "below"), ("transformers", "5.21.0", "inside"),
                                  ("transformers", "5.25.0", "inside"), ("transformers", "5.26.0", "above")):
        assert penv.tested_range_status(name, version) == status, (name, version)


def test_the_device_is_named():
    dev = penv.device()
    assert dev["kind"] in ("cpu", "cuda", "mps") and dev["name"]


# ----------------------------------------------------------------------------- the command
def test_env_command_text_and_json(monkeypatch):
    _fake_versions(monkeypatch, transformers="5.25.0")
    runner = CliRunner()
    text = runner.invoke(main, ["env"])
    assert text.exit_code == 0, text.output
    assert "transformers   5.25.0" in text.output and "device" in text.output
    out = runner.invoke(main, ["env", "--format", "json"])
    assert out.exit_code == 0, out.output
    payload = json.loads(out.output)
    assert payload["command"] == "env" and payload["exit_code"] == 0
    assert payload["device"]["kind"] in ("cpu", "cuda", "mps")
    assert {c["name"]: c["status"] for c in payload["components"]}["transformers"] == "inside"


def test_env_strict_exits_1_outside_the_range(monkeypatch):
    _fake_versions(monkeypatch, transformers="5.26.0")
    runner = CliRunner()
    assert runner.invoke(main, ["env"]).exit_code == 0
    result = runner.invoke(main, ["env", "--strict", "--format", "json"])
    assert result.exit_code == 1
    payload = json.loads(result.output)
    assert payload["exit_code"] == 1 and not payload["inside_tested_range"]


def test_env_bad_option_is_one_error_line():
    result = CliRunner().invoke(main, ["env", "--format", "yaml"])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("ddpatch: error:")]
    assert len(errors) == 1 and "--format" in errors[0]
    result = CliRunner().invoke(main, ["env", "--format", "json", "--bogus"])
    assert result.exit_code == 2
    payload = json.loads(result.stdout)
    assert payload["command"] == "env" and payload["exit_code"] == 2 and "--bogus" in payload["error"]


def test_env_help_and_main_help_do_not_import_torch():
    code = ("import sys; from click.testing import CliRunner; from patcher.cli import main; "
            "r = CliRunner().invoke(main, ['env', '--help']); assert r.exit_code == 0, r.output; "
            "assert 'tested' in r.output; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- the verify report
def _outcome(version: str) -> Outcome:
    return Outcome(result={"tree": "t", "environment": {"transformers": version, "torch": "2.13.0"}, "checks": [], "models": []},
                   seconds=1.0)


def test_verify_json_says_whether_transformers_is_tested():
    inside = verify_payload(_outcome("5.24.0"), 0)["environment"]
    assert inside["transformers"] == "5.24.0" and inside["transformers_in_tested_range"] == "inside"
    assert inside["transformers_tested_range"] == f"{LOW} <= transformers < {HIGH}"
    assert verify_payload(_outcome("5.20.2"), 0)["environment"]["transformers_in_tested_range"] == "below"


def test_verify_header_says_whether_transformers_is_tested(capsys):
    from patcher.report.text import render_verify

    render_verify(_outcome("5.26.0"), color="never")
    header = capsys.readouterr().out.splitlines()[0]
    assert "transformers 5.26.0 (ABOVE the tested range" in header
    render_verify(_outcome("5.25.0"), color="never")
    assert "transformers 5.25.0 (inside the tested range)" in capsys.readouterr().out.splitlines()[0]
