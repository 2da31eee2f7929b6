"""One torchrun launch for the commands of three TransformerEngine workers at one world size.

``te_dist_worker.py`` (Shard(0) TE tensors), ``te_grouped_dist_worker.py`` (GroupedTensor experts) and
``te_columns_worker.py`` (column cuts) each run save and load jobs; their ranks import the same
torch, torchao, DCP and TE classes (seconds each on the CI's 2 cores). Here their commands run in the
same processes, each on its own directory of the job's root (``dist/``, ``grouped/``, ``columns/``),
under the names ``dist.<command>``, ``grouped.<command>`` and ``columns.<command>`` (tests/te_jobs.py
groups them; worker_results.run runs a group in order and writes each command's results). The
grouped worker's commands run under ``simulate_gpu(HOPPER)``, as its own ``main`` runs them; all use
one gloo process group over every rank (the columns worker's on the CPU only: tests/te_jobs.py).

    torchrun --nproc-per-node N tests/te_jobs_worker.py dist.save+grouped.save DIR
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")

import te_columns_worker  # noqa: E402
import te_cpu  # noqa: E402
import te_dist_worker  # noqa: E402
import te_grouped_dist_worker  # noqa: E402
from dist_helpers import init_torchrun_mesh  # noqa: E402
from worker_results import run  # noqa: E402


def _in(sub: str, command, hopper: bool = False):
    """``command`` run on the directory ``sub`` of the job's root (under ``simulate_gpu(HOPPER)``)."""
    def on_root(root: str, mesh) -> None:
        path = os.path.join(root, sub)
        os.makedirs(path, exist_ok=True)
        if not hopper:
            return command(path, mesh)
        with te_cpu.simulate_gpu(te_cpu.HOPPER):
            return command(path, mesh)
    return on_root


COMMANDS = {f"dist.{name}": _in("dist", c) for name, c in te_dist_worker.COMMANDS.items()}
COMMANDS.update({f"grouped.{name}": _in("grouped", c, hopper=True)
                 for name, c in te_grouped_dist_worker.COMMANDS.items()})
COMMANDS.update({f"columns.{name}": _in("columns", c) for name, c in te_columns_worker.COMMANDS.items()})


def main() -> int:
    return run(COMMANDS, init_torchrun_mesh)


if __name__ == "__main__":
    sys.exit(main())
