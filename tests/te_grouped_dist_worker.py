"""The script every ``torchrun`` rank runs for ``tests/test_te_grouped_distributed.py`` (MoE experts
in TE GroupedTensors, expert parallelism N -> M).

    python -m torch.distributed.run --nproc-per-node N tests/te_grouped_dist_worker.py COMMAND DIR

Every recipe in :data:`RECIPES` is one group of 8 experts of shape (128, 256), built by TE's own
``make_grouped_tensor_with_shapes`` (``te_groups``) from deterministic values, the same on every rank
(the *global* group). A rank of an N-rank job holds experts ``[r*8/N, (r+1)*8/N)``: a local group of
8/N experts whose canonical components are the global ones' (padding garbage).

- ``save DIR`` at N ranks writes ``DIR/n{N}/grouped`` (key ``<recipe>.weight``: the local group as this
  rank's ``Shard(0)`` of the stacked ``[8, 128, 256]`` tensor; ``deq.<recipe>.weight`` the same in
  dequantized mode) and ``DIR/n{N}/members`` (keys ``<recipe>.weight<i>`` for this rank's experts
  ``i``, TE's ``single_grouped_weight=False`` layout, each a lone TE tensor).
- ``load DIR`` at M ranks loads every ``DIR/n*/{grouped,members}`` into: local groups of M's experts
  (``Shard(0)`` DTensors; canonical components bitwise the global experts', buffers updated in place);
  plain ``Shard(0)`` ``[8, 128, 256]`` DTensors (bitwise the members' reference dequantize); per-member
  keys of M's experts as lone TE tensors (bitwise components) and as plain tensors; and every expert's
  key as a ``Shard(0)`` DTensor over its rows, plain and TE (raw: a per-expert scale is shared by
  every rows shard; blockwise TE targets only where the rows keep whole 128-row blocks, and a clear
  error naming the key where they do not).

Sections of failures go to ``DIR/results-<command>-<world>.json``, as in ``dist_worker.py``.
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

import te_cpu  # noqa: E402
import te_groups  # noqa: E402  (installs the TE stand-in)
from dist_helpers import dtensor_from_local, init_torchrun_mesh, my_row_chunk  # noqa: E402
from qdcp import QuantizedSavePlanner, QuantizedStager  # noqa: E402
from qdcp.adapters import find_adapter  # noqa: E402
from quantized_cases import bits_diff as diff  # noqa: E402
from quantized_cases import components_diff  # noqa: E402
from worker_results import RANK, WORLD, check, qdcp_error_in, run, section_error, try_load  # noqa: E402
from worker_results import short as _short  # noqa: E402

EXPERTS, ROWS, COLS = 8, 128, 256
STACKED = (EXPERTS, ROWS, COLS)
RECIPES = ("mxfp8_both", "current_both_hopper", "delayed_both_e5m2", "block1_both", "block2_both",
           "nvfp4_both", "bf16")
ROW_BLOCK = {"block1_both": 128, "block2_both": 128}  # rows a TE target's shard must keep whole
SEED = {name: 100 * i + 7 for i, name in enumerate(RECIPES)}
GARBAGE_SEED = 5000


# ----------------------------------------------------------------------------- building

def experts(world: int = WORLD, rank: int = RANK) -> range:
    k = EXPERTS // world
    return range(rank * k, (rank + 1) * k)


def row_range() -> range:
    """This rank's Shard(0) rows of one expert."""
    o, s = my_row_chunk(ROWS)
    return range(o, o + s)


def global_group(name: str):
    return te_groups.BY[name].build(SEED[name], [(ROWS, COLS)] * EXPERTS, clean=True)


def local_group(name: str, glob, ids: range, seed: int):
    """A group of experts ``ids`` of ``glob`` (canonical components copied in; padding garbage)."""
    g = te_groups.BY[name].build(seed, [(ROWS, COLS)] * len(ids))
    a = find_adapter(g)
    a.copy_into(g, {n: c[ids.start:ids.stop] for n, c in a.components(glob).items()})
    return g


def lone_member(name: str, rows: int, seed: int):
    """A lone TE tensor (or plain tensor, bf16) of the recipe's member type, ``(rows, COLS)``, garbage."""
    g = te_groups.BY[name].build(seed, [(rows, COLS)])
    return find_adapter(g).members(g)[0]


def shard0(local: torch.Tensor, mesh, global_shape) -> DTensor:
    """A Shard(0) DTensor over ``local`` built from its spec (GroupedTensor forbids view ops)."""
    return dtensor_from_local(local, mesh, (Shard(0),), global_shape, torch.bfloat16)


# ----------------------------------------------------------------------------- comparing

def ptrs(g) -> dict[str, int]:
    return {n: b.data_ptr() for n, b in te_groups.flat(g).items()}


# ----------------------------------------------------------------------------- save

def save(root: str, mesh) -> None:
    out = os.path.join(root, f"n{WORLD}")
    ids = experts()
    grouped, members = {}, {}
    for name in RECIPES:
        glob = global_group(name)
        local = local_group(name, glob, ids, GARBAGE_SEED + RANK)
        grouped[f"{name}.weight"] = shard0(local, mesh, STACKED)
        grouped[f"deq.{name}.weight"] = shard0(local, mesh, STACKED)
        for i, m in zip(ids, find_adapter(local).members(local)):
            members[f"{name}.weight{i}"] = m
    for kind, state in (("grouped", grouped), ("members", members)):
        try:
            dcp.save(state, checkpoint_id=os.path.join(out, kind),
                     planner=QuantizedSavePlanner(dequantize=_dequantize_deq))
            check("save", True, "")
        except BaseException as e:  # noqa: BLE001
            section_error("save", f"saving {kind}", e)
    save_async(out, grouped)


def _dequantize_deq(fqn: str, t) -> bool:
    return fqn.startswith("deq.")


def save_async(out: str, grouped: dict) -> None:
    """The grouped state again with ``dcp.async_save`` and qdcp's stager (the flat buffers staged
    once per group, DTensor-wrapped), the live groups zeroed as soon as it returns: its data
    files must be byte-for-byte the sync save's."""
    stager = QuantizedStager()
    path = os.path.join(out, "grouped_async")
    live = {k: v._local_tensor for k, v in grouped.items() if not k.startswith("deq.")}
    try:
        fut = dcp.async_save(grouped, checkpoint_id=path, async_stager=stager,
                             planner=QuantizedSavePlanner(dequantize=_dequantize_deq))
        for g in live.values():  # training goes on: the checkpoint keeps the staged values
            for b in te_groups.flat(g).values():
                b.zero_()
        fut.result()
    except BaseException as e:  # noqa: BLE001
        section_error("async_save", "async_save of the grouped state", e)
        return
    finally:
        stager.close()
    dist.barrier()
    sync = os.path.join(out, "grouped")
    files = sorted(f for f in os.listdir(sync) if f.endswith(".distcp"))
    check("async_save", files == sorted(f for f in os.listdir(path) if f.endswith(".distcp")),
          f"data files differ: {files} vs {sorted(os.listdir(path))}")
    for f in files:
        with open(os.path.join(sync, f), "rb") as a, open(os.path.join(path, f), "rb") as b:
            check("async_save", a.read() == b.read(), f"{f}: the async save's bytes differ from the sync save's")


# ----------------------------------------------------------------------------- load

def load(root: str, mesh) -> None:
    globs = {name: global_group(name) for name in RECIPES}
    refs = {name: te_groups.reference(g) for name, g in globs.items()}
    saved = sorted(d for d in os.listdir(root) if d.startswith("n") and d[1:].isdigit())
    check("loaded_all", len(saved) >= 2, f"expected checkpoints saved at 1 and 2 ranks, found {saved}")
    for n in saved:
        for kind in ("grouped", "members"):
            path = os.path.join(root, n, kind)
            if not os.path.exists(os.path.join(path, ".metadata")):
                check("loaded_all", False, f"{path} has no .metadata")
                continue
            load_one(path, f"{n}/{kind}", kind, globs, refs, mesh)


def load_one(path: str, what: str, kind: str, globs: dict, refs: dict, mesh) -> None:
    """Load the checkpoint at ``path`` (saved as ``kind``) into each kind of target, checking each."""
    _into_groups(path, what, kind, globs, mesh)
    _into_plain_stacks(path, what, kind, refs, mesh)
    _into_member_keys(path, what, kind, globs, refs)
    _into_member_rows(path, what, refs, mesh)
    _unaligned_rows_refused(path, what, mesh)


def _into_groups(path: str, what: str, kind: str, globs: dict, mesh) -> None:
    """(1) this rank's experts as a local group, Shard(0) of [8, M, N]: the source's bits, in place."""
    ids, names = experts(), RECIPES
    groups = {name: te_groups.BY[name].build(GARBAGE_SEED + 100 + RANK, [(ROWS, COLS)] * len(ids))
              for name in names}  # every buffer garbage
    before = {name: ptrs(g) for name, g in groups.items()}
    err = try_load({f"{name}.weight": shard0(g, mesh, STACKED) for name, g in groups.items()}, path)
    for name, g in groups.items():
        sec = f"grouped_target[{name}]"
        if err is not None:
            check(sec, False, f"{what}: load failed: {_short(err)}")
            continue
        want = local_group(name, globs[name], ids, GARBAGE_SEED + 200)
        # group-only Float8 buffers (amax, scale) are not in per-member checkpoints
        skip = ("amax", "scale") if kind == "members" else ()
        check(sec, (d := components_diff(g, want, skip)) is None, f"{what}: {d}")
        check(sec, ptrs(g) == before[name], f"{what}: flat buffers were replaced, not filled in place")
        if name.startswith("delayed"):  # the group's second (columnwise) scale_inv follows
            check(sec, (d := diff(g.columnwise_scale_inv, g.scale_inv)) is None,
                  f"{what}: columnwise scale_inv: {d}")


def _into_plain_stacks(path: str, what: str, kind: str, refs: dict, mesh) -> None:
    """(2) plain Shard(0) DTensors of the stacked logical shape: the reference values."""
    ids, names = experts(), RECIPES
    plains = {name: torch.zeros(len(ids), ROWS, COLS, dtype=torch.bfloat16) for name in names}
    state = {f"{name}.weight": shard0(t, mesh, STACKED) for name, t in plains.items()}
    if kind == "grouped":
        deq = {name: torch.zeros(len(ids), ROWS, COLS, dtype=torch.bfloat16) for name in names}
        state.update({f"deq.{name}.weight": shard0(t, mesh, STACKED) for name, t in deq.items()})
    err = try_load(state, path)
    for name in names:
        sec = f"plain_stack[{name}]"
        if err is not None:
            check(sec, False, f"{what}: load failed: {_short(err)}")
            continue
        want = refs[name][ids.start:ids.stop]
        check(sec, (d := diff(plains[name], want)) is None, f"{what}: {d}")
        if kind == "grouped":
            check(sec, (d := diff(deq[name], want)) is None, f"{what} (dequantized entry): {d}")


def _into_member_keys(path: str, what: str, kind: str, globs: dict, refs: dict) -> None:
    """(3) per-member keys of this rank's experts: lone TE tensors (the member's bits) and plain tensors."""
    ids, names = experts(), RECIPES
    lone = {(name, i): lone_member(name, ROWS, GARBAGE_SEED + 300 + i) for name in names for i in ids}
    flat_plain = {(name, i): torch.zeros(ROWS, COLS, dtype=torch.bfloat16)
                  for name in (names + tuple(f"deq.{n}" for n in names) if kind == "grouped" else names)
                  for i in ids}  # deq.*: members of a group saved dequantized
    for label, targets in (("member_keys", lone), ("member_plain", flat_plain)):
        err = try_load({f"{name}.weight{i}": t for (name, i), t in targets.items()}, path)
        for (name, i), t in targets.items():
            name = name.removeprefix("deq.")
            sec = f"{label}[{name}]"
            if err is not None:
                check(sec, False, f"{what}: load failed: {_short(err)}")
                continue
            if label == "member_plain":
                d = diff(t, refs[name][i])
            else:
                d = components_diff(t, find_adapter(globs[name]).members(globs[name])[i])
            check(sec, d is None, f"{what}: expert {i}: {d}")


def _into_member_rows(path: str, what: str, refs: dict, mesh) -> None:
    """(4) every expert's key as a Shard(0) DTensor over its rows (FSDP-style), plain and TE."""
    rows, names = row_range(), RECIPES
    row_plain = {(name, i): torch.zeros(len(rows), COLS, dtype=torch.bfloat16)
                 for name in names for i in range(EXPERTS)}
    row_te = {(name, i): lone_member(name, len(rows), GARBAGE_SEED + 400 + i)
              for name in names if name != "bf16" and len(rows) % ROW_BLOCK.get(name, 1) == 0
              for i in range(EXPERTS)}
    for label, targets in (("member_rows_plain", row_plain), ("member_rows_te", row_te)):
        err = try_load({f"{name}.weight{i}": shard0(t, mesh, (ROWS, COLS)) for (name, i), t in targets.items()},
                    path)
        for (name, i), t in targets.items():
            sec = f"{label}[{name}]"
            if err is not None:
                check(sec, False, f"{what}: load failed: {_short(err)}")
                continue
            got = t if label == "member_rows_plain" else find_adapter(t).dequantize(t).to(torch.bfloat16)
            d = diff(got, refs[name][i][rows.start:rows.stop])
            check(sec, d is None, f"{what}: expert {i} rows {rows.start}:{rows.stop}: {d}")


def _unaligned_rows_refused(path: str, what: str, mesh) -> None:
    """(5) a blockwise TE rows shard that cuts a 128-row block cannot take the stored bits: a clear
    error naming the key, the target unchanged."""
    rows = row_range()
    for name, block in ROW_BLOCK.items():
        if len(rows) % block == 0:
            continue
        key = f"{name}.weight3"
        t = lone_member(name, len(rows), GARBAGE_SEED + 500)
        before = {n: v.clone() for n, v in find_adapter(t).components(t).items()}
        err = try_load({key: shard0(t, mesh, (ROWS, COLS))}, path)
        q = qdcp_error_in(err) if err is not None else None
        check(f"member_rows_te_unaligned[{name}]", q is not None and repr(key) in str(q),
              f"{what}: expected a qdcp error naming {key!r}, got {_short(err) if err else 'success'}")
        check(f"member_rows_te_unaligned[{name}]",
              all(torch.equal(v, find_adapter(t).components(t)[n]) for n, v in before.items()),
              f"{what}: the refused target was modified")


COMMANDS = {"save": save, "load": load}


def main() -> int:
    with te_cpu.simulate_gpu(te_cpu.HOPPER):
        return run(COMMANDS, init_torchrun_mesh)


if __name__ == "__main__":
    sys.exit(main())
