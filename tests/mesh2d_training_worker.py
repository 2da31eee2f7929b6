"""The script every ``torchrun`` rank runs for ``tests/test_mesh2d.py``'s real-model tests:
torchtitan's float8 training recipe on a ``(dp=2, tp=2)`` mesh, checkpointed and resumed.

    python -m torch.distributed.run --nproc-per-node N tests/mesh2d_training_worker.py COMMAND DIR

The model is built as torchtitan builds it: an MLP converted by torchao's
``convert_to_float8_training`` (FSDP float8 all-gather on), tensor parallel applied with
``parallelize_module`` (torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``) over
``tp``, then ``fully_shard`` over ``dp``: its weights are DTensors of torchao's
``WeightWithDynamicFloat8CastTensor`` with placements ``(_StridedShard(0), Shard(0))`` and
``(Shard(0), Shard(1))``. torchao's ``AdamW8bit`` on both: its states are per-shard 8-bit blocks,
the row-parallel weight's a column cut (stored as the grid of its blocks).

Commands:

- ``train DIR`` (4 ranks): steps 1-4; after step 2 the plain
  ``dcp.async_save(..., planner=QuantizedSavePlanner())`` (its own gloo group) while step 3 runs;
  the weights and optimizer states at step 2 are recorded whole. Then, in the same processes: a
  fresh model (other seed) built the same way loads the checkpoint with the plain
  ``dcp.load(..., planner=QuantizedLoadPlanner())`` (every weight and every state's codes and
  scales bit-identical to the saved ones, the weights still wrappers), and its steps 3-4 give the
  uninterrupted run's losses bit for bit; an unconverted model (and AdamW8bit) under 1-D FSDP over 4
  loads it too: weights bit-identical; the column-parallel weight's states (saved as row ranges,
  whose blocks the target's row shards share) the saved bits, so torchao's ``dequantize()`` gives
  the saved values exactly; the row-parallel weight's (saved as a grid of (2, 128) blocks) the saved
  values quantized by torchao in the target shard's own blocks.
- ``single DIR`` (1 rank): the same in one process (DCP's ``get_state_dict`` / ``set_state_dict``).

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

from dist_helpers import init_torchrun_mesh, square_loss_step, uint8_all_gather  # noqa: E402
from qdcp import QuantizedLoadPlanner  # noqa: E402
from quantized_cases import bits_diff, gated_save_planner  # noqa: E402
from training_cases import CASE_BY_NAME, float8_training, values  # noqa: E402
from worker_results import RANK, WORLD, check, run  # noqa: E402

CASE = CASE_BY_NAME["float8"]
D, H = 128, 256  # each rank's part of a weight: 64 x 128, large enough for torchao's 8-bit state
STEPS, SAVED_AT = 4, 2
CUDA = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if CUDA else torch.device("cpu")


def mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D, H, bias=False), torch.nn.ReLU(),
                               torch.nn.Linear(H, D, bias=False)).to(DEVICE)


def torchtitan_float8(seed: int):
    """The float8 MLP with TP over ``tp`` then FSDP2 over ``dp`` (torchtitan's order), and torchao's AdamW8bit."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
    from torchao.optim import AdamW8bit

    mesh = init_device_mesh(DEVICE.type, (2, 2), mesh_dim_names=("dp", "tp"))
    model = float8_training(mlp(seed))
    parallelize_module(model, mesh["tp"], {"0": Float8ColwiseParallel(), "2": Float8RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    if DEVICE.type == "cpu":
        model.set_custom_all_gather(uint8_all_gather())
    return model, AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.01), mesh


def step(model, opt, i: int, dp_rank: int) -> float:
    """One step on this data-parallel rank's part of step ``i``'s batch (the same on both TP ranks);
    the global mean loss."""
    x = torch.randn(16, D, generator=torch.Generator().manual_seed(1000 * i + dp_rank)).to(DEVICE)
    return square_loss_step(model(x), opt)


def plain(t: torch.Tensor) -> torch.Tensor:
    """A local state value's values: a weight wrapper's high-precision tensor, an 8-bit state's
    torchao ``dequantize()``."""
    return t.dequantize() if hasattr(t, "codes") else values(t)


def whole(v) -> torch.Tensor:
    """The whole logical tensor of a state value on every rank (as :func:`plain` gives it), on CPU."""
    if isinstance(v, DTensor):
        local = DTensor.from_local(plain(v._local_tensor), v.device_mesh, v.placements,
                                   shape=v.shape, stride=v.stride(), run_check=False)
        return local.redistribute(placements=[Replicate()] * v.device_mesh.ndim).to_local().cpu()
    return plain(v).detach().cpu().clone()


def state_buffers(opt) -> dict[str, torch.Tensor]:
    """This rank's 8-bit optimizer state buffers (codes and scales of its shard), by state."""
    out = {}
    for i, state in enumerate(opt.state.values()):
        for k, v in state.items():
            local = v._local_tensor if isinstance(v, DTensor) else v
            if hasattr(local, "codes"):
                out.update({f"{i}.{k}.codes": local.codes.cpu().clone(), f"{i}.{k}.scale": local.scale.cpu().clone()})
    return out


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
            saved, saved_buffers = snapshot(model, opt), state_buffers(opt)
            check("train", len(saved_buffers) == 8, f"expected 8-bit states of both weights: {sorted(saved_buffers)}")
            msd, osd = get_state_dict(model, opt)
            pending = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path,
                                     planner=gated_save_planner(gate), process_group=ckpt_group)
            gate = threading.Event()
    gate.set()
    pending.result()
    dist.barrier()
    if RANK == 0:
        torch.save(saved, os.path.join(root, "saved.pt"))
    _resume(path, saved, saved_buffers, losses, dp_rank)
    _load_plain_fsdp(path, saved)


def _resume(path: str, saved: dict, saved_buffers: dict, losses: list[float], dp_rank: int) -> None:
    model, opt, _ = torchtitan_float8(1)
    load_into(model, opt, path)
    same("resume_2d", state_buffers(opt), saved_buffers, "8-bit state buffers of this rank")
    check("resume_2d", type(model[0].weight._local_tensor).__name__ == CASE.cls_name,
          "the loaded weight is no longer torchao's float8 training wrapper")
    same("resume_2d", snapshot(model, opt), saved, "the same (2, 2) mesh")
    again = [step(model, opt, i, dp_rank) for i in range(SAVED_AT + 1, STEPS + 1)]
    check("resume_2d", again == losses[SAVED_AT:],
          f"losses after resuming {again} != the uninterrupted run's {losses[SAVED_AT:]}")


def _load_plain_fsdp(path: str, saved: dict) -> None:
    model = mlp(2)
    fully_shard(model, mesh=init_device_mesh(DEVICE.type, (WORLD,)))
    _load_elsewhere("plain_fsdp_4", model, path, saved, "an unconverted model, 1-D FSDP over 4")


def single(root: str, _mesh) -> None:
    _load_elsewhere("plain_single", mlp(3), os.path.join(root, "ckpt"), torch.load(os.path.join(root, "saved.pt")),
                    "an unconverted model in one process")


SAME_BLOCKS = ("0.weight",)  # column-parallel: its states saved as row ranges, blocks of 2 whole rows


def _load_elsewhere(section: str, model, path: str, saved: dict, what: str) -> None:
    """An unconverted model and a fresh AdamW8bit load the checkpoint: the weights bit-identical; each
    8-bit state the saved bits where this shard's blocks are the saved ones (``SAME_BLOCKS``), else
    the saved values quantized by torchao (``copy_``) in this shard's own blocks."""
    from torchao.optim import AdamW8bit

    opt = AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.01)
    load_into(model, opt, path)
    got = snapshot(model, opt)
    same(section, {k: v for k, v in got.items() if not k.startswith("optim.")},
         {k: v for k, v in saved.items() if not k.startswith("optim.")}, what)
    names = {p: n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for k, v in state.items():
            key = f"optim.{names[p]}.{k}"
            local = v._local_tensor if isinstance(v, DTensor) else v
            if not hasattr(local, "codes"):
                same(section, {key: whole(v)}, {key: saved[key]}, what)
                continue
            chunk = v.__create_chunk_list__()[0] if isinstance(v, DTensor) else None
            offsets, sizes = (chunk.offsets, chunk.sizes) if chunk is not None else ((0, 0), tuple(local.shape))
            values = saved[key][offsets[0]:offsets[0] + sizes[0], offsets[1]:offsets[1] + sizes[1]]
            if names[p] in SAME_BLOCKS:
                d = bits_diff(local.dequantize().cpu(), values)
                check(section, d is None, f"{what}: {key}: not the saved bits (dequantize() != the saved values): {d}")
                continue
            want = type(local).zeros(tuple(local.shape), signed=local.signed, block_size=local.block_size)
            want.copy_(values)
            for n in ("codes", "scale"):
                d = bits_diff(getattr(local, n).cpu(), getattr(want, n))
                check(section, d is None,
                      f"{what}: {key}.{n}: not the saved values quantized in this shard's blocks: {d}")


COMMANDS = {"train": train, "single": single}

if __name__ == "__main__":
    sys.exit(run(COMMANDS, lambda: init_torchrun_mesh(DEVICE)))
