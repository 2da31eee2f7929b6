"""QuantizedStager: dcp.async_save of quantized state dicts, bit-exact and byte-identical to dcp.save."""

from __future__ import annotations

import os
import pickle
from concurrent.futures import Future

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchao.quantization import Int8WeightOnlyConfig

import qdcp
from dist_helpers import run_one_rank_script
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner, StagingError, UnsupportedTensorError
from qdcp.adapters.base import find_adapter
from qdcp.staging.stager import QuantizedStager
from quantized_cases import CASES, assert_bitwise_equal, assert_same_buffers, inner
from state_dicts import (
    STATES,
    assert_same_checkpoint,
    assert_same_state,
    is_quantized,
    leaves,
    linear,
    map_leaves,
    mixed,
    mutate,
    snapshot,
)


def _staged_component_bytes(sd) -> int:
    total = 0
    for _, v in leaves(sd):
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
    assert_same_checkpoint(tmp_path / "async", tmp_path / "sync")

    target = STATES[name](1)
    dcp.load(target, checkpoint_id=tmp_path / "async", planner=QuantizedLoadPlanner())
    assert_same_state(target, state)


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
    state = mixed(0)
    expected = snapshot(state)
    stager = QuantizedStager()
    fut = dcp.async_save(state, checkpoint_id=tmp_path / "async",
                         planner=QuantizedSavePlanner(dequantize=dequantize), async_stager=stager)
    mutate(state)  # training goes on while the upload runs
    fut.result()
    dcp.save(expected, checkpoint_id=tmp_path / "sync", planner=QuantizedSavePlanner(dequantize=dequantize))
    assert_same_checkpoint(tmp_path / "async", tmp_path / "sync")

    if dequantize:  # load into plain targets; they must hold exactly the library's dequantize
        expected = map_leaves(expected, lambda v: find_adapter(v).dequantize(v) if is_quantized(v) else v)
        target = map_leaves(mixed(1), lambda v: torch.empty(v.shape, dtype=v.dtype) if is_quantized(v) else v)
    else:
        target = mixed(1)
    dcp.load(target, checkpoint_id=tmp_path / "async", planner=QuantizedLoadPlanner())
    assert_same_state(target, expected)
    stager.close()


def test_live_model_mutated_after_stage_does_not_change_checkpoint(tmp_path):
    model = linear(Int8WeightOnlyConfig(version=2), 0)
    before = snapshot(model.state_dict())
    stager = QuantizedStager()
    staged = stager.stage(model.state_dict())
    mutate(model.state_dict())
    assert not torch.equal(model[0].weight.qdata, before["0.weight"].qdata)
    assert_same_state(staged, before)

    del staged
    fut = dcp.async_save(model.state_dict(), checkpoint_id=tmp_path / "ckpt",
                         planner=QuantizedSavePlanner(), async_stager=stager)
    after = snapshot(model.state_dict())
    mutate(model.state_dict())
    fut.result()
    target = linear(Int8WeightOnlyConfig(version=2), 1).state_dict()
    dcp.load(target, checkpoint_id=tmp_path / "ckpt", planner=QuantizedLoadPlanner())
    assert_same_state(target, after)
    stager.close()


def test_async_staging_returns_future_and_matches_sync_save(tmp_path):
    state = mixed(0)
    expected = snapshot(state)
    stager = QuantizedStager(async_staging=True)
    staged = stager.stage(state)
    assert isinstance(staged, Future)
    assert_same_state(staged.result(), expected)
    del staged
    stager.synchronize_staging()

    resp = dcp.async_save(state, checkpoint_id=tmp_path / "async", planner=QuantizedSavePlanner(),
                          async_stager=stager)
    assert isinstance(resp, AsyncSaveResponse)
    resp.staging_completion.result()
    mutate(state)
    resp.upload_completion.result()
    dcp.save(expected, checkpoint_id=tmp_path / "sync", planner=QuantizedSavePlanner())
    assert_same_checkpoint(tmp_path / "async", tmp_path / "sync")
    stager.close()


# ----------------------------------------------------------------------------- buffers

def test_buffers_are_reused_and_reallocated_only_on_change():
    state = mixed(0)
    stager = QuantizedStager()

    def ptrs(sd):
        return {k: [b.data_ptr() for b in (inner(v).values() if find_adapter(v) else [v])]
                for k, v in leaves(sd) if isinstance(v, torch.Tensor)}

    first = ptrs(stager.stage(state))
    mutate(state)
    staged = stager.stage(state)
    assert ptrs(staged) == first
    assert_same_state(staged, state)
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
    state = mixed(0)
    stager = QuantizedStager()
    staged = stager.stage(state)
    nbytes = _staged_component_bytes(state)
    assert stager.staged_nbytes == nbytes == _staged_component_bytes(staged)
    hp = sum(v.numel() * v.dtype.itemsize for _, v in leaves(state) if isinstance(v, torch.Tensor))
    assert nbytes < hp  # the logical tensors would be bigger: nothing was dequantized
    stager.close()


def _buffer_ptrs(sd) -> dict[str, list[int]]:
    return {k: [b.data_ptr() for b in (inner(v).values() if find_adapter(v) else [v])]
            for k, v in leaves(sd) if isinstance(v, torch.Tensor)}


def _allocated(fn) -> int:
    """Bytes of host memory ``fn`` allocates (torch's profiler, which records every allocation)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


def test_prepared_buffers_are_the_ones_the_first_stage_copies_into():
    """prepare() allocates every buffer a stage() of the state dict uses (the components' bytes,
    no more), copies nothing, and the first real stage() copies into those very buffers: it
    allocates nothing (an unprepared stager's first stage allocates them all)."""
    state = mixed(0)
    stager = QuantizedStager()
    held = []
    assert _allocated(lambda: held.append(stager.prepare(state))) == _staged_component_bytes(state)
    assert held == [stager.staged_nbytes] == [_staged_component_bytes(state)]
    staged = []
    assert _allocated(lambda: staged.append(stager.stage(state))) == 0  # into the prepared buffers
    assert_same_state(staged[0], state)
    assert stager.staged_nbytes == held[0]
    assert _allocated(lambda: QuantizedStager().stage(state)) == _staged_component_bytes(state)
    stager.close()


def test_prepare_never_writes_buffers_an_upload_may_read():
    state = mixed(0)
    stager = QuantizedStager()
    staged = stager.stage(state)
    before = snapshot(staged)
    state["extra"] = torch.arange(8.0)
    assert stager.prepare(state) == _staged_component_bytes(state)  # the new entry's buffer, nothing rewritten
    assert_same_state(staged, before)
    del staged
    state["extra"] += 1
    assert_same_state(stager.stage(state), state)
    with pytest.raises(StagingError, match="reuse_buffers=False"):
        QuantizedStager(reuse_buffers=False).prepare(state)
    stager.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prepared_buffers_are_pinned_and_reused_on_cuda():
    state = map_leaves(mixed(0), lambda v: v.to("cuda") if isinstance(v, torch.Tensor) else v)
    stager = QuantizedStager()
    stager.prepare(state)
    prepared = {key: b.data_ptr() for key, b in stager._buffers.items()}
    assert all(b.is_pinned() for b in stager._buffers.values() if b.numel())
    staged = stager.stage(state)
    assert {key: b.data_ptr() for key, b in stager._buffers.items()} == prepared
    assert sorted(p for ptrs in _buffer_ptrs(staged).values() for p in ptrs) == sorted(prepared.values())
    assert_same_state(staged, map_leaves(state, lambda v: v.cpu() if isinstance(v, torch.Tensor) else v))
    stager.close()


def test_restage_while_previous_staged_dict_is_in_use_is_refused():
    state = mixed(0)
    stager = QuantizedStager(busy_timeout=0.05)
    staged = stager.stage(state)
    with pytest.raises(StagingError, match="still in use"):
        stager.stage(state)
    assert_same_state(staged, mixed(0))  # not overwritten
    del staged
    stager.stage(state)

    fresh = QuantizedStager(reuse_buffers=False)
    a, b = fresh.stage(state), fresh.stage(state)
    assert a["rng"].data_ptr() != b["rng"].data_ptr()
    assert fresh.staged_nbytes == 0


def test_back_to_back_async_saves_wait_for_the_upload(tmp_path):
    state = mixed(0)
    expected = [snapshot(state)]
    stager = QuantizedStager()
    futs = []
    for i in range(3):  # no fut.result() in between: stage() waits until the buffers are free
        futs.append(dcp.async_save(state, checkpoint_id=tmp_path / str(i),
                                   planner=QuantizedSavePlanner(), async_stager=stager))
        mutate(state)
        expected.append(snapshot(state))
    for f in futs:
        f.result()
    for i in range(3):
        dcp.save(expected[i], checkpoint_id=tmp_path / f"sync{i}", planner=QuantizedSavePlanner())
        assert_same_checkpoint(tmp_path / str(i), tmp_path / f"sync{i}")
    stager.close()


def test_share_memory_buffers_are_shared_and_reused():
    state = mixed(0)
    stager = QuantizedStager(share_memory=True)
    staged = stager.stage(state)
    w = staged["model"]["0.weight"]
    assert all(b.is_shared() for b in inner(w).values()) and staged["rng"].is_shared()
    ptr = w.qdata.data_ptr()
    del staged, w
    mutate(state)
    staged = stager.stage(state)
    assert staged["model"]["0.weight"].qdata.data_ptr() == ptr
    assert_same_state(staged, state)
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
    (The plain call with ``checkpoint_id=`` works: tests/test_new_empty.py.)"""
    path = tmp_path / "ckpt"
    with pytest.raises(NotImplementedError, match="zeros_like"):
        dcp.async_save(STATES[name](0), planner=QuantizedSavePlanner(), storage_writer=dcp.FileSystemWriter(path))
    assert not path.exists() or not os.listdir(path)


# ----------------------------------------------------------------------------- PROCESS, DTensor

# the body of a one-rank process: DTensors over quantized locals, through the PROCESS checkpointer
_PROCESS_IMPORTS = """
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from dist_helpers import dtensor_from_local
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner, find_adapter
from qdcp.staging.stager import QuantizedStager
from state_dicts import assert_same_checkpoint, assert_same_state, mixed, mutate, snapshot
"""
_PROCESS_MAIN = '''
mesh = init_device_mesh("cpu", (1,))

def shard(t):  # a DTensor over a quantized local tensor, built as FSDP2 would (no view_as)
    return dtensor_from_local(t, mesh, (Shard(0),), t.shape, t.dtype)

def state(seed):
    sd = mixed(seed)
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
        expected.append(snapshot(live))
        path = os.path.join(root, f"{dequantize}_{i}")
        fut = dcp.async_save(live, checkpoint_id=path, planner=QuantizedSavePlanner(dequantize=dequantize),
                             async_stager=stager, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        mutate(live)
        fut.result()
    for i in range(2):
        path = os.path.join(root, f"{dequantize}_{i}")
        dcp.save(expected[i], checkpoint_id=path + "_sync", planner=QuantizedSavePlanner(dequantize=dequantize))
        assert_same_checkpoint(path, path + "_sync")
        if not dequantize:
            target = state(5)
            dcp.load(target, checkpoint_id=path, planner=QuantizedLoadPlanner())
            target["model"] = {k: v._local_tensor for k, v in target["model"].items()}
            expected[i]["model"] = {k: v._local_tensor for k, v in expected[i]["model"].items()}
            assert_same_state(target, expected[i])
def buffers(x):  # every tensor holding a staged state dict's data: plain tensors, quantized inner buffers
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [b for v in x for b in buffers(v)]
    if not isinstance(x, torch.Tensor):
        return []
    with torch.no_grad():
        local = x.to_local() if isinstance(x, DTensor) else x
    adapter = find_adapter(local)
    return list(adapter.inner_buffers(local).values()) if adapter is not None else [local]

restaged = stager.stage(live)  # views of the buffers the stager keeps (reuse_buffers)
shared = all(b.is_shared() for b in buffers(restaged))
del restaged

# qdcp's writer in the checkpointer's process: it hashes each item as it writes and makes the record
import qdcp
from qdcp import checksums
before = snapshot(live)
path = os.path.join(root, "qdcp_writer")
fut = dcp.async_save(live, storage_writer=qdcp.storage_writer(path), planner=QuantizedSavePlanner(),
                     async_stager=stager, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
mutate(live)
fut.result()
md = qdcp.read_metadata(path)
assert set(checksums.record(md).items) == set(md.state_dict_metadata), "items without a recorded checksum"
dcp.save(before, checkpoint_id=path + "_sync", planner=QuantizedSavePlanner())
assert checksums.record(md).items == checksums.record(qdcp.read_metadata(path + "_sync")).items
stager.close()
print("OK shared=%s" % shared)
'''


def test_process_checkpointer_with_dtensors_raw_and_dequantized(tmp_path):
    """Also qdcp's writer in the checkpointer's process: the record it makes holds every item, as
    the planner's (DCP's writer) of the same values."""
    proc = run_one_rank_script(tmp_path, _PROCESS_MAIN, imports=_PROCESS_IMPORTS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "OK shared=True" in proc.stdout


class _Unstageable(torch.Tensor):
    """A tensor subclass no adapter handles: QuantizedStager refuses it, naming its key."""


def test_a_failed_background_staging_is_its_own_saves_error_not_the_nexts(tmp_path):
    """With ``async_staging=True`` a staging that fails is reported by that save's upload; the next
    save with the same stager was refused with the old error (naming a key it does not hold)."""
    stager = QuantizedStager(async_staging=True)
    try:
        bad = qdcp.async_save({"model": {"old": torch.randn(8).as_subclass(_Unstageable)}}, tmp_path / "bad",
                              stager=stager)
        with pytest.raises(UnsupportedTensorError, match="key 'model.old'"):
            bad.upload_completion.result()
        good = {"model": {"w": CASES[0].make(0)}}
        qdcp.async_save(good, tmp_path / "good", stager=stager).upload_completion.result()
    finally:
        stager.close()
    target = {"model": {"w": CASES[0].make(1)}}
    qdcp.load(target, tmp_path / "good")
    assert_same_buffers(target["model"]["w"], good["model"]["w"])


class _Holder:
    """A user's object holding a torchao optimizer state (whose library has no clone)."""

    def __init__(self, state: torch.Tensor) -> None:
        self.state = state


def test_an_object_whose_copy_fails_is_refused_naming_its_key(tmp_path):
    """Objects are staged with copy.deepcopy, as DCP's stager does; one holding an OptimState8bit
    failed inside torchao (aten.clone not implemented, no key named): now UnsupportedTensorError
    naming the key and what to do, nothing written."""
    optim8 = next(c for c in CASES if c.name == "optim8bit_signed")
    stager = QuantizedStager()
    try:
        with pytest.raises(UnsupportedTensorError, match=r"key 'extra\.ema'.*_Holder.*Put its tensors in the state"):
            qdcp.async_save({"extra": {"ema": _Holder(optim8.make(0))}}, tmp_path / "c", stager=stager).result()
    finally:
        stager.close()
    assert not (tmp_path / "c" / ".metadata").exists()
