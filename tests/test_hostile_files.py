"""Hostile and damaged checkpoint files: symlinks out of the checkpoint, FIFOs, and a small
``.metadata`` whose shared references stand for an exponential tree. Each is refused with
:class:`CheckpointFormatError` naming the file, before any target is changed, and never hangs
(what could hang runs in a child process under a timeout)."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from qdcp import CheckpointFormatError
from quantized_cases import CASE_BY_NAME, raise_inner
from state_dicts import assert_same_state, snapshot
from stored_bytes import resealed

pytestmark = pytest.mark.skipif(not hasattr(os, "symlink") or sys.platform == "win32", reason="POSIX files")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_TIMEOUT = 120


def _state(seed: int) -> dict:
    return {"w": CASE_BY_NAME["int8_row"].make(seed),
            "b": torch.randn(16, generator=torch.Generator().manual_seed(seed))}


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "c"
    qdcp.save(_state(0), path)
    return path


def _data_files(path) -> list[str]:
    return sorted({i.relative_path for i in qdcp.read_metadata(path).storage_data.values()})


def _outside_copy(path, name) -> str:
    """Move data file ``name`` out of the checkpoint (same bytes) and leave a symlink to it."""
    outside = str(path.parent / f"elsewhere-{name}")
    shutil.move(str(path / name), outside)
    os.symlink(outside, path / name)
    return outside


def _dcp_load(target, path):
    dcp.load(target, checkpoint_id=path, storage_reader=qdcp.storage_reader(path),
             planner=qdcp.QuantizedLoadPlanner())


def _error(load, target, path) -> str:
    """The message of the qdcp format error ``load(target, path)`` raises."""
    try:
        raise_inner(lambda: load(target, path))
    except CheckpointFormatError as e:
        return str(e)
    except AssertionError as e:  # dcp.load quotes a reader's .metadata error in its own AssertionError
        with pytest.raises(CheckpointFormatError) as got:
            qdcp.storage_reader(path).read_metadata()
        assert f"metadata read failed: {got.value}" in str(e), str(e)
        return str(got.value)
    raise AssertionError("it loaded")


def _refused(path, fragment: str, files: bool = True) -> None:
    """Both front doors refuse ``path`` with a format error whose message holds ``fragment`` (and,
    for ``files``, says which files qdcp reads); targets unchanged."""
    for load in (_dcp_load, qdcp.load):
        target = _state(7)
        before = snapshot(target)
        message = _error(load, target, path)
        assert fragment in message, message
        assert not files or "regular files inside the checkpoint directory" in message, message
        assert_same_state(target, before)


def _run(args: list[str], timeout: float = CHILD_TIMEOUT) -> subprocess.CompletedProcess:
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, ROOT, os.path.join(ROOT, "tests")])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _verify_refuses(path, fragment: str) -> None:
    """``qdcp verify`` prints one line naming the problem and exits 2 (unusable checkpoint)."""
    done = _run(["-m", "qdcp", "verify", str(path)])
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(lines) == 1 and fragment in lines[0], lines


def _in_child(call: str, timeout: float = CHILD_TIMEOUT) -> None:
    """Run ``call`` (a call of this module's helpers) in a child process: what could hang fails the test instead."""
    code = f"from test_hostile_files import _metadata_refused, _refused\n{call}\nprint('done')"
    done = _run(["-c", code], timeout)
    assert done.returncode == 0 and done.stdout.strip().endswith("done"), done.stdout + done.stderr


# ----------------------------------------------------------------------------- symlinks

def test_data_file_symlinked_outside_is_refused(ckpt):
    name = _data_files(ckpt)[0]
    outside = _outside_copy(ckpt, name)
    _refused(ckpt, f"{str(ckpt / name)!r} resolves to {outside!r}, outside the checkpoint directory")
    _verify_refuses(ckpt, "outside the checkpoint directory")


@pytest.mark.parametrize("scheme", ["local://", "file://"])
def test_a_local_fsspec_url_is_checked_as_its_path(ckpt, scheme):
    """fsspec's own local file system (``local://``) is read as the local path it names: the same
    refusal of a data file symlinked out of the checkpoint."""
    name = _data_files(ckpt)[0]
    outside = _outside_copy(ckpt, name)
    url = f"{scheme}{ckpt}"
    assert isinstance(qdcp.storage_reader(url), qdcp.CheckpointReader)
    for load in (lambda t: qdcp.load(t, url), lambda t: dcp.load(t, storage_reader=qdcp.storage_reader(url),
                                                                  planner=qdcp.QuantizedLoadPlanner())):
        target = _state(7)
        before = snapshot(target)
        with pytest.raises(CheckpointFormatError, match=f"resolves to {outside!r}, outside the checkpoint"):
            raise_inner(lambda: load(target))
        assert_same_state(target, before)


def test_storage_name_under_a_symlinked_directory_is_refused(ckpt, tmp_path):
    name = _data_files(ckpt)[0]
    os.mkdir(tmp_path / "outdir")
    shutil.move(str(ckpt / name), tmp_path / "outdir" / name)
    os.symlink(tmp_path / "outdir", ckpt / "sub")
    md = qdcp.read_metadata(ckpt)
    for index, info in md.storage_data.items():
        info.relative_path = f"sub/{name}"
    (ckpt / ".metadata").write_bytes(pickle.dumps(resealed(md)))
    _refused(ckpt, f"{str(ckpt / 'sub' / name)!r} resolves to")
    _verify_refuses(ckpt, "outside the checkpoint directory")


def test_metadata_symlinked_outside_is_refused(ckpt, tmp_path):
    shutil.move(str(ckpt / ".metadata"), tmp_path / "md")
    os.symlink(tmp_path / "md", ckpt / ".metadata")
    _refused(ckpt, f"the checkpoint's .metadata {str(ckpt / '.metadata')!r} resolves to")
    _verify_refuses(ckpt, ".metadata")


def test_symlink_staying_inside_and_a_symlinked_checkpoint_load(ckpt, tmp_path):
    name = _data_files(ckpt)[0]
    os.rename(ckpt / name, ckpt / "real.bin")
    os.symlink("real.bin", ckpt / name)
    os.symlink(ckpt, tmp_path / "link")  # the checkpoint directory itself a symlink
    for path in (ckpt, tmp_path / "link"):
        target = _state(7)
        qdcp.load(target, path)
        assert_same_state(target, _state(0))


# ----------------------------------------------------------------------------- FIFOs

def test_fifo_as_data_file_is_refused_without_blocking(ckpt):
    name = _data_files(ckpt)[0]
    os.remove(ckpt / name)
    os.mkfifo(ckpt / name)
    fragment = f"its data file {str(ckpt / name)!r} is a FIFO, not a regular file"
    _in_child(f"_refused({str(ckpt)!r}, {fragment!r})")
    _verify_refuses(ckpt, "is a FIFO")


def test_fifo_as_metadata_is_refused_without_hanging(ckpt):
    os.remove(ckpt / ".metadata")
    os.mkfifo(ckpt / ".metadata")
    fragment = f"the checkpoint's .metadata {str(ckpt / '.metadata')!r} is a FIFO, not a regular file"
    _in_child(f"_refused({str(ckpt)!r}, {fragment!r})")
    _verify_refuses(ckpt, "is a FIFO")


def test_fifo_swapped_in_after_the_check_is_not_read(ckpt):
    from qdcp.storage.local_files import open_inside

    os.mkfifo(ckpt / "pipe")
    with pytest.raises(CheckpointFormatError, match="is a FIFO"):
        open_inside(ckpt, "pipe", "a file")
    os.symlink("/etc/hostname", ckpt / "out")
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint directory"):
        open_inside(ckpt, "out", "a file")
    with pytest.raises(FileNotFoundError):
        open_inside(ckpt, "missing", "a file")


# ----------------------------------------------------------------------------- metadata graphs

def _metadata_with_planner_value(ckpt, value) -> None:
    """``value`` as key ``b``'s nesting in ``planner_data`` (not resealed: its digest could not be computed)."""
    md = qdcp.read_metadata(ckpt)
    md.planner_data["b"] = value
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


def test_shared_reference_dag_in_planner_data_is_refused_quickly(ckpt):
    x: list = []
    for _ in range(44):
        x = [x, x]
    _metadata_with_planner_value(ckpt, x)
    assert (ckpt / ".metadata").stat().st_size < 1 << 16
    _in_child(f"_metadata_refused({str(ckpt)!r}, 'its shared references stand for more than')", timeout=60)
    _verify_refuses(ckpt, "shared references stand for more than")


def _metadata_refused(path, why: str) -> None:
    """``.metadata`` refused for ``why``: parsed alone, and by both front doors (targets unchanged)."""
    from qdcp.storage.metadata import safe_load_metadata

    with open(os.path.join(path, ".metadata"), "rb") as f:
        with pytest.raises(CheckpointFormatError, match=why):
            safe_load_metadata(f)
    _refused(path, f"the checkpoint's .metadata cannot be read: {why}", files=False)


def test_deep_or_cyclic_metadata_is_refused(ckpt):
    deep: list = ["b"]
    for _ in range(40):  # no sharing: refused by the depth limit
        deep = [deep]
    cyclic: list = []
    cyclic.append(cyclic)
    pristine = (ckpt / ".metadata").read_bytes()
    for value, why in ((deep, "it nests objects deeper than 32 levels"), (cyclic, "an object in it contains itself")):
        (ckpt / ".metadata").write_bytes(pristine)
        _metadata_with_planner_value(ckpt, value)
        _in_child(f"_metadata_refused({str(ckpt)!r}, {why!r})", timeout=60)


def test_bounded_repr_in_nesting_message(ckpt):
    md = qdcp.read_metadata(ckpt)
    md.planner_data["b"] = ["c" * 10_000, "d"]  # a nesting that does not spell its key
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointFormatError, match="does not spell that key") as got:
        qdcp.read_metadata(ckpt)
    assert len(str(got.value)) < 500
