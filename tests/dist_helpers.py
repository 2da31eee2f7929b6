"""Helpers for the jobs every multi-process test repeats: process groups, row chunks, DTensors."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


def init_file_store_group(root: str, rank: int, world: int, backend: str = "gloo") -> None:
    """A process group over a FileStore in ``root`` (no port: tests run in parallel)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend, store=dist.FileStore(os.path.join(root, "store"), world),
                            rank=rank, world_size=world)


def init_torchrun_mesh(device: torch.device | None = None) -> DeviceMesh:
    """The process group torchrun's environment names (nccl for a CUDA ``device``, gloo otherwise)
    and a 1-D mesh over all its ranks."""
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shared = os.environ.get("QDCP_SHARED_GPU") == "1"  # ranks sharing one GPU: gloo carries CUDA tensors
    dist.init_process_group(("cpu:gloo,cuda:gloo" if shared else "nccl") if device.type == "cuda" else "gloo")
    return init_device_mesh(device.type, (dist.get_world_size(),))


def row_chunks(rows: int, world: int) -> list[tuple[int, int]]:
    """(offset, size) of each rank's rows for Shard(0): torch.chunk sizes, as DTensor does."""
    size = -(-rows // world)
    return [(min(r * size, rows), max(0, min(size, rows - r * size))) for r in range(world)]


def my_row_chunk(rows: int) -> tuple[int, int]:
    """(offset, size) of this rank's Shard(0) rows of a tensor with ``rows`` rows."""
    return row_chunks(rows, dist.get_world_size())[dist.get_rank()]


def my_rows(t: torch.Tensor) -> torch.Tensor:
    """This rank's Shard(0) rows of ``t``."""
    o, s = my_row_chunk(t.shape[0])
    return t[o:o + s]


def all_rows(local: torch.Tensor) -> torch.Tensor:
    """Every rank's ``local`` rows concatenated in rank order (the whole of a Shard(0) tensor), on
    every rank; through ``all_gather_object``, so for any dtype and uneven shards."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return torch.cat(parts)


def dtensor_from_local(local: torch.Tensor, mesh, placements, shape, dtype: torch.dtype) -> DTensor:
    """A DTensor over ``local`` built from its spec, without view ops (as FSDP2's
    ``_from_local_no_grad``; ``DTensor.from_local`` calls ``view_as``, which some subclasses lack)."""
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))
    return DTensor(local, spec, requires_grad=False)


_SCRIPT = '''\
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from dist_helpers import init_file_store_group
{imports}


def main():
    root = sys.argv[1]
    init_file_store_group(root, 0, 1)
{body}
    dist.destroy_process_group()


if __name__ == "__main__":  # the PROCESS checkpointer spawns: guard the entry point
    main()
'''


def run_one_rank_script(root, body: str, *, imports: str = "", timeout: int = 240) -> subprocess.CompletedProcess:
    """Run ``body`` as ``main()`` of a fresh Python process that is the one rank of a gloo group over
    a FileStore in ``root`` (``root`` in the body). ``os``, ``sys``, ``torch``, ``dist``, ``dcp`` and
    ``AsyncCheckpointerType`` are imported, then ``imports``; the entry point is guarded, as DCP's
    PROCESS checkpointer (which spawns) requires. The finished process, its output as text."""
    script = os.path.join(root, "run.py")
    with open(script, "w") as f:
        f.write(_SCRIPT.format(imports=textwrap.dedent(imports).strip(),
                               body=textwrap.indent(textwrap.dedent(body).strip("\n"), "    ")))
    return subprocess.run([sys.executable, script, str(root)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONWARNINGS="ignore"))


def uint8_all_gather():
    """FSDP2's default all-gather, with float8 buffers moved as their bytes (gloo has no float8)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class Uint8AllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if output_tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
            return super().__call__(output_tensor, input_tensor, group, async_op)
    return Uint8AllGather()


def square_loss_step(out: torch.Tensor, opt: torch.optim.Optimizer) -> float:
    """The test trainings' step on a model's output ``out``: mean-square loss, backward, optimizer
    step; the loss averaged over every rank."""
    loss = out.float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def training_state_items(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None):
    """``(key, value)`` of a model's state dict (``model.<fqn>``) and of its optimizer's per-parameter
    states (``optim.<parameter fqn>.<state>``), as the framework workers compare them."""
    for k, v in model.state_dict().items():
        yield f"model.{k}", v
    names = {p: n for n, p in model.named_parameters()}
    for p, state in (opt.state.items() if opt is not None else ()):
        for k, v in state.items():
            yield f"optim.{names[p]}.{k}", v
