"""The full-disk sweep (tests/full_disk.py) at every rank of a torchrun job on one real, loop-mounted
ext4 file system: ``torchrun ... full_disk_worker.py sweep MOUNT`` (run by tests/test_full_disk.py).
Each (door, spelling, target) is a section; a section also fails if no save in it ran out of space."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import full_disk as fd  # noqa: E402
import worker_results as wr  # noqa: E402

POINTS = int(os.environ.get("QDCP_FULL_DISK_POINTS", "6"))


def sweep(root: str, _mesh) -> None:
    root, world = Path(root), dist.get_world_size()
    if wr.RANK == 0:
        fd.reset(root, world)
        size = fd.save_size(root, world)
    sizes = [size if wr.RANK == 0 else 0]
    dist.broadcast_object_list(sizes, src=0)
    points = fd.sweep(sizes[0], POINTS)
    for door in fd.DOORS:
        for how in fd.SPELLINGS:
            for target in fd.TARGETS:
                section, failures = f"{door}/{how}/{target}", 0
                for free in points:
                    failed, problems = fd.run_case(root, door, how, target, free, wr.RANK, world)
                    failures += failed
                    for p in problems:
                        wr.check(section, False, p)
                wr.check(section, failures >= len(points) // 2,
                         f"only {failures} of {len(points)} saves ran out of space")


def init():
    dist.init_process_group("gloo")


if __name__ == "__main__":
    sys.exit(wr.run({"sweep": sweep}, init))
