"""The ``qdcp`` command line: inspect, verify and convert checkpoints.

    qdcp inspect PATH [--json]
    qdcp verify PATH
    qdcp convert PATH OUT --to safetensors [--dequantize] [--dtype bf16]
    qdcp convert PATH OUT --to dcp --dequantize [--dtype bf16]

Exit status: 0 success, 1 a check failed, 2 bad usage / missing or unreadable checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import warnings
from typing import Any, Sequence

import torch

from qdcp import spec as qspec
from qdcp.errors import QdcpError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

_DTYPE_ARGS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# safetensors dtype names (https://github.com/huggingface/safetensors, "Format")
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
}


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def _progress(i: int, n: int, key: str) -> None:
    if sys.stderr.isatty() and n > 1:
        width = 30
        done = int(width * (i + 1) / n)
        sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i + 1}/{n} {key[:40]:<40}")
        if i + 1 == n:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _short_attrs(attrs: dict) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, dict):
            if set(v) == {"dtype"}:
                return v["dtype"]
            if set(v) == {"tuple"}:
                return "x".join(fmt(x) for x in v["tuple"])
            if set(v) == {"enum", "value"}:
                return str(v["value"])
            if set(v) == {"object", "fields"}:
                return v["object"]
        if isinstance(v, list):
            return "x".join(fmt(x) for x in v)
        return str(v)
    return ",".join(f"{k}={fmt(v)}" for k, v in attrs.items() if v is not None and k != "dtype")


# ----------------------------------------------------------------------------- inspect

def cmd_inspect(args: argparse.Namespace) -> int:
    from qdcp.reader import describe

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
    from qdcp.adapters.base import find_adapter
    from qdcp.planner import read_specs
    from qdcp.reader import check_chunks, check_storage, read_entry, read_metadata

    md = read_metadata(args.path)
    problems = check_chunks(md) + check_storage(md, args.path)
    specs = read_specs(md)
    owned = {qspec.component_fqn(e.fqn, c.name) for e in specs.values() for c in e.components}
    problems += [f"{k}: a qdcp component item that no spec entry lists (damaged or missing spec)"
                 for k in sorted(md.state_dict_metadata)
                 if qspec.COMPONENT_SEPARATOR in k and k not in owned
                 and k.rsplit(qspec.COMPONENT_SEPARATOR, 1)[0] not in specs]
    keys = sorted(set(specs) | {k for k in md.state_dict_metadata if k not in owned})
    for i, key in enumerate(keys):
        _progress(i, len(keys), key)
        try:
            value = read_entry(args.path, key, md)
            if isinstance(value, torch.Tensor):
                adapter = find_adapter(value)
                plain = adapter.dequantize(value) if adapter else value
                expected = specs[key].shape if key in specs else tuple(md.state_dict_metadata[key].size)
                if tuple(plain.shape) != tuple(expected):
                    problems.append(f"{key}: rebuilt shape {tuple(plain.shape)} != {tuple(expected)}")
                if key in specs and specs[key].storage == qspec.RAW and plain.dtype != specs[key].dtype:
                    problems.append(f"{key}: rebuilt dtype {plain.dtype} != {specs[key].dtype}")
        except BaseException as e:  # CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt):
                raise
            problems.append(f"{key}: {_root_cause(e)}")
    for p in problems:
        print(f"FAIL {p}")
    print(f"{'OK' if not problems else 'FAILED'}: {len(keys)} entries, {len(problems)} problems")
    return EXIT_OK if not problems else EXIT_FAILED


def _root_cause(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))[0]
    return f"{type(e).__name__}: {e}"


# ----------------------------------------------------------------------------- convert

def cmd_convert(args: argparse.Namespace) -> int:
    if os.path.exists(args.out) and not args.overwrite:
        print(f"qdcp: {args.out} exists; pass --overwrite to replace it", file=sys.stderr)
        return EXIT_USAGE
    dtype = _DTYPE_ARGS[args.dtype] if args.dtype else None
    if args.to == "safetensors":
        return _to_safetensors(args.path, args.out, args.dequantize, dtype)
    if not args.dequantize:
        print("qdcp: --to dcp needs --dequantize (a raw copy is the checkpoint itself)", file=sys.stderr)
        return EXIT_USAGE
    return _to_dcp_dequantized(args.path, args.out, dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _to_safetensors(path: str, out: str, dequantize: bool, dtype: torch.dtype | None) -> int:
    """Stream entries into one safetensors file; memory holds one entry at a time.

    Raw export (default): components under ``<key>.__qdcp__.<component>`` and the qdcp spec of the
    raw entries in the header metadata under ``"qdcp"``; plain tensors under their key. With
    ``dequantize``: every tensor entry as a plain tensor under its key. Objects are skipped.
    """
    from qdcp.adapters.base import find_adapter
    from qdcp.planner import read_specs
    from qdcp.reader import read_entry, read_metadata
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = read_metadata(path)
    specs = read_specs(md)
    owned = {qspec.component_fqn(e.fqn, c.name): e for e in specs.values() for c in e.components}
    # plan: (tensor name, shape, dtype, how to produce it)
    plan: list[tuple[str, tuple, torch.dtype, str, str | None]] = []
    skipped = []
    for key in sorted(set(specs) | set(md.state_dict_metadata) - set(owned)):
        entry = specs.get(key)
        if entry is not None and entry.storage == qspec.RAW and not dequantize:
            for c in entry.components:
                plan.append((qspec.component_fqn(key, c.name), c.shape, c.dtype, key, c.name))
            continue
        if entry is not None:
            base = entry.dtype if entry.storage == qspec.RAW else (entry.stored_dtype or entry.dtype)
            shape = entry.shape
        else:
            item = md.state_dict_metadata[key]
            if not isinstance(item, TensorStorageMetadata):
                skipped.append(key)
                continue
            base, shape = item.properties.dtype, tuple(item.size)
        out_dtype = dtype if dtype is not None and base.is_floating_point else base
        plan.append((key, tuple(shape), out_dtype, key, None))
    header: dict[str, Any] = {}
    offset = 0
    for name, shape, dt, _, _ in plan:
        if dt not in _SAFETENSORS_DTYPES:
            print(f"qdcp: {name}: dtype {dt} has no safetensors name", file=sys.stderr)
            return EXIT_FAILED
        n = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dt], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    meta = {"format": "pt", "producer": "qdcp"}
    raw = {k: e for k, e in specs.items() if e.storage == qspec.RAW}
    if raw and not dequantize:
        meta["qdcp"] = qspec.dumps(raw)
    header["__metadata__"] = meta
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = out + ".tmp"
    keys = [p[3] for p in plan]
    unique = list(dict.fromkeys(keys))
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        i = 0
        for idx, key in enumerate(unique):
            _progress(idx, len(unique), key)
            value = read_entry(path, key, md)
            adapter = find_adapter(value)
            comps = adapter.components(value) if (adapter and not dequantize) else None
            while i < len(plan) and plan[i][3] == key:
                name, shape, dt, _, comp = plan[i]
                t = comps[comp] if comp is not None else (
                    adapter.dequantize(value) if adapter else value)
                t = _cast(t, dt).contiguous()
                assert tuple(t.shape) == tuple(shape), (name, t.shape, shape)
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
                i += 1
    os.replace(tmp, out)
    for key in skipped:
        print(f"qdcp: skipped non-tensor entry {key!r} (safetensors holds tensors only)", file=sys.stderr)
    print(f"wrote {out}: {len(plan)} tensors, {offset} bytes")
    return EXIT_OK


def _to_dcp_dequantized(path: str, out: str, dtype: torch.dtype | None) -> int:
    """A portable DCP copy: quantized entries dequantized (at write time, one at a time)."""
    import torch.distributed.checkpoint as dcp

    from qdcp.adapters.base import find_adapter
    from qdcp.planner import QuantizedSavePlanner, read_specs
    from qdcp.reader import read_entry, read_metadata

    md = read_metadata(path)
    specs = read_specs(md)
    owned = {qspec.component_fqn(e.fqn, c.name) for e in specs.values() for c in e.components}
    keys = sorted(set(specs) | set(md.state_dict_metadata) - owned)
    state = {}
    for i, key in enumerate(keys):
        _progress(i, len(keys), key)
        value = read_entry(path, key, md)
        plain = isinstance(value, torch.Tensor) and find_adapter(value) is None
        state[key] = _cast(value, dtype) if plain else value
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=out, planner=QuantizedSavePlanner(dequantize=True,
                                                                         dequantize_dtype=dtype),
                 no_dist=True)
    print(f"wrote {out}: {len(keys)} entries, dequantized")
    return EXIT_OK


# ----------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qdcp", description="Inspect, verify and convert qdcp/DCP checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="table of entries: storage, type, shape, bytes")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="read and rebuild every entry; check chunk coverage")
    p.add_argument("path")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("convert", help="export to safetensors or a dequantized DCP checkpoint")
    p.add_argument("path")
    p.add_argument("out")
    p.add_argument("--to", choices=["safetensors", "dcp"], required=True)
    p.add_argument("--dequantize", action="store_true", help="write plain high-precision tensors")
    p.add_argument("--dtype", choices=sorted(_DTYPE_ARGS), help="dtype of floating outputs")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qdcp`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    _quiet()
    try:
        return args.func(args)
    except FileNotFoundError as e:
        print(f"qdcp: {e}", file=sys.stderr)
        return EXIT_USAGE
    except QdcpError as e:
        print(f"qdcp: {args.path}: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
