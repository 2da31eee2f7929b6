"""A save's files, each named with its token (``__<token>_<rank>_<n>.distcp``,
``.metadata.<token>.tmp``), publishing ``.metadata`` (locally ``os.replace`` with ``overwrite``,
else ``os.link``) and what is removed after (docs/api.md, *Saves from several processes*).
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import re
from typing import Callable, Iterable

from torch.distributed.checkpoint.metadata import Metadata

from qdcp.errors import ConcurrentSaveError
from qdcp.storage.claims import CLAIM_PREFIX, honours_exclusive, protocols
from qdcp.storage.metadata import METADATA_FILE, safe_load_metadata

__all__ = ["save_prefix", "data_prefix", "metadata_tmp", "token_of", "referenced", "referenced_in",
           "publish_local", "publish_remote", "writes_whole", "debris"]

_DATA = re.compile(r"__([0-9a-f]{8,})_\d+_\d+\.distcp")
_TMP = re.compile(r"\.metadata(?:\.([0-9a-f]{8,}))?\.tmp")
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


def save_prefix(token: str) -> str:
    """The name prefix of every data file of the save ``token``."""
    return f"__{token}_"


def data_prefix(token: str, rank: int) -> str:
    return f"{save_prefix(token)}{rank}_"


def metadata_tmp(token: str) -> str:
    """The name the save ``token`` writes its ``.metadata`` under before publishing it."""
    return f"{METADATA_FILE}.{token}.tmp"


def token_of(name: str) -> str | None:
    """The save token in a qdcp file name ('' for an old qdcp's ``.metadata.tmp``), or None."""
    m = _DATA.fullmatch(name) or _TMP.fullmatch(name)
    return (m.group(1) or "") if m is not None else None


def referenced(metadata: Metadata | None) -> set[str]:
    """The data files ``metadata`` points into."""
    if metadata is None or not isinstance(getattr(metadata, "storage_data", None), dict):
        return set()
    return {getattr(info, "relative_path", None) for info in metadata.storage_data.values()} - {None}


def referenced_in(data: bytes | None) -> set[str]:
    """The data files the ``.metadata`` bytes ``data`` point into (none where absent or unreadable)."""
    try:
        return referenced(safe_load_metadata(io.BytesIO(data))) if data is not None else set()
    except Exception:  # noqa: BLE001 (a damaged .metadata lists nothing to remove)
        return set()


def _appeared(root: str) -> ConcurrentSaveError:
    return ConcurrentSaveError(
        f"a checkpoint was committed at {root!r} while this save ran, by a save that takes no qdcp claim "
        f"(stock DCP's writer, an older qdcp); it was kept and this save committed nothing. Pass "
        f"overwrite=True to replace it, or save to another path")


def publish_local(root: str, token: str, metadata: Metadata, overwrite: bool, check: Callable[[], None],
                  sync: bool) -> None:
    """Write ``.metadata.<token>.tmp`` and publish it as ``.metadata``, ``check()`` (the claim) first."""
    tmp, final = os.path.join(root, metadata_tmp(token)), os.path.join(root, METADATA_FILE)
    with open(tmp, "wb") as f:
        pickle.dump(metadata, f)
        if sync:
            os.fsync(f.fileno())
    check()
    if overwrite:
        os.replace(tmp, final)  # atomic on POSIX: readers see the old or the new one
    else:
        _link(root, tmp, final)


def _link(root: str, tmp: str, final: str) -> None:
    try:
        os.link(tmp, final)  # never replaces: fails if a .metadata appeared meanwhile
    except FileExistsError:
        raise _appeared(root) from None
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise
        if os.path.exists(final):  # a file system without hard links: checked, then renamed
            raise _appeared(root) from None
        os.replace(tmp, final)
        return
    os.remove(tmp)


#: fsspec protocols of object stores, whose writes readers see whole or not at all (one PUT)
_WHOLE_WRITES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"}


def writes_whole(fs) -> bool:
    """Whether ``fs`` is an object store whose writes are all-or-nothing (its protocol, or a
    ``qdcp_whole_writes`` it declares)."""
    declared = getattr(fs, "qdcp_whole_writes", None)
    if declared is not None:
        return bool(declared)
    return bool(protocols(fs) & _WHOLE_WRITES)


def publish_remote(fs, root: str, token: str, metadata: Metadata, overwrite: bool, check: Callable[[], None]) -> None:
    """Publish ``.metadata`` under an fsspec URL: one write on an object store (exclusive unless
    ``overwrite``), else a temporary renamed into place (``fs.mv``)."""
    root, whole = root.rstrip("/"), writes_whole(fs)
    final, tmp, data = f"{root}/{METADATA_FILE}", f"{root}/{metadata_tmp(token)}", pickle.dumps(metadata)
    if not whole:
        fs.pipe_file(tmp, data)
    check()
    fs.invalidate_cache(final)
    if not overwrite and not (whole and honours_exclusive(fs)) and fs.exists(final):
        raise _appeared(root)
    if not whole:
        fs.mv(tmp, final)
        return
    try:
        with fs.open(final, "wb" if overwrite else "xb") as f:
            f.write(data)
    except FileExistsError:
        raise _appeared(root) from None


def debris(names: Iterable[str], keep: set[str], replaced: set[str], token: str) -> list[str]:
    """What a save that published ``token`` (data files ``keep``) removes: the replaced checkpoint's
    files and other tokens' save files; never ``.metadata`` nor a claim's files."""
    out = []
    for name in names:
        if name in keep or name == METADATA_FILE or name.startswith(CLAIM_PREFIX):
            continue
        owner = token_of(name)
        if name in replaced or (owner is not None and owner != token):
            out.append(name)
    return sorted(out)
