"""torchao's ``NF4Tensor`` (QLoRA): blocks over the flattened tensor."""

from __future__ import annotations

import math
import sys

import torch

from qdcp.adapters.base import StoredEntry
from qdcp.adapters.torchao.base import TorchAOAdapter, import_class, removal
from qdcp.layouts import Flat, Replicated


class NF4TensorAdapter(TorchAOAdapter):
    """``torchao.quantization.NF4Tensor`` (QLoRA): blocks over the flattened tensor."""

    cls_name = "NF4Tensor"

    def component_names(self, t):  # the stored order (its __tensor_flatten__ names them in another)
        return ["quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"]

    def attributes(self, t):
        return {"block_size": t.block_size, "scaler_block_size": t.scaler_block_size, "dtype": t.dtype}

    def layouts(self, t):
        return {"quantized_data": Flat(2),
                "quantized_scalers": Flat(t.block_size),
                "quantization_factor": Flat(t.block_size * t.scaler_block_size),
                "scaler_mean": Replicated(tuple(t.scaler_mean.shape)),
                "nf4": Replicated(tuple(t.nf4.shape))}

    def dequantize(self, t, dtype=None):
        out = t.get_original_weight()  # NF4 has no wider-precision dequantize: computed in its dtype
        return out if dtype is None else out.to(dtype)

    def rebuild(self, stored):
        cls = self.tensor_class()
        args_cls = import_class("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "SubclassTensorArgs")
        shape = torch.Size(stored.shape)
        stride = torch.empty(shape, device="meta").stride()
        device = stored.components["quantized_data"].device
        attrs = stored.attrs
        meta = args_cls(shape, stride, 0, attrs["dtype"], device, False)
        ctx = {"block_size": attrs["block_size"], "scaler_block_size": attrs["scaler_block_size"],
               "n_blocks": math.prod(shape) // attrs["block_size"], "tensor_meta": meta}
        return cls.__tensor_unflatten__(dict(stored.components), ctx, shape, stride)

    def from_inner_buffers(self, t, buffers):
        # not NF4's own unflatten: its context keeps t's device (and requires_grad), not the buffers'
        return self.rebuild(StoredEntry(self.type_names[0], self.attributes(t), tuple(t.shape), t.dtype, buffers))

    def add_op(self, cls, op, impl):
        """Through NF4's own op table (``NF4_OPS_TABLE`` and ``implements`` of its module)."""
        module = sys.modules.get(cls.__module__)
        table = getattr(module, "NF4_OPS_TABLE", None)
        if not isinstance(table, dict) or op in table or not callable(getattr(module, "implements", None)):
            return None
        module.implements([op])(lambda func, args, kwargs: impl(func, args, kwargs or {}))
        return removal(table, op)

    def needs_global_amax(self, target):
        """NF4's scaler mean (and so every scaler's code) is the whole tensor's."""
        return True

    def quantize_like(self, target, hp, global_amax=None):
        to_nf4 = import_class("torchao.quantization", "to_nf4")
        return to_nf4(hp.to(target.dtype).contiguous(), target.block_size, target.scaler_block_size)
