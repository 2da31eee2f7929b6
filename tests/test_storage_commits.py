"""qdcp.storage, its commit protocol: atomic commits, crashes (SIGKILL in a subprocess at several points), checksums
found flipped, overwrite rules."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from cli_in_process import qdcp_cli
from crash_worker import state
from qdcp import CheckpointFormatError, QdcpError, QuantizedLoadPlanner, QuantizedSavePlanner
from qdcp.storage import CheckpointReader, CheckpointWriter, ChecksumError
from quantized_cases import assert_same_buffers, raise_inner

WORKER = os.path.join(os.path.dirname(__file__), "crash_worker.py")


def save(path, version, overwrite=False, planner_checksums=True, **kw):
    dcp.save(state(version), storage_writer=CheckpointWriter(path, overwrite=overwrite, **kw),
             planner=QuantizedSavePlanner(checksums=planner_checksums), no_dist=True)


def load(path):
    out = state(99)
    raise_inner(lambda: dcp.load(out, storage_reader=CheckpointReader(path), planner=QuantizedLoadPlanner(),
                            no_dist=True))
    return out


def assert_is_version(loaded, version):
    expected = state(version)
    for k in ("int8", "nf4", "mx"):
        assert_same_buffers(loaded[k], expected[k])
    assert torch.equal(loaded["bias"], expected["bias"]) and loaded["step"] == version


def crash(path, version, kill_at, overwrite=False, mode="sync"):
    args = [sys.executable, WORKER, str(path), str(version), kill_at] + (["--overwrite"] if overwrite else [])
    args += ["--async"] if mode == "async" else []
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])


def verify(path):
    """``qdcp verify PATH``, through the CLI's ``main`` in this process (tests/cli_in_process.py)."""
    return qdcp_cli("verify", path)


KILL_POINTS = ["resolve:1", "resolve:4", "resolve:9", "before_commit", "replace", "cleanup"]


@pytest.mark.parametrize("mode, kill_at", [("sync", k) for k in KILL_POINTS] +
                         [("async", k) for k in ("resolve:2", "before_commit", "cleanup")])
def test_killed_overwrite_leaves_a_loadable_checkpoint(tmp_path, mode, kill_at):
    path = tmp_path / "ckpt"
    save(path, 1)
    crash(path, 2, kill_at, overwrite=True, mode=mode)
    # killed before the commit: the old checkpoint, untouched; after it: the new one
    assert_is_version(load(path), 2 if kill_at == "cleanup" else 1)
    assert verify(path).returncode == 0
    # the next save cleans the debris of the killed one
    save(path, 3, overwrite=True)
    assert_is_version(load(path), 3)
    referenced = {i.relative_path for i in qdcp.read_metadata(path).storage_data.values()}
    assert {n for n in os.listdir(path) if n.endswith(".distcp")} == referenced


@pytest.mark.parametrize("mode, kill_at", [("sync", "resolve:1"), ("sync", "resolve:9"),
                                           ("sync", "before_commit"), ("sync", "replace"),
                                           ("async", "resolve:3")])
def test_killed_first_save_is_detected_as_partial(tmp_path, mode, kill_at):
    path = tmp_path / "fresh"
    crash(path, 2, kill_at, mode=mode)
    assert path.is_dir() and not (path / ".metadata").exists()
    # DCP re-raises a reader's metadata error as an AssertionError that carries qdcp's message
    with pytest.raises((CheckpointFormatError, AssertionError), match="did not finish"):
        load(path)
    proc = verify(path)
    assert proc.returncode == 2 and "did not finish" in proc.stderr


def test_overwrite_needs_an_explicit_choice(tmp_path):
    path = tmp_path / "ckpt"
    save(path, 1)
    before = {n: (path / n).read_bytes() for n in os.listdir(path)}
    with pytest.raises(QdcpError, match="already exists.*overwrite=True"):
        raise_inner(lambda: save(path, 2))
    assert {n: (path / n).read_bytes() for n in os.listdir(path)} == before
    assert_is_version(load(path), 1)


def test_second_save_to_a_path_in_flight_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    errors = []

    class Nested(QuantizedSavePlanner):
        def resolve_data(self, item):
            if not errors:
                try:
                    raise_inner(lambda: save(path, 5, overwrite=True))
                except QdcpError as e:
                    errors.append(e)
            return super().resolve_data(item)

    dcp.save(state(1), storage_writer=CheckpointWriter(path), planner=Nested(), no_dist=True)
    assert errors and "in progress" in str(errors[0])
    assert_is_version(load(path), 1)
    save(path, 2, overwrite=True)  # released after the first save finished
    assert_is_version(load(path), 2)


def _item_at(md, file_name, offset):
    for index, info in md.storage_data.items():
        if info.relative_path == file_name and info.offset <= offset < info.offset + info.length:
            return index.fqn
    return None


def _flip_every_30th_of_the_file(path, planner_checksums: bool):
    """Flip one byte at 30 places spread over the data file; yield (item fqn, outcome) where the
    outcome is the error a load raised, or None for a load that returned the saved values."""
    save(path, 1, planner_checksums=planner_checksums)
    md = qdcp.read_metadata(path)
    (data_file,) = [n for n in os.listdir(path) if n.endswith(".distcp")]
    raw = (path / data_file).read_bytes()
    for off in sorted({int(i * (len(raw) - 1) / 29) for i in range(30)}):
        flipped = bytearray(raw)
        flipped[off] ^= 0x5A
        (path / data_file).write_bytes(bytes(flipped))
        try:
            assert_is_version(load(path), 1)
            outcome = None
        except QdcpError as e:
            outcome = e
        yield _item_at(md, data_file, off), off, outcome
    (path / data_file).write_bytes(raw)
    assert_is_version(load(path), 1)


@pytest.mark.parametrize("planner_checksums", [True, False])
def test_flipped_byte_never_loads_wrong_values(tmp_path, planner_checksums):
    """qdcp's writer hashes each item's values as it writes them, whatever the planner records. A
    flip in stored values is a ChecksumError naming the key; a flip in torch.save's framing fails
    as unreadable, naming the key, or (bytes no value depends on) loads the exact values. Never
    wrong values."""
    outcomes = list(_flip_every_30th_of_the_file(tmp_path / "ckpt", planner_checksums=planner_checksums))
    for fqn, off, error in outcomes:
        if error is not None:
            assert f"key '{fqn.split('.__qdcp__.')[0]}'" in str(error), (off, error)
    assert sum(isinstance(e, ChecksumError) for _, _, e in outcomes) >= 5


def test_checksums_off_gives_a_stock_readable_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(10.0), "n": 3}, storage_writer=CheckpointWriter(path, checksums=False))
    out = {"w": torch.zeros(10), "n": 0}
    dcp.load(out, checkpoint_id=path)  # stock reader
    assert torch.equal(out["w"], torch.arange(10.0)) and out["n"] == 3


def test_async_save_through_checkpoint_writer_stages_quantized_tensors(tmp_path):
    """With qdcp's writer and no explicit stager, DCP stages through the writer: it must copy
    quantized tensors by their inner buffers, and the live state may change right after."""
    live = state(1)
    path = tmp_path / "ckpt"
    writer = CheckpointWriter(path)
    fut = dcp.async_save(live, storage_writer=writer, planner=QuantizedSavePlanner())
    live["int8"].qdata.zero_()  # training goes on
    fut.result()
    writer.close()
    assert_is_version(load(path), 1)


def test_async_save_through_checkpoint_writer_uses_the_stager_it_was_given(tmp_path):
    """``CheckpointWriter(path, stager=s)``: DCP stages through the writer, which hands the call to
    ``s`` (its buffers hold the staged copy) and leaves ``s`` open for the caller's next save."""
    stager = qdcp.QuantizedStager()
    for version in (1, 2):
        live = state(version)
        path = tmp_path / f"ckpt{version}"
        writer = CheckpointWriter(path, stager=stager)
        fut = dcp.async_save(live, storage_writer=writer, planner=QuantizedSavePlanner())
        live["int8"].qdata.zero_()
        fut.result()
        writer.close()  # not the writer's to close: the stager keeps its buffers for the next save
        assert stager.staged_nbytes > 0  # still open, its buffers kept for the next save
        assert_is_version(load(path), version)
    stager.close()
    with pytest.raises(qdcp.StagingError, match="closed"):
        stager.stage(state(3))


def test_storage_package_does_not_import_staging():
    """The writer asks for a stager through a factory (``set_default_stager``), never imports one."""
    import ast
    import pathlib

    for f in pathlib.Path(qdcp.storage.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(n.startswith(("qdcp.staging", "qdcp.planning")) for n in names), (f, names)
