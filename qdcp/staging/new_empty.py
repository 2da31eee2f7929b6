"""Same-size ``new_empty`` for quantized tensor classes whose library has none (docs/api.md).

DCP's default async stager copies a tensor that owns no storage as ``x.new_empty(x.size(),
device="cpu")`` plus a deep copy of ``x.__dict__``; torchao's classes implement no ``new_empty``,
so that fails before anything is written. :func:`register_new_empty` adds one, through the
library's own op registry, for each class a registered adapter handles that lacks it: only the
tensor's own size and dtype, an instance over new uninitialised inner buffers (any other request
raises ``NotImplementedError`` as before); an implementation the library has is never replaced.
Registered at the first use of qdcp's API and by each :class:`qdcp.QuantizedSavePlanner` (for classes imported since);
``QDCP_FILL_NEW_EMPTY=0`` before importing qdcp, or :func:`unregister_new_empty`, turns it off.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import torch

from qdcp.adapters.base import Adapter, OpRegisteringAdapter, all_adapters

__all__ = ["register_new_empty", "unregister_new_empty", "enable_new_empty", "filled_classes"]

ENV_VAR = "QDCP_FILL_NEW_EMPTY"

_lock = threading.Lock()
_removers: dict[type, Callable[[], None]] = {}  # class -> undo of the registration qdcp made
_refused: set[type] = set()                     # classes whose library implements new_empty itself
_disabled = False


def _same_size_new_empty(adapter: Adapter) -> Callable[..., Any]:
    def new_empty(func, args, kwargs) -> torch.Tensor:
        self, size = args[0], tuple(args[1]) if len(args) > 1 else tuple(kwargs.get("size", ()))
        dtype, layout = kwargs.get("dtype"), kwargs.get("layout")
        if size != tuple(self.shape) or dtype not in (None, self.dtype) or layout not in (None, torch.strided):
            raise NotImplementedError(
                f"{type(self).__name__} dispatch: {func} is implemented (by qdcp, for DCP's async "
                f"stager) only for the tensor's own size {tuple(self.shape)} and dtype {self.dtype}; "
                f"got size {size}, dtype {dtype}. To stage quantized tensors for dcp.async_save, "
                f"pass async_stager=qdcp.QuantizedStager().")
        device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else self.device
        pin = bool(kwargs.get("pin_memory")) and device.type == "cpu"
        with torch._C.DisableTorchFunctionSubclass():
            buffers = {name: torch.empty_like(b, device=device, pin_memory=pin)
                       for name, b in adapter.inner_buffers(self).items()}
        return adapter.from_inner_buffers(self, buffers)
    return new_empty


def register_new_empty() -> list[type]:
    """Add a same-size ``new_empty`` to every already-imported class a registered adapter handles
    whose library lacks one. Idempotent; returns the classes filled by this call."""
    if _disabled or os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        return []
    filled = []
    with _lock:
        for adapter in all_adapters():
            if not isinstance(adapter, OpRegisteringAdapter):
                continue
            for cls in adapter.loaded_classes():
                if cls in _removers or cls in _refused:
                    continue
                remove = adapter.add_op(cls, torch.ops.aten.new_empty.default, _same_size_new_empty(adapter))
                if remove is None:
                    _refused.add(cls)
                else:
                    _removers[cls] = remove
                    filled.append(cls)
    return filled


def unregister_new_empty() -> None:
    """Remove every ``new_empty`` qdcp added, and stop adding them (until :func:`enable_new_empty`)."""
    global _disabled
    with _lock:
        _disabled = True
        for remove in _removers.values():
            remove()
        _removers.clear()
        _refused.clear()


def enable_new_empty() -> list[type]:
    """Undo :func:`unregister_new_empty` (unless ``QDCP_FILL_NEW_EMPTY=0``) and register again."""
    global _disabled
    with _lock:
        _disabled = False
    return register_new_empty()


def filled_classes() -> list[type]:
    """The classes that currently use qdcp's ``new_empty``."""
    with _lock:
        return list(_removers)
