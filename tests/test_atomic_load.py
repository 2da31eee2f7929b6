"""QuantizedLoadPlanner(atomic=True): a load that fails leaves every target as it was; one that
succeeds equals the in-place load. Also the load planner's answers to the wrong call (a load planner
given to dcp.save) and to a partial load that matches nothing.

Everything goes through DCP's own calls with only qdcp's planner passed in.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from qdcp import ChecksumError, QuantizedLoadPlanner, QuantizedSavePlanner
from quantized_cases import CASES, inner, raise_inner
from state_dicts import assert_same_state, leaves, snapshot
from stored_bytes import flip_stored_bytes, tensor_bytes

# one entry of every torchao case qdcp covers on CPU, plain tensors and objects: 30 keys
_CASES = [c for c in CASES if c.name != "int8_dynamic_act"]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = {f"layer{i}.{c.name}": c.make(seed + i) for i, c in enumerate(_CASES)}
    return {"model": model, "bias": torch.randn(64, generator=g), "step": seed,
            "last": torch.randn(4096, generator=g)}


def _load(state, path, **kw):
    raise_inner(lambda: dcp.load(state, checkpoint_id=path, planner=QuantizedLoadPlanner(**kw)))


def _same_objects(state) -> dict[str, int]:
    """id() of every tensor and of every quantized tensor's inner buffers (a load keeps them)."""
    ids = {}
    for k, v in leaves(state):
        if isinstance(v, torch.Tensor):
            ids[k] = id(v)
            ids.update({f"{k}/{n}": id(b) for n, b in (inner(v).items() if hasattr(v, "__tensor_flatten__")
                                                         and type(v) is not torch.Tensor else [])})
    return ids


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    source = _state(0)
    dcp.save(source, checkpoint_id=path, planner=QuantizedSavePlanner())
    return path, source


def _corrupt_copy(saved, tmp_path) -> Path:
    path, source = saved
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(path):
        (bad / name).write_bytes((path / name).read_bytes())
    last = source["model"][f"layer{len(_CASES) - 1}.{_CASES[-1].name}"]  # its components are read last
    flip_stored_bytes(bad, tensor_bytes(inner(last)["codes"]))
    return bad


def test_atomic_load_equals_in_place_load_and_keeps_objects(saved):
    path, source = saved
    plain, atomic = _state(7), _state(7)
    ids = _same_objects(atomic)
    _load(plain, path)
    _load(atomic, path, atomic=True)
    assert_same_state(atomic, source)
    assert_same_state(atomic, plain)
    assert _same_objects(atomic) == ids  # parameters and inner buffers are the same objects


def test_corrupt_item_leaves_every_target_untouched(saved, tmp_path):
    bad = _corrupt_copy(saved, tmp_path)
    target = _state(7)
    before = snapshot(target)
    with pytest.raises(ChecksumError, match=f"layer{len(_CASES) - 1}"):
        _load(target, bad, atomic=True)
    assert_same_state(target, before)  # not one buffer, plain tensor or object changed


def test_corrupt_item_half_overwrites_in_place_load(saved, tmp_path):
    """What atomic=True fixes: DCP's in-place load has filled most entries when the bad one is read."""
    bad = _corrupt_copy(saved, tmp_path)
    target = _state(7)
    before = snapshot(target)
    with pytest.raises(ChecksumError):
        _load(target, bad)
    changed = [k for k, v in leaves(target["model"]) if not torch.equal(
        torch.cat([b.flatten().view(torch.uint8) for b in inner(v).values()]),
        torch.cat([b.flatten().view(torch.uint8) for b in inner(before["model"][k]).values()]))]
    assert len(changed) >= len(_CASES) - 1


def test_truncated_file_leaves_every_target_untouched(saved, tmp_path):
    path, _ = saved
    bad = tmp_path / "truncated"
    bad.mkdir()
    for name in os.listdir(path):
        data = (path / name).read_bytes()
        (bad / name).write_bytes(data[: len(data) - 100] if name.endswith(".distcp") else data)
    target = _state(7)
    before = snapshot(target)
    with pytest.raises(BaseException):  # DCP's reader's own error (docs/api.md: what stays DCP's)
        dcp.load(target, checkpoint_id=bad, planner=QuantizedLoadPlanner(atomic=True))
    assert_same_state(target, before)


def test_atomic_partial_load_keeps_what_the_checkpoint_lacks(saved):
    path, source = saved
    target = _state(7)
    target["extra"] = torch.arange(5.0)
    target["model"]["layer_new"] = _CASES[0].make(99)
    before = snapshot(target)
    _load(target, path, atomic=True, allow_partial_load=True)
    assert torch.equal(target["extra"], before["extra"])
    assert_same_state({"x": target["model"]["layer_new"]}, {"x": before["model"]["layer_new"]})
    del target["extra"], target["model"]["layer_new"]
    assert_same_state(target, source)


def test_load_planner_given_to_save_says_so(tmp_path):
    with pytest.raises(TypeError, match="QuantizedLoadPlanner is a load planner.*Pass QuantizedSavePlanner"):
        raise_inner(lambda: dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path,
                                     planner=QuantizedLoadPlanner()))
    assert not (tmp_path / ".metadata").exists()


def test_partial_load_says_how_many_keys_matched(saved):
    path, _ = saved
    target = _state(7)
    nested = {"app": target}  # one level deeper than what was saved: no key matches
    planner = QuantizedLoadPlanner(allow_partial_load=True)
    with pytest.warns(UserWarning, match=r"matched 0 of the 28 target keys.*which holds 28 keys.*nothing was loaded"):
        raise_inner(lambda: dcp.load(nested, checkpoint_id=path, planner=planner))
    assert planner.loaded_keys == [] and len(planner.missing_keys) == 28
    planner = QuantizedLoadPlanner(allow_partial_load=True)
    target["extra"] = torch.zeros(2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "QuantizedLoadPlanner", UserWarning)  # some keys matched: no warning
        raise_inner(lambda: dcp.load(target, checkpoint_id=path, planner=planner))
    assert planner.missing_keys == ["extra"] and len(planner.loaded_keys) == 28


@pytest.mark.parametrize("reader", ["dcp", "qdcp"])
def test_each_item_is_hashed_once_by_whoever_reads_it(saved, tmp_path, reader):
    """qdcp's reader checks each item on the bytes it just read and says so (its metadata's
    StorageMeta), so the planner hashes none; DCP's own reader leaves every check to the planner. A corrupt
    item is caught either way, naming its key, the targets untouched."""
    from torch.distributed.checkpoint import FileSystemReader

    from qdcp import CheckpointReader, read_metadata

    path, source = saved
    make = (lambda p: CheckpointReader(p)) if reader == "qdcp" else (lambda p: FileSystemReader(p))
    planner = QuantizedLoadPlanner(atomic=True)
    target = _state(7)
    raise_inner(lambda: dcp.load(target, storage_reader=make(path), planner=planner))
    assert_same_state(target, source)
    whole = len(read_metadata(path).storage_data)  # every stored chunk of this 1-rank checkpoint is read whole
    assert whole >= 30
    assert planner.hashed_items == (0 if reader == "qdcp" else whole)

    bad, target = _corrupt_copy(saved, tmp_path), _state(7)
    before = snapshot(target)
    with pytest.raises(ChecksumError, match=f"layer{len(_CASES) - 1}"):
        raise_inner(lambda: dcp.load(target, storage_reader=make(bad), planner=QuantizedLoadPlanner(atomic=True)))
    assert_same_state(target, before)
