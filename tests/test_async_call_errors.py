"""``qdcp.async_save`` raises at the call what is known then (an existing checkpoint, a claim held
by another save, a state dict the planner refuses), as qdcp's error, before anything is staged;
what fails in the background arrives from its future as an ordinary ``Exception`` with a note
naming the path and the rank. (These used to arrive from the future, one checkpoint interval
late, after staging; tests/async_call_errors_worker.py checks the same at 2 ranks.)"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import qdcp
from quantized_cases import CASE_BY_NAME

INT8 = CASE_BY_NAME["int8_row"]


class CountingStager(qdcp.QuantizedStager):
    """A QuantizedStager that counts what it staged."""

    def __init__(self) -> None:
        super().__init__()
        self.staged = 0

    def stage(self, state_dict):
        self.staged += 1
        return super().stage(state_dict)


def _state(seed: int = 0) -> dict:
    return {"model": {"0.weight": INT8.make(seed), "0.bias": torch.randn(8)}, "step": seed}


def _files(path) -> list[str]:
    return sorted(os.listdir(path))


def test_an_existing_checkpoint_is_refused_by_the_call_before_staging(tmp_path):
    path = tmp_path / "step_3"
    qdcp.save(_state(), path)
    before = _files(path)
    stager = CountingStager()
    with pytest.raises(qdcp.QdcpError, match=r"a checkpoint already exists at .*step_3.*pass overwrite=True"):
        qdcp.async_save(_state(1), path, stager=stager)
    assert stager.staged == 0 and _files(path) == before
    qdcp.async_save(_state(1), path, stager=stager, overwrite=True).result()  # overwrite=True goes through
    assert stager.staged == 1
    got = {"step": -1}
    qdcp.load(got, path, allow_partial_load=True)
    assert got == {"step": 1}


def test_a_claim_held_by_another_save_is_refused_by_the_call_before_staging(tmp_path):
    path = tmp_path / "step_3"
    path.mkdir()
    doc = {"qdcp_claim": 1, "token": "0123456789ab", "since": time.time(), "what": "a qdcp save of 8 ranks (train.py)",
           "owner": {"host": "node-17", "boot": "b", "pidns": "p", "pid": 4242, "start": "1"}}
    (path / ".qdcp-save.claim").write_text(json.dumps(doc))
    stager = CountingStager()
    with pytest.raises(qdcp.ConcurrentSaveError, match=r"another save holds .*pid 4242 on host 'node-17'"):
        qdcp.async_save(_state(), path, stager=stager)
    assert stager.staged == 0 and _files(path) == [".qdcp-save.claim"]


@pytest.mark.parametrize("bad, error, match", [
    ({"w.__qdcp__.qdata": torch.ones(2)}, qdcp.ReservedKeyError, r"w\.__qdcp__\.qdata"),
    ([torch.ones(2)], TypeError, r"state_dict must be a dict, not list"),
])
def test_a_state_dict_the_planner_refuses_is_refused_by_the_call_before_staging(tmp_path, bad, error, match):
    path = tmp_path / "step_3"
    stager = CountingStager()
    with pytest.raises(error, match=match):
        qdcp.async_save(bad, path, stager=stager)
    assert stager.staged == 0 and not path.exists()


def test_a_background_failure_is_an_exception_naming_path_and_rank(tmp_path):
    (tmp_path / "a_file").write_text("")
    path = tmp_path / "a_file" / "step_3"  # known only when the upload makes the directory
    fut = qdcp.async_save(_state(), path, stager=CountingStager())
    with pytest.raises(Exception) as info:  # noqa: PT011 (what it is, is the point)
        fut.result(timeout=120)
    assert isinstance(info.value, OSError) and isinstance(info.value, Exception), repr(info.value)
    assert info.value.__notes__ == [f"qdcp.async_save to {str(path)!r} in this process alone"]


def test_at_two_ranks_every_rank_raises_at_the_call_and_training_goes_on(tmp_path):
    from pathlib import Path

    from torchrun_jobs import torchrun

    rc, out, _ = torchrun(Path(__file__).with_name("async_call_errors_worker.py"), "all", 2, tmp_path, 240)
    outcomes = {}
    for rank in range(2):
        f = tmp_path / f"outcome-{rank}.json"
        assert f.exists(), f"rank {rank} wrote no outcome (torchrun exit {rc}):\n{out[-4000:]}"
        outcomes[rank] = json.loads(f.read_text())
    for rank, o in outcomes.items():
        assert o["exists"]["raised"] == "QdcpError" and "a checkpoint already exists" in o["exists"]["message"], o
        assert o["bad_on_rank_1"]["raised"] == "ReservedKeyError", o
        assert not o["bad_dir_made"] and o["good_after"] == {"raised": None} and o["all_reduce_after"] == 2.0, o
        assert o["checkpoint_group"] == {"reused": True, "backend": "gloo", "is_default": False, "size": 2}, o
    assert "w.__qdcp__.qdata" in outcomes[1]["bad_on_rank_1"]["message"]
    assert outcomes[0]["bad_on_rank_1"]["message"].startswith(
        f"the async save to {str(tmp_path / 'bad')!r} was refused on rank 1 (ReservedKeyError: "), outcomes[0]
    assert (tmp_path / "good" / ".metadata").is_file()
