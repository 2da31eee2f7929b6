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

FORGERIES = {
    "mx elem_dtype e5m2": ("mx_fp8", lambda e: e["attrs"].__setitem__("elem_dtype", {"dtype": "float8_e5m2"})),
    "type swapped": ("int8_group32", lambda e: e.__setitem__("type", "torchao.Float8Tensor")),
}


@pytest.mark.parametrize("forgery", FORGERIES)
def test_attributes_the_library_refuses_are_a_qdcp_refusal_naming_the_key(tmp_path, forgery):
    case, edit = FORGERIES[forgery]
    path = tmp_path / "c"
    qdcp.save({"w": CASE_BY_NAME[case].make(0)}, path)
    md = qdcp.read_metadata(path)
    doc = json.loads(md.planner_data[qspec.PLANNER_DATA_KEY])
    edit(doc["entries"]["w"])
    md.planner_data[qspec.PLANNER_DATA_KEY] = json.dumps(doc)
    (path / ".metadata").write_bytes(pickle.dumps(resealed(md)))

    with pytest.raises(qdcp.QdcpError, match="key 'w'"):
        qdcp.load({"w": CASE_BY_NAME[case].make(1)}, path)
    done = qdcp_cli("convert", str(path), str(tmp_path / "out.pt"), "--to", "torch")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done
    assert "key 'w': the stored entry cannot be rebuilt" in done.stderr, done
    assert not (tmp_path / "out.pt").exists()
    done = qdcp_cli("verify", str(path))
    fails = [line for line in done.stdout.splitlines() if line.startswith("FAIL ")]
    assert done.returncode == 1 and len(fails) == 1 and fails[0].startswith("FAIL w: "), done
