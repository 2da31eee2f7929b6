"""Quantized weights under 2-D parallelism: FSDP2 x TP and HSDP, saved at one mesh,
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

``tests/mesh2d_training_worker.py`` runs a real model the way torchtitan builds it (torchao float8
training, ``parallelize_module`` over TP, then ``fully_shard`` over DP) with torchao's AdamW8bit:
trained at ``(2, 2)``, checkpointed by the plain ``dcp.async_save`` with qdcp's planner while
training goes on (the row-parallel weight's 8-bit states stored as the grid of their per-shard
blocks), resumed at ``(2, 2)`` with every buffer and the uninterrupted run's losses bit for bit, and
loaded into an unconverted model under 1-D FSDP over 4 and in one process (weights bit-exact; states
the saved bits where the blocks match, else the saved values quantized in the target's blocks).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mesh2d_worker
import qdcp
import torchrun_jobs
from quantized_cases import bits_diff

pytestmark = pytest.mark.multiproc

# each (command, ranks) runs once per session; at 4 ranks, the save with the replicas check, and the
# three loads of that save, in one launch each
_job = torchrun_jobs.Worker("mesh2d_worker.py", timeout_s=300,
                            together={4: [("save", "replicas"), ("load-same", "load-fsdp", "load-other")]})
_training = torchrun_jobs.Worker("mesh2d_training_worker.py", timeout_s=300)
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


def test_column_cut_optimizer_state_reads_back_through_the_cli(shared_dir):
    """torchao's optimizer state of a row-parallel (column-cut) weight, saved as the grid of its
    per-shard blocks: ``qdcp verify`` passes, ``qdcp.read_entry(..., dequantize=True)`` gives
    torchao's own ``dequantize()`` of every saved shard, and a rebuild (no torchao instance holds
    such blocks) is refused naming what to do."""
    _saved(shared_dir)
    ckpt = shared_dir / "main"
    out = subprocess.run([sys.executable, "-m", "qdcp", "verify", str(ckpt), "--quiet"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().startswith("OK"), out.stdout + out.stderr
    blocks = mesh2d_worker.source_blocks(str(shared_dir))
    for name in mesh2d_worker.FLAT:
        key = f"{name}.rowwise"
        got = qdcp.read_entry(ckpt, key, dequantize=True)
        assert bits_diff(got, mesh2d_worker.values(name, blocks[key])) is None, key
        with pytest.raises(qdcp.UnsupportedTensorError, match=f"key {key!r}: .*not row ranges.*read it dequantized"):
            qdcp.read_entry(ckpt, key)


def test_diverged_replicas_are_named(shared_dir):
    torchrun_jobs.check_sections(_job(shared_dir, "replicas", 4), "replicas at (2, 2)", ["replicas"])


def _trained(shared_dir: Path) -> None:
    torchrun_jobs.check_sections(_training(shared_dir, "train", 4), "train at (2, 2)", ["train"])


def test_real_model_trained_at_fsdp_x_tp_resumes_bit_exact(shared_dir):
    _trained(shared_dir)
    torchrun_jobs.check_sections(_training(shared_dir, "train", 4), "resume at (2, 2)", ["resume_2d"])


def test_real_model_checkpoint_loads_into_plain_models_at_other_meshes(shared_dir):
    _trained(shared_dir)
    torchrun_jobs.check_sections(_training(shared_dir, "train", 4), "1-D FSDP over 4", ["plain_fsdp_4"])
    torchrun_jobs.check_sections(_training(shared_dir, "single", 1), "one process", ["plain_single"])
