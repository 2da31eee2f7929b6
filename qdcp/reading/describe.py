"""What a checkpoint stores, per state-dict key, read from its metadata alone (``qdcp inspect``)."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from qdcp import spec as qspec
from qdcp.reading.entries import read_metadata

__all__ = ["describe"]


def describe(path: str | os.PathLike) -> dict[str, dict]:
    """``{key: info}``: how the checkpoint at ``path`` stores each key. ``info["stored_as"]``:
    ``"plain"``, ``"raw"``, ``"dequantized"`` or ``"object"``; tensors add ``shape``, ``dtype``
    (logical) and ``bytes`` (stored); quantized entries ``type``, ``attrs`` and, raw,
    ``components``: ``{name: {shape, dtype, bytes, layout}}``."""
    md = read_metadata(path)
    specs = qspec.read_specs(md)
    out = {fqn: _quantized(entry) for fqn, entry in sorted(specs.items())}
    for fqn in sorted(qspec.entry_keys(md.state_dict_metadata, specs)):
        if fqn in out:
            continue
        item = md.state_dict_metadata[fqn]
        if isinstance(item, TensorStorageMetadata):
            dtype = item.properties.dtype
            out[fqn] = {"stored_as": "plain", "shape": list(item.size),
                        "dtype": qspec.dtype_to_str(dtype), "bytes": _nbytes(item.size, dtype)}
        elif isinstance(item, BytesStorageMetadata):
            out[fqn] = {"stored_as": "object"}
    return out


def _quantized(entry: qspec.EntrySpec) -> dict[str, Any]:
    """What :func:`describe` says of an entry a spec describes."""
    info: dict[str, Any] = {"stored_as": entry.storage, "type": entry.type, "shape": list(entry.shape),
                            "dtype": qspec.dtype_to_str(entry.dtype), "attrs": entry.attrs}
    if entry.info:
        info["info"] = entry.info
    if entry.storage == qspec.RAW:
        comps = {c.name: {"shape": list(c.shape), "dtype": qspec.dtype_to_str(c.dtype),
                          "bytes": _nbytes(c.shape, c.dtype), "layout": c.layout}
                 for c in entry.components}
        info["components"] = comps
        info["bytes"] = sum(c["bytes"] for c in comps.values())
    else:
        dtype = entry.stored_dtype or entry.dtype
        info["stored_dtype"] = qspec.dtype_to_str(dtype)
        info["bytes"] = _nbytes(entry.shape, dtype)
    return info


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(int(s) for s in shape) * dtype.itemsize
