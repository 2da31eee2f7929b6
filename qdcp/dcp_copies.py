"""DCP's own logic, reproduced where DCP has no extension point for what qdcp needs.

Each function says what it copies and why; everything else of qdcp uses DCP through its public
planner and storage interfaces. The private torch names these need are listed in docs/versions.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from qdcp.layouts import Chunk

__all__ = ["pre_2_4_state_dict", "read_items"]


def pre_2_4_state_dict(metadata: Metadata, state_dict: dict, original_state_dict: Any,
                       present: set[str]) -> tuple[dict, dict] | None:
    """``DefaultLoadPlanner.create_local_plan``'s fallback for checkpoints saved before torch 2.4
    (other flattened key names): the state dict flattened the old way and its mappings, where the
    checkpoint has keys neither ``state_dict`` nor ``present`` account for that the old flattening
    gives; None otherwise. Copied because DCP's version counts only its own state dict's keys as
    present, and qdcp's planner takes its quantized keys out of that dict."""
    missing = set(metadata.state_dict_metadata) - set(state_dict) - present
    if not missing:
        return None
    _version._derived_version = "2_3"
    try:
        old_state_dict, old_mappings = flatten_state_dict(original_state_dict)
    finally:
        _version._derived_version = None
    return (old_state_dict, old_mappings) if set(old_state_dict) & missing else None


def read_items(fqn: str, item_md: TensorStorageMetadata, chunk: Chunk) -> list[ReadItem]:
    """DCP's reads of ``chunk`` of item ``fqn`` (``create_read_items_for_chunk_list``); the common
    case -- one saved chunk that is exactly the one needed -- made directly, without DCP's general
    overlap sweep (which dominated load planning of many small entries)."""
    saved = item_md.chunks
    if len(saved) == 1 and tuple(saved[0].offsets) == chunk[0] and tuple(saved[0].sizes) == chunk[1]:
        offsets = torch.Size(chunk[0])
        zeros = torch.Size([0] * len(chunk[0]))
        return [ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, offsets, 0),
                         dest_offsets=zeros, storage_index=MetadataIndex(fqn, offsets, 0),
                         storage_offsets=zeros, lengths=torch.Size(chunk[1]))]
    return create_read_items_for_chunk_list(
        fqn, item_md, [ChunkStorageMetadata(torch.Size(chunk[0]), torch.Size(chunk[1]))])
