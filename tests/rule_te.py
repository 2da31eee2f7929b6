"""TransformerEngine families for the generated rule cases (tests/rule_cases.py), on TE's real
Python classes on CPU (tests/te_cpu.py stands in for the kernels).

TE cannot quantize without a GPU, so a TE tensor here is built from buffers: random codes and
scales for a whole tensor, cut per rank the way FSDP2 / tensor parallelism cut a TE weight (the
codes of the rank's region, the scales of its rows and blocks; a per-tensor scale kept), or drawn
for each rank's shape on its own (each rank quantized by itself). Each family gives what the
oracle needs, read from TE's buffers, never from qdcp: per-element codes and block values, the
configuration, and the values (``dequantize``: TE's own for Float8, torchao's ``MXTensor`` of the
same bits for MXFP8, the two libraries agreeing on it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch

import rule_oracle as rule
import te_cpu
from quantized_cases import seeded

te = te_cpu.install() if te_cpu.te_installed() else None

if te is not None:
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from transformer_engine.pytorch.constants import DType

    E4M3 = DType.kFloat8E4M3


def _ru(x: int, m: int) -> int:
    return -(-x // m) * m


def _codes(shape, seed: int) -> torch.Tensor:
    """Finite e4m3 codes (no NaN: 0x7F / 0xFF), as TE stores them (uint8)."""
    return torch.randint(0, 0x7F, shape, generator=seeded(seed), dtype=torch.int32).to(torch.uint8) \
        | (torch.randint(0, 2, shape, generator=seeded(seed + 7), dtype=torch.int32).to(torch.uint8) << 7)


@dataclasses.dataclass
class Buffers:
    """A TE tensor's content in compact form: codes, and per-tensor or per-block scales."""

    codes: torch.Tensor
    scale: torch.Tensor  # Float8: [1] float32 scale_inv; MXFP8: [rows, cols / 32] e8m0 (uint8)


@dataclasses.dataclass(frozen=True)
class TEFamily:
    """One TE family: draw buffers, cut them, build TE's tensor, read it back."""

    name: str
    draw: Callable[[tuple[int, int], int], Buffers]
    cut: Callable[[Buffers, tuple], Buffers | None]
    build: Callable[[Buffers, tuple[int, int]], torch.Tensor]
    read: Callable[[torch.Tensor], Buffers]
    values: Callable[[torch.Tensor], torch.Tensor]
    block: tuple[int, int] | None  # None: one scale for the whole tensor

    def make(self, shape, seed: int) -> torch.Tensor | None:
        with context():
            return self.build(self.draw(tuple(shape), seed), tuple(shape))

    def element_maps(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        b, shape = self.read(t), tuple(t.shape)
        scale = b.scale.contiguous().view(torch.int32 if b.scale.dtype == torch.float32 else torch.uint8)
        if self.block is None:
            return {"code": b.codes, "per_tensor_scale": scale.reshape(1, 1).expand(shape)}
        return {"code": b.codes, "scale": scale.repeat_interleave(self.block[1], dim=1)[:, : shape[1]]}


def context():
    """TE believes it runs on a Hopper GPU with the CPU as its device (only while a case runs)."""
    return te_cpu.simulate_gpu(te_cpu.HOPPER) if te is not None else contextlib.nullcontext()


def _region(chunk):
    (r, c), (nr, nc) = chunk
    return slice(r, r + nr), slice(c, c + nc)


# ----------------------------------------------------------------------------- Float8 (per-tensor)

def _f8_draw(shape, seed):
    return Buffers(_codes(shape, seed), torch.rand(1, generator=seeded(seed + 1)) * 0.01 + 0.001)


def _f8_cut(b: Buffers, chunk):
    return Buffers(b.codes[_region(chunk)].contiguous(), b.scale.clone())


def _f8_build(b: Buffers, shape):
    q = te.Float8CurrentScalingQuantizer(E4M3, device="cpu", rowwise=True, columnwise=False)
    return te.Float8Tensor(shape=shape, dtype=torch.bfloat16, data=b.codes, fp8_scale_inv=b.scale,
                           fp8_dtype=E4M3, data_transpose=None, quantizer=q, device="cpu")


def _f8_read(t):
    return Buffers(t._data, t._scale_inv)


# ----------------------------------------------------------------------------- MXFP8 (1 x 32 blocks, rowwise)

def _mx_draw(shape, seed):
    m, n = shape
    if n % 32:
        return None
    scale = torch.randint(118, 136, (m, n // 32), generator=seeded(seed + 1), dtype=torch.int32).to(torch.uint8)
    return Buffers(_codes(shape, seed), scale)


def _mx_cut(b: Buffers, chunk):
    (r, c), (nr, nc) = chunk
    if c % 32 or nc % 32:  # TE's MXFP8 tensor holds whole 1 x 32 blocks
        return None
    return Buffers(b.codes[_region(chunk)].contiguous(), b.scale[r:r + nr, c // 32:(c + nc) // 32].contiguous())


def _mx_build(b: Buffers | None, shape):
    if b is None:
        return None
    m, n = shape
    q = te.MXFP8Quantizer(E4M3, rowwise=True, columnwise=False)
    return te.MXFP8Tensor(shape=shape, dtype=torch.bfloat16, fp8_dtype=E4M3, quantizer=q,
                          rowwise_data=b.codes, rowwise_scale_inv=te_cpu.padded(b.scale, _ru(m, 128), _ru(n // 32, 4)),
                          columnwise_data=None, columnwise_scale_inv=None, with_gemm_swizzled_scales=False,
                          device="cpu")


def _mx_read(t):
    m, n = t.shape
    return Buffers(t._rowwise_data, t._rowwise_scale_inv[:m, : n // 32])


def _mx_values(t):
    """torchao's ``MXTensor`` dequantize of the same bits (TE's needs a GPU; the two agree:
    tests/test_transformer_engine.py)."""
    b = _mx_read(t)
    ao = MXTensor(b.codes.view(torch.float8_e4m3fn), b.scale.contiguous().view(torch.float8_e8m0fnu),
                  torch.float8_e4m3fn, 32, torch.bfloat16, None, None, False)
    return ao.dequantize(torch.bfloat16)


FAMILIES = {} if te is None else {
    "te_float8": TEFamily("te_float8", _f8_draw, _f8_cut, _f8_build, _f8_read, lambda t: t.dequantize(), None),
    "te_mxfp8": TEFamily("te_mxfp8", _mx_draw, _mx_cut, _mx_build, _mx_read, _mx_values, (1, 32)),
}


def is_te(t: torch.Tensor) -> bool:
    return te is not None and isinstance(t, (te.Float8Tensor, te.MXFP8Tensor))


def family_of(t: torch.Tensor) -> TEFamily:
    return FAMILIES["te_float8" if isinstance(t, te.Float8Tensor) else "te_mxfp8"]


def config(t: torch.Tensor) -> tuple:
    """A TE tensor's configuration but for its blocks; TE MXFP8 (rowwise, e4m3, 1 x 32) and
    torchao's ``MXTensor`` of e4m3 in blocks of 32 hold the same bits (docs/api.md's raw
    conversions), so they share one."""
    if isinstance(t, te.MXFP8Tensor) or (isinstance(t, MXTensor) and t.elem_dtype == torch.float8_e4m3fn
                                         and t.block_size == 32 and not t.is_swizzled_scales):
        return ("mxfp8", "e4m3", "1x32")
    return (type(t).__name__, "e4m3")


def view(t: torch.Tensor) -> rule.Target:
    """A TE target (or a torchao ``MXTensor`` loaded from TE) as the rule reads it."""
    rows, cols = t.shape
    if is_te(t) and family_of(t).block is None:  # one scale for the whole tensor
        return rule.Target(config(t), torch.zeros(rows, cols, dtype=torch.int64), ("per_tensor_scale",))
    blocks = rule.target_blocks(t) if isinstance(t, MXTensor) else \
        (torch.arange(rows)[:, None] * (cols + 1) + torch.arange(cols)[None, :] // 32)
    return rule.Target(config(t), blocks, ())
