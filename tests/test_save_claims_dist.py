"""Two 2-rank jobs saving to one path behave like two processes: the claim is taken once per job
(by its coordinator, rank 0), every rank of the losing job is told who holds the path, and the
claim is released on success, on a failure of any rank, and by SIGKILL of the job.

Each job is two tests/save_worker.py processes (gloo over a FileStore), kept for the module.
"""

from __future__ import annotations

import os

import pytest

from save_processes import Worker, assert_loads_as, claim_of, data_files, referenced, release, wait_for

N = 1000


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    pairs = {}
    for name in ("a", "b"):
        root = tmp_path_factory.mktemp(f"job_{name}")
        pairs[name] = [Worker(dist=(str(root), rank, 2)) for rank in range(2)]
    try:
        yield {name: [w.ready() for w in pair] for name, pair in pairs.items()}
    finally:
        for pair in pairs.values():
            for w in pair:
                w.close()


@pytest.fixture(autouse=True)
def _released(jobs, tmp_path):
    """Every test's held saves are let go and answered, whatever the test did."""
    yield
    release([w for job in jobs.values() for w in job], tmp_path / "go")


def _run(job: list[Worker], **cmd) -> list[dict]:
    for w in job:
        w.send(**cmd)
    return [w.result() for w in job]


def _hold(job: list[Worker], path, hold, seed: int) -> None:
    """Start a save of ``seed`` in every rank of ``job`` and wait until each is writing."""
    for w in job:
        w.send(path=path, seed=seed, n=N, hold=hold)
    for rank in range(len(job)):
        wait_for(f"{hold}.{rank}.waiting")


def test_the_second_job_is_refused_on_every_rank(tmp_path, jobs):
    a, b = jobs["a"], jobs["b"]
    path, hold = tmp_path / "ckpt", tmp_path / "go"
    _hold(a, path, hold, seed=1)
    for r in _run(b, path=path, seed=2, n=N):
        assert r.get("type") == "ConcurrentSaveError", r
        assert f"another save holds {os.fspath(path)!r}" in r["message"] and f"pid {a[0].pid} on host" in r["message"]
    claim = claim_of(path)
    assert claim["owner"]["pid"] == a[0].pid and "of 2 ranks" in claim["what"]  # once, by the coordinator
    assert all(n.startswith(f"__{claim['token']}_") for n in data_files(path))  # job b wrote nothing
    hold.touch()
    assert [w.result() for w in a] == [{"ok": True}, {"ok": True}]
    assert_loads_as(path, 1, N, world=2)
    assert sorted(os.listdir(path)) == [".metadata"] + referenced(path)


def test_a_failure_on_one_rank_releases_the_path(tmp_path, jobs):
    a = jobs["a"]
    path = tmp_path / "ckpt"
    results = _run(a, path=path, seed=1, n=N, fail_rank=1)
    assert [(r["type"], "injected failure on rank 1" in r["message"]) for r in results] == [("RuntimeError", True)] * 2
    assert not path.exists()  # both ranks' files, the claim and the directory the save made are gone
    assert _run(a, path=path, seed=2, n=N) == [{"ok": True}, {"ok": True}]
    assert_loads_as(path, 2, N, world=2)


def test_a_killed_job_does_not_block_the_next(tmp_path, jobs):
    a, b = jobs["a"], jobs["b"]
    path, hold = tmp_path / "ckpt", tmp_path / "go"
    _hold(a, path, hold, seed=1)
    assert claim_of(path)["owner"]["pid"] == a[0].pid
    a[0].kill()  # the coordinator, holding the claim
    a[1].kill()
    assert _run(b, path=path, seed=3, n=N) == [{"ok": True}, {"ok": True}]
    assert_loads_as(path, 3, N, world=2)
    assert sorted(os.listdir(path)) == [".metadata"] + referenced(path)  # the killed job's files removed
