"""The load side by component: which action each target key gets (qdcp.planning.key_plans), what each
action reads and how it finishes (qdcp.planning.actions), from a checkpoint's metadata alone."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torchao.prototype.mx_formats.mx_tensor import MXTensor

import rule_oracle
from qdcp.adapters import find_adapter
from qdcp.planning.actions import FromPlain, InPlace, IntoPlain, RawCopy, Reblock, Requantize
from qdcp.planning.key_plans import KeyPlanner
from quantized_cases import CASE_BY_NAME, SHAPE, bits_diff, components_diff, qdcp_load, qdcp_save

INT8, INT8_GROUP = CASE_BY_NAME["int8_row"], CASE_BY_NAME["int8_group32"]
FLOAT8 = CASE_BY_NAME["float8_row"]


@pytest.fixture
def checkpoint(tmp_path):
    """A raw Int8 entry, a dequantized one and a plain tensor; the sources, and its metadata."""
    import torch.distributed.checkpoint as dcp

    from qdcp import QuantizedSavePlanner

    src = {"raw": INT8.make(0), "deq": INT8.make(1), "plain": torch.randn(SHAPE, dtype=torch.bfloat16)}
    path = str(tmp_path / "ckpt")
    dcp.save(src, checkpoint_id=path, planner=QuantizedSavePlanner(dequantize=lambda fqn, t: fqn == "deq"),
             no_dist=True)
    return src, FileSystemReader(path).read_metadata()


def _action(md, fqn, target):
    plan = KeyPlanner(md, allow_partial_load=False).plan_key(fqn, target)
    assert plan is not None and len(plan.actions) == 1 and not plan.to_dcp
    return plan.actions[0]


def test_each_way_of_loading_is_its_own_action(checkpoint):
    _, md = checkpoint
    same = INT8.make(5)
    assert isinstance(_action(md, "raw", same), InPlace)
    # per-group targets of a per-row entry: their blocks lie inside the source's (docs/api.md's rule)
    assert isinstance(_action(md, "raw", INT8_GROUP.make(5)), Reblock)
    assert isinstance(_action(md, "raw", FLOAT8.make(5)), Requantize)
    assert isinstance(_action(md, "raw", torch.zeros(SHAPE, dtype=torch.float32)), IntoPlain)
    assert isinstance(_action(md, "plain", INT8.make(5)), FromPlain)
    assert isinstance(_action(md, "deq", INT8.make(5)), FromPlain)  # a dequantized entry is plain
    # plain into plain is DCP's own path
    assert KeyPlanner(md, allow_partial_load=False).plan_key("plain", torch.zeros(SHAPE)) is None


def test_in_place_reads_straight_into_the_targets_buffers(checkpoint):
    _, md = checkpoint
    target = INT8.make(5)
    action = _action(md, "raw", target)
    native = find_adapter(target).native_components(target)
    assert {r.stored for r in action.reads} == {f"raw.__qdcp__.{n}" for n in native}
    assert all(r.component is None for r in action.reads)  # no temporaries: the native buffers
    assert {r.buffer.data_ptr() for r in action.reads} == {t.data_ptr() for t in native.values()}


def test_finish_turns_what_was_read_into_the_targets_values(checkpoint):
    """Fill each action's reads from the stored tensors by hand, then finish: the same result
    dcp.load gives (the library's own dequantize / quantize)."""
    src, md = checkpoint
    comps = {f"raw.__qdcp__.{n}": c for n, c in find_adapter(src["raw"]).components(src["raw"]).items()}
    for target, want in ((torch.zeros(SHAPE, dtype=torch.float32), src["raw"].dequantize(torch.float32)),
                         (FLOAT8.make(5), FLOAT8.from_hp(src["raw"].dequantize())),
                         (INT8_GROUP.make(5), None)):
        action = _action(md, "raw", target)
        for r in action.reads:
            r.buffer.copy_(comps[r.stored][tuple(slice(o, o + n) for o, n in zip(*r.chunk))])
        action.finish()
        if want is None:  # per-group blocks inside the per-row source's: the source's codes and scales
            assert rule_oracle.maps_equal(rule_oracle.element_maps(target), rule_oracle.element_maps(src["raw"]))
            continue
        diff = bits_diff(target, want) if type(want) is torch.Tensor else components_diff(target, want)
        assert diff is None, diff


def test_raw_copy_across_families_reads_only_the_bits_it_needs(tmp_path):
    """torchao MXTensor stored, TE-free: an MXTensor target of the same format but swizzled
    scales is another config, filled raw through the mxfp8 form (no requantization)."""
    hp = torch.randn(SHAPE, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    src = MXTensor.to_mx(hp, torch.float8_e4m3fn, 32)
    path = qdcp_save(str(tmp_path / "mx"), {"w": src}, no_dist=True)
    md = FileSystemReader(path).read_metadata()
    target = MXTensor.to_mx(torch.zeros_like(hp), torch.float8_e4m3fn, 32, is_swizzled_scales=True)
    action = _action(md, "w", target)
    assert isinstance(action, RawCopy) and action.conversion.form == "mxfp8_e4m3_row32"
    assert {r.stored for r in action.reads} == {"w.__qdcp__.qdata", "w.__qdcp__.scale"}
    qdcp_load(path, {"w": target})
    assert bits_diff(target.dequantize(torch.bfloat16), src.dequantize(torch.bfloat16)) is None
