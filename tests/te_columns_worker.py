"""The script every ``torchrun`` rank runs for ``tests/test_te_columns.py``: TE tensors cut by columns.

    python -m torch.distributed.run --nproc-per-node N tests/te_columns_worker.py COMMAND DIR

TE's real classes on CPU (``te_cpu`` stands in for the compiled module; tensors are built under
``simulate_gpu(HOPPER)``). Each format is a ``(512, N)`` bf16 tensor whose buffers are cut from
deterministic *global* buffers (compact canonical form, native padding garbage-filled), with ``N``
twice the format's column block, so that a cut into 2 column shards falls on blocks, a cut into 3
splits blocks and a cut into 4 leaves every rank less than one block:

- ``float8``: per-tensor current scaling, Hopper: ``_data`` and its ``_transpose`` (no column block);
- ``mxfp8``: rowwise 1x32 and columnwise 32x1 E8M0 scales (column block 32);
- ``mxfp8_colwise``: the columnwise direction only (32x1: no column block);
- ``block1d``: blockwise 1x128 rowwise and 128x1 columnwise (column block 128);
- ``block2d``: blockwise 128x128 (column block 128);
- ``nvfp4``: rowwise 1x16 E4M3 scales, one amax (column block 16);
- ``nvfp4_2d``: TE's 2-D (16x16) weight quantization: rowwise and columnwise copies whose scales
  are constant on 16x16 tiles, the columnwise codes the transpose of the rowwise ones.

``save DIR`` (4 ranks, a ``(dp=2, tp=2)`` mesh): every format with the placements torchtitan's
FSDP2 x TP gives a column-parallel weight (``_StridedShard(0)`` x ``Shard(0)``: rows) and a
row-parallel one (``Shard(0)`` x ``Shard(1)``: columns), to ``DIR/src_<layout>``.

``load DIR`` at M ranks loads both checkpoints into targets cut by columns:

- M = 1: whole TE tensors; M = 2: ``Shard(1)`` (TP's ``RowwiseParallel``); M = 4: a ``(2, 2)`` mesh
  ``(Shard(0), Shard(1))``: column cuts on block boundaries. Same-type targets (other buffers) must
  end up with the canonical components of the same block of the global buffers (derived copies
  rebuilt, buffers updated in place), and TE's own ``dequantize()`` (where TE has a CPU one: Float8,
  blockwise) of each rank's target equals that block of TE's ``dequantize()`` of the whole source
  (gathered: the whole loaded tensor's); plain targets equal the reference dequantize.
- M = 3 (``Shard(1)``: blocks split) and M = 4 on a ``(1, 4)`` mesh ``(Shard(0), Shard(1))`` (each
  rank less than one block): formats with a column block must be refused at load planning with an
  ``AlignmentError`` naming the key and the nearest layout that works, the target's buffers
  bit-identical afterwards; the others load exactly; plain targets load every format exactly.

Where CUDA has a device per rank the ranks run nccl with their tensors there; otherwise gloo on CPU.
Sections of failures go to ``DIR/results-<command>-<world>.json`` (``worker_results``).
"""

from __future__ import annotations

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
from torch.distributed.tensor import Shard  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402
from transformer_engine.pytorch.constants import DType  # noqa: E402

from dist_helpers import dtensor_from_local, init_torchrun_mesh  # noqa: E402
from qdcp import AlignmentError, QuantizedSavePlanner  # noqa: E402
from qdcp.adapters import find_adapter  # noqa: E402
from quantized_cases import bits, bits_diff, seeded  # noqa: E402
from quantized_cases import components_diff as canonical_diff  # noqa: E402
from worker_results import RANK, WORLD, check, qdcp_error_in, run, try_load  # noqa: E402
from worker_results import short as _short  # noqa: E402

ROWS = 512
DTYPE = torch.bfloat16
E4M3 = DType.kFloat8E4M3
# format -> (columns, column block, row block): the blocks every stored component's layout falls on
FORMATS = {"float8": (64, 1, 1), "mxfp8": (64, 32, 32), "mxfp8_colwise": (64, 1, 32), "block1d": (256, 128, 128),
           "block2d": (256, 128, 128), "nvfp4": (32, 16, 1), "nvfp4_2d": (32, 16, 16)}
TE_CPU_DEQUANTIZE = ("float8", "block1d", "block2d")  # TE's MXFP8 / NVFP4 dequantize is a CUDA kernel
SEED = {f: 10 * i + 1 for i, f in enumerate(FORMATS)}
TARGET_SEED = 1000  # added to SEED for the garbage buffers of same-type targets
SOURCES = {"colwise": (_StridedShard(0, split_factor=2), Shard(0)), "rowwise": (Shard(0), Shard(1))}
CUDA = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if CUDA else torch.device("cpu")
Block = tuple[int, int, int, int]  # row offset, column offset, rows, columns


def shape(fmt: str) -> tuple[int, int]:
    return ROWS, FORMATS[fmt][0]


# ----------------------------------------------------------------------------- global buffers

def _fp8_bits(size, seed: int) -> torch.Tensor:
    """Random e4m3 bytes without NaN codes."""
    b = torch.randint(0, 256, size, generator=seeded(seed), dtype=torch.int32).to(torch.uint8)
    return torch.where((b & 0x7F) == 0x7F, b & 0xF0, b)


def _e8m0(size, seed: int) -> torch.Tensor:
    return torch.randint(118, 136, size, generator=seeded(seed)).to(torch.uint8)  # 2^-9 .. 2^8


def _f32(size, seed: int) -> torch.Tensor:
    return torch.rand(size, generator=seeded(seed)) * 0.01 + 1e-4


def _pack_row_pairs(packed_rows: torch.Tensor) -> torch.Tensor:
    """NVFP4 ``(M, N/2)`` rowwise bytes (element 2k in the low nibble) -> ``(M/2, N)`` bytes holding
    logical rows 2k (low nibble) and 2k+1 of each column: the columnwise codes of the transpose."""
    codes = torch.stack([packed_rows & 0xF, packed_rows >> 4], dim=-1).reshape(packed_rows.shape[0], -1)
    return codes[0::2] | (codes[1::2] << 4)


def global_buffers(fmt: str, seed: int) -> dict[str, torch.Tensor]:
    """The whole tensor's buffers in compact, logical-order form."""
    m, n = shape(fmt)
    if fmt == "float8":
        return {"data": _fp8_bits((m, n), seed), "scale_inv": torch.rand(1, generator=seeded(seed + 1)) * 0.01 + 1e-3}
    if fmt in ("mxfp8", "mxfp8_colwise"):
        g = {"cdata": _fp8_bits((m, n), seed + 2), "cscale": _e8m0((m // 32, n), seed + 3)}
        if fmt == "mxfp8":
            g.update(data=_fp8_bits((m, n), seed), scale=_e8m0((m, n // 32), seed + 1))
        return g
    if fmt == "block1d":
        return {"data": _fp8_bits((m, n), seed), "scale": _f32((m, n // 128), seed + 1),
                "cdata": _fp8_bits((m, n), seed + 2), "cscale": _f32((m // 128, n), seed + 3)}
    if fmt == "block2d":
        return {"data": _fp8_bits((m, n), seed), "scale": _f32((m // 128, n // 128), seed + 1)}
    data = torch.randint(0, 256, (m, n // 2), generator=seeded(seed)).to(torch.uint8)
    amax = torch.rand(1, generator=seeded(seed + 2)) * 10 + 0.5
    if fmt == "nvfp4":
        scale = torch.randint(0x08, 0x7F, (m, n // 16), generator=seeded(seed + 1)).to(torch.uint8)
        return {"data": data, "scale": scale, "amax": amax}
    tiles = torch.randint(0x08, 0x7F, (m // 16, n // 16), generator=seeded(seed + 1)).to(torch.uint8)
    return {"data": data, "scale": tiles.repeat_interleave(16, 0), "cdata": _pack_row_pairs(data),
            "cscale": tiles.repeat_interleave(16, 1), "amax": amax}


def _ru(x: int, k: int) -> int:
    return -(-x // k) * k


def part(t: torch.Tensor, blk: Block, rb: int = 1, cb: int = 1) -> torch.Tensor:
    """The items of a component with one item per ``rb x cb`` logical elements that a block of
    TE's local shape needs: ``ceil(rows / rb) x ceil(cols / cb)`` of them from the block's first
    one (on block boundaries: exactly the block's; elsewhere a same-shape stand-in, garbage past
    the end)."""
    r0, c0, rs, cs = blk
    rows, cols = -(-rs // rb), -(-cs // cb)
    return te_cpu.padded(t[r0 // rb: r0 // rb + rows, c0 // cb: c0 // cb + cols], rows, cols)


def _native(fmt: str, g: dict, blk: Block) -> tuple[type, dict]:
    """TE's class and constructor buffers (native layout, on CPU) for block ``blk`` of ``g``."""
    rs, cs = blk[2], blk[3]
    if fmt == "float8":
        data = part(g["data"], blk)
        return te.Float8Tensor, dict(data=data, data_transpose=data.t().contiguous(),
                                     fp8_scale_inv=g["scale_inv"].clone())
    if fmt in ("mxfp8", "mxfp8_colwise"):
        kw = dict(rowwise_data=None, rowwise_scale_inv=None, columnwise_data=part(g["cdata"], blk),
                  columnwise_scale_inv=te_cpu.padded(part(g["cscale"], blk, 32, 1), _ru(-(-rs // 32), 4), _ru(cs, 128)))
        if fmt == "mxfp8":
            kw.update(rowwise_data=part(g["data"], blk),
                      rowwise_scale_inv=te_cpu.padded(part(g["scale"], blk, 1, 32), _ru(rs, 128), _ru(-(-cs // 32), 4)))
        return te.MXFP8Tensor, kw
    if fmt == "block1d":
        return te.Float8BlockwiseQTensor, dict(
            rowwise_data=part(g["data"], blk), columnwise_data=part(g["cdata"], blk).t().contiguous(),
            rowwise_scale_inv=te_cpu.padded(part(g["scale"], blk, 1, 128).t(), -(-cs // 128), _ru(rs, 4)),
            columnwise_scale_inv=te_cpu.padded(part(g["cscale"], blk, 128, 1), -(-rs // 128), _ru(cs, 4)))
    if fmt == "block2d":
        data, tiles = part(g["data"], blk), part(g["scale"], blk, 128, 128)
        return te.Float8BlockwiseQTensor, dict(
            rowwise_data=data, rowwise_scale_inv=te_cpu.padded(tiles, tiles.shape[0], _ru(tiles.shape[1], 4)),
            columnwise_data=data.t().contiguous(),
            columnwise_scale_inv=te_cpu.padded(tiles.t(), tiles.shape[1], _ru(tiles.shape[0], 4)))
    kw = dict(rowwise_data=part(g["data"], blk, 1, 2), amax_rowwise=g["amax"].clone(),
              rowwise_scale_inv=te_cpu.padded(part(g["scale"], blk, 1, 16), _ru(rs, 128), _ru(-(-cs // 16), 4)),
              columnwise_data=None, columnwise_scale_inv=None, amax_columnwise=None)
    if fmt == "nvfp4_2d":  # TE keeps the columnwise copy transposed: (N, M/2) codes, (N, M/16) scales
        kw.update(columnwise_data=part(g["cdata"], blk, 2, 1).t().contiguous(), amax_columnwise=g["amax"].clone(),
                  columnwise_scale_inv=te_cpu.padded(part(g["cscale"], blk, 16, 1).t(), _ru(cs, 128),
                                                     _ru(-(-rs // 16), 4)))
    return te.NVFP4Tensor, kw


def build(fmt: str, g: dict[str, torch.Tensor], blk: Block) -> torch.Tensor:
    """The TE tensor of block ``blk`` (row offset, column offset, rows, columns) of the global
    buffers ``g``, on this rank's device."""
    cls, kw = _native(fmt, g, blk)
    kw = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    common = dict(shape=blk[2:], dtype=DTYPE, device=DEVICE)
    with te_cpu.simulate_gpu(te_cpu.HOPPER):
        if fmt == "float8":  # Hopper, rowwise + columnwise: data and its transpose
            q = te.Float8CurrentScalingQuantizer(E4M3, device=DEVICE, rowwise=True, columnwise=True)
            return cls(fp8_dtype=E4M3, quantizer=q, **common, **kw)
        if fmt.startswith("mxfp8"):
            q = te.MXFP8Quantizer(E4M3, rowwise=fmt == "mxfp8", columnwise=True)
            q.optimize_for_gemm = False
            return cls(fp8_dtype=E4M3, quantizer=q, with_gemm_swizzled_scales=False, **common, **kw)
        if fmt.startswith("block"):
            q = te.Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True,
                                        block_scaling_dim=2 if fmt == "block2d" else 1)
            return cls(fp8_dtype=E4M3, quantizer=q, is_2D_scaled=fmt == "block2d", **common, **kw)
        two_d = fmt == "nvfp4_2d"  # TE's weight recipe: 16x16 tiles, the columnwise copy derived
        q = te.NVFP4Quantizer(rowwise=True, columnwise=two_d, with_2d_quantization=two_d)
        return cls(fp4_dtype=DType.kFloat4E2M1, quantizer=q, with_gemm_swizzled_scales=False,
                   row_scaled_nvfp4=False, **common, **kw)


def on_cpu(t: torch.Tensor) -> torch.Tensor:
    """A TE tensor with ``t``'s buffers copied to the CPU (TE's own dequantize runs there)."""
    adapter = find_adapter(t)
    with te_cpu.simulate_gpu(te_cpu.HOPPER):  # TE's NVFP4 quantizer asks torch.cuda for its device when copied
        return adapter.from_inner_buffers(t, {k: v.cpu() for k, v in adapter.inner_buffers(t).items()})


def block_of(mesh, placements, size) -> Block:
    """This rank's block of a ``size`` DTensor with ``placements`` on ``mesh`` (the whole: None)."""
    if mesh is None:
        return (0, 0) + tuple(size)
    c = dtensor_from_local(torch.empty(0), mesh, placements, size, DTYPE).__create_chunk_list__()[0]
    return (c.offsets[0], c.offsets[1], c.sizes[0], c.sizes[1])


def wrap(local: torch.Tensor, mesh, placements, size):
    """``local`` as the shard of a ``size`` DTensor on ``mesh`` (None: ``local`` itself, whole)."""
    return local if mesh is None else dtensor_from_local(local, mesh, placements, size, DTYPE)


def column_aligned(fmt: str, blk: Block) -> bool:
    """Whether ``blk``'s columns fall on the format's column blocks (the last one may be partial)."""
    b, n = FORMATS[fmt][1], shape(fmt)[1]
    return blk[1] % b == 0 and ((blk[1] + blk[3]) % b == 0 or blk[1] + blk[3] == n)


# ----------------------------------------------------------------------------- save

def save(root: str, _mesh) -> None:
    """Every format at a ``(2, 2)`` mesh, one checkpoint per source layout."""
    mesh = init_device_mesh(DEVICE.type, (2, 2), mesh_dim_names=("dp", "tp"))
    for layout, placements in SOURCES.items():
        state = {"step": 7}
        for fmt in FORMATS:
            blk = block_of(mesh, placements, shape(fmt))
            state[f"te.{fmt}"] = wrap(build(fmt, global_buffers(fmt, SEED[fmt]), blk), mesh, placements, shape(fmt))
        try:
            dcp.save(state, checkpoint_id=os.path.join(root, f"src_{layout}"), planner=QuantizedSavePlanner())
            check("save", True, "")
        except BaseException as e:  # noqa: BLE001 (CheckpointException is a BaseException)
            check("save", False, f"dcp.save of the {layout} sources at (2, 2): {_short(e)}")


# ----------------------------------------------------------------------------- load

def targets() -> list[tuple[str, object, tuple]]:
    """(name, mesh, placements) of the targets this world size loads into (mesh None: whole)."""
    if WORLD == 1:
        return [("whole", None, None)]
    if WORLD == 2:
        return [("Shard(1) at 2", init_device_mesh(DEVICE.type, (2,)), (Shard(1),))]
    if WORLD == 3:
        return [("Shard(1) at 3", init_device_mesh(DEVICE.type, (3,)), (Shard(1),))]
    return [("(2, 2) Shard(0) x Shard(1)", init_device_mesh(DEVICE.type, (2, 2), mesh_dim_names=("dp", "tp")),
             (Shard(0), Shard(1))),
            ("(1, 4) Shard(0) x Shard(1)", init_device_mesh(DEVICE.type, (1, 4), mesh_dim_names=("dp", "tp")),
             (Shard(0), Shard(1)))]


def load(root: str, _mesh) -> None:
    """Both sources into every target cut of this world size (see the module docstring)."""
    refs = {}
    for fmt in FORMATS:
        whole = build(fmt, global_buffers(fmt, SEED[fmt]), (0, 0) + shape(fmt))
        refs[fmt] = find_adapter(whole).dequantize(whole).cpu()
        if fmt in TE_CPU_DEQUANTIZE:  # qdcp's reference is TE's own math, bit for bit
            diff = bits_diff(on_cpu(whole).dequantize(), refs[fmt])
            check(f"te_dequantize[{fmt}]", diff is None, f"qdcp's dequantize != TE's: {diff}")
    cuts = targets()
    for layout in SOURCES:
        path = os.path.join(root, f"src_{layout}")
        for name, mesh, placements in cuts:
            tag = f"{layout} source -> {name}"
            load_plain(path, tag, refs, mesh, placements)
            for fmt in FORMATS:
                blocks = all_blocks(mesh, placements, fmt)
                blk = blocks[RANK]
                if all(column_aligned(fmt, b) for b in blocks):
                    load_same_type(path, tag, fmt, blk, mesh, placements, refs)
                else:
                    load_refused(path, tag, fmt, blk, mesh, placements)


def all_blocks(mesh, placements, fmt: str) -> list[Block]:
    """Every rank's block of the format's tensor (a load is one collective: all align or it fails)."""
    mine = block_of(mesh, placements, shape(fmt))
    if mesh is None:
        return [mine]
    gathered: list = [None] * WORLD
    dist.all_gather_object(gathered, mine)
    return gathered


def load_plain(path: str, tag: str, refs: dict, mesh, placements) -> None:
    """Plain targets of the same cut, every format: the reference dequantize of their block."""
    state = {"step": -1}
    for fmt in FORMATS:
        blk = block_of(mesh, placements, shape(fmt))
        state[f"te.{fmt}"] = wrap(torch.zeros(blk[2:], dtype=DTYPE, device=DEVICE), mesh, placements, shape(fmt))
    err = try_load(state, path)
    for fmt in FORMATS:
        if err is not None:
            check(f"plain[{fmt}]", False, f"{tag}: load into plain targets: {_short(err)}")
            continue
        r0, c0, rs, cs = block_of(mesh, placements, shape(fmt))
        v = state[f"te.{fmt}"]
        got = (v if mesh is None else v._local_tensor).cpu()
        diff = bits_diff(got, refs[fmt][r0:r0 + rs, c0:c0 + cs])
        check(f"plain[{fmt}]", diff is None and state["step"] == 7,
              f"{tag}: te.{fmt} block {(r0, c0, rs, cs)} != reference dequantize ({diff}; step {state['step']})")


def load_same_type(path: str, tag: str, fmt: str, blk: Block, mesh, placements, refs: dict) -> None:
    """A same-type target of other buffers cut on block boundaries: the source's block, bit for bit."""
    section, key = f"same_type[{fmt}]", f"te.{fmt}"
    g = global_buffers(fmt, SEED[fmt])
    local = build(fmt, global_buffers(fmt, SEED[fmt] + TARGET_SEED), blk)
    ptrs = te_cpu.inner_ptrs(local)
    state = {key: wrap(local, mesh, placements, shape(fmt))}
    err = try_load(state, path)
    if err is not None:
        check(section, False, f"{tag}: {key} block {blk}: the load failed: {_short(err)}")
        return
    got = state[key] if mesh is None else state[key]._local_tensor
    check(section, got is local and te_cpu.inner_ptrs(local) == ptrs,
          f"{tag}: {key}: the target's local tensor or buffers were replaced, not updated in place")
    diff = canonical_diff(on_cpu(local), on_cpu(build(fmt, g, blk))) or te_cpu.derived_diff(fmt, on_cpu(local))
    check(section, diff is None, f"{tag}: {key} block {blk}: {diff}")
    check_whole_dequantize(tag, fmt, local, blk, refs, mesh)


def check_whole_dequantize(tag: str, fmt: str, local: torch.Tensor, blk: Block, refs: dict, mesh) -> None:
    """Every rank's loaded target gathered: each one's dequantize (TE's own where it has a CPU one,
    else qdcp's) placed at its block equals the source's whole, bit for bit."""
    mine = on_cpu(local)
    values = mine.dequantize() if fmt in TE_CPU_DEQUANTIZE else find_adapter(mine).dequantize(mine)
    gathered: list = [(blk, values)]
    if mesh is not None:
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, (blk, values))
    whole = torch.full(shape(fmt), float("nan"), dtype=DTYPE)
    for (r0, c0, rs, cs), v in gathered:
        whole[r0:r0 + rs, c0:c0 + cs] = v
    diff = bits_diff(whole, refs[fmt])
    check(f"whole_dequantize[{fmt}]", diff is None,
          f"{tag}: te.{fmt}: the loaded shards' dequantize != the source's: {diff}")


def load_refused(path: str, tag: str, fmt: str, blk: Block, mesh, placements) -> None:
    """A same-type target whose column cut splits the format's blocks (or holds less than one):
    an AlignmentError at planning naming the key and the nearest layout that works; the target's
    buffers (padding too) bit-identical afterwards."""
    section, key = f"refused[{fmt}]", f"te.{fmt}"
    local = build(fmt, global_buffers(fmt, SEED[fmt] + TARGET_SEED), blk)
    adapter = find_adapter(local)
    before = {k: bits(v).clone() for k, v in adapter.inner_buffers(local).items()}
    err = try_load({key: wrap(local, mesh, placements, shape(fmt))}, path)
    q = qdcp_error_in(err) if err is not None else None
    n, b = shape(fmt)[1], FORMATS[fmt][1]
    want = [repr(key), f"less than one block of {b}). The nearest layout that works: Shard(1) over {n // b} "
            f"ranks ({b} columns each), or dim 1 whole on every rank"]
    check(section, isinstance(q, AlignmentError) and all(w in str(q) for w in want),
          f"{tag}: {key} block {blk}: expected an AlignmentError naming the key and the nearest layout "
          f"({want}), got {'no error' if err is None else _short(q or err, 900)}")
    after = adapter.inner_buffers(local)
    check(section, all(torch.equal(before[k], bits(after[k])) for k in before),
          f"{tag}: {key}: a refused load changed the target")


# ----------------------------------------------------------------------------- main

COMMANDS = {"save": save, "load": load}


def main() -> int:
    return run(COMMANDS, lambda: init_torchrun_mesh(DEVICE))


if __name__ == "__main__":
    sys.exit(main())
