"""Adapters for torchao's quantized tensors and low-bit optimizer states, one module per family
(``base``: what they share; ``affine``, ``block_scaled``, ``nf4``, ``optim``). The quantized-*training*
weights are in :mod:`qdcp.adapters.torchao_training`.
"""

from __future__ import annotations

from qdcp.adapters.base import Adapter
from qdcp.adapters.torchao.affine import (
    Float8TensorAdapter,
    Int8TensorAdapter,
    IntxUnpackedToInt8TensorAdapter,
    granularity_from_block,
)
from qdcp.adapters.torchao.base import TorchAOAdapter, check_shape
from qdcp.adapters.torchao.block_scaled import (
    MXTensorAdapter,
    NVFP4TensorAdapter,
    amax_for_torchao_scale,
    swizzle_scale,
    unswizzle_scale,
)
from qdcp.adapters.torchao.nf4 import NF4TensorAdapter
from qdcp.adapters.torchao.optim import OptimState4bitAdapter, OptimState8bitAdapter, OptimStateFp8Adapter

__all__ = [
    "TorchAOAdapter", "check_shape", "granularity_from_block", "Int8TensorAdapter", "Float8TensorAdapter",
    "IntxUnpackedToInt8TensorAdapter", "MXTensorAdapter", "NVFP4TensorAdapter", "amax_for_torchao_scale",
    "swizzle_scale", "unswizzle_scale", "NF4TensorAdapter", "OptimState8bitAdapter", "OptimState4bitAdapter",
    "OptimStateFp8Adapter", "builtin_adapters",
]


def builtin_adapters() -> list[Adapter]:
    """The torchao adapters qdcp registers at its registry's first use."""
    return [Int8TensorAdapter(), Float8TensorAdapter(), IntxUnpackedToInt8TensorAdapter(),
            MXTensorAdapter(), NVFP4TensorAdapter(), NF4TensorAdapter(),
            OptimState8bitAdapter(), OptimState4bitAdapter(), OptimStateFp8Adapter()]
