"""TE grouped tensors for the tests, built by TE's own ``make_grouped_tensor_with_shapes`` on CPU.

``te_cpu`` stands in for TE's compiled module (installed on import). The flat buffers are filled here,
padding regions included (with garbage), as TE leaves them uninitialised. ``clean`` groups have their
padding zeroed (canonical components copied back in), as TE's kernels write it, so that whole buffers
can be compared bit for bit. Shared by ``test_te_grouped.py`` and ``te_grouped_dist_worker.py``.
"""

from __future__ import annotations

import dataclasses

import torch

import te_cpu

te = te_cpu.install()

from transformer_engine.pytorch.constants import DType  # noqa: E402
from transformer_engine.pytorch.tensor.storage.grouped_tensor_storage import GroupedTensorStorage  # noqa: E402

from qdcp.adapters import find_adapter  # noqa: E402
from quantized_cases import bits, seeded  # noqa: E402

E4M3, E5M2 = DType.kFloat8E4M3, DType.kFloat8E5M2
UNIFORM = [(128, 256)] * 4
VARY_FIRST = [(128, 256), (64, 256), (256, 256)]
VARY_LAST = [(128, 128), (128, 256), (128, 64)]
VARY_BOTH = [(64, 128), (128, 256), (32, 64)]


def _rand_u8(n, lo, hi, seed):
    return torch.randint(lo, hi, (n,), generator=seeded(seed), dtype=torch.int32).to(torch.uint8)


def _fp8(n, seed):
    b = _rand_u8(n, 0, 256, seed)
    return torch.where((b & 0x7F) == 0x7F, b & 0xF0, b)  # no e4m3 NaN codes


def quantizer(recipe, rowwise=True, columnwise=True, swizzled=False, fp8=E4M3, row_scaled=False):
    if recipe == "none":
        return None
    if recipe == "mxfp8":
        q = te.MXFP8Quantizer(fp8, rowwise=rowwise, columnwise=columnwise)
    elif recipe == "current":
        q = te.Float8CurrentScalingQuantizer(fp8, device="cpu", rowwise=rowwise, columnwise=columnwise)
    elif recipe == "delayed":
        q = te.Float8Quantizer(scale=torch.ones(1), amax=torch.zeros(1), fp8_dtype=fp8,
                               rowwise=rowwise, columnwise=columnwise)
    elif recipe.startswith("block"):
        q = te.Float8BlockQuantizer(fp8, rowwise=rowwise, columnwise=columnwise,
                                    block_scaling_dim=int(recipe[-1]))
    elif recipe == "nvfp4":
        q = te.NVFP4Quantizer(rowwise=rowwise, columnwise=columnwise, row_scaled_nvfp4=row_scaled)
    q.optimize_for_gemm = swizzled
    return q


def fill(g, seed):
    """Random valid values in every flat buffer, padding regions included."""
    fp4 = g.quantizer is not None and g.quantizer._get_compatible_recipe().nvfp4()
    for i, name in enumerate(("rowwise_data", "columnwise_data")):
        b = getattr(g, name)
        if b is None:
            continue
        if b.dtype == torch.bfloat16:
            b.copy_(torch.randn(b.shape, generator=seeded(seed + i)).to(torch.bfloat16))
        else:
            b.copy_(_rand_u8(b.numel(), 0, 256, seed + i) if fp4 else _fp8(b.numel(), seed + i))
    for i, name in enumerate(("scale_inv", "columnwise_scale_inv", "amax", "columnwise_amax", "scale")):
        b = getattr(g, name)
        if b is None:
            continue
        if b.dtype == torch.uint8:  # e8m0 (MXFP8) or e4m3 (NVFP4) scales
            lo, hi = (0x08, 0x7F) if fp4 else (118, 136)
            b.copy_(_rand_u8(b.numel(), lo, hi, seed + 10 + i))
        else:
            b.copy_(torch.rand(b.shape, generator=seeded(seed + 10 + i)) * 0.01 + 1e-3)
    return g


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    recipe: str
    kw: tuple = ()
    cap: tuple = te_cpu.HOPPER
    te_dq: bool = False   # members' TE dequantize runs on CPU (Float8, blockwise)

    def build(self, seed, shapes=UNIFORM, clean=False, internal=False):
        with te_cpu.simulate_gpu(self.cap):
            q = quantizer(self.recipe, **dict(self.kw))
            if q is not None and internal:
                q.internal = True
            g = GroupedTensorStorage.make_grouped_tensor_with_shapes(
                len(shapes), list(shapes), quantizer=q, device="cpu", dtype=torch.bfloat16)
            fill(g, seed)
            if clean:  # zero padding, as TE's kernels leave it
                a = find_adapter(g)
                comps = {k: v.clone() for k, v in a.components(g).items()}
                for name in ("scale_inv", "columnwise_scale_inv"):
                    b = getattr(g, name)
                    if b is not None and b.numel() > g.num_tensors:
                        b.zero_()
                a.copy_into(g, comps)
            return g


CASES = [
    Case("mxfp8_both", "mxfp8"),
    Case("mxfp8_rowwise_swizzled", "mxfp8", (("columnwise", False), ("swizzled", True))),
    Case("current_both_hopper", "current", te_dq=True),
    Case("current_blackwell", "current", cap=te_cpu.BLACKWELL, te_dq=True),
    Case("delayed_both_e5m2", "delayed", (("fp8", E5M2),), te_dq=True),
    Case("block2_both", "block2", te_dq=True),
    Case("block1_both", "block1", te_dq=True),
    Case("nvfp4_both", "nvfp4"),
    Case("nvfp4_row_scaled", "nvfp4", (("columnwise", False), ("row_scaled", True))),
    Case("bf16", "none"),
]
BY = {c.name: c for c in CASES}
SHAPES = {"uniform": UNIFORM, "vary_first": VARY_FIRST, "vary_last": VARY_LAST, "vary_both": VARY_BOTH}


def flat(g) -> dict[str, torch.Tensor]:
    """The group's flat buffers (TE's ``get_data_tensors``, by field name): its adapter's ``inner_buffers``."""
    return find_adapter(g).inner_buffers(g)


def assert_same_flat(a, b):
    fa, fb = flat(a), flat(b)
    assert sorted(fa) == sorted(fb)
    for n in fa:
        assert torch.equal(bits(fa[n]), bits(fb[n])), f"buffer {n} differs"


def reference(g):
    """Members' own single-tensor dequantize (qdcp's reference), stacked or laid out as TE's logical shape."""
    a = find_adapter(g)
    outs = [m if not isinstance(m, torch.Tensor) or find_adapter(m) is None else find_adapter(m).dequantize(m)
            for m in a.members(g)]
    outs = [o.to(torch.bfloat16) for o in outs]
    if g.first_dims is None and g.last_dims is None:
        return torch.stack(outs)  # [n, M, N]
    if g.first_dims is not None and g.last_dims is not None:
        return torch.cat([o.reshape(-1) for o in outs]).reshape(tuple(g.logical_shape))  # TE's own
    return torch.cat(outs, dim=1 if g.last_dims is not None else 0)
