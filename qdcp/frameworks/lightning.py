"""Lightning: ``ModelParallelStrategy`` (FSDP2) checkpoints of quantized tensors with qdcp (docs/frameworks.md).

Lightning's ``ModelParallelStrategy`` (pytorch-lightning 2.6) writes a sharded checkpoint (DCP files
plus ``meta.pt``) with DCP's ``save`` / ``load``, no planner, and refuses a ``CheckpointIO`` plugin.
``QuantizedFabricStrategy`` (``Fabric(strategy=...)``) and ``QuantizedTrainerStrategy``
(``Trainer(strategy=...)``) override the narrowest public methods above Lightning's private DCP
calls, ``save_checkpoint`` / ``load_checkpoint``, redoing only the sharded branch (same files, same
order) with qdcp's planners (``overwrite=True``, objects loaded ``weights_only=True``; override
``save_planner`` / ``load_planner`` for others). Private Lightning names are imported (so checked)
below. They subclass the ``lightning_fabric`` / ``pytorch_lightning`` classes, not ``lightning.*``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning_fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning_fabric.strategies.fsdp import _is_sharded_checkpoint
from lightning_fabric.strategies.model_parallel import _has_dtensor_modules
from lightning_fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning_fabric.utilities.load import _METADATA_FILENAME
from lightning_fabric.utilities.types import _Stateful
from pytorch_lightning.strategies import ModelParallelStrategy as TrainerModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.nn import Module
from torch.optim import Optimizer

from qdcp.planning.load import QuantizedLoadPlanner
from qdcp.planning.save import QuantizedSavePlanner

__all__ = ["QuantizedFabricStrategy", "QuantizedTrainerStrategy", "save_sharded", "load_sharded"]


def _one_model(state: Any) -> tuple[str, Module] | None:
    """The (key, module) of the one FSDP2/DTensor model in ``state``; None where Lightning would
    refuse the state (no model, several) or not take its sharded path (a lone module)."""
    if not isinstance(state, dict):
        return None
    models = [(k, v) for k, v in state.items() if _has_dtensor_modules(v)]
    return models[0] if len(models) == 1 else None


def save_sharded(tensors: dict[str, Any], metadata: dict[str, Any], path: Path, rank: int,
                 planner: QuantizedSavePlanner) -> None:
    """Lightning's sharded layout at ``path``: ``tensors`` (state dicts) through ``dcp.save`` with
    ``planner``, then ``metadata`` in ``meta.pt`` by rank 0. As Lightning does, a file at ``path``
    (a single-file checkpoint) gives way to the directory, and a checkpoint there is written over."""
    if path.is_file():
        path.unlink(missing_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(tensors, checkpoint_id=path, planner=planner)
    if rank == 0:
        torch.save(metadata, path / _METADATA_FILENAME)


def load_sharded(path: Path, state: dict[str, Any], model_key: str, strict: bool,
                 weights_only: bool | None, load_planner) -> dict[str, Any]:
    """Fill ``state`` from Lightning's sharded checkpoint at ``path``: ``state[model_key]``, then each
    optimizer, through ``dcp.load`` with a ``load_planner()`` each; other keys from ``meta.pt``.
    Returns what ``meta.pt`` holds beyond ``state``'s keys."""
    model = state[model_key]
    model_state = {model_key: get_model_state_dict(model)}
    dcp.load(model_state, checkpoint_id=path, planner=load_planner())
    model.load_state_dict(model_state[model_key], strict=strict)
    optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
    for key, optimizer in optimizers.items():
        optim_state = {key: get_optimizer_state_dict(model, optimizer)}
        dcp.load(optim_state, checkpoint_id=path, planner=load_planner())
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_state[key],
                                 options=StateDictOptions(cpu_offload=True))
    metadata = torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
    wanted = state.keys() - {model_key} - optimizers.keys()
    _validate_keys_for_strict_loading(wanted, metadata.keys(), strict=strict)
    for key in wanted & metadata.keys():
        state[key] = metadata.pop(key)
    return metadata


class _Planners:
    """The planners of a quantized strategy's DCP calls (override for other flags)."""

    def save_planner(self) -> QuantizedSavePlanner:
        """A fresh save planner: qdcp's, writing over a checkpoint in place as Lightning does."""
        return QuantizedSavePlanner(overwrite=True)

    def load_planner(self) -> QuantizedLoadPlanner:
        """A fresh load planner: qdcp's, DCP's defaults otherwise (in place)."""
        return QuantizedLoadPlanner()


class QuantizedFabricStrategy(_Planners, FabricModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` saving and loading sharded checkpoints with qdcp's planners."""

    def save_checkpoint(self, path, state, storage_options=None, filter=None) -> None:
        """``fabric.save``: Lightning's sharded checkpoint, written through qdcp's save planner."""
        found = _one_model(state)
        if found is None or storage_options is not None or filter is not None \
                or not self._save_distributed_checkpoint:
            return super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        path = Path(self.broadcast(path))
        model = found[1]
        options = StateDictOptions(cpu_offload=True)
        tensors, metadata = {}, {}
        for key, obj in state.items():
            if isinstance(obj, Module):
                tensors[key] = get_model_state_dict(obj, options=options)
            elif isinstance(obj, Optimizer):
                tensors[key] = get_optimizer_state_dict(model, obj, options=options)
            else:
                metadata[key] = obj.state_dict() if isinstance(obj, _Stateful) else obj
        save_sharded(tensors, metadata, path, self.global_rank, self.save_planner())
        return None

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None) -> dict[str, Any]:
        """``fabric.load``: a sharded checkpoint read through qdcp's load planner (others: Lightning's)."""
        path = Path(self.broadcast(path))
        found = _one_model(state)
        if found is None or not _is_sharded_checkpoint(path):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        return load_sharded(path, state, found[0], strict, weights_only, self.load_planner)


class QuantizedTrainerStrategy(_Planners, TrainerModelParallelStrategy):
    """The Trainer's ``ModelParallelStrategy`` saving and loading sharded checkpoints with qdcp's planners."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        """``trainer.save_checkpoint`` / ``ModelCheckpoint``: Lightning's sharded checkpoint through qdcp."""
        if storage_options is not None or not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        path = Path(self.broadcast(filepath))
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{i}"] = optim_state
        save_sharded(tensors, checkpoint, path, self.global_rank, self.save_planner())
        return None

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        """Resuming (``ckpt_path=``): a sharded checkpoint read through qdcp's load planner."""
        path = Path(self.broadcast(checkpoint_path))
        state = {"state_dict": self.model, **{f"optimizer_{i}": o for i, o in enumerate(self.optimizers)}}
        if _one_model(state) is None or not _is_sharded_checkpoint(path):
            return super().load_checkpoint(path, weights_only=weights_only)
        assert self.lightning_module is not None
        return load_sharded(path, state, "state_dict", self.lightning_module.strict_loading, weights_only,
                            self.load_planner)
