"""Quantized checkpoints into high-precision models: ``qdcp.load`` of a raw checkpoint into plain
bf16 targets, against vanilla ``dcp.load`` of the same values saved as bf16; and the other way,
``qdcp.save(..., dequantize=True)`` against vanilla ``dcp.save`` of those values.

Per format (4096x4096 weights of ``--gib`` logical GiB, files hot, targets on the CPU), best and
median of ``--repeat`` interleaved runs of:

- vanilla ``dcp.load`` of the bf16 values (each weight's ``dequantize()``, saved plain): the baseline;
- ``qdcp.load`` of the quantized checkpoint (all-or-nothing, its default) and ``atomic=False``;
- the same in-place load with each stored chunk dequantized whole
  (``qdcp.planning.rows.DEQUANTIZE_ELEMENTS`` past the tensor's size), as before row blocks;
- the library's ``dequantize()`` of the same tensors alone (the compute a load cannot skip);
- vanilla ``dcp.save`` of the bf16 values (the saves' baseline), ``qdcp.save(dequantize=True)`` of
  the quantized tensors, and the same with each tensor dequantized whole.

Saves are timed from a fresh directory, after ``os.sync()``.

    python benchmarks/dequantizing_load.py [--gib 0.375] [--kinds int8,mxfp8,nvfp4,nf4] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

import qdcp
from common import quantized_state
from qdcp.adapters import rows
from qdcp.adapters.base import find_adapter


def _whole(fn):
    def run():
        before = rows.DEQUANTIZE_ELEMENTS
        rows.DEQUANTIZE_ELEMENTS = 1 << 62
        try:
            fn()
        finally:
            rows.DEQUANTIZE_ELEMENTS = before
    return run


def bench(kind: str, gib: float, repeat: int, root: str) -> dict[str, list[float]]:
    state = quantized_state(kind, gib)
    values = {k: find_adapter(v).dequantize(v, torch.bfloat16).contiguous() for k, v in state.items()}
    q, v = f"{root}/{kind}-q", f"{root}/{kind}-v"
    qdcp.save(state, q)
    dcp.save(values, checkpoint_id=v)
    target = {k: torch.empty_like(t) for k, t in values.items()}
    fresh = lambda p: (shutil.rmtree(p, ignore_errors=True), os.sync())  # noqa: E731
    s, d = f"{root}/{kind}-s", f"{root}/{kind}-d"
    cases = {
        "vanilla dcp.load of the bf16 values": lambda: dcp.load(target, checkpoint_id=v),
        "qdcp.load": lambda: qdcp.load(target, q),
        "qdcp.load(atomic=False)": lambda: qdcp.load(target, q, atomic=False),
        "qdcp.load(atomic=False), chunks whole": _whole(lambda: qdcp.load(target, q, atomic=False)),
        "the library's dequantize() alone": lambda: [find_adapter(t).dequantize(t, torch.bfloat16)
                                                     for t in state.values()],
        "vanilla dcp.save of the bf16 values": lambda: dcp.save(values, checkpoint_id=s),
        "qdcp.save(dequantize=True)": lambda: qdcp.save(state, d, dequantize=True),
        "qdcp.save(dequantize=True), whole": _whole(lambda: qdcp.save(state, d, dequantize=True)),
    }
    before = {"vanilla dcp.save of the bf16 values": lambda: fresh(s), "qdcp.save(dequantize=True)": lambda: fresh(d),
              "qdcp.save(dequantize=True), whole": lambda: fresh(d)}
    for name, fn in cases.items():
        before.get(name, lambda: None)()
        fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(repeat):
        for name in (list(cases) if r % 2 == 0 else list(reversed(cases))):
            before.get(name, lambda: None)()
            gc.collect()
            t0 = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=0.375, help="logical bf16 GiB per format (default 0.375)")
    ap.add_argument("--kinds", default="int8,mxfp8,nvfp4,nf4", help="comma-separated formats")
    ap.add_argument("--repeat", type=int, default=5, help="interleaved runs of each case (default 5)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="qdcp-dequant-")
    try:
        for kind in args.kinds.split(","):
            times = bench(kind, args.gib, args.repeat, root)
            print(f"\n{kind}, {args.gib} GiB of bf16 values, {torch.get_num_threads()} threads")
            print(f"{'case':40} {'best s':>8} {'median s':>9} {'best / vanilla':>15} {'median / vanilla':>17}")
            for name, ts in times.items():
                base = times["vanilla dcp.save of the bf16 values" if "save" in name
                             else "vanilla dcp.load of the bf16 values"]
                base_best, base_med = min(base), statistics.median(base)
                best, med = min(ts), statistics.median(ts)
                print(f"{name:40} {best:8.3f} {med:9.3f} {best / base_best:15.2f} {med / base_med:17.2f}",
                      flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
