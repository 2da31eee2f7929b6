"""Each Hugging Face layout presents the directory it writes: ``layout.entries(directory)`` names
every quantized entry an export wrote, with the file tensors that hold it (all of them, each once),
and ``qdcp.QuantizedHFReader`` is that plus plain tensors (no per-format code of its own)."""

from __future__ import annotations

import warnings

import pytest
import torch

import qdcp
from qdcp.hf import ct_layout
from qdcp.hf.directory import HFDirectory
from qdcp.hf.layout import layout_named, layout_of
from qdcp.reading import CheckpointEntries
from quantized_cases import CASE_BY_NAME, bits, qdcp_save

warnings.filterwarnings("ignore")

#: quantized entries of each layout's export (every module a different scheme)
STATES = {
    "torchao": {"a.weight": "int8_group32", "b.weight": "nvfp4_per_tensor_swizzled", "c.weight": "mx_fp8",
                "d.weight": "intx_int4_group32_asym"},
    "compressed-tensors": {"a.weight": "int8_row", "b.weight": "float8_group64", "c.weight": "mx_fp8",
                           "d.weight": "intx_int4_group32_asym", "e.weight": "nvfp4"},
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(fmt)``: ``(state, root)`` of a checkpoint ``root/ckpt`` exported to ``root/out``
    in layout ``fmt`` (made once)."""
    made = {}

    def make(fmt: str):
        if fmt not in made:
            root = tmp_path_factory.mktemp(fmt)
            state = {key: CASE_BY_NAME[case].make(i) for i, (key, case) in enumerate(STATES[fmt].items())}
            state["norm.weight"] = torch.randn(64)
            qdcp_save(root / "ckpt", state, no_dist=True)
            qdcp.export(root / "ckpt", root / "out", format=fmt, max_shard_size="40KB")  # several files
            made[fmt] = state, root
        return made[fmt]
    return make


@pytest.mark.parametrize("fmt", sorted(STATES))
def test_layout_of_a_directory_is_the_one_that_wrote_it(exported, fmt):
    _, root = exported(fmt)
    d = HFDirectory.scan(str(root / "out"))
    assert len(set(f for f, _, _ in d.tensors.values())) > 1  # sharded: entries are found across files
    assert layout_of(d.config).name == fmt


@pytest.mark.parametrize("fmt", sorted(STATES))
def test_each_layout_presents_every_entry_it_wrote_from_exactly_its_tensors(exported, fmt):
    state, root = exported(fmt)
    d = HFDirectory.scan(str(root / "out"))
    entries = layout_named(fmt).entries(d)
    assert sorted(e.spec.fqn for e in entries) == sorted(k for k in state if k != "norm.weight")
    consumed = [e.consumed for e in entries]
    assert set().union(*consumed) == set(d.tensors) - {"norm.weight"}  # every written tensor is read
    assert sum(map(len, consumed)) == len(set().union(*consumed))       # once
    for e in entries:
        module = e.spec.fqn[: -len(".weight")]
        assert all(name.startswith(module + ".") for name in e.consumed), (e.spec.fqn, e.consumed)
        assert e.spec.shape == tuple(state[e.spec.fqn].shape)
        assert [c.name for c in e.spec.components] == list(e.items)
        for c in e.spec.components:
            item = e.items[c.name]
            assert (item.shape, item.dtype) == (tuple(c.shape), c.dtype)
            assert (item.tensor is None) != (item.build is None)
            if item.tensor is not None:  # read as it is: the file tensor's own shape and dtype
                assert item.tensor in e.consumed and d.tensors[item.tensor][1:] == (item.shape, item.dtype)


def test_torchao_layout_presents_the_source_entry_itself(exported):
    """torchao's layout holds the torchao type: the presented spec is the checkpoint's own (type,
    logical shape and dtype, components), and each component read as it is equals the stored bits."""
    _, root = exported("torchao")
    d = HFDirectory.scan(str(root / "out"))
    source = CheckpointEntries(root / "ckpt")
    for e in layout_named("torchao").entries(d):
        want = source.specs[e.spec.fqn]
        assert (e.spec.type, e.spec.shape, e.spec.dtype) == (want.type, want.shape, want.dtype)
        assert [(c.name, c.shape, c.dtype) for c in e.spec.components] == \
            [(c.name, c.shape, c.dtype) for c in want.components]
        stored = source.stored(e.spec.fqn).components
        for name, item in e.items.items():
            value = d.tensor(item.tensor) if item.tensor is not None else item.build(d.tensor, None)
            assert torch.equal(bits(value), bits(stored[name])), (e.spec.fqn, name)


def test_compressed_tensors_layout_presents_the_block_each_scale_covers(exported):
    """compressed-tensors' entries are its parameter sets: the block a scale covers comes back
    from the strategy the writer stated (the source's block), the integers unpacked to the source's."""
    state, root = exported("compressed-tensors")
    d = HFDirectory.scan(str(root / "out"))
    presented = {e.spec.fqn: e for e in layout_named("compressed-tensors").entries(d)}
    assert {k: e.spec.type for k, e in presented.items()} == {
        "a.weight": "compressed_tensors.int", "b.weight": "compressed_tensors.float",
        "c.weight": "compressed_tensors.mxfp8", "d.weight": "compressed_tensors.int",
        "e.weight": "compressed_tensors.nvfp4"}
    assert presented["a.weight"].spec.attrs == {"block": [1, 128], "bits": 8}
    assert presented["b.weight"].spec.attrs == {"block": [1, 64]}
    assert presented["d.weight"].spec.attrs == {"block": [1, 32], "bits": 4, "symmetric": False}
    for key in ("a.weight", "d.weight"):  # pack-quantized: the codes computed from the packed words
        item = presented[key].items["weight"]
        assert item.tensor is None and torch.equal(item.build(d.tensor, None), state[key].qdata)
    zero = presented["d.weight"].items["weight_zero_point"].build(d.tensor, None)
    assert torch.equal(zero, state["d.weight"].zero_point.to(torch.int8))


@pytest.mark.parametrize("block", [(128, 256), (1, 256), (1, 32), (128, 128), (32, 64)])
def test_strategy_and_block_are_inverses(block):
    """The writer's strategy of a block and the reader's block of a strategy, in one file."""
    shape = (128, 256)
    weights = ct_layout.strategy_of(block, shape)
    scale_shape = (1,) if block == shape else (shape[0] // block[0], shape[1] // block[1])
    assert ct_layout.block_of(weights, shape, scale_shape) == block
    assert weights["strategy"] == {(128, 256): "tensor", (1, 256): "channel", (1, 32): "group"}.get(block, "block")


def test_layout_of_a_config():
    ct = {"quant_method": "compressed-tensors"}
    assert layout_of({"quantization_config": ct}).name == "compressed-tensors"
    assert layout_of({"compression_config": ct}).name == "compressed-tensors"
    assert layout_of({"quantization_config": {"quant_method": "torchao"}}).name == "torchao"
    assert layout_of({}).name == "torchao"  # plain directories: no entry described, all tensors plain
    with pytest.raises(ValueError, match="unknown export format 'gguf'"):
        layout_named("gguf")
