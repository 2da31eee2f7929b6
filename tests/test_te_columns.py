"""TransformerEngine tensors loaded into targets cut by columns (tensor parallelism), on TE's real classes on
CPU (``te_cpu`` stands in for TE's compiled module).

``te_columns_worker.py`` saves every format (per-tensor Float8 with data and transpose; MXFP8 1x32 +
32x1, and 32x1 alone; blockwise 1x128 and 128x128; NVFP4 1x16, and TE's 2-D 16x16 weights) at a
``(2, 2)`` mesh as a column-parallel weight (rows) and as a row-parallel one (``Shard(0)`` x
``Shard(1)``: columns), each ``512 x N`` with ``N`` twice the format's column block, and loads both:

- column cuts on block boundaries (whole tensors; ``Shard(1)`` at 2 ranks, TP's ``RowwiseParallel``;
  a ``(2, 2)`` mesh whose TP dimension cuts columns): same-type targets hold the same block of the
  source bit for bit (canonical components, derived copies rebuilt, buffers updated in place), and
  the loaded shards' dequantize (TE's own for Float8 and blockwise) is the source's, bit for bit;
- column cuts that split blocks (``Shard(1)`` at 3 ranks) or leave a rank less than one block (a
  ``(1, 4)`` mesh): an ``AlignmentError`` at load planning naming the key and the nearest layout
  that works, the target untouched; formats without a column block (Float8, MXFP8 columnwise) load
  exactly; plain targets of every cut load every format exactly.

Its save (4 ranks) and loads (1-4 ranks) run once per session, in the launches the TE jobs of each
world size share (tests/te_jobs.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import te_cpu
import te_jobs
import torchrun_jobs
from qdcp.layouts import Blocked, Flat, Replicated, nearest_aligned

needs_te = pytest.mark.skipif(not te_cpu.te_installed(), reason="transformer_engine is not installed")

FORMATS = ("float8", "mxfp8", "mxfp8_colwise", "block1d", "block2d", "nvfp4", "nvfp4_2d")
NO_COLUMN_BLOCK = ("float8", "mxfp8_colwise")


SHARED_DIR = te_jobs.SHARED_DIR  # the TE jobs' directory; this module's files are under columns/


def _job(shared: Path, command: str, nproc: int) -> dict:
    """Run (once per session, in the TE jobs' launch of its world size) ``command`` at ``nproc`` ranks; its record."""
    return te_jobs.job(shared, f"columns.{command}", nproc, first=nproc)


def _loaded(shared: Path, m: int) -> dict:
    torchrun_jobs.check_sections(_job(shared, "save", 4), "save at (2, 2)", ["save"])
    return _job(shared, "load", m)


@pytest.mark.multiproc
@needs_te
def test_te_save_row_and_column_parallel_sources(shared_dir):
    """Every format saved at a (2, 2) mesh with FSDP2 x TP's placements of a column-parallel weight
    (rows) and of a row-parallel one (columns: 2 column shards, each on block boundaries)."""
    torchrun_jobs.check_sections(_job(shared_dir, "save", 4), "save at (2, 2)", ["save"])
    for layout in ("colwise", "rowwise"):
        assert (shared_dir / "columns" / f"src_{layout}" / ".metadata").exists()


@pytest.mark.multiproc
@needs_te
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", (1, 2, 4))
def test_te_column_cuts_on_blocks_load_bit_exact(shared_dir, m, fmt):
    """Whole targets (1), Shard(1) at 2 ranks, and the (2, 2) mesh Shard(0) x Shard(1) (4): the same
    block of the source in the target's buffers, and the shards' dequantize equal to the source's."""
    record = _loaded(shared_dir, m)
    names = [f"plain[{fmt}]", f"same_type[{fmt}]", f"whole_dequantize[{fmt}]"]
    if fmt in ("float8", "block1d", "block2d"):
        names.append(f"te_dequantize[{fmt}]")
    torchrun_jobs.check_sections(record, f"load at {m} ranks", names)


@pytest.mark.multiproc
@needs_te
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", (3, 4))
def test_te_column_cuts_that_split_blocks_are_refused_at_planning(shared_dir, m, fmt):
    """Shard(1) at 3 ranks (cuts inside blocks) and a (1, 4) mesh (each rank less than one block):
    an AlignmentError naming the key and the nearest layout that works, the target bit-identical;
    formats without a column block load exactly; plain targets always do."""
    record = _loaded(shared_dir, m)
    names = [f"plain[{fmt}]"]
    names += [f"same_type[{fmt}]", f"whole_dequantize[{fmt}]"] if fmt in NO_COLUMN_BLOCK else [f"refused[{fmt}]"]
    torchrun_jobs.check_sections(record, f"load at {m} ranks", names)


# ----------------------------------------------------------------------------- the message itself

# TE blockwise 1x128: rowwise (1, 128) and columnwise (128, 1) scales; columns fall on 128, rows on 128
BLOCK1D = {"rowwise_data": Blocked((1, 1)), "rowwise_scale_inv": Blocked((1, 128)),
           "columnwise_data": Blocked((1, 1)), "columnwise_scale_inv": Blocked((128, 1))}


def test_nearest_aligned_names_the_nearest_column_cut():
    """A 64-column shard of a 256-column 1x128 tensor (TP over 4): the shard is less than one block;
    the nearest cut whose shards hold whole blocks is TP over 2, or dim 1 kept whole."""
    assert nearest_aligned(BLOCK1D, (512, 256), ((0, 64), (512, 64))) == (
        " (this shard holds 64 columns, less than one block of 128). The nearest layout that works: "
        "Shard(1) over 2 ranks (128 columns each), or dim 1 whole on every rank (Replicate() on the mesh "
        "dimension that cuts it, or Shard(0) there instead, its shards on multiples of 128 rows); or a "
        "plain tensor target, which loads from any sharding (the dequantized values)")


def test_nearest_aligned_cases():
    # on block boundaries, the tail block partial: nothing to say
    assert nearest_aligned(BLOCK1D, (512, 256), ((128, 128), (128, 128))) == ""
    assert nearest_aligned(BLOCK1D, (512, 300), ((0, 256), (512, 44))) == ""
    # a cut wider than a block that still splits blocks
    msg = nearest_aligned({"s": Blocked((1, 32))}, (64, 320), ((0, 0), (64, 107)))
    assert "its columns [0, 107) cut blocks of 32" in msg
    assert "Shard(1) over 2 ranks (160 columns each)" in msg  # 3 shards of 107 do not fall on 32; 2 of 160 do
    # rows: a 64-row shard of 128x128 tiles
    msg = nearest_aligned({"s": Blocked((128, 128))}, (512, 256), ((64, 0), (64, 256)))
    assert "this shard holds 64 rows, less than one block of 128" in msg
    assert "Shard(0) over 4 ranks (128 rows each), or dim 0 whole on every rank (Replicate() on the mesh " \
           "dimension that cuts it)" in msg
    # one block spans the dim: it cannot be cut at all
    msg = nearest_aligned({"s": Blocked((1, 128))}, (128, 128), ((0, 64), (128, 64)))
    assert "dim 1 whole on every rank (Replicate() on the mesh dimension that cuts it, or Shard(0) there " \
           "instead; its 128 columns do not split into shards of whole blocks of 128)" in msg
    assert "Shard(1) over" not in msg
    # the NVFP4 data's 2-per-byte and the scales' 16 together: 16
    msg = nearest_aligned({"d": Blocked((1, 2)), "s": Blocked((1, 16)), "a": Replicated((1,))}, (512, 32),
                          ((0, 11), (512, 11)))
    assert "less than one block of 16" in msg and "Shard(1) over 2 ranks (16 columns each)" in msg
    # flat and replicated layouts have no blocks along a dim (flat ones say so in their own error)
    assert nearest_aligned({"f": Flat(256), "r": Replicated((1,))}, (128, 128), ((0, 64), (128, 64))) == ""
