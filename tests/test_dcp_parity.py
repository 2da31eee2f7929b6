"""Drop-in parity: what DCP's default planners handle, qdcp's handle the same way.

One test per case found by running PyTorch's own DCP tests (test/distributed/checkpoint) with
qdcp's planners swapped in for DCP's: tensor subclasses qdcp has no adapter for (ShardedTensor,
objects implementing DCP's ``__create_write_items__`` / ``__create_chunk_list__`` protocol, any
other subclass) go through DCP's default path untouched, byte for byte; plan caching caches what
DCP's does; the flatten options; the non-tensor objects trainers checkpoint.
"""

from __future__ import annotations

import argparse
import io
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlanner, TensorWriteData, WriteItem, WriteItemType

import qdcp
from qdcp import LoadMismatchError, QuantizedLoadPlanner, QuantizedSavePlanner, checksums
from quantized_cases import CASE_BY_NAME, assert_same_buffers, raise_inner
from state_dicts import data_files


@pytest.fixture(autouse=True, params=["plain", "switch"])
def switch(request):
    """Every case also runs with ``qdcp.install()`` on: DCP's default planners are then qdcp's."""
    if request.param == "plain":
        yield False
        return
    with qdcp.installed():
        yield True


def _both(state, tmp_path, **planner_kw):
    """Save ``state`` with DCP's default planner and with qdcp's; the two paths."""
    dcp.save(state, checkpoint_id=tmp_path / "dcp", planner=dcp.DefaultSavePlanner(**planner_kw))
    dcp.save(state, checkpoint_id=tmp_path / "qdcp", planner=QuantizedSavePlanner(**planner_kw))
    return tmp_path / "dcp", tmp_path / "qdcp"


# ----------------------------------------------------------------------------- subclasses without adapter

class Checkpointable(torch.Tensor):
    """A tensor that saves as one shard ``[offset, offset + local rows)`` of a larger tensor through
    DCP's checkpointable protocol (as DCP's own test's CheckpointableDistTensor does)."""

    @staticmethod
    def __new__(cls, fqn: str, local: torch.Tensor, offset: int, rows: int):
        r = torch.Tensor._make_wrapper_subclass(cls, (rows, *local.shape[1:]), dtype=local.dtype)
        r._fqn, r._local, r._offsets = fqn, local, torch.Size([offset] + [0] * (local.ndim - 1))
        return r

    def __init__(self, *args, **kwargs):
        super().__init__()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} is not supported")

    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(offsets=self._offsets, sizes=self._local.size())]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(self._fqn, self._offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=self._offsets, sizes=self._local.size()),
                              properties=TensorProperties.create_from_tensor(self._local), size=self.shape))]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._local


def test_checkpointable_protocol_objects_go_through_dcps_path(tmp_path):
    full = torch.arange(48.0).reshape(8, 6)
    state = {"w": Checkpointable("w", full, 0, 8), "q": CASE_BY_NAME["int8_row"].make(0)}
    dcp_path, qdcp_path = _both({"w": state["w"]}, tmp_path)
    assert data_files(dcp_path) == data_files(qdcp_path)
    dcp.save(state, checkpoint_id=tmp_path / "mixed", planner=QuantizedSavePlanner())
    part = Checkpointable("w", torch.zeros(3, 6), 2, 8)  # rows [2, 5): read in part
    target = {"w": part, "q": CASE_BY_NAME["int8_row"].make(1)}
    dcp.load(target, checkpoint_id=tmp_path / "mixed", planner=QuantizedLoadPlanner())
    assert torch.equal(part._local, full[2:5])
    assert_same_buffers(target["q"], state["q"])


class Marked(torch.Tensor):
    """A tensor subclass with storage (``as_subclass``), pickled whole by DCP."""


def test_any_other_tensor_subclass_is_saved_as_dcp_saves_it(tmp_path):
    t = torch.randn(4, 3).as_subclass(Marked)
    dcp_path, qdcp_path = _both({"m": t}, tmp_path)
    assert data_files(dcp_path) == data_files(qdcp_path)
    out = {"m": torch.zeros(4, 3)}
    with torch.serialization.safe_globals([Marked]):  # DCP's reader loads tensors weights-only
        dcp.load(out, checkpoint_id=qdcp_path, planner=QuantizedLoadPlanner())
    assert torch.equal(out["m"], t.as_subclass(torch.Tensor))


def _sharded_tensor_worker(rank: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    from dist_helpers import init_file_store_group

    init_file_store_group(root, rank, 2)
    full = torch.arange(48.0).reshape(8, 6)

    def sharded(dim: int, fill: torch.Tensor | None):
        spec = ChunkShardingSpec(dim=dim, placements=["rank:0/cpu", "rank:1/cpu"])
        st = sharded_tensor.empty(spec, 8, 6)
        local = st.local_shards()[0]
        offsets = local.metadata.shard_offsets
        rows, cols = local.tensor.shape
        local.tensor.copy_(fill[offsets[0]:offsets[0] + rows, offsets[1]:offsets[1] + cols]
                           if fill is not None else torch.zeros(rows, cols))
        return st

    state = {"st": sharded(0, full), "b": torch.ones(2)}
    dcp.save(state, checkpoint_id=os.path.join(root, "dcp"), planner=dcp.DefaultSavePlanner())
    dcp.save(state, checkpoint_id=os.path.join(root, "qdcp"), planner=QuantizedSavePlanner())
    target = {"st": sharded(1, None), "b": torch.zeros(2)}  # row-wise saved, column-wise loaded
    dcp.load(target, checkpoint_id=os.path.join(root, "qdcp"), planner=QuantizedLoadPlanner())
    local = target["st"].local_shards()[0]
    col = local.metadata.shard_offsets[1]
    assert torch.equal(local.tensor, full[:, col:col + local.tensor.shape[1]]), rank
    assert torch.equal(target["b"], torch.ones(2))
    dist.destroy_process_group()


def test_sharded_tensor_saves_as_dcp_saves_it_and_reshards_on_load(tmp_path):
    mp.spawn(_sharded_tensor_worker, args=(str(tmp_path),), nprocs=2, join=True)
    assert data_files(tmp_path / "dcp") == data_files(tmp_path / "qdcp")


# ----------------------------------------------------------------------------- plan caching, flattening

def _local_plan(rank: int, seed: int) -> Any:
    planner = QuantizedSavePlanner(enable_plan_caching=True)
    state = {"tensor": torch.rand(10, generator=torch.Generator().manual_seed(seed)), "value": [1, 2, 3],
             f"rank{rank}": CASE_BY_NAME["int8_row"].make(rank)}
    planner.set_up_planner(state, is_coordinator=rank == 0)
    return planner.create_local_plan()


def test_global_plan_caching_caches_what_dcp_caches():
    """As PyTorch's test_planner.py::test_global_plan_with_caching, with qdcp's planner: the plans
    given are cached as given; a second save of the same structure (other values) gets DCP's
    empty delta plans and equal metadata. The checksums join the metadata once the coordinator
    finishes its plan, and they are the second save's."""
    planner = QuantizedSavePlanner(enable_plan_caching=True)
    key = planner._cached_plans_key
    for cache in (SavePlanner._cached_all_plans, SavePlanner._cached_global_plan, SavePlanner._cached_metadata):
        cache.pop(key, None)
    all_plans = [_local_plan(r, 0) for r in range(2)]
    first_plans, first_md = planner.create_global_plan(all_plans)
    assert SavePlanner._cached_global_plan[key] == first_plans
    assert SavePlanner._cached_all_plans[key] == all_plans
    planner.finish_plan(first_plans[0])
    first_sums = dict(first_md.planner_data[checksums.PLANNER_DATA_KEY]["items"])
    del first_md.planner_data[checksums.PLANNER_DATA_KEY], first_md.planner_data[checksums.SEALED_KEY]
    all_plans = [_local_plan(r, 1) for r in range(2)]
    second_plans, second_md = planner.create_global_plan(all_plans)
    assert all(not p.usable and not p.items and p.planner_data is None for p in second_plans)
    assert first_md == second_md == SavePlanner._cached_metadata[key]
    planner.finish_plan(second_plans[0])
    second_sums = second_md.planner_data[checksums.PLANNER_DATA_KEY]["items"]
    assert second_sums["tensor"] != first_sums["tensor"]  # fresh: the values changed
    assert second_sums["rank1.__qdcp__.qdata"] == first_sums["rank1.__qdcp__.qdata"]


def test_flatten_state_dict_off_behaves_as_dcp(tmp_path):
    """Without flattening, a nested dict is one pickled object to DCP; qdcp's planners agree, and
    quantized tensors at the top level are planned by qdcp as usual."""
    def state(seed):
        return {"model": {"w": torch.arange(6.0) + seed}, "step": 3 + seed, "b": torch.arange(4.0) + seed}
    dcp_path, qdcp_path = _both(state(0), tmp_path, flatten_state_dict=False)
    assert data_files(dcp_path) == data_files(qdcp_path)
    for planner in (dcp.DefaultLoadPlanner, QuantizedLoadPlanner):
        outs = [state(9), state(9)]
        dcp.load(outs[0], checkpoint_id=dcp_path, planner=dcp.DefaultLoadPlanner(flatten_state_dict=False))
        dcp.load(outs[1], checkpoint_id=qdcp_path, planner=planner(flatten_state_dict=False))
        assert str(outs[0]) == str(outs[1])
    q = {"q": CASE_BY_NAME["nvfp4"].make(0), "b": torch.arange(4.0)}
    dcp.save(q, checkpoint_id=tmp_path / "q", planner=QuantizedSavePlanner(flatten_state_dict=False))
    out = {"q": CASE_BY_NAME["nvfp4"].make(1), "b": torch.zeros(4)}
    dcp.load(out, checkpoint_id=tmp_path / "q", planner=QuantizedLoadPlanner(flatten_state_dict=False))
    assert torch.equal(out["b"], torch.arange(4.0))
    assert_same_buffers(out["q"], q["q"])


# ----------------------------------------------------------------------------- objects

def test_objects_trainers_checkpoint_load_without_running_code(tmp_path):
    """torchtitan's TrainState keeps its losses in a BytesIO; configs travel as Namespaces."""
    losses = io.BytesIO()
    torch.save([1.5, 1.25], losses)
    state = {"losses": losses, "args": argparse.Namespace(lr=0.5, name="run"), "steps": {1, 2}}
    dcp.save(state, checkpoint_id=tmp_path, planner=QuantizedSavePlanner())
    out = {"losses": io.BytesIO(), "args": None, "steps": None}
    dcp.load(out, checkpoint_id=tmp_path, planner=QuantizedLoadPlanner())
    assert out["losses"].getvalue() == losses.getvalue()
    assert out["args"] == argparse.Namespace(lr=0.5, name="run") and out["steps"] == {1, 2}


class _Opaque:
    def __init__(self, v):
        self.v = v


def test_other_pickled_objects_need_weights_only_false(tmp_path):
    dcp.save({"obj": _Opaque(3)}, checkpoint_id=tmp_path, planner=QuantizedSavePlanner())
    with pytest.raises(LoadMismatchError, match=r"key 'obj'.*_Opaque.*weights_only=False"):
        raise_inner(lambda: dcp.load({"obj": None}, checkpoint_id=tmp_path, planner=QuantizedLoadPlanner()))
    out = {"obj": None}
    dcp.load(out, checkpoint_id=tmp_path, planner=QuantizedLoadPlanner(weights_only=False))  # trusted
    assert out["obj"].v == 3
