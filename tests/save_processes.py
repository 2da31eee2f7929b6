"""Helpers for tests that save from several processes: long-lived tests/save_worker.py processes
driven line by line, and what their checkpoints must load as."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import qdcp
from save_worker import full_state

WORKER = Path(__file__).with_name("save_worker.py")


class Worker:
    """One tests/save_worker.py process (``dist``: ``(root, rank, world)`` for a rank of a job)."""

    def __init__(self, dist: tuple[str, int, int] | None = None) -> None:
        args = [sys.executable, str(WORKER)] + (["--dist", *map(str, dist)] if dist else [])
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        self.pid = None
        self.pending = 0  #: commands sent whose answer is not read yet

    def ready(self, timeout: float = 180) -> "Worker":
        """Wait until it has imported torch (and joined its job)."""
        if self.pid is None:
            self.pid = self._line(timeout)["ready"]
        return self

    def _line(self, timeout: float) -> dict:
        deadline = time.time() + timeout
        while True:
            left = deadline - time.time()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError(f"save worker {self.proc.pid} did not answer in {timeout} s")
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"save worker {self.proc.pid} exited ({self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def send(self, **cmd) -> None:
        """Start a command (``op`` defaults to ``save``); :meth:`result` waits for its answer."""
        cmd.setdefault("op", "save")
        cmd = {k: os.fspath(v) if isinstance(v, Path) else v for k, v in cmd.items()}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        self.pending += 1

    def result(self, timeout: float = 180) -> dict:
        """The answer to the oldest command not answered yet."""
        answer = self._line(timeout)
        self.pending -= 1
        return answer

    def drain(self, timeout: float = 180) -> None:
        """Read the answers a failed test left unread (so the next test reads its own)."""
        while self.pending and self.proc.poll() is None:
            self.result(timeout)

    def save(self, **cmd) -> dict:
        """Run one save and return its answer."""
        self.send(**cmd)
        return self.result()

    def kill(self) -> None:
        """SIGKILL it (and reap it)."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self) -> None:
        """End it (it holds nothing between commands: no need to wait for a clean exit)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


def release(workers, *holds: Path) -> None:
    """After a test: let every held save go on and read what it answered (a test that failed
    midway leaves them waiting)."""
    for hold in holds:
        hold.touch()
    for w in workers:
        w.drain()


def wait_for(path: str | os.PathLike, timeout: float = 120) -> None:
    """Wait until ``path`` exists."""
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout} s")
        time.sleep(0.01)


def assert_loads_as(path, seed: int, n: int, world: int = 1, **storage_options) -> None:
    """The checkpoint at ``path`` loads bit-exact as the save ``seed`` (every rank's entries), and
    its metadata records a checksum of every item (made by the writer from every rank's writes)."""
    md = qdcp.read_metadata(path, **storage_options)
    assert set(qdcp.checksums.record(md).items) == set(md.state_dict_metadata)
    want = full_state(seed, n, world)
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in want.items()}
    qdcp.load(got, path, storage_options=storage_options or None)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k].view(torch.int32), v.view(torch.int32)), k
        else:
            assert got[k] == v, k


def claim_of(path) -> dict:
    """The claim file's record in checkpoint directory ``path``."""
    return json.loads((Path(path) / ".qdcp-save.claim").read_text())


def data_files(path) -> list[str]:
    """The ``*.distcp`` files in ``path``, sorted."""
    return sorted(n for n in os.listdir(path) if n.endswith(".distcp"))


def referenced(path, **storage_options) -> list[str]:
    """The data files the checkpoint's ``.metadata`` references, sorted."""
    md = qdcp.read_metadata(path, **storage_options)
    return sorted({i.relative_path for i in md.storage_data.values()})
