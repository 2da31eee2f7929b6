"""An async-checkpoint stager that copies what really holds a quantized tensor's data.

DCP's own stagers copy a tensor through ``new_empty``/``zeros_like`` and fail (or copy nothing) on
wrapper subclasses; :class:`QuantizedStager` copies each tensor's inner buffers, as its adapter
reports them, into CPU buffers it reuses across checkpoints, and rebuilds the same type over them::

    stager = QuantizedStager()
    stager.prepare(state)   # optional, before training: the first save then blocks as the later ones
    fut = dcp.async_save(state, checkpoint_id=path, planner=QuantizedSavePlanner(), async_stager=stager)
    fut.result()            # before the next async_save
    stager.close()          # after the last one
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from qdcp.adapters.base import find_adapter
from qdcp.errors import StagingError, UnsupportedTensorError
from qdcp.staging.chunked import names_own_chunks, staged_copy

__all__ = ["QuantizedStager"]

_Path = tuple  # keys from the state dict's root to a value, e.g. ("model", "layers.0.weight")


class _StagedDict(dict):
    """The staged state dict, a plain dict that can be weakly referenced: while it is alive an upload
    may still read the stager's buffers; nothing in DCP keeps it (``save`` works on a shallow copy)."""

    __slots__ = ("__weakref__",)

    def __reduce__(self):  # pickles (PROCESS checkpointer) as a plain dict
        return dict, (dict(self),)


def _path_str(path: _Path) -> str:
    return ".".join(str(p) for p in path)


class QuantizedStager:
    """Stages a state dict holding quantized tensors for ``dcp.async_save`` (docs/api.md).

    Quantized tensors (bare, or a DTensor's local tensor) are staged as their inner buffers, so
    staging memory is exactly the components' bytes; plain tensors as they are, other objects
    deep-copied. Buffers are kept by entry path and component, reallocated only when a shape,
    stride or dtype changes.

    Args:
        pin_memory: pin the buffers (default: where an accelerator is; ignored where none is).
        reuse_buffers: keep buffers for the next ``stage()`` (False: new ones every time).
        non_blocking: copy from an accelerator on a side stream, waited for once at the end.
        async_staging: ``stage()`` returns a Future and copies in a background thread; call
            :meth:`synchronize_staging` before the next in-place update of the model.
        share_memory: buffers in shared memory (for ``AsyncCheckpointerType.PROCESS``).
        busy_timeout: seconds ``stage()`` waits for the previous staged dict to be released (its
            upload finished) before raising :class:`~qdcp.StagingError`: reused buffers are
            never overwritten while an upload may still read them.
    """

    _synchronize_after_execute = True  # DCP's AsyncStager protocol: synchronize_staging() after the upload starts

    def __init__(self, pin_memory: bool | None = None, reuse_buffers: bool = True,
                 non_blocking: bool = True, async_staging: bool = False,
                 share_memory: bool = False, busy_timeout: float = 60.0) -> None:
        accel = torch.accelerator.is_available()
        self.pin_memory = accel if pin_memory is None else (bool(pin_memory) and accel)
        self.reuse_buffers = reuse_buffers
        self.non_blocking = non_blocking and accel
        self.async_staging = async_staging
        self.share_memory = share_memory
        self.busy_timeout = busy_timeout
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._last_staged: weakref.ref | None = None
        self._staging_future: Future | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="qdcp-stager") if async_staging else None
        # Created on the caller's thread, as DCP's DefaultStager does, so it is never the compute stream.
        self._stream = torch.Stream() if accel else None
        self._closed = False
        self._preparing = False  # prepare(): _copy allocates, copies nothing

    @property
    def should_synchronize_after_execute(self) -> bool:
        """Whether ``dcp.async_save`` calls :meth:`synchronize_staging` once the upload has started."""
        return self._synchronize_after_execute

    @property
    def staged_nbytes(self) -> int:
        """Bytes held in staging buffers (the components' and plain tensors' bytes, no more)."""
        return sum(b.untyped_storage().nbytes() for b in self._buffers.values())

    @property
    def in_use(self) -> bool:
        """Whether the state dict of the last :meth:`stage` is still alive (an upload may read its
        buffers): a stage() now would wait for it."""
        ref = self._last_staged
        return self._staging_future is not None or (ref is not None and ref() is not None)

    # ------------------------------------------------------------------------- protocol

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | Future:
        """A copy of ``state_dict`` that later in-place updates of the model do not change (with
        ``async_staging``, a Future of it); :class:`~qdcp.StagingError` if the previous staged dict
        is still in use past ``busy_timeout``."""
        if self._closed:
            raise StagingError("this QuantizedStager is closed; create a new one")
        with contextlib.suppress(Exception):  # the last stage's copies landed; its failure is that save's own
            self.synchronize_staging()       # (raised by its future and its upload), not the next save's
        if self.reuse_buffers:
            self._wait_until_released()
        ready = None
        if self._stream is not None:
            ready = torch.Event()
            ready.record(torch.accelerator.current_stream())
        if self._executor is None:
            return self._stage(state_dict, ready)
        future = self._executor.submit(self._stage, state_dict, ready)
        self._staging_future = future
        return future

    def synchronize_staging(self) -> None:
        """Wait until every copy of the last :meth:`stage` call has landed (re-raises its error)."""
        future, self._staging_future = self._staging_future, None  # never keep the staged dict alive
        if future is not None:
            future.result()

    def close(self) -> None:
        """Wait for staging, stop the background thread and drop this stager's buffers (uploads in
        flight keep the buffers they read alive on their own)."""
        if self._closed:
            return
        try:
            self.synchronize_staging()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._buffers.clear()
            self._last_staged = None
            self._closed = True

    def prepare(self, state_dict: dict[str, Any]) -> int:
        """Allocate (pinned, where an accelerator is) and touch the buffers that :meth:`stage` of
        ``state_dict`` will copy into, copying nothing, so that the first checkpoint of a run blocks
        no longer than the later ones (allocating pinned memory is what makes a cold save slow).
        Buffers of entries not in ``state_dict`` are dropped; those already allocated are kept
        untouched (an upload may still read them). Returns :attr:`staged_nbytes`."""
        if self._closed:
            raise StagingError("this QuantizedStager is closed; create a new one")
        if not self.reuse_buffers:
            raise StagingError("prepare() allocates buffers for later stage() calls to reuse: this stager was "
                               "made with reuse_buffers=False, which allocates new ones every time")
        self.synchronize_staging()
        seen: set[tuple] = set()
        self._preparing = True
        try:
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                self._walk(state_dict, (), seen, {})
        finally:
            self._preparing = False
        self._buffers = {k: b for k, b in self._buffers.items() if k in seen}  # entries gone: dropped
        return self.staged_nbytes

    # ------------------------------------------------------------------------- staging

    def _wait_until_released(self) -> None:
        ref = self._last_staged
        if ref is None or ref() is None:
            return
        deadline = time.monotonic() + self.busy_timeout
        delay, collected = 1e-4, False
        while ref() is not None:
            if delay >= 0.05 and not collected:  # a reference cycle may be all that holds it
                gc.collect()
                collected = True
                continue
            if time.monotonic() >= deadline:
                raise StagingError(
                    "stage() was called while the state dict staged by the previous call is still in "
                    "use (its upload may be in flight): the buffers it reads would be overwritten. "
                    "Wait for the previous dcp.async_save (fut.result()) before saving again, drop "
                    "references to the previous staged dict (or a failed save's future), or use "
                    "QuantizedStager(reuse_buffers=False).")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    @torch.no_grad()
    def _stage(self, state_dict: dict[str, Any], ready: torch.Event | None) -> dict[str, Any]:
        seen: set[tuple] = set()
        memo: dict[int, Any] = {}
        # staging reads metadata and copies buffers: no subclass __torch_function__ on the way
        with torch._C.DisableTorchFunctionSubclass():
            if self._stream is not None:
                self._stream.wait_event(ready)
                with self._stream:
                    staged = self._walk(state_dict, (), seen, memo)
                self._stream.synchronize()
            else:
                staged = self._walk(state_dict, (), seen, memo)
        if self.reuse_buffers:
            self._buffers = {k: b for k, b in self._buffers.items() if k in seen}  # entries gone: dropped
        out = _StagedDict(staged)
        self._last_staged = weakref.ref(out)
        return out

    def _walk(self, value: Any, path: _Path, seen: set, memo: dict[int, Any]) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in memo:  # tied tensors stay tied, as with deepcopy
                memo[id(value)] = (value, self._stage_tensor(value, path, seen))
            return memo[id(value)][1]
        if isinstance(value, dict):
            items = {k: self._walk(v, path + (k,), seen, memo) for k, v in value.items()}
            if type(value) is dict:
                return items
            try:
                return type(value)(items)
            except TypeError:
                return items
        if isinstance(value, list):
            return [self._walk(v, path + (i,), seen, memo) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            items = [self._walk(v, path + (i,), seen, memo) for i, v in enumerate(value)]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        try:
            return copy.deepcopy(value)  # DCP's stager copies objects so too
        except Exception as e:
            raise UnsupportedTensorError(
                f"key {_path_str(path)!r}: QuantizedStager copies a non-tensor value with copy.deepcopy, which "
                f"failed for this {type(value).__name__} ({type(e).__name__}: {e}); an object holding a "
                f"quantized tensor (one whose clone its library lacks) cannot be copied so. Put its tensors "
                f"in the state dict itself, or save it synchronously (qdcp.save)") from e

    def _stage_tensor(self, t: torch.Tensor, path: _Path, seen: set) -> torch.Tensor:
        if isinstance(t, DTensor):
            # DTensor.from_local would call view_as, which quantized subclasses lack: keep the spec
            # (mesh, placements, global shape) and swap in the staged local tensor.
            local = self._stage_tensor(t._local_tensor, path, seen)
            return DTensor(local, t._spec, requires_grad=False)
        adapter = find_adapter(t)
        if adapter is not None:
            buffers = {name: self._copy(b, path, name, seen)
                       for name, b in adapter.inner_buffers(t).items()}
            return adapter.from_inner_buffers(t, buffers)
        if names_own_chunks(t):  # DCP's _Checkpointable protocol: copies of the chunks it writes
            return staged_copy(t, _path_str(path), lambda chunk, n: self._copy(chunk.detach(), path, f"chunk{n}", seen))
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            raise UnsupportedTensorError(
                f"key {_path_str(path)!r}: QuantizedStager cannot stage "
                f"{type(t).__module__}.{type(t).__qualname__}: no qdcp adapter handles it. Register "
                f"one with qdcp.register_adapter, or convert it to a plain tensor.")
        return self._copy(t.detach(), path, None, seen)

    def _copy(self, src: torch.Tensor, path: _Path, name: str | None, seen: set) -> torch.Tensor:
        key = (path, name)
        seen.add(key)
        buf = self._buffers.get(key) if self.reuse_buffers else None
        stride = _cpu_stride(src)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or buf.stride() != stride:
            buf = self._allocate(src, stride)
            if self.reuse_buffers:
                self._buffers[key] = buf
            if self._preparing:
                _touch(buf)  # its pages now, not in the first stage()
        if not self._preparing:
            buf.copy_(src, non_blocking=self.non_blocking and src.device.type != "cpu")
        return buf

    def _allocate(self, src: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
        if self.share_memory:
            buf = torch.empty_strided(src.shape, stride, dtype=src.dtype).share_memory_()
            if self.pin_memory and buf.untyped_storage().nbytes() > 0:
                _pin_in_place(buf)
            return buf
        return torch.empty_strided(src.shape, stride, dtype=src.dtype,
                                   pin_memory=self.pin_memory and src.numel() > 0)


def _touch(buf: torch.Tensor) -> None:
    """Fault in every page of a new buffer (pinned memory is resident already; pageable memory
    is mapped at its first write, which would otherwise be the first stage's copy)."""
    if buf.untyped_storage().nbytes() and not buf.is_pinned():
        torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage()).zero_()


def _cpu_stride(src: torch.Tensor) -> tuple[int, ...]:
    """Strides of a dense CPU copy of ``src``: its own where dense, else contiguous."""
    if src.is_contiguous():
        return src.stride()
    return torch.empty_like(src, device="meta").stride()


def _pin_in_place(buf: torch.Tensor) -> None:
    """Page-lock shared memory in place (``pin_memory()`` would copy it out of shared memory)."""
    import torch.cuda._pin_memory_utils as pin_utils  # what DCP's StateDictStager uses

    storage = buf.untyped_storage()
    pin_utils.pin_memory(storage.data_ptr(), storage.nbytes())
    weakref.finalize(storage, pin_utils.unpin_memory, storage.data_ptr())
