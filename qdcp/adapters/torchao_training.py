"""Adapters for torchao's quantized-*training* weights (docs/adapters.md lists them).

- **Wrappers around a high-precision tensor** (float8 training with FSDP2 float8 all-gather, MoE
  training, int8 mixed-precision and BitNet training) quantize on the fly in their matmuls; the
  weight's values live in one plain tensor (``_tensor`` / ``_data``). :meth:`Adapter.unwrap` gives
  it: the planners store it as that plain tensor under the same key (the checkpoint DCP writes for
  the unconverted model) and load into it in place, the wrapper kept. Derived state (the
  precomputed float8 / BitNet scale, recomputed every step) is not stored.
- **Weights that hold quantized data** (``Int8QuantizedTrainingLinearWeight``,
  ``BitNetPacked2bitLinearWeight``) are stored raw with a spec, like torchao's inference types.

DCP's default async stager copies through ``new_empty``, which the wrappers answer with a plain,
uninitialised tensor; qdcp adds a same-size ``new_empty`` that builds a real wrapper
(qdcp.staging.new_empty) through ``torch.library.register_torch_dispatch``.
"""

from __future__ import annotations

import torch

from qdcp.adapters.base import Adapter
from qdcp.adapters.torchao.base import TorchAOAdapter, TorchAOClassAdapter, check_shape
from qdcp.errors import LoadMismatchError
from qdcp.layouts import Blocked, Replicated


class _WrapperAdapter(TorchAOClassAdapter):
    """A wrapper whose values are one high-precision tensor, ``inner`` (plus derived state): the
    MoE float8 / MXFP8, int8 mixed-precision and BitNet training weights (``_data``) are instances."""

    inner = "_data"

    def __init__(self, cls_name: str = "") -> None:
        self.cls_name = cls_name or self.cls_name
        super().__init__()
        self._libraries: dict[type, torch.library.Library] = {}

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
    inner = "_tensor"

    def inner_buffers(self, t):
        # its __tensor_flatten__ omits a zero precomputed scale and its __tensor_unflatten__ drops any:
        # both done here
        scale = t._precomputed_scale
        return {"_tensor": t._tensor, **({"_precomputed_scale": scale} if scale is not None else {})}

    def from_inner_buffers(self, t, buffers):
        return type(t)(buffers[self.inner], t._linear_mm_config, t._dtype, buffers.get("_precomputed_scale"))


# ----------------------------------------------------------------------------- quantized data

class Int8QuantizedTrainingWeightAdapter(TorchAOAdapter):
    """``torchao.prototype.quantized_training.Int8QuantizedTrainingLinearWeight``: int8 ``int_data``
    ``[out, in]`` and a per-row ``scale`` ``[out]`` of the weight's dtype, stored as ``[out, 1]``."""

    cls_name = "Int8QuantizedTrainingLinearWeight"

    def components(self, t):
        # views of the inner buffers, so also the native components: loads write straight into them
        return {"int_data": t.int_data, "scale": t.scale.view(-1, 1)}

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


class BitNetPacked2bitWeightAdapter(TorchAOAdapter):
    """``torchao.prototype.quantized_training.bitnet.BitNetPacked2bitLinearWeight``: four ternary
    values per int8 along each row (``int_data [M, N/4]``), one 0-d ``scale``."""

    cls_name = "BitNetPacked2bitLinearWeight"

    def layouts(self, t):
        return {"int_data": Blocked((1, 4)), "scale": Replicated(tuple(t.scale.shape))}

    def quantize_like(self, target, hp, global_amax=None):
        raise LoadMismatchError(
            f"{self.cls_name} is FSDP2's transient all-gather form of a BitNet weight; torchao has no "
            f"function that quantizes into it. Load into the BitNetTrainingLinearWeight instead.")


def builtin_adapters() -> list[Adapter]:
    """The torchao training adapters qdcp registers at its registry's first use."""
    wrappers = ("Float8TrainingWeightWrapperTensor", "MXFP8TrainingWeightWrapperTensor",
                "Int8MixedPrecisionTrainingLinearWeight", "BitNetTrainingLinearWeight")
    return [Float8TrainingWeightAdapter(), *map(_WrapperAdapter, wrappers), Int8QuantizedTrainingWeightAdapter(),
            BitNetPacked2bitWeightAdapter()]
