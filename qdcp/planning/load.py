"""The load planner: DCP's default load planner, with quantized targets and entries loaded by actions."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import threading
import warnings
from functools import partial

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.tensor import DTensor

from qdcp import checksums as sums
from qdcp import spec as qspec
from qdcp.dcp_copies import pre_2_4_state_dict, read_items
from qdcp.errors import CheckpointFormatError
from qdcp.io.torch_save import load_object
from qdcp.layouts import narrow
from qdcp.planning.actions import ItemRead, LoadAction, Temporaries
from qdcp.planning.key_plans import GroupTarget, KeyPlan, KeyPlanner
from qdcp.planning.placement import planning
from qdcp.planning.save import _check_instance
from qdcp.planning.shadows import Shadows
from qdcp.planning.verifier import ReadVerifier

__all__ = ["QuantizedLoadPlanner"]


class QuantizedLoadPlanner(DefaultLoadPlanner):
    """A :class:`~torch.distributed.checkpoint.DefaultLoadPlanner` that fills whatever the target holds
    (docs/api.md, *QuantizedLoadPlanner*): quantized or plain targets, from raw, dequantized or
    plain entries, at any sharding, updated in place. ``weights_only`` (default True) loads objects
    with ``torch.load(weights_only=True)``. ``checksums``: every item read whole is checked against
    the save's record, unless the storage reader verifies every item itself. ``atomic``: a failed
    load leaves every target as it was (:mod:`qdcp.planning.shadows`): this rank's targets are filled
once its last read is in, or, with ``copy_in_later``, only when the caller calls :meth:`copy_in`
(``qdcp.load`` does once ``dcp.load`` returned: every rank's reads are in; not with a ``Stateful``
value, whose ``load_state_dict`` ``dcp.load`` itself calls). ``loaded_keys`` and
    ``missing_keys`` say which target keys the checkpoint had; a partial load matching none warns.

    DCP calls, in order, on every rank: ``set_up_planner`` (every target key planned against the
    metadata: ``_actions`` by target key, ``_by_item`` the action each planned item name feeds,
    ``_handled`` the checkpoint keys they account for; keys left in ``state_dict`` go DCP's own
    way); ``create_local_plan`` (DCP's reads plus each action's); ``finish_plan`` (``_pending``
    counts each action's reads); then per read ``resolve_tensor`` and ``commit_tensor`` (checksum;
    the action's ``finish`` after its last read, and a group's ``members_loaded`` after its last
    member), or ``load_bytes`` for objects. Idle temporaries are dropped after the last read.
    """

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False, weights_only: bool = True, checksums: bool = True,
                 atomic: bool = False, copy_in_later: bool = False) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=flatten_sharded_tensors,
                         allow_partial_load=allow_partial_load)
        self.weights_only = weights_only
        self.checksums = bool(checksums)
        self.atomic = bool(atomic)
        self.copy_in_later = bool(copy_in_later) and self.atomic
        self._lock = threading.Lock()
        self._temporaries = Temporaries()
        self._start(ReadVerifier(None))

    def _start(self, verify: ReadVerifier) -> None:
        """A load's state, empty (made again by each ``set_up_planner``)."""
        self._verify = verify
        self._shadows = Shadows() if self.atomic else None
        self._narrowed: dict[str, torch.Tensor] = {}  # plain shadows remade in the stored dtype
        self._streams: set = set()  # CUDA streams with copies from pinned buffers left running
        self._reads_left = 0
        self.loaded_keys: list[str] = []   #: target keys the checkpoint holds (after planning)
        self.missing_keys: list[str] = []  #: target keys it lacks (a partial load skips them)
        #: checkpoint entries no rank's target asked for (after global planning, on the coordinator only)
        self.unread_keys: list[str] = []
        self.read_bytes = 0  #: bytes of the items this rank's plan reads (after ``finish_plan``)
        self._actions: dict[str, LoadAction] = {}
        self._by_item: dict[str, _Dest] = {}
        self._handled: set[str] = set()
        self._pending: dict[str, int] = {}  # action key -> its reads yet to come
        self._groups: dict[str, GroupTarget] = {}  # action key -> its group, where filled member by member
        self._group_left: dict[int, int] = {}  # id(group) -> its member actions yet to finish

    @property
    def hashed_items(self) -> int:
        """Items this planner hashed itself in the last load: those it reads whole, unless the
        storage reader verifies every item (qdcp's readers do, as they read: 0 then)."""
        return self._verify.hashed

    def changed_note(self, read_item: ReadItem, written: bool) -> str:
        """What this load has changed in the targets so far, for a storage reader's error about
        ``read_item``'s corrupt bytes (``written``: they went into ``resolve_tensor``'s buffer)."""
        key, buffered = self._target_of(read_item)
        return self._verify.changed(key, written and not buffered)

    def _target_of(self, read_item: ReadItem) -> tuple[str, bool]:
        """The target key ``read_item`` fills, and whether it arrives in a temporary of its action's
        (the target written only when the action finishes)."""
        hit = self._by_item.get(read_item.dest_index.fqn)
        if hit is None:
            return read_item.dest_index.fqn, False
        return hit.action.fqn, hit.read.dest.temporary

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        _check_instance(self, QuantizedLoadPlanner)
        _check_is_load(metadata)
        with qspec.no_gc():
            super().set_up_planner(state_dict, metadata, is_coordinator)
        # the one rule: a reader that verifies every item says so (qdcp's); with any other, this planner does
        reader_verifies = getattr(metadata.storage_meta, "verifies_items", False)
        with planning():
            if not reader_verifies:  # qdcp's readers check the chunks themselves; DCP's trusts them
                qspec.check_chunk_geometry(metadata)
            record = sums.record(metadata) if self.checksums and not reader_verifies else None
            keys = KeyPlanner(metadata, allow_partial_load=self.allow_partial_load)
        self._start(ReadVerifier(record, atomic=self.atomic))
        self._target_keys = list(self.state_dict)
        with planning(), _missing_key_hint(self._target_keys, metadata, keys.specs):
            if self._shadows is not None:
                self.state_dict = self._shadows.of_dict(self.state_dict)
            for fqn, target in list(self.state_dict.items()):
                plan = keys.plan_key(fqn, target)
                found = fqn in metadata.state_dict_metadata or fqn in keys.specs or \
                    (plan is not None and bool(plan.actions or plan.handled))
                (self.loaded_keys if found else self.missing_keys).append(fqn)
                if plan is not None:
                    self._take(fqn, plan)
        self._specs = keys.specs
        self._temporaries = keys.temporaries
        if self.allow_partial_load:
            _report_partial(self.loaded_keys, self.missing_keys, metadata, keys.specs)

    def _take(self, fqn: str, plan: KeyPlan) -> None:
        del self.state_dict[fqn]
        self.state_dict.update(plan.to_dcp)
        self._handled.update(plan.handled)
        if fqn not in plan.to_dcp:
            self._handled.add(fqn)
        if plan.group is not None:
            self._group_left[id(plan.group)] = len(plan.actions)
        for action in plan.actions:
            self._actions[action.fqn] = action
            self._by_item.update({r.item: _Dest(action, r) for r in action.reads})
            if plan.group is not None:
                self._groups[action.fqn] = plan.group

    def create_local_plan(self) -> LoadPlan:
        with planning():
            if self.flatten_state_dict:
                self._detect_pre_2_4_keys()
            with _missing_key_hint(self._target_keys, self.metadata, self._specs):
                plan = create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
            items = list(plan.items)
            for action in self._actions.values():
                for read in action.reads:
                    items.extend(_reads_of(action.fqn, read))
            return dataclasses.replace(plan, items=items)

    def _detect_pre_2_4_keys(self) -> None:
        """DCP's fallback for checkpoints saved before torch 2.4, with the keys qdcp plans counted as present."""
        owned = {qspec.component_fqn(f, c.name) for f, e in self._specs.items() for c in e.components}
        found = pre_2_4_state_dict(self.metadata, self.state_dict, self.original_state_dict, self._handled | owned)
        if found is not None:
            self.state_dict = {k: v for k, v in found[0].items() if k not in self._handled}
            if self._shadows is not None:  # rebuilt from the user's state dict: shadow those too
                self.state_dict = self._shadows.of_dict(self.state_dict)
            self.mappings = found[1]

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        with planning():
            self.unread_keys = _unread_entries(self.metadata, self._specs, global_plan)
            return super().create_global_plan(global_plan)

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        with planning():
            self.read_bytes = _read_bytes(self.metadata, new_plan.items)
            self._pending = dict.fromkeys(self._actions, 0)
            for item in new_plan.items:
                hit = self._by_item.get(item.dest_index.fqn)
                if hit is not None:
                    self._pending[hit.action.fqn] += 1
            self._reads_left = len(new_plan.items)
            self._verify.plan(new_plan.items)
            if self._shadows is not None:
                written = self._written_bytes(new_plan.items)
                self._shadows.fill_unread(written)
                self._narrowed = self._narrow_shadows(new_plan.items, written)
        if not new_plan.items:
            self._all_read()
        return super().finish_plan(new_plan)

    def _written_bytes(self, items: list[ReadItem]) -> dict[int, int]:
        """Bytes the planned reads write into each storage (by ``data_ptr``) in place: where DCP's
        reads land and actions' reads into the target's own buffers, not into temporaries."""
        written: dict[int, int] = {}
        for item in items:
            if item.type == LoadItemType.BYTE_IO:
                continue
            hit = self._by_item.get(item.dest_index.fqn)
            if hit is not None and hit.read.component is not None:
                continue  # a temporary; the action computes the target's buffers at finish
            dest = self._destination(item)
            ptr = dest.untyped_storage().data_ptr()
            written[ptr] = written.get(ptr, 0) + dest.numel() * dest.element_size()
        return written

    def _narrow_shadows(self, items: list[ReadItem], written: dict[int, int]) -> dict[str, torch.Tensor]:
        """``{target key: its shadow's new local buffer}`` for the plain targets DCP's own path
        fills whole from stored items of a narrower dtype (:meth:`Shadows.in_stored_dtype`): the
        reads go there, unconverted (``_destination``)."""
        stored: dict[str, set] = {}
        for item in items:
            if item.type != LoadItemType.BYTE_IO and item.dest_index.fqn not in self._by_item:
                md = self.metadata.state_dict_metadata.get(item.storage_index.fqn)
                dtype = md.properties.dtype if isinstance(md, TensorStorageMetadata) else None
                stored.setdefault(item.dest_index.fqn, set()).add(dtype)
        narrowed = {}
        for fqn, dtypes in stored.items():
            shadow, dtype = self.state_dict.get(fqn), next(iter(dtypes)) if len(dtypes) == 1 else None
            if not isinstance(shadow, torch.Tensor) or dtype is None or dtype.itemsize >= shadow.dtype.itemsize \
                    or (isinstance(shadow, DTensor) and any(p.is_partial() for p in shadow.placements)):
                continue
            local = self._shadows.in_stored_dtype(shadow, dtype, written)
            if local is not None:
                narrowed[fqn] = local
        return narrowed

    def _copy_in(self, dest: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Copy a checked host buffer on to its destination; from a pinned buffer to a device
        without blocking (waited for after the last read, :meth:`_all_read`)."""
        if dest.device.type == "cuda" and dest.dtype == host.dtype and host.is_pinned():
            dest.copy_(host, non_blocking=True)
            with self._lock:
                self._streams.add(torch.cuda.current_stream(dest.device))
        else:
            dest.copy_(host)
        return dest

    def _one_read(self) -> None:
        """Count a read done (checked, and its action finished); after the last, the shadows go in."""
        with self._lock:
            self._reads_left -= 1
            last = self._reads_left == 0
        if last:
            self._all_read()

    def _all_read(self) -> None:
        """Every read is in: the copies left running finish (the load returns with the targets
        filled, as DCP's does), then the shadows go in."""
        streams, self._streams = self._streams, set()
        for stream in streams:
            stream.synchronize()
        self._temporaries.clear()  # every action has finished: no idle temporary is kept past the load
        if self._shadows is not None and not self.copy_in_later:
            self._shadows.apply()

    def copy_in(self, state_dict: dict) -> None:
        """With ``copy_in_later``: fill the targets from the load's shadows, once ``dcp.load`` has
        returned on every rank (a failed load is never copied in). ``state_dict``: the one given to
        ``dcp.load``, which loads into a copy of its top level: objects read go there, and its
        top-level values are put back into ``state_dict`` as ``dcp.load`` itself does."""
        if self._shadows is not None and self.copy_in_later:
            self._shadows.apply()
            state_dict.update({k: v for k, v in self.original_state_dict.items() if k in state_dict})

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self._verify.buffer(read_item, self._destination(read_item))

    def _destination(self, read_item: ReadItem) -> torch.Tensor:
        hit = self._by_item.get(read_item.dest_index.fqn)
        if hit is None:
            local = self._narrowed.get(read_item.dest_index.fqn)
            if local is not None:  # DCP's lookup (the local tensor) and narrowing, into the remade buffer
                return narrow(local, (tuple(read_item.dest_offsets), tuple(read_item.lengths)))
            return super().resolve_tensor(read_item)
        return narrow(hit.read.buffer, (tuple(read_item.dest_offsets), tuple(read_item.lengths)))

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        hit = self._by_item.get(read_item.dest_index.fqn)
        if self._verify.check(read_item, tensor, *self._target_of(read_item)):
            tensor = self._copy_in(self._destination(read_item), tensor)  # read into a host buffer to check it
        if hit is None:
            super().commit_tensor(read_item, tensor)
        else:
            self._finish_read(hit.action)
        self._one_read()

    def _finish_read(self, action: LoadAction) -> None:
        if self._count_down(self._pending, action.fqn):
            action.finish()
            self._verify.finished(action.fqn)
            action.release()
            group = self._groups.get(action.fqn)
            if group is not None and self._count_down(self._group_left, id(group)):
                group.adapter.members_loaded(group.target)

    def _count_down(self, counts: dict[str, int], key: str) -> bool:
        with self._lock:
            counts[key] -= 1
            return counts[key] == 0

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self._verify.check_bytes(read_item, value.getbuffer(), read_item.dest_index.fqn)
        fqn = read_item.dest_index.fqn
        obj = load_object(value, fqn, self.weights_only)
        if self.flatten_state_dict:
            put = partial(set_element, self.original_state_dict, self.mappings[fqn], obj)
        else:  # atomic: into the user's dict, not the planner's copy of it
            target = self.state_dict if self._shadows is None else self.original_state_dict
            put = partial(target.__setitem__, fqn, obj)
        if self._shadows is not None:
            self._shadows.defer(put)
        else:
            put()
        self._one_read()


@dataclasses.dataclass(frozen=True)
class _Dest:
    """Where a planned item name's reads go: the action and its read."""

    action: LoadAction
    read: ItemRead


def _check_is_load(metadata) -> None:
    """Refuse a save's arguments: ``dcp.save`` gives a planner a ``StorageMeta`` (or, through DCP's
    fallback for planners without that argument, a bool) where a load gives the checkpoint's Metadata."""
    if metadata is not None and not isinstance(metadata, Metadata):
        raise TypeError(
            f"QuantizedLoadPlanner is a load planner, but it was set up with a "
            f"{type(metadata).__name__} instead of a checkpoint's Metadata: it was passed to dcp.save "
            f"or dcp.async_save. Pass QuantizedSavePlanner() there, QuantizedLoadPlanner() to dcp.load.")


def _report_partial(loaded: list[str], missing: list[str], metadata: Metadata, specs) -> None:
    """A partial load that matched none of the target's keys warns: the state dict's nesting (or
    the checkpoint) is most likely not the one meant."""
    if loaded or not missing:
        return
    stored = sorted(qspec.entry_keys(metadata.state_dict_metadata, specs))
    warnings.warn(
        f"QuantizedLoadPlanner(allow_partial_load=True) matched 0 of the {len(missing)} target keys "
        f"(e.g. {missing[:3]}) in the checkpoint, which holds {len(stored)} keys (e.g. {stored[:3]}): "
        f"nothing was loaded. Check the state dict's nesting against the checkpoint's keys "
        f"(qdcp.describe(path) lists them).", UserWarning, stacklevel=2)


@contextlib.contextmanager
def _missing_key_hint(target_keys: list[str], metadata: Metadata, specs):
    """DCP's ``Missing key in checkpoint state_dict: K.`` with the nesting that matches, where one does."""
    try:
        yield
    except RuntimeError as e:
        if not str(e).startswith("Missing key in checkpoint state_dict"):
            raise
        _refuse_orphans(target_keys, metadata, specs)
        hint = _nesting_hint(target_keys, qspec.entry_keys(metadata.state_dict_metadata, specs))
        if not hint:
            raise
        raise RuntimeError(f"{e} {hint}") from None


def _refuse_orphans(target_keys: list[str], metadata: Metadata, specs) -> None:
    """A target key the checkpoint stores component items of but has no spec entry for: damage
    (as the readers without a target say), not a missing key."""
    owners = qspec.stored_components(metadata.state_dict_metadata)
    for key in target_keys:
        if key not in specs and key in owners:
            raise CheckpointFormatError(
                f"key {key!r}: its component items are stored but no spec entry describes them: the "
                f"checkpoint's spec is damaged or missing (restore it from a good copy; `qdcp verify` lists "
                f"every problem)")


def _nesting_hint(target: list[str], stored: list[str]) -> str:
    """Where every target key the checkpoint lacks is a checkpoint key under one prefix (or is one
    prefix more than a checkpoint key), what that means: a flat state dict against a nested
    checkpoint (``{"model": model.state_dict()}``), or the other way round."""
    have = set(stored)
    missing = [k for k in target if k not in have]
    if not missing:
        return ""
    first = missing[0]
    for prefix in sorted({s[:-len(first) - 1] for s in have if s.endswith("." + first)}, key=len):
        if all(f"{prefix}.{k}" in have for k in missing):
            nested = "sd"
            for part in reversed(prefix.split(".")):
                nested = f'{{"{part}": {nested}}}'
            return (f"The checkpoint holds every missing key under {prefix + '.'!r} (e.g. {prefix + '.' + first!r}): "
                    f"it was saved nested; load into {nested} (sd: this state dict), nested as it was saved.")
    parts = first.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i]) + "."
        if all(k.startswith(prefix) and k[len(prefix):] in have for k in missing):
            inner = "sd" + "".join(f"[{p!r}]" for p in parts[:i])
            return (f"The checkpoint holds every missing key without the prefix {prefix!r} (e.g. "
                    f"{first[len(prefix):]!r}): it was saved flat; load into {inner} (sd: this state dict).")
    return ""


def _unread_entries(metadata: Metadata, specs, global_plan: list[LoadPlan]) -> list[str]:
    """The checkpoint's entries (of stored items) that no rank's plan reads an item of."""
    owner = {qspec.component_fqn(e.fqn, c.name): e.fqn for e in specs.values() for c in e.components}
    read = {owner.get(i.storage_index.fqn, i.storage_index.fqn) for plan in global_plan for i in plan.items}
    return [k for k in dict.fromkeys(owner.get(f, f) for f in metadata.state_dict_metadata) if k not in read]


def _read_bytes(metadata: Metadata, items: list[ReadItem]) -> int:
    """The bytes ``items`` read: a tensor item's elements, an object's stored length."""
    total = 0
    for item in items:
        md = metadata.state_dict_metadata.get(item.storage_index.fqn)
        if isinstance(md, TensorStorageMetadata):
            total += math.prod(item.lengths) * md.properties.dtype.itemsize
        else:
            total += getattr((metadata.storage_data or {}).get(item.storage_index), "length", 0)
    return total


def _reads_of(key: str, read: ItemRead) -> list[ReadItem]:
    """DCP's reads for one :class:`ItemRead`, under its planned item name; refuses saved chunks
    that leave holes in (or overlap) what is needed."""
    reads = read_items(read.stored, read.md, read.chunk)
    if read.stored != read.item:  # another key's item: this action's own destination name
        reads = [dataclasses.replace(r, dest_index=MetadataIndex(read.item, r.dest_index.offset, r.dest_index.index))
                 for r in reads]
    covered = sum(math.prod(r.lengths) for r in reads)
    if covered != math.prod(read.chunk[1]):
        raise CheckpointFormatError(
            f"key {key!r}: the checkpoint's chunks of {read.item!r} cover {covered} of the "
            f"{math.prod(read.chunk[1])} elements this rank needs (holes or overlaps).")
    return reads
