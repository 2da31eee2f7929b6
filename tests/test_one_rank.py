"""examples/fsdp2_train.py at one rank, the most common machine.

At world size 1 FSDP2 skips the all-gather and gives torchao's NF4 ``fsdp_post_all_gather`` one of
its three tensors; the example keeps its frozen NF4 weight out of FSDP there (a plain
``NF4Tensor``, a DTensor at N ranks). These runs check that it trains and resumes at one rank in
each ``--api`` / ``--stager`` mode, and that its checkpoints cross between one rank and two: the
resumed losses are the uninterrupted run's bit for bit, and a checkpoint written at one rank holds
the same entries, bit for bit, as the one written at two.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from qdcp import QuantizedLoadPlanner
from torchrun_jobs import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
NF4 = "model.base.weight"


def run(root, nproc: int, *extra: str) -> str:
    """The example at ``nproc`` ranks, checkpointing every 2 steps; its rank-0 output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", os.path.join(ROOT, "examples", "fsdp2_train.py"), "--dir", str(root),
           "--steps", str(STEPS), "--ckpt-every", "2", *extra]
    # on the CPU wherever the suite runs: on a one-GPU machine 1 rank would take the GPU and 2 the CPU,
    # whose kernels round differently
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{nproc} ranks {extra}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    return proc.stdout


def assert_resumed_exactly(root, world: int, start: int) -> None:
    """The resumed run ran at ``world`` ranks from ``start``, and each of its losses equals the
    uninterrupted run's loss of that step, bit for bit (JSON floats round-trip exactly)."""
    with open(os.path.join(root, "run-first.json")) as f:
        first = json.load(f)["losses"]
    with open(os.path.join(root, "run-resume.json")) as f:
        resumed = json.load(f)
    assert (resumed["world"], resumed["start"], resumed["device"]) == (world, start, "cpu")
    assert sorted(resumed["losses"], key=int) == [str(s) for s in range(start, STEPS)]
    assert resumed["losses"] == {k: first[k] for k in resumed["losses"]}


def stored_entries(path) -> dict:
    """Every entry of a checkpoint as stored: raw entries' type, attributes, shape and components,
    plain tensors and objects as read."""
    out = {}
    for key, info in qdcp.describe(path).items():
        if info.get("stored_as") == "raw":
            e = qdcp.read_stored(path, key)
            out[key] = (e.type_name, e.attrs, tuple(e.shape), e.dtype, dict(e.components))
        else:
            out[key] = qdcp.read_entry(path, key)
    return out


def assert_same_entries(a: dict, b: dict) -> None:
    """The same keys, and every tensor the same dtype, shape and bits."""
    assert a.keys() == b.keys()

    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and (x.dtype, x.shape) == (y.dtype, y.shape) and torch.equal(x, y)
        if isinstance(x, (tuple, list)):
            return type(x) is type(y) and len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        return x == y
    assert [k for k in a if not same(a[k], b[k])] == []


@pytest.mark.multiproc
def test_fsdp2_train_at_one_rank_and_across(tmp_path):
    """Trained at 1 rank (``qdcp.async_save``, the writer's stager), resumed at 1 rank
    (``qdcp.load``; saves through a ``QuantizedStager``), then resumed at 2 ranks from the same
    1-rank checkpoint: exact losses each time, and step 4 written again at 2 ranks holds the same
    entries, bit for bit, as at 1 rank (the NF4 weight a plain ``NF4Tensor`` there, a DTensor here)."""
    out = run(tmp_path, 1)
    assert "step 6/6" in out
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("step_")) == ["step_2", "step_4", "step_6"]
    run(tmp_path, 1, "--resume", "--resume-step", "2", "--stager", "qdcp")
    assert_resumed_exactly(tmp_path, 1, 2)
    one_rank = tmp_path / "written-at-1"
    shutil.copytree(tmp_path / "step_4", one_rank)  # step_4 as the 1-rank resume wrote it
    assert qdcp.describe(one_rank)[NF4]["type"] == "torchao.NF4Tensor"
    written = os.stat(tmp_path / "step_4" / ".metadata").st_mtime_ns
    run(tmp_path, 2, "--resume", "--resume-step", "2")
    assert_resumed_exactly(tmp_path, 2, 2)
    assert os.stat(tmp_path / "step_4" / ".metadata").st_mtime_ns != written  # written again (overwrite=True)
    assert_same_entries(stored_entries(one_rank), stored_entries(tmp_path / "step_4"))


@pytest.mark.multiproc
def test_fsdp2_train_saved_at_two_ranks_resumes_at_one(tmp_path):
    """DCP's own calls with qdcp's planners (``--api dcp``): trained at 2 ranks, resumed at 1 from
    step 2 with exact losses; and the 2-rank checkpoint's NF4 entry (saved from a DTensor) loads
    into the plain ``NF4Tensor`` parameter the example holds at 1 rank, bit for bit."""
    run(tmp_path, 2, "--api", "dcp")
    run(tmp_path, 1, "--api", "dcp", "--resume", "--resume-step", "2")
    assert_resumed_exactly(tmp_path, 1, 2)
    from torchao.quantization import to_nf4

    stored = qdcp.read_stored(tmp_path / "step_2", NF4)
    g = torch.Generator().manual_seed(1)
    target = torch.nn.Parameter(to_nf4(torch.randn(*stored.shape, generator=g).to(torch.bfloat16)),
                                requires_grad=False)
    names = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
    assert not torch.equal(target.quantized_data, stored.components["quantized_data"])
    dcp.load({"model": {"base.weight": target}}, checkpoint_id=str(tmp_path / "step_2"),
             planner=QuantizedLoadPlanner(allow_partial_load=True))
    assert all(torch.equal(getattr(target, n), stored.components[n]) for n in names)
