"""Running ``torchrun`` jobs from pytest: free ports, once-per-session jobs shared by xdist workers.

A job runs a worker script at N ranks; the worker writes ``results-<command>-<N>.json`` holding
``{section: [failures]}`` (and ``crash`` if it died). :func:`job` runs each (command, N) once per
session under a file lock in a directory every xdist worker sees, and returns its record;
:func:`check_sections` asserts on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(worker: Path, command: str, nproc: int, root: Path, timeout_s: int) -> tuple[int, str, float]:
    """Run ``worker command root`` at ``nproc`` ranks (retrying a port taken meanwhile)."""
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": "1",
        # torchao's low-bit optimizers torch.compile their step; on CPU, inductor compiles C++ per
        # shard shape (minutes on 2 cores). Eager runs the same step function.
        "TORCHDYNAMO_DISABLE": env.get("TORCHDYNAMO_DISABLE", "1"),
        "QDCP_WORKER_TIMEOUT": str(timeout_s - 30),
        "PYTHONUNBUFFERED": "1",
    })
    for attempt in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(worker), command, str(root)]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)  # torchrun starts each rank in a session of its own
            out, _ = proc.communicate()
            out += f"\n[torchrun_jobs] torchrun killed after {timeout_s} s"
        elapsed = time.monotonic() - start
        if proc.returncode != 0 and "address already in use" in out.lower() and attempt < 2:
            continue  # another job took the port between free_port and torchrun's bind
        return proc.returncode, out, elapsed
    raise AssertionError("unreachable")


def _children() -> dict[int, list[int]]:
    """``{ppid: [pid, ...]}`` of the processes now running (from /proc)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process descended from ``pid``."""
    tree, todo, found = _children(), [pid], []
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(tree.get(p, ()))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for p in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A directory every xdist worker of this session sees (under the session's base temp)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / name
    path.mkdir(exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Worker:
    """A worker script beside the tests: ``worker(root, command, nproc)`` is :func:`job` of it (each
    ``(command, nproc)`` run once per session, its files in ``root``, e.g. the module's ``shared_dir``).

    ``together`` maps a world size to groups of commands that share one launch there (torchrun and
    the ranks' imports cost seconds each on the CI's 2 cores): the first test that needs any of them
    runs them all, in the group's order, in the same processes (worker_results.run), and each test
    reads its own command's results. Group only commands that read nothing a command of their group
    writes."""

    def __init__(self, script: str, timeout_s: int = 240,
                 together: dict[int, list[tuple[str, ...]]] | None = None) -> None:
        self.path = Path(__file__).with_name(script)
        self.timeout_s = timeout_s
        self.together = together or {}

    def __call__(self, root: Path, command: str, nproc: int) -> dict:
        group = next((g for g in self.together.get(nproc, ()) if command in g), None)
        if group is None or len(group) == 1:
            return job(root, self.path, command, nproc, self.timeout_s)
        record = job(root, self.path, "+".join(group), nproc, self.timeout_s * len(group))
        return {**record, "results": record["results"][command]}

    def recorded(self, root: Path, command: str, nproc: int, name: str) -> dict:
        """The JSON the job wrote to ``root / name`` (what it observed), after checking that it
        did not crash (its sections are not required to pass)."""
        check_sections(self(root, command, nproc), f"{command} at {nproc} ranks", [], require_all=False)
        return json.loads((root / name).read_text())


def job(root: Path, worker: Path, command: str, nproc: int, timeout_s: int) -> dict:
    """Run (once per session) ``command`` at ``nproc`` ranks with its files in ``root``; its record."""
    root.mkdir(exist_ok=True)
    key = f"{command}-{nproc}"
    record_path = root / f"record-{key}.json"
    with _locked(root / f"lock-{key}"):
        if not record_path.exists():
            rc, out, elapsed = torchrun(worker, command, nproc, root, timeout_s)
            results = _results(root, command, nproc)
            if "+" in command:  # one launch of several commands: each one's results
                results = {c: _results(root, c, nproc) for c in command.split("+")}
            record = {"rc": rc, "tail": out[-6000:], "seconds": round(elapsed, 1), "results": results}
            record_path.write_text(json.dumps(record))
        return json.loads(record_path.read_text())


def _results(root: Path, command: str, nproc: int) -> dict | None:
    path = root / f"results-{command}-{nproc}.json"
    return json.loads(path.read_text()) if path.exists() else None


def explain(record: dict, what: str) -> str:
    return f"{what}: torchrun exit {record['rc']} after {record['seconds']} s; output tail:\n{record['tail']}"


def check_sections(record: dict, what: str, names, *, require_all: bool = True) -> None:
    """Assert that the job ran to the end and every section in ``names`` had no failure."""
    results = record["results"]
    assert results is not None, explain(record, f"{what}: the job wrote no results")
    assert not results.get("crash"), explain(record, f"{what}: the job crashed: {results['crash'][:3]}")
    failed = {}
    for name in names:
        if require_all:
            assert name in results, f"{what}: section {name!r} never ran (sections: {sorted(results)})"
        if results.get(name):
            failed[name] = results[name]
    if failed:
        lines = [f"{name}: {len(msgs)} failure(s)\n    " + "\n    ".join(msgs[:15])
                 for name, msgs in failed.items()]
        pytest.fail(f"{what}:\n" + "\n".join(lines), pytrace=False)
