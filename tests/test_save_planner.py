"""The save planner by component: the items and spec it plans for each entry, without writing."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard
from torchao.quantization import Int8Tensor, PerGroup, PerRow

import dcp_in_process as job
import rule_cases
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner
from qdcp import spec as qspec
from qdcp.adapters import find_adapter
from qdcp.errors import QdcpError
from quantized_cases import CASE_BY_NAME, CASES, SHAPE


def _plan(state, **kw):
    planner = QuantizedSavePlanner(**kw)
    planner.set_up_planner(state, None, True)
    plan = planner.create_local_plan()
    return plan, {i.index.fqn: i for i in plan.items}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_raw_entry_is_one_item_per_component_and_a_spec(case):
    t = case.make(0)
    plan, items = _plan({"w": t, "b": torch.ones(3)})
    comps = find_adapter(t).components(t)
    assert set(items) == {"b"} | {qspec.component_fqn("w", n) for n in comps}
    for name, c in comps.items():
        item = items[qspec.component_fqn("w", name)]
        assert tuple(item.tensor_data.size) == tuple(c.shape)
        assert item.tensor_data.properties.dtype == c.dtype
    spec = qspec.loads(plan.planner_data[qspec.PLANNER_DATA_KEY])["w"]
    assert spec.storage == qspec.RAW and spec.type == find_adapter(t).type_name(t)
    assert spec.shape == tuple(t.shape) and {c.name for c in spec.components} == set(comps)


def test_dequantized_entry_is_one_plain_item_of_the_asked_dtype():
    t = CASE_BY_NAME["int8_row"].make(0)
    _, items = _plan({"w": t}, dequantize=True)
    assert set(items) == {"w"} and items["w"].tensor_data.properties.dtype == t.dtype
    _, items = _plan({"w": t}, dequantize=True, dequantize_dtype=torch.float32)
    assert items["w"].tensor_data.properties.dtype == torch.float32
    assert tuple(items["w"].tensor_data.size) == SHAPE


def test_dequantize_callable_chooses_per_entry():
    a, b = CASES[0].make(0), CASES[0].make(1)
    plan, items = _plan({"keep": a, "plain": b}, dequantize=lambda fqn, t: fqn == "plain")
    specs = qspec.loads(plan.planner_data[qspec.PLANNER_DATA_KEY])
    assert specs["keep"].storage == qspec.RAW and specs["plain"].storage == qspec.DEQUANTIZED
    assert set(items) == {"plain"} | {qspec.component_fqn("keep", n) for n in find_adapter(a).components(a)}


def test_a_bad_dequantize_choice_is_refused_before_planning():
    with pytest.raises(TypeError, match="dequantize must be a bool or a callable"):
        QuantizedSavePlanner(dequantize="yes")


def test_shards_of_different_configs_save_dequantized_as_the_refusal_advises(tmp_path):
    """Two ranks whose shards of one entry were quantized each its own way (per row and per group):
    the raw save is refused naming the key and advising to save it dequantized; that save is taken
    (the shards' values are one plain tensor; the spec keeps the attributes both share) and loads
    back the values bitwise, into plain and quantized targets, from memory and from files."""
    hp = torch.randn(16, 64, dtype=torch.bfloat16)
    shards = [Int8Tensor.from_hp(hp[:8], PerRow()), Int8Tensor.from_hp(hp[8:], PerGroup(32))]
    values = torch.cat([s.dequantize() for s in shards])
    layout = rule_cases.Layout((2,), (Shard(0),))

    def state(rank):
        return rule_cases.placed_state(layout, shards[rank], (16, 64))

    with pytest.raises(QdcpError, match="'w'.*dequantized|dequantized.*'w'"):
        job.save(state, 2, QuantizedSavePlanner)
    deq = lambda: QuantizedSavePlanner(dequantize=True)  # noqa: E731
    metadata, store = job.save(state, 2, deq)
    on_disk = job.save_files(state, 2, deq, str(tmp_path / "ckpt"))
    for md in (metadata, on_disk):
        spec = qspec.loads(md.planner_data[qspec.PLANNER_DATA_KEY])["w"]
        assert spec.storage == qspec.DEQUANTIZED and spec.type == "torchao.Int8Tensor"
        assert "block_size" not in spec.attrs and spec.attrs["dtype"] == {"dtype": "bfloat16"}
    for rank in range(2):
        with job.as_rank(rank, 2):
            for where in ("memory", "files"):
                plain = torch.zeros(8, 64, dtype=torch.bfloat16)
                quantized = Int8Tensor.from_hp(torch.zeros(8, 64, dtype=torch.bfloat16), PerRow())
                for target in (plain, quantized):
                    state = rule_cases.placed_state(layout, target, (16, 64))
                    if where == "memory":
                        job.load(state, rank, 2, metadata, store, QuantizedLoadPlanner())
                    else:
                        job.load_files(state, str(tmp_path / "ckpt"), QuantizedLoadPlanner(atomic=True))
                mine = values[8 * rank:8 * rank + 8]
                assert torch.equal(plain.view(torch.int16), mine.view(torch.int16))
                expect = Int8Tensor.from_hp(mine, PerRow())
                assert torch.equal(quantized.qdata, expect.qdata) and torch.equal(quantized.scale, expect.scale)


@pytest.mark.parametrize("door", ["qdcp.save", "dcp.save", "dcp.async_save"])
@pytest.mark.parametrize("key", ["w.__qdcp__.qdata", "other.__qdcp__.x"])
def test_a_key_in_the_component_namespace_is_refused_naming_it(tmp_path, door, key):
    """Component items are named ``<key>.__qdcp__.<component>`` (docs/format.md): a state-dict key
    of that form beside a quantized entry collided with its item (a bare AssertionError inside
    DCP), and alone would be read back as a component; refused at planning, nothing written."""
    import os

    import torch.distributed.checkpoint as dcp

    import qdcp
    from qdcp import ReservedKeyError
    from quantized_cases import raise_inner

    state = {"w": CASE_BY_NAME["int8_row"].make(0), key: torch.ones(2)}
    path = tmp_path / "ckpt"
    calls = {"qdcp.save": lambda: qdcp.save(state, path),
             "dcp.save": lambda: dcp.save(state, checkpoint_id=path, planner=QuantizedSavePlanner()),
             "dcp.async_save": lambda: dcp.async_save(state, checkpoint_id=path,
                                                      planner=QuantizedSavePlanner()).result()}
    with pytest.raises(ReservedKeyError, match=rf"key '{key}'.*'\.__qdcp__\.'.*Rename that key"):
        raise_inner(calls[door])
    assert not os.path.exists(path / ".metadata")
