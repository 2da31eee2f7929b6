"""Values held once per tensor (docs/api.md, *Per tensor*): torchao's per-tensor Int8 / Float8 scale, NF4's
scaler mean. Every rank of a job is planned in this process (tests/dcp_in_process.py) through qdcp's real
planners; each case is checked against torchao's own quantization and slicing.

- a per-tensor tensor cut by torchao's slicing at uneven FSDP2 cuts saves, its scale stored once;
- per-tensor shards quantized each on its own are refused at save naming the key, even at even cuts;
- a target quantized like itself takes a per-tensor value from the whole tensor: torchao's quantization of
  the whole tensor, cut as FSDP2 cuts it;
- an Intx target with a float32 scale is quantized as torchao's ``IntxWeightOnlyConfig(scale_dtype=...)`` does.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard
from torchao.quantization import (
    Float8Tensor,
    Int8Tensor,
    IntxWeightOnlyConfig,
    PerGroup,
    PerRow,
    PerTensor,
    quantize_,
    to_nf4,
)

import dcp_in_process as job
import rule_cases as rc
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner
from qdcp.errors import AlignmentError
from quantized_cases import components_diff


def _fsdp2(world: int) -> rc.Layout:
    return rc.Layout((world,), (Shard(0),))


def _chunks(shape, world: int) -> list:
    return [rc.rank_chunk(_fsdp2(world), shape, r) for r in range(world)]


def _rows(t: torch.Tensor, chunk) -> torch.Tensor:
    (r, _), (n, _) = chunk
    return t[r:r + n]


def _hp(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.logspace(-2, 1, shape[0])[:, None]).to(torch.bfloat16)


def _save(locals_: list, shape, dequantize: bool = False):
    world = len(locals_)
    if world == 1 and not isinstance(locals_[0], tuple):
        return job.save(lambda r: {"w": locals_[0]}, 1, lambda: QuantizedSavePlanner(dequantize=dequantize))
    return job.save(lambda r: rc.placed_state(_fsdp2(world), locals_[r], shape), world,
                    lambda: QuantizedSavePlanner(dequantize=dequantize))


def _load(saved, targets: list, shape) -> None:
    metadata, store = saved
    world = len(targets)
    for r, target in enumerate(targets):
        with job.as_rank(r, world):
            job.load(rc.placed_state(_fsdp2(world), target, shape), r, world, metadata, store, QuantizedLoadPlanner())


def _per_tensor(kind: str, hp: torch.Tensor) -> torch.Tensor:
    return Int8Tensor.from_hp(hp, PerTensor()) if kind == "int8" else Float8Tensor.from_hp(hp, granularity=PerTensor())


@pytest.mark.parametrize("kind, shape", [("int8", (10, 16)), ("float8", (40, 66))])
def test_per_tensor_sliced_at_uneven_cuts_saves_its_one_scale_once(kind, shape):
    whole = _per_tensor(kind, _hp(shape, 1))
    saved = _save([_rows(whole, c) for c in _chunks(shape, 3)], shape)
    metadata, _ = saved
    scale = metadata.state_dict_metadata["w.__qdcp__.scale"]
    assert tuple(scale.size) == (1, 1) and len(scale.chunks) == 1
    assert '"block_size":[%d,%d]' % shape in metadata.planner_data["__qdcp__"]
    plain = [torch.zeros(c[1], dtype=torch.bfloat16) for c in _chunks(shape, 2)]
    _load(saved, plain, shape)
    assert all(torch.equal(p, _rows(whole.dequantize(), c)) for p, c in zip(plain, _chunks(shape, 2)))
    targets = [_rows(_per_tensor(kind, _hp(shape, 2)), c) for c in _chunks(shape, 2)]  # one whole each
    _load(saved, targets, shape)
    for target, c in zip(targets, _chunks(shape, 2)):
        assert components_diff(target, _rows(whole, c)) is None  # the source's bits


@pytest.mark.parametrize("kind", ["int8", "float8"])
@pytest.mark.parametrize("world", [2, 3])
def test_per_tensor_shards_quantized_each_on_its_own_are_refused_naming_the_key(kind, world):
    shape = (8, 58) if world == 2 else (10, 58)
    hp = _hp(shape, 3)
    with pytest.raises(AlignmentError, match="key 'w': component 'scale'"):
        _save([_per_tensor(kind, _rows(hp, c).contiguous()) for c in _chunks(shape, world)], shape)


def test_per_tensor_targets_take_the_whole_tensors_scale():
    """Float8 per-row saved from one process into Float8 per-tensor targets at FSDP2 x3."""
    shape = (12, 16)
    source = Float8Tensor.from_hp(_hp(shape, 4), granularity=PerRow())
    saved = _save([source], shape)
    want = Float8Tensor.from_hp(source.dequantize(), granularity=PerTensor())
    targets = [_rows(_per_tensor("float8", _hp(shape, 5)), c) for c in _chunks(shape, 3)]
    _load(saved, targets, shape)
    for target, c in zip(targets, _chunks(shape, 3)):
        assert components_diff(target, _rows(want, c)) is None


@pytest.mark.parametrize("dequantize", [True, False])
def test_nf4_targets_take_the_whole_tensors_scaler_mean(dequantize):
    """NF4 saved dequantized into same-config NF4 at FSDP2 x2, and raw into NF4 of another config."""
    shape = (24, 256)
    source = to_nf4(_hp(shape, 6), 64, 8)
    saved = _save([source], shape, dequantize=dequantize)
    block, scalers = (64, 8) if dequantize else (32, 16)
    want = torch.chunk(to_nf4(source.get_original_weight(), block, scalers), 2)
    targets = list(torch.chunk(to_nf4(_hp(shape, 7), block, scalers), 2))
    _load(saved, targets, shape)
    for target, part in zip(targets, want):
        assert components_diff(target, part) is None


def _intx_fp32(values: torch.Tensor) -> torch.Tensor:
    linear = torch.nn.Linear(values.shape[1], values.shape[0], bias=False, dtype=values.dtype)
    with torch.no_grad():
        linear.weight.copy_(values)
    quantize_(linear, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(32),
                                           scale_dtype=torch.float32))
    return linear.weight


def test_intx_target_with_a_float32_scale_is_quantized_as_its_config_does():
    """NF4 12x512 into Intx(int8, group 32, float32 scale): torchao's config path on the source's values."""
    shape = (12, 512)
    source = to_nf4(_hp(shape, 8), 64, 32)
    saved = _save([source], shape)
    target = _intx_fp32(_hp(shape, 9))
    metadata, store = saved
    with job.as_rank(0, 1):
        job.load({"w": target}, 0, 1, metadata, store, QuantizedLoadPlanner())
    assert target.scale.dtype == torch.float32
    assert components_diff(target, _intx_fp32(source.get_original_weight())) is None
