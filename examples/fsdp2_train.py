"""FSDP2 training with a quantized model, a low-bit optimizer and async quantized checkpoints.

A frozen NF4 base weight (QLoRA style) feeds a trainable layer optimized by torchao's AdamW8bit
(its states are quantized ``OptimState8bit`` DTensors). Every ``--ckpt-every`` steps the model and
optimizer state are saved with ``qdcp.async_save(state, path)`` (DCP's ``async_save`` with qdcp's
atomic, checksummed writer and planner) while training goes on; ``--api dcp`` uses the plain
``dcp.async_save(..., planner=QuantizedSavePlanner())`` instead. ``--stager qdcp`` passes a
``QuantizedStager`` kept for the run (the faster path with reused buffers). ``--resume`` loads the
newest checkpoint (``qdcp.load``: verified, all-or-nothing; or ``dcp.load`` with
``QuantizedLoadPlanner()``) at whatever world size this run has and continues; the losses it prints
from the resumed step on are checked against the log of the first run (bit for bit where both ran
on the same kind of device).

    torchrun --nproc-per-node 2 examples/fsdp2_train.py --dir /tmp/qdcp-fsdp2 --steps 8
    torchrun --nproc-per-node 1 examples/fsdp2_train.py --dir /tmp/qdcp-fsdp2 --steps 8 --resume

Any number of ranks, one included (there the NF4 weight stays out of FSDP: ``parallelize``). gloo
on CPU; nccl with one GPU per rank where CUDA has as many GPUs as ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # torchao's compiled optimizer step fails on CPU
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torchao.optim  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import qdcp  # noqa: E402
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner, QuantizedStager  # noqa: E402

DIM, HIDDEN = 256, 512


class QLoRAStyleModel(torch.nn.Module):
    """Frozen NF4 projection, then a trainable layer."""

    def __init__(self) -> None:
        super().__init__()
        from torchao.quantization import to_nf4

        g = torch.Generator().manual_seed(0)
        self.base = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.base.weight = torch.nn.Parameter(
            to_nf4(torch.randn(HIDDEN, DIM, generator=g).to(torch.bfloat16)), requires_grad=False)
        self.head = torch.nn.Linear(HIDDEN, DIM)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(DIM, HIDDEN, generator=g) / HIDDEN**0.5)
            self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.linear(x.to(torch.bfloat16), self.base.weight).float().relu()
        return self.head(h)


def parallelize(model: QLoRAStyleModel, mesh) -> QLoRAStyleModel:
    """FSDP2 over the model (the head its own unit). At one rank FSDP2 skips the all-gather and
    gives torchao's NF4 ``fsdp_post_all_gather`` one of its three tensors (a ValueError at the first
    forward; docs/troubleshooting.md): there the frozen NF4 weight stays out of FSDP, a plain
    ``NF4Tensor``. It is saved under the same key, with the same shape and bytes, at any world size."""
    fully_shard(model.head, mesh=mesh)
    ignored = {model.base.weight} if mesh.size() == 1 else None
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    return model


def batch(step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank and at every world size (so losses compare exactly)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, DIM, generator=g)
    return x.to(device), torch.tanh(x).to(device)


def save(model, optim, path: str, stager, group, saves: list, rank: int, api: str, overwrite: bool):
    """Start an async checkpoint; note how long training was blocked and when it was written. A
    resumed run writes the checkpoints after its start again (``overwrite``: replaced atomically)."""
    start = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    if api == "qdcp":
        fut = qdcp.async_save(state, path, stager=stager, process_group=group, overwrite=overwrite)
    else:
        kwargs = {"async_stager": stager} if stager is not None else {}
        fut = dcp.async_save(state, checkpoint_id=path, planner=QuantizedSavePlanner(overwrite=overwrite),
                             process_group=group, **kwargs)
    record = {"checkpoint": os.path.basename(path), "blocked_s": time.perf_counter() - start}
    saves.append(record)

    def written(_):
        record["total_s"] = time.perf_counter() - start
        if rank == 0:
            print(f"  checkpoint {record['checkpoint']}: training blocked {record['blocked_s'] * 1e3:.0f} ms, "
                  f"written in the background in {record['total_s'] * 1e3:.0f} ms", flush=True)
    fut.add_done_callback(written)
    return fut


def record(root: str, resume: bool, run: dict) -> None:
    """Rank 0: write this run's record (``run-first.json`` / ``run-resume.json``); a first run also
    writes ``losses.json``, which a resumed run's losses are checked against: bit for bit where both
    ran on the same kind of device (CPU and GPU kernels round differently: a first run at 2 ranks on
    a one-GPU machine runs on the CPU, its resume at 1 rank on the GPU)."""
    with open(os.path.join(root, f"run-{'resume' if resume else 'first'}.json"), "w") as f:
        json.dump(run, f)
    log_path = os.path.join(root, "losses.json")
    if not resume:
        with open(log_path, "w") as f:
            json.dump(run["losses"], f)
        return
    with open(log_path) as f:
        first = {int(k): v for k, v in json.load(f).items()}
    with open(os.path.join(root, "run-first.json")) as f:
        first_device = json.load(f).get("device", "cpu")
    losses, since = run["losses"], run["start"] + 1
    if first_device != run["device"]:
        worst = max((abs(first[s] - v) / abs(first[s]) for s, v in losses.items()), default=0.0)
        print(f"  losses from step {since} on not compared bit for bit: the first run ran on {first_device}, "
              f"this one on {run['device']}; largest relative difference {worst:.1e}", flush=True)
        return
    same = all(first[s] == v for s, v in losses.items())
    print(f"  losses from step {since} on identical to the first run: {same}", flush=True)
    if not same:
        raise SystemExit("resumed losses differ from the first run")


def arguments() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ckpt-every", type=int, default=3)
    parser.add_argument("--resume", action="store_true", help="load the newest checkpoint (or --resume-step's)")
    parser.add_argument("--resume-step", type=int, default=None)
    parser.add_argument("--api", choices=["qdcp", "dcp"], default="qdcp",
                        help="qdcp: qdcp.async_save / qdcp.load; dcp: DCP's calls with qdcp's planners")
    parser.add_argument("--stager", choices=["dcp", "qdcp"], default="dcp",
                        help="dcp: the default (DCP's stager, or with --api qdcp the writer's); "
                             "qdcp: a QuantizedStager kept for the run")
    return parser.parse_args()


def resume(model, optim, root: str, step: int | None, api: str) -> int:
    """Load the checkpoint of ``step`` (default: the newest) into the model and optimizer, at this
    run's world size; return its step."""
    saved = sorted(int(d.split("_")[1]) for d in os.listdir(root) if d.startswith("step_"))
    start = step if step is not None else saved[-1]
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    path = os.path.join(root, f"step_{start}")
    if api == "qdcp":
        qdcp.load(state, path)
    else:
        dcp.load(state, checkpoint_id=path, planner=QuantizedLoadPlanner())
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return start


def main() -> None:
    """Train, checkpointing as it goes; resume first with ``--resume``."""
    args = arguments()
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    # async_save plans with collectives from a background thread: give it its own process group,
    # or they interleave with FSDP's collectives on the default one.
    ckpt_group = dist.new_group(backend="gloo")

    model = parallelize(QLoRAStyleModel().to(device), mesh)
    optim = torchao.optim.AdamW8bit(model.head.parameters(), lr=1e-3, block_size=256)

    os.makedirs(args.dir, exist_ok=True)
    start = 0
    if args.resume:
        start = resume(model, optim, args.dir, args.resume_step, args.api)
        if rank == 0:
            print(f"  resumed from step {start} at world size {world}", flush=True)

    stager = QuantizedStager() if args.stager == "qdcp" else None
    pending, saves, losses = None, [], {}
    for step in range(start, args.steps):
        x, y = batch(step, device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses[step] = loss.item()
        if rank == 0:
            print(f"  step {step + 1}/{args.steps}  loss {losses[step]:.6f}", flush=True)
        if (step + 1) % args.ckpt_every == 0:
            if pending is not None:
                pending.result()  # one checkpoint in flight at a time
            pending = save(model, optim, os.path.join(args.dir, f"step_{step + 1}"), stager, ckpt_group, saves,
                           rank, args.api, overwrite=args.resume)
    if pending is not None:
        pending.result()
    if stager is not None:
        stager.close()

    if rank == 0:
        record(args.dir, args.resume, {"world": world, "device": device.type, "start": start, "losses": losses,
                                       "saves": saves})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
