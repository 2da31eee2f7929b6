"""All-or-nothing loads: every target is loaded into a shadow, copied in once every read is in.

``QuantizedLoadPlanner(atomic=True)`` hands DCP and its load actions a shadow of each target (a
plain tensor, the same quantized type over fresh inner buffers, a DTensor over a shadow of its
local tensor) and keeps the objects it reads aside. Only once this rank's last read has arrived
and been verified are the shadows copied (``copy_``) into the targets' buffers and the objects put
in place, so a failed load leaves every target as it was. A plain target that DCP fills whole from
narrower stored items gets a shadow of the stored dtype (:meth:`Shadows.in_stored_dtype`); the
copy-in converts. Where the reads do not write all of a shadow, :meth:`Shadows.fill_unread`
copies the target's values in first. Cost: one extra copy of the loaded state for the load's
duration, and one more copy of its bytes (docs/benchmarks.md, *All-or-nothing load*).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from qdcp.adapters.base import find_adapter
from qdcp.errors import LoadMismatchError
from qdcp.planning.placement import place, with_local
from qdcp.staging.chunked import ChunkCopies, names_own_chunks, shadow_of

__all__ = ["Shadows"]


class Shadows:
    """The shadows of one load's targets, and the objects read for them, until :meth:`apply`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.clear()

    def of_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of a flat state dict with every tensor replaced by its shadow."""
        return {fqn: self.of(fqn, value) for fqn, value in state_dict.items()}

    def of(self, fqn: str, value: Any) -> Any:
        """The shadow of target ``value`` (made once per target); non-tensors as they are."""
        made = self._made.get(id(value))
        if made is not None:
            return made
        placed = place(value)
        if placed is None:
            return value
        real, shadow_local = _shadow_local(fqn, placed.local)
        shadow = with_local(value, shadow_local)
        copies = _buffers(shadow_local)
        if type(shadow_local) is torch.Tensor and list(real) == [""]:
            self._plain[id(shadow)] = len(self._pairs)
        self._pairs.extend((buffer, copies[name]) for name, buffer in real.items())
        self._made[id(value)] = shadow
        self._keep.append(value)
        return shadow

    def fill_unread(self, written: dict[int, int]) -> None:
        """Copy each target into its shadow unless the planned reads write all of it: ``written``
        maps a storage's ``data_ptr`` to the bytes the reads write into it (they never overlap).
        Called once every read is planned, before any is read."""
        with torch.no_grad():
            for target, shadow in self._pairs:
                storage = shadow.untyped_storage()
                if written.get(storage.data_ptr()) != storage.nbytes() or not storage.nbytes():
                    shadow.copy_(target)

    def in_stored_dtype(self, shadow: Any, dtype: torch.dtype, written: dict[int, int]) -> torch.Tensor | None:
        """The local buffer of plain ``shadow`` (or a DTensor's) remade in the stored item's narrower
        ``dtype``, for a shadow the planned reads write whole (``written`` as for :meth:`fill_unread`):
        :meth:`apply`'s copy converts, as ``copy_`` into the target would have (a bf16 checkpoint
        into fp32 targets holds half the memory). None where it is not such a shadow."""
        index = self._plain.get(id(shadow))
        if index is None:
            return None
        target, local = self._pairs[index]
        storage = local.untyped_storage()
        if dtype.itemsize >= local.dtype.itemsize or not storage.nbytes() \
                or written.get(storage.data_ptr()) != storage.nbytes():
            return None
        local = torch.empty_like(local, dtype=dtype)
        self._pairs[index] = (target, local)
        return local

    def defer(self, put: Callable[[], None]) -> None:
        """Run ``put`` (an object read for the state dict) at :meth:`apply` instead of now."""
        with self._lock:
            self._deferred.append(put)

    def apply(self) -> None:
        """Copy every shadow into its target and put the objects read in place."""
        with torch.no_grad():
            for target, shadow in self._pairs:
                target.copy_(shadow)
        for put in self._deferred:
            put()
        self.clear()

    def clear(self) -> None:
        """Drop the shadows (after :meth:`apply`, or when the load is abandoned)."""
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a target's buffer, its shadow's)
        self._made: dict[int, Any] = {}   # id(target value) -> its shadow value
        self._keep: list[Any] = []        # the targets, so their ids stay theirs until apply
        self._deferred: list[Callable[[], None]] = []
        self._plain: dict[int, int] = {}  # id(shadow value) -> its pair, for a plain tensor's (or DTensor's) shadow


def _shadow_local(fqn: str, local: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(the target's buffers by name, a shadow over new buffers like them)`` for one local tensor
    (filled by :meth:`Shadows.fill_unread`)."""
    adapter = find_adapter(local)
    if adapter is None and names_own_chunks(local):  # DCP's _Checkpointable protocol: its chunks
        return shadow_of(local, fqn)
    if adapter is None:
        if type(local) not in (torch.Tensor, torch.nn.Parameter):
            raise LoadMismatchError(
                f"key {fqn!r}: an atomic load cannot stage a {type(local).__name__} target (a tensor "
                f"subclass qdcp has no adapter for). Load with QuantizedLoadPlanner(atomic=False), or "
                f"register an adapter for it (qdcp.register_adapter).")
        return {"": local}, torch.empty_like(local.detach())
    real = adapter.inner_buffers(local)
    try:
        shadow = adapter.from_inner_buffers(local, {n: torch.empty_like(b.detach()) for n, b in real.items()})
    except NotImplementedError:
        raise LoadMismatchError(
            f"key {fqn!r}: an atomic load cannot stage a {type(local).__name__} target (its adapter "
            f"cannot build one over new buffers). Load with QuantizedLoadPlanner(atomic=False).") from None
    return real, shadow


def _buffers(shadow: torch.Tensor) -> dict[str, torch.Tensor]:
    """The shadow's buffers by name (a plain tensor's under "")."""
    if isinstance(shadow, ChunkCopies):
        return {str(n): t for n, (_, t) in enumerate(shadow.chunks)}  # as shadow_of names them
    adapter = find_adapter(shadow)
    return {"": shadow} if adapter is None else adapter.inner_buffers(shadow)
