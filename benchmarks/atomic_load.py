"""The cost of an all-or-nothing load: ``QuantizedLoadPlanner(atomic=True)`` against the in-place load.

Prints, in one run, per quantized format (and for plain bf16 tensors, and ``widen``: the same bf16
tensors loaded into fp32 targets): the load time of the atomic
load / the in-place load of the same checkpoint into the same targets (files in the page cache),
and the peak extra resident memory of each, measured in a fresh process (the targets allocated
first; the peak counted from there), as a fraction of the loaded state's bytes.

    python benchmarks/atomic_load.py [--gib 0.5] [--kinds int8,nvfp4,plain] [--dir /tmp/qdcp-bench-atomic]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp

from common import compare, component_bytes, fresh_dir, quantized_state, table_row
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner

_PEAK = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[4])
import torch.distributed.checkpoint as dcp
from common import quantized_state
from qdcp import QuantizedLoadPlanner
import atomic_load

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))

ckpt, kind, gib, atomic = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[5] == "1"
target = atomic_load.target_state(kind, gib)
small = atomic_load.state(kind, 0.01, seed=1)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) restarts from the current resident size
base = status("VmRSS")
dcp.load(target, checkpoint_id=ckpt, planner=QuantizedLoadPlanner(atomic=atomic), no_dist=True)
print(json.dumps({"extra": status("VmHWM") - base}))
"""


def state(kind: str, gib: float, seed: int = 0) -> dict:
    """A quantized state of ``kind``, or ``plain`` (and ``widen``): bf16 tensors of the same logical size."""
    if kind not in ("plain", "widen"):
        return quantized_state(kind, gib, seed=seed)
    g = torch.Generator().manual_seed(seed)
    n = max(1, round(gib * 2**30 / (4096 * 4096 * 2)))
    return {f"layer{i}.weight": torch.randn(4096, 4096, generator=g).to(torch.bfloat16) for i in range(n)}


def target_state(kind: str, gib: float) -> dict:
    """What a checkpoint of ``state(kind, gib)`` is loaded into: the same kind, fp32 tensors for ``widen``."""
    if kind == "widen":
        return {k: torch.zeros(v.shape) for k, v in state("plain", gib).items()}
    return state(kind, gib, seed=1)


def _peak_extra(ckpt: str, kind: str, gib: float, atomic: bool) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-c", _PEAK, ckpt, kind, str(gib), here, "1" if atomic else "0"],
                         capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    return json.loads(run.stdout.strip().splitlines()[-1])["extra"]


def bench(kind: str, gib: float, root: str, repeat: int) -> dict:
    source, target = state(kind, gib), target_state(kind, gib)
    ckpt = fresh_dir(os.path.join(root, kind))
    dcp.save(source, checkpoint_id=ckpt, planner=QuantizedSavePlanner(), no_dist=True)
    load = lambda atomic: dcp.load(target, checkpoint_id=ckpt, planner=QuantizedLoadPlanner(atomic=atomic),  # noqa: E731
                                   no_dist=True)
    times = compare({"atomic": (lambda: load(True), None), "in_place": (lambda: load(False), None)},
                    repeat=repeat, collect=True)
    nbytes = component_bytes(target)
    peaks = {a: _peak_extra(ckpt, kind, gib, a) / nbytes for a in (True, False)}
    return {"kind": kind, "MiB": round(nbytes / 2**20), "time_ratio": times["atomic"] / times["in_place"],
            "in_place_s": times["in_place"], "peak_atomic": peaks[True], "peak_in_place": peaks[False]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=0.5, help="logical bf16 GiB per format")
    ap.add_argument("--kinds", default="int8,nvfp4,plain",
                    help="comma-separated: int8, mxfp8, nvfp4, nf4, plain, widen")
    ap.add_argument("--dir", default="/tmp/qdcp-bench-atomic", help="scratch directory (removed per run)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per case (median)")
    args = ap.parse_args()
    cols = ["kind", "MiB", "time_ratio", "in_place_s", "peak_atomic", "peak_in_place"]
    print(" | ".join(cols))
    for kind in args.kinds.split(","):
        print(table_row(bench(kind, args.gib, args.dir, args.repeat), cols), flush=True)


if __name__ == "__main__":
    main()
