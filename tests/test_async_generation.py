"""Exact under staleness (issue 42 item 3): samples drawn under older weights (async_generation: 0, 1 or 2 optimizer
steps stale), with their importance weights against the sampler's log-probs, train exactly the hand-written big batch
(tests/rollouts.py) under every split, and over two optimizer steps of one generation (steps_per_generation = 2 x
GA). Averaging per-micro-batch means (TRL's AsyncGRPOTrainer, trl#7206) does not: the control fails.

Then the async loop itself against the in-process stand-in server (tests/fake_vllm_server.py): rollouts are tagged
with the weight version they were sampled under, max_staleness drops older ones (counted, logged, sampled again).
"""

import copy
import itertools

import pytest
import torch

from hfacc import TokenWeightedTrainer, build_tiny_llama
from hfacc.objectives.policy_gradient import importance_sampling_weights
from tests.fake_vllm_server import FakeVLLMServer
from tests.grpo_setup import build_policy, run_grpo
from tests.helpers import VOCAB, relative_error, run_trainer
from tests.rollouts import make_rollout, reference_gradient, reference_sgd_steps, token_logps
from tests.test_policy_gradient import EPS, EPS_HIGH, SPLITS, accumulate, collate, grpo_args, objective_for

pytestmark = pytest.mark.xdist_group("async_generation")


def stale_rows(model, n, seed, mode="sequence_mask"):
    """``n`` rollout rows sampled under weights 0, 1 or 2 steps older than ``model`` (perturbed copies): each row's
    sampler log-probs are its stale sampler's, its importance weights exp(policy - sampler) in ``mode`` (TRL's
    truncation/masking, C in [0.5, 2]), its old log-probs the policy's own (TRL's rule with the correction on)."""
    rows = make_rollout(model, n=n, seed=seed)
    samplers = [model]
    generator = torch.Generator().manual_seed(seed)
    for _ in (1, 2):  # an older policy: the current one moved back by one more step of noise
        older = copy.deepcopy(samplers[-1])
        with torch.no_grad():
            for p in older.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=generator))
        samplers.append(older)
    out = []
    for i, row in enumerate(rows):
        lag = i % 3
        p = sum(1 for y in row["labels"] if y == -100)
        with torch.no_grad():
            policy = token_logps(model, row["input_ids"])[p - 1 :]
            sampler = token_logps(samplers[lag], row["input_ids"])[p - 1 :]
        weights, _ = importance_sampling_weights(
            policy, sampler, torch.zeros(len(policy), dtype=torch.long), 1, mode, 0.5, 2.0
        )
        out.append(
            {**row, "old_logps": [0.0] * p + policy.tolist(), "importance_weights": [0.0] * p + weights.tolist(),
             "staleness": lag}
        )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def setup():
    model = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=0)
    return model, stale_rows(model, 8, seed=0), stale_rows(model, 8, seed=0, mode="token_truncate")


@pytest.mark.parametrize("loss_type", ["token", "sequence", "dr_grpo"])
def test_stale_samples_with_their_weights_give_the_big_batch_under_every_split(setup, loss_type):
    model, rows, truncated = setup
    assert {r["staleness"] for r in rows} == {0, 1, 2}
    assert any(w not in (0.0, 1.0) for r in rows for w in r["importance_weights"][1:]), "the weights must matter"
    for weighted in (rows, truncated):
        want, _ = reference_gradient(model, weighted, loss_type, eps=EPS, eps_high=EPS_HIGH, max_completion_length=16)
        objective = objective_for(loss_type, 0.0, None)
        for (bs, ga), layout in itertools.product(SPLITS, ["padded", "packed rows"]):
            objective.fused = layout != "padded"
            error = relative_error(accumulate(model, objective, weighted, bs, ga, layout), want)
            assert error <= 1e-6, (loss_type, bs, ga, layout, error)


def test_a_per_micro_batch_mean_is_not_the_big_batch_of_stale_samples(setup):
    """The control (trl#7206): each micro-batch's own token mean, averaged over the window, at 2 x 4 and 3 x 3."""
    model, rows, _ = setup
    want, _ = reference_gradient(model, rows, "token", eps=EPS, eps_high=EPS_HIGH, max_completion_length=16)
    objective = objective_for("token", 0.0, None)
    for bs, ga in ((2, 4), (3, 3)):
        error = relative_error(accumulate(model, objective, rows, bs, ga, "padded", "micro_batch"), want)
        assert error > 0.01, (bs, ga, error)


def test_one_stale_generation_over_two_optimizer_steps(tmp_path, setup):
    """steps_per_generation = 2 x GA: 16 stale rows trained as two SGD steps of 2 x 4 through TokenWeightedTrainer,
    each step over its own tokens, the second at the updated weights, the weights fixed with the rows."""
    model, _, _ = setup
    rows = stale_rows(model, 16, seed=1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        want = reference_sgd_steps(model, [rows[:8], rows[8:]], "token", 0.5, eps=EPS, eps_high=EPS_HIGH,
                                   max_completion_length=16)  # fmt: skip
        model.load_state_dict(start)
        sgd = dict(learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0)
        _, capture = run_trainer(
            TokenWeightedTrainer, model, rows, grpo_args(tmp_path, 2, 4, **sgd), collate,
            objective=objective_for("token", 0.0, None),
        )  # fmt: skip
    finally:
        model.load_state_dict(start)
    assert len(capture.grads) == 2
    for got, expected in zip(capture.grads, want, strict=True):
        assert relative_error(got, expected) <= 1e-6


@pytest.fixture(scope="module")
def policy():
    return build_policy(0)


def async_run(policy, tmp_path, **settings):
    model, tokenizer = copy.deepcopy(policy[0]), policy[1]
    with FakeVLLMServer(model, tokenizer) as server:
        trainer, capture, _ = run_grpo(
            tmp_path, steps=3, policy=(model, tokenizer), learning_rate=1e-3, use_vllm=True, vllm_mode="server",
            vllm_server_base_url=server.url, vllm_server_timeout=60, async_generation=True, **settings,
        )  # fmt: skip
    return trainer, capture, server


def test_async_grpo_trains_on_stale_samples_tagged_with_their_version(policy, tmp_path):
    trainer, capture, server = async_run(policy, tmp_path)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    # step 1 sampled now; steps 2 and 3 took the generation sampled while the step before trained
    assert [h["sampling/staleness/max"] for h in logs] == [0.0, 1.0, 1.0]
    assert [h["sampling/dropped_samples"] for h in logs] == [0.0, 0.0, 0.0]
    # the server sampled step 2's rollout under version 0: its log-probs are the step-0 policy's, not step 1's
    assert logs[1]["sampling/sampling_logp_difference/max"] > 1e-4 > logs[0]["sampling/sampling_logp_difference/max"]
    assert all("importance_weights" in row for row in capture.rollouts[1].rows)  # the correction, on by default
    assert server.completion_requests == 4 * 2  # 2 prompts a generation; the 4th in flight at the end


def test_max_staleness_drops_older_samples_counts_them_and_samples_again(policy, tmp_path):
    trainer, _, server = async_run(policy, tmp_path, max_staleness=0)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert [h["sampling/dropped_samples"] for h in logs] == [0.0, 8.0, 8.0]  # a generation: 2 prompts x 4
    assert [h["sampling/staleness/max"] for h in logs] == [0.0, 0.0, 0.0]  # what trained is fresh
    assert server.completion_requests == 4 * 2 + 2 * 2  # the dropped generations sampled again
