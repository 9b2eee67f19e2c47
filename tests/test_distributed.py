"""Two CPU ranks (gloo) launched with accelerate_configs/ddp.yaml: exact gradients when the ranks see very
different token counts."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, free_port

TOL = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "results.json"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml"]
    launch += ["--main_process_port", str(free_port()), "tests/distributed_check.py", str(out)]
    proc = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


pytestmark = pytest.mark.distributed


def test_really_two_ranks(results):
    assert results["world_size"] == 2 and results["process_group_size"] == 2
    assert results["distributed_type"].endswith("MULTI_CPU")
    rank0, rank1 = results["local_targets"]
    assert rank0 > 10 * rank1  # the ranks' token counts differ a lot, which is what breaks naive averaging


@pytest.mark.parametrize(
    "case",
    [
        "hfacc bs1 ga4 avg=True",
        "hfacc bs1 ga4 avg=False",
        "hfacc bs2 ga2 avg=False",
        "hfacc bs2 ga2 sequence",
        "hfacc token budget",
        "loop helper",
    ],
)
def test_hfacc_is_exact_on_two_ranks(results, case):
    assert results["cases"][case]["grad_error"] <= TOL


@pytest.mark.parametrize(
    "case", ["hfacc bs1 ga4 avg=True", "hfacc bs1 ga4 avg=False", "hfacc bs2 ga2 avg=False", "hfacc token budget"]
)
def test_logged_loss_and_accuracy_are_the_global_token_means(results, case):
    r = results["cases"][case]
    assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-5)
    assert r["token_accuracy"] == pytest.approx(r["reference_accuracy"], rel=1e-5)
    assert r["num_targets"] == sum(results["local_targets"])


def test_stock_trainer_without_cross_rank_averaging_is_wrong(results):
    assert results["cases"]["stock bs1 ga4 avg=False"]["grad_error"] > 0.5


def test_a_shared_decision_needs_every_rank(results):
    assert results["agree"] == {"all yes": True, "one no": False}


PREFERENCE_CASES = [
    "sigmoid copy bs2 ga2 pf nll",
    "ipo given bs1 ga4 padded",
    "hinge peft bs3 ga2 pf nll",
    "robust precomputed bs2 ga2 padded",
    "simpo bs1 ga4 pf nll",
    "sigmoid copy token budget nll",
]


@pytest.mark.parametrize("case", PREFERENCE_CASES)
def test_preference_pairs_are_exact_on_two_ranks_with_uneven_pairs(results, case):
    """tests/preference_check.py: 7 pairs over 2 ranks (a repeated pair cut), against the big batch of all 7."""
    r = results["preference"][case]
    assert r["grad_error"] <= TOL and r["steps"] == 1
    assert r["loss_error"] <= 1e-5 and r["num_pairs"] == 7
    assert r["padding_free"] is ("padded" not in case)


def test_preference_evaluation_counts_every_pair_once_on_two_ranks(results):
    r = results["preference"]["evaluation"]
    assert r["num_pairs"] == 7  # accelerate's repeated pair dropped
    assert r["accuracy_error"] <= 1e-6 and r["margin_error"] <= 1e-6 and r["logps_error"] <= 1e-6


@pytest.mark.parametrize(
    "case", ["teacher beta0.5 t2 ce bs1 ga4 pf", "topk beta0 bs2 ga2 padded", "teacher beta1 bs2 ga2 padded"]
)
def test_distillation_is_exact_on_two_ranks_with_uneven_tokens(results, case):
    """tests/distillation_check.py: long completions on rank 0, short ones on rank 1, against the big batch."""
    r = results["distillation"][case]
    local = results["distillation"]["local_targets"]
    assert max(local) > 3 * min(local)  # the ranks hold very different numbers of target tokens
    assert r["grad_error"] <= TOL and r["loss_error"] <= 1e-5 and r["steps"] == 1 and r["fused"]
    assert r["num_targets"] == sum(local)
    assert r["padding_free"] is case.endswith("pf")


def test_on_policy_distillation_is_exact_on_two_ranks(results):
    """DistillationTrainer, lmbda 0.5: each step's update is the big batch of the rows both ranks trained in it."""
    r = results["distillation"]["on-policy lmbda0.5"]
    assert len(r["grad_errors"]) == 2 and max(r["grad_errors"]) <= TOL


def test_distillation_evaluation_counts_every_target_once_on_two_ranks(results):
    r = results["distillation"]["evaluation"]
    assert r["num_targets"] == r["want_targets"] and r["loss_error"] <= 1e-5 and r["agreement_error"] <= 1e-9


@pytest.mark.parametrize("case", ["reward bs2 ga2 pf", "reward bs1 ga4 padded"])
def test_reward_models_are_exact_on_two_ranks_with_uneven_pairs(results, case):
    """tests/reward_kto_check.py: 7 pairs with margins over 2 ranks, centering on, against the big batch of all 7;
    the logged extremes are those of all 14 scores. Padding-free, the pairs share their prompts' forward
    (hfacc.data.shared_prompts), chosen on both ranks."""
    r = results["reward_kto"][case]
    assert r["grad_error"] <= TOL and r["steps"] == 1 and r["num_pairs"] == 7
    assert r["loss_error"] <= 1e-5 and r["extremes_error"] <= 1e-5
    assert r["padding_free"] is r["shared_prompts"] is ("padded" not in case)


@pytest.mark.parametrize(
    "case",
    ["kto copy bs2 ga2 pf", "kto given bs1 ga4 pf", "kto peft bs3 ga2 padded", "kto precomputed bs2 ga2 padded"],
)
def test_kto_is_exact_on_two_ranks_with_its_reference_point_over_both(results, case):
    """7 unpaired rows over 2 ranks: z0 is the mean over all 7 KL rows (both ranks), taken before the first backward."""
    r = results["reward_kto"][case]
    assert r["grad_error"] <= TOL and r["steps"] == 1 and r["num_examples"] == 7
    assert r["loss_error"] <= 1e-5 and r["kl_error"] <= 1e-5 * max(r["z0"], 1.0)
    assert r["padding_free"] is ("padded" not in case)
    if "precomputed" in case:
        assert r["z0"] > 0.1  # the statistic is not hidden by its clamp at 0
