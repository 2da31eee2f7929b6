"""Tensors that name their own chunks to DCP, and copies of them.

DCP asks every state-dict value whether it implements ``__create_write_items__`` (save),
``__create_chunk_list__`` (load) and ``__get_tensor_shard__`` (both): its ``_Checkpointable``
protocol, which DTensor implements and other tensors may (Megatron's
``CheckpointableShardedTensor``: a global shape and offsets without a DTensor). qdcp's planners
leave such a tensor to DCP, as DCP's own planners do; where qdcp must *copy* one (the stager, the
shadows of an all-or-nothing load) it makes a :class:`ChunkCopies`: the same chunks, each a plain
tensor of its own, answering the same protocol.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.tensor import DTensor

__all__ = ["ChunkCopies", "names_own_chunks"]


def names_own_chunks(value: Any) -> bool:
    """Whether ``value`` is a tensor, other than a DTensor, that tells DCP its own chunks."""
    cls = type(value)
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
        and all(hasattr(cls, m) for m in ("__create_chunk_list__", "__get_tensor_shard__"))


class ChunkCopies(torch.Tensor):
    """A tensor of another's global shape holding copies of the chunks it held, as DCP sees them:
    ``__create_write_items__`` gives the original's write items (for the fqn DCP asks about),
    ``__create_chunk_list__`` its chunks, ``__get_tensor_shard__`` a copy, found by offset."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, chunks: list[tuple[torch.Size, torch.Tensor]],
                items: list[WriteItem] | None = None):
        device = chunks[0][1].device if chunks else like.device  # where the copies live
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=device)
        t.chunks = chunks
        t.items = items
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(f"qdcp's ChunkCopies (a staged or shadow copy) supports no {func}")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        if self.items is None:
            raise NotImplementedError("these chunk copies are a load's shadow: nothing to write")
        return [dataclasses.replace(i, index=dataclasses.replace(i.index, fqn=fqn)) for i in self.items]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=chunk.size()) for offsets, chunk in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, chunk in self.chunks:
            if offsets == index.offset:
                return chunk
        raise ValueError(f"no chunk at offset {tuple(index.offset)} for {index.fqn!r}")

    def __repr__(self) -> str:
        return f"ChunkCopies(shape={tuple(self.shape)}, chunks={[tuple(o) for o, _ in self.chunks]})"


def staged_copy(value: torch.Tensor, fqn: str, copy: Callable[[torch.Tensor, int], torch.Tensor]) -> ChunkCopies:
    """What an async save stages for ``value``: each chunk its write items name, ``copy(chunk, i)``."""
    items = value.__create_write_items__(fqn, value)
    chunks = [(i.index.offset, copy(value.__get_tensor_shard__(i.index), n)) for n, i in enumerate(items)]
    return ChunkCopies(value, chunks, items)


def shadow_of(value: torch.Tensor, fqn: str) -> tuple[dict[str, torch.Tensor], ChunkCopies]:
    """``(value's chunks by name, new chunks like them)``: the shadow of an all-or-nothing load's
    target (their values left to the caller; ``ChunkCopies.chunks`` in the same order)."""
    real = {str(n): (c.offsets, value.__get_tensor_shard__(MetadataIndex(fqn, c.offsets, n)))
            for n, c in enumerate(value.__create_chunk_list__())}
    copies = ChunkCopies(value, [(offsets, torch.empty_like(t.detach())) for offsets, t in real.values()])
    return {k: t for k, (_, t) in real.items()}, copies
