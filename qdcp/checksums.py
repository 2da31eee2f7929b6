"""Item checksums (docs/format.md, *Checksums*): the XXH3-64 hash of an item, the record of
them in ``Metadata.planner_data["__qdcp_checksums__"]``, the save's checks between ranks
(:class:`SaveHashes`) and the load planner's verifier (:class:`ReadVerifier`). One rule: qdcp's
writer hashes every item as it writes it, else the save planner does; qdcp's reader verifies every
item it reads, else the load planner verifies the items it reads whole.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import struct
import threading
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
# beside the record, under a key of its own: "this checkpoint's save recorded every item's checksum".
# A record deleted, or renamed by a flipped bit, is then damage, not a checkpoint without checksums.
SEALED_KEY = "__qdcp_sealed__"
ALGORITHM = "xxh3_64"

_U64 = struct.Struct("<Q")


def of_bytes(data: Any) -> int:
    """XXH3-64 of a bytes-like object."""
    return xxhash.xxh3_64_intdigest(data)


def of_tensor(t: torch.Tensor) -> int | None:
    """XXH3-64 of a CPU tensor's elements, row-major (any strides; the same value for a copy).

    A tensor subclass (one qdcp has no adapter for, saved as DCP saves it) is hashed by the values
    a plain tensor of its dtype holds once it is copied from it (what a plain load target gets);
    None where that copy is not defined (the item is then saved unchecked, as stock DCP saves it).
    """
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
    """The plain tensor holding a subclass's values: a view of its storage where the subclass
    keeps torch's own dispatch, else a copy into a plain tensor (None if it cannot be copied)."""
    if type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        return t.as_subclass(torch.Tensor)
    try:
        with torch.no_grad():
            plain = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    except Exception:  # a subclass whose copy_ is not defined: nothing to hash, as for stock DCP
        return None
    return plain if type(plain) is torch.Tensor else None


def of_data(data: Any) -> int | None:
    """XXH3-64 of what a writer is given for an item: a CPU tensor, or the bytes of an object
    (None: a tensor subclass whose values cannot be read, see :func:`of_tensor`)."""
    return of_tensor(data) if isinstance(data, torch.Tensor) else of_bytes(data)


# ----------------------------------------------------------------------------- trailers (read only)
# Items written by qdcp's writer before it recorded every item's hash itself carry their hash after
# their bytes ("qdcp-checksum/1": CRC-32, qdcp 0.1; "/2": XXH3-64), named in transform_descriptors.
_TRAILERS = {"1": 4, "2": 8}  # version -> bytes of the hash after the item
TRAILER_EXTENSION = "qdcp-checksum"


def trailer_version(descriptors: list[str], where: str) -> str | None:
    """The qdcp-checksum version among an item's transform descriptors (None if absent). The
    trailer wraps the raw bytes in the file: it is listed last (applied last at the save)."""
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
    """The payload of a ``qdcp-checksum/<version>`` item (without a copy), after checking its hash."""
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


# xxHash releases the GIL while it hashes: large items are hashed on these threads, beside the
# Python work (and the GIL-free copies) of the caller
_BACKGROUND_BYTES = 1 << 20
# A load planner's items waiting for their background hash hold at most this much host memory (the
# reads wait for the oldest hash past it): hashing slower than reading does not hold the whole load.
_PENDING_MAX = 512 << 20
_HASH_THREADS = max(1, min(4, os.cpu_count() or 1))


@functools.cache  # threads racing on the first call may each make one: both work
def _hash_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="qdcp-hash")


def _nbytes(data: Any) -> int:
    return data.numel() * data.element_size() if isinstance(data, torch.Tensor) else len(data)


def hash_later(data: Any) -> Callable[[], int | None]:
    """Start hashing ``data`` (a background thread for large data); call the result for the hash."""
    if _nbytes(data) < _BACKGROUND_BYTES:
        h = of_data(data)
        return lambda: h
    return _hash_pool().submit(of_data, data).result


def hash_many(items: Iterable[tuple[Any, Any]]) -> dict[Any, int | None]:
    """``{key: hash}`` for ``(key, data)`` pairs produced lazily (at most a few large ones are held
    at a time); large data is hashed on background threads while the next is produced."""
    out: dict[Any, int] = {}
    pending: collections.deque = collections.deque()
    for key, data in items:
        if _nbytes(data) < _BACKGROUND_BYTES:
            out[key] = of_data(data)
            continue
        pending.append((key, _hash_pool().submit(of_data, data)))
        if len(pending) > 2 * _HASH_THREADS:
            k, fut = pending.popleft()
            out[k] = fut.result()
    for k, fut in pending:
        out[k] = fut.result()
    return out


def item_key(item: WriteItem) -> tuple[str, tuple[int, ...]]:
    """A write item's ``(fqn, chunk offsets)``: how the save side names it across ranks."""
    return item.index.fqn, tuple(item.index.offset or ())


class SaveHashes:
    """The save planner's hashes: each rank's (:meth:`local`), compared between ranks before
    anything is written (:meth:`check`: shared items always, every replica with
    ``check_replicas``), and the record of them (:meth:`record`). ``by_writer``: the save's writer
    hashes every item and makes the record (qdcp's): only the items the checks compare are hashed."""

    def __init__(self, checksums: bool, check_replicas: bool, by_writer: bool = False) -> None:
        self.checksums = checksums
        self.check_replicas = check_replicas
        self.by_writer = by_writer

    def local(self, items: list[WriteItem], shared: list[tuple[str, tuple[int, ...]]],
              data: Callable[[WriteItem], Any]) -> dict:
        """This rank's part: ``{"hashes": {item key: hash}, "shared": [item key, ...]}`` for ``items``,
        whose data ``data(item)`` gives; ``shared``: the item keys other ranks' shards also hold."""
        shared_keys = set(shared)
        every = (self.checksums and not self.by_writer) or self.check_replicas
        hashed = items if every else [i for i in items if item_key(i) in shared_keys]
        return {"hashes": hash_many((item_key(i), data(i)) for i in hashed), "shared": shared}

    def check(self, per_rank: list[dict | None]) -> list[dict]:
        """Refuse items several ranks hold whose copies differ: a component's items that several
        shards hold (replicated, or constant along a dim the shards cut; DCP keeps one rank's
        copy), and with ``check_replicas`` every replicated chunk. Returns the ranks' parts (an
        empty one for a rank that sent none)."""
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
        """The metadata's checksum record: for each item, the hash the rank that writes it computed
        (DCP writes one rank's copy of a replicated item); None without ``checksums`` or where the
        writer makes it."""
        if not self.checksums or self.by_writer:
            return None
        return _record(metadata, ((item.index, per_rank[rank]["hashes"].get(item_key(item)))
                                  for rank, plan in enumerate(global_plan) for item in plan.items))


def written_record(metadata: Metadata, hashes: dict) -> dict:
    """The metadata's checksum record from the hashes a writer computed as it wrote each item
    (``{MetadataIndex: hash}``, the index as DCP's global plan set it)."""
    return _record(metadata, hashes.items())


def _record(metadata: Metadata, hashes: Iterable[tuple[Any, int | None]]) -> dict:
    """The record from ``(MetadataIndex, hash)`` pairs, packed straight into each item's bytes (the
    coordinator of a large job sets one hash per chunk of every rank: no per-chunk objects kept).
    An item with a chunk left unhashed (None: a subclass whose values cannot be read,
    :func:`of_tensor`) is listed as ``unchecked``."""
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
    """``{item key: [first rank, ranks whose hash differs from its]}`` over the items several ranks
    hash (each rank's ``hashes``; with ``shared_only``, only the keys it lists as ``shared``).
    Also the save planner's test for its whole-row fallback (:func:`qdcp.planning.save_entries.fall_back`)."""
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
        """``(chunk sizes or None for a BYTE_IO item, hash)`` of the stored chunk of ``fqn`` at
        ``offsets``, or None when the checkpoint records no checksum for it."""
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
    """The checksum record of ``metadata``, or None for a checkpoint written without checksums;
    the metadata's digest checked where the record carries one (:func:`sealed`). A checkpoint
    marked sealed (:func:`attach`) must carry the record, its digest and every item's hash."""
    data = getattr(metadata, "planner_data", None)
    data = data if isinstance(data, dict) else {}
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
    """``record`` (the checksum record about to join ``metadata``'s ``planner_data``) with the
    digest of what the metadata says of the checkpoint's entries (:func:`metadata_digest`)."""
    return {**record, "metadata": metadata_digest(metadata, record["items"], record.get("unchecked", ()))}


def attach(metadata: Metadata, record: dict) -> None:
    """Put ``record`` into ``metadata``'s ``planner_data``, sealed, with the mark that says the
    checkpoint carries one (:data:`SEALED_KEY`), replacing an earlier save's (DCP's plan caching
    hands the same metadata object to every save)."""
    if metadata.planner_data is None:
        metadata.planner_data = {}
    metadata.planner_data[PLANNER_DATA_KEY] = sealed(record, metadata)
    metadata.planner_data[SEALED_KEY] = ALGORITHM


def metadata_digest(metadata: Metadata, items: Mapping[str, Any], unchecked: Iterable[str] = ()) -> str:
    """XXH3-64 (16 hex digits) of the canonical JSON of the metadata's entries, nesting and spec
    and the record's item hashes (``unchecked`` too where the record has it): docs/format.md,
    *The metadata digest*. Built without GC passes (4x slower at 10k keys with them)."""
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


class ReadVerifier:
    """Checks the items a load planner reads whole (under DCP's reader) against a :class:`Record`.

    DCP's reader copies the part of a stored chunk a read item asks for into ``resolve_tensor``'s
    buffer, then calls ``commit_tensor``. For a whole stored chunk, :meth:`buffer` gives a host
    buffer of the stored dtype where the destination is another dtype or on a device (the hash is
    of the stored bytes), and :meth:`check` hashes what arrived: large items on a background
    thread, all of them compared by the time the plan's last item is committed."""

    def __init__(self, record: Record | None, atomic: bool = False) -> None:
        self.record = record
        self.atomic = atomic  # the load changes no target before every read is in and verified
        self._lock = threading.Lock()
        self.plan([])

    def plan(self, read_items) -> None:
        """Note which of the final plan's read items take a stored chunk (or object) whole: those
        this verifier checks."""
        self._whole: dict[Any, tuple[int, torch.dtype | None]] = {}  # read item -> (hash, stored dtype)
        self._temps: set[int] = set()
        self._filled: set[str] = set()
        self._pending: collections.deque = collections.deque()  # (future, expected, read item, key, bytes)
        self._pending_bytes = 0  # the host bytes the pending hashes hold on to
        self._remaining = len(read_items)
        self.hashed = 0  #: items this verifier hashed itself (this load)
        md = self.record.metadata.state_dict_metadata if self.record is not None else {}
        for item in read_items if self.record is not None else ():
            found = self.record.expected(item.storage_index.fqn, item.storage_index.offset)
            if found is not None and found[0] is None:  # an object
                self._whole[item] = (found[1], None)
            elif found is not None and not any(item.storage_offsets) and tuple(item.lengths) == found[0]:
                self._whole[item] = (found[1], md[item.storage_index.fqn].properties.dtype)

    def buffer(self, read_item, dest: torch.Tensor) -> torch.Tensor:
        """Where DCP should copy ``read_item``'s data: ``dest``, or a host buffer to check first
        (pinned where ``dest`` is on CUDA: torch's caching host allocator reuses it from load to
        load, and the copy on to the device need not block)."""
        found = self._whole.get(read_item)
        if found is None or (dest.device.type == "cpu" and dest.dtype == found[1]):
            return dest
        with self._lock:
            self._temps.add(id(read_item))
        return torch.empty(tuple(read_item.lengths), dtype=found[1], pin_memory=dest.device.type == "cuda")

    def check(self, read_item, tensor: torch.Tensor, key: str, buffered: bool = False) -> bool:
        """Verify ``tensor`` (what arrived for ``read_item``, the target ``key``'s) if it is a whole
        stored chunk; True when it sits in a host buffer from :meth:`buffer` that the caller must
        copy on. ``buffered``: the buffer it arrived in is a temporary, not the target's own."""
        with self._lock:
            temp = id(read_item) in self._temps
        self._verify(read_item, tensor, key, temp, buffered)
        return temp

    def check_bytes(self, read_item, data: Any, key: str) -> None:
        """Verify an object's bytes (put in its target, or deferred, once they pass)."""
        self._verify(read_item, bytes(data), key, True, False)

    def finished(self, key: str) -> None:
        """The target ``key`` was written from the temporaries its reads arrived in."""
        with self._lock:
            self._filled.add(key)

    def _verify(self, read_item, data: Any, key: str, temp: bool, buffered: bool) -> None:
        """Check one item's data; ``temp``: it sits in :meth:`buffer`'s host buffer (the caller
        copies it into the target once this returns); ``buffered``: in a temporary of the load's,
        written into the target later (:meth:`finished`)."""
        found = self._whole.get(read_item)
        if found is not None:
            with self._lock:
                self.hashed += 1
            n = _nbytes(data)
            if n >= _BACKGROUND_BYTES:
                with self._lock:
                    self._pending.append((_hash_pool().submit(of_data, data), found[0], read_item, key, n))
                    self._pending_bytes += n
            else:
                self._compare(read_item, of_data(data), found[0], key=key, written=not (temp or buffered))
        with self._lock:
            if not buffered:
                self._filled.add(key)
            self._remaining -= 1
            last = self._remaining <= 0
        self._collect(wait=last)

    def _collect(self, wait: bool) -> None:
        """Compare the background hashes that are done (all of them with ``wait``; the oldest
        while those pending hold more than :data:`_PENDING_MAX` bytes of the host's memory)."""
        while True:
            with self._lock:
                if not self._pending or not (wait or self._pending_bytes > _PENDING_MAX or self._pending[0][0].done()):
                    return
                fut, expected, read_item, key, n = self._pending.popleft()
                self._pending_bytes -= n
                written = key in self._filled  # its bytes reached the target while they were hashed
            self._compare(read_item, fut.result(), expected, key=key, written=written)

    def _compare(self, read_item, got: int | None, expected: int, *, key: str, written: bool) -> None:
        if got is None or got == expected:  # None: a subclass whose values cannot be read (of_tensor)
            return
        raise corrupt(read_item.storage_index.fqn, read_item.storage_index.offset, expected, got,
                      self.changed(key, written))

    def changed(self, key: str, written: bool) -> str:
        """What this load has changed in the targets so far, said after a corrupt item of target
        ``key`` (``written``: its bytes went into that target's own memory). An all-or-nothing
        load has changed none; an in-place one, every target filled so far (in part, for some)."""
        if self.atomic:
            return "The load is all-or-nothing: no target was changed."
        with self._lock:
            filled = sorted(self._filled | ({key} if written else set()))
        listed = ", ".join(repr(k) for k in filled[:20]) + (f" and {len(filled) - 20} more" if len(filled) > 20 else "")
        return (f"Entries of the target already filled from this checkpoint: {listed or 'none'}"
                f"{' (this one with the corrupt bytes)' if written else ''}. Load them from another checkpoint.")


def corrupt(item_fqn: str, offsets: Any, recorded: int, read: int, changed: str = "") -> ChecksumError:
    """The error for a stored chunk (or object) whose bytes do not match the checksum its save
    recorded, one text for every check (the load planner's, the storage reader's); ``changed``: what
    the load had already changed, said after it."""
    chunk = f"its stored chunk at {tuple(offsets)}: " if offsets else ""
    then = f" {changed}" if changed else ""
    return ChecksumError(
        f"{describe_item(item_fqn)}: the bytes read from the checkpoint do not match the checksum its save "
        f"recorded ({chunk}recorded {recorded:016x}, read {read:016x}): its data file is corrupt.{then}")
