"""The script every ``torchrun`` rank runs for ``tests/test_distributed.py``.

    python -m torch.distributed.run --nproc-per-node N tests/dist_worker.py COMMAND DIR

Commands (``N`` is the world size of the job):

- ``reshard-save DIR``: saves, at ``N`` ranks, under ``DIR/n{N}/``: ``main`` (every torchao case of
  ``quantized_cases`` as a DTensor ``Shard(0)`` (raw and dequantized) and ``Replicate()``), and one
  checkpoint per per-tensor-scale case (``pt_<case>``), each saved on its own so that a refused
  save does not hide the others. Checks the save-time behaviour and the ``.metadata``.
- ``reshard-load DIR``: at ``M`` ranks, loads every ``DIR/n*/`` checkpoint into plain ``Shard(0)``
  DTensors, plain full tensors, same-type quantized ``Shard(0)``/``Replicate()`` DTensors, and
  compares with references computed here from the same deterministic data.
- ``fsdp-save DIR`` / ``fsdp-load DIR``: FSDP2 (``fully_shard``) model with NF4 weights and three
  trainable layers driven by ``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8``, saved/loaded through
  ``get_state_dict``/``set_state_dict``.

Every check appends to a named *section*; rank 0 gathers the failures of all ranks, writes them to
``DIR/results-<command>-<world>.json`` (``{section: [failure, ...]}``) and the job exits 1 if any
section failed (2 if it crashed). pytest turns sections into test outcomes.

Local shards are built the way FSDP2 builds its DTensors: ``DTensor(local, DTensorSpec(...))``
without view ops (``DTensor.from_local`` calls ``view_as``, which ``Int8Tensor`` lacks).
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402

from dist_helpers import all_rows, dtensor_from_local, init_torchrun_mesh, my_rows, row_chunks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import qdcp  # noqa: E402
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner  # noqa: E402
from quantized_cases import CASES, SHAPE, bits, buffers_diff, gated_save_planner, inner  # noqa: E402
from stored_bytes import gap_bytes, stored_items  # noqa: E402
from worker_results import RANK, WORLD, check, qdcp_error_in, run, section_error, try_load  # noqa: E402
from worker_results import short as _short  # noqa: E402

# ----------------------------------------------------------------------------- setup

LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
# QDCP_SHARED_GPU=1 (scripts/gpu_check.sh): every rank on GPU 0, over gloo (cpu:gloo,cuda:gloo)
SHARED_GPU = os.environ.get("QDCP_SHARED_GPU") == "1" and torch.cuda.is_available()
USE_CUDA = SHARED_GPU or (torch.cuda.is_available() and torch.cuda.device_count() >= int(
    os.environ.get("LOCAL_WORLD_SIZE", WORLD)))
DEVICE = torch.device("cuda", 0 if SHARED_GPU else LOCAL_RANK) if USE_CUDA else torch.device("cpu")

PER_TENSOR = ("int8_tensor", "float8_tensor_e5m2", "nvfp4_per_tensor", "nvfp4_per_tensor_swizzled")
NF4 = ("nf4", "nf4_block32")
ROW_LOCAL = tuple(c.name for c in CASES if c.name not in PER_TENSOR + NF4)
CASE = {c.name: c for c in CASES}
SEED = {c.name: 100 + i for i, c in enumerate(CASES)}

ROOT = ""  # the job's directory (argv[2])


# ----------------------------------------------------------------------------- DTensors

def make_dtensor(local: torch.Tensor, mesh, placement, shape, dtype) -> DTensor:
    """A DTensor over ``local`` with one ``placement``."""
    return dtensor_from_local(local, mesh, (placement,), shape, dtype)


def nf4_ok(case, world: int, rows: int = SHAPE[0]) -> bool:
    """Whether ``case`` (NF4) shards at ``world`` ranks: torchao splits NF4 on whole scaler blocks."""
    group = _nf4_group(case)
    return all((s * SHAPE[1]) % group == 0 for _, s in row_chunks(rows, world))


def _nf4_group(case) -> int:
    probe = case.from_hp(torch.zeros(SHAPE, dtype=case.dtype))
    return probe.block_size * probe.scaler_block_size


def buildable(name: str, world: int) -> bool:
    return name not in NF4 or nf4_ok(CASE[name], world)


def local_shard(name: str, hp: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s quantized shard of ``hp`` at ``world`` ranks.

    Per-row-block formats and per-tensor formats: the case's ``from_hp`` of the rank's rows (each
    shard quantized on its own, as a sharded quantize does). NF4: ``torch.chunk`` of the globally
    quantized tensor, as FSDP2 shards an ``NF4Tensor`` parameter (one shared ``scaler_mean``).
    """
    case = CASE[name]
    o, s = row_chunks(hp.shape[0], world)[rank]
    if name in NF4:
        return torch.chunk(case.from_hp(hp.to(DEVICE)), world)[rank]
    return case.from_hp(hp[o:o + s].to(DEVICE))


def ref_dequant(name: str, hp: torch.Tensor, world: int) -> torch.Tensor:
    """The global tensor a ``Shard(0)`` checkpoint saved at ``world`` ranks stands for (on CPU)."""
    case = CASE[name]
    return torch.cat([case.dequantize(local_shard(name, hp, world, r)).cpu() for r in range(world)])


# ----------------------------------------------------------------------------- reshard: save

def main_state(mesh, world: int) -> dict:
    """``shard.*`` raw Shard(0), ``deq.*`` dequantized Shard(0), ``repl.*`` raw Replicate()."""
    state: dict = {"step": world, "bias": torch.arange(7, dtype=torch.float32)}
    for c in CASES:
        hp = c.hp(SEED[c.name])
        if c.name not in PER_TENSOR and buildable(c.name, world):
            for prefix in ("shard", "deq"):
                state[f"{prefix}.{c.name}"] = make_dtensor(
                    local_shard(c.name, hp, world, RANK), mesh, Shard(0), SHAPE, c.dtype)
        state[f"repl.{c.name}"] = make_dtensor(c.from_hp(hp.to(DEVICE)), mesh, Replicate(), SHAPE, c.dtype)
    return state


def reshard_save(root: str, mesh) -> None:
    out = os.path.join(root, f"n{WORLD}")
    path = os.path.join(out, "main")
    state = main_state(mesh, WORLD)
    try:
        dcp.save(state, checkpoint_id=path,
                 planner=QuantizedSavePlanner(dequantize=lambda fqn, t: fqn.startswith("deq.")))
    except BaseException as e:  # noqa: BLE001 (CheckpointException is a BaseException)
        section_error("save_main", "dcp.save of the main checkpoint", e)
        return
    check("save_main", True, "")
    dist.barrier()
    if RANK == 0:
        check_metadata(path, WORLD)

    # Per-tensor scales, each shard quantized on its own (its own scale): its own checkpoint each.
    outcomes = {}
    for name in PER_TENSOR:
        case = CASE[name]
        hp = case.hp(SEED[name])
        t = make_dtensor(local_shard(name, hp, WORLD, RANK), mesh, Shard(0), SHAPE, case.dtype)
        try:
            dcp.save({"w": t}, checkpoint_id=os.path.join(out, f"pt_{name}"), planner=QuantizedSavePlanner())
            outcomes[name] = "saved"
        except BaseException as e:  # noqa: BLE001
            q = qdcp_error_in(e)
            outcomes[name] = f"error {type(q or e).__name__}: {_short(q or e, 300)}"
            check(f"save_per_tensor[{name}]", q is not None and "'w'" in str(q),
                  f"{name}: the save failed without a QdcpError naming the key 'w': {_short(e)}")
            check(f"save_per_tensor[{name}]", WORLD > 1, f"{name}: a 1-rank save must work: {_short(e)}")
    if RANK == 0:
        with open(os.path.join(out, "per_tensor_outcomes.json"), "w") as f:
            json.dump(outcomes, f, indent=1)
    dist.barrier()
    direct_writes(out, mesh)
    rule_generated(out)
    rank_alone(out)


# ----------------------------------------------------------------------------- direct writes at N ranks

DIRECT_CASES = 3  # drawn states; each saved by qdcp.async_save (direct_io=True) and qdcp.save (buffered)


def _drawn_state(rng: random.Random, mesh, case: int) -> tuple[dict, dict]:
    """A state of 2-4 entries drawn by ``rng`` (the same draws on every rank), with each rank's
    local shard between 0.5 and 3 MiB (both sides of the 1 MiB a direct write needs): plain tensors
    of four dtypes and Int8Tensor weights, ``Shard(0)`` or ``Replicate()``; and the global values
    each stands for (on CPU; a quantized entry's by its components)."""
    state: dict = {"step": case}
    full: dict = {"step": case}
    for i in range(rng.randint(2, 4)):
        kind = rng.choice(["float32", "bfloat16", "int16", "uint8", "int8_row"])
        itemsize = 1 if kind in ("uint8", "int8_row") else (4 if kind == "float32" else 2)
        cols = rng.choice([256, 384, 1024])
        shard = rng.random() < 0.7
        local_bytes = rng.randint(1 << 19, 3 << 20)
        rows = max(WORLD, (local_bytes * (WORLD if shard else 1)) // (cols * itemsize))
        g = torch.Generator().manual_seed(1000 * case + i)
        placement = Shard(0) if shard else Replicate()
        o, n = row_chunks(rows, WORLD)[RANK] if shard else (0, rows)
        key = f"e{i}"
        if kind == "int8_row":
            hp = torch.randn(rows, cols, generator=g)
            # each rank's rows quantized on their own, as a sharded quantize does; the global
            # components are the ranks' components stacked (per-row scales)
            parts = [CASE["int8_row"].from_hp(hp[a:a + m]) for a, m in row_chunks(rows, WORLD)] if shard \
                else [CASE["int8_row"].from_hp(hp)]
            local = (parts[RANK] if shard else parts[0]).to(DEVICE)
            state[key] = make_dtensor(local, mesh, placement, (rows, cols), torch.float32)
            full[key] = {"qdata": torch.cat([p.qdata for p in parts if p.qdata.shape[0]]),
                         "scale": torch.cat([p.scale for p in parts if p.scale.shape[0]])}
        else:
            dtype = getattr(torch, kind)
            if dtype.is_floating_point:
                value = torch.randn(rows, cols, generator=g).to(dtype)
            else:
                value = torch.randint(0, 200, (rows, cols), generator=g).to(dtype)
            state[key] = make_dtensor(value[o:o + n].to(DEVICE), mesh, placement, (rows, cols), dtype)
            full[key] = value
    return state, full


def _empty_like(state: dict, mesh) -> dict:
    out: dict = {"step": -1}
    for k, v in state.items():
        if not isinstance(v, DTensor):
            continue
        local = v._local_tensor
        if hasattr(local, "qdata"):  # another Int8Tensor of the same shape: its bits replaced by the load
            fresh = CASE["int8_row"].from_hp(torch.zeros(local.shape).to(DEVICE) + 1)
        else:
            fresh = torch.zeros_like(local)
        out[k] = make_dtensor(fresh, mesh, v.placements[0], tuple(v.shape), v.dtype)
    return out


def _same_locals(got: dict, want: dict) -> list[str]:
    """What differs between two states' local shards (every inner buffer, bit for bit) and objects."""
    bad = []
    for k, w in want.items():
        if not isinstance(w, DTensor):
            bad += [] if got[k] == w else [f"{k}: {got[k]!r} != {w!r}"]
            continue
        diff = buffers_diff(got[k]._local_tensor, w._local_tensor)
        bad += [f"{k}: {diff}"] if diff else []
    return bad


def direct_writes(out: str, mesh) -> None:
    """Drawn states saved at N ranks by ``qdcp.async_save`` (each rank's upload writes its large
    items straight from its staging buffers) and by ``qdcp.save`` (buffered): the same stored items
    byte for byte, the direct one with alignment gaps; the direct one read back at N ranks by
    ``qdcp.load`` and by DCP's reader with the planner, every local shard bit-exact; the global
    values written for the test process to load at one rank."""
    rng = random.Random(20261126)
    for case in range(DIRECT_CASES):
        state, full = _drawn_state(rng, mesh, case)
        d, b = os.path.join(out, f"direct{case}"), os.path.join(out, f"buffered{case}")
        try:
            fut = qdcp.async_save(state, d, storage_options={"direct_io": True})  # direct on any host
            getattr(fut, "upload_completion", fut).result()
            qdcp.save(state, b)
        except BaseException as e:  # noqa: BLE001
            section_error("direct_writes", f"case {case}: saving", e)
            return
        dist.barrier()
        if RANK == 0:
            check("direct_writes", stored_items(d) == stored_items(b),
                  f"case {case}: the direct save's stored items differ from the buffered save's")
            gaps = gap_bytes(d), gap_bytes(b)
            check("direct_writes", gaps[0] > 0 and gaps[1] == 0,
                  f"case {case}: gaps {gaps[0]} (direct) / {gaps[1]} (buffered): expected some / none")
            torch.save(full, os.path.join(out, f"direct{case}-expected.pt"))
        for how in ("qdcp.load", "dcp.load"):
            target = _empty_like(state, mesh)
            try:
                if how == "qdcp.load":
                    qdcp.load(target, d)
                else:
                    dcp.load(target, checkpoint_id=d, planner=QuantizedLoadPlanner())
            except BaseException as e:  # noqa: BLE001
                section_error("direct_writes", f"case {case}: {how}", e)
                continue
            for msg in _same_locals(target, state):
                check("direct_writes", False, f"case {case}, {how}: {msg}")
        dist.barrier()


# ----------------------------------------------------------------------------- one rank alone

def rank_alone(out: str) -> None:
    """The last rank of the job, alone (the others wait at a barrier): ``qdcp.save`` /
    ``qdcp.async_save`` / ``qdcp.load`` with ``no_dist=True``, and ``qdcp.consolidate`` /
    ``read_entry``, which run no collective: each returns, the entries bit for bit."""
    check("rank_alone", True, "")
    if RANK == WORLD - 1:
        try:
            state = {"w": CASE["int8_row"].make(3), "b": torch.arange(6, dtype=torch.float32)}
            qdcp.save(state, os.path.join(out, "alone-sync"), no_dist=True)
            fut = qdcp.async_save(state, os.path.join(out, "alone-async"), no_dist=True)
            getattr(fut, "upload_completion", fut).result()
            for how in ("sync", "async"):
                path = os.path.join(out, f"alone-{how}")
                target = {"w": CASE["int8_row"].make(4), "b": torch.zeros(6)}
                qdcp.load(target, path, no_dist=True)
                same = buffers_diff(target["w"], state["w"]) is None and torch.equal(target["b"], state["b"])
                check("rank_alone", same, f"{how}: loaded alone, not the saved bits")
                whole = qdcp.consolidate(path, dequantize=False)
                check("rank_alone", buffers_diff(whole["w"], state["w"]) is None,
                      f"{how}: consolidate: not the saved bits")
                check("rank_alone", torch.equal(qdcp.read_entry(path, "b"), state["b"]), f"{how}: read_entry")
        except BaseException as e:  # noqa: BLE001
            section_error("rank_alone", "saving and loading alone", e)
    dist.barrier()


# ----------------------------------------------------------------------------- the load rule at N ranks

RULE_CASES = 30  # drawn cases per world size (tests/rule_ranks.py); the in-process generator runs thousands


def rule_generated(out: str) -> None:
    """The generated load-rule cases at this job's ranks (tests/rule_ranks.py): saved and loaded with
    DCP's and qdcp's calls across real processes, each rank's target checked against the rule; the
    outcomes' counts written for the test."""
    import rule_ranks

    counts = rule_ranks.generated_cases(os.path.join(out, "rule"), RULE_CASES, seed=20261127, device=DEVICE.type)
    if RANK == 0:
        with open(os.path.join(out, "rule_outcomes.json"), "w") as f:
            json.dump(counts, f, indent=1)
    dist.barrier()


def check_metadata(path: str, world: int) -> None:
    """Replicated components are written once: one chunk, one storage record."""
    md = qdcp.read_metadata(path)
    specs = qdcp.spec.read_specs(md)
    n_replicated = 0
    for fqn, entry in specs.items():
        for c in entry.components:
            item = f"{fqn}.__qdcp__.{c.name}"
            tmd = md.state_dict_metadata.get(item)
            check("metadata", tmd is not None, f"{item} missing from .metadata")
            if tmd is None:
                continue
            stored = [k for k in md.storage_data if k.fqn == item]
            if c.layout.get("kind") == "replicated" or fqn.startswith("repl."):
                n_replicated += 1
                check("metadata", len(tmd.chunks) == 1 and len(stored) == 1,
                      f"{item} ({c.layout}) is replicated but has {len(tmd.chunks)} chunks / "
                      f"{len(stored)} storage records")
            elif c.layout.get("kind") == "blocked" and fqn.startswith("shard."):
                check("metadata", len(tmd.chunks) == world,
                      f"{item}: {len(tmd.chunks)} chunks for a Shard(0) entry saved at {world} ranks")
    check("metadata", n_replicated > 0, "no replicated components seen")
    check("metadata", "step" in md.state_dict_metadata and "bias" in md.state_dict_metadata,
          "plain entries missing")


# ----------------------------------------------------------------------------- reshard: load

def reshard_load(root: str, mesh) -> None:
    for sub in sorted(os.listdir(root)):
        if not (sub.startswith("n") and sub[1:].isdigit()):
            continue
        n = int(sub[1:])
        main = os.path.join(root, sub, "main")
        if os.path.exists(os.path.join(main, ".metadata")):
            load_main(main, n, mesh)
            load_mixed(main, n, mesh)
        for name in PER_TENSOR:
            path = os.path.join(root, sub, f"pt_{name}")
            if os.path.exists(os.path.join(path, ".metadata")):
                load_per_tensor(path, name, n, mesh)
    load_global_amax(mesh)


def _load(section: str, what: str, state: dict, path: str) -> bool:
    err = try_load(state, path)
    if err is not None:
        section_error(section, what, err)
    return err is None


def load_main(path: str, n: int, mesh) -> None:
    """Load the ``n``-rank checkpoint at ``path`` into plain targets and into same-type targets."""
    tag = f"N={n}->M={WORLD}"
    entries = _reference_entries(n)
    _into_plain(path, n, tag, entries, mesh)
    _into_same_type(path, tag, entries, mesh)


def _reference_entries(n: int) -> dict:
    """fqn -> (case name, the global dequantized tensor its entry in an ``n``-rank checkpoint holds)."""
    names = [c.name for c in CASES]
    entries = {}  # fqn -> (case name, reference global dequantized tensor)
    for name in names:
        hp = CASE[name].hp(SEED[name])
        if name not in PER_TENSOR and buildable(name, n):
            ref = ref_dequant(name, hp, n)
            entries[f"shard.{name}"] = (name, ref)
            entries[f"deq.{name}"] = (name, ref)
        entries[f"repl.{name}"] = (name, CASE[name].dequantize(CASE[name].from_hp(hp.to(DEVICE))).cpu())
    return entries


def _into_plain(path: str, n: int, tag: str, entries: dict, mesh) -> None:
    """1. plain Shard(0) DTensors and 2. plain full tensors on every rank: the reference values."""
    for section, sharded in (("plain_shard", True), ("plain_full", False)):
        state = {"step": 0, "bias": torch.zeros(7)}
        for fqn, (name, ref) in entries.items():
            dtype = CASE[name].dtype
            if sharded:
                state[fqn] = make_dtensor(torch.zeros(my_rows(ref).shape, dtype=dtype, device=DEVICE),
                                          mesh, Shard(0), SHAPE, dtype)
            else:
                state[fqn] = torch.zeros(SHAPE, dtype=dtype, device=DEVICE)
        if not _load(section, f"{tag}: load into plain targets", state, path):
            continue
        check(section, state["step"] == n and torch.equal(state["bias"], torch.arange(7.0)),
              f"{tag}: plain entries wrong")
        for fqn, (name, ref) in entries.items():
            got = state[fqn]._local_tensor if sharded else state[fqn]
            want = my_rows(ref) if sharded else ref
            check(section, buffers_diff(got.cpu(), want) is None,
                  f"{tag}: {fqn}: plain target != reference dequantize ({buffers_diff(got.cpu(), want)})")


def _into_same_type(path: str, tag: str, entries: dict, mesh) -> None:
    """3. same type and config, Shard(0): raw -> buffers bit-identical to the source rows' buffers;
    4. Replicate(): bit-identical to the source; 5. dequantized -> quantized like the target.
    Every target's local tensor and buffers are filled in place."""
    state, expect, locals_ = {}, {}, {}
    for fqn, (name, ref) in entries.items():
        case, hp = CASE[name], CASE[name].hp(SEED[name])
        kind = fqn.split(".")[0]
        if kind == "repl":
            local = case.from_hp(case.hp(SEED[name] + 1000).to(DEVICE))
            state[fqn] = make_dtensor(local, mesh, Replicate(), SHAPE, case.dtype)
            expect[fqn] = case.from_hp(hp.to(DEVICE))
        elif not buildable(name, WORLD):
            continue  # no NF4 target shard at this world size (torchao cannot split it)
        else:
            local = local_shard(name, case.hp(SEED[name] + 1000), WORLD, RANK)
            state[fqn] = make_dtensor(local, mesh, Shard(0), SHAPE, case.dtype)
            if kind == "shard":
                expect[fqn] = local_shard(name, hp, WORLD, RANK)
            elif name in NF4:
                expect[fqn] = None  # quantize-on-load into NF4 shards: checked in global_amax
            else:  # dequantized entry: the target's config applied to the reference rows
                expect[fqn] = case.from_hp(my_rows(ref).to(DEVICE))
        locals_[fqn] = (state[fqn]._local_tensor, {k: v.data_ptr() for k, v in inner(local).items()})
    # raw entries (shard.*, repl.*) in one load, dequantized entries (deq.*) in another
    for section, kinds in (("same_type", ("shard", "repl")), ("deq_into_quantized", ("deq",))):
        part = {k: v for k, v in state.items() if k.split(".")[0] in kinds}
        if not _load(section, f"{tag}: load {'/'.join(kinds)} entries into same-type quantized targets",
                     part, path):
            continue
        for fqn in part:
            local, ptrs = locals_[fqn]
            check(section, part[fqn]._local_tensor is local and
                  {k: v.data_ptr() for k, v in inner(local).items()} == ptrs,
                  f"{tag}: {fqn}: the target's local tensor or buffers were replaced, not updated in place")
            if expect[fqn] is not None:
                diff = buffers_diff(local, expect[fqn])
                check(section, diff is None, f"{tag}: {fqn}: {diff}")


def load_mixed(path: str, n: int, mesh) -> None:
    """Raw entries and dequantized entries into quantized targets, in one load."""
    tag = f"N={n}->M={WORLD}"
    state, expect = {}, {}
    for name in ("int8_row", "optim8bit_signed"):
        case = CASE[name]
        hp = case.hp(SEED[name])
        ref = ref_dequant(name, hp, n)
        for kind in ("shard", "deq"):
            local = local_shard(name, case.hp(SEED[name] + 1000), WORLD, RANK)
            state[f"{kind}.{name}"] = make_dtensor(local, mesh, Shard(0), SHAPE, case.dtype)
            expect[f"{kind}.{name}"] = (local_shard(name, hp, WORLD, RANK) if kind == "shard"
                                        else case.from_hp(my_rows(ref).to(DEVICE)))
    if _load("mixed", f"{tag}: raw and dequantized entries into quantized targets in one load", state, path):
        for fqn, want in expect.items():
            diff = buffers_diff(state[fqn]._local_tensor, want)
            check("mixed", diff is None, f"{tag}: {fqn}: {diff}")


def load_per_tensor(path: str, name: str, n: int, mesh) -> None:
    """A per-tensor-scale Shard(0) entry that qdcp agreed to save must load exact values."""
    tag = f"{name} N={n}->M={WORLD}"
    case, hp = CASE[name], CASE[name].hp(SEED[name])
    ref = ref_dequant(name, hp, n)
    sharded = make_dtensor(torch.zeros(my_rows(ref).shape, dtype=case.dtype, device=DEVICE),
                           mesh, Shard(0), SHAPE, case.dtype)
    full = torch.zeros(SHAPE, dtype=case.dtype, device=DEVICE)
    for target, got, want in ((sharded, lambda: sharded._local_tensor, my_rows(ref)),
                              (full, lambda: full, ref)):
        if not _load(f"per_tensor[{name}]", f"{tag}: the load into a plain target", {"w": target}, path):
            continue
        diff = buffers_diff(got().cpu(), want)
        check(f"per_tensor[{name}]", diff is None,
              f"{tag}: saved without error but a plain target != the shards' dequantize ({diff}): "
              f"wrong values")
    # same type and config, shards quantized on their own: exact source shard (same layout) or a
    # quantize of the exact values like the target (any other layout)
    local = local_shard(name, case.hp(SEED[name] + 1000), WORLD, RANK)
    target = make_dtensor(local, mesh, Shard(0), SHAPE, case.dtype)
    if not _load(f"per_tensor[{name}]", f"{tag}: load into same type", {"w": target}, path):
        return
    got = case.dequantize(local).cpu()
    requant = case.dequantize(case.from_hp(my_rows(ref).to(DEVICE))).cpu()
    check(f"per_tensor[{name}]", torch.equal(bits(got), bits(my_rows(ref))) or torch.equal(bits(got), bits(requant)),
          f"{tag}: same-type target holds neither the source values nor a requantize of them: wrong values")


def load_global_amax(mesh) -> None:
    """Quantize-on-load into sharded targets with a per-tensor scale uses the global amax.

    A plain (vanilla DCP) checkpoint of the global high-precision tensor is loaded into NVFP4
    per-tensor-scale Shard(0) targets: every rank's ``per_tensor_scale`` must be the one of the
    whole tensor, and the buffers those of ``to_nvfp4(rows, per_tensor_scale=global)``.
    """
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    hp = CASES[0].hp(777)
    path = os.path.join(ROOT, f"plain_global_m{WORLD}")
    dcp.save({"a": hp, "b": hp}, checkpoint_id=path)  # vanilla DCP, every rank writes the same
    global_scale = per_tensor_amax_to_scale(hp.abs().amax()).to(DEVICE)
    want_scale = global_scale.clone()  # the targets hold (and loading overwrites) their own copies
    state, expect = {}, {}
    for fqn, swz in (("a", False), ("b", True)):
        local = NVFP4Tensor.to_nvfp4(torch.zeros(my_rows(hp).shape, dtype=hp.dtype, device=DEVICE) + 1,
                                     per_tensor_scale=global_scale.clone(), is_swizzled_scales=swz)
        state[fqn] = make_dtensor(local, mesh, Shard(0), SHAPE, hp.dtype)
        expect[fqn] = NVFP4Tensor.to_nvfp4(my_rows(hp).to(DEVICE).contiguous(),
                                           per_tensor_scale=global_scale, is_swizzled_scales=swz)
    if not _load("global_amax", "load a plain checkpoint into NVFP4 per-tensor Shard(0) targets",
                 state, path):
        return
    for fqn, want in expect.items():
        got = state[fqn]._local_tensor
        check("global_amax", torch.equal(got.per_tensor_scale.cpu(), want_scale.cpu()),
              f"{fqn}: per_tensor_scale {got.per_tensor_scale.item():.6g} != the whole tensor's "
              f"{want_scale.item():.6g} (the local shard's amax was used)")
        diff = buffers_diff(got, want)
        check("global_amax", diff is None, f"{fqn}: {diff}")


# ----------------------------------------------------------------------------- FSDP2

# NF4: FSDP2 pads uneven shards with new_empty, which NF4Tensor lacks, so its 384 rows split evenly
# at 1-4 ranks; the trainable (256, 384) weights split unevenly at 3 ranks (86/86/84 rows), every
# shard a whole number of optimizer blocks.
FSDP_IN, FSDP_HIDDEN, FSDP_OUT = 128, 384, 256
OPTIMS = (("a8", "AdamW8bit", {"block_size": 64}), ("a4", "AdamW4bit", {"block_size": 128}),
          ("fp8", "AdamWFp8", {"block_size": 256}))


class FsdpModel(torch.nn.Module):
    """A frozen NF4 weight (QLoRA style) feeding three trainable layers, one per optimizer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        from torchao.quantization import to_nf4

        g = torch.Generator().manual_seed(seed)
        w = torch.randn(FSDP_HIDDEN, FSDP_IN, generator=g).to(torch.bfloat16)
        # scaler blocks of 64 * 4 elements (2 rows)
        self.base = torch.nn.Module()
        self.base.weight = torch.nn.Parameter(to_nf4(w, 64, 4), requires_grad=False)
        for name, _, _ in OPTIMS:
            lin = torch.nn.Linear(FSDP_HIDDEN, FSDP_OUT, bias=True)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / 16)
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=g))
            setattr(self, name, lin)

    def forward(self, x):
        h = torch.nn.functional.linear(x.to(torch.bfloat16), self.base.weight).float().relu()
        return sum(getattr(self, name)(h) for name, _, _ in OPTIMS)


def manual_forward(model, x) -> torch.Tensor:
    """The model's forward computed from its gathered (whole) parameters, at any world size."""
    full = {k: gather_rows(p) for k, p in model.named_parameters()}  # NF4 weight: dequantized
    with torch.no_grad():
        h = torch.nn.functional.linear(x.cpu().to(torch.bfloat16), full["base.weight"]).float().relu()
        return sum(torch.nn.functional.linear(h, full[f"{n}.weight"], full[f"{n}.bias"]) for n, _, _ in OPTIMS)


def fsdp_setup(seed: int, mesh):
    import torchao.optim as ao_optim
    from torch.distributed.fsdp import fully_shard

    model = FsdpModel(seed).to(DEVICE)
    for name, _, _ in OPTIMS:
        fully_shard(getattr(model, name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    opts = [getattr(ao_optim, cls)(getattr(model, name).parameters(), lr=1e-2, weight_decay=0.01, **kw)
            for name, cls, kw in OPTIMS]
    return model, opts


def fsdp_grads(model, step: int) -> None:
    """Deterministic gradients (the same global values at any world size), set as DTensors."""
    for i, (fqn, p) in enumerate(sorted(model.named_parameters())):
        if not p.requires_grad:
            continue
        g = torch.Generator().manual_seed(1000 * step + i)
        full = torch.randn(p.shape, generator=g, dtype=p.dtype)
        local = my_rows(full) if p.ndim else full
        p.grad = make_dtensor(local.to(DEVICE).contiguous(), p.device_mesh, p.placements[0], p.shape, p.dtype)


def gather_rows(t) -> torch.Tensor:
    """The whole logical tensor of a Shard(0) DTensor (quantized locals dequantized), on CPU."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if qdcp.find_adapter(local) is not None:
        local = qdcp.find_adapter(local).dequantize(local)
    if not isinstance(t, DTensor):
        return local.detach().cpu().clone()  # a snapshot: states such as "step" change in place
    return all_rows(local.detach().cpu())


def fsdp_snapshot(model, opts) -> dict:
    out = {"params": {k: gather_rows(p) for k, p in model.named_parameters()}, "states": {}}
    for (name, _, _), opt in zip(OPTIMS, opts):
        for p_name, p in getattr(model, name).named_parameters():
            for k, v in opt.state[p].items():
                out["states"][f"{name}.{p_name}.{k}"] = gather_rows(v)
    return out


def state_types(model, opts) -> dict:
    out = {}
    for (name, _, _), opt in zip(OPTIMS, opts):
        for p_name, p in getattr(model, name).named_parameters():
            for k, v in opt.state[p].items():
                local = v._local_tensor if isinstance(v, DTensor) else v
                out[f"{name}.{p_name}.{k}"] = type(local).__name__
    return out


def fsdp_save(root: str, mesh) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = os.path.join(root, f"fsdp_n{WORLD}")
    model, opts = fsdp_setup(0, mesh)
    x = torch.randn(5, FSDP_IN, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    fsdp_grads(model, 1)
    for o in opts:
        o.step()
    types = state_types(model, opts)
    quantized = sorted(k for k, v in types.items() if v.startswith("OptimState"))
    check("fsdp_save", len(quantized) == 2 * len(OPTIMS),
          f"expected exp_avg/exp_avg_sq of each weight to be OptimState*, got {types}")
    check("fsdp_save", isinstance(model.base.weight, DTensor)
          and type(model.base.weight._local_tensor).__name__ == "NF4Tensor",
          f"FSDP2 did not shard the NF4 weight as DTensor(NF4Tensor): {type(model.base.weight)}")
    with torch.no_grad():
        y = model(x).detach().cpu()
    y_manual = manual_forward(model, x)
    msd, osd = get_state_dict(model, opts)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "ckpt"),
             planner=QuantizedSavePlanner())
    snap1 = fsdp_snapshot(model, opts)
    _async_save_while_stepping(out, {"model": msd, "optim": osd}, model, opts)
    snap2 = fsdp_snapshot(model, opts)
    nf4_full = gather_rows(model.base.weight)
    if RANK == 0:
        torch.save({"x": x.cpu(), "y": y, "y_manual": y_manual, "types": types, "after_save": snap1,
                    "after_next_step": snap2, "nf4": nf4_full}, os.path.join(out, "ref.pt"))
        _check_saved_specs(os.path.join(out, "ckpt"))
    dist.barrier()


def _async_save_while_stepping(out: str, state: dict, model, opts) -> None:
    """The plain call, DCP's default stager: the next step updates the model in place before the
    upload finishes; the checkpoint must still be the synchronous one (``out/ckpt``), byte for byte."""
    gate = threading.Event()
    fut = dcp.async_save(state, checkpoint_id=os.path.join(out, "ckpt_async"), planner=gated_save_planner(gate))
    fsdp_grads(model, 2)
    for o in opts:
        o.step()
    gate.set()
    fut.result()
    dist.barrier()
    for name in sorted(os.listdir(os.path.join(out, "ckpt"))):
        if name.endswith(".distcp") and RANK == 0:
            with open(os.path.join(out, "ckpt", name), "rb") as a, \
                    open(os.path.join(out, "ckpt_async", name), "rb") as b:
                check("fsdp_async_default_stager", a.read() == b.read(),
                      f"{name}: dcp.async_save (DCP's default stager) wrote other bytes than dcp.save")


def _check_saved_specs(ckpt: str) -> None:
    """The FSDP checkpoint holds the NF4 weight and the six optimizer states raw, each replicated
    component in one chunk."""
    md = qdcp.read_metadata(ckpt)
    specs = qdcp.spec.read_specs(md)
    check("fsdp_save", any(e.type == "torchao.NF4Tensor" for e in specs.values()),
          f"no NF4 entry saved raw: {sorted(specs)}")
    check("fsdp_save", sum(e.type.startswith("torchao.OptimState") for e in specs.values()) == 6,
          f"expected 6 OptimState entries saved raw: {sorted(specs)}")
    for fqn, e in specs.items():
        for c in e.components:
            if c.layout.get("kind") == "replicated":
                n = len(md.state_dict_metadata[f"{fqn}.__qdcp__.{c.name}"].chunks)
                check("fsdp_save", n == 1, f"{fqn}.{c.name} replicated but has {n} chunks")


def fsdp_load(root: str, mesh) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for sub in sorted(os.listdir(root)):
        if not sub.startswith("fsdp_n") or not os.path.exists(os.path.join(root, sub, "ref.pt")):
            continue
        tag = f"FSDP2 N={sub[6:]}->M={WORLD}"
        ref = torch.load(os.path.join(root, sub, "ref.pt"), weights_only=True)
        model, opts = fsdp_setup(1, mesh)
        msd, osd = get_state_dict(model, opts)  # initialises the optimizer states (zero-lr step)
        try:
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, sub, "ckpt"),
                     planner=QuantizedLoadPlanner())
            set_state_dict(model, opts, model_state_dict=msd, optim_state_dict=osd)
        except BaseException as e:  # noqa: BLE001
            section_error("fsdp_load", f"{tag}: load", e)
            continue
        check("fsdp_load", state_types(model, opts) == ref["types"],
              f"{tag}: state types {state_types(model, opts)} != saved {ref['types']}")
        check("fsdp_load", type(model.base.weight._local_tensor).__name__ == "NF4Tensor",
              f"{tag}: NF4 weight is no longer NF4: {type(model.base.weight._local_tensor)}")
        snap = fsdp_snapshot(model, opts)
        for group in ("params", "states"):
            for k, want in ref["after_save"][group].items():
                got = snap[group].get(k)
                check("fsdp_load", got is not None and buffers_diff(got, want) is None,
                      f"{tag}: {group} {k}: {None if got is None else buffers_diff(got, want)}")
        nf4 = model.base.weight._local_tensor
        src = torch.chunk(FsdpModel(0).base.weight.data, WORLD)[RANK]  # the saved rows' NF4 buffers
        check("fsdp_load", buffers_diff(nf4, src.to(DEVICE)) is None,
              f"{tag}: NF4 local buffers differ from the saved rows' ({buffers_diff(nf4, src)})")
        y = manual_forward(model, ref["x"].to(DEVICE))
        check("fsdp_load", buffers_diff(y, ref["y_manual"]) is None, f"{tag}: forward (gathered params) differs")
        # at 1 rank, FSDP2 skips the all-gather and torchao's NF4 fsdp_post_all_gather gets 1 of its 3 inputs
        # (docs/troubleshooting.md)
        if WORLD > 1:
            with torch.no_grad():
                y = model(ref["x"].to(DEVICE)).detach().cpu()
            check("fsdp_load", buffers_diff(y, ref["y"]) is None, f"{tag}: FSDP2 forward output differs")
        fsdp_grads(model, 2)
        for o in opts:
            o.step()
        snap = fsdp_snapshot(model, opts)
        for group in ("params", "states"):
            for k, want in ref["after_next_step"][group].items():
                got = snap[group].get(k)
                check("fsdp_step", got is not None and buffers_diff(got, want) is None,
                      f"{tag}: after one more step, {group} {k}: "
                      f"{None if got is None else buffers_diff(got, want)}")


def fsdp_limits(root: str, mesh) -> None:
    """docs/fsdp2.md's known limits, as written there: FSDP2 over a weight-only Int8Tensor (torchao
    lacks ``aten.split``) and torchao's AdamW8bit over bf16 FSDP2 parameters fail in torchao; the
    workarounds the docs give (``ignored_params``; fp32 parameters with a bf16 ``MixedPrecisionPolicy``)
    train and round-trip through ``qdcp.save`` / ``qdcp.load`` bit-exact."""
    import torchao.optim as ao_optim
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    def int8_model():
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        quantize_(model, Int8WeightOnlyConfig(version=2))
        return model

    try:
        fully_shard(int8_model(), mesh=mesh)
        check("fsdp_limits", False, "fully_shard of a weight-only Int8Tensor model now works: update docs/fsdp2.md")
    except NotImplementedError as e:
        check("fsdp_limits", "aten.split" in str(e), f"another torchao error than the docs say: {_short(e)}")

    def int8_sharded():  # the docs' workaround: the Int8Tensor weights kept out of FSDP2
        model = int8_model()
        fully_shard(model, mesh=mesh, ignored_params={p for n, p in model.named_parameters() if n.endswith("weight")})
        return model

    model = int8_sharded()
    path = os.path.join(root, "fsdp_limits", "int8")
    qdcp.save({"model": model.state_dict()}, path)
    fresh = int8_sharded()  # the same seed: zero the weights' buffers, then load them back
    for lin in fresh:
        lin.weight.qdata.zero_()
    qdcp.load({"model": fresh.state_dict()}, path)
    for i in range(2):
        check("fsdp_limits", buffers_diff(fresh[i].weight, model[i].weight) is None, f"Int8 weight {i} differs")

    def bf16_step(mp: bool):
        torch.manual_seed(6)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        if not mp:
            model = model.to(torch.bfloat16)
        fully_shard(model, mesh=mesh, **({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if mp else {}))
        opt = ao_optim.AdamW8bit(model.parameters(), lr=1e-3, block_size=256)
        model(torch.randn(4, 256, dtype=torch.bfloat16)).sum().backward()
        opt.step()
        return model, opt

    try:
        bf16_step(False)
        check("fsdp_limits", False, "AdamW8bit over bf16 FSDP2 parameters now steps: update docs/fsdp2.md")
    except RuntimeError as e:
        check("fsdp_limits", "expected dtype torch.bfloat16 for `end`" in str(e), f"another error: {_short(e)}")
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt = bf16_step(True)
    path = os.path.join(root, "fsdp_limits", "adamw8bit")
    msd, osd = get_state_dict(model, opt)
    qdcp.save({"model": msd, "optim": osd}, path)
    fresh, fresh_opt = bf16_step(True)
    fmsd, fosd = get_state_dict(fresh, fresh_opt)
    for v in fosd["state"].values():  # the same step taken: zero what is loaded back
        for t in v.values():
            local = t._local_tensor if isinstance(t, DTensor) else t
            for name in ("codes", "scale"):
                getattr(local, name, torch.empty(0)).zero_()
    qdcp.load({"model": fmsd, "optim": fosd}, path)

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    for fqn, v in osd["state"].items():
        for k, t in v.items():
            diff = buffers_diff(local(fosd["state"][fqn][k]), local(t))
            check("fsdp_limits", diff is None, f"AdamW8bit {fqn}.{k}: {diff}")
    kinds = {type(local(t)).__name__ for v in fosd["state"].values() for t in v.values()}
    check("fsdp_limits", "OptimState8bit" in kinds, f"no 8-bit optimizer state loaded: {kinds}")


# ----------------------------------------------------------------------------- main

COMMANDS = {"reshard-save": reshard_save, "reshard-load": reshard_load,
            "fsdp-save": fsdp_save, "fsdp-load": fsdp_load, "fsdp-limits": fsdp_limits}


def main() -> int:
    global ROOT
    ROOT = sys.argv[2]
    return run(COMMANDS, lambda: init_torchrun_mesh(DEVICE))


if __name__ == "__main__":
    sys.exit(main())
