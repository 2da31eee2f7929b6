"""The load rule of docs/api.md (*When a target gets the source's bits*), written from the docs alone.

Nothing here asks qdcp how it decides. Each torchao tensor is seen as per-element maps taken from
torchao's own attributes: its element codes and, for every element, the value of each block
component that applies to it (scale, zero point, per-tensor scale). The rule then reads:

- a target of the source's type whose configuration is the source's but for its blocks gets the
  source's bits where every one of its blocks covers elements whose source block values are all one
  value, bit for bit (inside one source block, or over source blocks that share it): its codes are
  the source's and its block values that one value;
- torchao's optimizer states (blocks over runs of a shard's own elements) get the source's bits
  where the target's blocks are the source's blocks;
- otherwise a quantized target holds torchao's own quantization of the source's values (the
  source's ``dequantize()``), quantized like the target;
- a plain target holds the source's values, bitwise.
"""

from __future__ import annotations

import torch

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
        return {"code": as_ints(t.codes).reshape(shape), "scale": as_ints(flat).reshape(shape)}
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
        else:
            out[comp] = _repeat(as_ints(value), block, shape)
    return out


def config(t: torch.Tensor) -> tuple:
    """Everything of a tensor's configuration but its blocks: class, attributes, component dtypes."""
    names, attrs = t.__tensor_flatten__()
    attrs = attrs if isinstance(attrs, dict) else dict(enumerate(attrs))
    rest = tuple(sorted((k, repr(v)) for k, v in attrs.items() if k != "block_size"))
    return type(t), rest, tuple((n, getattr(t, n).dtype) for n in names)


def target_blocks(t: torch.Tensor) -> torch.Tensor:
    """Per element of a target's local tensor: the index of the block it belongs to."""
    rows, cols = t.shape
    if type(t).__name__.startswith("OptimState"):
        return (torch.arange(rows * cols) // t.block_size).reshape(rows, cols)
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


def gets_source_bits(source_maps: dict, source_groups: tuple | None, target: torch.Tensor,
                     source_config: tuple) -> bool:
    """Whether the rule gives ``target`` (a local tensor over the maps' region) the source's bits.
    ``source_groups`` (optimizer states): the region's map of source group ids and every source
    group's size."""
    if config(target) != source_config:
        return False
    blocks = target_blocks(target)
    if source_groups is not None:  # the target's blocks must be the source's, whole
        ids, sizes = source_groups
        inside = torch.bincount(ids.reshape(-1), minlength=len(sizes))
        return constant_within(blocks, ids) and constant_within(ids, blocks) \
            and bool(((inside == 0) | (inside == sizes)).all())
    return all(constant_within(blocks, source_maps[c]) for c in source_maps if c != "code")


def maps_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
