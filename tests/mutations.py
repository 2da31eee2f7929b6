"""A mutation engine over a real checkpoint's files, and the oracle every reader must meet.

A *mutation* is one structural edit of a copy of a real checkpoint, drawn from a seed:

- of the spec (the JSON in ``planner_data``): a value anywhere in an entry's tree replaced by a
  hostile one (0, -1, 2**40, a wrong type, a deep list, a near value), a member dropped, an entry
  dropped, given another entry's spec, or renamed;
- of the storage records: an item's offset or length moved, its file renamed to another data
  file, ``.metadata``, a missing file, a copy of the same bytes outside the checkpoint (relative
  or absolute);
- of the tensor records: a size, a chunk's offsets or sizes changed, a chunk dropped or repeated;
- of the checksum record: dropped, one hash dropped or flipped, its algorithm renamed, the seal
  mark dropped;
- of a data file: truncated, one byte flipped, bytes appended, replaced by a symlink to a copy
  outside, removed;
- of an item's own ``torch.save`` archive (written anew at the end of its file, its storage record
  pointed there): a pickle that would run code (make the directory :data:`MARKER` beside the
  checkpoint), the same bytes as another dtype of the same size or in another shape (their checksum
  still matches: only the dtype and shape checks stand), a larger storage than the tensor needs, the
  zip records deflated, a non-tensor in place of a tensor.

A metadata edit is written as damage would leave it, or *resealed* (its digest recomputed, as a
forger would), so that only the structural checks stand between it and a reader.

The oracle (written from docs/api.md's guarantees and docs/format.md's checks), per door:
each of ``qdcp.load``, ``dcp.load`` with ``QuantizedLoadPlanner`` through qdcp's reader,
``qdcp.consolidate`` and ``qdcp verify`` either refuses with a qdcp error (``verify``: exit 1 or
2, its problems named) and ``qdcp.load``'s targets are left as they were, or gives the genuine
values bit for bit (a harmless edit); the four agree; a checkpoint whose edit points outside
never loads; ``dcp.load`` through DCP's own reader (the plain path) never gives wrong values
without an error; no door runs code a checkpoint carries (:data:`MARKER` never made). Every case
runs under a time and a memory limit (tests/mutation_worker.py).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import pickle
import random
import shutil
import zipfile
from pathlib import Path

import torch

HOSTILE = (0, -1, 1, 2, 3, 7, 2**25, 2**40, -2**63, 0.5, float("nan"), None, True, "", "x", [], [0], [0, 0],
           [1, 1], [1, 16], [2**40, 1], {}, {"dtype": "float16"}, "float8_e5m2")
DEEP = [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
KINDS = ("spec_value", "spec_value", "spec_value", "spec_drop", "spec_entry", "storage", "storage",
         "tensor_md", "record", "file", "file", "archive", "archive")
MARKER = "CODE-RAN"  # made beside the checkpoint by a hostile pickle that a reader unpickled
# dtypes of one element size: the same stored bytes read as another of them
SAME_SIZE = ((torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2), (torch.float16, torch.bfloat16,
             torch.int16), (torch.float32, torch.int32), (torch.float64, torch.int64))


class _RunsCode:
    """Pickles as a call of ``os.mkdir(where)``: what unpickling it would run."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __reduce__(self):
        return os.mkdir, (self.where,)


def load_md(path: Path):
    """The checkpoint's metadata (a checkpoint these tests wrote: a plain unpickle)."""
    return pickle.loads((path / ".metadata").read_bytes())


def write_md(path: Path, md, reseal: bool) -> None:
    from stored_bytes import resealed

    (path / ".metadata").write_bytes(pickle.dumps(resealed(md) if reseal else md))


def _walk(node, at=()):
    """Every (path, value) in a JSON tree, the tree itself first."""
    yield at, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _walk(v, (*at, k))


def _near(value, rng: random.Random):
    """A value near ``value``: one more or less, twice, a list shortened or grown."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return rng.choice([value + 1, value - 1, value * 2, -value, value // 2])
    if isinstance(value, list) and value:
        return rng.choice([value[:-1], value + value[-1:], list(reversed(value)), [_near(value[0], rng)] + value[1:]])
    if isinstance(value, str):
        return rng.choice(["torchao.Int8Tensor", "torchao.NF4Tensor", "torchao.MXTensor", "torchao.Float8Tensor",
                           "int8", "float32", "bfloat16", "float8_e4m3fn", "raw", "dequantized", value + "x"])
    return rng.choice(HOSTILE)


def _spec(md) -> tuple[dict, str]:
    from qdcp import spec as qspec

    return json.loads(md.planner_data[qspec.PLANNER_DATA_KEY]), qspec.PLANNER_DATA_KEY


def _edit_spec(md, rng: random.Random, kind: str) -> str:
    doc, key = _spec(md)
    entries = doc["entries"]
    name = rng.choice(sorted(entries))
    if kind == "spec_entry":
        other = rng.choice(sorted(entries))
        how = rng.choice(["drop", "copy", "rename"])
        if how == "drop":
            del entries[name]
        elif how == "copy":
            entries[name] = copy.deepcopy(entries[other])
        else:
            entries[name + ".x" if rng.random() < 0.5 else other] = entries.pop(name)
        label = f"spec entry {name!r}: {how} ({other!r})"
    else:
        paths = [p for p, _ in _walk(entries[name]) if p]
        at = rng.choice(paths)
        parent = entries[name]
        for k in at[:-1]:
            parent = parent[k]
        if kind == "spec_drop":
            label = f"spec {name!r} {list(at)}: dropped"
            parent.pop(at[-1])
        else:
            old = parent[at[-1]]
            new = rng.choice([_near(old, rng), rng.choice(HOSTILE), DEEP])
            parent[at[-1]] = new
            label = f"spec {name!r} {list(at)}: {str(old)[:40]} -> {str(new)[:40]}"
    md.planner_data[key] = json.dumps(doc)
    return label


def _storage_record(md, rng: random.Random):
    """One storage record's index, drawn in a fixed order (the same seed, the same record)."""
    return rng.choice(sorted(md.storage_data, key=lambda i: (i.fqn, tuple(i.offset or ()), i.index or 0)))


def _edit_storage(md, path: Path, rng: random.Random) -> str:
    index = _storage_record(md, rng)
    info = md.storage_data[index]
    files = sorted({i.relative_path for i in md.storage_data.values()})
    what = rng.choice(["offset", "length", "file"])
    if what == "file":
        outside = path.parent / f"outside-{info.relative_path}"
        if path.joinpath(info.relative_path).exists():
            shutil.copyfile(path / info.relative_path, outside)
        new = rng.choice([rng.choice(files), ".metadata", "missing.distcp", f"../{outside.name}", str(outside),
                          f"sub/../{info.relative_path}", "./" + info.relative_path])
        md.storage_data[index] = dataclasses.replace(info, relative_path=new)
        if new.startswith("../") or os.path.isabs(new):
            return f"storage {index.fqn}@{list(index.offset or [])}: file -> {new} [outside]"
    else:
        old = getattr(info, what)
        new = max(0, rng.choice([old + 1, old - 1, old + 4096, 0, 2**40, old * 2, old + 64]))
        md.storage_data[index] = dataclasses.replace(info, **{what: new})
    return f"storage {index.fqn}@{list(index.offset or [])}: {what} -> {md.storage_data[index]}"


def _edit_tensor_md(md, rng: random.Random) -> str:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    keys = sorted(k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))
    key = rng.choice(keys)
    tmd = md.state_dict_metadata[key]
    chunks = list(tmd.chunks)
    what = rng.choice(["size", "chunk offsets", "chunk sizes", "drop chunk", "repeat chunk"])
    size = list(tmd.size)
    if what == "size" and size:
        d = rng.randrange(len(size))
        size[d] = _near(size[d], rng) if rng.random() < 0.8 else 2**40
    elif what in ("chunk offsets", "chunk sizes") and chunks and size:
        i, d = rng.randrange(len(chunks)), rng.randrange(len(size))
        off, sz = list(chunks[i].offsets), list(chunks[i].sizes)
        (off if what == "chunk offsets" else sz)[d] = max(0, _near((off if what == "chunk offsets" else sz)[d], rng))
        chunks[i] = ChunkStorageMetadata(torch.Size(off), torch.Size(sz))
    elif what == "drop chunk" and chunks:
        chunks.pop(rng.randrange(len(chunks)))
    elif chunks:
        chunks.append(rng.choice(chunks))
    md.state_dict_metadata[key] = TensorStorageMetadata(tmd.properties, torch.Size(size), chunks)
    return f"tensor record {key!r}: {what}"


def _edit_record(md, rng: random.Random) -> str:
    from qdcp import checksums

    data = md.planner_data
    rec = data.get(checksums.PLANNER_DATA_KEY)
    what = rng.choice(["drop", "drop one", "flip one", "algorithm", "seal"])
    if what == "drop" or not isinstance(rec, dict):
        data.pop(checksums.PLANNER_DATA_KEY, None)
    elif what == "seal":
        for k in [k for k in data if "sealed" in k]:
            del data[k]
    elif what == "algorithm":
        rec["algorithm"] = rng.choice(["md5", "none", "", None])
    elif rec.get("items"):
        k = rng.choice(sorted(rec["items"]))
        if what == "drop one":
            del rec["items"][k]
        elif isinstance(rec["items"][k], bytes):
            h = bytearray(rec["items"][k])
            h[0] ^= 1
            rec["items"][k] = bytes(h)
    return f"checksum record: {what}"


def _edit_file(path: Path, md, rng: random.Random) -> str:
    name = rng.choice(sorted({i.relative_path for i in md.storage_data.values()}))
    f = path / name
    raw = bytearray(f.read_bytes())
    what = rng.choice(["truncate", "flip", "append", "symlink out", "remove"])
    if what == "truncate":
        f.write_bytes(bytes(raw[:rng.randrange(len(raw))]))
    elif what == "flip":
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        f.write_bytes(bytes(raw))
    elif what == "append":
        f.write_bytes(bytes(raw) + os.urandom(rng.randint(1, 64)))
    elif what == "symlink out":
        outside = path.parent / f"outside-{name}"
        f.rename(outside)
        os.symlink(outside, f)
    else:
        f.unlink()
    return f"data file {name}: {what}"


def _archive(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _deflated(raw: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    return out.getvalue()


def _edit_archive(md, path: Path, rng: random.Random) -> str:
    index = _storage_record(md, rng)
    info = md.storage_data[index]
    f = path / info.relative_path
    data = f.read_bytes()
    raw = data[info.offset:info.offset + info.length]
    value = torch.load(io.BytesIO(raw), weights_only=True)
    choices = ["runs code", "deflated", "not a tensor"]
    if isinstance(value, torch.Tensor):
        choices += ["another dtype", "another shape", "larger storage"]
    what = rng.choice(choices)
    if what == "runs code":
        new = _archive(_RunsCode(str(path.parent / MARKER)))
    elif what == "deflated":  # (of torch.save's own archive: qdcp's writer may leave the zip CRC-32s unset)
        new = _deflated(_archive(value))
    elif what == "not a tensor":
        new = _archive(rng.choice([[1, 2], 3, "x", {"a": torch.zeros(2)}]))
    elif what == "another dtype":
        size = next(group for group in SAME_SIZE if value.dtype in group)
        new = _archive(value.view(rng.choice([d for d in size if d != value.dtype])))
    elif what == "another shape":
        new = _archive(value.reshape(-1) if value.dim() != 1 else value.reshape(1, -1))
    else:
        new = _archive(torch.cat([value.reshape(-1), value.reshape(-1)])[:value.numel()].view(value.shape))
    f.write_bytes(data + new)
    md.storage_data[index] = dataclasses.replace(info, offset=len(data), length=len(new))
    return f"archive of {index.fqn}@{list(index.offset or [])}: {what}"


def mutate(path: Path, seed: int) -> tuple[str, bool, bool]:
    """Apply mutation ``seed`` to the checkpoint copy at ``path``: its label, whether it was resealed,
    and whether it points a reader outside the checkpoint."""
    rng = random.Random(seed)
    kind = rng.choice(KINDS)
    if kind == "file":
        label = _edit_file(path, load_md(path), rng)
        return label, False, "symlink out" in label
    md = load_md(path)
    if kind.startswith("spec"):
        label = _edit_spec(md, rng, kind)
    elif kind == "storage":
        label = _edit_storage(md, path, rng)
    elif kind == "tensor_md":
        label = _edit_tensor_md(md, rng)
    elif kind == "archive":
        label = _edit_archive(md, path, rng)
    else:
        label = _edit_record(md, rng)
    reseal = rng.random() < 0.5 and kind != "record"
    write_md(path, md, reseal)
    outside = "[outside]" in label
    return label + (" (resealed)" if reseal else ""), reseal, outside
