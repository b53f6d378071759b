"""The named backend: ``torch.compile(backend="zerosched")`` and transformers' ``Trainer``, on
two gloo ranks against unsharded eager; where its options come from."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import zerosched
from zerosched import named

import named_cases


@pytest.fixture
def clean_options(monkeypatch):
    monkeypatch.delenv(named.ENV, raising=False)
    saved = dict(named._configured)
    named._configured.clear()
    yield monkeypatch
    named._configured.clear()
    named._configured.update(saved)


def test_dynamo_knows_the_name():
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("zerosched") is named.compile_graph


def test_options_come_from_the_environment_then_configure_then_torch_compile(clean_options):
    clean_options.setenv(named.ENV, '{"scheduler": "jit", "budget": 1000}')
    assert named.current_options() == {"scheduler": "jit", "budget": 1000}
    zerosched.configure(budget="1MiB", inner="eager")
    assert named.current_options() == {"scheduler": "jit", "budget": "1MiB", "inner": "eager"}
    zerosched.configure(inner=None)
    assert named.current_options() == {"scheduler": "jit", "budget": "1MiB"}


@pytest.mark.parametrize("bad,message", [
    ('{"budjet": 1}', "unknown backend option(s) ['budjet']"),
    ("[1]", "must be an object, not list"),
    ("{", "not JSON"),
])
def test_a_bad_environment_variable_is_refused_naming_it(clean_options, bad, message):
    clean_options.setenv(named.ENV, bad)
    with pytest.raises(zerosched.ZeroschedError, match=named.ENV) as e:
        named.current_options()
    assert message in str(e.value)


def test_configure_refuses_bad_options_at_once(clean_options):
    with pytest.raises(zerosched.ZeroschedError, match="unknown backend option"):
        zerosched.configure(schedular="jit")
    with pytest.raises(zerosched.ZeroschedError, match="inner must be one of"):
        zerosched.configure(inner="tvm")
    assert named.current_options() == {}


def test_inductor_modes_are_refused_by_the_named_backend():
    with pytest.raises(zerosched.ZeroschedError, match="mode='max-autotune' is Inductor's"):
        named.compile_graph(torch.fx.symbolic_trace(torch.nn.Identity()), [], mode="max-autotune")


def _check_trained(r0, r1, rtol):
    assert r0["loss"] == r1["loss"]
    assert len(r0["loss"]) == named_cases.STEPS
    for got, want in zip(r0["loss"], r0["ref_loss"]):
        assert got == pytest.approx(want, rel=rtol)
    for r in (r0, r1):
        assert r["graphs"] >= 2, "the backend must have scheduled the forward and the backward"
        assert r["param_err"] <= 1e-5
        assert r["gathered_between"] == []


@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_torch_compile_by_name_with_options_trains_as_eager(ranks, zero):
    """``zero="model"``: a loop that calls the compiled model's ``zero_grad()`` (as ``Trainer``
    does), which never reaches the shards; the runtime clears them after the optimizer's step."""
    r0, r1 = ranks.run(named_cases.train_by_name, {"debug": True, "budget": "64KiB", "scheduler": "prefetch"}, zero)
    _check_trained(r0, r1, 1e-5)


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="transformers' Trainer needs accelerate, which python/requirements.txt does not pin")
def test_transformers_trainer_with_torch_compile_backend_zerosched(ranks):
    r0, r1 = ranks.run(named_cases.train_with_trainer)
    # The Trainer logs each step's loss rounded to four digits.
    _check_trained(r0, r1, 1e-3)
