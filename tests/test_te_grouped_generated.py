"""TE GroupedTensor (MoE experts) and its per-member keys, at generated expert counts.

docs/adapters.md: a group's members load from and into per-member keys ``<key>{offset + j}`` (TE's
``single_grouped_weight=False``), raw and bit-exact. The oracle: for 1 to 20 experts (so that
``weight1`` and ``weight10`` both exist), every recipe on TE's CPU classes and a drawn member shape,
a group saved whole loads member by member into single tensors holding member ``j``'s components
bit for bit (and into plain tensors holding its values, TE's own per-member dequantize); members
saved under their own keys load into a group whose members' components are theirs. And expert
parallelism at generated layouts: a group of 1-12 experts saved as ``Shard(0)`` of the stacked
``[n, M, N]`` tensor at 1-4 ranks (each rank a group of its experts) loads at another such layout
into groups holding those experts' components, and into plain ``Shard(0)`` stacks holding their
values (every rank planned and stored in this process, tests/dcp_in_process.py).
"""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import te_cpu

if not te_cpu.te_installed():
    pytest.skip("transformer_engine is not installed", allow_module_level=True)
te_cpu.install()
warnings.filterwarnings("ignore", message=".*Transformer Engine PyTorch extension.*")

from torch.distributed.tensor import Shard  # noqa: E402

import dcp_in_process as job  # noqa: E402
from dist_helpers import dtensor_from_local  # noqa: E402
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner  # noqa: E402
from qdcp.adapters import find_adapter  # noqa: E402
from quantized_cases import bits, components_diff, qdcp_load, qdcp_save  # noqa: E402
from te_groups import BY, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("hopper")


@settings(max_examples=25, deadline=None, derandomize=True, database=None, phases=(Phase.generate,),
          suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(sorted(n for n in BY if n != "nvfp4_row_scaled")), experts=st.integers(1, 20),
       shape=st.sampled_from([(32, 64), (64, 128), (128, 64)]), seed=st.integers(0, 1000))
def test_members_of_any_count_load_to_and_from_their_own_keys(name, experts, shape, seed):
    case = BY[name]
    src = case.build(seed, [shape] * experts, clean=True)
    members = find_adapter(src).members(src)
    with tempfile.TemporaryDirectory(prefix="qdcp-te-group-") as tmp:
        grouped = qdcp_save(f"{tmp}/group", {"layer.weight": src})
        targets = find_adapter(src).members(case.build(seed + 1, [shape] * experts))
        qdcp_load(grouped, {f"layer.weight{j}": t for j, t in enumerate(targets)})
        for j, (t, ref) in enumerate(zip(targets, members)):
            assert components_diff(t, ref) is None, f"member {j}: {components_diff(t, ref)}"
        plains = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(experts)]
        qdcp_load(grouped, {f"layer.weight{j}": t for j, t in enumerate(plains)})
        assert torch.equal(bits(torch.stack(plains)), bits(reference(src).reshape(experts, *shape)))

        apart = qdcp_save(f"{tmp}/members", {f"layer.weight{j}": m for j, m in enumerate(members)})
        dst = case.build(seed + 2, [shape] * experts)
        qdcp_load(apart, {"layer.weight": dst})
        for j, (got, ref) in enumerate(zip(find_adapter(dst).members(dst), members)):
            assert components_diff(got, ref) is None, f"member {j}: {components_diff(got, ref)}"


def experts_of(n: int, world: int, shape: tuple[int, int]) -> tuple[range, tuple]:
    """The current (fake) rank's experts under ``Shard(0)`` of ``[n, M, N]`` at ``world`` ranks."""
    probe = dtensor_from_local(torch.empty(0), job.mesh((world,)), (Shard(0),), (n, *shape), torch.bfloat16)
    chunk = probe.__create_chunk_list__()[0]
    return range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]), (n, *shape)


def group_of(name: str, glob, ids: range, shape, seed: int):
    """A group of the experts ``ids`` of ``glob`` (their canonical components copied in)."""
    g = BY[name].build(seed, [shape] * len(ids))
    a = find_adapter(g)
    a.copy_into(g, {n: c[ids.start:ids.stop] for n, c in a.components(glob).items()})
    return g


@settings(max_examples=40, deadline=None, derandomize=True, database=None, phases=(Phase.generate,),
          suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(sorted(n for n in BY if n != "nvfp4_row_scaled")), experts=st.integers(1, 12),
       shape=st.sampled_from([(32, 64), (64, 128)]), seed=st.integers(0, 1000),
       save_world=st.integers(1, 4), load_world=st.integers(1, 4))
def test_expert_parallel_groups_load_at_another_layout(name, experts, shape, seed, save_world, load_world):
    glob = BY[name].build(seed, [shape] * experts, clean=True)
    locals_ = []
    for rank in range(save_world):
        with job.as_rank(rank, save_world):
            ids, stacked = experts_of(experts, save_world, shape)
            if not ids:
                return  # a rank without experts: TE makes no empty group
            locals_.append(dtensor_from_local(group_of(name, glob, ids, shape, seed + 7), job.mesh((save_world,)),
                                              (Shard(0),), stacked, torch.bfloat16))
    metadata, store = job.save(lambda rank: {"layer.weight": locals_[rank]}, save_world, QuantizedSavePlanner)
    values = reference(glob)
    for rank in range(load_world):
        with job.as_rank(rank, load_world):
            ids, stacked = experts_of(experts, load_world, shape)
            if not ids:
                continue  # nothing for this rank to load
            mesh = job.mesh((load_world,))
            target = BY[name].build(seed + 11, [shape] * len(ids))
            plain = torch.zeros((len(ids), *shape), dtype=torch.bfloat16)
            for local in (target, plain):
                state = {"layer.weight": dtensor_from_local(local, mesh, (Shard(0),), stacked, torch.bfloat16)}
                job.load(state, rank, load_world, metadata, store, QuantizedLoadPlanner())
            want = group_of(name, glob, ids, shape, seed + 13)
            diff = components_diff(target, want)
            assert diff is None, f"rank {rank} of {load_world}, experts {list(ids)}: {diff}"
            assert torch.equal(bits(plain), bits(values[ids.start:ids.stop])), f"rank {rank}: not the experts' values"
