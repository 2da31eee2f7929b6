"""A process that saves checkpoints on command, for tests of saves from several processes (run by
tests/test_save_claims.py and tests/test_save_claims_dist.py).

    python tests/save_worker.py                       # one process
    python tests/save_worker.py --dist ROOT RANK WORLD  # one rank of a job (gloo over a FileStore in ROOT)

It reads one JSON command per line on stdin and answers one JSON line on stdout, so a test keeps a
few processes (torch imported once) and drives saves in them at chosen moments:

- ``{"op": "save", "path", "seed", "n", "overwrite", "hold", "fail_rank", "fsize"}``: ``qdcp.save``
  of :func:`state` (``n`` elements per rank). ``hold``: once data is being written (the claim
  taken), create ``<hold>.<rank>.waiting`` and wait for the file ``hold`` to exist. ``fail_rank``:
  that rank's write raises. ``fsize``: limit the size of files this process writes (RLIMIT_FSIZE:
  the OS then fails the write with EFBIG). ``enospc_after``: an injected fault, data files whose
  ``write`` fails with ENOSPC after that many bytes and whose ``close`` does not fail again.
- ``{"op": "pid"}``.

Answers: ``{"ok": true}`` or ``{"ok": false, "type", "message", "errno", "chain"}`` (``chain``: the
type names along ``__cause__`` / ``__context__``).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import resource
import signal
import sys
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.filesystem import FileSystem  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import qdcp  # noqa: E402
from qdcp import checkpoint as front_door  # noqa: E402
from qdcp.io import direct  # noqa: E402


def state(seed: int, n: int, rank: int = 0, world: int = 1) -> dict:
    """What a save of ``seed`` holds at ``rank`` of ``world``: a tensor every rank holds the same
    (DCP writes it once), one of this rank's own, and the step."""
    g = torch.Generator().manual_seed(seed)
    out = {"shared": torch.randn(n, generator=g), "step": seed}
    for r in range(world):
        mine = torch.randn(n, generator=torch.Generator().manual_seed(seed * 1000 + r))
        if r == rank:
            out[f"rank{r}"] = mine
    return out


def full_state(seed: int, n: int, world: int = 1) -> dict:
    """Every rank's entries of the save ``seed`` (what a one-process load of it gets)."""
    out: dict = {}
    for r in range(world):
        out.update(state(seed, n, r, world))
    return out


class _Planner(qdcp.QuantizedSavePlanner):
    """qdcp's save planner, pausing (``hold``) or failing (``fail``) at the first item written."""

    def __init__(self, hold: str | None, fail: bool, rank: int) -> None:
        super().__init__()
        self.hold, self.fail, self.rank, self.started = hold, fail, rank, False

    def resolve_data(self, write_item):
        if not self.started:
            self.started = True
            if self.fail:
                raise RuntimeError(f"injected failure on rank {self.rank}")
            if self.hold:
                open(f"{self.hold}.{self.rank}.waiting", "w").close()
                deadline = time.time() + 120
                while not os.path.exists(self.hold) and time.time() < deadline:
                    time.sleep(0.01)
        return super().resolve_data(write_item)


class _FullDisk(io.RawIOBase):
    """A data file on a disk that fills after ``room`` bytes: ``write`` then fails with ENOSPC, and
    ``close`` does not fail again (as some storages behave)."""

    def __init__(self, f, room: int) -> None:
        super().__init__()
        self.f, self.room = f, room

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = memoryview(b).nbytes
        if n > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return self.f.write(b)

    def tell(self) -> int:
        return self.f.tell()

    def fileno(self) -> int:
        return self.f.fileno()


@contextlib.contextmanager
def _disk_full_after(room: int | None):
    """DCP's file system writes data files onto a disk with ``room`` bytes left (None: as it is)."""
    if room is None:
        yield
        return
    real, real_write = FileSystem.create_stream, direct.DirectFile.write

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            yield _FullDisk(stream, room) if "w" in mode and str(path).endswith(".distcp") else stream

    def write(self, b):  # qdcp's direct data files (qdcp.io.direct), on the same disk
        n, left = memoryview(b).nbytes, getattr(self, "_room", room)
        if n > left:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room = left - n
        return real_write(self, b)

    FileSystem.create_stream, direct.DirectFile.write = create_stream, write
    try:
        yield
    finally:
        FileSystem.create_stream, direct.DirectFile.write = real, real_write


def _save(cmd: dict, rank: int, world: int) -> None:
    if cmd.get("fsize"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (cmd["fsize"], resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    real = front_door.QuantizedSavePlanner
    if cmd.get("hold") or cmd.get("fail_rank") is not None:  # qdcp.save as a user calls it, with these hooks
        planner = _Planner(cmd.get("hold"), cmd.get("fail_rank") == rank, rank)
        front_door.QuantizedSavePlanner = lambda **kw: planner
    try:
        with _disk_full_after(cmd.get("enospc_after")):
            qdcp.save(state(cmd["seed"], cmd["n"], rank, world), cmd["path"], overwrite=cmd.get("overwrite", False),
                      storage_options=cmd.get("storage_options"))
    finally:
        front_door.QuantizedSavePlanner = real
        if cmd.get("fsize"):
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, hard))


def _answer(e: BaseException | None) -> dict:
    if e is None:
        return {"ok": True}
    chain, seen, c = [], set(), e
    while c is not None and id(c) not in seen:
        seen.add(id(c))
        chain.append(f"{type(c).__name__}:{getattr(c, 'errno', None)}")
        c = c.__cause__ if c.__cause__ is not None else c.__context__
    return {"ok": False, "type": type(e).__name__, "message": str(e), "errno": getattr(e, "errno", None),
            "chain": chain}


def main() -> None:
    rank, world = 0, 1
    if sys.argv[1:2] == ["--dist"]:
        root, rank, world = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, "store"), world),
                                rank=rank, world_size=world)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "pid":
            print(json.dumps({"pid": os.getpid()}), flush=True)
            continue
        try:
            _save(cmd, rank, world)
            err = None
        except BaseException as e:  # noqa: BLE001 (reported to the test)
            err = e
        print(json.dumps(_answer(err)), flush=True)


if __name__ == "__main__":
    main()
