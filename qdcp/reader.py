"""Reading a checkpoint without a target: its metadata, a description, single entries, chunk checks.

Everything here reads through :func:`qdcp.storage.storage_reader` (safe metadata, verified
checksums).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from qdcp import spec as qspec
from qdcp.adapters.base import StoredEntry, adapter_for_type
from qdcp.storage import storage_reader

def read_metadata(path: str | os.PathLike, **storage_options: Any) -> Metadata:
    """The DCP ``Metadata`` of the checkpoint at ``path`` (a path or fsspec URL), read safely."""
    return storage_reader(path, **storage_options).read_metadata()


def describe(path: str | os.PathLike) -> dict[str, dict]:
    """Per state-dict key, how the checkpoint at ``path`` stores it.

    Returns ``{key: info}`` where ``info["stored_as"]`` is ``"plain"``, ``"raw"``, ``"dequantized"``
    or ``"object"``; tensors add ``shape`` and ``dtype`` (logical) and ``bytes`` (stored, excluding
    framing); quantized entries add ``type``, ``attrs`` and, raw, ``components``: ``{name: {shape,
    dtype, bytes, layout}}``.
    """
    md = read_metadata(path)
    specs = qspec.read_specs(md)
    owned = {qspec.component_fqn(e.fqn, c.name) for e in specs.values() for c in e.components}
    out: dict[str, dict] = {}
    for fqn, entry in sorted(specs.items()):
        info: dict[str, Any] = {"stored_as": entry.storage, "type": entry.type,
                                "shape": list(entry.shape), "dtype": qspec.dtype_to_str(entry.dtype),
                                "attrs": entry.attrs}
        if entry.info:
            info["info"] = entry.info
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


def read_stored(path: str | os.PathLike, key: str, metadata: Metadata | None = None) -> StoredEntry:
    """The raw entry ``key`` of the checkpoint at ``path`` as stored: its decoded attributes and
    canonical components, on CPU, checked as a loader checks them. Needs no tensor library.
    Memory: this entry only."""
    md = metadata if metadata is not None else read_metadata(path)
    entry = qspec.read_specs(md).get(key)
    if entry is None or entry.storage != qspec.RAW:
        raise KeyError(f"key {key!r} is not a raw quantized entry of the checkpoint at {os.fspath(path)!r}")
    attrs = decoded_attrs(entry)
    comps = read_components(path, key, [c.name for c in entry.components], md)
    return StoredEntry(entry.type, attrs, entry.shape, entry.dtype, comps)


def read_components(path: str | os.PathLike, key: str, names, metadata: Metadata | None = None) -> dict[str, torch.Tensor]:
    """Components ``names`` of the raw entry ``key`` (whole, canonical, on CPU), checked as
    :func:`read_stored` checks them. Memory: those components only."""
    md = metadata if metadata is not None else read_metadata(path)
    entry = qspec.read_specs(md).get(key)
    if entry is None or entry.storage != qspec.RAW:
        raise KeyError(f"key {key!r} is not a raw quantized entry of the checkpoint at {os.fspath(path)!r}")
    qspec.layouts_of(entry)
    qspec.check_component_bytes(entry)
    qspec.check_items(entry, md.state_dict_metadata, qspec.stored_components(md.state_dict_metadata).get(key, set()))
    comps = {}
    for name in names:
        c = entry.component(name)
        _check_claimed_bytes(md, qspec.component_fqn(key, name))
        comps[name] = torch.empty(c.shape, dtype=c.dtype)
    _load_quietly({qspec.component_fqn(key, n): t for n, t in comps.items()}, path)
    return comps


def decoded_attrs(entry: qspec.EntrySpec) -> dict[str, Any]:
    """The attributes of a stored entry, decoded with its adapter's classes (no tensor library needed)."""
    adapter = adapter_for_type(entry.type, entry.fqn)
    where = f"key {entry.fqn!r}: "
    return {k: qspec.decode_value(v, adapter.attribute_classes(), where) for k, v in entry.attrs.items()}


def stored_on_meta(entry: qspec.EntrySpec) -> StoredEntry:
    """A raw entry as :func:`read_stored` returns it, but with components on the meta device: what
    its shapes, dtypes and attributes imply, read nothing."""
    comps = {c.name: torch.empty(c.shape, dtype=c.dtype, device="meta") for c in entry.components}
    return StoredEntry(entry.type, decoded_attrs(entry), entry.shape, entry.dtype, comps)


def read_entry(path: str | os.PathLike, key: str, metadata: Metadata | None = None, *,
               dequantize: bool = False, dtype: torch.dtype | None = None) -> Any:
    """Read one state-dict entry of the checkpoint at ``path`` on CPU, without a target.

    Raw entries come back as an instance of their type (rebuilt through its adapter; the library
    must be importable), or with ``dequantize=True`` as the plain tensor of their values (computed
    in ``dtype``, default the logical dtype; TransformerEngine entries need no TE). Plain and
    dequantized entries come back as plain tensors (cast to ``dtype`` if it is given and they are
    floating), objects as loaded with ``torch.load(weights_only=True)``. Memory: this entry only.
    """
    md = metadata if metadata is not None else read_metadata(path)
    entry = qspec.read_specs(md).get(key)
    if entry is not None and entry.storage == qspec.RAW:
        stored = read_stored(path, key, md)
        adapter = adapter_for_type(entry.type, key)
        return adapter.dequantize_stored(stored, dtype) if dequantize else adapter.rebuild(stored)
    item = md.state_dict_metadata.get(key)
    if item is None:
        raise KeyError(f"key {key!r} is not in the checkpoint at {os.fspath(path)!r}")
    if isinstance(item, TensorStorageMetadata):
        _check_claimed_bytes(md, key)
    state = {key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
             if isinstance(item, TensorStorageMetadata) else None}
    _load_quietly(state, path)
    value = state[key]
    if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
        value = value.to(dtype)
    return value


_stored_cache: tuple[Any, dict[str, int]] = (None, {})


def _stored_bytes(md: Metadata) -> dict[str, int]:
    """Bytes stored per item fqn (framing included), computed once per metadata object."""
    global _stored_cache
    if _stored_cache[0] is not md:
        totals: dict[str, int] = {}
        for idx, info in (md.storage_data or {}).items():
            fqn = getattr(idx, "fqn", None)
            totals[fqn] = totals.get(fqn, 0) + int(getattr(info, "length", 0) or 0)
        _stored_cache = (md, totals)
    return _stored_cache[1]


def _check_claimed_bytes(md: Metadata, fqn: str) -> None:
    """A tensor item cannot hold more elements than its stored bytes: refuse before allocating."""
    from qdcp.errors import CheckpointFormatError

    item = md.state_dict_metadata.get(fqn)
    if not isinstance(item, TensorStorageMetadata):
        raise CheckpointFormatError(f"{fqn!r} is not a tensor item of the checkpoint")
    claimed = 1
    for s in item.size:
        claimed *= int(s)
    claimed *= item.properties.dtype.itemsize
    stored = _stored_bytes(md).get(fqn, 0)
    if claimed > stored:
        raise CheckpointFormatError(
            f"{fqn!r} claims {claimed} bytes but its stored items hold {stored}; the checkpoint's "
            f"metadata is corrupt or hostile")


def _load_quietly(state: dict, path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    from qdcp.planner import QuantizedLoadPlanner

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=storage_reader(path), planner=QuantizedLoadPlanner(),
                 no_dist=True)


def check_chunks(metadata: Metadata) -> list[str]:
    """Problems with the chunks of every tensor item: out of bounds, overlapping, or holes."""
    return [f"{fqn}: {problem}" for fqn, problem in qspec.chunk_problems(metadata.state_dict_metadata)]


def check_storage(metadata: Metadata, path: str | os.PathLike | None = None) -> list[str]:
    """Problems with the storage records: a chunk or object without one, one that belongs to no
    item, records of one file that overlap, or (for a local ``path``) that lie outside their file."""
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
        if path is not None and "://" not in os.fspath(path) and isinstance(rel, str):
            file = os.path.join(os.fspath(path), rel)
            size = os.path.getsize(file) if os.path.isfile(file) else None
            for off, length, fqn in spans:
                if size is None or off < 0 or length < 0 or off + length > size:
                    problems.append(f"{fqn}: its stored bytes [{off}, {off + length}) lie outside {rel!r} "
                                    f"({'missing' if size is None else f'{size} bytes'})")
    return problems


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()
