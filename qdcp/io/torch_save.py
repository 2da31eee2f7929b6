"""torch.save archives read in place: a stored item's bytes as a tensor over the read buffer (no
copy) where the archive is simple, the zip CRCs checked where nothing else checks the bytes, and
stored tensors and objects unpickled without running code (:func:`load_pickled_tensor`,
:func:`load_object`)."""

from __future__ import annotations

import argparse
import io
import math
import pickle
import re
import struct
import sys
import zipfile
import zlib
from typing import Any

import torch

from qdcp.adapters import allow_pickled
from qdcp.errors import CheckpointFormatError, ChecksumError, LoadMismatchError, QdcpError
from qdcp.layouts import byte_view

__all__ = ["ViewReader", "check_zip_crcs", "archived_tensor", "read_archive_into", "load_pickled_tensor",
           "load_object", "SAFE_OBJECT_TYPES"]


class ViewReader(io.RawIOBase):
    """A seekable read-only file over a memoryview (zipfile reads headers through it, no copy;
    ``tell`` is io's: ``seek(0, SEEK_CUR)``)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

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


def check_zip_crcs(payload: memoryview, where: str) -> None:
    """Verify the CRC-32 that ``torch.save`` writes for every record of its zip archive (the only
    integrity check of an item stored without qdcp checksums; ``torch.load`` does not check them)."""
    try:
        with zipfile.ZipFile(io.BufferedReader(ViewReader(payload))) as z:
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


def _plain_archive(mem: memoryview, fill=lambda start, end: None):
    """``(start, (dtype, shape, strides, storage offset, storage bytes))`` of the ``torch.save``
    archive ``mem`` holding one plain tensor, stored (not compressed): where its one storage record
    starts in ``mem``, and what its pickle describes. ``fill(start, end)`` brings those bytes of
    the archive into ``mem`` first: only its other records (the pickle, the zip directory: a few
    KiB) are asked for, never the storage record. None where the archive is anything else."""
    length = len(mem)
    tail = min(length, 1 << 16)
    fill(length - tail, length)
    with zipfile.ZipFile(io.BufferedReader(ViewReader(mem))) as z:
        infos, directory = z.infolist(), z.start_dir
    storage = [i for i in infos if _STORAGE_RECORD.fullmatch(i.filename)]
    if directory < length - tail or len(storage) != 1 or any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        return None
    record = storage[0]
    rest = min([i.header_offset for i in infos if i.header_offset > record.header_offset] + [directory])
    fill(rest, length - tail)  # the records after the storage record
    fill(0, record.header_offset + 30)  # the records before it and its local header
    start = _record_start(mem, record)
    fill(record.header_offset + 30, start)  # its name and extra field
    described = _describe(mem, infos)
    if start + record.file_size > rest or described is None or described[4] != record.file_size:
        return None
    return start, described


def archived_tensor(payload: memoryview, memory: torch.Tensor) -> torch.Tensor | None:
    """The tensor of the ``torch.save`` archive ``payload`` as a view of ``memory`` (the uint8
    tensor whose first bytes ``payload`` is): no copy. None where the archive is anything else
    than one plain tensor (:func:`_plain_archive`; the caller then loads it the usual way)."""
    try:
        found = _plain_archive(payload)
    except Exception:  # unreadable here: the usual load reports it
        return None
    if found is None:
        return None
    start, (dtype, shape, stride, offset, nbytes) = found
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride))
    if any(s < 0 for s in stride) or offset < 0 or (last + 1) * dtype.itemsize > nbytes or nbytes % dtype.itemsize \
            or (memory.data_ptr() + start) % dtype.itemsize:
        return None
    flat = memory[start: start + nbytes].view(dtype)
    return flat.as_strided(shape, stride, flat.storage_offset() + offset)


def read_archive_into(stream, offset: int, length: int, scratch: torch.Tensor, target: torch.Tensor) -> bool:
    """Read the ``torch.save`` archive stored at ``[offset, offset + length)`` of ``stream`` with
    its one storage record read straight into ``target`` (a contiguous plain CPU tensor, the
    caller checked), its other records into ``scratch`` (a uint8 tensor of at least ``length``
    bytes) at their own offsets: no copy of the tensor's bytes. False, ``target`` untouched, where
    the archive holds anything but a tensor of ``target``'s dtype, shape and bytes."""
    if target.numel() == 0 or length < 22:
        return False
    mem = memoryview(scratch.numpy())[:length]

    def fill(start: int, end: int) -> None:
        if end > start:
            stream.seek(offset + start)
            if stream.readinto(mem[start:end]) != end - start:
                raise EOFError(f"the stored item ended before byte {end} of {length}")

    try:
        found = _plain_archive(mem, fill)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, struct.error):
        return False
    nbytes = target.numel() * target.element_size()
    if found is None or found[1] != (target.dtype, tuple(target.shape), target.stride(), 0, nbytes):
        return False
    stream.seek(offset + found[0])
    if stream.readinto(memoryview(byte_view(target).numpy())) != nbytes:
        raise EOFError(f"the stored item ended inside its tensor's {nbytes} bytes")
    return True


def _describe(payload: memoryview, infos: list[zipfile.ZipInfo]):
    """``(dtype, shape, strides, storage offset, storage bytes)`` of the plain tensor the archive's
    pickle describes (from ``torch.load`` onto the meta device, once per distinct pickle; no
    storage is read), or None where it holds anything else."""
    pickled = [i for i in infos if i.filename.endswith("/data.pkl")]
    order = [i for i in infos if i.filename.endswith("/byteorder")]
    if len(pickled) != 1 or len(order) > 1:
        return None
    if order:
        at = _record_start(payload, order[0])
        if bytes(payload[at: at + order[0].file_size]) != sys.byteorder.encode():
            return None
    at = _record_start(payload, pickled[0])
    key = bytes(payload[at: at + pickled[0].file_size])
    described = _DESCRIBED.get(key)
    if described is None:
        try:
            meta = torch.load(ViewReader(payload), map_location="meta", weights_only=True)
        except Exception:
            return None
        if type(meta) is not torch.Tensor or meta.layout != torch.strided or meta.is_quantized:
            return None
        described = (meta.dtype, tuple(meta.shape), meta.stride(), meta.storage_offset(),
                     meta.untyped_storage().nbytes())
        if len(_DESCRIBED) < _DESCRIBED_MAX:
            _DESCRIBED[key] = described
    return described


def load_pickled_tensor(payload: memoryview, where: str) -> Any:
    """A stored ``torch.save`` archive loaded ``weights_only``; the classes stock DCP pickles whole are
    allowed by the adapters of their families, other classes refused, never imported."""
    names: list[str] = []
    for _ in range(3):
        try:
            return torch.load(ViewReader(payload), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(ViewReader(payload))
            try:
                unknown = allow_pickled(names)
            except QdcpError as e:  # the family's adapter says what the program must do first
                raise CheckpointFormatError(f"{where}: {e}") from None
            if unknown or not names:
                listed = ", ".join(unknown or names) or "a class"
                raise CheckpointFormatError(
                    f"{where}: the stored chunk is a pickled {listed} (DCP's own save of a tensor subclass, "
                    f"without qdcp's planner), which no registered qdcp adapter handles; refusing to unpickle "
                    f"it. Install the library that provides it (torchao types: pip install 'qdcp[torchao]'), "
                    f"or register an adapter with qdcp.register_adapter (the CLI: --import MODULE)") from None
    raise CheckpointFormatError(f"{where}: the stored chunk is a pickled {', '.join(names)}, which torch's "
                                f"weights-only loading still refuses with its library imported (the library does "
                                f"not allow it); refusing to unpickle it")


# types a stored non-tensor object may hold beyond torch.load's weights_only allowlist
SAFE_OBJECT_TYPES = (io.BytesIO, argparse.Namespace)


def load_object(value: io.BytesIO, fqn: str, weights_only: bool = True):
    """A non-tensor object, unpickled without running code unless ``weights_only`` is False."""
    try:
        with torch.serialization.safe_globals(list(SAFE_OBJECT_TYPES)):
            return torch.load(value, weights_only=weights_only)
    except pickle.UnpicklingError as e:
        refused = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        raise LoadMismatchError(
            f"key {fqn!r}: the checkpoint stores a pickled object that refers to "
            f"{refused.group(1) if refused else 'a global'}, which loading with weights_only=True "
            f"refuses (a pickle can run code). If you trust this checkpoint, pass "
            f"QuantizedLoadPlanner(weights_only=False), or allow that type with "
            f"torch.serialization.add_safe_globals.") from e
