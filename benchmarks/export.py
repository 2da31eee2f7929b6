"""Export and import speed and memory against safetensors and DCP on the same bytes.

Prints, per quantized format and layout:
- ``qdcp.export`` time / (``safetensors.torch.load_file`` + ``save_file`` of the same component
  bytes) (goal <= 1.2);
- export's peak extra memory (the peak resident size of a fresh process over what it held before
  the export, its imports warmed) / the largest entry's bytes (goal <= 1.1);
- ``dcp.load`` through ``QuantizedHFReader`` into quantized targets / ``dcp.load`` of the raw qdcp
  checkpoint into the same targets (goal <= 1.2). Both hot (files in the page cache).

    python benchmarks/export.py [--gib 1.0] [--kinds int8,mxfp8,nvfp4] [--shape 4096x4096] \
        [--dir /tmp/qdcp-bench-export]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from common import compare, component_bytes, fresh_dir, plain_twin, quantized_state, table_row
from qdcp import QuantizedHFReader, QuantizedLoadPlanner, QuantizedSavePlanner, export

_PEAK = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import qdcp

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))

ckpt, warm, out, layout = sys.argv[1:5]
qdcp.export(warm, out, format=layout, overwrite=True, progress=False)  # imports, on a small checkpoint
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) restarts from the current resident size
base = status("VmRSS")
qdcp.export(ckpt, out, format=layout, overwrite=True, progress=False)
print(json.dumps({"extra": status("VmHWM") - base}))
"""


def _peak_extra(ckpt: str, warm: str, out: str, layout: str) -> int:
    """Peak resident memory of a fresh process exporting ``ckpt``, over what it held before (its
    imports warmed by exporting the small checkpoint ``warm`` first)."""
    run = subprocess.run([sys.executable, "-c", _PEAK, ckpt, warm, out, layout], capture_output=True, text=True,
                         check=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    return json.loads(run.stdout.strip().splitlines()[-1])["extra"]


def bench(kind: str, layout: str, gib: float, root: str, shape: tuple[int, int] = (4096, 4096)) -> dict:
    state = quantized_state(kind, gib, *shape)
    ckpt, out = fresh_dir(f"{root}/ckpt"), fresh_dir(f"{root}/out")
    dcp.save(state, checkpoint_id=ckpt, planner=QuantizedSavePlanner(), no_dist=True)
    plain = plain_twin(state)
    st_in, st_out = f"{root}/plain.safetensors", f"{root}/plain_copy.safetensors"
    save_file(plain, st_in)
    del plain
    targets = state  # loaded in place, the same bytes both ways
    times = compare({  # both write new files (the previous output removed, untimed)
        "export": (lambda: export(ckpt, out, format=layout, progress=False),
                   lambda: shutil.rmtree(out, ignore_errors=True)),
        "safetensors": (lambda: save_file(load_file(st_in), st_out),
                        lambda: os.path.exists(st_out) and os.remove(st_out)),
    }, repeat=3)
    loads = compare({
        "import": (lambda: dcp.load(targets, storage_reader=QuantizedHFReader(out),
                                    planner=QuantizedLoadPlanner(), no_dist=True), None),
        "dcp": (lambda: dcp.load(targets, checkpoint_id=ckpt, planner=QuantizedLoadPlanner(), no_dist=True), None),
    }, repeat=3)
    largest = max(component_bytes({"x": t}) for t in state.values())
    warm = fresh_dir(f"{root}/warm")
    dcp.save(quantized_state(kind, 0.01, rows=256, cols=1024), checkpoint_id=warm, planner=QuantizedSavePlanner(),
             no_dist=True)
    extra = _peak_extra(ckpt, warm, out, layout)
    return {"kind": kind, "layout": layout, "bytes": component_bytes(state),
            "export_s": times["export"], "safetensors_s": times["safetensors"],
            "export_ratio": times["export"] / times["safetensors"],
            "peak_extra_ratio": extra / largest,
            "import_ratio": loads["import"] / loads["dcp"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0, help="logical bf16 GiB of the model")
    p.add_argument("--kinds", default="int8,mxfp8,nvfp4")
    p.add_argument("--layouts", default="torchao,compressed-tensors")
    p.add_argument("--dir", default="/tmp/qdcp-bench-export")
    p.add_argument("--shape", default="4096x4096", help="ROWSxCOLS of each layer's weight")
    args = p.parse_args()
    torch.manual_seed(0)
    cols = ["kind", "layout", "bytes", "export_s", "safetensors_s", "export_ratio", "peak_extra_ratio", "import_ratio"]
    print(" | ".join(cols))
    for kind in args.kinds.split(","):
        for layout in args.layouts.split(","):
            shape = tuple(int(n) for n in args.shape.split("x"))
            print(table_row(bench(kind, layout, args.gib, args.dir, shape), cols), flush=True)


if __name__ == "__main__":
    main()
