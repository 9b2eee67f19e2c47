"""Two ranks on the generate path sample their own completions (issue 37 item 1): GRPOTrainer and on-policy
DistillationTrainer, one launch of tests/sampling_seed_check.py (2 CPU ranks, gloo).

The ranks get the same prompt, the same weights and identically seeded global generators, so their completions
differ only if each rank draws under its own seed (before the per-rank seed reached the transformers engine they
were identical). The same seed gives each rank the same completions again, and a run resumed from its first
checkpoint samples the second generation as the uninterrupted run did.
"""

import json
import subprocess

import pytest

from tests.helpers import ROOT, torchrun

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("seeds")
    proc = subprocess.run(
        torchrun("tests/sampling_seed_check.py", str(out)), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert results["world_size"] == 2
    return results["ranks"]


@pytest.mark.parametrize("kind", ["grpo", "distill"])
def test_each_rank_samples_its_own_completions_reproducibly_and_on_resume(ranks, kind):
    rank0, rank1 = (r[kind] for r in ranks)
    assert len(rank0["first"]) == len(rank1["first"]) == 2  # one generation per step, two steps
    for g in range(2):
        mine, theirs = rank0["first"][g], rank1["first"][g]
        assert mine["prompts"] == theirs["prompts"] and len(set(map(tuple, mine["prompts"]))) == 1  # one prompt
        assert len(mine["completions"]) == 4 and mine["completions"] != theirs["completions"]  # two samples
    for rank in (rank0, rank1):
        assert rank["first"][0]["completions"] != rank["first"][1]["completions"]  # each generation draws afresh
        assert rank["again"] == rank["first"]  # the same seed: the same completions on each rank
        assert rank["resumed"] == rank["first"][1:]  # resumed from checkpoint 1: the second generation, as it was
