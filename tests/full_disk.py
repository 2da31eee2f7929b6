"""Saves on a real full disk: a small ext4 file system on a loop device, filled so that a save runs
out of space at a chosen point; no fault is injected in Python.

A case: checkpoint A exists; the disk is filled to leave ``free`` bytes; a save of B runs (to a new
path beside A, or ``overwrite=True`` over A) through one door (``qdcp.save``, ``qdcp.async_save``,
``dcp.save`` with ``qdcp.storage_writer``) at a path spelled one way (a local path, the same as a
``file://`` URL, or as ``local://``, fsspec's local file system, which commits by the rename rule);
then the space is freed and the same save retried. What must hold (:func:`run_case`):

- a failed save's error names ENOSPC (``No space left``);
- A loads bit-exact, and its directory holds exactly the files it held, byte for byte, unless the
  save (or its retry) replaced it; a new path that failed is not a checkpoint and holds nothing;
- no claim is left anywhere;
- the retry goes through at once, B loads bit-exact, and its directory holds only what it references.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torchao.quantization import Int8Tensor
from torchao.quantization.granularity import PerRow

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's qdcp, in a torchrun worker too
import qdcp  # noqa: E402

FILLER = ".filler"
DOORS = ("save", "async_save", "dcp_save")
SPELLINGS = ("path", "file_url", "local_url")
TARGETS = ("new", "overwrite")


@contextlib.contextmanager
def loop_disk(size_mb: int = 24):
    """A fresh ext4 file system of ``size_mb`` MiB mounted on a loop device; yields its mount point.
    Raises ``OSError`` with the reason where the machine does not allow it (not root, no loop devices)."""
    if os.geteuid() != 0:
        raise OSError("a loop mount needs root")
    work = Path(tempfile.mkdtemp(prefix="qdcp-disk-"))
    img, mnt = work / "img", work / "mnt"
    mnt.mkdir()
    try:
        with open(img, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, size_mb << 20)
        _run("mkfs.ext4", "-q", "-F", "-m", "0", str(img))
        _run("mount", "-o", "loop", str(img), str(mnt))
        try:
            yield mnt
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(*cmd: str) -> None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise OSError(f"{cmd[0]} is not installed") from e
    if p.returncode != 0:
        raise OSError(f"{' '.join(cmd)}: {p.stderr.strip() or p.returncode}")


def free_bytes(root: Path) -> int:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def fill(root: Path, free: int, block: int = 4096) -> None:
    """Leave about ``free`` bytes free on ``root``'s file system (a file of allocated blocks). The
    filler grows until the free count, read after a sync, is at most ``free``: a request for all
    that is free can fail for want of a block for the file's own extent tree (then it grows by
    halves from what it holds: a failed request may keep part of what it allocated), and ext4
    returns the blocks of files just removed at its journal's commit."""
    unfill(root)
    with open(root / FILLER, "wb") as f:
        for _ in range(200):
            os.sync()
            extra = free_bytes(root) - free
            if extra <= 0:
                time.sleep(0.02)  # once more after a pause: blocks freed late show up now
                os.sync()
                if free_bytes(root) <= free:
                    return
                continue
            while True:
                try:
                    os.posix_fallocate(f.fileno(), os.fstat(f.fileno()).st_blocks * 512, extra)
                    break
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    if extra <= block:
                        return  # not one more block fits: as full as it gets
                    extra = max(block, extra // 2 // block * block)
    raise OSError(f"{root}: could not leave {free} bytes free (the free count keeps growing)")


def unfill(root: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(root / FILLER)
    os.sync()


def model_state(seed: int, rank: int = 0, world: int = 1, layers: int = 4) -> dict:
    """``layers`` Int8Tensor Linear weights of this rank's own (64x128, per row) and a plain bias
    every rank holds alike (DCP writes it once)."""
    g = torch.Generator().manual_seed(seed)
    out = {"bias": torch.randn(128, generator=g), "step": seed}
    for r in range(world):
        gr = torch.Generator().manual_seed(seed * 100 + r)
        weights = [Int8Tensor.from_hp(torch.randn(64, 128, generator=gr), PerRow()) for _ in range(layers)]
        if r == rank:
            out.update({f"r{r}.layer{i}.weight": w for i, w in enumerate(weights)})
    return out


def spell(path: Path, how: str) -> str:
    return {"path": str(path), "file_url": f"file://{path}", "local_url": f"local://{path}"}[how]


def save(state: dict, where: str, door: str, overwrite: bool) -> None:
    """One save through ``door``; raises what the door raises."""
    if door == "save":
        qdcp.save(state, where, overwrite=overwrite)
    elif door == "async_save":
        qdcp.async_save(state, where, overwrite=overwrite).result()
    else:
        writer = qdcp.storage_writer(where, overwrite=overwrite)
        try:
            dcp.save(state, storage_writer=writer, planner=qdcp.QuantizedSavePlanner())
        finally:
            writer.abandon()


def _bits(t: torch.Tensor) -> list[torch.Tensor]:
    if type(t) is torch.Tensor:
        return [t.view(torch.int32) if t.dtype == torch.float32 else t]
    names, _ = t.__tensor_flatten__()
    return [getattr(t, n) for n in names]


def loads_as(path: Path, seed: int, rank: int, world: int) -> str | None:
    """None if the checkpoint at ``path`` loads as the save ``seed`` bit-exact, else what differs."""
    want = model_state(seed, rank, world)
    got = model_state(seed + 7919, rank, world)
    try:
        qdcp.load(got, str(path))
    except Exception as e:  # noqa: BLE001 (the failure is the finding)
        return f"{path} does not load: {type(e).__name__}: {str(e)[:300]}"
    for k, v in want.items():
        same = got[k] == v if not isinstance(v, torch.Tensor) else \
            all(torch.equal(a, b) for a, b in zip(_bits(got[k]), _bits(v), strict=True))
        if not same:
            return f"{path}: {k} differs from save {seed}"
    return None


def snapshot(path: Path) -> dict[str, bytes]:
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path))} if path.is_dir() else {}


def _names_enospc(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _claims(root: Path) -> list[str]:
    return [f"{d}/{n}" for d, _, names in os.walk(root) for n in names if n.startswith(".qdcp-save.")]


def run_case(root: Path, door: str, how: str, target: str, free: int, rank: int = 0,
             world: int = 1) -> tuple[bool, list[str]]:
    """One case (module docstring): whether the first save failed, and the problems found (rank 0
    fills and inspects the disk)."""
    a, b = root / "A", root / ("A" if target == "overwrite" else "B")
    problems: list[str] = []
    if rank == 0:
        shutil.rmtree(root / "B", ignore_errors=True)
        before = snapshot(a)
        fill(root, free)
    _barrier()
    failed: BaseException | None = None
    try:
        save(model_state(2, rank, world), spell(b, how), door, overwrite=target == "overwrite")
    except (Exception, CheckpointException) as e:  # checked below
        failed = e
    _barrier()
    if rank == 0:
        unfill(root)
        if failed is not None and not _names_enospc(failed):
            problems.append(f"the error does not name ENOSPC: {type(failed).__name__}: {str(failed)[:300]}")
        if failed is not None and snapshot(a) != before:
            problems.append(f"A's files changed: {sorted(before)} -> {sorted(snapshot(a))}")
        if failed is not None and target == "new" and snapshot(b):
            problems.append(f"the failed new path holds {sorted(snapshot(b))}")
        problems += [f"a claim was left: {c}" for c in _claims(root)]
    _barrier()
    problems += [p for p in [loads_as(a, 2 if failed is None and target == "overwrite" else 1, rank, world)] if p]
    if failed is not None:
        try:
            save(model_state(2, rank, world), spell(b, how), door, overwrite=target == "overwrite")
        except (Exception, CheckpointException) as e:  # the finding
            problems.append(f"the retry failed: {type(e).__name__}: {str(e)[:300]}")
    _barrier()
    b_problem = loads_as(b, 2, rank, world)
    problems += [b_problem] if b_problem else []
    if rank == 0:
        extra = set(os.listdir(b)) - {".metadata"} - _referenced(b) if b_problem is None else set()
        problems += [f"{b} holds files it does not reference: {sorted(extra)}"] if extra else []
        if target == "overwrite":
            reset(root, world)
    _barrier()
    return failed is not None, [f"{door}/{how}/{target}/free={free}: {p}" for p in problems]


def _referenced(path: Path) -> set[str]:
    md = qdcp.read_metadata(str(path))
    return {i.relative_path for i in md.storage_data.values()}


def reset(root: Path, world: int) -> None:
    """Make A the save 1 of ``world`` ranks again (written by rank 0 alone, as one process would)."""
    shutil.rmtree(root / "A", ignore_errors=True)
    state: dict = {}
    for r in range(world):
        state.update(model_state(1, r, world))
    qdcp.save(state, str(root / "A"), no_dist=True)


def save_size(root: Path, world: int) -> int:
    """Bytes of disk a save of B takes (measured: a save to a scratch path on this disk)."""
    before = free_bytes(root)
    state: dict = {}
    for r in range(world):
        state.update(model_state(2, r, world))
    qdcp.save(state, str(root / "measure"), no_dist=True)
    os.sync()
    used = before - free_bytes(root)
    shutil.rmtree(root / "measure")
    os.sync()
    return used


def sweep(size: int, points: int, block: int = 4096) -> list[int]:
    """``points`` free-space amounts from none to past the whole save, the last few blocks (where
    the commit runs out) each taken."""
    step = max(block, size // max(1, points - 6) // block * block)
    near = [size - k * block for k in range(4, -3, -1)]
    return sorted({max(0, f) for f in list(range(0, size, step)) + near})
