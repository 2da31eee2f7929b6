"""Results of a torchrun test worker: named sections of failures, gathered to rank 0 and written as
JSON for pytest (see tests/torchrun_jobs.py). Shared by dist_worker.py and te_dist_worker.py."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from qdcp import QdcpError

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))

_failures: dict[str, list[str]] = {}


def check(section: str, ok: bool, msg: str) -> None:
    """Record ``msg`` under ``section`` unless ``ok`` (a section that only passes still appears)."""
    _failures.setdefault(section, [])
    if not ok:
        _failures[section].append(f"[rank {RANK}/{WORLD}] {msg}")


def section_error(section: str, what: str, e: BaseException) -> None:
    check(section, False, f"{what}: {type(e).__name__}: {short(e)}")


def short(e: BaseException, n: int = 600) -> str:
    """One line about ``e``; for DCP's CheckpointException, the first rank's own exception."""
    if isinstance(e, CheckpointException):
        for rank, err in sorted(e.failures.items()):
            exc = err[0] if isinstance(err, tuple) else err
            if isinstance(exc, BaseException):
                return f"(rank {rank}) {type(exc).__name__}: {short(exc, n)}"
    s = str(e).replace("\n", " | ")
    return s if len(s) <= n else s[:n] + "..."


def qdcp_error_in(e: BaseException, _seen: set | None = None) -> QdcpError | None:
    """The QdcpError behind ``e`` (DCP wraps per-rank errors in CheckpointException)."""
    seen = set() if _seen is None else _seen
    if id(e) in seen:
        return None
    seen.add(id(e))
    if isinstance(e, QdcpError):
        return e
    if isinstance(e, CheckpointException):
        for err in e.failures.values():
            exc = err[0] if isinstance(err, tuple) else err
            found = qdcp_error_in(exc, seen) if isinstance(exc, BaseException) else None
            if found is not None:
                return found
    cause = e.__cause__ or e.__context__
    return qdcp_error_in(cause, seen) if cause is not None else None


def try_load(state: dict, path: str) -> BaseException | None:
    """``dcp.load`` with qdcp's load planner; the exception it raised, or None."""
    import torch.distributed.checkpoint as dcp

    from qdcp import QuantizedLoadPlanner

    try:
        dcp.load(state, checkpoint_id=path, planner=QuantizedLoadPlanner())
        return None
    except BaseException as e:  # noqa: BLE001
        return e


def record_outcome(path: str, data) -> None:
    """Write what a section observed (``data``, JSON) to ``path`` from rank 0, for the test to
    assert; every rank waits until it is written."""
    if RANK == 0:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    dist.barrier()


def _report(results_path: str, crashed: BaseException | None) -> dict[str, list[str]]:
    """Gather every rank's sections, write them (rank 0) and start afresh; the gathered sections."""
    if crashed is not None:
        section_error("crash", "the job raised", crashed)
        traceback.print_exception(crashed)
    gathered: list = [None] * WORLD
    dist.all_gather_object(gathered, _failures)
    _failures.clear()
    merged: dict[str, list[str]] = {}
    for part in gathered:
        for k, v in part.items():
            merged.setdefault(k, []).extend(v)
    bad = {k: v for k, v in merged.items() if v}
    if RANK == 0:
        with open(results_path, "w") as f:
            json.dump(merged, f, indent=1)
        for k, v in bad.items():
            print(f"FAILED section {k}:", *v[:20], sep="\n  ", file=sys.stderr)
    dist.barrier()
    return bad


def finish(results_path: str, crashed: BaseException | None = None) -> int:
    """Gather every rank's sections, write them (rank 0), tear down; the process exit status."""
    bad = _report(results_path, crashed)
    dist.destroy_process_group()
    return 2 if "crash" in bad else (1 if bad else 0)


def run(commands: dict, init) -> int:
    """A worker's ``main``: ``argv = [command, job_dir]``; runs ``commands[command](job_dir, mesh)``
    on the mesh ``init()`` makes, then :func:`finish`. A hung collective dumps stacks and exits.

    ``command`` may join several with ``+`` (one launch for them: tests/torchrun_jobs.py's
    ``Worker(together=...)``): they run in order in these processes, each writing its own results
    file; after one that crashed (on any rank) the rest do not run, and write none."""
    faulthandler.dump_traceback_later(int(os.environ.get("QDCP_WORKER_TIMEOUT", "240")), exit=True)
    names, root = sys.argv[1].split("+"), sys.argv[2]
    mesh = init()
    status = 0
    for i, command in enumerate(names):
        crashed = None
        try:
            commands[command](root, mesh)
        except BaseException as e:  # noqa: BLE001
            crashed = e
        path = os.path.join(root, f"results-{command}-{WORLD}.json")
        if i == len(names) - 1:
            return max(status, finish(path, crashed))
        bad = _report(path, crashed)
        status = max(status, 2 if "crash" in bad else (1 if bad else 0))
        if "crash" in bad:
            return max(status, finish(os.devnull, None))
    return status
