"""torchao's low-bit optimizer states (``torchao.optim``: 8-bit, 4-bit, fp8)."""

from __future__ import annotations

import math

from qdcp.adapters.base import StoredEntry
from qdcp.adapters.torchao.base import TorchAOAdapter
from qdcp.errors import UnsupportedTensorError
from qdcp.layouts import Blocked, Flat, Layout, Replicated, blocks_as_groups, groups_as_blocks


class _OptimStateAdapter(TorchAOAdapter):
    """``torchao.optim`` low-bit states: codes and one scale per ``block_size`` flattened elements.

    torchao makes a DTensor parameter's state per local tensor, so the blocks are over each shard's
    own elements (``groups_per_shard``): a shard that is no row range (tensor parallel's column
    cut) stores its scale (and 4-bit codes) as the grid of blocks they form in the logical tensor,
    and such an entry is dequantized by putting each block's elements back in a row."""

    groups_per_shard = True
    codes_per_byte = 1

    def _block_size(self, t) -> int:
        return t.codes.numel() * self.codes_per_byte // t.scale.numel()

    def attributes(self, t):
        attrs = {"block_size": self._block_size(t), "dtype": t.dtype}
        if hasattr(t, "signed"):
            attrs["signed"] = bool(t.signed)
        return attrs

    def layouts(self, t):
        codes = Flat(2) if self.codes_per_byte == 2 else Blocked((1,) * t.ndim)
        out: dict[str, Layout] = {"codes": codes, "scale": Flat(self._block_size(t))}
        if "qmap" in type(t).tensor_attrs:
            out["qmap"] = Replicated(tuple(t.qmap.shape))
        return out

    def _new(self, attrs, shape, device):
        kwargs = {k: attrs[k] for k in ("block_size", "dtype", "signed") if k in attrs}
        return self.tensor_class().zeros(tuple(shape), device=device, **kwargs)

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
        per_byte = self.codes_per_byte
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
    codes_per_byte = 2


class OptimStateFp8Adapter(_OptimStateAdapter):
    """``torchao.optim`` fp8 state (AdamWFp8)."""

    cls_name = "OptimStateFp8"
