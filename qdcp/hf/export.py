"""``qdcp.export``: a qdcp/DCP checkpoint (any world size) to a Hugging Face safetensors directory
in a layout inference engines load (:mod:`qdcp.hf.torchao_layout`, :mod:`qdcp.hf.ct_layout`).

Every entry is planned from the metadata first (an entry the layout cannot represent stops the
export before anything is written), then streamed one at a time into scratch beside ``out_dir``,
renamed into place at the end (:mod:`qdcp.outputs`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import Any, Callable, Mapping

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from qdcp import outputs
from qdcp import spec as qspec
from qdcp.errors import QdcpError
from qdcp.hf import safetensors_files as stf
from qdcp.hf.layout import ComponentReader, EntryPlan, HFLayout, Source, UnsupportedEntry, layout_named
from qdcp.reading.entries import CheckpointEntries


class ExportError(QdcpError):
    """The checkpoint cannot be exported as asked (nothing was written)."""


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What :func:`export` wrote."""

    out_dir: str
    files: tuple[str, ...]            #: safetensors files, in order
    tensors: int                      #: tensors written
    nbytes: int                       #: tensor bytes written
    dequantized: tuple[str, ...]      #: quantized keys written as plain values
    skipped: tuple[str, ...]          #: non-tensor entries (safetensors holds tensors only)
    left_out: tuple[str, ...] = ()    #: optimizer states and entries outside ``prefix`` (checkpoint keys)


def export(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, format: str,
           config: str | os.PathLike | Mapping[str, Any] | None = None, max_shard_size: int | str = "5GB",
           dequantize_unsupported: bool = False, overwrite: bool = False,
           progress: bool | None = None, prefix: str | None = None,
           include_optimizer: bool = False) -> ExportResult:
    """Write the checkpoint at ``checkpoint`` as a Hugging Face directory ``out_dir`` in ``format``.

    ``config``: a ``config.json`` (path or dict) the format's ``quantization_config`` is added to.
    Files above ``max_shard_size`` (bytes, ``"5GB"``, ``"500MiB"``) are split, with an index. An
    entry the format cannot represent raises :class:`ExportError` before anything is written,
    unless ``dequantize_unsupported`` (written dequantized). ``progress``: a bar on stderr (None: on
    a terminal only). ``prefix``: the subtree under it only, its keys written without it.
    Optimizer states (under a top-level key of :data:`OPTIMIZER_KEYS`) are left out unless
    ``include_optimizer``; :attr:`ExportResult.left_out` lists what was.
    """
    layout, max_bytes = layout_named(format), stf.parse_size(max_shard_size)
    # a config given for the source model may say it is quantized: only this layout's own says so
    config_json = {k: v for k, v in _base_config(config).items() if k != "quantization_config"}
    checkpoint, out_dir = os.fspath(checkpoint), os.fspath(out_dir)
    _check_output(checkpoint, out_dir, overwrite)
    entries = CheckpointEntries(checkpoint, reuse_memory=True)  # one entry in memory at a time
    sources, skipped = _sources(entries)
    sources, names, left_out = _selected(sources, prefix, include_optimizer)
    skipped = [k for k in skipped if _under(k, prefix)]
    plans = _plan_all(layout, sources, dequantize_unsupported,
                      lambda key: functools.partial(entries.components, names[key]))
    quantization_config = layout.quantization_config(plans)
    if quantization_config is not None:  # None: nothing written quantized
        config_json["quantization_config"] = quantization_config
    shards = stf.plan_shards([p.nbytes for p in plans], max_bytes)
    files = stf.shard_file_names(len(shards))
    with outputs.writing_dir(_SCRATCH, out_dir) as tmp:
        weight_map = _write_files(layout, [[plans[i] for i in s] for s in shards], files,
                                  functools.partial(_tensors, layout, entries, sources, names), tmp, progress)
        if len(files) > 1:
            stf.write_index(tmp, weight_map, sum(p.nbytes for p in plans))
        with open(os.path.join(tmp, stf.CONFIG_FILE), "w") as f:
            json.dump(config_json, f, indent=2)
            f.write("\n")
    return ExportResult(out_dir, tuple(files), sum(len(p.tensors) for p in plans), sum(p.nbytes for p in plans),
                        tuple(p.key for p in plans if p.dequantized), tuple(skipped), tuple(left_out))


_SCRATCH = "export"  #: the scratch directory's kind (:mod:`qdcp.outputs`)

#: what export writes in its directory (all that ``overwrite`` may replace)
_OURS = re.compile("|".join([re.escape(stf.SINGLE_FILE), r"model-\d{5,}-of-\d{5,}\.safetensors",
                              re.escape(stf.INDEX_FILE), re.escape(stf.CONFIG_FILE)])).fullmatch


def _check_output(checkpoint: str, out_dir: str, overwrite: bool) -> None:
    """Refuse, before reading anything, an ``out_dir`` that overlaps the checkpoint, is a file, or
    holds files without ``overwrite`` or that export does not write; what a killed export left is cleaned first."""
    try:
        outputs.check_separate([checkpoint], out_dir)
        outputs.clean(out_dir, _SCRATCH)
        outputs.check_replaceable(out_dir, overwrite, directory=True, ours=_OURS,
                                  what="an export (model*.safetensors, its index, config.json)")
    except outputs.OutputError as e:
        raise _OutputRefused(str(e)) from None


class _OutputRefused(ExportError, outputs.OutputError):
    """``out_dir`` cannot be written (an :class:`ExportError` and a :class:`qdcp.outputs.OutputError`)."""


def _sources(entries: CheckpointEntries) -> tuple[dict[str, Source], list[str]]:
    """Every tensor entry (raw quantized ones with their spec), and the keys of objects, each sorted."""
    sources: dict[str, Source] = {}
    skipped: list[str] = []
    for key in entries.keys():
        entry, item = entries.specs.get(key), entries.metadata.state_dict_metadata.get(key)
        if entry is not None and entry.storage == qspec.RAW:
            sources[key] = Source(key, tuple(entry.shape), entry.dtype, entry)
        elif isinstance(item, TensorStorageMetadata):
            sources[key] = Source(key, tuple(item.size), item.properties.dtype)
        elif item is not None:
            skipped.append(key)
    return sources, skipped


#: top-level keys a training checkpoint keeps its optimizer's state under
OPTIMIZER_KEYS = ("optim", "optimizer", "optimizers", "optim_state", "optimizer_state")


def _under(key: str, prefix: str | None) -> bool:
    return prefix is None or key.startswith(prefix.rstrip(".") + ".")


def _selected(sources: Mapping[str, Source], prefix: str | None,
              include_optimizer: bool) -> tuple[dict[str, Source], dict[str, str], list[str]]:
    """``(sources by the name they are written under, {that name: checkpoint key}, keys left out)``:
    those under ``prefix`` (written without it), optimizer states left out unless asked for."""
    kept: dict[str, Source] = {}
    names: dict[str, str] = {}
    left_out = []
    for key, src in sources.items():
        optimizer = key.split(".", 1)[0] in OPTIMIZER_KEYS
        if not _under(key, prefix) or (optimizer and not include_optimizer and prefix is None):
            left_out.append(key)
            continue
        name = key if prefix is None else key[len(prefix.rstrip(".")) + 1:]
        kept[name] = dataclasses.replace(src, key=name)
        names[name] = key
    if not kept and left_out:
        tops = sorted({k.split(".", 1)[0] for k in sources})
        raise ExportError(f"nothing to export under prefix {prefix!r} (nothing was written): the checkpoint's "
                          f"tensors lie under {tops}" if prefix is not None else
                          "the checkpoint holds no tensor but optimizer states (nothing was written): pass "
                          "include_optimizer=True (--include-optimizer) to export them")
    return kept, names, left_out


def _plan_all(layout: HFLayout, sources: Mapping[str, Source], dequantize_unsupported: bool,
              reader: Callable[[str], ComponentReader]) -> list[EntryPlan]:
    plans, refused = [], []
    for key, src in sources.items():
        if src.spec is None:
            plans.append(layout.plan_plain(key, src.shape, src.dtype))
            continue
        try:
            plans.append(layout.plan(src, reader(key)))
        except UnsupportedEntry as e:
            if not dequantize_unsupported:
                refused.append(f"key {key!r} ({src.spec.type}): {e}")
                continue
            plans.append(layout.plan_plain(key, src.shape, src.dtype, dequantized=True))
    _refuse(layout, refused, "Pass --dequantize-unsupported (dequantize_unsupported=True) to write these "
                             "entries as their dequantized values.")
    _check_names(layout, plans)
    return plans


def _refuse(layout: HFLayout, problems: list[str], fix: str) -> None:
    if problems:
        raise ExportError(f"cannot export to the {layout.name} format (nothing was written):\n  "
                          + "\n  ".join(problems) + "\n" + fix)


def _check_names(layout: HFLayout, plans: list[EntryPlan]) -> None:
    """Refuse two entries whose tensors the format names alike (a plain key spelling a quantized
    entry's inner tensor, ``m._weight_qdata`` beside ``m.weight``): one file would list a name twice."""
    owner: dict[str, str] = {}
    clashes = []
    for plan in plans:
        for t in plan.tensors:
            other = owner.setdefault(t.name, plan.key)
            if other != plan.key:
                clashes.append(f"keys {other!r} and {plan.key!r} both give a tensor named {t.name!r}")
    _refuse(layout, clashes[:10], "Rename one of each pair in the checkpoint (the format names a quantized "
                                  "entry's inner tensors after its key), or export the other format.")


def _base_config(config) -> Mapping[str, Any]:
    """The ``config`` given: a mapping, or the JSON object in the file it names (errors name it)."""
    if config is None or isinstance(config, Mapping):
        return config or {}
    try:
        with open(config) as f:
            loaded = json.load(f)
    except OSError as e:
        raise ExportError(f"config {os.fspath(config)!r} (--config): {e.strerror or e}") from None
    except ValueError as e:  # UnicodeDecodeError too
        raise ExportError(f"config {os.fspath(config)!r} (--config): not a JSON file ({e})") from None
    if not isinstance(loaded, dict):
        raise ExportError(f"config {os.fspath(config)!r} (--config): holds a JSON {type(loaded).__name__}, not "
                          f"an object")
    return loaded


def _tensors(layout: HFLayout, entries: CheckpointEntries, sources: Mapping[str, Source], keys: Mapping[str, str],
             plan: EntryPlan) -> dict[str, torch.Tensor]:
    """The planned tensors of one entry, read and converted; ``keys``: the checkpoint key of each name written."""
    key = keys[plan.key]
    if sources[plan.key].spec is None or plan.dequantized:
        return {plan.key: entries.entry(key, dequantize=True, dtype=plan.tensors[0].dtype)}
    return layout.produce(plan, entries.stored(key))


def _write_files(layout: HFLayout, shards: list[list[EntryPlan]], files: list[str],
                 tensors: Callable[[EntryPlan], dict], out: str, progress: bool | None) -> dict[str, str]:
    """Write each shard's file in ``out`` (one entry in memory); which file holds each tensor."""
    weight_map: dict[str, str] = {}
    with outputs.progress_bar(sum(p.nbytes for s in shards for p in s), "export", progress) as bar:
        for file_plans, name in zip(shards, files):
            with stf.ShardWriter(os.path.join(out, name), [t for p in file_plans for t in p.tensors],
                                 layout.file_metadata(file_plans, [p for s in shards for p in s])) as writer:
                for plan in file_plans:
                    values = tensors(plan)
                    for t in plan.tensors:
                        writer.write(t.name, values[t.name])
                        weight_map[t.name] = name
                    del values
                    bar.update(plan.nbytes)
    return weight_map
