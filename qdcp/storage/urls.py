"""Local paths and fsspec URLs; a ``file://`` URL is a local path."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

__all__ = ["is_url", "local_path"]


def local_path(path: str | os.PathLike) -> str | os.PathLike:
    """``path`` itself, or for a ``file://`` URL the local path it names."""
    text = os.fspath(path)
    if not text.startswith("file://"):
        return path
    parts = urlsplit(text)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{text!r}: a file:// URL names a local path (file:///abs/path); host {parts.netloc!r}")
    return unquote(parts.path) or "/"


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an fsspec URL (``memory://``, ``s3://``...) other than ``file://``."""
    return "://" in os.fspath(local_path(path))
