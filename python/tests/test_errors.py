"""Bad use of the backend and the runtime gets zerosched's exceptions with clear messages."""

from __future__ import annotations

import pytest
import torch

import error_cases
import zerosched


def test_compiling_a_model_that_was_not_sharded():
    kind, msg = error_cases.not_sharded()
    assert kind == "ZeroschedError"
    assert "graph input `" in msg and "that zerosched.shard() has not sharded" in msg


def test_one_graph_over_parameters_of_different_world_sizes(ranks):
    for kind, msg in ranks.run(error_cases.mixed_world_sizes):
        assert kind == "ZeroschedError"
        assert "sharded over different world sizes [1, 2]" in msg


def test_a_graph_the_exporter_cannot_represent(ranks):
    for kind, msg in ranks.run(error_cases.unrepresentable):
        assert kind == "ExportError"
        assert msg.startswith("graph 'forward_0', node 'true_graph_0': get_attr of a submodule"), msg
        assert "cannot be represented in fx-graph v1" in msg


def test_sharding_a_parameter_twice(ranks):
    for msg in ranks.run(error_cases.shard_twice):
        assert msg == "zerosched.shard: parameter `weight` is already sharded"


def test_shard_without_a_process_group():
    with pytest.raises(zerosched.ZeroschedError, match="torch.distributed is not initialized"):
        zerosched.shard(torch.nn.Linear(2, 2))


def test_a_bad_backend_option():
    with pytest.raises(zerosched.ZeroschedError, match="inner must be one of"):
        zerosched.backend(inner="cudagraphs")
    with pytest.raises(zerosched.ZeroschedError, match="scheduler"):
        zerosched.backend(scheduler="greedy")
