"""The reader by component: what qdcp.describe / read_stored report of a checkpoint on disk."""
from __future__ import annotations

import math

import pytest

from quantized_cases import CASES, qdcp_save


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_describe_reports_the_bytes_really_stored(tmp_path, case):
    """``describe()``'s byte count is the checkpoint's own: the items DCP recorded for the entry
    (and, raw, the source's inner buffers, every one of them stored)."""
    import qdcp
    from torch.distributed.checkpoint import FileSystemReader
    source = case.make(0)
    path = qdcp_save(str(tmp_path / "ckpt"), {"w": source}, no_dist=True)
    items = {k: v for k, v in FileSystemReader(path).read_metadata().state_dict_metadata.items()
             if k.startswith("w.__qdcp__.")}
    info = qdcp.describe(path)["w"]
    assert info["bytes"] == sum(math.prod(v.size) * v.properties.dtype.itemsize for v in items.values())
    assert set(info["components"]) == {k.split(".__qdcp__.")[1] for k in items}
    stored = qdcp.read_stored(path, "w").components
    assert info["bytes"] == sum(t.numel() * t.element_size() for t in stored.values())
