"""What a Hugging Face layout is, both ways: how each checkpoint entry becomes named safetensors
tensors, file metadata and ``config.json``'s ``quantization_config`` (export, planned from the
metadata alone so a refusal comes before any file is written), and how a directory in the layout
presents its quantized entries again (:class:`QuantizedHFReader`).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping, Sequence

import torch

from qdcp import spec as qspec
from qdcp.adapters.base import StoredEntry
from qdcp.errors import QdcpError
from qdcp.hf.directory import HFDirectory
from qdcp.hf.safetensors_files import RowBlocks, TensorOut
from qdcp.spec import EntrySpec

#: ``read(names)``: components of one stored entry, whole, by name
ComponentReader = Callable[[Sequence[str]], Mapping[str, torch.Tensor]]
#: ``get(name)``: one file tensor of a directory, whole
Getter = Callable[[str], torch.Tensor]


class UnsupportedEntry(QdcpError):
    """The layout has no representation for an entry (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One tensor entry of a qdcp checkpoint, as its metadata describes it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype                #: logical dtype (a plain entry: its stored dtype)
    spec: EntrySpec | None = None     #: the raw quantized entry's spec; None for plain tensors


@dataclasses.dataclass(frozen=True)
class EntryPlan:
    """How one entry is written: its tensors (in file order) and what the layout records of it."""

    key: str
    tensors: tuple[TensorOut, ...]
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)  #: the file's __metadata__ items
    scheme: Any = None          #: the layout's description of its quantization (None: plain)
    dequantized: bool = False   #: written as its plain (dequantized) values

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclasses.dataclass(frozen=True)
class Item:
    """Where one presented component comes from: a file tensor read by byte range, or
    ``build(get, out)`` from whole file tensors (into ``out`` where it can; returns what it filled)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor: str | None = None   #: the file tensor holding it as presented
    build: Callable[[Getter, torch.Tensor | None], torch.Tensor] | None = None


@dataclasses.dataclass(frozen=True)
class Presented:
    """One quantized entry of a directory as presented: its raw spec, its components' items, and
    the file tensors it consumes (not presented on their own)."""

    spec: EntrySpec
    items: Mapping[str, Item]
    consumed: frozenset[str]


def presented(key: str, type_name: str, shape, dtype: torch.dtype, attrs: Mapping,
              components: Mapping[str, tuple[Item, Any]], consumed) -> Presented:
    """A :class:`Presented` entry from ``{component: (item, layout)}`` (layouts of
    :mod:`qdcp.layouts`, in the spec's component order)."""
    specs = tuple(qspec.ComponentSpec(n, item.shape, item.dtype, layout.to_json())
                  for n, (item, layout) in components.items())
    spec = qspec.EntrySpec(key, qspec.RAW, type_name, tuple(shape), dtype, dict(attrs), specs)
    return Presented(spec, {n: item for n, (item, _) in components.items()}, frozenset(consumed))


class HFLayout:
    """One Hugging Face layout: writes a directory (:meth:`plan`, :meth:`produce`,
    :meth:`file_metadata`, :meth:`quantization_config`) and presents one (:meth:`reads`, :meth:`entries`)."""

    name: str = ""

    @classmethod
    def reads(cls, config: Mapping) -> bool:
        """Whether a directory whose ``config.json`` holds ``config`` is in this layout."""
        raise NotImplementedError

    def entries(self, directory: HFDirectory) -> list[Presented]:
        """The quantized entries of ``directory`` (other file tensors are presented plain); what it
        cannot read as it says raises :class:`CheckpointFormatError` naming the key."""
        raise NotImplementedError

    def plan(self, src: Source, read: ComponentReader) -> EntryPlan:
        """The plan of a raw quantized entry; raises :class:`UnsupportedEntry` if it has no form here.
        ``read(names)`` reads components of the entry where the plan depends on their values."""
        raise NotImplementedError

    def plan_plain(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, *,
                   dequantized: bool = False) -> EntryPlan:
        """The plan of a plain tensor entry (or a quantized one written dequantized)."""
        return EntryPlan(key, (TensorOut(key, shape, dtype),), dequantized=dequantized)

    def produce(self, plan: EntryPlan, stored: StoredEntry) -> dict[str, torch.Tensor | RowBlocks]:
        """The tensors of a planned raw entry, by name, from its stored components (or :class:`RowBlocks`)."""
        raise NotImplementedError

    def file_metadata(self, plans: Sequence[EntryPlan], directory: Sequence[EntryPlan]) -> dict[str, str]:
        """The ``__metadata__`` of a file holding ``plans``, in a directory holding ``directory``
        (every entry, in order)."""
        out = {"format": "pt"}
        for p in plans:
            out.update(p.metadata)
        return out

    def quantization_config(self, plans: Sequence[EntryPlan]) -> dict | None:
        """The ``quantization_config`` of ``config.json`` for a checkpoint of ``plans``."""
        raise NotImplementedError


#: the layouts, by name; reading tries them in this order (the first that :meth:`HFLayout.reads` a
#: directory's config presents it; torchao's reads any directory, plain ones included)
_LAYOUTS = {"compressed-tensors": ("qdcp.hf.ct_layout", "CompressedTensorsLayout"),
            "torchao": ("qdcp.hf.torchao_layout", "TorchAOLayout")}


def layout_named(name: str) -> HFLayout:
    """The layout ``name``: ``"torchao"`` or ``"compressed-tensors"``."""
    if name not in _LAYOUTS:
        raise ValueError(f"unknown export format {name!r}; choose one of {sorted(_LAYOUTS)}")
    module, cls = _LAYOUTS[name]
    return getattr(importlib.import_module(module), cls)()


def layout_of(config: Mapping) -> HFLayout:
    """The layout a directory whose ``config.json`` holds ``config`` is read in."""
    for name in _LAYOUTS:
        layout = layout_named(name)
        if layout.reads(config):
            return layout
    raise AssertionError("the torchao layout reads every directory")
