"""A run's checkpoints (qdcp/runs.py, ``qdcp list`` / ``qdcp prune``), on real checkpoints: the
latest complete one is found past a killed save, a damaged one and one being written; pruning
keeps the last K and the newest, never touches one being written, a damaged one, or what qdcp did
not write, and removes what failed saves left (a killed save's files and claim, an empty step
directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from cli_in_process import qdcp_cli
from qdcp.storage import claims
from quantized_cases import CASE_BY_NAME

INT8 = CASE_BY_NAME["int8_row"]
REPO = Path(__file__).resolve().parent.parent
OLD = time.time() - 3600  # an hour ago: past runs.ACTIVE_GRACE_S


def _state(step: int) -> dict:
    return {"model": {"0.weight": INT8.make(step), "0.bias": torch.full((8,), float(step))}, "step": step}


def _age(path: Path) -> None:
    for p in [*path.iterdir(), path]:
        os.utime(p, (OLD, OLD))


def _killed_save(path: Path) -> None:
    """A real qdcp save killed after writing its data, before its commit (SIGKILL-like: os._exit)."""
    code = ("import os, torch, qdcp\nfrom qdcp.storage import commit\n"
            "commit.publish_local = lambda *a, **k: os._exit(9)\n"
            f"qdcp.save({{'w': torch.randn(64, 64)}}, {str(path)!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 9, proc.stderr[-3000:]


@pytest.fixture
def run(tmp_path):
    """step_1..step_4 complete (qdcp.save), step_5 empty (a save killed before writing), step_7 a
    save killed before its commit, step_8 being written (its claim held), step_9 damaged (a data
    file cut short), step_6 complete by stock DCP, logs/ (not a checkpoint)."""
    root = tmp_path / "run"
    root.mkdir()
    for step in (1, 2, 3, 4):
        qdcp.save(_state(step), root / f"step_{step}")
        _age(root / f"step_{step}")
        os.utime(root / f"step_{step}" / ".metadata", (OLD + step, OLD + step))
    (root / "step_5").mkdir()
    _killed_save(root / "step_7")
    (root / "step_8").mkdir()
    held = claims.take(claims.LocalStore(root / "step_8"), "a qdcp save of 2 ranks (train.py)")
    qdcp.save(_state(9), root / "step_9")
    data = next(p for p in (root / "step_9").iterdir() if p.name.endswith(".distcp"))
    os.truncate(data, data.stat().st_size - 1)
    dcp.save({"w": torch.ones(4)}, checkpoint_id=root / "step_6")
    (root / "logs").mkdir()
    (root / "logs" / "notes.txt").write_text("mine")
    for name in ("step_5", "step_7", "step_6", "logs"):
        _age(root / name)
    yield root, held
    held.release()


def _states(root: Path) -> list[tuple[str, int | None, str]]:
    return [(os.path.basename(c.path), c.step, c.state) for c in qdcp.checkpoints(root)]


def test_checkpoints_lists_each_with_its_state_and_latest_is_the_last_complete(run):
    root, _ = run
    assert _states(root) == [("step_1", 1, "complete"), ("step_2", 2, "complete"), ("step_3", 3, "complete"),
                             ("step_4", 4, "complete"), ("step_5", 5, "failed"), ("step_6", 6, "complete"),
                             ("step_7", 7, "failed"), ("step_8", 8, "writing"), ("step_9", 9, "damaged")]
    found = {os.path.basename(c.path): c for c in qdcp.checkpoints(root)}
    assert [n for n, c in found.items() if c.by_qdcp] == ["step_1", "step_2", "step_3", "step_4", "step_7",
                                                           "step_8", "step_9"]
    data_file = next(n for n in os.listdir(root / "step_9") if n.endswith(".distcp"))
    assert found["step_9"].why.endswith(f"lie outside {data_file!r} ({(root / 'step_9' / data_file).stat().st_size} "
                                        f"bytes)"), found["step_9"].why
    assert "pid" in found["step_8"].why and found["step_4"].nbytes == sum(
        p.stat().st_size for p in (root / "step_4").iterdir())
    assert qdcp.latest(root) == str(root / "step_6")  # stock DCP's checkpoint is complete too
    (root / "step_6" / ".metadata").unlink()
    assert qdcp.latest(root) == str(root / "step_4")
    got = _state(0)
    qdcp.load(got, qdcp.latest(root))
    assert got["step"] == 4


def test_prune_keeps_the_last_k_and_removes_failed_saves_leftovers_only(run):
    root, _ = run
    before = {p: sorted(os.listdir(p)) for p in root.iterdir()}
    would = qdcp.prune(root, keep=2, dry_run=True)
    # the last 2 complete: step_4 and step_6 (stock DCP's: kept, counted, never removed)
    assert would == [str(root / n) for n in ("step_1", "step_2", "step_3", "step_5", "step_7")]
    assert {p: sorted(os.listdir(p)) for p in root.iterdir()} == before  # a dry run removes nothing
    assert qdcp.prune(root, keep=2) == would
    assert sorted(p.name for p in root.iterdir()) == ["logs", "step_4", "step_6", "step_8", "step_9"]
    assert os.listdir(root / "step_8") == [".qdcp-save.claim"] and os.listdir(root / "logs") == ["notes.txt"]
    got = _state(0)
    qdcp.load(got, root / "step_4")
    assert got["step"] == 4
    assert qdcp.prune(root, keep=2) == []


def test_prune_never_removes_the_newest_written_nor_what_qdcp_did_not_write(tmp_path):
    root = tmp_path / "run"
    for step in (10, 20, 30):
        qdcp.save(_state(step), root / f"step_{step}")
        os.utime(root / f"step_{step}" / ".metadata", (OLD + step, OLD + step))
    os.utime(root / "step_10" / ".metadata")  # re-saved last (a resumed run): the newest written
    (root / "step_20" / "README").write_text("notes of mine")
    with pytest.raises(ValueError, match="keep at least 1"):
        qdcp.prune(root, keep=0)
    assert qdcp.prune(root, keep=1) == [str(root / "step_20")]
    assert sorted(p.name for p in root.iterdir()) == ["step_10", "step_20", "step_30"]
    assert os.listdir(root / "step_20") == ["README"]  # its checkpoint files gone, the user's file kept
    assert qdcp.runs.left_behind(root / "step_20") == ["README"]
    assert _states(root) == [("step_10", 10, "complete"), ("step_30", 30, "complete")]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return qdcp_cli(*args)  # the CLI's main in this process (tests/cli_in_process.py)


def test_cli_list_and_prune(run):
    root, _ = run
    proc = _cli("list", str(root))
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert rows[0] == ["step", "state", "size", "age", "checkpoint"]
    table = [(r[0], r[1], r[-1]) for r in rows[1:] if not r[0].startswith("(")]
    assert [(s, st) for s, st, _ in table] == [("1", "complete"), ("2", "complete"), ("3", "complete"),
                                               ("4", "complete"), ("5", "failed"), ("6", "complete"),
                                               ("7", "failed"), ("8", "writing"), ("9", "damaged")]
    assert "step_6  <- latest" in proc.stdout
    listed = json.loads(_cli("list", str(root), "--json").stdout)
    assert [c["state"] for c in listed] == [st for _, st, _ in table]
    proc = _cli("prune", str(root), "--keep", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("would remove step_1 (complete, ") and " KiB)\n" in proc.stdout, proc.stdout
    assert [line.split(" (")[0] for line in proc.stdout.splitlines()] == [
        "would remove step_1", "would remove step_2", "would remove step_3", "would remove step_5",
        "would remove step_7", "dry run: nothing removed; run again with --yes to remove 5 checkpoints"]
    assert (root / "step_1").is_dir()
    proc = _cli("prune", str(root), "--keep", "2", "--yes")
    assert [line.split(" (")[0] for line in proc.stdout.splitlines()] == [
        "removed step_1", "removed step_2", "removed step_3", "removed step_5", "removed step_7"], proc.stdout
    assert not (root / "step_1").exists() and (root / "step_4").is_dir()
    proc = _cli("prune", str(root / "nope"), "--keep", "2")
    assert proc.returncode == 2 and "no directory at" in proc.stderr, proc.stderr


def test_a_metadata_symlinked_out_of_its_checkpoint_is_never_read(tmp_path):
    """A checkpoint whose ``.metadata`` is a symlink to a complete checkpoint's elsewhere is listed as
    damaged, saying so, not read (qdcp's rule for every file it opens: regular files inside)."""
    qdcp.save(_state(1), tmp_path / "run" / "step_1")
    qdcp.save(_state(1), tmp_path / "elsewhere")
    (tmp_path / "run" / "step_1" / ".metadata").unlink()
    (tmp_path / "run" / "step_1" / ".metadata").symlink_to(tmp_path / "elsewhere" / ".metadata")
    (found,) = qdcp.checkpoints(tmp_path / "run")
    assert found.state == "damaged" and "outside the checkpoint directory" in found.why, found
    assert qdcp.latest(tmp_path / "run") is None
