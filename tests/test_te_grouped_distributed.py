"""Expert parallelism with TE GroupedTensors: 8 experts saved at N ranks load at M ranks.

Real ``torchrun`` jobs (gloo) on TE's real classes on CPU; ``te_grouped_dist_worker.py`` builds the
groups (one per recipe: MXFP8, FP8 current and delayed scaling, blockwise 1x128 and 128x128, NVFP4,
bf16) and checks every target:

- save at N in {1, 2}: each rank's experts as a local GroupedTensor inside a ``Shard(0)`` DTensor of
  the stacked ``[8, 128, 256]`` tensor (raw and dequantized), and as per-member keys ``weight<i>``;
  ``dcp.async_save`` with ``QuantizedStager`` of the grouped state (live groups zeroed right after it
  returns) writes data files byte-for-byte the sync save's;
- load at M in {1, 2, 4} from each of those checkpoints into: local GroupedTensors of M's experts
  (bit-identical canonical components, in place), plain stacked ``Shard(0)`` DTensors (== the
  members' reference dequantize), per-member keys as lone TE tensors and plain tensors, and every
  expert's key as a ``Shard(0)`` DTensor over its rows (plain and TE, raw; a blockwise TE shard that
  cuts a 128-row block is refused naming the key and left untouched).

Jobs run once per session under a file lock (shared by pytest-xdist workers), each world size's in
the launch it shares with test_te_distributed.py's (tests/te_jobs.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import te_cpu
import te_jobs
import torchrun_jobs

if not te_cpu.te_installed():
    pytest.skip("transformer_engine is not installed", allow_module_level=True)

pytestmark = pytest.mark.multiproc

SAVE_WORLDS = (1, 2)
LOAD_WORLDS = (1, 2, 4)
RECIPES = ("mxfp8_both", "current_both_hopper", "delayed_both_e5m2", "block1_both", "block2_both",
           "nvfp4_both", "bf16")
TARGETS = ("grouped_target", "plain_stack", "member_keys", "member_plain", "member_rows_plain")


SHARED_DIR = te_jobs.SHARED_DIR  # the TE jobs' directory; this module's files are under grouped/


def _job(shared: Path, command: str, nproc: int) -> dict:
    """Run (once per session, in the TE jobs' launch of its world size) ``command`` at ``nproc`` ranks; its record."""
    return te_jobs.job(shared, f"grouped.{command}", nproc, first=nproc)


def _saved(shared: Path) -> None:
    for n in SAVE_WORLDS:
        torchrun_jobs.check_sections(_job(shared, "save", n), f"save at {n} ranks", ["save"])


@pytest.mark.parametrize("n", SAVE_WORLDS)
def test_experts_save_as_shards_of_the_stack_and_as_member_keys(shared_dir, n):
    """Each rank saves its 8/N experts: grouped (Shard(0) of [8, M, N], raw and dequantized) and by member."""
    torchrun_jobs.check_sections(_job(shared_dir, "save", n), f"save at {n} ranks", ["save", "async_save"])
    for kind in ("grouped", "members"):
        assert (shared_dir / "grouped" / f"n{n}" / kind / ".metadata").exists()


@pytest.mark.parametrize("m", LOAD_WORLDS)
def test_experts_load_at_another_expert_parallel_layout(shared_dir, m):
    """Checkpoints saved at 1 and 2 ranks (grouped and per-member) into every target at M ranks."""
    _saved(shared_dir)
    record = _job(shared_dir, "load", m)
    names = ["loaded_all"] + [f"{t}[{r}]" for t in TARGETS for r in RECIPES]
    blockwise = ("block1_both", "block2_both")  # 128-row blocks: M = 2, 4 cut them
    names += [f"member_rows_te[{r}]" for r in RECIPES if r != "bf16" and (m == 1 or r not in blockwise)]
    names += [f"member_rows_te_unaligned[{r}]" for r in blockwise if m > 1]
    torchrun_jobs.check_sections(record, f"load at {m} ranks", names)
