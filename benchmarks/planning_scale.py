"""Coordinator planning at cluster scale: N simulated ranks, qdcp's planners vs DCP's default ones.

Builds, in one process, the local save plans that N ranks send for a 70B-like layer stack (hidden
8192, FFN 28672, 8 KV heads; ``--layers`` of them) under FSDP2 ``Shard(0)`` over all N ranks:
torchao ``Int8Tensor`` (or ``--weights nvfp4``) weights, torchao ``OptimState8bit`` exp_avg and
exp_avg_sq (none on a rank that holds no rows of the weight: torchao's state cannot be empty), bf16
norms, and one MoE layer of ``--experts`` TE MXFP8 experts in a ``GroupedTensor``, split over
``min(N, experts)`` expert-parallel ranks and replicated over the others (TE's real classes on CPU,
through the tests' stand-in for its compiled module; left out where TE is not installed).
Each rank's plan is made by the real planner on that rank's own DTensors (a fake process group
seen from that rank; local tensors of one shard shape share one stand-in, built
through torchao). Then, on the coordinator, it times ``create_global_plan`` + ``finish_plan``, and
on load the ``.metadata`` unpickle plus one rank's ``set_up_planner`` + ``create_local_plan``. The
baseline is DCP's default planners on the same plain components (each one a ``Shard(0)`` DTensor of
the same chunks, or a plain tensor where the component is replicated). Coordinator peak memory is measured with
tracemalloc in separate runs.

With ``--ranks DPxTP`` (e.g. ``8x128``) the ranks form a 2-D mesh: each linear with torchtitan's
FSDP2 x TP placements (``_StridedShard(0)`` x ``Shard(0)`` column-parallel, ``Shard(0)`` x
``Shard(1)`` row-parallel), 8-bit AdamW states of the column-parallel ones, norms ``(Shard(0),
Replicate())``, no MoE layer; the baseline is DCP's default planners on plain tensors whose chunks
are exactly the items qdcp writes (tensors naming their own chunks, planned through DCP's
``_Checkpointable`` protocol).

    python benchmarks/planning_scale.py [--ranks 8,64,1024,8192] [--layers 1] [--weights int8] [--experts 64]
    python benchmarks/planning_scale.py --ranks 2x2,8x128 --experts 0
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import math
import os
import pickle
import sys
import time
import tracemalloc
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import qdcp
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner
from qdcp.adapters.base import StoredEntry
from qdcp.layouts import narrow

warnings.filterwarnings("ignore")

HIDDEN, FFN, KV = 8192, 28672, 1024
LINEARS = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (KV, HIDDEN), "v_proj": (KV, HIDDEN), "o_proj": (HIDDEN, HIDDEN),
           "gate_proj": (FFN, HIDDEN), "up_proj": (FFN, HIDDEN), "down_proj": (HIDDEN, FFN)}
NORMS = ("input_layernorm", "post_attention_layernorm")


def rank_rows(rows: int, world: int, rank: int) -> int:
    """How many rows rank ``rank`` holds under Shard(0): torch.chunk sizes, as DTensor does."""
    size = -(-rows // world)
    return max(0, min(size, rows - rank * size))


def dtensor(local: torch.Tensor, mesh, shape, dtype, placements=(Shard(0),)):
    """A DTensor over ``local`` built from its spec (TE's GroupedTensor forbids view ops)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    stride = torch.empty(shape, device="meta").stride()
    return DTensor(local, DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size(shape), stride, dtype)),
                   requires_grad=False)


class Shards:
    """Local shards by (kind, global shape, rows): one stand-in per shard shape, built by torchao
    for the largest shard and cut to fewer rows through the adapter's own layouts and rebuild."""

    def __init__(self, weights: str, experts: int = 0) -> None:
        self.weights = weights
        self.experts = experts
        self._full: dict = {}
        self._cut: dict = {}
        self._plain: dict = {}

    def quantized(self, kind: str, shape, rows: int, world: int) -> torch.Tensor:
        most = -(-shape[0] // world)
        key = (kind, tuple(shape), most)
        if key not in self._full:
            self._full[key] = self._build(kind, (most, shape[1]))
        if rows == most:
            return self._full[key]
        cut = (key, rows)
        if cut not in self._cut:
            t = self._full[key]
            adapter = qdcp.find_adapter(t)
            chunk = ((0, 0), (rows, shape[1]))
            comps = {n: narrow(c, layout.map_chunk(tuple(t.shape), chunk))
                     for (n, c), layout in zip(adapter.components(t).items(), adapter.layouts(t).values())}
            self._cut[cut] = adapter.rebuild(StoredEntry(adapter.type_name(t), adapter.attributes(t), (rows, shape[1]),
                                                         t.dtype, {n: c.clone() for n, c in comps.items()}))
        return self._cut[cut]

    def local(self, kind: str, shape) -> torch.Tensor:
        """A stand-in local tensor of ``shape`` (one per kind and shape)."""
        key = (kind, tuple(shape), "local")
        if key not in self._full:
            self._full[key] = self._build(kind, tuple(shape))
        return self._full[key]

    def plain(self, shape, dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if key not in self._plain:
            self._plain[key] = torch.zeros(shape, dtype=dtype)
        return self._plain[key]

    def _build(self, kind: str, shape) -> torch.Tensor:
        g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
        if kind == "optim":
            from torchao.optim.subclass_8bit import OptimState8bit
            t = OptimState8bit.zeros(shape, signed=True, block_size=256)
            t.codes.copy_(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8))
            return t
        hp = torch.randn(shape, generator=g, dtype=torch.bfloat16)
        if self.weights == "nvfp4":
            from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
            return NVFP4Tensor.to_nvfp4(hp)
        from torchao.quantization import Int8Tensor, PerRow
        return Int8Tensor.from_hp(hp, PerRow())


def rank_states(world: int, rank: int, mesh, layers: int, shards: Shards) -> tuple[dict, dict]:
    """Rank ``rank``'s quantized state dict and DCP's plain-components twin of it."""
    state, twin = {}, {}
    for i in range(layers):
        for name, shape in LINEARS.items():
            rows = rank_rows(shape[0], world, rank)
            fqn = f"model.layers.{i}.{name}.weight"
            for key, kind in ((fqn, "weight"), (f"optim.{fqn}.exp_avg", "optim"), (f"optim.{fqn}.exp_avg_sq", "optim")):
                if kind == "optim" and rows == 0:
                    continue  # torchao's 8-bit state cannot be empty: a rank with no rows has none
                local = shards.quantized(kind, shape, rows, world)
                state[key] = dtensor(local, mesh, shape, local.dtype)
                twin.update(_twin(key, local, shape, mesh, world, rank, shards))
        for name in NORMS:
            key = f"model.layers.{i}.{name}.weight"
            rows = rank_rows(HIDDEN, world, rank)
            state[key] = twin[key] = dtensor(shards.plain((rows,), torch.bfloat16), mesh, (HIDDEN,), torch.bfloat16)
    return state, twin


def _twin(key, local, shape, mesh, world, rank, shards) -> dict:
    """The same components as plain tensors: each row-sharded component seen as a
    ``[logical rows, n]`` matrix (the same bytes and the same chunks as qdcp's items), a Shard(0)
    DTensor; a plain tensor where the component is the same on every rank."""
    adapter = qdcp.find_adapter(local)
    out = {}
    for (name, comp), layout in zip(adapter.components(local).items(), adapter.layouts(local).values()):
        full = layout.map_chunk(tuple(shape), ((0,) * len(shape), tuple(shape)))[1]
        if layout.map_chunk(tuple(shape), ((0, 0), (1, shape[1])))[1] == tuple(full):
            out[f"{key}.{name}"] = shards.plain(full, comp.dtype)  # replicated (qmap, per-tensor scale)
            continue
        per_row = math.prod(full) // shape[0]
        rows = rank_rows(shape[0], world, rank)
        out[f"{key}.{name}"] = dtensor(shards.plain((rows, per_row), comp.dtype), mesh, (shape[0], per_row),
                                       comp.dtype)
    return out


# ----------------------------------------------------------------------------- MoE (TE GroupedTensor)

EXPERT_SHAPE = (2048, HIDDEN)  # one expert's up projection, MXFP8 rowwise and columnwise


def te_available() -> bool:
    """TE's classes on CPU through the tests' stand-in for its compiled module (tests/te_cpu.py)."""
    import importlib.util

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    return all(importlib.util.find_spec(m) is not None for m in ("transformer_engine", "te_cpu", "te_groups"))


def moe_state(world: int, rank: int, shards: Shards) -> tuple[dict, dict]:
    """One MoE layer's experts as a TE MXFP8 GroupedTensor: ``Shard(0)`` of the stacked
    ``[experts, 2048, 8192]`` over ``min(world, experts)`` expert-parallel ranks, replicated over
    the rest (a 2-D ``(dp, ep)`` mesh); and DCP's twin of its components."""
    import te_groups

    e = shards.experts
    ep = min(world, e)
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))
    key = ("moe", e // ep)
    if key not in shards._full:
        shards._full[key] = te_groups.BY["mxfp8_both"].build(0, [EXPERT_SHAPE] * (e // ep), clean=True)
    local = shards._full[key]
    shape = (e, *EXPERT_SHAPE)
    placements = (Replicate(), Shard(0))
    fqn = "model.layers.0.mlp.experts.w1"
    twin = {}
    adapter = qdcp.find_adapter(local)
    for (name, comp), layout in zip(adapter.components(local).items(), adapter.layouts(local).values()):
        full = layout.map_chunk(shape, ((0, 0, 0), shape))[1]
        part = shards.plain(tuple(comp.shape), comp.dtype)
        twin[f"{fqn}.{name}"] = dtensor(part, mesh, full, comp.dtype, placements)
    return {fqn: dtensor(local, mesh, shape, torch.bfloat16, placements)}, twin


def local_plans(world: int, layers: int, shards: Shards, mesh2d: tuple[int, int] | None = None):
    """Every rank's local plan, qdcp's and DCP's, each made on that rank (a fake process group)."""
    q_plans, d_plans, q0, d0 = [], [], None, None
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            qp, dp = QuantizedSavePlanner(), DefaultSavePlanner()
            if mesh2d is not None:
                state = rank_states_2d(mesh2d, layers, shards)
                qp.set_up_planner(state, None, rank == 0)
                q_plans.append(qp.create_local_plan())
                twin = plan_twin(q_plans[-1], shards)
            else:
                mesh = init_device_mesh("cpu", (world,))
                state, twin = rank_states(world, rank, mesh, layers, shards)
                if shards.experts:
                    moe, moe_twin = moe_state(world, rank, shards)
                    state.update(moe)
                    twin.update(moe_twin)
                qp.set_up_planner(state, None, rank == 0)
                q_plans.append(qp.create_local_plan())
            dp.set_up_planner(twin, None, rank == 0)
            d_plans.append(dp.create_local_plan())
            if rank == 0:
                q0, d0 = (qp, state), (dp, twin)
        finally:
            dist.destroy_process_group()
    return q_plans, d_plans, q0, d0


# ----------------------------------------------------------------------------- 2-D meshes

ROWWISE = ("o_proj", "down_proj")  # RowwiseParallel: columns cut by TP; the rest ColwiseParallel


def placements_2d(name: str, tp: int) -> tuple:
    """torchtitan's FSDP2 x TP placements of a linear's weight on a ``(dp, tp)`` mesh."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return (Shard(0), Shard(1)) if name in ROWWISE else (_StridedShard(0, split_factor=tp), Shard(0))


def rank_states_2d(mesh2d: tuple[int, int], layers: int, shards: Shards) -> dict:
    """This rank's state dict on a ``(dp, tp)`` mesh: quantized linears with FSDP2 x TP placements,
    8-bit AdamW states of every linear whose shard's blocks qdcp can store (all column-parallel ones;
    a row-parallel one's column cut where its width is a multiple or divisor of the 256-element
    block: stored as their grid), norms ``(Shard(0), Replicate())``; each local built once per local shape."""
    mesh = init_device_mesh("cpu", mesh2d, mesh_dim_names=("dp", "tp"))
    state = {}
    for i in range(layers):
        for name, shape in LINEARS.items():
            placements = placements_2d(name, mesh2d[1])
            fqn = f"model.layers.{i}.{name}.weight"
            probe = dtensor(torch.empty(0), mesh, shape, torch.bfloat16, placements)
            sizes = tuple(probe.__create_chunk_list__()[0].sizes)
            grid = name not in ROWWISE or sizes[1] % 256 == 0 or 256 % sizes[1] == 0
            keys = [(fqn, "weight")] + ([(f"optim.{fqn}.exp_avg", "optim"), (f"optim.{fqn}.exp_avg_sq", "optim")]
                                        if grid else [])
            for key, kind in keys:
                local = shards.local(kind, sizes)
                state[key] = dtensor(local, mesh, shape, local.dtype, placements)
        for name in NORMS:
            rows = HIDDEN // mesh2d[0]
            state[f"model.layers.{i}.{name}.weight"] = dtensor(shards.plain((rows,), torch.bfloat16), mesh, (HIDDEN,),
                                                               torch.bfloat16, (Shard(0), Replicate()))
    return state


def plan_twin(plan, shards: Shards) -> dict:
    """DCP's baseline for a qdcp local plan: plain tensors whose chunks are exactly the items qdcp
    writes (each a ``qdcp.staging.chunked.ChunkCopies``, which DCP plans through its ``_Checkpointable``
    protocol), planned by DCP's default planner."""
    import dataclasses as dc
    from collections import defaultdict

    from qdcp.staging.chunked import ChunkCopies

    by_fqn = defaultdict(list)
    for item in plan.items:
        if item.tensor_data is not None:
            by_fqn[item.index.fqn].append(item)
    twin = {}
    for fqn, items in by_fqn.items():
        td = items[0].tensor_data
        like = torch.empty(tuple(td.size), dtype=td.properties.dtype, device="meta")
        chunks = [(i.index.offset, shards.plain(tuple(i.tensor_data.chunk.sizes), td.properties.dtype))
                  for i in items]
        twin[fqn] = ChunkCopies(like, chunks, [dc.replace(i, index=dc.replace(i.index, index=None)) for i in items])
    return twin


def coordinator(planner_cls, plans, state):
    """A fresh coordinator planner, set up on rank 0's state; its global plan and finish timed."""
    planner = planner_cls()
    planner.set_up_planner(state, None, True)
    planner.create_local_plan()
    gc.collect()
    t0 = time.perf_counter()
    central, metadata = planner.create_global_plan(list(plans))
    planner.finish_plan(central[0])
    gc.collect()
    return time.perf_counter() - t0, getattr(planner, "metadata", metadata)


def peak_memory(planner_cls, plans, state) -> int:
    planner = planner_cls()
    planner.set_up_planner(state, None, True)
    planner.create_local_plan()
    gc.collect()
    tracemalloc.start()
    central, _ = planner.create_global_plan(list(plans))
    planner.finish_plan(central[0])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def load_side(planner_cls, blob: bytes, state) -> float:
    """Unpickle ``.metadata`` and plan one rank's load (rank 0's state as the target)."""
    gc.collect()
    t0 = time.perf_counter()
    md = pickle.load(io.BytesIO(blob))
    planner = planner_cls()
    planner.set_up_planner(state, md, False)
    planner.create_local_plan()
    gc.collect()
    return time.perf_counter() - t0


def measure(world: int, layers: int, shards: Shards, repeat: int, mesh2d: tuple[int, int] | None = None) -> dict:
    t0 = time.perf_counter()
    q_plans, d_plans, (qp0, q_state), (dp0, d_state) = local_plans(world, layers, shards, mesh2d)
    local_s = time.perf_counter() - t0
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        init_device_mesh("cpu", mesh2d or (world,))
        q_times, d_times = [], []
        for _ in range(repeat):
            qt, q_md = coordinator(QuantizedSavePlanner, q_plans, q_state)
            dt, d_md = coordinator(DefaultSavePlanner, d_plans, d_state)
            q_times.append(qt)
            d_times.append(dt)
        q_blob, d_blob = pickle.dumps(q_md), pickle.dumps(d_md)
        q_mem = peak_memory(QuantizedSavePlanner, q_plans, q_state)
        d_mem = peak_memory(DefaultSavePlanner, d_plans, d_state)
        q_load = min(load_side(QuantizedLoadPlanner, q_blob, q_state) for _ in range(repeat))
        d_load = min(load_side(DefaultLoadPlanner, d_blob, d_state) for _ in range(repeat))
    finally:
        dist.destroy_process_group()
    return {"ranks": f"{mesh2d[0]}x{mesh2d[1]}" if mesh2d else world, "items": sum(len(p.items) for p in q_plans),
            "dcp_items": sum(len(p.items) for p in d_plans), "local_plans_s": local_s,
            "qdcp_global_s": min(q_times), "dcp_global_s": min(d_times), "qdcp_md_bytes": len(q_blob),
            "dcp_md_bytes": len(d_blob), "qdcp_peak_mib": q_mem / 2**20, "dcp_peak_mib": d_mem / 2**20,
            "qdcp_load_s": q_load, "dcp_load_s": d_load}


COLS = ["ranks", "items", "dcp_items", "qdcp_global_s", "dcp_global_s", "time_ratio", "qdcp_md_bytes",
        "dcp_md_bytes", "md_ratio", "qdcp_peak_mib", "dcp_peak_mib", "mem_ratio", "qdcp_load_s", "dcp_load_s",
        "load_ratio"]


def run_all(worlds: list, layers: int, shards: Shards, repeat: int) -> list[dict]:
    """Measure every world size (an int) or 2-D mesh (``(dp, tp)``), printing a row as each is done."""
    print(" | ".join(COLS))
    rows = []
    for world in worlds:
        r = measure(world[0] * world[1], layers, shards, repeat, world) if isinstance(world, tuple) \
            else measure(world, layers, shards, repeat)
        r["time_ratio"] = r["qdcp_global_s"] / r["dcp_global_s"]
        r["md_ratio"] = r["qdcp_md_bytes"] / r["dcp_md_bytes"]
        r["mem_ratio"] = r["qdcp_peak_mib"] / r["dcp_peak_mib"]
        r["load_ratio"] = r["qdcp_load_s"] / r["dcp_load_s"]
        rows.append(r)
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in COLS), flush=True)
    return rows


def print_growth(rows: list[dict]) -> None:
    """How each measure grows from 1,024 to 8,192 ranks (where both were run)."""
    by = {r["ranks"]: r for r in rows}
    if 1024 in by and 8192 in by:
        a, b = by[1024], by[8192]
        print("growth 1024 -> 8192 (8x the ranks):")
        for name in ("qdcp_global_s", "dcp_global_s", "qdcp_md_bytes", "dcp_md_bytes", "qdcp_peak_mib",
                     "dcp_peak_mib", "qdcp_load_s", "dcp_load_s"):
            print(f"  {name}: x{b[name] / a[name]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,64,1024,8192",
                        help="world sizes (1-D FSDP), or DPxTP for a 2-D FSDP2 x TP mesh (e.g. 8x128)")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--weights", choices=["int8", "nvfp4"], default="int8")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--experts", type=int, default=64,
                        help="experts of a TE MXFP8 MoE layer (0: none; needs TransformerEngine installed)")
    args = parser.parse_args()
    experts = args.experts if args.experts and te_available() else 0
    if args.experts and not experts:
        print("TransformerEngine is not installed: no MoE layer")
    shards = Shards(args.weights, experts)
    with contextlib.ExitStack() as stack:
        if experts:  # TE asks torch.cuda about the device while it splits a group into members
            import te_cpu
            stack.enter_context(te_cpu.simulate_gpu(te_cpu.HOPPER))
        worlds = [tuple(int(v) for v in x.split("x")) if "x" in x else int(x) for x in args.ranks.split(",")]
        rows = run_all(worlds, args.layers, shards, args.repeat)
    print_growth(rows)


if __name__ == "__main__":
    main()
