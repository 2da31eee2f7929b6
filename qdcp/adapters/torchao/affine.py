"""torchao's affine tensors (``Int8Tensor``, ``Float8Tensor``, ``IntxUnpackedToInt8Tensor``): element
data, one scale (and zero point) per ``block_size`` block."""

from __future__ import annotations

import importlib
import math
from typing import Any, Mapping

import torch

from qdcp.adapters.base import RawInterchangeAdapter
from qdcp.adapters.formats import affine_form, parse_affine_form, repeat_blocks
from qdcp.adapters.torchao.base import TorchAOAdapter
from qdcp.errors import UnsupportedTensorError
from qdcp.layouts import Blocked, Layout, Replicated


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


def one_value_per_tensor(block_size, shape, scale: torch.Tensor) -> bool:
    """Whether a torchao affine tensor (or a shard of one, as torchao's slicing cuts it: ``block_size``
    cut to the shard's shape) holds one scale for the whole tensor: one block the shard's shape,
    of more than one row. A shard of one row is read as that row's block (torchao's slicing makes
    a per-row shard of one row and a per-tensor one alike)."""
    block = [int(b) for b in block_size]
    return scale.numel() == 1 and block == [int(s) for s in shape] and math.prod(block[:-1]) > 1


def _symmetric(zero_point: torch.Tensor | None) -> bool:
    return zero_point is None or not bool(torch.count_nonzero(zero_point))


class _AffineAdapter(TorchAOAdapter, RawInterchangeAdapter):
    """qdata elementwise; scale (and zero_point) one per ``block_size`` block.

    Raw interchange: 2-D tensors state their bits in the affine form of their element kind and
    block (``qdcp.adapters.formats.affine_form``), and take them from it where the values fit the
    target's buffers exactly (see :meth:`from_raw_form`)."""

    _zero_point = True  # the class always carries a zero_point
    block_attributes = ("block_size",)
    kind = ""  #: the element kind of its affine form

    def _kind(self, attrs: Mapping[str, Any]) -> str | None:
        return self.kind

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

    def needs_global_amax(self, target):
        """A per-tensor scale (:func:`one_value_per_tensor`) is the whole tensor's."""
        return one_value_per_tensor(target.block_size, target.shape, target.scale)

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
    kind = "int8"

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
    kind = "float8"

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
        """As torchao's ``IntxWeightOnlyConfig`` quantizes: ``from_hp``, then, for a scale dtype other
        than the values' (``scale_dtype``), the codes quantized again with the scale in that dtype."""
        mt = importlib.import_module("torchao.quantization.quant_primitives").MappingType
        mapping = mt.SYMMETRIC if _symmetric(target.zero_point) else mt.ASYMMETRIC
        hp, block = hp.to(target.dtype), tuple(target.block_size)
        new = type(target).from_hp(hp, block, target.target_dtype, mapping_type=mapping,
                                   activation_quantization=target.activation_quantization)
        if new.scale.dtype == target.scale.dtype:
            return new
        return type(target).from_hp(hp, block, target.target_dtype, mapping_type=mapping,
                                    activation_quantization=target.activation_quantization,
                                    intx_choose_qparams_algorithm=None, custom_scale=new.scale.to(target.scale.dtype),
                                    custom_zero_point=new.zero_point)
