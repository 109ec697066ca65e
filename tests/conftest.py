"""Test-wide settings.

Hypothesis runs **derandomized** by default (profile ``ci``): the examples are a function of
the test, so a clean clone cannot turn red by chance, and a failure reproduces on every
machine. Explore new random examples with ``HYPOTHESIS_PROFILE=dev python3 -m pytest ...``;
a failure there prints a ``@reproduce_failure`` blob to paste into the test.

Tiers (markers in pyproject.toml): ``python3 -m pytest -q`` (the README's command) runs every test
but the ``heavy`` ones (addopts ``-m "not heavy"``); ``-m "not slow"`` is the fast day-to-day subset
(every ``heavy`` test is ``slow`` too, marked so here); ``-m heavy`` runs the heavy ones, as .ci/run
does after the README's command, so CI runs every test. ``-m ""`` runs them all in one go.

Parallel workers (pytest-xdist, ``-n auto --dist loadgroup`` in pyproject's addopts; ``-n 0``
runs in one process): every test is grouped with the rest of its file, so a file's
module-scoped fixtures (a patched tree, a built model) are made once, on one worker; the drift
suite is grouped per variant instead (a variant's apply is shared by its fast and slow tests),
so its 30-odd variants spread over the workers. Each worker gets its own ``DDPATCH_HOME`` and
one torch thread.

Each worker also runs a warm verifier (``patcher.verify.process.runner.warm_verifier``) for the
session: a ``ddpatch verify`` child, in process or from a ``ddpatch`` subprocess, is forked
from a process that imported torch and transformers once, instead of a fresh Python (about
half of a tiny verify's time). ``DDPATCH_TEST_VERIFIER=fresh`` runs every verify the way a
user's single ``ddpatch verify`` does; ``tests/test_warm_verifier.py`` holds the two equal. The
session's server never idles out (``DDPATCH_WARM_IDLE=0``: a worker can go longer than the default
15 minutes between two verifies), and a test that needs its verifies forked asks for ``warm_server``,
which starts it again where an earlier test ended it (``tests/warm_support.py``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores: intra-op threads would only fight each other
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)

pytest_plugins = ["deprecation_guard"]  # no past_key_values FutureWarning from ddpatch's own code (5.24+)

settings.register_profile(
    "ci",
    derandomize=True,  # a fixed seed per test: the same examples on every run
    database=None,  # nothing learnt from earlier runs on this machine changes what runs
    print_blob=True,
    deadline=None,  # 2 shared CPU cores: timing is not a property
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    derandomize=False,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_report_header(config):
    """What this run tests, on the first lines of its output: CI installs the newest transformers in
    range (.ci/run), and a run's result means something only next to the versions it ran on."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def have(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return [f"ddpatch versions: python {platform.python_version()}, "
            + ", ".join(f"{n} {have(n)}" for n in ("torch", "transformers", "accelerate", "libcst"))]


def _group(item) -> str:
    """The xdist group of a test: its variant for the drift suite, else its file."""
    path = item.nodeid.split("::")[0]
    variant = getattr(getattr(item, "callspec", None), "params", {}).get("variant")
    if path.endswith("test_drift.py") and variant is not None:
        return f"{path}::{getattr(variant, 'name', variant)}"
    return path


#: tests a run of the suite measured over 3 s (tools/slow_tests.py writes the list): slow, out of the fast tier
MEASURED_SLOW = frozenset(line.split()[0] for line in (Path(__file__).parent / "slow_tests.txt").read_text().splitlines()
                          if line.strip() and not line.startswith("#"))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item)))
        if item.nodeid.split("@")[0] in MEASURED_SLOW and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("heavy") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)  # a heavy test is slow too: `-m "not slow"` (it replaces addopts' -m) leaves it out


@pytest.fixture(autouse=True, scope="session")
def _own_ddpatch_home():
    """A journal folder per test session (per xdist worker): parallel runs never share
    ``~/.cache/ddpatch``, and a test run never writes there. Tests that set DDPATCH_HOME
    themselves (monkeypatch) still win."""
    if os.environ.get("DDPATCH_HOME"):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="ddpatch-test-home-") as home:
        os.environ["DDPATCH_HOME"] = home
        try:
            yield
        finally:
            os.environ.pop("DDPATCH_HOME", None)


@pytest.fixture
def journal_home(tmp_path, monkeypatch):
    """``DDPATCH_HOME`` in the test's own ``tmp_path`` (``home``), for a test that reads or writes the journal:
    a file asks for it for all its tests with ``pytestmark = pytest.mark.usefixtures("journal_home")``."""
    home = tmp_path / "home"
    monkeypatch.setenv("DDPATCH_HOME", str(home))
    return home


@pytest.fixture(autouse=True, scope="session")
def _warm_verifier(_own_ddpatch_home):
    """One warm verifier per test session (per xdist worker), never idle; see the module docstring."""
    if os.environ.get("DDPATCH_TEST_VERIFIER", "warm") == "fresh":
        yield None
        return
    from warm_support import WarmServer

    server = WarmServer()
    server.live()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def warm_server(_warm_verifier):
    """The socket of a warm verifier that answers, named by ``DDPATCH_WARM_VERIFIER`` for this test (so
    ``runner.warm_verifier()`` reuses it), for a test that asserts its verifies are forked: the session's,
    started again where an earlier test ended it, or, under ``DDPATCH_TEST_VERIFIER=fresh``, the test's own."""
    if _warm_verifier is not None:
        yield _warm_verifier.live()
        return
    from warm_support import WarmServer

    own = WarmServer()
    try:
        yield own.live()
    finally:
        own.close()
