"""Code that torch.compile skipped (docs/design.md §4, mode 7): parameters gathered on access,
tracked, released after their backward use, gradients reduced into the shards."""

from __future__ import annotations

import pytest

import fallback_cases

SKIPPED = ["skipped.lin.bias", "skipped.lin.weight"]


def test_a_skipped_submodule_trains_through_the_fallback(ranks):
    for r in ranks.run(fallback_cases.train, True):
        for step, (got, want) in enumerate(zip(r["loss"], r["ref_loss"])):
            assert got == pytest.approx(want, rel=1e-5), f"step {step}"
        worst = max(r["param_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, f"{worst[0]} differs from the reference by {worst[1]:.2e}"
        # The fallback gathered exactly the skipped module's parameters, once per step...
        assert r["fallback_gathers"] == len(SKIPPED) * fallback_cases.STEPS
        # ...kept them through the forward for the backward...
        assert r["tracked_after_forward"] == [SKIPPED] * fallback_cases.STEPS
        # ...and released them once the backward had used them.
        assert r["tracked_between"] == [[]] * fallback_cases.STEPS
        assert r["gathered_between"] == [[]] * fallback_cases.STEPS


def test_without_the_fallback_the_skipped_submodule_reads_freed_parameters(ranks):
    with pytest.raises(AssertionError, match="out of bounds for storage of size 0"):
        ranks.run(fallback_cases.train, False)
