"""Two processes saving to one path: one wins, the other is told who holds the path, the result
loads bit-exact as one of the states; a killed save's claim is cleared; a failed save leaves what
was there as it was; a write error keeps its root cause.

Each save is ``qdcp.save`` in a real process (tests/save_worker.py, kept for the module); ``hold``
pauses a save once it has begun writing, so the overlap is certain (the unheld race runs too).
"""

from __future__ import annotations

import errno
import json
import os
import time

import pytest

import qdcp
from qdcp import ConcurrentSaveError
from save_processes import Worker, assert_loads_as, claim_of, data_files, referenced, release, wait_for
from save_worker import full_state

N = 1000


@pytest.fixture(scope="module")
def workers():
    ws = [Worker() for _ in range(3)]  # started together: their imports overlap
    try:
        yield [w.ready() for w in ws]
    finally:
        for w in ws:
            w.close()


@pytest.fixture(autouse=True)
def _released(request, tmp_path):
    """Every test's held saves are let go and answered, whatever the test did."""
    yield
    if "workers" in request.fixturenames:
        release(request.getfixturevalue("workers"), tmp_path / "go")


def _refused_by(result: dict, path, holder: Worker) -> None:
    assert not result["ok"] and result["type"] == "ConcurrentSaveError", result
    msg = result["message"]
    assert f"another save holds {os.fspath(path)!r}" in msg and f"pid {holder.pid} on host" in msg, msg
    assert "this save wrote nothing" in msg and ".qdcp-save.claim" in msg, msg


@pytest.mark.parametrize("overwrite", [False, True], ids=["new-path", "overwrite"])
def test_a_second_process_is_refused_while_the_first_saves(tmp_path, workers, overwrite):
    a, b, _ = workers
    path, hold = tmp_path / "ckpt", tmp_path / "go"
    if overwrite:
        qdcp.save(full_state(0, N), path)
    a.send(path=path, seed=1, n=N, overwrite=overwrite, hold=hold)
    wait_for(f"{hold}.0.waiting")
    _refused_by(b.save(path=path, seed=2, n=N, overwrite=overwrite), path, a)
    token = claim_of(path)["token"]
    assert claim_of(path)["owner"]["pid"] == a.pid
    if overwrite:
        assert_loads_as(path, 0, N)  # the old checkpoint, whole, while the new one is written
    old_files = referenced(path) if overwrite else []
    assert all(n.startswith(f"__{token}_") for n in data_files(path) if n not in old_files)  # b wrote nothing
    hold.touch()
    assert a.result() == {"ok": True}
    assert_loads_as(path, 1, N)
    assert sorted(os.listdir(path)) == [".metadata"] + referenced(path)
    assert all(n.startswith(f"__{token}_") for n in referenced(path))


@pytest.mark.parametrize("sizes, later", [((2_000_000, 2_000_000), False), ((50_000_000, N), True)],
                         ids=["together", "while-writing"])
def test_unsynchronised_saves_leave_one_whole_checkpoint(tmp_path, workers, sizes, later):
    """The race as reported (no hooks): two saves started at once, or a save of 50M elements and
    one of 1,000 started once the first is writing its data. One succeeds; the other is refused (by
    the claim, or, had it begun planning after the first committed, as an existing checkpoint)."""
    a, b, _ = workers
    path = tmp_path / "ckpt"
    a.send(path=path, seed=1, n=sizes[0])
    if later:
        deadline = time.time() + 120
        while not (path.is_dir() and data_files(path)) and time.time() < deadline:
            time.sleep(0.002)
    b.send(path=path, seed=2, n=sizes[1])
    results = {1: a.result(), 2: b.result()}
    winners = [seed for seed, r in results.items() if r["ok"]]
    assert len(winners) == 1, results
    loser = results[3 - winners[0]]
    assert loser["type"] == "ConcurrentSaveError" or \
        (loser["type"] == "QdcpError" and "already exists" in loser["message"]), loser
    assert_loads_as(path, winners[0], sizes[winners[0] - 1])
    assert sorted(os.listdir(path)) == [".metadata"] + referenced(path)


def test_the_claim_of_a_killed_save_is_cleared(tmp_path, workers):
    _, b, c = workers
    path, hold = tmp_path / "ckpt", tmp_path / "go"
    c.send(path=path, seed=1, n=N, hold=hold)
    wait_for(f"{hold}.0.waiting")
    assert claim_of(path)["owner"]["pid"] == c.pid
    c.kill()  # SIGKILL while it holds the path, its data half written
    assert claim_of(path)["owner"]["pid"] == c.pid  # left behind
    assert b.save(path=path, seed=2, n=N) == {"ok": True}  # not blocked: its process has ended
    assert_loads_as(path, 2, N)
    assert sorted(os.listdir(path)) == [".metadata"] + referenced(path)  # the killed save's files removed


def _foreign_claim(path, *, age: float, content: bytes | None = None) -> None:
    path.mkdir()
    doc = {"qdcp_claim": 1, "token": "0123456789ab", "since": time.time() - age,
           "what": "a qdcp save of 8 ranks (train.py)",
           "owner": {"host": "node-17", "boot": "b", "pidns": "p", "pid": 4242, "start": "1"}}
    claim = path / ".qdcp-save.claim"
    claim.write_bytes(json.dumps(doc).encode() if content is None else content)
    os.utime(claim, (time.time() - age, time.time() - age))


def test_a_claim_from_another_host_is_kept_and_named(tmp_path):
    """A claim taken on another host is never judged: however old, the save is refused naming the
    holder and saying how to clear it; once the file is deleted the same save goes through."""
    path = tmp_path / "ckpt"
    _foreign_claim(path, age=3600, content=None)
    with pytest.raises(ConcurrentSaveError, match="another save holds") as info:
        qdcp.save(full_state(1, N), path)
    msg = str(info.value)
    assert "pid 4242 on host 'node-17'" in msg and "delete the claim file" in msg, msg
    assert os.listdir(path) == [".qdcp-save.claim"]  # nothing written, the claim kept
    (path / ".qdcp-save.claim").unlink()
    qdcp.save(full_state(1, N), path)
    assert_loads_as(path, 1, N)


def test_an_unreadable_claim_is_cleared_once_old(tmp_path):
    """An empty claim (its taker killed between creating and writing it) blocks only while young."""
    fresh, stale = tmp_path / "fresh", tmp_path / "stale"
    _foreign_claim(fresh, age=0, content=b"")
    with pytest.raises(ConcurrentSaveError, match="another save holds"):
        qdcp.save(full_state(1, N), fresh)
    assert os.listdir(fresh) == [".qdcp-save.claim"]
    _foreign_claim(stale, age=300, content=b"")
    qdcp.save(full_state(1, N), stale)
    assert_loads_as(stale, 1, N)
    assert sorted(os.listdir(stale)) == [".metadata"] + referenced(stale)


def test_a_failed_save_leaves_what_was_there(tmp_path, workers):
    a, b, _ = workers
    fresh = tmp_path / "fresh"
    result = a.save(path=fresh, seed=1, n=N, fail_rank=0)
    assert result["type"] == "RuntimeError" and "injected failure" in result["message"]
    assert not fresh.exists()  # its files, its claim and the directory it made are gone
    assert b.save(path=fresh, seed=2, n=N) == {"ok": True}  # the path is free
    before = {n: (fresh / n).read_bytes() for n in os.listdir(fresh)}
    result = a.save(path=fresh, seed=3, n=N, overwrite=True, fail_rank=0)
    assert not result["ok"]
    assert {n: (fresh / n).read_bytes() for n in os.listdir(fresh)} == before
    assert_loads_as(fresh, 2, N)


@pytest.mark.parametrize("direct_io", [False, True])
@pytest.mark.parametrize("fault, code", [("fsize", errno.EFBIG), ("enospc_after", errno.ENOSPC)])
def test_a_write_error_keeps_its_root_cause(tmp_path, workers, fault, code, direct_io):
    """The write fails: the OS refuses it (RLIMIT_FSIZE: EFBIG), or a full disk's ``write`` fails
    with ENOSPC and its ``close`` does not fail again (torch.save would report only ``unexpected
    pos``; qdcp's write pipeline raises the OS error itself), written buffered or directly
    (``direct_io=True``: items over 1 MiB from their own memory). The error qdcp.save raises names
    the OS error and has it as its ``__cause__``; nothing is left behind."""
    a, _, _ = workers
    path = tmp_path / "ckpt"
    result = a.save(path=path, seed=1, n=600_000, storage_options={"direct_io": direct_io}, **{fault: 100_000})
    assert result["type"] == "CheckpointWriteError" and result["errno"] == code, result
    assert result["chain"][:2] == [f"CheckpointWriteError:{code}", f"OSError:{code}"], result["chain"]
    msg = result["message"]
    assert f"writing the checkpoint at {os.fspath(path)!r} failed: OSError: [Errno {code}] {os.strerror(code)}" in msg
    assert "Nothing was committed" in msg
    assert not path.exists()
    assert a.save(path=path, seed=1, n=N) == {"ok": True}  # the limit lifted: the path is free
    assert_loads_as(path, 1, N)


def test_a_second_process_is_refused_on_s3(tmp_path, workers, s3_bucket):
    """The same on an object store (moto): the claim is S3's conditional create."""
    opts, bucket = s3_bucket
    a, b, _ = workers
    url, hold = f"s3://{bucket}/ckpt", tmp_path / "go"
    a.send(path=url, seed=1, n=N, hold=hold, storage_options=opts)
    wait_for(f"{hold}.0.waiting")
    _refused_by(b.save(path=url, seed=2, n=N, storage_options=opts), url, a)
    hold.touch()
    assert a.result() == {"ok": True}
    assert_loads_as(url, 1, N, **opts)
    import s3fs

    names = sorted(p.rsplit("/", 1)[-1] for p in s3fs.S3FileSystem(**opts).ls(url, detail=False))
    assert names == [".metadata"] + referenced(url, **opts)


def test_the_directory_is_removed_whichever_rank_made_it(tmp_path):
    """A failed save removes the directory it made also where another rank reached
    ``prepare_local_plan`` before the coordinator (DCP's writer protocol, rank by rank; it was left
    when rank 1's mkdir made it: a race CI hit)."""
    from torch.distributed.checkpoint.planner import SavePlan

    path = tmp_path / "ckpt"
    (tmp_path / "alias").symlink_to(tmp_path)  # rank 1 names the path through a link: two processes'
    ranks = [qdcp.storage_writer(path), qdcp.storage_writer(tmp_path / "alias" / "ckpt")]  # holds, not one's
    for rank, w in enumerate(ranks):
        w.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    p1 = ranks[1].prepare_local_plan(SavePlan([]))  # rank 1 first: it makes the directory
    p0 = ranks[0].prepare_local_plan(SavePlan([]))
    ranks[0].prepare_global_plan([p0, p1])
    assert os.listdir(path) == [".qdcp-save.claim"]
    for w in ranks:
        w.abandon()  # the save failed on some rank: qdcp.save's cleanup
    assert not path.exists()
