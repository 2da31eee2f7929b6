"""torchao's block-scaled tensors (``MXTensor``, ``NVFP4Tensor``): packed elements, one scale per
``block_size`` along the last dim, scales plain or 128x4-tiled."""

from __future__ import annotations

import dataclasses
import math

import torch

from qdcp.adapters.base import RawInterchangeAdapter
from qdcp.adapters.formats import (
    MXFP8_FORMS,
    NVFP4_GLOBAL_DIVISOR,
    NVFP4_ROW16,
    as_u8,
    ceil_div,
    nvfp4_decode_scale,
    swizzle_128x4,
    unswizzle_128x4,
)
from qdcp.adapters.torchao.base import CLASS_PATHS, TorchAOAdapter, import_class
from qdcp.errors import UnsupportedTensorError
from qdcp.layouts import Blocked, Layout, Replicated


def unswizzle_scale(scale: torch.Tensor, n_rows: int, n_cols: int) -> torch.Tensor:
    """Plain ``(..., n_rows, n_cols)`` scales from 128x4-tiled ones (padding dropped)."""
    if scale.ndim == 2:
        return unswizzle_128x4(scale, n_rows, n_cols)
    return torch.stack([unswizzle_128x4(s, n_rows, n_cols) for s in scale])


def swizzle_scale(scale: torch.Tensor) -> torch.Tensor:
    """128x4-tiled scales (zero padded) from plain ``(..., rows, cols)`` ones, in torchao's view shape."""
    shape = (ceil_div(scale.shape[-2], 128) * 32, ceil_div(scale.shape[-1], 4) * 16)  # 32x16 per 128x4 tile
    if scale.ndim == 2:
        return swizzle_128x4(scale).view(shape)
    return torch.stack([swizzle_128x4(s).view(shape) for s in scale])


class _BlockScaledAdapter(TorchAOAdapter, RawInterchangeAdapter):
    """MX and NVFP4: packed element data, one scale per ``block_size`` along the last dim.

    Canonical scales are plain (unswizzled, unpadded) of shape ``(..., K / block_size)``; a tensor
    with ``is_swizzled_scales`` gets its tiled layout back on load.
    """

    block_attributes = ("block_size",)

    def _packing(self, t) -> int:
        """Elements per ``qdata`` item along the last dim (fp4: two a byte)."""
        return 2

    def components(self, t):
        comps = super().components(t)
        if t.is_swizzled_scales:
            comps["scale"] = unswizzle_scale(t.scale, t.shape[-2], t.shape[-1] // t.block_size)
        return comps

    def native_components(self, t):
        comps = super().components(t)
        if t.is_swizzled_scales:
            del comps["scale"]
        return comps

    def copy_into(self, target, components):
        components = dict(components)
        if target.is_swizzled_scales and "scale" in components:
            target.scale.copy_(swizzle_scale(components.pop("scale")).view(target.scale.shape))
        super().copy_into(target, components)

    def layouts(self, t):
        ones = (1,) * (t.ndim - 1)
        out: dict[str, Layout] = {"qdata": Blocked(ones + (self._packing(t),)),
                                  "scale": Blocked(ones + (t.block_size,))}
        for name in self.component_names(t):
            if name not in out:
                out[name] = _per_tensor_layout(getattr(t, name), t.shape)
        return out

    def rebuild(self, stored):
        if stored.attrs.get("is_swizzled_scales"):
            stored = dataclasses.replace(stored, components={**stored.components,
                                                             "scale": swizzle_scale(stored.components["scale"])})
        return super().rebuild(stored)


def _per_tensor_layout(value: torch.Tensor, shape) -> Layout:
    """A scale of one value per tensor (0-d or all ones: replicated) or per leading index."""
    if value.ndim == len(shape) and value.numel() > 1:
        block = tuple(n // v if v > 1 else n for n, v in zip(shape, value.shape))
        return Blocked(block)
    return Replicated(tuple(value.shape))


class MXTensorAdapter(_BlockScaledAdapter):
    """``torchao.prototype.mx_formats.MXTensor``: fp8 or fp4 (packed) elements, e8m0 scale per 32."""

    cls_name = "MXTensor"

    def _packing(self, t):
        return 2 if t.elem_dtype == torch.float4_e2m1fn_x2 else 1

    def quantize_like(self, target, hp, global_amax=None):
        return type(target).to_mx(
            hp.to(target.orig_dtype).contiguous(), target.elem_dtype, target.block_size,
            kernel_preference=target.kernel_preference, act_quant_kwargs=target.act_quant_kwargs,
            is_swizzled_scales=target.is_swizzled_scales)

    # Raw interchange: fp8 elements with block 32 are OCP MXFP8.
    def raw_forms_out(self, type_name, attrs):
        form = MXFP8_FORMS.get(attrs.get("elem_dtype")) if attrs.get("block_size") == 32 else None
        return {form: ["qdata", "scale"]} if form else {}

    def to_raw_form(self, type_name, attrs, form, components):
        return {"data": as_u8(components["qdata"]), "scale": as_u8(components["scale"])}

    def raw_forms_in(self, target):
        form = MXFP8_FORMS.get(target.elem_dtype) if target.block_size == 32 else None
        return (form,) if form else ()

    def from_raw_form(self, target, form, tensors):
        self.copy_into(target, {"qdata": tensors["data"].view(target.elem_dtype),
                                "scale": tensors["scale"].view(torch.float8_e8m0fnu)})

    def new_from_raw_form(self, form, tensors, *, shape, dtype):
        elem = next((d for d, f in MXFP8_FORMS.items() if f == form), None)
        if elem is None:
            return None
        kernel_preference = import_class("torchao.quantization.quantize_.common", "KernelPreference")
        return self.tensor_class()(tensors["data"].view(elem), tensors["scale"].view(torch.float8_e8m0fnu),
                                   elem, 32, dtype, kernel_preference.EMULATED, None, False)


class NVFP4TensorAdapter(_BlockScaledAdapter):
    """``torchao.prototype.mx_formats.NVFP4Tensor``: fp4 elements, e4m3 scale per 16, optional
    per-tensor scale (quantize-on-load uses the whole tensor's amax for it)."""

    cls_name = "NVFP4Tensor"

    def needs_global_amax(self, target):
        return target.per_tensor_scale is not None

    def quantize_like(self, target, hp, global_amax=None):
        per_tensor_scale = None
        if target.per_tensor_scale is not None:
            amax = global_amax if global_amax is not None else hp.abs().amax()
            to_scale = import_class(CLASS_PATHS["NVFP4Tensor"], "per_tensor_amax_to_scale")
            per_tensor_scale = to_scale(amax.to(hp.device))
        return type(target).to_nvfp4(
            hp.to(target.orig_dtype).contiguous(), block_size=target.block_size,
            per_tensor_scale=per_tensor_scale, act_per_tensor_scale=target.act_per_tensor_scale,
            is_swizzled_scales=target.is_swizzled_scales, use_triton_kernel=target.use_triton_kernel,
            act_quant_kwargs=target.act_quant_kwargs)

    # Raw interchange: block 16 with a per-tensor scale is the NVFP4 row-16 form; torchao's
    # per_tensor_scale is amax / (6 * 448) in fp32, so the form's amax is the fp32 value that
    # division maps to it exactly.
    def raw_forms_out(self, type_name, attrs):
        return {NVFP4_ROW16: ["qdata", "scale", "per_tensor_scale"]} if attrs.get("block_size") == 16 else {}

    def to_raw_form(self, type_name, attrs, form, components):
        pts = components.get("per_tensor_scale")
        if pts is None:  # no second-level scale: the form's decode scale 1 (amax 6 * 448) is exact
            pts = torch.ones((), dtype=torch.float32, device=components["qdata"].device)
        if pts.numel() != 1:
            raise UnsupportedTensorError(f"NVFP4Tensor per_tensor_scale of {pts.numel()} values has no NVFP4 global")
        return {"data": as_u8(components["qdata"]), "scale": as_u8(components["scale"]),
                "amax": amax_for_torchao_scale(pts.float().reshape(()))}

    def raw_forms_in(self, target):
        ok = target.block_size == 16 and (target.per_tensor_scale is None or target.per_tensor_scale.numel() == 1)
        return (NVFP4_ROW16,) if ok else ()

    def from_raw_form(self, target, form, tensors):
        """A target without a per-tensor scale takes the bits as they are where the form's decode
        scale is 1 (what such a tensor exports as); another decode scale it cannot hold, so the
        values are requantized like it, as a load without a raw path would."""
        pts = nvfp4_decode_scale(tensors["amax"])
        scale = tensors["scale"].view(torch.float8_e4m3fn)
        if target.per_tensor_scale is not None:
            self.copy_into(target, {"qdata": tensors["data"], "scale": scale,
                                    "per_tensor_scale": pts.reshape(target.per_tensor_scale.shape)})
        elif bool((pts == 1).all()):
            self.copy_into(target, {"qdata": tensors["data"], "scale": scale})
        else:
            held = self.new_from_raw_form(form, tensors, shape=tuple(target.shape), dtype=target.orig_dtype)
            self.copy_into(target, self.components(self.quantize_like(target, held.dequantize(target.orig_dtype))))

    def new_from_raw_form(self, form, tensors, *, shape, dtype):
        if form != NVFP4_ROW16:
            return None
        pts = nvfp4_decode_scale(tensors["amax"])
        return self.tensor_class()(tensors["data"], tensors["scale"].view(torch.float8_e4m3fn), 16, dtype,
                                   per_tensor_scale=pts)


def amax_for_torchao_scale(pts: torch.Tensor) -> torch.Tensor:
    """An fp32 amax whose torchao per-tensor scale ``amax / (6 * 448)`` is exactly ``pts``."""
    div = torch.tensor(NVFP4_GLOBAL_DIVISOR, dtype=torch.float32)
    amax = (pts.float() * div).reshape(())
    if amax.is_meta:  # planning: the shape is all there is
        return amax
    for _ in range(64):
        got = amax / div
        if got == pts:
            return amax
        amax = torch.nextafter(amax, torch.tensor(math.inf) if got < pts else torch.tensor(-math.inf))
    raise UnsupportedTensorError(f"no fp32 amax maps to torchao per_tensor_scale {float(pts)!r}")
