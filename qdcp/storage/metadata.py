"""DCP's ``.metadata``, read without running code: an allowlist unpickler, and the chunk-geometry check."""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import reprlib
from pathlib import PurePath
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from qdcp.errors import CheckpointFormatError
from qdcp.spec import check_chunk_geometry, describe_item

__all__ = ["MAX_METADATA_BYTES", "METADATA_FILE", "safe_load_metadata", "check_chunk_geometry", "check_stored_sizes",
           "QdcpStorageMeta"]

MAX_METADATA_BYTES = 1 << 30
METADATA_FILE = ".metadata"

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("torch", "strided"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
}


@dataclasses.dataclass
class QdcpStorageMeta(StorageMeta):
    """The ``StorageMeta`` qdcp's storage hands the planner through DCP: what the storage does itself
    (``guards_path``: refuses an existing checkpoint; ``hashes_items``: hashes and records every
    item; ``verifies_items``: verifies every item read). It pickles as the plain ``StorageMeta``."""

    guards_path: bool = False
    hashes_items: bool = False
    verifies_items: bool = False

    @classmethod
    def of(cls, meta: StorageMeta | None, **fields: Any) -> "QdcpStorageMeta":
        base = {f.name: getattr(meta, f.name) for f in dataclasses.fields(StorageMeta)} if meta is not None else {}
        return cls(**{**base, **fields})

    def plain(self) -> StorageMeta:
        """The same ``StorageMeta`` without qdcp's fields (what a checkpoint stores)."""
        return StorageMeta(**{f.name: getattr(self, f.name) for f in dataclasses.fields(StorageMeta)})

    def __reduce_ex__(self, protocol: Any) -> Any:
        return StorageMeta, (), self.plain().__dict__


class _AnyVersionTensorProperties(TensorProperties):
    """``TensorProperties`` as any supported torch pickled it (2.15 added ``strides``); replaced by
    this torch's own class after loading."""

    def __setstate__(self, state) -> None:
        dtype, layout, requires_grad, memory_format, pin_memory = tuple(state)[:5]
        super().__setstate__((dtype, layout, requires_grad, memory_format, pin_memory))

    def plain(self) -> TensorProperties:
        return TensorProperties(dtype=self.dtype, layout=self.layout, requires_grad=self.requires_grad,
                                memory_format=self.memory_format, pin_memory=self.pin_memory)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.distributed.checkpoint.metadata", "TensorProperties"):
            return _AnyVersionTensorProperties
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointFormatError(
            f"the checkpoint's .metadata refers to {module}.{name}, which is not a DCP metadata "
            f"class; refusing to unpickle it (the file may be tampered with)")


def safe_load_metadata(stream: IO[bytes]) -> Metadata:
    """Unpickle DCP ``Metadata`` admitting only DCP's metadata classes and builtins."""
    chunks, total = [], 0
    while True:  # in pieces: read(1 GiB) would reserve 1 GiB up front
        chunk = stream.read(1 << 20)
        if not chunk:
            break
        total += len(chunk)
        if total > MAX_METADATA_BYTES:
            raise CheckpointFormatError(f".metadata is larger than {MAX_METADATA_BYTES} bytes")
        chunks.append(chunk)
    data = b"".join(chunks)
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointFormatError:
        raise
    except MemoryError:  # a length field far beyond the file (CPython's unpickler reserves it first)
        raise CheckpointFormatError("the checkpoint's .metadata claims an object larger than memory; "
                                    "it is corrupt or hostile") from None
    except Exception as e:  # truncated or garbage pickles raise many types
        raise CheckpointFormatError(f"the checkpoint's .metadata cannot be read: {e!r}") from None
    if not isinstance(md, Metadata):
        raise CheckpointFormatError(f".metadata holds a {type(md).__name__}, not DCP Metadata")
    # planner_data: the free-form part (DCP's other fields are checked field by field below)
    damage = _graph_problem(md.planner_data, _MAX_NODES_PER_BYTE * len(data) + (1 << 16)) or _malformed(md)
    if damage is not None:
        raise CheckpointFormatError(f"the checkpoint's .metadata cannot be read: {damage}; it is corrupt "
                                    f"(restore it from a good copy)")
    for item in (md.state_dict_metadata or {}).values():
        if isinstance(getattr(item, "properties", None), _AnyVersionTensorProperties):
            item.properties = item.properties.plain()
    return md


def _malformed(md: Metadata) -> str | None:
    """What in unpickled ``md`` lacks a field of DCP's classes or holds the wrong type, or None."""
    entries = vars(md).get("state_dict_metadata")
    if not isinstance(entries, dict):
        return "it has no table of entries"
    for fqn, item in entries.items():
        if not isinstance(fqn, str):
            return f"an entry's key is a {type(fqn).__name__}"
        if isinstance(item, TensorStorageMetadata):
            fields = vars(item)
            if not isinstance(getattr(fields.get("properties"), "dtype", None), torch.dtype) \
                    or not _ints(fields.get("size")) or not isinstance(fields.get("chunks"), list) \
                    or not all(isinstance(c, ChunkStorageMetadata) and _ints(vars(c).get("offsets"))
                               and _ints(vars(c).get("sizes")) for c in fields["chunks"]):
                return f"the record of {describe_item(fqn)} is damaged"
        elif not isinstance(item, BytesStorageMetadata):
            return f"the record of {describe_item(fqn)} is a {type(item).__name__}"
    records = vars(md).get("storage_data")
    if not isinstance(records, dict):  # a save's writer always records where each item lies
        return "it has no table of storage records"
    for index, info in records.items():
        fqn = vars(index).get("fqn") if isinstance(index, MetadataIndex) else None
        fields = vars(info) if hasattr(info, "__dict__") else {}
        if not isinstance(fqn, str) or not isinstance(fields.get("relative_path"), str) \
                or not all(isinstance(fields.get(f), int) for f in ("offset", "length")):
            return f"the storage record of {describe_item(fqn) if isinstance(fqn, str) else 'an item'} is damaged"
    planner = vars(md).get("planner_data")
    if planner is not None and (not isinstance(planner, dict) or not all(isinstance(k, str) for k in planner)):
        return "its planner data is not a table of keys"
    nested = False
    for key, path in (planner or {}).items():  # DCP's nesting of each flat key: its path, joined by "."
        if isinstance(path, (tuple, list)):
            nested = True
            if not (all(isinstance(p, (str, int)) for p in path) and ".".join(map(str, path)) == key):
                return f"the nesting it records for key {_short(key)} ({_short(path)}) does not spell that key"
    if nested:  # DCP records the nesting of every item it flattened, or none
        unmapped = [fqn for fqn in entries if not isinstance(planner.get(fqn), (tuple, list))]
        if unmapped:
            return f"{describe_item(unmapped[0])} has no recorded nesting, unlike the others"
    return None


# nesting deeper than DCP's metadata has (Metadata > dict > record > list > chunk > size > int: 7)
_MAX_DEPTH = 32
# objects a walk of the unpickled graph meets (shared ones once per reference), at most this many per
# byte of the pickle (plus a floor): every later walk stays linear in the file's size
_MAX_NODES_PER_BYTE = 16
_LEAVES = (str, bytes, int, float, complex, type(None), torch.dtype, PurePath, slice)
_LEAF_TYPES = frozenset((str, bytes, int, float, bool, complex, type(None), torch.dtype, slice))
_REPR = reprlib.Repr()  # a bounded repr for messages
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 60, 60
_short = _REPR.repr


def _children(obj: Any) -> list:
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    return list(vars(obj).values()) if hasattr(obj, "__dict__") and not isinstance(obj, _LEAVES) else []


def _graph_problem(root: Any, max_nodes: int) -> str | None:
    """Why the unpickled graph of ``root`` is refused (a cycle, nesting deeper than :data:`_MAX_DEPTH`,
    more than ``max_nodes`` objects as a walk meets them), or None; each object visited once."""
    done: dict[int, tuple[int, int]] = {}  # id -> (objects under it, counted per reference; depth)
    open_ids: set[int] = set()
    stack: list[tuple[Any, list | None]] = [(root, None)]
    while stack:
        obj, kids = stack.pop()
        if kids is not None:  # every child done (leaves: one object, no depth)
            open_ids.discard(id(obj))
            got = [done.get(id(k), (1, 0)) for k in kids]
            count, depth = 1 + sum(n for n, _ in got), 1 + max((d for _, d in got), default=0)
            if depth > _MAX_DEPTH:
                return f"it nests objects deeper than {_MAX_DEPTH} levels"
            if count > max_nodes:
                return f"its shared references stand for more than {max_nodes} objects"
            done[id(obj)] = (count, depth)
        elif id(obj) in open_ids:
            return "an object in it contains itself"
        elif id(obj) not in done:
            kids = _children(obj)
            open_ids.add(id(obj))
            stack.append((obj, kids))
            stack.extend((k, None) for k in kids if type(k) not in _LEAF_TYPES and id(k) not in done)
    return None


def _ints(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(isinstance(v, int) for v in value)


#: a stored item may hold as little as 1/this of its elements' bytes in the recorded dtype (stock DCP's
#: whole quantized tensor: 1-bit codes of float32 values); an item claiming more is refused unread
MAX_PACKING = 32


def check_stored_sizes(md: Metadata) -> None:
    """Refuse metadata that would have a reader allocate far more than the checkpoint stores: an item
    claiming more than :data:`MAX_PACKING` times its stored bytes, or overlapping byte ranges in a file."""
    stored: dict[str, int] = {}
    spans: dict[Any, list[tuple[int, int, str]]] = {}
    for index, info in (md.storage_data if isinstance(md.storage_data, dict) else {}).items():
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(offset) is not int or type(length) is not int or not isinstance(index, MetadataIndex):
            continue
        stored[index.fqn] = stored.get(index.fqn, 0) + length
        spans.setdefault(getattr(info, "relative_path", None), []).append((offset, length, index.fqn))
    for fqn, item in (md.state_dict_metadata or {}).items():
        if isinstance(item, TensorStorageMetadata) and isinstance(item.properties.dtype, torch.dtype):
            claimed = math.prod(item.size) * item.properties.dtype.itemsize
            if claimed > MAX_PACKING * stored.get(fqn, 0):
                held = f"its stored items hold {stored[fqn]}" if fqn in stored else "it has no storage record"
                raise CheckpointFormatError(f"{describe_item(fqn)}: it claims {claimed} bytes of values but {held}; "
                                            f"the checkpoint's metadata is corrupt")
    for rel, found in spans.items():
        found.sort()
        for (a, la, fa), (b, _, fb) in zip(found, found[1:]):
            if a + la > b:
                raise CheckpointFormatError(
                    f"{describe_item(fb)}: its stored bytes in {rel!r} overlap those of {describe_item(fa)}; "
                    f"the checkpoint's metadata is corrupt")
