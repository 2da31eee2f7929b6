"""The adapter contract (:class:`Adapter` and the optional protocols) and the public registry of
adapters. Planners and the stager talk to tensors only through this contract; users add families
with :func:`register_adapter`.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import threading
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import torch

from qdcp import spec as qspec
from qdcp.errors import CheckpointFormatError, LoadMismatchError, QdcpError, UnsupportedTensorError
from qdcp.layouts import Chunk, Layout


@dataclasses.dataclass(frozen=True)
class StoredEntry:
    """What a checkpoint holds for a raw entry (or a chunk of one), decoded: no live tensor."""

    type_name: str                           #: registry name, one of the adapter's ``type_names``
    attrs: Mapping[str, Any]                 #: decoded attributes (``qdcp.spec.decode_value``)
    shape: tuple[int, ...]                   #: logical shape of the chunk the components cover
    dtype: torch.dtype                       #: logical dtype
    components: Mapping[str, torch.Tensor]   #: canonical components of that chunk


class Adapter(abc.ABC):
    """One family of quantized tensors. Subclass and register an instance with :func:`register_adapter`.

    Who calls what (no qdcp module calls anything else of an adapter, except the optional
    contracts, which a caller first tests with ``isinstance``):

    - registry: :attr:`type_names`, :meth:`matches`;
    - save planner: :meth:`type_name`, :meth:`attributes`, :meth:`info`, :meth:`components`,
      :meth:`layouts`, :meth:`dequantize` (large entries by rows: :mod:`qdcp.adapters.rows`), :meth:`unwrap`;
    - load planner: the same, plus :meth:`attribute_classes`, :meth:`native_components`,
      :meth:`copy_into`, :meth:`dequantize_stored`, :meth:`quantize_like`, :meth:`needs_global_amax`,
      :meth:`quantize_unsupported`;
    - stager and :func:`qdcp.to_device`: :meth:`inner_buffers`, :meth:`from_inner_buffers`;
    - ``qdcp.export``, ``qdcp.read_entry`` and the CLI: :meth:`rebuild`, :meth:`dequantize_stored`,
      :meth:`attribute_classes`.

    Optional contracts (``runtime_checkable`` protocols, subclassed beside this class):
    :class:`RawInterchangeAdapter`, :class:`GroupAdapter`, :class:`OpRegisteringAdapter`,
    :class:`PicklingAdapter`. The abstract methods are required; the defaults of the rest assume
    components are plain attributes stored as is. :class:`TraceableAdapter` and
    :class:`StoredOnlyAdapter` are ready-made bases (docs/adapters.md, *Writing one*;
    ``examples/custom_adapter.py``).
    """

    #: registry names of the types this adapter handles, e.g. ``("torchao.Int8Tensor",)``
    type_names: tuple[str, ...] = ()

    @abc.abstractmethod
    def matches(self, cls: type) -> bool:
        """Whether live instances of ``cls`` belong to this adapter."""

    def type_name(self, t: torch.Tensor) -> str:
        """Registry name of ``t``'s type (one of :attr:`type_names`; default the first)."""
        return self.type_names[0]

    @abc.abstractmethod
    def attributes(self, t: torch.Tensor) -> dict[str, Any]:
        """Configuration of ``t`` as Python values that :func:`qdcp.spec.encode_value` accepts."""

    def info(self, t: torch.Tensor) -> dict[str, Any]:
        """Descriptive facts about ``t`` for ``qdcp inspect`` (JSON), e.g. its recipe or native scale
        layout. Not part of its configuration: loads never compare them. Default: none."""
        return {}

    def attribute_classes(self) -> Mapping[str, type]:
        """Enums and records (by class name) that may appear in :meth:`attributes`."""
        return {}

    @abc.abstractmethod
    def component_names(self, t: torch.Tensor) -> list[str]:
        """Names of the components present on ``t``, in a fixed order."""

    def components(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """Components of ``t`` in canonical (stored) form. Must not copy when canonical == native."""
        return {n: getattr(t, n) for n in self.component_names(t)}

    def native_components(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """Components whose canonical form *is* the inner buffer: load may write straight into them."""
        return self.components(t)

    def inner_buffers(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every tensor that holds ``t``'s data, in native form (what a stager must copy)."""
        return self.native_components(t)

    @abc.abstractmethod
    def from_inner_buffers(self, t: torch.Tensor, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """A new instance like ``t`` whose data lives in ``buffers`` (same keys as :meth:`inner_buffers`)."""

    def unwrap(self, t: torch.Tensor) -> torch.Tensor | None:
        """For a wrapper whose values are one high-precision tensor of its shape and dtype (torchao's
        training weights): that tensor, which planners store and load in place. Default None."""
        return None

    @abc.abstractmethod
    def layouts(self, t: torch.Tensor) -> dict[str, Layout]:
        """How each component shards with the logical tensor (shard-invariant)."""

    #: True where the library groups each shard's own elements (torchao's optimizer states): a shard
    #: that is no row range of a ``Flat`` component stores it as the ``Blocked`` grid its groups form
    #: (:func:`qdcp.layouts.for_shard`), which :meth:`dequantize_stored` must take. False: refused.
    groups_per_shard: bool = False

    #: Attributes that only cut the elements into scale blocks (torchao's ``block_size``): a target
    #: otherwise like the source may take its bits with other blocks where they hold them exactly
    #: (:func:`qdcp.layouts.held_exactly`; docs/api.md). Empty: only an equal configuration loads raw.
    block_attributes: tuple[str, ...] = ()

    @abc.abstractmethod
    def dequantize(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision tensor ``t`` stands for, computed the way its library does, as
        ``dtype`` (default: ``t``'s logical dtype). A wider ``dtype`` is computed in that precision
        where the library can, never rounded through the logical dtype first."""

    @abc.abstractmethod
    def rebuild(self, stored: StoredEntry) -> torch.Tensor:
        """A live instance of the library's class holding ``stored`` (any chunk's worth); raises
        :class:`~qdcp.UnsupportedTensorError`, naming the library, where it cannot be imported."""

    def dequantize_stored(self, stored: StoredEntry, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A stored entry's values as :meth:`dequantize` gives them (default: of :meth:`rebuild`;
        TE's adapters compute them in plain torch)."""
        return self.dequantize(self.rebuild(stored), dtype)

    @abc.abstractmethod
    def quantize_like(self, target: torch.Tensor, hp: torch.Tensor,
                      global_amax: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize ``hp`` the way ``target`` is configured; returns a new instance.

        For a target that :meth:`needs_global_amax`, ``hp`` is the whole logical tensor (the load
        then takes the target shard's part of the result, by :meth:`layouts`) and ``global_amax``
        its abs-max; for a shard of one member of a group, ``hp`` is the shard and ``global_amax``
        the whole member's abs-max, which a per-tensor scale must use.
        """

    def quantize_unsupported(self, target: torch.Tensor) -> str | None:
        """Why :meth:`quantize_like` cannot fill ``target`` on this machine (e.g. it needs a GPU
        kernel), or None (default) when it can. Asked at load planning, before anything is read."""
        return None

    def needs_global_amax(self, target: torch.Tensor) -> bool:
        """Whether ``target`` holds values once for the whole tensor (a per-tensor scale, NF4's scaler
        mean): a shard of it is then quantized from the whole tensor and cut, as torchao slices."""
        return False

    def copy_into(self, target: torch.Tensor, components: Mapping[str, torch.Tensor]) -> None:
        """Copy canonical ``components`` (all or some) into ``target``'s buffers, in place."""
        native = self.native_components(target)
        refuse_unknown(self.type_name(target), components, native)
        for name, value in components.items():
            native[name].copy_(value)


def refuse_unknown(target_name: str, components: Mapping[str, Any], known) -> None:
    """Refuse, naming them, ``components`` that are not among the ``known`` ones of the target."""
    unknown = set(components) - set(known)
    if unknown:
        raise LoadMismatchError(f"the target {target_name} has no component(s) {sorted(unknown)} to load into")


class TraceableAdapter(Adapter):
    """An adapter of a traceable tensor subclass: inner buffers are what ``__tensor_flatten__`` names,
    rebuilt over new ones by ``__tensor_unflatten__``."""

    def inner_buffers(self, t):
        return {n: getattr(t, n) for n in t.__tensor_flatten__()[0]}

    def from_inner_buffers(self, t, buffers):
        names, ctx = t.__tensor_flatten__()
        if set(buffers) != set(names):
            raise LoadMismatchError(f"{self.type_name(t)}: expected buffers {sorted(names)}, got {sorted(buffers)}")
        return type(t).__tensor_unflatten__(dict(buffers), ctx, t.shape, t.stride())


class StoredOnlyAdapter(Adapter):
    """An adapter of a stored format with no live tensor class (compressed-tensors' parameter sets):
    it never matches a live tensor, and the live-tensor methods refuse, naming the family."""

    def matches(self, cls: type) -> bool:
        return False

    def _no_live(self, *args: Any, **kwargs: Any):
        raise UnsupportedTensorError(f"{', '.join(self.type_names)}: a stored format with no live tensor class "
                                     f"(nothing of it to save or quantize into); load it into another target")

    type_name = attributes = component_names = from_inner_buffers = layouts = _no_live
    dequantize = quantize_like = _no_live


# ----------------------------------------------------------------------------- optional contracts

@runtime_checkable
class RawInterchangeAdapter(Protocol):
    """An adapter that fills a target of another type with a stored entry's bits, within its family or
    through a library-neutral *form* (:mod:`qdcp.adapters.formats`); :func:`raw_conversion` picks
    the path. The defaults offer nothing."""

    def raw_load_sources(self, target: torch.Tensor, source_type: str,
                         source_attrs: dict[str, Any]) -> list[str] | None:
        """For a raw entry and ``target`` of two types of this family: the source components from
        which :meth:`raw_load` fills ``target`` exactly, or None. Asked of the target's adapter first."""
        return None

    def raw_load(self, target: torch.Tensor, source_type: str, source_attrs: dict[str, Any],
                 components: Mapping[str, torch.Tensor]) -> None:
        """Fill ``target`` in place from the canonical ``components`` named by :meth:`raw_load_sources`
        (for the chunk ``target`` holds)."""
        raise NotImplementedError

    def raw_forms_out(self, type_name: str, attrs: Mapping[str, Any]) -> Mapping[str, list[str]]:
        """Forms a stored entry of ``type_name`` / ``attrs`` states exactly, each with the components it needs."""
        return {}

    def to_raw_form(self, type_name: str, attrs: Mapping[str, Any], form: str,
                    components: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors of ``form`` from the components :meth:`raw_forms_out` named (for one chunk)."""
        raise NotImplementedError

    def raw_forms_in(self, target: torch.Tensor) -> tuple[str, ...]:
        """Forms from which :meth:`from_raw_form` fills ``target`` exactly, best first. Default: none."""
        return ()

    def from_raw_form(self, target: torch.Tensor, form: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Fill ``target`` in place from the tensors of ``form`` (for the chunk ``target`` holds)."""
        raise NotImplementedError

    def new_from_raw_form(self, form: str, tensors: Mapping[str, torch.Tensor], *, shape: tuple[int, ...],
                          dtype: torch.dtype) -> torch.Tensor | None:
        """A new instance of this family (default configuration) holding the tensors of ``form``
        exactly, or None for forms it does not build."""
        return None


@runtime_checkable
class GroupAdapter(Protocol):
    """An adapter of group types: one tensor that packs several members (MoE experts), checkpointed by
    member. The load planner maps a missing key :meth:`member_key` to a stored group's
    :meth:`member_chunk`, and a group target whose members are stored under their own keys into its
    :meth:`members`, then calls :meth:`members_loaded`. Subclass it beside :class:`Adapter`."""

    def member_key(self, key: str, index: int) -> str:
        """The state-dict key of member ``index`` of the group under ``key``: where a group stored by
        member keeps it, and the target key that stands for it. Default ``f"{key}{index}"`` (TE
        GroupedLinear's ``weight0..weight{n-1}``); plain ``[n, ...]`` stacks use the default too."""
        return f"{key}{index}"

    def members(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """For a group: its members, as tensors that share ``t``'s buffers (loading into them fills
        ``t`` in place), in order; None (default) for types of the family that are not groups."""
        return None

    def member_chunk(self, attrs: Mapping[str, Any], shape: tuple[int, ...], index: int) -> Chunk | None:
        """For a stored group (decoded ``attrs``, logical ``shape``): the logical chunk that is member
        ``index`` (leading dim 1), or None (default) when members are not chunks of the group."""
        return None

    def members_loaded(self, t: torch.Tensor) -> None:
        """Called once every member of ``t`` was loaded from its own key: bring group-only buffers in line."""


@runtime_checkable
class OpRegisteringAdapter(Protocol):
    """An adapter that fills aten ops its library lacks (the same-size ``new_empty`` DCP's default
    stager needs: qdcp.staging.new_empty) through the library's own op registry."""

    def loaded_classes(self) -> list[type]:
        """The tensor classes of this family whose modules are already imported (imports nothing)."""
        return []

    def add_op(self, cls: type, op: Any, impl: Callable[..., Any]) -> Callable[[], None] | None:
        """Make ``impl(func, args, kwargs)`` the implementation of aten ``op`` for ``cls`` through its
        library's own op registry, only where the library has none. Returns a callable that removes
        it again, or None (default) where ``cls`` implements ``op`` already or has no registry."""
        return None


@runtime_checkable
class PicklingAdapter(Protocol):
    """An adapter whose tensors stock DCP pickles whole (saved without qdcp's planner): it makes
    them loadable with ``torch.load(weights_only=True)`` when a checkpoint holds one."""

    def allow_pickled(self, qualified_name: str) -> bool:
        """Whether ``qualified_name`` (``module.Class``, as a pickle names a class) is one of this
        family's tensor classes; if so, import it from the library's own modules (which allows the
        library's classes in weights-only loads). Never imports a module the name gives."""


def allow_pickled(qualified_names: list[str]) -> list[str]:
    """Let the registered adapters allow the pickled classes ``qualified_names`` in weights-only
    loads (:class:`PicklingAdapter`); the names none of them takes."""
    adapters = [a for a in all_adapters() if isinstance(a, PicklingAdapter)]
    return [n for n in qualified_names if not any(a.allow_pickled(n) for a in adapters)]


# ----------------------------------------------------------------------------- raw conversion

@dataclasses.dataclass(frozen=True)
class RawConversion:
    """How a raw entry of another type fills a target with the same bits: read ``names`` (canonical
    components of the stored entry), then ``fill(target, components)`` (in place, for the chunk the
    target holds). Within one family the owner's ``raw_load`` fills; with a form, the source's
    adapter states the bits in that neutral form and the target's takes them
    (:mod:`qdcp.adapters.formats`)."""

    names: tuple[str, ...]
    fill: Callable[[torch.Tensor, Mapping[str, torch.Tensor]], None]
    form: str | None = None  #: the neutral form the bits pass through, None within a family


def raw_conversion(target_adapter: Adapter, target: torch.Tensor, source_adapter: Adapter, *, source_type: str,
                   source_attrs: Mapping[str, Any]) -> RawConversion | None:
    """The exact raw path from a stored entry of ``source_type`` into ``target``, or None: first a
    conversion either adapter makes within its family, then a form both declare."""
    for owner in (target_adapter, source_adapter):
        names = owner.raw_load_sources(target, source_type, dict(source_attrs)) \
            if isinstance(owner, RawInterchangeAdapter) else None
        if names is not None:
            return RawConversion(tuple(names), lambda t, comps, owner=owner:
                                 owner.raw_load(t, source_type, dict(source_attrs), comps))
    if not (isinstance(source_adapter, RawInterchangeAdapter) and isinstance(target_adapter, RawInterchangeAdapter)):
        return None
    offered = source_adapter.raw_forms_out(source_type, source_attrs)
    form = next((f for f in target_adapter.raw_forms_in(target) if f in offered), None)
    if form is None:
        return None
    return RawConversion(tuple(offered[form]), lambda t, comps: target_adapter.from_raw_form(
        t, form, source_adapter.to_raw_form(source_type, source_attrs, form, comps)), form)


# ----------------------------------------------------------------------------- registry

_lock = threading.Lock()
_adapters: list[Adapter] = []
_by_type_name: dict[str, Adapter] = {}
_by_class: dict[type, Adapter | None] = {}
BUILTIN_FAMILIES = ("torchao", "torchao_training", "transformer_engine", "te_grouped", "compressed_tensors")
_builtins_lock = threading.RLock()
_builtins = {"loading": False, "done": False}


def _load_builtins() -> None:
    """Register the built-in families' adapters (``qdcp.adapters.<family>.builtin_adapters()``), once,
    before the first registration or lookup: a user's adapters come after them and are tried first.
    (None of the families imports its library: the registry costs no import of torchao or TE.)"""
    if _builtins["done"]:
        return
    with _builtins_lock:
        if _builtins["done"] or _builtins["loading"]:  # (loading: re-entered by register_adapter below)
            return
        _builtins["loading"] = True
        try:
            for family in BUILTIN_FAMILIES:
                for adapter in importlib.import_module(f"qdcp.adapters.{family}").builtin_adapters():
                    register_adapter(adapter)
        finally:
            _builtins["done"] = True


def register_adapter(adapter: Adapter, *, override: bool = False) -> Adapter:
    """Register ``adapter`` for its :attr:`~Adapter.type_names`; later registrations are tried first.

    Raises ``ValueError`` if a type name is taken, unless ``override=True``.
    """
    if not isinstance(adapter, Adapter):
        raise TypeError(f"expected a qdcp.Adapter instance, got {type(adapter).__name__}")
    if not adapter.type_names:
        raise ValueError(f"{type(adapter).__name__} declares no type_names")
    _load_builtins()
    with _lock:
        for name in adapter.type_names:
            if name in _by_type_name and _by_type_name[name] is not adapter and not override:
                raise ValueError(f"type name {name!r} is already registered to "
                                 f"{type(_by_type_name[name]).__name__}; pass override=True")
        _by_type_name.update(dict.fromkeys(adapter.type_names, adapter))
        _adapters.insert(0, adapter)
        _by_class.clear()
    return adapter


def all_adapters() -> list[Adapter]:
    """Every registered adapter, most recently registered first."""
    _load_builtins()
    with _lock:
        return list(_adapters)


def registered_type_names() -> list[str]:
    """All registered type names, sorted."""
    _load_builtins()
    with _lock:
        return sorted(_by_type_name)


def find_adapter(t: torch.Tensor | type) -> Adapter | None:
    """The adapter for a live tensor (or class), or None for plain tensors and unknown types."""
    cls = t if isinstance(t, type) else type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return None
    try:
        return _by_class[cls]
    except KeyError:
        pass
    _load_builtins()
    with _lock:
        found = next((a for a in _adapters if a.matches(cls)), None)
        _by_class[cls] = found
    return found


def find_type_adapter(type_name: str) -> Adapter | None:
    """The adapter registered for a type name read from a checkpoint, or None."""
    _load_builtins()
    with _lock:
        return _by_type_name.get(type_name)


def adapter_for_type(type_name: str, fqn: str = "") -> Adapter:
    """The adapter registered for a type name read from a checkpoint (a clear error if none is)."""
    adapter = find_type_adapter(type_name)
    if adapter is None:
        raise CheckpointFormatError(
            f"key {fqn!r}: the checkpoint stores type {type_name!r}, which no registered qdcp adapter "
            f"handles (known: {', '.join(registered_type_names()) or 'none'}). Install the library "
            f"that provides it or register an adapter with qdcp.register_adapter.")
    return adapter


def describe_tensor(t: torch.Tensor, adapter: Adapter, fqn: str) -> tuple[dict, dict[str, Layout]]:
    """The JSON attributes (as :mod:`qdcp.spec` encodes them) and the layouts of a live instance,
    with a clear error naming ``fqn`` for an attribute that cannot be stored."""
    try:
        attrs = {k: qspec.encode_value(v) for k, v in adapter.attributes(t).items()}
    except TypeError as e:
        raise UnsupportedTensorError(
            f"key {fqn!r}: {adapter.type_name(t)} has an attribute qdcp cannot store ({e}); "
            f"save this entry dequantized (QuantizedSavePlanner(dequantize=...)).") from None
    return attrs, adapter.layouts(t)


def stored_on_meta(entry: qspec.EntrySpec) -> StoredEntry:
    """A raw entry as :func:`read_stored` returns it (attributes decoded with its adapter's classes:
    no tensor library needed), but with components on the meta device: read nothing."""
    classes = adapter_for_type(entry.type, entry.fqn).attribute_classes()
    attrs = {k: qspec.decode_value(v, classes, f"key {entry.fqn!r}: ") for k, v in entry.attrs.items()}
    comps = {c.name: torch.empty(c.shape, dtype=c.dtype, device="meta") for c in entry.components}
    return StoredEntry(entry.type, attrs, entry.shape, entry.dtype, comps)


def check_rebuildable(entry: qspec.EntrySpec, key: str) -> None:
    """Refuse a raw entry its library would not rebuild, found by rebuilding and dequantizing it on
    the meta device (:func:`stored_on_meta`: nothing allocated or read): the library's own checks
    of the attributes against the components, for every reader alike (a load that keeps the
    components as stored, ``verify``, ``convert``)."""
    try:
        adapter_for_type(entry.type, key).dequantize_stored(stored_on_meta(entry))
    except UnsupportedTensorError:
        return  # an entry its adapter cannot rebuild alone: said where it is read
    except QdcpError:
        raise
    except Exception as e:  # noqa: BLE001 (the library's own refusal of these attributes)
        raise rebuild_error(key, entry.type, e) from e


def rebuild_error(key: str, type_name: str, e: BaseException) -> CheckpointFormatError:
    """The refusal of an entry the library will not rebuild (``e``: the library's error)."""
    return CheckpointFormatError(
        f"key {key!r}: the stored entry cannot be rebuilt as a {type_name} ({type(e).__name__}: "
        f"{' '.join(str(e).split())[:300]}); its spec's attributes are damaged, or ones this qdcp and the "
        f"library do not agree on")
