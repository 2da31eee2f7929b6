"""qdcp.install(): DCP's own save / async_save / load, called as frameworks call them (no planner,
or DCP's default planners built inside the call), save and load quantized tensors.

Each behaviour is shown both ways: without the switch the call fails (or loses data) as DCP does;
with it, the same call is bit-exact.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
    state_dict_loader,
    state_dict_saver,
)

import qdcp
from quantized_cases import CASE_BY_NAME, assert_bitwise_equal, assert_same_buffers

NAMES = ["int8_row", "float8_row", "nf4", "mx_fp8", "nvfp4_per_tensor", "optim8bit_signed"]


def _dcp_functions():
    return [getattr(m, n) for m in (dcp, state_dict_saver, state_dict_loader)
            for n in ("save", "async_save", "load") if hasattr(m, n)]


@pytest.fixture
def switch():
    with qdcp.installed():
        yield


def _state(seed: int) -> dict:
    return {"model": {n: CASE_BY_NAME[n].make(seed) for n in NAMES}, "step": torch.tensor(seed),
            "bias": torch.arange(5.0) + seed}


def _assert_loaded(target: dict, source: dict) -> None:
    for n in NAMES:
        assert_same_buffers(target["model"][n], source["model"][n])
    assert torch.equal(target["bias"], source["bias"]) and torch.equal(target["step"], source["step"])


def test_install_and_uninstall_restore_every_name_exactly():
    before = _dcp_functions()
    qdcp.install()
    qdcp.install()  # idempotent
    wrapped = _dcp_functions()
    assert all(getattr(f, "__qdcp_switch__", False) for f in wrapped) and qdcp.is_installed()
    assert dcp.save is state_dict_saver.save and dcp.load is state_dict_loader.load
    qdcp.uninstall()
    assert all(a is b for a, b in zip(_dcp_functions(), before)) and not qdcp.is_installed()
    qdcp.uninstall()  # a no-op
    with qdcp.installed():
        with qdcp.installed():
            pass
        assert qdcp.is_installed()  # the inner block did not install it, so leaves it
    assert all(a is b for a, b in zip(_dcp_functions(), before))


def test_concurrent_install_uninstall_leaves_a_consistent_state():
    before = _dcp_functions()

    def churn():
        for _ in range(200):
            qdcp.install()
            qdcp.uninstall()
    threads = [threading.Thread(target=churn) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a is b for a, b in zip(_dcp_functions(), before))


def test_sync_save_without_planner_then_load_without_planner(tmp_path, switch):
    source, target = _state(0), _state(1)
    dcp.save(source, checkpoint_id=tmp_path)
    dcp.load(target, checkpoint_id=tmp_path)
    _assert_loaded(target, source)
    assert "model.nf4" in qdcp.describe(str(tmp_path)).keys()  # raw, with qdcp's spec


@pytest.mark.parametrize("writer", ["checkpoint_id", "FileSystemWriter"])
def test_async_save_without_stager(tmp_path, switch, writer):
    source, target = _state(0), _state(1)
    kwargs = ({"checkpoint_id": tmp_path} if writer == "checkpoint_id"
              else {"storage_writer": FileSystemWriter(tmp_path)})
    dcp.async_save(source, **kwargs).result()
    dcp.load(target, storage_reader=FileSystemReader(tmp_path))
    _assert_loaded(target, source)


def test_async_save_without_switch_fails(tmp_path):
    with pytest.raises(NotImplementedError):
        dcp.async_save(_state(0), storage_writer=FileSystemWriter(tmp_path)).result()


def test_default_planners_built_by_the_caller_are_replaced_with_their_flags(tmp_path, switch):
    """accelerate builds DefaultSavePlanner() / DefaultLoadPlanner() inside its functions; a
    partial load's flag is carried over to qdcp's planner."""
    source = _state(0)
    dcp.save(source, checkpoint_id=tmp_path, planner=DefaultSavePlanner())
    target = _state(1)
    target["model"]["extra"] = torch.zeros(3)
    dcp.load(target, checkpoint_id=tmp_path, planner=DefaultLoadPlanner(allow_partial_load=True))
    del target["model"]["extra"]
    _assert_loaded(target, source)
    with pytest.raises(BaseException, match="extra"):
        dcp.load({**_state(1), "extra": torch.zeros(3)}, checkpoint_id=tmp_path, planner=DefaultLoadPlanner())


def test_positional_storage_argument(tmp_path, switch):
    """DCP still takes (state_dict, storage) positionally: the switch sees the storage there too."""
    source, target = _state(0), _state(1)
    with pytest.warns(UserWarning, match="argument order"):
        dcp.save(source, FileSystemWriter(tmp_path))
    with pytest.warns(UserWarning, match="argument order"):
        dcp.load(target, FileSystemReader(tmp_path))
    _assert_loaded(target, source)


def test_other_planners_are_left_alone(tmp_path, switch):
    class Mine(DefaultSavePlanner):
        pass
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=tmp_path, planner=Mine())
    assert qdcp.read_metadata(str(tmp_path)).planner_data.get("__qdcp_checksums__") is None
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=tmp_path / "q")
    assert qdcp.read_metadata(str(tmp_path / "q")).planner_data.get("__qdcp_checksums__") is not None


def test_switch_loads_into_plain_targets(tmp_path, switch):
    source = _state(0)
    dcp.save(source, checkpoint_id=tmp_path)
    plain = {"model": {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in source["model"].items()},
             "step": torch.tensor(0), "bias": torch.zeros(5)}
    dcp.load(plain, checkpoint_id=tmp_path)
    for n in NAMES:
        want = CASE_BY_NAME[n].dequantize(source["model"][n])
        assert_bitwise_equal(plain["model"][n], want)


def test_switch_keeps_dcps_overwrite_in_place(tmp_path, switch):
    """Frameworks choose DCP's writer and its overwrite: the switch does not refuse a re-save."""
    dcp.save({"w": torch.ones(4)}, checkpoint_id=tmp_path)
    dcp.save({"w": torch.full((4,), 2.0)}, checkpoint_id=tmp_path)
    out = {"w": torch.zeros(4)}
    dcp.load(out, checkpoint_id=tmp_path)
    assert torch.equal(out["w"], torch.full((4,), 2.0))


def test_hf_storage_writer_gets_dequantized_entries(tmp_path, switch):
    """safetensors readers know no qdcp spec: through DCP's HuggingFaceStorageWriter, quantized
    entries are written as their dequantized values under their own keys."""
    source = {n: CASE_BY_NAME[n].make(0) for n in ("int8_row", "nf4", "mx_fp8")}
    dcp.save(source, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path), save_distributed=False))
    files = list(tmp_path.glob("*.safetensors"))
    loaded = {k: v for f in files for k, v in load_file(f).items()}
    assert sorted(loaded) == sorted(source)
    for n, t in source.items():
        assert_bitwise_equal(loaded[n], CASE_BY_NAME[n].dequantize(t))


class _Pickled:
    """An object only a full unpickler rebuilds (its class is no weights-only global)."""

    def __init__(self) -> None:
        self.v = 3


def _unpickles(path) -> bool:
    state = {"o": None, "w": torch.zeros(4)}
    try:
        dcp.load(state, checkpoint_id=path)
    except BaseException:  # noqa: BLE001 (DCP's CheckpointException): refused
        return False
    return isinstance(state["o"], _Pickled)


def test_weights_only_is_the_blocks_own_and_put_back(tmp_path):
    """``installed(weights_only=...)`` inside an ``install()`` holds for the block only: after it the
    app's setting is back (it stayed, so one trusted load left every later load unpickling anything;
    and an empty ``with installed():`` cancelled an app's ``install(weights_only=False)``)."""
    dcp.save({"o": _Pickled(), "w": torch.ones(4)}, checkpoint_id=tmp_path / "c")
    try:
        qdcp.install()
        assert not _unpickles(tmp_path / "c")
        with qdcp.installed(weights_only=False):
            assert _unpickles(tmp_path / "c")
        assert not _unpickles(tmp_path / "c")
        qdcp.uninstall()
        qdcp.install(weights_only=False)
        with qdcp.installed():
            assert not _unpickles(tmp_path / "c")
        assert _unpickles(tmp_path / "c")
    finally:
        qdcp.uninstall()
    assert not qdcp.is_installed()
