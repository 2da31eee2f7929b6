"""accelerate's FSDP2 checkpoint functions (what ``Accelerator.save_state`` / ``load_state`` and the
HF Trainer call for a sharded state dict) through ``qdcp.install()``.

``torchrun`` jobs (gloo, CPU; nccl where CUDA is present) run ``tests/accelerate_worker.py``: a
``fully_shard`` model with a layer trained by torchao's ``AdamW8bit``, a frozen ``NF4Tensor`` base
weight, a layer converted by accelerate's float8 recipe (``WeightWithDynamicFloat8CastTensor``) and
a frozen ``Int8Tensor`` layer kept out of ``fully_shard``; saved at 2 ranks by ``save_fsdp_model`` /
``save_fsdp_optimizer`` (which build ``DefaultSavePlanner()`` inside) with the switch and without:

- with the switch, resumed by ``load_fsdp_model`` / ``load_fsdp_optimizer`` at 2 and at 1 rank:
  every inner buffer, the wrapper's high-precision tensor and the 8-bit optimizer states bit-exact,
  parameters filled in place; the unquantized model gets the saved weights' values;
- the checkpoint holds qdcp's raw entries (the switch replaced accelerate's default planners);
- without it: resumes at 2 ranks, fails at 1 (DCP slices the ``NF4Tensor``) and into the
  unquantized model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import torchrun_jobs

pytest.importorskip("accelerate")
pytestmark = pytest.mark.multiproc

_job = torchrun_jobs.Worker("accelerate_worker.py", timeout_s=240)  # each (command, ranks) runs once per session


def _saved(shared_dir: Path) -> None:
    torchrun_jobs.check_sections(_job(shared_dir, "save", 2), "save at 2 ranks", ["save"])


@pytest.mark.parametrize("nproc", [2, 1])
def test_resume_is_bit_exact(shared_dir, nproc):
    _saved(shared_dir)
    torchrun_jobs.check_sections(_job(shared_dir, "load", nproc), f"load at {nproc} ranks", ["load"])


@pytest.mark.parametrize("nproc", [2, 1])
def test_unquantized_model_gets_the_saved_values(shared_dir, nproc):
    _saved(shared_dir)
    torchrun_jobs.check_sections(_job(shared_dir, "load", nproc), f"load at {nproc} ranks", ["load-plain"])


def test_checkpoints_hold_qdcp_raw_entries(shared_dir):
    import qdcp

    _saved(shared_dir)
    model = {k: v.get("type") for k, v in qdcp.describe(shared_dir / "qdcp" / "pytorch_model_fsdp_0").items()
             if v["stored_as"] == "raw"}
    assert model == {"model.base.weight": "torchao.NF4Tensor", "model.last.weight": "torchao.Int8Tensor"}, model
    # the float8 wrapper is stored as its high-precision tensor (DCP's checkpoint of the unconverted model)
    assert qdcp.describe(shared_dir / "qdcp" / "pytorch_model_fsdp_0")["model.middle.weight"]["dtype"] == "float32"
    optim = {k: v.get("type") for k, v in qdcp.describe(shared_dir / "qdcp" / "optimizer_0").items()
             if v["stored_as"] == "raw"}
    assert optim == {f"optimizer.state.{layer}.weight.{s}": "torchao.OptimState8bit"
                     for layer in ("first", "middle") for s in ("exp_avg", "exp_avg_sq")}, optim


def _stock(shared_dir: Path, nproc: int) -> dict:
    return _job.recorded(shared_dir, "load", nproc, f"stock-{nproc}.json")


def test_without_the_switch(shared_dir):
    _saved(shared_dir)
    same, other = _stock(shared_dir, 2), _stock(shared_dir, 1)
    assert same["resume"]["error"] is None and same["resume"]["differ"] == [], same  # same world size: works
    assert other["resume"]["error"].endswith("NotImplementedError: aten.slice(NF4Tensor) with end=128"), other
    for seen in (same, other):  # a quantized checkpoint does not fill an unquantized model
        assert seen["plain"]["error"].endswith("AttributeError: 'Tensor' object has no attribute 'block_size'"), seen


def test_merge_fsdp_weights_gives_the_saved_values(shared_dir, tmp_path):
    """accelerate's ``merge_fsdp_weights`` (DCP's ``_EmptyStateDictLoadPlanner`` inside) on the
    checkpoint saved at 2 ranks: one safetensors file, each weight equal to the saved one's values
    (torchao's ``dequantize()`` / ``get_original_weight()``, the float8 wrapper's ``_tensor``)."""
    import torch
    from accelerate.utils import merge_fsdp_weights
    from safetensors.torch import load_file

    import qdcp
    from quantized_cases import bits

    _saved(shared_dir)
    ref = torch.load(shared_dir / "ref.pt", weights_only=True)
    with qdcp.installed():
        merge_fsdp_weights(str(shared_dir / "qdcp" / "pytorch_model_fsdp_0"), str(tmp_path / "merged"))
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert sorted(merged) == sorted(f"{layer}.{p}" for layer in ("first", "base", "middle", "last")
                                    for p in ("weight", "bias") if (layer, p) != ("base", "bias"))
    for k, v in merged.items():
        want = ref.get(f"model.{k}.values", ref.get(f"model.{k}"))
        assert v.dtype == want.dtype and torch.equal(bits(v), bits(want)), k


def test_merge_fsdp_weights_of_a_stock_checkpoint_fails(shared_dir, tmp_path):
    """Without the switch, DCP pickles the torchao tensors into the shards, and the merge cannot
    copy the NF4 weight's shards into a plain tensor (torch 2.15's weights-only load already
    refuses to unpickle them: NF4Tensor is not among its allowed globals there)."""
    from accelerate.utils import merge_fsdp_weights
    from torch.distributed.checkpoint.api import CheckpointException

    from worker_results import short

    _saved(shared_dir)
    with pytest.raises(CheckpointException) as e:
        merge_fsdp_weights(str(shared_dir / "stock" / "pytorch_model_fsdp_0"), str(tmp_path / "merged"))
    said = short(e.value, 4000)
    assert said.endswith("AttributeError: 'Tensor' object has no attribute 'block_size'") or (
        "UnpicklingError: Weights only load failed" in said and "NF4Tensor was not an allowed global" in said), said
