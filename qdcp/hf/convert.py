"""A qdcp/DCP checkpoint as one safetensors file (``qdcp convert --to safetensors``).

Raw (default): each raw quantized entry's components under ``<key>.__qdcp__.<component>``, as
stored, and their qdcp spec in the header metadata under ``"qdcp"``; plain tensors under their
key. ``dequantize=True``: every tensor entry as its values (floating ones in ``dtype`` where
given). Objects are skipped. The header's ``producer: qdcp`` marks the file as qdcp's: only such a
file is replaced (``overwrite=True``). Entries stream one at a time into scratch beside ``out``,
renamed to ``out`` once complete (:mod:`qdcp.outputs`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import NamedTuple, Sequence

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from qdcp import outputs
from qdcp import spec as qspec
from qdcp.errors import QdcpError
from qdcp.hf.safetensors_files import SAFETENSORS_DTYPES, ShardWriter, TensorOut
from qdcp.reading.entries import CheckpointEntries

_SCRATCH = "convert"  #: the scratch file's kind (:mod:`qdcp.outputs`)


class TensorRow(NamedTuple):
    """One tensor of the file: its name, shape and dtype there, and what it holds."""

    name: str                      #: the tensor's name in the file
    shape: tuple[int, ...]
    dtype: torch.dtype
    key: str                       #: the checkpoint entry it comes from
    component: str | None          #: the raw component it is, as stored; None: the entry's values

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data in the file."""
        return TensorOut(self.name, self.shape, self.dtype).nbytes


@dataclasses.dataclass(frozen=True)
class SafetensorsResult:
    """What :func:`to_safetensors` wrote."""

    out: str
    rows: tuple[TensorRow, ...]    #: the file's tensors, in file order
    skipped: tuple[str, ...]       #: keys of non-tensor entries (safetensors holds tensors only)

    @property
    def tensors(self) -> int:
        """Tensors written."""
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        """Tensor bytes written (the file's data, its header aside)."""
        return sum(r.nbytes for r in self.rows)


class UnwritableDtype(QdcpError):
    """A tensor's dtype has no safetensors name (nothing was written)."""

    def __init__(self, row: TensorRow) -> None:
        super().__init__(f"tensor {row.name!r} (key {row.key!r}): dtype {row.dtype} has no safetensors name; "
                         f"nothing was written. Convert to a DCP checkpoint or a torch.save file instead, which "
                         f"hold it")
        self.row = row


def written_by_qdcp(path: str) -> bool:
    """Whether ``path`` is a safetensors file qdcp wrote (its header says ``producer: qdcp``)."""
    try:
        with safe_open(path, "pt") as f:
            return (f.metadata() or {}).get("producer") == "qdcp"
    except Exception:  # not a safetensors file at all
        return False


def to_safetensors(checkpoint: str | os.PathLike, out: str | os.PathLike, *, dequantize: bool = False,
                   dtype: torch.dtype | None = None, overwrite: bool = False,
                   progress: bool | None = None) -> SafetensorsResult:
    """Write the checkpoint at ``checkpoint`` as the safetensors file ``out`` (see the module's doc).

    ``out`` may not be, hold or lie inside the checkpoint, and is replaced only with ``overwrite``
    and if qdcp wrote it (:class:`qdcp.outputs.OutputError` before anything is read). A dtype
    safetensors has no name for raises :class:`UnwritableDtype` before anything is written.
    ``progress``: a bar on stderr (None: on a terminal only).
    """
    checkpoint, out = os.fspath(checkpoint), os.fspath(out)
    outputs.check_separate([checkpoint], out)
    outputs.clean(out, _SCRATCH)  # what a killed conversion to ``out`` left
    outputs.check_replaceable(out, overwrite, directory=False, ours=written_by_qdcp,
                              what="a safetensors file qdcp wrote")
    entries = CheckpointEntries(checkpoint)
    keys = entries.keys()
    rows, skipped = plan_rows(entries, keys, dequantize, dtype)
    bad = next((row for row in rows if row.dtype not in SAFETENSORS_DTYPES), None)
    if bad is not None:
        raise UnwritableDtype(bad)
    _write(entries, keys, rows, out, _file_metadata(entries, dequantize), progress)
    return SafetensorsResult(out, tuple(rows), tuple(skipped))


def plan_rows(entries: CheckpointEntries, keys: Sequence[str], dequantize: bool,
              dtype: torch.dtype | None) -> tuple[list[TensorRow], list[str]]:
    """The rows of every tensor to write, in file order, and the keys of objects (skipped): a raw
    entry's components as stored (``dequantize``: its values), floating values in ``dtype`` where given."""
    rows, skipped = [], []
    for key in keys:
        entry = entries.specs.get(key)
        raw = entry is not None and entry.storage == qspec.RAW
        if raw and not dequantize:
            rows += [TensorRow(qspec.component_fqn(key, c.name), tuple(c.shape), c.dtype, key, c.name)
                     for c in entry.components]
            continue
        item = entries.metadata.state_dict_metadata.get(key)
        if entry is None and not isinstance(item, TensorStorageMetadata):
            skipped.append(key)
            continue
        base = entry.dtype if raw else (entry.stored_dtype or entry.dtype) if entry is not None else \
            item.properties.dtype
        shape = tuple(entry.shape if entry is not None else item.size)
        rows.append(TensorRow(key, shape, dtype if dtype is not None and base.is_floating_point else base, key, None))
    return rows, skipped


def _file_metadata(entries: CheckpointEntries, dequantize: bool) -> dict[str, str]:
    """The header metadata: the qdcp spec of the raw entries (raw export) under ``"qdcp"``."""
    meta = {"format": "pt", "producer": "qdcp"}
    raw = {k: e for k, e in entries.specs.items() if e.storage == qspec.RAW}
    if raw and not dequantize:
        meta["qdcp"] = qspec.dumps(raw)
    return meta


def _write(entries: CheckpointEntries, keys: Sequence[str], rows: Sequence[TensorRow], out: str,
           metadata: dict[str, str], progress: bool | None) -> None:
    """Stream every entry's rows into ``out`` (one entry in memory), under a progress bar."""
    by_key = {key: list(group) for key, group in itertools.groupby(rows, key=lambda r: r.key)}  # rows in key order
    outs = [TensorOut(r.name, r.shape, r.dtype) for r in rows]
    with outputs.writing_file(_SCRATCH, out, ".safetensors.tmp") as tmp, ShardWriter(tmp, outs, metadata) as writer, \
            outputs.progress_bar(sum(r.nbytes for r in rows), "convert", progress) as bar:
        for i, key in enumerate(keys):
            bar.set_postfix_str(f"entry {i + 1}/{len(keys)}", refresh=False)
            key_rows = by_key.get(key, [])
            if key_rows and key_rows[0].component is not None:  # its components as stored
                stored = entries.stored(key).components
                values = [stored[row.component] for row in key_rows]
            else:  # its values
                values = [entries.entry(key, dequantize=True, dtype=row.dtype) for row in key_rows]
            for row, value in zip(key_rows, values):
                writer.write(row.name, value.to(row.dtype))
            bar.update(sum(r.nbytes for r in key_rows))
