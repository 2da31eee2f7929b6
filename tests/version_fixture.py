"""The state of the cross-version fixtures (tests/data/torch-<version>/, written by
scripts/make_version_fixture.py under each supported torch) and where they live."""

from __future__ import annotations

import os

import torch

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SHAPE = (16, 256)


def fixture_dir(version) -> str:
    major, minor = str(version).split("+")[0].split(".")[:2]
    return os.path.join(DATA, f"torch-{major}.{minor}")


def quantized_state(seed: int) -> dict:
    """torchao types through their own APIs, a low-bit optimizer state, a plain tensor, an object."""
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    from torchao.quantization import Int8Tensor, PerRow, to_nf4

    g = torch.Generator().manual_seed(seed)

    def hp():
        return torch.randn(SHAPE, generator=g).to(torch.bfloat16)
    state8 = OptimState8bit.zeros(SHAPE, signed=True, block_size=256)
    state8.copy_(torch.randn(SHAPE, generator=g))
    return {"int8": Int8Tensor.from_hp(hp(), PerRow()), "nf4": to_nf4(hp(), 32, 128),
            "mx": MXTensor.to_mx(hp(), torch.float8_e4m3fn, 32), "nvfp4": NVFP4Tensor.to_nvfp4(hp()),
            "exp_avg": state8, "bias": torch.randn(16, generator=g), "step": 7 + seed}
