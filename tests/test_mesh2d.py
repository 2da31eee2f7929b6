"""Quantized weights under 2-D parallelism (issue 29): FSDP2 x TP and HSDP, saved at one mesh,
loaded at any.

``torchrun`` jobs (gloo, CPU) run ``tests/mesh2d_worker.py``: torchao Int8 / Float8 per-row,
MXFP8, NVFP4 and torchao's 8-bit, 4-bit and FP8 optimizer states as DTensors with the placements torchtitan's FSDP2 x TP
gives real weights (``_StridedShard`` x ``Shard(0)``, ``Shard(0)`` x ``Shard(1)``) and HSDP's
(``Replicate()`` x ``Shard(0)``), saved at a ``(2, 2)`` mesh, loaded bit-exact at the same mesh,
1-D FSDP over 4, 1-D TP over 2 (rows and columns), a ``(1, 4)`` mesh and one process, into the same
type (the source's bits where the target's scale blocks fit in the source's, else the checkpoint's
values quantized like the target) and into plain tensors (the library's ``dequantize()`` of the
source blocks). A column cut of flat-block optimizer state is refused naming the key; diverged
HSDP replicas are named by ``check_replicas=True``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import torchrun_jobs

pytestmark = pytest.mark.multiproc

_job = torchrun_jobs.Worker("mesh2d_worker.py", timeout_s=300)  # each (command, ranks) runs once per session
LAYOUTS = ["colwise", "rowwise", "hsdp"]


def _saved(shared_dir: Path) -> None:
    torchrun_jobs.check_sections(_job(shared_dir, "save", 4), "save at (2, 2)", ["save"])


def test_save_at_fsdp_x_tp_and_hsdp(shared_dir):
    _saved(shared_dir)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_at_the_same_mesh(shared_dir, layout):
    _saved(shared_dir)
    torchrun_jobs.check_sections(_job(shared_dir, "load-same", 4), "load at (2, 2)", [f"same-{layout}"])


@pytest.mark.parametrize("command,nproc,sections", [
    ("load-fsdp", 4, ["fsdp"]),
    ("load-tp", 2, ["tp-rows", "tp-cols"]),
    ("load-other", 4, ["other-2d"]),
    ("load-single", 1, ["single"]),
])
def test_load_at_another_mesh(shared_dir, command, nproc, sections):
    _saved(shared_dir)
    torchrun_jobs.check_sections(_job(shared_dir, command, nproc), f"{command} at {nproc} ranks", sections)


def test_diverged_replicas_are_named(shared_dir):
    torchrun_jobs.check_sections(_job(shared_dir, "replicas", 4), "replicas at (2, 2)", ["replicas"])
