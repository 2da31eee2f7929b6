"""qdcp.save / qdcp.async_save / qdcp.load: the README's first path, with every protection of
qdcp's writer, reader and planners, tried as a user types it."""

from __future__ import annotations

import hashlib
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from qdcp import CheckpointFormatError, QdcpError, QuantizedStager
from quantized_cases import CASE_BY_NAME, bits, raise_inner
from state_dicts import assert_same_state, snapshot


def _state(seed: int) -> dict:
    return {"model": {"w": CASE_BY_NAME["int8_row"].make(seed), "nf4": CASE_BY_NAME["nf4"].make(seed),
                      "b": torch.randn(32, generator=torch.Generator().manual_seed(seed))},
            "step": seed}


def _files(path) -> dict[str, str]:
    return {n: hashlib.sha256((path / n).read_bytes()).hexdigest() for n in sorted(os.listdir(path))}


def test_save_load_round_trip_bit_exact_and_readable_by_stock_dcp(tmp_path):
    source = _state(0)
    qdcp.save(source, tmp_path / "c")
    target = _state(5)
    qdcp.load(target, tmp_path / "c")
    assert_same_state(target, source)
    plain = {"model": {"b": torch.zeros(32)}}
    dcp.load(plain, checkpoint_id=tmp_path / "c")  # an ordinary DCP checkpoint
    assert torch.equal(plain["model"]["b"], source["model"]["b"])


def test_second_save_is_refused_and_first_checkpoint_kept(tmp_path):
    path = tmp_path / "c"
    qdcp.save(_state(0), path)
    before = _files(path)
    with pytest.raises(QdcpError, match="already exists.*overwrite=True"):
        raise_inner(lambda: qdcp.save(_state(1), path))
    assert _files(path) == before
    qdcp.save(_state(1), path, overwrite=True)
    target = _state(5)
    qdcp.load(target, path)
    assert_same_state(target, _state(1))


def test_async_save_with_a_stager(tmp_path):
    stager = QuantizedStager()
    source = _state(0)
    fut = qdcp.async_save(source, tmp_path / "c", stager=stager)
    fut.result()
    stager.close()
    target = _state(5)
    qdcp.load(target, tmp_path / "c")
    assert_same_state(target, source)


def test_truncated_file_names_key_and_file_and_leaves_targets(tmp_path):
    path = tmp_path / "c"
    qdcp.save(_state(0), path)
    (name,) = [n for n in os.listdir(path) if n.endswith(".distcp")]
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[:-300])
    target = _state(5)
    before = snapshot(target)
    with pytest.raises(CheckpointFormatError, match=rf"key '[\w.]+'.*{name}.*truncated") as info:
        qdcp.load(target, path)  # the reader's own error, not DCP's CheckpointException around it
    assert type(info.value.__cause__).__name__ == "CheckpointException"
    assert_same_state(target, before)


class _Payload:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_crafted_metadata_runs_no_code(tmp_path):
    path = tmp_path / "c"
    qdcp.save(_state(0), path)
    marker = tmp_path / "PWNED"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    target = _state(5)
    before = snapshot(target)
    with pytest.raises(BaseException, match="refusing to unpickle"):
        raise_inner(lambda: qdcp.load(target, path))
    assert not marker.exists()
    assert_same_state(target, before)


def test_in_place_load_is_available(tmp_path):
    source = _state(0)
    qdcp.save(source, tmp_path / "c")
    target = _state(5)
    ids = id(target["model"]["w"].qdata)
    qdcp.load(target, tmp_path / "c", atomic=False)
    assert_same_state(target, source)
    assert id(target["model"]["w"].qdata) == ids


def test_errors_come_out_as_raised_not_wrapped_in_dcps_exception(tmp_path):
    """qdcp.save / qdcp.load raise the rank's own error (catchable by its type), chained from
    DCP's CheckpointException (a BaseException that `except Exception` would not catch)."""
    from torch.distributed.checkpoint.api import CheckpointException

    path = tmp_path / "c"
    qdcp.save(_state(0), path)
    with pytest.raises(QdcpError, match="already exists") as info:
        qdcp.save(_state(1), path)
    assert isinstance(info.value.__cause__, CheckpointException)


@pytest.mark.parametrize("async_staging", [False, True])
def test_async_save_errors_come_out_as_raised(tmp_path, async_staging):
    """qdcp.async_save's errors are the rank's own too, as qdcp.save raises them: what is known at
    the call (here: a checkpoint at the path) from the call itself, before staging
    (tests/test_async_call_errors.py: the others, and a background failure from the Future); the
    checkpoint there is kept, and the next save goes through."""
    path = tmp_path / "c"
    qdcp.save(_state(0), path)
    before = _files(path)
    stager = QuantizedStager(async_staging=async_staging)
    try:
        with pytest.raises(QdcpError, match="already exists.*overwrite=True"):
            qdcp.async_save(_state(1), path, stager=stager)
        result = qdcp.async_save(_state(1), tmp_path / "d", stager=stager)
        (result.upload_completion if async_staging else result).result()
    finally:
        stager.close()
    assert _files(path) == before
    target = _state(5)
    qdcp.load(target, path)
    assert_same_state(target, _state(0))


@pytest.mark.parametrize("shape", [(128, 128), (256, 64), (256, 128), (512, 64)])
def test_nf4_whose_quantization_factor_has_one_element_round_trips(tmp_path, shape):
    """NF4 of 16384 elements (default blocks) has a one-element ``quantization_factor`` of stride
    256: qdcp.load read it as 'stored data cannot be read' (a flat byte view of it was refused) and
    the safetensors writer would have too. Both doors, atomic and in place, and a raw export."""
    from safetensors import safe_open

    from qdcp.hf.convert import to_safetensors

    source = {"w": CASE_BY_NAME["nf4"].make(0, shape)}
    qdcp.save(source, tmp_path / "c")
    for atomic in (True, False):
        target = {"w": CASE_BY_NAME["nf4"].make(1, shape)}
        qdcp.load(target, tmp_path / "c", atomic=atomic)
        assert_same_state(target, source)
    target = {"w": CASE_BY_NAME["nf4"].make(1, shape)}
    dcp.load(target, checkpoint_id=tmp_path / "c", planner=qdcp.QuantizedLoadPlanner())
    assert_same_state(target, source)
    to_safetensors(tmp_path / "c", tmp_path / "c.safetensors")
    with safe_open(str(tmp_path / "c.safetensors"), "pt") as f:
        factor = f.get_tensor("w.__qdcp__.quantization_factor")
    assert torch.equal(bits(factor), bits(source["w"].quantization_factor))
