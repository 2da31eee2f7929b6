"""A checkpoint's bytes on disk: each stored item's bytes and the bytes between them (what direct
writes leave), and corrupting one the way a bad disk or transfer would: one flipped byte inside the
stored copy of known data."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import qdcp


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


def stored_items(path) -> dict[str, bytes]:
    """Each stored item's bytes, by ``fqn@offsets``."""
    md = qdcp.read_metadata(path)
    out = {}
    for index, info in md.storage_data.items():
        with open(Path(path) / info.relative_path, "rb") as f:
            f.seek(info.offset)
            out[f"{index.fqn}@{tuple(index.offset or ())}"] = f.read(info.length)
    return out


def gap_bytes(path) -> int:
    """Bytes of the checkpoint's data files that belong to no item (the gaps direct writes leave)."""
    md = qdcp.read_metadata(path)
    files = {i.relative_path for i in md.storage_data.values()}
    return sum(os.path.getsize(Path(path) / f) for f in files) - sum(i.length for i in md.storage_data.values())
