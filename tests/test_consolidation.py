"""Consolidation tools users run on a checkpoint afterwards, run for real on raw qdcp checkpoints.

DCP's ``format_utils.dcp_to_torch_save``, accelerate's ``merge_fsdp_weights`` and Lightning's
consolidation (``lightning_fabric.utilities.load._load_distributed_checkpoint``, what both
Lightning ``consolidate_checkpoint`` scripts run) read a checkpoint without a target through DCP's
``_EmptyStateDictLoadPlanner``:

- under ``qdcp.install()`` (which puts qdcp's ``ConsolidatingLoadPlanner`` in its place) each
  quantized entry comes out under its own key, equal to torchao's ``dequantize()``, plain tensors
  bit-exact, and no ``__qdcp__`` key appears;
- without the switch they write qdcp's inner buffers under ``<key>.__qdcp__.*`` keys and drop the
  entry (asserted exactly, as the behaviour the switch fixes);
- qdcp's own ``qdcp.consolidate`` / ``qdcp.dcp_to_torch_save``: the same, or the torchao types
  rebuilt bit-exact on request.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import format_utils, state_dict_loader
from torchao.quantization import Int8WeightOnlyConfig, quantize_

import qdcp
from qdcp.outputs import OutputError
from quantized_cases import bits

COMPONENTS = ("qdata", "scale", "zero_point")  # an Int8Tensor's inner buffers, as qdcp stores them


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16)).to(torch.bfloat16)
    quantize_(model[0], Int8WeightOnlyConfig(version=2))  # 0.weight: an Int8Tensor
    return model


@pytest.fixture(params=["qdcp.save", "QuantizedSavePlanner"])
def saved(request, tmp_path):
    """A raw qdcp checkpoint of ``{"model": state dict}`` (accelerate's layout) and what it holds."""
    state = _model().state_dict()
    path = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if request.param == "qdcp.save":
            qdcp.save({"model": state}, path)
        else:
            dcp.save({"model": state}, checkpoint_id=path, planner=qdcp.QuantizedSavePlanner(), no_dist=True)
    assert qdcp.describe(path)["model.0.weight"]["stored_as"] == "raw"
    want = {k: v.dequantize() if k == "0.weight" else v for k, v in state.items()}
    return path, state, want


def _assert_exact(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(bits(got[k]), bits(want[k])), k


def _keys(tree, prefix="") -> list[str]:
    if isinstance(tree, dict):
        return [k for key, v in tree.items() for k in _keys(v, f"{prefix}{key}.")] or [prefix]
    return [prefix]


def _assert_stock_view(sd: dict, state: dict) -> None:
    """What DCP's ``_EmptyStateDictLoadPlanner`` makes of a raw qdcp checkpoint: the int8 weight
    missing from ``model``, its buffers at the top level under component keys."""
    assert sorted(sd["model"]) == ["0.bias", "1.bias", "1.weight"]
    parts = {k: v for k, v in sd.items() if k != "model"}
    assert sorted(parts) == [f"model.0.weight.__qdcp__.{c}" for c in COMPONENTS]
    for c in COMPONENTS:
        assert torch.equal(parts[f"model.0.weight.__qdcp__.{c}"], getattr(state["0.weight"], c))


# ----------------------------------------------------------------------------- DCP's dcp_to_torch_save
def test_dcp_to_torch_save_under_the_switch(saved, tmp_path):
    path, _, want = saved
    with qdcp.installed():
        format_utils.dcp_to_torch_save(path, tmp_path / "out.pt")
    sd = torch.load(tmp_path / "out.pt", weights_only=True)  # plain tensors only
    assert list(sd) == ["model"]
    _assert_exact(sd["model"], want)
    assert not any("__qdcp__" in k for k in _keys(sd))


def test_dcp_to_torch_save_without_the_switch(saved, tmp_path):
    path, state, _ = saved
    format_utils.dcp_to_torch_save(path, tmp_path / "out.pt")
    _assert_stock_view(torch.load(tmp_path / "out.pt", weights_only=True), state)


def test_plain_checkpoint_consolidates_as_dcp_does(tmp_path):
    """A checkpoint with no quantized entry: the same file with the switch as without."""
    state = {"model": {"w": torch.randn(8, 4), "b": torch.arange(3)}, "step": 7, "groups": [{"lr": 0.5}]}
    dcp.save(state, checkpoint_id=tmp_path / "plain", no_dist=True)
    format_utils.dcp_to_torch_save(tmp_path / "plain", tmp_path / "stock.pt")
    with qdcp.installed():
        format_utils.dcp_to_torch_save(tmp_path / "plain", tmp_path / "qdcp.pt")
    stock, ours = (torch.load(tmp_path / n, weights_only=True) for n in ("stock.pt", "qdcp.pt"))
    assert ours["step"] == stock["step"] == 7 and ours["groups"] == stock["groups"] == [{"lr": 0.5}]
    _assert_exact(ours["model"], stock["model"])
    _assert_exact(ours["model"], state["model"])


def test_load_state_dict_from_keys_under_the_switch(saved):
    """DCP's ``_load_state_dict_from_keys`` (``_EmptyStateDictLoadPlanner(keys=...)``)."""
    path, _, want = saved
    with qdcp.installed(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = state_dict_loader._load_state_dict_from_keys({"model.0.weight"}, checkpoint_id=path)
        whole = state_dict_loader._load_state_dict_from_keys({"model"}, checkpoint_id=path)
    _assert_exact(sd["model"], {"0.weight": want["0.weight"]})
    _assert_exact(whole["model"], want)


def test_install_swaps_the_empty_planner_and_uninstall_restores_it():
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    assert format_utils._EmptyStateDictLoadPlanner is _EmptyStateDictLoadPlanner
    with qdcp.installed():
        for module in (format_utils, state_dict_loader):
            assert issubclass(module._EmptyStateDictLoadPlanner, qdcp.ConsolidatingLoadPlanner)
    for module in (format_utils, state_dict_loader):
        assert module._EmptyStateDictLoadPlanner is _EmptyStateDictLoadPlanner


# ----------------------------------------------------------------------------- accelerate's merge_fsdp_weights
@pytest.mark.parametrize("safe", [True, False])
def test_accelerate_merge_fsdp_weights_under_the_switch(saved, tmp_path, safe):
    pytest.importorskip("accelerate")
    from accelerate.utils import merge_fsdp_weights
    from safetensors.torch import load_file

    path, _, want = saved
    with qdcp.installed():
        merge_fsdp_weights(str(path), str(tmp_path / "merged"), safe_serialization=safe)
    out = tmp_path / "merged" / ("model.safetensors" if safe else "pytorch_model.bin")
    sd = load_file(out) if safe else torch.load(out, weights_only=True)
    _assert_exact(sd, want)  # the model's own keys, unwrapped from "model" as accelerate does


def test_accelerate_merge_fsdp_weights_without_the_switch(saved, tmp_path):
    pytest.importorskip("accelerate")
    from accelerate.utils import merge_fsdp_weights

    path, state, _ = saved
    merge_fsdp_weights(str(path), str(tmp_path / "merged"), safe_serialization=False)
    # more than one top-level key: accelerate does not unwrap "model", and writes the stock view
    _assert_stock_view(torch.load(tmp_path / "merged" / "pytorch_model.bin", weights_only=True), state)
    with pytest.raises(ValueError, match="Key `model` is invalid, expected torch.Tensor but received <class 'dict'>"):
        merge_fsdp_weights(str(path), str(tmp_path / "merged_safe"), safe_serialization=True)


# ----------------------------------------------------------------------------- Lightning's consolidation
@pytest.fixture
def lightning_folder(saved):
    """The checkpoint as Fabric lays it out: DCP's files and ``meta.pt`` (non-tensor user data)."""
    path, state, want = saved
    torch.save({"step": 7}, path / "meta.pt")
    return path, state, want


def test_lightning_consolidation_under_the_switch(lightning_folder):
    pytest.importorskip("lightning_fabric")
    pytest.importorskip("pytorch_lightning")
    from lightning_fabric.utilities.load import _load_distributed_checkpoint
    from pytorch_lightning.utilities.consolidate_checkpoint import _format_checkpoint

    path, _, want = lightning_folder
    with qdcp.installed():
        checkpoint = _load_distributed_checkpoint(path)
    assert sorted(checkpoint) == ["model", "step"] and checkpoint["step"] == 7
    _assert_exact(checkpoint["model"], want)
    trainer_format = _format_checkpoint(checkpoint)  # pytorch_lightning's consolidate_checkpoint
    _assert_exact(trainer_format["state_dict"], want)


def test_lightning_consolidation_without_the_switch(lightning_folder):
    pytest.importorskip("lightning_fabric")
    from lightning_fabric.utilities.load import _load_distributed_checkpoint

    path, state, _ = lightning_folder
    checkpoint = _load_distributed_checkpoint(path)
    assert checkpoint.pop("step") == 7
    _assert_stock_view(checkpoint, state)


# ----------------------------------------------------------------------------- qdcp's own
def test_qdcp_consolidate_and_dcp_to_torch_save(saved, tmp_path):
    path, state, want = saved
    _assert_exact(qdcp.consolidate(path)["model"], want)
    qdcp.dcp_to_torch_save(path, tmp_path / "out.pt")
    _assert_exact(torch.load(tmp_path / "out.pt", weights_only=True)["model"], want)
    kept = qdcp.consolidate(path, dequantize=False)["model"]
    assert type(kept["0.weight"]) is type(state["0.weight"])
    for c in COMPONENTS:
        assert torch.equal(getattr(kept["0.weight"], c), getattr(state["0.weight"], c)), c
    _assert_exact({k: v for k, v in kept.items() if k != "0.weight"},
                  {k: v for k, v in want.items() if k != "0.weight"})


def test_qdcp_dcp_to_torch_save_writes_over_nothing_it_was_not_asked_to(saved, tmp_path):
    """Unlike DCP's (torch.save over whatever is there): a path that is, holds or lies inside the
    checkpoint is refused even with ``overwrite=True``; an existing file only with it; a failed
    or refused call leaves every file as it was."""
    path, _, want = saved
    files = {n: (path / n).read_bytes() for n in sorted(os.listdir(path))}
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    inside = [path, path / ".metadata", path / next(n for n in files if n.endswith(".distcp")), tmp_path]
    for out in inside:
        for overwrite in (False, True):
            with pytest.raises(OutputError, match="the input"):
                qdcp.dcp_to_torch_save(path, out, overwrite=overwrite)
    with pytest.raises(OutputError, match="notes.txt' exists; it is replaced only with overwrite=True"):
        qdcp.dcp_to_torch_save(path, notes)
    assert notes.read_text() == "mine"
    (tmp_path / "folder").mkdir()
    with pytest.raises(OutputError, match="is not a file"):
        qdcp.dcp_to_torch_save(path, tmp_path / "folder", overwrite=True)
    assert {n: (path / n).read_bytes() for n in sorted(os.listdir(path))} == files
    written = qdcp.dcp_to_torch_save(path, notes, overwrite=True)
    _assert_exact(torch.load(notes, weights_only=True)["model"], want)
    _assert_exact(written["model"], want)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "folder", "notes.txt"]  # no scratch left


def test_qdcp_consolidate_keeps_nesting_and_objects(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model[1].parameters())
    model[1](torch.randn(2, 32, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}
    qdcp.save(state, tmp_path / "ckpt")
    with qdcp.installed():
        format_utils.dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "out.pt")
    for sd in (qdcp.consolidate(tmp_path / "ckpt"), torch.load(tmp_path / "out.pt", weights_only=True)):
        assert sd["step"] == 3 and sd["optim"]["param_groups"] == state["optim"]["param_groups"]
        # DCP records the optimizer's integer state keys as strings; nested as its own planner nests them
        assert torch.equal(sd["optim"]["state"]["0"]["exp_avg"], state["optim"]["state"][0]["exp_avg"])
        assert torch.equal(sd["model"]["0.weight"], state["model"]["0.weight"].dequantize())
