"""torchtitan's real ``CheckpointManager`` with qdcp's recipe (``qdcp.frameworks.torchtitan``).

``torchrun`` jobs (gloo, CPU; nccl where CUDA is present) run ``tests/torchtitan_worker.py``:
FSDP2 parts holding what torchtitan's float8 converters put in a state dict (torchao's
``WeightWithDynamicFloat8CastTensor`` and ``Float8TrainingWeightWrapperTensor``), torchtitan's
optimizer and LR-scheduler containers, in each of its three ``async_mode``\\s:

- saved through ``QuantizedCheckpointManager`` at 2 ranks while training goes on, loaded through it
  at 2 and at 1 rank: weights, optimizer states and step bit-exact, parameters filled in place;
- the last step's model-only export in bf16, as DCP files and as HF safetensors (torchtitan's HF
  writer), reads back through stock ``dcp.load`` / safetensors as plain tensors;
- torchtitan's own manager on the same model fails to save, and with only its model cache fixed
  it writes checkpoints that cannot be loaded (sync), load wrong weights without an error (async)
  or cannot stage on CPU (pinned): the failures the recipe fixes.
"""

from __future__ import annotations

import json

import pytest

import torchrun_jobs

pytest.importorskip("torchtitan.components.checkpointer")
pytestmark = pytest.mark.multiproc

# each (command, ranks) runs once per session; at 2 ranks the save and export runs share one launch
# (each in its own directories). The loads run in processes of their own, and so does the stock
# manager: it records what DCP does to a process that never ran qdcp's recipe (run after the
# recipe's saves in the same processes, its async mode recorded another outcome)
_job = torchrun_jobs.Worker("torchtitan_worker.py", timeout_s=300, together={2: [("save", "export")]})
MODES = ["disabled", "async", "async_with_pinned_mem"]


@pytest.mark.parametrize("nproc", [2, 1])
@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_resumes_bit_exact(shared_dir, mode, nproc):
    torchrun_jobs.check_sections(_job(shared_dir, "save", 2), "save at 2 ranks", [f"save-{mode}"])
    torchrun_jobs.check_sections(_job(shared_dir, "load", nproc), f"load at {nproc} ranks", [f"load-{mode}"])


@pytest.mark.parametrize("section", ["export", "export_hf"])
def test_model_only_export_holds_plain_export_dtype_weights(shared_dir, section):
    torchrun_jobs.check_sections(_job(shared_dir, "export", 2), "export at 2 ranks", [section])


@pytest.mark.parametrize("mode", MODES)
def test_without_the_recipe(shared_dir, mode):
    record = _job(shared_dir, "stock", 2)
    torchrun_jobs.check_sections(record, "stock at 2 ranks", [], require_all=False)
    seen = json.loads((shared_dir / f"stock-{mode}.json").read_text())
    # torchtitan's model cache asks the wrapper tensors for a storage they do not have
    assert "data pointer on an invalid python storage" in seen["stock_save"], seen
    experts = ["model1.experts.w1", "model1.experts.w2", "model1.proj.weight"]
    if mode == "disabled":  # DCP pickles the wrappers; loading them is refused
        assert seen["cache_fixed_save"] is None and "Weights only load failed" in seen["cache_fixed_load"], seen
    elif mode == "async":  # DCP's staging copies no data into them: wrong weights, no error
        assert seen["cache_fixed_load"] is None and seen["cache_fixed_differ"] == experts, seen
    else:  # DCP's pinned stager needs an accelerator for its non-blocking copies
        import torch

        if torch.cuda.is_available():
            pytest.skip("DCP's pinned stager runs where CUDA is present")
        assert "Non-blocking copy requires" in seen["cache_fixed_save"], seen
