"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from ranks import Ranks


@pytest.fixture(scope="session")
def ranks():
    """Two processes in one gloo process group, started once for every test that needs them."""
    r = Ranks(2)
    yield r
    r.close()
