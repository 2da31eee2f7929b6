"""What an export layout is: how each checkpoint entry becomes named safetensors tensors, file
metadata, and the ``quantization_config`` of ``config.json``.

A layout plans every entry from the checkpoint's metadata alone (so an entry it cannot represent
is refused before any file is written), then produces each entry's tensors from its stored
components, one entry at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch

from qdcp.adapters.base import StoredEntry
from qdcp.errors import QdcpError
from qdcp.hf.safetensors_files import RowBlocks, TensorOut
from qdcp.spec import EntrySpec


#: ``read(names)``: components of one stored entry, whole, by name
ComponentReader = Callable[[Sequence[str]], Mapping[str, torch.Tensor]]


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


class HFLayout:
    """One Hugging Face checkpoint layout (``"torchao"``, ``"compressed-tensors"``)."""

    name: str = ""

    def plan(self, src: Source, read: ComponentReader) -> EntryPlan:
        """The plan of a raw quantized entry; raises :class:`UnsupportedEntry` if it has no form here.
        ``read(names)`` reads components of the entry where the plan depends on their values."""
        raise NotImplementedError

    def plan_plain(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, *,
                   dequantized: bool = False) -> EntryPlan:
        """The plan of a plain tensor entry (or a quantized one written dequantized)."""
        return EntryPlan(key, (TensorOut(key, shape, dtype),), dequantized=dequantized)

    def produce(self, plan: EntryPlan, stored: StoredEntry) -> dict[str, torch.Tensor | RowBlocks]:
        """The tensors of a planned raw entry, by name, from its stored components (a tensor made
        from a large one may come as :class:`RowBlocks`, made as it is written)."""
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
