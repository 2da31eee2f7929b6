"""``qdcp export OUT --overwrite``, typed as a user types it, over generated output directories.

docs/api.md (*Hugging Face directories*; *Errors*): an existing, non-empty output directory is
replaced only with ``--overwrite`` and only if every file in it is one an export writes
(``model*.safetensors``, the index, ``config.json``; a directory under one of those names is not,
a symlink under one is replaced as a file, its target untouched);
otherwise the export is refused, one line on stderr, exit status 2, nothing written. The oracle
is that rule: each output directory is drawn from an earlier export's files (one file or shards
and their index), a user's files (some named almost like an export's), subdirectories and
symlinks to files outside it; a refused export leaves the directory, its parent and every symlink's
target byte for byte as they were; an accepted one leaves exactly a fresh export's files, byte for
byte those of an export into an empty directory, and never touches what a symlink pointed to.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import qdcp
from cli_in_process import qdcp_cli
from quantized_cases import CASE_BY_NAME

EXPORT_FILES = ("config.json", "model.safetensors", "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors", "model.safetensors.index.json")
USER_FILES = ("notes.txt", "tokenizer.json", "model.safetensors.bak", "generation_config.json", ".hidden",
              "config.json.orig", "model-00001-of-00002.safetensors.part")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("export-overwrite") / "ckpt"
    qdcp.save({f"layers.{i}.weight": CASE_BY_NAME["int8_row"].make(i, (64, 128)) for i in range(3)}
              | {"norm.weight": torch.ones(128, dtype=torch.bfloat16)}, path)
    return path


@pytest.fixture(scope="module")
def fresh(ckpt, tmp_path_factory) -> dict:
    """What an export into an empty directory writes, by shard size."""
    out = {}
    for size in ("1GB", "20KB"):
        d = tmp_path_factory.mktemp("fresh") / size
        assert qdcp_cli("export", ckpt, d, "--format", "torchao", "--max-shard-size", size, "--quiet").returncode == 0
        out[size] = tree(d)
    assert len(out["20KB"]) > 2, "the small shard size must shard"
    return out


def tree(root: Path) -> dict[str, bytes | str | None]:
    """Every entry under ``root``: a file's bytes, a symlink's target (``"-> target"``), None for a directory."""
    out: dict[str, bytes | str | None] = {}
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(here, name)
            rel = str(p.relative_to(root))
            out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else None if p.is_dir() else p.read_bytes()
    return out


def entries():
    kinds = st.sampled_from(["file", "dir", "symlink"])
    return st.dictionaries(st.sampled_from(EXPORT_FILES + USER_FILES), kinds, max_size=5)


@settings(max_examples=60, deadline=None, derandomize=True, database=None, phases=(Phase.generate,),
          suppress_health_check=list(HealthCheck))
@given(there=entries(), size=st.sampled_from(["1GB", "20KB"]))
def test_export_overwrite_replaces_only_an_export(ckpt, fresh, there, size):
    with tempfile.TemporaryDirectory(prefix="qdcp-export-out-") as tmp:
        work = Path(tmp)
        out, outside = work / "out", work / "outside"
        out.mkdir()
        outside.mkdir()
        for name, kind in there.items():
            if kind == "file":
                (out / name).write_bytes(f"earlier {name}".encode())
            elif kind == "dir":
                (out / name).mkdir()
                (out / name / "inside.bin").write_bytes(b"kept")
            else:  # a symlink to a file of the user's outside the output
                (outside / name).write_bytes(f"the user's {name}, outside".encode())
                (out / name).symlink_to(outside / name)
        before, beside, targets = tree(out), sorted(os.listdir(work)), tree(outside)

        proc = qdcp_cli("export", ckpt, out, "--format", "torchao", "--max-shard-size", size, "--quiet",
                        "--overwrite")

        assert tree(outside) == targets, "a symlink's target changed"
        not_exports = [n for n, kind in there.items() if n not in EXPORT_FILES or kind == "dir"]
        if proc.returncode == 2:
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
            assert tree(out) == before and sorted(os.listdir(work)) == beside, "a refused export changed files"
            assert not_exports, f"refused, the rule accepts it: {lines[0]}"
            assert not not_exports or any(repr(n) in lines[0] for n in not_exports), lines[0]
        else:
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert not not_exports, f"accepted with {not_exports} in the output"
            assert tree(out) == fresh[size], "not what an export into an empty directory writes"
            assert sorted(os.listdir(work)) == beside, "scratch left beside the output"
