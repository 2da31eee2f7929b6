"""The load rule of docs/api.md (*When a target gets the source's bits*), written from the docs alone.

Nothing here asks qdcp how it decides. Each torchao tensor is seen as per-element maps taken from
torchao's own attributes: its element codes and, for every element, the value of each block
component that applies to it (scale, zero point, per-tensor scale). The rule then reads:

- a target of the source's type whose configuration is the source's but for its blocks gets the
  source's bits where every one of its blocks covers elements whose source block values are all one
  value, bit for bit (inside one source block, or over source blocks that share it): its codes are
  the source's and its block values that one value;
- torchao's optimizer states and NF4 (blocks over runs of a shard's own elements) get the source's
  bits where the target's blocks are the source's blocks (NF4: its groups of double-quantized
  scalers);
- a value the target holds once for the whole tensor (a per-tensor scale, NF4's scaler mean) must be
  one value over the elements it covers;
- otherwise a quantized target holds torchao's own quantization of the source's values (the
  source's ``dequantize()``), quantized like the target: a target that holds a value once for the
  whole tensor holds the whole tensor's values quantized like it, cut to its shard as torchao's
  slicing (or FSDP2's chunks, for NF4) cuts it;
- a plain target holds the source's values, bitwise.
"""

from __future__ import annotations

import dataclasses

import torch
from torchao.prototype.mx_formats.utils import from_blocked, to_blocked

BLOCK_COMPONENTS = ("scale", "zero_point", "per_tensor_scale")


def as_ints(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of their width (bitwise comparison)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _repeat(values: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    out = values
    for d in (0, 1):
        out = out.repeat_interleave(block[d], dim=d)
    return out[: shape[0], : shape[1]]


def element_maps(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per element of a 2-D torchao tensor: ``code`` and each block component's value, as ints."""
    name = type(t).__name__
    shape = tuple(t.shape)
    if name.startswith("OptimState"):
        group = t.block_size
        flat = t.scale.repeat_interleave(group)[: t.numel()]
        return {"code": _codes(as_ints(t.codes), shape), "scale": as_ints(flat).reshape(shape)}
    if name == "NF4Tensor":  # blocks over the flattened elements; scalers double-quantized in groups
        n, block, group = t.numel(), t.block_size, t.block_size * t.scaler_block_size
        return {"code": _codes(as_ints(t.quantized_data), shape),
                "scaler": as_ints(t.quantized_scalers).repeat_interleave(block)[:n].reshape(shape),
                "quantization_factor": as_ints(t.quantization_factor).repeat_interleave(group)[:n].reshape(shape),
                "scaler_mean": as_ints(t.scaler_mean.reshape(1, 1)).expand(shape)}
    codes = as_ints(t.qdata)
    if codes.shape[-1] * 2 == shape[-1]:  # two fp4 codes a byte
        codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(shape)
    out = {"code": codes}
    block = tuple(t.block_size) if isinstance(t.block_size, (list, tuple)) else (1, int(t.block_size))
    for comp in BLOCK_COMPONENTS:
        value = getattr(t, comp, None)
        if value is None:
            continue
        if value.numel() == 1:
            out[comp] = as_ints(value.reshape(1, 1)).expand(shape)
        elif comp == "scale" and getattr(t, "is_swizzled_scales", False):  # torchao's blocked layout
            grid = (shape[0] // block[0], shape[1] // block[1])
            out[comp] = _repeat(as_ints(from_blocked(value.reshape(-1), *grid)), block, shape)
        else:
            out[comp] = _repeat(as_ints(value), block, shape)
    return out


def swizzled_as_torchao_lays_out(t: torch.Tensor) -> bool:
    """A tensor with swizzled scales (torchao's ``is_swizzled_scales``) holds them in torchao's own
    blocked layout of its compact scales, padding zero (docs/format.md); True for any other."""
    if not getattr(t, "is_swizzled_scales", False):
        return True
    block = int(t.block_size)
    compact = from_blocked(t.scale.reshape(-1), t.shape[0], t.shape[1] // block)
    return torch.equal(as_ints(t.scale.reshape(-1)), as_ints(to_blocked(compact)))


def _codes(codes: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Element codes of a flat code buffer: one a byte, or two 4-bit codes a byte."""
    n = int(torch.Size(shape).numel())
    if codes.numel() * 2 == n:
        codes = torch.stack([codes >> 4, codes & 0xF], dim=-1)
    return codes.reshape(shape)


def per_tensor(t: torch.Tensor) -> tuple[str, ...]:
    """The element maps of ``t`` that its library holds once for the whole tensor (NVFP4's
    ``per_tensor_scale``, NF4's scaler mean, the scale and zero point of a torchao affine tensor
    whose one block is its own shape, of more than one row: per tensor, or a shard of such a
    tensor as torchao's slicing cuts it): a target holds one such value, so the elements it
    covers must share it, and the shards of a save must agree on it. (A shard of one row whose
    block is its shape is read as that row's block; other blocks are the configuration's.)"""
    if type(t).__name__ == "NF4Tensor":
        return ("scaler_mean",)
    if getattr(t, "per_tensor_scale", None) is not None:
        return ("per_tensor_scale",)
    block = getattr(t, "block_size", None)
    if isinstance(block, (list, tuple)) and one_block_of_its_shape(block, t.shape) and t.shape[0] > 1:
        return tuple(c for c in ("scale", "zero_point") if getattr(t, c, None) is not None)
    return ()


def one_block_of_its_shape(block, shape) -> bool:
    """torchao's slicing cuts ``block_size`` to a shard's shape: a per-tensor tensor's shard has one block."""
    return [int(b) for b in block] == [int(s) for s in shape]


def config(t: torch.Tensor) -> tuple:
    """Everything of a tensor's configuration but its blocks: class, attributes, component dtypes."""
    names, attrs = t.__tensor_flatten__()
    attrs = attrs if isinstance(attrs, dict) else dict(enumerate(attrs))
    skip = ("block_size", "n_blocks", "tensor_meta")  # blocks, and the shard's own shape
    rest = tuple(sorted((k, repr(v)) for k, v in attrs.items() if k not in skip and v != tuple(t.shape)))
    return type(t), rest, tuple((n, getattr(t, n).dtype) for n in names)


def target_blocks(t: torch.Tensor) -> torch.Tensor:
    """Per element of a target's local tensor: the index of the block it belongs to."""
    rows, cols = t.shape
    if type(t).__name__.startswith("OptimState"):
        return (torch.arange(rows * cols) // t.block_size).reshape(rows, cols)
    if type(t).__name__ == "NF4Tensor":  # a scaler group: block_size x scaler_block_size elements
        return (torch.arange(rows * cols) // (t.block_size * t.scaler_block_size)).reshape(rows, cols)
    block = tuple(t.block_size) if isinstance(t.block_size, (list, tuple)) else (1, int(t.block_size))
    r = torch.arange(rows) // block[0]
    c = torch.arange(cols) // block[1]
    return r[:, None] * (cols + 1) + c[None, :]


def constant_within(blocks: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``values`` is one value over each block of ``blocks`` (same-shaped maps)."""
    b, v = blocks.reshape(-1), values.reshape(-1).to(torch.int64)
    first = torch.full((int(b.max()) + 1,), -(2**62), dtype=torch.int64)
    first.scatter_(0, b.flip(0), v.flip(0))  # any one element's value per block
    return bool(torch.equal(first[b], v))


@dataclasses.dataclass(frozen=True)
class Target:
    """What the rule reads of a target: its configuration but for its blocks, the block of each
    of its elements, and the element maps it holds once for the whole tensor."""

    config: tuple
    blocks: torch.Tensor
    per_tensor: tuple[str, ...]


def view(t: torch.Tensor) -> Target:
    """A torchao target as the rule reads it."""
    return Target(config(t), target_blocks(t), per_tensor(t))


def gets_source_bits(source_maps: dict, source_groups: tuple | None, target: torch.Tensor | Target,
                     source_config: tuple) -> bool:
    """Whether the rule gives ``target`` (a local tensor over the maps' region, or its view) the
    source's bits. ``source_groups`` (optimizer states): the region's map of source group ids and
    every source group's size."""
    target = target if isinstance(target, Target) else view(target)
    if target.config != source_config:
        return False
    blocks = target.blocks
    one = torch.zeros_like(blocks)
    if not all(constant_within(one, source_maps[c]) for c in target.per_tensor):
        return False
    if source_groups is not None:  # the target's blocks must be the source's, whole
        ids, sizes = source_groups
        inside = torch.bincount(ids.reshape(-1), minlength=len(sizes))
        return constant_within(blocks, ids) and constant_within(ids, blocks) \
            and bool(((inside == 0) | (inside == sizes)).all())
    return all(constant_within(blocks, source_maps[c]) for c in source_maps if c != "code")


def maps_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
