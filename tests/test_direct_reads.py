"""qdcp's reader reads a whole stored chunk straight into its target's memory (no scratch copy),
checked there against the checksum its save recorded."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import qdcp
from qdcp import ChecksumError, QuantizedLoadPlanner
from qdcp.storage import reader as reader_module


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 48, generator=g).to(torch.bfloat16), "b": torch.randn(48, generator=g),
            "idx": torch.arange(10) * (seed + 1), "step": seed}


@pytest.fixture
def direct_reads(monkeypatch):
    """How many items the reader read straight into their targets."""
    count = {"direct": 0, "other": 0}
    real = reader_module.read_archive_into

    def counting(*args):
        done = real(*args)
        count["direct" if done else "other"] += 1
        return done
    monkeypatch.setattr(reader_module, "read_archive_into", counting)
    return count


@pytest.mark.parametrize("atomic", [True, False])
def test_whole_chunks_are_read_straight_into_their_targets(tmp_path, direct_reads, atomic):
    saved = _state(1)
    qdcp.save(saved, tmp_path / "c")
    target = _state(2)
    kept = {k: v for k, v in target.items() if isinstance(v, torch.Tensor)}
    qdcp.load(target, tmp_path / "c", atomic=atomic)
    assert direct_reads == {"direct": 3, "other": 0}
    for k, v in kept.items():
        assert target[k] is v and torch.equal(v, saved[k])
    assert target["step"] == 1


def _flip_in_data(path, key: str) -> None:
    md = qdcp.read_metadata(path)
    info = next(i for idx, i in md.storage_data.items() if idx.fqn == key)
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length - 1200)  # inside the tensor's bytes (before the zip's last records)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_flipped_byte_read_straight_into_a_target_is_reported(tmp_path, direct_reads):
    saved = _state(1)
    qdcp.save(saved, tmp_path / "c")
    _flip_in_data(tmp_path / "c", "w")
    target = _state(2)
    before = target["w"].clone()
    with pytest.raises(ChecksumError, match="'w'"):
        qdcp.load(target, tmp_path / "c")  # atomic: read into its shadow, refused there
    assert torch.equal(target["w"], before)
    with pytest.raises(CheckpointException, match="key 'w'.*do not match the checksum"):
        dcp.load(_state(3), storage_reader=qdcp.CheckpointReader(tmp_path / "c"), planner=QuantizedLoadPlanner())
    assert direct_reads["direct"] >= 1
