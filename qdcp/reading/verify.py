"""The checks ``qdcp verify`` runs on a checkpoint beyond what reading it checks: the chunk
geometry and storage records of its metadata, component items no spec lists, and each entry read
whole and computed."""

from __future__ import annotations

import os

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from qdcp import spec as qspec
from qdcp.reading.entries import CheckpointEntries
from qdcp.storage.local_files import file_problem

__all__ = ["check_chunks", "check_storage", "check_components", "check_entry"]


def check_chunks(metadata: Metadata) -> list[str]:
    """Problems with the chunks of every tensor item: out of bounds, overlapping, or holes."""
    return [f"{fqn}: {problem}" for fqn, problem in qspec.chunk_problems(metadata.state_dict_metadata)]


def check_storage(metadata: Metadata, path: str | os.PathLike | None = None) -> list[str]:
    """Problems with the storage records: a chunk or object without one, one that belongs to no
    item, records of one file that overlap, or (for a local ``path``) whose file may not be read
    (:func:`qdcp.storage.local_files.file_problem`) or that lie outside their file."""
    problems = []
    records = metadata.storage_data or {}
    if not isinstance(records, dict):
        return ["the checkpoint's storage records are not a mapping"]
    have = {(getattr(i, "fqn", None), tuple(getattr(i, "offset", None) or ())) for i in records}
    wanted = set()
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            wanted |= {(fqn, tuple(c.offsets)) for c in item.chunks}
        else:
            wanted.add((fqn, ()))
    problems += [f"{fqn}: its chunk at {o} has no storage record" for fqn, o in sorted(wanted - have)]
    problems += [f"{fqn}: a storage record at {o} belongs to no item" for fqn, o in sorted(have - wanted)]
    per_file: dict = {}
    for index, info in records.items():
        per_file.setdefault(getattr(info, "relative_path", None), []).append(
            (int(getattr(info, "offset", 0) or 0), int(getattr(info, "length", 0) or 0), index.fqn))
    for rel, spans in per_file.items():
        spans.sort()
        for (a, la, fa), (b, lb, fb) in zip(spans, spans[1:]):
            if a + la > b:
                problems.append(f"{fb}: its stored bytes overlap those of {fa} in {rel!r}")
        if path is None or "://" in os.fspath(path):
            continue
        problem = file_problem(path, rel) if isinstance(rel, str) else "is not a file name"
        if problem is not None:  # outside the directory, or not a regular file: never read
            problems.append(f"{spans[0][2]}: its data file {rel!r} {problem}")
            continue
        file = os.path.join(os.fspath(path), rel)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        for off, length, fqn in spans:
            if size is None or off < 0 or length < 0 or off + length > size:
                problems.append(f"{fqn}: its stored bytes [{off}, {off + length}) lie outside {rel!r} "
                                f"({'missing' if size is None else f'{size} bytes'})")
    return problems


def check_components(entries: CheckpointEntries) -> list[str]:
    """Component items (``<key>.__qdcp__.<name>``) of an entry no spec describes: a damaged or missing spec."""
    stored = entries.metadata.state_dict_metadata
    return [f"{k}: a qdcp component item that no spec entry lists (damaged or missing spec)"
            for k in entries.keys() if qspec.COMPONENT_SEPARATOR in k and k in stored
            and k.rsplit(qspec.COMPONENT_SEPARATOR, 1)[0] not in entries.specs]


def check_entry(entries: CheckpointEntries, key: str) -> list[str]:
    """Read entry ``key`` whole (checksums and stored shapes checked on the way; errors raised) and
    compute its values: problems with their shape or dtype."""
    value = entries.entry(key, dequantize=True)
    if not isinstance(value, torch.Tensor):
        return []
    spec = entries.specs.get(key)
    expected = spec.shape if spec is not None else tuple(entries.metadata.state_dict_metadata[key].size)
    problems = []
    if tuple(value.shape) != tuple(expected):
        problems.append(f"{key}: rebuilt shape {tuple(value.shape)} != {tuple(expected)}")
    if spec is not None and spec.storage == qspec.RAW and value.dtype != spec.dtype:
        problems.append(f"{key}: rebuilt dtype {value.dtype} != {spec.dtype}")
    return problems
