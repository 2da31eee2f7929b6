"""A checkpoint directory's files by name (:class:`LocalStore`, :class:`FsspecStore`), and the claim
file, created exclusively, that keeps a path to one save at a time; stale only where that is
certain (docs/api.md, *Saves from several processes*).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import uuid
import weakref

from qdcp.errors import ConcurrentSaveError
from qdcp.owners import Owner

__all__ = ["CLAIM_FILE", "CLAIM_PREFIX", "PathClaim", "ClaimRecord", "LocalStore", "FsspecStore", "take",
           "read_record", "refuse_if_held", "honours_exclusive", "protocols"]

CLAIM_PREFIX = ".qdcp-save."  #: every file of a claim's (the claim, its asides) starts so
CLAIM_FILE = f"{CLAIM_PREFIX}claim"  #: the claim, in the checkpoint directory
UNREADABLE_GRACE_S = 10.0  #: an unreadable claim (its taker killed between create and write) this old is stale

#: fsspec protocols whose ``"xb"`` refuses an existing file (s3fs: S3's conditional write; memory, local)
_EXCLUSIVE_PROTOCOLS = {"s3", "s3a", "memory", "file", "local"}

_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # token -> this process's claims


def protocols(fs) -> set[str]:
    return set(fs.protocol) if isinstance(fs.protocol, (tuple, list)) else {fs.protocol}


def honours_exclusive(fs) -> bool:
    """Whether ``fs`` is known to make ``"xb"`` an exclusive create (else existence is checked first)."""
    return bool(protocols(fs) & _EXCLUSIVE_PROTOCOLS)


class LocalStore:
    """A local checkpoint directory's files, by name."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = self.label = os.fspath(root)

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def names(self) -> list[str]:
        return os.listdir(self.root)

    def exists(self, name: str) -> bool:
        return os.path.exists(self._path(name))

    def read(self, name: str) -> bytes | None:
        """The bytes of ``name``, or None if it does not exist."""
        try:
            with open(self._path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._path(name))

    def age(self, name: str) -> float | None:
        """Seconds since ``name`` was last written (None: it does not exist)."""
        try:
            return time.time() - os.stat(self._path(name)).st_mtime
        except FileNotFoundError:
            return None

    def create(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data`` unless it exists (atomic; a failed write removes it)."""
        try:
            fd = os.open(self._path(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            os.remove(self._path(name))  # ours (O_EXCL): a half-made claim would block the retry
            raise
        return True

    def remove_if_same(self, name: str, data: bytes, aside: str) -> bool:
        """Remove ``name`` if it holds ``data``: renamed to ``aside`` (one remover wins), compared, and
        linked back if it was another claim."""
        try:
            os.rename(self._path(name), self._path(aside))
        except FileNotFoundError:
            return False
        moved = self.read(aside)
        if moved != data:
            with contextlib.suppress(OSError):
                os.link(self._path(aside), self._path(name))  # never replaces a claim taken meanwhile
        os.remove(self._path(aside))
        return moved == data


class FsspecStore:
    """The files under an fsspec URL, by name (fsspec's listing cache dropped before each call)."""

    def __init__(self, fs, root: str, label: str) -> None:
        self.fs, self.root, self.label = fs, root.rstrip("/"), label

    def _path(self, name: str) -> str:
        self.fs.invalidate_cache(f"{self.root}/{name}")
        return f"{self.root}/{name}"

    def names(self) -> list[str]:
        self.fs.invalidate_cache(self.root)
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]

    def exists(self, name: str) -> bool:
        return self.fs.exists(self._path(name))

    def read(self, name: str) -> bytes | None:
        """The bytes of ``name``, or None if it does not exist (or cannot be read)."""
        try:
            return self.fs.cat_file(self._path(name))
        except OSError:
            return None

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name))

    def age(self, name: str) -> float | None:
        """Seconds since ``name`` was last written (None: absent, or the store cannot say)."""
        try:
            return time.time() - self.fs.modified(self._path(name)).timestamp()
        except (NotImplementedError, OSError):
            return None

    def create(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data`` with ``"xb"``, read back (a store ignoring ``"x"``
        overwrites); a failed write removes what it left."""
        path = self._path(name)
        if not honours_exclusive(self.fs) and self.fs.exists(path):
            return False
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        except BaseException:
            with contextlib.suppress(OSError):
                self.fs.rm_file(path)  # what the failed write left (created by it: "xb")
            raise
        return self.read(name) == data

    def remove_if_same(self, name: str, data: bytes, aside: str) -> bool:
        """Delete ``name`` if it holds ``data`` (not atomic)."""
        if self.read(name) != data:
            return False
        try:
            self.fs.rm_file(self._path(name))
        except OSError:
            return False
        return True


@dataclasses.dataclass(frozen=True)
class ClaimRecord:
    """What a claim file holds."""

    token: str
    owner: Owner
    since: float
    what: str

    def dumps(self) -> bytes:
        """The claim file's bytes (JSON)."""
        return json.dumps({"qdcp_claim": 1, "token": self.token, "owner": self.owner.to_json(),
                           "since": self.since, "what": self.what}).encode()

    @classmethod
    def loads(cls, data: bytes) -> "ClaimRecord":
        """The record in a claim file's bytes (ValueError if none)."""
        try:
            doc = json.loads(data)
            return cls(str(doc["token"]), Owner.from_json(doc["owner"]), float(doc["since"]), str(doc["what"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError("not a qdcp claim") from e

    def describe(self) -> str:
        """``<what>, pid N on host 'H', since HH:MM:SS`` for messages."""
        return f"{self.what}, {self.owner.describe()}, since {time.strftime('%H:%M:%S', time.localtime(self.since))}"


def read_record(store) -> tuple[bytes | None, ClaimRecord | None]:
    """The claim file's bytes (None: no claim) and its record (None: unreadable)."""
    data = store.read(CLAIM_FILE)
    if data is None:
        return None, None
    try:
        return data, ClaimRecord.loads(data)
    except ValueError:
        return data, None


class PathClaim:
    """This save's claim on a path: :meth:`check` before committing, :meth:`release` after."""

    def __init__(self, store, record: ClaimRecord) -> None:
        self.store, self.record, self.token = store, record, record.token  # the token its file names carry
        self.data = record.dumps()
        self.ended = False  #: its save can no longer commit (its files still to remove): the next save clears it
        # released when the save ends, or when its writer is dropped
        self._release = weakref.finalize(self, _release, store, self.data, record.token)
        _live[record.token] = self

    def check(self) -> None:
        """Raise :class:`ConcurrentSaveError` unless the claim file still holds this claim."""
        data, other = read_record(self.store)
        if data != self.data:
            holder = f"it is now held by {other.describe()}" if other is not None else \
                "the claim file is gone" if data is None else "the claim file holds another claim"
            raise ConcurrentSaveError(
                f"this save's claim on {self.store.label!r} was removed while it ran ({holder}); nothing "
                f"was committed. Someone deleted the claim file, or another save judged it stale: save again")

    def release(self) -> None:
        """Remove the claim file if it is still this claim's (idempotent)."""
        self._release()


def _release(store, data: bytes, token: str) -> None:
    with contextlib.suppress(OSError):  # a claim that cannot be removed turns stale with its process
        store.remove_if_same(CLAIM_FILE, data, f"{CLAIM_FILE}.{token}.release")


def take(store, what: str) -> PathClaim:
    """Claim ``store``'s path, clearing stale claims (:class:`ConcurrentSaveError` naming a live holder)."""
    record = ClaimRecord(uuid.uuid4().hex[:12], Owner.current(), time.time(), what)
    for _ in range(5):
        if store.create(CLAIM_FILE, record.dumps()):
            return PathClaim(store, record)
        stale = refuse_if_held(store)
        if stale is not None:  # (None: released meanwhile)
            store.remove_if_same(CLAIM_FILE, stale, f"{CLAIM_FILE}.{record.token}.stale")
    raise ConcurrentSaveError(f"{store.label!r}: other saves kept claiming it while this one cleared stale "
                              f"claims; nothing was written. Save again")


def refuse_if_held(store) -> bytes | None:
    """Raise :func:`take`'s error if a save that may still run holds the path; else the stale claim's
    bytes (None: no claim). Takes and clears nothing."""
    data, other = read_record(store)
    if data is not None and not _stale(store, other):
        raise ConcurrentSaveError(_busy(store, other))
    return data


def _stale(store, other: ClaimRecord | None) -> bool:
    """Whether the claim ``other`` (None: unreadable) is known to be abandoned."""
    if other is None:
        age = store.age(CLAIM_FILE)
        return age is not None and age > UNREADABLE_GRACE_S
    alive = other.owner.alive()
    if alive and other.owner == Owner.current():
        mine = _live.get(other.token)
        return mine is None or mine.ended
    return alive is False


def _busy(store, other: ClaimRecord | None) -> str:
    holder = other.describe() if other is not None else "a save that is taking it now"
    where = os.path.join(store.label, CLAIM_FILE) if "://" not in store.label else f"{store.label}/{CLAIM_FILE}"
    if other is not None and other.owner == Owner.current():
        after = "that save is in progress in this process: call .result() on its future before saving there again"
    elif other is not None and other.owner.here() is False:
        after = ("it was taken on another host, so qdcp cannot tell whether that save still runs: if it "
                 "does not (its job ended, its host died), delete the claim file and save again")
    else:
        after = "a claim whose save was killed on this host is cleared by the next save"
    return (f"another save holds {store.label!r}: {holder} (claim file {where!r}); this save wrote nothing. "
            f"Wait for that save to finish, or save to another path; {after}")
