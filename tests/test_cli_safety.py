"""The CLI never deletes or rewrites what it did not write, and says what is wrong in one line.

Run as a user types it (``python -m qdcp ...``) on a real checkpoint saved with ``qdcp.save``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qdcp
from qdcp.cli import build_parser
from quantized_cases import CASE_BY_NAME

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    qdcp.save({"m.weight": CASE_BY_NAME["int8_row"].make(0), "m.bias": torch.arange(4.0)}, path)
    return path


def _qdcp(*args, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "qdcp", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


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


@pytest.mark.parametrize("out", ["same", "inside", "parent", "symlink"])
@pytest.mark.parametrize("verb", ["export", "convert-dcp", "convert-safetensors"])
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
    _usage_error(_qdcp("export", ckpt, out, "--format", "torchao", "--quiet", "--overwrite"), "'notes.txt'")
    assert _snapshot(out) == before
    # the library call refuses the same way
    with pytest.raises(qdcp.ExportError, match="notes.txt"):
        qdcp.export(ckpt, out, format="torchao", overwrite=True)
    assert _snapshot(out) == before


def test_convert_overwrite_replaces_only_what_convert_wrote(ckpt, tmp_path):
    st = tmp_path / "w.safetensors"
    assert _qdcp("convert", ckpt, st, "--to", "safetensors", "--quiet").returncode == 0
    assert _qdcp("convert", ckpt, st, "--to", "safetensors", "--quiet", "--overwrite").returncode == 0
    mine = tmp_path / "mine.safetensors"
    mine.write_bytes(b"not qdcp's")
    _usage_error(_qdcp("convert", ckpt, mine, "--to", "safetensors", "--overwrite"), "is not a safetensors file qdcp wrote")
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


@pytest.mark.parametrize("case", ["out_is_a_file", "missing_checkpoint", "checkpoint_is_a_file", "bad_size",
                                  "missing_config"])
def test_user_errors_exit_2_with_one_line(ckpt, tmp_path, case):
    afile = tmp_path / "afile"
    afile.write_text("x")
    args = {"out_is_a_file": [ckpt, afile], "missing_checkpoint": [tmp_path / "nope", tmp_path / "o"],
            "checkpoint_is_a_file": [afile, tmp_path / "o"],
            "bad_size": [ckpt, tmp_path / "o", "--max-shard-size", "5XB"],
            "missing_config": [ckpt, tmp_path / "o", "--config", tmp_path / "nope.json"]}[case]
    words = {"out_is_a_file": ["afile", "is a file"], "missing_checkpoint": ["nope"],
             "checkpoint_is_a_file": ["afile"], "bad_size": ["5XB"], "missing_config": ["nope.json"]}[case]
    _usage_error(_qdcp("export", *args, "--format", "torchao", "--quiet"), *words)
    assert afile.read_text() == "x" and not (tmp_path / "o").exists()


def test_verify_counts_in_words(tmp_path):
    one = tmp_path / "one"
    qdcp.save({"w": torch.arange(3.0)}, one)
    assert _qdcp("verify", one, "--quiet").stdout.strip().endswith("OK: 1 entry, 0 problems")
    data = next(p for p in one.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    at = raw.find(torch.arange(3.0).numpy().tobytes())
    raw[at + 4] ^= 0xFF
    data.write_bytes(bytes(raw))
    proc = _qdcp("verify", one, "--quiet")
    assert proc.returncode == 1 and proc.stdout.strip().endswith("FAILED: 1 entry, 1 problem"), proc.stdout


def test_every_argument_has_help():
    parser = build_parser()
    assert all(a.help for a in parser._actions)
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"qdcp {name}: {action.dest} has no help text"
