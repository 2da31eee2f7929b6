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
- the columns' scales are written once: the checkpoint holds one scale per row, in one chunk, and
  the entry is per row (``block_size [1, 128]``), as an unsharded save writes it; so are uneven
  column cuts (127 columns: 64 and 63, whose ``block_size`` differ), which load back bit for bit;
- optimizer states (torchao's ``OptimState4bit``, blocks of 128 of a 256-column tensor: each block
  half a row) saved by rows load into column cuts, and saved by column cuts (stored as the grid of
  their blocks) into rows and one process, with the source's codes and scales: the same blocks in
  another form, read row by row or as a rectangle (through DCP's reader and its checksums);
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
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import qdcp  # noqa: E402
from dist_helpers import dtensor_from_local  # noqa: E402
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner  # noqa: E402
from quantized_cases import CASE_BY_NAME, components_diff  # noqa: E402
from rule_oracle import element_maps, maps_equal  # noqa: E402

SHAPE = (256, 128)


def weight(name: str, seed: int, shape=SHAPE):
    """A per-row weight whose rows span magnitudes (as trained weights do)."""
    g = torch.Generator().manual_seed(seed)
    hp = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[0])[:, None]
    return CASE_BY_NAME[name].from_hp(hp.to(torch.bfloat16))


def check(what: str, got, want) -> None:
    diff = components_diff(got, want)
    if diff is not None:
        raise AssertionError(f"rank {dist.get_rank()}: {what}: {diff}")


def stored_once(what: str, path: str, shape) -> None:
    """The checkpoint stores the entry per row, its scale in one chunk of one value per row."""
    md = FileSystemReader(path).read_metadata()
    scale = md.state_dict_metadata["w.__qdcp__.scale"]
    chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in scale.chunks]
    if tuple(scale.size) != (shape[0], 1) or chunks != [((0, 0), (shape[0], 1))]:
        raise AssertionError(f"{what}: the scale is stored as {tuple(scale.size)} in chunks {chunks}, "
                             f"not once per row")
    if '"block_size":[1,%d]' % shape[1] not in md.planner_data["__qdcp__"]:
        raise AssertionError(f"{what}: the entry is not stored per row: {md.planner_data['__qdcp__']}")


def uneven_columns(root: str, name: str, mesh) -> None:
    """127 columns cut 64 / 63 (torchao's slices report block_size [1, 64] and [1, 63]): saved per
    row, loaded into the whole tensor (rank 0) and into row shards with the source's bits."""
    rank, shape = dist.get_rank(), (SHAPE[0], 127)
    q = weight(name, 4, shape)
    lo, hi = (0, 64) if rank == 0 else (64, 127)
    path = f"{root}/{name}-uneven"
    dcp.save({"w": dtensor_from_local(q[:, lo:hi], mesh, (Shard(1),), shape, q.dtype)},
             checkpoint_id=path, planner=QuantizedSavePlanner())
    stored_once(f"{name} uneven columns", path, shape)
    rows = shape[0] // dist.get_world_size()
    target = weight(name, 5, shape)[rank * rows:(rank + 1) * rows]
    qdcp.load({"w": dtensor_from_local(target, mesh, (Shard(0),), shape, q.dtype)}, path)
    check(f"{name} uneven columns -> row shards (qdcp.load)", target, q[rank * rows:(rank + 1) * rows])
    if rank == 0:
        whole = weight(name, 6, shape)
        dcp.load({"w": whole}, checkpoint_id=path, planner=QuantizedLoadPlanner(), no_dist=True)
        check(f"{name} uneven columns -> one process", whole, q)


def optimizer_state_cuts(root: str, mesh) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    shape, case = (8, 256), CASE_BY_NAME["optim4bit"]
    rows, cols = shape[0] // world, shape[1] // world
    whole = case.make(10, shape)
    want = element_maps(whole)

    def same(what, got, r, c):
        part = {k: v[r[0]:r[1], c[0]:c[1]] for k, v in want.items()}
        if not maps_equal(element_maps(got), part):
            raise AssertionError(f"rank {rank}: {what}: not the source's codes and scales")

    by_rows = f"{root}/optim-rows"
    dcp.save({"s": dtensor_from_local(whole[rank * rows:(rank + 1) * rows], mesh, (Shard(0),), shape, torch.float32)},
             checkpoint_id=by_rows, planner=QuantizedSavePlanner())
    target = case.make(11, (shape[0], cols))
    dcp.load({"s": dtensor_from_local(target, mesh, (Shard(1),), shape, torch.float32)},
             checkpoint_id=by_rows, planner=QuantizedLoadPlanner())
    same("optimizer state by rows -> column cuts", target, (0, shape[0]), (rank * cols, (rank + 1) * cols))
    # saved by column cuts: each rank's own state of its columns (its blocks are the whole one's)
    by_cols = f"{root}/optim-columns"
    mine = case.make(12, (shape[0], cols))
    mine.copy_(whole.dequantize()[:, rank * cols:(rank + 1) * cols].contiguous())
    dcp.save({"s": dtensor_from_local(mine, mesh, (Shard(1),), shape, torch.float32)},
             checkpoint_id=by_cols, planner=QuantizedSavePlanner())
    gathered = [None] * world
    dist.all_gather_object(gathered, element_maps(mine))
    want = {k: torch.cat([g[k] for g in gathered], 1) for k in gathered[0]}
    target = case.make(13, (rows, shape[1]))
    dcp.load({"s": dtensor_from_local(target, mesh, (Shard(0),), shape, torch.float32)},
             checkpoint_id=by_cols, planner=QuantizedLoadPlanner())
    same("optimizer state by column cuts -> rows", target, (rank * rows, (rank + 1) * rows), (0, shape[1]))
    if rank == 0:
        target = case.make(14, shape)
        dcp.load({"s": target}, checkpoint_id=by_cols, planner=QuantizedLoadPlanner(), no_dist=True)
        same("optimizer state by column cuts -> one process", target, (0, shape[0]), (0, shape[1]))


def run(root: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows, cols = SHAPE[0] // world, SHAPE[1] // world
    for name in ("int8_row", "float8_row"):
        q = weight(name, 0)
        cut = q[:, rank * cols:(rank + 1) * cols]
        dcp.save({"w": dtensor_from_local(cut, mesh, (Shard(1),), SHAPE, q.dtype)},
                 checkpoint_id=f"{root}/{name}-columns", planner=QuantizedSavePlanner())
        stored_once(f"{name} columns", f"{root}/{name}-columns", SHAPE)
        uneven_columns(root, name, mesh)
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
    optimizer_state_cuts(root, mesh)
    dist.barrier()
    print(f"rank {rank}: OK", flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        run(sys.argv[2])
    finally:
        dist.destroy_process_group()
