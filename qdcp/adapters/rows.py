"""Dequantizing a stored entry (or a chunk of one) a block of rows at a time.

The libraries dequantize a whole tensor at once, through full-size intermediates. Block by block
(each as the adapter dequantizes a chunk of that size, into one output) they stay a few MiB and the
values are the same, element for element: each block of rows holds whole component blocks, and a
block's values depend on its own elements and scales only (tests/test_chunked_dequantize.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import torch

from qdcp.adapters.base import Adapter, StoredEntry
from qdcp.errors import AlignmentError
from qdcp.layouts import Blocked, Chunk, Flat, Layout, Replicated, ceil_div, full_chunk, narrow, relative

__all__ = ["DEQUANTIZE_ELEMENTS", "row_blocks", "dequantize_by_rows"]

#: logical elements dequantized at a time, rounded up to whole blocks of rows (2^20: the peak and
#: the memory glibc keeps afterwards both below a whole-tensor dequantize's; docs/benchmarks.md,
#: *Dequantizing loads and saves*)
DEQUANTIZE_ELEMENTS = 1 << 20


def row_blocks(layouts: Mapping[str, Layout], shape: tuple[int, ...],
               chunk: Chunk | None = None) -> list[tuple[Chunk, dict[str, Chunk]]] | None:
    """``chunk`` (default: the whole) of a logical tensor of ``shape`` whose components have
    ``layouts``, cut along dim 0 into blocks of about :data:`DEQUANTIZE_ELEMENTS` elements on every
    component's blocks: each block's logical chunk and, by component, its part of the components
    that cover ``chunk`` (relative to them). None where it stays whole: small, or a layout that
    does not cut by rows."""
    (offsets, sizes) = chunk if chunk is not None else full_chunk(shape)
    if not sizes or not layouts or len(shape) != len(sizes):
        return None
    row = max(1, math.prod(sizes[1:]))
    align = 1  # rows every component's blocks fall on
    for layout in layouts.values():
        if isinstance(layout, Blocked) and layout.block[0]:
            align = math.lcm(align, layout.block[0])
        elif isinstance(layout, Flat):
            if tuple(sizes[1:]) != tuple(shape[1:]):
                return None  # a flat layout's groups run across rows: only whole rows
            align = math.lcm(align, layout.group // math.gcd(layout.group, row))
        elif not isinstance(layout, (Blocked, Replicated)):
            return None
    step = ceil_div(max(1, DEQUANTIZE_ELEMENTS // row), align) * align  # whole blocks, ~DEQUANTIZE_ELEMENTS
    if sizes[0] <= step:
        return None
    try:
        whole = {name: layout.map_chunk(shape, (offsets, sizes)) for name, layout in layouts.items()}
        blocks = []
        for r in range(0, sizes[0], step):
            rows = ((offsets[0] + r, *offsets[1:]), (min(step, sizes[0] - r), *sizes[1:]))
            blocks.append((rows, {name: relative(layout.map_chunk(shape, rows), whole[name])
                                  for name, layout in layouts.items()}))
        return blocks
    except AlignmentError:  # pragma: no cover (the steps fall on every block)
        return None


def dequantize_by_rows(adapter: Adapter, stored: StoredEntry, blocks: list[tuple[Chunk, dict[str, Chunk]]],
                       at: Chunk, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The values of ``stored`` (the chunk ``at`` of its logical tensor), as
    ``adapter.dequantize_stored`` gives them, computed over :func:`row_blocks`' ``blocks`` into one
    output."""
    out = None
    for rows, parts in blocks:
        part = {name: narrow(stored.components[name], chunk) for name, chunk in parts.items()}
        values = adapter.dequantize_stored(dataclasses.replace(stored, shape=tuple(rows[1]), components=part), dtype)
        if out is None:
            out = torch.empty(at[1], dtype=values.dtype, device=values.device)
        narrow(out, relative(rows, at)).copy_(values)
    return out
