"""Hugging Face safetensors directories: a streaming shard writer, shard plan, index, size parsing.

The ``safetensors`` library has no streaming writer (``save_file`` needs a file's every tensor in
memory): here a file's header is computed from the planned names, shapes and dtypes, then each
tensor's bytes are appended as it is produced. Reading goes through the library (``safe_open``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
from typing import IO, Callable, Mapping, Sequence

import torch

from qdcp.errors import QdcpError
from qdcp.layouts import byte_view

#: torch dtype -> safetensors dtype name
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
}
SAFETENSORS_TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


@dataclasses.dataclass(frozen=True)
class TensorOut:
    """One tensor a safetensors file will hold."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """A tensor made and written a block of rows at a time (the whole never in memory at once):
    ``make(start, stop)`` returns rows ``[start, stop)``, ``rows`` at most per call."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[int, int], torch.Tensor]
    rows: int

    def blocks(self):
        """The row blocks in order."""
        for start in range(0, self.shape[0], max(1, self.rows)):
            yield self.make(start, min(start + max(1, self.rows), self.shape[0]))


def header_bytes(tensors: Sequence[TensorOut], metadata: Mapping[str, str]) -> bytes:
    """The length-prefixed JSON header of a file holding ``tensors`` in this order (padded with
    spaces to a multiple of 8 bytes, as the format allows)."""
    header: dict = {}
    offset = 0
    for t in tensors:
        if t.dtype not in SAFETENSORS_DTYPES:
            raise QdcpError(f"tensor {t.name!r}: dtype {t.dtype} has no safetensors name")
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(len(blob) + 8) % 8)
    return len(blob).to_bytes(8, "little") + blob


class ShardWriter:
    """Writes one safetensors file: the header at open, then each planned tensor in order. As a
    context manager it closes the file on exit, checking every planned tensor was written unless
    the block raised."""

    def __init__(self, path: str, tensors: Sequence[TensorOut], metadata: Mapping[str, str]) -> None:
        self.path = path
        self._pending = collections.deque(tensors)
        self._file: IO[bytes] = open(path, "wb")
        self._file.write(header_bytes(tensors, metadata))

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._file.close()
        if exc_type is None and self._pending:
            raise QdcpError(f"{self.path}: tensors {[t.name for t in self._pending]} were planned but not written")

    def write(self, name: str, value: torch.Tensor | RowBlocks) -> None:
        """Append ``value``'s bytes as tensor ``name`` (the next one planned, same shape and dtype)."""
        want = self._pending.popleft() if self._pending else None
        if want is None or want.name != name or tuple(value.shape) != want.shape or value.dtype != want.dtype:
            raise QdcpError(f"{self.path}: tensor {name!r} {tuple(value.shape)} {value.dtype} does not match "
                            f"the planned {want}")
        parts = value.blocks() if isinstance(value, RowBlocks) else (value,)
        written = 0
        for part in parts:
            if part.dtype != want.dtype or tuple(part.shape[1:]) != want.shape[1:]:
                raise QdcpError(f"{self.path}: a block of {name!r} is {tuple(part.shape)} {part.dtype}")
            if part.numel():
                data = byte_view(part.detach().contiguous())
                self._file.write(memoryview(data.cpu().numpy()))
            written += part.numel() * part.element_size()
        if written != want.nbytes:
            raise QdcpError(f"{self.path}: tensor {name!r}: {written} bytes written, {want.nbytes} planned")


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(B|[KMGT]i?B)?\s*", flags=re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """Bytes in ``size`` (``max_shard_size``): a positive int, or a string like ``"5GB"`` (10**9) or
    ``"500MiB"`` (2**20), as Hugging Face's ``max_shard_size`` reads them; ``ValueError`` otherwise."""
    m = None if isinstance(size, bool) else _SIZE.fullmatch(str(size))
    n = 0
    if isinstance(size, int) and m is not None:
        n = size
    elif m is not None:
        unit = (m.group(2) or "B").upper()
        n = int(float(m.group(1)) * (1024 if "I" in unit else 1000) ** "BKMGT".index(unit[0]))
    if n < 1:
        raise ValueError(f"max_shard_size (--max-shard-size) {size!r}: expected a positive number of bytes, or one "
                         f"with a unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (of 1024), as "
                         f"in '5GB' or '500MiB'")
    return n


def plan_shards(entry_bytes: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Entries (by index, in order) grouped into files of at most ``max_bytes`` each; an entry
    is never split, and one larger than ``max_bytes`` gets a file of its own."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(entry_bytes):
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    return shards


def shard_file_names(n: int) -> list[str]:
    """``model.safetensors`` for one file, else ``model-00001-of-0000N.safetensors``..."""
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_index(out_dir: str, weight_map: Mapping[str, str], total_size: int) -> None:
    """``model.safetensors.index.json``: total bytes and which file holds each tensor."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")


def directory_files(path: str) -> list[str]:
    """The safetensors files of a Hugging Face directory: those its index names, else
    ``model.safetensors``, else every ``*.safetensors`` file in it (sorted)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise QdcpError(f"{index}: weight_map must be an object")
        return sorted(set(weight_map.values()))
    if os.path.exists(os.path.join(path, SINGLE_FILE)):
        return [SINGLE_FILE]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"{path}: no safetensors files (model.safetensors or an index)")
    return found


def read_config(path: str) -> dict:
    """``config.json`` of a Hugging Face directory, or ``{}``."""
    p = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(p):
        return {}
    with open(p) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise QdcpError(f"{p}: expected a JSON object")
    return config
