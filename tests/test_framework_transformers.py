"""transformers' native distributed checkpoint (``save_pretrained(..., distributed_checkpoint=True)``)
of a model quantized by torchao after it was sharded, through ``qdcp.install()``.

One ``torchrun`` job (2 ranks, gloo) runs ``tests/transformers_worker.py``: a tiny Llama loaded with
``DistributedConfig(fsdp_size=2)``, its MLP quantized by ``quantize_`` (``Int8Tensor``\\s whose inner
tensors are DTensors). Under the switch, transformers' own save (DCP's ``HuggingFaceStorageWriter``)
writes each quantized weight as its values and transformers' own load gives them back bit for bit
(torchao's ``dequantize()``); stock transformers fails to save; a raw qdcp save of such a tensor is
refused naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import torchrun_jobs

pytest.importorskip("transformers.distributed")
# transformers loads a model with DistributedConfig through accelerate (the frameworks extra)
pytest.importorskip("accelerate", reason="transformers' distributed loading needs accelerate")
pytestmark = pytest.mark.multiproc

_job = torchrun_jobs.Worker("transformers_worker.py", timeout_s=240)


@pytest.fixture(scope="module")
def record(shared_dir) -> tuple[Path, dict]:
    return shared_dir, _job(shared_dir, "run", 2)


def test_distributed_save_and_load_under_the_switch_give_the_values(record):
    torchrun_jobs.check_sections(record[1], "transformers at 2 ranks", ["switch"])


def test_without_the_switch_the_save_fails(record):
    torchrun_jobs.check_sections(record[1], "transformers at 2 ranks", [], require_all=False)
    stock = json.loads((record[0] / "stock.json").read_text())
    # torch 2.13 and 2.15: DCP reads the wrapper's (absent) storage; 2.11 fails before that:
    # DTensor has no sharding rule for aten.is_pinned
    assert "data pointer on an invalid python storage" in stock["save"] or \
        "aten.is_pinned.default does not have a sharding strategy" in stock["save"], stock


def test_a_raw_save_of_a_tensor_quantized_after_sharding_is_refused_naming_the_key(record):
    torchrun_jobs.check_sections(record[1], "transformers at 2 ranks", ["raw"])


def test_a_load_into_a_tensor_quantized_after_sharding_is_refused_naming_the_key(record):
    """The model's own checkpoint (saved dequantized) loaded back into it: refused at planning with
    what to do (load before quantizing, or quantize before sharding), every weight unchanged."""
    torchrun_jobs.check_sections(record[1], "transformers at 2 ranks", ["load"])
