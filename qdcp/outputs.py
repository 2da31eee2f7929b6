"""Where qdcp's tools write (``qdcp convert`` / ``export``, :func:`qdcp.consolidate`): never over
their input, ``overwrite`` replacing only what qdcp wrote, and through scratch beside the output.

:func:`check_separate` refuses an output that is, contains or lies inside an input (symlinks
resolved); :func:`check_replaceable` refuses to replace an existing output unless asked to and
unless every file in it is one qdcp writes there. Both run before anything is read or written.

The tools write into a scratch file or directory beside their output and rename it into place at
the end. A scratch name says whose it is and for which output::

    .qdcp-<kind>-<output id>-<owner tag>-<random>[suffix]

(``<output id>``: a hash of the output's absolute path; ``<owner tag>``:
:meth:`qdcp.storage.owners.Owner.tag`). A run killed midway leaves its scratch behind; the next
run for the same output (:func:`clean`) removes those whose owner has ended on this machine, and
(:func:`recover`) puts back an export that ``--overwrite`` had moved aside (``.qdcp-replaced-*``)
when the kill came between moving the old output away and moving the new one in. Scratch of
another output, of a run still going, or made on another machine is never touched.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from typing import Callable, Iterable

from qdcp.errors import QdcpError
from qdcp.storage.owners import Owner

__all__ = ["OutputError", "check_separate", "check_replaceable", "name_matcher", "new_file", "new_dir", "clean",
           "recover", "REPLACED"]


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


# ----------------------------------------------------------------------------- scratch

REPLACED = "replaced"  #: the kind of the directory an output is moved into while it is replaced


def _output_id(out: str | os.PathLike) -> str:
    return hashlib.blake2s(os.path.abspath(os.fspath(out)).encode(), digest_size=4).hexdigest()


def _parent(out: str | os.PathLike) -> str:
    return os.path.dirname(os.path.abspath(os.fspath(out)))


def _name(kind: str, out: str | os.PathLike, suffix: str) -> str:
    return f".qdcp-{kind}-{_output_id(out)}-{Owner.current().tag()}-{uuid.uuid4().hex[:6]}{suffix}"


def new_file(kind: str, out: str | os.PathLike, suffix: str = "") -> str:
    """Create an empty scratch file for ``out`` beside it (its parent made if needed); its path."""
    os.makedirs(_parent(out), exist_ok=True)
    path = os.path.join(_parent(out), _name(kind, out, suffix))
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    return path


def new_dir(kind: str, out: str | os.PathLike) -> str:
    """Create an empty scratch directory for ``out`` beside it; its path."""
    os.makedirs(_parent(out), exist_ok=True)
    path = os.path.join(_parent(out), _name(kind, out, ""))
    os.mkdir(path)
    return path


def _left(kind: str, out: str | os.PathLike) -> list[str]:
    """Scratch of ``kind`` for ``out`` whose owner has ended on this machine."""
    parent = _parent(out)
    pattern = re.compile(rf"\.qdcp-{re.escape(kind)}-{_output_id(out)}-([0-9a-f]{{8}}\.\d+\.\d+)-[0-9a-f]{{6}}.*")
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    dead = []
    for name in sorted(names):
        m = pattern.fullmatch(name)
        owner = Owner.from_tag(m.group(1)) if m is not None else None
        if owner is not None and owner.alive() is False:
            dead.append(os.path.join(parent, name))
    return dead


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def clean(out: str | os.PathLike, *kinds: str) -> None:
    """Remove the scratch of ``kinds`` that killed runs left for ``out``."""
    for kind in kinds:
        for path in _left(kind, out):
            _remove(path)


def recover(out: str | os.PathLike) -> None:
    """Put back an output a killed run had moved aside to replace it (it is absent now), and
    remove the moved-aside copies that killed runs left where the output is in place."""
    for path in _left(REPLACED, out):
        moved = os.path.join(path, "dir")
        if not os.path.lexists(out) and os.path.isdir(moved):
            os.rename(moved, os.fspath(out))
        _remove(path)
