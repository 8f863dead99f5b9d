"""A session's live state on disk, so a crash loses nothing that was reported complete: a LoRA
session's after every operation that changes it, a full-weight session's every few optimizer
steps (service/durability/durable_sessions.py and service/durability/full_weight.py decide when).

A session's directory holds one file per part, each written whole under a new name, and a
manifest naming the current file of each part plus the caller's record (the operation the
state is after, its output, the session's step and policy versions). The manifest is replaced
atomically (write, fsync, rename, fsync the directory) only after the part files are on disk,
so a crash at any moment leaves either the previous state or the new one, never a mix; parts
an operation did not change keep their files (incremental: a forward-backward writes only the
gradients, an optim-step the adapter, moments and gradients, a weights-sync the generator).

Parts: `trainer` (the trainer adapter, or a full-weight session's every weight), `generator`
(the generator adapter, or the full-weight generator's copy of the model), `optimizer` (its
moments and the RNG state dropout draws from), `gradients` (accumulated since the last step;
none is an empty file).

Imports: nothing from posttrain (torch and safetensors only); hosts/in_process.py gathers the
parts from a session and puts them back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

PARTS = ("trainer", "generator", "optimizer", "gradients")
MANIFEST = "manifest.json"


def write(directory: Path, parts: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
    """Put `parts` (part -> tensors, or for `optimizer` a torch.save-able state) on disk and
    make them, with `record`, the session's state, atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(directory)
    generation = int(manifest.get("generation", 0)) + 1
    files = dict(manifest.get("parts", {}))
    superseded = []
    for part, value in parts.items():
        assert part in PARTS, f"unknown state part {part!r}"
        name = f"{part}.{generation}.{'pt' if part == 'optimizer' else 'safetensors'}"
        path = directory / name
        if part == "optimizer":
            torch.save(value, path)
        else:
            tensors = {k: v.detach().to("cpu").contiguous() for k, v in value.items()}
            save_file(tensors, str(path), metadata={"format": "pt"})
        fsync(path)
        if part in files:
            superseded.append(files[part])
        files[part] = name
    body = {"generation": generation, "parts": files, "record": record}
    temporary = directory / f"{MANIFEST}.tmp"
    temporary.write_text(json.dumps(body))
    fsync(temporary)
    os.replace(temporary, directory / MANIFEST)
    fsync(directory)
    for name in superseded:  # after the switch: a crash before this leaves only litter
        (directory / name).unlink(missing_ok=True)


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def read(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(part -> its value, the record) of the state the manifest names."""
    manifest = read_manifest(directory)
    parts: dict[str, Any] = {}
    for part, name in manifest.get("parts", {}).items():
        path = directory / name
        if part == "optimizer":
            parts[part] = torch.load(path, weights_only=True, map_location="cpu")
        else:
            parts[part] = load_file(str(path))
    return parts, manifest.get("record", {})


def remove(directory: Path) -> None:
    """A stopped session keeps no live state."""
    if directory.is_dir():
        for path in directory.iterdir():
            path.unlink(missing_ok=True)
        directory.rmdir()


def fsync(path: Path) -> None:
    """Flush a file, or a directory's entries (a rename inside it), to the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
