"""TE GroupedTensor / GroupedTensorStorage (MoE experts), on TE's real classes on CPU.

Groups come from ``te_groups`` (TE's own ``make_grouped_tensor_with_shapes``, buffers filled with
deterministic values, padding with garbage unless ``clean``). Multi-process expert parallelism is in
``test_te_grouped_distributed.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import te_cpu

if not te_cpu.te_installed():
    pytest.skip("transformer_engine is not installed", allow_module_level=True)
te_cpu.install()  # before anything imports transformer_engine
warnings.filterwarnings("ignore", message=".*Transformer Engine PyTorch extension.*")

from transformer_engine.pytorch.tensor.grouped_tensor import GroupedTensor  # noqa: E402
from transformer_engine.pytorch.tensor.storage.grouped_tensor_storage import GroupedTensorStorage  # noqa: E402

import qdcp  # noqa: E402
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner, UnsupportedTensorError  # noqa: E402
from qdcp.adapters import find_adapter, te_grouped  # noqa: E402
from quantized_cases import bits, qdcp_load, qdcp_save  # noqa: E402
from te_groups import BY, CASES, SHAPES, VARY_FIRST, Case, assert_same_flat, flat, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("hopper")


_save, _load = qdcp_save, qdcp_load


def _case_shape_params():
    out = []
    for c in CASES:
        for s in SHAPES:
            if c.name == "nvfp4_row_scaled" and s != "uniform":
                continue
            out.append(pytest.param(c, s, id=f"{c.name}-{s}"))
    return out


# ----------------------------------------------------------------------------- identity

def test_grouped_classes_are_recognised_and_te_is_not_imported_by_qdcp():
    a = find_adapter(GroupedTensor)
    assert a is find_adapter(GroupedTensorStorage) and a.type_names == ("transformer_engine.GroupedTensor",)
    assert "transformer_engine.GroupedTensor" in qdcp.registered_type_names()
    assert "transformer_engine" not in te_grouped.__dict__


def test_spec_records_the_group():
    g = BY["mxfp8_rowwise_swizzled"].build(0)
    a = find_adapter(g)
    assert a.attributes(g) == {"recipe": "mxfp8", "layout": "stacked", "uniform_first_dim": True,
                               "uniform_last_dim": True, "swizzled": True, "member_shape": [128, 256],
                               "member": {"fp8_dtype": "e4m3"}}
    v = BY["block1_both"].build(0, VARY_FIRST)
    attrs = a.attributes(v)
    assert attrs["layout"] == "members" and attrs["num_tensors"] == 3 and not attrs["uniform_first_dim"]
    assert attrs["member_shapes"] == [list(s) for s in VARY_FIRST] and attrs["logical_shape"] == [448, 256]
    assert attrs["member"] == {"fp8_dtype": "e4m3", "block_scaling_dim": 1}
    lay = a.layouts(g)
    assert lay["rowwise_data"].to_json() == {"kind": "blocked", "block": [1, 1, 1]}
    assert lay["rowwise_scale_inv"].to_json() == {"kind": "blocked", "block": [1, 1, 32]}
    f8 = BY["current_both_hopper"].build(0)
    assert {k: tuple(v.shape) for k, v in a.components(f8).items()} == {
        "data": (4, 128, 256), "scale_inv": (4, 1, 1), "amax": (4, 1, 1), "scale": (4, 1, 1)}
    assert a.layouts(f8)["scale_inv"].to_json() == {"kind": "blocked", "block": [1, 0, 0]}


# ----------------------------------------------------------------------------- save / load

@pytest.mark.parametrize("case,shape", _case_shape_params())
def test_raw_into_same_layout_is_bit_identical_in_place(tmp_path, case, shape):
    src = case.build(0, SHAPES[shape], clean=True)
    canon = find_adapter(src).components(src)
    path = _save(tmp_path / "c", {"w": src, "step": 1})
    info = qdcp.describe(path)["w"]
    assert info["bytes"] == sum(t.numel() * t.element_size() for t in canon.values())  # no padding stored
    dst = case.build(1, SHAPES[shape])  # garbage padding
    ptrs = {n: b.data_ptr() for n, b in flat(dst).items()}
    state = _load(path, {"w": dst, "step": 0})
    assert state["w"] is dst and state["step"] == 1
    assert {n: b.data_ptr() for n, b in flat(dst).items()} == ptrs
    assert_same_flat(dst, src)  # offsets and per-member padding rebuilt


@pytest.mark.parametrize("case,shape", _case_shape_params())
def test_into_plain_of_the_logical_shape_equals_members_dequantize(tmp_path, case, shape):
    src = case.build(0, SHAPES[shape])
    a = find_adapter(src)
    path = _save(tmp_path / "c", {"raw": src, "deq": src}, dequantize=lambda fqn, t: fqn == "deq")
    ref = reference(src)
    assert torch.equal(bits(a.dequantize(src)), bits(ref))
    if case.te_dq:  # qdcp's reference == TE's own member dequantize on CPU
        te_ref = [m.dequantize() for m in a.members(src)]
        assert all(torch.equal(bits(x), bits(find_adapter(m).dequantize(m)))
                   for x, m in zip(te_ref, a.members(src)))
    target = torch.zeros(a._logical_shape(src), dtype=torch.bfloat16)
    _load(path, {"raw": target})
    assert torch.equal(bits(target), bits(ref))
    plain = torch.zeros_like(target)
    dcp.load({"deq": plain}, checkpoint_id=path)  # dequantized mode: vanilla DCP reads it
    assert torch.equal(bits(plain), bits(ref))


def test_swizzle_and_float8_recipe_are_layout_details(tmp_path):
    src = BY["mxfp8_both"].build(0, clean=True)
    path = _save(tmp_path / "m", {"w": src})
    sw = Case("x", "mxfp8", (("swizzled", True),)).build(1)
    _load(path, {"w": sw})  # raw copy, re-swizzled per member
    a = find_adapter(sw)
    ca, cb = a.components(sw), a.components(src)
    assert all(torch.equal(bits(ca[n]), bits(cb[n])) for n in ca)
    assert not torch.equal(sw.scale_inv, src.scale_inv)
    # delayed (amax, separate columnwise scale_inv) <-> current scaling (amax, scale, shared scale_inv)
    d = Case("d", "delayed").build(2, clean=True)
    path = _save(tmp_path / "d", {"w": d})
    c = BY["current_both_hopper"].build(3)
    scale_before = c.scale.clone()
    _load(path, {"w": c})
    assert torch.equal(c.rowwise_data, d.rowwise_data) and torch.equal(c.columnwise_data, d.columnwise_data)
    assert torch.equal(c.scale_inv, d.scale_inv) and torch.equal(c.amax, d.amax)
    assert torch.equal(c.scale, scale_before)  # not in a delayed checkpoint: left alone
    path = _save(tmp_path / "c", {"w": c})
    d2 = Case("d", "delayed").build(4)
    _load(path, {"w": d2})
    assert torch.equal(d2.scale_inv, c.scale_inv) and torch.equal(d2.columnwise_scale_inv, c.scale_inv)


def _error(info) -> BaseException:
    err = info.value
    if getattr(err, "failures", None):
        err = next(iter(err.failures.values()))[0]
    return err


def test_other_format_is_a_clear_error_at_planning(tmp_path):
    path = _save(tmp_path / "c", {"w": BY["mxfp8_both"].build(0)})
    target = BY["block2_both"].build(1)
    before = {n: b.clone() for n, b in flat(target).items()}
    with pytest.raises(BaseException) as info:
        _load(path, {"w": target})
    err = _error(info)
    assert isinstance(err, UnsupportedTensorError) and "qdcp does not quantize into a TransformerEngine" in str(err)
    assert "key 'w'" in str(err) and "transformer_engine.GroupedTensor entry" in str(err)
    assert all(torch.equal(b, flat(target)[n]) for n, b in before.items())  # refused before reading


def test_grouped_tensor_storage_through_a_grouped_tensor_view(tmp_path):
    """quantizer.internal gives a GroupedTensorStorage (not a tensor): wrap it to checkpoint it."""
    case = BY["nvfp4_both"]
    src = case.build(0, clean=True, internal=True)
    assert type(src) is GroupedTensorStorage
    path = _save(tmp_path / "c", {"w": te_grouped.grouped_tensor_view(src)})
    dst = case.build(1, internal=True)
    _load(path, {"w": te_grouped.grouped_tensor_view(dst)})
    assert_same_flat(dst, src)


# ----------------------------------------------------------------------------- expert parallelism

@pytest.fixture
def fake_rank1_of_2():
    """A 2-rank mesh seen from rank 1, in this process (no collectives: dcp.load(no_dist=True))."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _shard0(local, mesh, global_shape):
    from torch.distributed.tensor import Shard

    from dist_helpers import dtensor_from_local

    # DTensor.from_local calls view_as, which GroupedTensor forbids
    return dtensor_from_local(local, mesh, (Shard(0),), global_shape, torch.bfloat16)


@pytest.mark.parametrize("name", ["mxfp8_both", "current_both_hopper", "nvfp4_both", "block1_both"])
def test_eight_experts_from_one_rank_load_as_rank1_of_2x4(tmp_path, fake_rank1_of_2, name):
    case = BY[name]
    src = case.build(0, [(128, 256)] * 8, clean=True)
    path = _save(tmp_path / "c", {"w": src}, no_dist=True)
    ref = reference(src)
    # plain DTensor [8, M, N] sharded on dim 0: this rank's 4 experts
    local = torch.zeros(4, 128, 256, dtype=torch.bfloat16)
    dcp.load({"w": _shard0(local, fake_rank1_of_2, (8, 128, 256))}, checkpoint_id=path,
             planner=QuantizedLoadPlanner(), no_dist=True)
    assert torch.equal(bits(local), bits(ref[4:]))
    # a 4-expert GroupedTensor as the local shard: raw, bit-identical to experts 4..7
    g4 = case.build(1, [(128, 256)] * 4)
    dcp.load({"w": _shard0(g4, fake_rank1_of_2, (8, 128, 256))}, checkpoint_id=path,
             planner=QuantizedLoadPlanner(), no_dist=True)
    a = find_adapter(g4)
    for (n, c4), c8 in zip(a.components(g4).items(), a.components(src).values()):
        assert torch.equal(bits(c4), bits(c8[4:])), n
    src_hi = find_adapter(src).members(src)[4:]
    for m4, m8 in zip(a.members(g4), src_hi):
        for n in m4.__tensor_flatten__()[0]:
            assert torch.equal(bits(getattr(m4, n)), bits(getattr(m8, n))), n
    # saving rank 1's experts back as its shard of [8, M, N] needs rank 0 too (a checkpoint with
    # half the chunks is refused): a real 2-process run, tests/test_te_grouped_distributed.py


def test_member_keys_into_a_group_sharded_within_experts_are_refused(tmp_path, fake_rank1_of_2):
    """Per-member entries fill whole local members; a group target split inside experts cannot."""
    case = BY["bf16"]
    src = case.build(0, [(128, 256)] * 2)
    path = _save(tmp_path / "m", {f"w{i}": m for i, m in enumerate(find_adapter(src).members(src))},
                 no_dist=True)
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    local = torch.zeros(2, 64, 256, dtype=torch.bfloat16)
    spec = DTensorSpec(fake_rank1_of_2, (Shard(1),), TensorMeta(torch.Size((2, 128, 256)),
                                                                (128 * 256, 256, 1), torch.bfloat16))
    with pytest.raises(BaseException) as info:
        dcp.load({"w": DTensor(local, spec, requires_grad=False)}, checkpoint_id=path,
                 planner=QuantizedLoadPlanner(), no_dist=True)
    err = _error(info)
    assert isinstance(err, qdcp.LoadMismatchError) and "key 'w'" in str(err) and "whole members" in str(err)


def test_per_expert_scales_of_shards_inside_experts_must_agree(fake_rank1_of_2):
    """Shards that cut experts' rows each hold the experts' per-tensor scales (``blocked [1, 0, 0]``):
    DCP writes one copy, so two ranks holding different values fail the save naming the key."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    case = BY["current_both_hopper"]
    spec = DTensorSpec(fake_rank1_of_2, (Shard(1),), TensorMeta(torch.Size((4, 128, 256)),
                                                                (128 * 256, 256, 1), torch.bfloat16))

    def local_plan(g):
        planner = QuantizedSavePlanner()
        planner.set_up_planner({"w": DTensor(g, spec, requires_grad=False)}, is_coordinator=True)
        return planner, planner.create_local_plan()

    a, b = case.build(0, [(64, 256)] * 4), case.build(1, [(64, 256)] * 4)
    planner, plan_a = local_plan(a)
    with pytest.raises(qdcp.AlignmentError, match=r"key 'w': component 'scale_inv' holds values shared"):
        planner.create_global_plan([plan_a, local_plan(b)[1]])
    b.scale_inv.copy_(a.scale_inv)  # the same scales (quantized with the whole experts' amax): fine
    b.amax.copy_(a.amax)
    b.scale.copy_(a.scale)
    planner, plan_a = local_plan(a)
    # the scales pass; DCP then sees both plans cover rank 1's rows only (this process is rank 1)
    with pytest.raises(ValueError, match="invalid fill|Failed to validate global plan"):  # torch 2.13 | 2.11
        planner.create_global_plan([plan_a, local_plan(b)[1]])


# ----------------------------------------------------------------------------- per-member keys

def test_one_member_of_a_group_raw_into_a_single_te_tensor():
    """The adapter half of ``weight`` -> ``weight{i}``: the chunk [i:i+1] of the stored components."""
    for name in ("mxfp8_both", "current_both_hopper", "block2_both", "nvfp4_both"):
        src = BY[name].build(0, clean=True)
        a = find_adapter(src)
        attrs = a.attributes(src)
        comps = a.components(src)
        member = a.members(BY[name].build(1, [(128, 256)]))[0]  # a lone TE tensor of the member type
        names = a.raw_load_sources(member, te_grouped.TYPE_NAME, attrs)
        assert names is not None, name
        a.raw_load(member, te_grouped.TYPE_NAME, attrs, {n: comps[n][2:3] for n in names})
        ref = a.members(src)[2]
        single = find_adapter(member)
        cm, cr = single.components(member), single.components(ref)
        assert all(torch.equal(bits(cm[n]), bits(cr[n])) for n in cr), name


@pytest.mark.parametrize("name", ["mxfp8_both", "current_both_hopper", "nvfp4_both", "bf16"])
def test_per_member_keys_and_grouped_weight_both_ways(tmp_path, name):
    case = BY[name]
    src = case.build(0, clean=True)
    a = find_adapter(src)
    path = _save(tmp_path / "g", {"layer.weight": src})
    # grouped checkpoint -> weight0..3 (TE's single_grouped_weight=False), raw and bit-exact
    targets = a.members(case.build(1))
    _load(path, {f"layer.weight{i}": t for i, t in enumerate(targets)})
    for t, ref in zip(targets, a.members(src)):
        assert torch.equal(bits(t), bits(ref)) if name == "bf16" else all(
            torch.equal(bits(x), bits(y)) for x, y in zip(find_adapter(t).components(t).values(),
                                                        find_adapter(ref).components(ref).values()))
    plains = [torch.zeros(128, 256, dtype=torch.bfloat16) for _ in range(4)]
    _load(path, {f"layer.weight{i}": t for i, t in enumerate(plains)})
    assert torch.equal(bits(torch.stack(plains)), bits(reference(src)))
    # a group saved dequantized (one plain [n, M, N] tensor) -> plain weight0..3
    path_dq = _save(tmp_path / "dq", {"layer.weight": src}, dequantize=True)
    plains = [torch.zeros(128, 256, dtype=torch.bfloat16) for _ in range(4)]
    _load(path_dq, {f"layer.weight{i}": t for i, t in enumerate(plains)})
    assert torch.equal(bits(torch.stack(plains)), bits(reference(src)))
    # per-member checkpoint -> grouped weight, in place into the flat buffers
    path2 = _save(tmp_path / "m", {f"layer.weight{i}": m for i, m in enumerate(a.members(src))})
    dst = case.build(2)
    _load(path2, {"layer.weight": dst})
    assert_same_flat(dst, src) if name != "current_both_hopper" else None
    for x, y in zip(a.components(dst).items(), a.components(src).items()):
        if x[0] not in ("amax", "scale"):  # group-only buffers: not in per-member entries
            assert torch.equal(bits(x[1]), bits(y[1])), x[0]


# ----------------------------------------------------------------------------- staging and offload

def test_stager_copies_the_flat_buffers_once(tmp_path):
    src = BY["mxfp8_both"].build(0, clean=True)
    a = find_adapter(src)
    bufs = a.inner_buffers(src)
    assert set(bufs) == {"rowwise_data", "columnwise_data", "scale_inv", "columnwise_scale_inv"}
    assert all(b.ndim == 1 for b in bufs.values())  # flat buffers, not member views
    stager = qdcp.QuantizedStager(busy_timeout=5)
    try:
        staged = stager.stage({"w": src})
        w = staged["w"]
        assert type(w) is GroupedTensor and w is not src
        assert stager.staged_nbytes == sum(b.numel() * b.element_size() for b in bufs.values())
        for n, b in a.inner_buffers(w).items():
            assert b.data_ptr() != bufs[n].data_ptr() and torch.equal(b, bufs[n])
        src.rowwise_data.zero_()  # training goes on: the staged copy keeps the old bits
        assert not torch.equal(w.rowwise_data, src.rowwise_data)
        path = _save(tmp_path / "a", {"w": w})
        dst = BY["mxfp8_both"].build(1)
        _load(path, {"w": dst})
        assert_same_flat(dst, w)
        del staged, w
        # current scaling shares one scale_inv between directions: staged once, still shared
        cs = BY["current_both_hopper"].build(0)
        staged = stager.stage({"c": cs})
        assert "columnwise_scale_inv" not in a.inner_buffers(cs)
        assert staged["c"].columnwise_scale_inv is staged["c"].scale_inv
        del staged
    finally:
        stager.close()


def test_async_save_with_the_stager_equals_sync_save(tmp_path):
    src = BY["nvfp4_both"].build(0, shapes=VARY_FIRST, clean=True)
    stager = qdcp.QuantizedStager()
    try:
        fut = dcp.async_save({"w": src}, checkpoint_id=tmp_path / "a", planner=QuantizedSavePlanner(),
                             async_stager=stager)
        fut.result()
    finally:
        stager.close()
    dst = BY["nvfp4_both"].build(1, shapes=VARY_FIRST)
    _load(tmp_path / "a", {"w": dst})
    assert_same_flat(dst, src)


def test_to_device_moves_every_buffer_and_keeps_the_parameter():
    src = BY["block2_both"].build(0, VARY_FIRST)
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(src, requires_grad=False)
    p = m.w
    qdcp.to_device(m, "meta")
    assert m.w is p and m.w.device.type == "meta" and isinstance(m.w, GroupedTensor)
    assert {b.device.type for b in find_adapter(m.w).inner_buffers(m.w).values()} == {"meta"}
    assert m.w.tensor_offsets.device.type == "meta" and m.w.first_dims.device.type == "meta"
    assert all(mem._rowwise_data.device.type == "meta" for mem in m.w.quantized_tensors)
    # a copy keeps every bit (and the storage class)
    st = BY["mxfp8_both"].build(0, internal=True)
    moved = qdcp.staging.offload.tensor_to_device(st, "cpu")
    assert type(moved) is GroupedTensorStorage
    assert_same_flat(moved, st)
