"""A checkpoint's entries, read without a target through :func:`qdcp.storage.storage_reader` (safe
metadata, verified checksums): its metadata, its keys and sizes, and single entries."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Sequence

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from qdcp import spec as qspec
from qdcp.adapters.base import StoredEntry, adapter_for_type, rebuild_error, stored_on_meta
from qdcp.dcp_copies import read_items
from qdcp.errors import CheckpointFormatError, QdcpError, UnsupportedTensorError
from qdcp.io.torch_save import load_object
from qdcp.layouts import ceil_div, narrow
from qdcp.storage import storage_reader
from qdcp.storage.metadata import check_stored_sizes


def read_metadata(path: str | os.PathLike, **storage_options: Any) -> Metadata:
    """The DCP ``Metadata`` of the checkpoint at ``path`` (a path or fsspec URL), read safely."""
    return storage_reader(path, **storage_options).read_metadata()


class CheckpointEntries:
    """One checkpoint's entries, read one at a time on CPU without a target (the metadata read,
    checked and indexed once). Each read assembles whole items from their stored chunks (any world
    size) and verifies them as a load does. Memory: the entry read.

    ``reuse_memory=True``: every entry is read into one buffer kept from read to read, so what a
    read returns is overwritten by the next read (use each entry before reading the next).
    """

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None, *,
                 reuse_memory: bool = False) -> None:
        self.path = path
        self._memory = _Arena() if reuse_memory else None
        self._storage = storage_reader(path)
        self.metadata = metadata if metadata is not None else self._storage.read_metadata()
        if metadata is not None:  # the caller's (the reader checks what it reads: no allocation beyond the store)
            check_stored_sizes(metadata)
        self._storage.check_files(self.metadata)  # symlinks out of it, FIFOs: the whole checkpoint refused
        self._set_up = False  # the storage reader (which checks the chunk geometry) at the first read
        self.specs = qspec.read_specs(self.metadata)
        self._stored = qspec.stored_components(self.metadata.state_dict_metadata)
        self._keys: list[str] | None = None

    def keys(self) -> list[str]:
        """The checkpoint's state-dict keys, sorted (component items folded into their entry:
        :func:`qdcp.spec.entry_keys`)."""
        if self._keys is None:
            self._keys = sorted(qspec.entry_keys(self.metadata.state_dict_metadata, self.specs))
        return list(self._keys)

    def nbytes(self, key: str) -> int:
        """The bytes entry ``key`` stores (a raw entry's components, a plain or dequantized
        entry's tensor; framing excluded); 0 for objects. ``KeyError`` for a key it does not hold."""
        entry = self.specs.get(key)
        if entry is not None and entry.storage == qspec.RAW:
            return sum(math.prod(c.shape) * c.dtype.itemsize for c in entry.components)
        item = self._item(key)
        return math.prod(item.size) * item.properties.dtype.itemsize if isinstance(item, TensorStorageMetadata) else 0

    def _item(self, key: str):
        if key not in self.metadata.state_dict_metadata:
            raise KeyError(f"key {key!r} is not in the checkpoint at {os.fspath(self.path)!r}")
        return self.metadata.state_dict_metadata[key]

    def _raw_spec(self, key: str) -> qspec.EntrySpec:
        entry = self.specs.get(key)
        if entry is None or entry.storage != qspec.RAW:
            raise KeyError(f"key {key!r} is not a raw quantized entry of the checkpoint at {os.fspath(self.path)!r}")
        return entry

    def stored(self, key: str) -> StoredEntry:
        """The raw entry ``key`` as stored: decoded attributes and canonical components."""
        entry = self._raw_spec(key)
        comps = self.components(key, [c.name for c in entry.components])
        return dataclasses.replace(stored_on_meta(entry), components=comps)

    def components(self, key: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Components ``names`` of the raw entry ``key`` (whole, canonical), the entry's spec checked first."""
        entry = self._raw_spec(key)
        qspec.layouts_of(entry)
        qspec.check_component_bytes(entry)
        qspec.check_items(entry, self.metadata.state_dict_metadata, self._stored.get(key, set()))
        items = self.tensor_items([qspec.component_fqn(key, n) for n in names])
        return {n: items[qspec.component_fqn(key, n)] for n in names}

    def tensor_items(self, fqns: Sequence[str]) -> dict[str, torch.Tensor]:
        """Whole tensor items ``fqns`` of the checkpoint, assembled from their stored chunks."""
        sd_md = self.metadata.state_dict_metadata
        reads = []
        for fqn in fqns:
            item = sd_md.get(fqn)
            if not isinstance(item, TensorStorageMetadata):
                raise CheckpointFormatError(f"{fqn!r} is not a tensor item of the checkpoint")
            reads += read_items(fqn, item, ((0,) * len(item.size), tuple(item.size)))
        arena = None
        if self._memory is not None:  # room for every stored chunk that is a whole item
            whole = [r for r in reads if _reads_whole_item(r, sd_md[r.dest_index.fqn])]
            self._memory.reset([self.metadata.storage_data[r.storage_index].length for r in whole])
            arena = self._memory
        assembler = _Assembler({fqn: sd_md[fqn] for fqn in fqns}, arena)
        self._read(reads, assembler)
        return assembler.done()

    def object_item(self, fqn: str) -> Any:
        """The non-tensor item ``fqn``, verified and unpickled without running code."""
        where = MetadataIndex(fqn)
        none = torch.Size((0,))
        assembler = _Assembler({})
        self._read([ReadItem(type=LoadItemType.BYTE_IO, dest_index=where, dest_offsets=none,
                             storage_index=where, storage_offsets=none, lengths=none)], assembler)
        return assembler.objects[fqn]

    def _read(self, reads: list[ReadItem], assembler: "_Assembler") -> None:
        if not self._set_up:
            self._storage.set_up_storage_reader(self.metadata, True)
            self._set_up = True
        self._storage.read_data(LoadPlan(reads), assembler).wait()

    def entry(self, key: str, *, dequantize: bool = False, dtype: torch.dtype | None = None) -> Any:
        """What :func:`read_entry` returns for ``key``."""
        entry = self.specs.get(key)
        if entry is not None and entry.storage == qspec.RAW:
            stored = self.stored(key)
            adapter = adapter_for_type(entry.type, key)
            try:
                return adapter.dequantize_stored(stored, dtype) if dequantize else adapter.rebuild(stored)
            except UnsupportedTensorError as e:  # the adapter's reason, said of this key
                if f"key {key!r}" in str(e):
                    raise
                raise UnsupportedTensorError(f"key {key!r}: {e}") from e
            except QdcpError:
                raise
            except Exception as e:  # the library's own error on attributes it does not take
                raise rebuild_error(key, entry.type, e) from e
        if not isinstance(self._item(key), TensorStorageMetadata):
            return self.object_item(key)
        value = self.tensor_items([key])[key]
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        return value


def _reads_whole_item(req: ReadItem, item: TensorStorageMetadata) -> bool:
    """Whether ``req`` reads a stored chunk that is the whole item, all of it."""
    whole = tuple(item.size)
    return tuple(req.lengths) == whole and not any(req.storage_offsets) and not any(req.dest_offsets) \
        and len(item.chunks) == 1 and tuple(item.chunks[0].sizes) == whole


class _Arena:
    """One uint8 buffer handed out in 64-byte aligned slots, reset before each read (grown when a
    read needs more; what earlier reads returned keeps the old buffer alive)."""

    ALIGN = 64

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._used = 0

    def reset(self, sizes: Sequence[int]) -> None:
        need = sum(ceil_div(n, self.ALIGN) * self.ALIGN for n in sizes)
        if self._buffer.numel() < need:
            self._buffer = torch.empty(0, dtype=torch.uint8)  # the old one freed first
            self._buffer = torch.empty(need, dtype=torch.uint8)
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        start = self._used
        if start + nbytes > self._buffer.numel():
            return None
        self._used = start + ceil_div(nbytes, self.ALIGN) * self.ALIGN
        return self._buffer[start: start + nbytes]


class _Assembler:
    """The planner side of :meth:`CheckpointEntries.tensor_items`: whole items from their chunks.
    A read of a whole stored chunk that is the whole item keeps the loaded tensor (no copy; read
    into ``arena`` when one is given); other reads are copied into the item, allocated at its
    first read."""

    def __init__(self, items: Mapping[str, TensorStorageMetadata], arena: _Arena | None = None) -> None:
        self._items = items
        self._arena = arena
        self._out: dict[str, torch.Tensor] = {}
        self.objects: dict[str, Any] = {}

    def buffer_for(self, req: ReadItem, nbytes: int) -> torch.Tensor | None:
        if self._arena is None or not _reads_whole_item(req, self._items[req.dest_index.fqn]):
            return None
        return self._arena.take(nbytes)

    def adopt_tensor(self, req: ReadItem, tensor: torch.Tensor) -> bool:
        fqn = req.dest_index.fqn
        whole = tuple(self._items[fqn].size)
        if tuple(tensor.shape) != whole or tuple(req.lengths) != whole or fqn in self._out:
            return False
        self._out[fqn] = tensor
        return True

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        fqn = req.dest_index.fqn
        if fqn not in self._out:
            item = self._items[fqn]
            self._out[fqn] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        return narrow(self._out[fqn], (tuple(req.dest_offsets), tuple(req.lengths)))

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, req: ReadItem, value) -> None:
        fqn = req.dest_index.fqn
        if fqn in self._items:
            raise CheckpointFormatError(f"{req.storage_index.fqn!r}: an object where a tensor was expected")
        self.objects[fqn] = load_object(value, fqn)

    def done(self) -> dict[str, torch.Tensor]:
        missing = sorted(set(self._items) - set(self._out))
        if missing:
            raise CheckpointFormatError(f"{missing}: no stored chunk holds these items")
        return self._out


def read_stored(path: str | os.PathLike, key: str, metadata: Metadata | None = None) -> StoredEntry:
    """The raw entry ``key`` of the checkpoint at ``path`` as stored (decoded attributes, canonical
    components, on CPU, checked as a load checks them); needs no tensor library."""
    return CheckpointEntries(path, metadata).stored(key)


def read_entry(path: str | os.PathLike, key: str, metadata: Metadata | None = None, *,
               dequantize: bool = False, dtype: torch.dtype | None = None) -> Any:
    """One state-dict entry of the checkpoint at ``path``, on CPU, without a target: a raw entry
    rebuilt as its type (the library must be importable), or with ``dequantize=True`` its values
    (in ``dtype``, default the logical dtype; TE entries need no TE); a plain tensor cast to
    ``dtype`` where given and floating; an object as ``torch.load(weights_only=True)`` loads it."""
    return CheckpointEntries(path, metadata).entry(key, dequantize=dequantize, dtype=dtype)
