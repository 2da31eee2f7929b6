"""Save and load speed and size of a quantized model vs vanilla DCP on the same bytes.

Prints, in one run:
- raw checkpoint bytes / sum of component bytes (goal <= 1.01);
- raw checkpoint bytes / bf16 checkpoint bytes of the same model;
- qdcp save and load time / vanilla DCP save and load time of plain tensors with the same byte
  count (goal <= 1.1), for each quantized format asked for;
- the cost of checksums: save and load through qdcp.CheckpointWriter / CheckpointReader (CRC-32
  per item, atomic commit) / the same without them.

    python benchmarks/save_load.py [--gib 1.0] [--kinds int8,mxfp8,nvfp4,nf4] [--dir /tmp/qdcp-bench]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed.checkpoint as dcp

from common import compare, component_bytes, dir_bytes, fresh_dir, plain_twin, quantized_state, table_row
from qdcp import CheckpointReader, CheckpointWriter, QuantizedLoadPlanner, QuantizedSavePlanner


def bench(kind: str, gib: float, root: str, repeat: int) -> dict:
    state = quantized_state(kind, gib)
    target = quantized_state(kind, gib, seed=1)
    twin = plain_twin(state)
    twin_target = {k: torch.empty_like(v) for k, v in twin.items()}
    q_dir, v_dir, b_dir, c_dir = (os.path.join(root, f"{kind}-{n}") for n in ("qdcp", "vanilla", "bf16", "crc"))

    saves = compare({
        "q": (lambda: dcp.save(state, checkpoint_id=q_dir, planner=QuantizedSavePlanner()),
              lambda: fresh_dir(q_dir)),
        "v": (lambda: dcp.save(twin, checkpoint_id=v_dir), lambda: fresh_dir(v_dir)),
        "c": (lambda: dcp.save(state, storage_writer=CheckpointWriter(c_dir), planner=QuantizedSavePlanner()),
              lambda: fresh_dir(c_dir))}, repeat)
    loads = compare({
        "q": (lambda: dcp.load(target, checkpoint_id=q_dir, planner=QuantizedLoadPlanner()), None),
        "v": (lambda: dcp.load(twin_target, checkpoint_id=v_dir), None),
        "c": (lambda: dcp.load(target, storage_reader=CheckpointReader(c_dir), planner=QuantizedLoadPlanner()),
              None)}, repeat)
    q_save, v_save, q_load, v_load = saves["q"], saves["v"], loads["q"], loads["v"]
    dcp.save(state, checkpoint_id=fresh_dir(b_dir), planner=QuantizedSavePlanner(dequantize=True))
    comp = component_bytes(state)
    out = {"kind": kind, "entries": len(state), "component_MiB": comp / 2**20,
           "ckpt/components": dir_bytes(q_dir) / comp, "ckpt/bf16_ckpt": dir_bytes(q_dir) / dir_bytes(b_dir),
           "save_s": q_save, "vanilla_save_s": v_save, "save_ratio": q_save / v_save,
           "load_s": q_load, "vanilla_load_s": v_load, "load_ratio": q_load / v_load,
           "crc_save/save": saves["c"] / q_save, "crc_load/load": loads["c"] / q_load}
    for d in (q_dir, v_dir, b_dir, c_dir):
        fresh_dir(d)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="logical (bf16) size of the model")
    parser.add_argument("--kinds", default="int8,mxfp8,nvfp4,nf4")
    parser.add_argument("--dir", default="/tmp/qdcp-bench")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cols = ["kind", "entries", "component_MiB", "ckpt/components", "ckpt/bf16_ckpt", "save_s",
            "vanilla_save_s", "save_ratio", "load_s", "vanilla_load_s", "load_ratio", "crc_save/save",
            "crc_load/load"]
    print(" | ".join(cols))
    for kind in args.kinds.split(","):
        r = bench(kind, args.gib, args.dir, args.repeat)
        print(table_row(r, cols), flush=True)


if __name__ == "__main__":
    main()
