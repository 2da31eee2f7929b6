"""Save and load speed and size of a quantized model vs vanilla DCP on the same bytes.

Prints, in one run, per quantized format:
- raw checkpoint bytes / sum of component bytes (goal <= 1.01);
- raw checkpoint bytes / bf16 checkpoint bytes of the same model;
- ``dcp.save`` / ``dcp.load`` with qdcp's planners (checksums recorded and verified, the default)
  / with DCP's default planners on plain tensors of the same bytes (goals <= 1.15 save, <= 1.20 load);
- the cost of checksums: save with / without (goal <= 1.05), load verified / unverified (<= 1.10);
- ``qdcp.CheckpointReader`` load / the same load through DCP's own reader, and
  ``qdcp.CheckpointWriter`` save / DCP's own writer (atomic commit);
- the verified load through qdcp's reader (what ``qdcp.load`` reads with: each item hashed as it is
  read, on another core while it is copied on) / vanilla DCP's unverified load of the same bytes
  (goal <= 1.15).

Loads are timed twice: *hot*, the files in the page cache (the software path alone: every byte is
copied at memory speed, so one more pass over it -- the checksum -- shows at full size), and
*cold*, the files' pages dropped before each load (``posix_fadvise(DONTNEED)``), read from disk.

    python benchmarks/save_load.py [--gib 1.0] [--kinds int8,mxfp8,nvfp4,nf4] [--dir /tmp/qdcp-bench]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed.checkpoint as dcp

from common import (
    compare,
    component_bytes,
    dir_bytes,
    drop_page_cache,
    fresh_dir,
    plain_twin,
    quantized_state,
    table_row,
)
from qdcp import CheckpointReader, CheckpointWriter, QuantizedLoadPlanner, QuantizedSavePlanner


def bench(kind: str, gib: float, root: str, repeat: int) -> dict:
    state = quantized_state(kind, gib)
    target = quantized_state(kind, gib, seed=1)
    twin = plain_twin(state)
    twin_target = {k: torch.empty_like(v) for k, v in twin.items()}
    q_dir, n_dir, v_dir, b_dir, w_dir = (os.path.join(root, f"{kind}-{n}")
                                         for n in ("qdcp", "nosums", "vanilla", "bf16", "writer"))

    saves = compare({
        "q": (lambda: dcp.save(state, checkpoint_id=q_dir, planner=QuantizedSavePlanner()),
              lambda: fresh_dir(q_dir)),
        "n": (lambda: dcp.save(state, checkpoint_id=n_dir, planner=QuantizedSavePlanner(checksums=False)),
              lambda: fresh_dir(n_dir)),
        "v": (lambda: dcp.save(twin, checkpoint_id=v_dir), lambda: fresh_dir(v_dir)),
        "w": (lambda: dcp.save(state, storage_writer=CheckpointWriter(w_dir), planner=QuantizedSavePlanner()),
              lambda: fresh_dir(w_dir))}, repeat)
    loads = {}
    for temp, setup in (("hot", None), ("cold", lambda: drop_page_cache(q_dir, v_dir))):
        loads[temp] = compare({
            "q": (lambda: dcp.load(target, checkpoint_id=q_dir, planner=QuantizedLoadPlanner()), setup),
            "n": (lambda: dcp.load(target, checkpoint_id=q_dir, planner=QuantizedLoadPlanner(checksums=False)),
                  setup),
            "v": (lambda: dcp.load(twin_target, checkpoint_id=v_dir), setup),
            "r": (lambda: dcp.load(target, storage_reader=CheckpointReader(q_dir), planner=QuantizedLoadPlanner()),
                  setup)}, repeat)
    dcp.save(state, checkpoint_id=fresh_dir(b_dir), planner=QuantizedSavePlanner(dequantize=True))
    comp = component_bytes(state)
    out = {"kind": kind, "entries": len(state), "component_MiB": comp / 2**20,
           "ckpt/components": dir_bytes(q_dir) / comp, "ckpt/bf16_ckpt": dir_bytes(q_dir) / dir_bytes(b_dir),
           "save_s": saves["q"], "vanilla_save_s": saves["v"], "save/vanilla": saves["q"] / saves["v"],
           "sums_save/none": saves["q"] / saves["n"], "writer/dcp_writer": saves["w"] / saves["q"]}
    for temp, t in loads.items():
        out.update({f"{temp}_load_s": t["q"], f"{temp}_load/vanilla": t["q"] / t["v"],
                    f"{temp}_verified/unverified": t["q"] / t["n"], f"{temp}_reader/dcp_reader": t["r"] / t["q"],
                    f"{temp}_reader_verified/vanilla": t["r"] / t["v"]})
    for d in (q_dir, n_dir, v_dir, b_dir, w_dir):
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
    cols = ["kind", "entries", "component_MiB", "ckpt/components", "ckpt/bf16_ckpt", "save_s", "vanilla_save_s",
            "save/vanilla", "sums_save/none", "writer/dcp_writer"]
    cols += [f"{t}_{c}" for t in ("hot", "cold") for c in ("load_s", "load/vanilla", "verified/unverified",
                                                           "reader/dcp_reader", "reader_verified/vanilla")]
    print(" | ".join(cols))
    for kind in args.kinds.split(","):
        r = bench(kind, args.gib, args.dir, args.repeat)
        print(table_row(r, cols), flush=True)


if __name__ == "__main__":
    main()
