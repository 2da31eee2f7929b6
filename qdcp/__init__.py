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
  ``install()``), ``cli.py`` + ``commands.py`` (the command line: its parser, its verbs),
  ``outputs.py`` (where those tools write: never over their input), ``owners.py`` (which process
  owns a claim or scratch file, and whether it still runs).
"""

import importlib
from typing import Any

# every public name, by the module it comes from: imported at its first use (``import qdcp`` imports no
# torch, so ``qdcp --help`` is instant), the package's set-up run then (:func:`_set_up`)
_EXPORTS = {
    "qdcp.adapters": ("Adapter", "StoredEntry", "find_adapter", "register_adapter", "registered_type_names"),
    "qdcp.checkpoint": ("async_save", "checkpoint_group", "load", "save"),
    "qdcp.errors": ("AlignmentError", "CheckpointFormatError", "CheckpointNotFoundError", "CheckpointWriteError",
                    "ChecksumError", "ConcurrentSaveError", "LoadMismatchError", "QdcpError", "ReplicaMismatchError",
                    "ReservedKeyError", "StagingError", "UnsupportedTensorError"),
    "qdcp.frameworks.switch": ("install", "installed", "is_installed", "uninstall"),
    "qdcp.hf": ("ExportError", "ExportResult", "QuantizedHFReader", "export"),
    "qdcp.planning": ("QuantizedLoadPlanner", "QuantizedSavePlanner"),
    "qdcp.reading": ("CheckpointEntries", "ConsolidatingLoadPlanner", "consolidate", "dcp_to_torch_save", "describe",
                     "read_entry", "read_metadata", "read_stored"),
    "qdcp.runs": ("CheckpointInfo", "checkpoints", "latest", "prune"),
    "qdcp.staging": ("QuantizedStager", "enable_new_empty", "register_new_empty", "to_device",
                     "unregister_new_empty"),
    "qdcp.storage": ("CheckpointReader", "CheckpointWriter", "set_default_stager", "storage_reader",
                     "storage_writer"),
}
_FROM = {name: module for module, names in _EXPORTS.items() for name in names}
_set_up_done: list[bool] = []


def _set_up() -> None:
    """What the first use of qdcp's API does, once: qdcp's writers stage through a shared
    ``QuantizedStager`` (``set_default_stager``), and ``new_empty`` is added to the torchao classes
    already imported (docs/api.md; each ``QuantizedSavePlanner()`` adds later ones). The adapters
    register themselves at the registry's first use (:mod:`qdcp.adapters.base`)."""
    if not _set_up_done:
        _set_up_done.append(True)
        staging = importlib.import_module("qdcp.staging")
        importlib.import_module("qdcp.storage").set_default_stager(staging.QuantizedStager)
        staging.register_new_empty()


def __getattr__(name: str) -> Any:
    module = _FROM.get(name)
    if module is None:  # a submodule (``qdcp.spec``), as an eager package would have imported it
        try:
            value = importlib.import_module(f"qdcp.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"qdcp.{name}":
                raise
            raise AttributeError(f"module 'qdcp' has no attribute {name!r}") from None
        return value
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    _set_up()
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_FROM])


__version__ = "0.1.0"

__all__ = [*_FROM]
