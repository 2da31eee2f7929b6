"""Lightning's real ``ModelParallelStrategy`` (FSDP2) with qdcp's recipe (``qdcp.frameworks.lightning``).

``torchrun`` jobs (gloo, CPU; nccl where CUDA is present) run ``tests/lightning_worker.py``: a model
with a trained fp32 layer (torchao's ``AdamW8bit``), a frozen ``NF4Tensor`` weight sharded by FSDP2
and a frozen ``Int8Tensor`` layer, checkpointed at 2 ranks through Fabric (``fabric.save``, twice to
one path) and through the Trainer (``ModelCheckpoint``'s ``last.ckpt``, ``trainer.save_checkpoint``):

- resumed through the same calls (``fabric.load``, ``trainer.fit(ckpt_path=...)``) at 2 and at 1
  rank: every inner buffer, dequantized value, optimizer state and the step bit-exact, the
  parameters filled in place;
- an unquantized model filled by ``fabric.load``: each weight equal to torchao's ``dequantize()``;
- the checkpoints hold qdcp's raw entries;
- Lightning's own strategy: resumes at 2 ranks, fails at 1 (DCP slices the ``NF4Tensor``) and
  into the unquantized model: the failures the recipe fixes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import torchrun_jobs

pytest.importorskip("pytorch_lightning")
pytest.importorskip("lightning_fabric")
pytestmark = pytest.mark.multiproc

_job = torchrun_jobs.Worker("lightning_worker.py", timeout_s=240)  # each (command, ranks) runs once per session
RESUMES = ["load-fabric", "load-trainer", "load-trainer-mc"]


def _saved(shared_dir: Path) -> None:
    torchrun_jobs.check_sections(_job(shared_dir, "save", 2), "save at 2 ranks", ["save-fabric", "save-trainer"])


@pytest.mark.parametrize("nproc", [2, 1])
@pytest.mark.parametrize("section", RESUMES)
def test_resume_is_bit_exact(shared_dir, section, nproc):
    _saved(shared_dir)
    torchrun_jobs.check_sections(_job(shared_dir, "load", nproc), f"load at {nproc} ranks", [section])


@pytest.mark.parametrize("nproc", [2, 1])
def test_unquantized_model_gets_the_dequantized_values(shared_dir, nproc):
    _saved(shared_dir)
    torchrun_jobs.check_sections(_job(shared_dir, "load", nproc), f"load at {nproc} ranks", ["load-plain"])


@pytest.mark.parametrize("path, prefix", [("fabric-qdcp", ""), ("trainer-qdcp", "state_dict.net."),
                                          ("trainer-qdcp-mc/last.ckpt", "state_dict.net.")])
def test_checkpoints_hold_qdcp_raw_entries(shared_dir, path, prefix):
    import qdcp

    _saved(shared_dir)
    entries = {k: (v["stored_as"], v.get("type")) for k, v in qdcp.describe(shared_dir / path).items()
               if v["stored_as"] == "raw"}
    optim = "optimizer_0.state.net." if prefix else "optimizer.state."
    model = prefix or "model."
    assert entries == {f"{model}base.weight": ("raw", "torchao.NF4Tensor"),
                       f"{model}frozen.weight": ("raw", "torchao.Int8Tensor"),
                       f"{optim}trained.weight.exp_avg": ("raw", "torchao.OptimState8bit"),
                       f"{optim}trained.weight.exp_avg_sq": ("raw", "torchao.OptimState8bit")}, entries
    assert (shared_dir / path / "meta.pt").is_file()  # Lightning's layout: DCP files and meta.pt


def _stock(shared_dir: Path, nproc: int) -> dict:
    return _job.recorded(shared_dir, "load", nproc, f"stock-{nproc}.json")


def test_without_the_recipe(shared_dir):
    _saved(shared_dir)
    same = _stock(shared_dir, 2)
    for framework in ("fabric", "trainer"):  # Lightning's own resume works at the same world size
        assert same[framework]["error"] is None and same[framework]["differ"] == [], same
    other = _stock(shared_dir, 1)
    for framework in ("fabric", "trainer"):  # at another, DCP slices the checkpoint's NF4 shards
        assert "NotImplementedError: aten.slice(NF4Tensor)" in other[framework]["error"], other
    for seen in (same, other):  # a quantized checkpoint does not fill an unquantized model
        assert "AttributeError: 'Tensor' object has no attribute 'block_size'" in seen["plain"]["error"], seen
