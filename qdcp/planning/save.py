"""The save planner: quantized entries raw (one DCP item per component plus a JSON spec) or dequantized.

:class:`QuantizedSavePlanner` subclasses DCP's default save planner and behaves exactly like it on
plain tensors and non-tensor objects. Quantized entries (found through the adapter registry, bare or
as the local tensor of a DTensor) are planned here:

- raw: one DCP item per component, named ``<fqn>.__qdcp__.<component>``, its chunk mapped from the
  logical chunk by the component's layout; the entry's JSON spec goes into
  ``Metadata.planner_data["__qdcp__"]``.
- dequantized: one plain item under ``<fqn>`` (dequantized when the writer asks for it).
- wrappers around a high-precision tensor (``Adapter.unwrap``): that plain tensor under the same key.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, Callable, Union

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType

from qdcp import checksums as sums
from qdcp import spec as qspec
from qdcp.adapters.base import Adapter, describe_tensor, find_adapter
from qdcp.errors import AlignmentError, LoadMismatchError, ReplicaMismatchError, StagingError, UnsupportedTensorError
from qdcp.layouts import Chunk, Flat, Layout, grid_view, nearest_aligned
from qdcp.planning.placement import Placed, is_empty, place, planning, shard_layouts, sharded_inside, with_local
from qdcp.staging.new_empty import register_new_empty
from qdcp.storage import refuse_existing_checkpoint

DequantizeChoice = Union[bool, Callable[[str, torch.Tensor], bool]]

__all__ = ["QuantizedSavePlanner", "DequantizeChoice"]


@dataclasses.dataclass
class _SaveEntry:
    fqn: str
    spec: qspec.EntrySpec
    placed: Placed
    adapter: Adapter
    items: list[WriteItem]
    shared: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (component, chunk offsets) other shards also hold


@dataclasses.dataclass(frozen=True)
class _RawTemplate:
    """What every raw entry of one structure (type, shard, attributes, component shapes) stores;
    made once and shared by all such entries (all layers of a model)."""
    type_name: str
    attrs: dict
    info: Any
    specs: tuple[qspec.ComponentSpec, ...]
    writes: tuple[tuple[str, WriteItemType, TensorWriteData], ...]  # (component, item type, data) per item
    shared: tuple[tuple[str, tuple[int, ...]], ...]  # (component, chunk offsets) other shards also hold


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
        overwrite: with a storage writer of DCP's own (``checkpoint_id=path``), a checkpoint already
            at that local path is refused (``FileExistsError``, before anything is written) unless
            True; DCP itself writes over it in place. qdcp's writers (``qdcp.save``,
            :class:`CheckpointWriter`) decide this themselves, by their own ``overwrite``.
        check_replicas: every rank's copy of a replicated chunk (HSDP's replicate dimension, a
            tensor-parallel-replicated scale, a ``Replicate()`` DTensor) is hashed and compared
            before anything is written; diverged replicas raise :class:`~qdcp.ReplicaMismatchError`
            naming the keys, chunks and ranks, instead of DCP silently writing one rank's copy.
            Costs a hash of each replica on its rank (free where ``checksums`` hashes them anyway).
        **kwargs: passed to ``DefaultSavePlanner`` (``flatten_state_dict``, ``enable_plan_caching``...).
    """

    def __init__(self, dequantize: DequantizeChoice = False,
                 dequantize_dtype: torch.dtype | None = None, checksums: bool = True, overwrite: bool = False,
                 check_replicas: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        register_new_empty()  # before dcp.async_save's default stager sees classes imported since
        if not (isinstance(dequantize, bool) or callable(dequantize)):
            raise TypeError("dequantize must be a bool or a callable (fqn, tensor) -> bool")
        self.dequantize = dequantize
        self.dequantize_dtype = dequantize_dtype
        self.checksums = bool(checksums)
        self.overwrite = bool(overwrite)
        self.check_replicas = bool(check_replicas)
        self._entries: dict[str, _SaveEntry] = {}
        self._sources: dict[str, tuple[_SaveEntry, str | None]] = {}
        self._templates: dict[tuple, _RawTemplate] = {}
        self._ready: dict[MetadataIndex, torch.Tensor | bytes] = {}

    @property
    def records_checksums(self) -> bool:
        """Whether the checkpoint's metadata will hold a checksum of every item (storage writers
        need no checksums of their own then)."""
        return self.checksums

    # DCP calls this first, on every rank.
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        _check_is_save(storage_meta)
        if not self.overwrite:
            refuse_existing_checkpoint(storage_meta, type(self).__name__)
        super().set_up_planner(state_dict, storage_meta=storage_meta, is_coordinator=is_coordinator)
        self._entries, self._sources, self._templates, self._ready = {}, {}, {}, {}
        with planning():
            self._plan_entries()

    def _plan_entries(self) -> None:
        for fqn, value in list(self.state_dict.items()):
            placed = place(value)
            if placed is None:
                continue
            adapter = find_adapter(placed.local)
            if adapter is None:
                _check_not_half_staged(fqn, placed.local)
                continue
            inner = adapter.unwrap(placed.local)
            if inner is not None:  # a wrapper around a high-precision tensor: DCP writes that tensor
                self.state_dict[fqn] = with_local(value, inner)
                continue
            dequantize = self.dequantize(fqn, value) if callable(self.dequantize) else self.dequantize
            if _sharded_inside(fqn, placed, adapter, dequantize):  # its values are a DTensor: DCP writes it
                self.state_dict[fqn] = adapter.dequantize(placed.local, self.dequantize_dtype)
                continue
            entry = self._plan_dequantized(fqn, placed, adapter) if dequantize \
                else self._plan_raw(fqn, placed, adapter)
            self._entries[fqn] = entry
            del self.state_dict[fqn]

    def _plan_raw(self, fqn: str, placed: Placed, adapter: Adapter) -> _SaveEntry:
        t = placed.local
        comps = adapter.components(t)
        raw_attrs, raw_info = adapter.attributes(t), adapter.info(t)
        key = (type(t), placed.global_shape, placed.chunk, placed.is_dtensor, repr(raw_attrs), repr(raw_info),
               tuple((n, tuple(v.shape), v.dtype) for n, v in comps.items()))
        template = self._templates.get(key)
        if template is None:  # entries of one structure (all layers of a model) share the work
            template = self._templates[key] = self._raw_template(fqn, placed, adapter, comps)
        items = [WriteItem(index=MetadataIndex(qspec.component_fqn(fqn, name), data.chunk.offsets),
                           type=item_type, tensor_data=data) for name, item_type, data in template.writes]
        entry_spec = qspec.EntrySpec(fqn, qspec.RAW, template.type_name, placed.global_shape, t.dtype,
                                     template.attrs, template.specs, None, template.info)
        entry = _SaveEntry(fqn, entry_spec, placed, adapter, items,
                           template.shared if placed.is_dtensor else ())
        for item, (name, _, _) in zip(items, template.writes):
            self._sources[item.index.fqn] = (entry, name)
        return entry

    def _raw_template(self, fqn: str, placed: Placed, adapter: Adapter, comps: dict) -> _RawTemplate:
        """What a raw entry of this structure stores: type, JSON attrs and info, component specs,
        and the (component, item type, TensorWriteData) of each item this rank writes."""
        t = placed.local
        try:
            adapter.component_names(t)  # the adapter refuses what it cannot store raw
        except UnsupportedTensorError as e:
            raise UnsupportedTensorError(f"key {fqn!r}: {e}") from None
        attrs, layouts = describe_tensor(t, adapter, fqn)
        if set(comps) != set(layouts):
            raise UnsupportedTensorError(f"key {fqn!r}: adapter gave components {sorted(comps)} "
                                         f"but layouts for {sorted(layouts)}")
        declared, layouts = layouts, shard_layouts(adapter, placed, layouts)
        specs, writes, shared = [], [], []
        for name, value in comps.items():
            layout = layouts[name]
            regrouped = layout is not declared[name]  # stored as a grid, written as a view of its groups
            try:
                global_shape = layout.component_shape(placed.global_shape)
                chunk = layout.map_chunk(placed.global_shape, placed.chunk) \
                    if not is_empty(placed.chunk) else None
            except AlignmentError as e:
                raise AlignmentError(
                    f"key {fqn!r}: component {name!r}: this rank's shard {placed.chunk} {e}"
                    f"{_per_shard(adapter, layout, t)}"
                    f"{_nearest(layouts, placed) or '. Shard on block boundaries, or ' + _DEQUANTIZED}.") from None
            if chunk is not None and tuple(value.shape) != chunk[1] and not (
                    regrouped and grid_view(value, chunk[1]) is not None):
                raise AlignmentError(
                    f"key {fqn!r}: component {name!r} has local shape {tuple(value.shape)} but the "
                    f"shard {placed.chunk} of {placed.global_shape} needs {chunk[1]}; the shard does "
                    f"not own whole blocks{_nearest(layouts, placed) or '. ' + _DEQUANTIZED.capitalize()}.")
            specs.append(qspec.ComponentSpec(name, tuple(global_shape), value.dtype, layout.to_json()))
            if chunk is not None:
                item = _write_item(name, chunk, global_shape, value.dtype, sharded=placed.is_dtensor)
                writes.append((name, item.type, item.tensor_data))
                if layout.shared(placed.global_shape, placed.chunk):
                    shared.append((name, chunk[0]))
        return _RawTemplate(adapter.type_name(t), attrs, _info(adapter, t), tuple(specs), tuple(writes),
                            tuple(shared))

    def _plan_dequantized(self, fqn: str, placed: Placed, adapter: Adapter) -> _SaveEntry:
        t = placed.local
        attrs, _ = describe_tensor(t, adapter, fqn)
        dtype = self.dequantize_dtype or t.dtype
        entry_spec = qspec.EntrySpec(fqn, qspec.DEQUANTIZED, adapter.type_name(t), placed.global_shape,
                                     t.dtype, attrs, (), dtype, _info(adapter, t))
        items = [] if is_empty(placed.chunk) else [
            _write_item(fqn, placed.chunk, placed.global_shape, dtype, sharded=placed.is_dtensor)]
        entry = _SaveEntry(fqn, entry_spec, placed, adapter, items)
        if items:
            self._sources[fqn] = (entry, None)
        return entry

    def create_local_plan(self) -> SavePlan:
        with planning():
            return self._create_local_plan()

    def _create_local_plan(self) -> SavePlan:
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
        hashed = items if self.checksums or self.check_replicas else [i for i in items if _item_key(i) in shared_keys]
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
        with planning():
            per_rank = [(plan.planner_data or {}).pop(_SUMS_KEY, None) or {"hashes": {}, "shared": []}
                        for plan in all_plans]
            _check_shared(per_rank)
            if self.check_replicas:
                _check_replicas(per_rank)
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
        # DCP merges the plans' planner_data into the metadata's: the spec texts are merged here
        # instead. Taken out of the plans for the call and put back (no copy per rank; DCP's plan
        # caching keeps these plans and compares later ones with them).
        texts = [(plan.planner_data or {}).pop(qspec.PLANNER_DATA_KEY, None) for plan in all_plans]
        try:
            # first: ranks that disagree on an entry's spec (e.g. its blocks) are named by key,
            # before DCP's own validation finds their component chunks inconsistent
            merged = [t or qspec.dumps({}) for t in texts]
            merged = merged[0] if all(t == merged[0] for t in merged) else _merge_specs(merged)
            plans, metadata = super()._create_global_plan(all_plans)
        finally:
            for plan, text in zip(all_plans, texts):
                if text is not None:
                    plan.planner_data[qspec.PLANNER_DATA_KEY] = text
        planner_data = dict(metadata.planner_data or {})
        planner_data[qspec.PLANNER_DATA_KEY] = merged
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
        # a regrouped component (for_shard) is written as its grid; others have the item's shape
        return grid_view(entry.adapter.components(t)[component], write_item.tensor_data.chunk.sizes)


_SUMS_KEY = "__qdcp_sums__"  # per-rank item hashes and shared component items; never saved as such


def _item_key(item: WriteItem) -> tuple[str, tuple[int, ...]]:
    return item.index.fqn, tuple(item.index.offset or ())


def _diverged(per_rank: list[dict], shared_only: bool) -> dict[tuple, list[int]]:
    """``{item key: [first rank, ranks whose hash differs from its]}`` over the items several ranks
    hash (each rank's ``hashes``; with ``shared_only``, only the keys it lists as ``shared``)."""
    first: dict[tuple, tuple[int, int]] = {}
    diverged: dict[tuple, list[int]] = {}
    for rank, part in enumerate(per_rank):
        hashes = part["hashes"]
        for key in (part["shared"] if shared_only else hashes):
            seen = first.setdefault(key, (rank, hashes[key]))
            if seen[1] != hashes[key]:
                diverged.setdefault(key, [seen[0]]).append(rank)
    return diverged


_DEQUANTIZED = "save this entry dequantized (QuantizedSavePlanner(dequantize=...))"


def _nearest(layouts: dict, placed: Placed) -> str:
    """The nearest layout whose shards own whole blocks, for a save refused for cutting them."""
    return nearest_aligned(layouts, placed.global_shape, placed.chunk, otherwise=_DEQUANTIZED)


def _check_shared(per_rank: list[dict]) -> None:
    """Items of a component that several ranks' shards hold (replicated, or constant along a dim
    the shards cut) must be equal: DCP keeps one rank's copy. Refuse them when they differ."""
    for key, ranks in _diverged(per_rank, shared_only=True).items():
        fqn, name = key[0].rsplit(qspec.COMPONENT_SEPARATOR, 1)
        raise AlignmentError(
            f"key {fqn!r}: component {name!r} holds values shared by the shards of ranks "
            f"{ranks[0]} and {ranks[1]} (one for the whole tensor, or for a block both shards "
            f"cut), but they differ: the shards were quantized each on its own (e.g. with "
            f"its own per-tensor scale). Quantize the shards with one scale for the whole "
            f"tensor, or save this entry dequantized.")


def _check_replicas(per_rank: list[dict]) -> None:
    """Every chunk several ranks hold must have one hash; the diverged ones are named."""
    diverged = _diverged(per_rank, shared_only=False)
    if diverged:
        lines = [f"key {_user_key(fqn)}: the chunk at {list(offsets)} of rank(s) {ranks[1:]} differs from rank "
                 f"{ranks[0]}'s" for (fqn, offsets), ranks in sorted(diverged.items())[:10]]
        more = f" (and {len(diverged) - 10} more)" if len(diverged) > 10 else ""
        raise ReplicaMismatchError(
            f"{len(diverged)} replicated chunk(s) differ between the ranks that hold them{more}; nothing was "
            f"written:\n  " + "\n  ".join(lines) + "\nThe replicas diverged in training (check that "
            "every replica group ran the same updates), or save from one replica group.")


def _user_key(item_fqn: str) -> str:
    """``'w'`` for a plain item, ``'w' (component 'scale')`` for one of a quantized entry's."""
    fqn, sep, name = item_fqn.rpartition(qspec.COMPONENT_SEPARATOR)
    return f"{fqn!r} (component {name!r})" if sep else repr(item_fqn)


def _checksum_record(global_plan: list[SavePlan], per_rank: list[dict], metadata: Metadata) -> dict:
    """The metadata's checksum record: for each item, the hash of the copy the rank that writes
    it computed (DCP writes one rank's copy of a replicated item), in the metadata's chunk order
    (DCP's global plan gives each item's chunk index)."""
    builder = sums.RecordBuilder()
    for fqn, md in metadata.state_dict_metadata.items():
        builder.item(fqn, len(md.chunks) if isinstance(md, TensorStorageMetadata) else 1)
    for rank, plan in enumerate(global_plan):
        hashes = per_rank[rank]["hashes"]
        for item in plan.items:
            builder.set(item.index.fqn, item.index.index or 0, hashes.get(_item_key(item)))
    return builder.record()


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


def _per_shard(adapter: Adapter, layout: Layout, t: torch.Tensor) -> str:
    """Why a shard of state grouped per shard (``groups_per_shard``) cannot be stored as a grid."""
    if not adapter.groups_per_shard or not isinstance(layout, Flat):
        return ""
    return (f"; nor do its blocks of {layout.group} elements of its own (a shard of {tuple(t.shape)}) form a "
            f"grid of the logical tensor: they do where a shard's columns are a multiple of {layout.group}, "
            f"or divide it and its rows divide into whole blocks")


def _info(adapter: Adapter, t: torch.Tensor) -> dict:
    """The adapter's descriptive facts, JSON-encoded (dropped, not fatal, if they cannot be)."""
    try:
        return {k: qspec.encode_value(v) for k, v in adapter.info(t).items()}
    except TypeError:
        return {}


def _write_item(fqn: str, chunk: Chunk, global_shape, dtype: torch.dtype, *, sharded: bool) -> WriteItem:
    offsets, sizes = chunk
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=WriteItemType.SHARD if sharded else WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(global_shape)))


def _sharded_inside(fqn: str, placed: Placed, adapter: Adapter, dequantize: bool) -> bool:
    """Whether ``placed`` is a quantized tensor whose inner tensors are DTensors (torchao's
    ``quantize_`` applied to an already sharded model): saved dequantized (its values, a DTensor),
    refused raw, naming the key."""
    if not sharded_inside(placed, adapter):
        return False
    if not dequantize:
        raise UnsupportedTensorError(
            f"key {fqn!r}: a {adapter.type_name(placed.local)} whose inner tensors are DTensors (quantized after "
            f"the model was sharded, e.g. torchao's quantize_ on FSDP2/TP weights); qdcp stores a quantized "
            f"tensor raw as a DTensor whose local tensor is quantized. Quantize before sharding, or save this "
            f"entry dequantized (QuantizedSavePlanner(dequantize=...)).")
    return True


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


def _check_is_save(storage_meta) -> None:
    """Refuse a load's arguments: ``dcp.load`` gives a planner the checkpoint's ``Metadata`` where a
    save gives a ``StorageMeta`` (or None); ``dcp.save``'s fallback for planners without that
    argument would give a bool, which this planner never gets."""
    if storage_meta is not None and not isinstance(storage_meta, StorageMeta):
        raise TypeError(
            f"QuantizedSavePlanner is a save planner, but it was set up with a {type(storage_meta).__name__} "
            f"instead of a save's StorageMeta: it was passed to dcp.load. Pass QuantizedLoadPlanner() "
            f"there, QuantizedSavePlanner() to dcp.save / dcp.async_save.")
