"""qdcp.export / ``qdcp export``: Hugging Face directories in torchao's and compressed-tensors'
layouts, checked with the consumers' own loaders (torchao's ``unflatten_tensor_state_dict``,
compressed-tensors' compressors, transformers' config classes)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file

import qdcp
from hf_helpers import TORCHAO_CASES, ct_decompress, read_dir, tiny_llama_config
from qdcp.adapters.base import find_adapter
from qdcp.errors import QdcpError
from qdcp.hf.ct_layout import pack_int32, packed_rows, unpack_int32
from qdcp.hf.safetensors_files import RowBlocks, ShardWriter, TensorOut
from quantized_cases import CASE_BY_NAME, bits_diff, components_diff, qdcp_save

warnings.filterwarnings("ignore")

from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict  # noqa: E402


def _torchao_load(out) -> dict:
    """The state dict torchao's own loader rebuilds from each file of ``out``."""
    result = {}
    for f in sorted(x for x in os.listdir(out) if x.endswith(".safetensors")):
        with safe_open(os.path.join(out, f), "pt") as so:
            md = so.metadata()
        got, leftover = unflatten_tensor_state_dict(load_file(os.path.join(out, f)), md)
        assert not leftover, leftover
        result.update(got)
    return result


def _assert_same_torchao(got, want, key):
    assert type(got) is type(want), (key, type(got))
    names = list(want.tensor_data_names) + list(getattr(want, "optional_tensor_data_names", None) or [])
    for n in names:
        a, b = getattr(want, n), getattr(got, n)
        assert (a is None) == (b is None), (key, n)
        if a is not None:
            assert bits_diff(a, b) is None, (key, n, bits_diff(a, b))
    assert bits_diff(got.dequantize(), want.dequantize()) is None, key


def _assert_loaded_as(got: dict, state: dict) -> None:
    """What transformers loaded is ``state``: the same keys, plain tensors bitwise, torchao tensors
    bit-exact in every buffer."""
    assert set(got) == set(state)
    for key, want in state.items():
        if type(want) is torch.Tensor:
            assert bits_diff(got[key], want) is None, key
        else:
            _assert_same_torchao(got[key], want, key)


@pytest.fixture
def torchao_state():
    state = {f"layers.{i}.{c.name}.weight": c.make(i) for i, c in enumerate(TORCHAO_CASES)}
    state["norm.weight"] = torch.randn(256)
    state["step"] = 7
    return state


def test_torchao_layout_rebuilds_every_type_bit_exact_with_torchaos_loader(tmp_path, torchao_state):
    qdcp_save(tmp_path / "ckpt", torchao_state, no_dist=True)
    result = qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao", max_shard_size="200KB")
    assert len(result.files) > 1 and result.skipped == ("step",)
    got = _torchao_load(tmp_path / "out")
    assert set(got) == set(torchao_state) - {"step"}
    for key, want in torchao_state.items():
        if key == "norm.weight":
            assert bits_diff(got[key], want) is None
        elif key != "step":
            _assert_same_torchao(got[key], want, key)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    tensors, _ = read_dir(tmp_path / "out")
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, file in index["weight_map"].items():
        with safe_open(os.path.join(tmp_path / "out", file), "pt") as so:
            assert name in so.keys()


def test_a_top_level_plain_tensor_is_torchaos_leftover(tmp_path):
    """A plain key without a module prefix ("scale_bias"): torchao's loader splits every name its
    metadata lists at the last '.', so it is not listed; the loader hands it back among its
    leftovers, the bits as saved (listed, the loader raised ValueError: not enough values to unpack)."""
    state = {"layers.0.weight": TORCHAO_CASES[0].make(0), "scale_bias": torch.randn(8)}
    qdcp_save(tmp_path / "ckpt", state, no_dist=True)
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao")
    (name,) = [f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors")]
    with safe_open(os.path.join(tmp_path / "out", name), "pt") as so:
        md = so.metadata()
    got, leftover = unflatten_tensor_state_dict(load_file(os.path.join(tmp_path / "out", name)), md)
    assert set(got) == {"layers.0.weight"} and set(leftover) == {"scale_bias"}
    _assert_same_torchao(got["layers.0.weight"], state["layers.0.weight"], "layers.0.weight")
    assert bits_diff(leftover["scale_bias"], state["scale_bias"]) is None
    target = {"layers.0.weight": TORCHAO_CASES[0].make(5), "scale_bias": torch.zeros(8)}  # qdcp reads it back
    dcp.load(target, storage_reader=qdcp.QuantizedHFReader(tmp_path / "out"), planner=qdcp.QuantizedLoadPlanner())
    _assert_same_torchao(target["layers.0.weight"], state["layers.0.weight"], "layers.0.weight")
    assert bits_diff(target["scale_bias"], state["scale_bias"]) is None


def test_torchao_config_is_read_by_transformers(tmp_path):
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from transformers import TorchAoConfig

    one = {"a.weight": CASE_BY_NAME["int8_row"].make(0), "b.weight": CASE_BY_NAME["int8_row"].make(1)}
    qdcp_save(tmp_path / "one", one, no_dist=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128}))
    qdcp.export(tmp_path / "one", tmp_path / "out1", format="torchao", config=tmp_path / "config.json")
    cfg = json.loads((tmp_path / "out1" / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == 128
    assert isinstance(TorchAoConfig.from_dict(cfg["quantization_config"]).quant_type, Int8WeightOnlyConfig)
    assert (tmp_path / "out1" / "model.safetensors").exists()
    assert not (tmp_path / "out1" / "model.safetensors.index.json").exists()

    mixed = {**one, "c.weight": CASE_BY_NAME["intx_int4_group32"].make(2)}
    qdcp_save(tmp_path / "mixed", mixed, no_dist=True)
    qdcp.export(tmp_path / "mixed", tmp_path / "out2", format="torchao")
    qc = json.loads((tmp_path / "out2" / "config.json").read_text())["quantization_config"]
    fqn = TorchAoConfig.from_dict(qc).quant_type
    assert isinstance(fqn.fqn_to_config["a"], Int8WeightOnlyConfig)
    assert isinstance(fqn.fqn_to_config["c"], IntxWeightOnlyConfig)
    assert fqn.fqn_to_config["c"].weight_dtype == torch.int4


def test_unsupported_entry_is_refused_before_anything_is_written(tmp_path):
    state = {"m.weight": CASE_BY_NAME["nf4"].make(0), "n.weight": CASE_BY_NAME["int8_row"].make(1)}
    qdcp_save(tmp_path / "ckpt", state, no_dist=True)
    with pytest.raises(qdcp.ExportError, match=r"key 'm.weight' \(torchao.NF4Tensor\)"):
        qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no OUT_DIR, no temporary directory left

    result = qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao", dequantize_unsupported=True)
    assert result.dequantized == ("m.weight",)
    got = _torchao_load(tmp_path / "out")
    assert bits_diff(got["m.weight"], qdcp.read_entry(tmp_path / "ckpt", "m.weight", dequantize=True)) is None
    _assert_same_torchao(got["n.weight"], state["n.weight"], "n.weight")


def test_existing_output_is_kept_unless_overwrite(tmp_path):
    qdcp_save(tmp_path / "ckpt", {"m.weight": CASE_BY_NAME["int8_row"].make(0)}, no_dist=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(qdcp.ExportError, match="overwrite"):
        qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao")
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
    with pytest.raises(qdcp.ExportError, match="keep.txt"):  # overwrite replaces only an export's files
        qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao", overwrite=True)
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
    os.remove(tmp_path / "out" / "keep.txt")
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao")  # an empty directory is free
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao", overwrite=True)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]


def _te_nvfp4(seed: int):
    """A TransformerEngine NVFP4Tensor (rowwise, 128 x 256, compact scales) from random codes and
    block scales, built on CPU (tests/te_cpu.py)."""
    import te_cpu

    te = te_cpu.install()
    from transformer_engine.pytorch.constants import DType

    g = torch.Generator().manual_seed(seed)
    scale = torch.zeros(128, 16, dtype=torch.uint8)
    scale[:, :16] = torch.randint(0x08, 0x7F, (128, 16), generator=g, dtype=torch.uint8)  # positive finite e4m3
    with te_cpu.simulate_gpu(te_cpu.BLACKWELL):
        return te.NVFP4Tensor(shape=(128, 256), dtype=torch.bfloat16, fp4_dtype=DType.kFloat4E2M1, quantizer=None,
                              rowwise_data=torch.randint(0, 256, (128, 128), generator=g, dtype=torch.uint8),
                              rowwise_scale_inv=scale, amax_rowwise=torch.tensor([5.4321]), columnwise_data=None,
                              columnwise_scale_inv=None, amax_columnwise=None, with_gemm_swizzled_scales=False,
                              device="cpu")


@pytest.mark.skipif(not __import__("te_cpu").te_installed(), reason="transformer_engine is not installed")
def test_te_nvfp4_in_the_torchao_layout_takes_torchaos_values(tmp_path):
    """TE's NVFP4 exports to torchao's layout with its bits, ``per_tensor_scale = amax / (6*448)``;
    its values there are torchao's decode ``per_tensor_scale * scale``, which is not TE's
    ``scale * amax * (1 / (6*448))``: in float32 some elements differ by a unit or two in the last
    place (docs/export_torchao.md says so). A float32 import gives torchao's values; the source's
    own are what a load of the qdcp checkpoint gives."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    src = _te_nvfp4(3)
    qdcp_save(tmp_path / "ckpt", {"m.weight": src}, no_dist=True)
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao")
    exported = _torchao_load(tmp_path / "out")["m.weight"]
    assert isinstance(exported, NVFP4Tensor)
    te_values = find_adapter(src).dequantize(src, torch.float32)
    got = {"m.weight": torch.zeros(128, 256)}
    dcp.load(got, storage_reader=qdcp.QuantizedHFReader(tmp_path / "out"), planner=qdcp.QuantizedLoadPlanner(),
             no_dist=True)
    assert bits_diff(got["m.weight"], exported.dequantize(torch.float32)) is None
    ulps = (got["m.weight"].view(torch.int32) - te_values.view(torch.int32)).abs()
    assert int(ulps.max()) <= 2 and bool(ulps.bool().any())
    ckpt = {"m.weight": torch.zeros(128, 256)}
    dcp.load(ckpt, checkpoint_id=tmp_path / "ckpt", planner=qdcp.QuantizedLoadPlanner(), no_dist=True)
    assert bits_diff(ckpt["m.weight"], te_values) is None


# ----------------------------------------------------------------------------- compressed-tensors

def _float8_block128():
    from torchao.quantization import Float8Tensor
    from torchao.quantization.granularity import PerBlock
    from torchao.quantization.quantize_.common import KernelPreference

    hp = torch.randn(256, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    return Float8Tensor.from_hp(hp, granularity=PerBlock([128, 128]), kernel_preference=KernelPreference.TORCH)


def _nvfp4_f32(per_tensor: bool):
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    hp = torch.randn(128, 256, generator=torch.Generator().manual_seed(6))
    pts = per_tensor_amax_to_scale(hp.abs().amax()) if per_tensor else None
    return NVFP4Tensor.to_nvfp4(hp, per_tensor_scale=pts)


CT_CASES = {
    "nvfp4": (lambda: _nvfp4_f32(True), "nvfp4-pack-quantized"),
    "nvfp4_no_global": (lambda: _nvfp4_f32(False), "nvfp4-pack-quantized"),
    "mx_fp8": (lambda: CASE_BY_NAME["mx_fp8"].make(1), "mxfp8-quantized"),
    "float8_row": (lambda: CASE_BY_NAME["float8_row"].make(2), "naive-quantized"),
    "float8_tensor": (lambda: CASE_BY_NAME["float8_row"].from_hp(CASE_BY_NAME["float8_row"].hp(3)), "naive-quantized"),
    "float8_block128": (_float8_block128, "naive-quantized"),
    "int8_row": (lambda: CASE_BY_NAME["int8_row"].make(4), "pack-quantized"),
    "int4_group32": (lambda: CASE_BY_NAME["intx_int4_group32"].make(5), "pack-quantized"),
    "int8_row_asym": (lambda: CASE_BY_NAME["int8_asym_row"].make(6), "pack-quantized"),
    "int4_group32_asym": (lambda: CASE_BY_NAME["intx_int4_group32_asym"].make(7), "pack-quantized"),
}


@pytest.mark.parametrize("name", sorted(CT_CASES))
def test_compressed_tensors_layout_decompresses_to_the_sources_dequantize(tmp_path, name):
    make, fmt = CT_CASES[name]
    w = make()
    state = {"model.layers.0.mlp.up.weight": w, "model.norm.weight": torch.randn(7)}
    qdcp_save(tmp_path / "ckpt", state, no_dist=True)
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="compressed-tensors")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == fmt
    assert qc["config_groups"]["group_0"]["targets"] == ["model.layers.0.mlp.up"]
    _assert_the_librarys_formats(qc)
    dense = ct_decompress(tmp_path / "out")
    got, want = dense["model.layers.0.mlp.up.weight"], w.dequantize()
    # compressed-tensors computes NVFP4 / MXFP8 values as bf16, the others in the scale's dtype:
    # both sides rounded once to the narrower dtype agree bit for bit
    common = min(got.dtype, want.dtype, key=lambda d: d.itemsize)
    assert bits_diff(got.to(common), want.to(common)) is None, bits_diff(got.to(common), want.to(common))
    assert bits_diff(dense["model.norm.weight"], state["model.norm.weight"]) is None
    tensors, _ = read_dir(tmp_path / "out")
    payload = tensors.get("model.layers.0.mlp.up.weight_packed", tensors.get("model.layers.0.mlp.up.weight"))
    if fmt == "pack-quantized":  # packed by the library's own packer from the same integers
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        bits = 8 if name.startswith("int8") else 4
        assert torch.equal(payload, pack_to_int32(w.qdata, bits))
        asymmetric = name.endswith("_asym")
        assert qc["config_groups"]["group_0"]["weights"]["symmetric"] is not asymmetric
        zero = tensors.get("model.layers.0.mlp.up.weight_zero_point")
        assert (zero is not None) == asymmetric
        if asymmetric:  # the zero points, packed along N
            assert torch.equal(zero, pack_to_int32(w.zero_point, bits, packed_dim=0))
    else:
        assert bits_diff(payload.view(torch.uint8), w.qdata.view(torch.uint8)) is None


def test_compressed_tensors_nvfp4_of_bf16_weights_rounds_differently(tmp_path):
    """The documented exception: NVFP4 with a per-tensor scale from bf16 weights decompresses, in
    the library, to values one bf16 step from torchao's ``dequantize()`` in some elements (its
    ``scale / global_scale`` and torchao's ``per_tensor_scale * scale`` round differently); a
    power-of-two per-tensor scale decompresses exactly."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    case = CASE_BY_NAME["nvfp4_per_tensor"]
    state = {"a.weight": case.make(2, (256, 512)),
             "b.weight": NVFP4Tensor.to_nvfp4(case.hp(2, (256, 512)), per_tensor_scale=torch.tensor(2.0 ** -10))}
    qdcp_save(tmp_path / "ckpt", state, no_dist=True)
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="compressed-tensors")
    dense = ct_decompress(tmp_path / "out")
    steps = (dense["a.weight"].view(torch.int16).int() - state["a.weight"].dequantize().view(torch.int16).int()).abs()
    assert int(steps.max()) == 1 and bool(steps.bool().any())
    assert bits_diff(dense["b.weight"], state["b.weight"].dequantize()) is None


def test_int_packing_matches_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    for bits in (4, 8):
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        v = torch.randint(lo, hi + 1, (16, 40), dtype=torch.int8)
        assert torch.equal(pack_int32(v, bits), pack_to_int32(v, bits))
        assert torch.equal(unpack_int32(pack_int32(v, bits), bits, 40), v)
        odd = v[:, :37]  # a padded last word, an odd number of nibbles
        assert torch.equal(unpack_int32(pack_to_int32(odd, bits), bits, 37), odd)
        assert torch.equal(unpack_from_int32(pack_int32(v, bits), bits, torch.Size((16, 40))), v)
        v = torch.arange(lo, hi + 1, dtype=torch.int8).repeat(16, 3)[:, :40]  # every value, every position
        assert torch.equal(pack_int32(v, bits), pack_to_int32(v, bits))
        blocks = dataclasses.replace(packed_rows(v, bits), rows=3)  # as the writer makes it: 6 blocks
        assert torch.equal(torch.cat(list(blocks.blocks())), pack_to_int32(v, bits))


def test_writer_checks_row_blocks(tmp_path):
    v = torch.randint(-8, 8, (10, 16), dtype=torch.int8)
    good = dataclasses.replace(packed_rows(v, 4), rows=4)
    with ShardWriter(str(tmp_path / "a.safetensors"), [TensorOut("w", (10, 2), torch.int32)], {}) as w:
        w.write("w", good)
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("w"), pack_int32(v, 4))
    short = RowBlocks((10, 2), torch.int32, lambda a, b: pack_int32(v[a:b], 4)[:1], 4)
    with pytest.raises(QdcpError, match="'w': 24 bytes written, 80 planned"):
        with ShardWriter(str(tmp_path / "b.safetensors"), [TensorOut("w", (10, 2), torch.int32)], {}) as w:
            w.write("w", short)


def _assert_the_librarys_formats(qc: dict) -> None:
    """Every scheme's format is the one the library itself picks for it (``infer_module_format``)."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig

    for name, group in QuantizationConfig.model_validate(qc).config_groups.items():
        assert infer_module_format(torch.nn.Linear, group).value == group.format, (name, group.format)


def _act_cases():
    from torchao.prototype.mx_formats.mx_tensor import MXTensor, QuantizeTensorToMXKwargs
    from torchao.quantization import Float8Tensor
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import QuantizeTensorToFloat8Kwargs

    hp = torch.randn(128, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(8))
    return {  # compressed-tensors preset whose input_activations the entry's dynamic activations are
        "W8A8": CASE_BY_NAME["int8_dynamic_act"].make(0),
        "FP8_DYNAMIC": Float8Tensor.from_hp(hp, granularity=PerRow(),
                                            act_quant_kwargs=QuantizeTensorToFloat8Kwargs(granularity=PerRow())),
        "MXFP8": MXTensor.to_mx(hp, torch.float8_e4m3fn, 32, act_quant_kwargs=QuantizeTensorToMXKwargs()),
    }


def test_compressed_tensors_carries_dynamic_activation_quantization(tmp_path):
    """An entry quantizing its activations dynamically (torchao's act_quant_kwargs) exports with
    the library's own ``input_activations`` for that scheme (its presets W8A8, FP8_DYNAMIC, MXFP8),
    read back by the library; an entry without them stays weight-only."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    cases = _act_cases()
    state = {f"{preset.lower()}.weight": t for preset, t in cases.items()}
    state["plain_int8.weight"] = CASE_BY_NAME["int8_row"].make(1)
    qdcp_save(tmp_path / "ckpt", state, no_dist=True)
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="compressed-tensors")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    _assert_the_librarys_formats(qc)  # int8 with activations: int-quantized; FP8: float-quantized
    config = QuantizationConfig.model_validate(qc)
    by_target = {tuple(g.targets): g for g in config.config_groups.values()}
    for preset in cases:
        got = by_target[(f"{preset.lower()}",)].input_activations
        want = preset_name_to_scheme(preset, ["Linear"]).input_activations
        assert got is not None and got.model_dump() == want.model_dump(), preset
    assert by_target[("plain_int8",)].input_activations is None
    dense = ct_decompress(tmp_path / "out")  # the weights decompress as before
    for key, t in state.items():
        want = t.dequantize()
        assert bits_diff(dense[key].to(want.dtype), want) is None, key
    targets = {**{f"{preset.lower()}.weight": t for preset, t in _act_cases().items()},
               "plain_int8.weight": CASE_BY_NAME["int8_row"].make(9)}
    for t in targets.values():  # the same configurations, other bits
        for value in find_adapter(t).native_components(t).values():
            if value.element_size() == 1:
                value.view(torch.uint8).bitwise_xor_(1)
            else:
                value.mul_(2)
    dcp.load(targets, storage_reader=qdcp.QuantizedHFReader(tmp_path / "out"), planner=qdcp.QuantizedLoadPlanner(),
             no_dist=True)
    assert all(components_diff(targets[k], v) is None for k, v in state.items())  # back raw, bit for bit


def test_compressed_tensors_refuses_an_activation_pre_scale(tmp_path):
    """An Int8Tensor with an activation pre-scale (the layer multiplies its input by it) has no
    compressed-tensors form: refused naming the key, nothing written."""
    from torchao.quantization import Int8Tensor
    from torchao.quantization.granularity import PerRow

    hp = CASE_BY_NAME["int8_row"].hp(2)
    w = Int8Tensor.from_hp(hp, PerRow(), act_pre_scale=torch.rand(hp.shape[1], dtype=hp.dtype) + 0.5)
    qdcp_save(tmp_path / "ckpt", {"m.weight": w}, no_dist=True)
    with pytest.raises(qdcp.ExportError, match="key 'm.weight'.*pre-scale"):
        qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="compressed-tensors")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_compressed_tensors_refuses_what_it_cannot_hold(tmp_path):
    state = {"a.weight": CASE_BY_NAME["float8_tensor_e5m2"].make(0),
             "b.weight": CASE_BY_NAME["optim8bit_signed"].make(1),
             "c.weight": CASE_BY_NAME["int8_row"].make(2)}
    qdcp_save(tmp_path / "ckpt", state, no_dist=True)
    with pytest.raises(qdcp.ExportError) as e:
        qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="compressed-tensors")
    assert "key 'a.weight'" in str(e.value) and "E4M3" in str(e.value) and "key 'b.weight'" in str(e.value)
    assert "key 'c.weight'" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]

    from torchao.quantization import Int8Tensor
    from torchao.quantization.granularity import PerTensor
    from torchao.quantization.quant_primitives import MappingType

    asym_per_tensor = Int8Tensor.from_hp(CASE_BY_NAME["int8_row"].hp(3), PerTensor(),
                                         mapping_type=MappingType.ASYMMETRIC)
    assert bool(asym_per_tensor.zero_point.count_nonzero())
    state = {"m.weight": asym_per_tensor, "n.weight": CASE_BY_NAME["int8_row"].make(4)}
    qdcp_save(tmp_path / "asym", state, no_dist=True)
    with pytest.raises(qdcp.ExportError, match="key 'm.weight'.*asymmetric per tensor"):
        qdcp.export(tmp_path / "asym", tmp_path / "out", format="compressed-tensors")
    assert not (tmp_path / "out").exists() and sorted(os.listdir(tmp_path)) == ["asym", "ckpt"]
    result = qdcp.export(tmp_path / "asym", tmp_path / "out", format="compressed-tensors",
                         dequantize_unsupported=True)
    assert result.dequantized == ("m.weight",)
    dense = ct_decompress(tmp_path / "out")
    assert bits_diff(dense["m.weight"], qdcp.read_entry(tmp_path / "asym", "m.weight", dequantize=True)) is None
    want = state["n.weight"].dequantize()
    assert bits_diff(dense["n.weight"].to(want.dtype), want) is None


def test_cli_export(tmp_path):
    state = {"m.weight": CASE_BY_NAME["mx_fp8"].make(0), "n.weight": CASE_BY_NAME["nf4"].make(1)}
    qdcp_save(tmp_path / "ckpt", state, no_dist=True)
    run = [sys.executable, "-m", "qdcp", "export", str(tmp_path / "ckpt"), str(tmp_path / "out"),
           "--format", "compressed-tensors", "--quiet"]
    refused = subprocess.run(run, capture_output=True, text=True)
    assert refused.returncode == 2 and "key 'n.weight'" in refused.stderr, refused.stderr
    done = subprocess.run(run + ["--dequantize-unsupported"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "'n.weight' has no compressed-tensors form: written dequantized" in done.stderr
    dense = ct_decompress(tmp_path / "out")
    assert bits_diff(dense["m.weight"], state["m.weight"].dequantize()) is None
    assert bits_diff(dense["n.weight"], state["n.weight"].get_original_weight()) is None


# ----------------------------------------------------------------------------- transformers loads them

def _llama_with(make, layers: int = 1):
    """A tiny transformers Llama (bf16) whose Linear weights but ``lm_head`` are ``make(i, hp)``
    of their own values; returns its config and state dict."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(layers)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for i, m in enumerate(linears):
        m.weight = torch.nn.Parameter(make(i, m.weight.detach()), requires_grad=False)
    return config, model.state_dict()


def _transformers_load(out, run: bool = True, **kwargs):
    """``AutoModelForCausalLM.from_pretrained(out)`` after one forward where ``run`` (a
    compressed-tensors model decompresses itself at its first forward)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16, **kwargs)
    if run:
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
    return model


def test_torchao_export_in_shards_loads_in_transformers(tmp_path):
    """Every type torchao's layout holds, in a tiny Llama exported in several shards, loads through
    transformers' ``from_pretrained``: its torchao quantizer merges the shards' metadata
    (``dict.update``: the last file's ``tensor_names`` wins) and rebuilds each entry with torchao's
    ``unflatten_tensor_state_dict`` from that. Same classes, inner tensors bit for bit. Every file's
    metadata describes each tensor it holds, and no entry's tensors span two files."""
    config, state = _llama_with(lambda i, hp: TORCHAO_CASES[i % len(TORCHAO_CASES)].from_hp(hp), layers=3)
    assert {type(v).__name__ for v in state.values()} >= {type(c.make(0)).__name__ for c in TORCHAO_CASES}
    qdcp_save(tmp_path / "ckpt", dict(state), no_dist=True)
    result = qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao", config=config.to_dict(),
                         max_shard_size="60KB")
    assert len(result.files) > 3
    model = _transformers_load(tmp_path / "out", run=False)  # (torchao's MX / NVFP4 matmuls need a GPU)
    _assert_loaded_as(model.state_dict(), state)
    # and what transformers saves of it, in shards (every file holding the whole metadata), imports back
    model.save_pretrained(tmp_path / "resaved", max_shard_size="60KB", save_original_format=False)
    _, resaved = read_dir(tmp_path / "resaved")
    assert len(resaved) > 3 and all(set(json.loads(md["tensor_names"])) == set(state) for md in resaved.values())
    _, targets = _llama_with(lambda i, hp: TORCHAO_CASES[i % len(TORCHAO_CASES)].from_hp(hp.flip(0)), layers=3)
    targets = {k: torch.zeros_like(v) if type(v) is torch.Tensor else v for k, v in targets.items()}
    dcp.load(targets, storage_reader=qdcp.QuantizedHFReader(tmp_path / "resaved"),
             planner=qdcp.QuantizedLoadPlanner(), no_dist=True)
    for key, want in state.items():
        assert (bits_diff if type(want) is torch.Tensor else components_diff)(targets[key], want) is None, key
    weight_map = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    _, metas = read_dir(tmp_path / "out")
    for file, md in metas.items():
        described = json.loads(md["tensor_names"])
        with safe_open(os.path.join(tmp_path / "out", file), "pt") as f:
            for name in f.keys():
                assert _entry_of(name, state) in described and _entry_of(name, state) in md, (file, name)
    for key in state:
        assert len({f for name, f in weight_map.items() if _entry_of(name, state) == key}) == 1, key


def _entry_of(tensor_name: str, state: dict) -> str:
    """The state-dict key whose tensor (or inner tensor ``<module>._<name>_<part>``) this is."""
    if tensor_name in state:
        return tensor_name
    module, rest = tensor_name.rsplit("._", 1)
    return next(f"{module}.{n}" for n in ("weight", "bias") if rest.startswith(n + "_") and f"{module}.{n}" in state)


def _act(kind: str):
    from torchao.prototype.mx_formats.mx_tensor import MXTensor, QuantizeTensorToMXKwargs
    from torchao.quantization import Float8Tensor, Int8Tensor
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quant_primitives import MappingType
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import QuantizeTensorToFloat8Kwargs
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import QuantizeTensorToInt8Kwargs

    if kind == "fp8":
        return lambda hp: Float8Tensor.from_hp(hp, granularity=PerRow(),
                                               act_quant_kwargs=QuantizeTensorToFloat8Kwargs(granularity=PerRow()))
    if kind == "mxfp8":
        return lambda hp: MXTensor.to_mx(hp, torch.float8_e4m3fn, 32, act_quant_kwargs=QuantizeTensorToMXKwargs())
    return lambda hp: Int8Tensor.from_hp(hp, PerRow(), mapping_type=MappingType.ASYMMETRIC,
                                         act_quant_kwargs=QuantizeTensorToInt8Kwargs(granularity=PerRow()))


def _float8(granularity: str):
    from torchao.quantization import Float8Tensor
    from torchao.quantization.granularity import PerBlock, PerTensor

    g = PerTensor() if granularity == "tensor" else PerBlock([128, 128])
    return lambda hp: Float8Tensor.from_hp(hp, granularity=g)


def _nvfp4(per_tensor: bool):
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    return lambda hp: NVFP4Tensor.to_nvfp4(hp, per_tensor_scale=per_tensor_amax_to_scale(hp.abs().amax())
                                           if per_tensor else None)


#: name: (quantize a bf16 weight, the format qdcp writes, whether transformers loads it compressed)
TRANSFORMERS_CT = {
    "nvfp4": (_nvfp4(True), "nvfp4-pack-quantized", True),
    "nvfp4_no_global": (_nvfp4(False), "nvfp4-pack-quantized", True),
    "mx_fp8": (CASE_BY_NAME["mx_fp8"].from_hp, "mxfp8-quantized", True),
    "float8_tensor": (_float8("tensor"), "naive-quantized", True),
    "float8_row": (CASE_BY_NAME["float8_row"].from_hp, "naive-quantized", True),
    "float8_group64": (CASE_BY_NAME["float8_group64"].from_hp, "naive-quantized", True),
    "float8_block128": (_float8("block128"), "naive-quantized", True),
    "int8_row": (CASE_BY_NAME["int8_row"].from_hp, "pack-quantized", True),
    "int4_group32": (CASE_BY_NAME["intx_int4_group32"].from_hp, "pack-quantized", True),
    "int8_row_asym": (CASE_BY_NAME["int8_asym_row"].from_hp, "pack-quantized", False),
    "int4_group32_asym": (CASE_BY_NAME["intx_int4_group32_asym"].from_hp, "pack-quantized", False),
    "int8_w8a8": (CASE_BY_NAME["int8_dynamic_act"].from_hp, "int-quantized", True),
    "int8_w8a8_asym": (_act("int8_asym"), "int-quantized", True),
    "fp8_dynamic": (_act("fp8"), "float-quantized", True),
    "mxfp8_dynamic": (_act("mxfp8"), "mxfp8-quantized", True),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMERS_CT))
def test_compressed_tensors_export_in_transformers(tmp_path, name):
    """transformers (its compressed-tensors quantizer) loads a tiny Llama qdcp exported, compressed
    (decompressed by its first forward) and with ``CompressedTensorsConfig(dequantize=True)``: the
    values compressed-tensors' own decompression gives, bit for bit. Except asymmetric
    ``pack-quantized`` loaded compressed: transformers allocates ``weight_zero_point`` unpacked and
    stops at the size mismatch (docs/export_compressed_tensors.md says so; pinned here so a fix is
    noticed); with ``dequantize=True`` those load too."""
    from transformers import CompressedTensorsConfig

    make, fmt, loads_compressed = TRANSFORMERS_CT[name]
    config, state = _llama_with(lambda i, hp: make(hp))
    qdcp_save(tmp_path / "ckpt", dict(state), no_dist=True)
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="compressed-tensors", config=config.to_dict())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["format"] == fmt
    dense = ct_decompress(tmp_path / "out")
    config = CompressedTensorsConfig(dequantize=True)
    got = _transformers_load(tmp_path / "out", quantization_config=config).state_dict()
    assert all(bits_diff(got[k], v.to(torch.bfloat16)) is None for k, v in dense.items())
    if loads_compressed:
        got = _transformers_load(tmp_path / "out").state_dict()
        assert all(bits_diff(got[k], v.to(torch.bfloat16)) is None for k, v in dense.items())
    else:
        _assert_transformers_refuses_packed_zero_points(tmp_path / "out")


def _assert_transformers_refuses_packed_zero_points(out) -> None:
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        _transformers_load(out)


@pytest.mark.parametrize("scheme", ["int4_group32_asym", "int8_channel_asym"])
def test_transformers_loads_no_asymmetric_pack_quantized_compressed(tmp_path, scheme):
    """Not even a directory compressed-tensors wrote itself: transformers loads asymmetric
    ``pack-quantized`` only with ``dequantize=True`` (the library's decompression, bit for bit)."""
    from transformers import CompressedTensorsConfig

    from ct_written import write_model

    write_model(scheme, tmp_path / "out")
    _assert_transformers_refuses_packed_zero_points(tmp_path / "out")
    dense = ct_decompress(tmp_path / "out")
    config = CompressedTensorsConfig(dequantize=True)
    got = _transformers_load(tmp_path / "out", quantization_config=config).state_dict()
    assert all(bits_diff(got[k], v.to(torch.bfloat16)) is None for k, v in dense.items())


# ----------------------------------------------------------------------------- saved at 2 ranks

def _save_sharded(rank: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, init_device_mesh

    from dist_helpers import dtensor_from_local, init_file_store_group

    init_file_store_group(root, rank, 2)
    mesh = init_device_mesh("cpu", (2,))
    state = {}
    for name, hp in _sharded_sources().items():
        local = CASE_BY_NAME[name].from_hp(hp[rank * 64:(rank + 1) * 64].contiguous())
        state[f"m.{name}.weight"] = dtensor_from_local(local, mesh, (Shard(0),), hp.shape, hp.dtype)
    dcp.save(state, checkpoint_id=os.path.join(root, "ckpt"), planner=qdcp.QuantizedSavePlanner())
    torch.distributed.destroy_process_group()


def _sharded_sources() -> dict:
    return {n: CASE_BY_NAME[n].hp(i, (128, 128)) for i, n in enumerate(("int8_row", "float8_row", "mx_fp8"))}


@pytest.mark.multiproc
def test_export_of_a_checkpoint_saved_at_two_ranks(tmp_path):
    mp.spawn(_save_sharded, args=(str(tmp_path),), nprocs=2, join=True)
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao")
    got = _torchao_load(tmp_path / "out")
    for name, hp in _sharded_sources().items():
        _assert_same_torchao(got[f"m.{name}.weight"], CASE_BY_NAME[name].from_hp(hp), name)


@pytest.mark.parametrize("format, plain", [("torchao", "m._weight_qdata"), ("compressed-tensors", "m.weight_scale")])
def test_two_entries_the_format_names_alike_are_refused(tmp_path, format, plain):
    """A plain key spelling a quantized entry's inner tensor in the format: the header listed the
    name twice and the file could not be opened, the export having returned normally."""
    state = {"m.weight": CASE_BY_NAME["int8_row"].make(0), plain: torch.zeros(3)}
    qdcp_save(tmp_path / "ckpt", state, no_dist=True)
    with pytest.raises(qdcp.ExportError, match=rf"keys '.*' and '.*' both give a tensor named '{re.escape(plain)}'"):
        qdcp.export(tmp_path / "ckpt", tmp_path / "out", format=format)
    assert not (tmp_path / "out").exists()


def test_a_given_configs_quantization_config_goes_where_nothing_is_quantized(tmp_path):
    """``config=`` from the source model says compressed-tensors; a checkpoint exported with no
    quantized entry must not keep that claim over dense weights."""
    qdcp_save(tmp_path / "ckpt", {"m.weight": torch.randn(4, 8)}, no_dist=True)
    config = {"model_type": "llama", "quantization_config": {"quant_method": "compressed-tensors"}}
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao", config=config)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written == {"model_type": "llama"}


@pytest.mark.parametrize("name, bits", [("int4_group32", 8), ("int4_group32_asym", 8)])
def test_a_pack_quantized_directory_whose_num_bits_disagrees_is_refused(tmp_path, name, bits):
    """config.json's num_bits says 8, the tensors hold 4-bit codes: read as 8-bit, the values came
    out scrambled (torch resized the output); refused naming the key."""
    make, _ = CT_CASES[name]
    qdcp_save(tmp_path / "ckpt", {"m.weight": make()}, no_dist=True)
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="compressed-tensors")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["num_bits"] = bits
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    target = {"m.weight": torch.zeros(CASE_BY_NAME["intx_int4_group32"].make(0).shape, dtype=torch.bfloat16)}
    with pytest.raises(BaseException, match=r"key 'm.weight': weight_packed is .* but 8-bit codes"):
        dcp.load(target, storage_reader=qdcp.QuantizedHFReader(tmp_path / "out"), planner=qdcp.QuantizedLoadPlanner())
    assert not target["m.weight"].any()


# ----------------------------------------------------------------------------- a training checkpoint

def _training_checkpoint(path):
    """A checkpoint as a training loop writes it (the demo's, docs/fsdp2.md's): the model under
    ``model``, torchao AdamW8bit states and param groups under ``optim``, the step; returns the
    model's config and state dict."""
    config, state = _llama_with(lambda i, hp: TORCHAO_CASES[0].from_hp(hp))
    optim8 = CASE_BY_NAME["optim8bit_signed"]
    trained = [k for k in state if k.endswith("up_proj.weight") or k.endswith("norm.weight")]
    optim = {"state": {k: {"exp_avg": optim8.make(i), "exp_avg_sq": optim8.make(i + 1), "step": torch.tensor(3.0)}
                       for i, k in enumerate(trained)},
             "param_groups": [{"lr": 1e-3, "params": trained}]}
    qdcp.save({"model": dict(state), "optim": optim, "step": 3}, path)
    return config, state


def test_a_training_checkpoints_model_exports_under_its_own_names_and_loads_in_transformers(tmp_path):
    """``prefix="model"`` exports the model subtree under the model's own names (was
    ``model.model.layers...``, which from_pretrained does not load) and leaves the optimizer out
    (its states needed --dequantize-unsupported); transformers loads it, every entry bit for bit."""
    config, state = _training_checkpoint(tmp_path / "ckpt")
    result = qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao", config=config.to_dict(),
                         prefix="model")
    assert result.skipped == () and result.dequantized == ()
    assert sorted(result.left_out) == sorted(k for k in qdcp.describe(tmp_path / "ckpt")
                                             if k.startswith("optim.") and "exp_avg" in k or k.endswith(".step"))
    model = _transformers_load(tmp_path / "out", run=False)
    _assert_loaded_as(model.state_dict(), state)


def test_an_export_leaves_optimizer_states_out_unless_asked(tmp_path):
    _training_checkpoint(tmp_path / "ckpt")
    optim_keys = sorted(k for k, v in qdcp.describe(tmp_path / "ckpt").items()
                        if k.startswith("optim.") and v["stored_as"] != "object")
    result = qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao")
    assert sorted(result.left_out) == optim_keys and len(optim_keys) == 3 * 4  # 4 trained parameters
    _, tensors = read_dir(tmp_path / "out")
    names = [n for md in tensors.values() for n in json.loads(md["tensor_names"])]
    assert names and all(n.startswith("model.") for n in names), names
    with pytest.raises(qdcp.ExportError, match=r"nothing to export under prefix 'modle'.*\['model', 'optim'\]"):
        qdcp.export(tmp_path / "ckpt", tmp_path / "out2", format="torchao", prefix="modle")
    assert not (tmp_path / "out2").exists()
    proc = subprocess.run([sys.executable, "-m", "qdcp", "export", str(tmp_path / "ckpt"), str(tmp_path / "out3"),
                           "--format", "torchao", "--prefix", "model"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "qdcp: left out 12 entries, outside --prefix or optimizer states: optim." in proc.stderr, proc.stderr
    assert sorted(os.listdir(tmp_path / "out3")) == ["config.json", "model.safetensors"]
