"""Plain targets loaded from stored items of another dtype (a bf16 checkpoint into fp32 targets).

The rule (DCP's, which docs/api.md keeps for plain targets): a plain target gets the stored values
converted as ``copy_`` converts them, in place or all-or-nothing, at one rank and at N, at any
layout of the save and the load. The all-or-nothing load holds the stored bytes where they are
narrower than the target's (its reads land unconverted: ``resolve_tensor`` hands qdcp's reader a
buffer of the stored dtype, and the one conversion is the copy into the target), and a failed load
leaves every target as it was.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Replicate, Shard

import dcp_in_process as job
import qdcp
from qdcp import ChecksumError, QuantizedLoadPlanner, QuantizedSavePlanner
from quantized_cases import bits_diff
from state_dicts import assert_same_state, snapshot
from stored_bytes import flip_stored_bytes, tensor_bytes

FLOATS = [torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32, torch.float64]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64]


def _values(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values of ``dtype`` (floats well inside float8's range, so every conversion is defined)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


# (stored, target): floats into any float, ints into ints and floats (a float into an int target
# is not a defined conversion for every value)
PAIRS = [(s, t) for s in FLOATS for t in FLOATS if t != torch.float8_e4m3fn] + \
        [(s, t) for s in INTS for t in INTS + FLOATS[1:]]


class Spy(QuantizedLoadPlanner):
    """The planner, recording the dtype of every buffer ``resolve_tensor`` hands out, by key."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.handed: dict[str, set] = {}

    def resolve_tensor(self, read_item):
        buf = super().resolve_tensor(read_item)
        self.handed.setdefault(read_item.dest_index.fqn, set()).add(buf.dtype)
        return buf


def _local(full: torch.Tensor, placement, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s local tensor of ``full`` under ``placement`` on a 1-D mesh of ``world`` (torch.chunk's cut)."""
    if isinstance(placement, Replicate):
        return full.clone()
    pieces = full.chunk(world, placement.dim)
    if rank < len(pieces):
        return pieces[rank].clone()
    shape = list(full.shape)
    shape[placement.dim] = 0
    return full.new_empty(shape)


def _dtensor(full: torch.Tensor, placement, rank: int, world: int) -> DTensor:
    local = _local(full, placement, rank, world)
    return DTensor.from_local(local, job.mesh((world,)), [placement], run_check=False,
                              shape=full.shape, stride=full.stride())


placements = st.sampled_from(["shard0", "shard1", "replicate"])


def _placement(name: str):
    return {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}[name]


@settings(max_examples=60, deadline=None)
@given(pair=st.sampled_from(PAIRS), rows=st.integers(1, 9), cols=st.integers(1, 7),
       saved_world=st.integers(1, 3), saved_at=placements, world=st.integers(1, 4), at=placements,
       atomic=st.booleans(), order=st.one_of(st.none(), st.integers(0, 99)), seed=st.integers(0, 999))
def test_a_plain_target_gets_the_stored_values_as_copy_converts_them(pair, rows, cols, saved_world, saved_at,
                                                                     world, at, atomic, order, seed):
    stored, dtype = pair
    full, vec = _values((rows, cols), stored, seed), _values((cols,), stored, seed + 1)
    metadata, store = job.save(lambda r: {"w": _dtensor(full, _placement(saved_at), r, saved_world), "v": vec},
                               saved_world, QuantizedSavePlanner)
    expect, expect_vec = full.to(dtype), vec.to(dtype)
    for rank in range(world):
        with job.as_rank(rank, world):
            w = _dtensor(torch.zeros(rows, cols, dtype=dtype), _placement(at), rank, world)
            v = torch.zeros(cols, dtype=dtype)
            state = {"w": w, "v": v}
            job.load(state, rank, world, metadata, store, QuantizedLoadPlanner(atomic=atomic), order=order)
            assert state["w"] is w and state["v"] is v
            want = _local(expect, _placement(at), rank, world)
            assert bits_diff(w.to_local(), want) is None, f"rank {rank}: {bits_diff(w.to_local(), want)}"
            assert bits_diff(v, expect_vec) is None, f"rank {rank}: {bits_diff(v, expect_vec)}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of bf16, fp32 and int8 tensors (one tied pair) and the fp32/bf16 targets to load it into."""
    path = tmp_path_factory.mktemp("widen") / "ckpt"
    tied = _values((64, 48), torch.bfloat16, 3)
    source = {"a": _values((64, 48), torch.bfloat16, 1), "b": _values((300,), torch.bfloat16, 2),
              "tied.0": tied, "tied.1": tied, "full": _values((32, 16), torch.float32, 4),
              "ids": _values((40,), torch.int8, 5), "step": 7}
    qdcp.save(source, path)
    return path, source


def _targets() -> dict:
    tied = torch.full((64, 48), -1.0)
    return {"a": torch.full((64, 48), -1.0), "b": torch.full((300,), -1.0, dtype=torch.float64),
            "tied.0": tied, "tied.1": tied, "full": torch.full((32, 16), -1.0, dtype=torch.bfloat16),
            "ids": torch.full((40,), -1.0), "step": 0}


def _expected(source: dict, targets: dict) -> dict:
    return {k: v.to(targets[k].dtype) if isinstance(v, torch.Tensor) else v for k, v in source.items()}


@pytest.mark.parametrize("atomic", [True, False])
def test_qdcp_reader_reads_a_narrower_stored_item_unconverted_into_the_atomic_loads_buffer(saved, atomic):
    path, source = saved
    targets = _targets()
    objects = {k: id(v) for k, v in targets.items()}
    planner = Spy(atomic=atomic)
    dcp.load(targets, storage_reader=qdcp.storage_reader(path), planner=planner)
    assert_same_state(targets, _expected(source, targets))
    assert targets["tied.0"] is targets["tied.1"]
    assert {k: id(v) for k, v in targets.items() if k != "step"} == {k: i for k, i in objects.items() if k != "step"}
    if atomic:  # the stored bytes held (bf16 into fp32/fp64, int8 into fp32); a narrower target's own
        # dtype, and a tied target's (two keys write its buffer: not provably whole, so a copy of it)
        assert planner.handed == {"a": {torch.bfloat16}, "b": {torch.bfloat16}, "tied.0": {torch.float32},
                                  "tied.1": {torch.float32}, "full": {torch.bfloat16}, "ids": {torch.int8}}
    else:  # in place: DCP's way, the target itself (qdcp's reader converts as it copies in)
        assert planner.handed == {"a": {torch.float32}, "b": {torch.float64}, "tied.0": {torch.float32},
                                  "tied.1": {torch.float32}, "full": {torch.bfloat16}, "ids": {torch.float32}}


@pytest.mark.parametrize("how", ["qdcp.load", "dcp.load"])
def test_a_widening_load_equals_the_in_place_one(saved, how):
    path, source = saved
    got = {}
    for atomic in (True, False):
        targets = _targets()
        if how == "qdcp.load":
            qdcp.load(targets, path, atomic=atomic)
        else:
            dcp.load(targets, checkpoint_id=path, planner=QuantizedLoadPlanner(atomic=atomic))
        got[atomic] = targets
    assert_same_state(got[True], got[False])
    assert_same_state(got[True], _expected(source, got[True]))


@pytest.mark.parametrize("key,named", [("a", r"'a'"), ("b", r"'b'"), ("ids", r"'ids'")])
def test_a_corrupt_item_leaves_every_widened_target_as_it_was(saved, tmp_path, key, named):
    path, source = saved
    bad = tmp_path / "bad"
    qdcp.save(source, bad)
    flip_stored_bytes(bad, tensor_bytes(source[key])[:64])
    targets = _targets()
    before = snapshot(targets)
    with pytest.raises(ChecksumError, match=named):
        qdcp.load(targets, bad)
    assert_same_state(targets, before)
