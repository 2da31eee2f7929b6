"""How qdcp's writers write one rank's items (the write pipeline behind :class:`qdcp.CheckpointWriter`):

- the items split by bytes into ``thread_count`` files, each written and fsync'd by its own thread;
- each tensor a ``torch.save`` archive as DCP writes it, without the zip CRC-32s where every item is
  hashed as written (one pass over the bytes fewer; ``torch.load`` never checks them);
- written from the tensor's own memory (a copy only where its storage is larger than its bytes, as
  DCP does); with ``direct``, large items skip the page cache too (:mod:`qdcp.io.direct`);
- with an accelerator, the next items copied to the host by a helper thread while one is written;
- buffered writes handed to the disk every :data:`WRITEBACK_BYTES` (``POSIX_FADV_DONTNEED``, as
  PostgreSQL's ``pg_flush_data``: writeback starts at once, the final fsync waits for little);
- with ``hash_items``, each item's bytes hashed (XXH3-64) while written, the hash riding in its result
  (:class:`HashedStorageInfo`) to the coordinator's checksum record: no pass before writing.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import os
import pickle
import queue
import threading
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from qdcp import checksums
from qdcp.io.direct import open_direct
from qdcp.io.threads import run_jobs

__all__ = ["default_thread_count", "usable_cores", "writes_direct", "write_items", "serialize_tensor"]

#: the most files/threads a rank writes with by default (4 reach a local NVMe's or a network file
#: system's parallel bandwidth; more compete with the training process for cores)
MAX_DEFAULT_THREADS = 4
#: with the default thread count, a rank's items are split into no more files than this many
#: bytes each fill (a small save stays one file; its writes are too short to gain from threads)
MIN_FILE_BYTES = 32 << 20
#: bytes written to a file before they are handed to the disk (writeback started, not waited for)
WRITEBACK_BYTES = 8 << 20


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity; the machine's count where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        return os.cpu_count() or 1


#: ``direct_io=None``: a staged (async) save's upload is written directly below this many usable
#: cores, buffered from it on (docs/benchmarks.md, *Async save on few cores*: on 2 cores training
#: beside a direct upload ran 2-3x as fast; on 16 buffered uploads finished 10-40% sooner)
DIRECT_UPLOAD_BELOW_CORES = 8


def writes_direct(direct_io: bool | None, staged: bool) -> bool:
    """Whether a save writes its large items from their memory, around the page cache
    (:mod:`qdcp.io.direct`): as ``direct_io`` asks; None: where the save is staged (its upload runs
    beside training) and this process may use fewer than :data:`DIRECT_UPLOAD_BELOW_CORES` cores."""
    if direct_io is None:
        return staged and usable_cores() < DIRECT_UPLOAD_BELOW_CORES
    return bool(direct_io)


def default_thread_count() -> int:
    """Files (and threads) a qdcp writer writes each rank's items into by default: the cores this
    process may use, at most :data:`MAX_DEFAULT_THREADS`."""
    return max(1, min(MAX_DEFAULT_THREADS, usable_cores()))


# ----------------------------------------------------------------------------- serialization

@functools.cache
def _no_crc_works() -> bool:
    """Whether torch's archive writer can be driven here without CRC-32s (its private
    ``PyTorchFileWriter`` / ``serialization._save``, see docs/versions.md); else ``torch.save``."""
    try:
        out = io.BytesIO()
        _save_no_crc(torch.arange(3, dtype=torch.int16), out)
        return torch.equal(torch.load(io.BytesIO(out.getvalue()), weights_only=True),
                           torch.arange(3, dtype=torch.int16))
    except Exception:  # pragma: no cover (another torch)
        return False


def _save_no_crc(t: torch.Tensor, out: Any) -> None:
    archive = torch._C.PyTorchFileWriter(out, False, torch.serialization._get_storage_alignment())
    try:
        torch.serialization._save(t, archive, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    except BaseException:
        # finish the archive here (its destructor would, and abort the process on a stream that
        # raises); the write's own error is the one raised (torch.save reports "unexpected pos")
        try:
            archive.write_end_of_file()
        except Exception:
            pass
        raise
    archive.write_end_of_file()


def serialize_tensor(t: torch.Tensor, out: Any, crc: bool = True) -> None:
    """Write ``t`` to the stream ``out`` as ``torch.save`` does; ``crc=False``: the archive's
    CRC-32 fields are 0 (not computed), everything else byte for byte the same."""
    if not crc and _no_crc_works():
        _save_no_crc(t, out)
    else:
        torch.save(t, out)


# ----------------------------------------------------------------------------- files and threads

def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize


def split_items(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """``items`` in at most ``bins`` non-empty groups of about equal bytes (tensors largest first
    into the lightest group; objects round-robin)."""
    bins = max(1, bins)
    groups: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    objects = [i for i in items if i.type == WriteItemType.BYTE_IO]
    for n, item in enumerate(objects):
        groups[n % bins].append(item)
    for item in sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_bytes, reverse=True):
        k = sizes.index(min(sizes))
        groups[k].append(item)
        sizes[k] += _item_bytes(item)
    return [g for g in groups if g]


@dataclasses.dataclass
class HashedStorageInfo(_StorageInfo):
    """DCP's per-item storage info with the hash of the item's bytes as written (``hash_items``);
    the coordinator takes the hash out (:meth:`stored`) before the metadata is written."""

    qdcp_hash: int | None = None

    def stored(self) -> _StorageInfo:
        return _StorageInfo(self.relative_path, self.offset, self.length, self.transform_descriptors)


def write_items(writer: Any, items: list[WriteItem], prefix: str, planner: Any, crc: bool,
                hash_items: bool = False, direct: bool = False) -> list[WriteResult]:
    """Write ``items`` into files named ``<prefix><n>.distcp`` in ``writer``'s directory (one per
    thread, or one per item where ``writer.single_file_per_rank`` is False), each fsync'd where
    ``writer.sync_files``; the results of every item, as DCP's writer returns them (with each
    item's hash where ``hash_items``). ``direct``: local files written with direct writes
    (:mod:`qdcp.io.direct`) where the file system takes them."""
    if getattr(writer, "single_file_per_rank", True):
        files = int(writer.thread_count or 1)
        if getattr(writer, "qdcp_auto_threads", False):  # the default: no file smaller than MIN_FILE_BYTES
            files = max(1, min(files, sum(_item_bytes(i) for i in items) // MIN_FILE_BYTES))
        groups = split_items(items, files)
    else:
        groups = [[i] for i in items]
    jobs = [(f"{prefix}{n}{DEFAULT_SUFFIX}", g) for n, g in enumerate(groups)]
    threads = max(1, min(int(writer.thread_count or 1), len(jobs)))
    ahead = max(0, int(getattr(writer, "per_thread_copy_ahead", 0) or 0))
    return run_jobs(jobs, [None] * threads, lambda _, job, failed: _write_file(writer, *job, planner, crc, ahead,
                                                                               hash_items, direct), "qdcp-write")


def _write_file(writer: Any, name: str, items: list[WriteItem], planner: Any, crc: bool,
                ahead: int, hash_items: bool, direct_writes: bool) -> list[WriteResult]:
    path = writer.fs.concat_path(writer.path, name)
    results = []
    direct = open_direct(os.fspath(path)) if direct_writes else None
    with direct if direct is not None else writer.fs.create_stream(path, "wb") as stream:
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                results.append(_write_one(writer.transforms, stream, planner.resolve_data(item), item, name, crc,
                                          hash_items))
        tensors = [i for i in items if i.type != WriteItemType.BYTE_IO]
        resolved = _prefetched(tensors, planner, ahead) if _accelerator() else \
            ((item, _host_tensor(planner, item)) for item in tensors)
        fd = _descriptor(stream)
        writeback = _Writeback(stream, fd) if writer.sync_files and fd is not None and direct is None else None
        for item, tensor in resolved:
            results.append(_write_one(writer.transforms, stream, tensor, item, name, crc, hash_items))
            del tensor
            if writeback is not None:
                writeback.start()
        if direct is not None:
            direct.finish()
        if writer.sync_files:
            stream.flush()
            if fd is not None:
                os.fsync(fd)
            else:
                os.sync()  # a stream without a descriptor (as DCP's writer does)
    return results


def _descriptor(stream: Any) -> int | None:
    """The stream's file descriptor; None for a stream without one (an object store's)."""
    try:
        return stream.fileno()
    except (AttributeError, io.UnsupportedOperation, ValueError):
        return None


def _write_one(transforms: Any, stream: Any, data: Any, item: WriteItem, name: str, crc: bool,
               hash_items: bool) -> WriteResult:
    hashed = None
    if hash_items:
        hashed = checksums.hash_later(data.getvalue() if item.type == WriteItemType.BYTE_IO else data)
    place = getattr(stream, "start_item", None)  # a DirectFile places each item itself
    if place is not None:
        place()
    offset = stream.tell()
    out, descriptors = transforms.transform_save_stream(item, stream)
    if item.type == WriteItemType.BYTE_IO:
        out.write(data.getbuffer())
    else:
        serialize_tensor(data, out, crc)
    out.close()
    if place is not None:
        offset = stream.item_start()
    length = stream.tell() - offset
    info = _StorageInfo(name, offset, length, transform_descriptors=descriptors or None) if hashed is None else \
        HashedStorageInfo(name, offset, length, transform_descriptors=descriptors or None, qdcp_hash=hashed())
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=info)


class _Writeback:
    """Starts the disk writing what has been written to a file (descriptor ``fd``) so far, without
    waiting for it (every :data:`WRITEBACK_BYTES`); nothing where the platform has no ``posix_fadvise``."""

    def __init__(self, stream: Any, fd: int) -> None:
        self._stream, self._done = stream, 0
        self._fd: int | None = fd if hasattr(os, "posix_fadvise") else None

    def start(self) -> None:
        if self._fd is None:
            return
        end = self._stream.tell()
        if end - self._done < WRITEBACK_BYTES:
            return
        try:
            self._stream.flush()
            os.posix_fadvise(self._fd, self._done, end - self._done, os.POSIX_FADV_DONTNEED)
        except OSError:  # a file system that refuses the advice: the fsync does it all
            self._fd = None
        self._done = end


# ----------------------------------------------------------------------------- device to host

def _accelerator() -> bool:
    return torch.accelerator.is_available()


def _host_tensor(planner: Any, item: WriteItem) -> torch.Tensor:
    """The item's data on the host, holding no more storage than its bytes (what ``torch.save``
    writes is the whole storage)."""
    t = planner.resolve_data(item).detach()
    if t.device.type != "cpu":
        t = t.cpu()
    elif t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _prefetched(items: list[WriteItem], planner: Any, ahead: int) -> Iterator[tuple[WriteItem, torch.Tensor]]:
    """``(item, host tensor)`` in order, resolved (and copied to the host) by a helper thread while
    the caller writes the previous ones: at least one item ahead, ``ahead`` bytes at most beyond."""
    if len(items) < 2:
        yield from ((item, _host_tensor(planner, item)) for item in items)
        return
    done: queue.SimpleQueue = queue.SimpleQueue()
    room = threading.Condition()
    state = {"held": 0, "stop": False}

    def fetch() -> None:
        try:
            for item in items:
                size = _item_bytes(item)
                with room:
                    room.wait_for(lambda: state["stop"] or state["held"] == 0 or state["held"] + size <= ahead)
                    if state["stop"]:
                        return
                    state["held"] += size
                done.put((item, _host_tensor(planner, item), size))
        except BaseException as e:
            done.put((None, e, 0))

    helper = threading.Thread(target=fetch, name="qdcp-copy-ahead", daemon=True)
    helper.start()
    try:
        for _ in items:
            item, tensor, size = done.get()
            if item is None:
                raise tensor
            yield item, tensor
            del tensor
            with room:
                state["held"] -= size
                room.notify()
    finally:
        with room:
            state["stop"] = True
            room.notify()
        helper.join()
