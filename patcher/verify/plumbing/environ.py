"""The environment a verifier child (and a tree's own tests) runs in: offline, no bytecode written.

Shared by the parent (``process.runner``) and ``subjects.upstream_tests``, so it sits at the bottom."""

from __future__ import annotations

import os


def child_env() -> dict:
    """The environment a verifier child runs in: offline, no bytecode written."""
    env = dict(os.environ)
    env.update(
        PYTHONDONTWRITEBYTECODE="1",
        HF_HUB_OFFLINE=env.get("HF_HUB_OFFLINE", "1"),
        TRANSFORMERS_OFFLINE=env.get("TRANSFORMERS_OFFLINE", "1"),
        TRANSFORMERS_VERBOSITY="error",
    )
    return env
