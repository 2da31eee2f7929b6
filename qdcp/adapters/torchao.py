"""Adapters for torchao's quantized tensors and low-bit optimizer states.

torchao is optional: nothing here imports it until a torchao tensor is seen (then torchao is already
imported) or a checkpoint entry of a torchao type must be rebuilt. Classes are recognised by module
prefix and class name, and loaded from the fixed import paths in :data:`_CLASS_PATHS` only.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import sys
from typing import Any, Mapping

import torch

from qdcp.adapters.base import Adapter, StoredEntry
from qdcp.adapters.formats import (
    MXFP8_FORMS,
    NVFP4_GLOBAL_DIVISOR,
    NVFP4_ROW16,
    affine_form,
    as_u8,
    ceil_div,
    mxfp8_form,
    nvfp4_decode_scale,
    parse_affine_form,
    repeat_blocks,
    swizzle_128x4,
    unswizzle_128x4,
)
from qdcp.errors import LoadMismatchError, UnsupportedTensorError
from qdcp.layouts import Blocked, Flat, Layout, Replicated, blocks_as_groups, groups_as_blocks

_CLASS_PATHS: dict[str, str] = {
    "Int8Tensor": "torchao.quantization",
    "Float8Tensor": "torchao.quantization",
    "IntxUnpackedToInt8Tensor": "torchao.quantization",
    "NF4Tensor": "torchao.quantization",
    "MXTensor": "torchao.prototype.mx_formats.mx_tensor",
    "NVFP4Tensor": "torchao.prototype.mx_formats.nvfp4_tensor",
    "OptimState8bit": "torchao.optim.subclass_8bit",
    "OptimState4bit": "torchao.optim.subclass_4bit",
    "OptimStateFp8": "torchao.optim.subclass_fp8",
    "Int8QuantizedTrainingLinearWeight": "torchao.prototype.quantized_training.int8",
    "BitNetPacked2bitLinearWeight": "torchao.prototype.quantized_training.bitnet",
}

# Enums and records that may appear in torchao attributes: class name -> (module, attribute).
_ATTRIBUTE_CLASSES: dict[str, str] = {
    "KernelPreference": "torchao.quantization.quantize_.common.kernel_preference",
    "MappingType": "torchao.quantization.quant_primitives",
    "Float8MMConfig": "torchao.float8.inference",
    "QuantizeTensorToInt8Kwargs": "torchao.quantization.quantize_.workflows.int8.int8_tensor",
    "QuantizeTensorToFloat8Kwargs": "torchao.quantization.quantize_.workflows.float8.float8_tensor",
    "IntxUnpackedToInt8TensorActivationQuantization":
        "torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor",
    "PerTensor": "torchao.quantization.granularity",
    "PerRow": "torchao.quantization.granularity",
    "PerAxis": "torchao.quantization.granularity",
    "PerGroup": "torchao.quantization.granularity",
    "PerToken": "torchao.quantization.granularity",
    "PerBlock": "torchao.quantization.granularity",
    "ScaleCalculationMode": "torchao.prototype.mx_formats.config",
    "QuantizeTensorToMXKwargs": "torchao.prototype.mx_formats.mx_tensor",
    "QuantizeTensorToNVFP4Kwargs": "torchao.prototype.mx_formats.nvfp4_tensor",
}


def _import(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UnsupportedTensorError(
            f"torchao type {name} is needed but cannot be imported from {module} ({e}); "
            f"install torchao 0.18 (pip install 'qdcp[torchao]')") from None


class TorchAOAdapter(Adapter):
    """Shared machinery for one torchao class that declares its data as ``TorchAOBaseTensor`` does.

    Subclasses set :attr:`cls_name` and implement :meth:`layouts` and :meth:`quantize_like`.
    """

    cls_name: str = ""

    def __init__(self) -> None:
        self.type_names = (f"torchao.{self.cls_name}",)
        self._attribute_classes: dict[str, type] | None = None

    # --- identity
    def matches(self, cls: type) -> bool:
        return cls.__name__ == self.cls_name and cls.__module__.split(".")[0] == "torchao"

    def type_name(self, t):
        return self.type_names[0]

    def tensor_class(self) -> type:
        return _import(_CLASS_PATHS[self.cls_name], self.cls_name)

    def loaded_classes(self):
        module = sys.modules.get(_CLASS_PATHS[self.cls_name])
        cls = getattr(module, self.cls_name, None) if module is not None else None
        return [cls] if isinstance(cls, type) and self.matches(cls) else []

    def add_op(self, cls, op, impl):
        """Through ``TorchAOBaseTensor.implements``: torchao's per-class table of aten ops."""
        table = getattr(cls, "_ATEN_OP_TABLE", {}).get(cls)
        if table is None or op in table or not hasattr(cls, "implements"):
            return None
        cls.implements(op)(lambda func, types, args, kwargs: impl(func, args, kwargs))
        handler = table[op]

        def remove() -> None:
            if table.get(op) is handler:
                del table[op]
        return remove

    def attribute_classes(self) -> Mapping[str, type]:
        if self._attribute_classes is None:
            found = {}
            for name, module in _ATTRIBUTE_CLASSES.items():
                try:
                    found[name] = getattr(importlib.import_module(module), name)
                except (ImportError, AttributeError):
                    pass
            self._attribute_classes = found
        return self._attribute_classes

    # --- declarations (TorchAOBaseTensor style)
    def _data_names(self, cls: type) -> tuple[list[str], list[str]]:
        return list(cls.tensor_data_names), list(getattr(cls, "optional_tensor_data_names", []) or [])

    def _attr_names(self, cls: type) -> list[str]:
        return list(cls.tensor_attribute_names) + list(
            getattr(cls, "optional_tensor_attribute_names", []) or [])

    def component_names(self, t):
        required, optional = self._data_names(type(t))
        return required + [n for n in optional if getattr(t, n, None) is not None]

    def attributes(self, t):
        return {n: getattr(t, n) for n in self._attr_names(type(t))}

    def dequantize(self, t, dtype=None):
        """torchao's ``dequantize``, computed in ``dtype`` where the class takes an ``output_dtype``
        that wide (else in the widest it takes, float32), then cast to ``dtype``."""
        if dtype is None or dtype == t.dtype or not _takes_output_dtype(type(t)):
            out = t.dequantize()
            return out if dtype is None else out.to(dtype)
        for work in dict.fromkeys((dtype, torch.float32)):
            if (type(t), work) in _REFUSED_OUTPUT or work.itemsize <= t.dtype.itemsize:
                continue
            try:
                return t.dequantize(output_dtype=work).to(dtype)
            except (AssertionError, ValueError, RuntimeError, NotImplementedError):
                _REFUSED_OUTPUT.add((type(t), work))  # e.g. dequantize_affine refuses float64
        return t.dequantize().to(dtype)

    def rebuild(self, stored):
        cls = self.tensor_class()
        out = cls.__tensor_unflatten__(dict(stored.components), dict(stored.attrs), torch.Size(stored.shape), None)
        check_shape(out, stored.shape, self.cls_name)
        return out

    def from_inner_buffers(self, t, buffers):
        attrs = self.attributes(t)
        return type(t).__tensor_unflatten__(dict(buffers), attrs, t.shape, t.stride())

    def copy_into(self, target, components):
        native = self.native_components(target)
        missing = set(components) - set(native)
        if missing:
            raise LoadMismatchError(
                f"the target {self.cls_name} has no component(s) {sorted(missing)} to load into")
        for name, value in components.items():
            native[name].copy_(value)


_OUTPUT_DTYPE: dict[type, bool] = {}
_REFUSED_OUTPUT: set[tuple[type, torch.dtype]] = set()


def _takes_output_dtype(cls: type) -> bool:
    """Whether ``cls.dequantize`` takes an ``output_dtype`` argument (torchao's newer classes do)."""
    known = _OUTPUT_DTYPE.get(cls)
    if known is None:
        try:
            known = "output_dtype" in inspect.signature(cls.dequantize).parameters
        except (TypeError, ValueError):
            known = False
        _OUTPUT_DTYPE[cls] = known
    return known


def check_shape(out: torch.Tensor, shape, cls_name: str) -> None:
    """Refuse a rebuilt tensor whose shape is not the stored logical shape."""
    if tuple(out.shape) != tuple(shape):
        raise LoadMismatchError(f"rebuilt {cls_name} has shape {tuple(out.shape)}, expected {tuple(shape)}")


# ----------------------------------------------------------------------------- affine int/float8

def _block_layout(block_size, shape) -> Blocked:
    block = tuple(int(b) for b in block_size)
    if len(block) != len(shape):
        raise UnsupportedTensorError(f"block_size {block} does not match shape {tuple(shape)}")
    return Blocked(block)


def granularity_from_block(block_size, shape):
    """The torchao granularity (PerTensor, PerRow, PerGroup) of a 2-D+ ``block_size`` over ``shape``."""
    g = importlib.import_module("torchao.quantization.granularity")
    block = [int(b) for b in block_size]
    if block == [int(s) for s in shape]:
        return g.PerTensor()
    if all(b == 1 for b in block[:-1]):
        return g.PerRow() if block[-1] == shape[-1] else g.PerGroup(block[-1])
    raise UnsupportedTensorError(f"cannot express block_size {block} as a torchao granularity")


def _symmetric(zero_point: torch.Tensor | None) -> bool:
    return zero_point is None or not bool(torch.count_nonzero(zero_point))


class _AffineAdapter(TorchAOAdapter):
    """qdata elementwise; scale (and zero_point) one per ``block_size`` block.

    Raw interchange: 2-D tensors state their bits in the affine form of their element kind and
    block (``qdcp.adapters.formats.affine_form``), and take them from it where the values fit the
    target's buffers exactly (see :meth:`from_raw_form`)."""

    _zero_point = True  # the class always carries a zero_point
    block_attributes = ("block_size",)

    def _kind(self, attrs: Mapping[str, Any]) -> str | None:
        raise NotImplementedError

    def _form(self, attrs: Mapping[str, Any]) -> str | None:
        block = attrs.get("block_size")
        kind = self._kind(attrs)
        ok = isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) for b in block)
        return affine_form(kind, block) if kind and ok else None

    def raw_forms_out(self, type_name, attrs):
        form = self._form(attrs)
        return {form: ["qdata", "scale"] + (["zero_point"] if self._zero_point else [])} if form else {}

    def to_raw_form(self, type_name, attrs, form, components):
        out = {"data": components["qdata"], "scale": components["scale"]}
        if components.get("zero_point") is not None:
            out["zero_point"] = components["zero_point"]
        return out

    def raw_forms_in(self, target):
        form = self._form(self.attributes(target)) if target.ndim == 2 else None
        return (form,) if form else ()

    def from_raw_form(self, target, form, tensors):
        """The form's bits as they are where the target holds them exactly and keeps its
        configuration: the same element dtype, the scale unchanged by the target's scale dtype,
        symmetric data for a symmetric target (zero points all zero, or none). Otherwise the form's
        values ``(data - zero_point) * scale`` are quantized like the target, as a load without a
        raw path would."""
        native = self.native_components(target)
        data, scale, given = tensors["data"], tensors["scale"], tensors.get("zero_point")
        held = scale.to(native["scale"].dtype)
        exact = data.dtype == native["qdata"].dtype and tuple(scale.shape) == tuple(native["scale"].shape) \
            and torch.equal(held.to(scale.dtype), scale)
        rest = {}
        if "zero_point" in native:
            zero = torch.zeros_like(native["zero_point"]) if given is None else given
            exact = exact and (_symmetric(given) or not _symmetric(native["zero_point"])) \
                and tuple(zero.shape) == tuple(native["zero_point"].shape) \
                and torch.equal(zero.to(native["zero_point"].dtype).to(zero.dtype), zero)
            rest["zero_point"] = zero
        else:
            exact = exact and _symmetric(given)
        if exact:
            self.copy_into(target, {"qdata": data, "scale": held, **rest})
            return
        _, block = parse_affine_form(form)
        values = data.float() if given is None else data.float() - repeat_blocks(given.float(), *block, data.shape)
        values = values * repeat_blocks(scale.float(), *block, data.shape)
        self.copy_into(target, self.components(self.quantize_like(target, values.to(target.dtype))))

    def layouts(self, t):
        scale_layout = _block_layout(t.block_size, t.shape)
        out: dict[str, Layout] = {}
        for name in self.component_names(t):
            value = getattr(t, name)
            if name == "qdata":
                out[name] = Blocked((1,) * t.ndim)
            elif value.ndim == t.ndim and tuple(value.shape) == scale_layout.component_shape(t.shape):
                out[name] = scale_layout
            else:  # activation scales and pre-scales: whole-tensor values
                out[name] = Replicated(tuple(value.shape))
        return out


class Int8TensorAdapter(_AffineAdapter):
    """``torchao.quantization.Int8Tensor`` (Int8WeightOnlyConfig / Int8DynamicActivationInt8WeightConfig v2)."""

    cls_name = "Int8Tensor"

    def _kind(self, attrs):
        return "int8"

    def quantize_like(self, target, hp, global_amax=None):
        mt = importlib.import_module("torchao.quantization.quant_primitives").MappingType
        mapping = mt.SYMMETRIC if _symmetric(target.zero_point) else mt.ASYMMETRIC
        gran = granularity_from_block(target.block_size, target.shape)
        return type(target).from_hp(
            hp.to(target.dtype), gran, mapping_type=mapping, act_quant_kwargs=target.act_quant_kwargs,
            act_quant_scale=target.act_quant_scale, act_quant_zero_point=target.act_quant_zero_point,
            act_pre_scale=target.act_pre_scale, reduce_range=target.reduce_range)


class Float8TensorAdapter(_AffineAdapter):
    """``torchao.quantization.Float8Tensor`` (weight-only on CPU; any granularity)."""

    cls_name = "Float8Tensor"
    _zero_point = False

    def _kind(self, attrs):
        return "float8"

    def quantize_like(self, target, hp, global_amax=None):
        return type(target).from_hp(
            hp.to(target.dtype), float8_dtype=target.qdata.dtype,
            granularity=granularity_from_block(target.block_size, target.shape),
            mm_config=target.mm_config, kernel_preference=target.kernel_preference,
            act_quant_kwargs=target.act_quant_kwargs)


class IntxUnpackedToInt8TensorAdapter(_AffineAdapter):
    """``torchao.quantization.IntxUnpackedToInt8Tensor`` (IntxWeightOnlyConfig and friends)."""

    cls_name = "IntxUnpackedToInt8Tensor"

    def _kind(self, attrs):
        dtype = attrs.get("target_dtype")
        return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else None

    def quantize_like(self, target, hp, global_amax=None):
        mt = importlib.import_module("torchao.quantization.quant_primitives").MappingType
        mapping = mt.SYMMETRIC if _symmetric(target.zero_point) else mt.ASYMMETRIC
        return type(target).from_hp(
            hp.to(target.dtype), tuple(target.block_size), target.target_dtype, mapping_type=mapping,
            activation_quantization=target.activation_quantization)


# ----------------------------------------------------------------------------- MX / NVFP4

def _swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of a 128x4-tiled (cuBLAS block-scaling) scale for a (rows, cols) plain scale."""
    return ceil_div(rows, 128) * 32, ceil_div(cols, 4) * 16


def unswizzle_scale(scale: torch.Tensor, n_rows: int, n_cols: int) -> torch.Tensor:
    """Plain ``(..., n_rows, n_cols)`` scales from 128x4-tiled ones (padding dropped)."""
    if scale.ndim == 2:
        return unswizzle_128x4(scale, n_rows, n_cols)
    return torch.stack([unswizzle_128x4(s, n_rows, n_cols) for s in scale])


def swizzle_scale(scale: torch.Tensor) -> torch.Tensor:
    """128x4-tiled scales (zero padded) from plain ``(..., rows, cols)`` ones, in torchao's view shape."""
    shape = _swizzled_shape(scale.shape[-2], scale.shape[-1])
    if scale.ndim == 2:
        return swizzle_128x4(scale).view(shape)
    return torch.stack([swizzle_128x4(s).view(shape) for s in scale])


class _BlockScaledAdapter(TorchAOAdapter):
    """MX and NVFP4: packed element data, one scale per ``block_size`` along the last dim.

    Canonical scales are plain (unswizzled, unpadded) of shape ``(..., K / block_size)``; a tensor
    with ``is_swizzled_scales`` gets its tiled layout back on load.
    """

    block_attributes = ("block_size",)

    def _packing(self, t) -> int:
        raise NotImplementedError

    def _plain_scale_shape(self, t) -> tuple[int, ...]:
        return tuple(t.shape[:-1]) + (t.shape[-1] // t.block_size,)

    def components(self, t):
        comps = super().components(t)
        if t.is_swizzled_scales:
            rows, cols = self._plain_scale_shape(t)[-2:]
            comps["scale"] = unswizzle_scale(t.scale, rows, cols)
        return comps

    def native_components(self, t):
        comps = super().components(t)
        if t.is_swizzled_scales:
            del comps["scale"]
        return comps

    def inner_buffers(self, t):
        return TorchAOAdapter.components(self, t)

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
                value = getattr(t, name)
                out[name] = _per_tensor_layout(value, t.shape)
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
        form = mxfp8_form(attrs.get("elem_dtype")) if attrs.get("block_size") == 32 else None
        return {form: ["qdata", "scale"]} if form else {}

    def to_raw_form(self, type_name, attrs, form, components):
        return {"data": as_u8(components["qdata"]), "scale": as_u8(components["scale"])}

    def raw_forms_in(self, target):
        form = mxfp8_form(target.elem_dtype) if target.block_size == 32 else None
        return (form,) if form else ()

    def from_raw_form(self, target, form, tensors):
        self.copy_into(target, {"qdata": tensors["data"].view(target.elem_dtype),
                                "scale": tensors["scale"].view(torch.float8_e8m0fnu)})

    def new_from_raw_form(self, form, tensors, *, shape, dtype):
        elem = next((d for d, f in MXFP8_FORMS.items() if f == form), None)
        if elem is None:
            return None
        kernel_preference = _import("torchao.quantization.quantize_.common", "KernelPreference")
        return self.tensor_class()(tensors["data"].view(elem), tensors["scale"].view(torch.float8_e8m0fnu),
                                   elem, 32, dtype, kernel_preference.EMULATED, None, False)


class NVFP4TensorAdapter(_BlockScaledAdapter):
    """``torchao.prototype.mx_formats.NVFP4Tensor``: fp4 elements, e4m3 scale per 16, optional
    per-tensor scale (quantize-on-load uses the whole tensor's amax for it)."""

    cls_name = "NVFP4Tensor"

    def _packing(self, t):
        return 2

    def needs_global_amax(self, target):
        return target.per_tensor_scale is not None

    def quantize_like(self, target, hp, global_amax=None):
        per_tensor_scale = None
        if target.per_tensor_scale is not None:
            amax = global_amax if global_amax is not None else hp.abs().amax()
            to_scale = _import(_CLASS_PATHS["NVFP4Tensor"], "per_tensor_amax_to_scale")
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


# ----------------------------------------------------------------------------- NF4

class NF4TensorAdapter(TorchAOAdapter):
    """``torchao.quantization.NF4Tensor`` (QLoRA): blocks over the flattened tensor."""

    cls_name = "NF4Tensor"
    _names = ["quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"]

    def component_names(self, t):
        return list(self._names)

    def attributes(self, t):
        return {"block_size": t.block_size, "scaler_block_size": t.scaler_block_size, "dtype": t.dtype}

    def layouts(self, t):
        return {"quantized_data": Flat(2),
                "quantized_scalers": Flat(t.block_size),
                "quantization_factor": Flat(t.block_size * t.scaler_block_size),
                "scaler_mean": Replicated(tuple(t.scaler_mean.shape)),
                "nf4": Replicated(tuple(t.nf4.shape))}

    def dequantize(self, t, dtype=None):
        out = t.get_original_weight()  # NF4 has no wider-precision dequantize: computed in its dtype
        return out if dtype is None else out.to(dtype)

    def rebuild(self, stored):
        cls = self.tensor_class()
        args_cls = _import("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "SubclassTensorArgs")
        shape = torch.Size(stored.shape)
        stride = torch.empty(shape, device="meta").stride()
        device = stored.components["quantized_data"].device
        attrs = stored.attrs
        meta = args_cls(shape, stride, 0, attrs["dtype"], device, False)
        ctx = {"block_size": attrs["block_size"], "scaler_block_size": attrs["scaler_block_size"],
               "n_blocks": math.prod(shape) // attrs["block_size"], "tensor_meta": meta}
        return cls.__tensor_unflatten__(dict(stored.components), ctx, shape, stride)

    def from_inner_buffers(self, t, buffers):
        return self.rebuild(StoredEntry(self.type_names[0], self.attributes(t), tuple(t.shape), t.dtype, buffers))

    def add_op(self, cls, op, impl):
        """Through NF4's own op table (``NF4_OPS_TABLE`` and ``implements`` of its module)."""
        module = sys.modules.get(cls.__module__)
        table = getattr(module, "NF4_OPS_TABLE", None)
        if not isinstance(table, dict) or op in table or not callable(getattr(module, "implements", None)):
            return None
        module.implements([op])(lambda func, args, kwargs: impl(func, args, kwargs or {}))
        handler = table[op]

        def remove() -> None:
            if table.get(op) is handler:
                del table[op]
        return remove

    def quantize_like(self, target, hp, global_amax=None):
        to_nf4 = _import("torchao.quantization", "to_nf4")
        return to_nf4(hp.to(target.dtype).contiguous(), target.block_size, target.scaler_block_size)


# ----------------------------------------------------------------------------- torchao.optim

class _OptimStateAdapter(TorchAOAdapter):
    """``torchao.optim`` low-bit states: codes and one scale per ``block_size`` flattened elements.

    torchao makes a DTensor parameter's state per local tensor, so the blocks are over each shard's
    own elements (``groups_per_shard``): a shard that is no row range (tensor parallel's column
    cut) stores its scale (and 4-bit codes) as the grid of blocks they form in the logical tensor,
    and such an entry is dequantized by putting each block's elements back in a row."""

    groups_per_shard = True

    def component_names(self, t):
        return list(type(t).tensor_attrs)

    def _block_size(self, t) -> int:
        return t.codes.numel() * self._codes_per_byte() // t.scale.numel()

    def _codes_per_byte(self) -> int:
        return 1

    def attributes(self, t):
        attrs = {"block_size": self._block_size(t), "dtype": t.dtype}
        if hasattr(t, "signed"):
            attrs["signed"] = bool(t.signed)
        return attrs

    def layouts(self, t):
        codes = Flat(2) if self._codes_per_byte() == 2 else Blocked((1,) * t.ndim)
        out: dict[str, Layout] = {"codes": codes, "scale": Flat(self._block_size(t))}
        if "qmap" in type(t).tensor_attrs:
            out["qmap"] = Replicated(tuple(t.qmap.shape))
        return out

    def _new(self, attrs, shape, device):
        cls = self.tensor_class()
        kwargs = {"block_size": attrs["block_size"], "device": device, "dtype": attrs["dtype"]}
        if "signed" in attrs:
            kwargs["signed"] = attrs["signed"]
        return cls.zeros(tuple(shape), **kwargs)

    def rebuild(self, stored):
        grid = self._grid(stored)
        if grid is not None:
            raise UnsupportedTensorError(
                f"{self.cls_name} saved from shards that are not row ranges (one scale per {grid} block "
                f"of the logical tensor, not per {stored.attrs['block_size']} flattened elements): no "
                f"{self.cls_name} of shape {tuple(stored.shape)} holds that; read it dequantized, or load "
                f"it into a target sharded as it was saved")
        out = self._new(stored.attrs, stored.shape, stored.components["codes"].device)
        for name, value in stored.components.items():
            getattr(out, name).copy_(value)
        return out

    def dequantize_stored(self, stored, dtype=None):
        grid = self._grid(stored)
        if grid is None:
            return super().dequantize_stored(stored, dtype)
        per_byte = self._codes_per_byte()
        codes_block = grid[:-1] + (grid[-1] // per_byte,)  # 4-bit: two codes per byte along the row
        comps = dict(stored.components)
        comps["codes"] = blocks_as_groups(comps["codes"], codes_block)
        comps["scale"] = comps["scale"].reshape(-1)  # the grid's row-major order is the groups' order
        flat = StoredEntry(stored.type_name, stored.attrs, (math.prod(stored.shape),), stored.dtype, comps)
        return groups_as_blocks(super().dequantize_stored(flat, dtype), grid, stored.shape)

    def _grid(self, stored) -> tuple[int, ...] | None:
        """The block each scale covers where the entry was saved as a grid (its scale has the
        logical rank: :meth:`qdcp.layouts.Flat.on_shard`); None for flat blocks."""
        scale = stored.components["scale"]
        if scale.ndim < 2 or scale.ndim != len(stored.shape):
            return None
        return tuple(n // s for n, s in zip(stored.shape, scale.shape))

    def from_inner_buffers(self, t, buffers):
        flat = t.__tensor_flatten__()[1]
        return type(t).__tensor_unflatten__(dict(buffers), flat, t.shape, t.stride())

    def quantize_like(self, target, hp, global_amax=None):
        out = self._new(self.attributes(target), hp.shape, target.codes.device)
        out.copy_(hp.to(device=target.codes.device, dtype=target.dtype).contiguous())  # torchao views it flat
        return out


class OptimState8bitAdapter(_OptimStateAdapter):
    """``torchao.optim`` 8-bit state (AdamW8bit)."""

    cls_name = "OptimState8bit"


class OptimState4bitAdapter(_OptimStateAdapter):
    """``torchao.optim`` 4-bit state (AdamW4bit): two codes per byte, flattened."""

    cls_name = "OptimState4bit"

    def _codes_per_byte(self):
        return 2


class OptimStateFp8Adapter(_OptimStateAdapter):
    """``torchao.optim`` fp8 state (AdamWFp8)."""

    cls_name = "OptimStateFp8"


def builtin_adapters() -> list[Adapter]:
    """The torchao adapters qdcp registers at import."""
    return [Int8TensorAdapter(), Float8TensorAdapter(), IntxUnpackedToInt8TensorAdapter(),
            MXTensorAdapter(), NVFP4TensorAdapter(), NF4TensorAdapter(),
            OptimState8bitAdapter(), OptimState4bitAdapter(), OptimStateFp8Adapter()]
