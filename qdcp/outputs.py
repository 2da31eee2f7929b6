"""Where qdcp's tools write (``qdcp convert`` / ``export``, :func:`qdcp.dcp_to_torch_save`): never over
their input, ``overwrite`` replacing only what qdcp wrote, and through scratch beside the output,
renamed into place at the end. A scratch name says whose it is and for which output::

    .qdcp-<kind>-<hash of the output's absolute path>-<Owner.tag()>-<random>[suffix]

The next run for the same output (:func:`clean`) removes the scratch whose owner
(:meth:`qdcp.owners.Owner.tag`) has ended on this machine, and puts back an export that
``--overwrite`` had moved aside (``.qdcp-replaced-*``) when a kill came between its two renames.
Scratch of another output, a live run or another machine is never touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import sys
import uuid
from typing import Any, Callable, Iterable, Iterator

from tqdm import tqdm

from qdcp.errors import QdcpError
from qdcp.owners import Owner

__all__ = ["OutputError", "check_separate", "check_replaceable", "new_file", "clean",
           "writing_file", "writing_dir",
           "progress_bar"]

_REPLACED = "replaced"  #: the kind of the directory an output is moved into while it is replaced


class OutputError(QdcpError, ValueError):
    """An output path qdcp will not write (nothing was written)."""


def check_separate(inputs: Iterable[str | os.PathLike], out: str | os.PathLike) -> None:
    """Refuse ``out`` if it is an input, holds one, or lies inside one (symlinks resolved)."""
    target = os.path.realpath(out)
    for given in inputs:
        source = os.path.realpath(given)
        common = os.path.commonpath([target, source])
        how = "is" if target == source else "lies inside" if common == source else \
            "contains" if common == target else None
        if how is not None:
            raise OutputError(f"the output {os.fspath(out)!r} {how} the input {os.fspath(given)!r}; writing it "
                              f"would replace or mix with the input. Choose an output outside the input")


def check_replaceable(out: str | os.PathLike, overwrite: bool, *, directory: bool,
                      ours: Callable[[str], Any], what: str, required: str | None = None) -> None:
    """Refuse an existing ``out`` unless ``overwrite`` and qdcp wrote all of it: ``ours(name)``
    true (a regex's ``fullmatch``...) for every file of a directory (``directory=True``;
    ``required``: a file it must hold), ``ours(path)`` for a file. An empty directory counts as absent."""
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


# ----------------------------------------------------------------------------- scratch

def _output_id(out: str | os.PathLike) -> str:
    return hashlib.blake2s(os.path.abspath(os.fspath(out)).encode(), digest_size=4).hexdigest()


def _scratch(kind: str, out: str | os.PathLike, suffix: str = "") -> str:
    """A fresh scratch path for ``out`` beside it (its parent made if needed), not created."""
    parent = os.path.dirname(os.path.abspath(os.fspath(out)))
    os.makedirs(parent, exist_ok=True)
    return os.path.join(parent, f".qdcp-{kind}-{_output_id(out)}-{Owner.current().tag()}-{uuid.uuid4().hex[:6]}"
                                f"{suffix}")


def new_file(kind: str, out: str | os.PathLike, suffix: str = "") -> str:
    """Create an empty scratch file for ``out`` beside it; its path."""
    path = _scratch(kind, out, suffix)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    return path


def _new_dir(kind: str, out: str | os.PathLike) -> str:
    path = _scratch(kind, out)
    os.mkdir(path)
    return path


def _left(kind: str, out: str | os.PathLike) -> list[str]:
    """Scratch of ``kind`` for ``out`` whose owner has ended on this machine."""
    parent = os.path.dirname(os.path.abspath(os.fspath(out)))
    pattern = re.compile(rf"\.qdcp-{re.escape(kind)}-{_output_id(out)}-([0-9a-f]{{8}}\.\d+\.\d+)-[0-9a-f]{{6}}.*")
    try:
        names = sorted(os.listdir(parent))
    except FileNotFoundError:
        return []
    matches = [(name, pattern.fullmatch(name)) for name in names]
    owners = [(name, Owner.from_tag(m.group(1))) for name, m in matches if m is not None]
    return [os.path.join(parent, name) for name, owner in owners if owner is not None and owner.alive() is False]


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def clean(out: str | os.PathLike, kind: str) -> None:
    """What killed runs left for ``out``: an output moved aside to be replaced is put back (where
    ``out`` is absent now; else the moved copy is removed), and the scratch of ``kind`` removed."""
    for path in _left(_REPLACED, out):
        moved = os.path.join(path, "dir")
        if not os.path.lexists(out) and os.path.isdir(moved):
            os.rename(moved, os.fspath(out))
        _remove(path)
    for path in _left(kind, out):
        _remove(path)


@contextlib.contextmanager
def writing_file(kind: str, out: str | os.PathLike, suffix: str) -> Iterator[str]:
    """A fresh scratch file for ``out`` (never a name the user may hold) to write; renamed to
    ``out`` when the block succeeds, removed when it fails."""
    tmp = new_file(kind, out, suffix)
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def writing_dir(kind: str, out: str | os.PathLike) -> Iterator[str]:
    """A fresh scratch directory for ``out`` to write, moved to ``out`` when the block succeeds
    (removed when it fails). An existing ``out`` is moved aside first, into scratch that
    :func:`clean` puts back if this run is killed before its second rename, and removed only after."""
    tmp = _new_dir(kind, out)
    try:
        yield tmp
        old = None
        if os.path.exists(out):
            old = _new_dir(_REPLACED, out)
            os.rename(out, os.path.join(old, "dir"))
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def progress_bar(total: int, desc: str, progress: bool | None) -> tqdm:
    """The tools' progress bar of ``total`` bytes on stderr (``progress`` None: on a terminal only)."""
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                disable=None if progress is None else not progress, file=sys.stderr, leave=False)
