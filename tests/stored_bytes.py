"""A checkpoint's bytes on disk: each stored item's bytes and the bytes between them (what direct
writes leave), and corrupting one the way a bad disk or transfer would: one flipped byte inside the
stored copy of known data."""

from __future__ import annotations

import io
import os
import struct
import zipfile
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


def record_span(blob: bytes, record: str) -> tuple[int, int] | None:
    """``(start, size)`` in ``blob`` (one stored item: a torch.save zip archive) of the bytes of its
    uncompressed record whose name ends with ``/record`` (``data/0``: the tensor's elements;
    ``data.pkl``), read from the record's local header; None if the item has no such record."""
    found = [i for i in zipfile.ZipFile(io.BytesIO(blob)).infolist() if i.filename.endswith("/" + record)]
    assert len(found) <= 1, f"{len(found)} records named {record!r}"
    if not found:
        return None
    zi = found[0]
    name_len, extra_len = struct.unpack("<HH", blob[zi.header_offset + 26:zi.header_offset + 30])
    return zi.header_offset + 30 + name_len + extra_len, zi.file_size


def flip_item_byte(path, pick: int) -> str | None:
    """Flip one byte of the data of one stored item, chosen by ``pick`` among the items that hold
    data (a byte of its ``data/0`` record, the tensor's elements); that item's fqn, None if none has."""
    md = qdcp.read_metadata(path)
    spans = []
    for index, info in sorted(md.storage_data.items(), key=lambda kv: (kv[0].fqn, tuple(kv[0].offset or ()))):
        with open(Path(path) / info.relative_path, "rb") as f:
            f.seek(info.offset)
            span = record_span(f.read(info.length), "data/0")
        if span is not None and span[1]:
            spans.append((index.fqn, info.relative_path, info.offset + span[0], span[1]))
    if not spans:
        return None
    fqn, rel, start, size = spans[pick % len(spans)]
    with open(Path(path) / rel, "r+b") as f:
        f.seek(start + (pick // len(spans)) % size)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x5A]))
    return fqn


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


def resealed(md):
    """``md`` with its checksum record's metadata digest recomputed, as the writer of such metadata
    would have recorded it: for tests of the checks a consistent but hostile (or buggy) .metadata
    meets behind the digest (a damaged one is refused by the digest first)."""
    from qdcp import checksums

    data = md.planner_data if isinstance(md.planner_data, dict) else {}
    rec = data.get(checksums.PLANNER_DATA_KEY)
    if isinstance(rec, dict) and "metadata" in rec and isinstance(rec.get("items"), dict) \
            and all(isinstance(v, bytes) for v in rec["items"].values()):
        data[checksums.PLANNER_DATA_KEY] = checksums.sealed({k: v for k, v in rec.items() if k != "metadata"}, md)
    return md
