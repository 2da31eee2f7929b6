"""qdcp's reader and writer for a local path, or their fsspec twins for a URL."""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager

from qdcp.errors import QdcpError
from qdcp.storage.reader import CheckpointReader, SafeReading
from qdcp.storage.urls import is_url, local_path
from qdcp.storage.writer import AtomicWriting, CheckpointWriter

try:  # fsspec is optional; DCP's fsspec storage is public from torch 2.15 on
    from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader, FsspecWriter
except ImportError:
    try:  # torch 2.11 - 2.14 (2.15 keeps this name, with a warning)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    except ImportError:  # pragma: no cover (fsspec not installed)
        FsspecReader = FsspecWriter = None

__all__ = ["storage_reader", "storage_writer"]


def storage_reader(path: str | os.PathLike, thread_count: int | None = None,
                   **storage_options: Any) -> FileSystemReader:
    """A safe, verifying reader for a local path or an fsspec URL; ``storage_options`` go to fsspec. A
    URL on the local file system (``file://``, ``local://``) is read as the local path it names."""
    path = _local_file_system_path(local_path(path), storage_options)
    if is_url(path):
        _need_fsspec()
        return FsspecCheckpointReader(os.fspath(path), thread_count=thread_count, **storage_options)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory at {os.fspath(path)!r}")
    return CheckpointReader(path, thread_count=thread_count)


def storage_writer(path: str | os.PathLike, overwrite: bool = False, checksums: bool = True,
                   stager: AsyncStager | None = None, **kwargs: Any) -> FileSystemWriter:
    """A :class:`CheckpointWriter` for a local path (``file://`` too), or its fsspec twin for a URL
    (other ``kwargs`` then fsspec's storage options)."""
    path = local_path(path)
    if is_url(path):
        _need_fsspec()
    cls = FsspecCheckpointWriter if is_url(path) else CheckpointWriter
    return cls(path, overwrite=overwrite, checksums=checksums, stager=stager, **kwargs)


def _local_file_system_path(path: str | os.PathLike, storage_options: dict) -> str | os.PathLike:
    if not is_url(path) or FsspecReader is None:
        return path
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, inner = fsspec.core.url_to_fs(os.fspath(path), **storage_options)
    return inner if isinstance(fs, LocalFileSystem) else path


def _need_fsspec() -> None:
    if FsspecWriter is None:
        raise QdcpError("URLs need fsspec: pip install fsspec (and s3fs for s3://)")


if FsspecWriter is not None:
    class FsspecCheckpointReader(SafeReading, FsspecReader):
        """:class:`CheckpointReader` for fsspec URLs."""

        def __init__(self, path: str, thread_count: int | None = None, **storage_options: Any) -> None:
            super().__init__(path, **storage_options)
            self._setup_safe_reading(thread_count)

    class FsspecCheckpointWriter(AtomicWriting, FsspecWriter):
        """:class:`CheckpointWriter` for fsspec URLs (written buffered, whatever ``direct_io``)."""
