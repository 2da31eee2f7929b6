"""Helpers shared by the benchmark scripts: timing, directory sizes, quantized state dicts."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import statistics
import time
import warnings
from typing import Callable

import torch

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def add_profile_argument(ap) -> None:
    """``--profile CASE`` (repeatable): after timing, the case runs once under :func:`profile`."""
    ap.add_argument("--profile", action="append", default=[], metavar="CASE",
                    help="after timing, run CASE once under cProfile and print where its time goes")


def device_of(name: str) -> torch.device:
    """The ``--device`` asked for; exits where it is CUDA and none is here."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    return device


def profile(name: str, fn: Callable[[], object], top: int = 25) -> None:
    """Run ``fn`` once under cProfile and print its ``top`` functions by own time (``--profile``)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    print(f"\n-- profile of {name!r} (own time, top {top})", flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def timed(fn: Callable[[], object], repeat: int = 3, setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn`` over ``repeat`` runs (``setup`` runs untimed before each)."""
    return compare({"x": (fn, setup)}, repeat)["x"]


def compare(cases: dict[str, tuple[Callable[[], object], Callable[[], object] | None]],
            repeat: int = 5, sync: bool = True, collect: bool = False) -> dict[str, float]:
    """Median wall time of each ``(fn, setup)``, runs interleaved so drift hits all cases alike.

    Before each timed run: its setup, then ``os.sync()`` so earlier writes are not flushed inside it.
    ``collect``: start each run with no garbage (``gc.collect()``, untimed) and end it with a timed
    ``gc.collect()``, so each case pays for collecting what it allocated, whether the collector ran
    during it or (with GC paused, as qdcp's planners do) after.
    """
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(repeat):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for name in order:
            fn, setup = cases[name]
            if setup:
                setup()
            if sync:
                os.sync()
            if collect:
                gc.collect()
            t0 = time.perf_counter()
            fn()
            if collect:
                gc.collect()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def table_row(row: dict, cols) -> str:
    """One ``" | "``-separated line of ``row``'s ``cols`` (floats to 3 decimals)."""
    return " | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols)


def drop_page_cache(*paths: str) -> None:
    """Evict the files under ``paths`` from the page cache (written back first), so the next read
    comes from the disk."""
    os.sync()
    for path in paths:
        for d, _, files in os.walk(path):
            for name in files:
                fd = os.open(os.path.join(d, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def dir_bytes(path: str) -> int:
    """Bytes of every file under ``path``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def fresh_dir(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return path


def quantized_state(kind: str, logical_gib: float, rows: int = 4096, cols: int = 4096, seed: int = 0):
    """``{layer{i}.weight: quantized tensor}`` of about ``logical_gib`` GiB of bf16 logical data."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    from torchao.quantization import Int8Tensor, PerRow, to_nf4

    make = {
        "int8": lambda hp: Int8Tensor.from_hp(hp, PerRow()),
        "mxfp8": lambda hp: MXTensor.to_mx(hp, torch.float8_e4m3fn, 32),
        "nvfp4": lambda hp: NVFP4Tensor.to_nvfp4(hp),
        "nf4": lambda hp: to_nf4(hp),
    }[kind]
    n = max(1, round(logical_gib * 2**30 / (rows * cols * 2)))
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": make(torch.randn(rows, cols, generator=g).to(torch.bfloat16))
            for i in range(n)}


def component_bytes(state) -> int:
    """Bytes of every inner buffer of every quantized value (plain tensors count as they are)."""
    import qdcp

    total = 0
    for t in state.values():
        adapter = qdcp.find_adapter(t)
        for c in (adapter.components(t).values() if adapter else [t]):
            total += c.numel() * c.element_size()
    return total


def plain_twin(state) -> dict[str, torch.Tensor]:
    """Plain tensors with the same names, shapes and dtypes as the components: vanilla DCP's job."""
    import qdcp

    out = {}
    for key, t in state.items():
        adapter = qdcp.find_adapter(t)
        for name, c in (adapter.components(t).items() if adapter else [("", t)]):
            out[f"{key}.{name}"] = c.clone()
    return out
