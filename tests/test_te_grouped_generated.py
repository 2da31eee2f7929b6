"""TE GroupedTensor (MoE experts) and its per-member keys, at generated expert counts.

docs/adapters.md: a group's members load from and into per-member keys ``<key>{offset + j}`` (TE's
``single_grouped_weight=False``), raw and bit-exact. The oracle: for 1 to 20 experts (so that
``weight1`` and ``weight10`` both exist), every recipe on TE's CPU classes and a drawn member shape,
a group saved whole loads member by member into single tensors holding member ``j``'s components
bit for bit (and into plain tensors holding its values, TE's own per-member dequantize); members
saved under their own keys load into a group whose members' components are theirs.
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

from qdcp.adapters import find_adapter  # noqa: E402
from quantized_cases import bits, qdcp_load, qdcp_save  # noqa: E402
from te_groups import BY, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("hopper")


def same_components(a: torch.Tensor, b: torch.Tensor) -> bool:
    ca, cb = find_adapter(a).components(a), find_adapter(b).components(b)
    return ca.keys() == cb.keys() and all(torch.equal(bits(ca[k]), bits(cb[k])) for k in ca)


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
            assert torch.equal(bits(t), bits(ref)) if name == "bf16" else same_components(t, ref), f"member {j}"
        plains = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(experts)]
        qdcp_load(grouped, {f"layer.weight{j}": t for j, t in enumerate(plains)})
        assert torch.equal(bits(torch.stack(plains)), bits(reference(src).reshape(experts, *shape)))

        apart = qdcp_save(f"{tmp}/members", {f"layer.weight{j}": m for j, m in enumerate(members)})
        dst = case.build(seed + 2, [shape] * experts)
        qdcp_load(apart, {"layer.weight": dst})
        for j, (got, ref) in enumerate(zip(find_adapter(dst).members(dst), members)):
            assert torch.equal(bits(got), bits(ref)) if name == "bf16" else same_components(got, ref), f"member {j}"
