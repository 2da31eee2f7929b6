"""``qdcp.export(..., format="compressed-tensors")`` of generated checkpoints, read by the library
itself and imported back (docs/export_compressed_tensors.md).

The page's promises, each checked on drawn checkpoints (1-4 entries of the types it maps: int8 per
row / group, symmetric or not, int4 per group 32, symmetric or not, FP8 E4M3 per row / group 64,
MXFP8, NVFP4 without a per-tensor scale, plain tensors; saved at 1-4 ranks cut by rows, every
rank's shard quantized on its own, which for these row-wise blocks is the whole tensor's
quantization), exported at a drawn shard size:

- compressed-tensors' own compressors decompress every entry to the source's ``dequantize()``
  (both rounded once to the narrower dtype), and the packed integers are the library's
  ``pack_to_int32`` of the source's codes;
- ``dcp.load`` through ``QuantizedHFReader`` with ``QuantizedLoadPlanner`` at 1-3 ranks (row
  shards): targets of the source's type and configuration get its codes, scales and zero points
  as stored (raw, never requantized); plain targets its values bitwise.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor

import dcp_in_process as job
import qdcp
from hf_helpers import ct_decompress, make, read_dir, row_chunk, save_drawn
from qdcp import QuantizedLoadPlanner
from quantized_cases import bits_diff, components_diff

warnings.filterwarnings("ignore")

# the page's mapping, row-wise blocks (a row cut keeps them whole): family -> packed bits (None: not packed)
FAMILIES = {"int8_row": 8, "int8_group32": 8, "int8_asym_row": 8, "intx_int4_group32": 4,
            "intx_int4_group32_asym": 4, "float8_row": None, "float8_group64": None, "mx_fp8": None,
            "nvfp4": None, "plain": None}


entry = st.tuples(st.sampled_from(sorted(FAMILIES)), st.sampled_from([(32, 64), (64, 128), (48, 192)]),
                  st.integers(0, 999))


@settings(max_examples=30, deadline=None, derandomize=True, database=None, phases=(Phase.generate,),
          suppress_health_check=list(HealthCheck))
@given(entries=st.lists(entry, min_size=1, max_size=4), world=st.integers(1, 4), into=st.integers(1, 3),
       shard_size=st.sampled_from(["5GB", "8KB"]))
def test_the_library_decompresses_and_qdcp_imports_every_entry(entries, world, into, shard_size):
    with tempfile.TemporaryDirectory(prefix="qdcp-ct-gen-") as tmp:
        ckpt, out = f"{tmp}/ckpt", f"{tmp}/out"
        module = "model.layers.{}.{}.weight".format  # a norm for plain entries, else a Linear
        hps, whole = save_drawn(entries, world, ckpt,
                                lambda i, family: module(i, "norm" if family == "plain" else "mlp.up"))
        qdcp.export(ckpt, out, format="compressed-tensors", max_shard_size=shard_size)

        stored, _ = read_dir(Path(out))
        quantized = any(family != "plain" for family, _ in hps.values())  # else a plain directory, no config
        dense = ct_decompress(Path(out)) if quantized else dict(stored)  # the library's own compressors
        assert set(dense) == set(whole), (sorted(dense), sorted(whole))
        for key, want in whole.items():
            family = hps[key][0]
            values = want if family == "plain" else want.dequantize()
            common = min(dense[key].dtype, values.dtype, key=lambda d: d.itemsize)
            diff = bits_diff(dense[key].to(common), values.to(common))
            assert diff is None, f"{key} ({family}, saved at {world} ranks): decompressed: {diff}"
            if FAMILIES[family] is not None:
                from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

                packed = stored[key.removesuffix("weight") + "weight_packed"]
                assert torch.equal(packed, pack_to_int32(want.qdata, FAMILIES[family])), f"{key}: packed codes"

        for rank in range(into):  # imported back at `into` ranks: each rank its rows
            with job.as_rank(rank, into):
                local, plain = {}, {}  # each rank's local targets (loaded in place)
                for key, (family, hp) in hps.items():
                    _, rows = row_chunk(into, hp.shape)
                    other = torch.randn(hp[rows].shape, generator=torch.Generator().manual_seed(7)).to(hp.dtype)
                    local[key], plain[key] = make(family, other), torch.zeros(hp[rows].shape, dtype=hp.dtype)
                for state in (local, plain):
                    placed = {k: DTensor(t, row_chunk(into, hps[k][1].shape)[0],
                                         requires_grad=False) for k, t in state.items()}
                    dcp.load(placed, storage_reader=qdcp.QuantizedHFReader(out), planner=QuantizedLoadPlanner(),
                             no_dist=True)
                for key, (family, hp) in hps.items():
                    _, rows = row_chunk(into, hp.shape)
                    want = make(family, hp[rows].contiguous())  # these rows' quantization: the whole's rows
                    diff = bits_diff(local[key], want) if family == "plain" else components_diff(local[key], want)
                    assert diff is None, f"{key} ({family}) imported at rank {rank}/{into}: {diff}"
                    values = want if family == "plain" else want.dequantize()
                    diff = bits_diff(plain[key], values)
                    assert diff is None, f"{key} ({family}) into a plain target at rank {rank}/{into}: {diff}"
