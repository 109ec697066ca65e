"""Where this environment stands: the versions ddpatch runs on, and whether each is inside the tested range.

``ddpatch env`` renders :func:`environment`; the verify report's header calls :func:`tested_range_status`.
Versions come from installed package metadata, so nothing heavy is imported except, in
:func:`environment` only, ``torch`` to name the device.

The tested ranges are what the version matrix (``.ci/matrix``) and the suite were run on, not what
pip allows. docs/transformers.md gives the policy: a new transformers minor enters the range (and
``pyproject.toml``'s pin) after the matrix passes on it.
"""

from __future__ import annotations

import platform
import re
import sys
from dataclasses import asdict, dataclass
from importlib import metadata

#: name -> (lowest tested release, first release above the range): the releases CI runs (.ci/run and
#: its version matrix, .ci/matrix), from the oldest stack to the minor after the newest.
#: ``transformers`` must equal the pin in pyproject.toml, the other lows its floors and the matrix's
#: oldest stack, the python and torch highs its newest stack (tests/test_versions.py checks each);
#: accelerate and libcst are the newest on the index when CI last ran (1.16.0, 1.9.0) and the floors.
TESTED_RANGES: dict[str, tuple[str, str]] = {
    "python": ("3.11", "3.14"),  # 3.11 (the suite, the transformers releases, the oldest stack), 3.13 (the newest stack)
    "torch": ("2.6", "2.16"),  # 2.6.0 (the oldest stack), 2.13.0 (the suite, the releases), 2.15.0 (the newest stack)
    "transformers": ("5.21", "5.26"),  # 5.21.0, 5.23.0, 5.24.0, 5.25.0 (the matrix), the newest in range (the suite, stacks)
    "accelerate": ("1.1", "1.17"),  # 1.1.0 (the oldest stack; transformers needs it), 1.16.0 (the rest)
    "libcst": ("1.5", "1.10"),  # 1.5.0 (the oldest stack), 1.9.0 (the rest)
}

#: what ``ddpatch env`` lists: (label, distribution name on the index, optional)
PACKAGES: tuple[tuple[str, str, bool], ...] = (
    ("torch", "torch", False),
    ("transformers", "transformers", False),
    ("accelerate", "accelerate", False),
    ("libcst", "libcst", False),
    ("fla", "flash-linear-attention", True),
    ("causal-conv1d", "causal-conv1d", True),
    ("flash-attn", "flash-attn", True),
)

INSIDE, BELOW, ABOVE, UNTESTED, MISSING = "inside", "below", "above", "untested", "not installed"


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"5.25.0.dev0"`` -> (5, 25, 0), ``"2.13.0+cpu"`` -> (2, 13, 0)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if not match:
        raise ValueError(f"not a version: {version!r}")
    parts = tuple(int(p) for p in match.group(1).split("."))
    return parts + (0,) * (3 - len(parts)) if len(parts) < 3 else parts


def tested_range_status(name: str, version: str | None) -> str:
    """``inside``, ``below`` or ``above`` the tested range of ``name``; ``untested`` when ddpatch
    declares no range for it (the optional GPU kernels); ``not installed`` when ``version`` is None.
    A pre-release counts as its release (5.26.0.dev0 is above a range that ends before 5.26)."""
    if version is None:
        return MISSING
    if name not in TESTED_RANGES:
        return UNTESTED
    low, high = (release(v) for v in TESTED_RANGES[name])
    have = release(version)
    if have < low:
        return BELOW
    return INSIDE if have < high else ABOVE


def range_text(name: str) -> str | None:
    """The tested range in words: ``5.21 <= transformers < 5.26``; None where ddpatch declares none."""
    if name not in TESTED_RANGES:
        return None
    low, high = TESTED_RANGES[name]
    return f"{low} <= {name} < {high}"


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Component:
    name: str
    version: str | None
    optional: bool
    status: str
    tested_range: str | None


def component(name: str, version: str | None, optional: bool = False) -> Component:
    return Component(name, version, optional, tested_range_status(name, version), range_text(name))


def device() -> dict:
    """The device a verify would run on: ``cuda`` (with its name), ``mps`` or ``cpu``. Imports torch."""
    try:
        import torch
    except ImportError:
        return {"kind": "none", "name": "torch not installed", "count": 0}
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return {"kind": "cuda", "name": torch.cuda.get_device_name(0), "count": count}
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return {"kind": "mps", "name": "Apple MPS", "count": 1}
    return {"kind": "cpu", "name": platform.processor() or platform.machine() or "cpu", "count": 1}


def environment(with_device: bool = True) -> dict:
    """Python and every package ddpatch uses, each with its tested-range status, and the device."""
    python = platform.python_version()
    components = [component("python", python)]
    components += [component(label, installed_version(dist), optional) for label, dist, optional in PACKAGES]
    required = [c for c in components if not c.optional]
    return {
        "python_executable": sys.executable,
        "components": [asdict(c) for c in components],
        "device": device() if with_device else None,
        "inside_tested_range": all(c.status == INSIDE for c in required),
    }


def environment_text(env: dict) -> str:
    rows = [(c["name"], c["version"] or "-", _status_words(c), c["tested_range"] or "")
            for c in env["components"]]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{a:<{width[0]}}  {b:<{width[1]}}  {c:<{width[2]}}  {d}".rstrip() for a, b, c, d in rows]
    dev = env.get("device")
    if dev:
        lines.append(f"{'device':<{width[0]}}  {dev['kind']}: {dev['name']}" + (f" (x{dev['count']})" if dev["count"] > 1 else ""))
    verdict = ("every required package is inside the tested range" if env["inside_tested_range"]
               else "some required package is outside the tested range (see docs/transformers.md)")
    lines.append(verdict)
    return "\n".join(lines) + "\n"


def _status_words(c: dict) -> str:
    if c["status"] == MISSING:
        return "not installed (optional)" if c["optional"] else "NOT INSTALLED"
    if c["status"] == UNTESTED:
        return "installed, untested (optional)"
    return {INSIDE: "tested", BELOW: "BELOW the tested range", ABOVE: "ABOVE the tested range"}[c["status"]]
