"""Fixtures for every tier. Helpers that tests call directly are plain modules beside this one:
tests/fakes.py (fake clock, SyncerCore factory), tests/waits.py (bounded polling), tests/ports.py
(local ports), tests/browser.py and tests/promtool.py (external tools)."""

from __future__ import annotations

import pytest

from tests import fakes


@pytest.fixture
def clock() -> fakes.FakeClock:
    """A fake clock at 1000 s that moves only when the test moves it."""
    return fakes.FakeClock()
