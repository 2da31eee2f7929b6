"""An opt-in, reversible switch: DCP's own ``save`` / ``async_save`` / ``load`` use qdcp's planners.

Frameworks (torchtitan, accelerate / the HF Trainer, Lightning, transformers) call DCP with no
planner, or with DCP's default planners built inside their functions, and offer no option for
another. :func:`install` replaces ``torch.distributed.checkpoint.save`` / ``async_save`` / ``load``
(and the same names in ``state_dict_saver`` / ``state_dict_loader``) with wrappers that, where the
planner is None or exactly DCP's ``DefaultSavePlanner`` / ``DefaultLoadPlanner``, pass qdcp's
planners with the default planner's flags carried over; every other argument, and any other
planner, is passed on unchanged. :func:`uninstall` puts DCP's functions back; :func:`installed`
does both around a block. Process-wide: every caller of those names in the process is affected.

What the wrappers choose:

- save: ``QuantizedSavePlanner`` (raw quantized entries, checksums), with ``overwrite=True`` (the
  caller chose DCP's writer and its overwrite-in-place); entries dequantized where the storage
  writer is DCP's ``HuggingFaceStorageWriter`` (safetensors readers know no qdcp spec);
- async_save without ``async_stager`` and with a writer that is no stager itself: a
  ``QuantizedStager`` (its own buffers per call: copies inner buffers, never ``new_empty``);
- load: ``QuantizedLoadPlanner`` (any target type; objects unpickled with ``weights_only``);
- DCP's ``_EmptyStateDictLoadPlanner`` (which consolidation tools, DCP's ``dcp_to_torch_save``,
  accelerate's ``merge_fsdp_weights`` and Lightning's ``consolidate_checkpoint``, look up at call
  time in ``format_utils``; ``state_dict_loader`` uses it too): ``qdcp.reading.consolidate``'s
  ``ConsolidatingLoadPlanner``, so each quantized entry comes out dequantized under its own key,
  not as its inner buffers under ``<key>.__qdcp__.*`` keys.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import format_utils, state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.staging import AsyncStager

from qdcp.planning.load import QuantizedLoadPlanner
from qdcp.planning.save import QuantizedSavePlanner
from qdcp.reading.consolidate import ConsolidatingLoadPlanner
from qdcp.staging.stager import QuantizedStager

__all__ = ["install", "uninstall", "installed", "is_installed"]

_MODULES = (dcp, state_dict_saver, state_dict_loader)
_NAMES = ("save", "async_save", "load")
_EMPTY = "_EmptyStateDictLoadPlanner"  # DCP's planner for loading a whole checkpoint without a target
_lock = threading.RLock()
_originals: dict[tuple[int, str], Callable] = {}  # (id(module), name) -> DCP's own function
_options: dict[str, Any] = {}


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    with _lock:
        return bool(_originals)


def install(*, weights_only: bool = True) -> None:
    """Make DCP's ``save`` / ``async_save`` / ``load`` use qdcp's planners where the caller passes
    none or DCP's default ones (see the module's docstring). Idempotent; thread-safe.

    ``weights_only``: how loads through the switch unpickle non-tensor objects (True: without
    running code, as ``QuantizedLoadPlanner``; DCP's default planner runs any pickle).
    """
    with _lock:
        _options["weights_only"] = bool(weights_only)
        if _originals:
            return
        own = {"save": state_dict_saver.save, "async_save": state_dict_saver.async_save,
               "load": state_dict_loader.load}
        wrapped = {"save": _wrap(own["save"], _save_arguments, "storage_writer"),
                   "async_save": _wrap(own["async_save"], _async_arguments, "storage_writer"),
                   "load": _wrap(own["load"], _load_arguments, "storage_reader")}
        for module in _MODULES:
            for name in _NAMES:
                if hasattr(module, name):
                    _originals[(id(module), name)] = getattr(module, name)
                    setattr(module, name, wrapped[name])
        for module in _empty_planner_modules():
            _originals[(id(module), _EMPTY)] = getattr(module, _EMPTY)
            setattr(module, _EMPTY, SwitchedEmptyStateDictLoadPlanner)


def uninstall() -> None:
    """Put back exactly the functions :func:`install` replaced. A no-op when not installed."""
    with _lock:
        for module, name in [(m, n) for m in _MODULES for n in _NAMES] + \
                [(m, _EMPTY) for m in _empty_planner_modules()]:
            original = _originals.pop((id(module), name), None)
            if original is not None:
                setattr(module, name, original)
        _originals.clear()


@contextlib.contextmanager
def installed(*, weights_only: bool = True) -> Iterator[None]:
    """:func:`install` for the duration of a ``with`` block: left installed if it already was, with
    the ``weights_only`` it had then put back (the block's own is process-wide while it runs)."""
    with _lock:
        already, before = is_installed(), _options.get("weights_only")
        install(weights_only=weights_only)
    try:
        yield
    finally:
        with _lock:
            if not already:
                uninstall()
            elif before is not None:
                _options["weights_only"] = before


def _empty_planner_modules() -> tuple:
    """The modules whose ``_EmptyStateDictLoadPlanner`` callers look up: ``format_utils`` (its
    ``dcp_to_torch_save``; accelerate and Lightning import it from there) and ``state_dict_loader``
    (its ``_load_state_dict_from_keys``). Where a torch lacks the name, the module is skipped."""
    return tuple(m for m in (format_utils, state_dict_loader) if hasattr(m, _EMPTY))


class SwitchedEmptyStateDictLoadPlanner(ConsolidatingLoadPlanner):
    """What ``qdcp.install()`` puts in place of DCP's ``_EmptyStateDictLoadPlanner``: qdcp's
    ``ConsolidatingLoadPlanner``, unpickling objects as :func:`install` was told."""

    __qdcp_switch__ = True

    def __init__(self, keys: Any = None, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("weights_only", _options.get("weights_only", True))
        super().__init__(keys, *args, **kwargs)


def _wrap(original: Callable, adjust: Callable[[dict[str, Any]], None], storage: str) -> Callable:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        # DCP's functions take (state_dict, *, ...), and still (state_dict, storage) positionally
        # (with a warning, its own): the storage is looked at in either place, args passed on as given
        seen = dict(kwargs)
        if len(args) == 2:
            seen[storage] = args[1]
        adjust(seen)
        for name in ("planner", "async_stager"):
            if name in seen:
                kwargs[name] = seen[name]
        return original(*args, **kwargs)

    call.__qdcp_switch__ = True
    return call


def _save_arguments(arguments: dict[str, Any]) -> None:
    planner = arguments.get("planner")
    if planner is None or type(planner) is DefaultSavePlanner:
        hf = isinstance(arguments.get("storage_writer"), dcp.HuggingFaceStorageWriter)
        arguments["planner"] = QuantizedSavePlanner(dequantize=hf, overwrite=True, **_save_flags(planner))


def _async_arguments(arguments: dict[str, Any]) -> None:
    _save_arguments(arguments)
    writer = arguments.get("storage_writer")
    if arguments.get("async_stager") is None and (not isinstance(writer, AsyncStager) or _torch_stages(writer)):
        arguments["async_stager"] = QuantizedStager(pin_memory=False, reuse_buffers=False)


def _torch_stages(writer: Any) -> bool:
    """Whether a writer DCP would use as its stager stages with torch's own code (a deep copy
    through ``new_empty``/``zeros_like``, which quantized tensors lack), not qdcp's."""
    owner = next(k for k in type(writer).__mro__ if "stage" in vars(k))
    return owner.__module__.startswith("torch.")


def _load_arguments(arguments: dict[str, Any]) -> None:
    planner = arguments.get("planner")
    if planner is None or type(planner) is DefaultLoadPlanner:
        flags = {} if planner is None else {
            "flatten_state_dict": planner.flatten_state_dict,
            "flatten_sharded_tensors": planner.flatten_sharded_tensors,
            "allow_partial_load": planner.allow_partial_load}
        arguments["planner"] = QuantizedLoadPlanner(weights_only=_options.get("weights_only", True), **flags)


def _save_flags(planner: DefaultSavePlanner | None) -> dict[str, Any]:
    """The flags a ``DefaultSavePlanner`` was built with, to build qdcp's with the same."""
    if planner is None:
        return {}
    flags = {"flatten_state_dict": planner.flatten_state_dict,
             "flatten_sharded_tensors": planner.flatten_sharded_tensors,
             "dedup_save_to_lowest_rank": planner.dedup_save_to_lowest_rank}
    caching = getattr(planner, "_enable_plan_caching", None)  # DCP keeps it private; absent before 2.7
    if caching is not None:
        flags["enable_plan_caching"] = caching
    return flags
