"""qdcp's write pipeline (qdcp.io.pipeline): files on threads, torch.save archives without the
redundant zip CRC-32s, read back bit for bit by stock DCP and by qdcp."""

from __future__ import annotations

import io
import os
import zipfile

import torch
import torch.distributed.checkpoint as dcp

import qdcp
from qdcp import CheckpointWriter, QuantizedLoadPlanner, QuantizedSavePlanner
from qdcp.io import pipeline
from qdcp.io.torch_save import _record_start


def _archive(t: torch.Tensor, crc: bool) -> bytes:
    out = io.BytesIO()
    pipeline.serialize_tensor(t, out, crc=crc)
    return out.getvalue()


def _records(archive: bytes) -> list[tuple[str, int, int, bytes]]:
    """Each zip record of ``archive``: name, offset, size and stored bytes (CRCs aside)."""
    view = memoryview(archive)
    return [(i.filename, i.header_offset, i.file_size,
             bytes(view[_record_start(view, i): _record_start(view, i) + i.compress_size]))
            for i in zipfile.ZipFile(io.BytesIO(archive)).infolist()]


def test_an_archive_without_crcs_is_torch_saves_with_zero_crcs():
    t = torch.randn(7, 33).to(torch.bfloat16)[:, 1:]  # a view: torch.save writes its whole storage
    plain = io.BytesIO()
    torch.save(t, plain)
    ours = _archive(t, crc=False)
    assert all(i.CRC == 0 for i in zipfile.ZipFile(io.BytesIO(ours)).infolist())
    assert len(ours) == len(plain.getvalue())
    # every record at the same place with the same bytes; the serialization id is derived from the CRCs
    same = lambda rs: [r if not r[0].endswith("serialization_id") else r[:3] for r in rs]  # noqa: E731
    assert same(_records(ours)) == same(_records(plain.getvalue()))
    assert _archive(t, crc=True) == plain.getvalue()
    loaded = torch.load(io.BytesIO(ours), weights_only=True)  # torch.load does not check CRCs
    assert loaded.stride() == t.stride() and torch.equal(loaded.view(torch.int16), t.view(torch.int16))


def _state(seed: int, n: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(256, 64 + i, generator=g) for i in range(n)} | {"step": seed, "b": torch.arange(5)}


def _crcs(path) -> list[int]:
    """The zip CRC-32 of every torch.save record in the checkpoint's data files."""
    md = qdcp.read_metadata(path)
    out = []
    for info in md.storage_data.values():
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if data[:4] == b"PK\x03\x04":
            out += [i.CRC for i in zipfile.ZipFile(io.BytesIO(data)).infolist() if "/data/" in i.filename]
    return out


def test_files_on_threads_read_back_bitwise_by_stock_dcp_and_qdcp(tmp_path):
    saved = _state(1)
    dcp.save(saved, storage_writer=CheckpointWriter(tmp_path / "c", thread_count=3), planner=QuantizedSavePlanner())
    names = sorted(n for n in os.listdir(tmp_path / "c") if n.endswith(".distcp"))
    assert [n.rsplit("_", 1)[1] for n in names] == ["0.distcp", "1.distcp", "2.distcp"]
    assert _crcs(tmp_path / "c") and set(_crcs(tmp_path / "c")) == {0}  # the planner's checksums check them
    for load in (lambda s: dcp.load(s, checkpoint_id=tmp_path / "c"),  # stock DCP's reader and planner
                 lambda s: qdcp.load(s, tmp_path / "c"),
                 lambda s: dcp.load(s, checkpoint_id=tmp_path / "c", planner=QuantizedLoadPlanner())):
        target = _state(2)
        load(target)
        assert all(torch.equal(target[k], saved[k]) for k in saved if k != "step") and target["step"] == 1


def test_crcs_are_kept_where_nothing_else_checks_an_item(tmp_path):
    saved = _state(3)
    dcp.save(saved, storage_writer=CheckpointWriter(tmp_path / "c", checksums=False),
             planner=QuantizedSavePlanner(checksums=False))
    crcs = _crcs(tmp_path / "c")
    assert crcs and 0 not in crcs
    dcp.save(saved, storage_writer=CheckpointWriter(tmp_path / "t"), planner=QuantizedSavePlanner(checksums=False))
    assert set(_crcs(tmp_path / "t")) == {0}  # the writer's trailers check them
    target = _state(4)
    qdcp.load(target, tmp_path / "t")
    assert all(torch.equal(target[k], saved[k]) for k in saved if k != "step")


def test_default_threads_split_only_large_saves(tmp_path):
    writer = CheckpointWriter(tmp_path / "c")
    assert writer.thread_count == pipeline.default_thread_count() and 1 <= writer.thread_count <= 4
    qdcp.save(_state(5), tmp_path / "small")
    assert len([n for n in os.listdir(tmp_path / "small") if n.endswith(".distcp")]) == 1
    items = [dcp.planner.WriteItem(index=dcp.metadata.MetadataIndex(f"k{i}"), type=dcp.planner.WriteItemType.TENSOR,
                                   tensor_data=dcp.planner.TensorWriteData(
                                       chunk=dcp.metadata.ChunkStorageMetadata((0,), (n,)),
                                       properties=dcp.metadata.TensorProperties(dtype=torch.uint8),
                                       size=torch.Size([n])))
             for i, n in enumerate([50, 40, 30, 20, 10])]
    groups = pipeline.split_items(items, 2)
    assert [[i.index.fqn for i in g] for g in groups] == [["k0", "k3", "k4"], ["k1", "k2"]]
    assert pipeline.split_items(items[:1], 4) == [items[:1]]


def test_default_stager_is_shared_and_its_buffers_reused(tmp_path):
    """dcp.async_save through qdcp's writers without a stager: the second save stages into the
    buffers the first allocated (one QuantizedStager shared by this process's writers)."""
    saved = _state(6)
    stagers = []
    for n in range(2):
        writer = CheckpointWriter(tmp_path / f"c{n}")
        result = dcp.async_save(saved, storage_writer=writer, planner=QuantizedSavePlanner())
        getattr(result, "upload_completion", result).result()
        del result
        stagers.append((writer._stager, {k: b.data_ptr() for k, b in writer._stager._buffers.items()}))
        writer.close()
    (first, ptrs), (second, again) = stagers
    assert second is first and again == ptrs and first.staged_nbytes > 0
    target = _state(7)
    qdcp.load(target, tmp_path / "c1")
    assert all(torch.equal(target[k], saved[k]) for k in saved if k != "step")


def test_writeback_starts_while_the_next_items_are_written(tmp_path, monkeypatch):
    """Buffered writes (``direct_io=False``; also where the file system refuses ``O_DIRECT``):
    where files are fsync'd, the disk is handed each file's bytes as they are written (in
    consecutive ranges from the start, each before the file's fsync), so the fsync waits for
    little; not where they are not fsync'd. The checkpoint reads back bit for bit."""
    advised: dict[int, list[tuple[int, int]]] = {}
    events: list[tuple[str, int]] = []
    real_advise, real_fsync = os.posix_fadvise, os.fsync

    def advise(fd, offset, length, advice):
        assert advice == os.POSIX_FADV_DONTNEED
        advised.setdefault(fd, []).append((offset, length))
        events.append(("advise", fd))
        return real_advise(fd, offset, length, advice)

    def fsync(fd):
        events.append(("fsync", fd))
        return real_fsync(fd)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    monkeypatch.setattr(os, "fsync", fsync)
    g = torch.Generator().manual_seed(0)
    saved = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(12)}  # 48 MiB: 24 MiB a file
    dcp.save(saved, storage_writer=CheckpointWriter(tmp_path / "c", thread_count=2, direct_io=False),
             planner=QuantizedSavePlanner())
    assert len(advised) == 2
    for fd in advised:  # every advice before its file's fsync
        last = max(i for i, e in enumerate(events) if e == ("advise", fd))
        assert ("fsync", fd) in events[last:]
    sizes = sorted(os.path.getsize(tmp_path / "c" / n) for n in os.listdir(tmp_path / "c") if n.endswith(".distcp"))
    for ranges in advised.values():
        assert ranges[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))
        assert all(n >= pipeline.WRITEBACK_BYTES for _, n in ranges)
        covered = ranges[-1][0] + ranges[-1][1]
        assert any(0 <= size - covered < pipeline.WRITEBACK_BYTES for size in sizes)
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    qdcp.load(target, tmp_path / "c")
    assert all(torch.equal(target[k], saved[k]) for k in saved)

    advised.clear()
    dcp.save(saved, storage_writer=CheckpointWriter(tmp_path / "u", thread_count=2, sync_files=False,
                                                    direct_io=False),
             planner=QuantizedSavePlanner())
    assert not advised
