"""The load rule of docs/api.md (*When a target gets the source's bits*), on generated cases.

Each case (tests/rule_cases.py) is a torchao type and config saved at a generated layout and loaded
at up to three generated layouts and target kinds, every rank planned and stored in this process
through qdcp's real planners, and checked against tests/rule_oracle.py, which is written from the
docs, not from qdcp's decisions: the source's bits, torchao's quantization of the values, the
values into a plain target, or a save refused naming the key. Cases are derandomized (the same in
every run); ``tests/rule_cases.py --cases N --seed S`` runs others. Each test prints how many
targets ended in each outcome.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rule_cases

CASES_PER_TEST = 1100
# two halves of the families, so two workers share the cases
HALVES = {"affine": ["float8_row", "int8_group32", "int8_row", "intx_int4_group32"],
          "block_scaled_and_optimizer": ["mx_fp8", "nvfp4", "optim8bit_signed"]}


@pytest.mark.parametrize("half", sorted(HALVES))
def test_every_generated_case_follows_the_rule(half, record_property):
    outcomes = collections.Counter()

    @settings(rule_cases.settings_for(CASES_PER_TEST), derandomize=True)
    @given(rule_cases.case_strategy(st.sampled_from(HALVES[half])))
    def check(case):
        outcomes.update(rule_cases.run_case(*case))

    check()
    print(dict(outcomes))
    record_property("outcomes", dict(outcomes))
    # the generator reaches every outcome the rule has, in each half
    for outcome in ("bits", "quantized", "plain", "refused at save"):
        assert outcomes[outcome] > 0, (outcome, dict(outcomes))
    assert sum(n for k, n in outcomes.items() if not k.startswith("no ")) >= 900, dict(outcomes)
