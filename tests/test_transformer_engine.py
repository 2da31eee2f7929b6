"""TransformerEngine adapters, on TE's real Python classes on CPU (te_cpu stands in for the kernels).

Tests build Float8Tensor / MXFP8Tensor / Float8BlockwiseQTensor / NVFP4Tensor objects from buffers
made here (TE's quantize kernels need CUDA), for both simulated GPU generations where that changes
which buffers exist (Hopper: Float8 transposes; Blackwell: none). Padding bytes of compact scales are
filled with garbage (TE leaves them uninitialised) except where a test wants bit-identical buffers.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp

import te_cpu

if not te_cpu.te_installed():
    pytest.skip("transformer_engine is not installed", allow_module_level=True)
te = te_cpu.install()

from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor as AONVFP4Tensor  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale  # noqa: E402
from transformer_engine.pytorch.constants import DType  # noqa: E402

import qdcp  # noqa: E402
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner, UnsupportedTensorError  # noqa: E402
from qdcp.adapters import find_adapter  # noqa: E402
from qdcp.adapters.base import raw_conversion  # noqa: E402
from qdcp.adapters.formats import swizzle_128x4, unpack_fp4, unswizzle_128x4  # noqa: E402
from quantized_cases import bits, inner, qdcp_load, raise_inner, save_ckpt, seeded  # noqa: E402

M, N = 128, 256  # multiples of 128: padding only where the format rounds up small dims
E4M3, E5M2 = DType.kFloat8E4M3, DType.kFloat8E5M2
GARBAGE = 0xAB


pytestmark = pytest.mark.usefixtures("hopper")


# ----------------------------------------------------------------------------- buffer makers


def _fp8_bits(shape, seed, fp8=E4M3):
    """Random fp8 bytes without NaN/Inf codes."""
    b = torch.randint(0, 256, shape, generator=seeded(seed), dtype=torch.int32).to(torch.uint8)
    if fp8 == E4M3:
        b = torch.where((b & 0x7F) == 0x7F, b & 0xF0, b)
    else:
        b = torch.where((b & 0x7C) == 0x7C, b & 0x83, b)
    return b


def _padded(compact, rows, cols, pad=GARBAGE):
    out = torch.full((rows, cols), pad, dtype=torch.uint8) if compact.dtype == torch.uint8 \
        else torch.full((rows, cols), float("nan"), dtype=compact.dtype)
    if compact.dtype != torch.uint8 and pad == 0:
        out.zero_()
    out[: compact.shape[0], : compact.shape[1]] = compact
    return out


def _ru(x, m):
    return -(-x // m) * m


def ref_swizzle(compact: torch.Tensor) -> torch.Tensor:
    """Independent reference of TE's 128x4 scale swizzle (explicit index formula, zero padded)."""
    rows, cols = compact.shape
    pr, pc = _ru(rows, 128), _ru(cols, 4)
    out = torch.zeros(pr * pc, dtype=compact.dtype)
    n_tx = pc // 4
    for r in range(rows):
        for c in range(cols):
            idx = ((r // 128) * n_tx + c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4
            out[idx] = compact[r, c]
    return out.view(pr, pc)


def make_float8(seed, *, fp8=E4M3, rowwise=True, columnwise=False, recipe="current", shape=(M, N),
                cap=te_cpu.HOPPER, pad=None):
    data = _fp8_bits(shape, seed, fp8)
    scale_inv = torch.rand(1, generator=seeded(seed + 1)) * 0.01 + 0.001
    non_tn = cap[0] >= 10
    has_data = rowwise or non_tn
    has_t = columnwise and not non_tn
    if recipe == "current":
        q = te.Float8CurrentScalingQuantizer(fp8, device="cpu", rowwise=rowwise, columnwise=columnwise)
    else:
        q = te.Float8Quantizer(scale=1 / scale_inv, amax=torch.zeros(1), fp8_dtype=fp8,
                               rowwise=rowwise, columnwise=columnwise)
    return te.Float8Tensor(
        shape=shape, dtype=torch.bfloat16, data=data if has_data else None, fp8_scale_inv=scale_inv,
        fp8_dtype=fp8, data_transpose=data.movedim(-1, 0).contiguous() if has_t else None,
        quantizer=q, device="cpu")


def make_mxfp8(seed, *, fp8=E4M3, rowwise=True, columnwise=False, swizzled=False, pad=GARBAGE,
               shape=(M, N)):
    m, n = shape

    def scales(r, c, s):
        return torch.randint(118, 136, (r, c), generator=seeded(s), dtype=torch.int32).to(torch.uint8)

    kw = dict(rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None)
    if rowwise:
        compact = scales(m, n // 32, seed + 1)
        kw["rowwise_data"] = _fp8_bits(shape, seed, fp8)
        kw["rowwise_scale_inv"] = ref_swizzle(compact) if swizzled else \
            _padded(compact, _ru(m, 128), _ru(n // 32, 4), pad)
    if columnwise:
        compact = scales(m // 32, n, seed + 3)
        kw["columnwise_data"] = _fp8_bits(shape, seed + 2, fp8)
        kw["columnwise_scale_inv"] = ref_swizzle(compact.t().contiguous()).reshape(
            _ru(m // 32, 4), _ru(n, 128)) if swizzled else _padded(compact, _ru(m // 32, 4), _ru(n, 128), pad)
    q = te.MXFP8Quantizer(fp8, rowwise=rowwise, columnwise=columnwise)
    q.optimize_for_gemm = swizzled
    return te.MXFP8Tensor(shape=shape, dtype=torch.bfloat16, fp8_dtype=fp8, quantizer=q,
                          with_gemm_swizzled_scales=swizzled, device="cpu", **kw)


def make_blockwise(seed, *, dim=2, rowwise=True, columnwise=False, pad=GARBAGE, shape=(M, N), fp8=E4M3):
    m, n = shape
    tm, tn = -(-m // 128), -(-n // 128)

    def sc(r, c, s):
        return torch.rand((r, c), generator=seeded(s)) * 0.01 + 1e-4

    padv = float("nan") if pad == GARBAGE else 0.0
    kw = dict(rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None)
    if dim == 2:
        data, s = _fp8_bits(shape, seed, fp8), sc(tm, tn, seed + 1)
        if rowwise:
            kw["rowwise_data"] = data
            kw["rowwise_scale_inv"] = _fill(s, tm, _ru(tn, 4), padv)
        if columnwise:
            kw["columnwise_data"] = data.t().contiguous()
            kw["columnwise_scale_inv"] = _fill(s.t(), tn, _ru(tm, 4), padv)
    else:
        if rowwise:
            kw["rowwise_data"] = _fp8_bits(shape, seed, fp8)
            kw["rowwise_scale_inv"] = _fill(sc(tn, m, seed + 1), tn, _ru(m, 4), padv)
        if columnwise:
            kw["columnwise_data"] = _fp8_bits((n, m), seed + 2, fp8)
            kw["columnwise_scale_inv"] = _fill(sc(tm, n, seed + 3), tm, _ru(n, 4), padv)
    q = te.Float8BlockQuantizer(fp8, rowwise=rowwise, columnwise=columnwise, block_scaling_dim=dim)
    return te.Float8BlockwiseQTensor(shape=shape, dtype=torch.bfloat16, fp8_dtype=fp8, quantizer=q,
                                     is_2D_scaled=dim == 2, device="cpu", **kw)


def _fill(compact, rows, cols, value):
    out = torch.full((rows, cols), value, dtype=compact.dtype)
    out[: compact.shape[0], : compact.shape[1]] = compact
    return out


def _e4m3_scales(r, c, seed):
    # positive finite e4m3 codes 0x08..0x7E
    return torch.randint(0x08, 0x7F, (r, c), generator=seeded(seed), dtype=torch.int32).to(torch.uint8)


def make_nvfp4(seed, *, rowwise=True, columnwise=False, swizzled=False, row_scaled=False, pad=GARBAGE,
               shape=(M, N)):
    m, n = shape
    kw = dict(rowwise_data=None, rowwise_scale_inv=None, columnwise_data=None, columnwise_scale_inv=None,
              amax_rowwise=None, amax_columnwise=None)
    if rowwise:
        compact = _e4m3_scales(m, n // 16, seed + 1)
        kw["rowwise_data"] = torch.randint(0, 256, (m, n // 2), generator=seeded(seed)).to(torch.uint8)
        kw["rowwise_scale_inv"] = ref_swizzle(compact) if swizzled else \
            _padded(compact, _ru(m, 128), _ru(n // 16, 4), pad)
        kw["amax_rowwise"] = torch.rand(m if row_scaled else 1, generator=seeded(seed + 2)) * 10 + 0.5
    if columnwise:
        compact = _e4m3_scales(n, m // 16, seed + 4)
        kw["columnwise_data"] = torch.randint(0, 256, (n, m // 2), generator=seeded(seed + 3)).to(torch.uint8)
        kw["columnwise_scale_inv"] = ref_swizzle(compact) if swizzled else \
            _padded(compact, _ru(n, 128), _ru(m // 16, 4), pad)
        kw["amax_columnwise"] = torch.rand(1, generator=seeded(seed + 5)) * 10 + 0.5
    return te.NVFP4Tensor(shape=shape, dtype=torch.bfloat16, fp4_dtype=DType.kFloat4E2M1, quantizer=None,
                          with_gemm_swizzled_scales=swizzled, row_scaled_nvfp4=row_scaled, device="cpu",
                          **kw)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: Callable[..., torch.Tensor]
    cap: tuple = te_cpu.HOPPER
    te_dequantize_on_cpu: bool = False  # TE's own dequantize() runs on CPU (Float8, blockwise)

    def build(self, seed, **kw):
        with te_cpu.simulate_gpu(self.cap):
            return self.make(seed, **kw)


def _c(name, fn, cap=te_cpu.HOPPER, te_dq=False, **kw):
    if fn is make_float8:
        kw["cap"] = cap

    def make(seed, **over):
        return fn(seed, **{**kw, **over})
    return Case(name, make, cap, te_dq)


BLACKWELL = te_cpu.BLACKWELL
CASES = [
    _c("f8_cs_rowwise", make_float8, te_dq=True),
    _c("f8_delayed_rowwise_e5m2", make_float8, te_dq=True, recipe="delayed", fp8=E5M2),
    _c("f8_cs_both_hopper", make_float8, te_dq=True, columnwise=True),
    _c("f8_cs_columnwise_only_hopper", make_float8, te_dq=True, rowwise=False, columnwise=True),
    _c("f8_cs_both_blackwell", make_float8, BLACKWELL, te_dq=True, columnwise=True),
    _c("f8_delayed_3d", make_float8, te_dq=True, recipe="delayed", shape=(4, 64, 96)),
    _c("mxfp8_rowwise", make_mxfp8),
    _c("mxfp8_columnwise", make_mxfp8, rowwise=False, columnwise=True),
    _c("mxfp8_both", make_mxfp8, columnwise=True),
    _c("mxfp8_both_swizzled_e5m2", make_mxfp8, columnwise=True, swizzled=True, fp8=E5M2),
    _c("block2d_rowwise", make_blockwise, te_dq=True),
    _c("block2d_both", make_blockwise, te_dq=True, columnwise=True),
    _c("block2d_columnwise_only", make_blockwise, te_dq=True, rowwise=False, columnwise=True),
    _c("block1d_both", make_blockwise, te_dq=True, dim=1, columnwise=True),
    _c("block1d_columnwise_only", make_blockwise, te_dq=True, dim=1, rowwise=False, columnwise=True),
    _c("nvfp4_rowwise", make_nvfp4),
    _c("nvfp4_both", make_nvfp4, columnwise=True),
    _c("nvfp4_both_swizzled", make_nvfp4, columnwise=True, swizzled=True),
    _c("nvfp4_columnwise_only", make_nvfp4, rowwise=False, columnwise=True),
    _c("nvfp4_row_scaled", make_nvfp4, row_scaled=True),
]
IDS = [c.name for c in CASES]
BY_NAME = {c.name: c for c in CASES}


_save = save_ckpt
_load = qdcp_load


def _canonical(t):
    return find_adapter(t).components(t)


def _assert_same_canonical(a, b):
    ca, cb = _canonical(a), _canonical(b)
    assert sorted(ca) == sorted(cb)
    for n in ca:
        assert ca[n].shape == cb[n].shape and ca[n].dtype == cb[n].dtype, n
        assert torch.equal(bits(ca[n]), bits(cb[n])), f"component {n} differs"


# ----------------------------------------------------------------------------- identity and registry

def test_import_qdcp_does_not_import_te():
    code = "import sys, qdcp; assert not any(m.startswith('transformer_engine') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("cls_name", ["Float8Tensor", "MXFP8Tensor", "Float8BlockwiseQTensor", "NVFP4Tensor"])
def test_te_classes_are_recognised_by_module_and_name(cls_name):
    adapter = find_adapter(getattr(te, cls_name))
    assert adapter is not None and adapter.type_names == (f"transformer_engine.{cls_name}",)
    assert f"transformer_engine.{cls_name}" in qdcp.registered_type_names()
    # torchao's classes of the same name stay with the torchao adapters
    assert find_adapter(AONVFP4Tensor).type_names == ("torchao.NVFP4Tensor",)


def test_swizzle_matches_the_reference_layout():
    compact = torch.randint(0, 256, (200, 7), generator=seeded(0)).to(torch.uint8)
    sw = swizzle_128x4(compact)
    assert torch.equal(sw, ref_swizzle(compact))
    assert torch.equal(unswizzle_128x4(sw, 200, 7), compact)


# ----------------------------------------------------------------------------- the declaration

_ROW, _COL = ["rowwise_data", "rowwise_scale_inv"], ["columnwise_data", "columnwise_scale_inv"]
_NV_ROW, _NV_COL = _ROW + ["amax_rowwise"], _COL + ["amax_columnwise"]
# canonical names stored per case (what checkpoints hold; must not change)
STORED_NAMES = {
    **{c.name: ["data", "scale_inv"] for c in CASES if c.name.startswith("f8_")},
    "mxfp8_rowwise": _ROW, "mxfp8_columnwise": _COL, "mxfp8_both": _ROW + _COL,
    "mxfp8_both_swizzled_e5m2": _ROW + _COL,
    "block2d_rowwise": _ROW, "block2d_both": _ROW, "block2d_columnwise_only": _ROW,  # one quantization
    "block1d_both": _ROW + _COL, "block1d_columnwise_only": _COL,
    "nvfp4_rowwise": _NV_ROW, "nvfp4_both": _NV_ROW + _NV_COL, "nvfp4_both_swizzled": _NV_ROW + _NV_COL,
    "nvfp4_columnwise_only": _NV_COL, "nvfp4_row_scaled": _NV_ROW,
}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_declaration_is_the_single_source(case):
    """Each TE adapter's component_names / layouts / components / native_components are its
    declared COMPONENTS for the usages the tensor holds: same names in order, declared dtypes,
    layouts whose component shape is the component's, in-place ones views of the declared buffer."""
    t = case.build(0)
    adapter = find_adapter(t)
    attrs = adapter.attributes(t)
    usages = {u for u in ("rowwise", "columnwise") if getattr(t, f"_{u}_data", None) is not None}
    declared = [c for c in adapter.declared(attrs) if c.usage is None or c.usage in usages]
    names = [c.name for c in declared]
    assert names == STORED_NAMES[case.name]
    assert adapter.component_names(t) == names
    layouts, comps, native = adapter.layouts(t), adapter.components(t), adapter.native_components(t)
    assert list(layouts) == names and list(comps) == names
    assert {n: v.dtype for n, v in comps.items()} == {c.name: c.dtype_for(attrs) for c in declared}
    for c in declared:
        assert layouts[c.name].component_shape(tuple(t.shape)) == tuple(comps[c.name].shape), c.name
    assert list(native) == [c.name for c in declared if c.is_in_place(t)]
    for name, view in native.items():
        c = next(c for c in declared if c.name == name)
        assert view.dtype == c.dtype_for(attrs) and torch.equal(bits(view), bits(comps[name]))
        assert view.data_ptr() == getattr(t, c.buffer).data_ptr(), name  # the TE buffer itself


# ----------------------------------------------------------------------------- load matrix

@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_raw_into_same_type_is_bit_identical_and_in_place(tmp_path, case):
    source = case.build(0, pad=0)  # zero padding, as TE's swizzled output has: buffers can match
    path = _save(tmp_path, {"w": source, "step": 3})
    target = case.build(1)
    before = {n: t.data_ptr() for n, t in inner(target).items()}
    state = {"w": target, "step": 0}
    _load(path, state)
    assert state["w"] is target and state["step"] == 3
    assert {n: t.data_ptr() for n, t in inner(target).items()} == before
    src_inner, dst_inner = inner(source), inner(target)
    assert sorted(src_inner) == sorted(dst_inner)
    for n in src_inner:
        assert torch.equal(bits(src_inner[n]), bits(dst_inner[n])), f"buffer {n} differs"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_padding_is_not_stored_and_comes_back_zero(tmp_path, case):
    source = case.build(0)  # garbage padding where the format pads
    path = _save(tmp_path, {"w": source})
    info = qdcp.describe(path)["w"]
    canon = _canonical(source)
    assert info["bytes"] == sum(t.numel() * t.element_size() for t in canon.values())
    target = case.build(1)
    _load(path, {"w": target})
    _assert_same_canonical(target, source)
    # every buffer, padding included, equals that of the same tensor built with zero padding
    clean = case.build(0, pad=0)
    for name, buf in inner(target).items():
        assert torch.equal(bits(buf), bits(inner(clean)[name])), name


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_into_plain_equals_reference_dequantize(tmp_path, case):
    """Raw entry through qdcp, and a dequantized entry through vanilla DCP: both the dequantize."""
    source = case.build(0)
    path = _save(tmp_path, {"raw": source, "deq": source}, dequantize=lambda fqn, t: fqn == "deq")
    ref = find_adapter(source).dequantize(source)
    if case.te_dequantize_on_cpu:
        assert torch.equal(bits(ref), bits(source.dequantize()))
    target = torch.zeros(source.shape, dtype=torch.bfloat16)
    _load(path, {"raw": target})
    assert torch.equal(bits(target), bits(ref))
    plain = torch.zeros(source.shape, dtype=torch.bfloat16)
    dcp.load({"deq": plain}, checkpoint_id=path)
    assert torch.equal(bits(plain), bits(ref))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_into_a_float32_target_is_computed_in_float32(tmp_path, case):
    """TE's dequantize math runs in float32: a float32 target gets those products exactly (for a
    Float8 tensor, fp8 x scale_inv in float32), not the bf16 dequantize widened."""
    source = case.build(0)
    path = _save(tmp_path, {"raw": source})
    target = torch.zeros(source.shape, dtype=torch.float32)
    _load(path, {"raw": target})
    want = find_adapter(source).dequantize(source, torch.float32)
    assert torch.equal(bits(target), bits(want))
    if case.name == "f8_cs_rowwise":
        exact = source._data.view(torch.float8_e4m3fn).float() * source._scale_inv.float()
        assert torch.equal(bits(target), bits(exact))
        assert not torch.equal(find_adapter(source).dequantize(source).float(), exact)


def _raises_needs_gpu(fn):
    """``fn`` fails with qdcp's UnsupportedTensorError saying a GPU is needed (DCP wraps it)."""
    with pytest.raises(BaseException) as info:
        fn()
    err = info.value
    failures = getattr(err, "failures", None)
    if failures:  # torch's CheckpointException: {rank: (exception, traceback)}
        err = next(iter(failures.values()))[0]
    assert isinstance(err, UnsupportedTensorError), repr(err)
    assert "qdcp does not quantize into a TransformerEngine" in str(err)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_into_other_format_or_from_plain_is_a_clear_error(tmp_path, case):
    source = case.build(0)
    path = _save(tmp_path, {"w": source})
    family = case.name.split("_")[0]
    if "3d" in case.name:  # another config of the same type: e5m2
        target = make_float8(1, fp8=E5M2, shape=tuple(source.shape))
    else:
        other = next(c for c in CASES[IDS.index(case.name):] + CASES if c.name.split("_")[0] != family)
        target = other.build(1)
    _raises_needs_gpu(lambda: _load(path, {"w": target}))
    plain = tmp_path / "plain"
    dcp.save({"w": torch.randn(source.shape, dtype=torch.bfloat16)}, checkpoint_id=plain)
    _raises_needs_gpu(lambda: _load(plain, {"w": case.build(2)}))


def test_float8_hopper_checkpoint_into_blackwell_and_transpose_only_targets(tmp_path):
    source = BY_NAME["f8_cs_both_hopper"].build(0)  # _data + _transpose
    path = _save(tmp_path, {"w": source})
    assert set(qdcp.describe(path)["w"]["components"]) == {"data", "scale_inv"}  # transpose derived
    blackwell = BY_NAME["f8_cs_both_blackwell"].build(1)  # _data only
    _load(path, {"w": blackwell})
    assert torch.equal(blackwell._data, source._data) and blackwell._transpose is None
    t_only = BY_NAME["f8_cs_columnwise_only_hopper"].build(2)  # _transpose only
    _load(path, {"w": t_only})
    assert t_only._data is None and torch.equal(t_only._transpose, source._transpose)
    assert not t_only._transpose_invalid
    # and back: a transpose-only checkpoint into a rowwise target
    path2 = tmp_path / "t"
    dcp.save({"w": t_only}, checkpoint_id=path2, planner=QuantizedSavePlanner())
    row = BY_NAME["f8_cs_rowwise"].build(3)
    _load(path2, {"w": row})
    assert torch.equal(row._data, source._data)


def test_blockwise_2d_columnwise_is_derived_from_rowwise(tmp_path):
    source = BY_NAME["block2d_rowwise"].build(0, pad=0)
    path = _save(tmp_path, {"w": source})
    both = BY_NAME["block2d_both"].build(1, pad=0)
    _load(path, {"w": both})
    assert torch.equal(both._columnwise_data, source._rowwise_data.t())
    assert torch.equal(both.dequantize(), source.dequantize())
    col_only = BY_NAME["block2d_columnwise_only"].build(2, pad=0)
    _load(path, {"w": col_only})
    assert torch.equal(bits(col_only.dequantize()), bits(source.dequantize()))


# ----------------------------------------------------------------------------- dequantize references

def test_float8_dequantize_hand_vector():
    data = torch.tensor([[0x38, 0xB8, 0x40, 0x00]], dtype=torch.uint8)  # e4m3: 1, -1, 2, 0
    t = te.Float8Tensor(shape=(1, 4), dtype=torch.float32, data=data, fp8_scale_inv=torch.tensor([0.5]),
                        fp8_dtype=E4M3, device="cpu")
    assert find_adapter(t).dequantize(t).tolist() == [[0.5, -0.5, 1.0, 0.0]]


def test_mxfp8_dequantize_hand_vector_and_torchao():
    data = torch.full((1, 64), 0x38, dtype=torch.uint8)  # e4m3 1.0
    scale = torch.zeros((128, 4), dtype=torch.uint8)
    scale[0, 0], scale[0, 1] = 127 + 3, 127 - 2  # 2^3 for cols 0..31, 2^-2 for 32..63
    t = te.MXFP8Tensor(shape=(1, 64), dtype=torch.float32, rowwise_data=data, rowwise_scale_inv=scale,
                       columnwise_data=None, columnwise_scale_inv=None, fp8_dtype=E4M3, quantizer=None,
                       with_gemm_swizzled_scales=False, device="cpu")
    out = find_adapter(t).dequantize(t)
    assert out[0, :32].eq(8.0).all() and out[0, 32:].eq(0.25).all()
    # same bits as a torchao MXTensor: same values
    src = BY_NAME["mxfp8_rowwise"].build(0)
    c = _canonical(src)
    ao = MXTensor(c["rowwise_data"], c["rowwise_scale_inv"], torch.float8_e4m3fn, 32, torch.bfloat16,
                  None, None, False)
    assert torch.equal(bits(ao.dequantize(torch.bfloat16)), bits(find_adapter(src).dequantize(src)))


def test_nvfp4_dequantize_hand_vector_and_torchao():
    # codes 0..15 in one row of 16 (low nibble first), scale 1.0 (e4m3 0x38), amax = 6 * 448
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 8)
    scale = torch.zeros((128, 4), dtype=torch.uint8)
    scale[0, 0] = 0x38
    t = te.NVFP4Tensor(shape=(1, 16), dtype=torch.float32, rowwise_data=packed, rowwise_scale_inv=scale,
                       columnwise_data=None, columnwise_scale_inv=None, amax_rowwise=torch.tensor([2688.0]),
                       amax_columnwise=None, fp4_dtype=DType.kFloat4E2M1, quantizer=None,
                       with_gemm_swizzled_scales=False, device="cpu")
    out = find_adapter(t).dequantize(t)
    assert out[0].tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    # same bits as a torchao NVFP4Tensor with per_tensor_scale = amax / 2688: same values when the
    # per-tensor factor is exact (amax a power of two times 2688)
    src = BY_NAME["nvfp4_rowwise"].build(0)
    src._amax_rowwise.fill_(2688.0 * 4)
    c = _canonical(src)
    ao = AONVFP4Tensor(c["rowwise_data"], c["rowwise_scale_inv"], 16, torch.bfloat16,
                       per_tensor_scale=per_tensor_amax_to_scale(src._amax_rowwise[0]))
    assert torch.equal(bits(ao.dequantize(torch.bfloat16)), bits(find_adapter(src).dequantize(src)))


def test_nvfp4_columnwise_dequantize_matches_rowwise_of_the_same_values():
    src = BY_NAME["nvfp4_both"].build(0)
    # make the columnwise copy hold exactly the rowwise values (transpose codes, same scales)
    a = find_adapter(src)
    c = a.components(src)
    codes = unpack_fp4(c["rowwise_data"])                # (M, N)
    ct = codes.t().contiguous()                                # (N, M)
    src._columnwise_data.copy_(ct[:, 0::2] | (ct[:, 1::2] << 4))
    one = torch.zeros((_ru(N, 128), _ru(M // 16, 4)), dtype=torch.uint8)
    one[:N, : M // 16] = 0x38
    src._columnwise_scale_inv.copy_(one)
    src._rowwise_scale_inv.zero_()
    src._rowwise_scale_inv[:M, : N // 16] = 0x38
    src._amax_columnwise.copy_(src._amax_rowwise)
    by_row = a.dequantize(src)
    col_only = te.NVFP4Tensor(shape=(M, N), dtype=torch.bfloat16, rowwise_data=None, rowwise_scale_inv=None,
                              columnwise_data=src._columnwise_data, columnwise_scale_inv=src._columnwise_scale_inv,
                              amax_rowwise=None, amax_columnwise=src._amax_columnwise,
                              fp4_dtype=DType.kFloat4E2M1, quantizer=None, with_gemm_swizzled_scales=False,
                              device="cpu")
    assert torch.equal(bits(a.dequantize(col_only)), bits(by_row))


def test_blockwise_dequantize_equals_te_own_for_unaligned_shapes():
    for dim in (1, 2):
        t = make_blockwise(0, dim=dim, columnwise=True, shape=(200, 300))
        assert torch.equal(bits(find_adapter(t).dequantize(t)), bits(t.dequantize()))


# ----------------------------------------------------------------------------- raw conversion with torchao

def _raw_convert(source, target):
    """The load planner's raw path for an entry of another library holding the same bits."""
    src_adapter = find_adapter(source)
    attrs = src_adapter.attributes(source)
    comps = src_adapter.components(source)
    how = raw_conversion(find_adapter(target), target, src_adapter, source_type=src_adapter.type_name(source),
                         source_attrs=attrs)
    if how is None:
        return False
    how.fill(target, {n: comps[n] for n in how.names})
    return True


def test_te_mxfp8_to_torchao_mxtensor_and_back_bit_exact():
    src = BY_NAME["mxfp8_rowwise"].build(0)
    hp = torch.randn(M, N, dtype=torch.bfloat16, generator=seeded(9))
    for swizzled in (False, True):
        ao = MXTensor.to_mx(hp, torch.float8_e4m3fn, 32, is_swizzled_scales=swizzled)
        assert _raw_convert(src, ao)
        ca = find_adapter(ao).components(ao)
        cs = _canonical(src)
        assert torch.equal(bits(ca["qdata"]), bits(cs["rowwise_data"]))
        assert torch.equal(bits(ca["scale"]), bits(cs["rowwise_scale_inv"]))
        assert torch.equal(bits(ao.dequantize(torch.bfloat16)), bits(find_adapter(src).dequantize(src)))
        back = BY_NAME["mxfp8_rowwise"].build(5, pad=0)
        assert _raw_convert(ao, back)
        _assert_same_canonical(back, src)
    # a target with a columnwise copy cannot be filled from rowwise bits
    assert not _raw_convert(MXTensor.to_mx(hp, torch.float8_e4m3fn, 32), BY_NAME["mxfp8_both"].build(1))
    # e5m2 TE -> e4m3 torchao is another format
    assert not _raw_convert(BY_NAME["mxfp8_both_swizzled_e5m2"].build(0), MXTensor.to_mx(hp, torch.float8_e4m3fn, 32))


def test_te_nvfp4_to_torchao_nvfp4_and_back():
    src = BY_NAME["nvfp4_rowwise"].build(0)
    hp = torch.randn(M, N, dtype=torch.bfloat16, generator=seeded(9))
    ao = AONVFP4Tensor.to_nvfp4(hp, per_tensor_scale=per_tensor_amax_to_scale(hp.abs().amax()))
    assert _raw_convert(src, ao)
    cs, ca = _canonical(src), find_adapter(ao).components(ao)
    assert torch.equal(ca["qdata"], cs["rowwise_data"])
    assert torch.equal(bits(ca["scale"]), bits(cs["rowwise_scale_inv"]))
    assert torch.equal(ca["per_tensor_scale"], per_tensor_amax_to_scale(src._amax_rowwise[0]))
    back = BY_NAME["nvfp4_rowwise"].build(7, pad=0)
    assert _raw_convert(ao, back)
    cb = _canonical(back)
    assert torch.equal(cb["rowwise_data"], cs["rowwise_data"])
    assert torch.equal(bits(cb["rowwise_scale_inv"]), bits(cs["rowwise_scale_inv"]))
    assert per_tensor_amax_to_scale(back._amax_rowwise[0]) == ao.per_tensor_scale
    # amax values that survive /2688 *2688 come back exactly
    src._amax_rowwise.fill_(2688.0 * 0.125)
    assert _raw_convert(src, ao) and _raw_convert(ao, back)
    assert torch.equal(back._amax_rowwise, src._amax_rowwise)


def test_dcp_raw_conversion_te_and_torchao_both_ways(tmp_path):
    hp = torch.randn(M, N, dtype=torch.bfloat16, generator=seeded(9))
    te_mx, te_nv = BY_NAME["mxfp8_rowwise"].build(0), BY_NAME["nvfp4_rowwise"].build(0)
    path = _save(tmp_path, {"mx": te_mx, "nv": te_nv})
    ao_mx = MXTensor.to_mx(hp, torch.float8_e4m3fn, 32, is_swizzled_scales=True)
    ao_nv = AONVFP4Tensor.to_nvfp4(hp, per_tensor_scale=per_tensor_amax_to_scale(hp.abs().amax()))
    _load(path, {"mx": ao_mx, "nv": ao_nv})
    assert torch.equal(bits(ao_mx.dequantize(torch.bfloat16)), bits(find_adapter(te_mx).dequantize(te_mx)))
    assert torch.equal(bits(find_adapter(ao_nv).components(ao_nv)["scale"]),
                       bits(_canonical(te_nv)["rowwise_scale_inv"]))
    path2 = tmp_path / "ao"
    dcp.save({"mx": ao_mx, "nv": ao_nv}, checkpoint_id=path2, planner=QuantizedSavePlanner())
    back_mx, back_nv = BY_NAME["mxfp8_rowwise"].build(3, pad=0), BY_NAME["nvfp4_rowwise"].build(3, pad=0)
    _load(path2, {"mx": back_mx, "nv": back_nv})
    _assert_same_canonical(back_mx, te_mx)
    assert torch.equal(_canonical(back_nv)["rowwise_data"], _canonical(te_nv)["rowwise_data"])
    assert per_tensor_amax_to_scale(back_nv._amax_rowwise[0]) == ao_nv.per_tensor_scale


# ----------------------------------------------------------------------------- stager buffers

@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_inner_buffers_round_trip(case):
    t = case.build(0)
    adapter = find_adapter(t)
    buffers = adapter.inner_buffers(t)
    assert set(buffers) == set(inner(t))
    copies = {n: b.clone() for n, b in buffers.items()}
    staged = adapter.from_inner_buffers(t, copies)
    assert type(staged) is type(t) and staged.shape == t.shape and staged.dtype == t.dtype
    for n, b in inner(staged).items():
        assert b is copies[n]
    _assert_same_canonical(staged, t)
    assert adapter.attributes(staged) == adapter.attributes(t)


def test_quantized_stager_async_save_equals_sync(tmp_path):
    from qdcp.staging.stager import QuantizedStager
    state = {c.name: c.build(i) for i, c in enumerate(CASES)}
    dcp.save(state, checkpoint_id=tmp_path / "sync", planner=QuantizedSavePlanner())
    fut = dcp.async_save(state, checkpoint_id=tmp_path / "async", planner=QuantizedSavePlanner(),
                         async_stager=QuantizedStager())
    fut.result() if hasattr(fut, "result") else fut.upload_completion.result()
    files = sorted(p.name for p in (tmp_path / "sync").iterdir() if p.suffix == ".distcp")
    for f in files:
        assert (tmp_path / "sync" / f).read_bytes() == (tmp_path / "async" / f).read_bytes()


# ----------------------------------------------------------------------------- GPU only

def _real_te_on_cuda() -> bool:
    ext = sys.modules.get("transformer_engine_torch")
    return torch.cuda.is_available() and ext is not None and getattr(ext, "__file__", None) != te_cpu.__file__


@pytest.mark.gpu
@pytest.mark.skipif(not _real_te_on_cuda(), reason="needs a CUDA device and TE's compiled extension")
def test_reference_dequantize_equals_te_cuda_dequantize_on_gpu():
    """On a GPU with real TE: the plain-torch dequantize equals TE's CUDA dequantize (MXFP8)."""
    hp = torch.randn(M, N, dtype=torch.bfloat16, device="cuda")
    q = te.MXFP8Quantizer(E4M3, rowwise=True, columnwise=False)
    t = q(hp)
    out = torch.zeros_like(hp)
    out.copy_(find_adapter(t).dequantize(t))
    assert torch.equal(bits(out.cpu()), bits(t.dequantize().cpu()))


@pytest.mark.gpu
@pytest.mark.skipif(not _real_te_on_cuda(), reason="needs a CUDA device and TE's compiled extension")
@pytest.mark.parametrize("quantizer", ["float8_current", "mxfp8"])
def test_stock_async_save_of_te_tensors_is_exact_or_refused_on_gpu(tmp_path, quantizer):
    """``dcp.async_save`` with DCP's own stager on real TE tensors: the checkpoint is the exact one
    (loads bit-identical), or the save fails naming QuantizedStager with nothing written. Never the
    uninitialised memory a stager that does not know TE tensors would copy."""
    hp = torch.randn(M, N, dtype=torch.bfloat16, device="cuda")
    q = (te.Float8CurrentScalingQuantizer(E4M3, device="cuda") if quantizer == "float8_current"
         else te.MXFP8Quantizer(E4M3, rowwise=True, columnwise=False))
    t = q(hp)
    path = tmp_path / "a"
    try:
        fut = dcp.async_save({"w": t}, checkpoint_id=path, planner=QuantizedSavePlanner())
        fut.result() if hasattr(fut, "result") else fut.upload_completion.result()
    except BaseException as e:  # noqa: BLE001
        assert "QuantizedStager" in repr(e) or "QuantizedStager" in str(getattr(e, "failures", "")), repr(e)
        assert not (path / ".metadata").exists()
        return
    out = torch.zeros(M, N, dtype=torch.bfloat16)
    dcp.load({"w": out}, checkpoint_id=path, planner=QuantizedLoadPlanner())
    assert torch.equal(bits(out), bits(find_adapter(t).dequantize(t).cpu()))


def test_inspect_shows_recipe_scale_layout_and_usage(tmp_path):
    """qdcp inspect (describe) shows each TE entry's recipe, native scale layout and usages; these
    are descriptive: a same-type load across recipes or swizzling still copies raw."""
    state = {"mx": make_mxfp8(0, swizzled=True, columnwise=True), "f8": make_float8(1, recipe="delayed"),
             "nv": make_nvfp4(2)}
    path = _save(tmp_path, state)
    info = qdcp.describe(path)
    assert info["mx"]["info"] == {"recipe": "mxfp8", "scales": "gemm_swizzled", "usage": "rowwise+columnwise"}
    assert info["f8"]["info"]["recipe"] == "delayed scaling"
    assert info["nv"]["info"]["scales"] == "compact" and info["nv"]["info"]["usage"] == "rowwise"
    import contextlib
    import io

    from qdcp.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", str(path)]) == 0
    assert "recipe=mxfp8" in out.getvalue() and "scales=gemm_swizzled" in out.getvalue()
    target = {"mx": make_mxfp8(5, swizzled=False, columnwise=True)}
    _load(path, target)
    _assert_same_canonical(target["mx"], state["mx"])


def test_export_te_mxfp8_and_nvfp4_to_torchao_and_compressed_tensors_layouts(tmp_path):
    """TE entries export raw: as torchao's MXTensor / NVFP4Tensor (rebuilt by torchao's own loader)
    and as compressed-tensors' MXFP8 / NVFP4 parameters, the payload bytes TE's rowwise data."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    state = {"mx.weight": BY_NAME["mxfp8_rowwise"].build(0), "nv.weight": BY_NAME["nvfp4_rowwise"].build(1)}
    _save(tmp_path, state)
    qdcp.export(tmp_path / "ckpt", tmp_path / "ao", format="torchao")
    with safe_open(str(tmp_path / "ao" / "model.safetensors"), "pt") as f:
        md = f.metadata()
    got, leftover = unflatten_tensor_state_dict(load_file(tmp_path / "ao" / "model.safetensors"), md)
    assert not leftover
    assert isinstance(got["mx.weight"], MXTensor) and isinstance(got["nv.weight"], AONVFP4Tensor)
    for key, data in (("mx.weight", "qdata"), ("nv.weight", "qdata")):
        cs = _canonical(state[key])
        assert torch.equal(bits(getattr(got[key], data)), bits(cs["rowwise_data"]))
        assert torch.equal(bits(got[key].scale), bits(cs["rowwise_scale_inv"]))
    assert torch.equal(bits(got["mx.weight"].dequantize(torch.bfloat16)),
                       bits(find_adapter(state["mx.weight"]).dequantize(state["mx.weight"])))
    assert got["nv.weight"].per_tensor_scale == per_tensor_amax_to_scale(state["nv.weight"]._amax_rowwise[0])

    qdcp.export(tmp_path / "ckpt", tmp_path / "ct", format="compressed-tensors")
    ct = load_file(tmp_path / "ct" / "model.safetensors")
    cs = _canonical(state["nv.weight"])
    assert torch.equal(ct["nv.weight_packed"], cs["rowwise_data"])
    assert torch.equal(bits(ct["nv.weight_scale"]), bits(cs["rowwise_scale_inv"]))
    assert torch.equal(bits(ct["mx.weight_scale"]), bits(_canonical(state["mx.weight"])["rowwise_scale_inv"]))


def test_3d_columnwise_raw_save_is_refused_naming_the_key(tmp_path):
    """A 3-D MXFP8 tensor with columnwise data: qdcp stores columnwise block scales of 2-D tensors
    only. The raw save is refused at planning naming the key and the fix, nothing written; saved
    dequantized it stores the rowwise values exactly."""
    shape = (2, 64, 96)
    m, n = 128, 96
    with te_cpu.simulate_gpu(te_cpu.HOPPER):
        scales = torch.randint(118, 136, (m, n // 32), generator=seeded(1), dtype=torch.int32).to(torch.uint8)
        cscales = torch.randint(118, 136, (m // 32, n), generator=seeded(3), dtype=torch.int32).to(torch.uint8)
        t = te.MXFP8Tensor(shape=shape, dtype=torch.bfloat16, fp8_dtype=E4M3,
                           quantizer=te.MXFP8Quantizer(E4M3, rowwise=True, columnwise=True),
                           with_gemm_swizzled_scales=False, device="cpu",
                           rowwise_data=_fp8_bits(shape, 0, E4M3), rowwise_scale_inv=_padded(scales, 128, 4, GARBAGE),
                           columnwise_data=_fp8_bits(shape, 2, E4M3),
                           columnwise_scale_inv=_padded(cscales, 4, 128, GARBAGE))
    path = tmp_path / "raw"
    with pytest.raises(qdcp.UnsupportedTensorError, match=r"key 'w'.*2-D tensors only.*dequantized"):
        raise_inner(lambda: dcp.save({"w": t}, checkpoint_id=path, planner=QuantizedSavePlanner()))
    assert not (path / ".metadata").exists()
    dcp.save({"w": t}, checkpoint_id=tmp_path / "dq", planner=QuantizedSavePlanner(dequantize=True))
    out = {"w": torch.zeros(shape, dtype=torch.bfloat16)}
    dcp.load(out, checkpoint_id=tmp_path / "dq", planner=QuantizedLoadPlanner())
    assert torch.equal(out["w"], find_adapter(t).dequantize(t))


@pytest.mark.parametrize("name", ["f8_cs_rowwise", "mxfp8_rowwise", "block2d_rowwise", "nvfp4_rowwise"])
def test_a_te_tensor_stock_dcp_pickled_is_read_or_named(tmp_path, monkeypatch, name):
    """Stock ``dcp.save`` pickles a TE tensor whole (TE's reduce function, its quantizer): with TE
    imported and its classes allowed (what ``import transformer_engine.pytorch`` does; here by
    hand, the stand-in skips TE's __init__) qdcp reads its values, the adapter's dequantize(); with
    TE not imported the error says to import it (it said no adapter handles the type, install it)."""
    from transformer_engine.pytorch.tensor import float8_blockwise_tensor as bw
    from transformer_engine.pytorch.tensor import float8_tensor as f8
    from transformer_engine.pytorch.tensor import mxfp8_tensor as mx
    from transformer_engine.pytorch.tensor import nvfp4_tensor as nv

    case = BY_NAME[name]
    with te_cpu.simulate_gpu(case.cap):
        src = case.build(0)
    dcp.save({"w": src}, checkpoint_id=tmp_path / "stock", no_dist=True)
    want = find_adapter(src).dequantize(src)
    for module in [m for m in list(sys.modules) if m.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, module)
    with pytest.raises(qdcp.CheckpointFormatError, match=r"key 'w'.*TransformerEngine tensor pickled by DCP's own "
                                                         r"save.*import transformer_engine\.pytorch"):
        qdcp.read_entry(tmp_path / "stock", "w", dequantize=True)
    monkeypatch.undo()
    globs = [DType, f8.Float8Quantizer, f8.Float8CurrentScalingQuantizer, mx.MXFP8Quantizer, nv.NVFP4Quantizer,
             bw.Float8BlockQuantizer, f8._make_float8_tensor_in_reduce_ex, mx._make_mxfp8_tensor_in_reduce_ex,
             nv._make_nvfp4_tensor_in_reduce_ex, bw._make_float8_blockwise_tensor_in_reduce_ex]
    with torch.serialization.safe_globals(globs):
        got = qdcp.read_entry(tmp_path / "stock", "w", dequantize=True)
    assert torch.equal(bits(got), bits(want))
