"""The TransformerEngine torchrun jobs of test_te_distributed.py and test_te_grouped_distributed.py,
shared: each world size's saves in one launch, then each world size's loads in one launch
(tests/te_jobs_worker.py), every job once per session under a file lock in one directory every
xdist worker sees. A load launch runs only after every save launch (its loads read them all).
"""

from __future__ import annotations

from pathlib import Path

import torchrun_jobs

JOB_TIMEOUT_S = 300  # a command's; a launch of k commands gets k times this
SAVES = {1: ("dist.save", "grouped.save"), 2: ("dist.save", "grouped.save"), 3: ("dist.save",),
         4: ("dist.save", "dist.save2d")}
LOADS = {1: ("dist.load", "grouped.load"), 2: ("dist.load", "grouped.load"), 3: ("dist.load",),
         4: ("dist.load", "grouped.load")}
_worker = torchrun_jobs.Worker("te_jobs_worker.py", timeout_s=JOB_TIMEOUT_S,
                               together={n: [SAVES[n], LOADS[n]] for n in SAVES})


def root(tmp_path_factory) -> Path:
    """The jobs' directory (the dist worker's files under ``dist/``, the grouped one's under ``grouped/``)."""
    return torchrun_jobs.shared_dir(tmp_path_factory, "qdcp_te_jobs")


def job(shared: Path, command: str, nproc: int, first: int = 1) -> dict:
    """The record of ``command`` (``dist.save``, ``grouped.load``, ...) at ``nproc`` ranks, run once
    per session with the rest of its launch; a load after every save (from ``first`` ranks on, so
    that xdist workers start on different launches)."""
    if command.endswith(".load"):
        worlds = sorted(SAVES)
        i = worlds.index(first) if first in worlds else 0
        for n in worlds[i:] + worlds[:i]:
            _worker(shared, SAVES[n][0], n)
    return _worker(shared, command, nproc)
