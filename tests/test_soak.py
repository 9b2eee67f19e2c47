"""A long run keeps memory flat: resident memory does not grow with the number of optimizer steps."""

import importlib.util

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def test_rss_is_flat_over_two_thousand_steps():
    spec = importlib.util.spec_from_file_location("memory_soak", ROOT / "benchmarks" / "memory_soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.soak(steps=2000, every=100, warmup=300)
    assert len(result["samples"]) == 20
    # Anything kept per step (a tensor, a list entry with a graph) would add megabytes over 1700 steps.
    assert result["growth_mib"] < 8, result["samples"]
