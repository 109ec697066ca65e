"""Folders of a tree that are copies of other projects' code: found while discovering, reported, not parsed.

Forks vendor third-party packages (a ``third_party/`` folder, pip's ``_vendor/``, a
``pip install --target`` folder, a copied project with its own ``pyproject.toml``). Those files
hold no DDTree or DFlash decoder, yet on a fork that vendors several packages they are most of
the tree, and parsing them (and running the steps over them) is most of a run. The rule
(docs/usage.md, "Vendored folders"):

* A folder below the tree's root *looks vendored* when it is named as such (``VENDOR_NAMES``),
  holds a ``*.dist-info`` folder (an install target), or has its own ``setup.py``,
  ``pyproject.toml`` or ``setup.cfg`` (a project of its own). The root itself never does.
* Its Python files are read as text once, for the recipe's decoder signals only: a definition
  of one of the recipe's marker or anchor functions (``ddtree_generate``, ``dflash_generate``,
  ...), or a word some step scans the tree for (``target_hidden``, the drafter's input). A
  folder with a signal is checked like any other, and the report says why it was kept.
* A folder without one is left out: listed in the report (text and JSON) with its reason and
  file count, never parsed. ``--include-vendored`` (or ``include-vendored = true``) checks them
  all, and so does passing the folder itself as the tree.

A single file can be a copy too: a fork that pins one transformers release keeps its own ``cache_utils.py``
(``class Cache``, ``class DynamicCache(Cache)``, ...), where ``past_key_values[layer_idx]`` is the legacy tuple its
annotation says, not a 5.x cache. A file that defines two or more of transformers' cache classes at module level
(``CACHE_CLASSES``), one of them ``Cache`` or ``DynamicCache``, and shows no decoder signal is left out the same
way (``copy_of_cache_code``), listed with its reason; ``--include-vendored`` checks it.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..results import VendoredFolder
from .recipe import Recipe

#: Folder names that by convention hold copies of other projects (pip's ``_vendor``, ``third_party``, ...).
VENDOR_NAMES = frozenset({
    "site-packages", "dist-packages", "third_party", "third-party", "thirdparty", "3rdparty",
    "vendor", "_vendor", "vendored", "external", "externals", "extern",
})
#: The classes transformers' cache module defines: a file that defines several is a copy of that module.
CACHE_CLASSES = frozenset({
    "Cache", "DynamicCache", "StaticCache", "SlidingWindowCache", "HybridCache", "HybridChunkedCache", "OffloadedCache",
    "OffloadedStaticCache", "QuantizedCache", "QuantoQuantizedCache", "HQQQuantizedCache", "EncoderDecoderCache", "SinkCache",
    "MambaCache", "CacheConfig", "QuantizedCacheConfig", "CacheLayerMixin", "DynamicLayer", "StaticLayer", "SlidingWindowLayer",
    "DynamicSlidingWindowLayer", "ChunkedSlidingLayer", "QuantizedLayer", "LinearAttentionLayer", "LinearAttentionCacheLayerMixin",
})
#: why such a file is left out (one reason for all of them: the report groups the files it leaves out by reason)
CACHE_COPY = "a copy of transformers' cache code, vendored: --include-vendored checks it"
_CLASS = re.compile(r"^class[ \t]+(\w+)", re.M)
#: Files that make a folder a project of its own.
PACKAGING = ("setup.py", "pyproject.toml", "setup.cfg")


def vendored_reason(name: str, dirnames: list[str], filenames: list[str]) -> str | None:
    """Why a folder (below the root) looks like a copy of a third-party package, or None."""
    if name.lower() in VENDOR_NAMES:
        return f"named {name}"
    info = sorted(d for d in dirnames if d.endswith(".dist-info"))
    if info:
        return f"holds {info[0]}"
    own = [f for f in PACKAGING if f in filenames]
    if own:
        return f"has its own {own[0]}"
    return None


class DecoderSignals:
    """The recipe's signs of a decoder in a file's text: a marker or anchor function defined, or a
    word a step scans the whole tree for (``Step.TREE_TRIGGER``, where that is a word)."""

    def __init__(self, recipe: Recipe, codemods: dict) -> None:
        names = sorted({n for up in recipe.upstreams.values() for n in (*up.markers, *up.anchors)})
        self.names = names
        self._defs = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(" + "|".join(map(re.escape, names)) + r")\b", re.M) if names else None
        # a trigger that is a word (``target_hidden``) is a sign of a decoder; one that is a pattern every file matches
        # (target-cache-config's ``\w\(``: every caller is read for the target it hands a decoder) is not
        triggers = sorted({cls.TREE_TRIGGER for cls in (codemods[s.codemod] for s in recipe.steps)
                           if cls.TREE_TRIGGER and re.fullmatch(r"\w+", cls.TREE_TRIGGER)})
        self._words = [re.compile(t) for t in triggers]

    def find(self, text: str) -> str | None:
        """What in ``text`` says a decoder may be there (``defines ddtree_generate``), or None."""
        if self._defs is not None and any(name in text for name in self.names):  # ``in`` first: most files have none
            m = self._defs.search(text)
            if m:
                return f"defines {m.group(1)}"
        for pattern in self._words:  # as a whole word: ``target_hidden``, not ``target_hidden_states``
            for m in pattern.finditer(text):
                before, after = text[m.start() - 1:m.start()], text[m.end():m.end() + 1]
                if not (before.isalnum() or before == "_" or after.isalnum() or after == "_"):
                    return f"uses {m.group(0)}"
        return None


def copy_of_cache_code(text: str) -> list[str]:
    """The transformers cache classes ``text`` defines at module level, where it is a copy of that module (two or more,
    ``Cache`` or ``DynamicCache`` among them); else []."""
    if "class " not in text or "Cache" not in text:
        return []
    names = sorted(set(_CLASS.findall(text)) & CACHE_CLASSES)
    return names if len(names) >= 2 and {"Cache", "DynamicCache"} & set(names) else []


def decoder_in(root: Path, paths: list[Path], signals: DecoderSignals) -> str | None:
    """The first decoder signal among ``paths`` (``defines ddtree_generate in x/y.py``), or None."""
    for path in paths:
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        found = signals.find(text)
        if found:
            return f"{found} in {path.relative_to(root).as_posix()}"
    return None


def settle(root: Path, candidates: dict[str, tuple[str, list[Path]]], signals: DecoderSignals) -> tuple[list[Path], list[VendoredFolder]]:
    """Of the folders that look vendored (``rel -> (reason, python files)``), the files to check after all
    (those of folders with a decoder signal), and each folder as the report lists it."""
    kept: list[Path] = []
    folders = []
    for rel, (reason, paths) in sorted(candidates.items()):
        decoder = decoder_in(root, paths, signals)
        if decoder is not None:
            kept += paths
        folders.append(VendoredFolder(rel, reason, len(paths), decoder))
    return kept, folders
