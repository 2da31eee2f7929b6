"""A per-row torchao weight cut for tensor parallelism as torchao's recipes cut it, through DCP's
own calls and ``qdcp.load``, at 2 ranks: three loads that once failed, below (``test_tp_slicing.py``
runs it).

    python -m torch.distributed.run --nproc-per-node 2 tests/tp_slicing_worker.py run DIR

- columns: each rank holds ``q[:, a:b]`` of a per-row ``Int8Tensor`` / ``Float8Tensor`` (torchao's
  column slice keeps each row's scale, ``block_size [1, 64]``) as a ``Shard(1)`` DTensor, saved with
  ``dcp.save`` + ``QuantizedSavePlanner``; loaded with ``qdcp.load`` into per-row row shards
  (``Shard(1)``'s DTensor over a torchao local) and, on rank 0, into the whole per-row tensor:
  the source's codes and scales, bit for bit (docs/api.md: the blocks a target block covers share
  one scale);
- rows: the per-row weight saved as row shards, loaded with ``dcp.load`` + ``QuantizedLoadPlanner``
  into tensor-parallel column cuts: each cut's codes and scales are the source's.
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import qdcp  # noqa: E402
from dist_helpers import dtensor_from_local  # noqa: E402
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner  # noqa: E402
from quantized_cases import CASE_BY_NAME, components_diff  # noqa: E402

SHAPE = (256, 128)


def weight(name: str, seed: int):
    """A per-row weight whose rows span magnitudes (as trained weights do)."""
    g = torch.Generator().manual_seed(seed)
    hp = torch.randn(SHAPE, generator=g) * torch.logspace(-3, 1, SHAPE[0])[:, None]
    return CASE_BY_NAME[name].from_hp(hp.to(torch.bfloat16))


def check(what: str, got, want) -> None:
    diff = components_diff(got, want)
    if diff is not None:
        raise AssertionError(f"rank {dist.get_rank()}: {what}: {diff}")


def run(root: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows, cols = SHAPE[0] // world, SHAPE[1] // world
    for name in ("int8_row", "float8_row"):
        q = weight(name, 0)
        cut = q[:, rank * cols:(rank + 1) * cols]
        dcp.save({"w": dtensor_from_local(cut, mesh, (Shard(1),), SHAPE, q.dtype)},
                 checkpoint_id=f"{root}/{name}-columns", planner=QuantizedSavePlanner())
        target = weight(name, 1)[rank * rows:(rank + 1) * rows]
        qdcp.load({"w": dtensor_from_local(target, mesh, (Shard(0),), SHAPE, q.dtype)}, f"{root}/{name}-columns")
        check(f"{name} columns -> row shards (qdcp.load)", target, q[rank * rows:(rank + 1) * rows])
        if rank == 0:
            whole = weight(name, 2)
            dcp.load({"w": whole}, checkpoint_id=f"{root}/{name}-columns", planner=QuantizedLoadPlanner(),
                     no_dist=True)
            check(f"{name} columns -> one process", whole, q)
        dcp.save({"w": dtensor_from_local(q[rank * rows:(rank + 1) * rows], mesh, (Shard(0),), SHAPE, q.dtype)},
                 checkpoint_id=f"{root}/{name}-rows", planner=QuantizedSavePlanner())
        target = weight(name, 3)[:, rank * cols:(rank + 1) * cols]
        dcp.load({"w": dtensor_from_local(target, mesh, (Shard(1),), SHAPE, q.dtype)},
                 checkpoint_id=f"{root}/{name}-rows", planner=QuantizedLoadPlanner())
        check(f"{name} rows -> column cuts (dcp.load)", target, cut)
    dist.barrier()
    print(f"rank {rank}: OK", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        run(sys.argv[2])
    finally:
        dist.destroy_process_group()
