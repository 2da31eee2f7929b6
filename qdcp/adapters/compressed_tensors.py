"""Entries of a ``compressed-tensors`` checkpoint, as :class:`qdcp.QuantizedHFReader` presents them.

compressed-tensors has no tensor class: a quantized ``<module>.weight`` is a set of parameters
(``weight_packed``, ``weight_scale``...). The adapter describes such an entry so any target loads
from it: raw (through the neutral forms) into torchao's and TE's NVFP4 / MXFP8 types and torchao's
affine ones, else with the values compressed-tensors' decompression computes, in plain torch
(NVFP4 and MXFP8 in bf16, the others in the scale's dtype). Integer weights are presented unpacked
(int8 values and zero points), so they shard like the logical tensor.
"""

from __future__ import annotations

import torch

from qdcp.adapters.base import Adapter, RawInterchangeAdapter, StoredEntry, StoredOnlyAdapter
from qdcp.adapters.formats import (
    MXFP8_FORMS,
    NVFP4_GLOBAL_DIVISOR,
    NVFP4_ROW16,
    affine_form,
    e2m1_to_float,
    repeat_blocks,
    unpack_fp4,
)
from qdcp.errors import UnsupportedTensorError

PREFIX = "compressed_tensors."
NVFP4 = PREFIX + "nvfp4"
MXFP8 = PREFIX + "mxfp8"
FLOAT = PREFIX + "float"   # FP8 E4M3 weight, scale per tensor / channel / group / block
INT = PREFIX + "int"       # int8 / int4 weight (unpacked), scale per tensor / channel / group


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, ...]) -> torch.Tensor:
    """One scale per ``block`` (a single value: per tensor) spread over ``shape`` (a chunk's worth)."""
    s = scale.reshape(-1, scale.shape[-1]) if scale.ndim == 2 else scale.reshape(1, 1)
    bn, bk = (shape[0], shape[1]) if s.numel() == 1 else block
    return repeat_blocks(s, bn, bk, shape)


class CompressedTensorsAdapter(StoredOnlyAdapter, RawInterchangeAdapter):
    """The stored compressed-tensors schemes (sources only: there is no live instance to save)."""

    type_names = (NVFP4, MXFP8, FLOAT, INT)

    def rebuild(self, stored):
        raise UnsupportedTensorError(f"{stored.type_name} is a compressed-tensors parameter set, not a tensor "
                                     f"class: load it into a target (quantized or plain)")

    def dequantize_stored(self, stored: StoredEntry, dtype: torch.dtype | None = None) -> torch.Tensor:
        c, shape = stored.components, stored.shape
        if stored.type_name == NVFP4:
            codes = e2m1_to_float(unpack_fp4(c["weight_packed"]))
            scale = c["weight_scale"].to(torch.bfloat16) / c["weight_global_scale"].float().reshape(1)
            out = (codes.reshape(shape[0], -1, 16) * scale.float().unsqueeze(-1)).reshape(shape).to(torch.bfloat16)
        elif stored.type_name == MXFP8:
            scale = torch.pow(2.0, c["weight_scale"].to(torch.float32) - 127).to(torch.bfloat16)
            w = c["weight"].to(torch.bfloat16).reshape(shape[0], -1, 32)
            out = (w * scale.unsqueeze(-1)).reshape(shape)
        else:  # as the library: (weight - zero_point) * scale, in the scale's dtype
            scale, block = c["weight_scale"], tuple(stored.attrs["block"])
            out = c["weight"].to(scale.dtype)
            if "weight_zero_point" in c:
                out = out - _expand(c["weight_zero_point"].to(scale.dtype), block, shape)
            out = out * _expand(scale, block, shape)
        return out if dtype is None else out.to(dtype)

    def raw_forms_out(self, type_name, attrs):
        if type_name == NVFP4:
            return {NVFP4_ROW16: ["weight_packed", "weight_scale", "weight_global_scale"]}
        if type_name == MXFP8:
            return {MXFP8_FORMS[torch.float8_e4m3fn]: ["weight", "weight_scale"]}
        block = attrs.get("block")
        if type_name in (FLOAT, INT) and isinstance(block, (list, tuple)) and len(block) == 2:
            kind = "float8" if type_name == FLOAT else f"int{int(attrs.get('bits', 8))}"
            zero = ["weight_zero_point"] if attrs.get("symmetric", True) is False else []
            return {affine_form(kind, block): ["weight", "weight_scale", *zero]}
        return {}

    def to_raw_form(self, type_name, attrs, form, components):
        if type_name == NVFP4:
            divisor = torch.tensor(NVFP4_GLOBAL_DIVISOR, dtype=torch.float32)
            decode = 1.0 / components["weight_global_scale"].float().reshape(())
            return {"data": components["weight_packed"], "scale": components["weight_scale"].view(torch.uint8),
                    "amax": decode * divisor}
        if type_name == MXFP8:
            return {"data": components["weight"].view(torch.uint8), "scale": components["weight_scale"]}
        scale = components["weight_scale"]
        out = {"data": components["weight"], "scale": scale.reshape(1, 1) if scale.ndim < 2 else scale}
        if "weight_zero_point" in components:
            out["zero_point"] = components["weight_zero_point"].reshape(out["scale"].shape)
        return out


def builtin_adapters() -> list[Adapter]:
    """The compressed-tensors adapter qdcp registers at its registry's first use (the library itself is not needed)."""
    return [CompressedTensorsAdapter()]
