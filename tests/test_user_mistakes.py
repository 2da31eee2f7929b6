"""What a user's own training loop falls into: each mistake gets a message that says what to do,
the CLI stays quiet, and the front door logs what it did (``logging.getLogger("qdcp")``)."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from quantized_cases import CASE_BY_NAME, raise_inner

INT8 = CASE_BY_NAME["int8_row"]


def _model(seed: int) -> dict:
    """A ``model.state_dict()``: an Int8Tensor weight and a plain bias."""
    return {"0.weight": INT8.make(seed), "0.bias": torch.randn(8, generator=torch.Generator().manual_seed(seed))}


@pytest.fixture(scope="module")
def nested(tmp_path_factory):
    """A checkpoint saved as ``{"model": model.state_dict(), "step": 7}``."""
    path = tmp_path_factory.mktemp("mistakes") / "nested"
    qdcp.save({"model": _model(0), "step": 7}, path)
    return path


# ----------------------------------------------------------------------------- the CLI


def test_help_imports_no_torchao_and_prints_nothing_on_stderr():
    code = ("import runpy, sys\nsys.argv = ['qdcp', '--help']\n"
            "try:\n    runpy.run_module('qdcp', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('torchao imported:', 'torchao' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "usage: qdcp" in proc.stdout and proc.stdout.rstrip().endswith("torchao imported: False")
    assert proc.stderr == ""


@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_commands_do_not_print_torchao_extension_failures(nested, verb):
    proc = subprocess.run([sys.executable, "-m", "qdcp", verb, str(nested)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- no checkpoint at the path


def test_missing_directory_is_a_clear_file_not_found(tmp_path):
    with pytest.raises(qdcp.CheckpointNotFoundError, match=r"no checkpoint \(\.metadata\) at .*nope.*no such "
                                                            r"directory.*is the path right.*did the save finish"):
        qdcp.load(_model(1), tmp_path / "nope")
    assert issubclass(qdcp.CheckpointNotFoundError, FileNotFoundError)


def test_empty_directory_is_a_clear_error_without_dcp_tracebacks(tmp_path, capfd):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint \(\.metadata\) at .*empty.*without \.metadata.*"
                                                r"is the path right.*did the save finish") as info:
        qdcp.load(_model(1), tmp_path / "empty")
    assert isinstance(info.value, qdcp.CheckpointNotFoundError)
    assert not isinstance(info.value, AssertionError)
    err = capfd.readouterr().err
    assert "metadata is not found" not in err and "Traceback" not in err


def test_a_damaged_metadata_is_the_readers_error_not_an_assertion(nested, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(nested, bad)
    (bad / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(qdcp.CheckpointFormatError) as info:
        qdcp.load(_model(1), bad)
    assert not isinstance(info.value, (AssertionError, FileNotFoundError))


# ----------------------------------------------------------------------------- nesting


def test_flat_state_dict_against_a_nested_checkpoint_says_how_to_nest(nested):
    hint = r"Missing key in checkpoint state_dict: 0\.(weight|bias)\. .*under 'model\.'.*\{\"model\": sd\}"
    with pytest.raises(RuntimeError, match=hint):
        qdcp.load(_model(1), nested)
    with pytest.raises(RuntimeError, match=hint):
        raise_inner(lambda: dcp.load(_model(1), checkpoint_id=nested, planner=qdcp.QuantizedLoadPlanner()))


def test_flat_plain_state_dict_gets_the_hint_too(nested):
    with pytest.raises(RuntimeError, match=r"Missing key in checkpoint state_dict: 0\.bias\. .*\{\"model\": sd\}"):
        qdcp.load({"0.bias": torch.zeros(8)}, nested)


def test_nested_state_dict_against_a_flat_checkpoint_says_which_inner_dict(tmp_path):
    qdcp.save(_model(0), tmp_path / "flat")
    with pytest.raises(RuntimeError, match=r"without the prefix 'model\.'.*sd\['model'\]"):
        qdcp.load({"model": _model(1)}, tmp_path / "flat")


def test_a_key_missing_for_another_reason_has_no_hint(nested):
    with pytest.raises(RuntimeError, match=r"Missing key in checkpoint state_dict: other\.$"):
        qdcp.load({"model": _model(1), "other": torch.zeros(2)}, nested)


# ----------------------------------------------------------------------------- planner classes


def test_a_planner_class_without_parentheses_is_told(nested, tmp_path):
    with pytest.raises(TypeError, match=r"planner=QuantizedLoadPlanner is the class itself: pass "
                                        r"QuantizedLoadPlanner\(\), an instance"):
        raise_inner(lambda: dcp.load({"model": _model(1)}, checkpoint_id=nested, planner=qdcp.QuantizedLoadPlanner))
    with pytest.raises(TypeError, match=r"planner=QuantizedSavePlanner is the class itself: pass "
                                        r"QuantizedSavePlanner\(\), an instance"):
        raise_inner(lambda: dcp.save(_model(1), checkpoint_id=tmp_path / "c", planner=qdcp.QuantizedSavePlanner))
    assert not (tmp_path / "c" / ".metadata").exists()


# ----------------------------------------------------------------------------- keys the target lacks


def test_checkpoint_keys_the_target_lacks_warn_once(nested):
    target = {"model": _model(1)}
    with pytest.warns(UserWarning, match=r"holds 1 entry the state dict has no key for, not loaded: \['step'\]"
                                         r".*allow_partial_load=True") as record:
        qdcp.load(target, nested)
    assert len([w for w in record if "no key for" in str(w.message)]) == 1
    assert torch.equal(target["model"]["0.bias"], _model(0)["0.bias"])  # the rest was loaded


def test_no_warning_when_everything_or_a_part_on_purpose_is_loaded(nested):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no key for")
        qdcp.load({"model": _model(1), "step": 0}, nested)
        qdcp.load({"model": _model(1)}, nested, allow_partial_load=True)


# ----------------------------------------------------------------------------- logging


def test_save_async_save_and_load_log_one_info_line_each(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="qdcp")
    state = {"model": _model(0)}
    qdcp.save(state, tmp_path / "a")
    qdcp.async_save(state, tmp_path / "b").result()
    qdcp.load({"model": _model(1)}, tmp_path / "a")
    lines = [r.getMessage() for r in caplog.records if r.name == "qdcp"]
    assert len(lines) == 3, lines
    for line, (what, name) in zip(lines, [("saved", "a"), ("saved (async)", "b"), ("loaded", "a")]):
        assert line.startswith(f"qdcp: {what} {tmp_path / name}: "), line
        assert " bytes in " in line and line.endswith(" GiB/s)")
        assert int(line.split(": ")[2].split()[0]) > 0
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "qdcp")


def test_the_qdcp_logger_has_no_handler_of_its_own():
    """Shown only where the application configures logging (its level: the root's, WARNING by default)."""
    assert logging.getLogger("qdcp").handlers == [] and logging.getLogger("qdcp").level == logging.NOTSET
