"""A step's files: their checksums written once a save is on disk, compared before a read, JSON checked."""

from __future__ import annotations

import json
import zlib
from typing import Any

import jax

MANIFEST = "nnx_shard_files.json"
SMALL_FILE_BYTES = 2**20


def write_file_manifest(step_dir: Any) -> None:
    """Records a CRC-32 of each small file a finished step holds (``nnx_shard_files.json``).

    Array content is covered by the fingerprints; this covers the small files
    (tree nodes, inline values and their copies) that Orbax may keep besides.
    Only process 0 writes it.
    """
    if jax.process_index() != 0 or not step_dir.exists() or (step_dir / MANIFEST).exists():
        return
    sums = {}
    for f in _files(step_dir):
        if f.name != MANIFEST and f.stat().length <= SMALL_FILE_BYTES:
            sums[str(f.relative_to(step_dir))] = zlib.crc32(f.read_bytes())
    (step_dir / MANIFEST).write_text(json.dumps(sums))


def _files(folder: Any) -> list[Any]:
    out = []
    for entry in sorted(folder.iterdir()):
        out.extend(_files(entry) if entry.is_dir() else [entry])
    return out


def changed_files(step_dir: Any) -> list[str]:
    """The small files of a step that differ from its manifest (empty without one)."""
    manifest = step_dir / MANIFEST
    if not manifest.exists():
        return []
    try:
        sums = json.loads(manifest.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return [MANIFEST]
    if not isinstance(sums, dict):
        return [MANIFEST]
    changed = []
    for name, crc in sums.items():
        f = step_dir / name
        if not f.exists() or zlib.crc32(f.read_bytes()) != crc:
            changed.append(name)
    return changed


TREE_METADATA = "_METADATA"  # Orbax's tree metadata file in an item's folder
JSON_FILES = ("_CHECKPOINT_METADATA", f"state/{TREE_METADATA}", "state/_sharding", "meta/metadata", MANIFEST)


def unreadable_json(step_dir: Any) -> list[str]:
    """The JSON files Orbax reads from a step that are missing, empty or do not parse (for naming a decode
    error)."""
    bad = []
    candidates = [step_dir / name for name in JSON_FILES]
    metadatas = step_dir / "state" / "array_metadatas"
    if metadatas.exists():
        candidates += sorted(metadatas.iterdir())
    for f in candidates:
        name = str(f.relative_to(step_dir))
        try:
            json.loads(f.read_text())
        except FileNotFoundError:
            if name != MANIFEST:
                bad.append(f"{name} (missing)")
        except (OSError, ValueError):
            bad.append(name)
    return bad
