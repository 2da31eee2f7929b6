"""Bad input gets a clear error naming the key, raised before any data is read or written."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from qdcp import (
    CheckpointFormatError,
    LoadMismatchError,
    QuantizedLoadPlanner,
    QuantizedSavePlanner,
)
from quantized_cases import CASE_BY_NAME, bits, inner, raise_inner
from stored_bytes import resealed

INT8 = CASE_BY_NAME["int8_group32"]


def _saved(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save({"w": INT8.make(0), "b": torch.ones(3)}, checkpoint_id=path, planner=QuantizedSavePlanner())
    return path


def _edit_spec(path, edit):
    """Rewrite the qdcp spec inside .metadata (as an attacker or a bug would)."""
    md_file = path / ".metadata"
    md = pickle.loads(md_file.read_bytes())
    doc = json.loads(md.planner_data["__qdcp__"])
    edit(doc, md)
    md.planner_data["__qdcp__"] = json.dumps(doc)
    md_file.write_bytes(pickle.dumps(resealed(md)))  # consistent, as its writer would have sealed it


def _load_fresh(path):
    target = INT8.make(1)
    before = {n: bits(t).clone() for n, t in inner(target).items()}
    state = {"w": target, "b": torch.zeros(3)}
    return state, before


def _assert_untouched(state, before):
    for n, t in inner(state["w"]).items():
        assert torch.equal(bits(t), before[n]), f"{n} was modified before the error"
    assert torch.equal(state["b"], torch.zeros(3))


@pytest.mark.parametrize("edit, error, match", [
    (lambda d, md: d.update(version=99), CheckpointFormatError, "version 99"),
    (lambda d, md: d.update(format="other"), CheckpointFormatError, "format 'qdcp'"),
    (lambda d, md: d["entries"]["w"].update(type="torchao.NoSuchTensor"), CheckpointFormatError,
     "'w'.*NoSuchTensor"),
    (lambda d, md: d["entries"]["w"].update(shape=[256, 64]), LoadMismatchError, "'w'.*shape"),
    (lambda d, md: d["entries"]["w"]["components"][1].update(dtype="float16"), CheckpointFormatError,
     "'w'.*'scale'"),
    (lambda d, md: d["entries"]["w"]["components"][1].update(shape=[256, 5]), CheckpointFormatError,
     "'w'.*'scale'"),
    (lambda d, md: md.state_dict_metadata.pop("w.__qdcp__.scale"), CheckpointFormatError,
     "'w'.*'scale' is missing"),
    (lambda d, md: d["entries"]["w"]["components"][0].update(layout={"kind": "spiral"}),
     CheckpointFormatError, "unknown layout"),
    (lambda d, md: d["entries"]["w"].update(dtype="complex_thing"), CheckpointFormatError, "dtype"),
    (lambda d, md: d["entries"]["w"].update(storage="zip"), CheckpointFormatError, "'w'.*storage"),
    (lambda d, md: d["entries"]["w"]["attrs"].update(
        block_size={"object": "os.system", "fields": {}}), CheckpointFormatError, "not allowed"),
])
def test_tampered_spec_is_refused_before_reading(tmp_path, edit, error, match):
    path = _saved(tmp_path)
    _edit_spec(path, edit)
    state, before = _load_fresh(path)
    with pytest.raises(error, match=match):
        raise_inner(lambda: dcp.load(state, checkpoint_id=path, planner=QuantizedLoadPlanner()))
    _assert_untouched(state, before)


def test_shape_mismatch_with_target_names_key(tmp_path):
    path = _saved(tmp_path)
    target = INT8.from_hp(INT8.hp(1, (128, 128)))
    with pytest.raises(LoadMismatchError, match="'w'.*shape"):
        raise_inner(lambda: dcp.load({"w": target, "b": torch.zeros(3)}, checkpoint_id=path,
                                      planner=QuantizedLoadPlanner()))


def test_missing_key_in_checkpoint(tmp_path):
    path = _saved(tmp_path)
    state = {"w": INT8.make(1), "b": torch.zeros(3), "other": INT8.make(2)}
    with pytest.raises(RuntimeError, match="Missing key.*other"):
        raise_inner(lambda: dcp.load(state, checkpoint_id=path, planner=QuantizedLoadPlanner()))
    # allow_partial_load skips it and loads the rest
    dcp.load(state, checkpoint_id=path, planner=QuantizedLoadPlanner(allow_partial_load=True))
    assert torch.equal(state["b"], torch.ones(3))


def test_quantized_entry_into_non_tensor_target(tmp_path):
    path = _saved(tmp_path)
    with pytest.raises(LoadMismatchError, match="'w'"):
        raise_inner(lambda: dcp.load({"w": 5, "b": torch.zeros(3)}, checkpoint_id=path,
                                      planner=QuantizedLoadPlanner()))


def test_stale_staged_plain_tensor_with_inner_attributes_is_refused(tmp_path):
    """A stager that builds a plain tensor and copies a subclass's __dict__ onto it (DCP's
    StateDictStager does this) must not produce a checkpoint of uninitialised memory."""
    fake = torch.empty(4, 4)
    fake.qdata = torch.zeros(4, 4, dtype=torch.int8)
    with pytest.raises(qdcp.StagingError, match="'w'.*QuantizedStager"):
        raise_inner(lambda: dcp.save({"w": fake}, checkpoint_id=tmp_path / "x",
                                      planner=QuantizedSavePlanner()))
    assert not (tmp_path / "x" / ".metadata").exists()


def test_load_bytes_refuses_pickled_code(tmp_path, capsys):
    class Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil"
    dcp.save({"obj": Boom(), "t": torch.ones(2)}, checkpoint_id=path)
    state = {"obj": None, "t": torch.zeros(2)}
    with pytest.raises(LoadMismatchError, match=r"key 'obj'.*refers to print.*weights_only=False"):
        raise_inner(lambda: dcp.load(state, checkpoint_id=path, planner=QuantizedLoadPlanner()))
    assert "pwned" not in capsys.readouterr().out


def test_dequantize_argument_type_checked():
    with pytest.raises(TypeError, match="dequantize"):
        QuantizedSavePlanner(dequantize="yes")


def test_an_adapter_must_implement_what_every_adapter_needs():
    """``qdcp.Adapter`` states its required methods as abstract: a subclass missing one cannot be
    made (TypeError naming it), and ``register_adapter`` refuses anything but an adapter."""
    from qdcp.adapters.base import StoredOnlyAdapter

    class Half(qdcp.Adapter):
        type_names = ("mine.Half",)

        def matches(self, cls):
            return False

    with pytest.raises(TypeError, match="abstract methods .*rebuild"):
        Half()
    with pytest.raises(TypeError, match="qdcp.Adapter instance"):
        qdcp.register_adapter(object())

    class Stored(StoredOnlyAdapter):  # a stored format without a tensor class: live methods refuse
        type_names = ("mine.Stored",)

        def rebuild(self, stored):
            raise NotImplementedError

    with pytest.raises(qdcp.UnsupportedTensorError, match="mine.Stored: a stored format with no live tensor"):
        Stored().dequantize(torch.zeros(1))
    assert not Stored().matches(torch.Tensor)
