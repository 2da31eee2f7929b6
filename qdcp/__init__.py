"""qdcp: PyTorch Distributed Checkpoint for quantized tensors.

    import qdcp

    qdcp.save(state, path)   # dcp.save with qdcp's writer and planner: atomic, checksummed, no overwrite
    qdcp.load(state, path)   # dcp.load with qdcp's reader and planner: verified, all-or-nothing

or DCP's own calls with qdcp's planners passed in::

    dcp.save(state, checkpoint_id=path, planner=qdcp.QuantizedSavePlanner())
    dcp.load(state, checkpoint_id=path, planner=qdcp.QuantizedLoadPlanner())

or, for frameworks that call DCP without a planner, process-wide: ``qdcp.install()``.

The package, data flowing one way (each folder's ``__init__`` says what its modules do):

- ``adapters/``: what each quantized tensor class holds and how its components shard (one per family).
- ``layouts.py``, ``spec.py``, ``checksums.py``: how a component maps to logical chunks, the on-disk
  format (versioned JSON spec), the checksums recorded with it.
- ``planning/``: DCP's save and load planners over those.
- ``staging/``: copies by inner buffers (async saves, offloading).
- ``storage/``: safe metadata, verified reads, atomic checksummed writes; ``io/``: how their bytes
  move fast (the write pipeline, direct writes, archives read in place).
- ``checkpoint.py`` (``qdcp.save`` / ``load``), ``runs.py`` (a run's checkpoints: ``latest``,
  ``checkpoints``, ``prune``), ``reading/`` (reading without a target: entries, describe, verify,
  consolidation), ``hf/`` (Hugging Face layouts), ``frameworks/`` (torchtitan, Lightning,
  ``install()``), ``cli.py``, ``outputs.py`` (where those tools write: never over their input),
  ``owners.py`` (which process owns a claim or scratch file, and whether it still runs).
"""

from qdcp.adapters import Adapter, StoredEntry, find_adapter, register_adapter, registered_type_names
from qdcp.adapters import compressed_tensors as _compressed_tensors
from qdcp.adapters import te_grouped as _te_grouped
from qdcp.adapters import torchao as _torchao
from qdcp.adapters import torchao_training as _torchao_training
from qdcp.adapters import transformer_engine as _transformer_engine
from qdcp.checkpoint import async_save, checkpoint_group, load, save
from qdcp.errors import (
    AlignmentError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ChecksumError,
    ConcurrentSaveError,
    LoadMismatchError,
    QdcpError,
    ReplicaMismatchError,
    ReservedKeyError,
    StagingError,
    UnsupportedTensorError,
)
from qdcp.frameworks.switch import install, installed, is_installed, uninstall
from qdcp.hf import ExportError, ExportResult, QuantizedHFReader, export
from qdcp.planning import QuantizedLoadPlanner, QuantizedSavePlanner
from qdcp.reading import (
    CheckpointEntries,
    ConsolidatingLoadPlanner,
    consolidate,
    dcp_to_torch_save,
    describe,
    read_entry,
    read_metadata,
    read_stored,
)
from qdcp.runs import CheckpointInfo, checkpoints, latest, prune
from qdcp.staging import QuantizedStager, enable_new_empty, register_new_empty, to_device, unregister_new_empty
from qdcp.storage import (
    CheckpointReader,
    CheckpointWriter,
    set_default_stager,
    storage_reader,
    storage_writer,
)

for _family in (_torchao, _torchao_training, _transformer_engine, _te_grouped, _compressed_tensors):
    for _adapter in _family.builtin_adapters():
        register_adapter(_adapter)
del _family, _adapter
set_default_stager(QuantizedStager)  # what qdcp's writers stage through when DCP uses them as stager
register_new_empty()  # for torchao classes already imported; QuantizedSavePlanner() adds later ones

__version__ = "0.1.0"

__all__ = [
    "save", "async_save", "load", "QuantizedSavePlanner", "QuantizedLoadPlanner", "QuantizedStager", "describe",
    "read_metadata", "read_entry", "read_stored", "CheckpointEntries", "CheckpointReader", "CheckpointWriter",
    "storage_reader", "storage_writer", "to_device", "register_new_empty", "unregister_new_empty",
    "enable_new_empty", "Adapter", "StoredEntry", "register_adapter", "find_adapter", "registered_type_names",
    "QdcpError", "CheckpointFormatError", "ChecksumError", "UnsupportedTensorError", "AlignmentError",
    "LoadMismatchError", "StagingError", "ReplicaMismatchError", "ConcurrentSaveError", "CheckpointWriteError",
    "ReservedKeyError", "CheckpointNotFoundError",
    "export", "ExportResult", "ExportError", "QuantizedHFReader", "install", "uninstall", "installed",
    "is_installed", "consolidate", "dcp_to_torch_save", "ConsolidatingLoadPlanner",
    "checkpoint_group", "latest", "checkpoints", "prune", "CheckpointInfo",
]
