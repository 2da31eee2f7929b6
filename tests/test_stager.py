"""QuantizedStager: dcp.async_save of quantized state dicts, bit-exact and byte-identical to dcp.save."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from concurrent.futures import Future

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.tensor import DTensor
from torchao.optim import AdamW8bit
from torchao.optim.subclass_8bit import OptimState8bit
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
from torchao.quantization import (
    Float8WeightOnlyConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    quantize_,
    to_nf4,
)
from torchao.quantization.granularity import PerGroup

import qdcp
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner, StagingError, UnsupportedTensorError
from qdcp.adapters.base import find_adapter
from qdcp.stager import QuantizedStager
from quantized_cases import CASES, assert_bitwise_equal, assert_same_buffers, inner


# ----------------------------------------------------------------------------- state dicts

def _linear(config, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(256, 128, dtype=torch.bfloat16))
    quantize_(m, config)
    return m


def _adamw8bit_state(seed: int) -> dict:
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(512, 256))
    opt = AdamW8bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    return opt.state_dict()


def _hp(seed: int, shape=(128, 256)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# name -> seed -> a state dict; two seeds give the same types and configs with different values.
STATES = {
    "int8": lambda s: _linear(Int8WeightOnlyConfig(version=2), s).state_dict(),
    "float8": lambda s: _linear(Float8WeightOnlyConfig(), s).state_dict(),
    "intx": lambda s: _linear(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
                              s).state_dict(),
    "nf4": lambda s: {"w": to_nf4(_hp(s))},
    "mx": lambda s: {"w": MXTensor.to_mx(_hp(s), torch.float8_e4m3fn, 32)},
    "nvfp4": lambda s: {"w": NVFP4Tensor.to_nvfp4(_hp(s))},
    "adamw8bit": _adamw8bit_state,
}


def _optim_state(seed: int) -> dict:
    """An AdamW8bit-like state built directly (AdamW8bit.step compiles: ~10 s once per process)."""
    def state8(signed: bool):
        hp = torch.randn(512, 256, generator=torch.Generator().manual_seed(seed))
        t = OptimState8bit.zeros((512, 256), signed=signed, block_size=256)
        t.copy_(hp if signed else hp.square() * 1e-3)
        return t
    return {"state": {0: {"step": torch.tensor(1.0), "exp_avg": state8(True), "exp_avg_sq": state8(False)}},
            "param_groups": [{"lr": 1e-3, "params": [0]}]}


def _mixed(seed: int) -> dict:
    """Quantized tensors, plain tensors and non-tensor objects, nested."""
    return {"model": STATES["int8"](seed), "nf4": STATES["nf4"](seed), "optim": _optim_state(seed),
            "step": seed, "config": {"lr": 0.1 * seed, "name": f"run{seed}"},
            "rng": torch.arange(8) + seed}


def _leaves(sd, prefix=""):
    """(path, value) of every leaf of a nested state dict."""
    if isinstance(sd, dict):
        for k, v in sd.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], sd


def _assert_same_state(a, b):
    la, lb = dict(_leaves(a)), dict(_leaves(b))
    assert sorted(la) == sorted(lb)
    for k, va in la.items():
        vb = lb[k]
        if isinstance(va, torch.Tensor) and find_adapter(va) is not None:
            assert_same_buffers(va, vb)
        elif isinstance(va, torch.Tensor):
            assert_bitwise_equal(va, vb)
        else:
            assert va == vb, k


def _quantized(v) -> bool:
    return isinstance(v, torch.Tensor) and find_adapter(v) is not None


def _map(sd, fn):
    """``sd`` with ``fn`` applied to every leaf (nested dicts and lists rebuilt)."""
    if isinstance(sd, dict):
        return {k: _map(v, fn) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_map(v, fn) for v in sd]
    return fn(sd)


def _snapshot(sd):
    """A deep copy to compare against later (quantized tensors through their adapters)."""
    def copy(v):
        if isinstance(v, DTensor):
            return DTensor(copy(v._local_tensor), v._spec, requires_grad=False)
        if _quantized(v):
            a = find_adapter(v)
            return a.from_inner_buffers(v, {n: b.clone() for n, b in a.inner_buffers(v).items()})
        return v.clone() if isinstance(v, torch.Tensor) else v
    return _map(sd, copy)


def _mutate(sd):
    """Update every tensor of ``sd`` in place, as an optimizer step would."""
    for _, v in _leaves(sd):
        if not isinstance(v, torch.Tensor):
            continue
        v = v._local_tensor if isinstance(v, DTensor) else v
        a = find_adapter(v)
        for b in (a.inner_buffers(v).values() if a is not None else [v]):
            with torch.no_grad():
                b.view(torch.uint8).add_(1) if b.element_size() == 1 else b.add_(1)


def _files(path) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))
            if n.endswith(".distcp")}


def _assert_same_checkpoint(a, b):
    """Same data files byte for byte, same entries (the .metadata pickle holds the path and a uuid)."""
    fa, fb = _files(a), _files(b)
    assert fa and list(fa) == list(fb)
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs"
    assert qdcp.describe(a) == qdcp.describe(b)


def _staged_component_bytes(sd) -> int:
    total = 0
    for _, v in _leaves(sd):
        if isinstance(v, torch.Tensor):
            a = find_adapter(v)
            total += sum(b.nbytes for b in a.inner_buffers(v).values()) if a else v.nbytes
    return total


# ----------------------------------------------------------------------------- protocol

def test_implements_dcp_async_stager_protocol():
    stager = QuantizedStager()
    assert isinstance(stager, AsyncStager)
    assert stager.should_synchronize_after_execute is True
    assert stager.pin_memory is torch.accelerator.is_available()
    stager.close()
    with pytest.raises(StagingError, match="closed"):
        stager.stage({})


def test_save_planner_pickles_for_the_process_checkpointer():
    for planner in (QuantizedSavePlanner(), QuantizedSavePlanner(dequantize=True)):
        back = pickle.loads(pickle.dumps(planner))
        assert back.dequantize == planner.dequantize


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("name", sorted(STATES))
def test_async_save_round_trip_bit_exact_and_byte_identical_to_save(name, tmp_path):
    state = STATES[name](0)
    stager = QuantizedStager()
    fut = dcp.async_save(state, checkpoint_id=tmp_path / "async", planner=QuantizedSavePlanner(),
                         async_stager=stager)
    fut.result()
    stager.close()
    dcp.save(state, checkpoint_id=tmp_path / "sync", planner=QuantizedSavePlanner())
    _assert_same_checkpoint(tmp_path / "async", tmp_path / "sync")

    target = STATES[name](1)
    dcp.load(target, checkpoint_id=tmp_path / "async", planner=QuantizedLoadPlanner())
    _assert_same_state(target, state)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_stage_copies_every_inner_buffer_bit_exact(case):
    t = case.make(0)
    stager = QuantizedStager()
    staged = stager.stage({"w": t})["w"]
    assert_same_buffers(staged, t)
    for name, b in inner(staged).items():
        assert b.device.type == "cpu"
        assert b.untyped_storage().data_ptr() != inner(t)[name].untyped_storage().data_ptr()
    assert_bitwise_equal(case.dequantize(staged), case.dequantize(t))
    assert stager.staged_nbytes == _staged_component_bytes({"w": t})


@pytest.mark.parametrize("dequantize", [False, True], ids=["raw", "dequantized"])
def test_mixed_state_dict_thread_checkpointer(dequantize, tmp_path):
    state = _mixed(0)
    expected = _snapshot(state)
    stager = QuantizedStager()
    fut = dcp.async_save(state, checkpoint_id=tmp_path / "async",
                         planner=QuantizedSavePlanner(dequantize=dequantize), async_stager=stager)
    _mutate(state)  # training goes on while the upload runs
    fut.result()
    dcp.save(expected, checkpoint_id=tmp_path / "sync", planner=QuantizedSavePlanner(dequantize=dequantize))
    _assert_same_checkpoint(tmp_path / "async", tmp_path / "sync")

    if dequantize:  # load into plain targets; they must hold exactly the library's dequantize
        expected = _map(expected, lambda v: find_adapter(v).dequantize(v) if _quantized(v) else v)
        target = _map(_mixed(1), lambda v: torch.empty(v.shape, dtype=v.dtype) if _quantized(v) else v)
    else:
        target = _mixed(1)
    dcp.load(target, checkpoint_id=tmp_path / "async", planner=QuantizedLoadPlanner())
    _assert_same_state(target, expected)
    stager.close()


def test_live_model_mutated_after_stage_does_not_change_checkpoint(tmp_path):
    model = _linear(Int8WeightOnlyConfig(version=2), 0)
    before = _snapshot(model.state_dict())
    stager = QuantizedStager()
    staged = stager.stage(model.state_dict())
    _mutate(model.state_dict())
    assert not torch.equal(model[0].weight.qdata, before["0.weight"].qdata)
    _assert_same_state(staged, before)

    del staged
    fut = dcp.async_save(model.state_dict(), checkpoint_id=tmp_path / "ckpt",
                         planner=QuantizedSavePlanner(), async_stager=stager)
    after = _snapshot(model.state_dict())
    _mutate(model.state_dict())
    fut.result()
    target = _linear(Int8WeightOnlyConfig(version=2), 1).state_dict()
    dcp.load(target, checkpoint_id=tmp_path / "ckpt", planner=QuantizedLoadPlanner())
    _assert_same_state(target, after)
    stager.close()


def test_async_staging_returns_future_and_matches_sync_save(tmp_path):
    state = _mixed(0)
    expected = _snapshot(state)
    stager = QuantizedStager(async_staging=True)
    staged = stager.stage(state)
    assert isinstance(staged, Future)
    _assert_same_state(staged.result(), expected)
    del staged
    stager.synchronize_staging()

    resp = dcp.async_save(state, checkpoint_id=tmp_path / "async", planner=QuantizedSavePlanner(),
                          async_stager=stager)
    assert isinstance(resp, AsyncSaveResponse)
    resp.staging_completion.result()
    _mutate(state)
    resp.upload_completion.result()
    dcp.save(expected, checkpoint_id=tmp_path / "sync", planner=QuantizedSavePlanner())
    _assert_same_checkpoint(tmp_path / "async", tmp_path / "sync")
    stager.close()


# ----------------------------------------------------------------------------- buffers

def test_buffers_are_reused_and_reallocated_only_on_change():
    state = _mixed(0)
    stager = QuantizedStager()

    def ptrs(sd):
        return {k: [b.data_ptr() for b in (inner(v).values() if find_adapter(v) else [v])]
                for k, v in _leaves(sd) if isinstance(v, torch.Tensor)}

    first = ptrs(stager.stage(state))
    _mutate(state)
    staged = stager.stage(state)
    assert ptrs(staged) == first
    _assert_same_state(staged, state)
    del staged

    state["rng"] = torch.arange(16)                    # shape change: a new buffer for it only
    del state["nf4"]                                   # entry gone: its buffers are dropped
    second = ptrs(stager.stage(state))
    assert second["rng"] != first["rng"]
    assert {k: v for k, v in second.items() if k != "rng"} == \
        {k: v for k, v in first.items() if k != "rng" and not k.startswith("nf4")}
    assert stager.staged_nbytes == _staged_component_bytes(state)
    stager.close()


def test_staged_bytes_equal_component_bytes_no_dequantized_copies():
    state = _mixed(0)
    stager = QuantizedStager()
    staged = stager.stage(state)
    nbytes = _staged_component_bytes(state)
    assert stager.staged_nbytes == nbytes == _staged_component_bytes(staged)
    hp = sum(v.numel() * v.dtype.itemsize for _, v in _leaves(state) if isinstance(v, torch.Tensor))
    assert nbytes < hp  # the logical tensors would be bigger: nothing was dequantized
    stager.close()


def test_restage_while_previous_staged_dict_is_in_use_is_refused():
    state = _mixed(0)
    stager = QuantizedStager(busy_timeout=0.05)
    staged = stager.stage(state)
    with pytest.raises(StagingError, match="still in use"):
        stager.stage(state)
    _assert_same_state(staged, _mixed(0))  # not overwritten
    del staged
    stager.stage(state)

    fresh = QuantizedStager(reuse_buffers=False)
    a, b = fresh.stage(state), fresh.stage(state)
    assert a["rng"].data_ptr() != b["rng"].data_ptr()
    assert fresh.staged_nbytes == 0


def test_back_to_back_async_saves_wait_for_the_upload(tmp_path):
    state = _mixed(0)
    expected = [_snapshot(state)]
    stager = QuantizedStager()
    futs = []
    for i in range(3):  # no fut.result() in between: stage() waits until the buffers are free
        futs.append(dcp.async_save(state, checkpoint_id=tmp_path / str(i),
                                   planner=QuantizedSavePlanner(), async_stager=stager))
        _mutate(state)
        expected.append(_snapshot(state))
    for f in futs:
        f.result()
    for i in range(3):
        dcp.save(expected[i], checkpoint_id=tmp_path / f"sync{i}", planner=QuantizedSavePlanner())
        _assert_same_checkpoint(tmp_path / str(i), tmp_path / f"sync{i}")
    stager.close()


def test_share_memory_buffers_are_shared_and_reused():
    state = _mixed(0)
    stager = QuantizedStager(share_memory=True)
    staged = stager.stage(state)
    w = staged["model"]["0.weight"]
    assert all(b.is_shared() for b in inner(w).values()) and staged["rng"].is_shared()
    ptr = w.qdata.data_ptr()
    del staged, w
    _mutate(state)
    staged = stager.stage(state)
    assert staged["model"]["0.weight"].qdata.data_ptr() == ptr
    _assert_same_state(staged, state)
    stager.close()


def test_unknown_tensor_subclass_is_refused_naming_the_key():
    class Marked(torch.Tensor):
        pass

    with pytest.raises(UnsupportedTensorError, match="'model.w'.*Marked"):
        QuantizedStager().stage({"model": {"w": torch.ones(2).as_subclass(Marked)}})


def test_tied_tensors_stay_tied():
    w = STATES["int8"](0)["0.weight"]
    staged = QuantizedStager().stage({"a": w, "b": w, "p": [w]})
    assert staged["a"] is staged["b"] is staged["p"][0]


# ----------------------------------------------------------------------------- without qdcp's stager

@pytest.mark.parametrize("name", ["int8", "nf4", "adamw8bit"])
def test_stock_writer_as_stager_fails_before_writing(name, tmp_path):
    """``storage_writer=FileSystemWriter(...)`` without ``async_stager`` stages through the writer
    (DCP's BlockingAsyncStager: ``zeros_like``, which torchao lacks and qdcp does not fill: zeroed
    buffers are not a zero tensor for every format). It fails before any planning or writing.
    (The plain call with ``checkpoint_id=`` works: tests/test_default_stager.py.)"""
    path = tmp_path / "ckpt"
    with pytest.raises(NotImplementedError, match="zeros_like"):
        dcp.async_save(STATES[name](0), planner=QuantizedSavePlanner(), storage_writer=dcp.FileSystemWriter(path))
    assert not path.exists() or not os.listdir(path)


# ----------------------------------------------------------------------------- PROCESS, DTensor

_PROCESS_SCRIPT = textwrap.dedent(r'''
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[2])))
    import test_stager as T
    from dist_helpers import init_file_store_group
    from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner
    from qdcp.stager import QuantizedStager


    def main():
        root = sys.argv[1]
        init_file_store_group(root, 0, 1)
        mesh = init_device_mesh("cpu", (1,))

        def shard(t):  # a DTensor over a quantized local tensor, built as FSDP2 would (no view_as)
            spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))
            return DTensor(t, spec, requires_grad=False)

        def state(seed):
            sd = T._mixed(seed)
            sd["model"] = {k: shard(v) for k, v in sd["model"].items()}
            return sd

        live = state(0)
        stager = QuantizedStager()
        staged = stager.stage(live)
        w = staged["model"]["0.weight"]
        assert isinstance(w, DTensor) and type(w._local_tensor) is type(live["model"]["0.weight"]._local_tensor)
        assert w.placements == live["model"]["0.weight"].placements
        assert w.__create_chunk_list__() == live["model"]["0.weight"].__create_chunk_list__()
        del staged, w
        for dequantize in (False, True):
            expected = []
            for i in range(2):  # the second save reuses buffers the first send moved to shared memory
                expected.append(T._snapshot(live))
                path = os.path.join(root, f"{dequantize}_{i}")
                fut = dcp.async_save(live, checkpoint_id=path, planner=QuantizedSavePlanner(dequantize=dequantize),
                                     async_stager=stager, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
                T._mutate(live)
                fut.result()
            for i in range(2):
                path = os.path.join(root, f"{dequantize}_{i}")
                dcp.save(expected[i], checkpoint_id=path + "_sync", planner=QuantizedSavePlanner(dequantize=dequantize))
                T._assert_same_checkpoint(path, path + "_sync")
                if not dequantize:
                    target = state(5)
                    dcp.load(target, checkpoint_id=path, planner=QuantizedLoadPlanner())
                    target["model"] = {k: v._local_tensor for k, v in target["model"].items()}
                    expected[i]["model"] = {k: v._local_tensor for k, v in expected[i]["model"].items()}
                    T._assert_same_state(target, expected[i])
        shared = all(b.is_shared() for b in stager._buffers.values())
        stager.close()
        dist.destroy_process_group()
        print("OK shared=%s" % shared)


    if __name__ == "__main__":  # the PROCESS checkpointer spawns: guard the entry point
        main()
''')


def test_process_checkpointer_with_dtensors_raw_and_dequantized(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_PROCESS_SCRIPT)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), __file__], capture_output=True,
                          text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "OK shared=True" in proc.stdout
