"""Per-key cost: many small tensors, qdcp's paths against vanilla DCP in the same run.

A state dict of ``--keys`` entries, half of them torchao ``Int8Tensor`` weights (``--rows`` x 64,
per-row scales) and half plain bf16 tensors of the same shape, as an MoE checkpoint with per-expert
keys or an optimizer's states reach tens of thousands of keys. Each case is timed interleaved with
the others (median of ``--repeat``), files in a fresh directory each run:

- vanilla ``dcp.save`` / ``dcp.load`` of the same state with every quantized weight replaced by its
  components as plain tensors (``<key>.qdata``, ``<key>.scale``, ``<key>.zero_point``: the items and
  bytes qdcp stores): the baseline;
- ``qdcp.save`` / ``qdcp.load``;
- ``dcp.save(..., planner=QuantizedSavePlanner())`` / ``dcp.load(..., planner=QuantizedLoadPlanner())``.

Prints seconds, the ratio to vanilla, microseconds per key, and ``.metadata`` bytes per key (per
entry of the state dict: vanilla's counts the same entries). At several ``--keys`` the per-key
figures show whether the cost grows linearly.

    python benchmarks/many_keys.py [--keys 2000,10000] [--repeat 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torchao.quantization import Int8Tensor
from torchao.quantization.granularity import PerRow

import qdcp
from common import compare
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner


def states(keys: int, rows: int) -> tuple[dict, dict]:
    """The quantized state (``keys`` entries) and its plain twin (the same bytes, vanilla DCP's)."""
    g = torch.Generator().manual_seed(0)
    quantized, plain = {}, {}
    for i in range(keys // 2):
        w = Int8Tensor.from_hp(torch.randn(rows, 64, generator=g), PerRow())
        b = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        quantized[f"experts.{i}.weight"], quantized[f"experts.{i}.norm"] = w, b
        plain[f"experts.{i}.weight.qdata"] = w.qdata.clone()
        plain[f"experts.{i}.weight.scale"] = w.scale.clone()
        plain[f"experts.{i}.weight.zero_point"] = w.zero_point.clone()
        plain[f"experts.{i}.norm"] = b.clone()
    return quantized, plain


def like(state: dict) -> dict:
    """Targets of the same types and shapes, other values (what a resume loads into)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, Int8Tensor):
            out[k] = Int8Tensor.from_hp(torch.randn(v.shape), PerRow())
        else:
            out[k] = torch.zeros_like(v)
    return out


def run(keys: int, rows: int, repeat: int, root: str) -> list[tuple]:
    quantized, plain = states(keys, rows)
    dirs = {name: os.path.join(root, name) for name in ("vanilla", "qdcp", "planner")}

    def fresh(name: str):
        return lambda: shutil.rmtree(dirs[name], ignore_errors=True)

    saves = compare({
        "vanilla": (lambda: dcp.save(plain, checkpoint_id=dirs["vanilla"], no_dist=True), fresh("vanilla")),
        "qdcp": (lambda: qdcp.save(quantized, dirs["qdcp"], no_dist=True), fresh("qdcp")),
        "planner": (lambda: dcp.save(quantized, checkpoint_id=dirs["planner"], no_dist=True,
                                     planner=QuantizedSavePlanner()), fresh("planner")),
    }, repeat, collect=True)
    sizes = {n: os.path.getsize(os.path.join(d, ".metadata")) for n, d in dirs.items()}
    targets = {"vanilla": like(plain), "qdcp": like(quantized), "planner": like(quantized)}
    loads = compare({
        "vanilla": (lambda: dcp.load(targets["vanilla"], checkpoint_id=dirs["vanilla"], no_dist=True), None),
        "qdcp": (lambda: qdcp.load(targets["qdcp"], dirs["qdcp"], no_dist=True), None),
        "planner": (lambda: dcp.load(targets["planner"], checkpoint_id=dirs["planner"], no_dist=True,
                                     planner=QuantizedLoadPlanner()), None),
    }, repeat, collect=True)
    rows_out = []
    for what, times in (("save", saves), ("load", loads)):
        for name, label in (("vanilla", f"vanilla dcp.{what}"), ("qdcp", f"qdcp.{what}"),
                            ("planner", f"dcp.{what} + Quantized{what.title()}Planner")):
            rows_out.append((keys, label, times[name], times[name] / times["vanilla"],
                             times[name] / keys * 1e6, sizes[name] / keys))
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="2000,10000", help="comma-separated numbers of state-dict entries")
    ap.add_argument("--rows", type=int, default=64, help="rows of each tensor (64 columns)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = ap.parse_args()
    print("keys | case | seconds | ratio to vanilla | us per key | .metadata bytes per key")
    for keys in (int(k) for k in args.keys.split(",")):
        root = tempfile.mkdtemp(prefix="qdcp-many-keys-", dir=args.dir)
        try:
            for keys_, label, s, ratio, us, md in run(keys, args.rows, args.repeat, root):
                print(f"{keys_} | {label} | {s:.2f} | {ratio:.2f} | {us:.0f} | {md:.0f}", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
