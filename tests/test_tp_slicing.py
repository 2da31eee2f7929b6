"""A per-row torchao weight cut by columns as torchao's tensor-parallel recipes cut it (evenly and
unevenly), at 2 real ranks, saved and loaded through ``dcp.save`` / ``dcp.load`` with qdcp's
planners and through ``qdcp.load``: the source's bits everywhere, its scales written once (see
tests/tp_slicing_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import torchrun_jobs

WORKER = Path(__file__).with_name("tp_slicing_worker.py")


@pytest.mark.multiproc
def test_per_row_weights_cut_by_columns_keep_their_bits_everywhere(tmp_path):
    rc, out, _ = torchrun_jobs.torchrun(WORKER, "run", 2, tmp_path, 240)
    assert rc == 0 and out.count(": OK") == 2, out[-3000:]
