"""Where qdcp's commands write: never over their input, and ``overwrite`` replaces only what qdcp wrote.

:func:`check_separate` refuses an output that is, contains or lies inside an input (symlinks
resolved); :func:`check_replaceable` refuses to replace an existing output unless asked to and
unless every file in it is one qdcp writes there. Both run before anything is read or written.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Iterable

from qdcp.errors import QdcpError


class OutputError(QdcpError, ValueError):
    """An output path qdcp will not write (nothing was written)."""


def check_separate(inputs: Iterable[str | os.PathLike], out: str | os.PathLike) -> None:
    """Refuse ``out`` if it is an input, holds one, or lies inside one."""
    target = os.path.realpath(out)
    for given in inputs:
        source = os.path.realpath(given)
        if target == source:
            how = "is"
        elif _inside(target, source):
            how = "lies inside"
        elif _inside(source, target):
            how = "contains"
        else:
            continue
        raise OutputError(f"the output {os.fspath(out)!r} {how} the input {os.fspath(given)!r}; writing it would "
                          f"replace or mix with the input. Choose an output outside the input")


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder and path != folder


def check_replaceable(out: str | os.PathLike, overwrite: bool, *, directory: bool,
                      ours: Callable[[str], bool], what: str, required: str | None = None) -> None:
    """Refuse an existing ``out`` unless ``overwrite`` and qdcp wrote all of it: ``ours(name)``
    for every file of a directory (``directory=True``; ``required``: a file it must hold),
    ``ours(path)`` for a file. An empty directory counts as absent."""
    out = os.fspath(out)
    if not os.path.lexists(out):
        return
    if os.path.islink(out) or directory != os.path.isdir(out):
        kind = "a symlink" if os.path.islink(out) else "a directory" if os.path.isdir(out) else \
            "a file" if os.path.isfile(out) else "a special file"
        raise OutputError(f"{out!r} is {kind}; the output here is {what}. Choose another path")
    if directory and not os.listdir(out):
        return
    if not overwrite:
        raise OutputError(f"{out!r} exists; pass --overwrite (overwrite=True) to replace it")
    if not directory:
        if not ours(out):
            raise OutputError(f"{out!r} is not {what}; --overwrite replaces only qdcp's own output. Move it away "
                              f"or choose another path")
        return
    names = sorted(os.listdir(out))
    foreign = [n for n in names if not ours(n) or os.path.isdir(os.path.join(out, n))]
    if foreign:
        listed = ", ".join(repr(n) for n in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputError(f"{out!r} holds {listed}, which qdcp did not write there as {what}; --overwrite replaces "
                          f"only qdcp's own output. Remove those or choose another path")
    if required is not None and required not in names:
        raise OutputError(f"{out!r} has no {required}, so it is not {what}; --overwrite replaces only qdcp's own "
                          f"output. Remove its files or choose another path")


def name_matcher(*patterns: str) -> Callable[[str], bool]:
    """``ours`` for :func:`check_replaceable`: a file name matching one of the regex ``patterns``."""
    compiled = [re.compile(p) for p in patterns]
    return lambda name: any(c.fullmatch(name) for c in compiled)
