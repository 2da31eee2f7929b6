"""The generated load-rule cases of tests/rule_cases.py at N real ranks (torchrun, gloo).

rule_cases.py plays every rank of a job in one process; here each rank is a process of a real job
(``tests/dist_worker.py``'s save job, at 1-4 ranks) and a case goes through the calls a user types:
``dcp.save(state, checkpoint_id=path, planner=QuantizedSavePlanner(...))`` (DCP's writer),
``qdcp.save`` or ``qdcp.async_save``; then ``dcp.load`` with ``QuantizedLoadPlanner()`` through DCP's
reader or qdcp's ``CheckpointReader``, or ``qdcp.load``, into targets at another layout of the same
ranks (on the CPU; half of them on the GPU where the job runs on CUDA, as scripts/gpu_check.sh's
does). Every rank draws the same cases (one seed), gathers each rank's chunk of a layout from the
DTensors themselves, and checks its own target against the same oracle (rule_cases.expected /
check_loaded, written from docs/api.md): the source's bits, the library's quantization of its
values, or the values bitwise. A save the rule refuses must fail on every rank with a qdcp error
naming the key; a load any rank's rule refuses (a TE target TE would have to quantize) must fail on
every rank, every target as it was. Rank 0 then reads the checkpoint without a target
(``read_entry``, ``consolidate`` both ways, ``qdcp verify``).

Collectives run in the same order on every rank whatever a check finds: a failed check is recorded
(``worker_results.check``) and the case goes on.
"""

from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import qdcp
import rule_cases as rc
import rule_te
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner
from rule_cases import Layout
from worker_results import RANK, WORLD, check, qdcp_error_in, short

SECTION = "rule_generated"
SAVES = ("dcp.save", "qdcp.save", "qdcp.async_save")
LOADS = ("dcp.load", "dcp.load + CheckpointReader", "qdcp.load")


def layouts_of(world: int) -> list[Layout]:
    """Every layout the generator draws whose mesh holds exactly ``world`` ranks."""
    out = [Layout((), ())] if world == 1 else []
    out += [Layout((world,), (p,)) for p in (Shard(0), Shard(1), Replicate())]
    for a in range(1, world + 1):
        if world % a:
            continue
        m = (a, world // a)
        out += [Layout(m, (Shard(0), Shard(1))), Layout(m, (_StridedShard(0, split_factor=m[1]), Shard(0))),
                Layout(m, (Replicate(), Shard(0))), Layout(m, (Replicate(), Shard(1))),
                Layout(m, (Shard(0), Replicate()))]
    return out


def draw(rng: random.Random, world: int, devices: tuple[str, ...] = ("cpu",)) -> tuple:
    """A case as rule_cases.case_strategy draws one, its layouts over ``world`` ranks, each target
    on one of ``devices`` (the source is saved from the CPU; a job on CPUs only draws what it drew
    before devices were drawn)."""
    ways = layouts_of(world)
    targets = [(rng.choice(ways), rng.choice(rc.KINDS), rng.choice(devices) if len(devices) > 1 else "cpu")
               for _ in range(rng.randint(1, 2))]
    return (rng.choice(sorted(rc.FAMILIES)), rng.choice([8, 10, 12, 16, 24, 32]), rng.choice([64, 96, 128, 256]),
            rng.randrange(2**16), rng.choice(ways), rng.random() < 0.5, targets)


class Meshes:
    """This job's device meshes by shape (each made once: a 2-D one makes process groups)."""

    def __init__(self) -> None:
        self._made: dict[tuple, object] = {}

    def mesh(self, shape: tuple, device: str = "cpu"):
        if (shape, device) not in self._made:
            self._made[shape, device] = init_device_mesh(device, shape)
        return self._made[shape, device]

    def chunk(self, layout: Layout, shape, dtype) -> tuple:
        """This rank's (offsets, sizes) of a ``shape`` tensor at ``layout``."""
        return rc.chunk_of(rc.spec_of(layout, shape, dtype, self.mesh), shape) if layout.mesh \
            else ((0, 0), tuple(shape))

    def placed(self, layout: Layout, local: torch.Tensor, shape) -> dict:
        """``{"w": local}`` as a DTensor at ``layout`` over a mesh of ``local``'s device type."""
        return rc.placed_state(layout, local, shape, lambda m: self.mesh(m, local.device.type))


def gathered(obj) -> list:
    out: list = [None] * WORLD
    dist.all_gather_object(out, obj)
    return out


def _fail(what: str, e: BaseException) -> None:
    check(SECTION, False, f"{what}: {type(e).__name__}: {short(e)}")


def save(how: str, state: dict, path: str, dequantize: bool) -> BaseException | None:
    try:
        if how == "dcp.save":
            dcp.save(state, checkpoint_id=path, planner=QuantizedSavePlanner(dequantize=dequantize))
        elif how == "qdcp.save":
            qdcp.save(state, path, dequantize=dequantize)
        else:
            fut = qdcp.async_save(state, path, dequantize=dequantize)
            getattr(fut, "upload_completion", fut).result()
        return None
    except BaseException as e:  # noqa: BLE001 (DCP raises CheckpointException; every rank checked against the rule)
        return e


def load(how: str, state: dict, path: str) -> BaseException | None:
    try:
        if how == "dcp.load":
            dcp.load(state, checkpoint_id=path, planner=QuantizedLoadPlanner())
        elif how == "dcp.load + CheckpointReader":
            dcp.load(state, storage_reader=qdcp.storage_reader(path), planner=QuantizedLoadPlanner())
        else:
            qdcp.load(state, path)
        return None
    except BaseException as e:  # noqa: BLE001 (DCP raises CheckpointException, a BaseException)
        return e


def run_case(meshes: Meshes, drawn: tuple, path: str, tag: str) -> list[str]:
    name, rows, cols, seed, layout, sliced, targets = drawn
    shape, sliced = (rows, cols), sliced and rc.FAMILIES[name][0]
    chunks = gathered(meshes.chunk(layout, shape, rc.source_dtype(name)))
    source = rc.make_source(name, shape, seed, layout, sliced, chunks)  # the same on every rank
    if source is None:
        return ["no source"]
    source.dequantized = random.Random(seed * 7177).random() < rc.DEQUANTIZED_SHARE
    how = SAVES[seed % len(SAVES)]
    refused = not source.dequantized and rc.save_refused_by_rule(source)
    err = save(how, meshes.placed(layout, source.locals[RANK][1], shape), path, source.dequantized)
    if err is not None or refused:
        q = qdcp_error_in(err) if err is not None else None
        check(SECTION, refused and q is not None and "'w'" in str(q),
              f"{tag}: {how}: " + (f"refused, the rule accepts it: {short(err)}" if not refused else
                                   "saved, the rule refuses it" if err is None else
                                   f"refused without a qdcp error naming 'w': {short(err)}"))
        if how != "dcp.save" and err is not None and RANK == 0:  # qdcp's writer leaves nothing behind
            left = os.listdir(path) if os.path.isdir(path) else []
            check(SECTION, not left, f"{tag}: the refused {how} left {left}")
        dist.barrier()
        return ["refused at save"]
    outcomes = [check_target(meshes, source, path, t_layout, kind, device, seed + i, f"{tag}, target {i}")
                for i, (t_layout, kind, device) in enumerate(targets)]
    if RANK == 0:
        try:
            outcomes.append(rc.check_read_without_target(source, path))
        except Exception as e:  # noqa: BLE001 (AssertionError: the rule broken)
            _fail(f"{tag}: read without a target", e)
    dist.barrier()
    return outcomes


def check_target(meshes: Meshes, source, path: str, layout: Layout, kind: str, device: str, seed: int,
                 tag: str) -> str:
    """One target of ``kind`` on ``device`` at ``layout``, loaded and checked on every rank; its outcome
    (``"... on cuda"`` for a CUDA target of the CPU's save, as rule_cases counts it)."""
    if kind == "wide" and source.wide is None and not source.dequantized:
        return "no target"
    chunk = meshes.chunk(layout, source.shape, torch.bfloat16)
    target, case = rc.target_maker(source, kind, seed)(chunk, RANK, device)
    if not all(gathered(not isinstance(target, str))):
        return "no target"
    expect, outcome = rc.expected(source, chunk, target, case)
    refused = "refused at load" in gathered(outcome)
    before = rc.inner_bits(target)
    how = LOADS[seed % len(LOADS)]
    with rule_te.context():
        err = load(how, meshes.placed(layout, target, source.shape), path)
    tag = f"{tag} ({kind} on {device} at {layout}, {how})"
    on = "" if device == "cpu" else f" on {device}"
    try:
        if refused:  # planning refused on some rank: DCP fails the load on every rank, before any read
            q = qdcp_error_in(err) if err is not None else None
            assert q is not None and "'w'" in str(q), f"not refused with a qdcp error naming 'w': {short(err)}" \
                if err is not None else "the load was accepted; the rule refuses it on some rank"
            assert rc.bits_equal(rc.inner_bits(target), before), "a refused load changed the target"
            return "refused at load" + on
        assert err is None, f"the load was refused, the rule accepts it: {short(err)}"
        rc.check_loaded(target, expect, outcome, RANK)
    except AssertionError as e:
        _fail(tag, e)
    return outcome + on


def generated_cases(root: str, cases: int, seed: int, device: str = "cpu") -> dict[str, int]:
    """``cases`` drawn cases from ``seed`` at this job's ranks, each saved under ``root``, their
    targets on the CPU or (half of them) on ``device``; the outcomes counted (the same on every
    rank but for the targets each rank checks)."""
    check(SECTION, True, "")  # the section ran (it records only what fails)
    meshes, counts = Meshes(), {}
    rng = random.Random(seed * 1000 + WORLD)
    for i in range(cases):
        drawn = draw(rng, WORLD, ("cpu", device) if device != "cpu" else ("cpu",))
        tag = f"case {i} {drawn[:4]} saved at {drawn[4]}"
        try:
            outcomes = run_case(meshes, drawn, os.path.join(root, f"rule{i}"), tag)
        except Exception as e:  # noqa: BLE001 (a check the helpers assert on every rank alike)
            _fail(tag, e)
            outcomes = ["error"]
        for o in outcomes:
            counts[o] = counts.get(o, 0) + 1
    return counts
