"""Adapters for torchao's quantized-*training* weights.

Two kinds:

- **Wrappers around a high-precision tensor** -- float8 training with FSDP2 float8 all-gather
  (``torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor``), MoE training
  (``Float8TrainingWeightWrapperTensor``, ``MXFP8TrainingWeightWrapperTensor``), int8
  mixed-precision and BitNet training. They quantize on the fly in their matmuls; the weight's
  values live in one plain tensor (``_tensor`` / ``_data``). :meth:`Adapter.unwrap` gives it: the
  planners store it as that plain tensor under the same key (the checkpoint DCP writes for the
  unconverted model) and load into it in place, the wrapper kept. Derived state (the precomputed
  float8 / BitNet scale, recomputed every step) is not stored.
- **Weights that hold quantized data** -- ``Int8QuantizedTrainingLinearWeight`` (int8 rows and a
  per-row scale) and ``BitNetPacked2bitLinearWeight`` (four ternary values per byte and one scale):
  stored raw with a spec, like torchao's inference types.

DCP's default async stager copies a tensor through ``new_empty``: the wrappers answer it with a
plain, uninitialised tensor (their dispatch unwraps every op it does not list), which DCP then
writes. qdcp fills a same-size ``new_empty`` that builds a real wrapper (see qdcp.staging.new_empty):
through ``torch.library.register_torch_dispatch`` for the wrappers (their own ``__torch_dispatch__``
has no op table) and through ``TorchAOBaseTensor.implements`` for the int8 weight.
"""

from __future__ import annotations

import sys

import torch

from qdcp.adapters.base import Adapter, OpRegisteringAdapter
from qdcp.adapters.torchao import TorchAOAdapter, check_shape
from qdcp.errors import LoadMismatchError
from qdcp.layouts import Blocked, Replicated


class _TrainingAdapter(Adapter, OpRegisteringAdapter):
    """One torchao training class, found by name under a fixed module (nothing is imported)."""

    cls_name = ""
    module = ""

    def __init__(self) -> None:
        self.type_names = (f"torchao.{self.cls_name}",)
        self._libraries: dict[type, torch.library.Library] = {}

    def matches(self, cls: type) -> bool:
        return cls.__name__ == self.cls_name and cls.__module__.split(".")[0] == "torchao"

    def type_name(self, t):
        return self.type_names[0]

    def loaded_classes(self):
        cls = getattr(sys.modules.get(self.module), self.cls_name, None)
        return [cls] if isinstance(cls, type) and self.matches(cls) else []


class _WrapperAdapter(_TrainingAdapter):
    """A wrapper whose values are one high-precision tensor, ``inner`` (plus derived state)."""

    inner = "_data"
    derived: tuple[str, ...] = ()  # optional derived tensors kept by staging and offloading

    def unwrap(self, t):
        return getattr(t, self.inner)

    def component_names(self, t):
        return [self.inner]

    def attributes(self, t):
        return {}

    def layouts(self, t):
        return {self.inner: Blocked((1,) * t.ndim)}

    def dequantize(self, t, dtype=None):
        inner = self.unwrap(t)
        return inner if dtype is None else inner.to(dtype)

    def inner_buffers(self, t):
        out = {self.inner: self.unwrap(t)}
        for name in self.derived:
            if isinstance(getattr(t, name, None), torch.Tensor):
                out[name] = getattr(t, name)
        return out

    def from_inner_buffers(self, t, buffers):
        names, ctx = t.__tensor_flatten__()
        return type(t).__tensor_unflatten__(dict(buffers), ctx, t.shape, t.stride())

    def add_op(self, cls, op, impl):
        """Through ``torch.library.register_torch_dispatch``, which the wrapper's own
        ``__torch_dispatch__`` defers to; removed again when the library is dropped."""
        if cls in self._libraries:
            return None
        lib = torch.library.Library("aten", "FRAGMENT")
        torch.library.register_torch_dispatch(op, cls, lambda _cls, func, types, args, kwargs:
                                              impl(func, args, kwargs), lib=lib)
        self._libraries[cls] = lib

        def remove() -> None:
            # the Library's finalizer takes its registrations back when the last reference goes
            self._libraries.pop(cls, None)
        return remove

    def rebuild(self, stored):
        raise LoadMismatchError(f"{self.cls_name} entries are stored as plain tensors; there is "
                                f"nothing to rebuild")

    def quantize_like(self, target, hp, global_amax=None):
        raise LoadMismatchError(f"{self.cls_name} holds no quantized data; load into its inner tensor")


class Float8TrainingWeightAdapter(_WrapperAdapter):
    """``torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor``: float8 training with FSDP2
    float8 all-gather (``_tensor``; the precomputed scale is derived state)."""

    cls_name = "WeightWithDynamicFloat8CastTensor"
    module = "torchao.float8.fsdp_utils"
    inner = "_tensor"
    derived = ("_precomputed_scale",)

    def from_inner_buffers(self, t, buffers):
        # its __tensor_unflatten__ drops the precomputed scale: build it directly
        return type(t)(buffers[self.inner], t._linear_mm_config, t._dtype, buffers.get("_precomputed_scale"))


class MoEFloat8TrainingWeightAdapter(_WrapperAdapter):
    """``torchao.prototype.moe_training.tensor.Float8TrainingWeightWrapperTensor`` (``_data``)."""

    cls_name = "Float8TrainingWeightWrapperTensor"
    module = "torchao.prototype.moe_training.tensor"


class MoEMXFP8TrainingWeightAdapter(_WrapperAdapter):
    """``torchao.prototype.moe_training.tensor.MXFP8TrainingWeightWrapperTensor`` (``_data``)."""

    cls_name = "MXFP8TrainingWeightWrapperTensor"
    module = "torchao.prototype.moe_training.tensor"


class Int8MixedPrecisionTrainingWeightAdapter(_WrapperAdapter):
    """``torchao.prototype.quantized_training.Int8MixedPrecisionTrainingLinearWeight`` (``_data``)."""

    cls_name = "Int8MixedPrecisionTrainingLinearWeight"
    module = "torchao.prototype.quantized_training.int8_mixed_precision"


class BitNetTrainingWeightAdapter(_WrapperAdapter):
    """``torchao.prototype.quantized_training.BitNetTrainingLinearWeight`` (``_data``; the
    precomputed scale is derived state)."""

    cls_name = "BitNetTrainingLinearWeight"
    module = "torchao.prototype.quantized_training.bitnet"
    derived = ("_precomputed_scale",)


# ----------------------------------------------------------------------------- quantized data

class _QuantizedTrainingAdapter(TorchAOAdapter):
    """A TorchAOBaseTensor of torchao's quantized training (``int_data`` and ``scale``, no attributes)."""

    def component_names(self, t):
        return ["int_data", "scale"]

    def attributes(self, t):
        return {}

    def from_inner_buffers(self, t, buffers):
        return type(t)(buffers["int_data"], buffers["scale"])


class Int8QuantizedTrainingWeightAdapter(_QuantizedTrainingAdapter):
    """``torchao.prototype.quantized_training.Int8QuantizedTrainingLinearWeight``: int8 ``int_data``
    ``[out, in]`` and a per-row ``scale`` ``[out]`` of the weight's dtype, stored as ``[out, 1]``."""

    cls_name = "Int8QuantizedTrainingLinearWeight"

    def components(self, t):
        return {"int_data": t.int_data, "scale": t.scale.view(-1, 1)}

    def native_components(self, t):
        return self.components(t)  # views of the inner buffers: loads write straight into them

    def inner_buffers(self, t):
        return {"int_data": t.int_data, "scale": t.scale}

    def layouts(self, t):
        return {"int_data": Blocked((1, 1)), "scale": Blocked((1, t.shape[1]))}

    def rebuild(self, stored):
        comps = stored.components
        out = self.tensor_class()(comps["int_data"], comps["scale"].reshape(-1).to(stored.dtype))
        check_shape(out, stored.shape, self.cls_name)
        return out

    def quantize_like(self, target, hp, global_amax=None):
        # from_float rounds to nearest (the in-place copy_ would round stochastically)
        return type(target).from_float(hp.to(target.dtype))

    def copy_into(self, target, components):
        native = self.components(target)
        for name, value in components.items():
            native[name].copy_(value)


class BitNetPacked2bitWeightAdapter(_QuantizedTrainingAdapter):
    """``torchao.prototype.quantized_training.bitnet.BitNetPacked2bitLinearWeight``: four ternary
    values per int8 along each row (``int_data [M, N/4]``), one 0-d ``scale``."""

    cls_name = "BitNetPacked2bitLinearWeight"

    def layouts(self, t):
        return {"int_data": Blocked((1, 4)), "scale": Replicated(tuple(t.scale.shape))}

    def rebuild(self, stored):
        out = self.tensor_class()(stored.components["int_data"], stored.components["scale"])
        check_shape(out, stored.shape, self.cls_name)
        return out

    def quantize_like(self, target, hp, global_amax=None):
        raise LoadMismatchError(
            f"{self.cls_name} is FSDP2's transient all-gather form of a BitNet weight; torchao has no "
            f"function that quantizes into it. Load into the BitNetTrainingLinearWeight instead.")


def builtin_adapters() -> list[Adapter]:
    """The torchao training adapters qdcp registers at import."""
    return [Float8TrainingWeightAdapter(), MoEFloat8TrainingWeightAdapter(), MoEMXFP8TrainingWeightAdapter(),
            Int8MixedPrecisionTrainingWeightAdapter(), BitNetTrainingWeightAdapter(),
            Int8QuantizedTrainingWeightAdapter(), BitNetPacked2bitWeightAdapter()]
