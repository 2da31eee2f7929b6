"""The script every ``torchrun`` rank runs for ``tests/test_training_distributed.py``.

    python -m torch.distributed.run --nproc-per-node N tests/training_dist_worker.py COMMAND DIR

FSDP2 (``fully_shard``, gloo) models whose weights are torchao quantized-training wrappers: an MLP
converted by ``convert_to_float8_training`` with float8 all-gather, and an MoE layer (3-D expert
weights used through ``torch._grouped_mm``, plus a projection) converted to MXFP8 training
(torchao's emulated recipe, the one that runs on CPU). AdamW on every weight.

Commands:

- ``train DIR`` (2 ranks): 8 steps of each model; after steps 3 and 6 a checkpoint through the
  plain ``dcp.async_save(..., planner=QuantizedSavePlanner())`` (DCP's default stager; its own
  gloo group) while training goes on; records the losses, and the gathered weights and optimizer states at step 6.
- ``resume DIR`` (2 ranks): fresh models load the step-6 checkpoint and run steps 7-8: the losses
  must equal the uninterrupted run's.
- ``load DIR`` (any N): fresh models at N ranks load the step-6 checkpoint: gathered weights and
  optimizer states bit-identical to the recorded ones; the wrappers stay wrappers, in place.

gloo cannot all-gather float8 tensors, so FSDP2's float8 all-gather runs through a custom
all-gather that moves their bytes as uint8 (the only change to how FSDP2 runs here).
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_helpers import all_rows, init_torchrun_mesh, square_loss_step, uint8_all_gather  # noqa: E402
from qdcp import QuantizedLoadPlanner  # noqa: E402
from quantized_cases import bits, gated_save_planner  # noqa: E402
from training_cases import CASE_BY_NAME, D, unavailable, values  # noqa: E402
from worker_results import RANK, WORLD, check, run  # noqa: E402

MODELS = tuple(n for n in ("float8", "moe_mxfp8") if not unavailable(CASE_BY_NAME[n]))  # MoE: torch >= 2.12
STEPS, CHECKPOINTS = 8, (3, 6)


def build(name: str, seed: int, mesh):
    case = CASE_BY_NAME[name]
    model = case.model(seed)
    parts = [model.experts, model.proj] if case.moe else [model[0], model[2]]
    for part in parts + [model]:
        fully_shard(part, mesh=mesh)
        if name == "float8":
            part.set_custom_all_gather(uint8_all_gather())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, opt


def step(name: str, model, opt, i: int) -> float:
    """One training step on this rank's part of step ``i``'s batch; the global mean loss."""
    g = torch.Generator().manual_seed(1000 * i + RANK)
    if CASE_BY_NAME[name].moe:
        x = torch.randn(128, D, generator=g).to(torch.bfloat16)
        out = model(x, torch.tensor([32, 64, 96, 128], dtype=torch.int32))
    else:
        out = model(torch.randn(16, D, generator=g))
    return square_loss_step(out, opt)


def gather(t) -> torch.Tensor:
    """The whole tensor of a Shard(0) DTensor (a wrapper's high-precision values), on every rank."""
    local = values(t).detach()
    if not isinstance(t, DTensor):
        return local.clone()
    return all_rows(local)


def snapshot(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": gather(v) for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        for k, v in state.items():
            out[f"optim.{fqn}.{k}"] = gather(v) if isinstance(v, torch.Tensor) else v
    return out


def checkpoint_path(root: str, name: str, at: int) -> str:
    return os.path.join(root, f"{name}-step{at}")


def train(root: str, mesh) -> None:
    # the upload runs collectives while training runs its own: give it its own group (as
    # torchtitan does), or the two interleave differently on each rank and hang
    ckpt_group = dist.new_group(backend="gloo")
    for name in MODELS:
        model, opt = build(name, 0, mesh)
        losses, pending, gate = [], None, threading.Event()
        for i in range(1, STEPS + 1):
            losses.append(step(name, model, opt, i))
            gate.set()  # the upload of the last checkpoint plans only now, after this step's updates
            if i in CHECKPOINTS:
                if pending is not None:
                    pending.result()
                msd, osd = get_state_dict(model, opt)
                gate = threading.Event()
                pending = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=checkpoint_path(root, name, i),
                                         planner=gated_save_planner(gate), process_group=ckpt_group)
                if i == CHECKPOINTS[-1]:
                    ref = snapshot(model, opt)
        pending.result()
        wrappers = {type(p._local_tensor).__name__ for p in model.parameters()}
        check("train", wrappers == {CASE_BY_NAME[name].cls_name}, f"{name}: parameters are {wrappers}")
        if RANK == 0:
            torch.save({"losses": losses, "ref": ref}, os.path.join(root, f"{name}-ref.pt"))
    dist.barrier()


def _load(name: str, root: str, mesh):
    model, opt = build(name, 1, mesh)
    before = {k: (p, values(p._local_tensor)) for k, p in model.named_parameters()}
    msd, osd = get_state_dict(model, opt)  # initialises the optimizer states
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=checkpoint_path(root, name, CHECKPOINTS[-1]),
             planner=QuantizedLoadPlanner())
    for k, p in model.named_parameters():  # dcp.load filled the wrapped tensors in place
        check("in_place", p is before[k][0] and values(p._local_tensor) is before[k][1],
              f"{name}: dcp.load replaced parameter {k} or its wrapped tensor")
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)  # the optimizer's states
    for k, p in model.named_parameters():
        check("in_place", p is before[k][0] and type(p._local_tensor).__name__ == CASE_BY_NAME[name].cls_name,
              f"{name}: after set_state_dict {k} is a {type(p._local_tensor).__name__}")
    return model, opt


def resume(root: str, mesh) -> None:
    for name in MODELS:
        record = torch.load(os.path.join(root, f"{name}-ref.pt"), weights_only=True)
        model, opt = _load(name, root, mesh)
        losses = [step(name, model, opt, i) for i in range(CHECKPOINTS[-1] + 1, STEPS + 1)]
        want = record["losses"][CHECKPOINTS[-1]:]
        check("resume", losses == want, f"{name}: resumed losses {losses} != uninterrupted {want}")


def load(root: str, mesh) -> None:
    for name in MODELS:
        record = torch.load(os.path.join(root, f"{name}-ref.pt"), weights_only=True)
        model, opt = _load(name, root, mesh)
        got = snapshot(model, opt)
        check("load", sorted(got) == sorted(record["ref"]), f"{name}: keys {sorted(got)} != {sorted(record['ref'])}")
        for k, want in record["ref"].items():
            ok = (torch.equal(bits(got[k]), bits(want)) and got[k].dtype == want.dtype) \
                if isinstance(want, torch.Tensor) else got.get(k) == want
            check("load", ok, f"{name}: {k} differs after loading at {WORLD} ranks")


COMMANDS = {"train": train, "resume": resume, "load": load}

if __name__ == "__main__":
    sys.exit(run(COMMANDS, init_torchrun_mesh))
