"""Storage: safe metadata, verified reads, checksummed atomic writes on DCP's file-system storage
(how the bytes move fast: :mod:`qdcp.io`). One job per module:

- :mod:`~qdcp.storage.metadata`: ``.metadata`` unpickled with an allowlist (no code runs).
- :mod:`~qdcp.storage.reader`: :class:`CheckpointReader` verifies every item and number it reads.
- :mod:`~qdcp.storage.writer`: :class:`CheckpointWriter`: no silent overwrite, one save per path,
  an atomic commit, the stager it hands ``dcp.async_save`` (:func:`set_default_stager`).
- :mod:`~qdcp.storage.claims`: a checkpoint directory's files by name (local or fsspec), and the
  claim file that keeps a path to one save at a time (its holder: :mod:`qdcp.owners`).
- :mod:`~qdcp.storage.commit`: a save's file names, publishing ``.metadata``, what is removed after.
- :mod:`~qdcp.storage.causes`: write errors raised with their root OS error.
- :mod:`~qdcp.storage.factories`: :func:`storage_writer` / :func:`storage_reader` for a path or URL.
"""

from qdcp.errors import CheckpointFormatError, ChecksumError
from qdcp.storage.factories import storage_reader, storage_writer
from qdcp.storage.metadata import MAX_METADATA_BYTES, METADATA_FILE, check_chunk_geometry, safe_load_metadata
from qdcp.storage.reader import CheckpointReader
from qdcp.storage.writer import CheckpointWriter, refuse_existing_checkpoint, set_default_stager

__all__ = [
    "CheckpointReader", "CheckpointWriter", "storage_reader", "storage_writer", "safe_load_metadata",
    "check_chunk_geometry", "refuse_existing_checkpoint", "set_default_stager", "ChecksumError",
    "CheckpointFormatError", "MAX_METADATA_BYTES", "METADATA_FILE",
]
