"""The CLI never deletes or rewrites what it did not write, and says what is wrong in one line.

Each verb runs as a user types it, through ``qdcp.cli.main`` in this process (tests/cli_in_process.py:
its exit status, stdout and stderr; test_cli.py and test_export.py run the installed entry point as
a subprocess), on a real checkpoint saved with ``qdcp.save``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import qdcp
from cli_in_process import qdcp_cli
from qdcp.cli import build_parser
from quantized_cases import CASE_BY_NAME


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    qdcp.save({"m.weight": CASE_BY_NAME["int8_row"].make(0), "m.bias": torch.arange(4.0)}, path)
    return path


_qdcp = qdcp_cli


def _snapshot(path: Path) -> dict:
    """Every file under ``path``: bytes and mtime."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            p = Path(root) / name
            out[str(p.relative_to(path))] = (p.read_bytes(), p.stat().st_mtime_ns)
    return out


def _usage_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 2, one line on stderr holding ``words``, no traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize("verb, out", [(verb, out) for verb in ("export", "convert-dcp")
                                       for out in ("same", "inside", "parent", "symlink")]
                         + [("convert-safetensors", "inside"), ("convert-safetensors", "symlink")])
def test_output_overlapping_the_input_is_refused_before_writing(ckpt, tmp_path, verb, out):
    work = tmp_path / "work"
    work.mkdir()
    src = work / "ckpt"
    subprocess.run(["cp", "-a", str(ckpt), str(src)], check=True)
    (work / "link").symlink_to(src)
    out_path = {"same": src, "inside": src / "sub", "parent": work, "symlink": work / "link"}[out]
    before, listing = _snapshot(src), sorted(os.listdir(work))
    args = {"export": ["--format", "torchao"], "convert-dcp": ["--to", "dcp", "--dequantize"],
            "convert-safetensors": ["--to", "safetensors"]}[verb]
    proc = _qdcp(verb.split("-")[0], src, out_path, *args, "--overwrite", "--quiet")
    _usage_error(proc, "the input", {"same": "is", "inside": "lies inside", "parent": "contains",
                                     "symlink": "is"}[out])
    assert _snapshot(src) == before and sorted(os.listdir(work)) == listing


def test_export_overwrite_replaces_only_what_export_wrote(ckpt, tmp_path):
    out = tmp_path / "out"
    assert _qdcp("export", ckpt, out, "--format", "torchao", "--quiet").returncode == 0
    first = _snapshot(out)
    assert sorted(first) == ["config.json", "model.safetensors"]
    _usage_error(_qdcp("export", ckpt, out, "--format", "torchao", "--quiet"), "exists", "--overwrite")
    assert _qdcp("export", ckpt, out, "--format", "torchao", "--quiet", "--overwrite").returncode == 0
    (out / "notes.txt").write_text("the user's own")
    before = _snapshot(out)
    _usage_error(_qdcp("export", ckpt, out, "--format", "torchao", "--quiet", "--overwrite"), "'notes.txt'",
                 "Remove those or choose another path")
    assert _snapshot(out) == before
    # the library call refuses the same way
    with pytest.raises(qdcp.ExportError, match="notes.txt"):
        qdcp.export(ckpt, out, format="torchao", overwrite=True)
    assert _snapshot(out) == before
    # a directory under one of export's file names is not export's either
    (out / "notes.txt").unlink()
    (out / "model.safetensors").unlink()
    (out / "model.safetensors").mkdir()
    (out / "model.safetensors" / "mine.bin").write_bytes(b"mine")
    before = _snapshot(out)
    with pytest.raises(qdcp.ExportError, match="'model.safetensors'"):
        qdcp.export(ckpt, out, format="torchao", overwrite=True)
    assert _snapshot(out) == before


def test_convert_overwrite_replaces_only_what_convert_wrote(ckpt, tmp_path):
    st = tmp_path / "w.safetensors"
    assert _qdcp("convert", ckpt, st, "--to", "safetensors", "--quiet").returncode == 0
    assert _qdcp("convert", ckpt, st, "--to", "safetensors", "--quiet", "--overwrite").returncode == 0
    mine = tmp_path / "mine.safetensors"
    mine.write_bytes(b"not qdcp's")
    _usage_error(_qdcp("convert", ckpt, mine, "--to", "safetensors", "--overwrite"),
                 "is not a safetensors file qdcp wrote")
    assert mine.read_bytes() == b"not qdcp's"

    dq = tmp_path / "dq"
    assert _qdcp("convert", ckpt, dq, "--to", "dcp", "--dequantize", "--quiet").returncode == 0
    assert _qdcp("convert", ckpt, dq, "--to", "dcp", "--dequantize", "--quiet", "--overwrite").returncode == 0
    out = {"m.weight": torch.zeros(CASE_BY_NAME["int8_row"].make(0).shape, dtype=torch.bfloat16),
           "m.bias": torch.zeros(4)}
    qdcp.load(out, dq)
    assert torch.equal(out["m.weight"], CASE_BY_NAME["int8_row"].make(0).dequantize())
    (dq / "train.log").write_text("mine")
    before = _snapshot(dq)
    _usage_error(_qdcp("convert", ckpt, dq, "--to", "dcp", "--dequantize", "--overwrite"), "'train.log'")
    assert _snapshot(dq) == before
    # data files without a .metadata: not a DCP checkpoint (whose files they are, qdcp cannot tell)
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "shard.distcp").write_bytes(b"someone's data")
    _usage_error(_qdcp("convert", ckpt, partial, "--to", "dcp", "--dequantize", "--overwrite"), "has no .metadata")
    assert sorted(os.listdir(partial)) == ["shard.distcp"]
    assert (partial / "shard.distcp").read_bytes() == b"someone's data"


def test_convert_to_safetensors_never_writes_over_a_file_beside_its_output(ckpt, tmp_path):
    """The file is written under a fresh temporary name, not ``OUT.tmp``, which may be the user's."""
    theirs = tmp_path / "w.safetensors.tmp"
    theirs.write_bytes(b"the user's")
    proc = _qdcp("convert", ckpt, tmp_path / "w.safetensors", "--to", "safetensors", "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with safe_open(tmp_path / "w.safetensors", "pt") as f:
        written = [f.get_tensor(k) for k in f.keys()]
    assert proc.stdout.strip().endswith(f": {len(written)} tensors, {sum(t.nbytes for t in written)} bytes")
    assert theirs.read_bytes() == b"the user's"
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors", "w.safetensors.tmp"]


@pytest.mark.parametrize("case", ["out_is_a_file", "missing_checkpoint", "checkpoint_is_a_file", "bad_size",
                                  "missing_config", "config_not_json", "convert_out_is_a_dir", "verify_missing",
                                  "missing_option", "keep_0"])
def test_user_errors_exit_2_with_one_line(ckpt, tmp_path, case):
    afile = tmp_path / "afile"
    afile.write_text("x")
    export = ["--format", "torchao", "--quiet"]
    args = {"out_is_a_file": ["export", ckpt, afile, *export],
            "missing_checkpoint": ["export", tmp_path / "nope", tmp_path / "o", *export],
            "checkpoint_is_a_file": ["export", afile, tmp_path / "o", *export],
            "bad_size": ["export", ckpt, tmp_path / "o", "--max-shard-size", "5XB", *export],
            "missing_config": ["export", ckpt, tmp_path / "o", "--config", tmp_path / "nope.json", *export],
            "config_not_json": ["export", ckpt, tmp_path / "o", "--config", afile, *export],
            "convert_out_is_a_dir": ["convert", ckpt, tmp_path, "--to", "safetensors", "--quiet"],
            "verify_missing": ["verify", tmp_path / "nope", "--quiet"],
            "missing_option": ["convert", ckpt, tmp_path / "o"], "keep_0": ["prune", tmp_path, "--keep", "0"]}[case]
    words = {"out_is_a_file": ["afile", "is a file"], "missing_checkpoint": ["no checkpoint directory", "nope"],
             "checkpoint_is_a_file": ["no checkpoint directory", "afile"], "bad_size": ["5XB"],
             "missing_config": ["--config", "nope.json", "No such file"],
             "config_not_json": ["--config", "afile", "not a JSON file"],
             "convert_out_is_a_dir": ["is a directory"],
             "verify_missing": ["no checkpoint directory", "nope"],
             "missing_option": ["qdcp convert", "--to", "--help"], "keep_0": ["keep=0", "at least 1"]}[case]
    _usage_error(_qdcp(*args), *words)
    assert sorted(os.listdir(tmp_path)) == ["afile"] and afile.read_text() == "x"


@pytest.mark.parametrize("size", ["5iB", "5XB", "", "GB", "5G", "1e9", "-3", "0", "5.5.5GB", "5 GB B"])
def test_a_bad_max_shard_size_is_refused_naming_the_option_and_its_forms(ckpt, tmp_path, size):
    _usage_error(_qdcp("export", ckpt, tmp_path / "o", "--format", "torchao", "--max-shard-size", size, "--quiet"),
                 "--max-shard-size", repr(size), "KB", "MiB", "'5GB'")
    for bad in (size, 0, -1, True):
        with pytest.raises(ValueError, match=r"max_shard_size \(--max-shard-size\) .*: expected a positive number"):
            qdcp.export(ckpt, tmp_path / "o", format="torchao", max_shard_size=bad)
    assert os.listdir(tmp_path) == []


def test_a_dtype_safetensors_cannot_hold_is_refused_in_one_line(tmp_path):
    qdcp.save({"z": torch.randn(4, dtype=torch.complex64)}, tmp_path / "ckpt")
    _usage_error(_qdcp("convert", tmp_path / "ckpt", tmp_path / "z.safetensors", "--to", "safetensors"),
                 "key 'z'", "torch.complex64", "has no safetensors name", "nothing was written")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def _corrupt(path: Path, *values: torch.Tensor) -> None:
    """Flip a byte inside each of ``values`` in the checkpoint's data file."""
    data = next(p for p in path.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    for v in values:
        at = raw.find(v.numpy().tobytes())
        assert at >= 0
        raw[at + 4] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_verify_counts_in_words(tmp_path):
    w, v = torch.arange(3.0), torch.arange(10.0, 13.0)
    one, two = tmp_path / "one", tmp_path / "two"
    qdcp.save({"w": w}, one)
    qdcp.save({"w": w, "v": v}, two)
    last = lambda proc: proc.stdout.strip().splitlines()[-1]  # noqa: E731
    proc = _qdcp("verify", one, "--quiet")
    assert proc.returncode == 0 and last(proc).startswith("OK: 1 entry, 0 problems; "), proc.stdout
    _corrupt(one, w)
    _corrupt(two, w, v)
    proc = _qdcp("verify", one, "--quiet")
    assert proc.returncode == 1 and last(proc).startswith("FAILED: 1 entry, 1 problem; "), proc.stdout
    proc = _qdcp("verify", two, "--quiet")
    assert proc.returncode == 1 and last(proc).startswith("FAILED: 2 entries, 2 problems; "), proc.stdout


def test_every_argument_has_help():
    parser = build_parser()
    assert all(a.help for a in parser._actions)
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"qdcp {name}: {action.dest} has no help text"


# ----------------------------------------------------------------------------- convert --to torch

def test_convert_to_torch_writes_whole_entries(ckpt, tmp_path):
    """``qdcp convert CKPT OUT --to torch``: one torch.save file, as DCP's dcp_to_torch_save, with each
    quantized entry under its own key: its values (``--dequantize``, plain tensors only: loads with
    ``weights_only=True`` and no torchao) or its own type, bit-identical buffers."""
    weight = CASE_BY_NAME["int8_row"].make(0)
    proc = _qdcp("convert", ckpt, tmp_path / "values.pt", "--to", "torch", "--dequantize", "--quiet")
    assert proc.returncode == 0 and "wrote 2 entries" in proc.stdout, proc.stderr
    values = torch.load(tmp_path / "values.pt", weights_only=True)
    assert sorted(values) == ["m.bias", "m.weight"] and type(values["m.weight"]) is torch.Tensor
    assert torch.equal(values["m.weight"], weight.dequantize()) and torch.equal(values["m.bias"], torch.arange(4.0))
    assert _qdcp("convert", ckpt, tmp_path / "typed.pt", "--to", "torch", "--quiet").returncode == 0
    typed = torch.load(tmp_path / "typed.pt", weights_only=False)["m.weight"]
    assert type(typed) is type(weight)
    assert torch.equal(typed.qdata, weight.qdata) and torch.equal(typed.scale, weight.scale)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["typed.pt", "values.pt"]  # no temporary left


@pytest.mark.parametrize("extra", [[], ["--overwrite"]])
def test_convert_to_torch_never_replaces_a_file(ckpt, tmp_path, extra):
    out = tmp_path / "model.pt"
    out.write_bytes(b"the user's own file")
    proc = _qdcp("convert", ckpt, out, "--to", "torch", "--dequantize", *extra)
    _usage_error(proc, "model.pt" if not extra else "--overwrite")
    assert out.read_bytes() == b"the user's own file"
