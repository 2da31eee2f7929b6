"""Multi-process resharding of TransformerEngine tensors: Shard(0) DTensors saved at N ranks,
loaded at M ranks, on TE's real classes on CPU (``te_cpu`` stands in for TE's compiled module).

Formats (``te_dist_worker.py`` builds each rank's rows from deterministic global buffers, 512 x 256):
Float8 current scaling (Hopper: data and transpose), MXFP8 rowwise compact, blockwise FP8 1x128
(rowwise and columnwise) and 128x128 (both copies), NVFP4 rowwise with one per-tensor amax.

- N, M in {1, 2, 4}: shards on 128-row boundaries, every format bit-exact both ways.
- 3 ranks (171/171/170 rows): blockwise formats (128-row blocks straddle the boundaries) are refused
  at save planning with an AlignmentError naming the key, and TE targets of those rows likewise at
  load planning; the other formats save and load at 3 ranks exactly; plain targets at 3 ranks load
  every format exactly (the covering blocks are read and dequantized).
- Per-tensor values (Float8 scale_inv, NVFP4 amax) must be the same on every rank; shards that
  differ are refused at save naming the key.

- Saved at a (2, 2) mesh (FSDP2 x TP's ``_StridedShard`` x ``Shard(0)``, and HSDP), loaded at every
  M like the 1-D checkpoints.
Jobs run once per session under a file lock (shared by pytest-xdist workers): one save job per N in
{1, 2, 3, 4}, one load job per M in {1, 2, 3, 4} that loads every saved checkpoint, each in the
launch it shares with test_te_grouped_distributed.py's at that world size (tests/te_jobs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import te_cpu
import te_jobs
import torchrun_jobs

if not te_cpu.te_installed():
    pytest.skip("transformer_engine is not installed", allow_module_level=True)

pytestmark = pytest.mark.multiproc

WORLDS = (1, 2, 3, 4)
ALIGNED = (1, 2, 4)
FORMATS = ("float8", "mxfp8", "block1d", "block2d", "nvfp4")
STRADDLING = ("block1d", "block2d")


# ----------------------------------------------------------------------------- running jobs

SHARED_DIR = te_jobs.SHARED_DIR  # the TE jobs' directory; this module's files are under dist/


def _job(shared: Path, command: str, nproc: int, first: int = 1) -> dict:
    """Run (once per session, in the TE jobs' launch of its world size) ``command`` at ``nproc`` ranks; its record."""
    return te_jobs.job(shared, f"dist.{command}", nproc, first)


_sections = torchrun_jobs.check_sections


def _saved(shared: Path, first: int = 1) -> None:
    """Every save job (each once per session), starting from ``first`` (xdist workers spread out)."""
    i = WORLDS.index(first)
    for n in WORLDS[i:] + WORLDS[:i]:
        _sections(_job(shared, "save", n), f"save at {n} ranks", ["save"])
    _sections(_job(shared, "save2d", 4), "save at a (2, 2) mesh", ["save2d"])


def _loaded(shared: Path, m: int) -> dict:
    _saved(shared, first=m)
    return _job(shared, "load", m, first=m)


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("n", WORLDS)
def test_te_shard0_save(shared_dir, n):
    """Save every format as Shard(0) DTensors at N ranks (at 3 ranks, the non-straddling ones)."""
    record = _job(shared_dir, "save", n)
    _sections(record, f"save at {n} ranks", ["save"])
    assert (shared_dir / "dist" / f"n{n}" / "main" / ".metadata").exists()


def test_te_unaligned_save_is_refused_at_planning_naming_the_key(shared_dir):
    """3 ranks over 512 rows (171/171/170): 1x128 columnwise and 128x128 scales cover 128-row blocks
    that straddle the shard boundaries: an AlignmentError naming the key, before anything is written."""
    record = _job(shared_dir, "save", 3)
    _sections(record, "save at 3 ranks", ["unaligned_save_error"])
    outcomes = json.loads((shared_dir / "dist" / "n3" / "unaligned_outcomes.json").read_text())
    for fmt in STRADDLING:
        assert outcomes[fmt].startswith("error AlignmentError") and f"'te.{fmt}'" in outcomes[fmt], outcomes


@pytest.mark.parametrize("n", (2, 4))
def test_te_per_tensor_values_that_differ_across_ranks_are_refused(shared_dir, n):
    """A Float8 scale_inv or NVFP4 amax that is not the same on every rank (shards quantized each on
    its own): DCP keeps one copy of a replicated item, so the save fails naming the key."""
    record = _job(shared_dir, "save", n)
    _sections(record, f"save at {n} ranks", ["mismatched_per_tensor[float8]", "mismatched_per_tensor[nvfp4]"])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", WORLDS)
def test_te_reshard_load(shared_dir, m, fmt):
    """Every checkpoint saved at N in {1, 2, 3, 4} loaded at M ranks into plain Shard(0) DTensors and
    plain full tensors (bitwise the reference dequantize of the global buffers; at M = 3, through the
    covering blocks) and into same-type TE Shard(0) targets (canonical components bitwise the global
    rows', derived copies rebuilt, buffers updated in place) where M's rows do not straddle blocks."""
    record = _loaded(shared_dir, m)
    names = ["loaded_all", f"plain_shard[{fmt}]", f"plain_full[{fmt}]"]
    if m in ALIGNED or fmt not in STRADDLING:
        names.append(f"same_type[{fmt}]")
    _sections(record, f"load at {m} ranks", names)


@pytest.mark.parametrize("fmt", STRADDLING)
def test_te_unaligned_target_is_refused_at_planning_naming_the_key(shared_dir, fmt):
    """TE blockwise targets of 171/171/170 rows cannot take whole blocks: AlignmentError naming the
    key, and the targets are left untouched (qdcp does not quantize into TE tensors)."""
    record = _loaded(shared_dir, 3)
    _sections(record, "load at 3 ranks", [f"unaligned_target_error[{fmt}]"])
