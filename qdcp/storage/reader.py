"""qdcp's storage reader: DCP's file-system reader with a safe ``.metadata``, every number it
gives checked before use, and every item verified once (against the checksum the save recorded,
its trailer, or torch.save's zip CRCs). It says so to the planner through the ``StorageMeta`` of
the metadata it reads (:class:`~qdcp.storage.metadata.QdcpStorageMeta`: ``verifies_items``).

A load planner may offer two things more, beside DCP's protocol (runtime-checkable, as DCP states
``AsyncStager``): :class:`ReportingLoadPlanner` (what the load changed, for an error) and
:class:`AdoptingLoadPlanner` (memory to read stored items into, kept as loaded)."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import threading
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.futures import Future

from qdcp import checksums
from qdcp.adapters import allow_pickled, find_adapter
from qdcp.errors import CheckpointFormatError, QdcpError
from qdcp.io.pipeline import default_thread_count
from qdcp.io.threads import run_jobs
from qdcp.io.torch_save import ViewReader, archived_tensor, check_zip_crcs, read_archive_into
from qdcp.spec import describe_item
from qdcp.storage.local_files import file_problem, open_inside, refusal
from qdcp.storage.metadata import QdcpStorageMeta, check_chunk_geometry, check_stored_sizes, safe_load_metadata

__all__ = ["SafeReading", "CheckpointReader", "metadata_error_told", "ReportingLoadPlanner", "AdoptingLoadPlanner",
           "NoMetadataError"]

# a whole stored chunk bound for a CUDA buffer, up to this size divided by the number of reading
# threads, is read into one of its thread's two reused pinned buffers and copied without blocking:
# the next item is read while it is copied and hashed (at most twice this size pinned in all)
_PINNED_MAX = 256 << 20


@runtime_checkable
class ReportingLoadPlanner(Protocol):
    """A load planner that can say what a load has changed in its targets so far
    (:class:`qdcp.QuantizedLoadPlanner`), said in the error for an item found corrupt."""

    def changed_note(self, read_item: ReadItem, written: bool) -> str:
        """What the load has changed so far, ``read_item``'s bytes included if ``written`` (copied
        into ``resolve_tensor``'s buffer before they were found corrupt)."""


@runtime_checkable
class AdoptingLoadPlanner(Protocol):
    """A load planner that keeps stored items as loaded, in memory it offers (qdcp's entry reader)."""

    def buffer_for(self, read_item: ReadItem, nbytes: int) -> torch.Tensor | None:
        """Memory to read a stored item into (a contiguous CPU uint8 tensor of ``nbytes``), or None."""

    def adopt_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> bool:
        """Keep ``tensor`` (the item as loaded, verified, possibly a view of :meth:`buffer_for`'s
        memory); False: the reader copies it into ``resolve_tensor``'s buffer, as DCP's does."""


class _PlannerCalls:
    """The planner as the reading threads call it, ``calls("method", *args)``: one call at a time
    (DCP's load planners are called by one thread), its optional capabilities looked up once."""

    def __init__(self, planner: Any, shared: bool) -> None:
        self.planner = planner
        self.adopting = isinstance(planner, AdoptingLoadPlanner)
        self.reporting = isinstance(planner, ReportingLoadPlanner)
        self._lock = threading.Lock() if shared else contextlib.nullcontext()

    def __call__(self, method: str, *args: Any) -> Any:
        with self._lock:
            return getattr(self.planner, method)(*args)

    def changed(self, req, written: bool) -> str:
        """What the load has changed so far, for an error about ``req`` ("" if the planner cannot say)."""
        return self("changed_note", req, written) if self.reporting else ""


class _Lane:
    """One reading thread's memory, kept by the reader from load to load: a scratch buffer, two
    pinned buffers for CUDA targets (and the copies from them still running), the item whose copy
    is still running (committed after the next item is read)."""

    def __init__(self) -> None:
        self.calls: _PlannerCalls | None = None
        self.scratch: torch.Tensor | None = None
        self.pinned: list[torch.Tensor | None] = [None, None]
        self.copied: list[Any] = [None, None]
        self.slot = 1
        self.pinned_max = _PINNED_MAX
        self.pending: Callable[[], None] | None = None
        self.devices: set[int] = set()  # the CUDA devices of the targets it copied into (this load)

    def buffer(self, length: int, pinned: bool = False) -> torch.Tensor:
        """``length`` bytes of reused memory: the scratch buffer, or the other of the two pinned
        buffers once the copy from it has ended (an old buffer is freed before a larger one is made)."""
        if pinned:
            self.slot = 1 - self.slot
            if self.copied[self.slot] is not None:
                self.copied[self.slot].synchronize()
            buf = self.pinned[self.slot]
            if buf is None or buf.numel() < length:
                self.pinned[self.slot] = None
                buf = self.pinned[self.slot] = torch.empty(max(length, 1 << 20), dtype=torch.uint8, pin_memory=True)
            return buf[:length]
        if self.scratch is None or self.scratch.numel() < length:
            self.scratch = None
            self.scratch = torch.empty(max(length, 1 << 20), dtype=torch.uint8)
        return self.scratch[:length]

    def finish_pending(self) -> None:
        """Commit the item whose copy was left running (its check waited for first)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending()


class NoMetadataError(CheckpointFormatError):
    """The checkpoint directory holds no ``.metadata`` (not a checkpoint, or a save that did not
    finish): ``qdcp.load`` raises :class:`qdcp.CheckpointNotFoundError` for it."""


class _MetadataUnreadable(BaseException):
    """Carries qdcp's ``.metadata`` error (its ``__cause__``) past ``dcp.load``'s ``except Exception``
    around ``read_metadata``, which would turn it into ``AssertionError("metadata is None; ...")``:
    DCP wraps it in its CheckpointException, message intact, and ``qdcp.load`` raises the cause.
    The cause travels with it when DCP gathers each rank's error to the others (pickled, where an
    exception's ``__cause__`` is lost)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.__cause__ = error

    def __reduce__(self):
        return type(self), (self.__cause__,)


def metadata_error_told(reader: Any, rank: int | None, read: Callable[[], Metadata]) -> Metadata:
    """``read()``, a reader's ``read_metadata`` (``rank``: DCP's rank-local fallback, called when the
    first call raised): where the fallback fails too, the first call's qdcp error (kept on
    ``reader``) is raised again as a :class:`_MetadataUnreadable`."""
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
    """Mixin for DCP's file-system readers: safe ``.metadata`` and verified checksums."""

    def _setup_safe_reading(self, thread_count: int | None = None) -> None:
        self.thread_count = max(1, int(thread_count)) if thread_count else None  # None: read_threads()
        self._qdcp_lanes: list[_Lane] = []
        self._qdcp_sums_of: Metadata | None = None  # the metadata whose record read_metadata checked

    def read_threads(self) -> int:
        """The threads a load reads files on: ``thread_count`` where given; by default the usable
        cores, at most 4 (into CUDA targets as into host memory)."""
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
        # the record and the metadata's digest before a planner reads the spec (damage refused as damage)
        self._qdcp_sums, self._qdcp_sums_of = checksums.record(metadata), metadata
        # this reader verifies every item it reads: the planner need not (one rule, no per-item calls)
        metadata.storage_meta = QdcpStorageMeta.of(metadata.storage_meta, load_id=self.load_id, verifies_items=True)
        return metadata

    def _open_file(self, name: str, what: str) -> Any:
        """File ``name`` of the checkpoint, opened for reading (``what``: how an error names it)."""
        return self.fs.create_stream(self.fs.concat_path(self.path, name), "rb")

    def check_files(self, metadata: Metadata) -> None:
        """Refuse a checkpoint whose data files may not be read (here: none; local checkpoints check),
        before anything is read: :meth:`set_up_storage_reader` calls it, as does qdcp's entry reader."""

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
        """DCP's ``FileSystemReader.read_data``, every number the metadata gives checked before use
        and every item verified once (a failure: a :class:`CheckpointFormatError` naming the key).
        The files are read on up to :meth:`read_threads` threads, each file's items in order by one
        of them, the planner called by one thread at a time; where reads fail, the error of the
        first failing file (in the plan's order) is raised once every thread has stopped. Copies
        into CUDA targets made on other threads have ended when this returns."""
        files = list(self._files_of(plan).items())
        threads = max(1, min(self.read_threads(), len(files)))
        calls = _PlannerCalls(planner, shared=threads > 1)
        while len(self._qdcp_lanes) < threads:
            self._qdcp_lanes.append(_Lane())
        lanes = self._qdcp_lanes[:threads]
        for lane in lanes:
            lane.calls, lane.pending, lane.devices = calls, None, set()
            lane.pinned_max = _PINNED_MAX // threads
        # a new thread's current CUDA device is 0: the others take the caller's (no context made on 0)
        device = torch.cuda.current_device() if threads > 1 and torch.cuda.is_initialized() else None

        def read(lane: _Lane, job: tuple[str, list], failed: threading.Event) -> tuple:
            if device is not None:
                torch.cuda.set_device(device)
            self._read_file(lane, *job, failed)
            return ()

        try:
            run_jobs(files, lanes, read, "qdcp-read")
            for lane in lanes:
                lane.finish_pending()
        finally:
            if device is not None:  # the other threads' copies ran on their own streams: ended here
                for index in sorted({d for lane in lanes for d in lane.devices}):
                    torch.cuda.synchronize(index)
            for lane in lanes:
                lane.calls, lane.pending = None, None
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _files_of(self, plan) -> dict[str, list]:
        """The plan's reads by data file (in the plan's order), every file checked to lie inside the checkpoint."""
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

    def _read_file(self, lane: _Lane, rel: str, reqs: list, failed: threading.Event) -> None:
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

    def _read_item(self, lane: _Lane, stream, size: int, rel: str, req) -> None:
        """Read one item, check it (its recorded checksum, else its trailer, else the zip's CRCs)
        and hand it to the planner: loaded bytes, or the part of a stored chunk ``req`` reads."""
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
                tensor = _unpickled(payload, where)
            verified = self._verification(calls, req, tensor, recorded)
        except QdcpError:
            raise
        except Exception as e:
            raise CheckpointFormatError(f"{where}: its stored data cannot be read ({type(e).__name__}: {e})") from e
        self._deliver(lane, req, target, self._requested_part(tensor, req, expected, where), verified, adoptable,
                      where, pinned)

    def _read_straight(self, lane: _Lane, stream, req, span: tuple[int, int], target: torch.Tensor,
                       expected: tuple, recorded: int, where: str) -> bool:
        """Read a whole stored chunk straight into ``target`` (``resolve_tensor``'s buffer), check it
        there and commit it, where ``target`` takes it as stored: the chunk's ``expected`` shape and
        dtype, on the CPU, contiguous (True); else False, nothing read into it."""
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
        """The item's stored bytes, read into ``memory``, its trailer checked and its transforms
        undone (only those make a copy)."""
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
        """Start hashing the item just read (large ones on a background thread, while the caller
        copies it on); the returned call waits and raises the error for corrupt bytes where the
        hash is not ``recorded``, saying what the load has changed so far (the planner's account;
        ``written``, default True: the bytes were copied into ``resolve_tensor``'s buffer)."""
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
        """A buffer the planner offers for this stored item (``buffer_for``: the item is read there
        and the planner adopts the view), or None."""
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
        """The part of a loaded stored chunk that ``req`` reads, after checking the chunk is the one
        the metadata records (``expected``: its shape and dtype) and the read lies within it."""
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
        """An object item, checked (the recorded checksum, else a torch.save archive's CRCs), to the planner."""
        if recorded is not None:
            self._verification(calls, req, payload, recorded)(written=False)
        elif zip_crcs and payload[:4] == b"PK\x03\x04":  # a torch.save archive
            check_zip_crcs(payload, where)
        calls("load_bytes", req, io.BytesIO(payload))

    def _deliver(self, lane: _Lane, req, target: torch.Tensor | None, tensor: torch.Tensor,
                 verified: Callable[..., None], adoptable: bool, where: str, pinned: bool) -> None:
        """The part of a stored chunk ``req`` reads, to the planner: adopted as it is (qdcp's entry
        reader keeps a whole chunk as loaded), else copied into ``target`` (``resolve_tensor``'s
        buffer) while the bytes just read are hashed on another core, then committed."""
        calls = lane.calls
        if adoptable and calls.adopting:
            verified(written=False)
            if calls("adopt_tensor", req, tensor):
                return
        if target is None:
            target = calls("resolve_tensor", req).detach()
        if target.device.type == "cuda":
            lane.devices.add(target.device.index if target.device.index is not None else torch.cuda.current_device())
        if target.size() != tensor.size():
            raise CheckpointFormatError(f"{where}: a read of {tuple(tensor.shape)} goes to a buffer of "
                                        f"{tuple(target.shape)}")
        if pinned and tensor.is_pinned():  # copied while the next item is read; committed after it
            target.copy_(tensor, non_blocking=True)
            with torch.cuda.device(target.device):
                copied = lane.copied[lane.slot] = torch.cuda.Event()
                copied.record()
            lane.finish_pending()
            lane.pending = lambda: self._commit(calls, req, target, verified, where)
            return
        target.copy_(tensor)
        self._commit(calls, req, target, verified, where)

    @staticmethod
    def _commit(calls: _PlannerCalls, req, target: torch.Tensor, verified: Callable[[], None], where: str) -> None:
        """Wait for ``target``'s check, then commit it to the planner."""
        verified()
        try:
            calls("commit_tensor", req, target)
        except QdcpError:
            raise
        except Exception as e:
            raise CheckpointFormatError(
                f"{where}: the entry cannot be rebuilt from its stored data ({type(e).__name__}: {e})") from e


def _unpickled(payload: memoryview, where: str) -> Any:
    """A stored item that is a ``torch.save`` archive, loaded with ``weights_only=True``. Stock DCP
    pickles a quantized tensor whole: where the archive names classes torch does not allow, the
    adapters of their families allow them (importing their library from its known modules, as a
    raw entry of the type would); other classes are refused, never imported."""
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


def _stored_values(tensor: torch.Tensor, dtype: torch.dtype, where: str) -> torch.Tensor:
    """A stored chunk as the plain values a plain chunk would hold. Stock DCP (no qdcp planner)
    pickles a quantized tensor whole: its values are computed by its adapter (as torchao's
    ``dequantize()``), in the dtype the metadata records; a subclass qdcp has no adapter for is
    left as it is (DCP's behaviour)."""
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
    """``(offset, length)`` of an item's stored bytes, checked to lie inside its file of ``size`` bytes."""
    offset, length = info.offset, info.length
    if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length <= size - offset):
        raise CheckpointFormatError(
            f"{where}: its stored bytes [{offset}, {offset}+{length}) lie outside {rel!r} ({size} "
            f"bytes); the file is truncated or the metadata is corrupt")
    return offset, length


class CheckpointReader(SafeReading, FileSystemReader):
    """A ``FileSystemReader`` that never runs code from ``.metadata``, verifies every item it reads
    and refuses a checkpoint whose save did not finish. ``thread_count``: data files read at once
    (default: :meth:`read_threads`)."""

    def __init__(self, path: str | os.PathLike, thread_count: int | None = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._setup_safe_reading(thread_count)

    def _open_file(self, name: str, what: str) -> Any:
        """Only a regular file inside the checkpoint directory (:func:`~qdcp.storage.local_files.open_inside`)."""
        return open_inside(self.path, name, what)

    def check_files(self, metadata: Metadata) -> None:
        """Refuse, before anything is read, a checkpoint whose data files resolve outside its
        directory or are not regular files (each file named, with the first key stored in it)."""
        first: dict[str, str] = {}
        for index, info in (metadata.storage_data or {}).items():
            first.setdefault(info.relative_path, index.fqn)
        for rel, fqn in first.items():
            problem = file_problem(self.path, rel)
            if problem is not None:
                raise refusal(f"{describe_item(fqn)}: its data file", self.path, rel, problem)
