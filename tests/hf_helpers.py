"""Helpers of the Hugging Face export / import tests: the torchao cases torchao's layout holds, a
tiny transformers model config, drawn checkpoints saved at N ranks cut by rows, a directory's
tensors and metadata, and compressed-tensors' own decompression of a directory."""

from __future__ import annotations

import json
import os
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torchao.prototype.safetensors.safetensors_utils import ALLOWED_TENSORS_SUBCLASSES

import dcp_in_process as job
import qdcp
from qdcp import QuantizedSavePlanner
from quantized_cases import CASE_BY_NAME, CASES

TORCHAO_CASES = [c for c in CASES if c.make(0).__class__.__name__ in ALLOWED_TENSORS_SUBCLASSES]


def make(family: str, hp: torch.Tensor) -> torch.Tensor:
    """``hp`` quantized as ``family`` (a quantized_cases name), or a copy of it (``"plain"``)."""
    return hp.clone() if family == "plain" else CASE_BY_NAME[family].from_hp(hp)


def row_chunk(world: int, shape) -> tuple[DTensorSpec, slice]:
    """The current (fake) rank's ``Shard(0)`` spec of a bf16 ``shape`` tensor at ``world`` ranks, and its rows."""
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(job.mesh((world,)), (Shard(0),), TensorMeta(torch.Size(shape), stride, torch.bfloat16))
    chunk = DTensor(torch.empty(0), spec, requires_grad=False).__create_chunk_list__()[0]
    return spec, slice(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0])


def save_drawn(entries, world: int, path: str, key: Callable[[int, str], str]) -> tuple[dict, dict]:
    """Save drawn ``entries`` (family, shape, seed) at ``world`` ranks cut by rows, every rank's
    rows quantized on their own (the whole tensor's quantization for row-wise blocks), under
    ``key(i, family)``: qdcp.save of the whole tensors at one rank, qdcp's writer given every
    rank's plan otherwise. Returns ``{key: (family, bf16 values)}`` and ``{key: the whole tensor}``."""
    hps, whole = {}, {}
    for i, (family, shape, seed) in enumerate(entries):
        hp = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        hps[key(i, family)], whole[key(i, family)] = (family, hp), make(family, hp)

    def state(rank):
        out = {}
        for k, (family, hp) in hps.items():
            spec, rows = row_chunk(world, hp.shape)
            out[k] = DTensor(make(family, hp[rows].contiguous()), spec, requires_grad=False)
        return out

    if world == 1:
        qdcp.save(whole, path)
    else:
        job.save_files(state, world, QuantizedSavePlanner, path)
    return hps, whole


def tiny_llama_config(layers: int = 1):
    """A transformers Llama small enough for CPU tests whose Linear weights fit every block the
    quantized types use (128 x 128, 256 x 128, 128 x 256); ``lm_head`` untied from the embedding."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=64, tie_word_embeddings=False)


def read_dir(out) -> tuple[dict, dict]:
    """All tensors of a Hugging Face directory and the per-file ``__metadata__``."""
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    tensors, metas = {}, {}
    for f in files:
        tensors.update(load_file(os.path.join(out, f)))
        with safe_open(os.path.join(out, f), "pt") as so:
            metas[f] = so.metadata()
    return tensors, metas


def ct_decompress(out) -> dict:
    """Dense weights of a compressed-tensors directory, through the library's own compressors."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_quantizable_tensors

    tensors, _ = read_dir(out)
    cfg = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    dense = {}
    for scheme in cfg.config_groups.values():
        comp = BaseCompressor.get_value_from_registry(scheme.format)
        names = comp.compression_param_names(scheme)
        for mod, _ in match_quantizable_tensors(tensors, ignore=cfg.ignore or [], targets=scheme.targets,
                                                param_targets=[names[0]]):
            if f"{mod}.weight_scale" not in tensors:  # matched by name, not quantized (a norm, an embedding)
                continue
            local = {p: tensors.pop(f"{mod}.{p}") for p in names if f"{mod}.{p}" in tensors}
            dense[f"{mod}.weight"] = comp.decompress(local, scheme)["weight"]
    dense.update(tensors)
    return dense
