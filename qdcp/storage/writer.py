"""qdcp's storage writer: DCP's file-system writer that refuses to write over a checkpoint unless
told to, claims the path for one save across processes and hosts (:mod:`qdcp.storage.claims`),
commits atomically (file names no other save shares, ``.metadata`` published last after checking
the claim again: :mod:`qdcp.storage.commit`), removes what a failed save wrote, raises write errors
with their root cause (:mod:`qdcp.storage.causes`), and guards the plain path's planner
(``refuse_existing_checkpoint``)."""

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
from qdcp.io import pipeline
from qdcp.io.pipeline import HashedStorageInfo, default_thread_count, write_items
from qdcp.storage import claims, commit
from qdcp.storage.causes import raise_with_cause
from qdcp.storage.metadata import METADATA_FILE, QdcpStorageMeta
from qdcp.storage.urls import is_url

__all__ = ["AtomicWriting", "CheckpointWriter", "refuse_existing_checkpoint"]

#: ``direct_io=None``: an async save's upload (a save this writer staged) is written directly where
#: the process may use fewer cores than this, buffered where it may use this many or more (measured:
#: docs/benchmarks.md, *Async save on few cores*; on 2 cores training beside a direct upload ran 2-3x
#: as fast as beside a buffered one, on 16 buffered uploads finished 10-40% sooner).
DIRECT_UPLOAD_BELOW_CORES = 8


def refuse_existing_checkpoint(storage_meta: StorageMeta | None, who: str) -> None:
    """Raise :class:`FileExistsError` if a DCP checkpoint already lies at the local path a save is
    about to write (``storage_meta.checkpoint_id``), unless that save's writer is one of qdcp's
    (which guards its path itself: ``QdcpStorageMeta.guards_path``). Remote paths (URLs) are not checked."""
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
    """What a qdcp writer stages through when ``dcp.async_save`` uses it as its stager and it was
    given none: a stager from ``factory()`` (``import qdcp`` sets :class:`qdcp.QuantizedStager`),
    shared by this process's qdcp writers, so that its buffers (pinned where an accelerator is) are
    allocated once and reused from save to save; a save that starts while the shared ones are still
    in use by uploads gets another. None: DCP's own staging. Setting it drops the shared stagers."""
    global _default_stager
    with _shared_lock:
        _default_stager = factory
        _shared.clear()


def _stage_shared(state_dict) -> tuple[AsyncStager, Any, bool]:
    """``(stager, staged, shared)``: ``state_dict`` staged by an idle shared default stager (one
    made if none is idle; kept for later saves unless there are already :data:`_SHARED_MAX`)."""
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
    """Mixin for DCP's file-system writers: no silent overwrite, atomic commit, one save per path
    (the arguments: :class:`CheckpointWriter`'s)."""

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
        """Whether this writer hashes every item as it writes it and records the checksums."""
        return self.qdcp_checksums and self._own_pipeline()

    def _own_pipeline(self) -> bool:
        """Whether items are written by qdcp's pipeline (torch.save archives), not DCP's own."""
        return getattr(self, "serialization_format", SerializationFormat.TORCH_SAVE) == SerializationFormat.TORCH_SAVE

    # DCP's hook: ``dcp.async_save`` without ``async_stager`` stages through a writer that is an
    # AsyncStager (FileSystemWriter is one). This writer does no staging of its own: it hands the
    # call to the stager it was given, else to one from the default factory (set_default_stager).
    def stage(self, state_dict):
        self.qdcp_staged = True  # this save's upload runs beside training (see _writes_direct)
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

    def _writes_direct(self) -> bool:
        """Whether this save's large items go to the disk from their memory (:mod:`qdcp.io.direct`):
        where ``direct_io`` asks (None: where this writer staged the save, an async one, and this
        process may use fewer than :data:`DIRECT_UPLOAD_BELOW_CORES` cores), files are fsync'd and
        lie on the local file system."""
        wanted = getattr(self, "qdcp_direct_io", None)
        if wanted is None:
            wanted = self.qdcp_staged and pipeline.usable_cores() < DIRECT_UPLOAD_BELOW_CORES
        return bool(wanted) and self.sync_files and isinstance(self.fs, FileSystem)

    def prepare_local_plan(self, plan):
        if getattr(self, "_is_coordinator", True):
            # the coordinator makes the directory: the other ranks write into it only once the
            # global plan (made after this) reaches them, so whether this save made it is known
            # here, with no race between ranks (abandon() removes it only then)
            self._made_dir = not is_url(self.path) and not os.path.isdir(self.path)
            self.fs.mkdir(self.path)
        return plan

    def check_path(self) -> None:
        """Raise now what planning this save would raise for its path, taking and writing nothing
        (``qdcp.async_save`` calls it before staging): a checkpoint there (no ``overwrite``), a claim
        on it held by a save that may still run (one of this process's among them)."""
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
        """On the coordinator only, once per save: refuse a checkpoint at the path (no ``overwrite``),
        claim the path (:mod:`qdcp.storage.claims`), then check again (one may have been committed
        meanwhile); every file name carries the claim's token."""
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
        # each item hashed as written (_hashes_items), the record made in finish() from the ranks' results
        try:
            if not getattr(self, "_is_coordinator", True):
                self.fs.mkdir(self.path)  # made by the coordinator, unless this host does not share its disk
            # qdcp's pipeline (qdcp.io.pipeline): files on threads, no zip CRC-32 where every
            # item is hashed, device copies ahead of the writes
            if not self._own_pipeline():
                fut = super().write_data(plan, planner)  # DCP's own (safetensors files)
                fut.wait()
            else:
                fut = Future()
                hashed = self._hashes_items()
                fut.set_result(write_items(self, plan.items, plan.storage_data.prefix, planner, crc=not hashed,
                                           hash_items=hashed, direct=self._writes_direct()))
        except BaseException as e:
            self._remove_files(plan.storage_data.prefix)  # this rank's own, partly written
            if self._claim is not None:
                self._claim.end()  # it cannot commit now; abandon() removes every rank's files
            raise_with_cause(e, f"writing the checkpoint at {os.fspath(self.path)!r}")
        finally:
            self.qdcp_staged = False  # the next save through this writer says again whether it is staged
        return fut

    def group_gone(self) -> QdcpError | None:
        """The error of a save made in a job that runs on after its process group was destroyed
        (an async save not waited for), or None while the group stands."""
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
        """End a save that did not commit: remove the files it wrote (every rank's: call it once
        every rank has returned, as ``qdcp.save`` does) and release its claim. A no-op after a
        save that committed, and on ranks other than the coordinator."""
        claim = self._claim
        if claim is not None:
            self._remove_files(commit.save_prefix(claim.token))
            self._store.remove(commit.metadata_tmp(claim.token))
        self._release()
        if claim is not None and getattr(self, "_made_dir", False):
            try:
                os.rmdir(self.path)  # the directory this save made, if nothing else is in it
            except OSError:
                pass

    @property
    def _store(self) -> claims.LocalStore | claims.FsspecStore:
        """The checkpoint directory's files, by name."""
        if is_url(self.path):
            return claims.FsspecStore(self.fs.fs, os.fspath(self.path), os.fspath(self.path))
        return claims.LocalStore(self.path)

    def _remove_files(self, prefix: str) -> None:
        """Remove this save's data files that start with ``prefix`` (never raises: best effort)."""
        with contextlib.suppress(OSError):
            for name in self._store.names():
                if name.startswith(prefix) and commit.token_of(name) is not None:
                    self._store.remove(name)

    def _commit(self, metadata: Metadata, results) -> None:
        """Write ``.metadata`` and publish it (the claim checked first); then remove what the
        replaced checkpoint and dead saves left (``_published`` set in between)."""
        metadata.version = CURRENT_DCP_VERSION
        storage_md, hashes = {}, {}
        for wr_list in results:
            for wr in wr_list:
                info = wr.storage_data
                if isinstance(info, HashedStorageInfo):  # the hash goes to the record, not the storage data
                    hashes[wr.index], info = info.qdcp_hash, info.stored()
                storage_md[wr.index] = info
        metadata.storage_data = storage_md
        if self._hashes_items():
            checksums.attach(metadata, checksums.written_record(metadata, hashes))
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
            try:
                self._remove_unreferenced(name)
            except OSError:
                continue  # e.g. a directory of that name: never removed; the others still are

    def _remove_unreferenced(self, name: str) -> None:
        """Remove a file the committed checkpoint does not reference (the replaced checkpoint's, a
        dead save's)."""
        self._store.remove(name)


def _dist_up() -> bool:
    return dist.is_available() and dist.is_initialized()


def _command() -> str:
    """This process's command line, shortened, to name a save in a claim."""
    line = " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]) if sys.argv and sys.argv[0] else "python"
    return line if len(line) <= 80 else line[:77] + "..."


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriter(AtomicWriting, FileSystemWriter):
    """A ``FileSystemWriter`` with checksums, atomic commit and explicit overwrite, that claims its
    path for one save at a time across processes and hosts (:mod:`qdcp.storage.claims`: a second
    save raises :class:`~qdcp.ConcurrentSaveError` naming the first) and removes what a failed
    save wrote (:meth:`abandon`, which ``qdcp.save`` calls once every rank has returned).

    Args:
        path: checkpoint directory.
        overwrite: replace an existing checkpoint (atomically). Default False: raise before writing.
        checksums: every item is hashed (XXH3-64) as it is written and the hashes recorded in the
            metadata, whatever the planner (:mod:`qdcp.checksums`; the files stay readable by
            stock DCP); :class:`CheckpointReader` and :class:`~qdcp.QuantizedLoadPlanner` verify
            them. False: none (a :class:`~qdcp.QuantizedSavePlanner` records none either).
        stager: what ``dcp.async_save`` stages through when it uses this writer as its stager (no
            ``async_stager`` given); it stays the caller's to close. Default: a
            :class:`~qdcp.QuantizedStager` shared by this process's qdcp writers (its buffers
            reused from save to save; :func:`set_default_stager`).
        thread_count: files (and threads) each rank writes into; default
            :func:`~qdcp.io.pipeline.default_thread_count` (the usable cores, at most 4).
        direct_io: write large items around the page cache, from their own memory
            (:mod:`qdcp.io.direct`; items may then start up to 4 KiB apart), where files are
            fsync'd (``sync_files``, the default) on a local file system that offers ``O_DIRECT``.
            None (default): for the saves this writer stages (``dcp.async_save`` through it,
            ``qdcp.async_save``) where this process may use fewer than
            :data:`DIRECT_UPLOAD_BELOW_CORES` cores (a direct write takes a fraction of a buffered
            one's CPU time, which training beside the upload feels on few cores). True: every
            save; False: none (buffered, as DCP's writer).
        **kwargs: other ``FileSystemWriter`` options (``sync_files``, ``per_thread_copy_ahead``...).

    Each rank's items are written by :mod:`qdcp.io.pipeline`.
    """
