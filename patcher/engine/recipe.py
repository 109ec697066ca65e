"""Recipes are data: a TOML file naming the upstreams it is for and an ordered list of steps.

Each step names a codemod (a class in ``patcher.engine.codemods``), its parameters, and the
functions it is anchored to in each upstream layout. Adding a recipe for the next
architecture means writing a TOML file, not engine code.
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import shipped
from ..errors import RecipeError


@dataclass(frozen=True)
class Upstream:
    name: str
    repository: str
    #: Functions whose definition identifies this layout (all must be defined).
    markers: tuple[str, ...]
    #: Names the recipe expects to find; a missing one is reported.
    anchors: tuple[str, ...]


@dataclass(frozen=True)
class StepSpec:
    id: str
    codemod: str
    why: str
    params: dict[str, Any] = field(default_factory=dict)
    #: upstream name -> functions in which the step must find a site.
    anchors: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: Upstreams the step applies to; empty means all.
    upstreams: tuple[str, ...] = ()

    def applies_to(self, upstream: str | None) -> bool:
        # a step written for one layout never runs on a tree whose layout is unknown
        return not self.upstreams or upstream in self.upstreams


@dataclass(frozen=True)
class Recipe:
    name: str
    version: int
    description: str
    transformers: str
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    upstreams: dict[str, Upstream]
    steps: tuple[StepSpec, ...]
    source: str = ""
    #: model_type -> the verify preset that proves a patched tree lossless on it
    verified: dict[str, str] = field(default_factory=dict)
    #: model_type -> the verify preset that shows the patched tree refusing it in one line
    refused: dict[str, str] = field(default_factory=dict)
    #: The steps without which a patched tree decodes lossy on a hybrid model (--select/--ignore
    #: that leaves one out, where it applies, warns and exits 1 unless --allow-lossy).
    lossless: tuple[str, ...] = ()
    #: What the recipe's code is called in messages ("DDTree/DFlash"): "no DDTree/DFlash decoder found in PATH".
    decoders: str = ""

    @property
    def label(self) -> str:
        return f"{self.name} v{self.version}"

    def detect_upstream(self, defined: set[str]) -> str | None:
        """The first upstream whose markers are all defined in the tree."""
        for up in self.upstreams.values():
            if up.markers and all(m in defined for m in up.markers):
                return up.name
        return None


def _tuple(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RecipeError(f"{where}: expected a list of strings")
    return tuple(value)


def parse_recipe(text: str, source: str = "<string>") -> Recipe:
    from .codemods import CODEMODS

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{source}: not valid TOML: {exc}") from None
    try:
        name, version = data["name"], int(data["version"])
    except KeyError as exc:
        raise RecipeError(f"{source}: missing key {exc}") from None
    upstreams = {
        key: Upstream(
            name=key,
            repository=str(value.get("repository", "")),
            markers=_tuple(value.get("markers"), f"{source}: upstreams.{key}.markers"),
            anchors=_tuple(value.get("anchors"), f"{source}: upstreams.{key}.anchors"),
        )
        for key, value in data.get("upstreams", {}).items()
    }
    steps = []
    seen = set()
    for i, raw in enumerate(data.get("steps", [])):
        where = f"{source}: steps[{i}]"
        sid = raw.get("id")
        codemod = raw.get("codemod", sid)
        if not sid:
            raise RecipeError(f"{where}: missing id")
        if sid in seen:
            raise RecipeError(f"{where}: duplicate step id {sid!r}")
        seen.add(sid)
        if codemod not in CODEMODS:
            raise RecipeError(f"{where}: unknown codemod {codemod!r}; known: {', '.join(sorted(CODEMODS))}")
        params = dict(raw.get("params", {}))
        unknown = set(params) - set(CODEMODS[codemod].PARAMS)
        if unknown:
            raise RecipeError(f"{where}: codemod {codemod!r} has no parameter(s) {', '.join(sorted(unknown))}")
        anchors = {up: _tuple(fns, f"{where}.anchors.{up}") for up, fns in raw.get("anchors", {}).items()}
        for up in list(anchors) + list(_tuple(raw.get("upstreams"), where)):
            if up not in upstreams:
                raise RecipeError(f"{where}: unknown upstream {up!r}")
        steps.append(
            StepSpec(
                id=sid,
                codemod=codemod,
                why=str(raw.get("why", "")).strip(),
                params=params,
                anchors=anchors,
                upstreams=_tuple(raw.get("upstreams"), where),
            )
        )
    if not steps:
        raise RecipeError(f"{source}: a recipe needs at least one step")
    return Recipe(
        name=name,
        version=version,
        description=str(data.get("description", "")).strip(),
        transformers=str(data.get("transformers", "")),
        include=_tuple(data.get("include", ["**/*.py"]), f"{source}: include"),
        exclude=_tuple(data.get("exclude", []), f"{source}: exclude"),
        upstreams=upstreams,
        steps=tuple(steps),
        source=source,
        verified=_model_presets(data.get("verified"), f"{source}: verified"),
        refused=_model_presets(data.get("refused"), f"{source}: refused"),
        lossless=_lossless(data.get("lossless"), seen, source),
        decoders=str(data.get("decoders", "")),
    )


def _lossless(value: Any, ids: set[str], source: str) -> tuple[str, ...]:
    out = _tuple(value, f"{source}: lossless")
    unknown = [v for v in out if v not in ids]
    if unknown:
        raise RecipeError(f"{source}: lossless names unknown step(s) {', '.join(unknown)}")
    return out


def _model_presets(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise RecipeError(f"{where}: expected a table of model_type = \"preset\"")
    return dict(value)


def builtin_recipes() -> dict[str, Path]:
    """The built-in recipes by name: ``recipes/*.toml`` of the checkout, or of the install (``patcher.shipped``)."""
    folder = shipped("recipes")
    return {p.name[: -len(".toml")]: p for p in sorted(folder.glob("*.toml"))} if folder.is_dir() else {}


def did_you_mean(name: str, known: list[str]) -> str:
    """`` (did you mean X?)`` for the known name closest to ``name`` ("." and "_" read alike), or ""."""
    def norm(s: str) -> str:
        return s.lower().replace(".", "_").replace("-", "_")

    exact = [k for k in known if norm(k) == norm(name)]
    close = exact or difflib.get_close_matches(norm(name), [norm(k) for k in known], n=1, cutoff=0.6)
    if not close:
        return ""
    match = exact[0] if exact else next(k for k in known if norm(k) == close[0])
    return f" (did you mean {match}?)"


def load_recipe(name_or_path: str) -> Recipe:
    """A built-in recipe by name, or a recipe file by path."""
    known = builtin_recipes()
    if name_or_path in known:
        entry = known[name_or_path]
        return parse_recipe(entry.read_text(encoding="utf-8"), source=f"recipes/{entry.name}")
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.is_file():
        return parse_recipe(path.read_text(encoding="utf-8"), source=str(path))
    hint = did_you_mean(name_or_path, sorted(known))
    raise RecipeError(f"unknown recipe {name_or_path!r}{hint}; known: {', '.join(sorted(known)) or 'none'}")
