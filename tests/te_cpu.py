"""Load TransformerEngine's real PyTorch tensor classes on a machine without a GPU (tests only).

TE's compiled extension ``transformer_engine_torch`` cannot be built without CUDA, but the tensor
classes (``Float8Tensor``, ``MXFP8Tensor``, ...) are pure Python. :func:`install` puts a stand-in
for the extension in ``sys.modules`` holding its enum constants only -- every kernel raises
``NotImplementedError`` -- and imports ``transformer_engine.pytorch.tensor`` without running
``transformer_engine.pytorch.__init__`` (which loads the extension). Every kernel being a stand-in,
the tests build each TE tensor from buffers they compute themselves (TE's quantize kernels do not run).

:func:`simulate_gpu` pins what TE asks ``torch.cuda`` about (the compute capability decides which
Float8 buffers exist; the current device is TE's default device for new tensors).
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import os
import sys
import types

import torch

HOPPER = (9, 0)
BLACKWELL = (10, 0)


class DType(enum.IntEnum):
    """``transformer_engine_torch.DType`` (transformer_engine.h / pybind_helper.h)."""

    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10


FP8FwdTensors = enum.IntEnum("FP8FwdTensors", {
    "GEMM1_INPUT": 0, "GEMM1_WEIGHT": 1, "GEMM1_OUTPUT": 2, "GEMM2_INPUT": 3, "GEMM2_WEIGHT": 4,
    "GEMM2_OUTPUT": 5, "GEMM3_INPUT": 6, "GEMM3_WEIGHT": 7, "GEMM3_OUTPUT": 8})
FP8BwdTensors = enum.IntEnum("FP8BwdTensors", {
    "GRAD_OUTPUT1": 0, "GRAD_INPUT1": 1, "GRAD_OUTPUT2": 2, "GRAD_INPUT2": 3, "GRAD_OUTPUT3": 4,
    "GRAD_INPUT3": 5})


def _kernel(name: str):
    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"transformer_engine_torch.{name} is a CUDA kernel; the CPU stand-in has none")
    missing.__name__ = name
    return missing


def _stand_in() -> types.ModuleType:
    mod = types.ModuleType("transformer_engine_torch")
    mod.__file__ = __file__
    mod.DType = DType
    mod.FP8FwdTensors = FP8FwdTensors
    mod.FP8BwdTensors = FP8BwdTensors

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _kernel(name)

    mod.__getattr__ = __getattr__
    return mod


def te_installed() -> bool:
    """Whether TE's Python package is installed (without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def install() -> types.ModuleType:
    """Import ``transformer_engine.pytorch.tensor`` over the stand-in; returns that module."""
    if "transformer_engine.pytorch.tensor" in sys.modules:
        return sys.modules["transformer_engine.pytorch.tensor"]
    os.environ.setdefault("NVTE_PROJECT_BUILDING", "1")  # skip ctypes-loading the CUDA libraries
    existing = sys.modules.get("transformer_engine_torch")
    if existing is None:
        sys.modules["transformer_engine_torch"] = _stand_in()
    elif getattr(existing, "__file__", None) != __file__:
        raise RuntimeError("a real transformer_engine_torch is loaded; use TE directly")
    spec = importlib.util.find_spec("transformer_engine")
    if spec is None:
        raise ImportError("transformer_engine is not installed")
    import transformer_engine  # noqa: F401  (runs common/__init__, harmless with NVTE_PROJECT_BUILDING)
    if "transformer_engine.pytorch" not in sys.modules:
        pkg = types.ModuleType("transformer_engine.pytorch")
        pkg.__path__ = [os.path.join(os.path.dirname(transformer_engine.__file__), "pytorch")]
        pkg.__package__ = "transformer_engine.pytorch"
        sys.modules["transformer_engine.pytorch"] = pkg
        transformer_engine.pytorch = pkg
    import transformer_engine.pytorch.tensor as tensor_mod
    return tensor_mod


@contextlib.contextmanager
def simulate_gpu(capability: tuple[int, int] = HOPPER):
    """Make TE believe it runs on a GPU of ``capability``, with the CPU as its current device."""
    saved = (torch.cuda.get_device_capability, torch.cuda.current_device)
    torch.cuda.get_device_capability = lambda device=None: capability
    torch.cuda.current_device = lambda: "cpu"
    _clear_arch_cache()
    try:
        yield
    finally:
        torch.cuda.get_device_capability, torch.cuda.current_device = saved
        _clear_arch_cache()


def _clear_arch_cache() -> None:
    """TE caches whether the GPU has non-TN FP8 GEMMs (it decides which Float8 buffers exist)."""
    utils = sys.modules.get("transformer_engine.pytorch.utils")
    if utils is not None:
        utils.is_non_tn_fp8_gemm_supported.cache_clear()


GARBAGE = 0xAB  # what the tests put in TE's padding, which TE leaves unset


def padded(compact: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``compact`` in the corner of a ``(rows, cols)`` buffer of garbage (TE leaves padding unset)."""
    fill = GARBAGE if compact.dtype == torch.uint8 else float("nan")
    out = torch.full((rows, cols), fill, dtype=compact.dtype)
    out[: compact.shape[0], : compact.shape[1]] = compact
    return out


def derived_diff(fmt: str, t: torch.Tensor) -> str | None:
    """The copies qdcp rebuilds rather than stores: the Float8 transpose, the 128x128 columnwise copy."""
    if fmt == "float8":
        if t._transpose is None or t._transpose_invalid:
            return "the Float8 transpose is missing or invalid"
        return _bits_diff(t._transpose, t._data.t().contiguous())
    if fmt == "block2d":
        tl, tn = -(-t.shape[0] // 128), -(-t.shape[1] // 128)
        return (_bits_diff(t._columnwise_data, t._rowwise_data.t().contiguous())
                or _bits_diff(t._columnwise_scale_inv[:, :tl], t._rowwise_scale_inv[:tl, :tn].t().contiguous()))
    return None


def inner_ptrs(t: torch.Tensor) -> dict[str, int]:
    """Where each of a TE tensor's buffers lives (a load in place keeps them)."""
    names, _ = t.__tensor_flatten__()
    return {n: getattr(t, n).data_ptr() for n in names}


def _bits_diff(a: torch.Tensor, b: torch.Tensor) -> str | None:
    from quantized_cases import bits_diff

    return bits_diff(a, b)
