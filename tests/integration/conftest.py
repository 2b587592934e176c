"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from sglang_swift.testing.peer_process import SimGroup


@pytest.fixture
def sims():
    """Simulated control agents in their own processes; all of them end with the test."""
    group = SimGroup()
    try:
        yield group
    finally:
        group.close()


def event(name: str, **match):
    """A predicate on a simulated agent's event: its name and the given fields."""
    return lambda e: e["ev"] == name and all(e.get(k) == v for k, v in match.items())
