"""State dicts that the stager and save tests share, and the jobs done on them: building them
(torchao weights, low-bit optimizer states, nested mixes with plain tensors and objects), deep
snapshots, in-place updates as an optimizer step makes, and comparing two states or two
checkpoints on disk."""

from __future__ import annotations

import os

import torch
from torch.distributed.tensor import DTensor
from torchao.optim import AdamW8bit
from torchao.optim.subclass_8bit import OptimState8bit
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
from torchao.quantization import (
    Float8WeightOnlyConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    quantize_,
    to_nf4,
)
from torchao.quantization.granularity import PerGroup

import qdcp
from qdcp.adapters.base import find_adapter
from quantized_cases import assert_bitwise_equal, assert_same_buffers


def linear(config, seed: int) -> torch.nn.Module:
    """A bf16 ``Linear(256, 128)`` quantized in place by torchao's ``config``."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(256, 128, dtype=torch.bfloat16))
    quantize_(m, config)
    return m


def _adamw8bit_state(seed: int) -> dict:
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(512, 256))
    opt = AdamW8bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    return opt.state_dict()


def _hp(seed: int, shape=(128, 256)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# name -> seed -> a state dict; two seeds give the same types and configs with different values.
STATES = {
    "int8": lambda s: linear(Int8WeightOnlyConfig(version=2), s).state_dict(),
    "float8": lambda s: linear(Float8WeightOnlyConfig(), s).state_dict(),
    "intx": lambda s: linear(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
                             s).state_dict(),
    "nf4": lambda s: {"w": to_nf4(_hp(s))},
    "mx": lambda s: {"w": MXTensor.to_mx(_hp(s), torch.float8_e4m3fn, 32)},
    "nvfp4": lambda s: {"w": NVFP4Tensor.to_nvfp4(_hp(s))},
    "adamw8bit": _adamw8bit_state,
}


def _optim_state(seed: int) -> dict:
    """An AdamW8bit-like state built directly (AdamW8bit.step compiles: ~10 s once per process)."""
    def state8(signed: bool):
        hp = torch.randn(512, 256, generator=torch.Generator().manual_seed(seed))
        t = OptimState8bit.zeros((512, 256), signed=signed, block_size=256)
        t.copy_(hp if signed else hp.square() * 1e-3)
        return t
    return {"state": {0: {"step": torch.tensor(1.0), "exp_avg": state8(True), "exp_avg_sq": state8(False)}},
            "param_groups": [{"lr": 1e-3, "params": [0]}]}


def mixed(seed: int) -> dict:
    """Quantized tensors, plain tensors and non-tensor objects, nested."""
    return {"model": STATES["int8"](seed), "nf4": STATES["nf4"](seed), "optim": _optim_state(seed),
            "step": seed, "config": {"lr": 0.1 * seed, "name": f"run{seed}"},
            "rng": torch.arange(8) + seed}


def leaves(sd, prefix=""):
    """(path, value) of every leaf of a nested state dict."""
    if isinstance(sd, dict):
        for k, v in sd.items():
            yield from leaves(v, f"{prefix}{k}.")
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            yield from leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], sd


def assert_same_state(a, b):
    """Same leaves: quantized tensors with bit-identical inner buffers, plain tensors bitwise equal,
    other objects equal."""
    la, lb = dict(leaves(a)), dict(leaves(b))
    assert sorted(la) == sorted(lb)
    for k, va in la.items():
        vb = lb[k]
        if isinstance(va, torch.Tensor) and find_adapter(va) is not None:
            assert_same_buffers(va, vb)
        elif isinstance(va, torch.Tensor):
            assert_bitwise_equal(va, vb)
        else:
            assert va == vb, k


def is_quantized(v) -> bool:
    """Whether ``v`` is a tensor a qdcp adapter handles."""
    return isinstance(v, torch.Tensor) and find_adapter(v) is not None


def map_leaves(sd, fn):
    """``sd`` with ``fn`` applied to every leaf (nested dicts and lists rebuilt)."""
    if isinstance(sd, dict):
        return {k: map_leaves(v, fn) for k, v in sd.items()}
    if isinstance(sd, list):
        return [map_leaves(v, fn) for v in sd]
    return fn(sd)


def snapshot(sd):
    """A deep copy to compare against later (quantized tensors through their adapters)."""
    def copy(v):
        if isinstance(v, DTensor):
            return DTensor(copy(v._local_tensor), v._spec, requires_grad=False)
        if is_quantized(v):
            a = find_adapter(v)
            return a.from_inner_buffers(v, {n: b.clone() for n, b in a.inner_buffers(v).items()})
        return v.clone() if isinstance(v, torch.Tensor) else v
    return map_leaves(sd, copy)


def mutate(sd):
    """Update every tensor of ``sd`` in place, as an optimizer step would."""
    for _, v in leaves(sd):
        if not isinstance(v, torch.Tensor):
            continue
        v = v._local_tensor if isinstance(v, DTensor) else v
        a = find_adapter(v)
        for b in (a.inner_buffers(v).values() if a is not None else [v]):
            with torch.no_grad():
                b.view(torch.uint8).add_(1) if b.element_size() == 1 else b.add_(1)


def data_files(path) -> dict[str, bytes]:
    """The bytes of a checkpoint's data files, by name."""
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))
            if n.endswith(".distcp")}


def assert_same_checkpoint(a, b):
    """Same data files byte for byte, same entries (the .metadata pickle holds the path and a uuid)."""
    fa, fb = data_files(a), data_files(b)
    assert fa and list(fa) == list(fb)
    for name in fa:
        assert fa[name] == fb[name], f"{name} differs"
    assert qdcp.describe(a) == qdcp.describe(b)
