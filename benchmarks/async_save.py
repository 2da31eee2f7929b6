"""How long ``dcp.async_save`` blocks the caller (QuantizedStager, DCP's default stager), and what it costs.

Builds a state dict of Int8Tensor weights (4096x4096, per-row scales) holding ``--gib`` GiB of
components, then measures, in one run:

- blocked: time the ``async_save`` call takes / a plain memcpy (``copy_``) of the same bytes into
  memory that is already touched (goal <= 1.2 on CPU; <= 0.05 with ``async_staging=True``);
- in stage(): the part of that time spent in ``QuantizedStager.stage`` (the rest is DCP's
  ``async_save`` around it: its checks, its per-call executor's thread start);
- done: time until the upload finished (written and fsynced), in seconds;
- peak mem: peak resident-memory growth during the save / the components' bytes, sampled from
  /proc every 2 ms (staging buffers, which stay allocated for the next save, are counted);
- the same for the plain call, ``dcp.async_save(state, planner=QuantizedSavePlanner())`` without
  ``async_stager`` (DCP's DefaultStager, through the ``new_empty`` qdcp fills for torchao), and for
  DCP's own ``async_save`` of plain tensors with the same byte count.

The first save of a stager allocates its buffers (cold); later saves reuse them (warm). A stager
``prepare()``d before the first save has them already: its cold row is the first save of a run.
Run: ``python benchmarks/async_save.py [--gib 0.25] [--dir /tmp] [--repeat 3] [--device cuda]`` (with
``--device cuda`` the baseline memcpy is a device-to-host copy into pinned memory).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torchao.quantization import Int8Tensor  # noqa: E402
from torchao.quantization.granularity import PerRow  # noqa: E402

from qdcp import QuantizedSavePlanner  # noqa: E402
from qdcp.adapters.base import find_adapter  # noqa: E402
from qdcp.staging.stager import QuantizedStager  # noqa: E402

SHAPE = (4096, 4096)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """Resident set size of this process, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """Samples RSS in a thread; ``peak - start`` is the growth while the block ran."""

    def __enter__(self):
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def quantized_state(gib: float) -> dict:
    """Int8Tensor weights holding about ``gib`` GiB of components (qdata, scale, zero_point)."""
    n = max(1, round(gib * 2**30 / (SHAPE[0] * SHAPE[1])))
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": Int8Tensor.from_hp(torch.randn(SHAPE, generator=g).to(torch.bfloat16),
                                                     PerRow()) for i in range(n)}


def component_bytes(state: dict) -> int:
    return sum(b.nbytes for t in state.values() for b in find_adapter(t).inner_buffers(t).values())


def plain_state(nbytes: int) -> dict:
    """Plain int8 tensors of the given total size, shaped like the quantized weights."""
    n = max(1, round(nbytes / (SHAPE[0] * SHAPE[1])))
    return {f"layers.{i}.weight": torch.randint(-128, 127, SHAPE, dtype=torch.int8) for i in range(n)}


def _tensors(state: dict):
    for v in state.values():
        yield from _tensors(v) if isinstance(v, dict) else (v,)


_memcpy_host: torch.Tensor | None = None  # the memcpy baseline's destination, kept for the whole run


def empty_host_cache() -> bool:
    """Give the pinned blocks torch's caching host allocator keeps back to the system, so that a
    stager's first save allocates (and pins) its own buffers, as the first save of a run does.
    False where this torch has no ``torch.accelerator.empty_host_cache``."""
    empty = getattr(torch.accelerator, "empty_host_cache", None)
    if empty is None:
        return False
    gc.collect()
    if torch.accelerator.is_available():
        empty()
    return True


def _host_views(srcs: list[torch.Tensor], pinned: bool) -> list[torch.Tensor]:
    """Host tensors shaped like ``srcs``, views of one buffer kept for the run. Allocated per call
    and freed, pinned destinations of exactly the components' sizes went back to torch's caching
    host allocator and became the next stager's "new" buffers: its cold save was not cold."""
    global _memcpy_host
    sizes = [-(-s.numel() * s.element_size() // 64) * 64 for s in srcs]
    if _memcpy_host is None or _memcpy_host.numel() < sum(sizes):
        _memcpy_host = None
        _memcpy_host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pinned)
        empty_host_cache()
    views, offset = [], 0
    for s, n in zip(srcs, sizes):
        views.append(_memcpy_host[offset:offset + s.numel() * s.element_size()].view(s.dtype).view(s.shape))
        offset += n
    return views


def memcpy_seconds(state: dict, repeat: int) -> float:
    """Typical (median) time to copy every tensor's bytes into already-touched CPU memory: a save
    is timed once, so its baseline is a typical copy, not the luckiest of several."""
    srcs = [b for t in _tensors(state)
            for b in (find_adapter(t).inner_buffers(t).values() if find_adapter(t) else [t])]
    cuda = srcs[0].device.type == "cuda"
    dsts = _host_views(srcs, pinned=cuda)  # host memory, pinned from a GPU
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        for d, s in zip(dsts, srcs):
            d.copy_(s, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


class TimedStager(QuantizedStager):
    """A QuantizedStager that keeps how long its last ``stage()`` call took: the part of a save's
    blocking that is qdcp's (the rest is DCP's ``async_save`` around it)."""

    stage_seconds: float | None = None

    def stage(self, state_dict):
        t0 = time.perf_counter()
        try:
            return super().stage(state_dict)
        finally:
            self.stage_seconds = time.perf_counter() - t0


def run_saves(state: dict, root: str, repeat: int, make_stager=None, planner_cls=None) -> list[dict]:
    """``repeat`` async saves, each timed against memcpys timed just before and after it (this
    machine's memory bandwidth drifts); the first save is the stager's cold one. Peak memory comes
    from a second series (a fresh stager: one cold save, one warm) sampled by a thread, which
    would otherwise compete with the copies being timed on this 2-core machine."""
    empty_host_cache()  # the pinned buffers earlier configurations freed: not this stager's to reuse
    stager = make_stager() if make_stager is not None else None
    out = [_one_save(state, root, i, stager, planner_cls, sample=False) for i in range(repeat)]
    if stager is not None:
        stager.close()
    empty_host_cache()
    stager = make_stager() if make_stager is not None else None
    mem = [_one_save(state, root, i, stager, planner_cls, sample=True)["mem"] for i in range(2)]
    if stager is not None:
        stager.close()
    for i, r in enumerate(out):
        r["mem"] = mem[min(i, 1)]
    return out


def _one_save(state: dict, root: str, i: int, stager, planner_cls, sample: bool) -> dict:
    before = memcpy_seconds(state, 2)
    path = os.path.join(root, f"ckpt{i}")
    kwargs = {"async_stager": stager} if stager is not None else {}
    if planner_cls is not None:
        kwargs["planner"] = planner_cls()
    with PeakRSS() if sample else contextlib.nullcontext() as mem:
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=path, **kwargs)
        blocked = time.perf_counter() - t0
        staged = None
        if hasattr(fut, "staging_completion"):
            fut.staging_completion.result()
            staged = time.perf_counter() - t0
            fut = fut.upload_completion
        fut.result()
        done = time.perf_counter() - t0
    memcpy = (before + memcpy_seconds(state, 2)) / 2
    shutil.rmtree(path, ignore_errors=True)
    in_stage = getattr(stager, "stage_seconds", None)
    return {"blocked": blocked / memcpy, "in_stage": in_stage / memcpy if in_stage is not None else None,
            "staged": staged, "done": done,
            "mem": mem.growth if sample else None,
            "staged_nbytes": stager.staged_nbytes if stager is not None else None}


def prepared_stager(state: dict) -> QuantizedStager:
    """A QuantizedStager whose buffers ``prepare(state)`` allocated before its first save."""
    stager = TimedStager()
    stager.prepare(state)
    return stager


def stage_only(stager: QuantizedStager, state: dict, repeat: int) -> float:
    """Median time ``stager.stage()`` alone blocks (warm buffers) / memcpy: DCP's own overhead excluded."""
    ratios = []
    for _ in range(repeat):
        memcpy = memcpy_seconds(state, 2)
        t0 = time.perf_counter()
        staged = stager.stage(state)
        blocked = time.perf_counter() - t0
        if hasattr(staged, "result"):
            staged.result()
        del staged
        stager.synchronize_staging()
        ratios.append(blocked / memcpy)
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of quantized components (default 1)")
    parser.add_argument("--dir", default=None, help="where to write checkpoints (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=5, help="saves per configuration (default 5)")
    parser.add_argument("--device", default="cpu", help="where the state lives: cpu or cuda (default cpu)")
    parser.add_argument("--only", default="", help="comma-separated configurations to run (default all): "
                        "stager, async-staging, prepared, nested, default, plain")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        # A fixed mmap threshold makes glibc return freed tensors to the OS at once, so RSS
        # growth measures what a save really holds. Re-exec with it set.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
        os.execv(sys.executable, [sys.executable] + sys.argv)

    state = {k: v.to(args.device) for k, v in quantized_state(args.gib).items()}
    nbytes = component_bytes(state)
    memcpy = memcpy_seconds(state, 3)
    print(f"{len(state)} Int8Tensor weights {SHAPE}, components {nbytes / 2**30:.3f} GiB; "
          f"memcpy {memcpy * 1e3:.1f} ms ({nbytes / memcpy / 2**30:.2f} GiB/s); "
          f"{torch.get_num_threads()} threads, accelerator: {torch.accelerator.is_available()}")
    if torch.accelerator.is_available() and not empty_host_cache():
        print(f"torch {torch.__version__} has no torch.accelerator.empty_host_cache: a configuration's cold "
              f"save may reuse the pinned buffers an earlier one freed (only the first row's cold save is cold)")

    root = tempfile.mkdtemp(prefix="qdcp-bench-", dir=args.dir)
    rows, only = [], []
    wanted = set(args.only.split(",")) if args.only else None

    def want(name: str) -> bool:
        return wanted is None or name in wanted
    try:
        for name, label, options in [("stager", "QuantizedStager", {}),
                                     ("async-staging", "QuantizedStager async_staging", {"async_staging": True})]:
            if not want(name):
                continue
            runs = run_saves(state, root, args.repeat, lambda: TimedStager(**options), QuantizedSavePlanner)
            stager = QuantizedStager(**options)
            stage_only(stager, state, 1)  # allocate its buffers
            only.append((label, stage_only(stager, state, 3)))
            staged_ratio = stager.staged_nbytes / nbytes
            stager.close()
            rows.append((label, runs, staged_ratio))
        # prepare(): the buffers allocated (and pinned) before the first save; its "cold" row is
        # the first save of a run (goal: blocks <= 2x a steady one)
        if want("prepared"):
            runs = run_saves(state, root, args.repeat, functools.partial(prepared_stager, state), QuantizedSavePlanner)
            rows.append(("QuantizedStager, prepare()d", runs, runs[0]["staged_nbytes"] / nbytes))
        # DCP checks each top-level value for Stateful (about 25 us per torchao tensor) before staging:
        # the usual {"model": ..., "optim": ...} layout pays it once
        if want("nested"):
            runs = run_saves({"model": state}, root, args.repeat, TimedStager, QuantizedSavePlanner)
            rows.append(('QuantizedStager, {"model": state}', runs, runs[0]["staged_nbytes"] / nbytes))
        # the plain call: no async_stager, DCP's DefaultStager (new_empty + a deep copy of __dict__)
        if want("default"):
            rows.append(("DCP DefaultStager, Int8Tensor", run_saves(state, root, args.repeat, None,
                                                                   QuantizedSavePlanner), None))
        del state
        if want("plain"):
            plain = {k: v.to(args.device) for k, v in plain_state(nbytes).items()}
            rows.append(("DCP DefaultStager, plain tensors", run_saves(plain, root, args.repeat), None))
            runs = run_saves(plain, root, args.repeat, TimedStager)
            rows.append(("QuantizedStager, plain tensors", runs, runs[0]["staged_nbytes"] / nbytes))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{'configuration':36} {'save':>5} {'blocked/memcpy':>15} {'in stage()':>10} {'staged s':>9} "
          f"{'done s':>7} {'peak mem/bytes':>15} {'buffers/bytes':>14}")
    for label, runs, staged_ratio in rows:
        warm = runs[1:] or runs
        summary = [("cold", runs[0]), ("warm", {k: (statistics.median(r[k] for r in warm)
                                                    if warm[0][k] is not None else None) for k in runs[0]})]
        for which, r in summary:
            staged = f"{r['staged']:9.3f}" if r["staged"] is not None else f"{'-':>9}"
            buffers = f"{staged_ratio:14.3f}" if staged_ratio is not None else f"{'-':>14}"
            in_stage = f"{r['in_stage']:10.3f}" if r["in_stage"] is not None else f"{'-':>10}"
            print(f"{label:36} {which:>5} {r['blocked']:15.3f} {in_stage} {staged} {r['done']:7.2f} "
                  f"{r['mem'] / nbytes:15.3f} {buffers}")
    for label, ratio in only:
        print(f"{label + ': stage() alone':52} {ratio:15.3f}")
    print("\nblocked/memcpy goals: <= 1.2 (sync staging, warm), <= 0.05 (async_staging). "
          "warm = median of saves 2..n, whose buffers are reused.")


if __name__ == "__main__":
    main()
