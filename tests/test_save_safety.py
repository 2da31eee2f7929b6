"""The plain DCP path with qdcp's save planner, as safe as a planner can make it.

- a tensor subclass qdcp has no adapter for saves as stock DCP saves it, checksummed (raw and with
  ``dequantize=True``), and a corrupt copy of it is caught naming the key;
- a second ``dcp.save`` / ``dcp.async_save`` into a directory that holds a checkpoint is refused
  before a byte is written, unless ``QuantizedSavePlanner(overwrite=True)``; qdcp's own writers
  decide by their own ``overwrite``;
- a save planner given to ``dcp.load`` says so.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.testing._internal.two_tensor import TwoTensor

import qdcp
from qdcp.errors import ChecksumError


class Tagged(torch.Tensor):
    """A subclass that owns its storage and keeps torch's dispatch (like a framework's parameter tag)."""


A = torch.full((8, 16), 1.2345678)
B = torch.full((8, 16), -7.654321)


def _subclass(kind: str) -> torch.Tensor:
    return A.clone().as_subclass(Tagged) if kind == "tagged" else TwoTensor(A.clone(), B.clone())


def _plain_values(t: torch.Tensor) -> torch.Tensor:
    """What a plain target gets from ``t`` (stock DCP copies the stored tensor into it)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def _files(path) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


def _load_plain(path, planner=None) -> torch.Tensor:
    out = {"w": torch.zeros(8, 16), "b": torch.zeros(3)}
    with torch.serialization.safe_globals([Tagged, TwoTensor]):
        dcp.load(out, checkpoint_id=str(path), **({"planner": planner} if planner is not None else {}))
    return out["w"]


@pytest.mark.parametrize("dequantize", [False, True], ids=["raw", "dequantize"])
@pytest.mark.parametrize("kind", ["tagged", "wrapper"])
def test_unadapted_subclass_saves_as_stock_dcp_checksummed(tmp_path, kind, dequantize):
    state = {"w": _subclass(kind), "b": torch.arange(3.0)}
    dcp.save(state, checkpoint_id=str(tmp_path / "stock"))
    dcp.save(state, checkpoint_id=str(tmp_path / "q"), planner=qdcp.QuantizedSavePlanner(dequantize=dequantize))

    stock = _load_plain(tmp_path / "stock")
    ours = _load_plain(tmp_path / "q", qdcp.QuantizedLoadPlanner())
    assert torch.equal(stock.view(torch.int32), ours.view(torch.int32))
    assert torch.equal(ours, _plain_values(state["w"]))

    # the item's checksum is recorded: XXH3-64 of the values a plain tensor gets from it
    with open(tmp_path / "q" / ".metadata", "rb") as f:
        record = pickle.load(f).planner_data["__qdcp_checksums__"]
    expected = xxhash.xxh3_64_intdigest(_plain_values(state["w"]).numpy().tobytes())
    assert record["items"]["w"] == expected.to_bytes(8, "little")


@pytest.mark.parametrize("kind", ["tagged", "wrapper"])
def test_corrupt_unadapted_subclass_is_caught_naming_the_key(tmp_path, kind):
    state = {"w": _subclass(kind), "b": torch.arange(3.0)}
    dcp.save(state, checkpoint_id=str(tmp_path), planner=qdcp.QuantizedSavePlanner())
    for name in os.listdir(tmp_path):
        if name.endswith(".distcp"):
            data = bytearray(open(tmp_path / name, "rb").read())
            hits = 0
            for value in (A, B):  # flip a bit of the first element of each stored copy
                pattern = value[0, :2].numpy().tobytes()
                at = data.find(pattern)
                while at >= 0:
                    data[at] ^= 0x01
                    hits += 1
                    at = data.find(pattern, at + len(pattern))
            open(tmp_path / name, "wb").write(bytes(data))
    assert hits >= 1
    target = {"w": torch.zeros(8, 16), "b": torch.zeros(3)}
    with torch.serialization.safe_globals([Tagged, TwoTensor]), pytest.raises(ChecksumError, match="'w'"):
        qdcp.load(target, str(tmp_path))
    assert not target["w"].any()  # the atomic load left the target as it was


def test_second_plain_save_into_a_checkpoint_is_refused_before_writing(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(4)}, checkpoint_id=path, planner=qdcp.QuantizedSavePlanner())
    before = _files(path)
    stamps = {n: os.stat(os.path.join(path, n)).st_mtime_ns for n in before}
    with pytest.raises(BaseException, match=r"already exists at .*QuantizedSavePlanner\(overwrite=True\)"):
        dcp.save({"w": torch.zeros(4)}, checkpoint_id=path, planner=qdcp.QuantizedSavePlanner())
    with pytest.raises(BaseException, match="already exists"):
        dcp.async_save({"w": torch.zeros(4)}, checkpoint_id=path, planner=qdcp.QuantizedSavePlanner()).result()
    assert _files(path) == before
    assert {n: os.stat(os.path.join(path, n)).st_mtime_ns for n in before} == stamps
    out = {"w": torch.zeros(4)}
    qdcp.load(out, path)
    assert torch.equal(out["w"], torch.ones(4))


def test_overwrite_true_replaces_and_qdcp_writers_decide_for_themselves(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(4)}, checkpoint_id=path, planner=qdcp.QuantizedSavePlanner())
    dcp.save({"w": torch.full((4,), 2.0)}, checkpoint_id=path, planner=qdcp.QuantizedSavePlanner(overwrite=True))
    # qdcp's writer guards the path by its own overwrite: the planner's default does not veto it
    dcp.save({"w": torch.full((4,), 3.0)}, storage_writer=qdcp.CheckpointWriter(path, overwrite=True),
             planner=qdcp.QuantizedSavePlanner())
    qdcp.save({"w": torch.full((4,), 4.0)}, path, overwrite=True)
    with pytest.raises(BaseException, match="pass overwrite=True"):
        qdcp.save({"w": torch.full((4,), 5.0)}, path)
    out = {"w": torch.zeros(4)}
    qdcp.load(out, path)
    assert torch.equal(out["w"], torch.full((4,), 4.0))
    # a directory without a checkpoint in it is no checkpoint to protect
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "notes.txt").write_text("mine")
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(fresh), planner=qdcp.QuantizedSavePlanner())
    assert (fresh / "notes.txt").read_text() == "mine"


def test_save_planner_given_to_load_says_so(tmp_path):
    qdcp.save({"w": torch.ones(4)}, tmp_path)
    with pytest.raises(BaseException, match=r"QuantizedSavePlanner is a save planner.*dcp\.load.*QuantizedLoadPlanner"):
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=str(tmp_path), planner=qdcp.QuantizedSavePlanner())
