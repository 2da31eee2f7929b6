"""The spec parser and the layouts: exact mappings, and malformed input never crashes the parser."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qdcp import spec as qspec
from qdcp.errors import AlignmentError, CheckpointFormatError
from qdcp.layouts import Blocked, Flat, Replicated, blocks_as_groups, for_shard, groups_as_blocks, layout_from_json


def test_blocked_maps_rows_and_packed_columns():
    scale = Blocked((1, 32))
    assert scale.component_shape((256, 128)) == (256, 4)
    assert scale.map_chunk((256, 128), ((64, 0), (64, 128))) == ((64, 0), (64, 4))
    packed = Blocked((1, 2))
    assert packed.map_chunk((10, 8), ((3, 0), (7, 8))) == ((3, 0), (7, 4))
    with pytest.raises(AlignmentError):
        Blocked((32, 1)).map_chunk((100, 4), ((16, 0), (32, 4)))
    # a partial last block is aligned when it ends the tensor
    assert Blocked((32, 1)).map_chunk((100, 4), ((96, 0), (4, 4))) == ((3, 0), (1, 4))
    assert Blocked((32, 1)).expand((100, 4), ((40, 1), (10, 2))) == ((32, 1), (32, 2))


def test_a_zero_block_is_constant_along_its_dim():
    """Blocked((1, 0, 0)): one item per expert of a stacked [n, M, N] group, shared by its rows."""
    per_member = Blocked((1, 0, 0))
    assert per_member.component_shape((8, 128, 256)) == (8, 1, 1)
    assert per_member.map_chunk((8, 128, 256), ((4, 0, 0), (4, 128, 256))) == ((4, 0, 0), (4, 1, 1))
    assert per_member.map_chunk((8, 128, 256), ((5, 32, 0), (1, 32, 256))) == ((5, 0, 0), (1, 1, 1))
    assert per_member.expand((8, 128, 256), ((5, 32, 0), (1, 32, 256))) == ((5, 32, 0), (1, 32, 256))
    assert not per_member.shared((8, 128, 256), ((4, 0, 0), (4, 128, 256)))  # whole experts: own items
    assert per_member.shared((8, 128, 256), ((5, 32, 0), (1, 32, 256)))  # rows of one: a copy
    assert per_member.map_chunk((8, 128, 256), ((0, 0, 0), (0, 128, 256)))[1] == (0, 1, 1)
    assert layout_from_json({"kind": "blocked", "block": [1, 0, 0]}, (8, 1, 1)) == per_member
    with pytest.raises(CheckpointFormatError):
        layout_from_json({"kind": "blocked", "block": [1, -1, 0]}, (8, 1, 1))
    # other layouts: only replicated items are shared
    assert Replicated((1,)).shared((8, 8), ((0, 0), (4, 8)))
    assert not Blocked((1, 32)).shared((8, 64), ((0, 0), (4, 64)))
    assert not Flat(4).shared((8, 8), ((0, 0), (4, 8)))


def test_flat_maps_row_shards_only():
    f = Flat(64)
    assert f.component_shape((512, 256)) == (2048,)
    assert f.map_chunk((512, 256), ((64, 0), (64, 256))) == ((256,), (256,))
    with pytest.raises(AlignmentError, match="contiguous"):
        f.map_chunk((512, 256), ((0, 0), (512, 128)))
    with pytest.raises(AlignmentError):
        Flat(16384).map_chunk((512, 256), ((10, 0), (100, 256)))
    assert Flat(16384).expand((512, 256), ((10, 0), (100, 256))) == ((0, 0), (128, 256))
    assert Flat(2).map_chunk((7,), ((0,), (7,))) == ((0,), (4,))


def test_flat_groups_of_a_column_cut_form_a_grid():
    """A shard grouping its own elements (torchao's optimizer state, made per local tensor) forms
    a grid of blocks in the logical tensor: whole groups along its rows, or whole rows per group."""
    f = Flat(256)
    assert f.on_shard((64, 128)) == Blocked((2, 128))    # a group: 2 of the shard's rows
    assert f.on_shard((32, 512)) == Blocked((1, 256))    # a row: 2 groups
    assert f.on_shard((4, 64, 128)) == Blocked((1, 2, 128))
    assert f.on_shard((64, 96)) is None                  # a group ends part-way through a row
    assert f.on_shard((3, 128)) is None                  # rows do not divide into whole groups
    assert f.on_shard((4096,)) is None
    assert Flat(2).on_shard((64, 128)) == Blocked((1, 2))  # 4-bit codes: a byte holds 2 of a row
    # a row range keeps the flat layout; a column cut gets its grid; no grid: the layout (which refuses)
    assert for_shard(f, (128, 256), ((64, 0), (64, 256)), (64, 256)) == f
    assert for_shard(f, (128, 256), ((64, 128), (64, 128)), (64, 128)) == Blocked((2, 128))
    assert for_shard(f, (128, 192), ((0, 96), (64, 96)), (64, 96)) == f
    assert Blocked((2, 128)).map_chunk((128, 256), ((64, 128), (64, 128))) == ((32, 1), (32, 1))


@pytest.mark.parametrize("shape,block", [((64, 128), (2, 128)), ((8, 512), (1, 256)), ((2, 4, 6), (1, 2, 3))])
def test_blocks_as_groups_puts_each_block_in_a_row(shape, block):
    t = torch.arange(torch.Size(shape).numel()).reshape(shape)
    groups = blocks_as_groups(t, block)
    size = block[-2] * block[-1]
    rows, cols = t.reshape(-1, shape[-1]).shape
    first = t.reshape(rows, cols)[:block[-2], :block[-1]].reshape(-1)  # the grid's first block
    assert torch.equal(groups[:size], first)
    assert torch.equal(groups_as_blocks(groups, block, shape), t)
    with pytest.raises(CheckpointFormatError):
        blocks_as_groups(t, (5,) * len(shape))


def test_replicated_is_whole_for_any_chunk():
    r = Replicated((16,))
    assert r.map_chunk((512, 256), ((100, 0), (3, 256))) == ((0,), (16,))
    assert layout_from_json(r.to_json(), (16,)) == r


@given(rows=st.integers(1, 300), block=st.integers(1, 64), o=st.integers(0, 299), s=st.integers(1, 300))
def test_expand_always_gives_an_aligned_cover(rows, block, o, s):
    o, s = o % rows, max(1, min(s, rows - o % rows))
    for layout in (Blocked((block, 1)), Flat(block)):
        lo, sz = layout.expand((rows, 3), ((o, 0), (s, 3)))
        assert lo[0] <= o and lo[0] + sz[0] >= o + s
        layout.map_chunk((rows, 3), (lo, sz))  # aligned: does not raise


def test_value_codec_roundtrip():
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    classes = {"PerRow": PerRow, "KernelPreference": KernelPreference}
    for v in [None, 3, 1.5, "x", [1, 2], (1, (2, 3)), torch.float8_e4m3fn, {"a": [1]},
              PerRow(-1), KernelPreference.AUTO, float("inf")]:
        enc = qspec.encode_value(v)
        json.dumps(enc, allow_nan=False)
        assert qspec.decode_value(enc, classes) == v
    with pytest.raises(TypeError):
        qspec.encode_value(object())
    with pytest.raises(CheckpointFormatError, match="not allowed"):
        qspec.decode_value({"object": "PerRow", "fields": {}}, {})


def _doc(entries):
    return json.dumps({"format": "qdcp", "version": 1, "entries": entries})


def test_spec_roundtrip():
    e = qspec.EntrySpec("w", "raw", "torchao.Int8Tensor", (4, 8), torch.bfloat16, {"b": 1},
                        (qspec.ComponentSpec("qdata", (4, 8), torch.int8, {"kind": "blocked", "block": [1, 1]}),))
    assert qspec.loads(qspec.dumps({"w": e})) == {"w": e}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(entry=st.dictionaries(
    st.sampled_from(["storage", "type", "shape", "dtype", "attrs", "components", "stored_dtype"]),
    json_values, max_size=7))
def test_spec_parser_fuzz_only_raises_format_errors(entry):
    try:
        qspec.loads(_doc({"w": entry}))
    except CheckpointFormatError:
        pass


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200) | st.binary(max_size=100).map(lambda b: b.decode("latin-1")))
def test_spec_parser_fuzz_garbage(text):
    try:
        qspec.loads(text)
    except CheckpointFormatError:
        pass


def test_spec_rejects_huge_and_deep_input():
    with pytest.raises(CheckpointFormatError, match="bad size"):
        qspec.loads(_doc({"w": {"storage": "dequantized", "type": "t", "shape": [2**60], "dtype": "int8"}}))
    with pytest.raises(CheckpointFormatError):
        qspec.loads("[" * 100000 + "]" * 100000)


def _tiling(size, chunks):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
    item = TensorStorageMetadata(TensorProperties(), torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in chunks])
    return qspec.chunk_problems({"w": item})


def test_chunk_problems_one_checker_for_every_defect():
    assert _tiling((8, 4), [((0, 0), (4, 4)), ((4, 0), (4, 4))]) == []
    assert _tiling((8, 4), [((0, 0), (4, 4))]) == [("w", "chunks cover 16 of its 32 elements (holes or overlaps)")]
    # an overlap that hides a hole: the element count is right, the tiling is not
    assert _tiling((8, 4), [((0, 0), (5, 4)), ((4, 0), (3, 4))]) == [("w", "chunks at (0, 0) and (4, 0) overlap")]
    assert _tiling((8, 4), [((6, 0), (4, 4))])[0][1].startswith("a chunk at (6, 0) of size (4, 4) does not fit")
    assert _tiling((8, 4), [((0,), (8,))])[0][1].startswith("a chunk at (0,) of size (8,) does not fit")
    assert _tiling((), [((), ())]) == []
