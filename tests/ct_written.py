"""Directories written by the ``compressed-tensors`` library itself (its own quantization and
compressors, on CPU), for import tests: a small model of Linear layers quantized with a scheme,
weights and scales from min/max, compressed by ``ModelCompressor`` and saved with its config."""

from __future__ import annotations

import os
from collections import OrderedDict

import torch
from safetensors.torch import save_file


def _minmax(w: torch.Tensor, args):
    from compressed_tensors.quantization import QuantizationStrategy as S

    if args.strategy == S.TENSOR:
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == S.CHANNEL:
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy in (S.GROUP, S.TENSOR_GROUP):
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    bh, bw = args.block_structure
    b = w.reshape(w.shape[0] // bh, bh, w.shape[1] // bw, bw)
    return b.amin((1, 3)), b.amax((1, 3))


@torch.no_grad()
def _calibrate(model: torch.nn.Module) -> None:
    from compressed_tensors.quantization import QuantizationStrategy as S
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    for m in model.modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        args, w, gs = scheme.weights, m.weight.float(), None
        if args.strategy == S.TENSOR_GROUP:
            gs = generate_gparam(w.amin(), w.amax())
            m.weight_global_scale.data.copy_(gs)
        scale, zp = calculate_qparams(*_minmax(w, args), args, global_scale=gs)
        m.weight_scale.data.copy_(scale.to(m.weight_scale.dtype))
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zp.to(m.weight_zero_point.dtype))


def schemes() -> dict:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    def weights_only(**kw):
        return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**{"symmetric": True, **kw}))
    return {
        "nvfp4": preset_name_to_scheme("NVFP4A16", ["Linear"]),
        "mxfp8": preset_name_to_scheme("MXFP8A16", ["Linear"]),
        "fp8_tensor": weights_only(num_bits=8, type="float", strategy="tensor"),
        "fp8_channel_dynamic": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]),
        "fp8_block": preset_name_to_scheme("FP8_BLOCK", ["Linear"]),
        "int8_w8a8": preset_name_to_scheme("W8A8", ["Linear"]),
        "int8_channel": weights_only(num_bits=8, type="int", strategy="channel"),
        "int4_group32": weights_only(num_bits=4, type="int", strategy="group", group_size=32),
        "int4_group32_asym": weights_only(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False),
        "int8_channel_asym": weights_only(num_bits=8, type="int", strategy="channel", symmetric=False),
    }


def write(scheme: str, out, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Write ``out`` (model.safetensors + config.json) with compressed-tensors; returns the state
    dict it saved. Layers ``fc1`` (with bias) and ``fc2`` are quantized, ``head`` is ignored."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(
        fc1=torch.nn.Linear(256, 128, bias=True), act=torch.nn.ReLU(),
        fc2=torch.nn.Linear(128, 256, bias=False), head=torch.nn.Linear(256, 128, bias=False))).to(dtype)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": schemes()[scheme]}, ignore=["head"]))
    _calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    os.makedirs(out, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(str(out))
    return state
