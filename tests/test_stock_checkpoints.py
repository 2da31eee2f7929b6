"""A checkpoint of torchao tensors written by DCP's own ``dcp.save`` (no qdcp planner: each tensor
pickled whole) loads through ``qdcp.load``: into the same type as from a dequantized checkpoint of
the same values, into a plain target as the library's own ``dequantize()``, bitwise. A stored
tensor whose values cannot be computed is a ``CheckpointFormatError`` naming the key, the target
left as it was."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from qdcp import CheckpointFormatError
from quantized_cases import CASE_BY_NAME, assert_bitwise_equal, assert_same_buffers, bits, inner

CASES = ["int8_group32", "float8_row", "nf4", "mx_fp4_swizzled", "nvfp4", "optim8bit_signed", "optim4bit"]


@pytest.mark.parametrize("name", CASES)
def test_a_stock_checkpoint_of_torchao_tensors_loads(tmp_path, name):
    case = CASE_BY_NAME[name]
    source = {"w": case.make(0), "b": torch.arange(3.0)}
    dcp.save(source, checkpoint_id=tmp_path / "stock")
    qdcp.save(source, tmp_path / "dequantized", dequantize=True)
    got, want = ({"w": case.make(1), "b": torch.zeros(3)} for _ in range(2))
    qdcp.load(got, tmp_path / "stock")
    qdcp.load(want, tmp_path / "dequantized")
    assert_same_buffers(got["w"], want["w"])  # quantized like the target from the same values
    plain = {"w": torch.zeros(source["w"].shape, dtype=source["w"].dtype), "b": torch.zeros(3)}
    qdcp.load(plain, tmp_path / "stock")
    assert_bitwise_equal(plain["w"], case.dequantize(source["w"]))
    assert torch.equal(plain["b"], source["b"])


def test_a_stored_tensor_whose_values_cannot_be_computed_names_its_key(tmp_path):
    case = CASE_BY_NAME["int8_group32"]
    good = case.make(0)
    _, ctx = good.__tensor_flatten__()
    damaged = type(good).__tensor_unflatten__({"qdata": good.qdata, "scale": good.scale[:, :3].contiguous()}, ctx,
                                              good.shape, good.stride())  # a scale too short for its blocks
    dcp.save({"layers.0.w": damaged}, checkpoint_id=tmp_path / "stock")
    target = {"layers.0.w": case.make(1)}
    before = {n: bits(t).clone() for n, t in inner(target["layers.0.w"]).items()}
    with pytest.raises(CheckpointFormatError, match=r"key 'layers\.0\.w': the stored chunk is a whole Int8Tensor "
                                                    r"\(pickled by DCP's own save.*cannot be computed"):
        qdcp.load(target, tmp_path / "stock")
    assert all(torch.equal(bits(t), before[n]) for n, t in inner(target["layers.0.w"]).items())
