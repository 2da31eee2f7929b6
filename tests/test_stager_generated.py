"""A ``QuantizedStager`` kept for a whole run, on generated runs of async saves.

docs/api.md: the stager's buffers are kept and reused from save to save (reallocated only where a
shape, stride or dtype changes), and ``qdcp.async_save`` saves the state as it was when it was
called: training may change it in place once staging is done. The oracle is written from that:
every checkpoint of a run holds exactly what a synchronous ``qdcp.save`` of the state, taken just
before the async save was called, holds (the same spec, every raw component and plain tensor
bitwise, the same objects), whatever happened to the state between saves (values changed in place,
entries replaced by another type, configuration or shape, entries removed or added) and although
every inner buffer of the state is overwritten before the upload is awaited.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import qdcp
from quantized_cases import CASE_BY_NAME, data_tensors

FAMILIES = ("int8_row", "int8_group32", "int8_asym_row", "float8_row", "intx_int4_group32", "mx_fp8", "mx_fp4",
            "nvfp4", "nvfp4_per_tensor", "nf4", "optim8bit_signed", "optim4bit", "plain")
SHAPES = ((64, 256), (128, 128), (128, 256))
KEYS = ("a", "b", "c")


def make(family: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    if family == "plain":
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return CASE_BY_NAME[family].make(seed, shape)


def scribble(state: dict) -> None:
    """Overwrite every byte the state's tensors hold, in place (training's next step)."""
    for v in state.values():
        if isinstance(v, torch.Tensor):
            for b in data_tensors(v):
                if b.numel():
                    flipped = b.detach().clone(memory_format=torch.contiguous_format)
                    flipped.view(-1).view(torch.uint8).bitwise_not_()
                    b.copy_(flipped)


def checkpoint_contents(path: Path) -> dict:
    """Everything a checkpoint holds, as plain data: its entries' specs and each key's stored
    components (raw entries) or value (plain tensors, objects), read without a target."""
    described = qdcp.describe(path)
    out = {"specs": described}
    for key, entry in described.items():
        if isinstance(entry, dict) and entry.get("stored_as") == "raw":
            stored = qdcp.read_stored(path, key)
            out[key] = {n: c.view(-1).view(torch.uint8) for n, c in stored.components.items()}
        else:
            value = qdcp.read_entry(path, key)
            out[key] = value.view(-1).view(torch.uint8) if isinstance(value, torch.Tensor) else value
    return out


def same_contents(a: dict, b: dict) -> bool:
    if a.keys() != b.keys() or a["specs"] != b["specs"]:
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict) and key != "specs":
            if x.keys() != y.keys() or not all(torch.equal(x[n], y[n]) for n in x):
                return False
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


entry = st.tuples(st.sampled_from(FAMILIES), st.sampled_from(SHAPES), st.integers(0, 1000))
# a step: for each key, keep it (its values changed in place), replace it, drop it, or add it
step = st.dictionaries(st.sampled_from(KEYS), st.one_of(st.just("keep"), st.just("drop"), entry), min_size=1)


@settings(max_examples=25, deadline=None, derandomize=True, database=None, phases=(Phase.generate,),
          suppress_health_check=list(HealthCheck))
@given(first=st.dictionaries(st.sampled_from(KEYS), entry, min_size=1), steps=st.lists(step, min_size=1, max_size=3),
       async_staging=st.booleans())
def test_every_checkpoint_of_a_run_is_the_state_at_its_call(first, steps, async_staging):
    stager = qdcp.QuantizedStager(async_staging=async_staging)
    state: dict = {k: make(*spec) for k, spec in first.items()}
    state["step"] = 0
    try:
        with tempfile.TemporaryDirectory(prefix="qdcp-stager-") as tmp:
            for i, changes in enumerate([{}, *steps]):
                for key, change in changes.items():
                    if change == "drop":
                        state.pop(key, None)
                    elif change != "keep":
                        state[key] = make(*change)
                state["step"] = i
                reference, saved = Path(tmp) / f"ref{i}", Path(tmp) / f"ckpt{i}"
                qdcp.save(state, reference)
                response = qdcp.async_save(state, saved, stager=stager)
                if async_staging:  # dcp.async_save's AsyncSaveResponse: staging goes on beside training
                    response.staging_completion.result()
                scribble(state)  # the upload may still be running: it writes what was staged
                getattr(response, "upload_completion", response).result()
                assert same_contents(checkpoint_contents(saved), checkpoint_contents(reference)), \
                    f"save {i} ({sorted(k for k in state if k != 'step')}) is not the state at its call"
    finally:
        stager.close()
