"""Runs generated mutations (tests/mutations.py) against every reader, under limits.

    python tests/mutation_worker.py save SRC qdcp.save|dcp.save       (the source checkpoint)
    python tests/mutation_worker.py cases SRC WORK FIRST COUNT OUT   (one process, one rank)
    python -m torch.distributed.run --nproc-per-node 2 tests/mutation_worker.py ranks DIR

``cases``: mutations ``FIRST .. FIRST+COUNT-1`` of the checkpoint ``SRC`` (saved by
:func:`save_source`), each in a fresh copy under ``WORK``; one JSON line per case goes to ``OUT``
(``{"seed", "start"}`` before it runs, then its label and the problems the oracle found). The
process runs under a memory limit (``RLIMIT_AS``) and each case under a time limit (the process
exits, dumping its stack; the caller sees a case started and never finished). ``ranks``: the same
at two ranks of a real job, the checkpoint saved by both ranks (``Shard(0)`` DTensors), each case
mutated by rank 0 and loaded by every rank; failures in the section ``mutations``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import resource
import shutil
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import mutations  # noqa: E402
import qdcp  # noqa: E402
from quantized_cases import CASE_BY_NAME, bits  # noqa: E402

CASE_SECONDS = 60
MEMORY_BYTES = 6 << 30  # address space; the loads themselves need a few hundred MiB
FAMILIES = ("int8_row", "nf4", "mx_fp8", "float8_row")
SHAPE = (256, 128)


def state(seed: int) -> dict:
    """The saved state: four quantized weights, a plain tensor, a non-tensor."""
    out: dict = {name: CASE_BY_NAME[name].make(seed + i, SHAPE) for i, name in enumerate(FAMILIES)}
    out["bias"] = torch.randn(16, generator=torch.Generator().manual_seed(seed))
    out["step"] = seed
    return out


def save_source(path: Path, door: str) -> None:
    if door == "qdcp.save":
        qdcp.save(state(0), path)
    else:
        dcp.save(state(0), checkpoint_id=path, planner=qdcp.QuantizedSavePlanner())


def _flat(t) -> list[torch.Tensor]:
    """A value's bits: a quantized tensor's inner tensors, a DTensor's local."""
    t = getattr(t, "_local_tensor", t)
    if not isinstance(t, torch.Tensor):
        return [t]
    if type(t) is torch.Tensor:
        return [bits(t)]
    names, _ = t.__tensor_flatten__()
    return [bits(getattr(t, n)) for n in names]


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = _flat(a[k]), _flat(b[k])
        if len(x) != len(y):
            return False
        for u, v in zip(x, y):
            if isinstance(u, torch.Tensor) != isinstance(v, torch.Tensor):
                return False
            if isinstance(u, torch.Tensor):
                if u.shape != v.shape or u.dtype != v.dtype or not torch.equal(u, v):
                    return False
            elif u != v:
                return False
    return True


def outcome(call) -> tuple[str, BaseException | None]:
    """``("loaded", None)``, ``("refused", e)`` for a qdcp error, ``("raw", e)`` for any other."""
    return outcome_of(call)[:2]


def outcome_of(call) -> tuple[str, BaseException | None, object]:
    """:func:`outcome`, and what ``call`` returned (None where it raised)."""
    from worker_results import qdcp_error_in

    try:
        return "loaded", None, call()
    except BaseException as e:  # noqa: BLE001 (judged below)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        found = qdcp_error_in(e)
        if found is None and isinstance(e, AssertionError) and "metadata read failed" in str(e):
            found = e  # dcp.load quotes a reader's .metadata refusal in its own AssertionError
        return ("refused", found, None) if found is not None else ("raw", e, None)


def _text(e: BaseException | None) -> str:
    return "" if e is None else f"{type(e).__name__}: {str(e)[:300]}"


def safe_doors(path: Path, make, genuine: dict) -> dict[str, tuple[str, str]]:
    """Each safe-path door's (verdict, error text) on ``path``; a verdict of "wrong values" or
    "target changed" where the oracle is broken."""
    out = {}
    for door in ("qdcp.load", "dcp.load+reader"):
        target = make()
        before = {k: [x.clone() if isinstance(x, torch.Tensor) else x for x in _flat(v)] for k, v in target.items()}
        if door == "qdcp.load":
            verdict, err = outcome(lambda: qdcp.load(target, path))
        else:
            verdict, err = outcome(lambda: dcp.load(target, checkpoint_id=path, planner=qdcp.QuantizedLoadPlanner(),
                                                    storage_reader=qdcp.storage_reader(path)))
        if verdict == "loaded" and not same(target, genuine):
            verdict = "wrong values"
        elif verdict == "refused" and door == "qdcp.load":
            now = {k: _flat(v) for k, v in target.items()}
            if any(not all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                           for a, b in zip(now[k], before[k])) for k in now):
                verdict = "target changed"
        out[door] = (verdict, _text(err))
    return out


PLAIN = "dcp.load (DCP's reader)"


def plain_door(path: Path, target: dict, genuine: dict) -> tuple[str, str]:
    """The plain path's verdict: ``dcp.load`` with qdcp's planner through DCP's own reader."""
    verdict, err = outcome(lambda: dcp.load(target, checkpoint_id=path, planner=qdcp.QuantizedLoadPlanner()))
    return ("wrong values" if verdict == "loaded" and not same(target, genuine) else verdict), _text(err)


def one_rank_case(src: Path, work: Path, seed: int, genuine: dict, consolidated: dict) -> dict:
    from cli_in_process import qdcp_cli

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    path = work / "c"
    shutil.copytree(src, path)
    label, resealed, outside = mutations.mutate(path, seed)
    doors = safe_doors(path, lambda: state(99), genuine)
    verdict, err, got = outcome_of(lambda: qdcp.consolidate(path))
    if verdict == "loaded" and not same(got, consolidated):
        verdict = "wrong values"
    doors["consolidate"] = (verdict, _text(err))
    try:
        done = qdcp_cli("verify", str(path))
        doors["verify"] = ({0: "loaded", 1: "refused", 2: "refused"}.get(done.returncode, "raw"),
                           (done.stdout + done.stderr).strip()[-300:])
    except BaseException as e:  # noqa: BLE001
        doors["verify"] = ("raw", _text(e))
    doors[PLAIN] = plain_door(path, state(99), genuine)
    return {"seed": seed, "label": label, "doors": doors, "problems": judge(doors, outside) + ran_code(path)}


def ran_code(path: Path) -> list[str]:
    """A door unpickled code the checkpoint carries: what it would have run, it ran."""
    return [f"a reader ran code from the checkpoint ({mutations.MARKER} made)"] \
        if (path.parent / mutations.MARKER).exists() else []


def judge(doors: dict, outside: bool) -> list[str]:
    """The oracle's findings (module docstring of tests/mutations.py)."""
    problems = [f"{d}: {v} {e}" for d, (v, e) in doors.items()
                if v in ("wrong values", "target changed") or (v == "raw" and d != PLAIN)]
    safe = {d: v for d, (v, _) in doors.items() if d != PLAIN and v in ("loaded", "refused")}
    if len(set(safe.values())) > 1:
        problems.append(f"the doors disagree: {safe}")
    if outside:
        problems += [f"{d}: loaded a checkpoint that points outside" for d, v in safe.items() if v == "loaded"]
    return problems


def run_cases(src: str, work: str, first: int, count: int, out: str) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    src_path = Path(src)
    genuine = state(0)
    consolidated = qdcp.consolidate(src_path)
    with open(out, "a") as f:
        for seed in range(first, first + count):
            f.write(json.dumps({"seed": seed, "start": True}) + "\n")
            f.flush()
            faulthandler.dump_traceback_later(CASE_SECONDS, exit=True)
            try:
                record = one_rank_case(src_path, Path(work) / "case", seed, genuine, consolidated)
            except Exception as e:  # noqa: BLE001 (a finding: every door's error is caught in outcome())
                record = {"seed": seed, "label": "?", "problems": [f"outside a door: {_text(e)}"]}
            faulthandler.cancel_dump_traceback_later()
            f.write(json.dumps(record) + "\n")
            f.flush()


RANK_CASES = int(os.environ.get("QDCP_MUTATION_RANK_CASES", "24"))
RANK_SEED = 7_000_000  # the seeds of the cases at ranks (the one-rank cases start at 0)


def sharded(seed: int) -> dict:
    """:func:`state` as this rank holds it: each tensor's rows cut as FSDP2 cuts them (by torchao's
    own slicing; NF4's split, as FSDP2 calls it), a ``Shard(0)`` DTensor of them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    global _MESH
    if _MESH is None:
        _MESH = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for k, v in state(seed).items():
        if isinstance(v, torch.Tensor):
            rows = -(-v.shape[0] // dist.get_world_size())
            start = rows * dist.get_rank()
            local = torch.chunk(v, dist.get_world_size())[dist.get_rank()] if "NF4" in type(v).__name__ \
                else v[start:start + rows]
            meta = TensorMeta(v.shape, torch.empty(v.shape, device="meta").stride(), v.dtype)
            v = DTensor(local, DTensorSpec(_MESH, (Shard(0),), meta), requires_grad=False)
        out[k] = v
    return out


_MESH = None


def rank_case(src: Path, root: Path, seed: int, genuine: dict) -> dict:
    """One case at this job's ranks: rank 0 mutates a copy of ``src``, every rank loads it."""
    import torch.distributed as dist

    path = root / f"case{seed}" / "c"
    told = [None]
    if dist.get_rank() == 0:
        shutil.copytree(src, path)
        told = [mutations.mutate(path, seed)]
    dist.broadcast_object_list(told, src=0)  # every rank judges with the case's label (and after the edit)
    label, _, outside = told[0]
    doors = safe_doors(path, lambda: sharded(99), genuine)
    doors[PLAIN] = plain_door(path, sharded(99), genuine)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, {d: v for d, (v, _) in doors.items()})
    problems = judge(doors, outside) + ran_code(path)
    problems += [f"the ranks disagree: {every}"] if any(e != every[0] for e in every) else []
    return {"seed": seed, "label": label, "doors": doors, "problems": problems}


def run_ranks(root: str, mesh) -> None:
    """The cases at this job's ranks (section ``mutations``); the source saved by every rank."""
    import torch.distributed as dist

    from worker_results import check

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    base = Path(root)
    genuine = sharded(0)
    src = base / "source"
    qdcp.save(sharded(0), src)
    counts: dict = {}
    for seed in range(RANK_SEED, RANK_SEED + RANK_CASES):
        faulthandler.dump_traceback_later(CASE_SECONDS, exit=True)
        record = rank_case(src, base, seed, genuine)
        faulthandler.cancel_dump_traceback_later()
        for p in record["problems"]:
            check("mutations", False, f"case {seed} ({record['label']}): {p}")
        verdict = record["doors"]["qdcp.load"][0]
        counts[verdict] = counts.get(verdict, 0) + 1
        dist.barrier()
    check("mutations", counts.get("loaded", 0) > 0 and counts.get("refused", 0) > 0, f"outcomes: {counts}")


def _init() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save_source(Path(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "cases":
        run_cases(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        from worker_results import run

        sys.exit(run({"ranks": run_ranks}, _init))
