r"""The script every ``torchrun`` rank runs for ``tests/test_framework_torchtitan.py``.

    python -m torch.distributed.run --nproc-per-node N tests/torchtitan_worker.py COMMAND DIR

torchtitan's real ``CheckpointManager`` (its config, folders, ``ModelWrapper``, ``OptimizersContainer``,
async modes) checkpoints two FSDP2 model parts whose weights are what torchtitan's float8 converters put
in a state dict: a float8-training MLP (``WeightWithDynamicFloat8CastTensor``, FSDP2 float8 all-gather)
and float8 grouped experts (``Float8TrainingWeightWrapperTensor``; their grouped matmul needs triton,
so their gradients are made up). AdamW (torchtitan's container) on every weight.

Commands (``save``, ``load`` and ``stock`` run once for each of torchtitan's ``async_mode``\s,
MODE = ``disabled``, ``async``, ``async_with_pinned_mem``; sections ``save-MODE``, ``load-MODE``):

- ``save`` (2 ranks): one step, then ``QuantizedCheckpointManager.save(curr_step=1)`` in MODE, and
  another step while an async checkpoint uploads; the gathered weights (wrappers' high-precision
  tensors) and optimizer states as staged are recorded.
- ``load`` (any N): fresh parts (other values, their own optimizer states) at N ranks,
  ``load(step=1)``: weights, optimizer states and the train step bit-identical to the record; the
  parameters are the same objects and still wrappers.
- ``export`` (2 ranks): ``save(curr_step=2, last_step=True)`` with ``last_save_model_only`` and
  ``export_dtype="bfloat16"``, as DCP files (section ``export``: read back by stock ``dcp.load``
  into plain bf16 tensors) and with ``last_save_in_hf`` (``export_hf``: torchtitan's HF writer and
  consolidation, a key-renaming state-dict adapter; read with safetensors): each weight equal to
  the wrapper's tensor cast to bf16.
- ``stock`` (2 ranks): torchtitan's own ``CheckpointManager``, and the same with only the
  model-cache fix, save and load in MODE: what happens is written to ``stock-MODE.json`` for the
  test to assert.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import HuggingFaceStorageReader  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torchtitan.components.checkpointer import MODEL, CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import ParamGroupConfig  # noqa: E402
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter  # noqa: E402

from dist_helpers import all_rows, init_torchrun_mesh  # noqa: E402
from quantized_cases import bits, differences  # noqa: E402
from training_cases import values  # noqa: E402
from training_dist_worker import build  # noqa: E402
from worker_results import RANK, WORLD, check, record_outcome, run, short  # noqa: E402

# isort: split
# qdcp last: its import registers new_empty for the torchao classes already imported, which the
# stock (recipe-less) async case below relies on for its float8 weights
from qdcp.frameworks.torchtitan import QuantizedCheckpointManager, QuantizedModelWrapper  # noqa: E402

MODES = ("disabled", "async", "async_with_pinned_mem")


class TrainState:
    """What torchtitan checkpoints of its trainer (a Stateful): the step."""

    def __init__(self, step: int = 0):
        self.step = step

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


WRAPPERS = {"WeightWithDynamicFloat8CastTensor", "Float8TrainingWeightWrapperTensor"}


def parts(seed: int, mesh):
    mlp, _ = build("float8", seed, mesh)
    moe, _ = build("moe_float8", seed, mesh)
    opt = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.01})],
        implementation="for-loop").build(model_parts=[mlp, moe])
    lrs = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=opt, training_steps=10)
    return [mlp, moe], opt, lrs


def train_step(model_parts, opt, lrs) -> None:
    mlp, moe = model_parts
    g = torch.Generator().manual_seed(7 + RANK)
    mlp(torch.randn(16, mlp[0].in_features, generator=g)).float().square().mean().backward()
    for p in moe.parameters():  # float8 grouped experts need triton to run: made-up gradients
        local = p._local_tensor
        p.grad = DTensor.from_local(torch.randn(local.shape, generator=g).to(local.dtype), p.device_mesh,
                                    p.placements, shape=p.shape, stride=p.stride())
    opt.step()
    lrs.step()
    opt.zero_grad()


def manager(cls, mode: str, root: str, model_parts, opt, lrs, ts, sd_adapter=None, **config):
    cfg = cls.Config(enable=True, folder="checkpoint", interval=1, async_mode=mode, **config)
    return cfg.build(dataloader=None, model_parts=model_parts, optimizers=opt, lr_schedulers=lrs,
                     states={"train_state": ts}, sd_adapter=sd_adapter, base_folder=os.path.join(root, mode))


def snapshot(model_parts, opt) -> dict:
    """Every weight's values and optimizer state, whole, on every rank."""
    out = {}
    for i, part in enumerate(model_parts):
        for k, v in part.state_dict().items():
            out[f"model{i}.{k}"] = _whole(v)
    for k, v in opt.state_dict().items():
        if isinstance(v, torch.Tensor):
            out[f"optim.{k}"] = _whole(v)
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    local = values(t).detach()
    return all_rows(local) if isinstance(t, DTensor) else local.clone()


def wrappers(model_parts) -> set[str]:
    return {type(p._local_tensor).__name__ for part in model_parts for p in part.parameters()}


def save(mode: str, root: str, mesh) -> None:
    model_parts, opt, lrs = parts(0, mesh)
    train_step(model_parts, opt, lrs)
    cm = manager(QuantizedCheckpointManager, mode, root, model_parts, opt, lrs, TrainState(1))
    cm.save(curr_step=1)
    cm.maybe_wait_for_staging()
    ref = snapshot(model_parts, opt)  # after staging: what the checkpoint must hold
    train_step(model_parts, opt, lrs)  # training goes on while an async checkpoint uploads
    cm.maybe_wait_for_saving()
    cm.close()
    check(f"save-{mode}", wrappers(model_parts) == WRAPPERS,
          f"parameters are {wrappers(model_parts)}")
    check(f"save-{mode}", os.path.exists(os.path.join(root, mode, "checkpoint", "step-1", ".metadata")),
          f"{mode}: no step-1 checkpoint was written")
    if RANK == 0:
        torch.save(ref, os.path.join(root, f"ref-{mode}.pt"))
    dist.barrier()


def load(mode: str, root: str, mesh) -> None:
    ref = torch.load(os.path.join(root, f"ref-{mode}.pt"), weights_only=True)
    model_parts, opt, lrs = parts(1, mesh)
    train_step(model_parts, opt, lrs)  # optimizer states exist, with other values
    before = {k: p for i, part in enumerate(model_parts) for k, p in part.named_parameters(prefix=str(i))}
    ts = TrainState()
    cm = manager(QuantizedCheckpointManager, mode, root, model_parts, opt, lrs, ts)
    check(f"load-{mode}", cm.load(step=1), f"{mode}: load(step=1) found no checkpoint")
    cm.close()
    got = snapshot(model_parts, opt)
    check(f"load-{mode}", ts.step == 1, f"{mode}: train step {ts.step} after load")
    check(f"load-{mode}", sorted(got) == sorted(ref), f"{mode}: keys {sorted(set(got) ^ set(ref))} differ")
    for k, want in ref.items():
        ok = k in got and got[k].dtype == want.dtype and torch.equal(bits(got[k]), bits(want))
        check(f"load-{mode}", ok, f"{mode}: {k} differs after loading at {WORLD} ranks")
    after = {k: p for i, part in enumerate(model_parts) for k, p in part.named_parameters(prefix=str(i))}
    check(f"load-{mode}", all(after[k] is p for k, p in before.items()), f"{mode}: load replaced a parameter")
    check(f"load-{mode}", wrappers(model_parts) == WRAPPERS,
          f"{mode}: parameters are {wrappers(model_parts)} after load")


class PrefixAdapter(BaseStateDictAdapter):
    """A torchtitan state-dict adapter renaming keys to HF's ``model.`` prefix (what a model's does)."""

    def __init__(self, model_config=None, hf_assets_path=None):
        self.fqn_to_index_mapping, self.hf_assets_path = None, hf_assets_path

    def to_hf(self, state_dict):
        return {f"model.{k}": v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict):
        return {k.removeprefix("model."): v for k, v in hf_state_dict.items()}

    def get_hf_storage_reader(self, path, from_quantized=False):
        return HuggingFaceStorageReader(path)


def export(root: str, mesh) -> None:
    """The last step's model-only save, as DCP files and as HF safetensors, in bf16."""
    from safetensors.torch import load_file

    for section, hf in (("export", False), ("export_hf", True)):
        model_parts, opt, lrs = parts(0, mesh)
        train_step(model_parts, opt, lrs)
        cm = manager(QuantizedCheckpointManager, "disabled", os.path.join(root, section), model_parts, opt, lrs,
                     TrainState(2), sd_adapter=PrefixAdapter() if hf else None, last_save_model_only=True,
                     export_dtype="bfloat16", last_save_in_hf=hf)
        cm.save(curr_step=2, last_step=True)
        cm.close()
        want = {k: _whole(v).to(torch.bfloat16) for part in model_parts for k, v in part.state_dict().items()}
        where = os.path.join(root, section, "disabled", "checkpoint", "step-2")
        if hf:
            files = [f for f in os.listdir(where) if f.endswith(".safetensors")]
            got = {k.removeprefix("model."): v for f in files for k, v in load_file(os.path.join(where, f)).items()}
        else:
            got = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in want.items()}
            dcp.load(got, checkpoint_id=where, no_dist=True)
        check(section, sorted(got) == sorted(want), f"keys {sorted(set(got) ^ set(want))} differ")
        for k, v in want.items():
            check(section, k in got and got[k].dtype == torch.bfloat16 and torch.equal(bits(got[k]), bits(v)),
                  f"{k}: the model-only export differs from the weight's values in bf16")


class _CacheFixedOnly(CheckpointManager):
    """torchtitan's manager with only qdcp's model-cache fix: DCP called as torchtitan calls it."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.states[MODEL] = QuantizedModelWrapper(self.states[MODEL].model)


def _attempt(fn) -> str | None:
    try:
        fn()
        return None
    except BaseException as e:  # noqa: BLE001  (DCP's CheckpointException is a BaseException)
        return f"{type(e).__name__}: {short(e, 300)}"


def stock(mode: str, root: str, mesh) -> None:
    """torchtitan's own manager on the same parts, and the same with only the cache fixed: what
    happens (written for the test to assert)."""
    outcome = {}
    for name, cls in (("stock", CheckpointManager), ("cache_fixed", _CacheFixedOnly)):
        model_parts, opt, lrs = parts(0, mesh)
        train_step(model_parts, opt, lrs)
        ref = snapshot(model_parts, opt)
        where = os.path.join(root, name)

        def save_it():
            cm = manager(cls, mode, where, model_parts, opt, lrs, TrainState(1))
            cm.save(curr_step=1)
            cm.maybe_wait_for_staging()
            cm.maybe_wait_for_saving()
            cm.close()
        outcome[f"{name}_save"] = _attempt(save_it)
        if outcome[f"{name}_save"] is not None:
            continue
        fresh, opt2, lrs2 = parts(1, mesh)
        train_step(fresh, opt2, lrs2)
        outcome[f"{name}_load"] = _attempt(
            lambda: manager(cls, mode, where, fresh, opt2, lrs2, TrainState()).load(step=1))
        got = snapshot(fresh, opt2)
        outcome[f"{name}_differ"] = differences(got, ref)
        outcome[f"{name}_zero"] = sorted(k for k, v in got.items() if k.startswith("model") and not v.any())
    record_outcome(os.path.join(root, f"stock-{mode}.json"), outcome)


def each_mode(fn):
    """A command running ``fn`` for every async mode, one after the other, in one job."""
    return lambda root, mesh: [fn(mode, root, mesh) for mode in MODES]


COMMANDS = {"save": each_mode(save), "load": each_mode(load), "stock": each_mode(stock), "export": export}

if __name__ == "__main__":
    sys.exit(run(COMMANDS, init_torchrun_mesh))
