"""Generated checkpoint cases checked against the load rule of docs/api.md (tests/rule_oracle.py).

A case: a type and config (torchao's affine types per row, group and tensor, symmetric and
asymmetric, float8 e4m3 and e5m2, Intx per row with a float32 scale through torchao's
``IntxWeightOnlyConfig(scale_dtype=...)``; MX fp8 / fp4 and NVFP4 with and without a per-tensor scale (its
quantization from the whole tensor's amax), scales swizzled or not (in torchao's layout, padding
zero, after a load); NF4, the ``torchao.optim`` 8-bit, 4-bit and FP8 states, torchao.float8's
training weight; TransformerEngine's Float8 and MXFP8 tensors, tests/rule_te.py, where TE is
installed); a source layout (1 to 8 ranks, 1-D or 2-D mesh, ``Shard(0)``, ``Shard(1)``,
``_StridedShard`` x ``Shard(0)`` as torchtitan's column-parallel FSDP2 x TP, ``Replicate`` and HSDP,
uneven shards, one process holding the tensor itself, no DTensor); each rank's local tensor either
cut from the whole quantized tensor by torchao's own slicing (tensor parallelism as torchao's
recipes shard a quantized weight) or quantized from its own block of the high-precision tensor; and
one to three targets, each a layout and a kind (the same config, another config or family, plain,
plain float32; a TE target that TE would have to quantize is refused at load, TE needing a GPU to
quantize). Every rank of a job is planned and stored in this process (tests/dcp_in_process.py)
through qdcp's real planners; a quarter of the cases are saved to real files through qdcp's writer
and loaded with ``dcp.load`` through qdcp's reader (its threads, its checks of the stored chunks it
reads in part; in place or all or nothing), then loaded once more with one byte of one stored item
flipped: every rank whose reads take it must refuse with a ``ChecksumError`` naming the key and
leave its target bitwise as it was. About one case in seven is saved with ``dequantize=True``
(plain entries at any layout, whatever each shard's configuration: quantized like each target).

Each target is checked against the rule, never against qdcp's own choice: the source's bits where
the rule says so, torchao's quantization of the source's values where it says so, the values
bitwise for a plain target; a save the docs refuse must raise a qdcp error naming the key at
planning. Run many cases from a seed:

    .venv/bin/python tests/rule_cases.py --cases 100000 --seed 1
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import inspect
import os
import random
import sys
import tempfile
import time
import warnings
from typing import Callable

# the tests' helpers, and this checkout's qdcp before any installed one
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard
from torchao.float8 import LinearMMConfig  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale  # noqa: E402
from torchao.quantization import (  # noqa: E402
    Float8Tensor,
    Int8Tensor,
    IntxUnpackedToInt8Tensor,
    IntxWeightOnlyConfig,
    PerAxis,
    PerGroup,
    PerTensor,
    quantize_,
    to_nf4,
)
from torchao.quantization.quant_primitives import MappingType  # noqa: E402

import dcp_in_process as job  # noqa: E402
import qdcp  # noqa: E402
import rule_oracle as rule  # noqa: E402
import rule_te  # noqa: E402
from cli_in_process import qdcp_cli  # noqa: E402
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner  # noqa: E402
from qdcp.adapters import rows as row_blocks  # noqa: E402
from qdcp.errors import ChecksumError, QdcpError, UnsupportedTensorError  # noqa: E402
from quantized_cases import CASE_BY_NAME, Case, bits_diff, components_diff, data_tensors  # noqa: E402
from stored_bytes import flip_item_byte  # noqa: E402
from training_cases import values as training_values  # noqa: E402

warnings.filterwarnings("ignore")

# family -> (can torchao slice its columns, another config of it or another family)
FAMILIES = {
    "int8_row": (True, "intx_int8_row_fp32"),
    "int8_group32": (True, "intx_int8_group32"),  # another affine type of one element kind and block
    "intx_int8_group32": (True, "int8_group32"),
    "intx_int8_row_fp32": (True, "float8_tensor_e5m2"),  # IntxWeightOnlyConfig(scale_dtype=torch.float32)
    "int8_tensor": (True, "int8_row"),
    "int8_asym_row": (True, "int8_row"),
    "float8_row": (True, "float8_group64"),
    "float8_tensor_e5m2": (True, "float8_row"),
    "intx_int4_group32": (True, "intx_int8_row"),
    "intx_int4_group32_asym": (True, "intx_int4_group32"),
    "nvfp4": (True, "mx_fp8"),
    "nvfp4_per_tensor": (True, "nvfp4"),
    "nvfp4_swizzled": (False, "nvfp4_per_tensor_swizzled"),
    "nvfp4_per_tensor_swizzled": (False, "nvfp4"),
    "mx_fp8": (False, "nvfp4"),
    "mx_fp4": (False, "mx_fp8"),
    "mx_fp8_e5m2_swizzled": (False, "mx_fp8"),
    "mx_fp4_swizzled": (False, "mx_fp4"),
    "optim8bit_signed": (False, "optimfp8"),
    "optim4bit": (False, "optim8bit_signed"),
    "optimfp8": (False, "optim4bit"),
    "nf4_b16": (True, "nf4_b32"),   # torchao cuts NF4 only into equal row chunks (torch.chunk)
    "float8_training": (False, "int8_row"),  # torchao.float8's FSDP2 weight: bf16 in a wrapper
    # TransformerEngine (its classes on CPU; TE cannot quantize here: a target whose values it
    # would have to quantize is refused), where TE is installed
    **({"te_float8": (True, "te_mxfp8"), "te_mxfp8": (True, "mx_fp8")} if rule_te.FAMILIES else {}),
}
# NF4 with blocks small enough for the generator's shapes (torchao's default needs 16,384 elements)
CASE_BY_NAME = {**CASE_BY_NAME, "intx_int8_group32": Case(
    "intx_int8_group32", lambda hp: IntxUnpackedToInt8Tensor.from_hp(hp, (1, 32), torch.int8)),
    "intx_int8_row_fp32": Case("intx_int8_row_fp32", lambda hp: intx_config_quantized(
        hp, (1, hp.shape[1]), torch.int8, MappingType.SYMMETRIC, torch.float32)), **{
    name: Case(name, lambda hp, b=b, s=s: to_nf4(hp.contiguous(), b, s), dequantize=lambda t: t.get_original_weight())
    for name, b, s in (("nf4_b16", 16, 16), ("nf4_b32", 32, 8))},
    "float8_training": Case("float8_training", lambda hp: WeightWithDynamicFloat8CastTensor(
        hp.clone(), LinearMMConfig(), torch.float8_e4m3fn), dequantize=training_values),
}


def wraps_values(t: torch.Tensor) -> bool:
    """A training weight that holds its values in one high-precision tensor (stored as that tensor)."""
    return isinstance(t, WeightWithDynamicFloat8CastTensor)


KINDS = ("same", "other", "plain", "wide")  # wide: a plain float32 target of a bfloat16 source
# the target's device: another device than the source's (saved from the CPU) where one is here
DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
OUTCOMES = collections.Counter()


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh shape and placements (``()``: one process, plain tensors)."""

    mesh: tuple[int, ...]
    placements: tuple

    @property
    def world(self) -> int:
        return int(torch.tensor(self.mesh).prod()) if self.mesh else 1


def layouts() -> st.SearchStrategy[Layout]:
    one_d = st.builds(lambda w, p: Layout((w,), (p,)), st.integers(1, 8),
                      st.sampled_from([Shard(0), Shard(1), Replicate()]))
    two_d = st.tuples(st.integers(1, 4), st.integers(1, 4)).flatmap(lambda m: st.sampled_from([
        Layout(m, (Shard(0), Shard(1))),                               # row-parallel FSDP2 x TP
        Layout(m, (_StridedShard(0, split_factor=m[1]), Shard(0))),    # column-parallel FSDP2 x TP
        Layout(m, (Replicate(), Shard(0))),                            # HSDP
        Layout(m, (Replicate(), Shard(1))),
        Layout(m, (Shard(0), Replicate())),
    ]))
    return st.one_of(st.just(Layout((), ())), one_d, two_d)


def spec_of(layout: Layout, shape, dtype, mesh: Callable = job.mesh) -> DTensorSpec:
    """The DTensor spec of a ``shape`` tensor at ``layout``, seen from the current rank (of a fake
    job; ``mesh``: the maker of a mesh of a shape, another for a real job)."""
    stride = torch.empty(shape, device="meta").stride()
    return DTensorSpec(mesh(layout.mesh), layout.placements, TensorMeta(torch.Size(shape), stride, dtype))


def chunk_of(spec: DTensorSpec, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    probe = DTensor(torch.empty(0), spec, requires_grad=False)
    c = probe.__create_chunk_list__()[0]
    return tuple(c.offsets), tuple(c.sizes)


_CHUNKS: dict = {}


def rank_chunk(layout: Layout, shape, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rank ``rank``'s (offsets, sizes) of a ``shape`` tensor at ``layout`` (DTensor's own cut, seen
    from that rank of a fake job; each kept, since a mesh costs a millisecond to make)."""
    if not layout.mesh:
        return (0, 0), tuple(shape)
    key = (layout, tuple(shape), rank)
    if key not in _CHUNKS:
        with job.as_rank(rank, layout.world):
            _CHUNKS[key] = chunk_of(spec_of(layout, shape, torch.bfloat16), shape)
    return _CHUNKS[key]


def cut(t: torch.Tensor, chunk) -> torch.Tensor | None:
    (r, c), (nr, nc) = chunk
    if type(t).__name__ == "NF4Tensor":  # torchao's NF4 splits only into equal chunks of rows (FSDP2's)
        whole_rows = (c, nc) == (0, t.shape[1])
        return torch.chunk(t, t.shape[0] // nr, dim=0)[r // nr] if whole_rows and nr and t.shape[0] % nr == 0 \
            and r % nr == 0 else None
    return t[r:r + nr, c:c + nc]


def build_local(name: str, hp: torch.Tensor, whole: torch.Tensor | None, chunk) -> torch.Tensor | None:
    """The local tensor of ``chunk``: cut from ``whole`` by torchao's slicing, or quantized from its
    own block of ``hp``; None where torchao cannot make it (an empty or unaligned shard)."""
    try:
        case = CASE_BY_NAME[name]
        local = cut(whole, chunk) if whole is not None else case.from_hp(cut(hp, chunk).contiguous())
        if local is None:
            return None
        case.dequantize(local)  # torchao's slicing keeps blocks a cut splits: such a shard is none
        return local if tuple(local.shape) == tuple(chunk[1]) and local.numel() else None
    except Exception:  # noqa: BLE001 (torchao refuses the shard: not a case)
        return None


def placed_state(layout: Layout, local: torch.Tensor, shape, mesh: Callable = job.mesh) -> dict:
    if not layout.mesh:
        return {"w": local}
    return {"w": DTensor(local, spec_of(layout, shape, local.dtype, mesh), requires_grad=False)}


@dataclasses.dataclass
class Source:
    """A saved source: what each rank held and the whole tensor's values and per-element maps."""

    name: str
    shape: tuple[int, int]
    locals: list
    values: torch.Tensor
    maps: dict
    groups: tuple | None
    config: tuple
    wide: torch.Tensor | None  # the values computed in float32 by the library (bfloat16 sources)
    dequantized: bool = False  # saved with dequantize=True: plain entries of its values


def make_local(name: str, seed: int, shape, sliced: bool):
    """A maker of each rank's local tensor of ``chunk``: cut from one whole tensor (``sliced``) or
    quantized on its own; it returns None where the library cannot make it."""
    te = rule_te.FAMILIES.get(name)
    if te is not None:
        whole = te.draw(tuple(shape), seed) if sliced else None

        def make(chunk, rank):
            if not chunk[1][0] * chunk[1][1]:
                return None
            if whole is None:
                return te.make(chunk[1], seed + 101 * (1 + chunk[0][0] * 997 + chunk[0][1]))  # replicas alike
            part = te.cut(whole, chunk)
            with rule_te.context():
                return None if part is None else te.build(part, chunk[1])
        return make
    case = CASE_BY_NAME[name]
    hp = case.hp(seed, shape)
    try:
        whole = case.from_hp(hp) if sliced else None
    except AssertionError:  # torchao makes no whole tensor of this shape (NF4 of 72 scalers): no slice of one
        return lambda chunk, rank: None
    return lambda chunk, rank: build_local(name, hp, whole, chunk)


def maps_of(t: torch.Tensor) -> dict:
    if rule_te.is_te(t):
        return rule_te.family_of(t).element_maps(t)
    return {} if wraps_values(t) else rule.element_maps(t)


def values_of(name: str, t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as its library gives them (its ``dequantize()``)."""
    return rule_te.family_of(t).values(t) if rule_te.is_te(t) else CASE_BY_NAME[name].dequantize(t)


def wide_values_of(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor's values computed in float32 by its library (``dequantize(output_dtype=...)``): what a
    float32 plain target gets (docs/adapters.md: never values rounded through bfloat16); None where
    the library computes no other precision."""
    if wraps_values(t) or rule_te.is_te(t) or "output_dtype" not in inspect.signature(t.dequantize).parameters:
        return None
    return t.dequantize(output_dtype=torch.float32)


def config_of(t: torch.Tensor):
    if rule_te.is_te(t):
        return rule_te.config(t)
    return None if wraps_values(t) else rule.config(t)


def source_dtype(name: str) -> torch.dtype:
    return CASE_BY_NAME[name].dtype if name in CASE_BY_NAME else torch.bfloat16


def make_source(name: str, shape, seed: int, layout: Layout, sliced: bool, chunks: list | None = None) -> Source | None:
    """Every rank's local tensor and the whole tensor's values and maps; ``chunks``: each rank's
    (offsets, sizes), where a real job gathered them (else computed here, rank by rank)."""
    make = make_local(name, seed, shape, sliced)
    dtype = source_dtype(name)
    locals_, maps, values = [], {}, torch.zeros(shape, dtype=dtype)
    wide = torch.zeros(shape, dtype=torch.float32) if dtype == torch.bfloat16 else None
    group_ids = torch.zeros(shape, dtype=torch.int64)
    for rank in range(layout.world):
        chunk = chunks[rank] if chunks is not None else rank_chunk(layout, shape, rank)
        local = make(chunk, rank)
        if local is None:
            return None
        locals_.append((chunk, local))
        region = (slice(chunk[0][0], chunk[0][0] + chunk[1][0]), slice(chunk[0][1], chunk[0][1] + chunk[1][1]))
        values[region] = values_of(name, local)
        local_wide = wide_values_of(local) if wide is not None else None
        if local_wide is None:
            wide = None
        else:
            wide[region] = local_wide
        for k, v in maps_of(local).items():
            maps.setdefault(k, torch.zeros(shape, dtype=v.dtype))[region] = v
        if flat_blocks(name):
            group_ids[region] = rank * shape[0] * shape[1] + rule.target_blocks(local)
    groups = None
    if flat_blocks(name):
        _, dense = torch.unique(group_ids, return_inverse=True)
        groups = (dense, torch.bincount(dense.reshape(-1)))
    return Source(name, shape, locals_, values, maps, groups, config_of(locals_[0][1]), wide)


def flat_blocks(name: str) -> bool:
    """Blocks over runs of the flattened elements of a shard (torchao's optimizer states, NF4)."""
    return name.startswith(("optim", "nf4"))


def whole_rows(source: Source) -> bool:
    """The docs' whole-row case: a 2-D blocked tensor cut by columns, every shard's blocks spanning
    its own columns, its block values one per row across the shards (torchao's tensor-parallel
    slicing of a per-row weight): stored as whole rows, even where the cuts are uneven."""
    if flat_blocks(source.name) or rule_te.is_te(source.locals[0][1]) or wraps_values(source.locals[0][1]):
        return False
    if len({rule.config(t) for _, t in source.locals}) > 1:
        return False
    for (_, (rows, cols)), t in source.locals:  # (MX / NVFP4 blocks are fixed: an int)
        if not isinstance(t.block_size, (list, tuple)):
            return False
        if t.block_size[1] != cols or t.block_size[0] != source.locals[0][1].block_size[0]:
            return False
    if all(cols == source.shape[1] for (_, (_, cols)), _ in source.locals):
        return False  # no column cut
    return all(torch.equal(m, m[:, :1].expand_as(m)) for k, m in source.maps.items()
               if k not in ("code", *rule.per_tensor(source.locals[0][1])))


def save_refused_by_rule(source: Source) -> bool:
    """The docs' save rule: every shard of an entry has one configuration, blocks included, one value
    of what the tensor holds once (per-tensor scale, NF4's scaler mean), and owns whole blocks
    (its first element starts one); NF4 is cut into runs of its flattened elements (row ranges);
    torchao optimizer states (blocks over a shard's own elements) of a shard that is no row
    range form a grid (columns a multiple of the block, or dividing it with whole blocks of
    rows), the same grid for every such shard, each shard starting a block of it."""
    if wraps_values(source.locals[0][1]):  # values: any layout
        return False
    if rule_te.is_te(source.locals[0][1]):  # whole blocks (the cut makes no other); one per-tensor scale
        return len({maps_of(t).get("per_tensor_scale", torch.zeros(1, 1))[0, 0].item() for _, t in source.locals}) > 1
    blocks = stored_blocks(source)
    if blocks is None:  # one value for the whole tensor that the shards do not share
        return True
    configs = {(rule.config(t), repr(b)) for (_, t), b in zip(source.locals, blocks)}
    if whole_rows(source):  # a per-row weight cut by columns (its shards' blocks span their columns)
        return False
    if len(configs) > 1:
        return True
    for comp in rule.per_tensor(source.locals[0][1]):  # held once for the whole tensor: one value
        if len({rule.element_maps(t)[comp][0, 0].item() for _, t in source.locals}) > 1:
            return True
    grids = set()
    for (offsets, sizes), t in source.locals:
        if source.name.startswith("nf4") and sizes[1] != source.shape[1] and sizes[0] > 1:
            return True  # NF4: runs of the flattened tensor only (row ranges), as torchao shards it
        if flat_blocks(source.name):
            g, (rows, cols) = t.block_size * getattr(t, "scaler_block_size", 1), sizes
            if cols == source.shape[1]:
                continue
            grid = (1, g) if cols % g == 0 else (g // cols, cols) if g % cols == 0 and rows % (g // cols) == 0 \
                else None
            if grid is None or offsets[0] % grid[0] or offsets[1] % grid[1]:
                return True  # its blocks form no grid of the tensor, or not the tensor's
            grids.add(grid)
            continue
        block = t.block_size if isinstance(t.block_size, (list, tuple)) else (1, t.block_size)
        if any(o % b for o, b in zip(offsets, block)) and not rule.one_block_of_its_shape(block, sizes):
            return True
    return len(grids) > 1  # the shards' blocks form one grid


def stored_block_sizes(source: Source) -> list:
    """The blocks a saved entry stores each shard with: a per-row weight cut by columns in whole rows
    (:func:`whole_rows`), a per-tensor one's shards in the whole tensor's block (:func:`stored_blocks`)."""
    if whole_rows(source):
        return [[t.block_size[0], source.shape[1]] for _, t in source.locals]
    return stored_blocks(source) or [t.block_size for _, t in source.locals]


def stored_blocks(source: Source) -> list | None:
    """Each shard's blocks as the docs' save rule reads them: a shard whose one block is its own shape
    (torchao's slicing of a per-tensor tensor) has the whole tensor's block, one value for it, where
    every shard is such a shard and they share the value; otherwise such shards of one row keep
    their own row blocks, and such shards of more rows are refused (None). Others: their own."""
    shape = list(source.shape)
    own = [getattr(t, "block_size", None) for _, t in source.locals]
    spanning = [isinstance(b, (list, tuple)) and rule.one_block_of_its_shape(b, sizes) and list(sizes) != shape
                for ((_, sizes), _), b in zip(source.locals, own)]
    if not any(spanning):
        return own
    values = {tuple(m[0, 0].item() for k, m in sorted(maps_of(t).items()) if k != "code")
              for ((_, t), span) in zip(source.locals, spanning) if span}
    if all(spanning) and len(values) == 1:
        return [shape] * len(own)
    if any(span and sizes[0] > 1 for ((_, sizes), _), span in zip(source.locals, spanning)):
        return None
    return own


def save_source(source: Source, layout: Layout, path: str | None = None):
    """The job's save: (metadata, store), or (metadata, path) where it goes to files at ``path``;
    or the qdcp error a planning rank raised (a refused save to files leaves none)."""
    def state(rank):
        return placed_state(layout, source.locals[rank][1], source.shape)
    planner = functools.partial(QuantizedSavePlanner, dequantize=source.dequantized)
    try:
        if path is None:
            return job.save(state, layout.world, planner)
        return job.save_files(state, layout.world, planner, path, sync_files=False), path
    except QdcpError as e:
        if path is not None:
            left = os.listdir(path) if os.path.isdir(path) else []
            assert not left, f"the refused save left {left} at its path"
        return e


def check_target(source: Source, saved, layout: Layout, kind: str, seed: int, device: str = "cpu",
                 corrupt: bool = False) -> str:
    """Load ``saved`` into a ``kind`` target on ``device`` at ``layout``, rank by rank; the rule's
    outcome (``"... on cuda"`` for a target on another device than the source's). ``corrupt``: the
    files hold a flipped byte; a rank whose load reads it must refuse, its target as it was."""
    if kind == "wide" and source.wide is None and not source.dequantized:
        return "no target"
    targets = target_maker(source, kind, seed)
    outcomes = set()
    for rank in range(layout.world):
        chunk = rank_chunk(layout, source.shape, rank)
        with job.as_rank(rank, layout.world):
            target, case = targets(chunk, rank, device)
            if isinstance(target, str):
                return target
            outcomes.add(_load_and_check(source, saved, layout, rank, chunk, target, case, seed, corrupt))
    return "+".join(sorted(outcomes)) + ("" if device == "cpu" else f" on {device}")


def target_maker(source: Source, kind: str, seed: int) -> Callable:
    """``(chunk, rank, device) -> (target, its Case)`` for a ``kind`` target of ``source``; the
    target is a string (``"no target"``) where the library cannot make that chunk."""
    name = source.name if kind == "same" else FAMILIES[source.name][1]
    case = CASE_BY_NAME.get(name)
    make = make_local(name, seed + 1, source.shape, FAMILIES.get(name, (False,))[0] and seed % 2) \
        if kind in ("same", "other") else None

    def target(chunk, rank: int, device: str):
        if kind in ("plain", "wide"):
            dtype = source.values.dtype if kind == "plain" else torch.float32
            return torch.zeros(chunk[1], dtype=dtype, device=device), case
        made = make(chunk, rank)
        if made is None:
            return "no target", case
        if device != "cpu":
            try:
                made = made.to(device)
            except Exception:  # noqa: BLE001 (the library cannot move it: not a case)
                return f"no target on {device}", case
        return made, case
    return target


def _load_and_check(source: Source, saved, layout: Layout, rank: int, chunk, target, case, seed: int,
                    corrupt: bool = False) -> str:
    expect, outcome = expected(source, chunk, target, case)
    metadata, store = saved
    before = inner_bits(target)
    with rule_te.context(), _dequantized_by_rows(seed):
        try:
            state = placed_state(layout, target, source.shape)
            if isinstance(store, str):  # files: dcp.load through qdcp's reader, in place or all or nothing
                job.load_files(state, store, QuantizedLoadPlanner(atomic=corrupt or _atomic(seed, rank)))
            else:
                job.load(state, rank, layout.world, metadata, store, QuantizedLoadPlanner(),
                         order=_read_order(seed, rank))
            assert outcome != "refused at load", f"rank {rank}: TE would have to quantize, the load was accepted"
        except ChecksumError as e:
            assert corrupt, f"rank {rank}: {e}"
            assert "'w'" in str(e), f"the error names no key: {e}"
            assert bits_equal(inner_bits(target), before), f"rank {rank}: a load refused for a corrupt byte " \
                f"changed its target"
            return "refused: corrupt byte"
        except QdcpError as e:
            assert outcome == "refused at load", f"rank {rank}: the load was refused, the rule accepts it: {e}"
            assert "'w'" in str(e), f"the error names no key: {e}"
    check_loaded(target, expect, outcome, rank)
    return outcome


def expected(source: Source, chunk, target: torch.Tensor, case) -> tuple:
    """What the rule says ``target`` (the chunk ``chunk`` of the tensor) holds after a load of
    ``source``, and the outcome's name: (expected maps / tensor, outcome)."""
    region = (slice(chunk[0][0], chunk[0][0] + chunk[1][0]), slice(chunk[0][1], chunk[0][1] + chunk[1][1]))
    values = source.values[region]
    if type(target) is torch.Tensor and target.dtype != values.dtype and not source.dequantized:
        expect, outcome = source.wide[region].to(target.device), "wide"  # the library's own float32
    elif type(target) is torch.Tensor or wraps_values(target):
        expect, outcome = values.to(target.dtype), "plain"
    elif source.dequantized:  # plain entries of the values: quantized like the target
        if rule_te.is_te(target):  # TE cannot quantize here
            expect, outcome = maps_of(target), "refused at load"
        else:
            expect, outcome = quantize_like(target, case, values.to(target.device, case.dtype).contiguous(),
                                            source.values, chunk), "quantized"
    else:
        maps = {k: v[region] for k, v in source.maps.items()}
        groups = (source.groups[0][region], source.groups[1]) if source.groups is not None else None
        te_view = rule_te.is_te(target) or source.name in rule_te.FAMILIES
        view = rule_te.view(target) if te_view else rule.view(_on_cpu(target))  # its layout, on any device
        converted = raw_conversion(source, maps, target, chunk)
        if converted is not None:  # another affine type of the same element kind and block
            expect, outcome = converted, "bits of another type"
        elif rule.gets_source_bits(maps, groups, view, source.config):
            expect, outcome = maps, "bits"
        elif rule_te.is_te(target):  # TE cannot quantize here
            expect, outcome = maps_of(target), "refused at load"
        else:  # the library's quantization, with the target's config, on the target's device
            expect, outcome = quantize_like(target, case, values.to(target.device, case.dtype).contiguous(),
                                            source.values, chunk), "quantized"
    return expect, outcome


def check_loaded(target: torch.Tensor, expect, outcome: str, rank: int) -> None:
    """``target`` after its load holds what :func:`expected` said (a refused load: as it was)."""
    assert _devices(target) <= {target.device.type}, f"rank {rank}: inner buffers left {target.device}"
    target, expect = _on_cpu(target), _on_cpu(expect)  # compared on the host
    if outcome == "refused at load":
        assert rule.maps_equal(maps_of(target), expect), f"rank {rank}: a refused load changed the target"
    elif wraps_values(target):
        assert bits_diff(training_values(target), expect) is None, f"rank {rank}: not the source's values"
    elif outcome in ("bits", "bits of another type"):
        assert rule.maps_equal(maps_of(target), expect), f"rank {rank}: not the source's bits ({outcome})"
        assert rule.swizzled_as_torchao_lays_out(target), f"rank {rank}: swizzled scales not in torchao's layout"
    elif outcome in ("plain", "wide"):
        assert bits_diff(target, expect) is None, f"rank {rank}: {outcome}: {bits_diff(target, expect)}"
    elif isinstance(expect, dict):  # the element maps of the whole tensor quantized, over the target's part
        assert rule.maps_equal(maps_of(target), expect), f"rank {rank}: not the whole tensor's quantization"
    else:
        diff = components_diff(target, expect)
        assert diff is None, f"rank {rank}: not torchao's quantization of the values: {diff}"


def inner_bits(t: torch.Tensor) -> list[torch.Tensor]:
    """Copies of the bytes of every tensor ``t`` holds its data in (its inner buffers, nested)."""
    flats = [b.detach().to("cpu").reshape(-1) for b in data_tensors(t)]
    return [torch.empty(f.shape, dtype=f.dtype).copy_(f).view(torch.uint8) for f in flats]


def bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _atomic(seed: int, rank: int) -> bool:
    """A load from files is all or nothing (``atomic=True``, ``qdcp.load``'s default) for about half
    the cases, in place (DCP's way) for the others."""
    return random.Random(seed * 6151 + rank).random() < 0.5


AFFINE_INT = ("Int8Tensor", "IntxUnpackedToInt8Tensor")


def raw_conversion(source: Source, maps: dict, target: torch.Tensor, chunk) -> dict | None:
    """docs/api.md: a raw entry of another of torchao's affine types of one element kind and block
    (``Int8Tensor`` <-> ``IntxUnpackedToInt8Tensor`` int8) is copied raw where the target's scale
    dtype holds the scales exactly and a symmetric target gets symmetric data: the element maps the
    target then holds (its codes the source's, its block values the source's in its dtypes); None
    for any other pair, or where those conditions do not hold (then the rule's case 2)."""
    src = source.locals[0][1]
    kinds = {type(src).__name__, type(target).__name__}
    if len(kinds) != 2 or not kinds <= set(AFFINE_INT):
        return None
    if any(getattr(t, "target_dtype", torch.int8) != torch.int8 for t in (src, target)):
        return None  # another element kind
    block = tuple(target.block_size)
    if any(tuple(b) != block for b in stored_block_sizes(source)) or any(o % b for o, b in zip(chunk[0], block)):
        return None  # not the source's blocks (as the entry stores them)
    src_dtypes = dict(source.config[2])
    out = {"code": maps["code"]}
    for name in ("scale", "zero_point"):
        stored = maps[name].view(src_dtypes[name])
        held = stored.to(getattr(target, name).dtype)
        if not torch.equal(held.to(stored.dtype), stored):
            return None  # the target's dtype does not hold the source's values
        out[name] = rule.as_ints(held)
    symmetric_target = not getattr(target, "zero_point").any()
    if symmetric_target and maps["zero_point"].any():
        return None
    return out


def _read_order(seed: int, rank: int) -> int | None:
    """The order a load's reads arrive in: the plan's for about half the cases, shuffled (with a
    seed of the case's) for the others: qdcp's reader commits the items of different files in any
    interleaving."""
    pick = random.Random(seed * 4099 + rank)
    return None if pick.random() < 0.5 else pick.randrange(1 << 30)


@contextlib.contextmanager
def _dequantized_by_rows(seed: int):
    """For about half the cases, a load dequantizes a stored chunk one block of rows at a time
    (the least :data:`qdcp.adapters.rows.DEQUANTIZE_ELEMENTS` allows): a case's tensors are
    smaller than the default's blocks, and the values must not depend on the blocks."""
    before = row_blocks.DEQUANTIZE_ELEMENTS
    if random.Random(seed * 7919).random() < 0.5:
        row_blocks.DEQUANTIZE_ELEMENTS = 1
    try:
        yield
    finally:
        row_blocks.DEQUANTIZE_ELEMENTS = before


def quantize_like(target: torch.Tensor, case: Case, values: torch.Tensor, whole: torch.Tensor,
                  chunk=None) -> torch.Tensor:
    """torchao's own quantization of ``values`` with ``target``'s config. The case's config,
    except for torchao's affine types, whose blocks are the target's own: a column cut of a
    per-group tensor that ends inside a group has blocks of its own columns (torchao's slicing sets
    ``block_size`` to them, e.g. 22 columns of a group-32 tensor: ``[1, 22]``); and a target that
    holds a value once for the whole tensor (rule_oracle.per_tensor: a per-tensor scale, NF4's
    scaler mean) at ``chunk`` of it: ``whole`` (the whole tensor's values) quantized like it, cut to
    ``chunk`` as torchao's slicing (NF4: FSDP2's chunks) cuts it."""
    kind = type(target).__name__
    if kind == "NVFP4Tensor" and target.per_tensor_scale is not None:  # (torchao cuts no swizzled scales)
        scale = per_tensor_amax_to_scale(whole.abs().amax()).to(values.device)
        return NVFP4Tensor.to_nvfp4(values, per_tensor_scale=scale, is_swizzled_scales=target.is_swizzled_scales)
    if rule.per_tensor(target) and chunk is not None and tuple(chunk[1]) != tuple(whole.shape):
        try:
            like = _like(target, case, whole.to(values.device, values.dtype).contiguous())
        except AssertionError:  # torchao makes no whole NF4 tensor of this shape (nor shards of one)
            like = None
        if like is not None and kind != "NF4Tensor":
            return cut(like, chunk)
        if like is not None and nf4_run_of_whole_blocks(target, chunk, whole.shape):  # the whole one's maps there
            (r, c), (nr, nc) = chunk
            return {k: v[r:r + nr, c:c + nc] for k, v in rule.element_maps(like).items()}
    return _like(target, case, values)  # (NF4 cut by columns, no part of a whole NF4 tensor: on its own)


def nf4_run_of_whole_blocks(t: torch.Tensor, chunk, shape) -> bool:
    """Whether an NF4 shard at ``chunk`` is a run of the whole tensor's flattened elements that starts
    and ends on its groups of double-quantized scalers (as torchao's FSDP2 chunks are)."""
    (r, c), (nr, nc) = chunk
    group, numel = t.block_size * t.scaler_block_size, shape[0] * shape[1]
    start, end = r * shape[1], (r + nr) * shape[1]
    return (c, nc) == (0, shape[1]) and start % group == 0 and (end % group == 0 or end == numel)


def _like(target: torch.Tensor, case: Case, values: torch.Tensor) -> torch.Tensor:
    block = getattr(target, "block_size", None)
    kind = type(target).__name__
    # torchao's int tensors do not record their mapping: all-zero zero points are symmetric (docs/adapters.md)
    zero = getattr(target, "zero_point", None)
    mapping = MappingType.SYMMETRIC if zero is None or not zero.any() else MappingType.ASYMMETRIC
    if kind in ("Int8Tensor", "Float8Tensor") and rule.one_block_of_its_shape(block, target.shape):
        return Int8Tensor.from_hp(values, PerTensor(), mapping_type=mapping) if kind == "Int8Tensor" else \
            Float8Tensor.from_hp(values, granularity=PerTensor(), float8_dtype=target.qdata.dtype)
    if kind in ("Int8Tensor", "Float8Tensor") and block is not None and block[0] == 1:
        granularity = PerGroup(block[-1])
        return Int8Tensor.from_hp(values, granularity, mapping_type=mapping) if kind == "Int8Tensor" else \
            Float8Tensor.from_hp(values, granularity=granularity, float8_dtype=target.qdata.dtype)
    if kind == "IntxUnpackedToInt8Tensor":  # torchao's own config path (its scale dtype too)
        return intx_config_quantized(values, tuple(block), target.target_dtype, mapping, target.scale.dtype)
    return case.from_hp(values)


def intx_config_quantized(values: torch.Tensor, block, weight_dtype, mapping, scale_dtype) -> torch.Tensor:
    """``values`` quantized by torchao's ``quantize_`` with ``IntxWeightOnlyConfig`` (its own config
    path: a scale dtype other than the values' recomputes the codes with the cast scale)."""
    rows, cols = values.shape
    linear = torch.nn.Linear(cols, rows, bias=False, dtype=values.dtype, device=values.device)
    with torch.no_grad():
        linear.weight.copy_(values)
    granularity = PerAxis(0) if block[-1] == cols else PerGroup(block[-1])
    quantize_(linear, IntxWeightOnlyConfig(weight_dtype=weight_dtype, granularity=granularity, mapping_type=mapping,
                                           scale_dtype=scale_dtype))
    return linear.weight


def _devices(t: torch.Tensor) -> set[str]:
    """The device types of ``t``'s storage: its own, or its inner buffers' for a wrapper subclass."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return {t.device.type}
    names, _ = t.__tensor_flatten__()
    return {getattr(t, n).device.type for n in names if isinstance(getattr(t, n), torch.Tensor)}


def _on_cpu(x):
    if isinstance(x, dict):
        return {k: _on_cpu(v) for k, v in x.items()}
    return x.to("cpu") if isinstance(x, torch.Tensor) and x.device.type != "cpu" else x


def run_case(name: str, rows: int, cols: int, seed: int, source_layout: Layout, sliced: bool,
             targets: list[tuple]) -> list[str]:
    """One generated case: the outcomes of its targets (or of its save)."""
    sliced = sliced and FAMILIES[name][0]
    source = make_source(name, (rows, cols), seed, source_layout, sliced)
    if source is None:
        return ["no source"]
    source.dequantized = random.Random(seed * 7177).random() < DEQUANTIZED_SHARE
    with _files(seed) as path:
        saved = save_source(source, source_layout, path)
        refused = not source.dequantized and save_refused_by_rule(source)
        if isinstance(saved, QdcpError):
            assert refused, f"the save was refused, the rule accepts it: {saved}"
            assert "'w'" in str(saved), f"the error names no key: {saved}"
            return ["refused at save"]
        assert not refused, "the rule refuses this save, qdcp saved it"
        outcomes = [check_target(source, saved, layout, kind, seed, *device) for layout, kind, *device in targets]
        if path is not None:
            outcomes.append(check_read_without_target(source, path))
            outcomes.append(check_corrupt_byte(source, saved, targets[0], seed))
        return outcomes


# The share of cases saved with dequantize=True (plain entries of the values, any layout)
DEQUANTIZED_SHARE = 0.15

# The share of cases saved to files and loaded with dcp.load through qdcp's reader (its threads,
# its checks of the items it reads in part, all-or-nothing loads), a flipped byte loaded last
FILES_SHARE = 0.25


@contextlib.contextmanager
def _files(seed: int):
    """A fresh directory to save the case to (None: the case runs in memory)."""
    if random.Random(seed * 31337).random() >= FILES_SHARE:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="qdcp-rule-") as tmp:
        yield os.path.join(tmp, "ckpt")


def check_read_without_target(source: Source, path: str) -> str:
    """``qdcp.read_entry(path, key, dequantize=True)`` and ``qdcp.consolidate(path)``, with no target
    and no process group: the whole tensor's values, bitwise those a plain target gets (the
    source's ``dequantize()``); ``consolidate(path, dequantize=False)``: the whole tensor rebuilt as
    its own type holding the source's bits (a dequantized entry: its values); ``qdcp verify``
    finds nothing wrong (and, in :func:`check_corrupt_byte`, names the key once a byte is flipped)."""
    values = qdcp.read_entry(path, "w", dequantize=True)
    assert bits_diff(values, source.values) is None, f"read_entry: {bits_diff(values, source.values)}"
    whole = qdcp.consolidate(path)["w"]
    assert bits_diff(whole, source.values) is None, f"consolidate: {bits_diff(whole, source.values)}"
    grid = source.name.startswith("optim") and any(cols != source.shape[1] for (_, (_, cols)), _ in source.locals)
    try:
        rebuilt = qdcp.consolidate(path, dequantize=False)["w"]
    except UnsupportedTensorError as e:  # docs/adapters.md: an optimizer state cut by columns has no whole form
        assert grid and not source.dequantized and "'w'" in str(e), e
        return "read without a target"
    assert not grid or source.dequantized, "an optimizer state cut by columns was rebuilt whole"
    if source.dequantized or wraps_values(source.locals[0][1]):  # stored as the plain tensor of its values
        assert bits_diff(rebuilt, source.values) is None, f"consolidate: {bits_diff(rebuilt, source.values)}"
    else:  # the whole tensor, rebuilt as its own type: the source's bits
        assert type(rebuilt) is type(source.locals[0][1]), f"consolidate rebuilt a {type(rebuilt).__name__}"
        assert rule.maps_equal(maps_of(rebuilt), source.maps), "consolidate: not the source's bits"
    verified = qdcp_cli("verify", path)
    assert verified.returncode == 0 and "OK: 1 entry, 0 problems" in verified.stdout, verified
    return "read without a target"


def check_corrupt_byte(source: Source, saved, target: tuple, seed: int) -> str:
    """One byte of one stored item's data flipped (a bad disk), the first target loaded again all or
    nothing: a rank whose reads take that item refuses with a ChecksumError naming the key, its
    target bitwise as it was; the others load as the rule says; one rank at least reads it."""
    layout, kind, *device = target
    if flip_item_byte(saved[1], seed) is None:
        return "no stored byte"
    verified = qdcp_cli("verify", saved[1])
    assert verified.returncode == 1 and "FAIL w: ChecksumError: key 'w'" in verified.stdout, verified
    outcome = check_target(source, saved, layout, kind, seed, *device, corrupt=True)
    if outcome.startswith("no ") or "refused at load" in outcome:
        return outcome
    on = f" on {device[0]}" if device and device[0] != "cpu" else ""  # check_target's tag of the whole outcome
    assert "refused: corrupt byte" in outcome.removesuffix(on).split("+"), \
        f"no rank's load noticed the flipped byte: {outcome}"
    return f"refused: corrupt byte{on}"


def case_strategy(families: st.SearchStrategy[str] = st.sampled_from(sorted(FAMILIES))) -> st.SearchStrategy:
    """A case: family, rows, columns, seed, source layout, sliced?, targets (layout, kind, device)."""
    return st.tuples(
        families, st.sampled_from([8, 10, 12, 16, 24, 32]), st.sampled_from([64, 96, 128, 256]),
        st.integers(0, 2**16), layouts(), st.booleans(),
        st.lists(st.tuples(layouts(), st.sampled_from(KINDS), st.sampled_from(DEVICES)), min_size=1, max_size=3))


CASE = case_strategy()


CASES_RUN = collections.Counter()


def check(drawn) -> None:
    for outcome in run_case(*drawn):
        OUTCOMES[outcome] += 1
    CASES_RUN[drawn[0]] += 1
    if PROGRESS_EVERY and sum(CASES_RUN.values()) % PROGRESS_EVERY == 0:
        report(f"after {sum(CASES_RUN.values())} cases")


def report(title: str) -> None:
    print(f"{title}, {time.perf_counter() - T0:.0f} s: {sum(OUTCOMES.values())} targets:", flush=True)
    for outcome, n in OUTCOMES.most_common():
        print(f"  {outcome:<24} {n}")
    print("  cases by family: " + ", ".join(f"{k} {n}" for k, n in sorted(CASES_RUN.items())), flush=True)


PROGRESS_EVERY = 0
T0 = time.perf_counter()


def settings_for(cases: int) -> settings:
    return settings(max_examples=cases, deadline=None, database=None, phases=(Phase.generate,),
                    suppress_health_check=list(HealthCheck))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", type=int, default=1000, help="print the counts every N cases (0: at the end)")
    args = ap.parse_args()
    global PROGRESS_EVERY, T0
    PROGRESS_EVERY, T0 = args.progress, time.perf_counter()
    test = hypothesis_seed(args.seed)(settings_for(args.cases)(given(CASE)(check)))
    test()
    report(f"{sum(CASES_RUN.values())} cases from seed {args.seed}")


if __name__ == "__main__":
    main()
