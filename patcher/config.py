"""Settings from a config file, read the way ruff and Fixit read theirs.

The nearest config file from the target path upward wins: in each folder, ``ddpatch.toml``
(its top-level keys) first, then ``pyproject.toml`` (its ``[tool.ddpatch]`` table; a
``pyproject.toml`` without that table is passed over). ``--config FILE`` names the file
instead; ``--isolated`` reads none. A flag given on the command line overrides the file.

    # pyproject.toml of your DDTree checkout
    [tool.ddpatch]
    recipe = "qwen3_6-gdn"
    ignore = ["cpu-safe-timing"]
    exclude = ["analysis/"]
    jobs = 4

Imports: stdlib, ``patcher.errors`` and the engine's recipe loader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .engine.recipe import did_you_mean  # noqa: F401  (the name config errors use, too)
from .errors import RecipeError

CONFIG_FILES = ("ddpatch.toml", "pyproject.toml")
#: The keys a config file may set, and what each must be.
KEYS = {
    "recipe": "a recipe name or a path to a recipe .toml (relative to the config file)",
    "select": "a list of step ids",
    "ignore": "a list of step ids",
    "jobs": "an integer >= 1",
    "upstream": "an upstream layout name",
    "presets": "a list of preset names (verify, ci --verify)",
    "format": '"text" or "json"',
    "allow-lossy": "true or false",
    "entry": "a list of FILE:FUNCTION decoders for verify (default: every decoder found)",
    "reviewed": "a list of drafter inputs whose deliberate difference was reviewed (verify): noise, positions, features",
    "include-vendored": "true or false",
    "exclude": "a list of glob patterns: files and folders to leave out (check, diff, apply, verify)",
    "prompts-file": "a path to a prompts file for verify (JSONL or plain text; relative to the config file)",
}


#: The drafter inputs a verify may record as deliberately different (``patcher.verify.judge.drafter.verdict.REVIEWABLE``).
REVIEWABLE = ("noise", "positions", "features")


class ConfigError(ValueError):
    """A config file that cannot be read or holds an unknown key or a bad value (one line, exit 2)."""


@dataclass
class Config:
    path: Path | None = None
    values: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


def _table(path: Path) -> dict[str, Any] | None:
    """The ddpatch settings in ``path``: ``[tool.ddpatch]`` of a pyproject.toml (None if it has none), else the whole file."""
    import tomllib

    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config {path}: cannot read it ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path}: not valid TOML ({exc})") from None
    if path.name == "pyproject.toml":
        return data.get("tool", {}).get("ddpatch")
    return data


def _ids(key: str, value: Any, path: Path) -> str:
    if isinstance(value, str):
        value = [v for v in value.split(",")]
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value) or not value:
        raise ConfigError(f"config {path}: {key} must be {KEYS[key]}, got {value!r}")
    return ",".join(v.strip() for v in value)


def _validate(values: dict[str, Any], path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in KEYS:
            guess = did_you_mean(key, list(KEYS))
            raise ConfigError(f"config {path}: unknown key {key!r}{guess}; known: {', '.join(KEYS)}")
        if key in ("select", "ignore"):
            value = _ids(key, value, path)
        elif key in ("presets", "entry", "reviewed"):
            value = _ids(key, value, path).split(",")
            unknown = [v for v in value if key == "reviewed" and v not in REVIEWABLE]
            if unknown:
                raise ConfigError(f"config {path}: reviewed must be {KEYS['reviewed']}, got {unknown[0]!r}")
        elif key == "exclude":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
                raise ConfigError(f"config {path}: exclude must be {KEYS['exclude']}, got {value!r}")
        elif key == "jobs":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config {path}: jobs must be {KEYS['jobs']}, got {value!r}")
        elif key == "format":
            if value not in ("text", "json"):
                raise ConfigError(f"config {path}: format must be {KEYS['format']}, got {value!r}")
        elif key in ("allow-lossy", "include-vendored"):
            if not isinstance(value, bool):
                raise ConfigError(f"config {path}: {key} must be {KEYS[key]}, got {value!r}")
        elif not isinstance(value, str) or not value:
            raise ConfigError(f"config {path}: {key} must be {KEYS[key]}, got {value!r}")
        if key == "recipe" and value.endswith(".toml") and not Path(value).is_absolute():
            value = str(path.parent / value)
        if key == "prompts-file":  # read by the verifier wherever the command runs from: anchored to the file, as recipe is
            value = str(path.parent / Path(value).expanduser())
        out[key] = value
    return out


def find_config(start: str | Path) -> Path | None:
    """The nearest config file from ``start`` (a file's folder, or the folder itself) upward."""
    here = Path(start).resolve()
    if not here.is_dir():
        here = here.parent
    for folder in (here, *here.parents):
        for name in CONFIG_FILES:
            candidate = folder / name
            if candidate.is_file() and (name != "pyproject.toml" or _table(candidate) is not None):
                return candidate
    return None


def load_config(start: str | Path | None = None, config: str | Path | None = None, isolated: bool = False) -> Config:
    """The settings for a run on ``start``: from ``config`` if given, else the nearest file; none if ``isolated``."""
    if isolated:
        return Config()
    if config is not None:
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
    else:
        path = find_config(start if start is not None else Path.cwd())
        if path is None:
            return Config()
    table = _table(path)
    if table is None:
        raise ConfigError(f"--config {path}: has no [tool.ddpatch] table")
    return Config(path, _validate(table, path))


# ----------------------------------------------------------------------------- recipe names
def default_recipe(path: str | Path | None) -> str:
    """The recipe to use when none is named: the only built-in one, or the only one whose upstream layout ``path`` has."""
    from .engine.recipe import builtin_recipes, load_recipe

    names = sorted(builtin_recipes())
    if len(names) == 1:
        return names[0]
    if path is not None:
        detected = [n for n in names if _detects(load_recipe(n), Path(path))]
        if len(detected) == 1:
            return detected[0]
    raise RecipeError(f"--recipe is required: {len(names)} built-in recipes, and none is the only one that detects the tree; "
                      f"known: {', '.join(names)}")


def _detects(recipe, root: Path) -> bool:
    from .engine.files import defined_functions

    defined: set[str] = set()
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))[:2000]
    for f in files:
        try:
            if f.is_file():
                defined |= set(defined_functions(f.read_text(encoding="utf-8", errors="replace")))
        except OSError:
            continue
    return any(u.markers and all(m in defined for m in u.markers) for u in recipe.upstreams.values())
