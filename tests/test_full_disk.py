"""Saves that run out of space on a real file system (a loop-mounted ext4, tests/full_disk.py), swept
over the bytes of a save, for every door (``qdcp.save``, ``qdcp.async_save``, ``dcp.save`` with
``qdcp.storage_writer``), every spelling of the path (local, ``file://``, fsspec's ``local://``), to a
new path and over an existing checkpoint, at one rank in this process and at two under torchrun: the
previous checkpoint stays bit-exact, a new path is left no checkpoint and empty, no claim is left,
and the same save retried with the space back goes through."""

from __future__ import annotations

import itertools
import json

import pytest

import full_disk as fd
from torchrun_jobs import check_sections, explain, torchrun

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def disk():
    try:
        with fd.loop_disk() as root:
            yield root
    except OSError as e:
        pytest.skip(f"no loop-mounted file system here: {e}")


@pytest.fixture(scope="module")
def one_rank(disk):
    fd.reset(disk, 1)
    return fd.sweep(fd.save_size(disk, 1), 10)


@pytest.mark.parametrize("door", fd.DOORS)
def test_a_full_disk_costs_no_checkpoint(disk, one_rank, door):
    found, failures = [], {}
    for how, target in itertools.product(fd.SPELLINGS, fd.TARGETS):
        for free in one_rank:
            failed, problems = fd.run_case(disk, door, how, target, free)
            failures[how, target] = failures.get((how, target), 0) + failed
            found += problems
    assert not found, "\n".join(found[:20])
    # the sweep reached every part of the save: all but the points past its size ran out of space
    assert all(n >= len(one_rank) - 3 for n in failures.values()), failures


def test_a_full_disk_at_two_ranks(disk):
    rc, out, seconds = torchrun(fd.Path(__file__).with_name("full_disk_worker.py"), "sweep", 2, disk, 420)
    results = disk / "results-sweep-2.json"
    record = {"rc": rc, "tail": out[-6000:], "seconds": round(seconds, 1),
              "results": json.loads(results.read_text()) if results.exists() else None}
    assert record["results"] is not None, explain(record, "the full-disk job wrote no results")
    sections = [f"{d}/{h}/{t}" for d, h, t in itertools.product(fd.DOORS, fd.SPELLINGS, fd.TARGETS)]
    check_sections(record, "the full-disk sweep at 2 ranks", sections)
