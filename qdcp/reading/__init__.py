"""Reading a checkpoint without a target: ``entries`` (:class:`CheckpointEntries`, one entry at a
time), ``describe`` (``qdcp inspect``), ``verify`` (``qdcp verify``'s checks) and ``consolidate``
(the whole checkpoint as one state dict).
"""

from qdcp.reading.consolidate import ConsolidatingLoadPlanner, consolidate, dcp_to_torch_save
from qdcp.reading.describe import describe
from qdcp.reading.entries import CheckpointEntries, read_entry, read_metadata, read_stored
from qdcp.reading.verify import check_chunks, check_components, check_entry, check_storage

__all__ = ["read_metadata", "CheckpointEntries", "read_stored", "read_entry", "describe", "check_chunks",
           "check_storage", "check_components", "check_entry", "consolidate", "dcp_to_torch_save",
           "ConsolidatingLoadPlanner"]
