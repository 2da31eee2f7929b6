"""A quantized tensor class of your own, checkpointed by qdcp through one adapter.

``BlockInt8Tensor`` holds int8 codes and one float32 scale per ``block`` elements of a row: a
wrapper subclass whose logical tensor has no storage, like torchao's. ``BlockInt8Adapter`` tells
qdcp its components, how they shard, and how to rebuild, dequantize and quantize it. Registered,
it works with every qdcp door: ``dcp.save`` / ``dcp.load`` with qdcp's planners (same type
bit-exact, into plain tensors, resharded), ``dcp.async_save`` with ``QuantizedStager``,
``qdcp.to_device``, and the CLI (``qdcp --import custom_adapter verify CKPT``).

    python examples/custom_adapter.py [--dir /tmp/qdcp-custom]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp

import qdcp
from qdcp.layouts import Blocked

aten = torch.ops.aten


class BlockInt8Tensor(torch.Tensor):
    """int8 ``qdata`` (M, N) and float32 ``scale`` (M, N / block): value = qdata * scale."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype = torch.bfloat16):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype, device=qdata.device)

    def __init__(self, qdata, scale, block, dtype=torch.bfloat16):
        self.qdata, self.scale, self.block = qdata, scale, block

    def __repr__(self) -> str:
        return f"BlockInt8Tensor(shape={tuple(self.shape)}, block={self.block}, dtype={self.dtype})"

    def __tensor_flatten__(self):
        return ["qdata", "scale"], (self.block, self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        return cls(inner["qdata"], inner["scale"], *ctx)

    @classmethod
    def quantize(cls, hp: torch.Tensor, block: int) -> "BlockInt8Tensor":
        """Symmetric int8, one scale per ``block`` elements of each row."""
        rows = hp.float().reshape(hp.shape[0], -1, block)
        scale = rows.abs().amax(-1).clamp(min=1e-12) / 127
        qdata = torch.round(rows / scale[..., None]).clamp(-127, 127).to(torch.int8).reshape(hp.shape)
        return cls(qdata, scale, block, hp.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        x = self.qdata.float().reshape(self.shape[0], -1, self.block) * self.scale[..., None]
        return x.reshape(self.shape).to(dtype or self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default, aten.clone.default):
            t = args[0]
            return cls(func(t.qdata), func(t.scale), t.block, t.dtype)
        if func is aten._to_copy.default and set(kwargs) <= {"device"}:
            t = args[0]
            return cls(func(t.qdata, **kwargs), func(t.scale, **kwargs), t.block, t.dtype)
        raise NotImplementedError(f"BlockInt8Tensor does not implement {func}")


class BlockInt8Adapter(qdcp.Adapter):
    """What qdcp needs to know of ``BlockInt8Tensor``; the base class's defaults do the rest
    (components are the attributes of the same names, stored as they are). It takes on none of the
    optional contracts (``qdcp.adapters.RawInterchangeAdapter``, ``GroupAdapter``,
    ``OpRegisteringAdapter``; docs/adapters.md says when a family needs one)."""

    type_names = ("example.BlockInt8Tensor",)

    def matches(self, cls):
        return issubclass(cls, BlockInt8Tensor)

    def type_name(self, t):
        return self.type_names[0]

    def component_names(self, t):
        return ["qdata", "scale"]

    def attributes(self, t):
        return {"block": t.block}

    def layouts(self, t):
        # a qdata element per logical element; a scale element per `block` elements of a row
        return {"qdata": Blocked((1, 1)), "scale": Blocked((1, t.block))}

    def dequantize(self, t, dtype=None):
        return t.dequantize(dtype)

    def rebuild(self, stored):
        c = stored.components
        return BlockInt8Tensor(c["qdata"], c["scale"], stored.attrs["block"], stored.dtype)

    def from_inner_buffers(self, t, buffers):
        return BlockInt8Tensor(buffers["qdata"], buffers["scale"], t.block, t.dtype)

    def quantize_like(self, target, hp, global_amax=None):
        return BlockInt8Tensor.quantize(hp, target.block)


qdcp.register_adapter(BlockInt8Adapter(), override=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    root = args.dir or tempfile.mkdtemp(prefix="qdcp-custom-")
    shutil.rmtree(root, ignore_errors=True)
    hp = torch.randn(64, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    w = BlockInt8Tensor.quantize(hp, 32)

    path = f"{root}/sync"
    dcp.save({"w": w, "step": 7}, checkpoint_id=path, planner=qdcp.QuantizedSavePlanner())
    same = BlockInt8Tensor.quantize(torch.zeros_like(hp), 32)
    plain = torch.zeros(64, 128, dtype=torch.float32)
    dcp.load({"w": same}, checkpoint_id=path, planner=qdcp.QuantizedLoadPlanner())
    dcp.load({"w": plain}, checkpoint_id=path, planner=qdcp.QuantizedLoadPlanner())
    print("same type, bit-exact:", torch.equal(same.qdata, w.qdata) and torch.equal(same.scale, w.scale))
    print("plain float32 target = dequantize:", torch.equal(plain, w.dequantize(torch.float32)))

    stager = qdcp.QuantizedStager()
    future = dcp.async_save({"w": w}, checkpoint_id=f"{root}/async", planner=qdcp.QuantizedSavePlanner(),
                            async_stager=stager)
    w.qdata.zero_()  # the staged copy was taken: this update is not in the checkpoint
    future.result()
    back = BlockInt8Tensor.quantize(torch.zeros_like(hp), 32)
    dcp.load({"w": back}, checkpoint_id=f"{root}/async", planner=qdcp.QuantizedLoadPlanner())
    print("async save with QuantizedStager holds the values at the call:", torch.equal(back.qdata, same.qdata))
    layer = torch.nn.Linear(128, 64, bias=False)
    layer.weight = torch.nn.Parameter(back, requires_grad=False)
    param = layer.weight
    qdcp.to_device(layer, "cpu")  # every inner buffer moves; the parameter object stays
    print("to_device keeps the parameter and its type:", layer.weight is param, type(layer.weight.data).__name__)
    print(f"checkpoints in {root}; try: qdcp --import custom_adapter verify {path}")


if __name__ == "__main__":
    main()
