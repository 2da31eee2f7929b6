"""A checkpoint whose save recorded checksums never loads unverified (docs/format.md, *Checksums*).

Damage that would switch verification off -- the checksum record deleted, its key's name changed
by one flipped bit, one item's hash dropped with the digest, the digest dropped, an item's hash
moved to the record's ``unchecked`` list -- and then one flipped byte of a stored value: every door
refuses the checkpoint (``CheckpointFormatError`` naming the damage, nothing loaded), whoever made
the record (qdcp's writer through ``qdcp.save``; the save planner through ``dcp.save``; qdcp's
writer under DCP's own planner). A checkpoint saved without checksums still loads, and ``qdcp
verify`` says it carries none.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

import qdcp
from cli_in_process import qdcp_cli
from qdcp import CheckpointFormatError, CheckpointWriter, QuantizedLoadPlanner, QuantizedSavePlanner, checksums
from quantized_cases import CASE_BY_NAME, assert_bitwise_equal, assert_same_buffers, raise_inner
from stored_bytes import flip_stored_bytes, tensor_bytes

INT8 = CASE_BY_NAME["int8_row"]


def _state(seed: int, quantized: bool = True) -> dict:
    g = torch.Generator().manual_seed(seed)
    s = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(48, generator=g), "step": seed}
    if quantized:
        s["q"] = INT8.make(seed, (64, 64))
    return s


SAVES = {
    "qdcp.save": lambda s, p: qdcp.save(s, p),
    "dcp.save+planner": lambda s, p: dcp.save(s, checkpoint_id=p, planner=QuantizedSavePlanner()),
    "writer+DCP planner": lambda s, p: dcp.save(s, storage_writer=CheckpointWriter(p), planner=DefaultSavePlanner()),
}


def _assert_same(got: dict, want: dict, where) -> None:
    for k, v in want.items():
        if type(v) is torch.Tensor:
            assert_bitwise_equal(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert_same_buffers(got[k], v)
        else:
            assert got[k] == v, (where, k)


def _drop_one_hash(record: dict) -> None:
    record["items"].pop(next(iter(record["items"])))
    record.pop("metadata")


def _unchecked(record: dict) -> None:
    fqn = next(iter(record["items"]))
    record["items"].pop(fqn)
    record["unchecked"] = [fqn]
    record.pop("metadata")


DAMAGES = {
    "record deleted": lambda data: data.pop(checksums.PLANNER_DATA_KEY),
    "record key renamed by one bit": lambda data: data.__setitem__(
        checksums.PLANNER_DATA_KEY.replace("checksums", "checksumr"), data.pop(checksums.PLANNER_DATA_KEY)),
    "one hash and the digest dropped": lambda data: _drop_one_hash(data[checksums.PLANNER_DATA_KEY]),
    "digest dropped": lambda data: data[checksums.PLANNER_DATA_KEY].pop("metadata"),
    "a hash moved to unchecked, digest dropped": lambda data: _unchecked(data[checksums.PLANNER_DATA_KEY]),
}


def _damage(path, damage) -> None:
    md = qdcp.read_metadata(path)
    damage(md.planner_data)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _loads(path, quantized: bool):
    """Each door's load of ``path`` into fresh targets: (name, targets, call)."""
    def fresh():
        return _state(99, quantized)
    for name, load in {
        "qdcp.load": lambda t: qdcp.load(t, path),
        "dcp.load+planner": lambda t: dcp.load(t, checkpoint_id=path, planner=QuantizedLoadPlanner()),
        "dcp.load+reader": lambda t: dcp.load(t, storage_reader=qdcp.CheckpointReader(path),
                                              planner=QuantizedLoadPlanner(atomic=True)),
    }.items():
        targets = fresh()
        yield name, targets, fresh(), (lambda load=load, targets=targets: raise_inner(lambda: load(targets)))


@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("damage", DAMAGES)
def test_damage_that_would_switch_verification_off_is_refused(tmp_path, save, damage):
    quantized = save != "writer+DCP planner"  # DCP's own planner cannot save torchao tensors raw
    source = _state(1, quantized)
    path = tmp_path / "ckpt"
    SAVES[save](source, path)
    _damage(path, DAMAGES[damage])
    flip_stored_bytes(path, tensor_bytes(source["w"]))
    for door, targets, before, load in _loads(path, quantized):
        with pytest.raises(CheckpointFormatError, match="is damaged"):
            load()
        _assert_same(targets, before, door)  # refused before anything was read
    done = qdcp_cli("verify", str(path))
    assert done.returncode == 2 and "is damaged" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done


@pytest.mark.parametrize("save", SAVES)
def test_an_undamaged_record_loads_and_verify_says_every_item_is_checksummed(tmp_path, save):
    quantized = save != "writer+DCP planner"
    source = _state(1, quantized)
    SAVES[save](source, tmp_path / "ckpt")
    for door, targets, _, load in _loads(tmp_path / "ckpt", quantized):
        load()
        _assert_same(targets, source, door)
    done = qdcp_cli("verify", str(tmp_path / "ckpt"))
    assert done.returncode == 0 and "every item checked against its recorded checksum" in done.stdout, done


def test_a_checkpoint_saved_without_checksums_loads_and_verify_says_so(tmp_path):
    source = _state(1, quantized=False)
    dcp.save(source, storage_writer=FileSystemWriter(tmp_path / "stock"))  # stock DCP
    dcp.save(source, storage_writer=CheckpointWriter(tmp_path / "off", checksums=False),
             planner=QuantizedSavePlanner(checksums=False))
    for name in ("stock", "off"):
        for door, targets, _, load in _loads(tmp_path / name, False):
            load()
            assert torch.equal(targets["w"], source["w"]), (name, door)
        done = qdcp_cli("verify", str(tmp_path / name))
        assert done.returncode == 0 and "no checksums recorded" in done.stdout, done
