"""qdcp.reading: what read_metadata, describe and read_stored report of a checkpoint, on disk or
behind an fsspec URL."""
from __future__ import annotations

import math
import pickle
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from qdcp import CheckpointFormatError, QuantizedSavePlanner
from quantized_cases import CASE_BY_NAME, CASES, qdcp_save


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_describe_reports_the_bytes_really_stored(tmp_path, case):
    """``describe()``'s byte count is the checkpoint's own: the items DCP recorded for the entry
    (and, raw, the source's inner buffers, every one of them stored)."""
    from torch.distributed.checkpoint import FileSystemReader

    source = case.make(0)
    path = qdcp_save(str(tmp_path / "ckpt"), {"w": source}, no_dist=True)
    items = {k: v for k, v in FileSystemReader(path).read_metadata().state_dict_metadata.items()
             if k.startswith("w.__qdcp__.")}
    info = qdcp.describe(path)["w"]
    assert info["bytes"] == sum(math.prod(v.size) * v.properties.dtype.itemsize for v in items.values())
    assert set(info["components"]) == {k.split(".__qdcp__.")[1] for k in items}
    stored = qdcp.read_stored(path, "w").components
    assert info["bytes"] == sum(t.numel() * t.element_size() for t in stored.values())


def test_describe_and_read_metadata_of_an_fsspec_url():
    url = f"memory://qdcp-{uuid.uuid4().hex}"
    dcp.save({"nf4": CASE_BY_NAME["nf4"].make(0), "bias": torch.full((3,), 1.0), "step": 3}, checkpoint_id=url,
             planner=QuantizedSavePlanner())
    info = qdcp.describe(url)
    assert info["nf4"]["stored_as"] == "raw" and info["bias"]["stored_as"] == "plain"
    assert qdcp.read_metadata(url).state_dict_metadata["bias"].size == torch.Size([3])


def test_tampered_metadata_pickle_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save({"w": CASE_BY_NAME["int8_group32"].make(0)}, checkpoint_id=path, planner=QuantizedSavePlanner())

    class Payload:
        def __reduce__(self):
            return (print, ("pwned",))

    (path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointFormatError, match="builtins.print"):
        qdcp.describe(path)
    with pytest.raises(CheckpointFormatError):
        qdcp.CheckpointReader(path).read_metadata()


def test_describe_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        qdcp.describe(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointFormatError, match="no .metadata"):
        qdcp.describe(tmp_path / "empty")


def test_entries_read_verifies_every_item(tmp_path):
    """Reading entries without a target (``read_stored``, ``read_entry``, ``CheckpointEntries``
    and so ``qdcp export``) checks each item against the checksum its save recorded: a flipped
    byte in a component's values is a ChecksumError naming the key, never wrong values."""
    from qdcp.reading import CheckpointEntries
    from qdcp.storage import ChecksumError

    path = tmp_path / "ckpt"
    source = CASE_BY_NAME["int8_group32"].make(0)
    dcp.save({"layer.w": source}, checkpoint_id=path, planner=QuantizedSavePlanner())
    entries = CheckpointEntries(path)
    assert torch.equal(entries.stored("layer.w").components["qdata"], source.qdata)
    info = next(v for k, v in entries.metadata.storage_data.items() if k.fqn == "layer.w.__qdcp__.qdata")
    data = path / info.relative_path
    raw = bytearray(data.read_bytes())
    raw[info.offset + info.length // 2] ^= 0x5A
    data.write_bytes(bytes(raw))
    for read in (lambda: qdcp.read_stored(path, "layer.w"), lambda: CheckpointEntries(path).stored("layer.w"),
                 lambda: qdcp.read_entry(path, "layer.w", dequantize=True),
                 lambda: qdcp.export(path, tmp_path / "out", format="torchao", progress=False)):
        with pytest.raises(ChecksumError, match="key 'layer.w'"):
            read()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no OUT_DIR, no temporary directory


@pytest.mark.parametrize("writer", ["dcp", "qdcp"])
def test_entries_reuse_memory_read_in_place(tmp_path, writer):
    """``CheckpointEntries(reuse_memory=True)`` reads each entry into one buffer kept from read to
    read: the tensors are views of it (strides as saved: a transposed tensor stays transposed),
    bit-equal to an ordinary read, and the next read of an entry the same size lands at the same
    address. Items are still verified: a flipped byte is a ChecksumError naming the key, both for
    checksums qdcp's planner recorded and for torch.save's zip CRCs (a stock DCP save)."""
    from qdcp.reading import CheckpointEntries
    from qdcp.storage import ChecksumError

    torch.manual_seed(0)
    state = {"a": torch.randn(64, 48), "b": torch.randn(64, 48), "t": torch.randn(48, 32).t(),
             "mask": torch.rand(17) > 0.5, "empty": torch.empty(0, 8), "q": CASE_BY_NAME["int8_group32"].make(0)}
    planner = QuantizedSavePlanner() if writer == "qdcp" else None
    dcp.save({k: v for k, v in state.items() if writer == "qdcp" or k != "q"}, checkpoint_id=tmp_path / "c",
             planner=planner)
    plain = CheckpointEntries(tmp_path / "c")
    reused = CheckpointEntries(tmp_path / "c", reuse_memory=True)
    for key in ("t", "mask", "empty"):
        got = reused.entry(key)
        assert torch.equal(got, state[key]) and got.dtype == state[key].dtype
        assert torch.equal(plain.entry(key), state[key])
    assert reused.entry("t").stride() == state["t"].stride()  # as saved, not made contiguous
    first = reused.entry("a")
    assert torch.equal(first, state["a"]) and torch.equal(first, plain.entry("a"))
    second = reused.entry("b")
    assert torch.equal(second, state["b"]) and second.data_ptr() == first.data_ptr()
    if writer == "qdcp":
        stored = reused.stored("q")
        for name, value in plain.stored("q").components.items():
            assert torch.equal(stored.components[name], value)
    info = next(v for k, v in reused.metadata.storage_data.items() if k.fqn == "b")
    data = tmp_path / "c" / info.relative_path
    raw = bytearray(data.read_bytes())
    raw[info.offset + info.length // 2] ^= 0x5A
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="key 'b'"):
        CheckpointEntries(tmp_path / "c", reuse_memory=True).entry("b")


def test_read_entry_of_objects_reads_them_safely(tmp_path):
    """Non-tensor entries come back as saved, read without a load planner and unpickled without
    running code (a class outside the allowlist is refused, naming the key)."""
    import argparse
    import fractions

    path = str(tmp_path / "ckpt")
    objects = {"step": 7, "args": argparse.Namespace(lr=0.5), "names": ["a", "b"]}
    qdcp.save({**objects, "w": torch.arange(4.0)}, path)
    for key, value in objects.items():
        assert qdcp.read_entry(path, key) == value
    bad = str(tmp_path / "bad")
    qdcp.save({"third": fractions.Fraction(1, 3)}, bad)
    with pytest.raises(qdcp.LoadMismatchError, match="'third'.*fractions.Fraction"):
        qdcp.read_entry(bad, "third")
