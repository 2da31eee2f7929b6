"""The ``qdcp`` command line's verbs (:mod:`qdcp.cli` parses the arguments, then calls ``cmd_<verb>``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import warnings
from typing import Any, Iterator, Sequence

import torch

from qdcp import checksums, outputs, runs
from qdcp.checkpoint import save
from qdcp.cli import DTYPES, EXIT_FAILED, EXIT_OK, one_line
from qdcp.errors import QdcpError
from qdcp.hf.convert import to_safetensors
from qdcp.hf.export import export
from qdcp.reading import (
    CheckpointEntries,
    check_chunks,
    check_components,
    check_entry,
    check_storage,
    dcp_to_torch_save,
    describe,
)
from qdcp.reading.consolidate import nest

_DTYPE_ARGS = dict(zip(DTYPES, (torch.bfloat16, torch.float16, torch.float32), strict=True))


#: the field an encoded attribute (qdcp.spec's JSON forms) is shown by, by its keys
_SHOWN_BY = {("dtype",): "dtype", ("tuple",): "tuple", ("enum", "value"): "value", ("fields", "object"): "object"}


def _short_attrs(attrs: dict) -> str:
    """``k=v,...`` for the inspect table: encoded values by their name or value, dims joined by x."""
    def fmt(v: Any) -> str:
        if isinstance(v, dict) and tuple(sorted(v)) in _SHOWN_BY:
            v = v[_SHOWN_BY[tuple(sorted(v))]]
        return "x".join(fmt(x) for x in v) if isinstance(v, list) else str(v)
    return ",".join(f"{k}={fmt(v)}" for k, v in attrs.items() if v is not None and k != "dtype")


# ----------------------------------------------------------------------------- the entries of a checkpoint

def _in_order(reading: CheckpointEntries, what: str, quiet: bool) -> Iterator[str]:
    """The checkpoint's keys in order, under a progress bar of the bytes each stores."""
    keys = reading.keys()
    sizes = {key: _nbytes(reading, key) for key in keys}
    with outputs.progress_bar(sum(sizes.values()), what, False if quiet else None) as bar:
        for i, key in enumerate(keys):
            bar.set_postfix_str(f"entry {i + 1}/{len(keys)}", refresh=False)
            yield key
            bar.update(sizes[key])


def _nbytes(reading: CheckpointEntries, key: str) -> int:
    try:
        return reading.nbytes(key)
    except KeyError:  # a spec entry with no item stored (a damaged checkpoint): reading it says so
        return 0


# ----------------------------------------------------------------------------- inspect

def cmd_inspect(args: argparse.Namespace) -> int:
    """``qdcp inspect``: print the table of entries (or ``--json``)."""
    info = describe(args.path)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return EXIT_OK
    rows = [("key", "stored", "type", "config", "shape", "dtype", "bytes", "vs bf16")]
    total = total_bf16 = 0
    for key, e in info.items():
        if e["stored_as"] == "object":
            rows.append((key, "object", "", "", "", "", "", ""))
            continue
        bf16 = math.prod(e["shape"]) * 2
        total += e["bytes"]
        total_bf16 += bf16
        rows.append((key, e["stored_as"], e.get("type", ""), _short_attrs({**e.get("attrs", {}), **e.get("info", {})}),
                     "x".join(map(str, e["shape"])), e["dtype"], str(e["bytes"]),
                     f"{e['bytes'] / bf16:.3f}" if bf16 else ""))
    rows.append(("total", "", "", "", "", "", str(total), f"{total / total_bf16:.3f}" if total_bf16 else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i < 6 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return EXIT_OK


# ----------------------------------------------------------------------------- verify

def cmd_verify(args: argparse.Namespace) -> int:
    """``qdcp verify``: read and rebuild every entry, list every problem; exit 1 if any."""
    reading = CheckpointEntries(args.path)
    md = reading.metadata
    problems = check_chunks(md) + check_storage(md, args.path) + check_components(reading)
    for key in _in_order(reading, "verify", args.quiet):
        try:
            problems += check_entry(reading, key)
        except BaseException as e:  # CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt):
                raise
            problems.append(f"{key}: {_first_failure(e)}")
    for p in problems:
        print(f"FAIL {p}")
    checked = "every item checked against its recorded checksum" if checksums.record(md) is not None \
        else "no checksums recorded (items checked only for their structure)"
    print(f"{'OK' if not problems else 'FAILED'}: {_count(len(reading.keys()), 'entry', 'entries')}, "
          f"{_count(len(problems), 'problem', 'problems')}; {checked}")
    return EXIT_OK if not problems else EXIT_FAILED


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _first_failure(e: BaseException) -> str:
    """``e`` on one line; a DCP ``CheckpointException``: its first rank's error."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))[0]
    return " ".join(f"{type(e).__name__}: {e}".split())  # one line per problem


# ----------------------------------------------------------------------------- convert

def cmd_convert(args: argparse.Namespace) -> int:
    """``qdcp convert``: to a safetensors file, a dequantized DCP checkpoint or one torch.save file
    (outputs checked first)."""
    outputs.check_separate([args.path], args.out)
    if args.to == "torch":
        return _to_torch(args)
    if args.to == "dcp" and not args.dequantize:
        raise ValueError("--to dcp needs --dequantize (a raw copy is the checkpoint itself)")  # printed, exit 2
    dtype = _DTYPE_ARGS[args.dtype] if args.dtype else None
    if args.to == "safetensors":
        return _to_safetensors(args, dtype)
    outputs.check_replaceable(args.out, args.overwrite, directory=True, ours=_DCP_FILES, required=".metadata",
                              what="a DCP checkpoint (.metadata and *.distcp files)")
    return _to_dcp_dequantized(args, dtype)


def _to_torch(args: argparse.Namespace) -> int:
    """``--to torch``: :func:`qdcp.dcp_to_torch_save`, never over an existing file."""
    if args.dtype:  # printed by main, exit 2
        raise ValueError("--to torch takes no --dtype (it writes each entry in its own dtype)")
    if args.overwrite:
        raise ValueError("--to torch takes no --overwrite (it never replaces a file: a torch.save file does not say "
                         "who wrote it)")
    if os.path.lexists(args.out):
        raise outputs.OutputError(f"{args.out!r} exists; --to torch writes a new file only (a torch.save file "
                                  f"does not say who wrote it). Move it away or choose another path")
    dcp_to_torch_save(args.path, args.out, dequantize=args.dequantize)
    print(f"wrote {_count(len(describe(args.path)), 'entry', 'entries')} to {args.out}")
    return EXIT_OK


#: what a DCP checkpoint directory holds (``.metadata.<token>.tmp``: qdcp's writer, stopped before its
#: commit; ``.qdcp-save.claim``: a save's claim on the directory)
_DCP_FILES = re.compile(r"\.metadata|\.metadata(\.[0-9a-f]+)?\.tmp|[^/]*\.distcp|\.qdcp-save\.claim"
                        r"|\.qdcp-save\.[0-9a-f]+\.beat").fullmatch


def _to_safetensors(args: argparse.Namespace, dtype: torch.dtype | None) -> int:
    """``--to safetensors``: :func:`qdcp.hf.convert.to_safetensors`, its result printed."""
    result = to_safetensors(args.path, args.out, dequantize=args.dequantize, dtype=dtype,
                            overwrite=args.overwrite, progress=False if args.quiet else None)
    _say_skipped(result.skipped)
    print(f"wrote {result.out}: {_count(result.tensors, 'tensor', 'tensors')}, {result.nbytes} bytes")
    return EXIT_OK


def _to_dcp_dequantized(args: argparse.Namespace, dtype: torch.dtype | None) -> int:
    """``--to dcp``: every tensor entry plain (in ``dtype`` if given), objects as they are, nested as
    the input was; readable by stock DCP. qdcp's writer replaces a previous output atomically."""
    reading = CheckpointEntries(args.path)
    flat = {key: reading.entry(key, dequantize=True, dtype=dtype) for key in _in_order(reading, "convert", args.quiet)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # errors raised as they are, not in DCP's CheckpointException
        save(nest(flat, reading.metadata), args.out, overwrite=args.overwrite)
    print(f"wrote {args.out}: {_count(len(flat), 'entry', 'entries')}, dequantized")
    return EXIT_OK


# ----------------------------------------------------------------------------- export

def cmd_export(args: argparse.Namespace) -> int:
    """``qdcp export``: a Hugging Face directory through :func:`qdcp.export`."""
    result = export(args.path, args.out, format=args.format, config=args.config,
                    max_shard_size=args.max_shard_size, dequantize_unsupported=args.dequantize_unsupported,
                    overwrite=args.overwrite, progress=False if args.quiet else None, prefix=args.prefix,
                    include_optimizer=args.include_optimizer)
    if result.left_out:
        what = "outside --prefix or optimizer states" if args.prefix else "optimizer states (--include-optimizer)"
        print(f"qdcp: left out {_count(len(result.left_out), 'entry', 'entries')}, {what}: "
              f"{', '.join(result.left_out[:3])}{' ...' if len(result.left_out) > 3 else ''}", file=sys.stderr)
    _say_skipped(result.skipped)
    for key in result.dequantized:
        print(f"qdcp: {key!r} has no {args.format} form: written dequantized", file=sys.stderr)
    print(f"wrote {result.out_dir} ({args.format}): {_count(len(result.files), 'file', 'files')}, "
          f"{_count(result.tensors, 'tensor', 'tensors')}, {result.nbytes} bytes")
    return EXIT_OK


def _say_skipped(keys: Sequence[str]) -> None:
    for key in keys:
        print(f"qdcp: skipped non-tensor entry {key!r} (safetensors holds tensors only)", file=sys.stderr)


# ----------------------------------------------------------------------------- a run's checkpoints

def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _bytes(n: int) -> str:
    """``1.5 GiB``-style sizes."""
    if n < 1024:
        return f"{n} B"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024 ** exp:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][exp]}"


def _run_dir(path: str) -> str:
    if not os.path.isdir(path):
        raise QdcpError(f"no directory at {path!r} (the directory holding a run's checkpoints)")
    return path


def cmd_list(args: argparse.Namespace) -> int:
    found = runs.checkpoints(_run_dir(args.path))
    if args.json:
        print(json.dumps([dataclasses.asdict(c) for c in found], indent=1))
        return EXIT_OK
    latest = runs.latest(args.path)
    print(f"{'step':>8}  {'state':<9} {'size':>10} {'age':>5}  checkpoint")
    for c in found:
        mark = "  <- latest" if c.path == latest else ""
        step = "-" if c.step is None else str(c.step)
        print(f"{step:>8}  {c.state:<9} {_bytes(c.nbytes):>10} {_age(c.age_s):>5}  "
              f"{os.path.basename(c.path)}{mark}")
        if c.why and c.state != "complete":
            print(f"{'':>8}  ({one_line(c.why)[:200]})")
    return EXIT_OK


def cmd_prune(args: argparse.Namespace) -> int:
    root = _run_dir(args.path)
    found = {c.path: c for c in runs.checkpoints(root)}
    doomed = runs.prune(root, keep=args.keep, dry_run=not args.yes)
    verb = "removed" if args.yes else "would remove"
    for path in doomed:
        c = found[path]
        print(f"{verb} {os.path.basename(path)} ({c.state}, {_bytes(c.nbytes)})")
        left = runs.left_behind(path)
        if left:
            print(f"  left in it (not written by qdcp): {', '.join(left[:10])}{' ...' if len(left) > 10 else ''}")
    if not doomed:
        print(f"nothing to remove (keeping the last {args.keep} complete checkpoints)")
    elif not args.yes:
        what = _count(len(doomed), "checkpoint", "checkpoints")
        print(f"dry run: nothing removed; run again with --yes to remove {what}")
    return EXIT_OK


# ----------------------------------------------------------------------------- main
