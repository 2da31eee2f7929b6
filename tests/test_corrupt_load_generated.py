"""A load that meets a corrupt stored item says what it changed (generated cases).

The rule (docs/api.md, the safe path table; docs/troubleshooting.md, the `ChecksumError` rows): a
flipped byte in a data file raises a `ChecksumError` naming the entry's key; an all-or-nothing load
(`qdcp.load`'s default, `QuantizedLoadPlanner(atomic=True)`) leaves every target as it was and says
that no target was changed; an in-place load lists the entries it had already filled, the corrupt
one marked where its target took the bad bytes. The oracle is each target's bits before and after
the failed load, never qdcp's own account: every target that changed must be listed (a user
reloads what the message names), and the corrupt entry's target, if it changed, marked.

Cases: a state dict of plain tensors (bf16, fp32), torchao tensors and objects, saved with
`qdcp.save` or `dcp.save` + `QuantizedSavePlanner`; targets of the same type, another quantized
type, a plain tensor (bf16 or fp32: dequantized), fresh values; one byte of one stored item's data
flipped; loaded through each door: `dcp.load` with only qdcp's planner (DCP's reader), `dcp.load`
with `qdcp.CheckpointReader`, `qdcp.load`, each in place and all-or-nothing.
"""

from __future__ import annotations

import re
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import qdcp
from qdcp import ChecksumError, QuantizedLoadPlanner, QuantizedSavePlanner
from quantized_cases import CASE_BY_NAME, bits_diff, buffers_diff, raise_inner
from state_dicts import leaves, snapshot
from stored_bytes import flip_item_byte

QUANTIZED = ["int8_row", "int8_group32", "float8_row", "nf4", "mx_fp8", "intx_int4_group32"]
OTHER = {"int8_row": "float8_row", "int8_group32": "int8_row", "float8_row": "int8_row", "nf4": "int8_group32",
         "mx_fp8": "int8_row", "intx_int4_group32": "int8_group32"}
# large enough that some items are hashed on a background thread (1 MiB and up)
SHAPES = [(128, 256), (256, 512), (1024, 512)]

entry = st.one_of(
    st.tuples(st.just("quantized"), st.sampled_from(QUANTIZED), st.sampled_from(SHAPES),
              st.sampled_from(["same", "other", "plain", "plain_fp32"])),
    st.tuples(st.just("plain"), st.sampled_from([torch.bfloat16, torch.float32]), st.sampled_from(SHAPES),
              st.sampled_from(["same", "fp32"])),
    st.tuples(st.just("object"), st.none(), st.none(), st.none()),
)


def _value(kind, what, shape, seed):
    if kind == "quantized":
        return CASE_BY_NAME[what].make(seed, shape)
    if kind == "plain":
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(what)
    return {"lr": 0.5 + seed, "step": seed}


def _target(kind, what, shape, target, seed):
    if kind == "quantized":
        case = CASE_BY_NAME[what]
        if target == "same":
            return case.make(seed, shape)
        if target == "other":
            return CASE_BY_NAME[OTHER[what]].make(seed, shape)
        return case.hp(seed, shape).to(torch.float32 if target == "plain_fp32" else case.dtype)
    if kind == "plain":
        return _value(kind, torch.float32 if target == "fp32" else what, shape, seed)
    return _value(kind, what, shape, seed)


def _load(door: str, atomic: bool, path: str, targets: dict) -> None:
    if door == "dcp":
        dcp.load(targets, checkpoint_id=path, planner=QuantizedLoadPlanner(atomic=atomic))
    elif door == "dcp+reader":
        dcp.load(targets, storage_reader=qdcp.CheckpointReader(path), planner=QuantizedLoadPlanner(atomic=atomic))
    else:
        qdcp.load(targets, path, atomic=atomic)


def _changed(before: dict, after: dict) -> set[str]:
    """The (flattened) keys whose target is not bitwise what it was."""
    was, now = dict(leaves(before)), dict(leaves(after))
    out = set()
    for key, old in was.items():
        new = now[key]
        if isinstance(old, torch.Tensor):
            diff = buffers_diff(old, new) if type(old) is not torch.Tensor else bits_diff(old, new)
            if diff is not None:
                out.add(key)
        elif old != new:
            out.add(key)
    return out


@settings(max_examples=40, deadline=None, derandomize=True, database=None, phases=(Phase.generate,),
          suppress_health_check=list(HealthCheck))
@given(entries=st.lists(entry, min_size=1, max_size=5), pick=st.integers(0, 10_000),
       save_with=st.sampled_from(["qdcp.save", "dcp.save"]), door=st.sampled_from(["dcp", "dcp+reader", "qdcp"]),
       atomic=st.booleans())
def test_a_failed_load_says_what_it_changed(entries, pick, save_with, door, atomic):
    source = {f"e{i}": _value(kind, what, shape, i) for i, (kind, what, shape, _) in enumerate(entries)}
    targets = {f"e{i}": _target(kind, what, shape, target, 100 + i)
               for i, (kind, what, shape, target) in enumerate(entries)}
    with tempfile.TemporaryDirectory() as root:
        path = f"{root}/ckpt"
        if save_with == "qdcp.save":
            qdcp.save(source, path)
        else:
            dcp.save(source, checkpoint_id=path, planner=QuantizedSavePlanner())
        corrupt = flip_item_byte(path, pick)
        if corrupt is None:  # only objects: no tensor bytes to flip
            return
        key = corrupt.split(".__qdcp__.")[0]
        before = snapshot(targets)
        try:
            raise_inner(lambda: _load(door, atomic, path, targets))
        except ChecksumError as e:
            message = str(e)
        else:
            raise AssertionError(f"the load of a checkpoint with a flipped byte in {corrupt!r} passed")
    assert message.startswith(f"key {key!r}"), message
    changed = _changed(before, targets)
    if atomic:
        assert not changed, f"an all-or-nothing load changed {sorted(changed)}"
        assert "no target was changed" in message, message
        return
    listed = set(re.findall(r"'([^']+)'", message.split("already filled from this checkpoint: ")[1]))
    assert changed <= listed, f"changed {sorted(changed - listed)} but listed only {sorted(listed)}: {message}"
    if key in changed:
        assert "(this one with the corrupt bytes)" in message, message
