"""``qdcp.export(..., format="torchao")`` of generated checkpoints, read back by torchao's own loader.

docs/export_torchao.md: the directory is what torchao's ``unflatten_tensor_state_dict`` rebuilds
into the same class with bit-identical inner tensors, whatever world size the checkpoint was saved
at, an entry's tensors always in one file. The oracle: each checkpoint holds 1-4 entries of the
types that page maps (torchao's affine types, MX, NVFP4, plain tensors) under module-prefixed keys,
saved at 1-4 ranks cut by rows (every rank's shard quantized on its own: per-row and per-block
scales make that the whole tensor's quantization), exported at a drawn shard size; torchao's loader,
file by file, gives every entry back as the whole tensor quantized at once, inner tensors bitwise.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

import qdcp
from hf_helpers import save_drawn
from quantized_cases import bits_diff

warnings.filterwarnings("ignore")

from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict  # noqa: E402

# torchao types export_torchao.md maps whose blocks run along rows (a row cut keeps them whole)
FAMILIES = ("int8_row", "int8_group32", "int8_asym_row", "float8_row", "intx_int4_group32",
            "intx_int4_group32_asym", "mx_fp8", "mx_fp4", "mx_fp8_e5m2_swizzled", "nvfp4", "nvfp4_swizzled", "plain")


def torchao_load(out: str) -> dict:
    """What torchao's own loader rebuilds from each file of the directory ``out``."""
    result = {}
    for name in sorted(f for f in os.listdir(out) if f.endswith(".safetensors")):
        with safe_open(os.path.join(out, name), "pt") as f:
            metadata = f.metadata()
        got, leftover = unflatten_tensor_state_dict(load_file(os.path.join(out, name)), metadata)
        assert not leftover, f"{name}: tensors torchao's loader could not place: {sorted(leftover)}"
        assert not set(got) & set(result), f"{name}: an entry in two files"
        result.update(got)
    return result


def same_inner(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if type(got) is not type(want):
        return f"{type(got).__name__}, not {type(want).__name__}"
    if type(want) is torch.Tensor:
        return bits_diff(got, want)
    names, _ = want.__tensor_flatten__()
    for n in names:
        diff = bits_diff(getattr(got, n), getattr(want, n))
        if diff is not None:
            return f"{n}: {diff}"
    return None


entry = st.tuples(st.sampled_from(FAMILIES), st.sampled_from([(32, 64), (64, 128), (96, 64)]), st.integers(0, 999))


@settings(max_examples=60, deadline=None, derandomize=True, database=None, phases=(Phase.generate,),
          suppress_health_check=list(HealthCheck))
@given(entries=st.lists(entry, min_size=1, max_size=4), world=st.integers(1, 4),
       shard_size=st.sampled_from(["5GB", "8KB"]))
def test_torchao_loader_rebuilds_every_entry_bit_for_bit(entries, world, shard_size):
    with tempfile.TemporaryDirectory(prefix="qdcp-export-gen-") as tmp:
        ckpt, out = f"{tmp}/ckpt", f"{tmp}/out"
        hps, whole = save_drawn(entries, world, ckpt,
                                lambda i, family: f"layers.{i}.{'norm' if family == 'plain' else 'weight'}")
        qdcp.export(ckpt, out, format="torchao", max_shard_size=shard_size)
        got = torchao_load(out)
        assert set(got) == set(whole), (sorted(got), sorted(whole))
        for key, want in whole.items():
            diff = same_inner(got[key], want)
            assert diff is None, f"{key} ({hps[key][0]}, saved at {world} ranks): {diff}"
