"""DCP's own logic, reproduced where DCP has no extension point for what qdcp needs; each function
says what it copies and why. The save planner's riders (per-rank data sent beside a plan in
``SavePlan.planner_data``) live here with DCP's plan caching, which must not see them. The private
names used are listed, with why, in docs/versions.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from qdcp.layouts import Chunk

__all__ = ["pre_2_4_state_dict", "read_items", "local_save_plan", "take_riders"]


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


def local_save_plan(planner: DefaultSavePlanner, plan: SavePlan, rider_key: str, rider: Any) -> SavePlan:
    """``DefaultSavePlanner.create_local_plan``'s return for ``plan``, which qdcp built itself, with
    ``rider`` (this save's data, never part of what plan caching compares) under ``rider_key`` of its
    ``planner_data``. With plan caching on: where the last save cached an equal plan (items and
    planner_data; DCP's own compares items only, qdcp's spec text rides in planner_data), DCP's empty,
    unusable plan, carrying only the rider; else ``plan`` is kept pending, for DCP's ``finish_plan``
    to cache. Copied because DCP's builds the plan itself and has no place for a rider."""
    if planner._enable_plan_caching:
        cached = SavePlanner._cached_save_plan.get(planner._cached_plans_key)
        if cached is not None and cached.items == plan.items and cached.planner_data == plan.planner_data:
            return SavePlan([], planner_data={rider_key: rider}, usable=False)
        planner._pending_local_plan = plan
    return dataclasses.replace(plan, planner_data={**plan.planner_data, rider_key: rider})


def take_riders(plans: list[SavePlan], key: str) -> list[Any]:
    """Each plan's rider under ``key`` (None where it has none), taken out of its ``planner_data``
    in place: DCP's plan caching keeps these plans and compares later ones with them."""
    return [(plan.planner_data or {}).pop(key, None) for plan in plans]
