"""How one checkpoint entry is loaded into one target: a small frozen class per way.

Each action says which items it reads (:class:`ItemRead`: checkpoint item, chunk, destination
buffer) and how it finishes once they are all in (:meth:`LoadAction.finish`), updating the target
in place. A plain entry into a plain target is no action: DCP's own path loads it.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from qdcp.adapters import rows
from qdcp.adapters.base import Adapter, RawConversion, StoredEntry, adapter_for_type, find_adapter
from qdcp.errors import AlignmentError, QdcpError
from qdcp.layouts import Chunk, Layout, full_chunk, held_exactly, narrow
from qdcp.planning.placement import Placed, relative

__all__ = ["Temporaries", "Destination", "ItemRead", "StoredSource", "LoadAction", "InPlace", "RawCopy",
           "Requantize", "Reblock", "IntoPlain", "FromPlain"]


class Temporaries:
    """The temporaries of one load: a buffer an action has finished with is handed to the next
    read of the same shape and dtype (a model's layers repeat their shapes), so a load does not
    fault in fresh pages for every entry. Holds at most ``keep`` idle buffers, newest first."""

    def __init__(self, keep: int = 8) -> None:
        self._idle: list[torch.Tensor] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            for i, t in enumerate(self._idle):
                if t.dtype == dtype and tuple(t.shape) == shape:
                    return self._idle.pop(i)
        return torch.empty(shape, dtype=dtype)

    def give(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self._idle.insert(0, tensor)
            del self._idle[self._keep:]

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()


class Destination:
    """Where a read lands: the target's own buffer, or a temporary of ``shape`` / ``dtype`` taken
    at its first use (the read, not the plan: only the entries being read hold temporaries) and
    given back when its action has finished."""

    def __init__(self, shape, dtype: torch.dtype, own: torch.Tensor | None, pool: Temporaries) -> None:
        self.shape, self.dtype, self._tensor, self.temporary = tuple(shape), dtype, own, own is None
        self._pool = pool
        self._lock = threading.Lock()

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            with self._lock:
                if self._tensor is None:
                    self._tensor = self._pool.take(self.shape, self.dtype)
        return self._tensor

    def release(self, held: set[int] | None) -> None:
        """Drop a temporary; it goes back to the pool unless the target may hold its memory
        (``held``: the storages of the target's buffers, None if unknown)."""
        tensor, self._tensor = self._tensor, (None if self.temporary else self._tensor)
        if self.temporary and tensor is not None and held is not None \
                and tensor.untyped_storage().data_ptr() not in held:
            self._pool.give(tensor)


@dataclasses.dataclass(frozen=True)
class ItemRead:
    """One checkpoint item, or the chunk of it an action needs, and where it lands."""

    item: str                        #: name the read is planned under (the target key's item)
    stored: str                      #: checkpoint item read (another key's, for a member of a group)
    md: TensorStorageMetadata        #: the checkpoint's metadata of ``stored``
    chunk: Chunk                     #: chunk of ``stored`` needed
    dest: Destination                #: the target's own buffer or a temporary
    component: str | None = None     #: canonical component a temporary holds (None: already in place)

    @property
    def buffer(self) -> torch.Tensor:
        """The destination tensor (a temporary is made here, at first use)."""
        return self.dest.tensor


@dataclasses.dataclass(frozen=True)
class StoredSource:
    """What the finish step needs of a raw checkpoint entry: its type, decoded attributes, dtype,
    and (to dequantize a chunk a block of rows at a time) its logical shape and component layouts."""

    type_name: str
    attrs: Mapping[str, Any]
    dtype: torch.dtype
    shape: tuple[int, ...]
    layouts: Mapping[str, Layout]


@dataclasses.dataclass(frozen=True)
class LoadAction:
    """Base of the actions: the target key, where the target sits, and the reads it needs."""

    fqn: str
    placed: Placed
    reads: tuple[ItemRead, ...]

    def components(self) -> dict[str, torch.Tensor]:
        """The temporaries read, by component name."""
        return {r.component: r.buffer for r in self.reads if r.component is not None}

    def finish(self) -> None:
        """Turn what was read into the target's values, in place (all reads are in)."""
        raise NotImplementedError

    def release(self) -> None:
        """Drop the temporaries (after :meth:`finish`)."""
        if any(r.dest.temporary for r in self.reads):
            held = _storages(self.placed.local)
            for r in self.reads:
                r.dest.release(held)


def _storages(t: torch.Tensor) -> set[int] | None:
    """The storages holding ``t``'s data (its adapter's inner buffers, for a quantized tensor);
    None where they cannot be told (then no temporary is reused)."""
    try:
        adapter = find_adapter(t)
        buffers = adapter.inner_buffers(t).values() if adapter is not None else [t]
        return {b.untyped_storage().data_ptr() for b in buffers if isinstance(b, torch.Tensor)}
    except Exception:  # noqa: BLE001 (a tensor whose storage cannot be read: keep nothing)
        return None


@dataclasses.dataclass(frozen=True)
class InPlace(LoadAction):
    """Same type and config: components were read straight into the target's buffers where their
    canonical form is the native one; the others are copied in by the adapter."""

    adapter: Adapter

    def finish(self) -> None:
        temps = self.components()
        if temps:
            self.adapter.copy_into(self.placed.local, temps)


@dataclasses.dataclass(frozen=True)
class RawCopy(LoadAction):
    """Another type with the same bits: the components that carry them, converted raw."""

    conversion: RawConversion

    def finish(self) -> None:
        self.conversion.fill(self.placed.local, self.components())


@dataclasses.dataclass(frozen=True)
class Requantize(LoadAction):
    """Another format or config: the covering chunk (``read_chunk``) dequantized, then quantized
    like the target."""

    adapter: Adapter
    source: StoredSource
    read_chunk: Chunk

    def finish(self) -> None:
        _fill(self.adapter, self.placed, _dequantized(self, self.source, self.read_chunk), self.read_chunk)


@dataclasses.dataclass(frozen=True)
class Reblock(Requantize):
    """The same type with other scale blocks, or a shard across the source's blocks: the source's
    bits where the target's blocks hold them exactly (:func:`qdcp.layouts.held_exactly`, the rule
    of docs/api.md), else dequantized and quantized like the target."""

    target_layouts: Mapping[str, Layout] = dataclasses.field(default_factory=dict)

    def finish(self) -> None:
        exact = self.exact_components()
        if exact is None:
            super().finish()
        else:
            self.adapter.copy_into(self.placed.local, exact)

    def exact_components(self) -> dict[str, torch.Tensor] | None:
        """The target's components holding the source's bits, or None where its blocks cannot."""
        read, own = self.components(), self.adapter.components(self.placed.local)
        out = {}
        for name, layout in self.target_layouts.items():
            held = held_exactly(read[name], self.source.layouts[name], self.placed.global_shape,
                                self.read_chunk, layout, self.placed.chunk)
            if held is None or held.dtype != own[name].dtype or tuple(held.shape) != tuple(own[name].shape):
                return None
            out[name] = held
        return out


@dataclasses.dataclass(frozen=True)
class IntoPlain(LoadAction):
    """A raw entry into a plain target: dequantized, in the target's precision where it is wider."""

    source: StoredSource
    read_chunk: Chunk

    def finish(self) -> None:
        wider = _wider(self.placed.local, self.source.dtype)
        _fill(None, self.placed, _dequantized(self, self.source, self.read_chunk, wider), self.read_chunk)


@dataclasses.dataclass(frozen=True)
class FromPlain(LoadAction):
    """A plain stored tensor into a quantized target, quantized like it; or, with no ``adapter``,
    into a plain target that DCP cannot fill itself (a member of a group stored under another key)."""

    adapter: Adapter | None
    read_chunk: Chunk

    def finish(self) -> None:
        _fill(self.adapter, self.placed, self.reads[0].buffer, self.read_chunk)


def _dequantized(action: LoadAction, source: StoredSource, read_chunk: Chunk,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """The stored entry's values over ``read_chunk``, from the temporaries read (in ``dtype``,
    default its logical dtype); a large chunk a block of rows at a time (:mod:`qdcp.adapters.rows`)."""
    adapter = adapter_for_type(source.type_name, action.fqn)
    stored = StoredEntry(source.type_name, source.attrs, read_chunk[1], source.dtype, action.components())
    blocks = rows.row_blocks(source.layouts, source.shape, read_chunk) \
        if set(source.layouts) == set(stored.components) else None
    if blocks is None:
        return adapter.dequantize_stored(stored, dtype)
    return rows.dequantize_by_rows(adapter, stored, blocks, read_chunk, dtype)


def _target_part(placed: Placed, values: torch.Tensor, read_chunk: Chunk) -> torch.Tensor:
    part = narrow(values, relative(placed.chunk, read_chunk))
    if tuple(part.shape) != tuple(placed.local.shape):  # one member of a group: [1, M, N] -> [M, N]
        part = part.reshape(placed.local.shape)
    return part


def _fill(adapter: Adapter | None, placed: Placed, values: torch.Tensor, read_chunk: Chunk) -> None:
    """The target's part of ``values`` (which cover ``read_chunk``) into the target, in place:
    copied into a plain target (``adapter`` None), else quantized like it."""
    target = placed.local
    if adapter is None:
        with torch.no_grad():
            target.copy_(_target_part(placed, values, read_chunk))
        return
    part, global_amax = None, None
    if adapter.needs_global_amax(target):  # read_chunk is then the whole tensor (of a group's member: its own)
        global_amax = values.abs().amax()
        if placed.whole is None and read_chunk != placed.chunk:  # the whole quantized, the shard's part
            part = _shard_part(adapter, _whole_like(adapter, target, values.to(target.device), global_amax), placed)
    if part is None:  # (or a shard that is no part of a whole one: NF4 cut by columns, or of 40 scalers)
        hp = _target_part(placed, values, read_chunk).to(target.device)
        part = adapter.components(adapter.quantize_like(target, hp, global_amax=global_amax))
    adapter.copy_into(target, part)


def _whole_like(adapter: Adapter, target: torch.Tensor, values: torch.Tensor,
                global_amax: torch.Tensor) -> torch.Tensor | None:
    """The whole tensor's ``values`` quantized like ``target``; None where its library makes no such
    whole tensor (NF4 of a scaler count its scaler blocks do not divide): no shard of one either."""
    try:
        return adapter.quantize_like(target, values, global_amax=global_amax.to(values.device))
    except (AssertionError, ValueError) as e:
        if isinstance(e, QdcpError):
            raise
        return None


def _shard_part(adapter: Adapter, whole: torch.Tensor | None, placed: Placed) -> dict[str, torch.Tensor] | None:
    """The components of ``placed``'s shard of a ``whole`` tensor of its type, as torchao's slicing
    cuts them: element data and blocks narrowed, a value held once for the whole tensor repeated
    (:func:`qdcp.layouts.held_exactly`, the shard's own blocks counted from its first element);
    None where the shard's blocks are no part of the whole's (NF4 cut by columns)."""
    if whole is None:
        return None
    shape, full = placed.global_shape, full_chunk(placed.global_shape)
    own, layouts = adapter.layouts(placed.local), adapter.layouts(whole)
    out = {}
    for name, value in adapter.components(whole).items():
        held = held_exactly(value, layouts[name], shape, full, own[name], placed.chunk)
        try:
            out[name] = held if held is not None else narrow(value, layouts[name].map_chunk(shape, placed.chunk))
        except AlignmentError:
            return None
    return out


def _wider(target: torch.Tensor, logical: torch.dtype) -> torch.dtype | None:
    """A plain floating target wider than the stored entry's logical dtype gets its values computed
    in its own precision (never rounded through the logical dtype); None otherwise."""
    if target.dtype.is_floating_point and target.dtype.itemsize > logical.itemsize:
        return target.dtype
    return None
