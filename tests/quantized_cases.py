"""Every torchao type and configuration qdcp covers on CPU, built through torchao's own APIs.

Each case gives ``from_hp(hp)`` -- the library's own high-precision -> quantized path for that
config, which is also the reference for "quantize like the target" -- and ``dequantize(t)``, the
library's own dequantize. All cases are logical ``SHAPE`` tensors of dtype ``case.dtype``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import torch

warnings.filterwarnings("ignore")

from torchao.optim.subclass_4bit import OptimState4bit  # noqa: E402
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402
from torchao.optim.subclass_fp8 import OptimStateFp8  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale  # noqa: E402
from torchao.quantization import (  # noqa: E402
    Float8Tensor,
    Int8Tensor,
    IntxUnpackedToInt8Tensor,
    MappingType,
    to_nf4,
)
from torchao.quantization.granularity import PerGroup, PerRow, PerTensor  # noqa: E402
from torchao.quantization.quantize_.workflows.int8.int8_tensor import QuantizeTensorToInt8Kwargs  # noqa: E402

SHAPE = (256, 128)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    from_hp: Callable[[torch.Tensor], torch.Tensor]
    dtype: torch.dtype = torch.bfloat16
    dequantize: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.dequantize()

    def hp(self, seed: int, shape=SHAPE) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=g, dtype=torch.float32).to(self.dtype)

    def make(self, seed: int, shape=SHAPE) -> torch.Tensor:
        return self.from_hp(self.hp(seed, shape))


def _optim(cls, **kw):
    def make(hp):
        t = cls.zeros(tuple(hp.shape), **kw, dtype=torch.float32, device=hp.device)
        t.copy_(hp.float())
        return t
    return make


def _nvfp4(per_tensor: bool, swizzled: bool):
    def make(hp):
        pts = per_tensor_amax_to_scale(hp.abs().amax()) if per_tensor else None
        return NVFP4Tensor.to_nvfp4(hp.contiguous(), per_tensor_scale=pts, is_swizzled_scales=swizzled)
    return make


CASES = [
    Case("int8_row", lambda hp: Int8Tensor.from_hp(hp, PerRow())),
    Case("int8_group32", lambda hp: Int8Tensor.from_hp(hp, PerGroup(32))),
    Case("int8_tensor", lambda hp: Int8Tensor.from_hp(hp, PerTensor())),
    Case("int8_asym_row", lambda hp: Int8Tensor.from_hp(hp, PerRow(), mapping_type=MappingType.ASYMMETRIC)),
    Case("int8_dynamic_act", lambda hp: Int8Tensor.from_hp(
        hp, PerRow(), act_quant_kwargs=QuantizeTensorToInt8Kwargs(granularity=PerRow()))),
    Case("float8_row", lambda hp: Float8Tensor.from_hp(hp, granularity=PerRow())),
    Case("float8_tensor_e5m2", lambda hp: Float8Tensor.from_hp(
        hp, float8_dtype=torch.float8_e5m2, granularity=PerTensor())),
    Case("float8_group64", lambda hp: Float8Tensor.from_hp(hp, granularity=PerGroup(64))),
    Case("intx_int8_row", lambda hp: IntxUnpackedToInt8Tensor.from_hp(hp, (1, SHAPE[1]), torch.int8)),
    Case("intx_int4_group32", lambda hp: IntxUnpackedToInt8Tensor.from_hp(hp, (1, 32), torch.int4)),
    Case("intx_int4_group32_asym", lambda hp: IntxUnpackedToInt8Tensor.from_hp(
        hp, (1, 32), torch.int4, mapping_type=MappingType.ASYMMETRIC)),
    Case("intx_int2_group64_dynact", lambda hp: IntxUnpackedToInt8Tensor.from_hp(
        hp, (1, 64), torch.int2, activation_quantization="int8_asym_per_token")),
    Case("nf4", lambda hp: to_nf4(hp), dequantize=lambda t: t.get_original_weight()),
    Case("nf4_block32", lambda hp: to_nf4(hp, 32, 128), dequantize=lambda t: t.get_original_weight()),
    Case("mx_fp8", lambda hp: MXTensor.to_mx(hp, torch.float8_e4m3fn, 32)),
    Case("mx_fp8_e5m2_swizzled", lambda hp: MXTensor.to_mx(hp, torch.float8_e5m2, 32, is_swizzled_scales=True)),
    Case("mx_fp4", lambda hp: MXTensor.to_mx(hp, torch.float4_e2m1fn_x2, 32)),
    Case("mx_fp4_swizzled", lambda hp: MXTensor.to_mx(hp, torch.float4_e2m1fn_x2, 32, is_swizzled_scales=True)),
    Case("nvfp4", _nvfp4(False, False)),
    Case("nvfp4_per_tensor", _nvfp4(True, False)),
    Case("nvfp4_swizzled", _nvfp4(False, True)),
    Case("nvfp4_per_tensor_swizzled", _nvfp4(True, True)),
    Case("optim8bit_signed", _optim(OptimState8bit, signed=True, block_size=256), torch.float32),
    Case("optim8bit_unsigned", _optim(OptimState8bit, signed=False, block_size=256), torch.float32),
    Case("optim4bit", _optim(OptimState4bit, signed=True, block_size=128), torch.float32),
    Case("optimfp8", _optim(OptimStateFp8, block_size=256), torch.float32),
]
CASE_BY_NAME = {c.name: c for c in CASES}


def inner(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensor's inner buffers by name, as torch's subclass protocol lists them."""
    names, _ = t.__tensor_flatten__()
    return {n: getattr(t, n) for n in names}


def data_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors ``t`` holds its data in: itself, or its inner buffers (nested), live."""
    if type(t) is torch.Tensor:
        return [t]
    return [b for v in inner(t).values() if isinstance(v, torch.Tensor) for b in data_tensors(v)]


def seeded(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (deterministic test data)."""
    return torch.Generator().manual_seed(seed)


def save_ckpt(tmp_path, state: dict, **planner_kw):
    """:func:`qdcp_save` into ``tmp_path / "ckpt"``; returns that path."""
    return qdcp_save(tmp_path / "ckpt", state, **planner_kw)


def qdcp_save(path, state: dict, no_dist: bool = False, **planner_kw):
    """``dcp.save`` with qdcp's save planner (``planner_kw`` for it); returns ``path``."""
    import torch.distributed.checkpoint as dcp

    from qdcp import QuantizedSavePlanner

    dcp.save(state, checkpoint_id=path, planner=QuantizedSavePlanner(**planner_kw), no_dist=no_dist)
    return path


def raise_inner(fn):
    """Run ``fn``; DCP wraps each rank's error in CheckpointException (a BaseException): re-raise
    the first rank's own error, as the user reads it (qdcp's, where one carried it)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return fn()
    except CheckpointException as e:
        err = next(iter(e.failures.values()))
        err = err[0] if isinstance(err, tuple) else err
        raise (err.__cause__ if type(err).__name__ == "_MetadataUnreadable" else err) from None


def gated_save_planner(gate, **planner_kw):
    """A ``QuantizedSavePlanner`` that plans (in ``async_save``'s upload thread) only once ``gate``
    (a ``threading.Event``) is set: a test updates the live model first, so a staged copy that
    aliased the live tensors is caught every time, not by chance."""
    from qdcp import QuantizedSavePlanner

    class GatedSavePlanner(QuantizedSavePlanner):
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            if not gate.wait(120):
                raise TimeoutError("the gate of the gated save planner was never opened")
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
    return GatedSavePlanner(**planner_kw)


def qdcp_load(path, state: dict, **planner_kw) -> dict:
    """``dcp.load`` with qdcp's load planner (``planner_kw`` for it), in place; returns ``state``."""
    import torch.distributed.checkpoint as dcp

    from qdcp import QuantizedLoadPlanner

    dcp.load(state, checkpoint_id=path, planner=QuantizedLoadPlanner(**planner_kw))
    return state


def bits(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a tensor's bytes, for bit-exact comparison of any dtype."""
    t = t.detach().contiguous()  # its elements are consecutive (size-1 dims may keep any stride)
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


def bits_diff(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None if two plain tensors have one shape and dtype and the same bytes, else what differs."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} != {tuple(b.shape)} {b.dtype}"
    if torch.equal(bits(a), bits(b)):
        return None
    return f"values differ ({int((bits(a) != bits(b)).sum())} bytes)"


def components_diff(got: torch.Tensor, want: torch.Tensor, skip=()) -> str | None:
    """None if two tensors' canonical qdcp components (but ``skip``) are bit-identical (plain
    tensors: their bytes), else what differs."""
    from qdcp.adapters import find_adapter

    a, b = find_adapter(got), find_adapter(want)
    if a is None or b is None:
        return bits_diff(got, want)
    ca = {n: v for n, v in a.components(got).items() if n not in skip}
    cb = {n: v for n, v in b.components(want).items() if n not in skip}
    if sorted(ca) != sorted(cb):
        return f"components {sorted(ca)} != {sorted(cb)}"
    for name in ca:
        diff = bits_diff(ca[name], cb[name])
        if diff is not None:
            return f"component {name}: {diff}"
    return None


def assert_same_buffers(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same subclass, same logical shape, and bit-identical inner buffers."""
    assert type(a) is type(b), (type(a), type(b))
    assert a.shape == b.shape
    ia, ib = inner(a), inner(b)
    assert sorted(ia) == sorted(ib)
    for name in ia:
        assert ia[name].shape == ib[name].shape, name
        assert ia[name].dtype == ib[name].dtype, name
        assert torch.equal(bits(ia[name]), bits(ib[name])), f"component {name} differs"


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert torch.equal(bits(a), bits(b))


def buffers_diff(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None if ``a`` and ``b`` have the same type, shape and bit-identical inner buffers."""
    if type(a) is not type(b):
        return f"types {type(a).__name__} != {type(b).__name__}"
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} != {tuple(b.shape)}"
    if type(a) is torch.Tensor:
        if a.dtype != b.dtype:
            return f"dtypes {a.dtype} != {b.dtype}"
        if torch.equal(bits(a.cpu()), bits(b.cpu())):
            return None
        if a.numel() <= 4:
            return f"values {a.tolist()} != {b.tolist()}"
        return "values differ"
    ia, ib = inner(a), inner(b)
    if sorted(ia) != sorted(ib):
        return f"components {sorted(ia)} != {sorted(ib)}"
    for n in ia:
        if ia[n].shape != ib[n].shape or ia[n].dtype != ib[n].dtype:
            return f"component {n}: {tuple(ia[n].shape)} {ia[n].dtype} != {tuple(ib[n].shape)} {ib[n].dtype}"
        if not torch.equal(bits(ia[n].cpu()), bits(ib[n].cpu())):
            diff = (ia[n].cpu().float() - ib[n].cpu().float()).abs() if ia[n].is_floating_point() else None
            return f"component {n} differs" + (f" (max abs diff {diff.max().item():.3g})" if diff is not None
                                                and diff.numel() and torch.isfinite(diff).all() else "")
    return None


def differences(got: dict, want: dict) -> list[str]:
    """The keys of two ``{key: tensor}`` snapshots whose tensors are not bit-identical (shape, dtype
    and bytes; compared on CPU), or that only one side has."""
    diff = sorted(set(got) ^ set(want))
    for k in sorted(set(got) & set(want)):
        a, b = got[k].cpu(), want[k].cpu()
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(bits(a), bits(b)):
            diff.append(k)
    return diff
