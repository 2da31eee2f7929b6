"""Adapters for TransformerEngine's quantized tensors (TE 2.20): Float8, MXFP8, blockwise FP8, NVFP4.

TE is optional and never imported here: classes are recognised by module prefix
``transformer_engine.`` and class name along the MRO, and TE is used to rebuild a tensor only if
``transformer_engine.pytorch.tensor`` is already imported. Everything numeric is plain torch on
CPU: canonical components (unswizzled, unpadded scales; data in logical row order), dequantize,
and the inverse transforms that rebuild TE's native buffers (padding zero-filled, scales
re-swizzled, transposes recomputed). Quantizing would need TE's CUDA kernels, which qdcp does not
drive, so loading into a TE tensor of another format or from plain values raises
:class:`UnsupportedTensorError` (at load planning).

Canonical components per type (see docs/format.md):

- ``Float8Tensor``: ``data`` (logical shape, fp8) and ``scale_inv`` (1,) f32. A transpose-only
  tensor (Hopper, columnwise) stores its transpose back in logical order; a target's transpose is
  recomputed on load (a byte transpose, exact).
- ``MXFP8Tensor``: ``rowwise_data`` / ``rowwise_scale_inv`` (M.., N/32) e8m0;
  ``columnwise_data`` / ``columnwise_scale_inv`` (M/32, N) e8m0 -- each direction is its own
  quantization, so each present one is stored.
- ``Float8BlockwiseQTensor``: 128x128 stores ``rowwise_data`` and ``rowwise_scale_inv``
  (M/128, N/128) f32 (the columnwise copy is their transpose, rebuilt on load); 1x128 stores
  rowwise ``(M, N/128)`` and columnwise ``(M/128, N)`` scales, data in logical order.
- ``NVFP4Tensor``: ``rowwise_data`` (M, N/2) packed low nibble first, ``rowwise_scale_inv``
  (M, N/16) e4m3, ``amax_rowwise`` (1,) or per row (M, 1); columnwise ``columnwise_data``
  (M/2, N) (two rows per byte), ``columnwise_scale_inv`` (M/16, N), ``amax_columnwise``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from qdcp.adapters.base import Adapter
from qdcp.errors import LoadMismatchError, UnsupportedTensorError
from qdcp.adapters.formats import (as_u8, bits_as, ceil_div, copy_bits, e2m1_to_float, pad2, repeat_blocks, round_up,
                                   rows, swizzle_128x4, unpack_fp4, unswizzle_128x4,
                                   NVFP4_ROW16, mxfp8_form)
from qdcp.layouts import Blocked, Layout, Replicated

_TE_TENSOR_MODULE = "transformer_engine.pytorch.tensor"

# TE DType values (transformer_engine.h) <-> the names qdcp records.
_FP8_NAMES = {7: "e4m3", 8: "e5m2"}
_FP8_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FP8_CODES = {v: k for k, v in _FP8_NAMES.items()}
_FP4_CODE = 10



def dequantize_fp8(data: torch.Tensor, fp8: str, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """TE Float8: ``fp8 * scale_inv`` in float32, then ``dtype`` (TE's CPU path, bit for bit)."""
    return (bits_as(data, _FP8_TORCH[fp8]).float() * scale_inv.float()).to(dtype)


def dequantize_mxfp8(data: torch.Tensor, fp8: str, scale: torch.Tensor, *, block_rows: int,
                     block_cols: int, dtype: torch.dtype) -> torch.Tensor:
    """MXFP8: ``fp8 * 2^(e-127)``, one E8M0 ``scale`` item per ``block_rows x block_cols`` block."""
    x = bits_as(data, _FP8_TORCH[fp8]).float()
    s = bits_as(scale, torch.float8_e8m0fnu).float()
    return (x * repeat_blocks(s, block_rows, block_cols, x.shape)).to(dtype)


def _te_tensor_module():
    """TE's tensor package if the program has already imported it (never imported here)."""
    return sys.modules.get(_TE_TENSOR_MODULE)


def _te_dtype(code: int):
    constants = sys.modules.get("transformer_engine.pytorch.constants")
    return constants.DType(code) if constants is not None else code


# ----------------------------------------------------------------------------- adapter base

class TEAdapter(Adapter):
    """Shared machinery: recognition, TE's inner buffers for the stager, and GPU-only errors."""

    cls_name: str = ""
    format_name: str = ""

    def __init__(self) -> None:
        self.type_names = (f"transformer_engine.{self.cls_name}",)

    def matches(self, cls: type) -> bool:
        return any(c.__name__ == self.cls_name and c.__module__.startswith("transformer_engine.")
                   for c in cls.__mro__)

    def type_name(self, t):
        return self.type_names[0]

    _RECIPES = {"Float8Quantizer": "delayed scaling", "Float8CurrentScalingQuantizer": "current scaling",
                "MXFP8Quantizer": "mxfp8", "Float8BlockQuantizer": "blockwise", "NVFP4Quantizer": "nvfp4"}
    _USAGE_BUFFERS = (("rowwise", "_data"), ("rowwise", "_rowwise_data"),
                      ("columnwise", "_transpose"), ("columnwise", "_columnwise_data"))

    def info(self, t):
        """Recipe (from the quantizer), native scale layout and which usages hold buffers."""
        out = {}
        quantizer = getattr(t, "_quantizer", None)
        if quantizer is not None:
            out["recipe"] = self._RECIPES.get(type(quantizer).__name__, type(quantizer).__name__)
        if hasattr(t, "_with_gemm_swizzled_scales"):
            out["scales"] = "gemm_swizzled" if t._with_gemm_swizzled_scales else "compact"
        usage = [u for u, attr in self._USAGE_BUFFERS if getattr(t, attr, None) is not None]
        if usage:
            out["usage"] = "+".join(dict.fromkeys(usage))
        return out

    # --- stager: TE's own buffers, rewrapped through TE's flatten protocol
    def inner_buffers(self, t):
        names, _ = t.__tensor_flatten__()
        return {n: getattr(t, n) for n in names}

    def from_inner_buffers(self, t, buffers):
        names, ctx = t.__tensor_flatten__()
        if set(buffers) != set(names):
            raise LoadMismatchError(f"{self.cls_name}: expected buffers {sorted(names)}, got {sorted(buffers)}")
        return type(t).__tensor_unflatten__(dict(buffers), ctx, t.shape, t.stride())

    # --- canonical
    def native_components(self, t):
        return {}

    def dequantize(self, t, dtype=None):
        """TE's dequantize math in plain torch (float32, then ``dtype``: a float32 target gets the
        exact products, never rounded through the logical dtype)."""
        return self._dequantize(self.attributes(t), tuple(t.shape), dtype or t.dtype, self.components(t))

    def dequantize_stored(self, stored, dtype=None):
        """The same math on stored components: needs no TransformerEngine."""
        return self._dequantize(stored.attrs, tuple(stored.shape), dtype or stored.dtype, stored.components)

    def _dequantize(self, attrs, shape, dtype, comps) -> torch.Tensor:
        raise NotImplementedError

    def rebuild(self, stored):
        if _te_tensor_module() is None:
            raise UnsupportedTensorError(
                f"rebuilding a TransformerEngine {self.cls_name} needs transformer_engine, which this "
                f"process has not imported (qdcp never imports it); import transformer_engine.pytorch "
                f"first. Its values need no TE: qdcp.read_entry(path, key, dequantize=True).")
        return self._rebuild_te(stored.attrs, tuple(int(s) for s in stored.shape), stored.dtype,
                                dict(stored.components))

    def _rebuild_te(self, attrs, shape, dtype, comps) -> torch.Tensor:
        raise NotImplementedError

    def quantize_unsupported(self, target):
        return (f"qdcp does not quantize into a TransformerEngine {self.format_name} tensor (that needs "
                f"TE's CUDA quantize kernels, which qdcp does not drive); only raw loads of the same "
                f"format ({self.type_names[0]}, same config, on block boundaries) fill one. Load into a "
                f"plain tensor and quantize it with TE's quantizer.")

    def quantize_like(self, target, hp, global_amax=None):
        raise UnsupportedTensorError(self.quantize_unsupported(target))

    def copy_into(self, target, components):
        unknown = set(components) - set(self.component_names(target))
        if unknown:
            raise LoadMismatchError(
                f"the target {self.cls_name} has no component(s) {sorted(unknown)} to load into")
        for name, value in components.items():
            self._copy_component(target, name, value)

    def _copy_component(self, target, name: str, value: torch.Tensor) -> None:
        raise NotImplementedError


def _check_2d(t_shape, cls_name: str, what: str) -> None:
    if len(t_shape) != 2:
        raise UnsupportedTensorError(
            f"{cls_name} of shape {tuple(t_shape)}: qdcp stores {what} of 2-D tensors only; save this "
            f"entry dequantized (QuantizedSavePlanner(dequantize=...)).")


# ----------------------------------------------------------------------------- Float8Tensor

class TEFloat8TensorAdapter(TEAdapter):
    """TE ``Float8Tensor`` (delayed and current scaling): fp8 data and one ``scale_inv``."""

    cls_name = "Float8Tensor"
    format_name = "Float8 (per-tensor scaling)"

    def attributes(self, t):
        return {"fp8_dtype": _FP8_NAMES[int(t._fp8_dtype)]}

    def component_names(self, t):
        return ["data", "scale_inv"]

    def layouts(self, t):
        return {"data": Blocked((1,) * t.ndim), "scale_inv": Replicated(tuple(t._scale_inv.shape))}

    def components(self, t):
        fp8 = _FP8_TORCH[_FP8_NAMES[int(t._fp8_dtype)]]
        if t._data is not None:
            data = t._data.view(fp8)
        elif t._transpose is not None and not t._transpose_invalid:
            data = t._transpose.movedim(0, -1).contiguous().view(fp8)
        else:
            raise UnsupportedTensorError("Float8Tensor holds neither data nor a valid transpose")
        return {"data": data, "scale_inv": t._scale_inv}

    def native_components(self, t):
        out = {"scale_inv": t._scale_inv}
        if t._data is not None and t._transpose is None:  # else copy_into recomputes the transpose
            out["data"] = t._data.view(_FP8_TORCH[_FP8_NAMES[int(t._fp8_dtype)]])
        return out

    def _copy_component(self, target, name, value):
        if name == "scale_inv":
            target._scale_inv.copy_(value.reshape(target._scale_inv.shape))
            return
        if target._data is not None:
            copy_bits(target._data, value)
        if target._transpose is not None:
            copy_bits(target._transpose, as_u8(value).movedim(-1, 0))
            target._transpose_invalid = False

    def _dequantize(self, attrs, shape, dtype, comps):
        return dequantize_fp8(comps["data"], attrs["fp8_dtype"], comps["scale_inv"], dtype)

    def _rebuild_te(self, attrs, shape, dtype, comps):
        te = _te_tensor_module()
        data = as_u8(comps["data"]).contiguous()
        return te.Float8Tensor(shape=shape, dtype=dtype, data=data, fp8_scale_inv=comps["scale_inv"],
                               fp8_dtype=_te_dtype(_FP8_CODES[attrs["fp8_dtype"]]),
                               device=data.device)


# ----------------------------------------------------------------------------- MXFP8Tensor

class TEMXFP8TensorAdapter(TEAdapter):
    """TE ``MXFP8Tensor``: fp8 data, E8M0 scale per 32 along rows (rowwise) or columns (columnwise)."""

    cls_name = "MXFP8Tensor"
    format_name = "MXFP8"

    def attributes(self, t):
        return {"fp8_dtype": _FP8_NAMES[int(t._fp8_dtype)]}

    def component_names(self, t):
        names = []
        if t._rowwise_data is not None:
            names += ["rowwise_data", "rowwise_scale_inv"]
        if t._columnwise_data is not None:
            _check_2d(t.shape, self.cls_name, "columnwise MXFP8 data")
            names += ["columnwise_data", "columnwise_scale_inv"]
        return names

    def layouts(self, t):
        ones = (1,) * t.ndim
        out: dict[str, Layout] = {}
        if t._rowwise_data is not None:
            out["rowwise_data"] = Blocked(ones)
            out["rowwise_scale_inv"] = Blocked(ones[:-1] + (32,))
        if t._columnwise_data is not None:
            out["columnwise_data"] = Blocked(ones)
            out["columnwise_scale_inv"] = Blocked((32, 1))
        return out

    def components(self, t):
        fp8 = _FP8_TORCH[_FP8_NAMES[int(t._fp8_dtype)]]
        shape = tuple(t.shape)
        m, n = rows(shape), shape[-1]
        out = {}
        if t._rowwise_data is not None:
            s = as_u8(t._rowwise_scale_inv)
            nb = ceil_div(n, 32)
            s = unswizzle_128x4(s, m, nb) if t._with_gemm_swizzled_scales else s[:m, :nb]
            out["rowwise_data"] = t._rowwise_data.view(fp8)
            out["rowwise_scale_inv"] = s.contiguous().view(torch.float8_e8m0fnu).reshape(*shape[:-1], nb)
        if t._columnwise_data is not None:
            s = as_u8(t._columnwise_scale_inv)
            mb = ceil_div(m, 32)
            # Swizzled columnwise scales tile the transposed (N, M/32) matrix.
            s = unswizzle_128x4(s, n, mb).t() if t._with_gemm_swizzled_scales else s[:mb, :n]
            out["columnwise_data"] = t._columnwise_data.view(fp8)
            out["columnwise_scale_inv"] = s.contiguous().view(torch.float8_e8m0fnu)
        return out

    def native_components(self, t):
        fp8 = _FP8_TORCH[_FP8_NAMES[int(t._fp8_dtype)]]
        out = {}
        if t._rowwise_data is not None:
            out["rowwise_data"] = t._rowwise_data.view(fp8)
        if t._columnwise_data is not None:
            out["columnwise_data"] = t._columnwise_data.view(fp8)
        return out

    @staticmethod
    def native_scale(compact: torch.Tensor, columnwise: bool, swizzled: bool) -> torch.Tensor:
        """TE's padded (and optionally swizzled) scale buffer from a compact canonical one."""
        c = as_u8(compact.contiguous())
        c = c.reshape(-1, c.shape[-1])
        if columnwise:
            rows, cols = round_up(c.shape[0], 4), round_up(c.shape[1], 128)
            if swizzled:
                return swizzle_128x4(c.t()).reshape(rows, cols)
            return pad2(c, rows, cols)
        if swizzled:
            return swizzle_128x4(c)
        return pad2(c, round_up(c.shape[0], 128), round_up(c.shape[1], 4))

    def _copy_component(self, target, name, value):
        buf = getattr(target, "_" + name)
        if name.endswith("_data"):
            copy_bits(buf, value)
        else:
            native = self.native_scale(value, name.startswith("columnwise"),
                                       target._with_gemm_swizzled_scales)
            copy_bits(buf, native)

    def _dequantize(self, attrs, shape, dtype, comps):
        fp8 = attrs["fp8_dtype"]
        if "rowwise_data" in comps:
            data, scale = comps["rowwise_data"], comps["rowwise_scale_inv"]
            return dequantize_mxfp8(data, fp8, scale, block_rows=1, block_cols=32, dtype=dtype)
        return dequantize_mxfp8(comps["columnwise_data"], fp8, comps["columnwise_scale_inv"], block_rows=32,
                                block_cols=1, dtype=dtype)

    def _rebuild_te(self, attrs, shape, dtype, comps):
        te = _te_tensor_module()
        kw = {}
        for d in ("rowwise", "columnwise"):
            data = comps.get(f"{d}_data")
            kw[f"{d}_data"] = None if data is None else as_u8(data).contiguous()
            scale = comps.get(f"{d}_scale_inv")
            kw[f"{d}_scale_inv"] = None if scale is None else self.native_scale(scale, d == "columnwise", False)
        device = next(v.device for v in comps.values())
        return te.MXFP8Tensor(shape=shape, dtype=dtype, fp8_dtype=_te_dtype(_FP8_CODES[attrs["fp8_dtype"]]),
                              quantizer=None, with_gemm_swizzled_scales=False, device=device, **kw)

    # Raw interchange: the rowwise direction is OCP MXFP8 (E8M0 per 32 along rows).
    def raw_forms_out(self, type_name, attrs):
        form = mxfp8_form(_FP8_TORCH.get(attrs.get("fp8_dtype")))
        return {form: ["rowwise_data", "rowwise_scale_inv"]} if form else {}

    def to_raw_form(self, type_name, attrs, form, components):
        return {"data": as_u8(components["rowwise_data"]), "scale": as_u8(components["rowwise_scale_inv"])}

    def raw_forms_in(self, target):
        if target._rowwise_data is None or target._columnwise_data is not None:
            return ()  # a columnwise copy is a separate quantization: needs a GPU
        return (mxfp8_form(_FP8_TORCH[_FP8_NAMES[int(target._fp8_dtype)]]),)

    def from_raw_form(self, target, form, tensors):
        self.copy_into(target, {"rowwise_data": tensors["data"], "rowwise_scale_inv": tensors["scale"]})


# ----------------------------------------------------------------------------- blockwise FP8

class TEFloat8BlockwiseQTensorAdapter(TEAdapter):
    """TE ``Float8BlockwiseQTensor``: fp8 data, f32 scale per 128x128 tile or per 1x128 vector."""

    cls_name = "Float8BlockwiseQTensor"
    format_name = "blockwise FP8"

    def attributes(self, t):
        return {"fp8_dtype": _FP8_NAMES[int(t._fp8_dtype)], "block_scaling_dim": 2 if t._is_2D_scaled else 1}

    def component_names(self, t):
        _check_2d(t.shape, self.cls_name, "blockwise FP8")
        if t._is_2D_scaled:
            return ["rowwise_data", "rowwise_scale_inv"]
        names = []
        if t._rowwise_data is not None:
            names += ["rowwise_data", "rowwise_scale_inv"]
        if t._columnwise_data is not None:
            names += ["columnwise_data", "columnwise_scale_inv"]
        return names

    def layouts(self, t):
        if t._is_2D_scaled:
            return {"rowwise_data": Blocked((1, 1)), "rowwise_scale_inv": Blocked((128, 128))}
        out: dict[str, Layout] = {}
        if t._rowwise_data is not None:
            out["rowwise_data"] = Blocked((1, 1))
            out["rowwise_scale_inv"] = Blocked((1, 128))
        if t._columnwise_data is not None:
            out["columnwise_data"] = Blocked((1, 1))
            out["columnwise_scale_inv"] = Blocked((128, 1))
        return out

    def components(self, t):
        _check_2d(t.shape, self.cls_name, "blockwise FP8")
        fp8 = _FP8_TORCH[_FP8_NAMES[int(t._fp8_dtype)]]
        m, n = t.shape
        tm, tn = ceil_div(m, 128), ceil_div(n, 128)
        out = {}
        if t._is_2D_scaled:
            if t._rowwise_data is not None:
                out["rowwise_data"] = t._rowwise_data.view(fp8)
                out["rowwise_scale_inv"] = t._rowwise_scale_inv[:tm, :tn].contiguous()
            else:  # columnwise only: the transpose of the rowwise copy, with transposed tiles
                out["rowwise_data"] = t._columnwise_data.t().contiguous().view(fp8)
                out["rowwise_scale_inv"] = t._columnwise_scale_inv[:tn, :tm].t().contiguous()
            return out
        if t._rowwise_data is not None:
            out["rowwise_data"] = t._rowwise_data.view(fp8)
            out["rowwise_scale_inv"] = t._rowwise_scale_inv[:tn, :m].t().contiguous()
        if t._columnwise_data is not None:
            out["columnwise_data"] = t._columnwise_data.t().contiguous().view(fp8)
            out["columnwise_scale_inv"] = t._columnwise_scale_inv[:tm, :n].contiguous()
        return out

    def native_components(self, t):
        if t._rowwise_data is not None and not (t._is_2D_scaled and t._columnwise_data is not None):
            return {"rowwise_data": t._rowwise_data.view(_FP8_TORCH[_FP8_NAMES[int(t._fp8_dtype)]])}
        return {}  # a 2-D columnwise copy is rebuilt by copy_into

    @staticmethod
    def native_buffers(is_2d: bool, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """TE buffers (by attribute) that canonical component ``name`` fills."""
        if name == "rowwise_data":
            out = {"_rowwise_data": as_u8(value)}
            if is_2d:  # the 128x128 columnwise copy is the transpose of the rowwise one
                out["_columnwise_data"] = as_u8(value).t()
            return out
        if name == "columnwise_data":
            return {"_columnwise_data": as_u8(value).t()}
        if is_2d:  # rowwise_scale_inv (tm, tn)
            tm, tn = value.shape
            return {"_rowwise_scale_inv": pad2(value, tm, round_up(tn, 4)),
                    "_columnwise_scale_inv": pad2(value.t(), tn, round_up(tm, 4))}
        if name == "rowwise_scale_inv":  # (m, tn) -> (tn, roundup(m, 4))
            m, tn = value.shape
            return {"_rowwise_scale_inv": pad2(value.t(), tn, round_up(m, 4))}
        tm, n = value.shape  # columnwise_scale_inv (tm, n) -> (tm, roundup(n, 4))
        return {"_columnwise_scale_inv": pad2(value, tm, round_up(n, 4))}

    def _copy_component(self, target, name, value):
        for attr, native in self.native_buffers(target._is_2D_scaled, name, value).items():
            buf = getattr(target, attr)
            if buf is not None:
                copy_bits(buf, native)

    def _dequantize(self, attrs, shape, dtype, comps):
        fp8 = _FP8_TORCH[attrs["fp8_dtype"]]
        if attrs["block_scaling_dim"] == 2:
            q, s = comps["rowwise_data"], comps["rowwise_scale_inv"]
            m, n = q.shape
            s = repeat_blocks(s, 128, 128, (m, n))
            return (bits_as(q, fp8).to(torch.float32) * s).to(dtype)
        if "rowwise_data" in comps:
            q, s = comps["rowwise_data"], comps["rowwise_scale_inv"]
            s = s.repeat_interleave(128, 1)[:, : q.shape[1]]
        else:
            q, s = comps["columnwise_data"], comps["columnwise_scale_inv"]
            s = s.repeat_interleave(128, 0)[: q.shape[0]]
        return (bits_as(q, fp8).to(torch.float32) * s).to(dtype)

    def _rebuild_te(self, attrs, shape, dtype, comps):
        te = _te_tensor_module()
        is_2d = attrs["block_scaling_dim"] == 2
        kw = {"_rowwise_data": None, "_rowwise_scale_inv": None,
              "_columnwise_data": None, "_columnwise_scale_inv": None}
        for name, value in comps.items():
            native = self.native_buffers(is_2d, name, value)
            kw.update({k: v.contiguous() for k, v in native.items()})
        device = next(v.device for v in comps.values())
        return te.Float8BlockwiseQTensor(
            shape=shape, dtype=dtype, rowwise_data=kw["_rowwise_data"],
            rowwise_scale_inv=kw["_rowwise_scale_inv"], columnwise_data=kw["_columnwise_data"],
            columnwise_scale_inv=kw["_columnwise_scale_inv"],
            fp8_dtype=_te_dtype(_FP8_CODES[attrs["fp8_dtype"]]), quantizer=None, is_2D_scaled=is_2d,
            device=device)


# ----------------------------------------------------------------------------- NVFP4Tensor

class TENVFP4TensorAdapter(TEAdapter):
    """TE ``NVFP4Tensor``: E2M1 data (two per byte), E4M3 scale per 16, fp32 amax."""

    cls_name = "NVFP4Tensor"
    format_name = "NVFP4"

    def attributes(self, t):
        rht = bool(t._columnwise_data is not None and getattr(t._quantizer, "with_rht", False))
        return {"row_scaled": bool(t._row_scaled_nvfp4), "use_4over6": bool(t._nvfp4_use_4over6),
                "e4m3_max": int(t._nvfp4_e4m3_max), "columnwise_rht": rht}

    def component_names(self, t):
        names = []
        if t._rowwise_data is not None:
            names += ["rowwise_data", "rowwise_scale_inv", "amax_rowwise"]
        if t._columnwise_data is not None:
            _check_2d(t.shape, self.cls_name, "columnwise NVFP4 data")
            names += ["columnwise_data", "columnwise_scale_inv", "amax_columnwise"]
        return names

    def layouts(self, t):
        ones = (1,) * t.ndim
        out: dict[str, Layout] = {}
        if t._rowwise_data is not None:
            out["rowwise_data"] = Blocked(ones[:-1] + (2,))
            out["rowwise_scale_inv"] = Blocked(ones[:-1] + (16,))
            out["amax_rowwise"] = (Blocked(ones[:-1] + (t.shape[-1],)) if t._row_scaled_nvfp4
                                   else Replicated(tuple(t._amax_rowwise.shape)))
        if t._columnwise_data is not None:
            out["columnwise_data"] = Blocked((2, 1))
            out["columnwise_scale_inv"] = Blocked((16, 1))
            out["amax_columnwise"] = Replicated(tuple(t._amax_columnwise.shape))
        return out

    def components(self, t):
        shape = tuple(t.shape)
        m, n = rows(shape), shape[-1]
        swz = t._with_gemm_swizzled_scales
        out = {}
        if t._rowwise_data is not None:
            nb = ceil_div(n, 16)
            s = as_u8(t._rowwise_scale_inv)
            s = unswizzle_128x4(s, m, nb) if swz else s[:m, :nb]
            out["rowwise_data"] = as_u8(t._rowwise_data)
            out["rowwise_scale_inv"] = s.contiguous().view(torch.float8_e4m3fn).reshape(*shape[:-1], nb)
            amax = t._amax_rowwise
            out["amax_rowwise"] = amax.reshape(*shape[:-1], 1) if t._row_scaled_nvfp4 else amax
        if t._columnwise_data is not None:
            mb = ceil_div(m, 16)
            s = as_u8(t._columnwise_scale_inv)
            s = unswizzle_128x4(s, n, mb) if swz else s[:n, :mb]
            out["columnwise_data"] = as_u8(t._columnwise_data).t().contiguous()
            out["columnwise_scale_inv"] = s.t().contiguous().view(torch.float8_e4m3fn)
            out["amax_columnwise"] = t._amax_columnwise
        return out

    def native_components(self, t):
        out = {}
        if t._rowwise_data is not None:
            out["rowwise_data"] = as_u8(t._rowwise_data)
            if not t._row_scaled_nvfp4:
                out["amax_rowwise"] = t._amax_rowwise
        if t._columnwise_data is not None:
            out["amax_columnwise"] = t._amax_columnwise
        return out

    @staticmethod
    def native_scale(compact: torch.Tensor, columnwise: bool, swizzled: bool) -> torch.Tensor:
        c = as_u8(compact.contiguous())
        c = c.reshape(-1, c.shape[-1])
        if columnwise:
            c = c.t()  # (N, M/16): TE keeps columnwise scales in the transposed orientation
        if swizzled:
            return swizzle_128x4(c)
        return pad2(c, round_up(c.shape[0], 128), round_up(c.shape[1], 4))

    def _copy_component(self, target, name, value):
        buf = getattr(target, "_" + name)
        if name == "rowwise_data":
            copy_bits(buf, value)
        elif name == "columnwise_data":
            copy_bits(buf, as_u8(value).t())
        elif name.endswith("_scale_inv"):
            copy_bits(buf, self.native_scale(value, name.startswith("columnwise"),
                                              target._with_gemm_swizzled_scales))
        else:
            buf.copy_(value.reshape(buf.shape))

    def _dequantize(self, attrs, shape, dtype, comps):
        if attrs.get("use_4over6"):
            raise UnsupportedTensorError(
                "NVFP4 with 4over6 block selection: qdcp has no verified plain-torch dequantize for it; "
                "load it into an NVFP4Tensor of the same config, or dequantize with TE on a GPU")
        finv = torch.tensor(1.0 / (6.0 * float(attrs.get("e4m3_max", 448))), dtype=torch.float32)
        if "rowwise_data" in comps:
            codes = unpack_fp4(comps["rowwise_data"])[..., : shape[-1]]
            scale = bits_as(comps["rowwise_scale_inv"], torch.float8_e4m3fn).float()
            amax = comps["amax_rowwise"].float()
            amax = amax.reshape(*shape[:-1], 1) if attrs.get("row_scaled") else amax.reshape(())
            final = (scale * amax) * finv  # TE's kernel: float(scale) * amax * (1 / (6 * e4m3_max))
            final = final.repeat_interleave(16, dim=-1)[..., : shape[-1]]
            return (e2m1_to_float(codes) * final).to(dtype)
        if attrs.get("columnwise_rht"):
            raise UnsupportedTensorError(
                "NVFP4 columnwise-only tensor with random Hadamard transform: its values cannot be "
                "recovered without the inverse transform; save or load the rowwise copy")
        packed = comps["columnwise_data"]  # (M/2, N), two logical rows per byte
        p = as_u8(packed)
        codes = torch.stack([p & 0xF, p >> 4], dim=1).reshape(p.shape[0] * 2, p.shape[1])[: shape[0]]
        scale = bits_as(comps["columnwise_scale_inv"], torch.float8_e4m3fn).float()
        final = (scale * comps["amax_columnwise"].float().reshape(-1)[0]) * finv
        final = final.repeat_interleave(16, dim=0)[: shape[0]]
        return (e2m1_to_float(codes) * final).to(dtype)

    def _rebuild_te(self, attrs, shape, dtype, comps):
        te = _te_tensor_module()
        kw: dict[str, Any] = {}
        for d in ("rowwise", "columnwise"):
            data = comps.get(f"{d}_data")
            if data is None:
                kw[f"{d}_data"] = kw[f"{d}_scale_inv"] = kw[f"amax_{d}"] = None
                continue
            kw[f"{d}_data"] = as_u8(data).contiguous() if d == "rowwise" else as_u8(data).t().contiguous()
            kw[f"{d}_scale_inv"] = self.native_scale(comps[f"{d}_scale_inv"], d == "columnwise", False)
            kw[f"amax_{d}"] = comps[f"amax_{d}"].reshape(-1).contiguous()
        device = next(v.device for v in comps.values())
        return te.NVFP4Tensor(
            shape=shape, dtype=dtype, fp4_dtype=_te_dtype(_FP4_CODE), quantizer=None,
            with_gemm_swizzled_scales=False, row_scaled_nvfp4=bool(attrs.get("row_scaled")),
            nvfp4_use_4over6=bool(attrs.get("use_4over6")), nvfp4_e4m3_max=int(attrs.get("e4m3_max", 448)),
            device=device, **kw)

    # Raw interchange: the rowwise direction with one global amax is NVFP4's row-16 form.
    def raw_forms_out(self, type_name, attrs):
        if attrs.get("row_scaled") or attrs.get("use_4over6"):
            return {}
        return {NVFP4_ROW16: ["rowwise_data", "rowwise_scale_inv", "amax_rowwise"]}

    def to_raw_form(self, type_name, attrs, form, components):
        return {"data": as_u8(components["rowwise_data"]), "scale": as_u8(components["rowwise_scale_inv"]),
                "amax": components["amax_rowwise"].float().reshape(())}

    def raw_forms_in(self, target):
        if target._rowwise_data is None or target._columnwise_data is not None:
            return ()
        if target._row_scaled_nvfp4 or target._nvfp4_use_4over6:
            return ()
        return (NVFP4_ROW16,)

    def from_raw_form(self, target, form, tensors):
        self.copy_into(target, {"rowwise_data": tensors["data"], "rowwise_scale_inv": tensors["scale"],
                                "amax_rowwise": tensors["amax"].reshape(target._amax_rowwise.shape)})


def builtin_adapters() -> list[Adapter]:
    """The TransformerEngine adapters qdcp registers at import (TE itself is not imported)."""
    return [TEFloat8TensorAdapter(), TEMXFP8TensorAdapter(), TEFloat8BlockwiseQTensorAdapter(),
            TENVFP4TensorAdapter()]
