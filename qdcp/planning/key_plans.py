"""Choosing the load action for each target key, from the checkpoint's metadata alone.

:class:`KeyPlanner` is built once per load from the checkpoint's metadata and asked, per target
key, for a :class:`KeyPlan`: the :mod:`qdcp.planning.actions` to run, and what (if anything) it leaves
to DCP's own path. Every check that metadata allows is made here, before anything is read.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from qdcp import spec as qspec
from qdcp.adapters.base import (
    Adapter,
    GroupAdapter,
    adapter_for_type,
    check_rebuildable,
    describe_tensor,
    find_adapter,
    find_type_adapter,
    raw_conversion,
)
from qdcp.errors import AlignmentError, LoadMismatchError, UnsupportedTensorError
from qdcp.layouts import Blocked, Chunk, Flat, Layout, Replicated, full_chunk, grid_view, nearest_aligned
from qdcp.planning.actions import (
    Destination,
    FromPlain,
    InPlace,
    IntoPlain,
    ItemRead,
    LoadAction,
    RawCopy,
    Reblock,
    Requantize,
    StoredSource,
    Temporaries,
)
from qdcp.planning.placement import Placed, expand, is_empty, place, shard_layouts, sharded_inside, with_local

__all__ = ["KeyPlan", "KeyPlanner", "GroupTarget"]


@dataclasses.dataclass(frozen=True)
class GroupTarget:
    """A group target filled member by member: ``adapter.members_loaded(target)`` once all are in."""

    adapter: Adapter
    target: torch.Tensor


@dataclasses.dataclass(frozen=True)
class KeyPlan:
    """What one target key became: ``actions`` to run; ``to_dcp`` (keys and tensors) for DCP's own
    path in its place; ``handled``, other keys of the checkpoint it accounts for; ``group``, the
    group target whose members these actions fill."""

    actions: tuple[LoadAction, ...] = ()
    to_dcp: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    handled: tuple[str, ...] = ()
    group: GroupTarget | None = None


class KeyPlanner:
    """Plans target keys against one checkpoint's metadata; caches work shared by entries of one
    structure (a model's layers)."""

    def __init__(self, metadata: Metadata, *, allow_partial_load: bool) -> None:
        self.md = metadata.state_dict_metadata
        self.specs = qspec.read_specs(metadata)
        self.allow_partial_load = allow_partial_load
        self._stored = qspec.stored_components(self.md)
        self._structures: dict[str, StoredSource] = {}  # structure -> decoded attrs and layouts
        self._configs: dict[tuple, bool] = {}      # (check, structure, target structure) -> its answer
        self._members: dict[str, tuple[str, int]] | None = None
        self.temporaries = Temporaries()  # shared by this load's actions

    def plan_key(self, fqn: str, target: Any) -> KeyPlan | None:
        """The plan for target key ``fqn``, or None where DCP's own path loads it as it is."""
        placed = place(target)
        adapter = find_adapter(placed.local) if placed is not None else None
        inner = adapter.unwrap(placed.local) if adapter is not None else None
        unwrapped = None
        if inner is not None:  # a wrapper around a high-precision tensor: load into that, in place
            unwrapped = with_local(target, inner)
            placed, adapter = place(unwrapped), None
        source = self.specs.get(fqn)
        if source is None and fqn not in self.md and placed is not None:
            grouped = self._member_of_group(fqn, placed, adapter) or self._group_by_member(fqn, placed, adapter)
            if grouped is not None:
                return grouped
        if source is not None and source.storage == qspec.DEQUANTIZED:
            source = None  # stored as a plain tensor under fqn
        if source is None and adapter is None:
            return None if unwrapped is None else KeyPlan(to_dcp={fqn: unwrapped})
        if adapter is not None and sharded_inside(placed, adapter):
            raise UnsupportedTensorError(
                f"key {fqn!r}: the target is a {adapter.type_name(placed.local)} whose inner tensors are "
                f"DTensors (quantized after the model was sharded, e.g. torchao's quantize_ on FSDP2/TP "
                f"weights); qdcp loads into a quantized tensor, or a DTensor whose local tensor is one. "
                f"Load into the model before quantizing it (its sharded plain weights take the "
                f"checkpoint's values), or quantize before sharding.")
        if placed is None:
            raise LoadMismatchError(
                f"key {fqn!r}: the checkpoint stores a quantized tensor but the target holds "
                f"{type(target).__name__}; give a tensor (plain or quantized) as the target.")
        action = self.plan_entry(fqn, placed, adapter, source)
        return KeyPlan(actions=(action,) if action is not None else ())

    # ------------------------------------------------------------------ one entry
    def plan_entry(self, fqn: str, placed: Placed, adapter: Adapter | None, source: qspec.EntrySpec | None,
                   *, src_fqn: str | None = None) -> LoadAction | None:
        """The action that fills ``placed`` from ``source`` (None: a plain entry), stored under
        ``src_fqn`` (default ``fqn``); None when there is nothing to read."""
        src_fqn = src_fqn or fqn
        if source is None:
            return self._from_plain(fqn, placed, adapter, src_fqn)
        if source.shape != placed.global_shape:
            raise LoadMismatchError(
                f"key {fqn!r}: checkpoint shape {source.shape} != target shape {placed.global_shape}")
        source_adapter = adapter_for_type(source.type, fqn)
        decoded = self.decoded(source, source_adapter, fqn)
        qspec.check_items(source, self.md, self._stored.get(src_fqn, set()), key=fqn)
        if is_empty(placed.chunk):
            return None
        if adapter is not None and self._cached(_same_config, adapter, placed, source, fqn):
            _check_raw(source_adapter, source, fqn)
            try:
                return self._in_place(fqn, placed, adapter, source, src_fqn=src_fqn, layouts=decoded.layouts)
            except AlignmentError:  # the shard cuts the source's blocks: quantized like it, where it can be
                if adapter.quantize_unsupported(placed.local):
                    raise
        if adapter is not None and adapter.block_attributes and adapter.type_name(placed.local) == source.type \
                and self._cached(_reblockable, adapter, placed, source, decoded, fqn):
            _check_raw(source_adapter, source, fqn)  # codes re-blocked, not rebuilt
            return self._dequantizing(fqn, placed, adapter, source, src_fqn=src_fqn, decoded=decoded,
                                      exact=adapter.layouts(placed.local))
        if adapter is not None:
            conversion = raw_conversion(adapter, placed.local, source_adapter, source_type=source.type,
                                        source_attrs=decoded.attrs)
            if conversion:
                _check_raw(source_adapter, source, fqn)
            action = (self._raw_copy(fqn, placed, source, src_fqn=src_fqn, conversion=conversion,
                                     layouts=decoded.layouts) if conversion else None)
            if action is not None:
                return action
        return self._dequantizing(fqn, placed, adapter, source, src_fqn=src_fqn, decoded=decoded)

    def decoded(self, source: qspec.EntrySpec, source_adapter: Adapter, fqn: str) -> StoredSource:
        """A stored entry with its attributes decoded and its layouts checked, once per structure."""
        structure = _structure_key(source)
        known = self._structures.get(structure)
        if known is None:
            attrs = {k: qspec.decode_value(v, source_adapter.attribute_classes(), f"key {fqn!r}: ")
                     for k, v in source.attrs.items()}
            layouts = qspec.layouts_of(source)
            qspec.check_component_bytes(source)
            known = self._structures[structure] = StoredSource(source.type, attrs, source.dtype, source.shape,
                                                               layouts)
        return known

    def _cached(self, check, adapter: Adapter, placed: Placed, source: qspec.EntrySpec, *args) -> bool:
        """``check(adapter, placed, source, *args)``, once per source and target structure."""
        t = placed.local
        key = (check, _structure_key(source), type(t), repr(adapter.attributes(t)),
               tuple((n, tuple(v.shape), v.dtype) for n, v in adapter.components(t).items()),
               placed.chunk[1] if adapter.groups_per_shard else None)  # a column cut regroups (for_shard)
        known = self._configs.get(key)
        if known is None:
            known = self._configs[key] = check(adapter, placed, source, *args)
        return known

    def _read(self, src_fqn: str, source: qspec.EntrySpec, name: str, chunk: Chunk, *, fqn: str,
              buffer: torch.Tensor | None = None, part: str = "") -> ItemRead:
        """A read of ``chunk`` of component ``name``, into ``buffer`` or a new temporary (``part``:
        one of several reads of the component, each into its own part of the buffer)."""
        stored = qspec.component_fqn(src_fqn, name)
        dest = Destination(chunk[1], source.component(name).dtype, buffer, self.temporaries)
        return ItemRead(qspec.component_fqn(fqn, name) + part, stored, self.md[stored], chunk, dest,
                        name if dest.temporary else None)

    def _row_reads(self, fqn, placed, adapter, source, name, stored: Layout, native, src_fqn) -> list | None:
        """A column cut's groups (the grid of a shard's own rows, :func:`~qdcp.layouts.for_shard`)
        read from a checkpoint that stores the same groups flat (saved whole or by rows): one read
        of each of its rows' runs of groups, straight into that row of its buffer. None where the
        target's groups are not the stored ones or its buffer is no such grid."""
        if not adapter.groups_per_shard or not isinstance(stored, Flat) or len(source.shape) != 2:
            return None
        target = shard_layouts(adapter, placed, adapter.layouts(placed.local)).get(name)
        if not isinstance(target, Blocked) or not _same_groups(target, stored, source.shape) or target.block[0] != 1:
            return None
        try:
            grid = target.map_chunk(source.shape, placed.chunk)
        except AlignmentError:
            return None
        dest = native.get(name)
        dest = grid_view(dest, grid[1]) if dest is not None else None
        if dest is None or not dest.is_contiguous():
            return None
        (r0, c0), (nr, nc) = placed.chunk
        return [self._read(src_fqn, source, name, stored.map_chunk(source.shape, ((r0 + i, c0), (1, nc))),
                           fqn=fqn, buffer=dest[i], part=f"#row{i}") for i in range(nr)]

    def _in_place(self, fqn, placed, adapter, source, *, src_fqn, layouts) -> InPlace:
        native = adapter.native_components(placed.local)
        reads = []
        for c in source.components:
            try:
                chunk = layouts[c.name].map_chunk(source.shape, placed.chunk)
            except AlignmentError as e:
                rows = self._row_reads(fqn, placed, adapter, source, c.name, layouts[c.name], native, src_fqn)
                if rows is None:
                    raise AlignmentError(f"key {fqn!r}: component {c.name!r}: the target shard {placed.chunk} "
                                         f"{e}{nearest_aligned(layouts, source.shape, placed.chunk)}") from None
                reads.extend(rows)
                continue
            dest = native.get(c.name)
            if dest is not None and adapter.groups_per_shard:
                dest = grid_view(dest, chunk[1])  # the target's flat groups, read as the grid they form
            direct = dest is not None and dest.is_contiguous() and tuple(dest.shape) == chunk[1]
            reads.append(self._read(src_fqn, source, c.name, chunk, fqn=fqn, buffer=dest if direct else None))
        return InPlace(fqn, placed, tuple(reads), adapter)

    def _raw_copy(self, fqn, placed, source, *, src_fqn, conversion, layouts) -> RawCopy | None:
        """The components that carry the bits, for exactly the target's chunk; None when the
        chunk is not aligned to their layouts (or the entry lacks one)."""
        try:
            reads = tuple(self._read(src_fqn, source, name, layouts[name].map_chunk(source.shape, placed.chunk),
                                     fqn=fqn) for name in conversion.names)
        except (AlignmentError, KeyError):
            return None
        return RawCopy(fqn, placed, reads, conversion)

    def _dequantizing(self, fqn, placed, adapter, source, *, src_fqn, decoded, exact=None) -> LoadAction:
        """The aligned chunk covering the target's (the whole tensor where a per-tensor scale
        needs the global amax), dequantized; quantized like a quantized target, or with the
        target's own layouts given as ``exact``, its bits taken where its blocks hold them."""
        _check_can_quantize(fqn, adapter, placed.local, f"a {source.type} entry")
        layouts = decoded.layouts
        read_chunk = _amax_chunk(adapter, placed) or expand(layouts, source.shape, placed.chunk)
        reads = []
        for c in source.components:
            try:
                chunk = layouts[c.name].map_chunk(source.shape, read_chunk)
            except AlignmentError as e:
                raise AlignmentError(f"key {fqn!r}: component {c.name!r}: {e}") from None
            reads.append(self._read(src_fqn, source, c.name, chunk, fqn=fqn))
        if adapter is None:
            return IntoPlain(fqn, placed, tuple(reads), decoded, read_chunk)
        if exact is not None:
            return Reblock(fqn, placed, tuple(reads), adapter, decoded, read_chunk, exact)
        return Requantize(fqn, placed, tuple(reads), adapter, decoded, read_chunk)

    def _from_plain(self, fqn, placed, adapter, src_fqn) -> FromPlain | None:
        plain_md = self.md.get(src_fqn)
        if plain_md is None:
            if self.allow_partial_load:
                return None
            raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
        if not isinstance(plain_md, TensorStorageMetadata):
            raise LoadMismatchError(f"key {fqn!r}: the checkpoint holds a non-tensor object here")
        if tuple(plain_md.size) != placed.global_shape:
            raise LoadMismatchError(
                f"key {fqn!r}: checkpoint shape {tuple(plain_md.size)} != target shape {placed.global_shape}")
        _check_can_quantize(fqn, adapter, placed.local, "a plain tensor")
        read_chunk = _amax_chunk(adapter, placed) or placed.chunk
        temp = Destination(read_chunk[1], plain_md.properties.dtype, None, self.temporaries)
        return FromPlain(fqn, placed, (ItemRead(fqn, src_fqn, plain_md, read_chunk, temp),), adapter, read_chunk)

    # ------------------------------------------------------------------ groups
    def _member_of_group(self, fqn: str, placed: Placed, adapter: Adapter | None) -> KeyPlan | None:
        """A target key that the group adapter of a stored entry names as one of its members
        (plain, quantized, or a DTensor of either): the logical chunk that adapter names for it,
        from the group stored raw, or dequantized (a plain tensor of the group's logical shape)."""
        found = self._member_keys().get(fqn)
        if found is None:
            return None
        group_key, index = found
        group = self.specs[group_key]
        g_adapter = adapter_for_type(group.type, group_key)
        attrs = self.decoded(group, g_adapter, fqn).attrs
        chunk = g_adapter.member_chunk(attrs, group.shape, index)
        if chunk is None:
            return None
        if chunk[1][0] != 1 or tuple(chunk[1][1:]) != placed.global_shape:
            raise LoadMismatchError(f"key {fqn!r}: member {index} of {group_key!r} has shape "
                                    f"{tuple(chunk[1][1:])}, the target {placed.global_shape}")
        within = (chunk[0][0], *(c + o for c, o in zip(chunk[0][1:], placed.chunk[0])))
        member = Placed(placed.local, (within, (1, *placed.chunk[1])), group.shape, placed.is_dtensor,
                        whole=chunk)
        source = group if group.storage == qspec.RAW else None
        action = self.plan_entry(fqn, member, adapter, source, src_fqn=group_key)
        return KeyPlan(actions=(action,) if action is not None else ())

    def _member_keys(self) -> dict[str, tuple[str, int]]:
        """Member key -> (group key, index), for every stored entry of a group family, as its
        adapter names the members (built on first use: only loads with missing keys need it)."""
        if self._members is None:
            self._members = {}
            for key, spec in self.specs.items():
                g_adapter = find_type_adapter(spec.type)
                if isinstance(g_adapter, GroupAdapter) and spec.shape:
                    self._members.update({g_adapter.member_key(key, i): (key, i) for i in range(spec.shape[0])})
        return self._members

    def _group_by_member(self, fqn: str, placed: Placed, adapter: Adapter | None) -> KeyPlan | None:
        """A group target ``<key>`` (a group type, or a plain ``[n, ...]`` stack; a DTensor of either
        sharded on dim 0 only: expert parallelism) whose members are stored as ``<key><i>``: local
        member ``j`` is global member ``i = offset + j``, loaded into the target in place."""
        if fqn[-1:].isdigit():
            return None  # "<key>1" + "0" would read as "<key>10"
        group_adapter = adapter if isinstance(adapter, GroupAdapter) else None
        members = group_adapter.members(placed.local) if group_adapter is not None else None
        if adapter is None and placed.local.ndim >= 2:
            members = list(placed.local.unbind(0))  # a plain [n, ...] stack
        # a plain [n, ...] stack names its members as GroupAdapter.member_key does by default
        member_key = group_adapter.member_key if group_adapter is not None else partial(GroupAdapter.member_key, None)
        first = placed.chunk[0][0] if placed.chunk[0] else 0
        first_key = member_key(fqn, first)
        if members is None or (first_key not in self.md and first_key not in self.specs):
            return None
        if placed.is_dtensor and (any(placed.chunk[0][1:]) or placed.chunk[1][1:] != placed.global_shape[1:]
                                  or len(members) != placed.chunk[1][0]):
            raise LoadMismatchError(
                f"key {fqn!r}: the checkpoint stores this group by member ({member_key(fqn, 0)}, "
                f"{member_key(fqn, 1)}, ...); a "
                f"sharded target must split whole members (Shard(0) of a stacked [n, ...] tensor), "
                f"but this rank holds the chunk {placed.chunk} of {placed.global_shape}")
        actions, to_dcp, handled = [], {}, []
        for j, member in enumerate(members):
            key = member_key(fqn, first + j)
            source = self.specs.get(key)
            if source is not None and source.storage == qspec.DEQUANTIZED:
                source = None
            m_adapter = find_adapter(member)
            if source is None and m_adapter is None:
                to_dcp[key] = member  # plain member view <- plain entry: DCP's own path
                continue
            handled.append(key)
            action = self.plan_entry(key, place(member), m_adapter, source)
            if action is not None:
                actions.append(action)
        group = GroupTarget(adapter, placed.local) if adapter is not None else None
        return KeyPlan(tuple(actions), to_dcp, tuple(handled), group)


_REBUILDABLE: set[tuple[type, str]] = set()  # (adapter class, structure) checked rebuildable in this process


def _check_raw(adapter: Adapter, source: qspec.EntrySpec, fqn: str) -> None:
    """Before a load copies a raw entry's components into a target without rebuilding it: refuse
    what its library would not rebuild (:func:`~qdcp.adapters.base.check_rebuildable`, as
    ``verify`` and ``convert`` would), once per structure in a process. A load that dequantizes
    rebuilds it from the data anyway (refused there as here); a group's members are checked as members."""
    key = (type(adapter), _structure_key(source))
    if key in _REBUILDABLE or isinstance(adapter, GroupAdapter):
        return
    check_rebuildable(source, fqn)
    if len(_REBUILDABLE) > 4096:
        _REBUILDABLE.clear()
    _REBUILDABLE.add(key)


def _structure_key(entry: qspec.EntrySpec) -> str:
    """Everything in an entry's spec but its key (entries of one model's layers share it, and so
    the planning work done for it): the JSON it was parsed from."""
    return entry.structure or repr(entry)


def _same_config(adapter: Adapter, placed: Placed, source: qspec.EntrySpec, fqn: str) -> bool:
    """Whether a target shard has the checkpoint entry's exact type, config and components (the
    component layouts of that shard: :func:`~qdcp.layouts.for_shard` where its adapter groups per shard)."""
    t = placed.local
    if adapter.type_name(t) != source.type:
        return False
    attrs, layouts = describe_tensor(t, adapter, fqn)
    layouts = shard_layouts(adapter, placed, layouts)
    if not qspec.same_attrs(attrs, source.attrs) or set(layouts) != {c.name for c in source.components}:
        return False
    comps = adapter.components(t)
    stored = qspec.layouts_of(source)
    for c in source.components:
        if comps[c.name].dtype != c.dtype:
            return False
        if layouts[c.name].to_json() != c.layout and not _same_groups(layouts[c.name], stored[c.name], source.shape):
            return False
    return True


def _same_groups(target: Layout, stored: Layout, shape: tuple[int, ...]) -> bool:
    """Whether a target's groups are a checkpoint's in another form: flat groups (a row range, or
    the whole tensor) of a checkpoint stored as their grid (saved cut by columns,
    :func:`~qdcp.layouts.for_shard`), read as a rectangle of it; or a column cut's grid of a
    checkpoint stored flat (saved whole or by rows), read row by row (:meth:`KeyPlanner._row_reads`)."""
    if isinstance(target, Flat) and isinstance(stored, Blocked):
        return target.on_shard(shape) == stored
    if isinstance(target, Blocked) and isinstance(stored, Flat):
        return stored.on_shard(shape) == target
    return False


def _reblockable(adapter: Adapter, placed: Placed, source: qspec.EntrySpec, decoded: StoredSource, fqn: str) -> bool:
    """Whether a target of the source's type has the source's attributes but for its blocks
    (``adapter.block_attributes``), the same components and dtypes, every layout blocked or
    replicated on both sides: then its blocks may hold the source's bits (docs/api.md)."""
    t = placed.local
    attrs, layouts = describe_tensor(t, adapter, fqn)
    blocks = adapter.block_attributes
    if not qspec.same_attrs({k: v for k, v in attrs.items() if k not in blocks},
                            {k: v for k, v in source.attrs.items() if k not in blocks}):
        return False
    comps = adapter.components(t)
    if set(comps) != {c.name for c in source.components}:
        return False
    kinds = (Blocked, Replicated)
    return all(comps[c.name].dtype == c.dtype and isinstance(layouts[c.name], kinds)
               and isinstance(decoded.layouts[c.name], kinds) for c in source.components)


def _check_can_quantize(fqn: str, adapter: Adapter | None, target: torch.Tensor, stored: str) -> None:
    """Refuse, at planning, a load that must quantize into a target whose adapter cannot here."""
    why = adapter.quantize_unsupported(target) if adapter is not None else None
    if why:
        raise UnsupportedTensorError(
            f"key {fqn!r}: the checkpoint holds {stored} whose bits this {adapter.type_name(target)} "
            f"target cannot take as they are (another format or config, or a shard that cuts its "
            f"blocks), so it would have to be quantized: {why}")


def _amax_chunk(adapter: Adapter | None, placed: Placed) -> Chunk | None:
    """The whole tensor, for a shard of a target whose per-tensor scale needs the global amax:
    every rank reads it all and computes the same amax, with no collective."""
    if adapter is None or not adapter.needs_global_amax(placed.local):
        return None
    whole = placed.whole or full_chunk(placed.global_shape)  # (one member's, for a member of a group)
    return whole if placed.chunk != whole else None
