"""The script every ``torchrun`` rank runs for ``tests/test_mesh2d.py``'s real-model tests:
torchtitan's float8 training recipe on a ``(dp=2, tp=2)`` mesh, checkpointed and resumed.

    python -m torch.distributed.run --nproc-per-node N tests/mesh2d_training_worker.py COMMAND DIR

The model is built as torchtitan builds it: an MLP converted by torchao's
``convert_to_float8_training`` (FSDP float8 all-gather on), tensor parallel applied with
``parallelize_module`` (torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``) over
``tp``, then ``fully_shard`` over ``dp``: its weights are DTensors of torchao's
``WeightWithDynamicFloat8CastTensor`` with placements ``(_StridedShard(0), Shard(0))`` and
``(Shard(0), Shard(1))``. AdamW on both weights.

Commands:

- ``train DIR`` (4 ranks): steps 1-4; after step 2 the plain
  ``dcp.async_save(..., planner=QuantizedSavePlanner())`` (its own gloo group) while step 3 runs;
  the weights and optimizer states at step 2 are recorded whole. Then, in the same processes: a
  fresh model (other seed) built the same way loads the checkpoint with the plain
  ``dcp.load(..., planner=QuantizedLoadPlanner())`` (every value bit-identical to the recorded
  ones, the weights still wrappers), and its steps 3-4 give the uninterrupted run's losses bit for
  bit; a plain (unconverted) model under 1-D FSDP over 4 loads it too, bit-identical.
- ``single DIR`` (1 rank): a plain model and AdamW in one process load it (DCP's
  ``get_state_dict`` / ``set_state_dict``), bit-identical.

gloo cannot all-gather float8 tensors, so FSDP2's float8 all-gather moves their bytes as uint8
(``dist_helpers.uint8_all_gather``); with nccl (a GPU per rank) FSDP2's own runs.
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
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_helpers import init_torchrun_mesh, uint8_all_gather  # noqa: E402
from quantized_cases import bits_diff, gated_save_planner  # noqa: E402
from training_cases import CASE_BY_NAME, D, values  # noqa: E402
from worker_results import RANK, WORLD, check, run  # noqa: E402

from qdcp import QuantizedLoadPlanner  # noqa: E402

CASE = CASE_BY_NAME["float8"]
STEPS, SAVED_AT = 4, 2
CUDA = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if CUDA else torch.device("cpu")


def torchtitan_float8(seed: int):
    """The float8 MLP with TP over ``tp`` then FSDP2 over ``dp`` (torchtitan's order), and its AdamW."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    mesh = init_device_mesh(DEVICE.type, (2, 2), mesh_dim_names=("dp", "tp"))
    model = CASE.model(seed).to(DEVICE)
    parallelize_module(model, mesh["tp"], {"0": Float8ColwiseParallel(), "2": Float8RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    if DEVICE.type == "cpu":
        model.set_custom_all_gather(uint8_all_gather())
    return model, _adamw(model), mesh


def _adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def step(model, opt, i: int, dp_rank: int) -> float:
    """One step on this data-parallel rank's part of step ``i``'s batch (the same on both TP ranks);
    the global mean loss."""
    x = torch.randn(16, D, generator=torch.Generator().manual_seed(1000 * i + dp_rank)).to(DEVICE)
    loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / WORLD


def whole(v) -> torch.Tensor:
    """The whole logical tensor of a state value on every rank (a wrapper's high-precision values), on CPU."""
    if isinstance(v, DTensor):
        plain = DTensor.from_local(values(v._local_tensor), v.device_mesh, v.placements,
                                   shape=v.shape, stride=v.stride(), run_check=False)
        return plain.redistribute(placements=[Replicate()] * v.device_mesh.ndim).to_local().cpu()
    return values(v).detach().cpu().clone()


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    """Every weight and optimizer state, whole, by ``model.<fqn>`` / ``optim.<fqn>.<state>``."""
    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": whole(v) for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        out.update({f"optim.{fqn}.{k}": whole(v) for k, v in state.items()})
    return out


def same(section: str, got: dict, want: dict, what: str) -> None:
    check(section, set(got) == set(want), f"{what}: keys {sorted(got)} != {sorted(want)}")
    for k in sorted(set(got) & set(want)):
        d = bits_diff(got[k], want[k])
        check(section, d is None, f"{what}: {k}: {d}")


def load_into(model, opt, path: str) -> None:
    """The plain call a training script makes to resume: DCP's ``get_state_dict`` / ``dcp.load``
    with qdcp's planner / ``set_state_dict``."""
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, planner=QuantizedLoadPlanner())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def train(root: str, _mesh) -> None:
    path = os.path.join(root, "ckpt")
    ckpt_group = dist.new_group(backend="gloo")  # the upload's collectives apart from training's
    model, opt, mesh = torchtitan_float8(0)
    dp_rank = mesh.get_local_rank("dp")
    want = {"0.weight": (_StridedShard(0, split_factor=2), Shard(0)), "2.weight": (Shard(0), Shard(1))}
    for fqn, placements in want.items():
        w = model.get_parameter(fqn)
        check("train", type(w._local_tensor).__name__ == CASE.cls_name and w.placements == placements,
              f"{fqn}: not torchtitan's FSDP2 x TP float8 weight: {type(w._local_tensor).__name__} {w.placements}")
    losses, pending, gate = [], None, threading.Event()
    for i in range(1, STEPS + 1):
        losses.append(step(model, opt, i, dp_rank))
        gate.set()  # the upload plans only after this step's in-place updates: a staged copy must hold
        if i == SAVED_AT:
            saved = snapshot(model, opt)
            msd, osd = get_state_dict(model, opt)
            pending = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path,
                                     planner=gated_save_planner(gate), process_group=ckpt_group)
            gate = threading.Event()
    gate.set()
    pending.result()
    dist.barrier()
    if RANK == 0:
        torch.save(saved, os.path.join(root, "saved.pt"))
    _resume(path, saved, losses, dp_rank)
    _load_plain_fsdp(path, saved)


def _resume(path: str, saved: dict, losses: list[float], dp_rank: int) -> None:
    model, opt, _ = torchtitan_float8(1)
    load_into(model, opt, path)
    check("resume_2d", type(model[0].weight._local_tensor).__name__ == CASE.cls_name,
          "the loaded weight is no longer torchao's float8 training wrapper")
    same("resume_2d", snapshot(model, opt), saved, "the same (2, 2) mesh")
    again = [step(model, opt, i, dp_rank) for i in range(SAVED_AT + 1, STEPS + 1)]
    check("resume_2d", again == losses[SAVED_AT:],
          f"losses after resuming {again} != the uninterrupted run's {losses[SAVED_AT:]}")


def _load_plain_fsdp(path: str, saved: dict) -> None:
    model = CASE.plain_model(2).to(DEVICE)
    fully_shard(model, mesh=init_device_mesh(DEVICE.type, (WORLD,)))
    opt = _adamw(model)
    load_into(model, opt, path)
    same("plain_fsdp_4", snapshot(model, opt), saved, "an unconverted model, 1-D FSDP over 4")


def single(root: str, _mesh) -> None:
    model = CASE.plain_model(3).to(DEVICE)
    opt = _adamw(model)
    load_into(model, opt, os.path.join(root, "ckpt"))
    same("plain_single", snapshot(model, opt), torch.load(os.path.join(root, "saved.pt")),
         "an unconverted model in one process")


COMMANDS = {"train": train, "single": single}

if __name__ == "__main__":
    sys.exit(run(COMMANDS, lambda: init_torchrun_mesh(DEVICE)))
