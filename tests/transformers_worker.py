"""The script every ``torchrun`` rank runs for ``tests/test_framework_transformers.py``.

    python -m torch.distributed.run --nproc-per-node 2 tests/transformers_worker.py run DIR

transformers' native distributed checkpoint (``save_pretrained(..., distributed_checkpoint=True)``:
``dcp.save`` with DCP's ``HuggingFaceStorageWriter``; ``from_pretrained`` of that directory:
``dcp.load`` with ``DefaultLoadPlanner``) of a tiny Llama loaded with ``DistributedConfig(fsdp_size=2)``
whose MLP torchao then quantizes (``Int8WeightOnlyConfig``: an ``Int8Tensor`` whose inner tensors are
DTensors, as ``quantize_`` makes of a sharded weight). Sections:

- ``switch``: under ``qdcp.install()`` the save writes each quantized weight as its values; the
  model loaded back from those files holds, bit for bit, torchao's ``dequantize()`` of each weight,
  and the other weights unchanged;
- ``stock``: without the switch the save fails (written for the test to assert);
- ``raw``: a raw qdcp save of such a tensor is refused naming the key;
- ``load``: a load into such a model (from its own checkpoint, saved dequantized) is refused at
  planning naming the key and what to do, every weight of the model unchanged.
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torchao.quantization import Int8WeightOnlyConfig, quantize_  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

import qdcp  # noqa: E402
from quantized_cases import differences  # noqa: E402
from worker_results import RANK, check, qdcp_error_in, record_outcome, run, short  # noqa: E402

MLP = ("gate_proj", "up_proj", "down_proj")


def sharded_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2),
                                                dtype=torch.float32)


def quantized(root: str):
    """The tiny Llama at 2 ranks (FSDP2), its MLP quantized by torchao after sharding."""
    src = os.path.join(root, "src")
    if RANK == 0 and not os.path.exists(src):
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2)).save_pretrained(src)
    dist.barrier()
    model = sharded_model(src)
    quantize_(model.model.layers[0].mlp, Int8WeightOnlyConfig(version=2))
    return model


def values(model) -> dict:
    """Every weight's whole values (quantized ones through torchao's dequantize()), on every rank."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.dequantize() if hasattr(v, "qdata") else v
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def runs(root: str, _mesh) -> None:
    model = quantized(root)
    check("switch", type(model.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor", "not quantized")
    want = values(model)
    with qdcp.installed():
        model.save_pretrained(os.path.join(root, "dist"), distributed_checkpoint=True)
        loaded = sharded_model(os.path.join(root, "dist"))
    got = values(loaded)
    check("switch", not differences(got, want), f"loaded back: {differences(got, want)}")
    check("switch", all(type(loaded.model.layers[0].mlp.get_submodule(n).weight).__name__ == "DTensor" for n in MLP),
          "the model loaded back is not the plain sharded one")
    outcome = None
    try:
        model.save_pretrained(os.path.join(root, "stock"), distributed_checkpoint=True)
    except BaseException as e:  # noqa: BLE001  (DCP's CheckpointException is a BaseException)
        outcome = f"{type(e).__name__}: {short(e, 300)}"
    record_outcome(os.path.join(root, "stock.json"), {"save": outcome})
    try:
        dcp.save(model.state_dict(), checkpoint_id=os.path.join(root, "raw"), planner=qdcp.QuantizedSavePlanner())
        check("raw", False, "a raw save of a quantized tensor with DTensor inner tensors was accepted")
    except BaseException as e:  # noqa: BLE001
        err = qdcp_error_in(e)
        check("raw", isinstance(err, qdcp.UnsupportedTensorError) and "'model.layers.0.mlp.gate_proj.weight'"
              in str(err) and "Quantize before sharding" in str(err), f"not a clear error naming the key: {short(e)}")
    refused_load(root, model, want)
    dist.barrier()


def refused_load(root: str, model, want: dict) -> None:
    path = os.path.join(root, "dequantized")
    dcp.save(model.state_dict(), checkpoint_id=path, planner=qdcp.QuantizedSavePlanner(dequantize=True))
    before = {k: v.qdata._local_tensor.clone() for k, v in model.state_dict().items() if hasattr(v, "qdata")}
    try:
        dcp.load(model.state_dict(), checkpoint_id=path, planner=qdcp.QuantizedLoadPlanner())
        check("load", False, "a load into a quantized tensor with DTensor inner tensors was accepted")
    except BaseException as e:  # noqa: BLE001
        err = qdcp_error_in(e)
        check("load", isinstance(err, qdcp.UnsupportedTensorError) and "key 'model.layers.0.mlp." in str(err)
              and "Load into the model before quantizing it" in str(err),
              f"not a clear error naming the key: {short(e)}")
    changed = differences(values(model), want)
    check("load", not changed, f"the refused load changed the model: {changed}")
    after = {k: v.qdata._local_tensor for k, v in model.state_dict().items() if hasattr(v, "qdata")}
    check("load", all(torch.equal(before[k], after[k]) for k in before), "a refused load changed some qdata")


if __name__ == "__main__":
    sys.exit(run({"run": runs}, lambda: dist.init_process_group("gloo")))
