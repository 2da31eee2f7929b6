"""The script every ``torchrun`` rank runs for ``tests/test_te_distributed.py`` (TE tensors, N -> M).

    python -m torch.distributed.run --nproc-per-node N tests/te_dist_worker.py COMMAND DIR

TE's real classes on CPU (``te_cpu`` stands in for the compiled module, installed before any TE
import; tensors are built under ``simulate_gpu(HOPPER)``). Every format is a ``(512, 256)`` bf16
tensor whose buffers are cut from deterministic *global* buffers (compact canonical form): each rank
builds its rows' TE tensor (native padding garbage-filled) and wraps it as a ``Shard(0)`` DTensor
built from a ``DTensorSpec`` (no view ops).

- ``save DIR`` at N ranks: N in {1, 2, 4} (128-row aligned shards) saves every format to
  ``DIR/n{N}/main``. N = 3 (171/171/170 rows) saves the formats whose blocks do not straddle shard
  boundaries to ``DIR/n3/main`` and tries each straddling format on its own (``DIR/n3/<fmt>``), where
  the save must fail at planning with an ``AlignmentError`` naming the key. At N in {2, 4}, shards
  whose per-tensor values differ (Float8 ``scale_inv``, NVFP4 amax) must be refused naming the key.
- ``load DIR`` at M ranks: every ``DIR/n*/main`` into plain ``Shard(0)`` DTensors and plain full
  tensors (bitwise the reference dequantize of the global buffers, computed here with qdcp's TE
  adapter on a full-size TE tensor) and into same-type TE ``Shard(0)`` targets built from other
  (garbage) buffers (canonical components bitwise the global rows', buffers updated in place).
  Where M's rows straddle a format's blocks, the TE target load must fail at planning with an
  ``AlignmentError`` naming the key; plain targets still load exactly (covering blocks).

- ``save2d DIR`` at 4 ranks: every format on a ``(2, 2)`` mesh with FSDP2 x TP's placements of a
  column-parallel weight (``_StridedShard(0)`` x ``Shard(0)``) and HSDP's (``Replicate()`` x
  ``Shard(0)``, replicas compared with ``check_replicas=True``); ``load`` loads them like the rest.

Sections of failures go to ``DIR/results-<command>-<world>.json``, as in ``dist_worker.py``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import te_cpu  # noqa: E402

te = te_cpu.install()  # before anything imports transformer_engine

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402
from transformer_engine.pytorch.constants import DType  # noqa: E402

from dist_helpers import dtensor_from_local, init_torchrun_mesh, my_row_chunk, row_chunks  # noqa: E402
from qdcp import AlignmentError, QuantizedSavePlanner  # noqa: E402
from qdcp.adapters import find_adapter  # noqa: E402
from quantized_cases import (  # noqa: E402
    bits,
    bits_diff,  # noqa: E402
    seeded,
)
from quantized_cases import components_diff as canonical_diff  # noqa: E402
from worker_results import RANK, WORLD, check, qdcp_error_in, run, try_load  # noqa: E402
from worker_results import short as _short  # noqa: E402

ROWS, COLS = 512, 256
SHAPE = (ROWS, COLS)
DTYPE = torch.bfloat16
E4M3 = DType.kFloat8E4M3

FORMATS = ("float8", "mxfp8", "block1d", "block2d", "nvfp4")
STRADDLING = ("block1d", "block2d")  # 128-row blocks (1x128 columnwise, 128x128): need aligned rows
SEED = {f: 10 * i + 1 for i, f in enumerate(FORMATS)}
TARGET_SEED = 1000  # added to SEED for the garbage buffers of same-type targets


# ----------------------------------------------------------------------------- global buffers


def _fp8_bits(shape, seed: int) -> torch.Tensor:
    """Random e4m3 bytes without NaN codes."""
    b = torch.randint(0, 256, shape, generator=seeded(seed), dtype=torch.int32).to(torch.uint8)
    return torch.where((b & 0x7F) == 0x7F, b & 0xF0, b)


def global_buffers(fmt: str, seed: int) -> dict[str, torch.Tensor]:
    """The whole tensor's buffers in compact, logical-row-order form."""
    m, n = SHAPE
    if fmt == "float8":
        return {"data": _fp8_bits(SHAPE, seed), "scale_inv": torch.rand(1, generator=seeded(seed + 1)) * 0.01 + 1e-3}
    if fmt == "mxfp8":  # e8m0 codes 2^-9 .. 2^8 per row x 32 cols
        return {"data": _fp8_bits(SHAPE, seed),
                "scale": torch.randint(118, 136, (m, n // 32), generator=seeded(seed + 1)).to(torch.uint8)}
    if fmt == "block1d":  # rowwise f32 per row x 128 cols; columnwise its own data, f32 per 128 rows x col
        return {"data": _fp8_bits(SHAPE, seed),
                "scale": torch.rand(m, n // 128, generator=seeded(seed + 1)) * 0.01 + 1e-4,
                "cdata": _fp8_bits(SHAPE, seed + 2),
                "cscale": torch.rand(m // 128, n, generator=seeded(seed + 3)) * 0.01 + 1e-4}
    if fmt == "block2d":  # f32 per 128x128 tile
        return {"data": _fp8_bits(SHAPE, seed),
                "scale": torch.rand(m // 128, n // 128, generator=seeded(seed + 1)) * 0.01 + 1e-4}
    if fmt == "nvfp4":  # e2m1 pairs, positive finite e4m3 codes per row x 16 cols, one amax
        return {"data": torch.randint(0, 256, (m, n // 2), generator=seeded(seed)).to(torch.uint8),
                "scale": torch.randint(0x08, 0x7F, (m, n // 16), generator=seeded(seed + 1)).to(torch.uint8),
                "amax": torch.rand(1, generator=seeded(seed + 2)) * 10 + 0.5}
    raise ValueError(fmt)


def _ru(x: int, k: int) -> int:
    return -(-x // k) * k


def build(fmt: str, g: dict[str, torch.Tensor], o: int, s: int) -> torch.Tensor:
    """The TE tensor of rows ``[o, o + s)`` of the global buffers ``g`` (native layout)."""
    n = COLS
    with te_cpu.simulate_gpu(te_cpu.HOPPER):
        if fmt == "float8":  # Hopper, rowwise + columnwise: data and its transpose
            data = g["data"][o:o + s].clone()
            q = te.Float8CurrentScalingQuantizer(E4M3, device="cpu", rowwise=True, columnwise=True)
            return te.Float8Tensor(shape=(s, n), dtype=DTYPE, data=data, fp8_scale_inv=g["scale_inv"].clone(),
                                   fp8_dtype=E4M3, data_transpose=data.t().contiguous(), quantizer=q,
                                   device="cpu")
        if fmt == "mxfp8":  # rowwise, compact scales
            q = te.MXFP8Quantizer(E4M3, rowwise=True, columnwise=False)
            q.optimize_for_gemm = False
            return te.MXFP8Tensor(
                shape=(s, n), dtype=DTYPE, fp8_dtype=E4M3, quantizer=q, with_gemm_swizzled_scales=False,
                device="cpu", rowwise_data=g["data"][o:o + s].clone(),
                rowwise_scale_inv=te_cpu.padded(g["scale"][o:o + s], _ru(s, 128), _ru(n // 32, 4)),
                columnwise_data=None, columnwise_scale_inv=None)
        if fmt in ("block1d", "block2d"):
            t0, tl = o // 128, -(-s // 128)  # unaligned shards: the covering tiles (refused at planning)
            q = te.Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True,
                                        block_scaling_dim=2 if fmt == "block2d" else 1)
            data = g["data"][o:o + s].clone()
            if fmt == "block2d":
                tiles = te_cpu.padded(g["scale"][t0:t0 + tl], tl, n // 128)  # NaN rows past the tensor's tiles
                kw = dict(rowwise_data=data, rowwise_scale_inv=te_cpu.padded(tiles, tl, _ru(n // 128, 4)),
                          columnwise_data=data.t().contiguous(),
                          columnwise_scale_inv=te_cpu.padded(tiles.t(), n // 128, _ru(tl, 4)))
            else:
                cs = te_cpu.padded(g["cscale"][t0:t0 + tl], tl, n)
                kw = dict(rowwise_data=data,
                          rowwise_scale_inv=te_cpu.padded(g["scale"][o:o + s].t(), n // 128, _ru(s, 4)),
                          columnwise_data=g["cdata"][o:o + s].t().contiguous(),
                          columnwise_scale_inv=te_cpu.padded(cs, tl, _ru(n, 4)))
            return te.Float8BlockwiseQTensor(shape=(s, n), dtype=DTYPE, fp8_dtype=E4M3, quantizer=q,
                                             is_2D_scaled=fmt == "block2d", device="cpu", **kw)
        if fmt == "nvfp4":  # rowwise, compact scales, one per-tensor amax (the same on every rank)
            return te.NVFP4Tensor(
                shape=(s, n), dtype=DTYPE, fp4_dtype=DType.kFloat4E2M1, quantizer=None,
                with_gemm_swizzled_scales=False, row_scaled_nvfp4=False, device="cpu",
                rowwise_data=g["data"][o:o + s].clone(),
                rowwise_scale_inv=te_cpu.padded(g["scale"][o:o + s], _ru(s, 128), _ru(n // 16, 4)),
                amax_rowwise=g["amax"].clone(), columnwise_data=None, columnwise_scale_inv=None,
                amax_columnwise=None)
    raise ValueError(fmt)


# ----------------------------------------------------------------------------- DTensors

def aligned(world: int) -> bool:
    return all(o % 128 == 0 and s % 128 == 0 for o, s in row_chunks(ROWS, world))


def make_dtensor(local: torch.Tensor, mesh) -> DTensor:
    """A Shard(0) DTensor of the test's global shape over ``local``."""
    return dtensor_from_local(local, mesh, (Shard(0),), SHAPE, DTYPE)


# ----------------------------------------------------------------------------- save

def save(root: str, mesh) -> None:
    out = os.path.join(root, f"n{WORLD}")
    o, s = my_row_chunk(ROWS)
    main_formats = FORMATS if aligned(WORLD) else tuple(f for f in FORMATS if f not in STRADDLING)
    state = {"step": WORLD}
    for fmt in main_formats:
        state[f"te.{fmt}"] = make_dtensor(build(fmt, global_buffers(fmt, SEED[fmt]), o, s), mesh)
    try:
        dcp.save(state, checkpoint_id=os.path.join(out, "main"), planner=QuantizedSavePlanner())
        check("save", True, "")
    except BaseException as e:  # noqa: BLE001 (CheckpointException is a BaseException)
        check("save", False, f"dcp.save at {WORLD} ranks ({', '.join(main_formats)}): {_short(e)}")
    if aligned(WORLD):
        if WORLD > 1:
            save_mismatched_per_tensor(out, mesh)
        return

    # Unaligned rows: a format whose blocks straddle the shard boundaries must be refused at planning.
    outcomes = {}
    for fmt in STRADDLING:
        path = os.path.join(out, fmt)
        g = global_buffers(fmt, SEED[fmt])
        local = build(fmt, g, o, s)  # its tile rows: the covering tiles (TE's shape for s rows)
        key = f"te.{fmt}"
        try:
            dcp.save({key: make_dtensor(local, mesh)}, checkpoint_id=path, planner=QuantizedSavePlanner())
            outcomes[fmt] = "saved"
            check("unaligned_save_error", False, f"{fmt}: rows {row_chunks(ROWS, WORLD)} saved without an error")
        except BaseException as e:  # noqa: BLE001
            q = qdcp_error_in(e)
            outcomes[fmt] = f"error {type(q or e).__name__}: {_short(q or e, 400)}"
            check("unaligned_save_error", isinstance(q, AlignmentError) and repr(key) in str(q)
                  and "The nearest layout that works: " in str(q) and "save this entry dequantized" in str(q),
                  f"{fmt}: not an AlignmentError naming {key!r} and the nearest layout: {_short(e)}")
        dist.barrier()
        check("unaligned_save_error", not os.path.exists(os.path.join(path, ".metadata")),
              f"{fmt}: a refused save left a .metadata behind")
    if RANK == 0:
        with open(os.path.join(out, "unaligned_outcomes.json"), "w") as f:
            json.dump(outcomes, f, indent=1)


def save_mismatched_per_tensor(out: str, mesh) -> None:
    """Shards holding different per-tensor values (Float8 scale_inv, NVFP4 amax), e.g. each quantized
    on its own: DCP would keep one rank's copy, so the save must fail naming the key."""
    o, s = my_row_chunk(ROWS)
    for fmt, name in (("float8", "scale_inv"), ("nvfp4", "amax")):
        g = global_buffers(fmt, SEED[fmt])
        g[name] = g[name] * (1 + RANK)
        key, path = f"te.{fmt}", os.path.join(out, f"mismatch_{fmt}")
        try:
            dcp.save({key: make_dtensor(build(fmt, g, o, s), mesh)}, checkpoint_id=path,
                     planner=QuantizedSavePlanner())
            check(f"mismatched_per_tensor[{fmt}]", False, f"{fmt}: ranks with different {name} saved")
        except BaseException as e:  # noqa: BLE001
            q = qdcp_error_in(e)
            check(f"mismatched_per_tensor[{fmt}]", isinstance(q, AlignmentError) and repr(key) in str(q),
                  f"{fmt}: not an AlignmentError naming {key!r}: {_short(e)}")
        dist.barrier()
        check(f"mismatched_per_tensor[{fmt}]", not os.path.exists(os.path.join(path, ".metadata")),
              f"{fmt}: a refused save left a .metadata behind")


# 2-D meshes at 4 ranks, (dp=2, tp=2): torchtitan's FSDP2 x TP placements of a column-parallel
# weight, and HSDP's; each with the 1-D world size whose row blocks it gives (for ``aligned``)
MESH2D = {"colwise": ((_StridedShard(0, split_factor=2), Shard(0)), 4), "hsdp": ((Replicate(), Shard(0)), 2)}


def save2d(root: str, _mesh) -> None:
    """Every format at a (2, 2) mesh, one checkpoint per layout (``DIR/m2d_<layout>/main``), the
    replicas (HSDP) compared on save; the ``load`` command loads them with the 1-D ones."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for layout, (placements, n) in MESH2D.items():
        chunk = dtensor_from_local(torch.empty(0), mesh, placements, SHAPE, DTYPE).__create_chunk_list__()[0]
        o, s = chunk.offsets[0], chunk.sizes[0]
        state = {"step": n}  # what the loads check it against
        for fmt in FORMATS:
            local = build(fmt, global_buffers(fmt, SEED[fmt]), o, s)
            state[f"te.{fmt}"] = dtensor_from_local(local, mesh, placements, SHAPE, DTYPE)
        try:
            dcp.save(state, checkpoint_id=os.path.join(root, f"m2d_{layout}", "main"),
                     planner=QuantizedSavePlanner(check_replicas=True))
        except BaseException as e:  # noqa: BLE001
            check("save2d", False, f"dcp.save at (2, 2) {layout}: {_short(e)}")
    check("save2d", True, "")


# ----------------------------------------------------------------------------- load

def load(root: str, mesh) -> None:
    refs = {}
    for fmt in FORMATS:
        g = global_buffers(fmt, SEED[fmt])
        full = build(fmt, g, 0, ROWS)
        refs[fmt] = (g, find_adapter(full).dequantize(full))
    loaded = []
    for sub in sorted(os.listdir(root)):
        path = os.path.join(root, sub, "main")
        if sub.startswith("n") and sub[1:].isdigit() and os.path.exists(os.path.join(path, ".metadata")):
            load_one(path, int(sub[1:]), refs, mesh)
            loaded.append(int(sub[1:]))
    check("loaded_all", sorted(loaded) == [1, 2, 3, 4], f"loaded the checkpoints saved at N={loaded} only")
    for layout, (_, n) in MESH2D.items():
        path = os.path.join(root, f"m2d_{layout}", "main")
        check("loaded_all", os.path.exists(os.path.join(path, ".metadata")), f"no (2, 2) {layout} checkpoint")
        if os.path.exists(os.path.join(path, ".metadata")):
            load_one(path, n, refs, mesh, tag=f"(2, 2) {layout}->M={WORLD}")


def load_one(path: str, n: int, refs: dict, mesh, tag: str | None = None) -> None:
    """Load the ``n``-rank checkpoint at ``path`` into plain, same-type and misaligned TE targets."""
    tag = tag or f"N={n}->M={WORLD}"
    formats = FORMATS if aligned(n) else tuple(f for f in FORMATS if f not in STRADDLING)
    _into_plain(path, n, refs, mesh, tag, formats)
    _into_same_type(path, refs, mesh, tag, formats)
    if not aligned(WORLD):
        _straddling_targets_refused(path, mesh, tag, formats)


def _into_plain(path: str, n: int, refs: dict, mesh, tag: str, formats: tuple) -> None:
    """(a) plain Shard(0) DTensors and plain full tensors: the reference dequantize, bit for bit."""
    o, s = my_row_chunk(ROWS)
    for section, sharded in (("plain_shard", True), ("plain_full", False)):
        state = {"step": -1}
        for fmt in formats:
            state[f"te.{fmt}"] = (make_dtensor(torch.zeros((s, COLS), dtype=DTYPE), mesh) if sharded
                                  else torch.zeros(SHAPE, dtype=DTYPE))
        err = try_load(state, path)
        for fmt in formats:
            if err is not None:
                check(f"{section}[{fmt}]", False, f"{tag}: load into plain targets: {_short(err)}")
                continue
            ref = refs[fmt][1]
            got = state[f"te.{fmt}"]._local_tensor if sharded else state[f"te.{fmt}"]
            want = ref[o:o + s] if sharded else ref
            diff = bits_diff(got, want)
            check(f"{section}[{fmt}]", diff is None and state["step"] == n,
                  f"{tag}: te.{fmt} != reference dequantize ({diff}; step {state['step']})")


def _into_same_type(path: str, refs: dict, mesh, tag: str, formats: tuple) -> None:
    """(b) same-type TE Shard(0) targets holding other buffers: canonical components of the global
    rows, filled in place."""
    o, s = my_row_chunk(ROWS)
    state, locals_ = {}, {}
    for fmt in formats:
        if fmt in STRADDLING and not aligned(WORLD):
            continue
        local = build(fmt, global_buffers(fmt, SEED[fmt] + TARGET_SEED), o, s)
        state[f"te.{fmt}"] = make_dtensor(local, mesh)
        locals_[fmt] = (local, te_cpu.inner_ptrs(local))
    err = try_load(state, path) if state else None
    for fmt, (local, ptrs) in locals_.items():
        section = f"same_type[{fmt}]"
        if err is not None:
            check(section, False, f"{tag}: load into same-type TE targets: {_short(err)}")
            continue
        check(section, state[f"te.{fmt}"]._local_tensor is local and te_cpu.inner_ptrs(local) == ptrs,
              f"{tag}: te.{fmt}: the target's local tensor or buffers were replaced, not updated in place")
        diff = canonical_diff(local, build(fmt, refs[fmt][0], o, s)) or te_cpu.derived_diff(fmt, local)
        check(section, diff is None, f"{tag}: te.{fmt}: {diff}")


def _straddling_targets_refused(path: str, mesh, tag: str, formats: tuple) -> None:
    """(c) TE targets whose rows straddle the format's blocks: a planning-time error naming the key,
    the target unchanged."""
    o, s = my_row_chunk(ROWS)
    for fmt in formats:
        if fmt not in STRADDLING:
            continue
        key = f"te.{fmt}"
        local = build(fmt, global_buffers(fmt, SEED[fmt] + TARGET_SEED), o, s)
        before = {k: bits(v).clone() for k, v in find_adapter(local).inner_buffers(local).items()}
        err = try_load({key: make_dtensor(local, mesh)}, path)
        q = qdcp_error_in(err) if err is not None else None
        check(f"unaligned_target_error[{fmt}]", isinstance(q, AlignmentError) and repr(key) in str(q),
              f"{tag}: {key} into TE targets of rows {row_chunks(ROWS, WORLD)}: expected an AlignmentError "
              f"naming the key, got {'no error' if err is None else _short(err)}")
        after = find_adapter(local).inner_buffers(local)
        check(f"unaligned_target_error[{fmt}]", all(torch.equal(before[k], bits(after[k])) for k in before),
              f"{tag}: {key}: a refused load changed the target")


# ----------------------------------------------------------------------------- main

COMMANDS = {"save": save, "save2d": save2d, "load": load}


def main() -> int:
    return run(COMMANDS, init_torchrun_mesh)


if __name__ == "__main__":
    sys.exit(main())
