"""The TransformerEngine torchrun jobs of test_te_distributed.py, test_te_grouped_distributed.py and
test_te_columns.py, shared: each world size's saves in one launch, then each world size's loads in
one launch (tests/te_jobs_worker.py), every job once per session under a file lock in one directory
every xdist worker sees. A load launch runs only after every save launch (its loads read them all).
Where CUDA is present te_columns_worker.py runs its tensors on the GPU over nccl, so there its
commands keep launches of their own (in the same ``columns/`` directory).
"""

from __future__ import annotations

from pathlib import Path

import torch

import torchrun_jobs

#: the jobs' directory, each test module's ``SHARED_DIR`` (conftest's ``shared_dir``); each worker's
#: files under its own: ``dist/``, ``grouped/``, ``columns/``
SHARED_DIR = "qdcp_te_jobs"
JOB_TIMEOUT_S = 300  # a command's; a launch of k commands gets k times this
WITH_COLUMNS = not torch.cuda.is_available()  # te_columns_worker.py's commands share the launches
_COLUMNS_SAVE = ("columns.save",) if WITH_COLUMNS else ()
_COLUMNS_LOAD = ("columns.load",) if WITH_COLUMNS else ()
SAVES = {1: ("dist.save", "grouped.save"), 2: ("dist.save", "grouped.save"), 3: ("dist.save",),
         4: ("dist.save", "dist.save2d") + _COLUMNS_SAVE}
LOADS = {1: ("dist.load", "grouped.load") + _COLUMNS_LOAD, 2: ("dist.load", "grouped.load") + _COLUMNS_LOAD,
         3: ("dist.load",) + _COLUMNS_LOAD, 4: ("dist.load", "grouped.load") + _COLUMNS_LOAD}
COLUMNS_WORKER = Path(__file__).with_name("te_columns_worker.py")
_worker = torchrun_jobs.Worker("te_jobs_worker.py", timeout_s=JOB_TIMEOUT_S,
                               together={n: [SAVES[n], LOADS[n]] for n in SAVES})


def job(shared: Path, command: str, nproc: int, first: int = 1) -> dict:
    """The record of ``command`` (``dist.save``, ``grouped.load``, ...) at ``nproc`` ranks, run once
    per session with the rest of its launch; a load after every save (from ``first`` ranks on, so
    that xdist workers start on different launches)."""
    if command.startswith("columns.") and not WITH_COLUMNS:  # its own launch, as te_columns_worker.py's main
        return torchrun_jobs.job(shared / "columns", COLUMNS_WORKER, command.split(".", 1)[1], nproc, JOB_TIMEOUT_S)
    if command.endswith(".load"):
        worlds = sorted(SAVES)
        i = worlds.index(first) if first in worlds else 0
        for n in worlds[i:] + worlds[:i]:
            _worker(shared, SAVES[n][0], n)
    return _worker(shared, command, nproc)
