"""What every torchao adapter shares: :class:`TorchAOAdapter`, one class declaring its data as
``TorchAOBaseTensor`` does. Classes are recognised by module prefix and class name; torchao is
imported only where a stored entry needs its classes, and only from fixed paths (:data:`CLASS_PATHS`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from typing import Any, Callable, Mapping

import torch

from qdcp.adapters.base import OpRegisteringAdapter, TraceableAdapter
from qdcp.errors import LoadMismatchError, UnsupportedTensorError

CLASS_PATHS: dict[str, str] = {
    "Int8Tensor": "torchao.quantization",
    "Float8Tensor": "torchao.quantization",
    "IntxUnpackedToInt8Tensor": "torchao.quantization",
    "NF4Tensor": "torchao.quantization",
    "MXTensor": "torchao.prototype.mx_formats.mx_tensor",
    "NVFP4Tensor": "torchao.prototype.mx_formats.nvfp4_tensor",
    "OptimState8bit": "torchao.optim.subclass_8bit",
    "OptimState4bit": "torchao.optim.subclass_4bit",
    "OptimStateFp8": "torchao.optim.subclass_fp8",
    "Int8QuantizedTrainingLinearWeight": "torchao.prototype.quantized_training.int8",
    "BitNetPacked2bitLinearWeight": "torchao.prototype.quantized_training.bitnet",
    "WeightWithDynamicFloat8CastTensor": "torchao.float8.fsdp_utils",
    "Float8TrainingWeightWrapperTensor": "torchao.prototype.moe_training.tensor",
    "MXFP8TrainingWeightWrapperTensor": "torchao.prototype.moe_training.tensor",
    "Int8MixedPrecisionTrainingLinearWeight": "torchao.prototype.quantized_training.int8_mixed_precision",
    "BitNetTrainingLinearWeight": "torchao.prototype.quantized_training.bitnet",
}

# Enums and records that may appear in torchao attributes: class name -> (module, attribute).
_ATTRIBUTE_CLASSES: dict[str, str] = {
    "KernelPreference": "torchao.quantization.quantize_.common.kernel_preference",
    "MappingType": "torchao.quantization.quant_primitives",
    "Float8MMConfig": "torchao.float8.inference",
    "QuantizeTensorToInt8Kwargs": "torchao.quantization.quantize_.workflows.int8.int8_tensor",
    "QuantizeTensorToFloat8Kwargs": "torchao.quantization.quantize_.workflows.float8.float8_tensor",
    "IntxUnpackedToInt8TensorActivationQuantization":
        "torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor",
    "PerTensor": "torchao.quantization.granularity",
    "PerRow": "torchao.quantization.granularity",
    "PerAxis": "torchao.quantization.granularity",
    "PerGroup": "torchao.quantization.granularity",
    "PerToken": "torchao.quantization.granularity",
    "PerBlock": "torchao.quantization.granularity",
    "ScaleCalculationMode": "torchao.prototype.mx_formats.config",
    "QuantizeTensorToMXKwargs": "torchao.prototype.mx_formats.mx_tensor",
    "QuantizeTensorToNVFP4Kwargs": "torchao.prototype.mx_formats.nvfp4_tensor",
}


def import_class(module: str, name: str) -> Any:
    """``module.name`` (a torchao class or function), or an error naming torchao 0.18 to install."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UnsupportedTensorError(
            f"torchao type {name} is needed but cannot be imported from {module} ({e}); "
            f"install torchao 0.18 (pip install 'qdcp[torchao]')") from None


def removal(table: dict, op: Any) -> Callable[[], None]:
    """What :meth:`~qdcp.adapters.base.OpRegisteringAdapter.add_op` returns for an entry it put in a
    library's op ``table``: a callable that removes it, unless something replaced it since."""
    handler = table[op]

    def remove() -> None:
        if table.get(op) is handler:
            del table[op]
    return remove


class TorchAOClassAdapter(TraceableAdapter, OpRegisteringAdapter):
    """One torchao class, recognised by name under the ``torchao`` package and imported (only when
    an entry must be rebuilt) from :data:`CLASS_PATHS`. Subclasses set :attr:`cls_name`."""

    cls_name: str = ""

    def __init__(self) -> None:
        self.type_names = (f"torchao.{self.cls_name}",)

    def matches(self, cls: type) -> bool:
        return cls.__name__ == self.cls_name and cls.__module__.split(".")[0] == "torchao"

    def tensor_class(self) -> type:
        return import_class(CLASS_PATHS[self.cls_name], self.cls_name)

    def loaded_classes(self):
        cls = getattr(sys.modules.get(CLASS_PATHS[self.cls_name]), self.cls_name, None)
        return [cls] if isinstance(cls, type) and self.matches(cls) else []


class TorchAOAdapter(TorchAOClassAdapter):
    """One torchao class that declares its data as ``TorchAOBaseTensor`` does; subclasses set
    :attr:`cls_name` and implement :meth:`layouts` and :meth:`quantize_like`."""

    def allow_pickled(self, qualified_name: str) -> bool:
        """A pickled ``torchao...<cls_name>`` (stock DCP's save of this type): its class imported from
        :data:`CLASS_PATHS` (torchao allows its own classes in weights-only loads on import)."""
        module, _, name = qualified_name.rpartition(".")
        if name != self.cls_name or module.split(".")[0] != "torchao":
            return False
        self.tensor_class()
        return True

    def add_op(self, cls, op, impl):
        """Through ``TorchAOBaseTensor.implements``: torchao's per-class table of aten ops."""
        table = getattr(cls, "_ATEN_OP_TABLE", {}).get(cls)
        if table is None or op in table or not hasattr(cls, "implements"):
            return None
        cls.implements(op)(lambda func, types, args, kwargs: impl(func, args, kwargs))
        return removal(table, op)

    def attribute_classes(self) -> Mapping[str, type]:
        return _attribute_classes()

    # --- what ``TorchAOBaseTensor.__tensor_flatten__`` derives from the class's declared lists: the
    # data names (the optional ones where set) and the attributes by name
    def component_names(self, t):
        return list(t.__tensor_flatten__()[0])

    def attributes(self, t):
        return dict(t.__tensor_flatten__()[1])

    def dequantize(self, t, dtype=None):
        """torchao's ``dequantize``, computed in ``dtype`` where the class takes an ``output_dtype``
        that wide (else in the widest it takes, float32), then cast to ``dtype``."""
        if dtype is None or dtype == t.dtype or not _takes_output_dtype(type(t)):
            out = t.dequantize()
            return out if dtype is None else out.to(dtype)
        for work in dict.fromkeys((dtype, torch.float32)):
            if (type(t), work) in _REFUSED_OUTPUT or work.itemsize <= t.dtype.itemsize:
                continue
            try:
                return t.dequantize(output_dtype=work).to(dtype)
            except (AssertionError, ValueError, RuntimeError, NotImplementedError):
                _REFUSED_OUTPUT.add((type(t), work))  # e.g. dequantize_affine refuses float64
        return t.dequantize().to(dtype)

    def rebuild(self, stored):
        cls = self.tensor_class()
        out = cls.__tensor_unflatten__(dict(stored.components), dict(stored.attrs), torch.Size(stored.shape), None)
        check_shape(out, stored.shape, self.cls_name)
        return out


@functools.cache
def _attribute_classes() -> dict[str, type]:
    """The classes of :data:`_ATTRIBUTE_CLASSES` that this torchao has."""
    found = {}
    for name, module in _ATTRIBUTE_CLASSES.items():
        try:
            found[name] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            pass
    return found


_REFUSED_OUTPUT: set[tuple[type, torch.dtype]] = set()


@functools.cache
def _takes_output_dtype(cls: type) -> bool:
    """Whether ``cls.dequantize`` takes an ``output_dtype`` argument (torchao's newer classes do)."""
    try:
        return "output_dtype" in inspect.signature(cls.dequantize).parameters
    except (TypeError, ValueError):
        return False


def check_shape(out: torch.Tensor, shape, cls_name: str) -> None:
    """Refuse a rebuilt tensor whose shape is not the stored logical shape."""
    if tuple(out.shape) != tuple(shape):
        raise LoadMismatchError(f"rebuilt {cls_name} has shape {tuple(out.shape)}, expected {tuple(shape)}")
