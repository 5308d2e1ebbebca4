"""Every API test starts with REPLAYSSM_CUTE_DEBUG unset: a test of the debug-mode checks sets it
itself (monkeypatch), and a debug setting in the environment does not change the other tests."""

import pytest


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("REPLAYSSM_CUTE_DEBUG", raising=False)
