"""Storage: safe metadata reading, checksummed items and atomic commits on top of DCP's file writers.

- :func:`safe_load_metadata` unpickles DCP's ``.metadata`` with an allowlist (no code runs).
- :class:`ChecksumExtension` appends a CRC-32 to every stored item; :class:`CheckpointReader`
  verifies it before the item is deserialized and names the state-dict key on a mismatch.
- :class:`CheckpointWriter` refuses to write over an existing checkpoint unless ``overwrite=True``;
  with it, new data files get fresh names and the new ``.metadata`` atomically replaces the old one
  (``rename``), so a save killed at any point leaves the previous checkpoint loadable. Files of the
  previous checkpoint are removed only after the commit. One save per path at a time per process.
  Used by ``dcp.async_save`` as its stager (when none is given), it stages through
  :class:`qdcp.QuantizedStager`.
- :func:`storage_writer` / :func:`storage_reader` pick the file-system or fsspec variant for a path
  or URL (``memory://``, ``s3://``...).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import struct
import threading
import uuid
import zlib
from typing import IO, Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

try:  # fsspec is optional
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
except ImportError:  # pragma: no cover
    FsspecReader = FsspecWriter = None

from qdcp import spec as qspec
from qdcp.errors import CheckpointFormatError, QdcpError

MAX_METADATA_BYTES = 1 << 30
METADATA_FILE = ".metadata"

# ----------------------------------------------------------------------------- safe metadata

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("torch", "strided"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointFormatError(
            f"the checkpoint's .metadata refers to {module}.{name}, which is not a DCP metadata "
            f"class; refusing to unpickle it (the file may be tampered with)")


def safe_load_metadata(stream: IO[bytes]) -> Metadata:
    """Unpickle DCP ``Metadata`` admitting only DCP's metadata classes and builtins."""
    data = stream.read(MAX_METADATA_BYTES + 1)
    if len(data) > MAX_METADATA_BYTES:
        raise CheckpointFormatError(f".metadata is larger than {MAX_METADATA_BYTES} bytes")
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointFormatError:
        raise
    except Exception as e:  # truncated or garbage pickles raise many types
        raise CheckpointFormatError(f"the checkpoint's .metadata cannot be read: {e!r}") from None
    if not isinstance(md, Metadata):
        raise CheckpointFormatError(f".metadata holds a {type(md).__name__}, not DCP Metadata")
    return md


# ----------------------------------------------------------------------------- checksums

class ChecksumError(CheckpointFormatError):
    """A stored item's bytes do not match the checksum written with them."""


class _CrcWriter(io.RawIOBase):
    """Passes bytes through to ``out`` and appends their CRC-32 (4 bytes, little-endian) on close."""

    def __init__(self, out: IO[bytes]) -> None:
        super().__init__()
        self._out, self._crc = out, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self._crc = zlib.crc32(b, self._crc)
        return self._out.write(b)

    def close(self) -> None:
        if not self.closed:
            self._out.write(struct.pack("<I", self._crc))
            self._out.close()
        super().close()


def _verified_payload(raw: IO[bytes], where: str) -> io.BytesIO:
    data = raw.read(-1)
    if len(data) < 4:
        raise ChecksumError(f"{where}: the stored item is truncated ({len(data)} bytes)")
    payload = memoryview(data)[:-4]
    (expected,) = struct.unpack("<I", data[-4:])
    actual = zlib.crc32(payload)
    if actual != expected:
        raise ChecksumError(f"{where}: checksum mismatch (stored {expected:08x}, computed {actual:08x}); "
                            f"the data file is corrupt")
    return io.BytesIO(payload)


class ChecksumExtension(StreamTransformExtension):
    """DCP stream extension ``qdcp-checksum/1``: a CRC-32 after each item's bytes."""

    @staticmethod
    def registry_name() -> str:
        return "qdcp-checksum"

    @staticmethod
    def from_descriptor(version: str) -> "ChecksumExtension":
        if version.partition(".")[0] != "1":
            raise CheckpointFormatError(f"unknown qdcp-checksum version {version!r}")
        return ChecksumExtension()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _CrcWriter(output)

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return _verified_payload(input, "stored item")


class _VerifyingTransforms:
    """Reader-side transforms that verify ``qdcp-checksum`` items and name the key on failure."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def transform_load_stream(self, read_item, transform_descriptors, raw_stream):
        descriptors = list(transform_descriptors or ())
        descriptor = ChecksumExtension().get_descriptor()
        if descriptor in descriptors:
            # written last-applied-first: the checksum wraps the raw bytes in the file
            if descriptors[-1] != descriptor:
                raise CheckpointFormatError(f"unexpected extension order {descriptors}")
            raw_stream = _verified_payload(raw_stream, _describe_item(read_item.storage_index.fqn))
            descriptors = descriptors[:-1]
        return self._inner.transform_load_stream(read_item, descriptors, raw_stream)


def _describe_item(fqn: str) -> str:
    if qspec.COMPONENT_SEPARATOR in fqn:
        key, comp = fqn.rsplit(qspec.COMPONENT_SEPARATOR, 1)
        return f"key {key!r} (component {comp!r})"
    return f"key {fqn!r}"


# ----------------------------------------------------------------------------- readers

class _SafeReading:
    """Mixin for DCP's file-system readers: safe ``.metadata`` and verified checksums."""

    def _setup_safe_reading(self) -> None:
        self.transforms = _VerifyingTransforms(self.transforms)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        if not self.fs.exists(path):
            raise CheckpointFormatError(
                f"{os.fspath(self.path)!r} has no .metadata: it is not a DCP checkpoint, or its save "
                f"did not finish (a partial checkpoint)")
        with self.fs.create_stream(path, "rb") as f:
            metadata = safe_load_metadata(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class CheckpointReader(_SafeReading, FileSystemReader):
    """A ``FileSystemReader`` that never runs code from ``.metadata``, verifies item checksums and
    refuses a checkpoint whose save did not finish."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._setup_safe_reading()


def _is_url(path: str | os.PathLike) -> bool:
    return "://" in os.fspath(path)


def storage_reader(path: str | os.PathLike, **storage_options: Any) -> FileSystemReader:
    """A safe, verifying reader for a local path or an fsspec URL (``memory://``, ``s3://``...).

    ``storage_options`` go to fsspec (e.g. ``client_kwargs={"endpoint_url": ...}``).
    """
    if _is_url(path):
        _need_fsspec()
        return FsspecCheckpointReader(os.fspath(path), **storage_options)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory at {os.fspath(path)!r}")
    return CheckpointReader(path)


# ----------------------------------------------------------------------------- writers

_in_flight_lock = threading.Lock()
_in_flight: set[str] = set()


class _AtomicWriting:
    """Mixin for DCP's file-system writers: no silent overwrite, atomic commit, one save per path."""

    def _setup_atomic(self, overwrite: bool) -> None:
        self.qdcp_overwrite = overwrite
        self._holds_path = False
        self._stager = None

    # DCP uses a writer that is an AsyncStager as the stager of dcp.async_save when none is given:
    # stage through qdcp's stager so quantized tensors are copied by their inner buffers.
    def stage(self, state_dict):
        if self._stager is None:
            from qdcp.stager import QuantizedStager

            self._stager = QuantizedStager()
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        if self._stager is not None:
            self._stager.synchronize_staging()

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def __getstate__(self):  # the PROCESS checkpointer pickles the writer: buffers stay here
        state = self.__dict__.copy()
        state["_stager"] = None
        return state

    def _key(self) -> str:
        return os.path.abspath(os.fspath(self.path)) if not _is_url(self.path) else os.fspath(self.path)

    def prepare_local_plan(self, plan):
        self.fs.mkdir(self.path)
        if self.fs.exists(self._get_metadata_path()) and not self.qdcp_overwrite:
            raise QdcpError(
                f"a checkpoint already exists at {os.fspath(self.path)!r}; pass overwrite=True to "
                f"replace it (the old one stays loadable until the new one is complete), or save "
                f"to a new path")
        with _in_flight_lock:
            if self._key() in _in_flight:
                raise QdcpError(
                    f"another save to {os.fspath(self.path)!r} is in progress in this process; wait "
                    f"for it (call .result() on its future) before saving there again")
            _in_flight.add(self._key())
            self._holds_path = True
        return plan

    def _release(self) -> None:
        if self._holds_path:
            with _in_flight_lock:
                _in_flight.discard(self._key())
            self._holds_path = False

    def prepare_global_plan(self, plans):
        token = uuid.uuid4().hex[:8]
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{token}_{i}_")) for i, p in enumerate(plans)]

    def write_data(self, plan, planner):
        try:
            fut = super().write_data(plan, planner)
            fut.wait()  # a torch.futures.Future, already complete for file-system writers
        except BaseException:
            self._release()
            raise
        if not getattr(self, "_is_coordinator", False):
            self._release()
        return fut

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._is_coordinator = is_coordinator

    def finish(self, metadata: Metadata, results) -> None:
        try:
            self._commit(metadata, results)
        finally:
            self._release()

    def _commit(self, metadata: Metadata, results) -> None:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        metadata.version = CURRENT_DCP_VERSION
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        tmp_path = self.fs.concat_path(self.path, f"{METADATA_FILE}.tmp")
        with self.fs.create_stream(tmp_path, "wb") as f:
            pickle.dump(metadata, f)
            if self.sync_files:
                try:
                    os.fsync(f.fileno())
                except (AttributeError, io.UnsupportedOperation):
                    os.sync()
        final = self._get_metadata_path()
        if _is_url(self.path):
            self.fs.rename(tmp_path, final)  # object stores: copy + delete; not atomic
        else:
            os.replace(tmp_path, final)  # atomic on POSIX: readers see the old or the new one
            if self.sync_files:
                _fsync_dir(os.fspath(self.path))
        referenced = {info.relative_path for info in storage_md.values()}
        self._remove_unreferenced(referenced)

    def _remove_unreferenced(self, referenced: set[str]) -> None:
        """Delete data files of earlier checkpoints at this path (after the commit)."""
        if _is_url(self.path):
            return
        root = os.fspath(self.path)
        for name in os.listdir(root):
            if name.endswith(".distcp") and name.startswith("__") and name not in referenced:
                os.remove(os.path.join(root, name))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter(_AtomicWriting, FileSystemWriter):
    """A ``FileSystemWriter`` with checksums, atomic commit and explicit overwrite.

    Args:
        path: checkpoint directory.
        overwrite: replace an existing checkpoint (atomically). Default False: raise before writing.
        checksums: append a CRC-32 to every item (verified by :class:`CheckpointReader`). A
            checksummed checkpoint needs qdcp's reader; pass False for stock-DCP-readable files.
        **kwargs: ``FileSystemWriter`` options (``thread_count``, ``sync_files``...).
    """

    def __init__(self, path: str | os.PathLike, overwrite: bool = False, checksums: bool = True,
                 **kwargs: Any) -> None:
        extensions = [ChecksumExtension()] if checksums else None
        super().__init__(path, overwrite=True, _extensions=extensions, **kwargs)
        self._setup_atomic(overwrite)


def storage_writer(path: str | os.PathLike, overwrite: bool = False, checksums: bool = True,
                   **kwargs: Any) -> FileSystemWriter:
    """A :class:`CheckpointWriter` for a local path, or its fsspec twin for a URL.

    For URLs, ``kwargs`` are fsspec storage options; the commit is a rename (not atomic on object
    stores), but ``.metadata`` is still written last.
    """
    if _is_url(path):
        _need_fsspec()
        return FsspecCheckpointWriter(path, overwrite=overwrite, checksums=checksums, **kwargs)
    return CheckpointWriter(path, overwrite=overwrite, checksums=checksums, **kwargs)


def _need_fsspec() -> None:
    if FsspecWriter is None:
        raise QdcpError("URLs need fsspec: pip install fsspec (and s3fs for s3://)")


if FsspecWriter is not None:
    class FsspecCheckpointReader(_SafeReading, FsspecReader):
        """:class:`CheckpointReader` for fsspec URLs."""

        def __init__(self, path: str, **storage_options: Any) -> None:
            super().__init__(path, **storage_options)
            self._setup_safe_reading()

    class FsspecCheckpointWriter(_AtomicWriting, FsspecWriter):
        """:class:`CheckpointWriter` for fsspec URLs (the commit rename is not atomic on object stores)."""

        def __init__(self, path: str, overwrite: bool = False, checksums: bool = True,
                     **kwargs: Any) -> None:
            extensions = [ChecksumExtension()] if checksums else None
            super().__init__(os.fspath(path), overwrite=True, _extensions=extensions, **kwargs)
            self._setup_atomic(overwrite)
