"""Each entry's data is produced once per save: through ``dcp.save`` with qdcp's planner, the
planner asks the adapter for an entry's components (raw) or dequantized values (dequantized) once,
hashes and writes that, drops it once written, and the checkpoint holds the same bits.

The adapter is torchao's own ``Int8Tensor`` adapter, registered again as a subclass that counts the
calls qdcp makes to it (calls the adapter makes to itself, e.g. ``inner_buffers`` through
``components``, are its own business and not counted)."""
from __future__ import annotations

import collections
import contextlib
import gc
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import qdcp
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner
from qdcp.adapters import find_adapter, register_adapter
from quantized_cases import CASE_BY_NAME

INT8 = CASE_BY_NAME["int8_row"]
KEYS = ("a", "b", "c")


@pytest.fixture
def counted():
    """Registers a counting subclass of the Int8Tensor adapter; yields its counter
    ``{(method, id(tensor)): calls}`` and the values ``dequantize`` returned; restores the original."""
    original = find_adapter(INT8.make(0))
    calls: collections.Counter = collections.Counter()
    made: list[weakref.ref] = []
    depth = [0]

    @contextlib.contextmanager
    def call(name, t):
        if depth[0] == 0:
            calls[name, id(t)] += 1
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1

    class Counting(type(original)):
        def components(self, t):
            with call("components", t):
                return super().components(t)

        def dequantize(self, t, dtype=None):
            with call("dequantize", t):
                out = super().dequantize(t, dtype)
            made.append(weakref.ref(out))
            return out

        def inner_buffers(self, t):
            with call("inner_buffers", t):
                return super().inner_buffers(t)

    register_adapter(Counting(), override=True)
    try:
        yield calls, made
    finally:
        register_adapter(original, override=True)


def _state():
    return {**{k: INT8.make(i) for i, k in enumerate(KEYS)}, "bias": torch.arange(5.0), "step": 7}


def _per_entry(calls, state, method):
    return [calls[method, id(state[k])] for k in KEYS]


@pytest.mark.parametrize("checksums", [True, False])
def test_raw_save_asks_for_each_entrys_components_once(tmp_path, counted, checksums):
    calls, _ = counted
    state = _state()
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path, thread_count=2),
             planner=QuantizedSavePlanner(checksums=checksums))
    assert _per_entry(calls, state, "components") == [1, 1, 1]  # was 7 (4 unhashed): planned, hashed, written
    assert _per_entry(calls, state, "inner_buffers") == [0, 0, 0]  # the sharded-inside check uses those components
    assert _per_entry(calls, state, "dequantize") == [0, 0, 0]
    target = {**{k: INT8.make(10 + i) for i, k in enumerate(KEYS)}, "bias": torch.zeros(5), "step": 0}
    dcp.load(target, checkpoint_id=tmp_path, planner=QuantizedLoadPlanner())
    for k in KEYS:  # the source's bits
        assert torch.equal(target[k].qdata, state[k].qdata) and torch.equal(target[k].scale, state[k].scale)
    assert torch.equal(target["bias"], state["bias"]) and target["step"] == 7


def test_dequantized_save_dequantizes_each_entry_once_and_drops_it_once_written(tmp_path, counted):
    calls, made = counted
    state = _state()
    planner = QuantizedSavePlanner(dequantize=True)
    dcp.save(state, checkpoint_id=tmp_path, planner=planner)
    assert _per_entry(calls, state, "dequantize") == [1, 1, 1]  # was 2: hashed at planning, written
    assert _per_entry(calls, state, "components") == [0, 0, 0]
    gc.collect()
    assert len(made) == 3 and all(ref() is None for ref in made)  # not held by the planner once written
    target = {k: torch.zeros(INT8.make(0).shape, dtype=INT8.dtype) for k in KEYS}
    qdcp.load(target, tmp_path, allow_partial_load=True)
    for k in KEYS:
        assert torch.equal(target[k], INT8.dequantize(state[k]))
