"""A run's checkpoints under one directory, for a training loop without a checkpoint manager: the
latest complete one, a list of them, pruning to the last K, and cleaning what failed saves left.

Each directory directly under the run's directory is one checkpoint; its step is the last number
in its name (``step_300``: 300). Its state is one of :data:`STATES`:

- ``complete``: a committed ``.metadata`` qdcp's metadata reader accepts whose storage records pass
  :func:`qdcp.reading.verify.check_storage` (no data read: a flipped byte is ``qdcp verify``'s to find);
- ``writing``: a claim held by a save that may still run (one taken on another host is never
  judged), or, without ``.metadata``, a file written in the last :data:`ACTIVE_GRACE_S` seconds;
- ``failed``: no ``.metadata`` and none of the above: what a killed or failed save left;
- ``damaged``: a ``.metadata`` that is not complete by the rule above (it says why).

Only what qdcp wrote is removed: a checkpoint whose ``.metadata`` carries qdcp's records, its
``.metadata`` first (a removal cut short leaves a ``failed`` directory), then the files it
references; in a failed save's directory, the files qdcp's writer names and a claim no save holds.
A directory is removed once empty; anything else in it is left, and named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import stat
import time
from typing import Any

from qdcp import checksums, spec
from qdcp.errors import CheckpointFormatError, ConcurrentSaveError
from qdcp.reading.verify import check_storage
from qdcp.storage import claims, commit
from qdcp.storage.local_files import open_inside
from qdcp.storage.metadata import METADATA_FILE, check_chunk_geometry, safe_load_metadata

__all__ = ["CheckpointInfo", "STATES", "ACTIVE_GRACE_S", "checkpoints", "latest", "prune", "left_behind"]

STATES = ("complete", "writing", "failed", "damaged")
ACTIVE_GRACE_S = 120.0  #: a directory without .metadata or claim written to this recently may be a save running
_STEP = re.compile(r"(\d+)(?!.*\d)")
_PRUNE_ASIDE = "pruned"
_DCP_FILE = re.compile(r"__\d+_\d+\.distcp|\.metadata\.tmp|__\d+\.metadata\.tmp")


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory of a run, as :func:`checkpoints` found it."""

    path: str
    step: int | None  #: the last number in the directory's name (None: it has none)
    state: str  #: one of :data:`STATES`
    nbytes: int  #: the bytes of the files in the directory
    age_s: float  #: seconds since its ``.metadata`` (else its newest file) was written
    why: str | None = None  #: what makes it ``damaged`` / ``writing`` / ``failed``
    by_qdcp: bool = False  #: its ``.metadata`` carries qdcp's records (else: files only qdcp's writer names)


def checkpoints(root: str | os.PathLike) -> list[CheckpointInfo]:
    """Every checkpoint directory directly under ``root``, oldest first: by step (directories with
    no number in their name first), then by age. ``root`` missing: an empty list."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    dirs = [os.path.join(os.fspath(root), n) for n in names]
    found = [c for d in dirs if os.path.isdir(d) and not os.path.islink(d) and (c := _inspect_if_there(d)) is not None]
    return sorted(found, key=lambda c: (c.step is not None, c.step or 0, -c.age_s, c.path))


def latest(root: str | os.PathLike) -> str | None:
    """The path of the latest complete checkpoint under ``root`` (highest step, then newest), or
    None: the one to resume from. Directories being written, failed or damaged are passed over."""
    done = [c for c in checkpoints(root) if c.state == "complete"]
    return done[-1].path if done else None


def prune(root: str | os.PathLike, keep: int, *, dry_run: bool = False) -> list[str]:
    """Remove the complete checkpoints under ``root`` but the last ``keep`` (by step) and the newest
    written, and what failed saves left; returns the directories removed (``dry_run``: that would
    be, nothing removed). Never one being written, damaged, or not qdcp's (see the module)."""
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r}: keep at least 1 (the latest complete checkpoint is never removed)")
    found = checkpoints(root)
    done = [c for c in found if c.state == "complete"]
    kept = {c.path for c in done[-keep:]} | ({min(done, key=lambda c: c.age_s).path} if done else set())
    doomed = [c for c in done if c.path not in kept and c.by_qdcp]
    doomed += [c for c in found if c.state == "failed" and (c.by_qdcp or not os.listdir(c.path))]
    if dry_run:
        return [c.path for c in doomed]
    return [c.path for c in doomed if _removed(c)]


def left_behind(path: str | os.PathLike) -> list[str]:
    """The names in a checkpoint directory that :func:`prune` would leave (written by others)."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n != METADATA_FILE and commit.token_of(n) is None
                  and not n.startswith(claims.CLAIM_PREFIX))


# ----------------------------------------------------------------------------- one directory


def _inspect_if_there(path: str) -> CheckpointInfo | None:
    with contextlib.suppress(FileNotFoundError):  # removed meanwhile (another pruner)
        return _inspect(path)
    return None


def _inspect(path: str) -> CheckpointInfo | None:
    """What the directory ``path`` holds (None: not a checkpoint, e.g. a directory of logs)."""
    names = os.listdir(path)
    sizes, newest = _stats(path, names)
    step = int(m.group(1)) if (m := _STEP.search(os.path.basename(path))) else None
    ours = [n for n in names if commit.token_of(n) is not None]
    dcp_files = [n for n in names if _DCP_FILE.fullmatch(n)]
    empty_step = not names and step is not None  # a save killed before writing (or one just begun)
    if not (METADATA_FILE in names or claims.CLAIM_FILE in names or ours or dcp_files or empty_step):
        return None
    held = _held(path) if claims.CLAIM_FILE in names else None
    info = dict(path=path, step=step, nbytes=sum(sizes.values()), age_s=max(0.0, time.time() - newest))
    problem, by_qdcp = None, bool(ours) or claims.CLAIM_FILE in names
    if METADATA_FILE in names:
        info["age_s"] = max(0.0, time.time() - os.stat(os.path.join(path, METADATA_FILE)).st_mtime)
        problem, by_qdcp = _problem(path)
    if held:
        return CheckpointInfo(**info, state="writing", why=held, by_qdcp=by_qdcp)
    if METADATA_FILE in names:
        return CheckpointInfo(**info, state="damaged" if problem else "complete", why=problem, by_qdcp=by_qdcp)
    if not by_qdcp and time.time() - newest < ACTIVE_GRACE_S:  # no claim to tell: DCP's writer, or just made
        why = f"no .metadata yet; written to {time.time() - newest:.0f} s ago (a save may be running)"
        return CheckpointInfo(**info, state="writing", why=why, by_qdcp=by_qdcp)
    why = "no .metadata: a save that did not finish" + (f" ({len(names)} files)" if names else " (empty)")
    return CheckpointInfo(**info, state="failed", why=why, by_qdcp=by_qdcp)


def _stats(path: str, names: list[str]) -> tuple[dict[str, int], float]:
    """``({name: bytes} of the regular files, newest mtime of the directory and its files)``."""
    sizes, newest = {}, os.stat(path).st_mtime
    for name in names:
        try:
            st = os.lstat(os.path.join(path, name))
        except FileNotFoundError:
            continue
        newest = max(newest, st.st_mtime)
        if stat.S_ISREG(st.st_mode):
            sizes[name] = st.st_size
    return sizes, newest


def _held(path: str) -> str | None:
    """What holds the claim in ``path`` (the error's text), or None if no save holds it."""
    try:
        claims.refuse_if_held(claims.LocalStore(path))
    except ConcurrentSaveError as e:
        return str(e)
    return None


def _problem(path: str) -> tuple[str | None, bool]:
    """``(why the checkpoint is not complete or None, whether qdcp wrote its .metadata)``."""
    try:
        md = _metadata(path)
        check_chunk_geometry(md)
    except (CheckpointFormatError, OSError) as e:
        return f"its .metadata is not usable: {e}", False
    data = md.planner_data if isinstance(md.planner_data, dict) else {}
    by_qdcp = spec.PLANNER_DATA_KEY in data or checksums.PLANNER_DATA_KEY in data
    problems = check_storage(md, path)
    return (f"its .metadata's storage records: {problems[0]}" if problems else None), by_qdcp


def _removed(c: CheckpointInfo) -> bool:
    with contextlib.suppress(FileNotFoundError):  # another pruner (another rank) removed it meanwhile
        return _remove(c)
    return False


def _remove(c: CheckpointInfo) -> bool:
    """Remove checkpoint ``c``'s files that qdcp wrote, if it is still as found (never a file of a
    save that claimed the path since); whether they are gone (the directory too, unless others'
    files are left in it)."""
    now = _inspect_if_there(c.path)
    if now is None or now.state != c.state or now.state not in ("complete", "failed"):
        return False  # changed meanwhile (a save began): left alone
    names = set(os.listdir(c.path))
    store = claims.LocalStore(c.path)
    data = store.read(claims.CLAIM_FILE)
    if data is not None and _held(c.path) is not None:
        return False
    ours = {n for n in names if commit.token_of(n) is not None}
    if store.read(claims.CLAIM_FILE) != data:
        return False  # a save claimed the path meanwhile: left alone
    if METADATA_FILE in names:
        try:
            ours |= names & commit.referenced(_metadata(c.path))
            os.remove(os.path.join(c.path, METADATA_FILE))  # first: no longer complete, whatever follows
        except (FileNotFoundError, CheckpointFormatError):
            return False  # another pruner took it, or it was swapped since
    for name in sorted(ours):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(c.path, name))
    if data is not None:  # a claim no save holds (a killed save's): removed if it is still that one
        store.remove_if_same(claims.CLAIM_FILE, data, f"{claims.CLAIM_FILE}.{_PRUNE_ASIDE}")
    with contextlib.suppress(OSError):  # what others wrote stays (left_behind names it)
        os.rmdir(c.path)
    return True


def _metadata(path: str) -> Any:
    with open_inside(path, METADATA_FILE, "the checkpoint's .metadata") as f:  # never a file outside it
        return safe_load_metadata(f)
