"""The backend's schedule cache and its cross-rank agreement check (debug mode)."""

from __future__ import annotations

import backend_cases


def test_ranks_that_reach_different_schedules_raise_instead_of_hanging(ranks):
    for msg in ranks.run(backend_cases.disagreeing_ranks):
        assert msg.endswith("_0`: the ranks reached different schedules (hashes differ)"), msg


def test_a_graph_compiled_again_is_scheduled_from_the_cache(ranks):
    for hits in ranks.run(backend_cases.cache_hits):
        assert hits == [0, 2]  # the forward and the backward graph
