"""A whole checkpoint as one state dict of full tensors (what consolidation tools write).

DCP's ``dcp_to_torch_save``, accelerate's ``merge_fsdp_weights`` and Lightning's
``consolidate_checkpoint`` read without a target through DCP's ``_EmptyStateDictLoadPlanner``: on a
qdcp checkpoint a quantized entry would come out as its ``<key>.__qdcp__.*`` items. Here
:func:`consolidate` / :func:`dcp_to_torch_save` are qdcp's equivalents, and
:class:`ConsolidatingLoadPlanner` is what ``qdcp.install()`` puts in place of DCP's planner.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from qdcp import outputs
from qdcp import spec as qspec
from qdcp.checkpoint import load
from qdcp.errors import CheckpointFormatError
from qdcp.planning.load import QuantizedLoadPlanner
from qdcp.reading.entries import CheckpointEntries, read_metadata

__all__ = ["consolidate", "dcp_to_torch_save", "ConsolidatingLoadPlanner"]


def consolidate(path: str | os.PathLike, *, dequantize: bool = True) -> dict[str, Any]:
    """Every entry of the checkpoint at ``path`` (any world size's), whole, on CPU, nested as saved
    (DCP's ``dcp_to_torch_save`` state dict, quantized entries under their own keys): their values
    (``dequantize=True``, in the entry's dtype) or rebuilt as their type (the library must be
    importable). Checksums verified, objects unpickled without running code; no collective runs."""
    md = read_metadata(path)
    flat = empty_entries(md, dequantize=dequantize)
    load(flat, path, no_dist=True, allow_partial_load=True)  # a part on purpose: no warning of the rest
    if not dequantize:
        entries = CheckpointEntries(path, md)
        for key, entry in entries.specs.items():
            if entry.storage == qspec.RAW:
                flat[key] = entries.entry(key)
    return nest(flat, md)


def dcp_to_torch_save(dcp_checkpoint_dir: str | os.PathLike, torch_save_path: str | os.PathLike, *,
                      dequantize: bool = True, overwrite: bool = False) -> dict[str, Any]:
    """DCP's ``dcp_to_torch_save`` for qdcp checkpoints: :func:`consolidate` written with
    ``torch.save``; returns the state dict written. Unlike DCP's, a path that is, holds or lies
    inside the checkpoint is refused, and an existing file unless ``overwrite=True``
    (:class:`~qdcp.outputs.OutputError` before anything is read); written through scratch beside it."""
    outputs.check_separate([dcp_checkpoint_dir], torch_save_path)
    outputs.clean(torch_save_path, "torch")  # what a killed conversion to the same file left
    out = os.fspath(torch_save_path)
    if os.path.lexists(out) and not (overwrite and os.path.isfile(out) and not os.path.islink(out)):
        why = "is not a file" if os.path.isdir(out) or os.path.islink(out) else \
            "exists; it is replaced only with overwrite=True (a torch.save file does not say who wrote it)"
        raise outputs.OutputError(f"{out!r} {why}. Move it away or choose another path")
    state = consolidate(dcp_checkpoint_dir, dequantize=dequantize)
    with outputs.writing_file("torch", out, ".pt.tmp") as tmp:
        torch.save(state, tmp)
    return state


def empty_entries(md: Metadata, *, dequantize: bool = True, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """``{flat key: target}`` for every entry of ``md``: an empty tensor of each tensor entry (a raw
    one's logical shape and dtype; left out unless ``dequantize``), ``None`` for objects. ``keys``:
    only those named or under one named (as DCP's ``_EmptyStateDictLoadPlanner(keys=)``)."""
    specs = qspec.read_specs(md)
    wanted = None if keys is None else set(keys)
    out: dict[str, Any] = {}
    for key in qspec.entry_keys(md.state_dict_metadata, specs):
        if qspec.COMPONENT_SEPARATOR in key:  # a save never writes such a key but as a spec's component
            raise CheckpointFormatError(
                f"{qspec.describe_item(key)}: a qdcp component item that no spec entry lists: the checkpoint's "
                f"spec is damaged or missing (restore it from a good copy; `qdcp verify` lists every problem)")
        entry, item = specs.get(key), md.state_dict_metadata.get(key)
        if not _included(key, md, wanted):
            continue
        if entry is not None and entry.storage == qspec.RAW:
            if dequantize:
                out[key] = torch.empty(tuple(entry.shape), dtype=entry.dtype)
        elif item is not None:
            out[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype) \
                if isinstance(item, TensorStorageMetadata) else None
    return out


def _included(key: str, md: Metadata, wanted: set[str] | None) -> bool:
    """Whether ``key`` (a flat key) or one of its parents (by the saved nesting) is in ``wanted``."""
    if wanted is None or key in wanted:
        return True
    path = _path(key, md)
    return any(".".join(str(p) for p in path[:i]) in wanted for i in range(1, len(path)))


def _path(key: str, md: Metadata) -> tuple:
    """The nesting a flat key was saved from (DCP records it in ``planner_data``), else the key."""
    mapping = md.planner_data if isinstance(md.planner_data, Mapping) else {}
    path = mapping.get(key)
    return tuple(path) if isinstance(path, (tuple, list)) and path else (key,)


def nest(flat: Mapping[str, Any], md: Metadata, into: dict | None = None) -> dict[str, Any]:
    """``flat`` nested as the checkpoint's state dict was (dicts for names, lists for indices), as
    DCP's own load puts values back into a nested state dict."""
    root: dict = {} if into is None else into
    for key, value in flat.items():
        set_element(root, _path(key, md), value)
    return root


class ConsolidatingLoadPlanner(QuantizedLoadPlanner):
    """DCP's ``_EmptyStateDictLoadPlanner`` for qdcp checkpoints: fills an empty state dict with every
    entry, quantized ones dequantized under their own keys. DCP's arguments (``keys``) plus
    :class:`QuantizedLoadPlanner`'s."""

    def __init__(self, keys: Iterable[str] | None = None, *args: Any, **kwargs: Any) -> None:
        self.keys = keys
        super().__init__(*args, **kwargs)

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        """Build ``state_dict`` (empty) from ``metadata``, then plan as qdcp's load planner."""
        if state_dict:
            raise ValueError("ConsolidatingLoadPlanner fills an empty state dict; it was given one with "
                             f"keys {sorted(state_dict)[:5]}")
        if metadata is None:
            raise ValueError("ConsolidatingLoadPlanner needs the checkpoint's metadata")
        nest(empty_entries(metadata, keys=self.keys), metadata, into=state_dict)
        super().set_up_planner(state_dict, metadata, is_coordinator)
