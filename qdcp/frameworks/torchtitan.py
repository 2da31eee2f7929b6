"""torchtitan: a ``CheckpointManager`` that checkpoints quantized weights with qdcp (docs/frameworks.md).

torchtitan's ``CheckpointManager`` (torchtitan 0.3) calls DCP without a planner.
:class:`QuantizedCheckpointManager` is it with qdcp's planners, built by its own ``Config``::

    checkpoint = QuantizedCheckpointManager.Config(enable=True, folder="checkpoint", interval=500,
                                                   async_mode="async_with_pinned_mem")

Its seams: ``dcp_save`` / ``dcp_load`` (``overwrite=True``: torchtitan writes a step's folder in
place; quantized tensors staged by a :class:`~qdcp.QuantizedStager`), the model's state-dict cache
(:class:`QuantizedModelWrapper`), and ``_save_last_step`` (private, calling torchtitan's
``_create_checkpoint_id`` as its own does), whose model-only save writes plain ``export_dtype`` weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager, ModelWrapper
from torchtitan.tools.utils import GarbageCollection

from qdcp.adapters import find_adapter
from qdcp.planning.load import QuantizedLoadPlanner
from qdcp.planning.placement import place, with_local
from qdcp.planning.save import QuantizedSavePlanner
from qdcp.staging.stager import QuantizedStager

__all__ = ["QuantizedCheckpointManager", "QuantizedModelWrapper", "plain_weights"]


def _storages(t: torch.Tensor) -> tuple[int, ...]:
    """The storage addresses holding ``t``'s data (its inner buffers' for a quantized tensor)."""
    placed = place(t)
    local = placed.local if placed is not None else t
    adapter = find_adapter(local)
    buffers = adapter.inner_buffers(local).values() if adapter is not None else (local,)
    return tuple(b.untyped_storage().data_ptr() for b in buffers)


class QuantizedModelWrapper(ModelWrapper):
    """torchtitan's ``ModelWrapper`` whose cache accepts quantized weights: an entry whose storage
    moved is refreshed in place where it is a plain tensor (torchtitan's rule), replaced where it
    is a quantized one (which has no single storage to copy into)."""

    def state_dict(self) -> dict[str, Any]:
        """The flattened model state dict, its tensors' storage kept stable across calls."""
        for key, value in self._get_state_dict().items():
            cached = self.cached_state_dict.get(key)
            if cached is None or type(cached) is not type(value) or cached.shape != value.shape \
                    or cached.dtype != value.dtype:
                self.cached_state_dict[key] = value
            elif isinstance(value, torch.Tensor) and _storages(cached) != _storages(value):
                if find_adapter(place(value).local) is None:
                    cached.copy_(value)
                else:
                    self.cached_state_dict[key] = value
        return self.cached_state_dict


def _plain(value: Any, dtype: torch.dtype) -> Any:
    placed = place(value)
    if placed is None:
        return value
    adapter = find_adapter(placed.local)
    if adapter is None:
        local = placed.local
    else:
        inner = adapter.unwrap(placed.local)
        local = inner if inner is not None else adapter.dequantize(placed.local, dtype)
    if local.is_floating_point() and local.dtype != dtype:
        local = local.to(dtype)
    return local if not placed.is_dtensor else with_local(value, local)


def plain_weights(state_dict: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``state_dict`` with every quantized weight as a plain tensor of ``dtype`` (a training
    wrapper's high-precision tensor, a quantized tensor's values computed by its adapter) and
    every floating-point tensor cast to ``dtype``; DTensors stay DTensors, other values as they are."""
    return {k: _plain(v, dtype) for k, v in state_dict.items()}


class QuantizedCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` saving and loading quantized weights with qdcp (same
    config, folders and behaviour; qdcp's checkpoints)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.states[MODEL] = QuantizedModelWrapper(self.states[MODEL].model)
        if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # what torchtitan's DefaultStager does (pinned, reused, shared memory for the process
            # that writes, copied in a background thread), for quantized tensors too
            self.stager = QuantizedStager(reuse_buffers=True, async_staging=True, share_memory=True)

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False):
        """torchtitan's ``dcp_save`` with qdcp's planner (and stager, for async saves)."""
        if to_hf:  # torchtitan's HF writer and conversion, given plain weights (_save_last_step)
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        planner = QuantizedSavePlanner(overwrite=True)
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, checkpoint_id=checkpoint_id, process_group=self.pg,
                                 planner=planner, async_stager=QuantizedStager(reuse_buffers=False))
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = dcp.async_save(state_dict, checkpoint_id=checkpoint_id, process_group=self.pg, planner=planner,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        else:
            ret = dcp.save(state_dict, checkpoint_id=checkpoint_id, planner=planner)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    @torch.no_grad()
    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """torchtitan's ``dcp_load`` with :class:`~qdcp.QuantizedLoadPlanner` (HF files: torchtitan's own)."""
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        dcp.load(state_dict, checkpoint_id=checkpoint_id, planner=QuantizedLoadPlanner(atomic=True))
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)
        return None

    def _save_last_step(self, curr_step: int) -> None:
        """The final save; a model-only one writes plain weights of ``export_dtype``."""
        if not self.last_save_model_only:
            return super()._save_last_step(curr_step)
        if self.last_save_in_hf and self.sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf is True, but sd_adapter is not provided.")
        states = plain_weights(self.states[MODEL].state_dict(), self.export_dtype)
        self.dcp_save(states, checkpoint_id=self._create_checkpoint_id(curr_step), async_mode=AsyncMode.DISABLED,
                      enable_garbage_collection=True, to_hf=self.last_save_in_hf)
        return None
