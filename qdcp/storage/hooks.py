"""The contract between qdcp's planners and qdcp's storage, beside DCP's own protocols.

DCP's ``SavePlanner`` / ``LoadPlanner`` and ``StorageWriter`` / ``StorageReader`` talk through
``resolve_data``, ``resolve_tensor``, ``commit_tensor`` and ``load_bytes``. qdcp's storage asks a
planner for a few more things, stated here as ``runtime_checkable`` protocols (as DCP states
``AsyncStager``); a planner that is none of them gets DCP's behaviour (every item verified by the
reader and copied into ``resolve_tensor``'s buffer; the writer's own checksums on).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["VerifyingLoadPlanner", "ReportingLoadPlanner", "AdoptingLoadPlanner", "ChecksummingSavePlanner",
           "verifies_whole_items", "records_checksums"]


@runtime_checkable
class VerifyingLoadPlanner(Protocol):
    """A load planner that checks the items it reads whole against the checkpoint's checksums
    (:class:`qdcp.QuantizedLoadPlanner`). :class:`qdcp.CheckpointReader` checks those items itself,
    where the bytes are hot, and tells it."""

    @property
    def verifies_whole_items(self) -> bool:
        """Whether it checks them in this load (it has the checkpoint's checksums)."""

    def note_verified(self, read_item: ReadItem) -> None:
        """The reader checks ``read_item`` against its recorded checksum before it commits it (it
        says so before asking ``resolve_tensor``): not to be hashed again."""


@runtime_checkable
class ReportingLoadPlanner(Protocol):
    """A load planner that can say what a load has changed in its targets so far
    (:class:`qdcp.QuantizedLoadPlanner`): :class:`qdcp.CheckpointReader` says it in the error for a
    stored item whose bytes do not match their checksum."""

    def changed_note(self, read_item: ReadItem, written: bool) -> str:
        """What the load has changed so far, ``read_item``'s bytes included if ``written`` (copied
        into ``resolve_tensor``'s buffer before they were found corrupt)."""


@runtime_checkable
class AdoptingLoadPlanner(Protocol):
    """A load planner that keeps stored items as loaded, in memory it offers (qdcp's entry reader)."""

    def buffer_for(self, read_item: ReadItem, nbytes: int) -> torch.Tensor | None:
        """Memory to read a stored item into (a contiguous CPU uint8 tensor of ``nbytes``), or None."""

    def adopt_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> bool:
        """Keep ``tensor`` (the item as loaded, verified, possibly a view of :meth:`buffer_for`'s
        memory); False: the reader copies it into ``resolve_tensor``'s buffer, as DCP's does."""


@runtime_checkable
class ChecksummingSavePlanner(Protocol):
    """A save planner that records every item's checksum in the checkpoint's metadata
    (:class:`qdcp.QuantizedSavePlanner`): :class:`qdcp.CheckpointWriter` adds none of its own."""

    @property
    def records_checksums(self) -> bool:
        """Whether it records them in this save."""


def verifies_whole_items(planner) -> bool:
    """Whether ``planner`` checks the items it reads whole itself (:class:`VerifyingLoadPlanner`)."""
    return isinstance(planner, VerifyingLoadPlanner) and bool(planner.verifies_whole_items)


def records_checksums(planner) -> bool:
    """Whether ``planner`` records every item's checksum (:class:`ChecksummingSavePlanner`)."""
    return isinstance(planner, ChecksummingSavePlanner) and bool(planner.records_checksums)
