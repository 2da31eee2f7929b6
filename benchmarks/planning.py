"""Planning time for many entries: qdcp's planners vs DCP's default planners (goal <= 1.5).

Plans (no I/O) a state dict of N small Int8Tensor entries (3 components each) with qdcp, and with
DCP's default planners the same state as plain tensors: the components as separate plain entries
(the same item count). Save: set_up_planner + create_local_plan + create_global_plan + finish_plan;
load: set_up_planner + create_local_plan + create_global_plan + finish_plan. Each run starts with no
garbage and ends with a timed ``gc.collect()`` (qdcp pauses the collector while planning; the pass
it skips is charged here).

    python benchmarks/planning.py [--entries 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

from common import compare, plain_twin
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner


def plan_save(planner, state):
    planner.set_up_planner(state, None, True)
    local = planner.create_local_plan()
    plans, md = planner.create_global_plan([local])
    planner.finish_plan(plans[0])
    return md


def plan_load(planner, state, md):
    planner.set_up_planner(state, md, True)
    local = planner.create_local_plan()
    plans = planner.create_global_plan([local])
    planner.finish_plan(plans[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from torchao.quantization import Int8Tensor, PerRow

    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": Int8Tensor.from_hp(torch.randn(32, 64, generator=g).bfloat16(), PerRow())
             for i in range(args.entries)}
    target = {k: Int8Tensor.from_hp(torch.randn(32, 64, generator=g).bfloat16(), PerRow()) for k in state}
    twin = plain_twin(state)
    twin_target = {k: torch.empty_like(v) for k, v in twin.items()}
    q_md = plan_save(QuantizedSavePlanner(), state)
    v_md = plan_save(DefaultSavePlanner(), twin)
    t = compare({
        "qdcp_save": (lambda: plan_save(QuantizedSavePlanner(), state), None),
        "dcp_save": (lambda: plan_save(DefaultSavePlanner(), twin), None),
        "qdcp_load": (lambda: plan_load(QuantizedLoadPlanner(), target, q_md), None),
        "dcp_load": (lambda: plan_load(DefaultLoadPlanner(), twin_target, v_md), None),
    }, args.repeat, sync=False, collect=True)
    print(f"entries={args.entries} items={len(twin)}")
    ratio = t['qdcp_save'] / t['dcp_save']
    print(f"save planning: qdcp {t['qdcp_save']:.3f}s  dcp {t['dcp_save']:.3f}s  ratio {ratio:.2f}")
    ratio = t['qdcp_load'] / t['dcp_load']
    print(f"load planning: qdcp {t['qdcp_load']:.3f}s  dcp {t['dcp_load']:.3f}s  ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
