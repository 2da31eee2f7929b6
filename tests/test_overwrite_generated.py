"""What ``qdcp.save(..., overwrite=True)`` removes from a directory, on generated directories.

docs/api.md (*The commit*): once the new ``.metadata`` is published, the save removes only the
files the replaced ``.metadata`` referenced and the debris of qdcp saves at that path that no
longer run (``__<token>_<rank>_<n>.distcp``, ``.metadata.<token>.tmp``), never a file another
writer's name scheme made. The oracle is that sentence: each directory is drawn with an old
checkpoint (none, qdcp's, stock DCP's, or qdcp's whose ``.metadata`` was damaged to list names it
should not: ``.metadata`` itself, a claim's file, a user's file), dead qdcp saves' files, a user's
files (some named almost like qdcp's), subdirectories (one named like a qdcp data file); after
the save, exactly the old checkpoint's files and the dead saves' are gone (the new ``.metadata``
and its files in their place, loading what was saved), and every other file is byte for byte
as it was.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import qdcp
from quantized_cases import CASE_BY_NAME

# names a user (or another tool) may keep beside a checkpoint, some close to qdcp's own
USER_FILES = ("notes.txt", "model.safetensors", "README", "__0_0.distcp.bak", ".metadata.bak",
              "x__0123456789ab_0_0.distcp", "__0123456789ab_0_0.distcp.old", "__0123456789ab_a_0.distcp",
              "__0123456789AB_0_0.distcp", ".metadata.0123456789ab.tmp.keep", ".qdcp-save.claim.txt.keep")
# what a qdcp save that died leaves: data files and its unpublished .metadata, of its own token
DEAD_SAVE_FILES = ("__{t}_0_0.distcp", "__{t}_1_3.distcp", ".metadata.{t}.tmp")
SUBDIRS = ("logs", "__fedcba987654_0_0.distcp")
# what a damaged old .metadata may list besides its own files
DAMAGED_LISTS = (".metadata", ".qdcp-save.claim", "notes.txt")


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file under ``root`` (relative path: bytes) and directory (relative path: None)."""
    out: dict[str, bytes | None] = {}
    for here, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(here, d), root)] = None
        for f in files:
            out[os.path.relpath(os.path.join(here, f), root)] = Path(here, f).read_bytes()
    return out


def referenced(path: Path) -> set[str]:
    """The data files a checkpoint's ``.metadata`` lists (as DCP records them)."""
    md = qdcp.read_metadata(path)
    return {info.relative_path for info in md.storage_data.values()}


def state(seed: int) -> dict:
    return {"w": CASE_BY_NAME["int8_row"].make(seed, (32, 64)), "b": torch.full((8,), float(seed)), "step": seed}


@settings(max_examples=80, deadline=None, derandomize=True, database=None, phases=(Phase.generate,),
          suppress_health_check=list(HealthCheck))
@given(old=st.sampled_from(["none", "qdcp", "stock", "damaged"]), damaged=st.sampled_from(DAMAGED_LISTS),
       user=st.sets(st.sampled_from(USER_FILES)), dead=st.lists(st.integers(1, 2**48 - 1), max_size=2),
       subdirs=st.sets(st.sampled_from(SUBDIRS)))
def test_overwrite_removes_the_old_checkpoint_and_dead_saves_files_only(old, damaged, user, dead, subdirs):
    with tempfile.TemporaryDirectory(prefix="qdcp-overwrite-") as tmp:
        path = Path(tmp) / "ckpt"
        path.mkdir()
        gone: set[str] = set()
        if old in ("qdcp", "damaged"):
            qdcp.save(state(1), path, overwrite=True)
        elif old == "stock":
            dcp.save({"b": torch.ones(8)}, storage_writer=dcp.FileSystemWriter(path))
        referenced_before = referenced(path) if old != "none" else set()
        gone |= referenced_before
        for name in user:
            (path / name).write_bytes(f"the user's {name}".encode())
        for token in dead:
            for pattern in DEAD_SAVE_FILES:
                name = pattern.format(t=f"{token:012x}")
                (path / name).write_bytes(b"a dead save's bytes")
                gone.add(name)
        for d in subdirs:
            (path / d).mkdir()
            (path / d / "inside.txt").write_bytes(b"kept")
        if old == "damaged":  # the old .metadata lists a name of another's instead of one of its items' files
            md = pickle.loads((path / ".metadata").read_bytes())
            index = sorted(md.storage_data, key=lambda i: i.fqn)[0]
            md.storage_data[index] = dataclasses.replace(md.storage_data[index], relative_path=damaged)
            (path / ".metadata").write_bytes(pickle.dumps(md))
            listed = {info.relative_path for info in md.storage_data.values()}
            # what it lists goes; never the new .metadata, nor a claim's file
            gone = (gone - referenced_before) | (listed - {".metadata", ".qdcp-save.claim"})
        before = tree(path)

        saved = state(2)
        qdcp.save(saved, path, overwrite=True)

        after = tree(path)
        new = referenced(path)
        assert not new & set(before), "the new checkpoint wrote over a file that was there"
        expected = {n for n in before if n not in gone} | new | {".metadata"}
        assert set(after) == expected, (sorted(set(after) - expected), sorted(expected - set(after)))
        changed = [n for n in before if n in after and n != ".metadata" and after[n] != before[n]]
        assert not changed, f"files changed: {changed}"
        loaded = state(3)
        qdcp.load(loaded, path)
        assert torch.equal(loaded["w"].qdata, saved["w"].qdata) and torch.equal(loaded["b"], saved["b"])
        assert loaded["step"] == 2
