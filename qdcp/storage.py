"""Storage: safe metadata reading, checksummed items and atomic commits on top of DCP's file writers.

- :func:`safe_load_metadata` unpickles DCP's ``.metadata`` with an allowlist (no code runs).
- :class:`ChecksumExtension` appends an XXH3-64 to every stored item (where the save planner
  records no checksums of its own); :class:`CheckpointReader` verifies every item it reads (the
  trailer, or the planner's checksum) and names the state-dict key on a mismatch.
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
import math
import os
import pickle
import re
import struct
import sys
import threading
import uuid
import weakref
import zipfile
import zlib
from typing import IO, Any, Callable

import xxhash

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

try:  # fsspec is optional; DCP's fsspec storage is public from torch 2.15 on
    from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader, FsspecWriter
except ImportError:
    try:  # torch 2.11 - 2.14 (2.15 keeps this name, with a warning)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    except ImportError:  # pragma: no cover (fsspec not installed)
        FsspecReader = FsspecWriter = None

from qdcp import checksums
from qdcp.errors import CheckpointFormatError, ChecksumError, QdcpError
from qdcp.spec import chunk_problems, describe_item

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


class _AnyVersionTensorProperties(TensorProperties):
    """``TensorProperties`` as any supported torch pickled it: torch 2.15 added ``strides`` (a sixth
    value its older readers cannot unpack). Replaced by this torch's own class after loading."""

    def __setstate__(self, state) -> None:
        dtype, layout, requires_grad, memory_format, pin_memory = tuple(state)[:5]
        super().__setstate__((dtype, layout, requires_grad, memory_format, pin_memory))

    def plain(self) -> TensorProperties:
        return TensorProperties(dtype=self.dtype, layout=self.layout, requires_grad=self.requires_grad,
                                memory_format=self.memory_format, pin_memory=self.pin_memory)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) == ("torch.distributed.checkpoint.metadata", "TensorProperties"):
            return _AnyVersionTensorProperties
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointFormatError(
            f"the checkpoint's .metadata refers to {module}.{name}, which is not a DCP metadata "
            f"class; refusing to unpickle it (the file may be tampered with)")


def safe_load_metadata(stream: IO[bytes]) -> Metadata:
    """Unpickle DCP ``Metadata`` admitting only DCP's metadata classes and builtins."""
    chunks, total = [], 0
    while True:  # in pieces: read(1 GiB) would reserve 1 GiB up front
        chunk = stream.read(1 << 20)
        if not chunk:
            break
        total += len(chunk)
        if total > MAX_METADATA_BYTES:
            raise CheckpointFormatError(f".metadata is larger than {MAX_METADATA_BYTES} bytes")
        chunks.append(chunk)
    data = b"".join(chunks)
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointFormatError:
        raise
    except MemoryError:  # a length field far beyond the file (CPython's unpickler reserves it first)
        raise CheckpointFormatError("the checkpoint's .metadata claims an object larger than memory; "
                                    "it is corrupt or hostile") from None
    except Exception as e:  # truncated or garbage pickles raise many types
        raise CheckpointFormatError(f"the checkpoint's .metadata cannot be read: {e!r}") from None
    if not isinstance(md, Metadata):
        raise CheckpointFormatError(f".metadata holds a {type(md).__name__}, not DCP Metadata")
    for item in (md.state_dict_metadata or {}).values():
        if isinstance(getattr(item, "properties", None), _AnyVersionTensorProperties):
            item.properties = item.properties.plain()
    return md


def check_chunk_geometry(md: Metadata) -> None:
    """Refuse metadata whose chunks do not tile their items exactly (:func:`qdcp.spec.chunk_problems`)."""
    problems = chunk_problems(md.state_dict_metadata or {})
    if problems:
        fqn, problem = problems[0]
        raise CheckpointFormatError(f"{describe_item(fqn)}: {problem}; the checkpoint's metadata is corrupt")


# ----------------------------------------------------------------------------- checksums

_TRAILERS = {"1": 4, "2": 8}  # qdcp-checksum version -> bytes of the hash after the item


def _stream_hash(version: str, data: Any) -> int:
    return zlib.crc32(data) if version == "1" else checksums.of_bytes(data)


class _HashWriter(io.RawIOBase):
    """Passes bytes through to ``out`` and appends their XXH3-64 (8 bytes, little-endian) on close."""

    def __init__(self, out: IO[bytes]) -> None:
        super().__init__()
        self._out, self._hash = out, xxhash.xxh3_64()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self._hash.update(b)
        return self._out.write(b)

    def close(self) -> None:
        if not self.closed:
            self._out.write(struct.pack("<Q", self._hash.intdigest()))
            self._out.close()
        super().close()


def _verified_view(data: Any, where: str, version: str) -> memoryview:
    """The payload of a ``qdcp-checksum/<version>`` item (without a copy), after checking its hash
    (version 1: CRC-32, written by qdcp 0.1; version 2: XXH3-64)."""
    size = _TRAILERS[version]
    if len(data) < size:
        raise ChecksumError(f"{where}: the stored item is truncated ({len(data)} bytes)")
    payload = memoryview(data)[:-size]
    expected = int.from_bytes(bytes(data[-size:]), "little")
    actual = _stream_hash(version, payload)
    if actual != expected:
        raise ChecksumError(f"{where}: checksum mismatch (stored {expected:0{2 * size}x}, computed "
                            f"{actual:0{2 * size}x}); the data file is corrupt")
    return payload


class ChecksumExtension(StreamTransformExtension):
    """DCP stream extension ``qdcp-checksum/2``: an XXH3-64 after each item's bytes. Reads
    ``qdcp-checksum/1`` (a CRC-32, qdcp 0.1) too."""

    def __init__(self, version: str = "2") -> None:
        super().__init__()
        self.version = version

    @staticmethod
    def registry_name() -> str:
        return "qdcp-checksum"

    @staticmethod
    def from_descriptor(version: str) -> "ChecksumExtension":
        major = version.partition(".")[0]
        if major not in _TRAILERS:
            raise CheckpointFormatError(f"unknown qdcp-checksum version {version!r}; upgrade qdcp")
        return ChecksumExtension(major)

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/{self.version}"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        if self.version != "2":
            raise CheckpointFormatError("qdcp writes qdcp-checksum/2 only")
        return _HashWriter(output)

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(_verified_view(input.read(-1), "stored item", self.version))


def _checksum_version(descriptors: list[str], where: str = "stored item") -> str | None:
    """The qdcp-checksum version among an item's transform descriptors (None if absent)."""
    for d in descriptors:
        name, _, version = d.partition("/")
        if name == ChecksumExtension.registry_name():
            major = version.partition(".")[0]
            if major not in _TRAILERS:
                raise CheckpointFormatError(f"{where}: unknown qdcp-checksum version {version!r}; upgrade qdcp")
            return major
    return None


class _ViewReader(io.RawIOBase):
    """A seekable read-only file over a memoryview (zipfile reads headers through it, no copy)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek value {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, b) -> int:
        chunk = self._view[self._pos: self._pos + len(b)]
        b[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


def _record_start(payload: memoryview, info: zipfile.ZipInfo) -> int:
    """Where the bytes of the zip record ``info`` start in ``payload`` (after its local header)."""
    head = bytes(payload[info.header_offset: info.header_offset + 30])
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad local header of {info.filename!r}")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _check_zip_crcs(payload: memoryview, where: str) -> None:
    """Verify the CRC-32 that ``torch.save`` writes for every record of its zip archive (the only
    integrity check of an item stored without qdcp checksums; ``torch.load`` does not check them)."""
    try:
        with zipfile.ZipFile(io.BufferedReader(_ViewReader(payload))) as z:
            for info in z.infolist():
                if info.CRC == 0 and info.file_size:
                    continue  # saved with torch.serialization.config.save.compute_crc32 = False
                if info.compress_type != zipfile.ZIP_STORED:
                    with z.open(info) as f:  # zipfile checks the CRC at the end
                        while f.read(1 << 24):
                            pass
                    continue
                start = _record_start(payload, info)
                record = payload[start: start + info.compress_size]
                if len(record) != info.compress_size or zlib.crc32(record) != info.CRC:
                    raise zipfile.BadZipFile(f"Bad CRC-32 for file {info.filename!r}")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError,
            KeyError, struct.error) as e:
        raise ChecksumError(f"{where}: the stored item is corrupt ({e})") from None


_STORAGE_RECORD = re.compile(r"[^/]+/data/[0-9]+")
#: the tensor a ``torch.save`` pickle (``data.pkl``) describes: dtype, size, strides, storage
#: offset, storage bytes (the same pickle always describes the same tensor; bounded)
_DESCRIBED: dict[bytes, tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int, int]] = {}
_DESCRIBED_MAX = 4096


def _archived_tensor(payload: memoryview, memory: torch.Tensor) -> torch.Tensor | None:
    """The tensor of the ``torch.save`` archive ``payload`` as a view of ``memory`` (the uint8
    tensor whose first bytes ``payload`` is): no copy. Its bytes are the one storage record the
    archive's zip directory lists; its size, strides and dtype come from ``torch.load`` onto the
    meta device (which reads no storage), once per distinct pickle. None where the archive is
    anything else (the caller then loads it the usual way)."""
    try:
        with zipfile.ZipFile(io.BufferedReader(_ViewReader(payload))) as z:
            infos = z.infolist()
        storage = [i for i in infos if _STORAGE_RECORD.fullmatch(i.filename)]
        pickled = [i for i in infos if i.filename.endswith("/data.pkl")]
        order = [i for i in infos if i.filename.endswith("/byteorder")]
        if len(storage) != 1 or len(pickled) != 1 or len(order) > 1 \
                or any(i.compress_type != zipfile.ZIP_STORED for i in storage + pickled + order):
            return None
        if order:
            at = _record_start(payload, order[0])
            if bytes(payload[at: at + order[0].file_size]) != sys.byteorder.encode():
                return None
        at = _record_start(payload, pickled[0])
        key = bytes(payload[at: at + pickled[0].file_size])
        described = _DESCRIBED.get(key)
        if described is None:
            meta = torch.load(_ViewReader(payload), map_location="meta", weights_only=True)
            if type(meta) is not torch.Tensor or meta.layout != torch.strided or meta.is_quantized:
                return None
            described = (meta.dtype, tuple(meta.shape), meta.stride(), meta.storage_offset(),
                         meta.untyped_storage().nbytes())
            if len(_DESCRIBED) < _DESCRIBED_MAX:
                _DESCRIBED[key] = described
        start = _record_start(payload, storage[0])
    except Exception:  # unreadable here: the usual load reports it
        return None
    dtype, shape, stride, offset, nbytes = described
    itemsize = dtype.itemsize
    if storage[0].file_size != nbytes:
        return None
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride))
    if start + nbytes > len(payload) or any(s < 0 for s in stride) or offset < 0 \
            or (last + 1) * itemsize > nbytes or nbytes % itemsize or (memory.data_ptr() + start) % itemsize:
        return None
    flat = memory[start: start + nbytes].view(dtype)
    return flat.as_strided(shape, stride, flat.storage_offset() + offset)


class _VerifyingTransforms:
    """Reader-side transforms that verify ``qdcp-checksum`` items and name the key on failure."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def transform_load_stream(self, read_item, transform_descriptors, raw_stream):
        descriptors = list(transform_descriptors or ())
        where = describe_item(read_item.storage_index.fqn)
        version = _checksum_version(descriptors, where)
        if version is not None:
            # written last-applied-first: the checksum wraps the raw bytes in the file
            if _checksum_version(descriptors[-1:]) is None:
                raise CheckpointFormatError(f"unexpected extension order {descriptors}")
            raw_stream = io.BytesIO(_verified_view(raw_stream.read(-1), where, version))
            descriptors = descriptors[:-1]
        return self._inner.transform_load_stream(read_item, descriptors, raw_stream)


# ----------------------------------------------------------------------------- readers

# torch 2.11's dcp.load catches every Exception of read_metadata() and of its rank-local fallback
# read_metadata(rank=...) and then says only "metadata is None" (2.12 on quote them).
_DCP_HIDES_METADATA_ERRORS = torch.__version__ < "2.12"


class _MetadataUnreadable(BaseException):
    """Carries qdcp's ``.metadata`` error (its ``__cause__``) past torch 2.11's ``except Exception``
    around ``read_metadata``: DCP wraps it in its CheckpointException, message intact."""


class _SafeReading:
    """Mixin for DCP's file-system readers: safe ``.metadata`` and verified checksums."""

    def _setup_safe_reading(self) -> None:
        self.transforms = _VerifyingTransforms(self.transforms)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        try:
            return self._read_metadata(rank)
        except CheckpointFormatError as e:
            first = getattr(self, "_qdcp_metadata_error", None)
            if rank is None:
                self._qdcp_metadata_error = e
            elif first is not None and _DCP_HIDES_METADATA_ERRORS:
                raise _MetadataUnreadable(str(first)) from first
            raise

    def _read_metadata(self, rank: int | None) -> Metadata:
        path = self._get_metadata_path(rank)
        if not self.fs.exists(path):
            raise CheckpointFormatError(
                f"{os.fspath(self.path)!r} has no .metadata: it is not a DCP checkpoint, or its save "
                f"did not finish (a partial checkpoint)")
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = safe_load_metadata(f)
        except OSError as e:
            raise CheckpointFormatError(f"the checkpoint's .metadata cannot be read: {e}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        check_chunk_geometry(metadata)  # here, not in read_metadata: `qdcp verify` lists such problems
        self._qdcp_sums = checksums.record(metadata)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._qdcp_chunks = {  # (item fqn, chunk offsets) -> (chunk sizes, dtype)
            (fqn, tuple(c.offsets)): (tuple(c.sizes), item.properties.dtype)
            for fqn, item in metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata) for c in item.chunks}

    def read_data(self, plan, planner) -> Future:
        """DCP's ``FileSystemReader.read_data``, checking every number the metadata gives before it is
        used: files stay inside the checkpoint, byte ranges inside their file, the stored tensor has
        the dtype and chunk shape the metadata records. Every item is verified once: against its
        ``qdcp-checksum`` trailer, else against the checksum the save planner recorded (left to a
        planner that ``verifies_whole_items`` for items it reads whole), else by torch.save's zip
        CRCs. Any failure is a :class:`CheckpointFormatError` naming the state-dict key. A planner
        may offer memory for an item (``buffer_for(req, nbytes)``, a uint8 CPU tensor): the item is
        read there and offered back as a view of it (``adopt_tensor(req, tensor)``), no copy made."""
        per_file: dict[str, list] = {}
        for req in plan.items:
            info = self.storage_data.get(req.storage_index)
            where = describe_item(req.storage_index.fqn)
            if info is None:
                raise CheckpointFormatError(
                    f"{where}: the checkpoint has no storage record for its chunk at "
                    f"{tuple(req.storage_index.offset or ())}")
            rel = info.relative_path
            if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
                raise CheckpointFormatError(f"{where}: its data file {rel!r} is outside the checkpoint directory")
            per_file.setdefault(rel, []).append(req)
        for rel, reqs in per_file.items():
            try:
                stream_cm = self.fs.create_stream(self.fs.concat_path(self.path, rel), "rb")
                stream = stream_cm.__enter__()
            except OSError as e:
                raise CheckpointFormatError(
                    f"{describe_item(reqs[0].storage_index.fqn)}: its data file {rel!r} cannot be opened "
                    f"({e}); the checkpoint is incomplete") from None
            try:
                size = stream.seek(0, io.SEEK_END)
                for req in reqs:
                    self._read_item(stream, size, rel, req, planner=planner)
            finally:
                stream_cm.__exit__(None, None, None)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _planner_checks(self, req, planner) -> bool:
        """Whether ``planner`` verifies this item itself: it says it checks the items it reads
        whole (``verifies_whole_items``), the checkpoint records a checksum, and it is read whole."""
        found = self._qdcp_sums.expected(req.storage_index.fqn, req.storage_index.offset) \
            if self._qdcp_sums is not None else None
        if found is None or not getattr(planner, "verifies_whole_items", False):
            return False
        sizes = found[0]
        return sizes is None or (not any(req.storage_offsets) and tuple(req.lengths) == sizes)

    def _recorded(self, req) -> int | None:
        """The checksum the checkpoint records for the stored item ``req`` reads (None if none)."""
        found = self._qdcp_sums.expected(req.storage_index.fqn, req.storage_index.offset) \
            if self._qdcp_sums is not None else None
        return found[1] if found is not None else None

    @staticmethod
    def _compare(req, got: int | None, expected: int) -> None:
        if got is not None and got != expected:  # None: a subclass whose values cannot be read
            raise ChecksumError(
                f"{describe_item(req.storage_index.fqn)}: the stored chunk at "
                f"{tuple(req.storage_index.offset or ())} does not match the checksum its save recorded "
                f"(recorded {expected:016x}, read {got:016x}): the data file is corrupt")

    def _verification(self, req, tensor: torch.Tensor, recorded: int | None, planner) -> Callable[[], None]:
        """Start hashing the stored chunk just read (large ones on a background thread, while the
        caller copies it on); the returned call waits, compares with ``recorded`` and tells a qdcp
        planner that would hash it again that it is verified."""
        if recorded is None:
            return lambda: None
        pending = checksums.hash_later(tensor)

        def verified() -> None:
            self._compare(req, pending(), recorded)
            self._note_verified(req, planner)
        return verified

    def _note_verified(self, req, planner) -> None:
        """Tell a qdcp planner that would check ``req`` itself that this reader has."""
        note = getattr(planner, "note_verified", None)
        if note is not None and self._planner_checks(req, planner):
            note(req)

    def _read_buffer(self, length: int) -> torch.Tensor:
        buf = getattr(self, "_qdcp_buffer", None)
        if buf is None or buf.numel() < length:
            self._qdcp_buffer = None
            buf = self._qdcp_buffer = torch.empty(max(length, 1 << 20), dtype=torch.uint8)
        return buf[:length]

    def _payload(self, stream, offset: int, length: int, rel: str, *, where: str, descriptors, version, req,
                 memory: torch.Tensor):
        """The item's stored bytes, read into ``memory`` (``length`` bytes), trailer checked and
        transforms undone (only those other than the checksum make a copy)."""
        stream.seek(offset)
        data = memoryview(memory.numpy())[:length]
        got = stream.readinto(data)
        if got != length:
            raise CheckpointFormatError(f"{where}: {rel!r} ended after {got} of {length} bytes")
        if not descriptors:
            return data
        if version is not None and len(descriptors) == 1:
            return _verified_view(data, where, version)
        return memoryview(self.transforms.transform_load_stream(req, descriptors, io.BytesIO(data)).read(-1))

    @staticmethod
    def _planner_buffer(planner, req, length: int) -> torch.Tensor | None:
        """A buffer the planner offers for this stored item (``buffer_for``: the item is read there
        and the planner adopts the view), or None."""
        offer = getattr(planner, "buffer_for", None)
        buffer = offer(req, length) if offer is not None else None
        if buffer is None:
            return None
        if buffer.dtype != torch.uint8 or buffer.device.type != "cpu" or not buffer.is_contiguous() \
                or buffer.numel() < length:
            raise QdcpError(f"{type(planner).__name__}.buffer_for gave {buffer.dtype} {tuple(buffer.shape)} on "
                            f"{buffer.device}; a contiguous CPU uint8 buffer of {length} bytes is needed")
        return buffer[:length]

    def _requested_part(self, tensor, req, where: str) -> torch.Tensor:
        """The part of a loaded stored chunk that ``req`` reads, after checking the chunk is the one
        the metadata records and the read lies within it."""
        expected = self._qdcp_chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
        if not isinstance(tensor, torch.Tensor) or expected is None \
                or (tuple(tensor.shape), tensor.dtype) != expected:
            got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            want = f"{expected[0]} {expected[1]}" if expected is not None else "no such chunk"
            raise CheckpointFormatError(
                f"{where}: the stored chunk at {tuple(req.storage_index.offset or ())} is {got} but the "
                f"metadata records {want}; the data does not belong to this entry")
        if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(req.storage_offsets, req.lengths, tensor.shape)):
            raise CheckpointFormatError(f"{where}: a read of {tuple(req.lengths)} at {tuple(req.storage_offsets)} "
                                        f"falls outside its stored chunk {tuple(tensor.shape)}")
        for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
            tensor = tensor.narrow(dim, o, n)
        return tensor

    def _read_item(self, stream, size: int, rel: str, req, *, planner) -> None:
        where = describe_item(req.storage_index.fqn)
        info = self.storage_data[req.storage_index]
        offset, length = info.offset, info.length
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset
                and 0 <= length <= size - offset):
            raise CheckpointFormatError(
                f"{where}: its stored bytes [{offset}, {offset}+{length}) lie outside {rel!r} ({size} "
                f"bytes); the file is truncated or the metadata is corrupt")
        descriptors = list(info.transform_descriptors or ())
        version = _checksum_version(descriptors, where)
        # the recorded checksum is checked here, on the bytes just read (hot), also where the planner
        # would check it (it is told, and skips its own pass over them)
        recorded = self._recorded(req) if version is None else None
        zip_crcs = version is None and recorded is None  # nothing else checks it
        in_place = req.type != LoadItemType.BYTE_IO \
            and (not descriptors or (version is not None and len(descriptors) == 1))
        buffer = self._planner_buffer(planner, req, length) if in_place else None
        adoptable = True  # a view of the reader's own scratch buffer is copied out, never kept
        try:
            # read into memory, checked there (trailer, recorded checksum or the zip's CRCs)
            memory = buffer if buffer is not None else self._read_buffer(length)
            payload = self._payload(stream, offset, length, rel, where=where, descriptors=descriptors,
                                    version=version, req=req, memory=memory)
            if req.type == LoadItemType.BYTE_IO:
                if recorded is not None:
                    self._compare(req, checksums.of_bytes(payload), recorded)
                    self._note_verified(req, planner)
                elif zip_crcs and payload[:4] == b"PK\x03\x04":  # a torch.save archive
                    _check_zip_crcs(payload, where)
                planner.load_bytes(req, io.BytesIO(payload))
                return
            if zip_crcs:
                _check_zip_crcs(payload, where)
            tensor = _archived_tensor(payload, memory) if in_place else None
            if tensor is None:
                tensor = torch.load(_ViewReader(payload), map_location="cpu", weights_only=True)
            else:
                adoptable = buffer is not None
            verified = self._verification(req, tensor, recorded, planner)
        except QdcpError:
            raise
        except Exception as e:
            raise CheckpointFormatError(f"{where}: its stored data cannot be read ({type(e).__name__}: {e})") from e
        tensor = self._requested_part(tensor, req, where)
        adopt = getattr(planner, "adopt_tensor", None)  # qdcp's entry reader keeps a whole chunk as loaded
        if adoptable and adopt is not None:
            verified()
            if adopt(req, tensor):
                return
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointFormatError(f"{where}: a read of {tuple(tensor.shape)} goes to a buffer of "
                                        f"{tuple(target.shape)}")
        target.copy_(tensor)  # while the bytes just read are hashed on another core
        verified()
        try:
            planner.commit_tensor(req, target)
        except QdcpError:
            raise
        except Exception as e:
            raise CheckpointFormatError(
                f"{where}: the entry cannot be rebuilt from its stored data ({type(e).__name__}: {e})") from e


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


# ----------------------------------------------------------------------------- overwrite guard

# the StorageMeta objects qdcp's writers gave to this process's saves (by id): those writers
# guard their path themselves (refusing an existing checkpoint unless overwrite=True)
_guarded_metas: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def refuse_existing_checkpoint(storage_meta: StorageMeta | None, who: str) -> None:
    """Raise :class:`FileExistsError` if a DCP checkpoint already lies at the local path a save is
    about to write (``storage_meta.checkpoint_id``), unless that save's writer is one of qdcp's
    (which guards its path itself). Remote paths (URLs) are not checked."""
    path = getattr(storage_meta, "checkpoint_id", None)
    if path is None or _guarded_metas.get(id(storage_meta)) is storage_meta or _is_url(path):
        return
    if os.path.isfile(os.path.join(os.fspath(path), METADATA_FILE)):
        raise FileExistsError(
            f"a checkpoint already exists at {os.fspath(path)!r} and this save would overwrite its files "
            f"in place (a save that fails midway leaves neither checkpoint loadable). Save to a new path, "
            f"or pass {who}(overwrite=True) to replace it; qdcp.save(..., overwrite=True) replaces it "
            f"atomically")


class _AtomicWriting:
    """Mixin for DCP's file-system writers: no silent overwrite, atomic commit, one save per path."""

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()
        if meta is not None:
            _guarded_metas[id(meta)] = meta  # this writer refuses an existing checkpoint itself
        return meta

    def _setup_atomic(self, overwrite: bool) -> None:
        self.qdcp_overwrite = overwrite
        self._qdcp_extensions = tuple(self.transforms.extensions)
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
        # a planner that records every item's checksum in the metadata makes the writer's own
        # qdcp-checksum trailers redundant: leave them out (the files stay stock-DCP readable)
        self.transforms.extensions = () if getattr(planner, "records_checksums", False) else self._qdcp_extensions
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
        checksums: every item is checksummed: by the save planner where it records checksums
            in the metadata (:class:`~qdcp.QuantizedSavePlanner`, the default; the files stay
            readable by stock DCP), otherwise by this writer, which appends an XXH3-64 to each
            item (``qdcp-checksum/2``; such files need :class:`CheckpointReader`). Both are
            verified by :class:`CheckpointReader`. False: no writer checksums.
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
