"""TransformerEngine MXFP8 / NVFP4 state dicts: qdcp raw checkpoints vs TE's own pickle path.

Builds real TE tensors on CPU (TE's pure-Python classes over tests/te_cpu.py's stand-in for the
compiled extension; buffers filled with random bits), about ``--gib`` GiB of buffers per format,
and measures in one run:
- checkpoint bytes / buffer bytes for qdcp (compact scales, padding not stored) and for vanilla
  DCP, which pickles each TE tensor's raw buffers (TE >= 2.17);
- sync save and load (into same-type TE targets) time, qdcp / vanilla DCP.

    python benchmarks/te_checkpoint.py [--gib 1.0] [--dir /tmp/qdcp-te-bench]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import te_cpu  # noqa: E402

te = te_cpu.install()
from common import compare, dir_bytes, fresh_dir, table_row  # noqa: E402
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner, find_adapter  # noqa: E402
from test_transformer_engine import make_mxfp8, make_nvfp4  # noqa: E402

ROWS = COLS = 4096


def te_safe_globals() -> None:
    """What TE's own ``transformer_engine.pytorch.__init__`` registers for weights_only loads."""
    import transformer_engine.pytorch.tensor.float8_tensor as f8
    import transformer_engine.pytorch.tensor.mxfp8_tensor as mx
    import transformer_engine.pytorch.tensor.nvfp4_tensor as nv
    from transformer_engine.pytorch.constants import DType

    names = []
    for mod in (f8, mx, nv):
        names += [getattr(mod, n) for n in dir(mod)
                  if n.startswith("_make_") or n.endswith("Tensor") or n.endswith("Quantizer")]
    torch.serialization.add_safe_globals(names + [DType])


def buffer_bytes(state) -> int:
    total = 0
    for t in state.values():
        for b in find_adapter(t).inner_buffers(t).values():
            total += b.numel() * b.element_size()
    return total


def bench(fmt: str, gib: float, root: str, repeat: int) -> dict:
    make = {"mxfp8": make_mxfp8, "nvfp4": make_nvfp4}[fmt]
    per = (ROWS * COLS) if fmt == "mxfp8" else (ROWS * COLS // 2)
    n = max(1, round(gib * 2**30 / per))
    with te_cpu.simulate_gpu(te_cpu.HOPPER):
        state = {f"layer{i}.weight": make(i, shape=(ROWS, COLS)) for i in range(n)}
        target = {k: make(1000 + i, shape=(ROWS, COLS)) for i, k in enumerate(state)}
        target2 = {k: make(2000 + i, shape=(ROWS, COLS)) for i, k in enumerate(state)}
        q_dir, v_dir = os.path.join(root, f"{fmt}-qdcp"), os.path.join(root, f"{fmt}-te-pickle")
        saves = compare({
            "q": (lambda: dcp.save(state, checkpoint_id=q_dir, planner=QuantizedSavePlanner()),
                  lambda: fresh_dir(q_dir)),
            "v": (lambda: dcp.save(state, checkpoint_id=v_dir), lambda: fresh_dir(v_dir))}, repeat)
        loads = compare({
            "q": (lambda: dcp.load(target, checkpoint_id=q_dir, planner=QuantizedLoadPlanner()), None),
            "v": (lambda: dcp.load(target2, checkpoint_id=v_dir), None)}, repeat)
        buf = buffer_bytes(state)
        out = {"fmt": fmt, "entries": n, "buffer_MiB": buf / 2**20,
               "qdcp/buffers": dir_bytes(q_dir) / buf, "te_pickle/buffers": dir_bytes(v_dir) / buf,
               "save_ratio": saves["q"] / saves["v"], "load_ratio": loads["q"] / loads["v"],
               "qdcp_save_s": saves["q"], "te_save_s": saves["v"], "qdcp_load_s": loads["q"],
               "te_load_s": loads["v"]}
    fresh_dir(q_dir)
    fresh_dir(v_dir)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--formats", default="mxfp8,nvfp4")
    parser.add_argument("--dir", default="/tmp/qdcp-te-bench")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    te_safe_globals()
    cols = ["fmt", "entries", "buffer_MiB", "qdcp/buffers", "te_pickle/buffers", "qdcp_save_s",
            "te_save_s", "save_ratio", "qdcp_load_s", "te_load_s", "load_ratio"]
    print(" | ".join(cols))
    for fmt in args.formats.split(","):
        r = bench(fmt, args.gib, args.dir, args.repeat)
        print(table_row(r, cols), flush=True)


if __name__ == "__main__":
    main()
