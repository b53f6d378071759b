"""The runtime's gathers and bucketed gradient reductions on two gloo ranks, called directly."""

from __future__ import annotations

import pytest

import runtime_cases


def test_a_bucket_of_gathers_gives_the_full_parameters_and_releases_free_them(ranks):
    for r in ranks.run(runtime_cases.gather_wait_release):
        assert r["equal"] == {"a": True, "b": True, "c": True}
        assert r["held"] == (8 + 16 + 12) * 4  # padded to a multiple of two ranks, float32
        assert r["after"] == 0
        assert r["freed"] == [0, 0, 0]


# Gradients of 48, 8, 60 and 28 bytes, in that order: a bucket of at least their sum issues one
# reduce-scatter and one all-reduce (the persistent bias) at the end of the backward; 0 issues each
# reduction on its own; 64 bytes issues the first three (116 bytes) when the third arrives, the
# fourth at the end.
@pytest.mark.parametrize("bucket,reduce_scatters,all_reduces", [(1 << 20, 1, 1), (0, 3, 1), (64, 2, 1)])
def test_gradients_queued_into_buckets_average_into_the_shards(ranks, bucket, reduce_scatters, all_reduces):
    for r in ranks.run(runtime_cases.reductions, bucket):
        assert max(r["err"].values()) == 0.0, r["err"]
        assert r["counts"] == {"_reduce_scatter": 2 * reduce_scatters, "_all_reduce": 2 * all_reduces}
        assert r["queued"] == 0 and r["in_flight"] == 0
