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


def pytest_collection_modifyitems(session, config, items):
    """Skip the tests marked ``cuda`` without a GPU; send the test modules' workers to the ranks by
    value, as a notebook's are.

    By reference, each rank would import the test module, and pytest with it, to find a worker by
    name: about a second per rank and launch on two cores. cloudpickle keeps a class sent by value
    the same class when an instance of it comes back.
    """
    import cloudpickle
    import torch
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (make gpu runs it on a machine with one)")
        for item in items:
            if item.get_closest_marker("cuda"):
                item.add_marker(skip)
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        cloudpickle.register_pickle_by_value(module)
