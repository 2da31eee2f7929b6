"""An opt-in, reversible switch: DCP's own ``save`` / ``async_save`` / ``load`` use qdcp's planners
(docs/frameworks.md, "The switch", has the table of what each call gets).

:func:`install` replaces them in ``torch.distributed.checkpoint``, ``state_dict_saver`` and
``state_dict_loader`` with wrappers that, where the planner is None or exactly DCP's default one,
pass qdcp's with its flags carried over; every other argument and planner is passed on unchanged.
DCP's ``_EmptyStateDictLoadPlanner`` becomes qdcp's ``ConsolidatingLoadPlanner``. :func:`uninstall`
puts DCP's functions back; :func:`installed` does both around a block. Process-wide.
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
_originals: dict[tuple[Any, str], Callable] = {}  # (module, name) -> DCP's own function
_options: dict[str, Any] = {}


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    with _lock:
        return bool(_originals)


def install(*, weights_only: bool = True) -> None:
    """Make DCP's ``save`` / ``async_save`` / ``load`` use qdcp's planners where the caller passes
    none or DCP's default ones; idempotent, thread-safe. ``weights_only``: how loads through the
    switch unpickle objects (True: without running code; DCP's default planner runs any pickle)."""
    with _lock:
        _options["weights_only"] = bool(weights_only)
        if _originals:
            return
        wrapped = {"save": _wrap(state_dict_saver.save, _save_arguments, "storage_writer"),
                   "async_save": _wrap(state_dict_saver.async_save, _async_arguments, "storage_writer"),
                   "load": _wrap(state_dict_loader.load, _load_arguments, "storage_reader")}
        targets = [(m, n, wrapped[n]) for m in _MODULES for n in _NAMES if hasattr(m, n)]
        # where callers look the empty planner up: format_utils (its dcp_to_torch_save; accelerate and
        # Lightning import it from there) and state_dict_loader (_load_state_dict_from_keys)
        targets += [(m, _EMPTY, SwitchedEmptyStateDictLoadPlanner) for m in (format_utils, state_dict_loader)
                    if hasattr(m, _EMPTY)]
        for module, name, new in targets:
            _originals[(module, name)] = getattr(module, name)
            setattr(module, name, new)


def uninstall() -> None:
    """Put back exactly the functions :func:`install` replaced. A no-op when not installed."""
    with _lock:
        for (module, name), original in _originals.items():
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
        arguments["planner"] = QuantizedSavePlanner(dequantize=hf, overwrite=True, **_flags(planner, _SAVE_FLAGS))


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
        arguments["planner"] = QuantizedLoadPlanner(weights_only=_options.get("weights_only", True),
                                                    **_flags(planner, _LOAD_FLAGS))


#: the flags of DCP's default planners qdcp's are built with: qdcp's name -> DCP's attribute
_SAVE_FLAGS = {"flatten_state_dict": "flatten_state_dict", "flatten_sharded_tensors": "flatten_sharded_tensors",
               "dedup_save_to_lowest_rank": "dedup_save_to_lowest_rank",
               "enable_plan_caching": "_enable_plan_caching"}  # DCP keeps it private; absent before 2.7
_LOAD_FLAGS = {n: n for n in ("flatten_state_dict", "flatten_sharded_tensors", "allow_partial_load")}


def _flags(planner: Any, names: dict[str, str]) -> dict[str, Any]:
    """The flags a DCP default planner was built with (those it has), to build qdcp's with the same."""
    return {} if planner is None else {ours: getattr(planner, theirs) for ours, theirs in names.items()
                                       if hasattr(planner, theirs)}
