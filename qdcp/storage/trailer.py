"""The ``qdcp-checksum`` item trailer: an XXH3-64 appended to each stored item by a DCP stream
extension (where the save planner records no checksums of its own), and its reader-side check."""

from __future__ import annotations

import io
import struct
import zlib
from typing import IO, Any

import xxhash
from torch.distributed.checkpoint._extension import StreamTransformExtension

from qdcp import checksums
from qdcp.errors import CheckpointFormatError, ChecksumError
from qdcp.spec import describe_item

__all__ = ["ChecksumExtension", "checksum_version", "verified_view", "VerifyingTransforms"]

_TRAILERS = {"1": 4, "2": 8}  # qdcp-checksum version -> bytes of the hash after the item


def _stream_hash(version: str, data: Any) -> int:
    return zlib.crc32(data) if version == "1" else checksums.of_bytes(data)


class _HashWriter(io.RawIOBase):
    """Passes bytes through to ``out`` and appends their XXH3-64 (8 bytes, little-endian) on close."""

    def __init__(self, out: IO[bytes]) -> None:
        super().__init__()
        self._out, self._hash = out, xxhash.xxh3_64()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self._hash.update(b)
        return self._out.write(b)

    def close(self) -> None:
        if not self.closed:
            self._out.write(struct.pack("<Q", self._hash.intdigest()))
            self._out.close()
        super().close()


def verified_view(data: Any, where: str, version: str) -> memoryview:
    """The payload of a ``qdcp-checksum/<version>`` item (without a copy), after checking its hash
    (version 1: CRC-32, written by qdcp 0.1; version 2: XXH3-64)."""
    size = _TRAILERS[version]
    if len(data) < size:
        raise ChecksumError(f"{where}: the stored item is truncated ({len(data)} bytes)")
    payload = memoryview(data)[:-size]
    expected = int.from_bytes(bytes(data[-size:]), "little")
    actual = _stream_hash(version, payload)
    if actual != expected:
        raise ChecksumError(f"{where}: checksum mismatch (stored {expected:0{2 * size}x}, computed "
                            f"{actual:0{2 * size}x}); the data file is corrupt")
    return payload


class ChecksumExtension(StreamTransformExtension):
    """DCP stream extension ``qdcp-checksum/2``: an XXH3-64 after each item's bytes. Reads
    ``qdcp-checksum/1`` (a CRC-32, qdcp 0.1) too."""

    def __init__(self, version: str = "2") -> None:
        super().__init__()
        self.version = version

    @staticmethod
    def registry_name() -> str:
        return "qdcp-checksum"

    @staticmethod
    def from_descriptor(version: str) -> "ChecksumExtension":
        major = version.partition(".")[0]
        if major not in _TRAILERS:
            raise CheckpointFormatError(f"unknown qdcp-checksum version {version!r}; upgrade qdcp")
        return ChecksumExtension(major)

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/{self.version}"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        if self.version != "2":
            raise CheckpointFormatError("qdcp writes qdcp-checksum/2 only")
        return _HashWriter(output)

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(verified_view(input.read(-1), "stored item", self.version))


def checksum_version(descriptors: list[str], where: str = "stored item") -> str | None:
    """The qdcp-checksum version among an item's transform descriptors (None if absent)."""
    for d in descriptors:
        name, _, version = d.partition("/")
        if name == ChecksumExtension.registry_name():
            major = version.partition(".")[0]
            if major not in _TRAILERS:
                raise CheckpointFormatError(f"{where}: unknown qdcp-checksum version {version!r}; upgrade qdcp")
            return major
    return None


class VerifyingTransforms:
    """Reader-side transforms that verify ``qdcp-checksum`` items and name the key on failure."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def transform_load_stream(self, read_item, transform_descriptors, raw_stream):
        descriptors = list(transform_descriptors or ())
        where = describe_item(read_item.storage_index.fqn)
        version = checksum_version(descriptors, where)
        if version is not None:
            # written last-applied-first: the checksum wraps the raw bytes in the file
            if checksum_version(descriptors[-1:]) is None:
                raise CheckpointFormatError(f"unexpected extension order {descriptors}")
            raw_stream = io.BytesIO(verified_view(raw_stream.read(-1), where, version))
            descriptors = descriptors[:-1]
        return self._inner.transform_load_stream(read_item, descriptors, raw_stream)
