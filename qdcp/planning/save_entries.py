"""Save entries: what DCP writes for each quantized key of a state dict, and each item's data.

For each key whose value (bare, or the local tensor of a DTensor) an adapter takes,
:class:`EntryPlanner` plans a :class:`SaveEntry`: raw, one DCP item per component named
``<fqn>.__qdcp__.<component>``, its chunk mapped by the component's layout; or dequantized, one
plain item under ``<fqn>``. Wrappers around a high-precision tensor (``Adapter.unwrap``), and
quantized tensors whose inner tensors are DTensors (saved dequantized), are put back in the state
dict as the plain value DCP writes. :func:`merge_specs` makes one spec document of every rank's.

Each entry's data (its components, or its dequantized values computed when first asked for) is
kept until the last of its items is given to the writer, then dropped (:meth:`EntryPlanner.release`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from typing import Any, Callable, Union

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from qdcp import checksums as sums
from qdcp import spec as qspec
from qdcp.adapters import rows
from qdcp.adapters.base import Adapter, StoredEntry, describe_tensor, find_adapter
from qdcp.errors import AlignmentError, LoadMismatchError, ReservedKeyError, StagingError, UnsupportedTensorError
from qdcp.layouts import Blocked, Chunk, Flat, Layout, full_chunk, grid_view, nearest_aligned
from qdcp.planning.placement import Placed, is_empty, place, shard_layouts, sharded_inside, with_local

DequantizeChoice = Union[bool, Callable[[str, torch.Tensor], bool]]

_LOCK = threading.Lock()  # entries' data counts: writers resolve items on several threads (one lock: planners pickle)

__all__ = ["DequantizeChoice", "EntryPlanner", "SaveEntry", "RawTemplate", "fall_back", "merge_specs"]


@dataclasses.dataclass(eq=False)
class SaveEntry:
    """One quantized key as this rank saves it: its spec and the items it writes."""
    fqn: str
    spec: qspec.EntrySpec
    placed: Placed
    adapter: Adapter
    items: list[WriteItem]
    shared: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (component, chunk offsets) other shards also hold
    values: Any = None  # its components (raw) or dequantized values, kept while items still need them
    left: int = 0  # items that still need them
    # a shard stored whole (:func:`_stored_whole`): how it is stored per shard instead,
    # (spec, {item key: item}) for the coordinator to fall back to (:func:`fall_back`), or why it cannot be
    per_shard: tuple[qspec.EntrySpec, dict] | str | None = None


@dataclasses.dataclass(frozen=True)
class RawTemplate:
    """What every raw entry of one structure (type, shard, attributes, component shapes) stores;
    made once and shared by all such entries (all layers of a model)."""
    type_name: str
    attrs: dict
    info: Any
    specs: tuple[qspec.ComponentSpec, ...]
    writes: tuple[tuple[str, WriteItemType, TensorWriteData], ...]  # (component, item type, data) per item
    shared: tuple[tuple[str, tuple[int, ...]], ...]  # (component, chunk offsets) other shards also hold
    per_shard: RawTemplate | str | None = None  # a whole shard's fallback (see SaveEntry.per_shard)


class EntryPlanner:
    """Plans the quantized keys of one rank's state dict and gives each of their items' data
    (``dequantize`` and ``dequantize_dtype``: :class:`~qdcp.QuantizedSavePlanner`'s)."""

    def __init__(self, dequantize: DequantizeChoice, dequantize_dtype: torch.dtype | None) -> None:
        self.dequantize = dequantize
        self.dequantize_dtype = dequantize_dtype
        self.entries: dict[str, SaveEntry] = {}
        self._sources: dict[str, tuple[SaveEntry, str | None]] = {}  # item fqn -> (entry, component)
        self._templates: dict[tuple, RawTemplate] = {}

    def plan(self, state_dict: dict[str, Any]) -> None:
        """Plan every quantized key of (flattened) ``state_dict``: planned entries are taken out of
        it; wrappers and quantized tensors sharded inside are replaced by the plain value DCP writes."""
        for fqn, value in list(state_dict.items()):
            if qspec.COMPONENT_SEPARATOR in fqn:
                raise ReservedKeyError(
                    f"key {fqn!r}: qdcp names the items of quantized entries '<key>{qspec.COMPONENT_SEPARATOR}"
                    f"<component>', so a state-dict key containing {qspec.COMPONENT_SEPARATOR!r} would be read as "
                    f"one (or collide with one); nothing was written. Rename that key")
            placed = place(value)
            if placed is None:
                continue
            adapter = find_adapter(placed.local)
            if adapter is None:
                _check_not_half_staged(fqn, placed.local)
                continue
            inner = adapter.unwrap(placed.local)
            if inner is not None:  # a wrapper around a high-precision tensor: DCP writes that tensor
                state_dict[fqn] = with_local(value, inner)
                continue
            dequantize = self.dequantize(fqn, value) if callable(self.dequantize) else self.dequantize
            if dequantize and sharded_inside(placed, adapter):  # its values are a DTensor: DCP writes it
                state_dict[fqn] = adapter.dequantize(placed.local, self.dequantize_dtype)
                continue
            entry = self._plan_dequantized(fqn, placed, adapter) if dequantize \
                else self._plan_raw(fqn, placed, adapter)
            self.entries[fqn] = entry
            del state_dict[fqn]

    def items(self) -> list[WriteItem]:
        """Every item of every entry, in entry order."""
        return [item for entry in self.entries.values() for item in entry.items]

    def shared(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(item fqn, chunk offsets)`` of the items other ranks' shards also hold."""
        return [(qspec.component_fqn(e.fqn, name), offsets)
                for e in self.entries.values() for name, offsets in e.shared]

    def per_shard(self) -> dict[str, tuple[qspec.EntrySpec, dict] | str]:
        """The entries stored whole (per tensor, or whole rows), each with how it is stored per shard
        instead (for :func:`fall_back`, on the coordinator)."""
        return {fqn: e.per_shard for fqn, e in self.entries.items() if e.per_shard is not None}

    def spec_text(self) -> str:
        """This rank's spec document: every entry's :class:`~qdcp.spec.EntrySpec`."""
        return qspec.dumps({fqn: e.spec for fqn, e in self.entries.items()})

    def data(self, item: WriteItem) -> torch.Tensor | None:
        """What DCP writes for ``item``: a component (a regrouped one as its grid) or the dequantized
        values; None for an item of no entry (DCP's own). Computed once per entry and kept while
        its items are left to resolve (recomputed only for an item asked for again after that)."""
        source = self._sources.get(item.index.fqn)
        if source is None:
            return None
        entry, component = source
        values = entry.values
        if values is None:
            values = _compute(entry)
            with _LOCK:
                if entry.left > 0:
                    entry.values = values
        if component is None:
            return values
        # a regrouped component (for_shard) is written as its grid; others have the item's shape
        return grid_view(values[component], item.tensor_data.chunk.sizes)

    def expect(self, items: list[WriteItem]) -> None:
        """The items the writer will still ask this planner's entries for (this rank's final plan,
        less those already copied out): each entry's data is kept until the last of them is
        released, and dropped now where there are none (DCP may have another rank write them)."""
        left = dict.fromkeys(self.entries.values(), 0)
        for item in items:
            source = self._sources.get(item.index.fqn)
            if source is not None:
                left[source[0]] += 1
        with _LOCK:
            for entry, n in left.items():
                entry.left = n
                if n == 0:
                    entry.values = None

    def release(self, item: WriteItem) -> None:
        """``item``'s data was given to the writer (or copied out for it): its entry's data is
        dropped after the last of its items."""
        source = self._sources.get(item.index.fqn)
        if source is None:
            return
        entry = source[0]
        with _LOCK:
            entry.left -= 1
            if entry.left <= 0:
                entry.values = None

    def _plan_raw(self, fqn: str, placed: Placed, adapter: Adapter) -> SaveEntry:
        t = placed.local
        comps = adapter.components(t)
        if not placed.is_dtensor and any(isinstance(c, DTensor) for c in comps.values()):
            raise _sharded_inside_error(fqn, adapter, t)  # (the components asked for once: checked here)
        raw_attrs, raw_info = adapter.attributes(t), adapter.info(t)
        key = (type(t), placed.global_shape, placed.chunk, placed.is_dtensor, repr(raw_attrs), repr(raw_info),
               tuple((n, tuple(v.shape), v.dtype) for n, v in comps.items()))
        template = self._templates.get(key)
        if template is None:  # entries of one structure (all layers of a model) share the work
            template = self._templates[key] = self._raw_template(fqn, placed, adapter, comps)
        items, entry_spec = _entry_of(fqn, placed, template)
        per_shard = template.per_shard
        if isinstance(per_shard, RawTemplate):
            alt_items, alt_spec = _entry_of(fqn, placed, per_shard)
            per_shard = (alt_spec, {sums.item_key(old): new for old, new in zip(items, alt_items)})
        entry = SaveEntry(fqn, entry_spec, placed, adapter, items, template.shared if placed.is_dtensor else (),
                          comps if items else None, len(items), per_shard)
        for item, (name, _, _) in zip(items, template.writes):
            self._sources[item.index.fqn] = (entry, name)
        return entry

    def _raw_template(self, fqn: str, placed: Placed, adapter: Adapter, comps: dict) -> RawTemplate:
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
        whole = _stored_whole(adapter, placed, attrs, layouts)
        if whole is None:
            return _template_of(fqn, placed, adapter, comps, attrs, declared, layouts, layouts)
        wide_attrs, spec_layouts, item_layouts, own_blocks = whole
        per_shard: RawTemplate | str = ONE_VALUE
        if own_blocks:
            try:
                per_shard = _template_of(fqn, placed, adapter, comps, attrs, declared, layouts, layouts)
            except AlignmentError as e:
                per_shard = str(e)
        template = _template_of(fqn, placed, adapter, comps, wide_attrs, declared, spec_layouts, item_layouts)
        return dataclasses.replace(template, per_shard=per_shard)

    def _plan_dequantized(self, fqn: str, placed: Placed, adapter: Adapter) -> SaveEntry:
        t = placed.local
        attrs = _describing_attributes(fqn, adapter, t)
        dtype = self.dequantize_dtype or t.dtype
        entry_spec = qspec.EntrySpec(fqn, qspec.DEQUANTIZED, adapter.type_name(t), placed.global_shape,
                                     t.dtype, attrs, (), dtype, _info(adapter, t))
        items = [] if is_empty(placed.chunk) else [
            _write_item(fqn, placed.chunk, placed.global_shape, dtype, sharded=placed.is_dtensor)]
        entry = SaveEntry(fqn, entry_spec, placed, adapter, items, left=len(items))
        if items:
            self._sources[fqn] = (entry, None)
        return entry


def _describing_attributes(fqn: str, adapter: Adapter, t: torch.Tensor) -> dict:
    """A dequantized entry's attributes, which only describe what it was (loads read its values):
    those a spec can hold. A tensor with one it cannot hold is saved dequantized for that reason."""
    try:
        return describe_tensor(t, adapter, fqn)[0]
    except UnsupportedTensorError:
        out = {}
        for k, v in adapter.attributes(t).items():
            try:
                out[k] = qspec.encode_value(v)
            except TypeError:
                continue
        return out


def _compute(entry: SaveEntry) -> Any:
    """An entry's data: its components (raw), or its values in the stored dtype (dequantized)."""
    t = entry.placed.local
    if entry.spec.storage == qspec.DEQUANTIZED:
        return _dequantized(entry.fqn, entry.adapter, t, entry.spec.stored_dtype)
    return entry.adapter.components(t)


def _dequantized(fqn: str, adapter: Adapter, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``adapter.dequantize(t, dtype)``; a large tensor a block of rows at a time
    (:mod:`qdcp.adapters.rows`), each block's components and attributes as a load reads them back
    (``dequantize_stored``: the values a load of the raw entry would give a plain target)."""
    try:  # what a raw save of it would record; a tensor it cannot describe is dequantized whole
        layouts = adapter.layouts(t)
        blocks = rows.row_blocks(layouts, tuple(t.shape))
        if blocks is not None:
            components = adapter.components(t)
            encoded, _ = describe_tensor(t, adapter, fqn)
            attrs = {k: qspec.decode_value(v, adapter.attribute_classes(), f"key {fqn!r}: ")
                     for k, v in encoded.items()}
    except Exception:  # noqa: BLE001 (e.g. an attribute a spec cannot hold: why it is saved dequantized)
        blocks = None
    if blocks is None or set(layouts) != set(components):
        return adapter.dequantize(t, dtype)
    stored = StoredEntry(adapter.type_name(t), attrs, tuple(t.shape), t.dtype, components)
    return rows.dequantize_by_rows(adapter, stored, blocks, full_chunk(t.shape), dtype)


def _template_of(fqn: str, placed: Placed, adapter: Adapter, comps: dict, attrs: dict, declared: dict,
                 spec_layouts: dict[str, Layout], item_layouts: dict[str, Layout]) -> RawTemplate:
    """The template of a raw entry whose components ``spec_layouts`` describe and whose items this
    shard writes ``item_layouts`` cut (the same, but for a column cut stored as whole rows)."""
    t = placed.local
    specs, writes, shared = [], [], []
    for name, value in comps.items():
        layout = item_layouts[name]
        regrouped = layout is not declared[name] and layout is spec_layouts[name]  # a grid of its groups
        try:
            global_shape = layout.component_shape(placed.global_shape)
            chunk = layout.map_chunk(placed.global_shape, placed.chunk) \
                if not is_empty(placed.chunk) else None
        except AlignmentError as e:
            raise AlignmentError(
                f"key {fqn!r}: component {name!r}: this rank's shard {placed.chunk} {e}"
                f"{_per_shard(adapter, layout, t)}"
                f"{_nearest(item_layouts, placed) or '. Shard on block boundaries, or ' + _DEQUANTIZED}.") from None
        if chunk is not None and tuple(value.shape) != chunk[1] and not (
                regrouped and grid_view(value, chunk[1]) is not None):
            raise AlignmentError(
                f"key {fqn!r}: component {name!r} has local shape {tuple(value.shape)} but the "
                f"shard {placed.chunk} of {placed.global_shape} needs {chunk[1]}; the shard does "
                f"not own whole blocks{_nearest(item_layouts, placed) or '. S' + _DEQUANTIZED[1:]}.")
        specs.append(qspec.ComponentSpec(name, tuple(global_shape), value.dtype, spec_layouts[name].to_json()))
        if chunk is not None:
            item = _write_item(name, chunk, global_shape, value.dtype, sharded=placed.is_dtensor)
            writes.append((name, item.type, item.tensor_data))
            if layout.shared(placed.global_shape, placed.chunk):
                shared.append((name, chunk[0]))
    return RawTemplate(adapter.type_name(t), attrs, _info(adapter, t), tuple(specs), tuple(writes),
                       tuple(shared))


def _entry_of(fqn: str, placed: Placed, template: RawTemplate) -> tuple[list[WriteItem], qspec.EntrySpec]:
    items = [WriteItem(index=MetadataIndex(qspec.component_fqn(fqn, name), data.chunk.offsets),
                       type=item_type, tensor_data=data) for name, item_type, data in template.writes]
    entry_spec = qspec.EntrySpec(fqn, qspec.RAW, template.type_name, placed.global_shape, placed.local.dtype,
                                 template.attrs, template.specs, None, template.info)
    return items, entry_spec


#: a shard stored whole as one value for the whole tensor has no other form (:func:`_stored_whole`)
ONE_VALUE = "one value for the whole tensor"


def _stored_whole(adapter: Adapter, placed: Placed, attrs: dict, layouts: dict[str, Layout]):
    """A shard whose one block value spans it where torchao's slicing cut ``block_size`` to the
    shard, described as the whole tensor's (each value written once, every rank's copy compared
    before anything is written, :func:`qdcp.checksums.diverged`): one block the shard's shape (a
    per-tensor tensor cut by rows or columns) is one value for the whole tensor; blocks spanning
    its columns (a per-row weight cut by columns) are blocks of whole rows, shared by the shards
    that cut them. ``(attrs, spec layouts, item layouts, own_blocks)``, or None where it is
    neither. Where the shards' values differ, :func:`fall_back` stores each shard with its own
    blocks if ``own_blocks`` (blocks of single rows); else the save is refused naming the key."""
    names = [a for a in adapter.block_attributes if a in attrs]
    if not placed.is_dtensor or len(names) != 1 or is_empty(placed.chunk):
        return None
    encoded = attrs[names[0]]
    block = list(encoded["tuple"]) if isinstance(encoded, dict) and "tuple" in encoded else encoded
    shape, sizes = [int(n) for n in placed.global_shape], list(placed.chunk[1])
    if not isinstance(block, list) or len(block) != len(shape) or len(block) < 2:
        return None
    if block == sizes and sizes != shape:  # one value for the whole tensor
        wide, item, own_blocks = shape, [0] * len(block), math.prod(block[:-1]) == 1
    elif block[-1] == sizes[-1] < shape[-1]:  # whole rows
        wide, item, own_blocks = [*block[:-1], shape[-1]], [*block[:-1], 0], True
    else:
        return None
    spec_layouts, item_layouts = {}, {}
    for name, layout in layouts.items():
        if isinstance(layout, Blocked) and list(layout.block) == block:
            spec_layouts[name], item_layouts[name] = Blocked(tuple(wide)), Blocked(tuple(item))
        else:
            spec_layouts[name] = item_layouts[name] = layout
    if spec_layouts == layouts:
        return None
    wide_attr = {"tuple": wide} if isinstance(encoded, dict) else wide
    return {**attrs, names[0]: wide_attr}, spec_layouts, item_layouts, own_blocks


def fall_back(plans: list[SavePlan], per_rank: list[dict | None]) -> list[SavePlan]:
    """On the coordinator: entries stored whole (:func:`_stored_whole`) whose shards hold different
    values for what they store once, or whose ranks describe them differently (a shard of one row
    beside shards of several), are stored per shard instead: each rank's items and spec of that
    entry replaced by the ones it sent (``per_rank[r]["per_shard"]``, the riders, updated in place;
    its hashes and shared items follow). A per-tensor value is left to :class:`~qdcp.checksums.SaveHashes`'
    check, which refuses it; a shard with no per-shard form (uneven cuts) is refused naming the key."""
    alts = [(part or {}).get("per_shard", {}) for part in per_rank]
    whole = {fqn for alt in alts for fqn in alt}
    if not whole:
        return plans
    swap: dict[str, list[int] | None] = {}
    for key, ranks in sums.diverged([part or {"hashes": {}, "shared": []} for part in per_rank], True).items():
        fqn = qspec.split_item(key[0])[0]
        if fqn in whole:
            swap.setdefault(fqn, ranks)
    for fqn in _described_differently(plans, whole):
        swap.setdefault(fqn, None)
    plans = list(plans)
    for fqn, ranks in sorted(swap.items()):
        mine = {rank: alt[fqn] for rank, alt in enumerate(alts) if fqn in alt}
        if ONE_VALUE in mine.values():
            continue  # refused by the check of shared values (or of the specs), naming the key
        specs = [alt[0] for alt in mine.values() if not isinstance(alt, str)]
        if len(specs) < len(mine) or any(spec != specs[0] for spec in specs):
            between = f" (ranks {ranks[0]} and {ranks[1]}: each shard was quantized on its own)" if ranks else ""
            raise AlignmentError(
                f"key {fqn!r}: its shards are cut by columns, each with its own scales for its rows, and "
                f"they differ between the shards of a row{between}, so its rows cannot be stored whole; nor "
                f"can its shards be stored each with blocks of its own columns, which are not one size "
                f"(uneven cuts). Cut the columns evenly, quantize the whole weight before cutting it "
                f"(torchao's slicing keeps the rows' scales), or {_DEQUANTIZED}.")
        for rank, (spec, replaced) in mine.items():
            plans[rank] = _swapped(plans[rank], per_rank[rank], fqn, spec, replaced)
    return plans


def _described_differently(plans: list[SavePlan], fqns: set[str]) -> list[str]:
    """The entries of ``fqns`` whose spec differs between the ranks that hold them."""
    texts = [(plan.planner_data or {}).get(qspec.PLANNER_DATA_KEY) for plan in plans]
    if all(text == texts[0] for text in texts):  # (the ranks' documents alike: nothing to parse)
        return []
    return [fqn for fqn, specs in _by_key(texts).items() if fqn in fqns and any(s != specs[0] for s in specs)]


def _by_key(texts: list[str | None]) -> dict[str, list[qspec.EntrySpec]]:
    """The specs of each entry, one per rank's document that holds it (None: a rank with none)."""
    out: dict[str, list[qspec.EntrySpec]] = {}
    for text in texts:
        for fqn, spec in (qspec.loads(text).items() if text else ()):
            out.setdefault(fqn, []).append(spec)
    return out


def _swapped(plan: SavePlan, part: dict, fqn: str, spec: qspec.EntrySpec, replaced: dict) -> SavePlan:
    """``plan`` with the entry ``fqn`` stored per shard: its items, hashes, shared items and spec."""
    for old, new in replaced.items():
        if old in part["hashes"]:
            part["hashes"][sums.item_key(new)] = part["hashes"].pop(old)
    part["shared"] = [key for key in part["shared"] if qspec.split_item(key[0])[0] != fqn]
    planner_data = dict(plan.planner_data or {})
    text = planner_data.get(qspec.PLANNER_DATA_KEY)
    if text is not None:
        entries = qspec.loads(text)
        entries[fqn] = spec
        planner_data[qspec.PLANNER_DATA_KEY] = qspec.dumps(entries)
    return dataclasses.replace(plan, items=[replaced.get(sums.item_key(i), i) for i in plan.items],
                               planner_data=planner_data)


def merge_specs(rank_texts: list[str | None]) -> str:
    """One spec document from every rank's (None: a rank with no entries; ranks may hold different
    entries, e.g. pipeline stages). Ranks that disagree on an entry's spec (its type, config, mode or
    blocks) raise :class:`~qdcp.LoadMismatchError` naming the key, except for an entry saved
    dequantized, whose attributes only describe the shards (:func:`_describing_both`)."""
    texts = [t or qspec.dumps({}) for t in rank_texts]
    if all(t == texts[0] for t in texts):
        return texts[0]
    merged: dict[str, qspec.EntrySpec] = {}
    for fqn, (first, *others) in _by_key(texts).items():
        for entry in others:
            both = first if first == entry else _describing_both(first, entry)
            if both is None:
                raise LoadMismatchError(
                    f"key {fqn!r}: ranks disagree on how it is stored ({_differences(first, entry)}); "
                    f"every rank must hold the same type, config and mode (shards quantized each "
                    f"with its own configuration: quantize them alike, or {_DEQUANTIZED}).")
            first = both
        merged[fqn] = first
    return qspec.dumps(merged)


def _differences(a: qspec.EntrySpec, b: qspec.EntrySpec) -> str:
    """What two ranks' specs of one entry differ in: ``field: a vs b``, attributes by name."""
    ja, jb = a.to_json(), b.to_json()
    ja.update({f"attrs.{k}": v for k, v in ja.pop("attrs").items()})
    jb.update({f"attrs.{k}": v for k, v in jb.pop("attrs").items()})
    out = [f"{k}: {json.dumps(ja.get(k))} vs {json.dumps(jb.get(k))}" for k in sorted(set(ja) | set(jb))
           if ja.get(k) != jb.get(k)]
    return "; ".join(text if len(text) <= 200 else text[:197] + "..." for text in out)


def _describing_both(a: qspec.EntrySpec, b: qspec.EntrySpec) -> qspec.EntrySpec | None:
    """Two ranks' specs of an entry saved dequantized whose shards' configurations differ (what the
    advice to save such an entry dequantized is for): one spec with the attributes and facts both
    share (the stored values are one plain tensor either way); None where they differ in more."""
    if a.storage != qspec.DEQUANTIZED or b.storage != qspec.DEQUANTIZED:
        return None
    if dataclasses.replace(a, attrs={}, info={}) != dataclasses.replace(b, attrs={}, info={}):
        return None
    return dataclasses.replace(a, attrs={k: v for k, v in a.attrs.items() if b.attrs.get(k, object()) == v},
                               info={k: v for k, v in a.info.items() if b.info.get(k, object()) == v})


_DEQUANTIZED = "save this entry dequantized (QuantizedSavePlanner(dequantize=...))"


def _nearest(layouts: dict, placed: Placed) -> str:
    """The nearest layout whose shards own whole blocks, for a save refused for cutting them."""
    return nearest_aligned(layouts, placed.global_shape, placed.chunk, otherwise=_DEQUANTIZED)


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


def _sharded_inside_error(fqn: str, adapter: Adapter, t: torch.Tensor) -> UnsupportedTensorError:
    """A quantized tensor whose inner tensors are DTensors (torchao's ``quantize_`` applied to an
    already sharded model) is refused raw, naming the key (saved dequantized, its values a DTensor)."""
    return UnsupportedTensorError(
        f"key {fqn!r}: a {adapter.type_name(t)} whose inner tensors are DTensors (quantized after "
        f"the model was sharded, e.g. torchao's quantize_ on FSDP2/TP weights); qdcp stores a quantized "
        f"tensor raw as a DTensor whose local tensor is quantized. Quantize before sharding, or save this "
        f"entry dequantized (QuantizedSavePlanner(dequantize=...)).")


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
