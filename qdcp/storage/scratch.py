"""Scratch files and directories beside an output, and what a killed run left of them.

``qdcp convert`` and ``qdcp export`` write into a scratch file or directory beside their output and
rename it into place at the end. A scratch name says whose it is and for which output::

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

from qdcp.storage.owners import Owner

__all__ = ["new_file", "new_dir", "clean", "recover", "REPLACED"]

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
