"""qdcp.staging.new_empty, what the plain call needs:
``dcp.async_save(state, checkpoint_id=p, planner=QuantizedSavePlanner())``.

No ``async_stager``: DCP's default stager copies each wrapper subclass through ``new_empty`` and a
deep copy of its ``__dict__``. qdcp fills the same-size ``new_empty`` torchao lacks (qdcp.staging.new_empty);
these tests check the checkpoints that call writes against ``dcp.save``'s, byte for byte.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchao.quantization import Int8Tensor

import qdcp
from dist_helpers import run_one_rank_script
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner
from quantized_cases import CASES, assert_same_buffers, gated_save_planner, inner
from state_dicts import STATES, assert_same_checkpoint, mixed, mutate, snapshot

NEW_EMPTY = torch.ops.aten.new_empty.default


def _async_then_mutate(state, path, **planner_kw):
    gate = threading.Event()
    fut = dcp.async_save(state, checkpoint_id=path, planner=gated_save_planner(gate, **planner_kw))
    mutate(state)
    gate.set()
    fut.result()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_plain_async_save_writes_the_sync_checkpoint_byte_for_byte(case, tmp_path):
    """Every torchao type qdcp supports (and the low-bit optimizer states): the checkpoint of the
    plain call equals ``dcp.save``'s of the values at the call, though the model is updated in
    place before the upload starts; it loads bit-identically."""
    live = {"w": case.make(0), "b": torch.arange(6.0)}
    before = snapshot(live)
    _async_then_mutate(live, tmp_path / "async")
    dcp.save(before, checkpoint_id=tmp_path / "sync", planner=QuantizedSavePlanner())
    assert_same_checkpoint(tmp_path / "async", tmp_path / "sync")
    target = {"w": case.make(1), "b": torch.zeros(6)}
    dcp.load(target, checkpoint_id=tmp_path / "async", planner=QuantizedLoadPlanner())
    assert_same_buffers(target["w"], before["w"])
    assert torch.equal(target["b"], before["b"])


@pytest.mark.parametrize("dequantize", [False, True])
def test_plain_async_save_of_a_nested_mixed_state(dequantize, tmp_path):
    """Model weights, NF4, optimizer states with plain step counters, objects; raw and dequantized."""
    live = mixed(0)
    before = snapshot(live)
    _async_then_mutate(live, tmp_path / "async", dequantize=dequantize)
    dcp.save(before, checkpoint_id=tmp_path / "sync", planner=QuantizedSavePlanner(dequantize=dequantize))
    assert_same_checkpoint(tmp_path / "async", tmp_path / "sync")


def test_new_empty_is_same_size_only_and_builds_buffers_on_the_device():
    t = STATES["int8"](0)["0.weight"]
    y = t.new_empty(t.size(), device="cpu")
    assert type(y) is type(t) and y.shape == t.shape and y.dtype == t.dtype
    for name, b in inner(t).items():
        yb = inner(y)[name]
        assert (yb.shape, yb.dtype, yb.device) == (b.shape, b.dtype, torch.device("cpu"))
        assert yb.data_ptr() != b.data_ptr()
    y = t.new_empty(t.size(), device="meta")
    assert all(b.device.type == "meta" for b in inner(y).values())
    with pytest.raises(NotImplementedError, match="own size.*QuantizedStager"):
        t.new_empty((3, 3))
    with pytest.raises(NotImplementedError, match="own size"):
        t.new_empty(t.size(), dtype=torch.float32)


def test_a_library_new_empty_is_never_replaced():
    """Where the library implements ``new_empty`` itself, qdcp leaves it alone."""
    qdcp.unregister_new_empty()
    table = Int8Tensor._ATEN_OP_TABLE[Int8Tensor]
    assert NEW_EMPTY not in table

    def own(func, types, args, kwargs):
        return torch.full((1,), 7.0)
    Int8Tensor.implements(NEW_EMPTY)(own)
    try:
        qdcp.enable_new_empty()
        assert Int8Tensor not in qdcp.staging.new_empty.filled_classes()
        assert torch.equal(STATES["int8"](0)["0.weight"].new_empty((1,)), torch.full((1,), 7.0))
        qdcp.unregister_new_empty()
        assert NEW_EMPTY in table  # removing qdcp's registrations leaves the library's
    finally:
        del table[NEW_EMPTY]
        qdcp.enable_new_empty()
    assert Int8Tensor in qdcp.staging.new_empty.filled_classes()


def test_turned_off_the_plain_call_fails_before_writing(tmp_path):
    qdcp.unregister_new_empty()
    try:
        with pytest.raises(NotImplementedError, match="new_empty"):
            dcp.async_save(STATES["int8"](0), checkpoint_id=tmp_path / "c", planner=QuantizedSavePlanner())
        assert not (tmp_path / "c").exists() or not os.listdir(tmp_path / "c")
    finally:
        qdcp.enable_new_empty()
    dcp.async_save(STATES["int8"](0), checkpoint_id=tmp_path / "c", planner=QuantizedSavePlanner()).result()


def test_env_var_turns_the_registration_off(tmp_path):
    script = textwrap.dedent("""
        import warnings; warnings.filterwarnings("ignore")
        import torch, torchao.quantization, qdcp
        from torchao.quantization import Int8Tensor
        qdcp.QuantizedSavePlanner()
        print(torch.ops.aten.new_empty.default in Int8Tensor._ATEN_OP_TABLE[Int8Tensor])
    """)
    for value, expected in (("0", "False"), ("1", "True")):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, QDCP_FILL_NEW_EMPTY=value))
        assert out.stdout.strip().splitlines()[-1] == expected, out.stderr[-2000:]


def test_classes_imported_after_qdcp_are_filled_when_a_planner_is_made():
    script = textwrap.dedent("""
        import warnings; warnings.filterwarnings("ignore")
        import torch, qdcp
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
        before = torch.ops.aten.new_empty.default in NVFP4Tensor._ATEN_OP_TABLE[NVFP4Tensor]
        qdcp.QuantizedSavePlanner()
        print(before, torch.ops.aten.new_empty.default in NVFP4Tensor._ATEN_OP_TABLE[NVFP4Tensor])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "False True", out.stderr[-2000:]


_PROCESS_IMPORTS = """
from qdcp import QuantizedSavePlanner
from state_dicts import assert_same_checkpoint, mixed, mutate, snapshot
"""
_PROCESS_MAIN = '''
live = mixed(0)
for i in range(2):  # the second save finds the checkpoint daemon already running
    before = snapshot(live)
    path = os.path.join(root, f"async{i}")
    fut = dcp.async_save(live, checkpoint_id=path, planner=QuantizedSavePlanner(),
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    mutate(live)
    fut.result()
    dcp.save(before, checkpoint_id=path + "_sync", planner=QuantizedSavePlanner())
    assert_same_checkpoint(path, path + "_sync")
print("OK")
'''


def test_plain_async_save_with_the_process_checkpointer(tmp_path):
    """DCP's default stager and the PROCESS checkpointer (the staged torchao tensors are pickled
    to the checkpoint daemon): the checkpoints equal ``dcp.save``'s of the values at each call."""
    proc = run_one_rank_script(tmp_path, _PROCESS_MAIN, imports=_PROCESS_IMPORTS)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
