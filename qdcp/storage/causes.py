"""Write errors that name their root OS error: ``torch.save`` into a stream whose ``write`` raised
(ENOSPC) reports ``RuntimeError: ... unexpected pos``, the OS error only its ``__context__``."""

from __future__ import annotations

from typing import NoReturn

from qdcp.errors import CheckpointWriteError, QdcpError

__all__ = ["root_os_error", "raise_with_cause"]


def root_os_error(exc: BaseException) -> OSError | None:
    """The deepest ``OSError`` in ``exc``'s chain (``__cause__``, else ``__context__``), or None."""
    found, seen = None, set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and not isinstance(exc, QdcpError):
            found = exc
        exc = exc.__cause__ if exc.__cause__ is not None else exc.__context__
    return found


def raise_with_cause(exc: BaseException, doing: str) -> NoReturn:
    """Re-raise ``exc``, or where an OS error lies behind it (no qdcp error), a
    :class:`CheckpointWriteError` naming it and ``doing``, from it."""
    root = root_os_error(exc) if isinstance(exc, Exception) and not isinstance(exc, QdcpError) else None
    if root is None:
        raise exc
    told = "" if root is exc else f"; torch reported: {type(exc).__name__}: {_one_line(exc)}"
    err = CheckpointWriteError(root.errno or 0, f"{doing} failed: {type(root).__name__}: {_one_line(root)}{told}. "
                                                f"Nothing was committed: what was at that path is as it was")
    if root.filename is not None:
        err.filename = root.filename
    raise err from root


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."
