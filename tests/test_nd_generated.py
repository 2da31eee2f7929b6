"""Quantized tensors of three dimensions (stacked experts, ``[E, N, K]``) at generated layouts.

docs/format.md writes every torchao layout for any number of dimensions (``blocked [1, .., 1]``,
scales ``blocked [1, .., block]``), and docs/api.md's rule holds "at any layout". The oracle: a
3-D tensor whose blocks run along its last dimension is quantized row by row, so every shard of it
cut along a leading dimension (experts, or rows within them) is the library's quantization of its
own values; a same-config target at any such layout gets, bit for bit, ``from_hp`` of its region
of the high-precision tensor, and a plain target that region's ``dequantize()``. Each case is
saved at 1-4 ranks (``Shard(0)`` or ``Shard(1)``, uneven included), every rank planned and stored
in this process (tests/dcp_in_process.py), and loaded at another layout; a third of them through
files and qdcp's reader.
"""

from __future__ import annotations

import tempfile

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
from torchao.quantization import Float8Tensor, Int8Tensor, IntxUnpackedToInt8Tensor, PerGroup, PerRow

import dcp_in_process as job
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner
from quantized_cases import bits_diff, components_diff

FAMILIES = {
    "float8_row": lambda hp: Float8Tensor.from_hp(hp, granularity=PerRow()),
    "int8_row": lambda hp: Int8Tensor.from_hp(hp, PerRow()),
    "int8_group32": lambda hp: Int8Tensor.from_hp(hp, PerGroup(32)),
    "intx_int4_group32": lambda hp: IntxUnpackedToInt8Tensor.from_hp(hp, (1, 1, 32), torch.int4),
    "mx_fp8": lambda hp: MXTensor.to_mx(hp, torch.float8_e4m3fn, 32),
    "nvfp4": lambda hp: NVFP4Tensor.to_nvfp4(hp),
}


def region(layout: tuple[int, int], shape: tuple[int, ...]):
    """``(spec, offsets, sizes)`` of the current (fake) rank's shard at ``layout`` (ranks, dim)."""
    world, dim = layout
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(job.mesh((world,)), (Shard(dim),), TensorMeta(torch.Size(shape), stride, torch.bfloat16))
    chunk = DTensor(torch.empty(0), spec, requires_grad=False).__create_chunk_list__()[0]
    return spec, tuple(chunk.offsets), tuple(chunk.sizes)


def cut(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


@settings(max_examples=150, deadline=None, derandomize=True, database=None, phases=(Phase.generate,),
          suppress_health_check=list(HealthCheck))
@given(family=st.sampled_from(sorted(FAMILIES)), shape=st.tuples(st.sampled_from([1, 2, 3, 4, 6]),
       st.sampled_from([4, 8, 16]), st.sampled_from([64, 128])), seed=st.integers(0, 2**16),
       source=st.tuples(st.integers(1, 4), st.integers(0, 1)), target=st.tuples(st.integers(1, 4), st.integers(0, 1)),
       kind=st.sampled_from(["same", "plain"]), files=st.integers(0, 2))
def test_three_dimensional_tensors_load_at_any_leading_layout(family, shape, seed, source, target, kind, files):
    quantize = FAMILIES[family]
    hp = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    locals_ = []
    for rank in range(source[0]):
        with job.as_rank(rank, source[0]):
            spec, offsets, sizes = region(source, shape)
        locals_.append((spec, quantize(cut(hp, offsets, sizes).contiguous()) if all(sizes) else None))
    if any(t is None for _, t in locals_):
        return  # an empty shard: not a tensor torchao makes

    def state(rank):
        spec, local = locals_[rank]
        return {"w": DTensor(local, spec, requires_grad=False)}

    with tempfile.TemporaryDirectory(prefix="qdcp-nd-") as tmp:
        path = f"{tmp}/ckpt" if files == 0 else None
        saved = job.save_files(state, source[0], QuantizedSavePlanner, path) if path else \
            job.save(state, source[0], QuantizedSavePlanner)
        for rank in range(target[0]):
            with job.as_rank(rank, target[0]):
                spec, offsets, sizes = region(target, shape)
                if not all(sizes):
                    continue
                values = cut(hp, offsets, sizes).contiguous()
                expect = quantize(values)
                local = torch.zeros(sizes, dtype=torch.bfloat16) if kind == "plain" else \
                    quantize(torch.randn(sizes).to(torch.bfloat16))
                loaded = {"w": DTensor(local, spec, requires_grad=False)}
                if path:
                    job.load_files(loaded, path, QuantizedLoadPlanner(atomic=bool(seed % 2)))
                else:
                    job.load(loaded, rank, target[0], *saved, QuantizedLoadPlanner())
                if kind == "plain":
                    assert bits_diff(local, expect.dequantize()) is None, (rank, bits_diff(local, expect.dequantize()))
                else:
                    assert components_diff(local, expect) is None, (rank, components_diff(local, expect))
