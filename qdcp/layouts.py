"""How a component (inner buffer) of a quantized tensor shards with its logical tensor.

A layout maps a chunk of the logical tensor -- ``(offsets, sizes)``, the unit DCP and DTensor
speak in -- to the chunk of one component that holds exactly that chunk's data:

- :class:`Blocked`: one component item per block of ``block[d]`` logical elements along each dim
  (element data ``(1, ..., 1)``; fp4 packed two per byte ``(1, ..., 2)``; a per-row scale of
  ``[M, N]`` ``(1, N)``); a block of ``0`` is one item for the whole dim (a per-expert scale of a
  stacked ``[n, M, N]`` group is ``(1, 0, 0)``), whose copies shards that cut the dim must agree on.
- :class:`Flat`: 1-D over the row-major flattened tensor, one item per ``group`` elements
  (torchao optimizer states, NF4). Where a library groups each shard's own elements and a shard is
  no row range (a column cut), its groups form a :class:`Blocked` grid instead (:func:`for_shard`).
- :class:`Replicated`: every chunk needs the whole component (lookup tables, per-tensor scales).

A chunk *aligned* to a layout maps to a whole number of component items; ``expand`` gives the
smallest aligned chunk covering a chunk (read it, dequantize, slice: exact for any boundary).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from qdcp.errors import AlignmentError, CheckpointFormatError

Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def full_chunk(shape: Sequence[int]) -> Chunk:
    """The chunk covering the whole tensor."""
    return tuple(0 for _ in shape), tuple(int(s) for s in shape)


def narrow(t: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The view of ``t`` that is ``chunk``."""
    for dim, (o, s) in enumerate(zip(*chunk)):
        t = t.narrow(dim, o, s)
    return t


def relative(inner: Chunk, outer: Chunk) -> Chunk:
    """``inner`` with offsets relative to ``outer``'s (``inner`` lies within ``outer``)."""
    return tuple(i - o for i, o in zip(inner[0], outer[0])), inner[1]


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers."""
    return -(-a // b)


class Layout:
    """Base class: subclasses implement :meth:`map_chunk` and :meth:`expand`."""

    def component_shape(self, logical_shape: Sequence[int]) -> tuple[int, ...]:
        """The component's global shape for a logical tensor of ``logical_shape``."""
        return self.map_chunk(logical_shape, full_chunk(logical_shape))[1]

    def map_chunk(self, logical_shape: Sequence[int], chunk: Chunk) -> Chunk:
        """Component chunk holding exactly logical ``chunk``; :class:`AlignmentError` if none does."""
        raise NotImplementedError

    def expand(self, logical_shape: Sequence[int], chunk: Chunk) -> Chunk:
        """Smallest aligned logical chunk that contains ``chunk``."""
        raise NotImplementedError

    def shared(self, logical_shape: Sequence[int], chunk: Chunk) -> bool:
        """Whether the component items ``chunk`` maps to also belong to other chunks (values every
        shard holds a copy of, which shards saved on their own must agree on). Default: no."""
        return False

    def on_shard(self, local_shape: Sequence[int]) -> Layout | None:
        """The layout this one amounts to in the logical tensor where it groups the elements of a
        shard of ``local_shape`` on their own (see :meth:`Flat.on_shard`); None: no other."""
        return None

    def to_json(self) -> dict:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Blocked(Layout):
    """One component item per ``block`` of logical elements, same rank as the logical tensor
    (``block[d] == 0``: one item for the whole of dim ``d``, constant along it)."""

    block: tuple[int, ...]

    def _check_rank(self, logical_shape: Sequence[int]) -> None:
        if len(self.block) != len(logical_shape):
            raise CheckpointFormatError(
                f"block {self.block} does not match a logical tensor of rank {len(logical_shape)}")

    def map_chunk(self, logical_shape, chunk):
        self._check_rank(logical_shape)
        out_o, out_s = [], []
        for d, (o, s, b, n) in enumerate(zip(*chunk, self.block, logical_shape)):
            if b == 0:  # constant along this dim: every extent needs its one item
                out_o.append(0)
                out_s.append(1 if s > 0 else 0)
                continue
            if o % b or ((o + s) % b and o + s != n):
                raise AlignmentError(f"logical rows/cols [{o}, {o + s}) of dim {d} do not fall on blocks of {b}")
            out_o.append(o // b)
            out_s.append(ceil_div(o + s, b) - o // b)
        return tuple(out_o), tuple(out_s)

    def expand(self, logical_shape, chunk):
        self._check_rank(logical_shape)
        out_o, out_s = [], []
        for o, s, b, n in zip(*chunk, self.block, logical_shape):
            lo, hi = ((o // b) * b, min(n, ceil_div(o + s, b) * b)) if b else (o, o + s)  # b 0: constant, any extent
            out_o.append(lo)
            out_s.append(hi - lo)
        return tuple(out_o), tuple(out_s)

    def shared(self, logical_shape, chunk):
        return any(b == 0 and s < n for s, b, n in zip(chunk[1], self.block, logical_shape))

    def to_json(self):
        return {"kind": "blocked", "block": list(self.block)}


@dataclasses.dataclass(frozen=True)
class Flat(Layout):
    """A 1-D component over the flattened logical tensor, one item per ``group`` elements."""

    group: int

    def map_chunk(self, logical_shape, chunk):
        offsets, sizes = chunk
        numel = math.prod(logical_shape)
        start, length = _linear_range(logical_shape, offsets, sizes)
        end = start + length
        if start % self.group or (end % self.group and end != numel):
            raise AlignmentError(
                f"flat elements [{start}, {end}) do not fall on groups of {self.group}")
        return (start // self.group,), (ceil_div(end, self.group) - start // self.group,)

    def expand(self, logical_shape, chunk):
        offsets, sizes = chunk
        if not logical_shape:
            return chunk
        rows = int(logical_shape[0])
        row_len = math.prod(logical_shape[1:])
        step = self.group // math.gcd(self.group, row_len) if row_len else 1
        lo = (offsets[0] // step) * step
        hi = min(rows, ceil_div(offsets[0] + sizes[0], step) * step)
        return (lo,) + tuple(0 for _ in logical_shape[1:]), (hi - lo,) + tuple(logical_shape[1:])

    def on_shard(self, local_shape):
        """Groups of ``group`` consecutive elements of a shard's own row-major elements, as the
        :class:`Blocked` grid they form in the logical tensor (shards of one tensor all of
        ``local_shape``): rows cut into whole groups, ``(1, ..., group)``; or groups of ``k`` whole
        shard rows, ``(1, ..., k, cols)``. None where they form no grid (a group that spans a row
        boundary part-way, a 1-D tensor)."""
        if len(local_shape) < 2:
            return None
        lead, rows, cols = (1,) * (len(local_shape) - 2), int(local_shape[-2]), int(local_shape[-1])
        if cols and cols % self.group == 0:
            return Blocked(lead + (1, self.group))
        if cols and self.group % cols == 0 and rows % (self.group // cols) == 0:
            return Blocked(lead + (self.group // cols, cols))
        return None

    def to_json(self):
        return {"kind": "flat", "group": self.group}


@dataclasses.dataclass(frozen=True)
class Replicated(Layout):
    """The whole component belongs to every chunk; its shape is given, not derived."""

    shape: tuple[int, ...]

    def map_chunk(self, logical_shape, chunk):
        return full_chunk(self.shape)

    def expand(self, logical_shape, chunk):
        return chunk

    def shared(self, logical_shape, chunk):
        return True

    def to_json(self):
        return {"kind": "replicated"}


def _linear_range(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> tuple[int, int]:
    """Row-major ``(start, length)`` of a chunk; :class:`AlignmentError` if it is not contiguous."""
    # Contiguous iff: leading dims of size 1, then one partial dim, then only full dims.
    if math.prod(sizes) == 0:
        return 0, 0
    d = next((k for k, s in enumerate(sizes) if s != 1), len(sizes))
    if any(sizes[k] != shape[k] for k in range(d + 1, len(shape))):
        raise AlignmentError(
            f"chunk at offsets {tuple(offsets)} sizes {tuple(sizes)} is not contiguous in a "
            f"tensor of shape {tuple(shape)}: only row (dim-0) shards map to a flat buffer (the nearest "
            f"layout that works: shard it by rows only, e.g. Shard(0) where the weight is Shard(1), or "
            f"Replicate() on the tensor-parallel mesh dimension)")
    return sum(o * math.prod(shape[k + 1:]) for k, o in enumerate(offsets)), math.prod(sizes)


def for_shard(layout: Layout, logical_shape: Sequence[int], chunk: Chunk, local_shape: Sequence[int]) -> Layout:
    """The layout of a component whose groups are over the elements of the shard holding ``chunk``
    (of ``local_shape``): ``layout`` where the chunk maps onto it (a row range of a :class:`Flat`
    component), else the grid :meth:`Layout.on_shard` gives, else ``layout`` (which then refuses the
    chunk with its own error)."""
    try:
        layout.map_chunk(logical_shape, chunk)
        return layout
    except AlignmentError:
        return layout.on_shard(local_shape) or layout


def grid_view(t: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor | None:
    """A shard's own flat component buffer ``t`` as the ``sizes`` grid its groups form
    (:func:`for_shard`): ``t`` where it already has that shape, a view where it is contiguous and
    holds that many elements (row-major over the grid is the groups' order), else None."""
    sizes = tuple(int(s) for s in sizes)
    if tuple(t.shape) == sizes:
        return t
    return t.view(sizes) if t.is_contiguous() and t.numel() == math.prod(sizes) else None


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t``, row-major, as a flat uint8 view of its memory. ``view(-1)``
    keeps the stride a size-1 dim may carry (NF4's one-element ``quantization_factor`` has stride
    256), which ``view(torch.uint8)`` then refuses; the elements of a contiguous tensor are
    consecutive whatever those strides are."""
    if not t.is_contiguous():
        raise ValueError(f"byte_view of a non-contiguous tensor {tuple(t.shape)} strides {t.stride()}")
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def _grid(shape: Sequence[int], block: Sequence[int]) -> tuple[int, int, int, int]:
    """A tensor of ``shape`` as 2-D rows x cols (leading dims merged into rows; their blocks are 1)
    cut into blocks of ``block[-2:]``: (block rows, rows per block, block cols, cols per block)."""
    if any(b != 1 for b in block[:-2]) or len(shape) != len(block) or len(shape) < 2:
        raise CheckpointFormatError(f"block {tuple(block)} is no 2-D grid of a tensor of shape {tuple(shape)}")
    rows, cols = math.prod(shape[:-1]), int(shape[-1])
    rb, cb = int(block[-2]), int(block[-1])
    if rows % rb or cols % cb:
        raise CheckpointFormatError(f"a tensor of shape {tuple(shape)} is not whole blocks of {tuple(block)}")
    return rows // rb, rb, cols // cb, cb


def blocks_as_groups(t: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """The elements of ``t`` (whole blocks of ``block``) with each block's consecutive, blocks in
    row-major order of the grid: 1-D, the order :meth:`Flat.on_shard` grouped them in."""
    n, rb, m, cb = _grid(t.shape, block)
    return t.reshape(n, rb, m, cb).permute(0, 2, 1, 3).reshape(-1)


def groups_as_blocks(flat: torch.Tensor, block: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """The inverse of :func:`blocks_as_groups`: a tensor of ``shape`` from its grouped elements."""
    n, rb, m, cb = _grid(shape, block)
    return flat.reshape(n, m, rb, cb).permute(0, 2, 1, 3).reshape(tuple(shape))


PLAIN_TARGET = "a plain tensor target, which loads from any sharding (the dequantized values)"


def nearest_aligned(layouts: dict[str, Layout], shape: Sequence[int], chunk: Chunk,
                    otherwise: str = PLAIN_TARGET) -> str:
    """For an error about ``chunk`` of a tensor of ``shape`` whose components have ``layouts``: what
    splits blocks (per dim, the blocks of every :class:`Blocked` layout together) and the nearest
    layouts whose shards do not, else ``otherwise``; "" where ``chunk`` falls on them on every dim."""
    notes, fixes = [], []
    for d, (o, s, n) in enumerate(zip(chunk[0], chunk[1], shape)):
        b = _dim_block(layouts, len(shape), d)
        if o % b == 0 and ((o + s) % b == 0 or o + s == n):
            continue
        what = "rows" if d == 0 else "columns" if d == len(shape) - 1 else f"indices of dim {d}"
        notes.append(f"this shard holds {s} {what}, less than one block of {b}" if s < b
                     else f"its {what} [{o}, {o + s}) cut blocks of {b}")
        fixes.append(_aligned_cut(d, n, b, s, what, _dim_block(layouts, len(shape), 0)))
    if not fixes:
        return ""
    return f" ({'; '.join(notes)}). The nearest layout that works: {'; '.join(fixes)}; or {otherwise}"


def _dim_block(layouts: dict[str, Layout], rank: int, d: int) -> int:
    """The logical extent along dim ``d`` that every Blocked layout's blocks fall on."""
    return math.lcm(1, *(lay.block[d] for lay in layouts.values()
                         if isinstance(lay, Blocked) and len(lay.block) == rank and lay.block[d]))


def _aligned_cut(d: int, n: int, b: int, s: int, what: str, row_block: int) -> str:
    """The nearest Shard(d) (no more shards than now) whose shards fall on blocks of ``b``, and
    the layouts that keep dim ``d`` whole."""
    now = ceil_div(n, max(s, 1))  # about how many shards cut dim d now
    k = next(k for k in range(now, 0, -1) if k == 1 or ceil_div(n, k) % b == 0)
    rows = f", its shards on multiples of {row_block} rows" if row_block > 1 else ""
    how = "Replicate() on the mesh dimension that cuts it" + (f", or Shard(0) there instead{rows}" if d else "")
    if k == 1:
        return f"dim {d} whole on every rank ({how}; its {n} {what} do not split into shards of whole blocks of {b})"
    return f"Shard({d}) over {k} ranks ({ceil_div(n, k)} {what} each), or dim {d} whole on every rank ({how})"


def layout_from_json(data: dict, component_shape: Sequence[int]) -> Layout:
    """Rebuild a layout recorded in a spec (``component_shape`` fills in a replicated one)."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "blocked":
        block = data.get("block")
        if (not isinstance(block, list) or len(block) > 16
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block)):
            raise CheckpointFormatError(f"bad block {block!r}")
        return Blocked(tuple(block))
    if kind == "flat":
        g = data.get("group")
        if not isinstance(g, int) or isinstance(g, bool) or g <= 0:
            raise CheckpointFormatError(f"bad flat group {g!r}")
        return Flat(g)
    if kind == "replicated":
        return Replicated(tuple(component_shape))
    raise CheckpointFormatError(f"unknown layout {data!r}")


# ----------------------------------------------------------------------------- the bits a target can hold

def held_exactly(source: torch.Tensor, source_layout: Layout, shape: Sequence[int], read_chunk: Chunk,
                 target_layout: Layout, target_chunk: Chunk) -> torch.Tensor | None:
    """Component ``source`` (read over logical ``read_chunk`` of a tensor of ``shape``, by
    ``source_layout``) as the component of a target shard ``target_chunk`` whose own layout is
    ``target_layout`` (its blocks counted from the shard's first element), where the target holds
    the source's bits exactly; None where it cannot. The rule: docs/api.md, *When a target gets the
    source's bits* (element data copied where both layouts agree; each target block's value taken
    from the source blocks it covers, which must hold one value, bit for bit; replicated copied)."""
    if isinstance(source_layout, Replicated) and isinstance(target_layout, Replicated):
        return source if tuple(source.shape) == tuple(target_layout.shape) else None
    if not (isinstance(source_layout, Blocked) and isinstance(target_layout, Blocked)):
        return None
    if _element_data(source_layout) or _element_data(target_layout):
        if source_layout != target_layout:
            return None
        try:
            want = source_layout.map_chunk(shape, target_chunk)
        except AlignmentError:
            return None
        have = source_layout.map_chunk(shape, read_chunk)
        return narrow(source, relative(want, have))
    out = source
    for d, (bs, bt) in enumerate(zip(source_layout.block, target_layout.block)):
        out = _one_value_per_block(out, d, int(shape[d]), bs, bt, read_chunk[0][d], target_chunk[0][d],
                                   target_chunk[1][d])
        if out is None:
            return None
    return out


def _element_data(layout: Blocked) -> bool:
    """Whether a blocked component holds element data (one item per element, or two packed along
    the last dim) rather than one value per block."""
    return all(b == 1 for b in layout.block[:-1]) and layout.block[-1] in (1, 2)


def _one_value_per_block(values: torch.Tensor, d: int, n: int, bs: int, bt: int, read_start: int,
                         start: int, size: int) -> torch.Tensor | None:
    """Along dim ``d``: ``values`` (one per source block of ``bs``, the first at logical
    ``read_start``'s block) as one per target block of ``bt`` counted from logical ``start`` over
    ``size`` elements; None where a target block covers source blocks of different values."""
    if size == 0:
        return None
    bt = bt or size                      # 0: one value for the whole of the shard's extent
    n_target = ceil_div(size, bt)
    firsts = torch.arange(n_target) * bt + start  # logical first element of each target block
    if bs == 0:                          # the source holds one value along this dim
        return values.index_select(d, torch.zeros(n_target, dtype=torch.long))
    base = read_start // bs
    first_item = firsts // bs - base
    last_item = (torch.clamp(firsts + bt, max=start + size) - 1) // bs - base
    if int(last_item.max()) >= values.shape[d] or int(first_item.min()) < 0:
        return None
    # consecutive source blocks whose boundary lies strictly inside one target block must agree
    bounds = torch.arange(1, values.shape[d]) * bs + base * bs  # logical start of source block i+1
    inside = (bounds > start) & (bounds < start + size) & ((bounds - start) % bt != 0)
    pairs = torch.nonzero(inside).flatten()
    if len(pairs) and not torch.equal(_bits(values.index_select(d, pairs)), _bits(values.index_select(d, pairs + 1))):
        return None
    return values.index_select(d, first_item)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its width, so equality is bitwise (NaNs, signed zeros)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()]) if t.element_size() in ints else t
