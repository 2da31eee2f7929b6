"""qdcp.checksums through the planners: the save planner records a checksum of every item it
writes (from the bytes being written), the load planner verifies every item it reads whole.
(CheckpointReader's own verification and CheckpointWriter's record: tests/test_storage.py.)

Everything here goes through DCP's own calls (stock FileSystemWriter / FileSystemReader) with only
qdcp's planners passed in.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from qdcp import (
    CheckpointFormatError,
    CheckpointWriter,
    ChecksumError,
    QuantizedLoadPlanner,
    QuantizedSavePlanner,
    checksums,
)
from quantized_cases import CASE_BY_NAME, assert_same_buffers, gated_save_planner, inner, raise_inner
from state_dicts import mutate, snapshot
from stored_bytes import flip_stored_bytes, tensor_bytes

INT8 = CASE_BY_NAME["int8_group32"]


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": INT8.make(seed), "nf4": CASE_BY_NAME["nf4"].make(seed),
            "bias": torch.randn(64, generator=g), "step": seed, "opt": {"lr": 0.5 + seed}}


def _targets() -> dict:
    return {"w": INT8.make(9), "nf4": CASE_BY_NAME["nf4"].make(9), "bias": torch.zeros(64), "step": -1,
            "opt": {"lr": -1.0}}


def _load(path, state, **kw):
    raise_inner(lambda: dcp.load(state, checkpoint_id=path, planner=QuantizedLoadPlanner(**kw)))
    return state


def _hashes(path) -> dict:
    return checksums.record(qdcp.read_metadata(path)).items


# ----------------------------------------------------------------------------- save side

def test_every_item_is_recorded_with_the_hash_of_its_bytes(tmp_path):
    state = _state()
    dcp.save(state, checkpoint_id=tmp_path, planner=QuantizedSavePlanner())
    md = qdcp.read_metadata(tmp_path)
    record = checksums.record(md)
    assert set(record.items) == set(md.state_dict_metadata)  # components, plain tensors, objects
    for name, buf in inner(state["w"]).items():
        assert record.expected(f"w.__qdcp__.{name}", (0,) * buf.ndim)[1] == checksums.of_bytes(tensor_bytes(buf))
    assert record.expected("bias", (0,))[1] == checksums.of_bytes(tensor_bytes(state["bias"]))


def test_checksums_off_records_none_and_loads(tmp_path):
    dcp.save(_state(), checkpoint_id=tmp_path, planner=QuantizedSavePlanner(checksums=False))
    assert checksums.PLANNER_DATA_KEY not in qdcp.read_metadata(tmp_path).planner_data
    loaded = _load(tmp_path, _targets())
    assert_same_buffers(loaded["w"], _state()["w"])


def test_async_save_hashes_the_staged_copy(tmp_path):
    """The live tensors change after ``async_save`` returns and before the upload plans (gated):
    the checkpoint holds, and its checksums describe, the values at the call."""

    for stager in (None, qdcp.QuantizedStager()):
        live = _state(1)
        before = snapshot(live)
        gate = threading.Event()
        path = tmp_path / ("default" if stager is None else "quantized")
        fut = dcp.async_save(live, checkpoint_id=path, planner=gated_save_planner(gate),
                             **({"async_stager": stager} if stager else {}))
        mutate(live)
        gate.set()
        fut.result()
        loaded = _load(path, _targets())
        assert_same_buffers(loaded["w"], before["w"])
        assert torch.equal(loaded["bias"], before["bias"])
        assert _hashes(path) == _hashes(_save_sync(before, tmp_path / f"sync_{path.name}"))


def _save_sync(state, path):
    dcp.save(state, checkpoint_id=path, planner=QuantizedSavePlanner())
    return path


@pytest.mark.parametrize("writer", ["dcp", "qdcp"])
def test_plan_caching_records_fresh_checksums_every_save(tmp_path, writer):
    """With ``enable_plan_caching`` the second save reuses the cached global plan (and its
    metadata object), but the checksums are of the second save's values, whoever records them."""
    for i in range(3):
        state = _state(i)
        where = {"checkpoint_id": tmp_path / f"c{i}"} if writer == "dcp" else \
            {"storage_writer": CheckpointWriter(tmp_path / f"c{i}")}
        dcp.save(state, **where, planner=QuantizedSavePlanner(enable_plan_caching=True))
        loaded = _load(tmp_path / f"c{i}", _targets())
        assert_same_buffers(loaded["w"], state["w"])
        assert _hashes(tmp_path / f"c{i}") == _hashes(_save_sync(state, tmp_path / f"s{i}"))


def _save_rank_by_rank(path, world: int, writer) -> None:
    """``dcp.save``'s calls for a ``world``-rank job, rank by rank in this process (ranks hold
    ``w`` and ``bias`` alike, which DCP has one rank write, and an entry of their own)."""
    states = [{"w": INT8.make(0), f"own{r}": INT8.make(r + 1), "bias": torch.arange(8.0), "step": 7}
              for r in range(world)]
    writers = [writer(path, r) for r in range(world)]
    planners = [QuantizedSavePlanner() for _ in range(world)]
    plans = []
    for r, (w, p) in enumerate(zip(writers, planners)):
        w.set_up_storage_writer(r == 0, rank=r, use_collectives=True)
        p.set_up_planner(states[r], storage_meta=w.storage_meta(), is_coordinator=r == 0)
        plans.append(w.prepare_local_plan(p.create_local_plan()))
    central, metadata = planners[0].create_global_plan(plans)
    central = writers[0].prepare_global_plan(central)
    results = []
    for w, p, plan in zip(writers, planners, central):
        fut = w.write_data(p.finish_plan(plan), p)
        fut.wait()
        results.append(fut.value())
    writers[0].finish(metadata, results)


def _qdcp_writer(path, rank):
    alias = path.parent / f"rank{rank}"  # one process holding the path once per rank, as ranks do
    if not alias.exists():
        alias.symlink_to(path.parent)
    return qdcp.storage_writer(alias / path.name)


@pytest.mark.parametrize("world", [1, 2])
def test_qdcps_writer_records_the_hashes_the_planner_would(tmp_path, world):
    """With qdcp's writer each item is hashed as it is written (no pass before): the record is the
    one the planner makes with DCP's own writer, every item of every rank in it."""
    _save_rank_by_rank(tmp_path / "qdcp", world, _qdcp_writer)
    _save_rank_by_rank(tmp_path / "dcp", world, lambda path, rank: dcp.FileSystemWriter(path))
    md = qdcp.read_metadata(tmp_path / "qdcp")
    assert set(_hashes(tmp_path / "qdcp")) == set(md.state_dict_metadata)
    assert _hashes(tmp_path / "qdcp") == _hashes(tmp_path / "dcp")
    assert {type(info).__name__ for info in md.storage_data.values()} == {"_StorageInfo"}  # no hash left there
    target = {"w": INT8.make(9), **{f"own{r}": INT8.make(9) for r in range(world)}, "bias": torch.zeros(8), "step": 0}
    qdcp.load(target, tmp_path / "qdcp")
    assert_same_buffers(target["w"], INT8.make(0))
    assert_same_buffers(target[f"own{world - 1}"], INT8.make(world))


def test_qdcps_writer_hashes_each_item_once_as_it_writes(tmp_path, monkeypatch):
    """No item is hashed at planning (nothing several ranks hold here): each once, by the writer."""
    hashed, writing = [], threading.Event()

    class Planner(QuantizedSavePlanner):
        def resolve_data(self, write_item):
            writing.set()
            return super().resolve_data(write_item)

    real = checksums.of_data
    monkeypatch.setattr(checksums, "of_data", lambda data: hashed.append(writing.is_set()) or real(data))
    dcp.save(_state(), storage_writer=qdcp.storage_writer(tmp_path), planner=Planner())
    assert hashed and all(hashed)  # every hash taken once writing began
    assert len(hashed) == len(qdcp.read_metadata(tmp_path).storage_data)  # each item once
    assert_same_buffers(_load(tmp_path, _targets())["w"], _state()["w"])


# ----------------------------------------------------------------------------- load side

@pytest.mark.parametrize("where", ["component", "plain", "object"])
def test_flipped_byte_is_a_checksum_error_naming_key_and_component(tmp_path, where):
    state = _state()
    dcp.save(state, checkpoint_id=tmp_path, planner=QuantizedSavePlanner())
    needle, match = {
        "component": (tensor_bytes(state["w"].qdata[5:9]), r"key 'w' \(component 'qdata'\)"),
        "plain": (tensor_bytes(state["bias"]), r"key 'bias'"),
        "object": (None, r"key 'opt.lr'"),
    }[where]
    if needle is None:  # the pickled float inside the object's torch.save archive
        import struct
        needle = struct.pack(">d", 0.5)  # pickle's BINFLOAT
    flip_stored_bytes(tmp_path, needle, at=3)
    with pytest.raises(ChecksumError, match=match + r".*already filled from this checkpoint"):
        _load(tmp_path, _targets())


def test_error_lists_the_entries_already_filled(tmp_path):
    state = _state()
    dcp.save(state, checkpoint_id=tmp_path, planner=QuantizedSavePlanner())
    flip_stored_bytes(tmp_path, tensor_bytes(state["w"].qdata[5:9]))
    with pytest.raises(ChecksumError) as e:
        _load(tmp_path, _targets())
    filled = str(e.value).split("already filled from this checkpoint: ")[1]
    # the plain tensor and the objects come first in the data file; w's target holds the bad bytes
    assert filled.startswith("'bias', 'nf4', 'opt.lr', 'step', 'w' (this one with the corrupt bytes).")


def test_verified_into_a_wider_target_dtype(tmp_path):
    """bf16 stored, fp32 target: read into a host buffer of the stored dtype, checked, then copied."""
    w = torch.randn(32, 16).to(torch.bfloat16)
    dcp.save({"w": w}, checkpoint_id=tmp_path, planner=QuantizedSavePlanner())
    out = _load(tmp_path, {"w": torch.zeros(32, 16)})
    assert torch.equal(out["w"], w.float())
    flip_stored_bytes(tmp_path, tensor_bytes(w[3:5]))
    with pytest.raises(ChecksumError, match="key 'w'"):
        _load(tmp_path, {"w": torch.zeros(32, 16)})


def test_verification_off_is_a_choice(tmp_path):
    state = _state()
    dcp.save(state, checkpoint_id=tmp_path, planner=QuantizedSavePlanner())
    flip_stored_bytes(tmp_path, tensor_bytes(state["bias"]))
    out = _load(tmp_path, _targets(), checksums=False)
    assert not torch.equal(out["bias"], state["bias"])  # what verification prevents


def test_unknown_algorithm_is_refused_before_reading(tmp_path):
    dcp.save(_state(), checkpoint_id=tmp_path, planner=QuantizedSavePlanner())
    md = qdcp.read_metadata(tmp_path)
    md.planner_data[checksums.PLANNER_DATA_KEY]["algorithm"] = "blake9"
    import pickle
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    targets = _targets()
    with pytest.raises(CheckpointFormatError, match="blake9.*checksums=False"):
        _load(tmp_path, targets)
    assert torch.equal(targets["bias"], torch.zeros(64))  # nothing was read
    _load(tmp_path, targets, checksums=False)


@pytest.mark.parametrize("door", ["qdcp.save", "dcp.save"])
def test_the_metadata_digest_refuses_a_consistent_rename_and_is_optional(tmp_path, door):
    """A key renamed in every place .metadata names it (what one flipped byte of a pickled string
    does) passes every structural check; the digest the save records catches it. A record without
    the digest (earlier qdcp, which set no mark either) loads as before."""
    import dataclasses
    import pickle

    state = _state()
    if door == "qdcp.save":
        qdcp.save(state, tmp_path / "c")
    else:
        dcp.save(state, checkpoint_id=tmp_path / "c", planner=QuantizedSavePlanner())
    raw = (tmp_path / "c" / ".metadata").read_bytes()
    md = pickle.loads(raw)
    assert set(md.planner_data[checksums.PLANNER_DATA_KEY]) == {"algorithm", "items", "metadata"}
    md.state_dict_metadata["bjas"] = md.state_dict_metadata.pop("bias")
    md.storage_data = {(dataclasses.replace(i, fqn="bjas") if i.fqn == "bias" else i): v
                       for i, v in md.storage_data.items()}
    md.planner_data["bjas"] = ("bjas",)
    del md.planner_data["bias"]
    items = md.planner_data[checksums.PLANNER_DATA_KEY]["items"]
    items["bjas"] = items.pop("bias")
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointFormatError, match="does not match the digest its save recorded"):
        qdcp.consolidate(tmp_path / "c")
    with pytest.raises(CheckpointFormatError, match="does not match the digest"):
        _load(tmp_path / "c", {"bjas": torch.zeros(64)}, allow_partial_load=True)
    md = pickle.loads(raw)
    del md.planner_data[checksums.PLANNER_DATA_KEY]["metadata"]
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointFormatError, match="is damaged: its checksum record has lost its digest"):
        _load(tmp_path / "c", _targets())  # this save sealed its record: a lost digest is damage
    del md.planner_data[checksums.SEALED_KEY]  # as an earlier qdcp saved it: neither digest nor mark
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(md))
    out = _load(tmp_path / "c", _targets())
    assert torch.equal(out["bias"], state["bias"])
