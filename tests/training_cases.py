"""torchao's quantized-training weights, built the way a user converts a model (on CPU).

Each case converts a small model with torchao's own API and names the wrapper class its weights
become. ``wraps_high_precision``: the wrapper's values are one plain tensor (stored as that tensor);
otherwise it holds quantized data (stored raw).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import torch
import torch.nn as nn

warnings.filterwarnings("ignore")

from torchao.quantization import quantize_  # noqa: E402

E, D, H = 4, 64, 128  # experts, model dim, hidden dim of the MoE layer


def mlp(dtype=torch.float32, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, H, bias=False), nn.ReLU(), nn.Linear(H, D, bias=False)).to(dtype)


class Experts(nn.Module):
    """A toy MoE expert layer: 3-D expert weights used through ``torch._grouped_mm``."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter((torch.randn(E, H, D, generator=g) * 0.05).to(torch.bfloat16))
        self.w2 = nn.Parameter((torch.randn(E, D, H, generator=g) * 0.05).to(torch.bfloat16))

    def forward(self, x, offs):
        h = torch.relu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs))
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)


class MoE(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        self.experts = Experts(seed)
        torch.manual_seed(seed)
        self.proj = nn.Linear(D, D, bias=False, dtype=torch.bfloat16)

    def forward(self, x, offs):
        return self.proj(self.experts(x, offs))


def float8_training(m: nn.Module) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return m


def moe_mxfp8_training(m: nn.Module) -> nn.Module:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe

    quantize_(m, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL),
              filter_fn=lambda mod, fqn: isinstance(mod, (Experts, nn.Linear)))
    return m


def moe_float8_training(m: nn.Module) -> nn.Module:
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig

    quantize_(m, Float8TrainingOpConfig(), filter_fn=lambda mod, fqn: isinstance(mod, (Experts, nn.Linear)))
    return m


def int8_quantized_training(m: nn.Module) -> nn.Module:
    from torchao.prototype.quantized_training import int8_weight_only_quantized_training

    quantize_(m, int8_weight_only_quantized_training())
    return m


def int8_mixed_precision_training(m: nn.Module) -> nn.Module:
    from torchao.prototype.quantized_training import Int8MixedPrecisionTrainingConfig

    quantize_(m, Int8MixedPrecisionTrainingConfig())
    return m


def bitnet_training(m: nn.Module) -> nn.Module:
    from torchao.prototype.quantized_training import bitnet_training as config

    quantize_(m, config())
    return m


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    convert: Callable[[nn.Module], nn.Module]
    cls_name: str
    wraps_high_precision: bool = True
    moe: bool = False

    def model(self, seed: int) -> nn.Module:
        base = MoE(seed) if self.moe else mlp(seed=seed)
        return self.convert(base)

    def plain_model(self, seed: int) -> nn.Module:
        """The same architecture, unconverted (what a user loads a training checkpoint into)."""
        return MoE(seed) if self.moe else mlp(seed=seed)


_UNAVAILABLE: dict[str, str | None] = {}


def unavailable(case: "Case") -> str | None:
    """Why torchao cannot build ``case`` with this torch, or None. Only torch older than 2.12 may
    lack what torchao's training recipes need (its MXFP8 MoE training asks for newer); there a
    build error skips the case. On newer torch every case must build: an error is raised, never
    taken for a skip (a regression that breaks building fails the tests)."""
    if case.name not in _UNAVAILABLE:
        if _TORCH < (2, 12):
            try:
                case.model(0)
                _UNAVAILABLE[case.name] = None
            except (AssertionError, ImportError, NotImplementedError, RuntimeError) as e:
                _UNAVAILABLE[case.name] = f"{case.name}: torchao cannot build it with torch {torch.__version__} ({e})"
        else:
            case.model(0)
            _UNAVAILABLE[case.name] = None
    return _UNAVAILABLE[case.name]


_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


CASES = [
    Case("float8", float8_training, "WeightWithDynamicFloat8CastTensor"),
    Case("moe_mxfp8", moe_mxfp8_training, "MXFP8TrainingWeightWrapperTensor", moe=True),
    Case("moe_float8", moe_float8_training, "Float8TrainingWeightWrapperTensor", moe=True),
    Case("int8_mixed_precision", int8_mixed_precision_training, "Int8MixedPrecisionTrainingLinearWeight"),
    Case("bitnet", bitnet_training, "BitNetTrainingLinearWeight"),
    Case("int8_quantized", int8_quantized_training, "Int8QuantizedTrainingLinearWeight",
         wraps_high_precision=False),
]
CASE_BY_NAME = {c.name: c for c in CASES}


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or a DTensor's local tensor."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def values(t: torch.Tensor) -> torch.Tensor:
    """What a training weight holds: a wrapper's high-precision tensor, or the dequantized int8 weight."""
    t = local(t)
    if hasattr(t, "_tensor"):
        return t._tensor
    if hasattr(t, "_data"):
        return t._data
    return t.dequantize() if hasattr(t, "int_data") else t
