"""torchao's quantized-training weights (float8 training, MoE training, int8 and BitNet training).

Wrappers around a high-precision tensor are stored as that plain tensor (the checkpoint DCP writes
for the unconverted model) and loaded into it in place; ``Int8QuantizedTrainingLinearWeight`` holds
int8 data and is stored raw. Every save path (``dcp.save``, the plain ``dcp.async_save`` with DCP's
default stager, ``QuantizedStager``) writes the same bytes, never the uninitialised memory vanilla
``dcp.async_save`` writes for these wrappers.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from dist_helpers import run_one_rank_script
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner, QuantizedStager, StagingError
from quantized_cases import bits_diff, gated_save_planner, raise_inner
from state_dicts import data_files, mutate, snapshot
from training_cases import CASE_BY_NAME, CASES, unavailable, values


def _param(case):
    reason = unavailable(case)
    return pytest.param(case, id=case.name, marks=[pytest.mark.skip(reason=reason)] if reason else [])


ALL = [_param(c) for c in CASES]
WRAPPERS = [_param(c) for c in CASES if c.wraps_high_precision]
INT8 = CASE_BY_NAME["int8_quantized"]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bits_diff(a, b) is None


def test_every_case_builds_its_wrapper_class():
    for case in (c for c in CASES if not unavailable(c)):
        types = {type(v).__name__ for v in case.model(0).state_dict().values()}
        assert types == {case.cls_name}, (case.name, types)


@pytest.mark.parametrize("case", WRAPPERS)
def test_stored_as_the_checkpoint_dcp_writes_for_the_unconverted_model(case, tmp_path):
    sd = case.model(0).state_dict()
    dcp.save(sd, checkpoint_id=tmp_path / "qdcp", planner=QuantizedSavePlanner())
    plain = case.plain_model(0).state_dict()
    dcp.save(plain, checkpoint_id=tmp_path / "dcp")  # DCP's own planner, the unconverted model
    assert data_files(tmp_path / "qdcp") == data_files(tmp_path / "dcp")
    assert {k: v["stored_as"] for k, v in qdcp.describe(tmp_path / "qdcp").items()} == {k: "plain" for k in sd}
    target = case.plain_model(5).state_dict()
    dcp.load(target, checkpoint_id=tmp_path / "qdcp")  # stock DCP, into the unconverted model
    assert all(_same(target[k], values(sd[k])) for k in sd)


@pytest.mark.parametrize("case", WRAPPERS)
def test_load_fills_the_wrapped_tensor_in_place(case, tmp_path):
    saved = case.model(0).state_dict()
    dcp.save(saved, checkpoint_id=tmp_path, planner=QuantizedSavePlanner())
    model = case.model(7)
    params = {k: p for k, p in model.named_parameters()}
    inner = {k: values(p) for k, p in params.items()}
    ptrs = {k: t.data_ptr() for k, t in inner.items()}
    dcp.load(model.state_dict(), checkpoint_id=tmp_path, planner=QuantizedLoadPlanner())
    for k, p in model.named_parameters():
        assert p is params[k] and type(p).__name__ == case.cls_name
        assert values(p) is inner[k] and values(p).data_ptr() == ptrs[k]
        assert _same(values(p), values(saved[k]))


@pytest.mark.parametrize("case", ALL)
def test_every_save_path_writes_the_same_bytes(case, tmp_path):
    """``dcp.save``; the plain ``dcp.async_save`` (DCP's default stager) and ``QuantizedStager``,
    each with the model updated in place before its upload starts: identical data files."""
    live = case.model(0).state_dict()
    before = snapshot(live)
    for name, kwargs in (("default", {}), ("quantized", {"async_stager": QuantizedStager()})):
        gate = threading.Event()
        fut = dcp.async_save(live, checkpoint_id=tmp_path / name, planner=gated_save_planner(gate), **kwargs)
        mutate(live)
        gate.set()
        fut.result()
        live = snapshot(before)
    dcp.save(before, checkpoint_id=tmp_path / "sync", planner=QuantizedSavePlanner())
    assert data_files(tmp_path / "default") == data_files(tmp_path / "sync") == data_files(tmp_path / "quantized")


@pytest.mark.parametrize("case", WRAPPERS[:2])
def test_without_qdcps_new_empty_the_half_staged_wrapper_is_refused(case, tmp_path):
    """DCP's default stager on a wrapper without a real ``new_empty`` builds a plain uninitialised
    tensor carrying the wrapper's inner tensor as an attribute (vanilla DCP writes that garbage);
    qdcp's planner refuses it, naming QuantizedStager, before anything is written."""
    qdcp.unregister_new_empty()
    try:
        staged = next(iter(case.model(0).state_dict().values()))
        assert type(staged.new_empty(staged.size(), device="cpu")) is torch.Tensor
        with pytest.raises(StagingError, match="QuantizedStager"):
            raise_inner(lambda: dcp.async_save(case.model(0).state_dict(), checkpoint_id=tmp_path / "c",
                                                planner=QuantizedSavePlanner()).result())
        assert not (tmp_path / "c" / ".metadata").exists()
        assert not any(n.endswith(".distcp") for n in os.listdir(tmp_path / "c")) if (tmp_path / "c").exists() else True
    finally:
        qdcp.enable_new_empty()
    staged = next(iter(case.model(0).state_dict().values()))
    assert type(staged.new_empty(staged.size(), device="cpu")).__name__ == case.cls_name


# ----------------------------------------------------------------------------- int8 quantized training

def test_int8_quantized_training_weight_is_stored_raw_and_loads_bit_exact(tmp_path):
    saved = INT8.model(0).state_dict()
    dcp.save(saved, checkpoint_id=tmp_path, planner=QuantizedSavePlanner())
    info = qdcp.describe(tmp_path)["0.weight"]
    assert info["stored_as"] == "raw" and info["type"] == "torchao.Int8QuantizedTrainingLinearWeight"
    assert {n: (c["shape"], c["dtype"]) for n, c in info["components"].items()} == \
        {"int_data": ([128, 64], "int8"), "scale": ([128, 1], "float32")}
    model = INT8.model(3)
    w = model[0].weight
    dcp.load(model.state_dict(), checkpoint_id=tmp_path, planner=QuantizedLoadPlanner())
    assert model[0].weight is w
    for k, t in model.state_dict().items():
        assert _same(t.int_data, saved[k].int_data) and _same(t.scale, saved[k].scale)
    plain = {k: torch.zeros(v.shape) for k, v in saved.items()}
    dcp.load(plain, checkpoint_id=tmp_path, planner=QuantizedLoadPlanner())
    assert all(_same(plain[k], saved[k].dequantize()) for k in saved)


def test_int8_quantized_training_target_from_a_plain_checkpoint_is_from_float(tmp_path):
    """A float checkpoint into an int8 training weight: torchao's own ``from_float`` (round to
    nearest; the weight's in-place ``copy_`` would round stochastically)."""
    from torchao.prototype.quantized_training.int8 import Int8QuantizedTrainingLinearWeight

    plain = INT8.plain_model(0).state_dict()
    dcp.save(plain, checkpoint_id=tmp_path)
    for _ in range(2):
        model = INT8.model(3)
        dcp.load(model.state_dict(), checkpoint_id=tmp_path, planner=QuantizedLoadPlanner())
        for k, t in model.state_dict().items():
            want = Int8QuantizedTrainingLinearWeight.from_float(plain[k])
            assert _same(t.int_data, want.int_data) and _same(t.scale, want.scale)


# ----------------------------------------------------------------------------- process checkpointer

_PROCESS_IMPORTS = """
from qdcp import QuantizedSavePlanner
from state_dicts import data_files, mutate, snapshot
from training_cases import CASE_BY_NAME, unavailable
"""
_PROCESS_MAIN = '''
for name in (n for n in ("float8", "moe_mxfp8", "int8_quantized") if not unavailable(CASE_BY_NAME[n])):
    live = CASE_BY_NAME[name].model(0).state_dict()
    before = snapshot(live)
    path = os.path.join(root, name)
    fut = dcp.async_save(live, checkpoint_id=path, planner=QuantizedSavePlanner(),
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    mutate(live)
    fut.result()
    dcp.save(before, checkpoint_id=path + "_sync", planner=QuantizedSavePlanner())
    assert data_files(path) == data_files(path + "_sync"), name
print("OK")
'''


def test_plain_async_save_with_the_process_checkpointer(tmp_path):
    proc = run_one_rank_script(tmp_path, _PROCESS_MAIN, imports=_PROCESS_IMPORTS, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
