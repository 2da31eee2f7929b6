"""Integrity through the front door: the save planner records a checksum of every item it writes,
the load planner verifies every item it reads whole, CheckpointReader the items read in part.

Everything here goes through DCP's own calls (stock FileSystemWriter / FileSystemReader unless a
test says otherwise) with only qdcp's planners (or reader) passed in.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

import qdcp
from qdcp import (
    CheckpointFormatError,
    ChecksumError,
    CheckpointReader,
    CheckpointWriter,
    QuantizedLoadPlanner,
    QuantizedSavePlanner,
)
from qdcp import checksums
from quantized_cases import CASE_BY_NAME, assert_same_buffers, gated_save_planner, inner, raise_inner
from state_dicts import mutate, snapshot

DATA = Path(__file__).with_name("data") / "qdcp-0.1-checkpoints"
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


def _flip_stored_bytes(path, needle: bytes, at: int = 7) -> None:
    """Flip one byte inside the stored copy of ``needle`` (a tensor's raw bytes) in the data file."""
    (name,) = [n for n in os.listdir(path) if n.endswith(".distcp")]
    raw = bytearray((Path(path) / name).read_bytes())
    pos = raw.find(needle)
    assert pos >= 0 and raw.find(needle, pos + 1) < 0
    raw[pos + at] ^= 0x5A
    (Path(path) / name).write_bytes(bytes(raw))


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


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
        assert record.expected(f"w.__qdcp__.{name}", (0,) * buf.ndim)[1] == checksums.of_bytes(_raw(buf))
    assert record.expected("bias", (0,))[1] == checksums.of_bytes(_raw(state["bias"]))


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


def test_plan_caching_records_fresh_checksums_every_save(tmp_path):
    """With ``enable_plan_caching`` the second save reuses the cached global plan, but the
    checksums are of the second save's values."""
    for i in range(3):
        state = _state(i)
        dcp.save(state, checkpoint_id=tmp_path / f"c{i}", planner=QuantizedSavePlanner(enable_plan_caching=True))
        loaded = _load(tmp_path / f"c{i}", _targets())
        assert_same_buffers(loaded["w"], state["w"])
        assert _hashes(tmp_path / f"c{i}") == _hashes(_save_sync(state, tmp_path / f"s{i}"))


def test_checkpoint_writer_leaves_checksums_to_the_planner(tmp_path):
    """QuantizedSavePlanner + CheckpointWriter: no qdcp-checksum trailers; stock DCP reads it."""
    dcp.save(_state(), storage_writer=CheckpointWriter(tmp_path), planner=QuantizedSavePlanner())
    md = qdcp.read_metadata(tmp_path)
    assert not any(info.transform_descriptors for info in md.storage_data.values())
    loaded = _load(tmp_path, _targets())  # stock FileSystemReader
    assert_same_buffers(loaded["w"], _state()["w"])
    dcp.save(_state(), storage_writer=CheckpointWriter(tmp_path / "t"), planner=QuantizedSavePlanner(checksums=False))
    md = qdcp.read_metadata(tmp_path / "t")
    assert {tuple(i.transform_descriptors) for i in md.storage_data.values()} == {("qdcp-checksum/2",)}


# ----------------------------------------------------------------------------- load side

@pytest.mark.parametrize("where", ["component", "plain", "object"])
def test_flipped_byte_is_a_checksum_error_naming_key_and_component(tmp_path, where):
    state = _state()
    dcp.save(state, checkpoint_id=tmp_path, planner=QuantizedSavePlanner())
    needle, match = {
        "component": (_raw(state["w"].qdata[5:9]), r"key 'w' \(component 'qdata'\)"),
        "plain": (_raw(state["bias"]), r"key 'bias'"),
        "object": (None, r"key 'opt.lr'"),
    }[where]
    if needle is None:  # the pickled float inside the object's torch.save archive
        import struct
        needle = struct.pack(">d", 0.5)  # pickle's BINFLOAT
    _flip_stored_bytes(tmp_path, needle, at=3)
    with pytest.raises(ChecksumError, match=match + r".*already filled from this checkpoint"):
        _load(tmp_path, _targets())


def test_error_lists_the_entries_already_filled(tmp_path):
    state = _state()
    dcp.save(state, checkpoint_id=tmp_path, planner=QuantizedSavePlanner())
    _flip_stored_bytes(tmp_path, _raw(state["w"].qdata[5:9]))
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
    _flip_stored_bytes(tmp_path, _raw(w[3:5]))
    with pytest.raises(ChecksumError, match="key 'w'"):
        _load(tmp_path, {"w": torch.zeros(32, 16)})


def test_verification_off_is_a_choice(tmp_path):
    state = _state()
    dcp.save(state, checkpoint_id=tmp_path, planner=QuantizedSavePlanner())
    _flip_stored_bytes(tmp_path, _raw(state["bias"]))
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


# ----------------------------------------------------------------------------- older checkpoints

def _v01_state() -> dict:
    """What tests/data/qdcp-0.1-checkpoints hold (written by qdcp 0.1, before item checksums)."""
    g = torch.Generator().manual_seed(7)
    return {"int8": INT8.from_hp(torch.randn(64, 64, generator=g).to(torch.bfloat16)),
            "nf4": CASE_BY_NAME["nf4_block32"].from_hp(torch.randn(64, 64, generator=g).to(torch.bfloat16)),
            "bias": torch.randn(16, generator=g), "step": 12, "opt": {"lr": 0.5}}


def _v01_targets() -> dict:
    s = _v01_state()
    return {"int8": INT8.make(3, (64, 64)), "nf4": CASE_BY_NAME["nf4_block32"].make(3, (64, 64)),
            "bias": torch.zeros(16), "step": 0, "opt": {"lr": 0.0}} if s else {}


@pytest.mark.parametrize("name", ["crc32", "stock"])
def test_checkpoints_written_before_checksums_still_load(tmp_path, name):
    """qdcp 0.1 wrote CRC-32 trailers (CheckpointWriter) or nothing (stock writer)."""
    want = _v01_state()
    out = _v01_targets()
    dcp.load(out, storage_reader=CheckpointReader(DATA / name), planner=QuantizedLoadPlanner())
    for k in ("int8", "nf4"):
        assert_same_buffers(out[k], want[k])
    assert torch.equal(out["bias"], want["bias"]) and out["step"] == 12 and out["opt"] == {"lr": 0.5}
    copy = shutil.copytree(DATA / name, tmp_path / name)
    _flip_stored_bytes(copy, _raw(want["bias"]))
    with pytest.raises(ChecksumError if name == "crc32" else CheckpointFormatError, match="key 'bias'"):
        raise_inner(lambda: dcp.load(_v01_targets(), storage_reader=CheckpointReader(copy),
                                      planner=QuantizedLoadPlanner()))


# ----------------------------------------------------------------------------- partial reads

def _reshard_worker(rank: int, root: str, reader: str, results) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from dist_helpers import init_file_store_group

    init_file_store_group(root, rank, 2)
    mesh = init_device_mesh("cpu", (2,))
    target = {"w": distribute_tensor(torch.zeros(64, 32), mesh, [Shard(0)])}
    storage = CheckpointReader(os.path.join(root, "ckpt")) if reader == "qdcp" else \
        dcp.FileSystemReader(os.path.join(root, "ckpt"))
    try:
        dcp.load(target, storage_reader=storage, planner=QuantizedLoadPlanner())
        results[rank] = ("loaded", target["w"].to_local().clone())
    except BaseException as e:  # noqa: BLE001 (CheckpointException)
        inner = next(iter(e.failures.values())) if isinstance(e, CheckpointException) else e
        inner = inner[0] if isinstance(inner, tuple) else inner
        results[rank] = (type(inner).__name__, str(inner))
    dist.destroy_process_group()


def _reshard(tmp_path, reader: str) -> dict:
    results = mp.Manager().dict()
    mp.spawn(_reshard_worker, args=(str(tmp_path), reader, results), nprocs=2, join=True)
    (tmp_path / "store").unlink(missing_ok=True)
    return dict(results)


def test_items_read_in_part_are_verified_by_checkpoint_reader(tmp_path):
    """Saved whole at 1 rank, loaded as Shard(0) at 2: each rank reads half of the stored chunk
    (the planner cannot check a part). CheckpointReader checks the whole stored chunk it loaded;
    stock DCP's reader does not, and a rank whose half holds no flipped byte loads fine."""
    w = torch.randn(64, 32)
    dcp.save({"w": w}, checkpoint_id=tmp_path / "ckpt", planner=QuantizedSavePlanner())
    ok = _reshard(tmp_path, "qdcp")
    assert all(r[0] == "loaded" for r in ok.values())
    assert torch.equal(torch.cat([ok[0][1], ok[1][1]]), w)
    _flip_stored_bytes(tmp_path / "ckpt", _raw(w[50:52]))  # a byte of rank 1's rows
    bad = _reshard(tmp_path, "qdcp")
    assert all(r[0] == "ChecksumError" and "key 'w'" in r[1] for r in bad.values()), bad
    stock = _reshard(tmp_path, "stock")
    assert stock[0][0] == "loaded" and torch.equal(stock[0][1], w[:32])
