"""qdcp quickstart: checkpoint a model quantized with several torchao types, raw and dequantized.

Quantizes a small MLP (Int8, Float8, Intx int4, MXFP8, NVFP4 and NF4 layers), saves a raw and a
dequantized DCP checkpoint, reloads the raw one into a freshly quantized model (bit-identical) and
both into a plain bf16 model, and prints one line per key.

    python examples/quickstart.py [--dir /tmp/qdcp-quickstart]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp

import qdcp

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def build_model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    dims = [256, 512, 512, 512, 512, 512, 256]
    layers = [torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:])]
    return torch.nn.Sequential(*layers).to(torch.bfloat16)


def quantize(model: torch.nn.Sequential) -> torch.nn.Sequential:
    """One torchao type per layer, each through torchao's own API."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    from torchao.quantization import (
        Float8WeightOnlyConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
        PerGroup,
        quantize_,
        to_nf4,
    )

    quantize_(model[0], Int8WeightOnlyConfig(version=2))
    quantize_(model[1], Float8WeightOnlyConfig())
    quantize_(model[2], IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    with torch.no_grad():
        w = model[3].weight
        model[3].weight = torch.nn.Parameter(MXTensor.to_mx(w.detach(), torch.float8_e4m3fn, 32),
                                             requires_grad=False)
        w = model[4].weight.detach()
        model[4].weight = torch.nn.Parameter(
            NVFP4Tensor.to_nvfp4(w, per_tensor_scale=per_tensor_amax_to_scale(w.abs().amax())),
            requires_grad=False)
        model[5].weight = torch.nn.Parameter(to_nf4(model[5].weight.detach()), requires_grad=False)
    return model


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """The library's own dequantize of a quantized tensor (plain tensors pass through)."""
    adapter = qdcp.find_adapter(t)
    return adapter.dequantize(t) if adapter else t


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    adapter = qdcp.find_adapter(a)
    pairs = (zip(adapter.inner_buffers(a).values(), adapter.inner_buffers(b).values())
             if adapter else [(a, b)])
    return all(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
               for x, y in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write checkpoints (default: a temp dir)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="qdcp-quickstart-")
    raw_dir, deq_dir = f"{root}/raw", f"{root}/dequantized"
    shutil.rmtree(raw_dir, ignore_errors=True)
    shutil.rmtree(deq_dir, ignore_errors=True)

    model = quantize(build_model(0))
    qdcp.save(model.state_dict(), raw_dir)                   # raw: every inner buffer
    qdcp.save(model.state_dict(), deq_dir, dequantize=True)  # portable: plain bf16 tensors

    # 1. raw -> a freshly quantized model (other random weights): buffers bit-identical
    restored = quantize(build_model(1))
    qdcp.load(restored.state_dict(), raw_dir)
    same_bits = all(_same_bits(a, b) for a, b in zip(model.state_dict().values(),
                                                     restored.state_dict().values()))

    # 2. raw and dequantized -> plain bf16 models: equal to the library's own dequantize
    plain_from_raw, plain_from_deq = build_model(2), build_model(3)
    qdcp.load(plain_from_raw.state_dict(), raw_dir)
    dcp.load(plain_from_deq.state_dict(), checkpoint_id=deq_dir)  # stock DCP reads it

    info = qdcp.describe(raw_dir)
    ref_sd, raw_sd, deq_sd = model.state_dict(), plain_from_raw.state_dict(), plain_from_deq.state_dict()
    print(f"{'key':<10} {'type':<32} {'raw bytes':>10} {'bf16 bytes':>10} {'ratio':>6} "
          f"{'max err raw':>11} {'max err deq':>11}")
    total_raw = total_bf16 = 0
    for key in ref_sd:
        entry = info[key]
        bf16_bytes = ref_sd[key].numel() * 2
        ref = dequantized(ref_sd[key]).float()
        err_raw = (raw_sd[key].float() - ref).abs().max().item()
        err_deq = (deq_sd[key].float() - ref).abs().max().item()
        total_raw += entry["bytes"]
        total_bf16 += bf16_bytes
        print(f"{key:<10} {entry.get('type', 'plain'):<32} {entry['bytes']:>10} {bf16_bytes:>10} "
              f"{entry['bytes'] / bf16_bytes:>6.3f} {err_raw:>11.3g} {err_deq:>11.3g}")
    print(f"{'total':<10} {'':<32} {total_raw:>10} {total_bf16:>10} {total_raw / total_bf16:>6.3f}")
    print(f"raw checkpoint reloaded into a quantized model bit-identically: {same_bits}")
    print(f"checkpoints in {root}")
    if not same_bits:
        raise SystemExit("the quantized round trip changed some buffer")


if __name__ == "__main__":
    main()
