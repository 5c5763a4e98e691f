"""Shared test fixtures: the launcher's forkserver, started once per test session."""

import pytest


def _warm() -> int:
    return 0


@pytest.fixture(scope="session")
def warm_launcher():
    """Start the launcher's forkserver once (it imports torch: seconds); later launches reuse it.

    Tests that count processes or time launches ask for it, so that the start-up is neither counted
    as a stray process nor timed; any test file that launches benefits from the same warm server.
    """
    from d2lpar.processes.launch import launch
    launch(_warm, 1, quiet=True)
    yield launch
