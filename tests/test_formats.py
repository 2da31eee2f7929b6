"""The shared byte-layout helpers against the libraries that define those layouts."""
from __future__ import annotations

import pytest
import torch
from torchao.prototype.mx_formats.utils import from_blocked, to_blocked

from qdcp.adapters.formats import ceil_div, e2m1_to_float, round_up, swizzle_128x4, unpack_fp4, unswizzle_128x4


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (128, 4), (130, 5), (200, 7), (256, 64), (513, 33)])
def test_swizzle_is_torchaos_blocked_layout(shape):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    compact = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    ours = swizzle_128x4(compact)
    assert ours.shape == (round_up(shape[0], 128), round_up(shape[1], 4))
    assert torch.equal(ours.reshape(-1), to_blocked(compact).reshape(-1))
    assert torch.equal(unswizzle_128x4(ours, *shape), compact)
    assert torch.equal(unswizzle_128x4(ours, *shape), from_blocked(to_blocked(compact), *shape))


def test_ceil_div_and_round_up():
    assert [ceil_div(a, 32) for a in (0, 1, 32, 33)] == [0, 1, 1, 2]
    assert [round_up(a, 128) for a in (0, 1, 128, 129)] == [0, 128, 128, 256]


def test_fp4_nibbles_low_first_and_values():
    packed = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8)
    codes = unpack_fp4(packed)
    assert codes.tolist() == [[1, 2, 8, 15]]
    assert e2m1_to_float(codes).tolist() == [[0.5, 1.0, -0.0, -6.0]]
    assert str(e2m1_to_float(torch.tensor([8], dtype=torch.uint8))[0].item()) == "-0.0"
