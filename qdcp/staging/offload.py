"""Move modules and tensors between devices with their quantized inner buffers, in place.

``param.data = t.to(device)`` leaves a wrapper subclass's inner buffers where they were (the
wrapper holds no storage); :func:`to_device` moves every inner buffer through the tensor's adapter
and swaps the result into the existing parameter object (``torch.utils.swap_tensors``), so
optimizers and hooks that hold the parameter keep working.
"""

from __future__ import annotations

import torch

from qdcp.adapters.base import find_adapter


def tensor_to_device(t: torch.Tensor, device: torch.device | str, pin_memory: bool = False,
                     non_blocking: bool = False) -> torch.Tensor:
    """A copy of ``t`` (plain or quantized) on ``device``, every inner buffer moved."""
    device = torch.device(device)
    pin = pin_memory and device.type == "cpu"

    def move(x: torch.Tensor) -> torch.Tensor:
        y = x.to(device, non_blocking=non_blocking)
        return y.pin_memory() if pin and not y.is_pinned() else y

    adapter = find_adapter(t)
    if adapter is None:
        return move(t.detach())
    buffers = {n: move(b) for n, b in adapter.inner_buffers(t).items()}
    return adapter.from_inner_buffers(t, buffers)


def to_device(obj: torch.nn.Module | torch.Tensor, device: torch.device | str, pin_memory: bool = False,
              non_blocking: bool = False) -> torch.nn.Module | torch.Tensor:
    """Move a module's parameters and buffers (or one tensor) to ``device``, in place.

    Parameters and buffers stay the same Python objects; quantized ones get all their inner
    buffers moved, and a parameter's ``.grad`` moves with it (as ``Module.to`` moves it).
    ``pin_memory`` pins CPU destinations (needs an accelerator); ``non_blocking`` is passed to each
    copy (synchronize before reading the results). Every copy is made before any object changes,
    and a swap torch refuses (a tensor something holds a weak reference to) puts back those already
    made: on failure the module is as it was. Returns ``obj``.
    """
    device = torch.device(device)
    if isinstance(obj, torch.nn.Module):
        named = [*obj.named_parameters(), *obj.named_buffers()]
    elif isinstance(obj, torch.Tensor):
        named = [("tensor", obj)]
    else:
        raise TypeError(f"to_device takes a Module or a Tensor, got {type(obj).__name__}")
    moves = []
    for name, t in named:
        moved = tensor_to_device(t, device, pin_memory, non_blocking)
        grad = t.grad if isinstance(t, torch.nn.Parameter) else None
        if isinstance(t, torch.nn.Parameter) or getattr(t, "_is_param", False):
            moved = torch.nn.Parameter(moved, requires_grad=t.requires_grad)
        if grad is not None:
            grad = tensor_to_device(grad, device, pin_memory, non_blocking)
        moves.append((name, t, moved, grad))
    done = []
    for name, t, moved, grad in moves:
        try:
            torch.utils.swap_tensors(t, moved)
        except RuntimeError as e:
            for _, a, b, _ in reversed(done):
                torch.utils.swap_tensors(a, b)  # the swap is its own inverse
            raise RuntimeError(f"to_device: {name!r} cannot be moved in place ({e}); nothing was moved") from e
        done.append((name, t, moved, grad))
    for _, t, _, grad in done:
        if grad is not None:
            t.grad = grad
    return obj
