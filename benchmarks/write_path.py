"""The write path against the storage's own limit: qdcp's saves / fsync'd writes of the same bytes.

Builds Int8Tensor weights (4096x4096, per-row scales) holding ``--gib`` GiB of components on
``--device`` and times, interleaved, best of ``--repeat`` (each after ``os.sync()``, its directory
fresh), in ONE run:

- the storage's own bandwidth for the same bytes (the components' bytes, from host memory): written
  with plain ``write`` calls and fsync'd, into 1 file and into ``--files`` files on as many threads
  (the anchor), and into ``--files`` files with writeback started after each buffer as qdcp's
  pipeline starts it (``posix_fadvise(POSIX_FADV_DONTNEED)``: the disk writes while the next
  buffer is written);
- vanilla ``dcp.save`` of plain tensors with the same bytes (the components cloned), through
  ``FileSystemWriter`` at its defaults (``thread_count=1``) and at ``thread_count=--files``;
- ``dcp.save(state, planner=QuantizedSavePlanner())`` (DCP's own writer);
- ``qdcp.save`` (synchronous) and ``qdcp.async_save`` (the whole save: the call until its future is
  done), both at qdcp's defaults (the sync save buffered; the async one with direct writes,
  :mod:`qdcp.io.direct`, on a host of fewer than 8 usable cores, buffered on more), the sync
  save again direct (``direct_io=True``) and the async one both ways (``direct_io=True`` / ``False``);
  ``async_save`` also with a ``QuantizedStager`` kept across saves (its steady state: buffers reused);
- the staging copy alone (``QuantizedStager.stage`` into kept buffers): DCP starts an async save's
  upload only once staging has returned, so storage / (storage + staging) bounds the whole save;
- with ``--fsspec``: the same bytes written through fsspec (``file://``, fsync'd) and ``qdcp.save``
  to that URL (qdcp's fsspec writer).

Prints GiB/s per case (best run), each save's ratio to vanilla ``dcp.save`` (thread_count=1) and to
the storage's parallel bandwidth (best runs, and medians: a virtual disk's buffered writes vary
from run to run), and the CPU seconds each takes (median; user + system time of the process: what
a save running beside training takes from its cores; buffered writes copy every byte into the page
cache there, qdcp's direct writes do not). Goals: ``qdcp.save`` >= 1.0x vanilla; a whole save at
qdcp's defaults >= 0.85x the storage.

    python benchmarks/write_path.py [--gib 1] [--device cpu|cuda] [--files 4] [--repeat 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import threading
import time
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp

import qdcp
from common import add_profile_argument, device_of, plain_twin, profile, quantized_state
from qdcp import QuantizedSavePlanner, QuantizedStager
from qdcp.adapters.base import find_adapter
from qdcp.io.pipeline import DIRECT_UPLOAD_BELOW_CORES, usable_cores


def host_bytes(state: dict) -> list[torch.Tensor]:
    """The components' bytes as flat uint8 host tensors (what the storage anchor writes)."""
    out = []
    for t in state.values():
        adapter = find_adapter(t)
        for b in (adapter.inner_buffers(t).values() if adapter else [t]):
            out.append(b.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    return out


def split(buffers: list[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
    """``buffers`` in ``n`` groups of about equal bytes (largest first into the lightest group)."""
    groups: list[list[torch.Tensor]] = [[] for _ in range(n)]
    sizes = [0] * n
    for b in sorted(buffers, key=lambda b: -b.numel()):
        i = sizes.index(min(sizes))
        groups[i].append(b)
        sizes[i] += b.numel()
    return [g for g in groups if g]


def _write_fsynced(opener: Callable[[str], object], path: str, group: list[torch.Tensor],
                   early: bool = False) -> None:
    with opener(path) as f:
        done = 0
        for b in group:
            f.write(memoryview(b.numpy()))
            if early and hasattr(os, "posix_fadvise"):  # Linux; elsewhere the plain anchor again
                f.flush()
                os.posix_fadvise(f.fileno(), done, f.tell() - done, os.POSIX_FADV_DONTNEED)
                done = f.tell()
        f.flush()
        try:
            os.fsync(f.fileno())
        except (AttributeError, OSError, ValueError):  # a file object without a descriptor
            os.sync()


def write_files(buffers: list[torch.Tensor], directory: str, n: int, opener=None, early: bool = False) -> None:
    """Write ``buffers`` into ``n`` files on ``n`` threads, each fsync'd before it is closed
    (``early``: writeback started after each buffer)."""
    opener = opener or (lambda p: open(p, "wb"))
    os.makedirs(directory, exist_ok=True) if "://" not in directory else None
    threads = [threading.Thread(target=_write_fsynced, args=(opener, f"{directory}/part{i}", g, early))
               for i, g in enumerate(split(buffers, n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # this process's threads, the kernel's work for them included
    return r.ru_utime + r.ru_stime


def timed(cases: dict[str, tuple[Callable[[], object], Callable[[], object]]], repeat: int) -> dict[str, list]:
    """Each ``(fn, cleanup)``'s runs over ``repeat`` interleaved rounds: ``[(wall s, CPU s)]`` (CPU:
    user + system time of this process, what the save takes from the cores training runs on);
    ``cleanup`` runs untimed before and after each run, then ``os.sync()``."""
    runs: dict[str, list] = {k: [] for k in cases}
    for r in range(repeat):
        for name in (list(cases) if r % 2 == 0 else list(reversed(cases))):
            fn, cleanup = cases[name]
            cleanup()
            os.sync()
            c0, t0 = _cpu_seconds(), time.perf_counter()
            fn()
            runs[name].append((time.perf_counter() - t0, _cpu_seconds() - c0))
            print(f"  {name}: {runs[name][-1][0]:.3f} s, CPU {runs[name][-1][1]:.2f} s", flush=True)  # as it goes
            cleanup()
    return runs


def beside_training(save: Callable[[], object], rounds: int, device: torch.device) -> list[tuple[float, float]]:
    """Training beside an async save's upload: ``[(steps/s while the upload runs / steps/s alone,
    upload seconds)]`` per round; a "step" is a 768x768 matmul on ``device`` (the cores' or the
    accelerator's work a training loop does while its checkpoint is written)."""
    a, b = torch.randn(768, 768, device=device), torch.randn(768, 768, device=device)

    def steps(stop: Callable[[], bool]) -> tuple[int, float]:
        k, t0 = 0, time.perf_counter()
        while not stop():
            a @ b
            if device.type != "cpu":
                torch.accelerator.synchronize()
            k += 1
        return k, time.perf_counter() - t0

    deadline = time.perf_counter() + 1.0
    k, t = steps(lambda: time.perf_counter() > deadline)
    alone = k / t
    out = []
    for _ in range(rounds):
        fut = save()
        upload = getattr(fut, "upload_completion", fut)
        k, t = steps(upload.done)
        upload.result()
        out.append((k / t / alone, t))
    return out


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of quantized components (default 1)")
    ap.add_argument("--device", default="cpu", help="where the state lives: cpu or cuda (default cpu)")
    ap.add_argument("--files", type=int, default=4, help="files/threads of the storage's parallel anchor")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; each case's best is kept (default 3)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    ap.add_argument("--fsspec", action=argparse.BooleanOptionalAction, default=True,
                    help="also the fsspec storage (file:// URL) and its anchor (default on)")
    ap.add_argument("--only", action="append", default=[], metavar="CASE",
                    help="time only these cases (and the anchors: storage, vanilla thread_count=1)")
    add_profile_argument(ap)
    args = ap.parse_args()
    device = device_of(args.device)

    state = {k: v.to(device) for k, v in quantized_state("int8", 2 * args.gib).items()}
    twin = plain_twin(state)
    raw = host_bytes(state)
    nbytes = sum(b.numel() for b in raw)
    root = tempfile.mkdtemp(prefix="qdcp-write-", dir=args.dir)
    d = {k: os.path.join(root, k) for k in ("raw", "vanilla", "q")}
    url = "file://" + os.path.join(root, "fs")
    clean = lambda *paths: lambda: [shutil.rmtree(p, ignore_errors=True) for p in paths]  # noqa: E731
    kept, copier = QuantizedStager(), QuantizedStager()
    whole = lambda fut: getattr(fut, "upload_completion", fut).result()  # noqa: E731
    files = args.files
    buffered, direct = {"direct_io": False}, {"direct_io": True}
    cases = {
        "storage, 1 file": (lambda: write_files(raw, d["raw"], 1), clean(d["raw"])),
        f"storage, {files} files": (lambda: write_files(raw, d["raw"], files), clean(d["raw"])),
        f"storage, {files} files, early writeback": (lambda: write_files(raw, d["raw"], files, early=True),
                                                     clean(d["raw"])),
        "vanilla dcp.save (thread_count=1)": (lambda: dcp.save(twin, storage_writer=dcp.FileSystemWriter(d["vanilla"])),
                                             clean(d["vanilla"])),
        f"vanilla dcp.save (thread_count={files})": (
            lambda: dcp.save(twin, storage_writer=dcp.FileSystemWriter(d["vanilla"], thread_count=files)),
            clean(d["vanilla"])),
        "dcp.save + QuantizedSavePlanner": (lambda: dcp.save(state, checkpoint_id=d["q"],
                                                             planner=QuantizedSavePlanner()), clean(d["q"])),
        "qdcp.save": (lambda: qdcp.save(state, d["q"]), clean(d["q"])),
        "qdcp.async_save (whole save)": (lambda: whole(qdcp.async_save(state, d["q"])), clean(d["q"])),
        "qdcp.async_save, kept stager": (lambda: whole(qdcp.async_save(state, d["q"], stager=kept)), clean(d["q"])),
        # the sync save direct; the async one each way (its default is one of them: which, by cores)
        "qdcp.save, direct_io=True": (lambda: qdcp.save(state, d["q"], storage_options=direct),
                                      clean(d["q"])),
        "qdcp.async_save (whole), direct_io=True": (
            lambda: whole(qdcp.async_save(state, d["q"], storage_options=direct)), clean(d["q"])),
        "qdcp.async_save (whole), direct_io=False": (
            lambda: whole(qdcp.async_save(state, d["q"], storage_options=buffered)), clean(d["q"])),
        # what an async save does before DCP starts its upload: the staging copy alone (kept buffers)
        "staging copy alone (QuantizedStager.stage)": (lambda: copier.stage(state), lambda: None),
    }
    if args.fsspec:
        import fsspec

        fs = fsspec.filesystem("file")
        cases[f"storage via fsspec, {files} files"] = (
            lambda: (fs.makedirs(url, exist_ok=True), write_files(raw, url, files, lambda p: fs.open(p, "wb"))),
            clean(url[len("file://"):]))
        cases["qdcp.save (fsspec file://)"] = (lambda: qdcp.save(state, url), clean(url[len("file://"):]))
    if args.only:
        keep = {f"storage, {files} files", f"storage, {files} files, early writeback",
                "vanilla dcp.save (thread_count=1)", "staging copy alone (QuantizedStager.stage)", *args.only}
        cases = {k: v for k, v in cases.items() if k in keep or (args.fsspec and k.startswith("storage via"))}
    cores = usable_cores()
    print(f"{len(state)} Int8Tensor weights on {device}, {nbytes / 2**30:.3f} GiB of components; "
          f"{os.cpu_count()} CPUs; writing under {root}; best of {args.repeat}; an async upload's default "
          f"here: {'direct' if cores < DIRECT_UPLOAD_BELOW_CORES else 'buffered'} writes ({cores} usable "
          f"cores; direct below {DIRECT_UPLOAD_BELOW_CORES})")
    try:
        # steady state, as a run's periodic checkpoints: every stager's buffers allocated (pinned
        # on a GPU: 0.66 s per GiB on an H100) before timing; a run's first save is async_save.py's
        kept.prepare(state)
        copier.prepare(state)
        whole(qdcp.async_save(state, d["q"]))  # the writers' shared stager
        clean(d["q"])()
        runs = timed(cases, args.repeat)
        times = {k: min(t for t, _ in v) for k, v in runs.items()}
        training = {}
        for name, opts in (() if args.only else (("direct (direct_io=True)", direct),
                                                  ("buffered (direct_io=False)", buffered))):
            def save(opts=opts):
                shutil.rmtree(d["q"], ignore_errors=True)
                os.sync()
                return qdcp.async_save(state, d["q"], storage_options=opts)

            training[name] = beside_training(save, args.repeat, device)
        for name in args.profile:
            fn, cleanup = cases[name]
            cleanup()
            profile(name, fn)
            cleanup()
    finally:
        kept.close()
        copier.close()
        shutil.rmtree(root, ignore_errors=True)
    disk = times[f"storage, {files} files"]
    fs_disk = times.get(f"storage via fsspec, {files} files")
    vanilla = times["vanilla dcp.save (thread_count=1)"]
    medians = {k: median([t for t, _ in v]) for k, v in runs.items()}
    fs_med = medians.get(f"storage via fsspec, {files} files")
    print(f"\n{'case':44} {'GiB/s':>7} {'/ vanilla':>10} {'/ storage':>10} {'median: / storage':>18} {'CPU s':>6}")
    for name, t in times.items():
        anchor = fs_disk if "fsspec" in name and fs_disk else disk
        anchor_med = fs_med if "fsspec" in name and fs_med else medians[f"storage, {files} files"]
        cpu = median([c for _, c in runs[name]])
        print(f"{name:44} {nbytes / t / 2**30:7.3f} {vanilla / t:10.2f} {anchor / t:10.2f} "
              f"{anchor_med / medians[name]:18.2f} {cpu:6.2f}")
    early = times[f"storage, {files} files, early writeback"]
    for name in ("qdcp.save", "qdcp.async_save (whole save)"):
        if name in times:
            print(f"{name} / storage with early writeback: {early / times[name]:.2f}")
    staging = times["staging copy alone (QuantizedStager.stage)"]
    print(f"storage / (storage + the staging copy): {disk / (disk + staging):.2f} (DCP starts an async save's "
          f"upload once staging has returned: the most an async whole save can reach here)")
    if training:
        print("\ntraining beside qdcp.async_save's upload (steps/s / steps/s alone; upload seconds):")
        for name, rounds in training.items():
            print(f"  {name:28} " + ", ".join(f"{r:.2f}x ({t:.2f} s)" for r, t in rounds)
                  + f"; median {median([r for r, _ in rounds]):.2f}x")
    print(f"goals: qdcp.save / vanilla >= 1.0; whole save at qdcp's defaults / storage ({files} files) >= 0.85 "
          f"(fsspec: / storage via fsspec)")


if __name__ == "__main__":
    main()
