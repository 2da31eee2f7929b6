"""Item checksums (docs/format.md, *Checksums*): XXH3-64 of each item, their record in the metadata
and its digest, and the save's checks between ranks (:class:`SaveHashes`; the load planner's
verifier is :mod:`qdcp.planning.verifier`). qdcp's writer hashes every item, else the save
planner; qdcp's reader verifies every item, else the load planner the items it reads whole.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from qdcp.errors import AlignmentError, CheckpointFormatError, ChecksumError, ReplicaMismatchError
from qdcp.layouts import byte_view
from qdcp.spec import COMPONENT_SEPARATOR, describe_item, no_gc
from qdcp.spec import PLANNER_DATA_KEY as SPEC_KEY

PLANNER_DATA_KEY = "__qdcp_checksums__"
# "this save recorded every item's checksum": a record deleted or renamed is then damage
SEALED_KEY = "__qdcp_sealed__"
ALGORITHM = "xxh3_64"

_U64 = struct.Struct("<Q")


def of_bytes(data: Any) -> int:
    """XXH3-64 of a bytes-like object."""
    return xxhash.xxh3_64_intdigest(data)


def of_tensor(t: torch.Tensor) -> int | None:
    """XXH3-64 of a CPU tensor's elements, row-major (any strides). A subclass is hashed by the values
    a plain copy of it holds; None where it cannot be copied (the item is saved unchecked)."""
    t = t.detach()
    if t.device.type != "cpu":
        raise ValueError(f"checksums are computed on CPU tensors, got one on {t.device}")
    if type(t) is not torch.Tensor:
        t = _as_plain(t)
        if t is None:
            return None
    if t.numel() == 0:
        return of_bytes(b"")
    return of_bytes(byte_view(t.contiguous()).numpy())  # row-major


def _as_plain(t: torch.Tensor) -> torch.Tensor | None:
    """A subclass's values as a plain tensor (a view where it keeps torch's dispatch), or None."""
    if type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        return t.as_subclass(torch.Tensor)
    try:
        with torch.no_grad():
            plain = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    except Exception:  # a subclass whose copy_ is not defined: nothing to hash, as for stock DCP
        return None
    return plain if type(plain) is torch.Tensor else None


def of_data(data: Any) -> int | None:
    """XXH3-64 of a CPU tensor (:func:`of_tensor`) or of an object's bytes."""
    return of_tensor(data) if isinstance(data, torch.Tensor) else of_bytes(data)


# ----------------------------------------------------------------------------- trailers (read only)
# Older qdcp writers put each item's hash after its bytes ("qdcp-checksum/1": CRC-32; "/2": XXH3-64)
_TRAILERS = {"1": 4, "2": 8}  # version -> bytes of the hash after the item
TRAILER_EXTENSION = "qdcp-checksum"


def trailer_version(descriptors: list[str], where: str) -> str | None:
    """The qdcp-checksum version among an item's transform descriptors (None if absent; it is last)."""
    for d in descriptors:
        name, _, version = d.partition("/")
        if name == TRAILER_EXTENSION:
            major = version.partition(".")[0]
            if major not in _TRAILERS:
                raise CheckpointFormatError(f"{where}: unknown qdcp-checksum version {version!r}; upgrade qdcp")
            if descriptors[-1] != d:
                raise CheckpointFormatError(f"{where}: unexpected extension order {descriptors}")
            return major
    return None


def trailed_payload(data: Any, where: str, version: str) -> memoryview:
    """The payload of a ``qdcp-checksum/<version>`` item (no copy), its hash checked."""
    size = _TRAILERS[version]
    if len(data) < size:
        raise ChecksumError(f"{where}: the stored item is truncated ({len(data)} bytes)")
    payload = memoryview(data)[:-size]
    expected = int.from_bytes(bytes(data[-size:]), "little")
    actual = zlib.crc32(payload) if version == "1" else of_bytes(payload)
    if actual != expected:
        raise ChecksumError(f"{where}: checksum mismatch (stored {expected:0{2 * size}x}, computed "
                            f"{actual:0{2 * size}x}); the data file is corrupt")
    return payload


# xxHash releases the GIL: items this large are hashed on background threads
BACKGROUND_BYTES = 1 << 20
_HASH_THREADS = max(1, min(4, os.cpu_count() or 1))


@functools.cache  # threads racing on the first call may each make one: both work
def hash_pool() -> ThreadPoolExecutor:
    """The threads large items are hashed on."""
    return ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="qdcp-hash")


def nbytes(data: Any) -> int:
    """The bytes of a tensor or bytes-like object."""
    return data.numel() * data.element_size() if isinstance(data, torch.Tensor) else len(data)


def hash_later(data: Any) -> Callable[[], int | None]:
    """Start hashing ``data`` (a background thread for large data); call the result for the hash."""
    if nbytes(data) < BACKGROUND_BYTES:
        h = of_data(data)
        return lambda: h
    return hash_pool().submit(of_data, data).result


def hash_many(items: Iterable[tuple[Any, Any]]) -> dict[Any, int | None]:
    """``{key: hash}`` for lazily produced ``(key, data)`` pairs, a few large ones hashed at a time."""
    out: dict[Any, int] = {}
    pending: collections.deque = collections.deque()
    for key, data in items:
        if nbytes(data) < BACKGROUND_BYTES:
            out[key] = of_data(data)
            continue
        pending.append((key, hash_pool().submit(of_data, data)))
        if len(pending) > 2 * _HASH_THREADS:
            k, fut = pending.popleft()
            out[k] = fut.result()
    for k, fut in pending:
        out[k] = fut.result()
    return out


def item_key(item: WriteItem) -> tuple[str, tuple[int, ...]]:
    """A write item's ``(fqn, chunk offsets)``: how the save side names it across ranks."""
    return item.index.fqn, tuple(item.index.offset or ())


@dataclasses.dataclass(eq=False)
class SaveHashes:
    """The save planner's hashes: each rank's (:meth:`local`), compared between ranks (:meth:`check`),
    and their record (:meth:`record`). ``by_writer``: the writer hashes and records every item, so
    only what the checks compare is hashed."""

    checksums: bool
    check_replicas: bool
    by_writer: bool = False

    def local(self, items: list[WriteItem], shared: list[tuple[str, tuple[int, ...]]],
              data: Callable[[WriteItem], Any]) -> dict:
        """This rank's ``{"hashes": {item key: hash}, "shared": [item keys other ranks also hold]}``."""
        shared_keys = set(shared)
        every = (self.checksums and not self.by_writer) or self.check_replicas
        hashed = items if every else [i for i in items if item_key(i) in shared_keys]
        return {"hashes": hash_many((item_key(i), data(i)) for i in hashed), "shared": shared}

    def check(self, per_rank: list[dict | None]) -> list[dict]:
        """Refuse shared component items whose copies differ between ranks (every replicated chunk
        with ``check_replicas``); the ranks' parts (empty for a rank that sent none)."""
        per_rank = [part or {"hashes": {}, "shared": []} for part in per_rank]
        for key, ranks in diverged(per_rank, shared_only=True).items():
            fqn, name = key[0].rsplit(COMPONENT_SEPARATOR, 1)
            raise AlignmentError(
                f"key {fqn!r}: component {name!r} holds values shared by the shards of ranks "
                f"{ranks[0]} and {ranks[1]} (one for the whole tensor, or for a block both shards "
                f"cut), but they differ: the shards were quantized each on its own (e.g. with "
                f"its own per-tensor scale). Quantize the shards with one scale for the whole "
                f"tensor, or save this entry dequantized.")
        differ = diverged(per_rank, shared_only=False) if self.check_replicas else {}
        if differ:
            lines = [f"{describe_item(fqn)}: the chunk at {list(offsets)} of rank(s) {ranks[1:]} differs from rank "
                     f"{ranks[0]}'s" for (fqn, offsets), ranks in sorted(differ.items())[:10]]
            more = f" (and {len(differ) - 10} more)" if len(differ) > 10 else ""
            raise ReplicaMismatchError(
                f"{len(differ)} replicated chunk(s) differ between the ranks that hold them{more}; nothing was "
                f"written:\n  " + "\n  ".join(lines) + "\nThe replicas diverged in training (check that "
                "every replica group ran the same updates), or save from one replica group.")
        return per_rank

    def record(self, global_plan: list[SavePlan], per_rank: list[dict], metadata: Metadata) -> dict | None:
        """The checksum record, each item's hash from the rank that writes it; None where not the planner's."""
        if not self.checksums or self.by_writer:
            return None
        return written_record(metadata, ((item.index, per_rank[rank]["hashes"].get(item_key(item)))
                                  for rank, plan in enumerate(global_plan) for item in plan.items))


def written_record(metadata: Metadata, hashes: Iterable[tuple[Any, int | None]]) -> dict:
    """The checksum record from ``(MetadataIndex, hash)`` pairs, packed straight into each item's
    bytes; an item with an unhashed chunk (None) is listed as ``unchecked``."""
    packed: dict[str, bytearray] = {}
    missing: dict[str, int] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        missing[fqn] = len(md.chunks) if isinstance(md, TensorStorageMetadata) else 1
        packed[fqn] = bytearray(8 * missing[fqn])
    for index, h in hashes:
        if h is not None and index.fqn in packed:
            _U64.pack_into(packed[index.fqn], 8 * (index.index or 0), h)
            missing[index.fqn] -= 1
    items = {fqn: bytes(b) for fqn, b in packed.items() if b and not missing[fqn]}
    unchecked = sorted(fqn for fqn, b in packed.items() if b and missing[fqn])
    return {"algorithm": ALGORITHM, "items": items, **({"unchecked": unchecked} if unchecked else {})}


def diverged(per_rank: list[dict], shared_only: bool) -> dict[tuple, list[int]]:
    """``{item key: [first rank, ranks whose hash differs]}`` over the ranks' hashes (with
    ``shared_only``, only the keys each lists as ``shared``)."""
    first: dict[tuple, tuple[int, int]] = {}
    out: dict[tuple, list[int]] = {}
    for rank, part in enumerate(per_rank):
        hashes = part["hashes"]
        for key in (part["shared"] if shared_only else hashes):
            seen = first.setdefault(key, (rank, hashes[key]))
            if seen[1] != hashes[key]:
                out.setdefault(key, [seen[0]]).append(rank)
    return out


@dataclasses.dataclass
class Record:
    """The checksums a checkpoint carries, looked up by item and chunk offsets."""

    metadata: Metadata
    items: Mapping[str, bytes]
    _by_offsets: dict[str, dict[tuple, tuple[tuple, int]]] = dataclasses.field(default_factory=dict)

    def expected(self, fqn: str, offsets: Any) -> tuple[tuple[int, ...] | None, int] | None:
        """``(chunk sizes, or None for an object; hash)`` of ``fqn``'s chunk at ``offsets``, or None."""
        if fqn not in self._by_offsets:
            self._by_offsets[fqn] = self._table(fqn)
        return self._by_offsets[fqn].get(tuple(offsets or ()))

    def _table(self, fqn: str) -> dict[tuple, tuple[tuple | None, int]]:
        blob = self.items.get(fqn)  # bytes: record() checked
        if blob is None:
            return {}
        item = self.metadata.state_dict_metadata.get(fqn)
        chunks = item.chunks if isinstance(item, TensorStorageMetadata) else [None]
        if len(blob) != 8 * len(chunks):
            raise CheckpointFormatError(f"{describe_item(fqn)}: the checkpoint records {len(blob) // 8} checksums "
                                        f"for its {len(chunks)} chunks; the metadata is damaged")
        hashes = struct.unpack(f"<{len(chunks)}Q", blob)
        return {tuple(c.offsets) if c else (): (tuple(c.sizes) if c else None, h) for c, h in zip(chunks, hashes)}


def record(metadata: Metadata | None) -> Record | None:
    """The checksum record of ``metadata`` (None: saved without checksums), its digest checked; a
    sealed checkpoint (:func:`attach`) must carry the record, its digest and every item's hash."""
    data = metadata.planner_data if isinstance(getattr(metadata, "planner_data", None), dict) else {}
    raw, marked = data.get(PLANNER_DATA_KEY), data.get(SEALED_KEY) is not None
    if raw is None:
        if marked:
            raise _damaged("its save recorded every item's checksum, but the record is missing (or its name damaged)")
        return None
    unchecked = raw.get("unchecked", []) if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or not isinstance(raw.get("items"), dict) \
            or not all(isinstance(k, str) and isinstance(v, bytes) for k, v in raw["items"].items()) \
            or not isinstance(unchecked, list) or not all(isinstance(k, str) for k in unchecked):
        raise CheckpointFormatError("the checkpoint's checksum record is malformed; the metadata is damaged")
    if raw.get("algorithm") != ALGORITHM:
        raise CheckpointFormatError(
            f"the checkpoint's items are checksummed with {raw.get('algorithm')!r}, which this qdcp does "
            f"not know (it knows {ALGORITHM!r}). Upgrade qdcp, or load without verification "
            f"(QuantizedLoadPlanner(checksums=False)).")
    if marked and "metadata" not in raw:
        raise _damaged("its checksum record has lost its digest")
    covered = {*raw["items"], *unchecked}
    for fqn, item in (metadata.state_dict_metadata or {}).items() if marked else ():
        if fqn not in covered and (not isinstance(item, TensorStorageMetadata) or item.chunks):
            raise _damaged(f"its checksum record has no checksum for {describe_item(fqn)}")
    if "metadata" in raw and raw["metadata"] != metadata_digest(metadata, raw["items"], unchecked):
        raise CheckpointFormatError(
            "the checkpoint's .metadata does not match the digest its save recorded: it is damaged (an "
            "entry's key, shape, dtype or chunks, its nesting or the qdcp spec changed). Restore it from a "
            "good copy")
    return Record(metadata, raw["items"])


def _damaged(what: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"the checkpoint's .metadata is damaged: {what}. It cannot be verified, so it "
                                 f"is not loaded; restore it from a good copy")


def sealed(record: dict, metadata: Metadata) -> dict:
    """``record`` with the digest of ``metadata`` (:func:`metadata_digest`)."""
    return {**record, "metadata": metadata_digest(metadata, record["items"], record.get("unchecked", ()))}


def attach(metadata: Metadata, record: dict) -> None:
    """Put ``record`` into ``metadata.planner_data``, sealed and marked (:data:`SEALED_KEY`), replacing
    an earlier save's (plan caching reuses the metadata object)."""
    if metadata.planner_data is None:
        metadata.planner_data = {}
    metadata.planner_data[PLANNER_DATA_KEY] = sealed(record, metadata)
    metadata.planner_data[SEALED_KEY] = ALGORITHM


def metadata_digest(metadata: Metadata, items: Mapping[str, Any], unchecked: Iterable[str] = ()) -> str:
    """XXH3-64 (hex) of the canonical JSON of the metadata's entries, nesting, spec and item hashes
    (docs/format.md, *The metadata digest*); built without GC passes (4x slower at 10k keys with them)."""
    entries: dict[str, Any] = {}
    with no_gc():
        for fqn, item in (metadata.state_dict_metadata or {}).items():
            entries[fqn] = [str(item.properties.dtype), list(item.size),
                            [[list(c.offsets), list(c.sizes)] for c in item.chunks]] \
                if isinstance(item, TensorStorageMetadata) else "bytes"
        data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        doc = {"entries": entries, "nesting": {k: list(v) for k, v in data.items() if isinstance(v, (tuple, list))},
               "spec": data.get(SPEC_KEY),
               "items": {k: v.hex() for k, v in items.items()}}
        if unchecked:
            doc["unchecked"] = sorted(unchecked)
        return xxhash.xxh3_64_hexdigest(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


def corrupt(item_fqn: str, offsets: Any, recorded: int, read: int, changed: str = "") -> ChecksumError:
    """The error for an item whose bytes do not match its recorded checksum (``changed``: what the load
    had already changed)."""
    chunk = f"its stored chunk at {tuple(offsets)}: " if offsets else ""
    then = f" {changed}" if changed else ""
    return ChecksumError(
        f"{describe_item(item_fqn)}: the bytes read from the checkpoint do not match the checksum its save "
        f"recorded ({chunk}recorded {recorded:016x}, read {read:016x}): its data file is corrupt.{then}")
