"""Where a state-dict value's data sits: its local tensor and that tensor's chunk of the global one.

Shared by the save and load planners: DTensors are seen through their local tensor and chunk, plain
tensors as the whole of themselves. Chunks are ``(offsets, sizes)`` tuples (:mod:`qdcp.layouts`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from qdcp.errors import AlignmentError
from qdcp.layouts import Chunk, Layout, for_shard, full_chunk, relative
from qdcp.spec import no_gc

__all__ = ["Placed", "place", "sharded_inside", "with_local", "planning", "is_empty", "relative", "expand",
           "shard_layouts"]


@dataclasses.dataclass(frozen=True)
class Placed:
    """A state-dict value seen as (local tensor, its chunk of the global tensor)."""

    local: torch.Tensor
    chunk: Chunk
    global_shape: tuple[int, ...]
    is_dtensor: bool
    whole: Chunk | None = None  # the target's whole logical tensor, where it is one member of a group


def place(value: Any) -> Placed | None:
    """Where ``value``'s data sits in its global tensor; None for non-tensors and off-mesh DTensors."""
    if isinstance(value, DTensor):
        if value.device_mesh.get_coordinate() is None:
            return None
        chunk = value.__create_chunk_list__()[0]
        return Placed(value._local_tensor, (tuple(chunk.offsets), tuple(chunk.sizes)),
                       tuple(value.shape), True)
    if isinstance(value, torch.Tensor):
        return Placed(value, full_chunk(value.shape), tuple(value.shape), False)
    return None


def sharded_inside(placed: Placed, adapter) -> bool:
    """Whether ``placed`` is a quantized tensor (not a DTensor) whose inner buffers (as its
    ``adapter`` gives them) are DTensors: torchao's ``quantize_`` applied to an already sharded model."""
    return not placed.is_dtensor and any(isinstance(b, DTensor) for b in adapter.inner_buffers(placed.local).values())


def with_local(value: Any, local: torch.Tensor) -> torch.Tensor:
    """``local`` in ``value``'s place: bare, or as the local tensor of a DTensor like ``value``."""
    if not isinstance(value, DTensor):
        return local
    # from its spec, as FSDP2 does: DTensor.from_local calls view_as, which torchao's tensors lack
    return DTensor(local, value._spec, requires_grad=local.requires_grad)


@contextlib.contextmanager
def planning():
    """Plan without routing every ``.shape``/``.dtype`` of a tensor subclass through its
    ``__torch_function__`` (planning reads metadata only; it made planning 2-4x slower), nor GC."""
    with no_gc(), torch._C.DisableTorchFunctionSubclass():
        yield


def is_empty(chunk: Chunk) -> bool:
    """Whether ``chunk`` holds no element."""
    return math.prod(chunk[1]) == 0


def expand(layouts: dict[str, Layout], shape: tuple[int, ...], chunk: Chunk) -> Chunk:
    """Smallest chunk containing ``chunk`` that is aligned to every layout."""
    for _ in range(8):
        grown = chunk
        for layout in layouts.values():
            grown = layout.expand(shape, grown)
        if grown == chunk:
            return chunk
        chunk = grown
    raise AlignmentError(f"no aligned chunk covers {chunk} in a tensor of shape {shape}")


def shard_layouts(adapter, placed: Placed, layouts: dict[str, Layout]) -> dict[str, Layout]:
    """The layouts of ``placed``'s components: its adapter's ``layouts``, where the adapter groups
    each shard's elements on its own (``groups_per_shard``) as :func:`~qdcp.layouts.for_shard`
    gives them for this shard (a column cut's groups form a grid)."""
    if not adapter.groups_per_shard or is_empty(placed.chunk):
        return layouts
    shape = tuple(placed.local.shape)
    return {n: for_shard(lay, placed.global_shape, placed.chunk, shape) for n, lay in layouts.items()}
