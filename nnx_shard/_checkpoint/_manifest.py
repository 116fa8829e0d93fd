"""A step's files: their checksums written once a save is on disk, compared before a read, JSON checked."""

from __future__ import annotations

import json
import zlib
from typing import Any

import jax

from nnx_shard._base import storage

MANIFEST = "nnx_shard_files.json"
SMALL_FILE_BYTES = 2**20


def write_file_manifest(step_dir: Any) -> None:
    """Records a CRC-32 of each small file a finished step holds (``nnx_shard_files.json``).

    Array content is covered by the fingerprints; this covers the small files
    (tree nodes, inline values and their copies) that Orbax may keep besides.
    Only process 0 writes it. In a bucket the step is listed once and its
    small files fetched together.
    """
    if jax.process_index() != 0 or not step_dir.exists():
        return
    files = storage.list_files(step_dir)
    if MANIFEST in files:
        return
    small = sorted(n for n, size in files.items() if size <= SMALL_FILE_BYTES)
    data = storage.read_many(step_dir, small)
    sums = {n: zlib.crc32(b) for n, b in data.items() if b is not None}
    storage.write_bytes(step_dir / MANIFEST, json.dumps(sums).encode())


def checked_files(step_dir: Any) -> tuple[list[str], dict[str, bytes]]:
    """The small files of a step that differ from its manifest (empty without one), and the bytes of those
    that match it, read once (a restore takes the step's metadata from them)."""
    raw = storage.read_many(step_dir, [MANIFEST])[MANIFEST]
    if raw is None:
        return [], {}
    try:
        sums = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return [MANIFEST], {}
    if not isinstance(sums, dict):
        return [MANIFEST], {}
    data = storage.read_many(step_dir, list(sums))
    changed = [name for name, crc in sums.items() if data[name] is None or zlib.crc32(data[name]) != crc]
    return changed, {n: b for n, b in data.items() if b is not None and n not in changed}


TREE_METADATA = "_METADATA"  # Orbax's tree metadata file in an item's folder
JSON_FILES = ("_CHECKPOINT_METADATA", f"state/{TREE_METADATA}", "state/_sharding", "meta/metadata", MANIFEST)


def unreadable_json(step_dir: Any) -> list[str]:
    """The JSON files of a step Orbax reads that are missing, empty or unparsable (to name a decode error)."""
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
