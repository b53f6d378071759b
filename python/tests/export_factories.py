"""Factories for ``python -m zerosched.export --module export_factories:NAME`` (test_export.py)."""

from __future__ import annotations

import torch


class TwoTower(torch.nn.Module):
    """Two inputs through a shared embedding, a keyword argument, and a loss of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 1, bias=False)

    def forward(self, left: torch.Tensor, right: torch.Tensor, target: torch.Tensor | None = None) -> dict:
        a = self.proj(self.embed(left)).mean(1)
        b = self.proj(self.embed(right)).mean(1)
        score = self.head(torch.tanh(a * b)).squeeze(-1)
        return {"score": score, "loss": torch.nn.functional.mse_loss(score, target)}


def two_tower_batch():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batch = {"left": torch.randint(0, 32, (4, 6), generator=g), "right": torch.randint(0, 32, (4, 6), generator=g),
             "target": torch.randn(4, generator=g)}
    return TwoTower(), batch


def mlp_step():
    """A step function: the factory says how the loss is made."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))

    def step(m: torch.nn.Module) -> None:
        (m(x) - x).pow(2).mean().backward()

    return model, step


def logits_only():
    """A batch whose output is no loss: the exporter must say so."""
    return torch.nn.Linear(4, 4), torch.randn(2, 4)
