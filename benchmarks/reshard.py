"""Reshard load 2 -> 1: a quantized checkpoint saved by 2 ranks (Shard(0) DTensors of quantized
rows) loaded by 1 process, vs vanilla DCP loading plain tensors of the same bytes saved the same
way (goal <= 1.2). ``--kind``: ``int8`` (torchao Int8Tensor) or ``te-mxfp8``
(TransformerEngine tensors, real classes on CPU through tests/te_cpu.py).

    python benchmarks/reshard.py [--gib 1.0] [--kind int8] [--dir /tmp/qdcp-reshard]

It runs ``torchrun --nproc-per-node 2`` on itself to save, then loads in this process.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from common import compare, fresh_dir  # noqa: E402
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner, find_adapter  # noqa: E402

ROWS, COLS = 4096, 4096


def hp(i: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)


KIND = "int8"


def quantize(x: torch.Tensor, seed: int = 0):
    """``x`` quantized as ``KIND`` (TE tensors get random bits of x's shape: TE quantizes on GPU only)."""
    if KIND == "int8":
        from torchao.quantization import Int8Tensor, PerRow

        return Int8Tensor.from_hp(x, PerRow())
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import te_cpu

    te_cpu.install()
    from test_transformer_engine import make_mxfp8

    make = make_mxfp8
    with te_cpu.simulate_gpu(te_cpu.HOPPER):
        return make(seed, shape=tuple(x.shape))


def save_sharded(root: str, n: int) -> None:
    """Each of 2 ranks saves its rows: quantized (qdcp) and the plain components (vanilla)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows = ROWS // world

    def dtensor(local, shape, dtype):
        stride = torch.empty(shape, device="meta").stride()
        spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))
        return DTensor(local, spec, requires_grad=False)

    q_state, v_state = {}, {}
    for i in range(n):
        local = quantize(hp(i)[rank * rows:(rank + 1) * rows].contiguous(), seed=10 * i + rank)
        q_state[f"layer{i}.weight"] = dtensor(local, (ROWS, COLS), torch.bfloat16)
        for name, comp in find_adapter(local).components(local).items():
            v_state[f"layer{i}.weight.{name}"] = dtensor(comp.clone(), (ROWS,) + tuple(comp.shape[1:]), comp.dtype)
    dcp.save(q_state, checkpoint_id=os.path.join(root, "qdcp"), planner=QuantizedSavePlanner())
    dcp.save(v_state, checkpoint_id=os.path.join(root, "vanilla"))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="logical (bf16) size")
    parser.add_argument("--dir", default="/tmp/qdcp-reshard")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--kind", default="int8", choices=["int8", "te-mxfp8"])
    parser.add_argument("--save-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global KIND
    KIND = args.kind
    n = max(1, round(args.gib * 2**30 / (ROWS * COLS * 2)))
    if args.save_worker:
        save_sharded(args.dir, n)
        return
    fresh_dir(args.dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                    f"--master-port={port}", os.path.abspath(__file__), "--gib", str(args.gib),
                    "--dir", args.dir, "--kind", args.kind, "--save-worker"], check=True, capture_output=True)
    q_target = {f"layer{i}.weight": quantize(hp(1000 + i), seed=1000 + i) for i in range(n)}
    v_target = {}
    for key, t in q_target.items():
        for name, comp in find_adapter(t).components(t).items():
            v_target[f"{key}.{name}"] = torch.empty_like(comp)
    t = compare({
        "q": (lambda: dcp.load(q_target, checkpoint_id=os.path.join(args.dir, "qdcp"),
                               planner=QuantizedLoadPlanner()), None),
        "v": (lambda: dcp.load(v_target, checkpoint_id=os.path.join(args.dir, "vanilla")), None),
    }, args.repeat)
    # the loaded quantized tensor's first rows are rank 0's buffers, bit for bit
    ref = quantize(hp(0)[: ROWS // 2].contiguous(), seed=0)
    got = find_adapter(ref).components(q_target["layer0.weight"])
    for name, comp in find_adapter(ref).components(ref).items():
        assert torch.equal(got[name][: comp.shape[0]].view(torch.uint8), comp.view(torch.uint8)), name
    print(f"kind={args.kind} entries={n}  reshard 2->1 load: qdcp {t['q']:.3f}s  vanilla {t['v']:.3f}s  "
          f"ratio {t['q'] / t['v']:.3f}")
    fresh_dir(args.dir)


if __name__ == "__main__":
    main()
