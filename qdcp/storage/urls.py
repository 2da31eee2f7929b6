"""Local paths and fsspec URLs."""

from __future__ import annotations

import os

__all__ = ["is_url"]


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an fsspec URL (``memory://``, ``s3://``...), not a local path."""
    return "://" in os.fspath(path)
