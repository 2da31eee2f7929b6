"""Generated load-rule cases at FSDP2's own sharding, in a real job (``test_fsdp2_rule.py`` runs it).

    python -m torch.distributed.run --nproc-per-node N tests/fsdp2_rule_worker.py run DIR
    (QDCP_FSDP2_RULE_CASES / QDCP_FSDP2_RULE_SEED: how many cases, from which seed)

Each rank of a 1-3 rank gloo job draws the same cases (one seed): a torchao type and config (the
generator's families, most often those that hold a value once per tensor: per-tensor Int8 /
Float8 / NVFP4, NF4; and Intx with a float32 scale), a shape whose rows FSDP2 cuts evenly or not,
and a source: the weight of a ``fully_shard`` module (its DTensor spec and chunk FSDP2's own),
its local tensor cut from the whole quantized tensor by torchao's slicing or quantized from its own
rows; or the whole tensor saved from one process (rank 0, ``no_dist``). The source is saved with
``dcp.save`` + ``QuantizedSavePlanner``, ``qdcp.save`` or ``qdcp.async_save`` (raw, or
``dequantize=True``), and loaded into targets of every kind (the same config, another, plain, plain
float32) at FSDP2's sharding with ``dcp.load`` (DCP's reader or qdcp's) or ``qdcp.load``. Every
rank checks its target against the oracle of tests/rule_cases.py / rule_oracle.py (written from
docs/api.md): the source's bits, torchao's quantization of the values (a per-tensor value from the
whole tensor), the values bitwise; a save the rule refuses fails on every rank naming the key.
Failures are recorded in the section ``fsdp2_rule`` (tests/worker_results.py); the outcome counts
go to ``DIR/outcomes-N.json``.
"""

from __future__ import annotations

import os
import random
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import rule_cases as rc  # noqa: E402
import rule_ranks  # noqa: E402
from qdcp import QuantizedSavePlanner  # noqa: E402
from rule_cases import Layout  # noqa: E402
from worker_results import RANK, WORLD, check, record_outcome, run  # noqa: E402

SECTION = "fsdp2_rule"
CASES = int(os.environ.get("QDCP_FSDP2_RULE_CASES", "40"))  # per launch; rule_cases.py runs thousands
SEED = int(os.environ.get("QDCP_FSDP2_RULE_SEED", "20261202"))  # others: more cases from fresh seeds
# what the per-tensor classes need, drawn more often; every other family of the generator too
FOCUS = ("int8_tensor", "float8_tensor_e5m2", "nvfp4_per_tensor", "nf4_b16", "intx_int8_row_fp32")
OTHERS = tuple(sorted(n for n in rc.FAMILIES if n not in FOCUS and n not in rc.rule_te.FAMILIES))


class FSDP2Meshes(rule_ranks.Meshes):
    """rule_ranks' meshes, where a 1-D ``Shard(0)`` layout of this job's ranks is FSDP2's: the spec
    and chunk of the weight of a ``fully_shard`` module of that shape (a quantized local in its
    place, as FSDP2 holds one: ``DTensor(local, spec)``)."""

    def __init__(self) -> None:
        super().__init__()
        self._specs: dict = {}

    def _weight(self, shape, dtype) -> DTensor:
        key = (tuple(shape), dtype)
        if key not in self._specs:
            module = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=dtype)
            fully_shard(module, mesh=self.mesh((WORLD,)))
            self._specs[key] = module.weight
        return self._specs[key]

    def chunk(self, layout: Layout, shape, dtype) -> tuple:
        if layout != fsdp2():
            return super().chunk(layout, shape, dtype)
        c = self._weight(shape, dtype).__create_chunk_list__()[0]
        return tuple(c.offsets), tuple(c.sizes)

    def placed(self, layout: Layout, local: torch.Tensor, shape) -> dict:
        if layout != fsdp2():
            return super().placed(layout, local, shape)
        return {"w": DTensor(local, self._weight(shape, local.dtype)._spec, requires_grad=False)}


def fsdp2() -> Layout:
    return Layout((WORLD,), (Shard(0),))


def draw(rng: random.Random) -> tuple:
    """A case as rule_ranks draws one (family, rows, cols, seed, source layout, sliced?, targets), at
    FSDP2's sharding of this job's ranks or in one process."""
    name = rng.choice(FOCUS if rng.random() < 0.7 else OTHERS)
    target_layouts = [fsdp2()] + ([Layout((), ())] if WORLD == 1 else [])
    targets = [(rng.choice(target_layouts), kind, "cpu") for kind in rng.sample(rc.KINDS, rng.randint(1, 3))]
    source = fsdp2() if WORLD == 1 or rng.random() < 0.75 else Layout((), ())
    return (name, rng.choice([8, 10, 12, 16, 24]), rng.choice([64, 128, 256]), rng.randrange(2**16), source,
            rng.random() < 0.5, targets)


def one_process_case(meshes: FSDP2Meshes, drawn: tuple, path: str, tag: str) -> list[str]:
    """A source saved from one process (rank 0, ``dcp.save(no_dist=True)``), its targets at FSDP2's sharding."""
    name, rows, cols, seed, layout, sliced, targets = drawn
    shape = (rows, cols)
    source = rc.make_source(name, shape, seed, layout, sliced and rc.FAMILIES[name][0])
    if source is None:
        return ["no source"]
    source.dequantized = random.Random(seed * 7177).random() < rc.DEQUANTIZED_SHARE
    if RANK == 0:
        dcp.save({"w": source.locals[0][1]}, checkpoint_id=path, no_dist=True,
                 planner=QuantizedSavePlanner(dequantize=source.dequantized))
    dist.barrier()
    return [rule_ranks.check_target(meshes, source, path, t_layout, kind, device, seed + i, f"{tag}, target {i}")
            for i, (t_layout, kind, device) in enumerate(targets)]


def run_cases(root: str, mesh) -> None:
    check(SECTION, True, "")  # the section ran (it records only what fails)
    rule_ranks.SECTION = SECTION  # rule_ranks' checks record here
    meshes, counts = FSDP2Meshes(), {}
    rng = random.Random(SEED + WORLD)
    for i in range(CASES):
        drawn = draw(rng)
        tag = f"case {i} {drawn[:4]} saved at {drawn[4]}"
        path = os.path.join(root, f"case{i}")
        try:
            if drawn[4] == fsdp2():
                outcomes = rule_ranks.run_case(meshes, drawn, path, tag)
            else:
                outcomes = one_process_case(meshes, drawn, path, tag)
        except Exception as e:  # noqa: BLE001 (a check the helpers assert on every rank alike)
            rule_ranks._fail(tag, e)
            outcomes = ["error"]
        for o in outcomes:
            counts[o] = counts.get(o, 0) + 1
    record_outcome(os.path.join(root, f"outcomes-{WORLD}.json"), counts)


def _init() -> None:
    dist.init_process_group("gloo")  # (the meshes are FSDP2Meshes')


if __name__ == "__main__":
    sys.exit(run({"run": run_cases}, _init))
