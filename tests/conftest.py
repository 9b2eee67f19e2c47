"""Suite-wide settings: the tests' models are tiny, and the CI machine has 2 cores."""

import os

import pytest
import torch

# Processes the tests launch (accelerate launch, torchrun: 2 ranks on 2 cores) inherit this: one thread per rank.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models: on 2 shared cores, synchronizing torch's threads costs more than they compute (the invariants'
    50-step runs: 489 s with the default threads, 111 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Tests that build nothing they share can go to any worker, one by one; every other module's tests stay together on
# one worker, so its module- and session-scoped fixtures (a two-process launch, a trained tiny model: up to minutes)
# are built once, not once per worker that runs one of its tests.
SPREAD_ONE_BY_ONE = {"test_notebooks.py"}


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``--dist loadgroup`` (the README's test command), keep each module on one worker except
    the modules in ``SPREAD_ONE_BY_ONE``; without xdist the marker is inert."""
    for item in items:
        if item.path.name not in SPREAD_ONE_BY_ONE:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def pytest_collection_finish(session):
    """Every ``Trainer.train()`` starts with a full ``gc.collect()`` (accelerate's ``free_memory``): 0.7 s each time
    over the objects of torch, transformers and datasets. Frozen once, after the test modules imported them, they are
    left out of every later collection (what the tests make is still collected)."""
    import gc

    gc.collect()
    gc.freeze()
