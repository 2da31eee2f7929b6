"""Checkpoints written under one supported torch load under every other.

``tests/data/torch-<version>/`` holds, for each torch the fixture was written with
(scripts/make_version_fixture.py), a raw and a dequantized checkpoint and the inner buffers and
dequantized values that torch computed. Whatever torch runs this test loads every version's
fixture: raw entries into same-type targets (bit-identical buffers) and into plain targets (the
recorded dequantize), the dequantized checkpoint into plain targets; plain tensors and objects as
saved. Run under each version with ``tox -e torch211,...,torch215``. Through qdcp's
``CheckpointReader``: torch 2.15 pickles a field into ``.metadata`` that DCP's own reader before
2.15 cannot unpack; qdcp's reader reads every supported version's.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from qdcp import CheckpointReader, QuantizedLoadPlanner, find_adapter
from quantized_cases import bits_diff
from version_fixture import DATA, quantized_state

FIXTURES = sorted(glob.glob(os.path.join(DATA, "torch-*")))
IDS = [os.path.basename(p) for p in FIXTURES]


def _expected(path) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(path, "expected.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bits_diff(a, b) is None


def test_fixtures_of_the_oldest_pinned_and_newest_torch_are_present():
    assert {"torch-2.11", "torch-2.13", "torch-2.15"} <= set(IDS)


@pytest.mark.parametrize("path", FIXTURES, ids=IDS)
def test_raw_checkpoint_loads_bit_exact(path):
    want = _expected(path)
    target = quantized_state(5)
    dcp.load(target, storage_reader=CheckpointReader(os.path.join(path, "raw")), planner=QuantizedLoadPlanner())
    for key, value in target.items():
        if isinstance(value, torch.Tensor) and find_adapter(value) is not None:
            for name, buf in find_adapter(value).inner_buffers(value).items():
                assert _same(buf.contiguous(), want[f"{key}.{name}"]), (key, name)
        elif isinstance(value, torch.Tensor):
            assert _same(value, want[key]), key
    assert target["step"] == 7
    plain = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in want.items() if "." not in k}
    dcp.load(plain, storage_reader=CheckpointReader(os.path.join(path, "raw")), planner=QuantizedLoadPlanner())
    for key, value in plain.items():
        assert _same(value, want[key]), key


@pytest.mark.parametrize("path", FIXTURES, ids=IDS)
def test_dequantized_checkpoint_loads_bit_exact(path):
    want = _expected(path)
    plain = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in want.items() if "." not in k}
    dcp.load(plain, storage_reader=CheckpointReader(os.path.join(path, "dequantized")),
             planner=QuantizedLoadPlanner())
    for key, value in plain.items():
        assert _same(value, want[key]), key
