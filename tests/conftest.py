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


def pytest_collection_finish(session):
    """Every ``Trainer.train()`` starts with a full ``gc.collect()`` (accelerate's ``free_memory``): 0.7 s each time
    over the objects of torch, transformers and datasets. Frozen once, after the test modules imported them, they are
    left out of every later collection (what the tests make is still collected)."""
    import gc

    gc.collect()
    gc.freeze()
