"""A reader never allocates beyond what the checkpoint stores (docs/format.md, *What a loader checks*).

Two forged ``.metadata`` (resealed: the checksum record and the digest recomputed, so only the size
checks stand between them and a reader): a 16-float item claiming 65536 x 32768 elements (8 GiB for
1 KB stored), and one stored item listed again under 2,600 other keys at the same byte range (each
read allocating its size again). ``qdcp.load``, ``dcp.load`` with qdcp's reader, ``qdcp verify``
and ``qdcp convert --to torch`` refuse both with one ``CheckpointFormatError`` naming the key, at
the metadata, before a planner allocates a target (run in a child process whose address space is
capped, so the old behaviour fails instead of taking the machine's memory).
"""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import qdcp
from qdcp import checksums
from stored_bytes import resealed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
sys.path[:0] = [{root!r}, {tests!r}]
import torch, torch.distributed.checkpoint as dcp
import qdcp
from cli_in_process import qdcp_cli
from quantized_cases import raise_inner
path, out = sys.argv[1], sys.argv[2]
for name, load in (("qdcp.load", lambda t: qdcp.load(t, path, allow_partial_load=True)),
                   ("dcp.load", lambda t: dcp.load(t, storage_reader=qdcp.storage_reader(path),
                                                   planner=qdcp.QuantizedLoadPlanner(allow_partial_load=True)))):
    try:
        raise_inner(lambda: load({{"b": torch.zeros(16)}}))
        print(name, "LOADED")
    except qdcp.CheckpointFormatError as e:
        print(name, "REFUSED", " ".join(str(e).split()))
for args in (("verify", path), ("convert", path, out, "--to", "torch")):
    done = qdcp_cli(*args)
    print(args[0], done.returncode, " ".join(done.stderr.split()))
"""


def _forge(path, change) -> None:
    md = qdcp.read_metadata(path)
    change(md)
    (path / ".metadata").write_bytes(pickle.dumps(resealed(md)))


def _claims_8_gib(md) -> None:
    item = md.state_dict_metadata["b"]
    item.size = torch.Size([65536, 32768])
    item.chunks[0] = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([65536, 32768]))
    (index,) = [i for i in md.storage_data if i.fqn == "b"]
    md.storage_data[type(index)(fqn="b", offset=torch.Size([0, 0]), index=index.index)] = md.storage_data.pop(index)


def _listed_2600_times(md) -> None:
    (index,) = [i for i in md.storage_data if i.fqn == "b"]
    record = md.planner_data[checksums.PLANNER_DATA_KEY]
    for k in range(2600):
        fqn = f"b{k}"
        md.state_dict_metadata[fqn] = copy.deepcopy(md.state_dict_metadata["b"])
        md.storage_data[type(index)(fqn=fqn, offset=index.offset, index=index.index)] = md.storage_data[index]
        md.planner_data[fqn] = (fqn,)
        record["items"][fqn] = record["items"]["b"]


@pytest.mark.parametrize("forge, key", [(_claims_8_gib, "key 'b'"), (_listed_2600_times, "overlap")],
                         ids=["claimed-shape", "repeated-range"])
def test_a_reader_allocates_no_more_than_is_stored(tmp_path, forge, key):
    path = tmp_path / "c"
    qdcp.save({"b": torch.randn(16, generator=torch.Generator().manual_seed(0)), "step": 3}, path)
    _forge(path, forge)
    script = _CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    done = subprocess.run([sys.executable, "-c", script, str(path), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.split(" ", 1)[0] in
             ("qdcp.load", "dcp.load", "verify", "convert")]
    assert len(lines) == 4, done.stdout[-3000:] + done.stderr[-3000:]
    for line in lines[:2]:
        assert " REFUSED " in line and key in line and "metadata is corrupt" in line, line
    for line in lines[2:]:
        assert line.split(" ", 2)[1] == "2" and key in line and "metadata is corrupt" in line, line
    assert not (tmp_path / "out.pt").exists()
