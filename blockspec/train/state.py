"""A training state (weights, AdamW moments, data position, schedule, RNG) as safetensors shards plus one JSON index.

A GPU call of the flagship recipe returns at most 8 files of at most 16 MiB, so a state is written in
shards of at most `max_file_bytes` each (a tensor larger than that is cut into flat chunks), and it
loads with safetensors and json alone: nothing is pickled. The top-level keys of the saved object
form groups whose shards are named after them (``model-00000.safetensors``, ``optimizer-00000...``),
so a call can return or carry one group (the weights) without another (the moments).

The index (``state.json``) is written last and lists every shard with its sha256: a directory holds
one consistent state, and a shard from another save is refused by name and hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from blockspec.train.data import DataError

STATE_FORMAT = "blockspec-train-state/1"
INDEX = "state.json"
MIB = 1 << 20
MAX_FILE_BYTES = 16 * MIB
SHARD_SUFFIX = ".safetensors"


class StateError(DataError):
    """A state directory cannot be read: missing or mismatched shard, unknown format; the message names the file."""


# ---------------------------------------------------------------- nested objects <-> JSON skeleton + tensors
def flatten(obj: Any) -> tuple[Any, dict[str, Tensor]]:
    """A JSON-able skeleton of `obj` and its tensors by name (contiguous CPU copies; aliases stored once).

    Dicts with non-string keys, tuples and tensors are tagged objects in the skeleton, so `unflatten`
    gives back the same types (an optimizer's int-keyed state, Python's RNG tuple).
    """
    tensors: dict[str, Tensor] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, Tensor):
            key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype)
            if x.numel() and key in seen:  # a tied weight: one copy, two names
                return {"__tensor__": seen[key]}
            name = path or "root"
            tensors[name] = x.detach().to("cpu").contiguous()
            if x.numel():
                seen[key] = name
            return {"__tensor__": name}
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: walk(v, f"{path}.{k}" if path else k) for k, v in x.items()}
            return {"__items__": [[walk(k, f"{path}.k{i}"), walk(v, f"{path}.{i}")]
                                  for i, (k, v) in enumerate(x.items())]}
        if isinstance(x, tuple):
            return {"__tuple__": [walk(v, f"{path}.{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(x)]
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise StateError(f"state entry {path or 'root'}: cannot store a {type(x).__name__}")

    return walk(obj, ""), tensors


def unflatten(skeleton: Any, tensors: dict[str, Tensor]) -> Any:
    """The object `flatten` was given, its tensors taken from `tensors` (aliases become the same tensor)."""
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__tuple__" in skeleton:
            return tuple(unflatten(v, tensors) for v in skeleton["__tuple__"])
        if "__items__" in skeleton:
            return {unflatten(k, tensors): unflatten(v, tensors) for k, v in skeleton["__items__"]}
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    return skeleton


# ---------------------------------------------------------------- shards
def _serialize(tensors: dict[str, Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata={"format": STATE_FORMAT})


def _header_bytes(name: str, t: Tensor) -> int:
    """A generous bound on what one tensor adds to a safetensors header (its name, dtype, shape, offsets)."""
    return len(name) + 64 + 24 * max(1, t.dim())


def pack_shards(tensors: dict[str, Tensor], max_file_bytes: int) -> tuple[list[bytes], dict[str, Any]]:
    """Serialized shards of at most max_file_bytes each, and which parts make each tensor.

    Each tensor goes into the first shard with room for it (first fit, in order: deterministic); one
    larger than a shard is flattened and cut into chunks (``name#0``, ``name#1``, ...) that are
    joined and reshaped on load.
    """
    base = 256  # the header's braces, metadata and padding
    if max_file_bytes < 4096:
        raise StateError(f"shard size {max_file_bytes} bytes is too small: at least 4096")
    shards: list[dict[str, Tensor]] = []
    used: list[int] = []
    where: dict[str, Any] = {}

    def add(key: str, t: Tensor) -> None:
        cost = t.nbytes + _header_bytes(key, t)
        for i, size in enumerate(used):
            if size + cost <= max_file_bytes:
                shards[i][key] = t
                used[i] += cost
                return
        shards.append({key: t})
        used.append(base + cost)

    for name, t in tensors.items():
        if base + t.nbytes + _header_bytes(name, t) <= max_file_bytes:
            add(name, t)
            where[name] = {"parts": [name]}
            continue
        flat = t.reshape(-1)
        per_chunk = max(1, (max_file_bytes - base - _header_bytes(name + "#000000", flat)) // t.element_size())
        parts = []
        for i, start in enumerate(range(0, flat.numel(), per_chunk)):
            part = f"{name}#{i}"
            add(part, flat[start : start + per_chunk].clone())
            parts.append(part)
        where[name] = {"parts": parts, "shape": list(t.shape)}
    blobs = [_serialize(shard) for shard in shards]
    for blob, shard in zip(blobs, shards):
        if len(blob) > max_file_bytes:  # the header bound is generous: this does not happen
            raise StateError(f"shard of {list(shard)[:3]}... is {len(blob)} bytes, over {max_file_bytes}")
    return blobs, where


def save_state(directory: str | Path, obj: dict[str, Any], max_file_bytes: int = MAX_FILE_BYTES) -> list[Path]:
    """Write `obj` (a dict; its top-level keys are the shard groups) into `directory`; returns the files written.

    Shards are named after their group and content hash, written before the index; the index replaces the
    old one atomically and shards no longer listed are removed after it, so a save cut short leaves the
    previous state readable. The index itself must stay under max_file_bytes.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files: list[dict[str, Any]] = []
    tensor_index: dict[str, Any] = {}
    skeleton: dict[str, Any] = {}
    for group, value in obj.items():
        if not isinstance(group, str) or not group.replace("_", "").isalnum():
            raise StateError(f"state group {group!r}: top-level keys must be plain names")
        skel, tensors = flatten(value)
        skeleton[group] = _prefix_refs(skel, f"{group}/")
        tensors = {f"{group}/{k}": v for k, v in tensors.items()}
        shards, where = pack_shards(tensors, max_file_bytes)
        for blob in shards:
            digest = hashlib.sha256(blob).hexdigest()
            name = f"{group}-{digest[:16]}{SHARD_SUFFIX}"
            path = directory / name
            if not path.is_file() or path.stat().st_size != len(blob):
                tmp = path.with_suffix(".tmp")
                tmp.write_bytes(blob)
                tmp.replace(path)
            files.append({"file": name, "group": group, "bytes": len(blob), "sha256": digest})
        for name, info in where.items():
            tensor_index[name] = info
    index = {"format": STATE_FORMAT, "files": files, "tensors": tensor_index, "state": skeleton}
    text = json.dumps(index, separators=(",", ":"))
    if len(text) > max_file_bytes:
        raise StateError(f"{directory / INDEX}: index of {len(text)} bytes is over {max_file_bytes}")
    tmp = directory / (INDEX + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, directory / INDEX)
    listed = {f["file"] for f in files}
    for stale in directory.glob(f"*{SHARD_SUFFIX}"):
        if stale.name not in listed:
            stale.unlink()
    return [directory / INDEX] + [directory / f["file"] for f in files]


def _prefix_refs(skeleton: Any, prefix: str) -> Any:
    """The skeleton with every tensor reference prefixed (tensor names are unique across groups)."""
    if isinstance(skeleton, list):
        return [_prefix_refs(v, prefix) for v in skeleton]
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return {"__tensor__": prefix + skeleton["__tensor__"]}
        return {k: _prefix_refs(v, prefix) for k, v in skeleton.items()}
    return skeleton


def read_index(directory: str | Path) -> dict[str, Any]:
    """The state's index (state.json), checked for its format."""
    path = Path(directory) / INDEX
    try:
        index = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StateError(f"{path}: cannot read the state index: {exc}") from None
    if index.get("format") != STATE_FORMAT:
        raise StateError(f"{path}: format {index.get('format')!r}, expected {STATE_FORMAT!r}")
    return index


def has_state(directory: str | Path | None) -> bool:
    return directory is not None and (Path(directory) / INDEX).is_file()


def load_state(directory: str | Path, groups: Iterable[str] | None = None) -> dict[str, Any]:
    """The saved object, or only the given groups (others absent from the result), each shard verified.

    A group whose shards are all missing is left out of the result, so a caller can resume without it
    (weights carried, AdamW moments left on the machine); a group with some but not all shards is an error.
    """
    from safetensors.torch import load

    directory = Path(directory)
    index = read_index(directory)
    wanted = set(index["state"]) if groups is None else set(groups)
    present: dict[str, bool] = {}
    tensors: dict[str, Tensor] = {}
    for f in index["files"]:
        if f["group"] not in wanted:
            continue
        path = directory / f["file"]
        if not path.is_file():
            if present.get(f["group"]):
                raise StateError(f"{path}: shard missing (the group's other shards are here)")
            present[f["group"]] = False
            continue
        if present.get(f["group"]) is False:
            raise StateError(f"{path}: the group {f['group']!r} is here only in part")
        present[f["group"]] = True
        blob = path.read_bytes()
        if hashlib.sha256(blob).hexdigest() != f["sha256"]:
            raise StateError(f"{path}: sha256 does not match {INDEX} (a shard of another save, or a partial copy)")
        tensors.update(load(blob))
    whole: dict[str, Tensor] = {}
    for name, info in index["tensors"].items():
        if name.split("/", 1)[0] not in wanted or info["parts"][0] not in tensors:
            continue
        if len(info["parts"]) == 1 and "shape" not in info:
            whole[name] = tensors[info["parts"][0]]
        else:
            whole[name] = torch.cat([tensors[p] for p in info["parts"]]).reshape(info["shape"])
    out = {}
    for group in wanted & set(index["state"]):
        if present.get(group, True) is False:
            continue
        out[group] = unflatten(index["state"][group], whole)
    return out


def state_files(directory: str | Path, groups: Iterable[str] | None = None) -> list[Path]:
    """The index and the shards of the given groups (all by default): what a call returns or carries."""
    directory = Path(directory)
    index = read_index(directory)
    wanted = None if groups is None else set(groups)
    return [directory / INDEX] + [directory / f["file"] for f in index["files"]
                                  if wanted is None or f["group"] in wanted]
