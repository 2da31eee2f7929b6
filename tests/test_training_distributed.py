"""FSDP2 training with torchao's quantized-training weights, checkpointed through the front door.

Real ``torchrun`` jobs (gloo, CPU) run ``tests/training_dist_worker.py``: a float8-training MLP
(``convert_to_float8_training`` with FSDP2 float8 all-gather) and an MoE layer with torchao's MXFP8
training wrappers (expert weights ``[E, H, D]`` used through ``torch._grouped_mm``), AdamW:

- train at 2 ranks for 8 steps with the plain ``dcp.async_save(..., planner=QuantizedSavePlanner())``
  after steps 3 and 6 (the next step's in-place updates land before each upload plans);
- resume at 2 ranks from the step-6 checkpoint: steps 7-8 give the uninterrupted run's losses;
- load at 1 and 3 ranks: weights and optimizer states bit-identical to step 6's, the wrappers
  filled in place.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import torchrun_jobs

pytestmark = pytest.mark.multiproc

WORKER = Path(__file__).with_name("training_dist_worker.py")
JOB_TIMEOUT_S = 300


def _job(shared: Path, command: str, nproc: int) -> dict:
    return torchrun_jobs.job(shared, WORKER, command, nproc, JOB_TIMEOUT_S)


def _trained(shared: Path) -> None:
    torchrun_jobs.check_sections(_job(shared, "train", 2), "train at 2 ranks", ["train"])


def test_async_checkpoints_then_resume_give_the_uninterrupted_losses(shared_dir):
    _trained(shared_dir)
    torchrun_jobs.check_sections(_job(shared_dir, "resume", 2), "resume at 2 ranks", ["resume", "in_place"])


@pytest.mark.parametrize("m", [1, 3])
def test_load_at_another_world_size_is_exact(shared_dir, m):
    _trained(shared_dir)
    torchrun_jobs.check_sections(_job(shared_dir, "load", m), f"load at {m} ranks", ["load", "in_place"])
