"""A spec whose attributes the library refuses (resealed, so only the rebuild stands in the way): an
MX entry's ``elem_dtype`` changed to e5m2 over e4m3 data, an Int8 entry's type swapped to
Float8Tensor. Every reader refuses it with a qdcp error naming the key, never the library's raw
``AssertionError`` / ``KeyError``: ``qdcp.load`` and ``qdcp convert --to torch`` (one line, exit 2),
``qdcp verify`` (one problem, naming the key, exit 1)."""

from __future__ import annotations

import json
import pickle

import pytest

import qdcp
from cli_in_process import qdcp_cli
from qdcp import spec as qspec
from quantized_cases import CASE_BY_NAME
from stored_bytes import resealed

FORGERIES = {  # key: (case, edit of its spec entry)
    "mx": ("mx_fp8", lambda e: e["attrs"].__setitem__("elem_dtype", {"dtype": "float8_e5m2"})),
    "swapped": ("int8_group32", lambda e: e.__setitem__("type", "torchao.Float8Tensor")),
}


def test_attributes_the_library_refuses_are_a_qdcp_refusal_naming_the_key(tmp_path):
    path = tmp_path / "c"
    qdcp.save({key: CASE_BY_NAME[case].make(0) for key, (case, _) in FORGERIES.items()}, path)
    md = qdcp.read_metadata(path)
    doc = json.loads(md.planner_data[qspec.PLANNER_DATA_KEY])
    for key, (_, edit) in FORGERIES.items():
        edit(doc["entries"][key])
    md.planner_data[qspec.PLANNER_DATA_KEY] = json.dumps(doc)
    (path / ".metadata").write_bytes(pickle.dumps(resealed(md)))

    for key, (case, _) in FORGERIES.items():
        with pytest.raises(qdcp.QdcpError, match=f"key '{key}'"):
            qdcp.load({key: CASE_BY_NAME[case].make(1)}, path, allow_partial_load=True)
    done = qdcp_cli("convert", str(path), str(tmp_path / "out.pt"), "--to", "torch")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done
    assert "the stored entry cannot be rebuilt" in done.stderr, done
    assert not (tmp_path / "out.pt").exists()
    done = qdcp_cli("verify", str(path))
    fails = sorted(line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("FAIL "))
    assert done.returncode == 1 and fails == ["FAIL mx", "FAIL swapped"], done
