"""The runtime's GPU path (NCCL, collectives on a side stream, record_stream), one rank per GPU.
Skipped on machines without CUDA, such as the CI runners."""

from __future__ import annotations

import pytest
import torch

import train_cases
from ranks import Ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def gpu_ranks():
    r = Ranks(torch.cuda.device_count(), backend="nccl")
    yield r
    r.close()


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_training_on_gpus_matches_the_unsharded_eager_run(gpu_ranks, inner):
    results = gpu_ranks.run(train_cases.train, "llama", inner, 256 * 1024, train_cases.BUCKETING_COST, 0,
                           train_cases.STEPS, "cuda")
    for r in results:
        for got, want in zip(r["loss"], r["ref_loss"]):
            assert got == pytest.approx(want, rel=1e-4)  # TF32 and other GPU kernels
        assert max(r["param_err"].values()) <= 1e-4
        assert r["gathered_between"] == [[]] * train_cases.STEPS
        assert r["model_grads"] == [[]] * train_cases.STEPS
        assert 0 < r["peak"] <= 256 * 1024
