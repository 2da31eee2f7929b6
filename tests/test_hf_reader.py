"""qdcp.QuantizedHFReader: Hugging Face directories (torchao's layout, compressed-tensors', plain)
loaded through ``dcp.load`` with ``QuantizedLoadPlanner``: same type bit-exact, the other family raw,
plain targets with the values the format's own library computes, DTensor targets at 2 ranks."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import qdcp
from hf_helpers import TORCHAO_CASES, ct_decompress
from qdcp.adapters import find_adapter
from qdcp.errors import CheckpointFormatError
from quantized_cases import CASE_BY_NAME, bits_diff, components_diff, qdcp_save

warnings.filterwarnings("ignore")


def _load(state: dict, path) -> dict:
    dcp.load(state, storage_reader=qdcp.QuantizedHFReader(path), planner=qdcp.QuantizedLoadPlanner(), no_dist=True)
    return state


@pytest.fixture(scope="module")
def torchao_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchao_dir")
    state = {f"layers.{i}.{c.name}.weight": c.make(i) for i, c in enumerate(TORCHAO_CASES)}
    state["norm.weight"] = torch.randn(256)
    qdcp_save(root / "ckpt", state, no_dist=True)
    qdcp.export(root / "ckpt", root / "out", format="torchao", max_shard_size="300KB")
    return state, root / "out"


def test_torchao_layout_into_same_types_is_bit_exact(torchao_dir):
    state, out = torchao_dir
    targets = {k: CASE_BY_NAME[k.split(".")[2]].make(99) if k != "norm.weight" else torch.zeros(256) for k in state}
    _load(targets, out)
    for key, want in state.items():
        got = targets[key]
        assert (bits_diff(got, want) if key == "norm.weight" else components_diff(got, want)) is None, key


def test_torchao_layout_into_plain_targets_is_torchaos_dequantize(torchao_dir):
    state, out = torchao_dir
    targets = _load({k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}, out)
    for key, want in state.items():
        assert bits_diff(targets[key], want if key == "norm.weight" else want.dequantize()) is None, key


def test_torchao_layout_into_float32_targets_is_computed_in_float32(torchao_dir):
    """float32 targets get the values computed in float32, as from a qdcp checkpoint: NVFP4 and MX
    equal to torchao's own ``dequantize(torch.float32)``, bit for bit (never rounded through bf16)."""
    state, out = torchao_dir
    targets = _load({k: torch.zeros(v.shape, dtype=torch.float32) for k, v in state.items()}, out)
    for key, want in state.items():
        if key == "norm.weight":
            assert bits_diff(targets[key], want) is None
            continue
        expected = want.dequantize(torch.float32) if type(want).__name__ in ("NVFP4Tensor", "MXTensor") \
            else find_adapter(want).dequantize(want, torch.float32)
        assert bits_diff(targets[key], expected) is None, key


def test_plain_safetensors_directory(tmp_path):
    from safetensors.torch import save_file

    want = {"a.weight": torch.randn(8, 4), "b": torch.arange(6, dtype=torch.int64)}
    os.makedirs(tmp_path / "d")
    save_file(want, tmp_path / "d" / "model.safetensors")
    got = _load({k: torch.zeros_like(v) for k, v in want.items()}, tmp_path / "d")
    assert all(bits_diff(got[k], v) is None for k, v in want.items())


# ----------------------------------------------------------------------------- written by compressed-tensors

@pytest.fixture(scope="module")
def ct_dirs(tmp_path_factory):
    from ct_written import schemes, write

    root = tmp_path_factory.mktemp("ct_dirs")
    return {s: (write(s, root / s), root / s) for s in schemes()}


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp8", "fp8_tensor", "fp8_channel_dynamic", "fp8_block", "int8_w8a8",
                                    "int8_channel", "int4_group32", "int4_group32_asym", "int8_channel_asym"])
def test_directory_written_by_compressed_tensors_into_plain_targets(ct_dirs, scheme):
    _, out = ct_dirs[scheme]
    dense = ct_decompress(out)
    targets = _load({k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in dense.items()}, out)
    for key, want in dense.items():
        assert bits_diff(targets[key], want.to(torch.bfloat16)) is None, key


def test_compressed_tensors_nvfp4_and_mxfp8_into_torchao_targets_raw(ct_dirs):
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    hp = torch.randn(128, 256, dtype=torch.bfloat16)
    nv = _load({"fc1.weight": NVFP4Tensor.to_nvfp4(hp, per_tensor_scale=torch.tensor(0.01))}, ct_dirs["nvfp4"][1])
    stored = ct_dirs["nvfp4"][0]
    assert bits_diff(nv["fc1.weight"].qdata, stored["fc1.weight_packed"]) is None
    assert bits_diff(nv["fc1.weight"].scale, stored["fc1.weight_scale"]) is None
    decode = nv["fc1.weight"].per_tensor_scale * stored["fc1.weight_global_scale"].float()
    assert abs(float(decode) - 1.0) < 1e-6  # the global scale's reciprocal, in fp32

    mx = _load({"fc1.weight": MXTensor.to_mx(hp, torch.float8_e4m3fn, 32)}, ct_dirs["mxfp8"][1])
    stored = ct_dirs["mxfp8"][0]
    assert bits_diff(mx["fc1.weight"].qdata, stored["fc1.weight"]) is None
    assert bits_diff(mx["fc1.weight"].scale.view(torch.uint8), stored["fc1.weight_scale"]) is None
    assert bits_diff(mx["fc1.weight"].dequantize(), ct_decompress(ct_dirs["mxfp8"][1])["fc1.weight"]) is None


def _affine_target(scheme: str, hp: torch.Tensor):
    """A torchao target of the kind and block of compressed-tensors ``scheme`` (values ``hp``)."""
    from torchao.quantization import Float8Tensor, Int8Tensor, IntxUnpackedToInt8Tensor
    from torchao.quantization.granularity import PerBlock, PerRow, PerTensor

    if scheme.startswith("fp8"):
        g = {"fp8_tensor": PerTensor(), "fp8_channel_dynamic": PerRow(), "fp8_block": PerBlock([128, 128])}[scheme]
        return Float8Tensor.from_hp(hp, granularity=g)
    from torchao.quantization.quant_primitives import MappingType

    mapping = MappingType.ASYMMETRIC if scheme.endswith("_asym") else MappingType.SYMMETRIC
    if scheme.startswith("int8"):
        return Int8Tensor.from_hp(hp, PerRow(), mapping_type=mapping)
    return IntxUnpackedToInt8Tensor.from_hp(hp, (1, 32), torch.int4, mapping_type=mapping)


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_channel_dynamic", "fp8_block", "int8_w8a8", "int8_channel",
                                    "int4_group32", "int4_group32_asym", "int8_channel_asym"])
def test_compressed_tensors_fp8_and_int_into_torchao_targets_raw(ct_dirs, scheme):
    """A directory the library wrote, loaded into torchao's Float8Tensor / Int8Tensor /
    IntxUnpackedToInt8Tensor of the same kind and block (asymmetric targets for asymmetric
    schemes): the library's codes, scales and zero points as stored (packed ones unpacked by the
    library's own ``unpack_from_int32``); zero points zero for symmetric schemes."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    stored, out = ct_dirs[scheme]
    for module in ("fc1", "fc2"):
        packed = stored.get(f"{module}.weight_packed")
        bits = 4 if scheme.startswith("int4") else 8
        if packed is None:
            codes = stored[f"{module}.weight"]
        else:
            shape = torch.Size(stored[f"{module}.weight_shape"].tolist())
            codes = unpack_from_int32(packed, bits, shape)
        target = _affine_target(scheme, torch.ones(codes.shape, dtype=torch.bfloat16))
        got = _load({f"{module}.weight": target}, out)[f"{module}.weight"]
        assert bits_diff(got.qdata, codes) is None, module
        scale = stored[f"{module}.weight_scale"]
        assert torch.equal(got.scale.to(scale.dtype).reshape(scale.shape), scale), module
        if scheme.endswith("_asym"):
            zero = unpack_from_int32(stored[f"{module}.weight_zero_point"], bits, scale.shape, packed_dim=0)
            assert bool(zero.count_nonzero()) and bits_diff(got.zero_point, zero) is None, module
        else:
            assert getattr(got, "zero_point", None) is None or not bool(got.zero_point.count_nonzero()), module


@pytest.mark.parametrize("name", ["int8_row", "int8_group32", "float8_row", "float8_group64", "intx_int4_group32",
                                  "int8_asym_row", "intx_int4_group32_asym"])
def test_affine_entries_round_trip_through_compressed_tensors_raw(tmp_path, name):
    """A torchao affine tensor exported to compressed-tensors loads back into its own type bit for
    bit, even where quantizing its values again would not reproduce it (its first row's codes
    halved: a requantize would pick a smaller scale)."""
    case = CASE_BY_NAME[name]
    w = case.make(0)
    half = (w.qdata[0].float() / 2).round() if w.qdata.dtype == torch.int8 else w.qdata[0].float() / 2
    w.qdata[0] = half.to(w.qdata.dtype)
    qdcp_save(tmp_path / "ckpt", {"m.weight": w}, no_dist=True)
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="compressed-tensors")
    got = _load({"m.weight": case.make(1)}, tmp_path / "out")["m.weight"]
    assert components_diff(got, w) is None
    assert components_diff(case.from_hp(w.dequantize()), w) is not None  # what a requantize would give differs


def test_affine_scale_the_target_cannot_hold_is_requantized(tmp_path):
    """A qdcp checkpoint's Int8Tensor (fp32 scales) into an IntxUnpackedToInt8Tensor (bf16 scales)
    that rounding would change: the values are quantized like the target instead, as a load without a raw path would."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    w = CASE_BY_NAME["int8_row"].make(0)
    w.scale.copy_(w.scale * (1 + 2 ** -12))  # not a bf16 value
    qdcp_save(tmp_path / "ckpt", {"m.weight": w}, no_dist=True)
    target = IntxUnpackedToInt8Tensor.from_hp(torch.ones(w.shape, dtype=torch.bfloat16), (1, w.shape[1]), torch.int8)
    state = {"m.weight": target}
    dcp.load(state, checkpoint_id=tmp_path / "ckpt", planner=qdcp.QuantizedLoadPlanner(), no_dist=True)
    got = state["m.weight"]
    want = IntxUnpackedToInt8Tensor.from_hp(w.dequantize().to(torch.bfloat16), (1, w.shape[1]), torch.int8)
    assert components_diff(got, want) is None


def test_nvfp4_without_per_tensor_scale_round_trips_raw(tmp_path, ct_dirs):
    """An NVFP4Tensor without a per-tensor scale exports with decode scale 1 and loads back into
    such a target raw, bit for bit (its first block holds only codes of 0.5: requantizing would
    pick a smaller scale). The library's own directory (another global scale) loads into one as
    its values requantized like the target."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    w = NVFP4Tensor.to_nvfp4(torch.randn(64, 128, dtype=torch.bfloat16))
    w.qdata[0, :8] = 0x11
    qdcp_save(tmp_path / "ckpt", {"m.weight": w}, no_dist=True)
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="compressed-tensors")
    got = _load({"m.weight": NVFP4Tensor.to_nvfp4(torch.ones(64, 128, dtype=torch.bfloat16))}, tmp_path / "out")
    assert got["m.weight"].per_tensor_scale is None and components_diff(got["m.weight"], w) is None

    dense = ct_decompress(ct_dirs["nvfp4"][1])["fc1.weight"]
    target = NVFP4Tensor.to_nvfp4(torch.ones(dense.shape, dtype=torch.bfloat16))
    got = _load({"fc1.weight": target}, ct_dirs["nvfp4"][1])["fc1.weight"]
    assert components_diff(got, NVFP4Tensor.to_nvfp4(dense.to(torch.bfloat16))) is None


def test_exported_compressed_tensors_round_trip_into_the_source_type(tmp_path):
    w = CASE_BY_NAME["mx_fp8"].make(3)
    qdcp_save(tmp_path / "ckpt", {"m.weight": w}, no_dist=True)
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="compressed-tensors")
    got = _load({"m.weight": CASE_BY_NAME["mx_fp8"].make(4)}, tmp_path / "out")
    assert components_diff(got["m.weight"], w) is None


# ----------------------------------------------------------------------------- quantization_status

_RESAVED = ["fp8_tensor", "fp8_block", "mxfp8", "nvfp4", "int8_w8a8", "int4_group32"]


@pytest.fixture(scope="module")
def resaved_dirs(tmp_path_factory):
    """Per scheme: a tiny Llama the library quantized and saved compressed, and the same model
    loaded by transformers (its first forward decompresses it) and re-saved: dense bf16 weights
    under a config that still names the format, ``quantization_status: "decompressed"``."""
    from ct_written import resave_with_transformers, write_model

    root = tmp_path_factory.mktemp("resaved")
    for scheme in _RESAVED:
        write_model(scheme, root / scheme / "compressed")
        resave_with_transformers(root / scheme / "compressed", root / scheme / "decompressed")
    return root


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _copy_with_config(src, dst, edit) -> None:
    """``src`` copied to ``dst`` with its ``quantization_config`` changed by ``edit``."""
    shutil.copytree(src, dst)
    config = _config(dst)
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("scheme", _RESAVED)
def test_decompressed_directory_loads_its_dense_weights(resaved_dirs, scheme):
    """A directory transformers re-saved after decompressing (dense bf16 ``weight`` beside the
    quantization parameters, the config still naming the format) loads as the dense tensors it
    stores, bit for bit (its FP8 / MXFP8 weights were read as codes: every element wrong)."""
    from safetensors.torch import load_file

    out = resaved_dirs / scheme / "decompressed"
    qc = _config(out)["quantization_config"]
    assert qc["quantization_status"] == "decompressed"
    assert qc["config_groups"]["group_0"]["format"] == _config(out.parent / "compressed")["quantization_config"][
        "config_groups"]["group_0"]["format"]
    stored = load_file(out / "model.safetensors")
    weights = {k: v for k, v in stored.items() if k.endswith(".weight")}
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    got = _load({k: torch.zeros(v.shape, dtype=v.dtype) for k, v in weights.items()}, out)
    assert all(bits_diff(got[k], v) is None for k, v in weights.items())
    # the status absent: the stored dtypes decide (dense here; codes in the compressed directory)
    _copy_with_config(out, out.parent / "no_status", lambda qc: qc.pop("quantization_status"))
    got = _load({k: torch.zeros(v.shape, dtype=v.dtype) for k, v in weights.items()}, out.parent / "no_status")
    assert all(bits_diff(got[k], v) is None for k, v in weights.items())
    compressed = out.parent / "compressed"
    _copy_with_config(compressed, out.parent / "compressed_no_status", lambda qc: qc.pop("quantization_status"))
    dense = ct_decompress(compressed)
    got = _load({k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in weights.items()},
                out.parent / "compressed_no_status")
    assert all(bits_diff(got[k], dense[k].to(torch.bfloat16)) is None for k in weights)


def test_compressed_tensors_directory_that_contradicts_its_config_is_refused(resaved_dirs, tmp_path):
    """Whatever the reader cannot interpret is refused, naming the key: dense weights under
    ``compressed``, codes under ``decompressed``, a parameter stored in a dtype the format's codes
    or scales cannot have, codes no config group targets."""
    layer = "model.layers.0.mlp.down_proj.weight"
    cases = {
        "dense_as_compressed": (resaved_dirs / "fp8_tensor" / "decompressed",
                                lambda qc: qc.update(quantization_status="compressed"),
                                f"key '{layer}': the config's quantization_status is 'compressed' but the directory "
                                f"stores a dense torch.bfloat16 weight"),
        "codes_as_decompressed": (resaved_dirs / "mxfp8" / "compressed",
                                  lambda qc: qc.update(quantization_status="decompressed"),
                                  f"key '{layer}': .*'decompressed' but the directory stores "
                                  "torch.float8_e4m3fn codes"),
        "packed_as_decompressed": (resaved_dirs / "int4_group32" / "compressed",
                                   lambda qc: qc.update(quantization_status="decompressed"),
                                   f"key '{layer}': .*stores packed codes"),
        "untargeted_codes": (resaved_dirs / "fp8_tensor" / "compressed",
                             lambda qc: qc["config_groups"]["group_0"].update(targets=["re:.*self_attn.*"]),
                             f"key '{layer}': '{layer}' holds compressed-tensors codes .* no config group"),
        "nvfp4_as_mxfp8": (resaved_dirs / "nvfp4" / "compressed",
                           lambda qc: qc["config_groups"]["group_0"].update(format="mxfp8-quantized"),
                           f"key '{layer}': a mxfp8-quantized module stores '{layer}'; the directory lacks it"),
    }
    for name, (src, edit, message) in cases.items():
        _copy_with_config(src, tmp_path / name, edit)
        _assert_refused(tmp_path / name, {layer: torch.zeros(128, 256, dtype=torch.bfloat16)}, message)


def test_compressed_tensors_parameter_of_the_wrong_dtype_is_refused(resaved_dirs, tmp_path):
    """A compressed directory whose MXFP8 scales are stored as bf16 (not E8M0 bytes) or whose FP8
    codes are stored as int8 is refused naming the key and the parameter."""
    from safetensors.torch import load_file, save_file

    layer = "model.layers.0.self_attn.q_proj"
    for scheme, part, dtype, want in (("mxfp8", "weight_scale", torch.bfloat16, "torch.uint8 or torch.float8_e8m0fnu"),
                                      ("fp8_tensor", "weight", torch.int8, "torch.float8_e4m3fn")):
        out = tmp_path / scheme
        shutil.copytree(resaved_dirs / scheme / "compressed", out)
        tensors = load_file(out / "model.safetensors")
        tensors[f"{layer}.{part}"] = tensors[f"{layer}.{part}"].view(torch.uint8).to(dtype)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        _assert_refused(out, {f"{layer}.weight": torch.zeros(128, 128, dtype=torch.bfloat16)},
                        f"key '{layer}.weight': '{layer}.{part}' is stored as {dtype}, but .* stores it as {want}")


def _assert_refused(path, targets: dict, message: str) -> None:
    """The reader refuses ``path`` with ``message``; ``dcp.load`` stops with it, the targets untouched."""
    with pytest.raises(CheckpointFormatError, match=message):
        qdcp.QuantizedHFReader(path).read_metadata()
    with pytest.raises(BaseException, match=message):  # DCP quotes the reader's error
        _load(targets, path)
    assert not any(bool(t.count_nonzero()) for t in targets.values())


# ----------------------------------------------------------------------------- DTensor targets at 2 ranks

def _load_sharded(rank: int, out: str, results) -> None:
    from torch.distributed.tensor import Shard, init_device_mesh

    from dist_helpers import dtensor_from_local, init_file_store_group

    init_file_store_group(os.path.dirname(out), rank, 2)
    mesh = init_device_mesh("cpu", (2,))
    state, locals_ = {}, {}  # targets are filled in place: the locals hold what was loaded
    for name, hp in _sharded_sources().items():
        locals_[name] = CASE_BY_NAME[name].from_hp(torch.zeros_like(hp[rank * 64:(rank + 1) * 64]) + 1)
        state[f"m.{name}.weight"] = dtensor_from_local(locals_[name], mesh, (Shard(0),), hp.shape, hp.dtype)
    locals_["plain"] = torch.zeros(64, 128)
    state["m.plain"] = dtensor_from_local(locals_["plain"], mesh, (Shard(0),), (128, 128), torch.float32)
    dcp.load(state, storage_reader=qdcp.QuantizedHFReader(out), planner=qdcp.QuantizedLoadPlanner())
    for name, hp in _sharded_sources().items():
        want = CASE_BY_NAME[name].from_hp(hp[rank * 64:(rank + 1) * 64].contiguous())
        results[(rank, name)] = components_diff(locals_[name], want)
    results[(rank, "plain")] = bits_diff(locals_["plain"], _plain()[rank * 64:(rank + 1) * 64])
    torch.distributed.destroy_process_group()


def _sharded_sources() -> dict:
    return {n: CASE_BY_NAME[n].hp(i, (128, 128)) for i, n in enumerate(("int8_row", "float8_row", "mx_fp8"))}


def _plain() -> torch.Tensor:
    return torch.randn(128, 128, generator=torch.Generator().manual_seed(9))


@pytest.mark.multiproc
def test_dtensor_targets_at_two_ranks(tmp_path):
    state = {f"m.{n}.weight": CASE_BY_NAME[n].from_hp(hp) for n, hp in _sharded_sources().items()}
    state["m.plain"] = _plain()
    qdcp_save(tmp_path / "ckpt", state, no_dist=True)
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="torchao")
    results = mp.Manager().dict()
    mp.spawn(_load_sharded, args=(str(tmp_path / "out"), results), nprocs=2, join=True)
    assert dict(results) == {(r, n): None for r in (0, 1) for n in (*_sharded_sources(), "plain")}


def test_load_temporaries_are_made_at_the_read_and_reused(tmp_path):
    """Loading compressed-tensors weights into torchao targets converts each entry through
    temporaries: they are made when the first entry is read and handed on to the next entry of
    the same shape when one is done, so a load of six layers uses one temporary per component
    shape (they were all made at planning: twelve), and none outlives the load (the planner does)."""
    import gc
    import weakref

    from torchao.quantization import Int8Tensor
    from torchao.quantization.granularity import PerRow

    state = {f"m{i}.weight": CASE_BY_NAME["int8_row"].make(i) for i in range(6)}
    qdcp_save(tmp_path / "ckpt", state, no_dist=True)
    qdcp.export(tmp_path / "ckpt", tmp_path / "out", format="compressed-tensors")
    buffers, alive = [], []

    class Watching(qdcp.QuantizedLoadPlanner):
        def resolve_tensor(self, read_item):
            buffer = super().resolve_tensor(read_item)
            buffers.append((tuple(buffer.shape), buffer.untyped_storage().data_ptr()))
            alive.append(weakref.ref(buffer._base if buffer._base is not None else buffer))
            return buffer

    targets = {k: Int8Tensor.from_hp(torch.ones(v.shape, dtype=torch.bfloat16), PerRow()) for k, v in state.items()}
    planner = Watching()
    dcp.load(targets, storage_reader=qdcp.QuantizedHFReader(tmp_path / "out"), planner=planner, no_dist=True)
    assert all(components_diff(targets[k], v) is None for k, v in state.items())
    assert len(buffers) == 2 * len(state) and len({ptr for _, ptr in buffers}) == 2, buffers
    gc.collect()
    assert planner is not None and all(ref() is None for ref in alive)
