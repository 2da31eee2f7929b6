"""qdcp's storage reader: DCP's file-system reader with a safe ``.metadata``, every number checked
before use, every item verified once (``QdcpStorageMeta.verifies_items``); the files read by
:mod:`qdcp.io.reads`. Planners may also be :class:`ReportingLoadPlanner` / :class:`AdoptingLoadPlanner`."""

from __future__ import annotations

import contextlib
import io
import os
import threading
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.futures import Future

from qdcp import checksums
from qdcp.adapters import find_adapter
from qdcp.errors import CheckpointFormatError, QdcpError
from qdcp.io.pipeline import default_thread_count
from qdcp.io.reads import Lane, lanes_for, read_files
from qdcp.io.torch_save import archived_tensor, check_zip_crcs, load_pickled_tensor, read_archive_into
from qdcp.spec import describe_item
from qdcp.storage.local_files import file_problem, open_inside, refusal
from qdcp.storage.metadata import QdcpStorageMeta, check_chunk_geometry, check_stored_sizes, safe_load_metadata

__all__ = ["SafeReading", "CheckpointReader", "metadata_error_told", "ReportingLoadPlanner", "AdoptingLoadPlanner",
           "NoMetadataError"]


@runtime_checkable
class ReportingLoadPlanner(Protocol):
    """A load planner that says what a load has changed so far, for a corrupt item's error."""

    def changed_note(self, read_item: ReadItem, written: bool) -> str:
        """What the load has changed, ``read_item``'s corrupt bytes included if ``written``."""


@runtime_checkable
class AdoptingLoadPlanner(Protocol):
    """A load planner that keeps stored items as loaded, in memory it offers (qdcp's entry reader)."""

    def buffer_for(self, read_item: ReadItem, nbytes: int) -> torch.Tensor | None:
        """Memory to read a stored item into (a contiguous CPU uint8 tensor of ``nbytes``), or None."""

    def adopt_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> bool:
        """Keep ``tensor`` (the item as loaded, verified, possibly a view of :meth:`buffer_for`'s
        memory); False: the reader copies it into ``resolve_tensor``'s buffer, as DCP's does."""


class _PlannerCalls:
    """The planner as the reading threads call it, ``calls("method", *args)``: one call at a time."""

    def __init__(self, planner: Any, shared: bool) -> None:
        self.planner = planner
        self.adopting = isinstance(planner, AdoptingLoadPlanner)
        self.reporting = isinstance(planner, ReportingLoadPlanner)
        self._lock = threading.Lock() if shared else contextlib.nullcontext()

    def __call__(self, method: str, *args: Any) -> Any:
        with self._lock:
            return getattr(self.planner, method)(*args)

    def changed(self, req, written: bool) -> str:
        return self("changed_note", req, written) if self.reporting else ""


class NoMetadataError(CheckpointFormatError):
    """No ``.metadata`` (``qdcp.load`` raises :class:`qdcp.CheckpointNotFoundError` for it)."""


class _MetadataUnreadable(BaseException):
    """Carries qdcp's ``.metadata`` error (its ``__cause__``, kept when pickled) past ``dcp.load``'s
    ``except Exception`` around ``read_metadata`` (an ``AssertionError`` otherwise)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.__cause__ = error

    def __reduce__(self):
        return type(self), (self.__cause__,)


def metadata_error_told(reader: Any, rank: int | None, read: Callable[[], Metadata]) -> Metadata:
    """``read()``, a reader's ``read_metadata`` (``rank``: DCP's fallback after the first call raised);
    where the fallback fails too, the first call's error is raised as a :class:`_MetadataUnreadable`."""
    try:
        return read()
    except CheckpointFormatError as e:
        first = getattr(reader, "_qdcp_metadata_error", None)
        if rank is None:
            reader._qdcp_metadata_error = e
        elif first is not None:
            raise _MetadataUnreadable(first)
        raise


class SafeReading:
    """Mixin for DCP's file-system readers (see the module)."""

    def _setup_safe_reading(self, thread_count: int | None = None) -> None:
        self.thread_count = max(1, int(thread_count)) if thread_count else None  # None: read_threads()
        self._qdcp_lanes: list[Lane] = []
        self._qdcp_sums_of: Metadata | None = None  # the metadata whose record read_metadata checked

    def read_threads(self) -> int:
        """The threads a load reads files on: ``thread_count``, else :func:`default_thread_count`."""
        return self.thread_count or default_thread_count()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        return metadata_error_told(self, rank, lambda: self._read_metadata(rank))

    def _read_metadata(self, rank: int | None) -> Metadata:
        path = self._get_metadata_path(rank)
        if not self.fs.exists(path):
            raise NoMetadataError(
                f"{os.fspath(self.path)!r} has no .metadata: it is not a DCP checkpoint, or its save "
                f"did not finish (a partial checkpoint)")
        try:
            with self._open_file(os.path.basename(os.fspath(path)), "the checkpoint's .metadata") as f:
                metadata = safe_load_metadata(f)
        except OSError as e:
            raise CheckpointFormatError(f"the checkpoint's .metadata cannot be read: {e}") from None
        check_stored_sizes(metadata)  # before any planner allocates for what the metadata claims
        # the record and digest checked before a planner reads the spec
        self._qdcp_sums, self._qdcp_sums_of = checksums.record(metadata), metadata
        metadata.storage_meta = QdcpStorageMeta.of(metadata.storage_meta, load_id=self.load_id, verifies_items=True)
        return metadata

    def _open_file(self, name: str, what: str) -> Any:
        return self.fs.create_stream(self.fs.concat_path(self.path, name), "rb")

    def check_files(self, metadata: Metadata) -> None:
        """Refuse, before anything is read, data files that may not be read (local checkpoints check)."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.check_files(metadata)
        check_chunk_geometry(metadata)  # here, not in read_metadata: `qdcp verify` lists such problems
        if self._qdcp_sums_of is not metadata:  # metadata this reader did not read (the entry reader's)
            self._qdcp_sums = checksums.record(metadata)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._qdcp_chunks = {  # (item fqn, chunk offsets) -> (chunk sizes, dtype)
            (fqn, tuple(c.offsets)): (tuple(c.sizes), item.properties.dtype)
            for fqn, item in metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata) for c in item.chunks}

    def read_data(self, plan, planner) -> Future:
        """DCP's ``read_data``, each item checked and verified (errors name the key), the files on up
        to :meth:`read_threads` threads (docs/api.md, *Storage*); CUDA copies have ended on return."""
        files = list(self._files_of(plan).items())
        threads = max(1, min(self.read_threads(), len(files)))
        lanes = lanes_for(self._qdcp_lanes, threads, _PlannerCalls(planner, shared=threads > 1))
        read_files(files, lanes, lambda lane, job, failed: self._read_file(lane, *job, failed))
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _files_of(self, plan) -> dict[str, list]:
        """The plan's reads by data file, in order, each file checked to lie inside the checkpoint."""
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
        return per_file

    def _read_file(self, lane: Lane, rel: str, reqs: list, failed: threading.Event) -> None:
        """Read ``reqs`` from data file ``rel``, in order (until ``failed`` is set: another file failed)."""
        where = f"{describe_item(reqs[0].storage_index.fqn)}: its data file"
        with contextlib.ExitStack() as files:
            try:  # an fsspec stream opens as it is entered
                stream = files.enter_context(self._open_file(rel, where))
            except OSError as e:
                raise CheckpointFormatError(f"{where} {rel!r} cannot be opened ({e}); the checkpoint is "
                                            f"incomplete") from None
            size = stream.seek(0, io.SEEK_END)
            try:
                for req in reqs:
                    if failed.is_set():
                        break
                    self._read_item(lane, stream, size, rel, req)
            except BaseException:
                lane.pending = None  # the load failed: the item copied last is not committed
                raise

    def _read_item(self, lane: Lane, stream, size: int, rel: str, req) -> None:
        """Read one item, check it and hand it (bytes, or the part of a chunk ``req`` reads) to the planner."""
        calls, where = lane.calls, describe_item(req.storage_index.fqn)
        info = self.storage_data[req.storage_index]
        span = _stored_range(info, size, rel, where)
        descriptors = list(info.transform_descriptors or ())
        version = checksums.trailer_version(descriptors, where)
        transforms = descriptors[:-1] if version is not None else descriptors
        found = self._qdcp_sums.expected(req.storage_index.fqn, req.storage_index.offset) \
            if self._qdcp_sums is not None and version is None else None
        recorded = found[1] if found is not None else None
        expected = self._qdcp_chunks.get((req.storage_index.fqn, tuple(req.storage_index.offset or ())))
        whole = expected is not None and not any(req.storage_offsets) and tuple(req.lengths) == expected[0]
        tensor_item = req.type != LoadItemType.BYTE_IO
        in_place = tensor_item and not transforms  # read as a view of the memory it was read into
        buffer = self._planner_buffer(calls, req, span[1]) if in_place else None
        target = calls("resolve_tensor", req).detach() if tensor_item and not calls.adopting else None
        if whole and target is not None and not descriptors and recorded is not None \
                and self._read_straight(lane, stream, req, span, target, expected, recorded, where):
            return
        pinned = whole and in_place and target is not None and target.device.type == "cuda" \
            and span[1] <= lane.pinned_max
        try:
            with torch.cuda.device(target.device) if pinned else contextlib.nullcontext():
                memory = buffer if buffer is not None else lane.buffer(span[1], pinned)
            payload = self._payload(stream, span, rel, memory, transforms, version, req, where)
            if not tensor_item:
                return self._deliver_bytes(calls, req, payload, recorded, version is None, where)
            if version is None and recorded is None:
                check_zip_crcs(payload, where)
            tensor = archived_tensor(payload, memory) if in_place else None
            adoptable = tensor is None or buffer is not None  # a view of the reader's own memory is copied out
            if tensor is None:
                tensor = load_pickled_tensor(payload, where)
            verified = self._verification(calls, req, tensor, recorded)
        except QdcpError:
            raise
        except Exception as e:
            raise CheckpointFormatError(f"{where}: its stored data cannot be read ({type(e).__name__}: {e})") from e
        self._deliver(lane, req, target, self._requested_part(tensor, req, expected, where), verified, adoptable,
                      where, pinned)

    def _read_straight(self, lane: Lane, stream, req, span: tuple[int, int], target: torch.Tensor,
                       expected: tuple, recorded: int, where: str) -> bool:
        """Read a whole chunk straight into ``target``, check and commit it, where ``target`` is a
        contiguous plain CPU tensor of its ``expected`` shape and dtype (True); else False, unread."""
        if (tuple(target.shape), target.dtype) != expected or target.device.type != "cpu" \
                or not target.is_contiguous() or type(target) is not torch.Tensor:
            return False
        try:
            if not read_archive_into(stream, *span, lane.buffer(span[1]), target):
                return False
        except Exception as e:
            raise CheckpointFormatError(f"{where}: its stored data cannot be read ({type(e).__name__}: {e})") from e
        self._commit(lane.calls, req, target, self._verification(lane.calls, req, target, recorded), where)
        return True

    def _payload(self, stream, span: tuple[int, int], rel: str, memory: torch.Tensor, transforms: list,
                 version: str | None, req, where: str) -> memoryview:
        """The item's bytes read into ``memory``, its trailer checked, its transforms undone (a copy)."""
        offset, length = span
        stream.seek(offset)
        data = memoryview(memory.numpy())[:length]
        got = stream.readinto(data)
        if got != length:
            raise CheckpointFormatError(f"{where}: {rel!r} ended after {got} of {length} bytes")
        if version is not None:
            data = checksums.trailed_payload(data, where, version)
        if not transforms:
            return data
        return memoryview(self.transforms.transform_load_stream(req, transforms, io.BytesIO(data)).read(-1))

    @staticmethod
    def _verification(calls: _PlannerCalls, req, data: Any, recorded: int | None) -> Callable[..., None]:
        """Start hashing the item just read; the call returned waits and raises for a hash that is not
        ``recorded`` (``written``: its bytes already went into ``resolve_tensor``'s buffer)."""
        if recorded is None:
            return lambda written=True: None
        pending = checksums.hash_later(data)

        def verified(written: bool = True) -> None:
            got = pending()
            if got is not None and got != recorded:  # None: a subclass whose values cannot be read
                raise checksums.corrupt(req.storage_index.fqn, req.storage_index.offset, recorded, got,
                                        calls.changed(req, written))
        return verified

    @staticmethod
    def _planner_buffer(calls: _PlannerCalls, req, length: int) -> torch.Tensor | None:
        """The planner's ``buffer_for`` memory for this item (checked), or None."""
        buffer = calls("buffer_for", req, length) if calls.adopting else None
        if buffer is None:
            return None
        if buffer.dtype != torch.uint8 or buffer.device.type != "cpu" or not buffer.is_contiguous() \
                or buffer.numel() < length:
            raise QdcpError(f"{type(calls.planner).__name__}.buffer_for gave {buffer.dtype} {tuple(buffer.shape)} "
                            f"on {buffer.device}; a contiguous CPU uint8 buffer of {length} bytes is needed")
        return buffer[:length]

    @staticmethod
    def _requested_part(tensor, req, expected: tuple | None, where: str) -> torch.Tensor:
        """The part of a loaded chunk ``req`` reads, the chunk checked to be the ``expected`` one."""
        if expected is not None and isinstance(tensor, torch.Tensor):
            tensor = _stored_values(tensor, expected[1], where)
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

    def _deliver_bytes(self, calls: _PlannerCalls, req, payload: memoryview, recorded: int | None, zip_crcs: bool,
                       where: str) -> None:
        """An object item, checked, to the planner."""
        if recorded is not None:
            self._verification(calls, req, payload, recorded)(written=False)
        elif zip_crcs and payload[:4] == b"PK\x03\x04":  # a torch.save archive
            check_zip_crcs(payload, where)
        calls("load_bytes", req, io.BytesIO(payload))

    def _deliver(self, lane: Lane, req, target: torch.Tensor | None, tensor: torch.Tensor,
                 verified: Callable[..., None], adoptable: bool, where: str, pinned: bool) -> None:
        """The part of a chunk ``req`` reads, to the planner: adopted as it is, else copied into
        ``target`` while it is hashed on another core, then committed."""
        calls = lane.calls
        if adoptable and calls.adopting:
            verified(written=False)
            if calls("adopt_tensor", req, tensor):
                return
        if target is None:
            target = calls("resolve_tensor", req).detach()
        lane.note_target(target)
        if target.size() != tensor.size():
            raise CheckpointFormatError(f"{where}: a read of {tuple(tensor.shape)} goes to a buffer of "
                                        f"{tuple(target.shape)}")
        if pinned and tensor.is_pinned():
            return lane.copy_later(target, tensor, lambda: self._commit(calls, req, target, verified, where))
        target.copy_(tensor)
        self._commit(calls, req, target, verified, where)

    @staticmethod
    def _commit(calls: _PlannerCalls, req, target: torch.Tensor, verified: Callable[[], None], where: str) -> None:
        verified()
        try:
            calls("commit_tensor", req, target)
        except QdcpError:
            raise
        except Exception as e:
            raise CheckpointFormatError(
                f"{where}: the entry cannot be rebuilt from its stored data ({type(e).__name__}: {e})") from e


def _stored_values(tensor: torch.Tensor, dtype: torch.dtype, where: str) -> torch.Tensor:
    """A stored chunk's plain values: a whole quantized tensor (stock DCP's) dequantized by its adapter
    to the recorded dtype; a subclass with no adapter left as it is (as DCP does)."""
    adapter = find_adapter(tensor)
    if adapter is None:
        return tensor
    try:
        return adapter.dequantize(tensor, dtype).to(dtype)
    except Exception as e:
        raise CheckpointFormatError(
            f"{where}: the stored chunk is a whole {type(tensor).__name__} (pickled by DCP's own save, "
            f"without qdcp's planner) whose values cannot be computed ({type(e).__name__}: {e}): it is "
            f"damaged, or from another version of its library. Load it where it was saved and re-save "
            f"it with qdcp.save") from e


def _stored_range(info, size: int, rel: str, where: str) -> tuple[int, int]:
    """``(offset, length)`` of an item's bytes, checked to lie inside its file of ``size`` bytes."""
    offset, length = info.offset, info.length
    if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length <= size - offset):
        raise CheckpointFormatError(
            f"{where}: its stored bytes [{offset}, {offset}+{length}) lie outside {rel!r} ({size} "
            f"bytes); the file is truncated or the metadata is corrupt")
    return offset, length


class CheckpointReader(SafeReading, FileSystemReader):
    """A ``FileSystemReader`` that runs no code from ``.metadata`` and verifies every item it reads.
    ``thread_count``: data files read at once (default: :meth:`read_threads`)."""

    def __init__(self, path: str | os.PathLike, thread_count: int | None = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._setup_safe_reading(thread_count)

    def _open_file(self, name: str, what: str) -> Any:
        """Only a regular file inside the checkpoint directory (:func:`~qdcp.storage.local_files.open_inside`)."""
        return open_inside(self.path, name, what)

    def check_files(self, metadata: Metadata) -> None:
        """Refuse data files outside the directory or not regular (named with their first key)."""
        first: dict[str, str] = {}
        for index, info in (metadata.storage_data or {}).items():
            first.setdefault(info.relative_path, index.fqn)
        for rel, fqn in first.items():
            problem = file_problem(self.path, rel)
            if problem is not None:
                raise refusal(f"{describe_item(fqn)}: its data file", self.path, rel, problem)
