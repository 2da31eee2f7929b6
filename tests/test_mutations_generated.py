"""Generated structural damage and forgery of real checkpoints (tests/mutations.py), every reader
judged by one oracle, each case under a time and a memory limit in a child process
(tests/mutation_worker.py): at one rank over checkpoints of both save doors, and at two ranks of a
real job (a checkpoint both ranks saved, loaded by both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torchrun_jobs

WORKER = Path(__file__).with_name("mutation_worker.py")
ROOT = WORKER.parent.parent
CASES = int(os.environ.get("QDCP_MUTATION_CASES", "60"))  # per save door; QDCP_MUTATION_CASES for more


def _child(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(WORKER.parent)]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def _records(out: Path) -> tuple[list[dict], int | None]:
    """The finished cases' records, and the seed of a case started but never finished (the child
    was stopped by its time or memory limit), if any."""
    started, done = [], []
    for line in out.read_text().splitlines() if out.exists() else []:
        r = json.loads(line)
        (started if r.get("start") else done).append(r)
    unfinished = {r["seed"] for r in started} - {r["seed"] for r in done}
    return done, min(unfinished) if unfinished else None


@pytest.mark.parametrize("door", ("qdcp.save", "dcp.save"))
def test_generated_damage_is_refused_or_harmless_at_one_rank(tmp_path, door):
    src = tmp_path / "source"
    made = _child(["save", str(src), door], 300)
    assert made.returncode == 0, made.stderr[-3000:]
    out, first, problems = tmp_path / "cases.jsonl", 0, []
    while first < CASES:
        ran = _child(["cases", str(src), str(tmp_path / "work"), str(first), str(CASES - first), str(out)], 900)
        records, stuck = _records(out)
        if stuck is None:
            assert ran.returncode == 0, ran.stderr[-3000:]
            break
        problems.append(f"case {stuck} did not finish within its limits: {ran.stderr[-1500:]}")
        first = stuck + 1
    records, _ = _records(out)
    problems += [f"case {r['seed']} ({r['label']}): {p}" for r in records for p in r["problems"]]
    assert not problems, "\n".join(problems[:20])
    verdicts = [r["doors"]["qdcp.load"][0] for r in records]
    assert verdicts.count("loaded") and verdicts.count("refused") > CASES // 2, verdicts


@pytest.mark.multiproc
def test_generated_damage_at_two_ranks(tmp_path):
    rc, out, seconds = torchrun_jobs.torchrun(WORKER, "ranks", 2, tmp_path, 420)
    results = tmp_path / "results-ranks-2.json"
    assert results.exists(), f"torchrun exit {rc} after {seconds:.0f} s, no results:\n{out[-4000:]}"
    found = json.loads(results.read_text())
    assert not found.get("crash"), found["crash"][:3]
    assert "mutations" in found and not found["mutations"], "\n".join(found["mutations"][:20])
    assert rc == 0, out[-4000:]
