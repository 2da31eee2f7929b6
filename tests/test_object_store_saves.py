"""Saves to object stores (s3:// on a real S3-compatible server, moto; memory://): the claim is an
exclusive create (S3's ``If-None-Match: *``), ``.metadata`` is published in one conditional write,
a claim whose process has ended is cleared, and an overwrite removes the replaced files."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import qdcp
from qdcp import ConcurrentSaveError
from qdcp.owners import Owner
from qdcp.storage import claims
from qdcp.storage.claims import CLAIM_FILE, FsspecStore
from qdcp.storage.factories import FsspecWriter


@pytest.fixture(params=["s3", "memory"])
def store(request):
    """``(url, storage options, fsspec file system)`` of an empty checkpoint location."""
    import fsspec

    if request.param == "memory":
        url = f"memory://qdcp-{uuid.uuid4().hex}/ckpt"
        return url, {}, fsspec.filesystem("memory")
    opts, bucket = request.getfixturevalue("s3_bucket")
    import s3fs

    return f"s3://{bucket}/ckpt", opts, s3fs.S3FileSystem(**opts)


def _names(fs, url) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url, detail=False))


def _values(seed: int) -> dict:
    return {"w": torch.randn(64, generator=torch.Generator().manual_seed(seed)), "step": seed}


def _loads_as(url, opts, seed: int) -> None:
    got = {"w": torch.zeros(64), "step": -1}
    qdcp.load(got, url, storage_options=opts or None)
    assert torch.equal(got["w"], _values(seed)["w"]) and got["step"] == seed


class _Held(qdcp.QuantizedSavePlanner):
    def __init__(self, writing: threading.Event, go: threading.Event) -> None:
        super().__init__()
        self.writing, self.go = writing, go

    def resolve_data(self, write_item):
        self.writing.set()
        self.go.wait(60)
        return super().resolve_data(write_item)


def test_metadata_is_published_with_a_conditional_write(store):
    """A save that takes no claim (DCP's own fsspec writer) commits while a qdcp save writes: the
    qdcp save's exclusive write of ``.metadata`` fails, it removes its files, the other stays."""
    url, opts, fs = store
    writing, go, errors = threading.Event(), threading.Event(), []

    def held_save():
        try:
            dcp.save(_values(1), storage_writer=qdcp.storage_writer(url, **opts), planner=_Held(writing, go),
                     no_dist=True)
        except CheckpointException as e:
            errors.extend(err[0] if isinstance(err, tuple) else err for err in e.failures.values())

    thread = threading.Thread(target=held_save)
    thread.start()
    try:
        assert writing.wait(60)
        dcp.save(_values(2), storage_writer=FsspecWriter(url, **opts), no_dist=True)  # no claim taken
        try:
            claims.take(FsspecStore(fs, url, url), "a test")  # the held save's claim, seen from here
            seen = None
        except ConcurrentSaveError as e:
            seen = e
    finally:
        go.set()
        thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], ConcurrentSaveError), errors
    assert "committed at" in str(errors[0]) and "takes no qdcp claim" in str(errors[0])
    assert _names(fs, url) == [".metadata", "__0_0.distcp"]  # the qdcp save's files and claim removed
    _loads_as(url, opts, 2)
    assert seen is not None and "another save holds" in str(seen)


def test_a_claim_whose_process_ended_is_cleared_and_a_live_one_kept(store):
    url, opts, fs = store
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    dead = Owner.current().to_json() | {"pid": ended.pid, "start": ""}
    for owner, refused in ((dead, False), (Owner.current().to_json() | {"host": "node-17"}, True)):
        record = {"qdcp_claim": 1, "token": "0123456789ab", "since": 0.0, "what": "a qdcp save of 1 rank",
                  "owner": owner}
        fs.pipe_file(f"{url}/{CLAIM_FILE}", claims.json.dumps(record).encode())
        if refused:
            with pytest.raises(ConcurrentSaveError, match="pid .* on host 'node-17'.*delete the claim file"):
                qdcp.save(_values(3), url, overwrite=True, storage_options=opts or None)
        else:
            qdcp.save(_values(3), url, storage_options=opts or None)
            assert CLAIM_FILE not in _names(fs, url)
    _loads_as(url, opts, 3)


def test_an_overwrite_removes_the_replaced_files(store):
    url, opts, fs = store
    qdcp.save(_values(1), url, storage_options=opts or None)
    first = _names(fs, url)
    qdcp.save(_values(2), url, overwrite=True, storage_options=opts or None)
    second = _names(fs, url)
    assert len(first) == len(second) == 2 and set(first) & set(second) == {".metadata"}, (first, second)
    _loads_as(url, opts, 2)
