"""A model folder the user names (``--target``, ``--draft``) checked before anything loads: bad input is one line.

Stdlib only, so the parent checks it before it starts a child: a folder with a ``config.json`` and no weights, a
truncated or corrupt ``.safetensors`` file (its header says more data than the file holds, or is not JSON), a
shard the index names and the folder lacks, or a model of the wrong kind for its flag (a target given as
``--draft``: its config has no ``dflash_config`` and names no drafter architecture). Each is a ``FolderError``
naming the folder and what is wrong; ``ddpatch`` prints it as one ``ddpatch: error:`` line and exits 2.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ..plumbing.drafter_kinds import kind_of, verify_refusal

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
#: what marks a drafter's config: DFlash's field, or an architecture named as upstream names its drafters
DRAFTER_FIELDS = ("dflash_config",)
DRAFTER_NAMES = ("DraftModel", "DFlash", "DSpark", "Eagle", "Medusa")


class FolderError(ValueError):
    """A model folder that cannot be what its flag says."""


def _config(folder: Path, flag: str) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FolderError(f"{flag} {folder}: no config.json (not a Hugging Face model folder)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise FolderError(f"{flag} {folder}: config.json is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise FolderError(f"{flag} {folder}: config.json holds no JSON object")
    return data


def check_safetensors(path: Path, flag: str, folder: Path) -> None:
    """The file's header is JSON and its tensors' data fits in the file: a truncated download or a corrupt copy fails
    here, in one line, instead of deep inside the loader."""
    where = f"{flag} {folder}: {path.name}"
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            raw = handle.read(n) if n is not None and n <= size - 8 else None
    except OSError as exc:
        raise FolderError(f"{where} cannot be read ({exc})") from None
    if n is None:
        raise FolderError(f"{where} is truncated ({size} bytes: not even a header)")
    if raw is None:
        raise FolderError(f"{where} is truncated or corrupt (its header claims {n} bytes, the file holds {size})")
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise FolderError(f"{where} is corrupt (its header is not JSON)") from None
    end = max((t.get("data_offsets", [0, 0])[1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)), default=0)
    if 8 + n + end > size:
        raise FolderError(f"{where} is truncated ({size} bytes; its tensors need {8 + n + end}): download it again")


def weights_of(folder: Path, flag: str) -> list[Path]:
    """The folder's weight files (one file, or the shards its index names), each checked; FolderError if none."""
    for index in INDEXES:
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError):
                raise FolderError(f"{flag} {folder}: {index} is not a valid index (no weight_map)") from None
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise FolderError(f"{flag} {folder}: {index} names {len(missing)} shard(s) the folder lacks: {', '.join(missing[:3])}")
            paths = [folder / s for s in shards]
            break
    else:
        paths = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
        if not paths:
            paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise FolderError(f"{flag} {folder}: no weights (looked for model.safetensors, pytorch_model.bin, and a sharded "
                          f"checkpoint's index): a config.json alone cannot be loaded")
    for path in paths:
        if path.suffix == ".safetensors":
            check_safetensors(path, flag, folder)
    return paths


def is_drafter(config: dict) -> bool:
    archs = config.get("architectures") or []
    return any(f in config for f in DRAFTER_FIELDS) or any(any(n in a for n in DRAFTER_NAMES) for a in archs if isinstance(a, str))


def check_pair(target: str | None, draft: str | None, refuse=verify_refusal) -> None:
    """``--target`` and ``--draft`` as folders of the right kind, with readable weights; FolderError otherwise.
    ``refuse``: the one line (or None) for the drafter's kind (``drafter_kinds.verify_refusal``, the referee's own)."""
    if target:
        folder = Path(target)
        config = _config(folder, "--target")
        if is_drafter(config):
            raise FolderError(f"--target {folder} is a drafter ({', '.join(config.get('architectures') or ['dflash_config'])}): "
                              "pass the target model's folder as --target and this one as --draft")
        weights_of(folder, "--target")
    if draft:
        folder = Path(draft)
        config = _config(folder, "--draft")
        if not is_drafter(config):
            kind = ", ".join(config.get("architectures") or []) or config.get("model_type") or "model"
            raise FolderError(f"--draft {folder} is a {kind}, not a drafter (its config has no dflash_config): pass the "
                              "drafter's folder as --draft, or --scripted-draft to verify before a drafter exists")
        why = refuse(kind_of(config), f"--draft {folder}")  # one line naming the kind, never a DFlash verdict
        if why:
            raise FolderError(why)
        weights_of(folder, "--draft")
