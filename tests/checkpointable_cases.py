"""A tensor that takes part in DCP through its ``_Checkpointable`` protocol, not as a DTensor.

DCP asks any state-dict value for ``__create_write_items__`` (save), ``__create_chunk_list__``
(load) and ``__get_tensor_shard__`` (both): Megatron's ``CheckpointableShardedTensor`` is one such
tensor. :class:`RowBlocks` is the smallest: a wrapper of a global shape holding some row blocks of
it, each its own plain tensor (several on one process, as a rank holding several shards does).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class RowBlocks(torch.Tensor):
    """A ``shape`` tensor of which this process holds the row blocks ``blocks`` ({row offset: tensor})."""

    @staticmethod
    def __new__(cls, shape, blocks: dict[int, torch.Tensor]):
        first = next(iter(blocks.values()))
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=first.dtype, device=first.device)
        t.blocks = dict(blocks)
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return RowBlocks(args[0].shape, args[0].blocks)
        raise NotImplementedError(f"RowBlocks supports no {func}")

    def _offsets(self, row: int) -> torch.Size:
        return torch.Size([row] + [0] * (self.dim() - 1))

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, self._offsets(row), i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=self._offsets(row), sizes=block.size()),
                              properties=TensorProperties.create_from_tensor(block), size=self.shape))
                for i, (row, block) in enumerate(self.blocks.items())]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=self._offsets(row), sizes=block.size())
                for row, block in self.blocks.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.blocks[index.offset[0]]


def row_blocks(full: torch.Tensor, rows: list[int]) -> RowBlocks:
    """``full`` cut at ``rows`` (the first rows of each block), every block copied."""
    edges = list(rows) + [full.shape[0]]
    return RowBlocks(full.shape, {a: full[a:b].clone() for a, b in zip(edges, edges[1:])})
