"""Adapters for TransformerEngine's quantized tensors (TE 2.20): Float8, MXFP8, blockwise FP8, NVFP4.

TE is never imported here: classes are recognised by module prefix and class name along the MRO,
and TE rebuilds a tensor only if the program imported it. The rest is plain torch on CPU:
canonical components (unswizzled, unpadded scales; data in logical row order), dequantize, and
the transforms back to TE's native buffers. Quantizing needs TE's CUDA kernels, so a load into a
TE tensor of another format or from plain values is refused at planning
(:class:`UnsupportedTensorError`). Each adapter declares its components (``COMPONENTS``, of
:class:`~qdcp.adapters.te_components.Component`; docs/adapters.md tables them), from which
:class:`TEAdapter` derives every per-component method.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from qdcp.adapters.base import Adapter, RawInterchangeAdapter, TraceableAdapter, refuse_unknown
from qdcp.adapters.formats import (
    MXFP8_FORMS,
    NVFP4_ROW16,
    as_u8,
    bits_as,
    ceil_div,
    copy_bits,
    e2m1_to_float,
    pad2,
    repeat_blocks,
    round_up,
    rows,
    swizzle_128x4,
    unpack_fp4,
    unswizzle_128x4,
)
from qdcp.adapters.te_components import Component, blocked, blocks
from qdcp.errors import UnsupportedTensorError
from qdcp.layouts import Blocked

_TE_TENSOR_MODULE = "transformer_engine.pytorch.tensor"

# TE DType values (transformer_engine.h) <-> the names qdcp records.
_FP8_NAMES = {7: "e4m3", 8: "e5m2"}
_FP8_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FP8_CODES = {v: k for k, v in _FP8_NAMES.items()}
_FP4_CODE = 10


def _te_tensor_module():
    """TE's tensor package if the program has already imported it (never imported here)."""
    return sys.modules.get(_TE_TENSOR_MODULE)


def is_te_class(cls: type, names: tuple[str, ...]) -> bool:
    """Whether ``cls`` or a base of it is a TransformerEngine class named one of ``names``."""
    return any(c.__name__ in names and c.__module__.startswith("transformer_engine.") for c in cls.__mro__)


def _te_dtype(code: int):
    constants = sys.modules.get("transformer_engine.pytorch.constants")
    return constants.DType(code) if constants is not None else code


# ----------------------------------------------------------------------------- adapter base

class TEAdapter(TraceableAdapter, RawInterchangeAdapter):
    """Recognition, rebuilding through TE, GPU-only errors and every per-component method (from
    :attr:`COMPONENTS`); a subclass adds its attributes, dequantize math and TE's constructor keywords."""

    cls_name: str = ""
    format_name: str = ""
    #: canonical components of every usage, in stored order (see :class:`Component`)
    COMPONENTS: tuple[Component, ...] = ()
    #: raw interchange of the rowwise direction: ``(form tensor, canonical component)`` pairs
    RAW_FORM: tuple[tuple[str, str], ...] = ()

    def __init__(self) -> None:
        self.type_names = (f"transformer_engine.{self.cls_name}",)

    def matches(self, cls: type) -> bool:
        return is_te_class(cls, (self.cls_name,))

    def allow_pickled(self, qualified_name: str) -> bool:
        """A TE tensor stock DCP pickled: loadable where the program imported TE (which allows its
        classes in weights-only loads); without it, an error says to import it."""
        if not qualified_name.startswith("transformer_engine."):
            return False
        if _te_tensor_module() is None:
            raise UnsupportedTensorError(
                f"the stored chunk is a TransformerEngine tensor pickled by DCP's own save ({qualified_name}); "
                f"qdcp never imports TransformerEngine: `import transformer_engine.pytorch` before reading it "
                f"(or re-save it with qdcp.save, whose raw entries load without TE)")
        return True

    def attributes(self, t):
        """The format's configuration: its fp8 dtype (formats with more, or none, override)."""
        return {"fp8_dtype": _FP8_NAMES[int(t._fp8_dtype)]}

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

    # --- canonical components: all derived from the declaration
    def declared(self, attrs) -> tuple[Component, ...]:
        """The components declared for a tensor with ``attrs``, every usage (default :attr:`COMPONENTS`)."""
        return self.COMPONENTS

    def present_components(self, t, attrs=None, *, check_2d: bool = True) -> list[Component]:
        """The declared components live ``t`` holds (those of its usages), in order. ``check_2d``
        refuses, naming the class and shape, one that needs a 2-D tensor on a tensor of another rank."""
        found = []
        for c in self.declared(self.attributes(t) if attrs is None else attrs):
            if c.present(t):
                if check_2d and c.needs_2d:
                    _check_2d(t.shape, self.cls_name, c.needs_2d)
                found.append(c)
        return found

    def component_names(self, t):
        """Names of the declared components of ``t``'s usages (refuses 2-D-only ones on other ranks)."""
        return [c.name for c in self.present_components(t)]

    # layouts / components / native_components do not refuse a non-2-D tensor: a dequantized save
    # describes and dequantizes (from the rowwise components) tensors of any rank.
    def _each(self, t, fn) -> dict[str, Any]:
        """``fn(component, attrs)`` of each present component of ``t``, by name (``None`` results left out)."""
        attrs = self.attributes(t)
        out = {c.name: fn(c, attrs) for c in self.present_components(t, attrs, check_2d=False)}
        return {k: v for k, v in out.items() if v is not None}

    def layouts(self, t):
        """Each present component's declared layout (replicated: its whole native buffer)."""
        return self._each(t, lambda c, attrs: c.layout_for(t, attrs))

    def components(self, t):
        """Each present component in canonical form, as its declared dtype."""
        return self._each(t, lambda c, attrs: c.canonical(t, attrs))

    def native_components(self, t):
        """The present components whose canonical form is their TE buffer."""
        return self._each(t, lambda c, attrs: c.canonical(t, attrs) if c.is_in_place(t) else None)

    def copy_into(self, target, components):
        """Write canonical ``components`` into ``target``'s buffers (padding zero, swizzle and
        transposed copies as the target keeps them)."""
        present = {c.name: c for c in self.present_components(target)}
        refuse_unknown(self.cls_name, components, present)
        swizzled = bool(getattr(target, "_with_gemm_swizzled_scales", False))
        for name, value in components.items():
            self._copy_component(target, present[name], value, swizzled)

    def _copy_component(self, target, comp: Component, value: torch.Tensor, swizzled: bool) -> None:
        """Copy canonical ``value`` into every TE buffer of ``comp`` that ``target`` has."""
        for attr, native in comp.native(value, swizzled).items():
            buf = getattr(target, attr)
            if buf is not None:
                copy_bits(buf, native)

    def _native_kwargs(self, attrs, comps) -> dict[str, Any]:
        """TE constructor keywords (buffer names, no underscore) holding ``comps`` natively, unswizzled;
        None for declared buffers ``comps`` does not fill."""
        declared = {c.name: c for c in self.declared(attrs)}
        kw: dict[str, Any] = {a.lstrip("_"): None for c in declared.values()
                              for a in (c.buffer, *(d for d, _ in c.derived))}
        for name, value in comps.items():
            if name in declared:
                kw.update((a.lstrip("_"), v.contiguous()) for a, v in declared[name].native(value, False).items())
        return kw

    # --- raw interchange through a neutral form (formats.py), from the declared RAW_FORM
    _FORM_TENSORS = {"data": as_u8, "scale": as_u8, "amax": lambda v: v.float().reshape(())}

    def raw_form(self, attrs) -> str | None:
        """The neutral form the rowwise direction of a tensor with ``attrs`` is, or None (default)."""
        return None

    def raw_forms_out(self, type_name, attrs):
        """The declared :attr:`RAW_FORM` where :meth:`raw_form` names one for ``attrs``."""
        form = self.raw_form(attrs)
        return {form: [c for _, c in self.RAW_FORM]} if form else {}

    def to_raw_form(self, type_name, attrs, form, components):
        """The form's tensors from the components :attr:`RAW_FORM` maps them to."""
        return {k: self._FORM_TENSORS[k](components[c]) for k, c in self.RAW_FORM}

    def raw_forms_in(self, target):
        """The form of a rowwise-only target (a columnwise copy needs TE's kernels)."""
        if not self.RAW_FORM or target._rowwise_data is None or target._columnwise_data is not None:
            return ()
        form = self.raw_form(self.attributes(target))
        return (form,) if form else ()

    def from_raw_form(self, target, form, tensors):
        """Fill ``target`` from the form's tensors through :meth:`copy_into`."""
        self.copy_into(target, {c: tensors[k] for k, c in self.RAW_FORM})

    # --- values
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
        te = _te_tensor_module()
        if te is None:
            raise UnsupportedTensorError(
                f"rebuilding a TransformerEngine {self.cls_name} needs transformer_engine, which this "
                f"process has not imported (qdcp never imports it); import transformer_engine.pytorch "
                f"first. Its values need no TE: qdcp.read_entry(path, key, dequantize=True).")
        attrs, comps = stored.attrs, dict(stored.components)
        kw = self._te_kwargs(attrs, comps)
        if "fp8_dtype" in attrs:
            kw["fp8_dtype"] = _te_dtype(_FP8_CODES[attrs["fp8_dtype"]])
        return getattr(te, self.cls_name)(shape=tuple(int(s) for s in stored.shape), dtype=stored.dtype,
                                          quantizer=None, device=next(v.device for v in comps.values()), **kw)

    def _te_kwargs(self, attrs, comps) -> dict[str, Any]:
        """The format's keywords of TE's constructor for ``rebuild`` (besides shape, dtypes, device)."""
        raise NotImplementedError

    def quantize_unsupported(self, target):
        return (f"qdcp does not quantize into a TransformerEngine {self.format_name} tensor (that needs "
                f"TE's CUDA quantize kernels, which qdcp does not drive); only raw loads of the same "
                f"format ({self.type_names[0]}, same config, on block boundaries) fill one. Load into a "
                f"plain tensor and quantize it with TE's quantizer.")

    def quantize_like(self, target, hp, global_amax=None):
        raise UnsupportedTensorError(self.quantize_unsupported(target))


def _check_2d(t_shape, cls_name: str, what: str) -> None:
    if len(t_shape) != 2:
        raise UnsupportedTensorError(
            f"{cls_name} of shape {tuple(t_shape)}: qdcp stores {what} of 2-D tensors only; save this "
            f"entry dequantized (QuantizedSavePlanner(dequantize=...)).")


def _fp8(attrs) -> torch.dtype:
    """Canonical dtype of fp8 data: the tensor's own fp8 dtype."""
    return _FP8_TORCH[attrs["fp8_dtype"]]


# ----------------------------------------------------------------------------- TE's native layouts
# Transforms between TE's native buffers and canonical components: ``(t, buffer) -> canonical``
# (unpadded, unswizzled, logical order) and ``(canonical, swizzled) -> native`` (zero-padded,
# re-swizzled where the target is).

def _transposed(t, buf):
    """TE keeps this copy transposed: back to logical order."""
    return as_u8(buf).t().contiguous()


def _transpose_back(value, swizzled):
    return as_u8(value).t()


def _flat(value, swizzled):
    return value.reshape(-1)


def _row_scale(block: int):
    """Compact ``(M.., N/block)`` scale from TE's padded (or 128x4-swizzled) ``(M, N/block)`` buffer."""
    def compact(t, buf):
        shape = tuple(t.shape)
        m, nb = rows(shape), ceil_div(shape[-1], block)
        s = as_u8(buf)
        s = unswizzle_128x4(s, m, nb) if t._with_gemm_swizzled_scales else s[:m, :nb]
        return s.contiguous().reshape(*shape[:-1], nb)
    return compact


def _row_scale_native(value, swizzled):
    """TE's padded ``(128k, 4k)`` (or swizzled) buffer of a compact rows-by-blocks scale."""
    c = as_u8(value.contiguous())
    c = c.reshape(-1, c.shape[-1])
    if swizzled:
        return swizzle_128x4(c)
    return pad2(c, round_up(c.shape[0], 128), round_up(c.shape[1], 4))


def _mx_col_scale(t, buf):
    """MXFP8 columnwise ``(M/32, N)``; swizzled scales tile the transposed ``(N, M/32)`` matrix."""
    m, n = rows(tuple(t.shape)), t.shape[-1]
    mb = ceil_div(m, 32)
    s = as_u8(buf)
    s = unswizzle_128x4(s, n, mb).t() if t._with_gemm_swizzled_scales else s[:mb, :n]
    return s.contiguous()


def _mx_col_scale_native(value, swizzled):
    c = as_u8(value.contiguous())
    c = c.reshape(-1, c.shape[-1])
    n_rows, n_cols = round_up(c.shape[0], 4), round_up(c.shape[1], 128)
    if swizzled:
        return swizzle_128x4(c.t()).reshape(n_rows, n_cols)
    return pad2(c, n_rows, n_cols)


def _nvfp4_col_scale(t, buf):
    """NVFP4 columnwise ``(M/16, N)``: TE keeps it transposed, ``(N, M/16)``, padded or swizzled."""
    m, n = rows(tuple(t.shape)), t.shape[-1]
    mb = ceil_div(m, 16)
    s = as_u8(buf)
    s = unswizzle_128x4(s, n, mb) if t._with_gemm_swizzled_scales else s[:n, :mb]
    return s.t().contiguous()


def _nvfp4_col_scale_native(value, swizzled):
    return _row_scale_native(as_u8(value.contiguous()).t(), swizzled)


def _nvfp4_amax(t, buf):
    return buf.reshape(*t.shape[:-1], 1) if t._row_scaled_nvfp4 else buf


def _nvfp4_amax_layout(shape, attrs):
    """Row-scaled NVFP4: one amax per row; else replicated."""
    return Blocked((1,) * (len(shape) - 1) + (shape[-1],)) if attrs["row_scaled"] else None


def _block_row_scale(t, buf):
    """Blockwise 1x128 rowwise ``(M, N/128)``; TE keeps it as ``(N/128, roundup(M, 4))``."""
    m, n = t.shape
    return buf[:ceil_div(n, 128), :m].t().contiguous()


def _block_row_scale_native(value, swizzled):
    """TE's ``(N/128, roundup(M, 4))`` of a compact ``(M, N/128)`` (or 128x128 ``(M/128, N/128)``) scale."""
    m, tn = value.shape
    return pad2(value.t(), tn, round_up(m, 4))


def _block_col_scale(t, buf):
    """Blockwise 1x128 columnwise ``(M/128, N)``; TE pads the columns to 4."""
    m, n = t.shape
    return buf[:ceil_div(m, 128), :n].contiguous()


def _block_pad_cols(value, swizzled):
    r, c = value.shape
    return pad2(value, r, round_up(c, 4))


def _block2d_data(t, buf):
    """128x128: the rowwise data, or (columnwise only) the transpose of the columnwise copy."""
    return buf if buf is not None else t._columnwise_data.t().contiguous()


def _block2d_scale(t, buf):
    """128x128 ``(M/128, N/128)`` tiles, from the rowwise scale or the transposed columnwise one."""
    tm, tn = (ceil_div(s, 128) for s in t.shape)
    if t._rowwise_data is not None:
        return buf[:tm, :tn].contiguous()
    return t._columnwise_scale_inv[:tn, :tm].t().contiguous()


# ----------------------------------------------------------------------------- Float8Tensor

def _float8_data(t, data):
    """``_data``, or (Hopper, columnwise only) the transpose moved back to logical order."""
    if data is not None:
        return data
    if t._transpose is not None and not t._transpose_invalid:
        return t._transpose.movedim(0, -1).contiguous()
    raise UnsupportedTensorError("Float8Tensor holds neither data nor a valid transpose")


class TEFloat8TensorAdapter(TEAdapter):
    """TE ``Float8Tensor`` (delayed and current scaling): fp8 data and one ``scale_inv``."""

    cls_name = "Float8Tensor"
    format_name = "Float8 (per-tensor scaling)"
    COMPONENTS = (
        # the transpose (Hopper) is recomputed from data on load, so data is in place only without one
        Component("data", "_data", None, _fp8, blocks(), to_canonical=_float8_data,
                  derived=(("_transpose", lambda v, swizzled: as_u8(v).movedim(-1, 0)),),
                  in_place=lambda t: t._data is not None and t._transpose is None),
        Component("scale_inv", "_scale_inv", None, torch.float32),
    )

    def _copy_component(self, target, comp, value, swizzled):
        super()._copy_component(target, comp, value, swizzled)
        if comp.derived and target._transpose is not None:
            target._transpose_invalid = False

    def _dequantize(self, attrs, shape, dtype, comps):
        # fp8 * scale_inv in float32, then dtype (TE's CPU path, bit for bit)
        return (bits_as(comps["data"], _FP8_TORCH[attrs["fp8_dtype"]]).float() * comps["scale_inv"].float()).to(dtype)

    def _te_kwargs(self, attrs, comps):
        return {"data": as_u8(comps["data"]).contiguous(), "fp8_scale_inv": comps["scale_inv"]}


# ----------------------------------------------------------------------------- MXFP8Tensor

class TEMXFP8TensorAdapter(TEAdapter):
    """TE ``MXFP8Tensor``: fp8 data, E8M0 scale per 32 along rows (rowwise) or columns (columnwise)."""

    cls_name = "MXFP8Tensor"
    format_name = "MXFP8"
    _E8M0, _COL = torch.float8_e8m0fnu, "columnwise MXFP8 data"
    COMPONENTS = (
        Component("rowwise_data", "_rowwise_data", "rowwise", _fp8, blocks()),
        Component("rowwise_scale_inv", "_rowwise_scale_inv", "rowwise", _E8M0, blocks(32),
                  to_canonical=_row_scale(32), to_native=_row_scale_native),
        Component("columnwise_data", "_columnwise_data", "columnwise", _fp8, blocks(), needs_2d=_COL),
        Component("columnwise_scale_inv", "_columnwise_scale_inv", "columnwise", _E8M0, blocked(32, 1),
                  to_canonical=_mx_col_scale, to_native=_mx_col_scale_native, needs_2d=_COL),
    )
    # Raw interchange: the rowwise direction is OCP MXFP8 (E8M0 per 32 along rows).
    RAW_FORM = (("data", "rowwise_data"), ("scale", "rowwise_scale_inv"))

    def raw_form(self, attrs):
        return MXFP8_FORMS.get(_FP8_TORCH.get(attrs.get("fp8_dtype")))

    def _dequantize(self, attrs, shape, dtype, comps):
        # fp8 * 2^(e-127), one E8M0 item per 1x32 (rowwise) or 32x1 (columnwise) block
        usage, block = ("rowwise", (1, 32)) if "rowwise_data" in comps else ("columnwise", (32, 1))
        x = bits_as(comps[f"{usage}_data"], _FP8_TORCH[attrs["fp8_dtype"]]).float()
        s = bits_as(comps[f"{usage}_scale_inv"], torch.float8_e8m0fnu).float()
        return (x * repeat_blocks(s, *block, x.shape)).to(dtype)

    def _te_kwargs(self, attrs, comps):
        return {"with_gemm_swizzled_scales": False, **self._native_kwargs(attrs, comps)}


# ----------------------------------------------------------------------------- blockwise FP8

class TEFloat8BlockwiseQTensorAdapter(TEAdapter):
    """TE ``Float8BlockwiseQTensor``: fp8 data, f32 scale per 128x128 tile or per 1x128 vector."""

    cls_name = "Float8BlockwiseQTensor"
    format_name = "blockwise FP8"
    #: 1x128: each present direction is its own quantization (data in logical order)
    COMPONENTS = (
        Component("rowwise_data", "_rowwise_data", "rowwise", _fp8, blocks()),
        Component("rowwise_scale_inv", "_rowwise_scale_inv", "rowwise", torch.float32, blocks(1, 128),
                  to_canonical=_block_row_scale, to_native=_block_row_scale_native),
        Component("columnwise_data", "_columnwise_data", "columnwise", _fp8, blocks(),
                  to_canonical=_transposed, to_native=_transpose_back),
        Component("columnwise_scale_inv", "_columnwise_scale_inv", "columnwise", torch.float32,
                  blocks(128, 1), to_canonical=_block_col_scale, to_native=_block_pad_cols),
    )
    #: 128x128: one quantization, stored rowwise; the columnwise copy is its transpose (rebuilt on load)
    COMPONENTS_2D = (
        Component("rowwise_data", "_rowwise_data", None, _fp8, blocks(), to_canonical=_block2d_data,
                  derived=(("_columnwise_data", _transpose_back),),
                  in_place=lambda t: t._rowwise_data is not None and t._columnwise_data is None),
        Component("rowwise_scale_inv", "_rowwise_scale_inv", None, torch.float32, blocks(128, 128),
                  to_canonical=_block2d_scale, to_native=_block_pad_cols,
                  derived=(("_columnwise_scale_inv", _block_row_scale_native),)),
    )

    def attributes(self, t):
        return {**super().attributes(t), "block_scaling_dim": 2 if t._is_2D_scaled else 1}

    def declared(self, attrs):
        return self.COMPONENTS_2D if attrs["block_scaling_dim"] == 2 else self.COMPONENTS

    def present_components(self, t, attrs=None, *, check_2d=True):
        _check_2d(t.shape, self.cls_name, "blockwise FP8")  # every component, either usage
        return super().present_components(t, attrs, check_2d=check_2d)

    def _dequantize(self, attrs, shape, dtype, comps):
        usage = "rowwise" if "rowwise_data" in comps else "columnwise"  # 128x128: rowwise only
        q = comps[f"{usage}_data"]
        block = (128, 128) if attrs["block_scaling_dim"] == 2 else (1, 128) if usage == "rowwise" else (128, 1)
        s = repeat_blocks(comps[f"{usage}_scale_inv"], *block, q.shape)
        return (bits_as(q, _FP8_TORCH[attrs["fp8_dtype"]]).to(torch.float32) * s).to(dtype)

    def _te_kwargs(self, attrs, comps):
        return {"is_2D_scaled": attrs["block_scaling_dim"] == 2, **self._native_kwargs(attrs, comps)}


# ----------------------------------------------------------------------------- NVFP4Tensor

class TENVFP4TensorAdapter(TEAdapter):
    """TE ``NVFP4Tensor``: E2M1 data (two per byte), E4M3 scale per 16, fp32 amax."""

    cls_name = "NVFP4Tensor"
    format_name = "NVFP4"
    _E4M3, _COL = torch.float8_e4m3fn, "columnwise NVFP4 data"
    COMPONENTS = (
        Component("rowwise_data", "_rowwise_data", "rowwise", torch.uint8, blocks(2)),
        Component("rowwise_scale_inv", "_rowwise_scale_inv", "rowwise", _E4M3, blocks(16),
                  to_canonical=_row_scale(16), to_native=_row_scale_native),
        Component("amax_rowwise", "_amax_rowwise", "rowwise", torch.float32, _nvfp4_amax_layout,
                  to_canonical=_nvfp4_amax, to_native=_flat, in_place=lambda t: not t._row_scaled_nvfp4),
        Component("columnwise_data", "_columnwise_data", "columnwise", torch.uint8, blocked(2, 1),
                  to_canonical=_transposed, to_native=_transpose_back, needs_2d=_COL),
        Component("columnwise_scale_inv", "_columnwise_scale_inv", "columnwise", _E4M3, blocked(16, 1),
                  to_canonical=_nvfp4_col_scale, to_native=_nvfp4_col_scale_native, needs_2d=_COL),
        Component("amax_columnwise", "_amax_columnwise", "columnwise", torch.float32, to_native=_flat,
                  needs_2d=_COL),
    )
    # Raw interchange: the rowwise direction with one global amax is NVFP4's row-16 form.
    RAW_FORM = (("data", "rowwise_data"), ("scale", "rowwise_scale_inv"), ("amax", "amax_rowwise"))

    def attributes(self, t):
        rht = bool(t._columnwise_data is not None and getattr(t._quantizer, "with_rht", False))
        return {"row_scaled": bool(t._row_scaled_nvfp4), "use_4over6": bool(t._nvfp4_use_4over6),
                "e4m3_max": int(t._nvfp4_e4m3_max), "columnwise_rht": rht}

    def raw_form(self, attrs):
        return None if attrs.get("row_scaled") or attrs.get("use_4over6") else NVFP4_ROW16

    def _dequantize(self, attrs, shape, dtype, comps):
        if attrs.get("use_4over6"):
            raise UnsupportedTensorError(
                "NVFP4 with 4over6 block selection: qdcp has no verified plain-torch dequantize for it; "
                "load it into an NVFP4Tensor of the same config, or dequantize with TE on a GPU")
        finv = torch.tensor(1.0 / (6.0 * float(attrs.get("e4m3_max", 448))), dtype=torch.float32)
        row = "rowwise_data" in comps
        if not row and attrs.get("columnwise_rht"):
            raise UnsupportedTensorError(
                "NVFP4 columnwise-only tensor with random Hadamard transform: its values cannot be "
                "recovered without the inverse transform; save or load the rowwise copy")
        usage = "rowwise" if row else "columnwise"
        packed = as_u8(comps[f"{usage}_data"])  # columnwise: (M/2, N), two logical rows per byte
        codes = (unpack_fp4(packed) if row else unpack_fp4(packed.t()).t())[tuple(map(slice, shape))]
        amax = comps[f"amax_{usage}"].float()
        amax = amax.reshape(*shape[:-1], 1) if row and attrs.get("row_scaled") else amax.reshape(-1)[0]
        scale = bits_as(comps[f"{usage}_scale_inv"], torch.float8_e4m3fn).float()
        final = (scale * amax) * finv  # TE's kernel: float(scale) * amax * (1 / (6 * e4m3_max))
        final = repeat_blocks(final, *((1, 16) if row else (16, 1)), shape)
        return (e2m1_to_float(codes) * final).to(dtype)

    def _te_kwargs(self, attrs, comps):
        return {"fp4_dtype": _te_dtype(_FP4_CODE), "with_gemm_swizzled_scales": False,
                "row_scaled_nvfp4": bool(attrs.get("row_scaled")), "nvfp4_use_4over6": bool(attrs.get("use_4over6")),
                "nvfp4_e4m3_max": int(attrs.get("e4m3_max", 448)), **self._native_kwargs(attrs, comps)}


def builtin_adapters() -> list[Adapter]:
    """The TransformerEngine adapters qdcp registers at its registry's first use (TE itself is not imported)."""
    return [TEFloat8TensorAdapter(), TEMXFP8TensorAdapter(), TEFloat8BlockwiseQTensorAdapter(),
            TENVFP4TensorAdapter()]
