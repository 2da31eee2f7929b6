"""Reading checkpoint metadata without running code from it, and describing a checkpoint.

DCP's ``.metadata`` file is a pickle. :func:`safe_load_metadata` unpickles it with an allowlist of
DCP's metadata classes, torch dtypes/sizes and path classes: any other global is refused.
:class:`SafeFileSystemReader` is a ``FileSystemReader`` that reads metadata that way.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)

from qdcp import spec as qspec
from qdcp.errors import CheckpointFormatError

MAX_METADATA_BYTES = 1 << 30

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch", "strided"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointFormatError(
            f"the checkpoint's .metadata refers to {module}.{name}, which is not a DCP metadata "
            f"class; refusing to unpickle it (the file may be tampered with)")


def safe_load_metadata(stream: IO[bytes]) -> Metadata:
    """Unpickle DCP ``Metadata`` admitting only DCP's metadata classes and builtins."""
    data = stream.read(MAX_METADATA_BYTES + 1)
    if len(data) > MAX_METADATA_BYTES:
        raise CheckpointFormatError(f".metadata is larger than {MAX_METADATA_BYTES} bytes")
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointFormatError:
        raise
    except Exception as e:  # truncated or garbage pickles raise many types
        raise CheckpointFormatError(f"the checkpoint's .metadata cannot be read: {e!r}") from None
    if not isinstance(md, Metadata):
        raise CheckpointFormatError(f".metadata holds a {type(md).__name__}, not DCP Metadata")
    return md


class _SafeMetadata:
    """Mixin for DCP's file-system readers: ``read_metadata`` never runs code from the file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        if not self.fs.exists(path):
            raise CheckpointFormatError(
                f"{os.fspath(self.path)!r} has no .metadata: it is not a DCP checkpoint, or its save "
                f"did not finish")
        with self.fs.create_stream(path, "rb") as f:
            metadata = safe_load_metadata(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """A ``FileSystemReader`` whose ``read_metadata`` never runs code from the checkpoint."""


def _is_url(path: str | os.PathLike) -> bool:
    return "://" in os.fspath(path)


def safe_storage_reader(path: str | os.PathLike, **storage_options: Any) -> FileSystemReader:
    """A reader for a local path or an fsspec URL (``memory://``, ``s3://``...) that reads
    ``.metadata`` safely; ``storage_options`` go to fsspec (e.g. ``client_kwargs``)."""
    if _is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        class SafeFsspecReader(_SafeMetadata, FsspecReader):
            """An ``FsspecReader`` whose ``read_metadata`` never runs code from the checkpoint."""

        return SafeFsspecReader(os.fspath(path), **storage_options)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory at {os.fspath(path)!r}")
    return SafeFileSystemReader(path)


def read_metadata(path: str | os.PathLike, **storage_options: Any) -> Metadata:
    """The DCP ``Metadata`` of the checkpoint at ``path`` (a path or fsspec URL), read safely."""
    return safe_storage_reader(path, **storage_options).read_metadata()


def describe(path: str | os.PathLike) -> dict[str, dict]:
    """Per state-dict key, how the checkpoint at ``path`` stores it.

    Returns ``{key: info}`` where ``info["stored_as"]`` is ``"plain"``, ``"raw"``, ``"dequantized"``
    or ``"object"``; tensors add ``shape`` and ``dtype`` (logical) and ``bytes`` (stored, excluding
    framing); quantized entries add ``type``, ``attrs`` and, raw, ``components``: ``{name: {shape,
    dtype, bytes, layout}}``.
    """
    from qdcp.planner import read_specs

    md = read_metadata(path)
    specs = read_specs(md)
    owned = {qspec.component_fqn(e.fqn, c.name) for e in specs.values() for c in e.components}
    out: dict[str, dict] = {}
    for fqn, entry in sorted(specs.items()):
        info: dict[str, Any] = {"stored_as": entry.storage, "type": entry.type,
                                "shape": list(entry.shape), "dtype": qspec.dtype_to_str(entry.dtype),
                                "attrs": entry.attrs}
        if entry.storage == qspec.RAW:
            comps = {}
            for c in entry.components:
                nbytes = _nbytes(c.shape, c.dtype)
                comps[c.name] = {"shape": list(c.shape), "dtype": qspec.dtype_to_str(c.dtype),
                                 "bytes": nbytes, "layout": c.layout}
            info["components"] = comps
            info["bytes"] = sum(c["bytes"] for c in comps.values())
        else:
            dtype = entry.stored_dtype or entry.dtype
            info["stored_dtype"] = qspec.dtype_to_str(dtype)
            info["bytes"] = _nbytes(entry.shape, dtype)
        out[fqn] = info
    for fqn, item in sorted(md.state_dict_metadata.items()):
        if fqn in owned or fqn in out:
            continue
        if isinstance(item, TensorStorageMetadata):
            dtype = item.properties.dtype
            out[fqn] = {"stored_as": "plain", "shape": list(item.size),
                        "dtype": qspec.dtype_to_str(dtype), "bytes": _nbytes(item.size, dtype)}
        elif isinstance(item, BytesStorageMetadata):
            out[fqn] = {"stored_as": "object"}
    return out


def read_entry(path: str | os.PathLike, key: str, metadata: Metadata | None = None) -> Any:
    """Read one state-dict entry of the checkpoint at ``path`` on CPU, without a target.

    Raw entries come back as an instance of their type (rebuilt through its adapter; the library
    must be installed), plain and dequantized entries as plain tensors, objects as loaded with
    ``torch.load(weights_only=True)``. Memory: this entry only.
    """
    import torch.distributed.checkpoint as dcp

    from qdcp.adapters.base import adapter_for_type
    from qdcp.planner import QuantizedLoadPlanner, read_specs

    md = metadata if metadata is not None else read_metadata(path)
    entry = read_specs(md).get(key)
    if entry is not None and entry.storage == qspec.RAW:
        adapter = adapter_for_type(entry.type, key)
        attrs = {k: qspec.decode_value(v, adapter.attribute_classes(), f"key {key!r}: ")
                 for k, v in entry.attrs.items()}
        comps = {c.name: torch.empty(c.shape, dtype=c.dtype) for c in entry.components}
        state = {qspec.component_fqn(key, n): t for n, t in comps.items()}
        _load_quietly(state, path)
        return adapter.rebuild(entry.type, attrs, entry.shape, entry.dtype, comps)
    item = md.state_dict_metadata.get(key)
    if item is None:
        raise KeyError(f"key {key!r} is not in the checkpoint at {os.fspath(path)!r}")
    state = {key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
             if isinstance(item, TensorStorageMetadata) else None}
    _load_quietly(state, path)
    return state[key]


def _load_quietly(state: dict, path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    from qdcp.planner import QuantizedLoadPlanner

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=safe_storage_reader(path), planner=QuantizedLoadPlanner(),
                 no_dist=True)


def check_chunks(metadata: Metadata) -> list[str]:
    """Problems with the chunks of every tensor item: out of bounds, overlapping, or holes."""
    problems = []
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        size = tuple(item.size)
        total = 1
        for s in size:
            total *= s
        covered = 0
        boxes = []
        for ch in item.chunks:
            o, n = tuple(ch.offsets), tuple(ch.sizes)
            if len(o) != len(size) or any(a < 0 or b < 0 or a + b > d for a, b, d in zip(o, n, size)):
                problems.append(f"{fqn}: chunk at {o} of size {n} is outside {size}")
                continue
            vol = 1
            for b in n:
                vol *= b
            covered += vol
            boxes.append((o, n))
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                (oa, na), (ob, nb) = boxes[i], boxes[j]
                if all(a < c + e and c < a + b for a, b, c, e in zip(oa, na, ob, nb)) and \
                        all(b > 0 for b in na) and all(e > 0 for e in nb):
                    problems.append(f"{fqn}: chunks at {oa} and {ob} overlap")
        if covered != total and not any("overlap" in p and p.startswith(fqn) for p in problems):
            problems.append(f"{fqn}: chunks cover {covered} of {total} elements")
    return problems


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()
