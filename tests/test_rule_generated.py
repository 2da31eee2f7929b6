"""The load rule of docs/api.md (*When a target gets the source's bits*), on generated cases.

Each case (tests/rule_cases.py) is a type and config (torchao's affine types per row, group and
tensor, symmetric and asymmetric, float8 e4m3 and e5m2; MX fp8 / fp4 and NVFP4 with and without a
per-tensor scale, scales swizzled or not; NF4, low-bit optimizer states, float8 training weights;
TransformerEngine's Float8 and MXFP8 where TE is installed) saved at a generated layout and loaded
at up to three generated layouts and target kinds, every rank planned and stored in this process
through qdcp's real planners, and checked against tests/rule_oracle.py, which is written from the
docs, not from qdcp's decisions: the source's bits, torchao's quantization of the values, the
values into a plain target (into a float32 one, the library's own float32 values), or a save
refused naming the key. A quarter of the cases go through
real files and qdcp's reader, and are loaded again with a flipped stored byte (refused, nothing
changed). Cases are derandomized (the same in
every run); ``tests/rule_cases.py --cases N --seed S`` runs others. Each test prints how many
targets ended in each outcome.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rule_cases

# the families in three parts (cases each), so two workers share them; NF4 is slow to quantize
# (torchao's to_nf4 on CPU), so its part is smaller. TE's families run where TE is installed.
PARTS = {
    "affine": (["float8_row", "float8_tensor_e5m2", "int8_asym_row", "int8_group32", "int8_row", "int8_tensor",
                "intx_int4_group32", "intx_int4_group32_asym", "intx_int8_group32", "intx_int8_row_fp32"], 950),
    "block_scaled_and_optimizer": (["mx_fp4", "mx_fp4_swizzled", "mx_fp8", "mx_fp8_e5m2_swizzled", "nvfp4",
                                    "nvfp4_per_tensor", "nvfp4_per_tensor_swizzled", "nvfp4_swizzled", "optim4bit",
                                    "optim8bit_signed", "optimfp8"], 950),
    "nf4_training_te": (["float8_training", "nf4_b16", *sorted(rule_cases.rule_te.FAMILIES)], 400),
}


@pytest.mark.parametrize("part", sorted(PARTS))
def test_every_generated_case_follows_the_rule(part, record_property):
    outcomes = collections.Counter()
    families, cases = PARTS[part]

    @settings(rule_cases.settings_for(cases), derandomize=True)
    @given(rule_cases.case_strategy(st.sampled_from(families)))
    def check(case):
        outcomes.update(rule_cases.run_case(*case))

    check()
    print(dict(outcomes))
    record_property("outcomes", dict(outcomes))
    # the generator reaches every outcome the rule has, in each part
    for outcome in ("bits", "quantized", "plain", "refused at save", "refused: corrupt byte"):
        assert outcomes[outcome] > 0, (outcome, dict(outcomes))
    if part != "nf4_training_te":  # float32 plain targets of bfloat16 torchao tensors (NF4's has no output dtype)
        assert outcomes["wide"] > 0, dict(outcomes)
    if rule_cases.rule_te.FAMILIES and part == "nf4_training_te":
        assert outcomes["refused at load"] > 0, dict(outcomes)
    assert sum(n for k, n in outcomes.items() if not k.startswith("no ")) >= 0.8 * cases, dict(outcomes)
