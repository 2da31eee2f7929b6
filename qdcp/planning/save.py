"""The save planner: DCP's save call order, with quantized entries planned by an :class:`EntryPlanner`
(:mod:`~qdcp.planning.save_entries`) and items hashed and ranks compared by :class:`qdcp.checksums.SaveHashes`."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from qdcp import checksums as sums
from qdcp import dcp_copies
from qdcp import spec as qspec
from qdcp.planning.placement import planning
from qdcp.planning.save_entries import DequantizeChoice, EntryPlanner, fall_back, merge_specs
from qdcp.staging.new_empty import register_new_empty
from qdcp.storage import refuse_existing_checkpoint

__all__ = ["QuantizedSavePlanner", "DequantizeChoice"]

_SUMS_KEY = "__qdcp_sums__"  # per-rank item hashes and shared component items; never saved as such


class QuantizedSavePlanner(DefaultSavePlanner):
    """A :class:`~torch.distributed.checkpoint.DefaultSavePlanner` that also saves quantized tensors
    (docs/api.md, *QuantizedSavePlanner*).

    Args:
        dequantize: False (default) stores quantized entries raw; True stores them as plain tensors
            of their logical dtype; a callable ``(fqn, tensor) -> bool`` chooses per entry.
        dequantize_dtype: dtype of dequantized entries (default: each entry's logical dtype).
        checksums: with a storage writer that does not hash what it writes (DCP's own), hash every
            item here, device tensors copied to the host then and kept until written (default
            True). qdcp's writers hash as they write (``QdcpStorageMeta.hashes_items``).
        overwrite: with a storage writer of DCP's own, a checkpoint already at that local path is
            refused (``FileExistsError``, before anything is written) unless True. qdcp's writers
            decide this by their own ``overwrite``.
        check_replicas: every rank's copy of a replicated chunk is hashed and compared before
            anything is written; diverged replicas raise :class:`~qdcp.ReplicaMismatchError`.
        **kwargs: passed to ``DefaultSavePlanner`` (``flatten_state_dict``, ``enable_plan_caching``...).

    DCP calls, in order: ``set_up_planner`` (the quantized entries planned and taken out of
    ``state_dict``); ``create_local_plan`` (DCP's items plus the entries', the spec document in
    ``planner_data``, this save's hashes riding beside it); on the coordinator
    ``create_global_plan`` (:func:`~qdcp.planning.save_entries.fall_back`, the hashes compared, the
    specs merged by :func:`~qdcp.planning.save_entries.merge_specs`); ``finish_plan`` (the checksum
    record joins the metadata); then ``resolve_data`` per item (each entry's data, computed once,
    dropped once its last item is given).
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
        self._entries = EntryPlanner(dequantize, dequantize_dtype)
        self._hashes = sums.SaveHashes(self.checksums, self.check_replicas)
        self._ready: dict[MetadataIndex, torch.Tensor | bytes] = {}  # host copies, object bytes: as hashed, to write
        self._sums_record: dict | None = None  # the checksum record (coordinator), added by finish_plan

    # ``self=None``: DCP calls this by keyword, so ``planner=QuantizedSavePlanner`` (the class, no
    # ``()``) arrives here without a planner and is told so, not with Python's "missing 'self'"
    def set_up_planner(self=None, state_dict=None, storage_meta=None, is_coordinator=False) -> None:
        _check_instance(self, QuantizedSavePlanner)
        _check_is_save(storage_meta)
        if not self.overwrite:
            refuse_existing_checkpoint(storage_meta, type(self).__name__)
        with qspec.no_gc():
            super().set_up_planner(state_dict, storage_meta=storage_meta, is_coordinator=is_coordinator)
        self._entries = EntryPlanner(self.dequantize, self.dequantize_dtype)
        # qdcp's writers hash each item as they write it (no pass over the data, no device copy, here)
        by_writer = getattr(storage_meta, "hashes_items", False)
        self._hashes = sums.SaveHashes(self.checksums, self.check_replicas, by_writer)
        self._ready, self._sums_record = {}, None
        with planning():
            self._entries.plan(self.state_dict)

    def create_local_plan(self) -> SavePlan:
        with planning():
            plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
            entry_items = self._entries.items()
            planner_data: dict[str, Any] = dict(self.mappings) if self.flatten_state_dict else {}
            for item in entry_items:
                planner_data.setdefault(item.index.fqn, (item.index.fqn,))
            planner_data[qspec.PLANNER_DATA_KEY] = self._entries.spec_text()
            self.plan = SavePlan([*plan.items, *entry_items], planner_data=planner_data)
            mine = self._hashes.local(self.plan.items, self._entries.shared(), self._written)
            mine["per_shard"] = self._entries.per_shard()  # column cuts stored whole, and their fallback
            return dcp_copies.local_save_plan(self, self.plan, _SUMS_KEY, mine)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        with planning():
            riders = dcp_copies.take_riders(all_plans, _SUMS_KEY)
            all_plans = fall_back(all_plans, riders)  # a column cut whose rows' scales differ: per shard
            per_rank = self._hashes.check(riders)
            plans, metadata = super().create_global_plan(all_plans)
            self._sums_record = self._hashes.record(self.global_plan, per_rank, metadata)
            return plans, metadata

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's hook (its plan caching calls it too), with the ranks' spec documents merged into one
        (first, so that what the ranks disagree on is named before DCP validates the plans): DCP's
        own keeps one rank's planner_data. The documents are taken out of the plans for DCP's call
        and put back after it (DCP's plan caching keeps these plans and compares later ones)."""
        texts = dcp_copies.take_riders(all_plans, qspec.PLANNER_DATA_KEY)
        try:
            merged = merge_specs(texts)
            plans, metadata = super()._create_global_plan(all_plans)
        finally:
            for plan, text in zip(all_plans, texts):
                if text is not None:
                    plan.planner_data[qspec.PLANNER_DATA_KEY] = text
        planner_data = {**(metadata.planner_data or {}), qspec.PLANNER_DATA_KEY: merged}
        return plans, dataclasses.replace(metadata, planner_data=planner_data)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        # On the coordinator: the checksums join the Metadata that finish() writes. Added here, not
        # in create_global_plan, which returns (and plan caching keeps) what DCP's would.
        if self._sums_record is not None and getattr(self, "metadata", None) is not None:
            sums.attach(self.metadata, self._sums_record)
        plan = super().finish_plan(new_plan)
        # only what the writer will ask for is kept (DCP may have another rank write a replica)
        keep = {item.index for item in plan.items}
        self._ready = {index: data for index, data in self._ready.items() if index in keep}
        self._entries.expect([item for item in plan.items if item.index not in self._ready])
        return plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        ready = self._ready.pop(write_item.index, None)
        if ready is not None:
            return io.BytesIO(ready) if isinstance(ready, bytes) else ready
        data = self._item_data(write_item)
        self._entries.release(write_item)
        return data

    def _item_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = self._entries.data(write_item)
        return super().resolve_data(write_item) if data is None else data

    def _written(self, item: WriteItem) -> torch.Tensor | bytes:
        """Exactly what :meth:`resolve_data` will give the writer for ``item``, to hash. Objects
        are serialized once (kept for the writer); device data is copied to the host once (the
        copy the writer would make), kept for the writer."""
        data = self._item_data(item)
        if isinstance(data, io.BytesIO):
            data = self._ready[item.index] = data.getvalue()
        elif data.device.type != "cpu":
            data = self._ready[item.index] = data.detach().cpu()
            self._entries.release(item)  # the device data is not needed again
        return data


def _check_instance(planner: Any, cls: type) -> None:
    """Refuse a planner passed as its class (``planner=QuantizedSavePlanner``, without ``()``): DCP
    then calls its methods unbound, with the state dict (or nothing) in the planner's place."""
    if not isinstance(planner, cls):
        raise TypeError(f"planner={cls.__name__} is the class itself: pass {cls.__name__}(), an instance "
                        f"(e.g. planner=qdcp.{cls.__name__}())")


def _check_is_save(storage_meta) -> None:
    """Refuse a load's arguments: ``dcp.load`` gives a planner the checkpoint's ``Metadata`` where a
    save gives a ``StorageMeta`` (or None); ``dcp.save``'s fallback for planners without that
    argument would give a bool, which this planner never gets."""
    if storage_meta is not None and not isinstance(storage_meta, StorageMeta):
        raise TypeError(
            f"QuantizedSavePlanner is a save planner, but it was set up with a {type(storage_meta).__name__} "
            f"instead of a save's StorageMeta: it was passed to dcp.load. Pass QuantizedLoadPlanner() "
            f"there, QuantizedSavePlanner() to dcp.save / dcp.async_save.")
