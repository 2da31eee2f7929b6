"""Directories written by the ``compressed-tensors`` library itself (its own quantization and
compressors, on CPU), for import tests: a small model of Linear layers (or a tiny transformers
Llama) quantized with a scheme, weights and scales from min/max, compressed by ``ModelCompressor``
and saved with its config; and such a model re-saved by transformers."""

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
    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(
        fc1=torch.nn.Linear(256, 128, bias=True), act=torch.nn.ReLU(),
        fc2=torch.nn.Linear(128, 256, bias=False), head=torch.nn.Linear(256, 128, bias=False))).to(dtype)
    return _quantize_and_save(model, scheme, out, ignore=["head"])


def write_model(scheme: str, out) -> dict[str, torch.Tensor]:
    """A tiny transformers Llama (``hf_helpers.tiny_llama_config``) quantized with ``scheme`` by the
    library and saved by it (its ``config.json`` holds the model's config), as ``from_pretrained``
    loads it: every Linear but ``lm_head``. Returns the state dict it saved."""
    from transformers import LlamaForCausalLM

    from hf_helpers import tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config()
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    config.save_pretrained(str(out))
    return _quantize_and_save(model, scheme, out, ignore=["lm_head"])


def resave_with_transformers(src, out) -> None:
    """What transformers writes when it re-saves a loaded compressed-tensors model: loaded with
    ``from_pretrained`` (compressed), run once (its first forward decompresses it in place), saved
    with ``save_pretrained``: dense weights, the config still naming the format, with
    ``quantization_status: "decompressed"``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    model.save_pretrained(str(out))


def _quantize_and_save(model: torch.nn.Module, scheme: str, out, ignore: list[str]) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": schemes()[scheme]}, ignore=ignore))
    _calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    os.makedirs(out, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(str(out))
    return state
