"""qdcp.storage: CheckpointWriter (every item's checksum recorded, whatever the planner),
CheckpointReader (checkpoints written before planner checksums, items verified when read in part),
and checkpoints through fsspec URLs: memory:// and s3:// against a real S3-compatible server (moto)
that the tests start on loopback (the ``s3_endpoint`` fixture, tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

import qdcp
from qdcp import (
    CheckpointFormatError,
    CheckpointReader,
    CheckpointWriter,
    ChecksumError,
    QuantizedLoadPlanner,
    QuantizedSavePlanner,
    checksums,
)
from quantized_cases import CASE_BY_NAME, assert_bitwise_equal, assert_same_buffers, raise_inner
from stored_bytes import flip_stored_bytes, tensor_bytes

CASES = [CASE_BY_NAME[n] for n in ("int8_group32", "mx_fp4_swizzled", "nf4", "optim8bit_signed")]
DATA = Path(__file__).with_name("data") / "qdcp-0.1-checkpoints"
INT8 = CASE_BY_NAME["int8_group32"]


def _state(seed):
    s = {c.name: c.make(seed) for c in CASES}
    s["bias"], s["step"] = torch.full((3,), float(seed)), seed
    return s


def _check(loaded, saved):
    for c in CASES:
        assert_same_buffers(loaded[c.name], saved[c.name])
    assert torch.equal(loaded["bias"], saved["bias"]) and loaded["step"] == saved["step"]


# ----------------------------------------------------------------------------- CheckpointWriter

@pytest.mark.parametrize("planner_checksums", [True, False])
def test_checkpoint_writer_records_every_items_checksum_whatever_the_planner(tmp_path, planner_checksums):
    """CheckpointWriter hashes every item as it writes it and records the hashes in the metadata,
    whatever the planner asks (no trailers: stock DCP reads the files); a flipped stored value is
    then refused through DCP's own reader too, by the load planner."""
    saved = _state(0)
    dcp.save(saved, storage_writer=CheckpointWriter(tmp_path / "c"),
             planner=QuantizedSavePlanner(checksums=planner_checksums))
    md = qdcp.read_metadata(tmp_path / "c")
    assert not any(info.transform_descriptors for info in md.storage_data.values())
    assert set(md.planner_data[checksums.PLANNER_DATA_KEY]["items"]) == set(md.state_dict_metadata)
    loaded = _state(1)
    raise_inner(lambda: dcp.load(loaded, checkpoint_id=tmp_path / "c", planner=QuantizedLoadPlanner()))
    _check(loaded, saved)
    flip_stored_bytes(tmp_path / "c", tensor_bytes(saved["int8_group32"].qdata))
    with pytest.raises(ChecksumError, match="key 'int8_group32'"):
        raise_inner(lambda: dcp.load(_state(1), checkpoint_id=tmp_path / "c", planner=QuantizedLoadPlanner()))


# ----------------------------------------------------------------------------- CheckpointReader

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
    flip_stored_bytes(copy, tensor_bytes(want["bias"]))
    with pytest.raises(ChecksumError if name == "crc32" else CheckpointFormatError, match="key 'bias'"):
        raise_inner(lambda: dcp.load(_v01_targets(), storage_reader=CheckpointReader(copy),
                                      planner=QuantizedLoadPlanner()))


def _reshard_worker(rank: int, root: str, loads: tuple[tuple[str, str], ...], results) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from dist_helpers import init_file_store_group

    init_file_store_group(root, rank, 2)
    mesh = init_device_mesh("cpu", (2,))
    for reader, name in loads:
        target = {"w": distribute_tensor(torch.zeros(64, 32), mesh, [Shard(0)])}
        storage = CheckpointReader(os.path.join(root, name)) if reader == "qdcp" else \
            dcp.FileSystemReader(os.path.join(root, name))
        try:
            dcp.load(target, storage_reader=storage, planner=QuantizedLoadPlanner())
            results[reader, name, rank] = ("loaded", target["w"].to_local().clone())
        except BaseException as e:  # noqa: BLE001 (CheckpointException)
            inner = next(iter(e.failures.values())) if isinstance(e, CheckpointException) else e
            inner = inner[0] if isinstance(inner, tuple) else inner
            results[reader, name, rank] = (type(inner).__name__, str(inner))
        dist.barrier()
    dist.destroy_process_group()


def _reshard(tmp_path, *loads: tuple[str, str]) -> dict:
    """``{(reader, checkpoint): {rank: outcome}}`` of loading each checkpoint (a directory under
    ``tmp_path``) at 2 ranks through the reader named beside it, in turn (one pair of spawned processes)."""
    results = mp.Manager().dict()
    mp.spawn(_reshard_worker, args=(str(tmp_path), loads, results), nprocs=2, join=True)
    (tmp_path / "store").unlink(missing_ok=True)
    return {load: {rank: results[(*load, rank)] for rank in range(2)} for load in loads}


def test_items_read_in_part_are_verified_by_checkpoint_reader(tmp_path):
    """Saved whole at 1 rank, loaded as Shard(0) at 2: each rank reads half of the stored chunk
    (the planner cannot check a part). CheckpointReader checks the whole stored chunk it loaded;
    stock DCP's reader does not, and a rank whose half holds no flipped byte loads fine."""
    w = torch.randn(64, 32)
    dcp.save({"w": w}, checkpoint_id=tmp_path / "ckpt", planner=QuantizedSavePlanner())
    shutil.copytree(tmp_path / "ckpt", tmp_path / "bad")
    flip_stored_bytes(tmp_path / "bad", tensor_bytes(w[50:52]))  # a byte of rank 1's rows
    after = _reshard(tmp_path, ("qdcp", "ckpt"), ("qdcp", "bad"), ("stock", "bad"))
    ok, bad, stock = after["qdcp", "ckpt"], after["qdcp", "bad"], after["stock", "bad"]
    assert all(r[0] == "loaded" for r in ok.values())
    assert torch.equal(torch.cat([ok[0][1], ok[1][1]]), w)
    assert all(r[0] == "ChecksumError" and "key 'w'" in r[1] for r in bad.values()), bad
    assert stock[0][0] == "loaded" and torch.equal(stock[0][1], w[:32])


# ----------------------------------------------------------------------------- fsspec URLs

def test_memory_url_round_trip():
    url = f"memory://qdcp-{uuid.uuid4().hex}"
    saved = _state(0)
    dcp.save(saved, checkpoint_id=url, planner=QuantizedSavePlanner())
    loaded = _state(1)
    dcp.load(loaded, checkpoint_id=url, planner=QuantizedLoadPlanner())
    _check(loaded, saved)
    # a dequantized copy read through the safe fsspec reader by stock DCP
    url2 = url + "-deq"
    dcp.save(saved, checkpoint_id=url2, planner=QuantizedSavePlanner(dequantize=True))
    plain = {c.name: torch.zeros(saved[c.name].shape, dtype=c.dtype) for c in CASES}
    dcp.load(plain, storage_reader=qdcp.storage_reader(url2), planner=QuantizedLoadPlanner(),
             )
    for c in CASES:
        assert_bitwise_equal(plain[c.name], c.dequantize(saved[c.name]))


def test_s3_round_trip(s3_endpoint):
    import s3fs
    opts = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    bucket = f"qdcp-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**opts).mkdir(bucket)
    url = f"s3://{bucket}/ckpt"
    saved = _state(0)
    dcp.save(saved, storage_writer=qdcp.storage_writer(url, **opts), planner=QuantizedSavePlanner())
    names = sorted(p.rsplit("/", 1)[1] for p in s3fs.S3FileSystem(**opts).ls(f"{bucket}/ckpt"))
    assert names[0] == ".metadata" and len(names) == 2 and names[1].endswith("_0_0.distcp")
    loaded = _state(1)
    dcp.load(loaded, storage_reader=qdcp.storage_reader(url, **opts),
             planner=QuantizedLoadPlanner())
    _check(loaded, saved)
    assert qdcp.read_metadata(url, **opts).state_dict_metadata["bias"].size == torch.Size([3])


def test_async_save_to_memory_url():
    url = f"memory://qdcp-{uuid.uuid4().hex}"
    saved = _state(0)
    live = _state(0)
    stager = qdcp.QuantizedStager()
    fut = dcp.async_save(live, storage_writer=qdcp.storage_writer(url), planner=QuantizedSavePlanner(),
                         async_stager=stager)
    live["int8_group32"].qdata.zero_()  # training goes on; the checkpoint keeps the staged values
    fut.result()
    stager.close()
    loaded = _state(1)
    dcp.load(loaded, storage_reader=qdcp.storage_reader(url), planner=QuantizedLoadPlanner())
    _check(loaded, saved)


def test_the_storage_says_what_it_does_in_the_storage_meta_it_gives_dcp(tmp_path):
    """qdcp's writer and reader declare what they do themselves in the ``StorageMeta`` DCP hands
    the planner (so that the planner does not do it again), and that declaration never reaches a
    file: the committed ``.metadata`` and one read by qdcp and pickled again hold DCP's class. The
    planner's extra capabilities are runtime-checkable protocols: qdcp's state them, DCP's do not."""
    import pickle

    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    from qdcp.reading.entries import _Assembler
    from qdcp.storage.reader import AdoptingLoadPlanner, ReportingLoadPlanner

    meta = CheckpointWriter(tmp_path / "c").storage_meta()
    assert (meta.guards_path, meta.hashes_items, meta.verifies_items) == (True, True, False)
    qdcp.save(_state(0), tmp_path / "c")
    md = CheckpointReader(tmp_path / "c").read_metadata()
    assert md.storage_meta.verifies_items and type(pickle.loads(pickle.dumps(md)).storage_meta) is StorageMeta
    with open(tmp_path / "c" / ".metadata", "rb") as f:
        assert type(pickle.load(f).storage_meta) is StorageMeta
    assert isinstance(qdcp.QuantizedLoadPlanner(), ReportingLoadPlanner)
    assert not isinstance(qdcp.QuantizedLoadPlanner(), AdoptingLoadPlanner)
    assert isinstance(_Assembler({}), AdoptingLoadPlanner)
    assert not isinstance(DefaultLoadPlanner(), (ReportingLoadPlanner, AdoptingLoadPlanner))
