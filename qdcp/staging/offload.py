"""Move modules and tensors between devices with their quantized inner buffers, in place.

``param.data = t.to(device)`` leaves a wrapper subclass's inner buffers where they were (the
wrapper holds no storage); :func:`to_device` moves every inner buffer through the tensor's adapter
and swaps the result into the existing parameter object (``torch.utils.swap_tensors``), so
optimizers and hooks that hold the parameter keep working.
"""

from __future__ import annotations

import torch

from qdcp.adapters.base import find_adapter


def _move(t: torch.Tensor, device: torch.device, pin_memory: bool, non_blocking: bool) -> torch.Tensor:
    pin = pin_memory and device.type == "cpu"

    def move(x: torch.Tensor) -> torch.Tensor:
        y = x.to(device, non_blocking=non_blocking)
        return y.pin_memory() if pin and not y.is_pinned() else y

    adapter = find_adapter(t)
    if adapter is None:
        return move(t.detach())
    buffers = {n: move(b) for n, b in adapter.inner_buffers(t).items()}
    return adapter.from_inner_buffers(t, buffers)


def tensor_to_device(t: torch.Tensor, device: torch.device | str, pin_memory: bool = False,
                     non_blocking: bool = False) -> torch.Tensor:
    """A copy of ``t`` (plain or quantized) on ``device``, every inner buffer moved."""
    return _move(t, torch.device(device), pin_memory, non_blocking)


def to_device(obj: torch.nn.Module | torch.Tensor, device: torch.device | str, pin_memory: bool = False,
              non_blocking: bool = False) -> torch.nn.Module | torch.Tensor:
    """Move a module's parameters and buffers (or one tensor) to ``device``, in place.

    Parameters and buffers stay the same Python objects; quantized ones get all their inner
    buffers moved. ``pin_memory`` pins CPU destinations (needs an accelerator); ``non_blocking``
    is passed to each copy (synchronize before reading the results). Returns ``obj``.
    """
    device = torch.device(device)
    tensors: list[torch.Tensor] = []
    if isinstance(obj, torch.nn.Module):
        tensors.extend(obj.parameters())
        tensors.extend(obj.buffers())
    elif isinstance(obj, torch.Tensor):
        tensors.append(obj)
    else:
        raise TypeError(f"to_device takes a Module or a Tensor, got {type(obj).__name__}")
    for t in tensors:
        moved = _move(t, device, pin_memory, non_blocking)
        if isinstance(t, torch.nn.Parameter) or getattr(t, "_is_param", False):
            moved = torch.nn.Parameter(moved, requires_grad=t.requires_grad)
        torch.utils.swap_tensors(t, moved)
    return obj
