"""qdcp.to_device moves every inner buffer and keeps parameter objects."""

from __future__ import annotations

import pytest
import torch

import qdcp
from quantized_cases import CASES, assert_same_buffers, inner


class Holder(torch.nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.w = torch.nn.Parameter(w, requires_grad=False)
        self.register_buffer("b", b)


def _devices(t):
    adapter = qdcp.find_adapter(t)
    return {str(x.device) for x in (adapter.inner_buffers(t).values() if adapter else [t])}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_to_meta_moves_every_inner_buffer_in_place(case):
    m = Holder(case.make(0), torch.randn(3))
    w, b = m.w, m.b
    qdcp.to_device(m, "meta")
    assert m.w is w and m.b is b
    assert m.w.device.type == "meta" and _devices(m.w) == {"meta"} and m.b.device.type == "meta"
    assert type(m.w) is type(case.make(0))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_tensor_copy_keeps_bits(case):
    t = case.make(0)
    moved = qdcp.staging.offload.tensor_to_device(t, "cpu")
    assert_same_buffers(moved, t)


def test_plain_parameters_keep_identity():
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    p = m.weight
    qdcp.to_device(m, "meta")
    assert m.weight is p and m.weight.device.type == "meta"


def test_rejects_other_objects():
    with pytest.raises(TypeError, match="Module or a Tensor"):
        qdcp.to_device([1], "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cuda_round_trip_keeps_bits(case):
    t = case.make(0)
    ref = {n: x.clone() for n, x in inner(t).items()}
    m = Holder(t, torch.randn(3))
    w = m.w
    qdcp.to_device(m, "cuda")
    assert m.w is w and _devices(m.w) == {"cuda:0"}
    qdcp.to_device(m, "cpu", pin_memory=True)
    assert m.w is w and _devices(m.w) == {"cpu"}
    for n, x in inner(m.w).items():
        assert torch.equal(x.view(torch.uint8) if x.dtype.itemsize == 1 else x,
                           ref[n].view(torch.uint8) if ref[n].dtype.itemsize == 1 else ref[n])


def test_gradients_move_with_their_parameters_and_a_refused_swap_changes_nothing():
    """A parameter's ``.grad`` moves with it, as ``Module.to`` moves it (it was dropped: a step
    between micro-batches lost the accumulated gradient). A tensor torch will not swap in place
    (something holds a weak reference to it) fails the whole move naming it, every parameter left
    as it was (half the module was moved before)."""
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    model(torch.randn(3, 8)).sum().backward()
    params = dict(model.named_parameters())
    grads = {n: p.grad.clone() for n, p in params.items()}
    qdcp.to_device(model, "cpu")
    for n, p in model.named_parameters():
        assert p is params[n] and p.grad is not None and torch.equal(p.grad, grads[n]), n
    qdcp.to_device(model, "meta")
    for n, p in model.named_parameters():
        assert p is params[n] and p.device.type == "meta" and p.grad is not None and p.grad.device.type == "meta"
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    model(torch.randn(3, 8)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    held = weakref.ref(model[1].weight)  # noqa: F841 (the reference torch's swap refuses)
    with pytest.raises(RuntimeError, match="'1.weight' cannot be moved in place.*nothing was moved"):
        qdcp.to_device(model, "meta")
    for n, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p.detach(), values[n]) and torch.equal(p.grad, grads[n]), n
