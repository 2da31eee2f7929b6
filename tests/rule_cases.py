"""Generated checkpoint cases checked against the load rule of docs/api.md (tests/rule_oracle.py).

A case: a torchao type and config; a source layout (1 to 8 ranks, 1-D or 2-D mesh, ``Shard(0)``,
``Shard(1)``, ``_StridedShard`` x ``Shard(0)`` as torchtitan's column-parallel FSDP2 x TP,
``Replicate`` and HSDP, uneven shards, one rank holding a plain tensor); each rank's local
tensor either cut from the whole quantized tensor by torchao's own slicing (tensor parallelism as
torchao's recipes shard a quantized weight) or quantized from its own block of the high-precision
tensor; and one to three targets, each a layout and a kind (the same config, another config or
family, plain). Every rank of a job is planned and stored in this process
(tests/dcp_in_process.py) through qdcp's real planners.

Each target is checked against the rule, never against qdcp's own choice: the source's bits where
the rule says so, torchao's quantization of the source's values where it says so, the values
bitwise for a plain target; a save the docs refuse must raise a qdcp error naming the key at
planning. Run many cases from a seed:

    .venv/bin/python tests/rule_cases.py --cases 100000 --seed 1
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

import dcp_in_process as job  # noqa: E402
import rule_oracle as rule  # noqa: E402
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner  # noqa: E402
from qdcp.errors import QdcpError  # noqa: E402
from quantized_cases import CASE_BY_NAME, bits_diff, components_diff  # noqa: E402

warnings.filterwarnings("ignore")

# family -> (can torchao slice its columns, another config of it or another family)
FAMILIES = {
    "int8_row": (True, "int8_group32"),
    "int8_group32": (True, "int8_row"),
    "float8_row": (True, "float8_group64"),
    "intx_int4_group32": (True, "intx_int8_row"),
    "nvfp4": (True, "mx_fp8"),
    "mx_fp8": (False, "nvfp4"),
    "optim8bit_signed": (False, "optimfp8"),
}
KINDS = ("same", "other", "plain")
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


def spec_of(layout: Layout, shape, dtype) -> DTensorSpec:
    """The DTensor spec of a ``shape`` tensor at ``layout``, seen from the current (fake) rank."""
    stride = torch.empty(shape, device="meta").stride()
    return DTensorSpec(job.mesh(layout.mesh), layout.placements, TensorMeta(torch.Size(shape), stride, dtype))


def chunk_of(spec: DTensorSpec, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    probe = DTensor(torch.empty(0), spec, requires_grad=False)
    c = probe.__create_chunk_list__()[0]
    return tuple(c.offsets), tuple(c.sizes)


def cut(t: torch.Tensor, chunk) -> torch.Tensor:
    (r, c), (nr, nc) = chunk
    return t[r:r + nr, c:c + nc]


def build_local(name: str, hp: torch.Tensor, whole: torch.Tensor | None, chunk) -> torch.Tensor | None:
    """The local tensor of ``chunk``: cut from ``whole`` by torchao's slicing, or quantized from its
    own block of ``hp``; None where torchao cannot make it (an empty or unaligned shard)."""
    try:
        case = CASE_BY_NAME[name]
        local = cut(whole, chunk) if whole is not None else case.from_hp(cut(hp, chunk).contiguous())
        case.dequantize(local)  # torchao's slicing keeps blocks a cut splits: such a shard is none
        return local if tuple(local.shape) == tuple(chunk[1]) and local.numel() else None
    except Exception:  # noqa: BLE001 (torchao refuses the shard: not a case)
        return None


def placed_state(layout: Layout, local: torch.Tensor, shape) -> dict:
    if not layout.mesh:
        return {"w": local}
    return {"w": DTensor(local, spec_of(layout, shape, local.dtype), requires_grad=False)}


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


def make_source(name: str, shape, seed: int, layout: Layout, sliced: bool) -> Source | None:
    case = CASE_BY_NAME[name]
    hp = case.hp(seed, shape)
    whole = case.from_hp(hp) if sliced else None
    locals_, maps, values = [], {}, torch.zeros(shape, dtype=case.dtype)
    group_ids = torch.zeros(shape, dtype=torch.int64)
    for rank in range(layout.world):
        with job.as_rank(rank, layout.world):
            chunk = chunk_of(spec_of(layout, shape, case.dtype), shape) if layout.mesh else ((0, 0), shape)
        local = build_local(name, hp, whole, chunk)
        if local is None:
            return None
        locals_.append((chunk, local))
        region = (slice(chunk[0][0], chunk[0][0] + chunk[1][0]), slice(chunk[0][1], chunk[0][1] + chunk[1][1]))
        values[region] = case.dequantize(local)
        for k, v in rule.element_maps(local).items():
            maps.setdefault(k, torch.zeros(shape, dtype=v.dtype))[region] = v
        if name.startswith("optim"):
            group_ids[region] = rank * shape[0] * shape[1] + rule.target_blocks(local)
    groups = None
    if name.startswith("optim"):
        _, dense = torch.unique(group_ids, return_inverse=True)
        groups = (dense, torch.bincount(dense.reshape(-1)))
    return Source(name, shape, locals_, values, maps, groups, rule.config(locals_[0][1]))


def save_refused_by_rule(source: Source) -> bool:
    """The docs' save rule: every shard of an entry has one configuration, blocks included, and
    owns whole blocks (its first element starts one); torchao optimizer states (blocks over a
    shard's own elements) of a shard that is no row range form a grid (columns a multiple of the
    block, or dividing it with whole blocks of rows)."""
    configs = {(rule.config(t), repr(getattr(t, "block_size", None))) for _, t in source.locals}
    if len(configs) > 1:
        return True
    for (offsets, sizes), t in source.locals:
        if source.name.startswith("optim"):
            g, (rows, cols) = t.block_size, sizes
            if cols != source.shape[1] and not (cols % g == 0 or (g % cols == 0 and rows % (g // cols) == 0)):
                return True
            if cols != source.shape[1] and len({tuple(x.shape) for _, x in source.locals}) > 1:
                return True
            continue
        block = t.block_size if isinstance(t.block_size, (list, tuple)) else (1, t.block_size)
        if any(o % b for o, b in zip(offsets, block)):
            return True
    return False


def save_source(source: Source, layout: Layout):
    """The job's save; (metadata, store), or the qdcp error a planning rank raised."""
    def state(rank):
        return placed_state(layout, source.locals[rank][1], source.shape)
    try:
        return job.save(state, layout.world, QuantizedSavePlanner)
    except QdcpError as e:
        return e


def check_target(source: Source, saved, layout: Layout, kind: str, seed: int) -> str:
    """Load ``saved`` into a ``kind`` target at ``layout``, rank by rank; the rule's outcome."""
    name = source.name if kind == "same" else FAMILIES[source.name][1]
    case = CASE_BY_NAME.get(name)
    other_hp = case.hp(seed + 1, source.shape) if kind != "plain" else None
    whole = case.from_hp(other_hp) if kind != "plain" and FAMILIES.get(name, (False,))[0] and seed % 2 else None
    outcomes = set()
    for rank in range(layout.world):
        with job.as_rank(rank, layout.world):
            chunk = chunk_of(spec_of(layout, source.shape, torch.bfloat16), source.shape) if layout.mesh \
                else ((0, 0), source.shape)
            if kind == "plain":
                target = torch.zeros(chunk[1], dtype=source.values.dtype)
            else:
                target = build_local(name, other_hp, whole, chunk)
                if target is None:
                    return "no target"
            outcomes.add(_load_and_check(source, saved, layout, rank, chunk, target, case))
    return "+".join(sorted(outcomes))


def _load_and_check(source: Source, saved, layout: Layout, rank: int, chunk, target, case) -> str:
    region = (slice(chunk[0][0], chunk[0][0] + chunk[1][0]), slice(chunk[0][1], chunk[0][1] + chunk[1][1]))
    values = source.values[region]
    if type(target) is torch.Tensor:
        expect, outcome = values.to(target.dtype), "plain"
    else:
        maps = {k: v[region] for k, v in source.maps.items()}
        groups = (source.groups[0][region], source.groups[1]) if source.groups is not None else None
        if rule.gets_source_bits(maps, groups, target, source.config):
            expect, outcome = maps, "bits"
        else:
            expect, outcome = case.from_hp(values.to(case.dtype).contiguous()), "quantized"
    metadata, store = saved
    job.load(placed_state(layout, target, source.shape), rank, layout.world, metadata, store,
             QuantizedLoadPlanner())
    if outcome == "bits":
        assert rule.maps_equal(rule.element_maps(target), expect), f"rank {rank}: not the source's bits"
    elif outcome == "plain":
        assert bits_diff(target, expect) is None, f"rank {rank}: {bits_diff(target, expect)}"
    else:
        diff = components_diff(target, expect)
        assert diff is None, f"rank {rank}: not torchao's quantization of the values: {diff}"
    return outcome


def run_case(name: str, rows: int, cols: int, seed: int, source_layout: Layout, sliced: bool,
             targets: list[tuple[Layout, str]]) -> list[str]:
    """One generated case: the outcomes of its targets (or of its save)."""
    sliced = sliced and FAMILIES[name][0]
    source = make_source(name, (rows, cols), seed, source_layout, sliced)
    if source is None:
        return ["no source"]
    saved = save_source(source, source_layout)
    refused = save_refused_by_rule(source)
    if isinstance(saved, QdcpError):
        assert refused, f"the save was refused, the rule accepts it: {saved}"
        assert "'w'" in str(saved), f"the error names no key: {saved}"
        return ["refused at save"]
    assert not refused, "the rule refuses this save, qdcp saved it"
    return [check_target(source, saved, layout, kind, seed) for layout, kind in targets]


def case_strategy(families: st.SearchStrategy[str] = st.sampled_from(sorted(FAMILIES))) -> st.SearchStrategy:
    """A case: family, rows, columns, seed, source layout, sliced?, targets (layout, kind)."""
    return st.tuples(
        families, st.sampled_from([8, 16, 24, 32]), st.sampled_from([64, 96, 128, 256]),
        st.integers(0, 2**16), layouts(), st.booleans(),
        st.lists(st.tuples(layouts(), st.sampled_from(KINDS)), min_size=1, max_size=3))


CASE = case_strategy()


def check(drawn) -> None:
    for outcome in run_case(*drawn):
        OUTCOMES[outcome] += 1


def settings_for(cases: int) -> settings:
    return settings(max_examples=cases, deadline=None, database=None, phases=(Phase.generate,),
                    suppress_health_check=list(HealthCheck))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    test = hypothesis_seed(args.seed)(settings_for(args.cases)(given(CASE)(check)))
    test()
    print(f"{sum(OUTCOMES.values())} targets in {time.perf_counter() - t0:.0f} s:")
    for outcome, n in OUTCOMES.most_common():
        print(f"  {outcome:<24} {n}")


if __name__ == "__main__":
    main()
