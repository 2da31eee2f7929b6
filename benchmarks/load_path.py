"""The load path: qdcp's loads / vanilla ``dcp.load`` of plain tensors with the same bytes, hot.

Saves Int8Tensor weights (4096x4096, per-row scales) holding ``--gib`` GiB of components with
``qdcp.save``, and their components cloned as plain tensors with vanilla ``dcp.save``; then times,
interleaved, files in the page cache (*hot*: the software path alone), loading into targets on
``--device``:

- vanilla ``dcp.load`` of the plain tensors (DCP's reader and planner): the baseline;
- ``dcp.load(..., planner=QuantizedLoadPlanner())`` (DCP's reader; every item verified; goal <= 1.10);
- ``qdcp.load`` (qdcp's reader, verified, all-or-nothing: its default; goal <= 1.15 on CPU, <= 0.8
  on a GPU) and ``qdcp.load(atomic=False)`` (in place, as DCP loads); ``qdcp.load`` with its files
  read on up to 4 threads, asked for (the default where CUDA is in use is one thread).

Also times one XXH3-64 pass over the same bytes (the checksum's own cost: what a verified load
through DCP's reader adds where the pass cannot overlap the reads). Prints the best and the median
of ``--repeat`` runs of each, and their ratios to vanilla.

    python benchmarks/load_path.py [--gib 0.1875] [--device cpu|cuda] [--repeat 7] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
import xxhash

import qdcp
from common import add_profile_argument, device_of, plain_twin, profile, quantized_state
from qdcp import QuantizedLoadPlanner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=0.1875, help="GiB of components (default 0.1875: 192 MiB)")
    ap.add_argument("--device", default="cpu", help="where the targets live: cpu or cuda (default cpu)")
    ap.add_argument("--repeat", type=int, default=7, help="interleaved runs of each case (default 7)")
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    add_profile_argument(ap)
    args = ap.parse_args()
    device = device_of(args.device)
    state = quantized_state("int8", 2 * args.gib)
    twin = plain_twin(state)
    target = {k: v.to(device) for k, v in quantized_state("int8", 2 * args.gib, seed=1).items()}
    twin_target = {k: torch.empty_like(v, device=device) for k, v in twin.items()}
    root = tempfile.mkdtemp(prefix="qdcp-load-", dir=args.dir)
    q, v = f"{root}/q", f"{root}/v"
    try:
        qdcp.save(state, q)
        dcp.save(twin, checkpoint_id=v)
        nbytes = sum(t.numel() * t.element_size() for t in twin.values())
        twin_bytes = [t.contiguous().view(-1).view(torch.uint8).numpy() for t in twin.values()]
        cases = {
            "vanilla dcp.load": lambda: dcp.load(twin_target, checkpoint_id=v),
            # what verifying costs by itself: one XXH3-64 pass over the same bytes, on one core
            "one XXH3-64 pass over the bytes": lambda: [xxhash.xxh3_64_intdigest(b) for b in twin_bytes],
            "dcp.load + QuantizedLoadPlanner": lambda: dcp.load(target, checkpoint_id=q,
                                                                planner=QuantizedLoadPlanner()),
            "qdcp.load": lambda: qdcp.load(target, q),
            "qdcp.load(atomic=False)": lambda: qdcp.load(target, q, atomic=False),
            "qdcp.load, files on 4 threads": lambda: qdcp.load(target, q, storage_options={"thread_count": 4}),
        }
        for fn in cases.values():  # warm: files in the page cache, caches filled
            fn()
        times: dict[str, list[float]] = {k: [] for k in cases}
        for r in range(args.repeat):
            for name in (list(cases) if r % 2 == 0 else list(reversed(cases))):
                gc.collect()
                _sync(device)
                t0 = time.perf_counter()
                cases[name]()
                _sync(device)
                times[name].append(time.perf_counter() - t0)
        for name in args.profile:
            profile(name, cases[name])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{len(state)} Int8Tensor weights, {nbytes / 2**20:.0f} MiB of components, targets on {device}; "
          f"files hot; {args.repeat} interleaved runs")
    base_best, base_med = min(times["vanilla dcp.load"]), statistics.median(times["vanilla dcp.load"])
    print(f"\n{'case':34} {'best s':>8} {'median s':>9} {'best / vanilla':>15} {'median / vanilla':>17}")
    for name, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        print(f"{name:34} {best:8.3f} {med:9.3f} {best / base_best:15.2f} {med / base_med:17.2f}")
    hashed = min(times["one XXH3-64 pass over the bytes"])
    print(f"\nvanilla's best + one hash pass: {(base_best + hashed) / base_best:.2f}x vanilla (the least a load "
          f"that verifies every byte after DCP's reader copied it costs, where the pass cannot overlap)")
    print("goals: dcp.load + QuantizedLoadPlanner <= 1.10; qdcp.load <= 1.15 (CPU), <= 0.8 (GPU)")


if __name__ == "__main__":
    main()
