"""The save planner by component: the items and spec it plans for each entry, without writing."""
from __future__ import annotations

import pytest
import torch

from qdcp import QuantizedSavePlanner
from qdcp import spec as qspec
from qdcp.adapters import find_adapter
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
