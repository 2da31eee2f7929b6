"""Storage: safe metadata reading, checksummed items and atomic commits on top of DCP's file writers.

What a checkpoint is lives here; how its bytes move fast (the write pipeline, direct writes,
archives read in place, threads) lives in :mod:`qdcp.io`, which the writer and reader call. One job
per module:

- :mod:`~qdcp.storage.metadata`: :func:`safe_load_metadata` unpickles DCP's ``.metadata`` with an
  allowlist (no code runs); :func:`check_chunk_geometry`.
- :mod:`~qdcp.storage.reader`: :class:`CheckpointReader` verifies every item it reads against
  the checksums its save recorded (:mod:`qdcp.checksums`) and checks every number the metadata
  gives, naming the state-dict key on a mismatch.
- :mod:`~qdcp.storage.owners`: which process owns a file (host, boot, PID namespace, PID, start
  time) and whether it still runs.
- :mod:`~qdcp.storage.claims`: one save per path at a time
  across processes and hosts: a claim file made by exclusive create, stale claims cleared.
- :mod:`~qdcp.storage.commit`: a save's file names (its token), publishing ``.metadata``, what is
  removed after.
- :mod:`~qdcp.storage.causes`: write errors raised with their root OS error.
- :mod:`~qdcp.storage.writer`: :class:`CheckpointWriter` refuses to write over an existing
  checkpoint unless ``overwrite=True``; with it, new data files get fresh names and the new
  ``.metadata`` atomically replaces the old one (``rename``), so a save killed at any point leaves
  the previous checkpoint loadable. One save per path at a time (its claim). Used by
  ``dcp.async_save`` as its stager (DCP's hook: a writer that is an ``AsyncStager``), it stages
  nothing itself: it hands the call to the stager it was given, else to one made by
  :func:`set_default_stager`'s factory (``import qdcp`` sets :class:`qdcp.QuantizedStager`).
  :func:`refuse_existing_checkpoint` guards the plain path.
- :mod:`~qdcp.storage.factories`: :func:`storage_writer` / :func:`storage_reader` pick the
  file-system or fsspec variant for a path or URL (``memory://``, ``s3://``...).
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
