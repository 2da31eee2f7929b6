"""DCP's ``_Checkpointable`` protocol: tensors that tell DCP their own chunks (global shape and
offsets without being DTensors, e.g. Megatron's ``CheckpointableShardedTensor``). qdcp's planners,
stager, writer and reader treat them as DCP does: the chunks they name are written, read back into
any split of the same tensor or a plain one, and checksummed like any other item."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from checkpointable_cases import RowBlocks, row_blocks
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner, QuantizedStager

FULL = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) / 7


def _whole(t) -> torch.Tensor:
    return torch.cat([t.blocks[k] for k in sorted(t.blocks)]) if isinstance(t, RowBlocks) else t


TARGETS = {
    "same split": lambda: row_blocks(torch.zeros(8, 6), [0, 4]),
    "another split": lambda: row_blocks(torch.zeros(8, 6), [0, 1, 6]),
    "plain tensor": lambda: torch.zeros(8, 6),
}


def _save(how: str, path: str) -> None:
    state = {"w": row_blocks(FULL, [0, 4]), "b": torch.arange(3.0)}
    if how == "dcp.save":
        dcp.save(state, checkpoint_id=path, planner=QuantizedSavePlanner(), no_dist=True)
    elif how == "dcp.async_save":
        dcp.async_save(state, checkpoint_id=path, planner=QuantizedSavePlanner(), async_stager=QuantizedStager(),
                       no_dist=True).result()
    else:
        qdcp.save(state, path)


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("how", ["dcp.save", "dcp.async_save", "qdcp.save"])
def test_chunks_it_names_load_into_any_split(tmp_path, how, target):
    path = str(tmp_path / "ckpt")
    _save(how, path)
    chunks = dcp.FileSystemReader(path).read_metadata().state_dict_metadata["w"].chunks
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [((0, 0), (4, 6)), ((4, 0), (4, 6))]
    state = {"w": TARGETS[target](), "b": torch.zeros(3)}
    blocks_before = dict(state["w"].blocks) if isinstance(state["w"], RowBlocks) else None
    if how == "qdcp.save":
        qdcp.load(state, path)
    else:
        dcp.load(state, checkpoint_id=path, planner=QuantizedLoadPlanner(), no_dist=True)
    assert torch.equal(_whole(state["w"]), FULL) and torch.equal(state["b"], torch.arange(3.0))
    if blocks_before is not None:  # filled in place
        assert all(state["w"].blocks[k] is v for k, v in blocks_before.items())


def test_written_as_dcp_writes_it(tmp_path):
    """The same items as DCP's default planner writes: stock ``dcp.load`` reads qdcp's, and
    qdcp's planner reads DCP's."""
    ours, theirs = str(tmp_path / "qdcp"), str(tmp_path / "dcp")
    _save("dcp.save", ours)
    dcp.save({"w": row_blocks(FULL, [0, 4]), "b": torch.arange(3.0)}, checkpoint_id=theirs, no_dist=True)
    for path, planner in ((ours, None), (theirs, QuantizedLoadPlanner())):
        state = {"w": row_blocks(torch.zeros(8, 6), [0, 3]), "b": torch.zeros(3)}
        dcp.load(state, checkpoint_id=path, planner=planner, no_dist=True)
        assert torch.equal(_whole(state["w"]), FULL)


def test_a_corrupt_chunk_is_caught_naming_the_key(tmp_path):
    path = str(tmp_path / "ckpt")
    _save("dcp.save", path)
    data = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp")]
    needle = FULL[4:].numpy().tobytes()
    for f in data:
        raw = bytearray(open(f, "rb").read())
        at = bytes(raw).find(needle)
        if at >= 0:
            raw[at + 5] ^= 0x01
            open(f, "wb").write(raw)
            break
    else:
        pytest.fail("the second block's bytes are not in any data file")
    target = row_blocks(torch.full((8, 6), 5.0), [0, 4])
    with pytest.raises(qdcp.ChecksumError, match="'w'"):
        qdcp.load({"w": target, "b": torch.zeros(3)}, path)
    assert torch.equal(_whole(target), torch.full((8, 6), 5.0))  # all or nothing: untouched


def test_staged_chunks_are_copies_reused_across_saves(tmp_path):
    """An async save stages copies of the chunks (later updates do not reach the checkpoint); a
    reusing stager copies into the same buffers the next time."""
    stager = QuantizedStager(reuse_buffers=True)
    w = row_blocks(FULL, [0, 4])
    staged = stager.stage({"w": w})
    first = [t.data_ptr() for _, t in staged["w"].chunks]
    for block in w.blocks.values():
        block.zero_()  # training goes on
    assert torch.equal(torch.cat([t for _, t in staged["w"].chunks]), FULL)
    del staged
    again = stager.stage({"w": w})
    assert [t.data_ptr() for _, t in again["w"].chunks] == first and not any(t.any() for _, t in again["w"].chunks)
    stager.close()
