"""A local checkpoint's files as its reader opens them: only regular files whose real path lies inside
the directory's (symlinks that stay inside are followed), checked before the open, opened
``O_NOFOLLOW | O_NONBLOCK`` and checked again on the descriptor."""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from qdcp.errors import CheckpointFormatError

__all__ = ["file_problem", "open_inside", "refusal"]

_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) \
    | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _within(base: str, real: str) -> bool:
    try:
        return os.path.commonpath([base, real]) == base
    except ValueError:  # another drive (Windows)
        return False


def file_problem(root: str | os.PathLike, name: str) -> str | None:
    """Why file ``name`` of ``root`` may not be read (outside ``root``, not a regular file), or None."""
    path = os.path.join(os.fspath(root), name)
    if not os.path.lexists(path):
        return None
    real, base = os.path.realpath(path), os.path.realpath(root)
    if not _within(base, real):
        return f"resolves to {real!r}, outside the checkpoint directory {base!r} (a symlink leaves it)"
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return None
    return None if stat.S_ISREG(mode) else f"is {_kind(mode)}, not a regular file"


def refusal(what: str, root: str | os.PathLike, name: str, problem: str) -> CheckpointFormatError:
    """The error refusing file ``name`` of checkpoint ``root`` (``what``: how the message starts)."""
    return CheckpointFormatError(
        f"{what} {os.path.join(os.fspath(root), name)!r} {problem}; qdcp reads only regular files inside "
        f"the checkpoint directory (symlinks that stay inside it are followed). Replace it with the file "
        f"itself (cp -rL copies a checkpoint with its symlinks resolved) or restore it from a good copy")


def open_inside(root: str | os.PathLike, name: str, what: str) -> BinaryIO:
    """File ``name`` of ``root`` opened for reading once checked (:func:`file_problem`, else :func:`refusal`)."""
    problem = file_problem(root, name)
    if problem is not None:
        raise refusal(what, root, name, problem)
    real = os.path.realpath(os.path.join(os.fspath(root), name))
    try:
        fd = os.open(real, _FLAGS)
    except OSError as e:
        if os.path.islink(real):  # swapped for a symlink after the check (O_NOFOLLOW: ELOOP)
            raise refusal(what, root, name, "became a symlink while it was opened") from None
        raise e from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise refusal(what, root, name, f"is {_kind(mode)}, not a regular file")
        return os.fdopen(fd, "rb")  # O_NONBLOCK does not change how a regular file is read
    except BaseException:
        os.close(fd)
        raise
