"""Where a claim (:mod:`qdcp.storage.claims`) lives: a local directory, or an fsspec one.

:class:`LocalStore`: the claim is created with ``O_CREAT | O_EXCL`` (atomic on POSIX file systems
and on NFS from v3 on), its heartbeat is its mtime, and a claim is removed by renaming it aside
first, so that what is removed is exactly the claim that was judged (a claim taken meanwhile is
put back with ``link``, which never replaces).

:class:`FsspecStore`: the claim is created with fsspec's exclusive ``"xb"`` mode (s3fs sends
S3's ``If-None-Match: *``; memory and local file systems check it too) and read back; the
heartbeat is a separate ``.qdcp-save.<token>.beat`` object (a claim's bytes are never rewritten);
removing is a read then a delete (object stores have no atomic rename).
"""

from __future__ import annotations

import os
import time

__all__ = ["CLAIM_FILE", "CLAIM_PREFIX", "LocalStore", "FsspecStore", "honours_exclusive"]

CLAIM_PREFIX = ".qdcp-save."  #: every file of a claim's (the claim, its heartbeat, its asides) starts so
CLAIM_FILE = f"{CLAIM_PREFIX}claim"  #: the claim, in the checkpoint directory

#: fsspec protocols whose ``"xb"`` mode refuses an existing file (s3fs: S3's conditional write,
#: tested on moto; fsspec's memory and local file systems)
_EXCLUSIVE_PROTOCOLS = {"s3", "s3a", "memory", "file", "local"}


def honours_exclusive(fs) -> bool:
    """Whether ``fs`` (an fsspec file system) is known to make ``"xb"`` an exclusive create; for
    others qdcp checks existence first (not atomic: two writers may both pass the check)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool(set(protocols) & _EXCLUSIVE_PROTOCOLS)


class LocalStore:
    """Claims in a local directory."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.fspath(root)
        self.label = self.root

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def create(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data`` unless it exists (atomic)."""
        try:
            fd = os.open(self._path(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def read(self, name: str) -> bytes | None:
        """The bytes of ``name``, or None if it does not exist."""
        try:
            with open(self._path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def last_beat(self, token: str) -> float | None:
        """When the claim's holder last showed it runs (the claim's mtime)."""
        try:
            return os.stat(self._path(CLAIM_FILE)).st_mtime
        except FileNotFoundError:
            return None

    def beat(self, token: str, data: bytes) -> None:
        """Touch the claim if it is still ``data``."""
        if self.read(CLAIM_FILE) == data:
            os.utime(self._path(CLAIM_FILE))

    def drop_beat(self, token: str) -> None:
        """Nothing to drop: the heartbeat is the claim's own mtime."""

    def remove_if_same(self, name: str, data: bytes, aside: str) -> bool:
        """Remove ``name`` if it holds ``data``: rename it to ``aside`` (atomic: one of several
        removers gets it), compare, and link it back if it was another claim."""
        try:
            os.rename(self._path(name), self._path(aside))
        except FileNotFoundError:
            return False
        moved = self.read(aside)
        if moved != data:
            try:
                os.link(self._path(aside), self._path(name))  # never replaces a claim taken meanwhile
            except OSError:
                pass
        os.remove(self._path(aside))
        return moved == data


class FsspecStore:
    """Claims under an fsspec URL (``memory://``, ``s3://``...)."""

    def __init__(self, fs, root: str, label: str) -> None:
        self.fs, self.root, self.label = fs, root.rstrip("/"), label

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def create(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data`` with the store's exclusive write; read back (a store
        that ignores ``"x"`` overwrites: the later writer then finds its bytes there)."""
        path = self._path(name)
        self.fs.invalidate_cache(path)
        if not honours_exclusive(self.fs) and self.fs.exists(path):
            return False
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        return self.read(name) == data

    def read(self, name: str) -> bytes | None:
        """The bytes of ``name``, or None if it does not exist."""
        self.fs.invalidate_cache(self._path(name))
        try:
            return self.fs.cat_file(self._path(name))
        except FileNotFoundError:
            return None

    def _mtime(self, name: str) -> float | None:
        path = self._path(name)
        self.fs.invalidate_cache(path)
        try:
            return self.fs.modified(path).timestamp()
        except (FileNotFoundError, NotImplementedError):
            return None

    def last_beat(self, token: str) -> float | None:
        """The later of the claim's and its heartbeat object's modification times."""
        times = [t for t in (self._mtime(CLAIM_FILE), self._mtime(f"{CLAIM_PREFIX}{token}.beat") if token else None)
                 if t is not None]
        return max(times) if times else None

    def beat(self, token: str, data: bytes) -> None:
        """Rewrite this claim's heartbeat object (never the claim itself)."""
        if self.read(CLAIM_FILE) == data:
            self.fs.pipe_file(self._path(f"{CLAIM_PREFIX}{token}.beat"), str(time.time()).encode())

    def drop_beat(self, token: str) -> None:
        """Delete this claim's heartbeat object."""
        try:
            self.fs.rm_file(self._path(f"{CLAIM_PREFIX}{token}.beat"))
        except FileNotFoundError:
            pass

    def remove_if_same(self, name: str, data: bytes, aside: str) -> bool:
        """Delete ``name`` if it holds ``data`` (a read, then a delete: not atomic)."""
        if self.read(name) != data:
            return False
        try:
            self.fs.rm_file(self._path(name))
        except FileNotFoundError:
            return False
        return True
