"""Corrupting a checkpoint on disk the way a bad disk or transfer would: one flipped byte inside the
stored copy of known data."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t`` as DCP stores them (row-major)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def flip_stored_bytes(path, needle: bytes, at: int = 7) -> str:
    """Flip one byte inside the stored copy of ``needle`` (a tensor's raw bytes, stored once in the
    checkpoint's data files); the name of the file changed."""
    found = []
    for name in sorted(n for n in os.listdir(path) if n.endswith(".distcp")):
        raw = bytearray((Path(path) / name).read_bytes())
        pos = raw.find(needle)
        if pos >= 0:
            assert raw.find(needle, pos + 1) < 0
            found.append((name, raw, pos))
    assert len(found) == 1, f"{len(found)} data files hold the bytes"
    name, raw, pos = found[0]
    raw[pos + at] ^= 0x5A
    (Path(path) / name).write_bytes(bytes(raw))
    return name
