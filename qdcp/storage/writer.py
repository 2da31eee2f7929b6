"""qdcp's storage writer: DCP's file-system writer with no silent overwrite, one save per path
(:mod:`qdcp.storage.claims`), an atomic commit (:mod:`qdcp.storage.commit`), a failed save's files
removed and write errors raised with their root cause (:mod:`qdcp.storage.causes`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystem, SerializationFormat, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.staging import AsyncStager
from torch.futures import Future

from qdcp import checksums
from qdcp.errors import QdcpError
from qdcp.io.pipeline import HashedStorageInfo, default_thread_count, write_items, writes_direct
from qdcp.storage import claims, commit
from qdcp.storage.causes import raise_with_cause
from qdcp.storage.metadata import METADATA_FILE, QdcpStorageMeta
from qdcp.storage.urls import is_url

__all__ = ["AtomicWriting", "CheckpointWriter", "refuse_existing_checkpoint"]


def refuse_existing_checkpoint(storage_meta: StorageMeta | None, who: str) -> None:
    """Raise :class:`FileExistsError` if a checkpoint lies at the local path a save is about to write,
    unless its writer guards the path itself (``QdcpStorageMeta.guards_path``). URLs are not checked."""
    path = getattr(storage_meta, "checkpoint_id", None)
    if path is None or getattr(storage_meta, "guards_path", False) or is_url(path):
        return
    if os.path.isfile(os.path.join(os.fspath(path), METADATA_FILE)):
        raise FileExistsError(
            f"a checkpoint already exists at {os.fspath(path)!r} and this save would overwrite its files "
            f"in place (a save that fails midway leaves neither checkpoint loadable). Save to a new path, "
            f"or pass {who}(overwrite=True) to replace it; qdcp.save(..., overwrite=True) replaces it "
            f"atomically")


_default_stager: Callable[[], AsyncStager] | None = None
_shared_lock = threading.Lock()
_shared: list[AsyncStager] = []  # default stagers, reused by this process's writers from save to save
_SHARED_MAX = 2


def set_default_stager(factory: Callable[[], AsyncStager] | None) -> None:
    """What a qdcp writer given no stager stages through: ``factory()``'s stagers (qdcp's first use sets
    :class:`qdcp.QuantizedStager`), shared by this process's writers so their buffers are reused from
    save to save (a save finding them all busy gets another). None: DCP's own staging. Setting it
    drops the shared stagers."""
    global _default_stager
    with _shared_lock:
        _default_stager = factory
        _shared.clear()


def _stage_shared(state_dict) -> tuple[AsyncStager, Any, bool]:
    """``(stager, staged, shared)``: staged by an idle shared stager, else a new one (kept if fewer
    than :data:`_SHARED_MAX` are)."""
    with _shared_lock:
        stager = next((s for s in _shared if not getattr(s, "in_use", True)), None)
        shared = stager is not None
        if stager is None:
            stager = _default_stager()
            if len(_shared) < _SHARED_MAX and hasattr(stager, "in_use"):
                _shared.append(stager)
                shared = True
        return stager, stager.stage(state_dict), shared


class AtomicWriting:
    """Mixin for DCP's file-system writers (the arguments: :class:`CheckpointWriter`'s)."""

    def __init__(self, path: str | os.PathLike, overwrite: bool = False, checksums: bool = True,
                 stager: AsyncStager | None = None, thread_count: int | None = None,
                 direct_io: bool | None = None, **kwargs: Any) -> None:
        super().__init__(path, overwrite=True, thread_count=thread_count or default_thread_count(), **kwargs)
        self.qdcp_overwrite = overwrite
        self.qdcp_checksums = bool(checksums)
        self.qdcp_auto_threads = thread_count is None
        self.qdcp_direct_io = direct_io
        self._claim: claims.PathClaim | None = None
        self._published = False
        self._stager = stager
        self._owns_stager = stager is None
        self.qdcp_staged = False  # set by stage(): this save's upload runs beside training
        self._dist_seen = _dist_up()  # made in a job: a save that finds no process group would be torn

    def storage_meta(self) -> StorageMeta | None:
        """DCP's, declaring to the planner what this writer does itself (:class:`QdcpStorageMeta`)."""
        return QdcpStorageMeta.of(super().storage_meta(), guards_path=True, hashes_items=self._hashes_items())

    def _hashes_items(self) -> bool:
        return self.qdcp_checksums and self._own_pipeline()

    def _own_pipeline(self) -> bool:
        """Whether items are written by qdcp's pipeline (torch.save archives), not DCP's (safetensors)."""
        return getattr(self, "serialization_format", SerializationFormat.TORCH_SAVE) == SerializationFormat.TORCH_SAVE

    # DCP's hook: ``dcp.async_save`` without ``async_stager`` stages through the writer; it hands
    # the call to its stager, else to a shared default one (set_default_stager)
    def stage(self, state_dict):
        self.qdcp_staged = True  # this save's upload runs beside training
        self._dist_seen = self._dist_seen or _dist_up()
        if self._stager is None:
            if _default_stager is None:
                return super().stage(state_dict)  # DCP's own (FileSystemWriter's) staging
            self._stager, staged, shared = _stage_shared(state_dict)
            self._owns_stager = not shared
            return staged
        return self._stager.stage(state_dict)

    @property
    def should_synchronize_after_execute(self) -> bool:
        """The stager's answer (DCP asks the object it staged through)."""
        stager = getattr(self, "_stager", None)
        if stager is not None:
            return stager.should_synchronize_after_execute
        return super().should_synchronize_after_execute

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
        state["_claim"] = None  # taken where the save runs (the PROCESS checkpointer's daemon)
        return state

    def prepare_local_plan(self, plan):
        if getattr(self, "_is_coordinator", True):
            # the other ranks write only once the global plan reaches them: no race on whether
            # this save made the directory (abandon() removes only that)
            self._made_dir = not is_url(self.path) and not os.path.isdir(self.path)
            self.fs.mkdir(self.path)
        return plan

    def check_path(self) -> None:
        """Raise now what planning would raise for the path (a checkpoint there without ``overwrite``,
        a claim held), taking and writing nothing: ``qdcp.async_save`` calls it before staging."""
        if self.fs.exists(self.path):
            self._refuse_existing()
            claims.refuse_if_held(self._store)

    def _refuse_existing(self) -> None:
        if not self.qdcp_overwrite and self._store.exists(METADATA_FILE):
            raise QdcpError(
                f"a checkpoint already exists at {os.fspath(self.path)!r}; pass overwrite=True to "
                f"replace it (the old one stays loadable until the new one is complete), or save "
                f"to a new path")

    def _release(self) -> None:
        claim, self._claim = self._claim, None
        if claim is not None:
            claim.release()

    def prepare_global_plan(self, plans):
        """On the coordinator: refuse a checkpoint at the path, claim it, check again (one may have been
        committed meanwhile); every file name carries the claim's token."""
        what = f"a qdcp save of {len(plans)} rank{'s' if len(plans) != 1 else ''} ({_command()})"
        self._refuse_existing()
        self._claim = claims.take(self._store, what)
        try:
            self._refuse_existing()
        except BaseException:
            self._release()
            raise
        token = self._claim.token
        return [dataclasses.replace(p, storage_data=_StoragePrefix(commit.data_prefix(token, i)))
                for i, p in enumerate(plans)]

    def write_data(self, plan, planner):
        try:
            if not getattr(self, "_is_coordinator", True):
                self.fs.mkdir(self.path)  # made by the coordinator, unless this host does not share its disk
            if not self._own_pipeline():
                fut = super().write_data(plan, planner)  # DCP's own (safetensors files)
                fut.wait()
            else:
                fut = Future()
                hashed = self._hashes_items()
                direct = writes_direct(self.qdcp_direct_io, self.qdcp_staged) and self.sync_files \
                    and isinstance(self.fs, FileSystem)
                fut.set_result(write_items(self, plan.items, plan.storage_data.prefix, planner, crc=not hashed,
                                           hash_items=hashed, direct=direct))
        except BaseException as e:
            self._remove_files(plan.storage_data.prefix)  # this rank's own, partly written
            if self._claim is not None:
                self._claim.ended = True  # it cannot commit now; abandon() removes every rank's files
            raise_with_cause(e, f"writing the checkpoint at {os.fspath(self.path)!r}")
        finally:
            self.qdcp_staged = False  # the next save through this writer says again whether it is staged
        return fut

    def group_gone(self) -> QdcpError | None:
        """The error of a save made in a job whose process group has since been destroyed, or None."""
        if not self._dist_seen or _dist_up():
            return None
        return QdcpError(
            f"the save to {os.fspath(self.path)!r} was made in a job, but torch.distributed is no longer "
            f"initialized where it runs (the process group was destroyed before an async save finished): "
            f"each rank would commit a checkpoint of its own data alone (a torn checkpoint); nothing was "
            f"committed. Wait for the save (its future's .result()) before dist.destroy_process_group()")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        torn = self.group_gone()
        if torn is not None:
            raise torn
        if kwargs.get("use_collectives") is False and _dist_up() and dist.get_world_size() > 1:
            raise QdcpError(
                f"saving to {os.fspath(self.path)!r} with use_collectives=False: every rank would commit a "
                f".metadata of its own data and claim the path for itself; qdcp's writer commits one "
                f"checkpoint per save. Pass use_collectives=True (the default)")
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._is_coordinator = is_coordinator

    def finish(self, metadata: Metadata, results) -> None:
        self._published = False
        try:
            self._commit(metadata, results)
        except BaseException as e:
            if not self._published:
                self.abandon()
            raise_with_cause(e, f"committing the checkpoint at {os.fspath(self.path)!r}")
        finally:
            self._release()

    def abandon(self) -> None:
        """End a save that did not commit: remove every rank's files (call it once every rank has
        returned, as ``qdcp.save`` does) and release the claim. A no-op after a commit and off the
        coordinator."""
        claim = self._claim
        if claim is not None:
            self._remove_files(commit.save_prefix(claim.token))
            self._store.remove(commit.metadata_tmp(claim.token))
        self._release()
        if claim is not None and getattr(self, "_made_dir", False):
            with contextlib.suppress(OSError):  # the directory this save made, if nothing else is in it
                os.rmdir(self.path)

    @property
    def _store(self) -> claims.LocalStore | claims.FsspecStore:
        if is_url(self.path):
            return claims.FsspecStore(self.fs.fs, os.fspath(self.path), os.fspath(self.path))
        return claims.LocalStore(self.path)

    def _remove_files(self, prefix: str) -> None:
        """Remove this save's data files starting with ``prefix`` (best effort)."""
        with contextlib.suppress(OSError):
            for name in self._store.names():
                if name.startswith(prefix) and commit.token_of(name) is not None:
                    self._store.remove(name)

    def _commit(self, metadata: Metadata, results) -> None:
        """Publish ``.metadata`` (the claim checked first), then remove what the replaced checkpoint
        and dead saves left."""
        metadata.version = CURRENT_DCP_VERSION
        storage_md, hashes = {}, {}
        for wr_list in results:
            for wr in wr_list:
                info = wr.storage_data
                if isinstance(info, HashedStorageInfo):  # the hash goes to the record
                    hashes[wr.index], info = info.qdcp_hash, info.stored()
                storage_md[wr.index] = info
        metadata.storage_data = storage_md
        if self._hashes_items():
            checksums.attach(metadata, checksums.written_record(metadata, hashes.items()))
        metadata.storage_meta = self.storage_meta().plain()
        token, store, root = self._claim.token, self._store, os.fspath(self.path)
        replaced = commit.referenced_in(store.read(METADATA_FILE)) if self.qdcp_overwrite else set()
        if is_url(self.path):
            commit.publish_remote(self.fs.fs, root, token, metadata, self.qdcp_overwrite, self._claim.check)
        else:
            commit.publish_local(root, token, metadata, self.qdcp_overwrite, self._claim.check, self.sync_files)
        self._published = True
        try:  # committed; what is left (a name that cannot be removed, a directory) stays
            if self.sync_files and not is_url(self.path):
                _fsync_dir(root)
            names = store.names()
        except OSError:
            return
        for name in commit.debris(names, commit.referenced(metadata), replaced, token):
            with contextlib.suppress(OSError):  # e.g. a directory of that name: left, the others still go
                self._remove_unreferenced(name)

    def _remove_unreferenced(self, name: str) -> None:
        """Remove a file the committed checkpoint does not reference."""
        self._store.remove(name)


def _dist_up() -> bool:
    return dist.is_available() and dist.is_initialized()


def _command() -> str:
    line = " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]) if sys.argv and sys.argv[0] else "python"
    return line if len(line) <= 80 else line[:77] + "..."


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter(AtomicWriting, FileSystemWriter):
    """A ``FileSystemWriter`` with checksums, atomic commit, explicit overwrite and one save per path
    (a second raises :class:`~qdcp.ConcurrentSaveError` naming the first); :meth:`abandon` removes
    what a failed save wrote (docs/api.md, *Storage*).

    Args:
        path: checkpoint directory.
        overwrite: replace an existing checkpoint (atomically). Default False: raise before writing.
        checksums: hash every item (XXH3-64) as it is written and record the hashes, whatever the
            planner. False: no record.
        stager: what ``dcp.async_save`` stages through when it uses this writer as its stager; the
            caller's to close. Default: a :class:`~qdcp.QuantizedStager` shared by this process's
            writers (:func:`set_default_stager`).
        thread_count: files (and threads) each rank writes into; default
            :func:`~qdcp.io.pipeline.default_thread_count`.
        direct_io: large items written around the page cache (:func:`qdcp.io.pipeline.writes_direct`;
            fsync'd local files only). None: for the async saves this writer stages, on fewer than
            :data:`~qdcp.io.pipeline.DIRECT_UPLOAD_BELOW_CORES` cores; True: every save; False: none.
        **kwargs: other ``FileSystemWriter`` options (``sync_files``, ``per_thread_copy_ahead``...).
    """
