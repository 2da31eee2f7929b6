"""A 2-rank job that destroys its process group before its async save finished (tests/teardown_worker.py):
the save fails loudly on every rank and commits nothing, through ``qdcp.async_save`` and through
``dcp.async_save`` with qdcp's writer. (Each rank used to commit a checkpoint of its own data alone:
a torn checkpoint that looked complete.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchrun_jobs import torchrun

WORKER = Path(__file__).with_name("teardown_worker.py")


@pytest.mark.parametrize("door", ["qdcp", "dcp"])
def test_a_destroyed_process_group_commits_no_torn_checkpoint(tmp_path, door):
    rc, out, _ = torchrun(WORKER, door, 2, tmp_path, 240)
    outcomes = {}
    for rank in range(2):
        f = tmp_path / f"outcome-{rank}.json"
        assert f.exists(), f"rank {rank} wrote no outcome (torchrun exit {rc}):\n{out[-4000:]}"
        outcomes[rank] = json.loads(f.read_text())
    assert not (tmp_path / "step_3" / ".metadata").exists(), (outcomes, out[-3000:])
    for rank, o in outcomes.items():
        assert o["raised"] is not None, f"rank {rank}'s save reported success: {outcomes}"
        if door == "qdcp":  # (DCP's own call may find the group gone first: its ValueError names it)
            assert "no longer initialized" in o["message"] and "destroy_process_group" in o["message"], outcomes


def test_a_script_that_ends_with_its_async_save_running_keeps_the_save(tmp_path):
    """Each rank's script returns right after ``qdcp.async_save`` (no ``result()``): the interpreter's
    exit waits for the save, saying so once per rank, and the checkpoint is committed and complete
    (it used to fail at exit, unsaid: concurrent.futures refuses new work at interpreter shutdown)."""
    import torch
    from torchao.quantization import Int8Tensor
    from torchao.quantization.granularity import PerRow

    import qdcp

    rc, out, _ = torchrun(WORKER, "exit", 2, tmp_path, 240)
    assert out.count("qdcp: waiting at exit for 1 async save(s) still running") == 2, out[-4000:]
    assert "the async save failed" not in out, out[-4000:]
    state, expected = {}, {}
    for rank in range(2):
        g = torch.Generator().manual_seed(rank)
        for i in range(4):
            t = Int8Tensor.from_hp(torch.randn(1024, 1024, generator=g), PerRow())
            expected[f"layer{rank}.{i}.weight"] = t
            state[f"layer{rank}.{i}.weight"] = Int8Tensor.from_hp(torch.zeros(1024, 1024), PerRow())
    qdcp.load({"model": state}, tmp_path / "step_3")
    for key, t in expected.items():
        assert torch.equal(state[key].qdata, t.qdata) and torch.equal(state[key].scale, t.scale), key
