"""The script every ``torchrun`` rank runs for ``tests/test_framework_accelerate.py``.

    python -m torch.distributed.run --nproc-per-node N tests/accelerate_worker.py COMMAND DIR

accelerate's FSDP2 checkpoint functions (``accelerate.utils.fsdp_utils.save_fsdp_model`` /
``save_fsdp_optimizer`` / ``load_fsdp_model`` / ``load_fsdp_optimizer``: what
``Accelerator.save_state`` / ``load_state`` and the HF Trainer call for a ``SHARDED_STATE_DICT``;
they build ``DefaultSavePlanner()`` / ``DefaultLoadPlanner()`` inside) on a ``fully_shard`` model,
with ``qdcp.install()`` and without. ``Accelerator(cpu=True)`` sets up gloo from torchrun's
environment but ignores an FSDP plugin on CPU, so the model is sharded here and the plugin passed to
the functions, as the Accelerator passes its own.

The model: a first layer trained with torchao's ``AdamW8bit`` (its states ``OptimState8bit``
DTensors), a frozen QLoRA-style ``NF4Tensor`` base weight (sharded by FSDP2), a middle layer
converted by accelerate's float8 recipe (``convert_model_to_fp8_ao``,
``enable_fsdp_float8_all_gather=True``, ``emulate=True`` on CPU: its weight a
``WeightWithDynamicFloat8CastTensor``), and a frozen last layer quantized by
``Int8WeightOnlyConfig`` (an ``Int8Tensor``, kept whole on every rank by ``ignored_params``).
The same model unquantized (fp32 middle, bf16 base and last) is the "plain" target.

Commands (KIND = ``qdcp`` with the switch, ``stock`` without):

- ``save`` (2 ranks): two training steps, then the model and optimizer saved by accelerate's
  functions to ``DIR/KIND``; rank 0 writes the whole weights, inner buffers and optimizer states
  (``ref.pt``). Section ``save``.
- ``load`` (any N): fresh models (other weights, no optimizer state yet) at N ranks filled by
  accelerate's load functions. With the switch, section ``load``: every inner buffer (the float8
  wrapper's high-precision ``_tensor``, NF4's, the int8 layer's, the 8-bit states' codes, scales
  and code book) and plain tensor bit-exact, parameters filled in place, types kept; section
  ``load-plain``: the unquantized model filled by ``load_fsdp_model``, each weight equal to the
  saved one's values (torchao's ``dequantize()`` / ``get_original_weight()``, the wrapper's
  ``_tensor``). Without the switch, what happened (``stock-N.json``: the error, or the keys that
  differ) for the test to assert.
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torchao.optim  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.utils.ao import convert_model_to_fp8_ao  # noqa: E402
from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torchao.float8 import Float8LinearConfig  # noqa: E402
from torchao.quantization import Int8WeightOnlyConfig, quantize_, to_nf4  # noqa: E402

import qdcp  # noqa: E402
from dist_helpers import all_rows, init_torchrun_mesh, training_state_items, uint8_all_gather  # noqa: E402
from quantized_cases import differences, inner  # noqa: E402
from worker_results import RANK, WORLD, check, record_outcome, run, short  # noqa: E402

CUDA = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if CUDA else torch.device("cpu")
STEPS = 2
KINDS = {"first.weight": "Tensor", "base.weight": "NF4Tensor", "middle.weight": "WeightWithDynamicFloat8CastTensor",
         "last.weight": "Int8Tensor", "states": ["OptimState8bit", "Tensor"]}
LAYERS = ("first", "base", "middle", "last")


class Base(nn.Linear):
    """A frozen linear layer whose weight may be an ``NF4Tensor`` (used through its bf16 values)."""

    def forward(self, x):
        w = self.weight
        return F.linear(x, w.get_original_weight() if hasattr(w, "get_original_weight") else w)


class Net(nn.Module):
    """first (trained, AdamW8bit), base (frozen NF4), middle (accelerate's float8 recipe), last
    (frozen int8); ``quantized=False``: the same layers unquantized."""

    def __init__(self, seed: int, quantized: bool = True):
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(64, 256)
        self.base = Base(256, 256, bias=False, dtype=torch.bfloat16)
        self.middle = nn.Linear(256, 256)
        self.last = nn.Linear(256, 32, dtype=torch.bfloat16)
        self.base.requires_grad_(False)
        self.last.requires_grad_(False)
        if quantized:
            self.base.weight = nn.Parameter(to_nf4(self.base.weight.detach()), requires_grad=False)
            emulate = not CUDA or torch.cuda.get_device_capability() < (8, 9)
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=emulate)
            convert_model_to_fp8_ao(self, config=config,
                                    module_filter_func=lambda module, fqn: fqn == "middle")
            quantize_(self.last, Int8WeightOnlyConfig(version=2))

    def forward(self, x):
        h = self.first(x).to(torch.bfloat16)
        h = self.middle((h + self.base(h)).float())
        return self.last(h.to(torch.bfloat16)).float()


def build(seed: int, mesh, quantized: bool = True):
    model = Net(seed, quantized).to(DEVICE)
    for part in (model.first, model.base, model.middle):
        fully_shard(part, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=set(model.last.parameters()))  # Int8Tensor: no aten.split
    if not CUDA:
        for part in (model.first, model.base, model.middle, model):
            part.set_custom_all_gather(uint8_all_gather())
    opt = torchao.optim.AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-2, block_size=256)
    return model, opt


def train(model, opt, steps: int) -> None:
    for i in range(steps):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * i + RANK)).to(DEVICE)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def plugin():
    return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")


# ----------------------------------------------------------------------------- what is compared
REPLICATED = {"qmap", "nf4", "scaler_mean"}  # AdamW8bit's code book, NF4's table and mean: whole in every piece


def values(t: torch.Tensor) -> torch.Tensor:
    """What a subclass stands for, by its library: NF4's ``get_original_weight``, the float8
    wrapper's high-precision ``_tensor``, the others' ``dequantize()``."""
    if hasattr(t, "get_original_weight"):
        return t.get_original_weight()
    return t._tensor if type(t).__name__ == "WeightWithDynamicFloat8CastTensor" else t.dequantize()


def snapshot(model: nn.Module, opt=None) -> dict[str, torch.Tensor]:
    """Whole values on every rank: plain tensors; every inner buffer of a subclass (the float8
    wrapper's ``_tensor``, NF4's and the int8 layer's buffers, the 8-bit states') and its values."""
    out: dict[str, torch.Tensor] = {}

    def add(key: str, t: torch.Tensor) -> None:
        sharded = isinstance(t, DTensor)
        local = t.to_local() if sharded else t
        parts = {"": local}
        if hasattr(local, "__tensor_flatten__"):
            parts = {**inner(local), "values": values(local)}
        for name, buf in parts.items():
            whole = all_rows(buf.detach()) if sharded and name not in REPLICATED else buf.detach().clone()
            out[f"{key}.{name}" if name else key] = whole.cpu()

    for key, v in training_state_items(model, opt):
        add(key, v)
    return out


def kinds(model: nn.Module, opt) -> dict:
    def local(t):
        return type(t.to_local() if isinstance(t, DTensor) else t).__name__
    out = {f"{k}.weight": local(getattr(model, k).weight) for k in LAYERS}
    out["states"] = sorted({local(v) for s in opt.state.values() for k, v in s.items() if k != "step"})
    return out


# ----------------------------------------------------------------------------- commands
def save(root: str, mesh) -> None:
    acc = Accelerator(cpu=not CUDA)
    model, opt = build(0, mesh)
    train(model, opt, STEPS)
    check("save", kinds(model, opt) == KINDS, f"trained with {kinds(model, opt)}")
    for kind in ("qdcp", "stock"):
        with qdcp.installed() if kind == "qdcp" else _nothing():
            save_fsdp_model(plugin(), acc, model, os.path.join(root, kind))
            save_fsdp_optimizer(plugin(), acc, opt, model, os.path.join(root, kind))
    ref = snapshot(model, opt)
    if RANK == 0:
        torch.save(ref, os.path.join(root, "ref.pt"))
    dist.barrier()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def resume(root: str, kind: str, acc) -> dict:
    """A fresh model and optimizer at WORLD ranks filled by accelerate's load functions."""
    model, opt = build(1, _mesh())
    before = dict(model.named_parameters())
    try:
        with qdcp.installed() if kind == "qdcp" else _nothing():
            load_fsdp_model(plugin(), acc, model, os.path.join(root, kind))
            load_fsdp_optimizer(plugin(), acc, opt, model, os.path.join(root, kind))
    except BaseException as e:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
        return {"error": f"{type(e).__name__}: {short(e)}"}
    ref = torch.load(os.path.join(root, "ref.pt"), weights_only=True)
    return {"error": None, "differ": differences(snapshot(model, opt), ref),
            "in_place": all(p is before[n] for n, p in model.named_parameters()), "kinds": kinds(model, opt)}


def resume_plain(root: str, kind: str, acc) -> dict:
    """The unquantized model at WORLD ranks filled by ``load_fsdp_model``: the weights that differ
    from the saved ones' values."""
    model, _ = build(1, _mesh(), quantized=False)
    try:
        with qdcp.installed() if kind == "qdcp" else _nothing():
            load_fsdp_model(plugin(), acc, model, os.path.join(root, kind))
    except BaseException as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {short(e)}"}
    ref = torch.load(os.path.join(root, "ref.pt"), weights_only=True)
    got = snapshot(model)
    want = {k: ref.get(f"{k}.values", ref.get(k)) for k in got}
    return {"error": None, "differ": differences(got, want)}


_MESH = []


def _mesh():
    return _MESH[0]


def load(root: str, mesh) -> None:
    _MESH.append(mesh)
    acc = Accelerator(cpu=not CUDA)
    seen = resume(root, "qdcp", acc)
    check("load", seen["error"] is None, f"load failed: {seen['error']}")
    if seen["error"] is None:
        check("load", not seen["differ"], f"differs from the saved state at {WORLD} ranks: {seen['differ']}")
        check("load", seen["in_place"], "load replaced a parameter")
        check("load", seen["kinds"] == KINDS, f"after load: {seen['kinds']}")
    plain = resume_plain(root, "qdcp", acc)
    check("load-plain", plain["error"] is None and not plain["differ"], f"plain model: {plain}")
    stock = {"resume": resume(root, "stock", acc), "plain": resume_plain(root, "stock", acc)}
    record_outcome(os.path.join(root, f"stock-{WORLD}.json"), stock)


if __name__ == "__main__":
    sys.exit(run({"save": save, "load": load}, lambda: init_torchrun_mesh(DEVICE)))
