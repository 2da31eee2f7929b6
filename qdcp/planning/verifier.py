"""The load planner's verifier: the whole stored chunks it reads under DCP's own reader checked against
the checkpoint's checksum record (qdcp's readers verify every item themselves)."""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

from qdcp import checksums as sums

__all__ = ["ReadVerifier"]

#: a load planner's items waiting for their hash hold at most this much host memory
_PENDING_MAX = 512 << 20


class ReadVerifier:
    """Checks the whole stored chunks a load planner reads under DCP's reader: :meth:`buffer` gives a
    host buffer of the stored dtype where the target is another dtype or on a device, :meth:`check`
    hashes what arrived (large items in the background, all compared by the plan's last commit)."""

    def __init__(self, record: sums.Record | None, atomic: bool = False) -> None:
        self.record = record
        self.atomic = atomic  # the load changes no target before every read is in and verified
        self._lock = threading.Lock()
        self.plan([])

    def plan(self, read_items) -> None:
        """Note the final plan's read items that take a stored chunk (or object) whole."""
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
        (pinned for a CUDA ``dest``)."""
        found = self._whole.get(read_item)
        if found is None or (dest.device.type == "cpu" and dest.dtype == found[1]):
            return dest
        with self._lock:
            self._temps.add(id(read_item))
        return torch.empty(tuple(read_item.lengths), dtype=found[1], pin_memory=dest.device.type == "cuda")

    def check(self, read_item, tensor: torch.Tensor, key: str, buffered: bool = False) -> bool:
        """Verify ``tensor`` (``read_item``'s, for target ``key``) if it is a whole chunk; True where it
        sits in :meth:`buffer`'s buffer, for the caller to copy on. ``buffered``: in a temporary."""
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
        """Check one item's data (``temp``: in :meth:`buffer`'s buffer; ``buffered``: in a temporary
        written into the target later, :meth:`finished`)."""
        found = self._whole.get(read_item)
        if found is not None:
            with self._lock:
                self.hashed += 1
            n = sums.nbytes(data)
            if n >= sums.BACKGROUND_BYTES:
                with self._lock:
                    self._pending.append((sums.hash_pool().submit(sums.of_data, data), found[0], read_item, key, n))
                    self._pending_bytes += n
            else:
                self._compare(read_item, sums.of_data(data), found[0], key=key, written=not (temp or buffered))
        with self._lock:
            if not buffered:
                self._filled.add(key)
            self._remaining -= 1
            last = self._remaining <= 0
        self._collect(wait=last)

    def _collect(self, wait: bool) -> None:
        """Compare the finished background hashes (all with ``wait``; the oldest past :data:`_PENDING_MAX`)."""
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
        raise sums.corrupt(read_item.storage_index.fqn, read_item.storage_index.offset, expected, got,
                      self.changed(key, written))

    def changed(self, key: str, written: bool) -> str:
        """What the load has changed so far, after a corrupt item of target ``key`` (``written``: its
        bytes went into the target)."""
        if self.atomic:
            return "The load is all-or-nothing: no target was changed."
        with self._lock:
            filled = sorted(self._filled | ({key} if written else set()))
        listed = ", ".join(repr(k) for k in filled[:20]) + (f" and {len(filled) - 20} more" if len(filled) > 20 else "")
        return (f"Entries of the target already filled from this checkpoint: {listed or 'none'}"
                f"{' (this one with the corrupt bytes)' if written else ''}. Load them from another checkpoint.")
