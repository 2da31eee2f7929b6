"""DCP planners that save quantized tensors raw or dequantized and load them into any target.

:class:`QuantizedSavePlanner` and :class:`QuantizedLoadPlanner` subclass DCP's default planners and
behave exactly like them on plain tensors and non-tensor objects. Quantized entries (found through
the adapter registry, bare or as the local tensor of a DTensor) are planned here:

- save, raw: one DCP item per component, named ``<fqn>.__qdcp__.<component>``, its chunk mapped
  from the logical chunk by the component's layout; the entry's JSON spec goes into
  ``Metadata.planner_data["__qdcp__"]``.
- save, dequantized: one plain item under ``<fqn>`` (dequantized when the writer asks for it).
- load: every check that can be made from metadata is made in ``set_up_planner``, before any data
  is read. Same type and config: components are read straight into the target's buffers. Anything
  else: the covering chunk is read, dequantized and, for a quantized target, quantized like it;
  the target is updated in place (its objects are kept).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import math
import pickle
import re
import threading
from typing import Any, Callable, Union

import torch
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from qdcp import checksums as sums
from qdcp import spec as qspec
from qdcp.adapters.base import Adapter, RawConversion, StoredEntry, adapter_for_type, find_adapter, raw_conversion
from qdcp.errors import (
    AlignmentError,
    CheckpointFormatError,
    LoadMismatchError,
    StagingError,
    UnsupportedTensorError,
)
from qdcp.layouts import Chunk, Layout, full_chunk
from qdcp.new_empty import register_new_empty

DequantizeChoice = Union[bool, Callable[[str, torch.Tensor], bool]]

__all__ = ["QuantizedSavePlanner", "QuantizedLoadPlanner"]


# ----------------------------------------------------------------------------- shared helpers

@dataclasses.dataclass(frozen=True)
class _Placed:
    """A state-dict value seen as (local tensor, its chunk of the global tensor)."""

    local: torch.Tensor
    chunk: Chunk
    global_shape: tuple[int, ...]
    is_dtensor: bool
    whole: Chunk | None = None  # the target's whole logical tensor, where it is one member of a group

    def whole_chunk(self) -> Chunk:
        return self.whole if self.whole is not None else full_chunk(self.global_shape)


def _place(value: Any) -> _Placed | None:
    """Where ``value``'s data sits in its global tensor; None for non-tensors and off-mesh DTensors."""
    if isinstance(value, DTensor):
        if value.device_mesh.get_coordinate() is None:
            return None
        chunk = value.__create_chunk_list__()[0]
        return _Placed(value._local_tensor, (tuple(chunk.offsets), tuple(chunk.sizes)),
                       tuple(value.shape), True)
    if isinstance(value, torch.Tensor):
        return _Placed(value, full_chunk(value.shape), tuple(value.shape), False)
    return None


def _with_local(value: Any, local: torch.Tensor) -> torch.Tensor:
    """``local`` in ``value``'s place: bare, or as the local tensor of a DTensor like ``value``."""
    if not isinstance(value, DTensor):
        return local
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


@contextlib.contextmanager
def _planning():
    """Plan without routing every ``.shape``/``.dtype`` of a tensor subclass through its
    ``__torch_function__`` (planning reads metadata only), and without cyclic GC passes over the
    model's live objects every few hundred small allocations; both made planning 2-4x slower."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch._C.DisableTorchFunctionSubclass():
            yield
    finally:
        if gc_was_enabled:
            gc.enable()


def _is_empty(chunk: Chunk) -> bool:
    return math.prod(chunk[1]) == 0


def _relative(inner: Chunk, outer: Chunk) -> Chunk:
    return tuple(i - o for i, o in zip(inner[0], outer[0])), inner[1]


def _narrow(t: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    for dim, (o, s) in enumerate(zip(*chunk)):
        t = t.narrow(dim, o, s)
    return t


def _expand(layouts: dict[str, Layout], shape: tuple[int, ...], chunk: Chunk) -> Chunk:
    """Smallest chunk containing ``chunk`` that is aligned to every layout."""
    for _ in range(8):
        grown = chunk
        for layout in layouts.values():
            grown = layout.expand(shape, grown)
        if grown == chunk:
            return chunk
        chunk = grown
    raise AlignmentError(f"no aligned chunk covers {chunk} in a tensor of shape {shape}")


def _describe_tensor(t: torch.Tensor, adapter: Adapter, fqn: str) -> tuple[dict, dict[str, Layout]]:
    """JSON attrs and layouts of a live instance, with a clear error for unstorable attributes."""
    try:
        attrs = {k: qspec.encode_value(v) for k, v in adapter.attributes(t).items()}
    except TypeError as e:
        raise UnsupportedTensorError(
            f"key {fqn!r}: {adapter.type_name(t)} has an attribute qdcp cannot store ({e}); "
            f"save this entry dequantized (QuantizedSavePlanner(dequantize=...)).") from None
    return attrs, adapter.layouts(t)


# ----------------------------------------------------------------------------- save

@dataclasses.dataclass
class _SaveEntry:
    fqn: str
    spec: qspec.EntrySpec
    placed: _Placed
    adapter: Adapter
    items: list[WriteItem]
    shared: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (component, chunk offsets) other shards also hold


class QuantizedSavePlanner(DefaultSavePlanner):
    """A :class:`~torch.distributed.checkpoint.DefaultSavePlanner` that also saves quantized tensors.

    Args:
        dequantize: False (default) stores quantized entries raw; True stores them as plain tensors
            of their logical dtype; a callable ``(fqn, tensor) -> bool`` chooses per entry.
        dequantize_dtype: dtype of dequantized entries (default: each entry's logical dtype).
        checksums: hash every item written (XXH3-64 of the bytes being written, the staged copy in
            an async save) into the checkpoint's metadata; :class:`QuantizedLoadPlanner` verifies
            them (default True). Device tensors of a synchronous save are copied to the host at
            planning (the one copy the writer would make) and kept until written.
        **kwargs: passed to ``DefaultSavePlanner`` (``flatten_state_dict``, ``enable_plan_caching``...).
    """

    def __init__(self, dequantize: DequantizeChoice = False,
                 dequantize_dtype: torch.dtype | None = None, checksums: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        register_new_empty()  # before dcp.async_save's default stager sees classes imported since
        if not (isinstance(dequantize, bool) or callable(dequantize)):
            raise TypeError("dequantize must be a bool or a callable (fqn, tensor) -> bool")
        self.dequantize = dequantize
        self.dequantize_dtype = dequantize_dtype
        self.checksums = bool(checksums)
        self._entries: dict[str, _SaveEntry] = {}
        self._sources: dict[str, tuple[_SaveEntry, str | None]] = {}
        self._templates: dict[tuple, tuple] = {}
        self._ready: dict[MetadataIndex, torch.Tensor | bytes] = {}

    @property
    def records_checksums(self) -> bool:
        """Whether the checkpoint's metadata will hold a checksum of every item (storage writers
        need no checksums of their own then)."""
        return self.checksums

    # DCP calls this first, on every rank.
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, storage_meta=storage_meta, is_coordinator=is_coordinator)
        self._entries, self._sources, self._templates, self._ready = {}, {}, {}, {}
        with _planning():
            self._plan_entries()

    def _plan_entries(self) -> None:
        for fqn, value in list(self.state_dict.items()):
            placed = _place(value)
            if placed is None:
                continue
            adapter = find_adapter(placed.local)
            if adapter is None:
                _check_not_half_staged(fqn, placed.local)
                continue
            inner = adapter.unwrap(placed.local)
            if inner is not None:  # a wrapper around a high-precision tensor: DCP writes that tensor
                self.state_dict[fqn] = _with_local(value, inner)
                continue
            dequantize = self.dequantize(fqn, value) if callable(self.dequantize) else self.dequantize
            entry = self._plan_dequantized(fqn, placed, adapter) if dequantize \
                else self._plan_raw(fqn, placed, adapter)
            self._entries[fqn] = entry
            del self.state_dict[fqn]

    def _plan_raw(self, fqn: str, placed: _Placed, adapter: Adapter) -> _SaveEntry:
        t = placed.local
        comps = adapter.components(t)
        raw_attrs, raw_info = adapter.attributes(t), adapter.info(t)
        key = (type(t), placed.global_shape, placed.chunk, placed.is_dtensor, repr(raw_attrs), repr(raw_info),
               tuple((n, tuple(v.shape), v.dtype) for n, v in comps.items()))
        template = self._templates.get(key)
        if template is None:  # entries of one structure (all layers of a model) share the work
            template = self._templates[key] = self._raw_template(fqn, placed, adapter, comps)
        type_name, attrs, info, specs, writes, shared = template
        items = [WriteItem(index=MetadataIndex(qspec.component_fqn(fqn, name), data.chunk.offsets),
                           type=item_type, tensor_data=data) for name, item_type, data in writes]
        entry_spec = qspec.EntrySpec(fqn, qspec.RAW, type_name, placed.global_shape, t.dtype, attrs,
                                     specs, None, info)
        entry = _SaveEntry(fqn, entry_spec, placed, adapter, items, shared if placed.is_dtensor else ())
        for item, (name, _, _) in zip(items, writes):
            self._sources[item.index.fqn] = (entry, name)
        return entry

    def _raw_template(self, fqn: str, placed: _Placed, adapter: Adapter, comps: dict) -> tuple:
        """What a raw entry of this structure stores: type, JSON attrs and info, component specs,
        and the (component, item type, TensorWriteData) of each item this rank writes."""
        t = placed.local
        attrs, layouts = _describe_tensor(t, adapter, fqn)
        if set(comps) != set(layouts):
            raise UnsupportedTensorError(f"key {fqn!r}: adapter gave components {sorted(comps)} "
                                         f"but layouts for {sorted(layouts)}")
        specs, writes, shared = [], [], []
        for name, value in comps.items():
            layout = layouts[name]
            try:
                global_shape = layout.component_shape(placed.global_shape)
                chunk = layout.map_chunk(placed.global_shape, placed.chunk) \
                    if not _is_empty(placed.chunk) else None
            except AlignmentError as e:
                raise AlignmentError(
                    f"key {fqn!r}: component {name!r}: this rank's shard {placed.chunk} {e}. Shard on "
                    f"block boundaries, or save this entry dequantized.") from None
            if chunk is not None and tuple(value.shape) != chunk[1]:
                raise AlignmentError(
                    f"key {fqn!r}: component {name!r} has local shape {tuple(value.shape)} but the "
                    f"shard {placed.chunk} of {placed.global_shape} needs {chunk[1]}; the shard does "
                    f"not own whole blocks. Save this entry dequantized.")
            specs.append(qspec.ComponentSpec(name, tuple(global_shape), value.dtype, layout.to_json()))
            if chunk is not None:
                item = _write_item(name, chunk, global_shape, value.dtype, placed.is_dtensor)
                writes.append((name, item.type, item.tensor_data))
                if layout.shared(placed.global_shape, placed.chunk):
                    shared.append((name, chunk[0]))
        return (adapter.type_name(t), attrs, _info(adapter, t), tuple(specs), tuple(writes),
                tuple(shared))

    def _plan_dequantized(self, fqn: str, placed: _Placed, adapter: Adapter) -> _SaveEntry:
        t = placed.local
        attrs, _ = _describe_tensor(t, adapter, fqn)
        dtype = self.dequantize_dtype or t.dtype
        entry_spec = qspec.EntrySpec(fqn, qspec.DEQUANTIZED, adapter.type_name(t), placed.global_shape,
                                     t.dtype, attrs, (), dtype, _info(adapter, t))
        items = [] if _is_empty(placed.chunk) else [
            _write_item(fqn, placed.chunk, placed.global_shape, dtype, placed.is_dtensor)]
        entry = _SaveEntry(fqn, entry_spec, placed, adapter, items)
        if items:
            self._sources[fqn] = (entry, None)
        return entry

    def create_local_plan(self) -> SavePlan:
        plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        items = list(plan.items)
        planner_data: dict[str, Any] = dict(self.mappings) if self.flatten_state_dict else {}
        for entry in self._entries.values():
            items.extend(entry.items)
            for item in entry.items:
                planner_data.setdefault(item.index.fqn, (item.index.fqn,))
        planner_data[qspec.PLANNER_DATA_KEY] = qspec.dumps({f: e.spec for f, e in self._entries.items()})
        self.plan = SavePlan(items, planner_data=planner_data)
        # per-save data, sent beside the plan (never part of what plan caching compares)
        shared = [(qspec.component_fqn(e.fqn, name), offsets) for e in self._entries.values()
                  for name, offsets in e.shared]
        shared_keys = set(shared)
        hashed = items if self.checksums else [i for i in items if _item_key(i) in shared_keys]
        mine = {"hashes": sums.hash_many((_item_key(i), self._written(i)) for i in hashed), "shared": shared}
        if self._enable_plan_caching:
            cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
            if cached is not None and cached.items == self.plan.items \
                    and cached.planner_data == self.plan.planner_data:
                return SavePlan([], planner_data={_SUMS_KEY: mine}, usable=False)
            self._pending_local_plan = self.plan
        return dataclasses.replace(self.plan, planner_data={**planner_data, _SUMS_KEY: mine})

    def _written(self, item: WriteItem) -> torch.Tensor | bytes:
        """Exactly what :meth:`resolve_data` will give the writer for ``item``, to hash. Objects
        are serialized once (kept for the writer); device data is copied to the host once (the
        copy the writer would make), kept for the writer."""
        data = self._item_data(item)
        if isinstance(data, io.BytesIO):
            data = self._ready[item.index] = data.getvalue()
        elif data.device.type != "cpu":
            data = self._ready[item.index] = data.detach().cpu()
        return data

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # take the per-save hashes out of the plans (in place: DCP's plan caching keeps the plans
        # it is given and compares later ones with them)
        per_rank = [(plan.planner_data or {}).pop(_SUMS_KEY, None) or {"hashes": {}, "shared": []}
                    for plan in all_plans]
        _check_shared(per_rank)
        plans, metadata = super().create_global_plan(all_plans)
        self._sums_record = _checksum_record(self.global_plan, per_rank, metadata) if self.checksums else None
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        # On the coordinator: the checksums join the Metadata that finish() writes. Added here, not
        # in create_global_plan, which returns (and plan caching keeps) what DCP's would.
        record = getattr(self, "_sums_record", None)
        if record is not None and getattr(self, "metadata", None) is not None:
            self.metadata.planner_data[sums.PLANNER_DATA_KEY] = record
        return super().finish_plan(new_plan)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        texts, stripped = [], []
        for plan in all_plans:
            data = dict(plan.planner_data or {})
            texts.append(data.pop(qspec.PLANNER_DATA_KEY, None) or qspec.dumps({}))
            stripped.append(dataclasses.replace(plan, planner_data=data))
        plans, metadata = super()._create_global_plan(stripped)
        planner_data = dict(metadata.planner_data or {})
        planner_data[qspec.PLANNER_DATA_KEY] = texts[0] if len(set(texts)) == 1 else _merge_specs(texts)
        return plans, dataclasses.replace(metadata, planner_data=planner_data)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        ready = self._ready.get(write_item.index)
        if ready is not None:
            return io.BytesIO(ready) if isinstance(ready, bytes) else ready
        return self._item_data(write_item)

    def _item_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        source = self._sources.get(write_item.index.fqn)
        if source is None:
            return super().resolve_data(write_item)
        entry, component = source
        t = entry.placed.local
        if component is None:
            return entry.adapter.dequantize(t, entry.spec.stored_dtype)
        return entry.adapter.components(t)[component]


_SUMS_KEY = "__qdcp_sums__"  # per-rank item hashes and shared component items; never saved as such


def _item_key(item: WriteItem) -> tuple[str, tuple[int, ...]]:
    return item.index.fqn, tuple(item.index.offset or ())


def _check_shared(per_rank: list[dict]) -> None:
    """Items of a component that several ranks' shards hold (replicated, or constant along a dim
    the shards cut) must be equal: DCP keeps one rank's copy. Refuse them when they differ."""
    first: dict[tuple, tuple[int, int]] = {}
    for rank, part in enumerate(per_rank):
        hashes = part["hashes"]
        for key in part["shared"]:
            seen = first.setdefault(key, (rank, hashes[key]))
            if seen[1] != hashes[key]:
                fqn, name = key[0].rsplit(qspec.COMPONENT_SEPARATOR, 1)
                raise AlignmentError(
                    f"key {fqn!r}: component {name!r} holds values shared by the shards of ranks "
                    f"{seen[0]} and {rank} (one for the whole tensor, or for a block both shards "
                    f"cut), but they differ: the shards were quantized each on its own (e.g. with "
                    f"its own per-tensor scale). Quantize the shards with one scale for the whole "
                    f"tensor, or save this entry dequantized.")


def _checksum_record(global_plan: list[SavePlan], per_rank: list[dict], metadata: Metadata) -> dict:
    """The metadata's checksum record: for each item, the hash of the copy the rank that writes
    it computed (DCP writes one rank's copy of a replicated item), in the metadata's chunk order."""
    written = {}
    for rank, plan in enumerate(global_plan):
        hashes = per_rank[rank]["hashes"]
        for item in plan.items:
            key = _item_key(item)
            written[key] = hashes.get(key)
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        offsets = [tuple(c.offsets) for c in md.chunks] if isinstance(md, TensorStorageMetadata) else [()]
        out[fqn] = [written.get((fqn, o)) for o in offsets]
    return sums.encode(out)


def _merge_specs(texts: list[str]) -> str:
    """One spec document from every rank's (ranks with different entries, e.g. pipeline stages)."""
    merged: dict[str, qspec.EntrySpec] = {}
    for text in texts:
        for fqn, entry in qspec.loads(text).items():
            other = merged.setdefault(fqn, entry)
            if other != entry:
                raise LoadMismatchError(
                    f"key {fqn!r}: ranks disagree on how it is stored ({other.to_json()} vs "
                    f"{entry.to_json()}); every rank must hold the same type, config and mode.")
    return qspec.dumps(merged)


def _info(adapter: Adapter, t: torch.Tensor) -> dict:
    """The adapter's descriptive facts, JSON-encoded (dropped, not fatal, if they cannot be)."""
    try:
        return {k: qspec.encode_value(v) for k, v in adapter.info(t).items()}
    except TypeError:
        return {}


def _write_item(fqn: str, chunk: Chunk, global_shape, dtype: torch.dtype, sharded: bool) -> WriteItem:
    offsets, sizes = chunk
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=WriteItemType.SHARD if sharded else WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(global_shape)))


def _check_not_half_staged(fqn: str, t: torch.Tensor) -> None:
    """Refuse a plain tensor that a stager built from a quantized one without its data. (Tensor
    subclasses qdcp has no adapter for -- ShardedTensor, DCP's checkpointable protocol, anything
    else -- go through DCP's default path untouched, as with DCP's own planner.)"""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return
    inner = getattr(t, "__dict__", {})
    if any(isinstance(v, torch.Tensor) for v in inner.values()):
        raise StagingError(
            f"key {fqn!r}: a plain tensor carries tensor attributes "
            f"({', '.join(k for k, v in inner.items() if isinstance(v, torch.Tensor))}): it was staged "
            f"from a quantized tensor by a stager that does not copy its inner buffers, and its "
            f"storage holds no data. Pass async_stager=qdcp.QuantizedStager() to dcp.async_save.")


# ----------------------------------------------------------------------------- load

@dataclasses.dataclass
class _LoadEntry:
    fqn: str
    placed: _Placed
    adapter: Adapter | None            # the target's adapter (None for a plain target)
    source: qspec.EntrySpec | None     # None: the checkpoint holds a plain tensor under fqn
    mode: str                          # "direct" | "convert" | "quantize" | "raw_copy"
    read_chunk: Chunk                  # logical chunk read from the checkpoint
    buffers: dict[str, torch.Tensor]   # item fqn -> destination (target buffer or temporary)
    temps: dict[str, str]              # item fqn -> component name, for temporaries
    needs: dict[str, tuple[TensorStorageMetadata, Chunk]]  # item fqn -> (checkpoint md, chunk)
    source_attrs: dict[str, Any] | None = None  # decoded attributes of a raw checkpoint entry
    pending: int = 0
    raw_copy: RawConversion | None = None    # mode "raw_copy": how the read components fill the target
    storage: dict[str, str] = dataclasses.field(default_factory=dict)  # item fqn -> checkpoint item, if other
    group: _MembersLoad | None = None   # a member of a group target loaded by member


@dataclasses.dataclass
class _MembersLoad:
    """A group target filled member by member: ``adapter.members_loaded(target)`` once all are in."""

    adapter: Adapter
    target: torch.Tensor
    pending: int = 0


class QuantizedLoadPlanner(DefaultLoadPlanner):
    """A :class:`~torch.distributed.checkpoint.DefaultLoadPlanner` that fills whatever the target holds.

    Quantized or plain targets, from raw, dequantized or plain checkpoint entries, at any sharding.
    Targets are updated in place. ``weights_only`` (default True) loads non-tensor objects with
    ``torch.load(weights_only=True)``, so a checkpoint cannot run code; pass False only for
    checkpoints you trust that hold arbitrary pickled objects. ``checksums`` (default True):
    every item read whole is checked against the checksum the save recorded (raising
    :class:`~qdcp.ChecksumError`); items read in part, when resharding, are checked by
    :class:`~qdcp.CheckpointReader`.
    """

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False, weights_only: bool = True, checksums: bool = True) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict,
                         flatten_sharded_tensors=flatten_sharded_tensors,
                         allow_partial_load=allow_partial_load)
        self.weights_only = weights_only
        self.checksums = bool(checksums)
        self._entries: dict[str, _LoadEntry] = {}
        self._dest: dict[str, _LoadEntry] = {}
        self._lock = threading.Lock()
        self._verify = sums.ReadVerifier(None)

    @property
    def verifies_whole_items(self) -> bool:
        """Whether this planner checks every item it reads whole against the checkpoint's checksums
        (a storage reader then needs to check only the items read in part)."""
        return self._verify.record is not None

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._verify = sums.ReadVerifier(sums.record(metadata) if self.checksums else None)
        self._specs = qspec.read_specs(metadata)
        self._entries, self._dest, self._handled = {}, {}, set()
        self._structures: dict[tuple, tuple] = {}  # structure -> (decoded attrs, layouts)
        self._configs: dict[tuple, bool] = {}  # (structure, target structure) -> same config?
        self._stored_components = qspec.stored_components(metadata.state_dict_metadata)
        with _planning():
            self._plan_entries(metadata)

    def _plan_entries(self, metadata: Metadata) -> None:
        specs = self._specs
        md = metadata.state_dict_metadata
        for fqn, target in list(self.state_dict.items()):
            source = specs.get(fqn)
            placed = _place(target)
            adapter = find_adapter(placed.local) if placed is not None else None
            inner = adapter.unwrap(placed.local) if adapter is not None else None
            if inner is not None:  # a wrapper around a high-precision tensor: load into that, in place
                target = self.state_dict[fqn] = _with_local(target, inner)
                placed, adapter = _place(target), None
            if source is None and fqn not in md and placed is not None \
                    and self._plan_group_members(fqn, placed, adapter, specs, metadata):
                continue
            if source is not None and source.storage == qspec.DEQUANTIZED:
                source = None  # stored as a plain tensor under fqn
            if source is None and adapter is None:
                continue  # plain target, plain entry (or not a tensor): DCP's default path
            if placed is None:
                raise LoadMismatchError(
                    f"key {fqn!r}: the checkpoint stores a quantized tensor but the target holds "
                    f"{type(target).__name__}; give a tensor (plain or quantized) as the target.")
            del self.state_dict[fqn]
            self._handled.add(fqn)
            entry = self._plan_entry(fqn, placed, adapter, source, metadata)
            if entry is not None:
                self._entries[fqn] = entry
                for item_fqn in entry.needs:
                    self._dest[item_fqn] = entry

    def _plan_group_members(self, fqn, placed, adapter, specs, metadata) -> bool:
        """Keys the checkpoint lacks, mapped through a group's members (TE GroupedLinear's
        ``weight`` <-> ``weight0..weight{n-1}``, MoE experts by index). True if planned."""
        return self._plan_member_of_group(fqn, placed, adapter, specs, metadata) \
            or self._plan_group_by_member(fqn, placed, adapter, specs, metadata)

    def _plan_member_of_group(self, fqn, placed, adapter, specs, metadata) -> bool:
        """A target ``<key><i>`` (plain, quantized, or a DTensor of either) is member ``i`` of a
        group stored under ``<key>`` (raw, or dequantized: a plain tensor of the group's logical
        shape): the logical chunk the group's adapter names for it."""
        m = re.fullmatch(r"(.*\D)(\d+)", fqn)
        group = specs.get(m.group(1)) if m else None
        if group is None:
            return False
        g_adapter = adapter_for_type(group.type, m.group(1))
        attrs, _ = self._decoded(group, g_adapter, fqn)
        chunk = g_adapter.member_chunk(attrs, group.shape, int(m.group(2)))
        if chunk is None:
            return False
        if chunk[1][0] != 1 or tuple(chunk[1][1:]) != placed.global_shape:
            raise LoadMismatchError(f"key {fqn!r}: member {m.group(2)} of {m.group(1)!r} has shape "
                                    f"{tuple(chunk[1][1:])}, the target {placed.global_shape}")
        within = (chunk[0][0], *(c + o for c, o in zip(chunk[0][1:], placed.chunk[0])))
        member = _Placed(placed.local, (within, (1, *placed.chunk[1])), group.shape, placed.is_dtensor,
                         whole=chunk)
        del self.state_dict[fqn]
        self._handled.add(fqn)
        source = group if group.storage == qspec.RAW else None
        self._add(self._plan_entry(fqn, member, adapter, source, metadata, src_fqn=m.group(1)))
        return True

    def _plan_group_by_member(self, fqn, placed, adapter, specs, metadata) -> bool:
        """A group target ``<key>`` (a group type, or a plain ``[n, ...]`` stack; a DTensor of either
        sharded on dim 0 only: expert parallelism) whose members are stored as ``<key><i>``: local
        member ``j`` is global member ``i = offset + j``, loaded into the target in place."""
        md = metadata.state_dict_metadata
        if fqn[-1:].isdigit():
            return False  # "<key>1" + "0" would read as "<key>10"
        members = adapter.members(placed.local) if adapter is not None else None
        if adapter is None and placed.local.ndim >= 2:
            members = list(placed.local.unbind(0))
        first = placed.chunk[0][0] if placed.chunk[0] else 0
        if members is None or (f"{fqn}{first}" not in md and f"{fqn}{first}" not in specs):
            return False
        if placed.is_dtensor and (any(placed.chunk[0][1:]) or placed.chunk[1][1:] != placed.global_shape[1:]
                                  or len(members) != placed.chunk[1][0]):
            raise LoadMismatchError(
                f"key {fqn!r}: the checkpoint stores this group by member ({fqn}0, {fqn}1, ...); a "
                f"sharded target must split whole members (Shard(0) of a stacked [n, ...] tensor), "
                f"but this rank holds the chunk {placed.chunk} of {placed.global_shape}")
        del self.state_dict[fqn]
        self._handled.add(fqn)
        group = _MembersLoad(adapter, placed.local) if adapter is not None else None
        for j, member in enumerate(members):
            key = f"{fqn}{first + j}"
            source = specs.get(key)
            if source is not None and source.storage == qspec.DEQUANTIZED:
                source = None
            m_adapter = find_adapter(member)
            if source is None and m_adapter is None:
                self.state_dict[key] = member  # plain member view <- plain entry: DCP's own path
                continue
            self._handled.add(key)
            entry = self._plan_entry(key, _place(member), m_adapter, source, metadata)
            if entry is not None and group is not None:
                entry.group = group
                group.pending += 1
            self._add(entry)
        return True

    def _add(self, entry: _LoadEntry | None) -> None:
        if entry is not None:
            self._entries[entry.fqn] = entry
            for item_fqn in entry.needs:
                self._dest[item_fqn] = entry

    def _plan_entry(self, fqn, placed, adapter, source, metadata, src_fqn=None) -> _LoadEntry | None:
        md = metadata.state_dict_metadata
        src_fqn = src_fqn or fqn
        if source is None:  # plain checkpoint entry -> quantized target (or a member of a group)
            plain_md = md.get(src_fqn)
            if plain_md is None:
                if self.allow_partial_load:
                    return None
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            if not isinstance(plain_md, TensorStorageMetadata):
                raise LoadMismatchError(f"key {fqn!r}: the checkpoint holds a non-tensor object here")
            if tuple(plain_md.size) != placed.global_shape:
                raise LoadMismatchError(
                    f"key {fqn!r}: checkpoint shape {tuple(plain_md.size)} != target shape "
                    f"{placed.global_shape}")
            _check_can_quantize(fqn, adapter, placed.local, "a plain tensor")
            read_chunk = _amax_chunk(adapter, placed) or placed.chunk
            temp = torch.empty(read_chunk[1], dtype=plain_md.properties.dtype)
            entry = _LoadEntry(fqn, placed, adapter, None, "quantize", read_chunk, {fqn: temp}, {},
                               {fqn: (plain_md, read_chunk)})
            if src_fqn != fqn:
                entry.storage[fqn] = src_fqn
            return entry

        if source.shape != placed.global_shape:
            raise LoadMismatchError(
                f"key {fqn!r}: checkpoint shape {source.shape} != target shape {placed.global_shape}")
        src_items = {c.name: qspec.component_fqn(src_fqn, c.name) for c in source.components}
        source_adapter = adapter_for_type(source.type, fqn)
        structure = _structure_key(source)
        source_attrs, layouts = self._decoded(source, source_adapter, fqn)
        qspec.check_items(source, md, self._stored_components.get(src_fqn, set()), key=fqn)
        if _is_empty(placed.chunk):
            return None

        if adapter is not None and self._same_config(adapter, placed.local, source, structure, fqn):
            return _with_storage(self._plan_direct(fqn, placed, adapter, source, layouts, md, src_items),
                                 fqn, src_items)
        if adapter is not None:
            entry = _plan_raw_copy(fqn, placed, adapter, source, source_adapter, source_attrs, layouts, md,
                                   src_items)
            if entry is not None:
                return _with_storage(entry, fqn, src_items)
        _check_can_quantize(fqn, adapter, placed.local, f"a {source.type} entry")
        read_chunk = _amax_chunk(adapter, placed) or _expand(layouts, source.shape, placed.chunk)
        buffers, temps, needs = {}, {}, {}
        for c in source.components:
            item = qspec.component_fqn(fqn, c.name)
            try:
                chunk = layouts[c.name].map_chunk(source.shape, read_chunk)
            except AlignmentError as e:
                raise AlignmentError(f"key {fqn!r}: component {c.name!r}: {e}") from None
            buffers[item] = torch.empty(chunk[1], dtype=c.dtype)
            temps[item] = c.name
            needs[item] = (md[src_items[c.name]], chunk)
        return _with_storage(_LoadEntry(fqn, placed, adapter, source, "convert", read_chunk, buffers, temps,
                                        needs, source_attrs), fqn, src_items)

    def _decoded(self, source: qspec.EntrySpec, source_adapter: Adapter, fqn: str) -> tuple:
        """A stored entry's decoded attributes and layouts, checked once per structure."""
        structure = _structure_key(source)
        known = self._structures.get(structure)
        if known is None:
            attrs = {k: qspec.decode_value(v, source_adapter.attribute_classes(), f"key {fqn!r}: ")
                     for k, v in source.attrs.items()}
            layouts = qspec.layouts_of(source)
            qspec.check_component_bytes(source)
            known = self._structures[structure] = (attrs, layouts)
        return known

    def _same_config(self, adapter, t, source, structure, fqn) -> bool:
        key = (structure, type(t), repr(adapter.attributes(t)),
               tuple((n, tuple(v.shape), v.dtype) for n, v in adapter.components(t).items()))
        same = self._configs.get(key)
        if same is None:
            same = self._configs[key] = _same_config(adapter, t, source, fqn)
        return same

    def _plan_direct(self, fqn, placed, adapter, source, layouts, md, src_items) -> _LoadEntry:
        native = adapter.native_components(placed.local)
        buffers, temps, needs = {}, {}, {}
        for c in source.components:
            item = qspec.component_fqn(fqn, c.name)
            try:
                chunk = layouts[c.name].map_chunk(source.shape, placed.chunk)
            except AlignmentError as e:
                raise AlignmentError(f"key {fqn!r}: component {c.name!r}: the target shard "
                                     f"{placed.chunk} {e}") from None
            dest = native.get(c.name)
            if dest is not None and dest.is_contiguous() and tuple(dest.shape) == chunk[1]:
                buffers[item] = dest
            else:
                buffers[item] = torch.empty(chunk[1], dtype=c.dtype)
                temps[item] = c.name
            needs[item] = (md[src_items[c.name]], chunk)
        return _LoadEntry(fqn, placed, adapter, source, "direct", placed.chunk, buffers, temps, needs)

    def create_local_plan(self) -> LoadPlan:
        with _planning():
            return self._create_local_plan()

    def _create_local_plan(self) -> LoadPlan:
        if self.flatten_state_dict:
            self._detect_pre_2_4_keys()
        plan = create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        items = list(plan.items)
        for entry in self._entries.values():
            for item_fqn, (item_md, chunk) in entry.needs.items():
                stored = entry.storage.get(item_fqn, item_fqn)
                reads = _read_items(stored, item_md, chunk)
                if stored != item_fqn:  # another key's item: this entry's own destination name
                    reads = [dataclasses.replace(r, dest_index=MetadataIndex(item_fqn, r.dest_index.offset,
                                                                             r.dest_index.index))
                             for r in reads]
                covered = sum(math.prod(r.lengths) for r in reads)
                if covered != math.prod(chunk[1]):
                    raise CheckpointFormatError(
                        f"key {entry.fqn!r}: the checkpoint's chunks of {item_fqn!r} cover {covered} of "
                        f"the {math.prod(chunk[1])} elements this rank needs (holes or overlaps).")
                items.extend(reads)
        return dataclasses.replace(plan, items=items)

    def _detect_pre_2_4_keys(self) -> None:
        """DCP's fallback for checkpoints saved before torch 2.4 (other flattened key names), as in
        ``DefaultLoadPlanner.create_local_plan``, with the keys qdcp plans counted as present."""
        owned = {qspec.component_fqn(f, c.name) for f, e in self._specs.items() for c in e.components}
        missing = set(self.metadata.state_dict_metadata) - set(self.state_dict) - self._handled - owned
        if not missing:
            return
        _version._derived_version = "2_3"
        try:
            old_state_dict, old_mappings = flatten_state_dict(self.original_state_dict)
        finally:
            _version._derived_version = None
        if set(old_state_dict) & missing:
            self.state_dict = {k: v for k, v in old_state_dict.items() if k not in self._handled}
            self.mappings = old_mappings

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        for entry in self._entries.values():
            entry.pending = 0
        for item in new_plan.items:
            entry = self._dest.get(item.dest_index.fqn)
            if entry is not None:
                entry.pending += 1
        self._verify.plan(new_plan.items)
        return super().finish_plan(new_plan)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self._destination(read_item)
        return self._verify.buffer(read_item, dest)

    def _destination(self, read_item: ReadItem) -> torch.Tensor:
        entry = self._dest.get(read_item.dest_index.fqn)
        if entry is None:
            return super().resolve_tensor(read_item)
        buf = entry.buffers[read_item.dest_index.fqn]
        return _narrow(buf, (tuple(read_item.dest_offsets), tuple(read_item.lengths)))

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        entry = self._dest.get(read_item.dest_index.fqn)
        key = entry.fqn if entry is not None else read_item.dest_index.fqn
        if self._verify.check(read_item, tensor, key):
            self._destination(read_item).copy_(tensor)  # it was read into a host buffer to check it
            tensor = self._destination(read_item)
        if entry is None:
            return super().commit_tensor(read_item, tensor)
        with self._lock:
            entry.pending -= 1
            done = entry.pending == 0
        if done:
            _finalize(entry)
            group = entry.group
            if group is not None:
                with self._lock:
                    group.pending -= 1
                    last = group.pending == 0
                if last:
                    group.adapter.members_loaded(group.target)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self._verify.check_bytes(read_item, value.getbuffer(), read_item.dest_index.fqn)
        try:
            with torch.serialization.safe_globals(list(_SAFE_OBJECT_TYPES)):
                obj = torch.load(value, weights_only=self.weights_only)
        except pickle.UnpicklingError as e:
            refused = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
            raise LoadMismatchError(
                f"key {read_item.dest_index.fqn!r}: the checkpoint stores a pickled object that refers to "
                f"{refused.group(1) if refused else 'a global'}, which loading with weights_only=True "
                f"refuses (a pickle can run code). If you trust this checkpoint, pass "
                f"QuantizedLoadPlanner(weights_only=False), or allow that type with "
                f"torch.serialization.add_safe_globals.") from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# Objects whose unpickling runs no code, allowed beside torch's weights-only types: what trainers
# checkpoint as non-tensor state (torchtitan's TrainState keeps its losses in a BytesIO).
_SAFE_OBJECT_TYPES = (io.BytesIO, argparse.Namespace)


def _plan_raw_copy(fqn, placed, adapter, source, source_adapter, source_attrs, layouts, md, src_items):
    """A raw entry of another type that holds the target's bits: read the components that carry
    them (:func:`qdcp.adapters.base.raw_conversion`), for exactly the target's chunk. None when
    there is no such path, or the target's chunk is not aligned to those components' layouts."""
    how = raw_conversion(adapter, placed.local, source_adapter, source.type, source_attrs)
    if how is None:
        return None
    return _raw_copy_entry(fqn, placed, adapter, source, source_attrs, layouts, md, src_items, how)


def _raw_copy_entry(fqn, placed, adapter, source, source_attrs, layouts, md, src_items, how):
    buffers, temps, needs = {}, {}, {}
    try:
        for name in how.names:
            c = source.component(name)
            item = qspec.component_fqn(fqn, name)
            chunk = layouts[name].map_chunk(source.shape, placed.chunk)
            buffers[item] = torch.empty(chunk[1], dtype=c.dtype)
            temps[item] = name
            needs[item] = (md[src_items[name]], chunk)
    except (AlignmentError, KeyError):
        return None
    return _LoadEntry(fqn, placed, adapter, source, "raw_copy", placed.chunk, buffers, temps, needs,
                      source_attrs, raw_copy=how)


def _with_storage(entry: _LoadEntry, fqn: str, src_items: dict[str, str]) -> _LoadEntry:
    """Record which checkpoint item each destination item reads, where it is another key's."""
    for name, stored in src_items.items():
        item = qspec.component_fqn(fqn, name)
        if item != stored:
            entry.storage[item] = stored
    return entry


def _structure_key(entry: qspec.EntrySpec) -> tuple:
    """A hashable summary of everything in an entry's spec but its key (entries of one model's
    layers share it, and so the planning work done for it)."""
    if entry.structure:  # parsed from JSON: its text already is that summary
        return (entry.structure,)
    return (entry.storage, entry.type, entry.shape, entry.dtype, repr(entry.attrs),
            tuple((c.name, c.shape, c.dtype, repr(c.layout)) for c in entry.components))


def _read_items(fqn: str, item_md: TensorStorageMetadata, chunk: Chunk) -> list[ReadItem]:
    """DCP's reads of ``chunk`` of item ``fqn``; the common case -- one saved chunk that is exactly
    the one needed -- without DCP's general overlap sweep."""
    saved = item_md.chunks
    if len(saved) == 1 and tuple(saved[0].offsets) == chunk[0] and tuple(saved[0].sizes) == chunk[1]:
        offsets = torch.Size(chunk[0])
        zeros = torch.Size([0] * len(chunk[0]))
        return [ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, offsets, 0),
                         dest_offsets=zeros, storage_index=MetadataIndex(fqn, offsets, 0),
                         storage_offsets=zeros, lengths=torch.Size(chunk[1]))]
    return create_read_items_for_chunk_list(
        fqn, item_md, [ChunkStorageMetadata(torch.Size(chunk[0]), torch.Size(chunk[1]))])


def _same_config(adapter: Adapter, t: torch.Tensor, source: qspec.EntrySpec, fqn: str) -> bool:
    """Whether a target instance has the checkpoint entry's exact type, config and components."""
    if adapter.type_name(t) != source.type:
        return False
    attrs, layouts = _describe_tensor(t, adapter, fqn)
    if attrs != source.attrs or set(layouts) != {c.name for c in source.components}:
        return False
    comps = adapter.components(t)
    for c in source.components:
        if layouts[c.name].to_json() != c.layout or comps[c.name].dtype != c.dtype:
            return False
    return True


def _check_can_quantize(fqn: str, adapter: Adapter | None, target: torch.Tensor, stored: str) -> None:
    """Refuse, at planning, a load that must quantize into a target whose adapter cannot here."""
    why = adapter.quantize_unsupported(target) if adapter is not None else None
    if why:
        raise UnsupportedTensorError(
            f"key {fqn!r}: the checkpoint holds {stored} whose bits this {adapter.type_name(target)} "
            f"target cannot take as they are (another format or config, or a shard that cuts its "
            f"blocks), so it would have to be quantized: {why}")


def _amax_chunk(adapter: Adapter | None, placed: _Placed) -> Chunk | None:
    """The whole tensor, for a shard of a target whose per-tensor scale needs the global amax:
    every rank reads it all and computes the same amax, with no collective."""
    if adapter is None or not adapter.needs_global_amax(placed.local):
        return None
    whole = placed.whole_chunk()
    return whole if placed.chunk != whole else None


def _wider(target: torch.Tensor, logical: torch.dtype) -> torch.dtype | None:
    """A plain floating target wider than the stored entry's logical dtype gets its values computed
    in its own precision (never rounded through the logical dtype); None otherwise."""
    if find_adapter(target) is None and target.dtype.is_floating_point and target.dtype.itemsize > logical.itemsize:
        return target.dtype
    return None


def _finalize(entry: _LoadEntry) -> None:
    """Turn what was read for one entry into the target's values, in place."""
    target = entry.placed.local
    if entry.mode == "direct":
        if entry.temps:
            entry.adapter.copy_into(target, {c: entry.buffers[i] for i, c in entry.temps.items()})
        return
    if entry.mode == "raw_copy":
        comps = {c: entry.buffers[i] for i, c in entry.temps.items()}
        entry.raw_copy.fill(target, comps)
        return
    if entry.mode == "quantize":
        read = next(iter(entry.buffers.values()))
    else:
        source = entry.source
        stored = StoredEntry(source.type, entry.source_attrs, entry.read_chunk[1], source.dtype,
                             {c: entry.buffers[i] for i, c in entry.temps.items()})
        read = adapter_for_type(source.type, entry.fqn).dequantize_stored(stored, _wider(target, source.dtype))
    hp = _narrow(read, _relative(entry.placed.chunk, entry.read_chunk))
    if tuple(hp.shape) != tuple(target.shape):  # one member of a group: [1, M, N] -> [M, N]
        hp = hp.reshape(target.shape)
    if entry.adapter is None:
        with torch.no_grad():
            target.copy_(hp)
        return
    global_amax = None
    if entry.adapter.needs_global_amax(target):  # read_chunk is the whole tensor (_amax_chunk)
        global_amax = read.abs().amax()
    new = entry.adapter.quantize_like(target, hp.to(target.device), global_amax=global_amax)
    entry.adapter.copy_into(target, entry.adapter.components(new))


