"""Direct writes (qdcp.io.direct): an async save's large items go to the disk from the
staging buffers (``O_DIRECT``; a synchronous save's too with ``direct_io=True``), each item placed
up to a block after the previous one so that its data lands at a file offset congruent to its
address; every byte still reads back exactly, through stock DCP and qdcp, and the items' bytes are
those a buffered save writes."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qdcp
from cli_in_process import qdcp_cli
from qdcp import CheckpointWriter, QuantizedSavePlanner, QuantizedStager
from qdcp.io import direct, pipeline
from qdcp.io.pipeline import DIRECT_UPLOAD_BELOW_CORES
from qdcp.io.torch_save import ViewReader, _record_start
from stored_bytes import gap_bytes, stored_items

BLOCK = direct.BLOCK


def _direct_dir(base: Path) -> Path | None:
    """A directory under ``base`` (else under the checkout) whose file system takes O_DIRECT."""
    for root in (base, Path(__file__).resolve().parent.parent):
        d = Path(tempfile.mkdtemp(prefix="qdcp-direct-", dir=root))
        f = direct.open_direct(str(d / "probe"))
        if f is not None:
            f.close()
            os.remove(d / "probe")
            return d
    return None


@pytest.fixture
def ddir(tmp_path):
    if not direct.supported():
        pytest.skip("no O_DIRECT on this platform")
    d = _direct_dir(tmp_path)
    if d is None:
        pytest.skip("no file system here takes O_DIRECT")
    yield d
    if tmp_path not in d.parents:
        shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- DirectFile, generated

_write = st.tuples(st.integers(0, 3 * 8192), st.integers(0, 63), st.booleans())  # (size, address offset, large)
_item = st.lists(_write, min_size=0, max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(_item, min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_a_direct_file_holds_each_item_at_its_offset(ddir, monkeypatch, items, seed):
    """The rule from the module's docs: every item's bytes lie at ``[item_start, item_start + n)``,
    in order, each starting less than a block after the previous one ends (zeros between); the
    file ends with the last item; a large write that starts its item lands at a file offset
    congruent to its address (mod BLOCK)."""
    monkeypatch.setattr(direct, "DIRECT_MIN", 8192)
    monkeypatch.setattr(direct, "BUFFER_BYTES", 16384)  # runs flushed mid-item too
    monkeypatch.setattr(direct, "_HELD_MAX", 4096)
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (64 * 8192,), dtype=torch.uint8, generator=g)
    path = ddir / f"f{seed}"
    expected, placed, first_large = [], [], []
    cursor = 0
    with direct.open_direct(str(path)) as f:
        for writes in items:
            f.start_item()
            data, first = bytearray(), None
            for size, shift, large in writes:
                size = size + 8192 if large else size % 200  # large ones over DIRECT_MIN
                at = (cursor * 64 + shift * 64 + shift) % (pool.numel() - size)
                cursor += 1
                piece = pool[at: at + size]
                if first is None and size >= 8192 and len(data) <= 4096:
                    first = (len(data), piece.data_ptr())
                f.write(memoryview(piece.numpy()))
                data += piece.numpy().tobytes()
            start = f.item_start()
            assert f.tell() - start == len(data)
            expected.append(bytes(data))
            placed.append(start)
            first_large.append(first)
        f.finish()
    raw = path.read_bytes()
    end = 0
    for data, start, first in zip(expected, placed, first_large):
        assert end <= start < end + BLOCK and raw[end:start] == bytes(start - end)
        assert raw[start: start + len(data)] == data
        if first is not None:
            assert (start + first[0] - first[1]) % BLOCK == 0
        end = start + len(data)
    assert len(raw) == end


def test_a_direct_write_the_file_system_refuses_is_written_buffered(ddir):
    """EINVAL from a direct write (here: memory the device cannot take directly) turns direct
    writes off for the rest of the file; its bytes, and the later ones, are written all the same."""
    data = torch.randint(0, 256, (3 * direct.DIRECT_MIN + 5,), dtype=torch.uint8)
    off = (-data.data_ptr() % BLOCK) + 1  # an address one past a block
    with direct.open_direct(str(ddir / "f")) as f:
        f.start_item()
        f._write_direct(memoryview(data[off:].numpy()))  # bypassing write()'s placement
        assert not f._direct
        f.write(memoryview(data.numpy()))
        f.finish()
    assert (ddir / "f").read_bytes() == data[off:].numpy().tobytes() + data.numpy().tobytes()


def test_a_file_system_without_o_direct_gets_buffered_files(tmp_path):
    tmpfs = next((line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                  if line.split()[2] == "tmpfs" and os.access(line.split()[1], os.W_OK)), None) \
        if Path("/proc/mounts").exists() else None
    if tmpfs is None or not direct.supported():
        pytest.skip("no writable tmpfs with O_DIRECT refused here")
    d = Path(tempfile.mkdtemp(dir=tmpfs))
    try:
        f = direct.open_direct(str(d / "probe"))
        if f is not None:
            f.close()
            pytest.skip(f"{tmpfs} takes O_DIRECT")
        state = {"w": torch.randn(1 << 19), "v": torch.arange(7)}
        qdcp.save(state, d / "c")
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(target, checkpoint_id=d / "c")
        assert all(torch.equal(target[k], state[k]) for k in state)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- saves

def _state(seed: int) -> dict:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(1024, 1536, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(1536, 1024, generator=g))
    quantize_(torch.nn.Sequential(lin), Int8WeightOnlyConfig())
    wide = torch.randn(700, 900, generator=g)
    return {
        "q": lin.weight.detach(),  # an Int8Tensor: 1.5 MiB of qdata, small scales
        "f32": torch.randn(3, 1 << 17, generator=g),  # 1.5 MiB
        "bf16": torch.randn(1 << 20, generator=g).to(torch.bfloat16),  # 2 MiB
        "i16": torch.randint(-9, 9, (1 << 20,), dtype=torch.int16, generator=g)[1:],  # a view, odd address
        "cols": wide[:, 1:],  # not contiguous: written from a copy
        "small": torch.arange(11),
        "step": seed,
    }


def _data_offsets(path: Path) -> dict[str, int]:
    """Where each stored tensor item's data record starts in its file, by fqn."""
    md = qdcp.read_metadata(path)
    out = {}
    for index, info in md.storage_data.items():
        raw = memoryview((path / info.relative_path).read_bytes())[info.offset: info.offset + info.length]
        if bytes(raw[:4]) != b"PK\x03\x04":
            continue
        with zipfile.ZipFile(ViewReader(raw)) as z:
            rec = next((i for i in z.infolist() if "/data/" in i.filename), None)  # none: a pickled object
        if rec is not None:
            out[index.fqn] = info.offset + _record_start(raw, rec)
    return out


def _equal(a, b) -> bool:
    if hasattr(a, "qdata"):
        return torch.equal(a.qdata, b.qdata) and torch.equal(a.scale, b.scale)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _empty_like(state: dict) -> dict:
    fresh = _state(99)
    return {k: fresh[k] for k in state}


def _large(state: dict) -> dict[str, torch.Tensor]:
    """The stored names and tensors of the state's items of 1 MiB or more written from their own memory."""
    return {"q.__qdcp__.qdata": state["q"].qdata, "f32": state["f32"], "bf16": state["bf16"]}


def _assert_written_from(path: Path, sources: dict[str, torch.Tensor]) -> None:
    """Each item's data lies in its file at an offset congruent (mod BLOCK) to the address of the
    memory it was written from: the placement a direct write needs."""
    where = _data_offsets(path)
    for fqn, t in sources.items():
        assert (where[fqn] - t.data_ptr()) % BLOCK == 0, fqn


def _reads_back(path: Path, state: dict) -> None:
    target = _empty_like(state)
    qdcp.load(target, path)
    assert all(_equal(target[k], state[k]) for k in state)
    plain = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor) and k != "q"}
    dcp.load(plain, checkpoint_id=path)  # stock DCP's reader and planner
    assert all(torch.equal(plain[k], state[k]) for k in plain)
    verified = qdcp_cli("verify", path)  # every item's checksum, through the CLI
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_sync_save_is_buffered_unless_asked_and_then_written_from_the_tensors(ddir):
    """``qdcp.save`` (training waits for it) writes buffered by default: items end to end. With
    ``direct_io=True`` each large item's data lies at an offset congruent to the tensor's own
    address; the stored items are byte for byte the same; both read back exactly."""
    state = _state(1)
    qdcp.save(state, ddir / "b")
    qdcp.save(state, ddir / "d", storage_options={"direct_io": True})
    assert stored_items(ddir / "d") == stored_items(ddir / "b")
    assert gap_bytes(ddir / "b") == 0 and gap_bytes(ddir / "d") > 0
    _assert_written_from(ddir / "d", _large(state))
    buffered = _data_offsets(ddir / "b")
    assert any((buffered[f] - t.data_ptr()) % BLOCK for f, t in _large(state).items())  # not so by chance
    for name in ("d", "b"):
        _reads_back(ddir / name, state)


def _staged(stager: QuantizedStager, sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stager's buffer holding each source's copy (found by its bytes: the sources differ)."""
    buffers = list(stager._buffers.values())
    out = {}
    for fqn, t in sources.items():
        found = [b for b in buffers if b.shape == t.shape and b.dtype == t.dtype and torch.equal(b, t)]
        assert len(found) == 1, fqn
        out[fqn] = found[0]
    return out


@pytest.fixture
def cores(monkeypatch):
    """Pin the cores the writers see this process may use (``qdcp.io.pipeline.usable_cores``)."""
    def pin(n: int) -> None:
        monkeypatch.setattr(pipeline, "usable_cores", lambda: n)
    return pin


@pytest.mark.parametrize("how", ["qdcp.async_save", "qdcp.async_save, kept stager", "dcp.async_save + writer"])
def test_an_async_save_writes_from_the_staging_buffers(ddir, cores, how):
    """An async save (its upload runs beside training) on a host of few cores writes each large
    item straight from the stager's buffer that holds it; the items are those a buffered save
    stores; all read back."""
    cores(DIRECT_UPLOAD_BELOW_CORES - 1)
    state = _state(2)
    path = ddir / "c"
    kept = QuantizedStager() if "kept" in how else None
    writer = CheckpointWriter(path) if how == "dcp.async_save + writer" else None
    try:
        if writer is not None:
            fut = dcp.async_save(state, storage_writer=writer, planner=QuantizedSavePlanner())
        else:
            fut = qdcp.async_save(state, path, stager=kept)
        getattr(fut, "upload_completion", fut).result()
        stager = kept or (writer._stager if writer is not None else None)
        if stager is not None:
            _assert_written_from(path, _staged(stager, _large(state)))
        assert gap_bytes(path) > 0
    finally:
        if kept is not None:
            kept.close()
    qdcp.save(state, ddir / "b")
    assert stored_items(path) == stored_items(ddir / "b")
    _reads_back(path, state)


@pytest.mark.parametrize("usable, direct_io", [(2, None), (DIRECT_UPLOAD_BELOW_CORES - 1, None),
                                               (DIRECT_UPLOAD_BELOW_CORES, None), (64, None), (64, True), (2, False)])
def test_an_async_upload_is_written_buffered_on_a_host_of_many_cores(ddir, cores, usable, direct_io):
    """``direct_io=None``: an async save's upload is written directly where the process may use
    fewer than ``DIRECT_UPLOAD_BELOW_CORES`` cores, buffered (no alignment gaps) where it may use
    as many or more; ``True`` / ``False`` hold on any host; a synchronous save is buffered unless
    asked. Either way the stored items are those of a buffered save and read back."""
    cores(usable)
    state = _state(2)
    for name, save in (("a", qdcp.async_save), ("s", qdcp.save)):
        result = save(state, ddir / name, storage_options={"direct_io": direct_io})
        if name == "a":
            getattr(result, "upload_completion", result).result()
    direct = direct_io if direct_io is not None else usable < DIRECT_UPLOAD_BELOW_CORES
    assert (gap_bytes(ddir / "a") > 0) == direct
    assert (gap_bytes(ddir / "s") > 0) == bool(direct_io)
    assert stored_items(ddir / "a") == stored_items(ddir / "s")
    _reads_back(ddir / "a", state)


@pytest.mark.parametrize("direct_io, shared", [(None, False), (True, False), (False, False), (True, True)])
def test_a_writer_given_a_stager_by_dcp_writes_as_told(ddir, direct_io, shared):
    """``dcp.async_save(..., async_stager=...)`` stages without the writer: at its default the
    writer cannot tell the save is async and writes buffered; ``direct_io=True`` writes direct
    (from shared-memory buffers too, as the process checkpointer's stager holds them)."""
    state = _state(3)
    stager = QuantizedStager(share_memory=shared)
    try:
        fut = dcp.async_save(state, storage_writer=CheckpointWriter(ddir / "c", direct_io=direct_io),
                             planner=QuantizedSavePlanner(), async_stager=stager)
        getattr(fut, "upload_completion", fut).result()
        if direct_io:
            _assert_written_from(ddir / "c", _staged(stager, _large(state)))
        assert (gap_bytes(ddir / "c") == 0) == (not direct_io)
    finally:
        stager.close()
    dcp.save(state, storage_writer=CheckpointWriter(ddir / "s", thread_count=3, direct_io=direct_io),
             planner=QuantizedSavePlanner())
    assert (gap_bytes(ddir / "s") == 0) == (not direct_io)
    _reads_back(ddir / "c", state)
    _reads_back(ddir / "s", state)


def test_a_save_that_fails_midway_leaves_no_direct_file(ddir, monkeypatch):
    """A write error inside a direct file (here: the disk full) removes what the save wrote, and
    an existing checkpoint at the path stays as it was."""
    state = _state(4)
    qdcp.save(state, ddir / "c", storage_options={"direct_io": True})
    before = {n: (ddir / "c" / n).read_bytes() for n in os.listdir(ddir / "c")}
    real = os.pwrite

    def full(fd, data, offset):
        if memoryview(data).nbytes >= direct.DIRECT_MIN:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(Exception, match="No space left"):
        qdcp.save(_state(5), ddir / "c", overwrite=True, storage_options={"direct_io": True})
    monkeypatch.setattr(os, "pwrite", real)
    assert {n: (ddir / "c" / n).read_bytes() for n in os.listdir(ddir / "c")} == before
    target = _empty_like(state)
    qdcp.load(target, ddir / "c")
    assert all(_equal(target[k], state[k]) for k in state)


_DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.int16, torch.float64, torch.uint8]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(st.tuples(st.sampled_from(_DTYPES), st.integers(1, 9000), st.integers(0, 2)),
                      min_size=1, max_size=6),
       threads=st.integers(1, 3), trailers=st.booleans(), seed=st.integers(0, 2**16))
def test_generated_saves_written_directly_store_what_buffered_ones_store(ddir, monkeypatch, specs, threads,
                                                                         trailers, seed):
    """Generated state dicts (dtypes, sizes on both sides of the direct threshold, views and
    non-contiguous tensors), 1-3 files, with the writer's own checksum trailers or the planner's
    record: a direct save stores each item's bytes exactly as a buffered save does, and both read
    back bit for bit (stock DCP too, where no trailers need qdcp's reader)."""
    monkeypatch.setattr(direct, "DIRECT_MIN", 4096)  # most items go direct
    monkeypatch.setattr(direct, "BUFFER_BYTES", 8192)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i, (dtype, n, kind) in enumerate(specs):
        base = torch.randn(n + 3, generator=g).mul(50)
        t = base.to(dtype) if dtype.is_floating_point else base.to(torch.int64).clamp(-100, 100).to(dtype)
        state[f"t{i}"] = t[:n] if kind == 0 else t[3:] if kind == 1 else t[: (n + 3) // 2 * 2].view(-1, 2)[:, 0]
    state["step"] = seed
    out, here = {}, Path(tempfile.mkdtemp(dir=ddir))  # one directory per example
    for name, direct_io in (("d", True), ("b", False)):
        writer = CheckpointWriter(here / name, thread_count=threads, checksums=True, direct_io=direct_io)
        dcp.save(state, storage_writer=writer, planner=QuantizedSavePlanner(checksums=not trailers))
        out[name] = here / name
    assert stored_items(out["d"]) == stored_items(out["b"])
    for path in out.values():
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
        qdcp.load(target, path)
        assert all(torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v
                   for k, v in state.items())
        if not trailers:
            plain = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
            dcp.load(plain, checkpoint_id=path)
            assert all(torch.equal(plain[k], state[k]) for k in plain)


def test_files_not_fsyncd_are_written_buffered(ddir):
    """``sync_files=False`` asks for the page cache (the save returns before the disk has the
    bytes): no direct writes then, even with ``direct_io=True``; the checkpoint reads back."""
    state = _state(6)
    dcp.save(state, storage_writer=CheckpointWriter(ddir / "c", direct_io=True, sync_files=False),
             planner=QuantizedSavePlanner())
    assert gap_bytes(ddir / "c") == 0
    _reads_back(ddir / "c", state)
