"""The safe front door: DCP's ``save`` / ``async_save`` / ``load`` with all of qdcp's protections.

    qdcp.save(state, path)        # dcp.save: atomic commit, refuses an existing checkpoint, checksums
    qdcp.load(state, path)        # dcp.load: verified, all-or-nothing, .metadata never runs code

Each call is exactly DCP's own call with qdcp's storage writer or reader and planner passed in
(``qdcp.CheckpointWriter`` / ``qdcp.CheckpointReader``, ``QuantizedSavePlanner`` /
``QuantizedLoadPlanner``); the checkpoints are ordinary DCP checkpoints that stock ``dcp.load`` reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, wait
from typing import Any, Iterator

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful

from qdcp import errors
from qdcp.errors import CheckpointNotFoundError, QdcpError
from qdcp.planning.load import QuantizedLoadPlanner
from qdcp.planning.save import DequantizeChoice, QuantizedSavePlanner
from qdcp.storage import storage_reader, storage_writer
from qdcp.storage.reader import NoMetadataError

__all__ = ["save", "async_save", "load", "checkpoint_group"]

#: one INFO line per finished ``save`` / ``async_save`` / ``load`` (path, bytes, seconds, GiB/s); no
#: handler of its own: shown only where the application configures logging
logger = logging.getLogger("qdcp")


def save(state_dict: dict[str, Any], path: str | os.PathLike, *, overwrite: bool = False,
         dequantize: DequantizeChoice = False, process_group=None, no_dist: bool = False,
         storage_options: dict[str, Any] | None = None) -> Metadata:
    """Save ``state_dict`` to ``path`` (a directory or an fsspec URL) with ``dcp.save``.

    Quantized tensors raw (``dequantize=True``: as plain tensors), every item checksummed, committed
    atomically; an existing checkpoint at ``path`` is refused unless ``overwrite=True`` (then
    replaced atomically: a failed save leaves the old one loadable). Errors are raised as they
    were raised on this rank (``qdcp.ChecksumError``...), not wrapped in DCP's CheckpointException.
    ``no_dist``: this process saves alone, whatever process group is initialized (DCP's
    ``no_dist``; e.g. rank 0 of a job saving what it alone holds).
    """
    start = time.perf_counter()
    with _own_error():
        writer = storage_writer(path, overwrite=overwrite, **(storage_options or {}))
        try:
            metadata = dcp.save(state_dict, storage_writer=writer,
                                planner=QuantizedSavePlanner(dequantize=dequantize),
                                process_group=process_group, **_alone(no_dist))
        finally:
            writer.abandon()  # after a failure on any rank: this save's files removed, its claim released
    _log_done("saved", path, _stored_bytes(metadata), start)
    return metadata


def async_save(state_dict: dict[str, Any], path: str | os.PathLike, *, stager=None, overwrite: bool = False,
               dequantize: DequantizeChoice = False, process_group=None, no_dist: bool = False,
               storage_options: dict[str, Any] | None = None):
    """:func:`save` in the background with ``dcp.async_save``; returns what it returns (a Future).

    ``stager``: a :class:`qdcp.QuantizedStager` kept for the whole run (its buffers are reused
    from save to save; ``stager.prepare(state_dict)`` before training makes the first save as fast as
    the later ones); without one the writer stages through a ``QuantizedStager`` shared by this
    process's qdcp writers (its buffers reused too). ``storage_options``: the writer's
    (:class:`qdcp.CheckpointWriter`; ``direct_io`` chooses how the upload writes, docs/api.md).
    ``no_dist``: as in :func:`save`. Errors, raised by the
    call or by the Future's ``result()``, are this rank's own, as :func:`save` raises them.
    Wait for the previous save's future before the next save.

    ``process_group``: where the save's collectives run (from DCP's background thread); default
    :func:`checkpoint_group`, never the group training's collectives run on (they would interleave).
    What is known at the call is raised by it on every rank, before staging (:func:`_refuse_at_call`:
    a checkpoint at ``path``, a claim held, a state dict the planner refuses); errors from the
    futures are ordinary exceptions with a note naming the path and the rank (docs/api.md).
    """
    # the writer stages (DCP's hook for a writer that is an AsyncStager), through ``stager`` if given:
    # a writer that staged its save knows the upload runs beside training (direct writes on few cores)
    start = time.perf_counter()
    writer = storage_writer(path, overwrite=overwrite, stager=stager, **(storage_options or {}))
    group = process_group if process_group is not None or no_dist else checkpoint_group()
    _refuse_at_call(state_dict, path, writer, dequantize, group, no_dist)
    try:
        with _own_error():
            result = dcp.async_save(state_dict, storage_writer=writer,
                                    planner=QuantizedSavePlanner(dequantize=dequantize),
                                    process_group=group, **_alone(no_dist))
    except BaseException:
        writer.abandon()
        raise
    upload = getattr(result, "upload_completion", result)  # DCP's AsyncSaveResponse, or the Future itself
    upload.add_done_callback(lambda _: writer.abandon())  # a failed upload's files removed, claim released
    upload.add_done_callback(lambda done: _log_upload(done, path, start))
    where = _where(path, no_dist)
    uploaded = _own_errors(upload, writer, where)
    _track(group, uploaded, where)
    if isinstance(result, Future):
        return uploaded
    return dataclasses.replace(result, staging_completion=_own_errors(result.staging_completion, writer, where),
                               upload_completion=uploaded)


def _finish_at_exit() -> None:
    """Wait, at the interpreter's exit, for this process's async saves still running (:func:`_track`),
    saying so once, and how one failed if it did. A script that ends while an async save runs would
    otherwise lose it without a word: at exit ``concurrent.futures`` refuses the work the save still
    hands its pools. Run from threading's exit hooks (``threading._register_atexit``), which come
    before that refusal (``atexit``'s come after it)."""
    with _uploads_lock:
        pending = {f: where for group in _uploads.values() for f, where in group.items() if not f.done()}
        _uploads.clear()
    if not pending:
        return
    logger.warning("qdcp: waiting at exit for %d async save(s) still running (%s); wait on the Future "
                   "async_save returns before the script ends", len(pending), "; ".join(pending.values()))
    for upload in pending:
        try:
            upload.result()
        except BaseException as e:  # noqa: BLE001 (the interpreter is exiting: said, not raised)
            logger.error("qdcp: the async save failed: %s: %s", type(e).__name__, _short(e))


# (the default group it was made for, the group): one checkpoint group per default group
_checkpoint_groups: list[tuple[Any, Any]] = []
_checkpoint_groups_lock = threading.Lock()


def checkpoint_group():
    """The process group :func:`async_save` runs its collectives on when given none: a gloo group of
    all ranks, made by the first call after the default group is initialized and reused by every
    later one (a new default group, after ``destroy_process_group`` and ``init_process_group``, gets
    a new one). Making it is a collective (``dist.new_group``): every rank must call this at the same
    point, as every rank calls ``async_save``. None where ``torch.distributed`` is not initialized
    (a save of one process) or has no gloo backend (then DCP's default group)."""
    if not (dist.is_available() and dist.is_initialized()) or not dist.is_gloo_available():
        return None
    world = dist.group.WORLD
    with _checkpoint_groups_lock:
        if _checkpoint_groups and _checkpoint_groups[0][0] is world:
            return _checkpoint_groups[0][1]
        group = dist.new_group(backend="gloo")
        _checkpoint_groups[:] = [(world, group)]  # the old default group's (destroyed with it) dropped
        logger.debug("qdcp: made a gloo process group for async saves' collectives")
        return group


def load(state_dict: dict[str, Any], path: str | os.PathLike, *, atomic: bool = True,
         allow_partial_load: bool = False, weights_only: bool = True, process_group=None,
         no_dist: bool = False, storage_options: dict[str, Any] | None = None) -> None:
    """Load the checkpoint at ``path`` into ``state_dict``, in place, with ``dcp.load``.

    Fills whatever ``state_dict`` holds (same quantized types bit-exact, other types requantized,
    plain tensors dequantized); every item is verified against its recorded checksum and the
    metadata is read without unpickling code. ``atomic`` (default True): the targets are changed
    only once every read of every rank is in and verified, so a failed load leaves them as they
    were on every rank (it holds one extra copy of the loaded state meanwhile; False loads in
    place, as DCP does).
    ``no_dist``: this process loads alone, whatever process group is initialized (DCP's
    ``no_dist``; e.g. rank 0 of a job reading a whole checkpoint). Errors are raised as
    :func:`save` raises them; no checkpoint at ``path`` (no directory, or no ``.metadata`` in it) is
    :class:`qdcp.CheckpointNotFoundError`, a ``FileNotFoundError``. Checkpoint entries the state dict
    has no key for are not loaded (as DCP does) and warned about once (``UserWarning``, listing
    them; ``allow_partial_load=True`` loads a part on purpose, without the warning).
    """
    start = time.perf_counter()
    try:
        reader = storage_reader(path, **(storage_options or {}))
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(_not_found(path, "no such directory")) from e
    # all-or-nothing across ranks: copied in once dcp.load returned, unless dcp.load must hand a
    # Stateful its loaded values itself (then once this rank's reads are in)
    later = not any(isinstance(v, Stateful) for v in state_dict.values())
    planner = QuantizedLoadPlanner(atomic=atomic, allow_partial_load=allow_partial_load, weights_only=weights_only,
                                   copy_in_later=later)
    with _metadata_found(path), _own_error():
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group,
                 **_alone(no_dist))
    planner.copy_in(state_dict)  # dcp.load returned: every rank's reads are in and verified
    if planner.unread_keys and not allow_partial_load:
        _warn_unread(planner.unread_keys, path)
    _log_done("loaded", path, planner.read_bytes, start)


def _not_found(path: str | os.PathLike, why: str) -> str:
    return f"no checkpoint (.metadata) at {os.fspath(path)!r} ({why}): is the path right, and did the save finish?"


@contextlib.contextmanager
def _metadata_found(path: str | os.PathLike) -> Iterator[None]:
    """A load of a directory without ``.metadata`` raises :class:`CheckpointNotFoundError` (the
    reader's :class:`~qdcp.storage.reader.NoMetadataError` its cause); DCP's warnings of it (with
    tracebacks, on the root logger) are dropped meanwhile."""

    def noise(record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], NoMetadataError))

    root = logging.getLogger()
    root.addFilter(noise)
    try:
        yield
    except NoMetadataError as e:
        raise CheckpointNotFoundError(_not_found(path, "a directory without .metadata; a save stopped "
                                                       "before its commit leaves none")) from e
    finally:
        root.removeFilter(noise)


def _warn_unread(keys: list[str], path: str | os.PathLike) -> None:
    what = "1 entry" if len(keys) == 1 else f"{len(keys)} entries"
    more = " ..." if len(keys) > 5 else ""
    warnings.warn(
        f"qdcp.load: the checkpoint at {os.fspath(path)!r} holds {what} the state dict has no key for, not "
        f"loaded: {keys[:5]}{more}. Pass allow_partial_load=True to load a part of a checkpoint on purpose "
        f"(no warning); qdcp.describe(path) lists its keys.", UserWarning, stacklevel=3)


def _stored_bytes(metadata: Any) -> int:
    """The bytes a checkpoint's items take in its files (its metadata's storage records)."""
    storage = getattr(metadata, "storage_data", None)
    return sum(getattr(info, "length", 0) for info in storage.values()) if isinstance(storage, dict) else 0


def _log_upload(done: Future, path: str | os.PathLike, start: float) -> None:
    if not done.cancelled() and done.exception() is None:
        _log_done("saved (async)", path, _stored_bytes(done.result()), start)


def _log_done(what: str, path: str | os.PathLike, nbytes: int, start: float) -> None:
    seconds = time.perf_counter() - start
    logger.info("qdcp: %s %s: %d bytes in %.3f s (%.3f GiB/s)", what, os.fspath(path), nbytes, seconds,
                nbytes / 2**30 / seconds if seconds > 0 else 0.0)


def _own_errors(fut: Future, writer: Any, where: str) -> Future:
    """A Future with ``fut``'s result, or its error as :func:`_own_error` re-raises it (a save
    whose process group was destroyed meanwhile failing with the writer's error that says so,
    whichever of DCP's collectives found the group gone first), always an ``Exception`` (what is
    not one, e.g. DCP's ``CheckpointException`` without a rank's error, is a :class:`QdcpError`
    caused by it), with a note saying ``where`` (the path, the rank)."""
    out: Future = Future()

    def relay(done: Future) -> None:
        try:
            with _own_error():
                value = done.result()
        except BaseException as e:  # noqa: BLE001 (handed to the caller's Future)
            torn = writer.group_gone()
            if torn is not None and not isinstance(e, QdcpError):
                torn.__cause__ = e
                e = torn
            if not isinstance(e, Exception):
                wrapped = QdcpError(f"{where} failed: {type(e).__name__}: {_short(e)}")
                wrapped.__cause__ = e
                e = wrapped
            _add_note(e, where)
            out.set_exception(e)
        else:
            out.set_result(value)

    fut.add_done_callback(relay)
    return out


def _add_note(e: BaseException, note: str) -> None:
    """``e.add_note(note)`` once (one error is relayed by both of an AsyncSaveResponse's futures), as
    the attribute itself: Python 3.10 has no ``add_note`` (3.11+ shows ``__notes__`` in tracebacks)."""
    notes = getattr(e, "__notes__", [])
    if note not in notes:
        e.__notes__ = [*notes, note]


def _short(e: BaseException, limit: int = 2000) -> str:
    text = str(e)
    return text if len(text) <= limit else text[:limit] + " ..."


def _where(path: str | os.PathLike, no_dist: bool) -> str:
    """``qdcp.async_save to 'PATH' on rank R of W`` (``... in this process alone`` without a job)."""
    if no_dist or not (dist.is_available() and dist.is_initialized()):
        return f"qdcp.async_save to {os.fspath(path)!r} in this process alone"
    return f"qdcp.async_save to {os.fspath(path)!r} on rank {dist.get_rank()} of {dist.get_world_size()}"


# this process's qdcp.async_save uploads not yet done (each Future: where it saves), per process
# group (None: the default one); waited for at exit by one hook
_uploads: dict[Any, dict[Future, str]] = {}
_uploads_lock = threading.Lock()
_exit_hook: list[bool] = []


def _in_flight_on(group: Any) -> dict[Future, str]:
    with _uploads_lock:
        pending = {f: where for f, where in _uploads.get(group, {}).items() if not f.done()}
        _uploads[group] = pending
        return pending


def _track(group: Any, upload: Future, where: str) -> None:
    """Count ``upload`` in flight on ``group`` (later saves on it wait for it; so does the exit)."""
    with _uploads_lock:
        if not _exit_hook:
            threading._register_atexit(_finish_at_exit)
            _exit_hook.append(True)
        _uploads.setdefault(group, {})[upload] = where


def _refuse_at_call(state_dict: Any, path: str | os.PathLike, writer: Any, dequantize: DequantizeChoice,
                    group: Any, no_dist: bool) -> None:
    """Raise, on every rank of an async save, what would make it fail that is known now (see
    :func:`async_save`), before anything is staged: each rank checks, then the ranks share their
    findings (one ``all_gather_object`` on the save's group, in the caller's thread, once this
    process's earlier async saves on that group are done, so no two saves' collectives meet)."""
    try:
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"qdcp.async_save: state_dict must be a dict, not {type(state_dict).__name__}")
        writer.check_path()
        QuantizedSavePlanner(dequantize=dequantize).set_up_planner(  # a dry run: plans, writes nothing
            state_dict=dict(state_dict), storage_meta=None, is_coordinator=False)
        mine = None
    except Exception as e:  # noqa: BLE001 (shared with the other ranks, then raised)
        mine = e
    found = [mine]
    if not no_dist and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        wait(_in_flight_on(group))
        found = [None] * dist.get_world_size(group)
        dist.all_gather_object(found, None if mine is None else (type(mine).__name__, _short(mine)), group=group)
    if mine is not None:
        writer.abandon()
        raise mine
    failed = next(((rank, f) for rank, f in enumerate(found) if f is not None), None)
    if failed is not None:
        writer.abandon()
        rank, (kind, message) = failed
        cls = getattr(errors, kind, None)
        cls = cls if isinstance(cls, type) and issubclass(cls, QdcpError) else QdcpError
        raise cls(f"the async save to {os.fspath(path)!r} was refused on rank {rank} ({kind}: {message}); "
                  f"nothing was staged or written")


def _alone(no_dist: bool) -> dict[str, bool]:
    """DCP's ``no_dist`` where asked for (passed only then: the calls stay as they were otherwise)."""
    return {"no_dist": True} if no_dist else {}


@contextlib.contextmanager
def _own_error() -> Iterator[None]:
    """Re-raise this rank's own error (else the lowest failing rank's) out of DCP's
    ``CheckpointException``, which wraps every rank's error in one ``BaseException``: the user's
    ``except qdcp.ChecksumError`` (or ``FileExistsError``...) then catches it. Its own cause stays
    its ``__cause__`` (an ``OSError`` behind a write error: ``qdcp.CheckpointWriteError``), DCP's
    exception becoming its ``__context__``; an error without a cause is chained from DCP's."""
    try:
        yield
    except CheckpointException as e:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        failure = e.failures.get(rank, e.failures[min(e.failures)]) if e.failures else None
        err = failure[0] if isinstance(failure, tuple) else failure
        if not isinstance(err, BaseException):
            raise
        if not isinstance(err, Exception) and isinstance(err.__cause__, Exception):
            err = err.__cause__  # a carrier past torch 2.11's `except Exception` (qdcp/storage/reader.py)
        own = err.__cause__ if err.__cause__ is not None else None if err.__suppress_context__ else err.__context__
        raise err from (own if own is not None else e)
