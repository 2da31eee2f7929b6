"""``QuantizedHFReader``: a DCP ``StorageReader`` over a Hugging Face safetensors directory.

    dcp.load(state, storage_reader=qdcp.QuantizedHFReader(path), planner=qdcp.QuantizedLoadPlanner())

The directory's layout names its quantized entries; they are presented as qdcp raw entries (a
spec in the metadata, one item per component), so the load planner fills any target at any world
size. Items stored as presented are read by byte range; the others (swizzled scales, packed
integers) are computed from their whole tensors. Nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from qdcp import spec as qspec
from qdcp.hf.directory import HFDirectory
from qdcp.hf.layout import Item, layout_of
from qdcp.storage.reader import metadata_error_told


class QuantizedHFReader(StorageReader):
    """A DCP ``StorageReader`` over a Hugging Face safetensors directory (torchao's layout,
    compressed-tensors', or plain); use it with :class:`qdcp.QuantizedLoadPlanner`."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self._items: dict[str, Item] = {}
        self._dir: HFDirectory | None = None

    # --- StorageReader
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.isdir(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Present the directory to DCP: the quantized entries its layout names (the layout its
        config says) as qdcp raw entries, every other tensor plain. (A directory has no rank-local
        metadata: DCP's fallback call, ``rank=``, presents it again, or raises its error again.)"""
        return metadata_error_told(self, kwargs.get("rank"), self._present)

    def _present(self) -> Metadata:
        self._dir = d = HFDirectory.scan(self.path)
        specs: dict[str, qspec.EntrySpec] = {}
        items: dict[str, Item] = {}
        consumed: set[str] = set()
        for entry in layout_of(d.config).entries(d):
            specs[entry.spec.fqn] = entry.spec
            consumed |= entry.consumed
            items.update({qspec.component_fqn(entry.spec.fqn, n): item for n, item in entry.items.items()})
        for name, (_, shape, dtype) in d.tensors.items():
            if name not in consumed:
                items[name] = Item(shape, dtype, tensor=name)
        self._items = items
        sd_md = {fqn: TensorStorageMetadata(TensorProperties(dtype=i.dtype), torch.Size(i.shape),
                                            [ChunkStorageMetadata(torch.Size([0] * len(i.shape)), torch.Size(i.shape))])
                 for fqn, i in items.items()}
        return Metadata(state_dict_metadata=sd_md, planner_data={qspec.PLANNER_DATA_KEY: qspec.dumps(specs)},
                        storage_data={})

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._dir is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Read each requested part into the planner's buffer: by byte range where the item is a
        file tensor, else from the item computed whole (straight into the buffer when the part is
        the item, else once per plan)."""
        handles: dict[str, Any] = {}
        built: dict[str, torch.Tensor] = {}
        with contextlib.ExitStack() as files:
            def handle(name: str):
                file = self._dir.tensors[name][0]
                if file not in handles:
                    handles[file] = files.enter_context(safe_open(file, "pt"))
                return handles[file]

            def whole(name: str) -> torch.Tensor:
                return handle(name).get_tensor(name)

            for req in plan.items:
                fqn = req.storage_index.fqn
                item = self._items[fqn]
                region = tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))
                target = planner.resolve_tensor(req).detach()
                if item.tensor is not None:
                    value = handle(item.tensor).get_slice(item.tensor)[region] if region else whole(item.tensor)
                    target.copy_(value.reshape(target.shape))
                elif fqn not in built and tuple(req.lengths) == item.shape and target.is_contiguous() \
                        and target.dtype == item.dtype:
                    value = item.build(whole, target)
                    if value.data_ptr() != target.data_ptr():
                        target.copy_(value.reshape(target.shape))
                else:
                    if fqn not in built:
                        built[fqn] = item.build(whole, None)
                    target.copy_(built[fqn][region].reshape(target.shape))
                planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut
