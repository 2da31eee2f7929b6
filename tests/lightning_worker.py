"""The script every ``torchrun`` rank runs for ``tests/test_framework_lightning.py``.

    python -m torch.distributed.run --nproc-per-node N tests/lightning_worker.py COMMAND DIR

Lightning's real ``ModelParallelStrategy`` (FSDP2), in Fabric and in the Trainer, with qdcp's
strategies (``qdcp.frameworks.lightning``) and with Lightning's own. The model: a trained fp32
layer (torchao's ``AdamW8bit``: its states are ``OptimState8bit`` DTensors), a frozen QLoRA-style
``NF4Tensor`` weight (sharded by FSDP2) and a frozen bf16 layer quantized by
``Int8WeightOnlyConfig`` (an ``Int8Tensor``, kept whole on every rank by ``ignored_params``:
torchao's ``Int8Tensor`` has no ``aten.split``, so ``fully_shard`` cannot shard it).

Commands (KIND = ``qdcp`` for qdcp's strategies, ``stock`` for Lightning's):

- ``save`` (2 ranks): ``fabric.save(path, state)`` after one training step and again, to the same
  path, after the second (``fabric-KIND``); a Trainer fit of two steps whose ``ModelCheckpoint``
  writes ``step=1.ckpt``, ``step=2.ckpt`` and ``last.ckpt`` after each (``trainer-KIND-mc``), then
  ``trainer.save_checkpoint`` (``trainer-KIND``). Rank 0 writes the whole weights, inner buffers,
  dequantized values and optimizer states (``ref-*.pt``). Sections ``save-fabric``, ``save-trainer``.
- ``load`` (any N): fresh models (other weights, no optimizer state yet: torchao's ``NF4Tensor``
  cannot run FSDP2's forward at one rank, its ``fsdp_post_all_gather`` unpacks 3 buffers from 1) at N ranks resumed by
  ``fabric.load`` and by ``trainer.fit(ckpt_path=...)`` (``trainer-KIND`` and ``last.ckpt``), and an
  unquantized model filled by ``fabric.load``. With qdcp's strategies, sections ``load-fabric``,
  ``load-trainer``, ``load-trainer-mc`` (every inner buffer, dequantized value, optimizer state
  and the step bit-exact, parameters filled in place) and ``load-plain`` (every weight equal to
  torchao's ``dequantize()`` of the saved one, in the target's dtype); with Lightning's own, what
  happens is written to ``stock-N.json`` for the test to assert.
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
from torch.nn import functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytorch_lightning as pl  # noqa: E402
import torchao.optim  # noqa: E402
from lightning_fabric import Fabric  # noqa: E402
from lightning_fabric.strategies import ModelParallelStrategy as FabricStock  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from pytorch_lightning.strategies import ModelParallelStrategy as TrainerStock  # noqa: E402
from torchao.quantization import Int8WeightOnlyConfig, quantize_, to_nf4  # noqa: E402

from dist_helpers import all_rows, init_torchrun_mesh, training_state_items  # noqa: E402
from qdcp.frameworks.lightning import QuantizedFabricStrategy, QuantizedTrainerStrategy  # noqa: E402
from quantized_cases import differences, inner  # noqa: E402
from worker_results import RANK, WORLD, check, record_outcome, run, short  # noqa: E402

CUDA = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if CUDA else torch.device("cpu")
ACCELERATOR = "cuda" if CUDA else "cpu"
STEPS = 2
STRATEGIES = {"fabric": {"qdcp": QuantizedFabricStrategy, "stock": FabricStock},
              "trainer": {"qdcp": QuantizedTrainerStrategy, "stock": TrainerStock}}


class Base(nn.Linear):
    """A frozen linear layer whose weight may be an ``NF4Tensor`` (used through its bf16 values)."""

    def forward(self, x):
        w = self.weight
        return F.linear(x, w.get_original_weight() if hasattr(w, "get_original_weight") else w)


class Net(nn.Module):
    """A trained fp32 layer, a frozen NF4 weight (QLoRA's base), a frozen int8 weight-only layer;
    ``quantized=False``: the same model unquantized (bf16 frozen weights)."""

    def __init__(self, seed: int, quantized: bool = True):
        super().__init__()
        torch.manual_seed(seed)
        self.trained = nn.Linear(64, 256)
        self.base = Base(256, 256, bias=False, dtype=torch.bfloat16)
        self.frozen = nn.Linear(256, 64, dtype=torch.bfloat16)
        if quantized:
            self.base.weight = nn.Parameter(to_nf4(self.base.weight.detach()))
            quantize_(self.frozen, Int8WeightOnlyConfig(version=2))
        self.base.requires_grad_(False)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = self.trained(x).to(torch.bfloat16)
        return self.frozen(h + self.base(h)).float()


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """FSDP2 over the data-parallel mesh; the int8 layer stays whole on every rank."""
    fully_shard(model.trained, mesh=mesh)
    fully_shard(model.base, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=set(model.frozen.parameters()))
    return model


def optimizer(params):
    return torchao.optim.AdamW8bit([p for p in params if p.requires_grad], lr=1e-2, block_size=256)


def batch(i: int) -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * i + RANK)).to(DEVICE)


def strategy(framework: str, kind: str):
    cls = STRATEGIES[framework][kind]
    if framework == "fabric":
        return cls(parallelize_fn=lambda m, mesh: parallelize(m, mesh["data_parallel"]),
                   data_parallel_size=WORLD, tensor_parallel_size=1)
    return cls(data_parallel_size=WORLD, tensor_parallel_size=1)


# ----------------------------------------------------------------------------- what is compared
# inner buffers every Shard(0) piece holds whole: AdamW8bit's code book, NF4's lookup table and mean
REPLICATED = {"qmap", "nf4", "scaler_mean"}


def _whole(name: str, buf: torch.Tensor, sharded: bool) -> torch.Tensor:
    # a Shard(0) tensor's rows, and its blocks (row-major), concatenate in rank order
    return all_rows(buf.detach()) if sharded and name not in REPLICATED else buf.detach().clone()


def dequantized(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torchao's own dequantization: NF4's ``get_original_weight``, the others' ``dequantize``
    (computed in ``dtype`` where the class takes an ``output_dtype``)."""
    if hasattr(t, "get_original_weight"):
        out = t.get_original_weight()
    else:
        out = t.dequantize(output_dtype=dtype) if dtype is not None and type(t).__name__ == "Int8Tensor" \
            else t.dequantize()
    return out if dtype is None else out.to(dtype)


def snapshot(model: nn.Module, opt=None) -> dict[str, torch.Tensor]:
    """Whole values on every rank: plain weights, every inner buffer of a quantized tensor, its
    values dequantized by torchao (in its dtype and in float32), the optimizer states and steps."""
    out: dict[str, torch.Tensor] = {}

    def add(key: str, t: torch.Tensor) -> None:
        sharded = isinstance(t, DTensor)
        local = t.to_local() if sharded else t
        if hasattr(local, "__tensor_flatten__"):
            for name, buf in inner(local).items():
                out[f"{key}.{name}"] = _whole(name, buf, sharded)
            out[f"{key}.dequantized"] = _whole("", dequantized(local), sharded)
            out[f"{key}.float32"] = _whole("", dequantized(local, torch.float32), sharded)
        else:
            out[key] = _whole("", local, sharded)

    for key, v in training_state_items(model, opt):
        add(key, v)
    return out


KINDS = {"base": "NF4Tensor", "frozen": "Int8Tensor", "states": ["OptimState8bit", "Tensor"]}


def kinds(model: nn.Module, opt) -> dict:
    """The tensor classes of the frozen weights and (but steps) the optimizer states; AdamW8bit
    keeps a small tensor's states (the bias's) plain."""
    base = model.base.weight
    states = sorted({type(v.to_local()).__name__ for s in opt.state.values() for k, v in s.items()
                     if k != "step" and isinstance(v, DTensor)})
    return {"base": type(base.to_local() if isinstance(base, DTensor) else base).__name__,
            "frozen": type(model.frozen.weight).__name__, "states": states}


# ----------------------------------------------------------------------------- Fabric
def fabric_for(kind: str) -> Fabric:
    fabric = Fabric(accelerator=ACCELERATOR, devices=WORLD, strategy=strategy("fabric", kind))
    fabric.launch()
    return fabric


def fabric_model(fabric: Fabric, seed: int, steps: int):
    model = fabric.setup_module(Net(seed))
    opt = fabric.setup_optimizers(optimizer(model.parameters()))
    for i in range(steps):
        fabric.backward(model(batch(i)).square().mean())
        opt.step()
        opt.zero_grad()
    return model, opt


def fabric_save(root: str, kind: str) -> None:
    fabric = fabric_for(kind)
    model, opt = fabric_model(fabric, 0, STEPS - 1)
    path = os.path.join(root, f"fabric-{kind}")
    fabric.save(path, {"model": model, "optimizer": opt, "step": STEPS - 1})
    fabric.backward(model(batch(STEPS - 1)).square().mean())
    opt.step()
    opt.zero_grad()
    fabric.save(path, {"model": model, "optimizer": opt, "step": STEPS})  # written over, as Lightning does
    ref = snapshot(model, opt)
    check("save-fabric", kinds(model, opt) == KINDS,
          f"{kind}: trained with {kinds(model, opt)}")
    if RANK == 0:
        torch.save(ref, os.path.join(root, f"ref-fabric-{kind}.pt"))


def fabric_load(root: str, kind: str) -> dict:
    """Fresh model and optimizer at WORLD ranks, ``fabric.load``; what came of it."""
    fabric = fabric_for(kind)
    model, opt = fabric_model(fabric, 1, 0)  # its states made by the load (no forward: see load())
    before = dict(model.named_parameters())
    state = {"model": model, "optimizer": opt, "step": 0}
    try:
        fabric.load(os.path.join(root, f"fabric-{kind}"), state)
    except BaseException as e:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
        return {"error": f"{type(e).__name__}: {short(e)}"}
    return outcome(root, f"fabric-{kind}", model, opt, before, {"step": state["step"]})


def fabric_load_plain(root: str, kind: str) -> dict:
    """The unquantized model at WORLD ranks filled by ``fabric.load`` from the quantized checkpoint:
    the weights that differ from torchao's dequantized values (in the weight's dtype)."""
    fabric = fabric_for(kind)
    model = fabric.setup_module(Net(1, quantized=False))
    try:
        fabric.load(os.path.join(root, f"fabric-{kind}"), {"model": model})
    except BaseException as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {short(e)}"}
    ref = torch.load(os.path.join(root, f"ref-fabric-{kind}.pt"), weights_only=True)
    got = snapshot(model)
    want = {}
    for k, v in got.items():  # a quantized entry's values in the target's dtype, else the saved tensor
        want[k] = ref.get(f"{k}.float32" if v.dtype == torch.float32 else f"{k}.dequantized", ref.get(k))
    return {"error": None, "differ": differences(got, want), "dtypes": {k: str(v.dtype) for k, v in got.items()}}


def outcome(root: str, ref_name: str, model, opt, before: dict, extra: dict) -> dict:
    ref = torch.load(os.path.join(root, f"ref-{ref_name}.pt"), weights_only=True)
    same_objects = all(p is before[n] for n, p in model.named_parameters())
    return {"error": None, "differ": differences(snapshot(model, opt), ref), "in_place": same_objects,
            "kinds": kinds(model, opt), **extra}


# ----------------------------------------------------------------------------- Trainer
class LitNet(pl.LightningModule):
    def __init__(self, seed: int):
        super().__init__()
        self.net = Net(seed)

    def configure_model(self):
        parallelize(self.net, self.device_mesh["data_parallel"])

    def configure_optimizers(self):
        return optimizer(self.parameters())

    def training_step(self, batch, i):
        return self.net(batch[0]).square().mean()

    def train_dataloader(self):
        data = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)


def trainer_for(kind: str, callbacks=()) -> pl.Trainer:
    return pl.Trainer(accelerator=ACCELERATOR, devices=WORLD, strategy=strategy("trainer", kind), max_steps=STEPS,
                      callbacks=list(callbacks), logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=bool(callbacks), num_sanity_val_steps=0)


def trainer_save(root: str, kind: str) -> None:
    mc = ModelCheckpoint(dirpath=os.path.join(root, f"trainer-{kind}-mc"), filename="{step}",
                         every_n_train_steps=1, save_top_k=-1, save_last=True)  # last.ckpt: written over
    trainer = trainer_for(kind, [mc])
    lit = LitNet(0)
    trainer.fit(lit)
    trainer.save_checkpoint(os.path.join(root, f"trainer-{kind}"))
    opt = trainer.optimizers[0]
    ref = snapshot(lit.net, opt)
    check("save-trainer", kinds(lit.net, opt) == KINDS,
          f"{kind}: trained with {kinds(lit.net, opt)}")
    wrote = sorted(os.listdir(mc.dirpath)) if os.path.isdir(mc.dirpath) else None
    check("save-trainer", wrote == ["last.ckpt", "step=1.ckpt", "step=2.ckpt"],
          f"{kind}: ModelCheckpoint wrote {wrote}")
    if RANK == 0:
        torch.save(ref, os.path.join(root, f"ref-trainer-{kind}.pt"))


def trainer_load(root: str, kind: str, path: str) -> dict:
    """A fresh module resumed by ``trainer.fit(ckpt_path=path)`` at WORLD ranks (its ``max_steps``
    already reached: the restored state is what the fit leaves); what came of it."""
    params: dict = {}

    class Resumed(LitNet):
        def on_fit_start(self):  # sharded, not yet restored: the parameters a load must fill
            params.update(self.net.named_parameters())

    trainer = trainer_for(kind)
    lit = Resumed(1)
    try:
        trainer.fit(lit, ckpt_path=path)
    except BaseException as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {short(e)}"}
    return outcome(root, f"trainer-{kind}", lit.net, trainer.optimizers[0], params,
                   {"step": trainer.global_step})


# ----------------------------------------------------------------------------- commands
def save(root: str, mesh) -> None:
    for kind in ("qdcp", "stock"):
        fabric_save(root, kind)
        trainer_save(root, kind)
    dist.barrier()


def _expect_exact(section: str, seen: dict) -> None:
    check(section, seen["error"] is None, f"load failed: {seen['error']}")
    if seen["error"] is None:
        check(section, not seen["differ"], f"differs from the saved state at {WORLD} ranks: {seen['differ']}")
        check(section, seen["step"] == STEPS, f"step {seen['step']} after load")
        check(section, seen["in_place"], "load replaced a parameter")
        check(section, seen["kinds"] == KINDS,
              f"after load: {seen['kinds']}")


def load(root: str, mesh) -> None:
    _expect_exact("load-fabric", fabric_load(root, "qdcp"))
    plain = fabric_load_plain(root, "qdcp")
    check("load-plain", plain["error"] is None and not plain["differ"], f"plain model: {plain}")
    _expect_exact("load-trainer", trainer_load(root, "qdcp", os.path.join(root, "trainer-qdcp")))
    last = os.path.join(root, "trainer-qdcp-mc", "last.ckpt")
    _expect_exact("load-trainer-mc", trainer_load(root, "qdcp", last))
    stock = {"fabric": fabric_load(root, "stock"),
             "trainer": trainer_load(root, "stock", os.path.join(root, "trainer-stock")),
             "plain": fabric_load_plain(root, "stock")}
    record_outcome(os.path.join(root, f"stock-{WORLD}.json"), stock)


if __name__ == "__main__":
    sys.exit(run({"save": save, "load": load}, lambda: init_torchrun_mesh(DEVICE)))
