"""Saves a checkpoint and SIGKILLs itself at a chosen point (run by tests/test_storage_commits.py).

    python tests/crash_worker.py PATH VERSION KILL_AT [--overwrite] [--async]

KILL_AT: ``none``; ``resolve:N`` (the N-th item handed to the writer); ``before_commit`` (all data
written, no .metadata yet); ``replace`` (new .metadata written to .metadata.<token>.tmp, not yet published);
``cleanup`` (committed, old files not yet removed).
"""

from __future__ import annotations

import os
import signal
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import qdcp  # noqa: E402
from qdcp.storage import CheckpointWriter  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from quantized_cases import CASE_BY_NAME  # noqa: E402


def state(version: int) -> dict:
    """The state saved as ``version``: quantized, plain and object entries."""
    return {
        "int8": CASE_BY_NAME["int8_group32"].make(version),
        "nf4": CASE_BY_NAME["nf4"].make(version),
        "mx": CASE_BY_NAME["mx_fp4_swizzled"].make(version),
        "bias": torch.full((64,), float(version)),
        "step": version,
    }


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillingPlanner(qdcp.QuantizedSavePlanner):
    def __init__(self, at: int):
        super().__init__()
        self.at, self.seen = at, 0

    def resolve_data(self, write_item):
        self.seen += 1
        if self.seen == self.at:
            die()
        return super().resolve_data(write_item)


class KillingWriter(CheckpointWriter):
    def __init__(self, path, kill_at, overwrite):
        super().__init__(path, overwrite=overwrite)
        self.kill_at = kill_at

    def _commit(self, metadata, results):
        if self.kill_at == "before_commit":
            die()
        if self.kill_at == "replace":  # the publish: os.replace (overwrite) or os.link (a new path)
            real_replace, real_link = os.replace, os.link

            def replace(src, dst):
                if str(dst).endswith(".metadata"):
                    die()
                return real_replace(src, dst)

            def link(src, dst):
                if str(dst).endswith(".metadata"):
                    die()
                return real_link(src, dst)
            os.replace, os.link = replace, link
        super()._commit(metadata, results)

    def _remove_unreferenced(self, referenced):
        if self.kill_at == "cleanup":
            die()
        super()._remove_unreferenced(referenced)


def main() -> None:
    path, version, kill_at = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    overwrite = "--overwrite" in sys.argv
    at = int(kill_at.split(":")[1]) if kill_at.startswith("resolve:") else 0
    writer, planner = KillingWriter(path, kill_at, overwrite), KillingPlanner(at)
    if "--async" not in sys.argv:
        dcp.save(state(version), storage_writer=writer, planner=planner, no_dist=True)
        return
    # async: the upload (and so the kill) happens in DCP's background thread while training goes on
    live = state(version)
    fut = dcp.async_save(live, storage_writer=writer, planner=planner,
                         async_stager=qdcp.QuantizedStager(), no_dist=True)
    live["int8"].qdata.zero_()
    fut.result()


if __name__ == "__main__":
    main()
