"""Declared components of TransformerEngine tensors: what an adapter states instead of code.

A TE adapter lists its canonical components as a tuple of :class:`Component` (as torchao's
``TorchAOBaseTensor`` declares ``tensor_data_names``); ``TEAdapter`` derives its per-component
methods from it. Nothing here imports TransformerEngine: the transforms read TE's attributes by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch

from qdcp.adapters.formats import as_u8, bits_as
from qdcp.layouts import Blocked, Layout, Replicated

#: ``(logical shape, attributes) -> layout``, None for replicated
LayoutFn = Callable[[tuple[int, ...], Mapping[str, Any]], "Layout | None"]
#: ``(live TE tensor, its native buffer or None) -> canonical tensor`` (bytes; the dtype is applied after)
ToCanonical = Callable[[Any, "torch.Tensor | None"], torch.Tensor]
#: ``(canonical value, GEMM-swizzled scales) -> the native buffer's contents``
ToNative = Callable[[torch.Tensor, bool], torch.Tensor]


def blocks(*tail: int) -> LayoutFn:
    """Layout function: ``Blocked`` with one item per element along the leading dims and ``tail``
    as the blocks of the last ``len(tail)`` dims (``blocks()`` is element data, ``blocks(32)`` one
    item per 32 along rows, ``blocks(32, 1)`` one per 32 down columns of a 2-D tensor)."""
    def layout(shape: tuple[int, ...], attrs: Mapping[str, Any]) -> Layout:
        return Blocked((1,) * (len(shape) - len(tail)) + tuple(tail))
    return layout


def blocked(*block: int) -> LayoutFn:
    """Layout function: exactly ``Blocked(block)``, whatever the rank (a 2-D-only component)."""
    def layout(shape: tuple[int, ...], attrs: Mapping[str, Any]) -> Layout:
        return Blocked(tuple(block))
    return layout


@dataclasses.dataclass(frozen=True)
class Component:
    """One canonical component of a TE tensor type, declared once."""

    name: str                                   #: canonical (stored) name
    buffer: str                                 #: TE attribute holding it natively, e.g. ``_rowwise_scale_inv``
    usage: str | None = None                    #: ``"rowwise"`` / ``"columnwise"``, or None: always present
    dtype: torch.dtype | Callable[[Mapping[str, Any]], torch.dtype] = torch.uint8
    layout: LayoutFn | None = None              #: None (or None returned): replicated
    to_canonical: ToCanonical | None = None     #: None: the native buffer as it is
    to_native: ToNative | None = None           #: None: the canonical value as it is (reshaped by the copy)
    derived: tuple[tuple[str, ToNative], ...] = ()  #: other TE buffers it fills, by attribute
    in_place: Callable[[Any], bool] | None = None  #: None: no ``to_canonical`` and no derived buffer
    needs_2d: str = ""                          #: 2-D only: what ``component_names`` calls it when refusing

    def present(self, t: Any) -> bool:
        """Whether live ``t`` holds this component (its usage's data buffer is set)."""
        return self.usage is None or getattr(t, f"_{self.usage}_data", None) is not None

    def dtype_for(self, attrs: Mapping[str, Any]) -> torch.dtype:
        """The canonical dtype for a tensor with ``attrs``."""
        return self.dtype if isinstance(self.dtype, torch.dtype) else self.dtype(attrs)

    def canonical(self, t: Any, attrs: Mapping[str, Any]) -> torch.Tensor:
        """The canonical form of this component of live ``t`` (a view where no transform is declared)."""
        buf = getattr(t, self.buffer)
        value = buf if self.to_canonical is None else self.to_canonical(t, buf)
        return bits_as(value, self.dtype_for(attrs))

    def layout_for(self, t: Any, attrs: Mapping[str, Any]) -> Layout:
        """How this component of live ``t`` shards with the logical tensor."""
        lay = self.layout(tuple(t.shape), attrs) if self.layout is not None else None
        return lay if lay is not None else Replicated(tuple(getattr(t, self.buffer).shape))

    def is_in_place(self, t: Any) -> bool:
        """Whether the canonical form of this component of ``t`` *is* its native buffer."""
        if self.in_place is not None:
            return self.in_place(t)
        return self.to_canonical is None and not self.derived

    def native(self, value: torch.Tensor, swizzled: bool) -> dict[str, torch.Tensor]:
        """TE buffers (by attribute) that canonical ``value`` fills, in native form (1-byte types as
        uint8, TE's storage type); ``swizzled``: the target keeps GEMM-swizzled scales."""
        out = {self.buffer: value if self.to_native is None else self.to_native(value, swizzled)}
        out.update((attr, fn(value, swizzled)) for attr, fn in self.derived)
        return {k: as_u8(v) if v.element_size() == 1 else v for k, v in out.items()}
