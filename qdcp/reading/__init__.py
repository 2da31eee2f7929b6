"""Reading a checkpoint without a target (a DCP ``StorageReader`` is a reader in
:mod:`qdcp.storage` and :mod:`qdcp.hf`; this package reads *with* one):

- ``entries``: :func:`read_metadata`, :class:`CheckpointEntries` (the state-dict keys, their sizes,
  and each entry read whole: as stored, rebuilt, or as values), :func:`read_stored`, :func:`read_entry`;
- ``describe``: :func:`describe`, what each key stores (``qdcp inspect``);
- ``verify``: the checks ``qdcp verify`` adds to reading every entry;
- ``consolidate``: the whole checkpoint as one state dict (:func:`consolidate`,
  :func:`dcp_to_torch_save`, and :class:`ConsolidatingLoadPlanner` for DCP's consolidation tools).
"""

from qdcp.reading.consolidate import ConsolidatingLoadPlanner, consolidate, dcp_to_torch_save
from qdcp.reading.describe import describe
from qdcp.reading.entries import CheckpointEntries, read_entry, read_metadata, read_stored
from qdcp.reading.verify import check_chunks, check_components, check_entry, check_storage

__all__ = ["read_metadata", "CheckpointEntries", "read_stored", "read_entry", "describe", "check_chunks",
           "check_storage", "check_components", "check_entry", "consolidate", "dcp_to_torch_save",
           "ConsolidatingLoadPlanner"]
