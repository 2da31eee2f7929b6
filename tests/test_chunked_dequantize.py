"""A raw entry loaded into a plain target is dequantized a block of rows at a time
(``qdcp.planning.rows.DEQUANTIZE_ELEMENTS`` logical elements, rounded up to whole blocks): the
target gets, bit for bit, what the library's own ``dequantize()`` of the whole tensor gives
(docs/api.md: "a plain target always gets the source's ``dequantize()``, bitwise"), and a wider
target (or ``dequantize_dtype``) what the whole chunk computed at once gives, whatever the block
size. Every family qdcp covers on CPU, through ``qdcp.load`` and ``dcp.load`` with the planner, and
``qdcp.save(..., dequantize=True)`` read back by ``dcp.load``. (The generated rule cases,
tests/rule_cases.py, dequantize by rows in about half their loads, at every sharding.)
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings

import dcp_in_process as job
import qdcp
import rule_cases
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner
from qdcp.adapters import rows
from qdcp.adapters.base import find_adapter, register_adapter
from qdcp.errors import QdcpError, UnsupportedTensorError
from quantized_cases import CASES, bits_diff

_WHOLE = 1 << 40  # more elements than any test tensor: one piece


def _rows_per_block(path) -> int:
    """The fewest rows a piece can hold: every component's blocks whole, from the layouts the
    checkpoint records (docs/format.md: a blocked layout's block, a flat one's groups of elements)."""
    entry = qdcp.describe(path)["w"]
    cols = math.prod(entry["shape"][1:])
    rows = 1
    for component in entry["components"].values():
        layout = component["layout"]
        if layout["kind"] == "blocked":
            rows = math.lcm(rows, layout["block"][0] or 1)
        elif layout["kind"] == "flat":
            rows = math.lcm(rows, layout["group"] // math.gcd(layout["group"], cols))
    return rows


def _load(path, target: torch.Tensor, how: str) -> torch.Tensor:
    state = {"w": target}
    if how == "qdcp.load":
        qdcp.load(state, path)
    else:
        dcp.load(state, checkpoint_id=path, planner=QuantizedLoadPlanner())
    assert state["w"] is target
    return target


def _pieces_asked_for(monkeypatch, src: torch.Tensor) -> list:
    """The shapes of the chunks ``src``'s adapter is asked to dequantize from stored components
    (``dequantize_stored``) with data, as they are asked for (the load's check of each entry on
    the meta device reads nothing: not counted)."""
    adapter = type(find_adapter(src))
    pieces, real = [], adapter.dequantize_stored

    def counting(self, stored, dtype=None):
        if not any(c.is_meta for c in stored.components.values()):
            pieces.append(tuple(stored.shape))
        return real(self, stored, dtype)

    monkeypatch.setattr(adapter, "dequantize_stored", counting)
    return pieces


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every CPU case saved raw, one checkpoint each."""
    root = tmp_path_factory.mktemp("dequant")
    out = {}
    for case in CASES:
        src = case.make(11)
        qdcp.save({"w": src}, root / case.name)
        out[case.name] = (root / case.name, src)
    return out


@pytest.mark.parametrize("how", ["qdcp.load", "dcp.load"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_dequantized_by_rows_the_values_are_the_whole_tensors(saved, monkeypatch, case, how):
    path, src = saved[case.name]
    pieces = _pieces_asked_for(monkeypatch, src)
    wider = torch.float64 if case.dtype == torch.float32 else torch.float32
    got = {}
    for elements in (_WHOLE, 1, 3000):
        monkeypatch.setattr(rows, "DEQUANTIZE_ELEMENTS", elements)
        pieces.clear()
        got[elements] = {dtype: _load(path, torch.full(src.shape, float("nan"), dtype=dtype), how)
                         for dtype in (case.dtype, wider)}
        if elements == _WHOLE:
            assert pieces == [tuple(src.shape)] * 2, pieces
        elif elements == 1:  # a block of rows at a time (where a block spans fewer rows than all)
            step = _rows_per_block(path)
            assert pieces == [(min(step, src.shape[0] - r), *src.shape[1:])
                              for _ in range(2) for r in range(0, src.shape[0], step)], pieces
    # the library's own dequantize() of the whole tensor, bitwise, in the logical dtype
    want = case.dequantize(src)
    for elements, values in got.items():
        assert bits_diff(values[case.dtype], want) is None, (elements, bits_diff(values[case.dtype], want))
        assert bits_diff(values[wider], got[_WHOLE][wider]) is None, (elements, bits_diff(values[wider],
                                                                                         got[_WHOLE][wider]))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_saved_dequantized_by_rows_the_values_are_the_whole_tensors(tmp_path, monkeypatch, case):
    src = case.make(12)
    pieces = _pieces_asked_for(monkeypatch, src)
    wider = torch.float64 if case.dtype == torch.float32 else torch.float32
    qdcp.save({"w": src}, tmp_path / "raw")  # the layouts the format records, for the expected pieces
    step = _rows_per_block(tmp_path / "raw")
    got = {}
    for elements in (_WHOLE, 1, 3000):
        monkeypatch.setattr(rows, "DEQUANTIZE_ELEMENTS", elements)
        got[elements] = {}
        for dtype in (None, wider):
            path = tmp_path / f"{elements}-{dtype}"
            pieces.clear()
            qdcp.save({"w": src}, path, dequantize=True) if dtype is None else \
                dcp.save({"w": src}, checkpoint_id=path, planner=QuantizedSavePlanner(dequantize=True,
                                                                                   dequantize_dtype=dtype))
            if elements == 1 and step < src.shape[0]:
                assert pieces == [(min(step, src.shape[0] - r), *src.shape[1:])
                                  for r in range(0, src.shape[0], step)], pieces
            elif elements != 3000:  # one piece: the live tensor's own dequantize()
                assert pieces == [], pieces
            out = {"w": torch.full(src.shape, float("nan"), dtype=dtype or case.dtype)}
            dcp.load(out, checkpoint_id=path)
            got[elements][dtype] = out["w"]
    want = case.dequantize(src)
    for elements, values in got.items():
        assert bits_diff(values[None], want) is None, (elements, bits_diff(values[None], want))
        assert bits_diff(values[wider], got[_WHOLE][wider]) is None, (elements, bits_diff(values[wider],
                                                                                         got[_WHOLE][wider]))


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(rule_cases.case_strategy())
def test_n_ranks_save_dequantized_by_rows_the_whole_shards_values(drawn):
    """Generated sources (tests/rule_cases.py: every family, 1-8 ranks, every layout, shards cut by
    torchao's slicing or quantized on their own), saved ``dequantize=True`` with single blocks of
    rows: every stored chunk is bitwise the one the whole-tensor computation stores."""
    name, rows_, cols, seed, layout, sliced, _ = drawn
    source = rule_cases.make_source(name, (rows_, cols), seed, layout, sliced and rule_cases.FAMILIES[name][0])
    if source is None:
        return

    def save(elements: int):
        before = rows.DEQUANTIZE_ELEMENTS
        rows.DEQUANTIZE_ELEMENTS = elements
        try:
            with rule_cases.rule_te.context():
                return job.save(lambda r: rule_cases.placed_state(layout, source.locals[r][1], source.shape),
                                layout.world, lambda: QuantizedSavePlanner(dequantize=True))
        finally:
            rows.DEQUANTIZE_ELEMENTS = before

    try:
        _, whole = save(_WHOLE)
    except QdcpError as e:  # refused (shards of different configs): refused alike by rows
        with pytest.raises(type(e)):
            save(1)
        return
    _, by_rows = save(1)
    assert by_rows.keys() == whole.keys()
    for key, value in whole.items():
        if isinstance(value, torch.Tensor):
            assert bits_diff(by_rows[key], value) is None, (key, bits_diff(by_rows[key], value))
        else:
            assert by_rows[key] == value, key


def test_a_tensor_a_spec_cannot_describe_is_saved_dequantized_whole(tmp_path, monkeypatch):
    """``dequantize=True`` is the way to save a tensor whose attributes no spec can hold: there it
    is dequantized whole, by its adapter, as before (a raw save of it is refused naming the key)."""
    case = next(c for c in CASES if c.name == "int8_row")
    original = find_adapter(case.make(0))

    class Opaque(type(original)):
        def attributes(self, t):
            return {**super().attributes(t), "recipe": object()}  # no spec encodes it

    register_adapter(Opaque(), override=True)
    try:
        monkeypatch.setattr(rows, "DEQUANTIZE_ELEMENTS", 1)
        src = case.make(13)
        with pytest.raises(UnsupportedTensorError, match="'w'"):
            qdcp.save({"w": src}, tmp_path / "raw")
        qdcp.save({"w": src}, tmp_path / "dq", dequantize=True)
        out = {"w": torch.full(src.shape, float("nan"), dtype=case.dtype)}
        dcp.load(out, checkpoint_id=tmp_path / "dq")
        assert bits_diff(out["w"], case.dequantize(src)) is None
        again = {"w": torch.full(src.shape, float("nan"), dtype=case.dtype)}
        qdcp.load(again, tmp_path / "dq")  # qdcp's reader and its checks too
        assert bits_diff(again["w"], case.dequantize(src)) is None
    finally:
        register_adapter(original, override=True)
