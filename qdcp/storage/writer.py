"""qdcp's storage writer: DCP's file-system writer that refuses to write over a checkpoint unless
told to, commits atomically (fresh data-file names, ``.metadata`` renamed into place last), allows
one save per path at a time, and guards the plain path's planner (``refuse_existing_checkpoint``)."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import threading
import uuid
import weakref
from typing import Any, Callable

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from qdcp.errors import QdcpError
from qdcp.storage.hooks import records_checksums
from qdcp.storage.metadata import METADATA_FILE
from qdcp.storage.trailer import ChecksumExtension
from qdcp.storage.urls import is_url

__all__ = ["AtomicWriting", "CheckpointWriter", "refuse_existing_checkpoint"]

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
    if path is None or _guarded_metas.get(id(storage_meta)) is storage_meta or is_url(path):
        return
    if os.path.isfile(os.path.join(os.fspath(path), METADATA_FILE)):
        raise FileExistsError(
            f"a checkpoint already exists at {os.fspath(path)!r} and this save would overwrite its files "
            f"in place (a save that fails midway leaves neither checkpoint loadable). Save to a new path, "
            f"or pass {who}(overwrite=True) to replace it; qdcp.save(..., overwrite=True) replaces it "
            f"atomically")


_default_stager: Callable[[], AsyncStager] | None = None


def set_default_stager(factory: Callable[[], AsyncStager] | None) -> None:
    """What a qdcp writer stages through when ``dcp.async_save`` uses it as its stager and it was
    given none: ``factory()``, made once per writer (``import qdcp`` sets :class:`qdcp.QuantizedStager`);
    None: DCP's own staging."""
    global _default_stager
    _default_stager = factory


class AtomicWriting:
    """Mixin for DCP's file-system writers: no silent overwrite, atomic commit, one save per path."""

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()
        if meta is not None:
            _guarded_metas[id(meta)] = meta  # this writer refuses an existing checkpoint itself
        return meta

    def _setup_atomic(self, overwrite: bool, stager: AsyncStager | None = None) -> None:
        self.qdcp_overwrite = overwrite
        self._qdcp_extensions = tuple(self.transforms.extensions)
        self._holds_path = False
        self._stager = stager
        self._owns_stager = stager is None

    # DCP's hook: ``dcp.async_save`` without ``async_stager`` stages through a writer that is an
    # AsyncStager (FileSystemWriter is one). This writer does no staging of its own: it hands the
    # call to the stager it was given, else to one from the default factory (set_default_stager).
    def stage(self, state_dict):
        if self._stager is None:
            if _default_stager is None:
                return super().stage(state_dict)  # DCP's own (FileSystemWriter's) staging
            self._stager = _default_stager()
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        if self._stager is not None:
            self._stager.synchronize_staging()

    def close(self) -> None:
        """Closes the stager this writer made (a stager passed in stays its owner's)."""
        if self._stager is not None and self._owns_stager:
            self._stager.close()
            self._stager = None

    def __getstate__(self):  # the PROCESS checkpointer pickles the writer: buffers stay here
        state = self.__dict__.copy()
        state["_stager"] = None
        state["_owns_stager"] = True
        return state

    def _key(self) -> str:
        return os.path.abspath(os.fspath(self.path)) if not is_url(self.path) else os.fspath(self.path)

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
        self.transforms.extensions = () if records_checksums(planner) else self._qdcp_extensions
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
        if is_url(self.path):
            self.fs.rename(tmp_path, final)  # object stores: copy + delete; not atomic
        else:
            os.replace(tmp_path, final)  # atomic on POSIX: readers see the old or the new one
            if self.sync_files:
                _fsync_dir(os.fspath(self.path))
        referenced = {info.relative_path for info in storage_md.values()}
        self._remove_unreferenced(referenced)

    def _remove_unreferenced(self, referenced: set[str]) -> None:
        """Delete data files of earlier checkpoints at this path (after the commit)."""
        if is_url(self.path):
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


class CheckpointWriter(AtomicWriting, FileSystemWriter):
    """A ``FileSystemWriter`` with checksums, atomic commit and explicit overwrite.

    Args:
        path: checkpoint directory.
        overwrite: replace an existing checkpoint (atomically). Default False: raise before writing.
        checksums: every item is checksummed: by the save planner where it records checksums
            in the metadata (:class:`~qdcp.QuantizedSavePlanner`, the default; the files stay
            readable by stock DCP), otherwise by this writer, which appends an XXH3-64 to each
            item (``qdcp-checksum/2``; such files need :class:`CheckpointReader`). Both are
            verified by :class:`CheckpointReader`. False: no writer checksums.
        stager: what ``dcp.async_save`` stages through when it uses this writer as its stager (no
            ``async_stager`` given); it stays the caller's to close. Default: a
            :class:`~qdcp.QuantizedStager` this writer makes, and closes in :meth:`close`.
        **kwargs: ``FileSystemWriter`` options (``thread_count``, ``sync_files``...).
    """

    def __init__(self, path: str | os.PathLike, overwrite: bool = False, checksums: bool = True,
                 stager: AsyncStager | None = None, **kwargs: Any) -> None:
        extensions = [ChecksumExtension()] if checksums else None
        super().__init__(path, overwrite=True, _extensions=extensions, **kwargs)
        self._setup_atomic(overwrite, stager)
