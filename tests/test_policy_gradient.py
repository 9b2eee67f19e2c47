"""PolicyGradientObjective on fixed rollouts: every loss type, beta 0 and > 0, every split and layout gives the update
of the hand-written big batch (tests/rollouts.py, plain torch) to <= 1e-6; normalizing per micro-batch does not.

Cheap first: the pure functions over all loss types and splits without a model; then the model through the
trainer's own window functions over the whole cross product; then a covering subset through TokenWeightedTrainer
(and steps_per_generation = 2 x GA: two SGD steps on one rollout with old log-probs). Two ranks:
tests/test_grpo.py launches tests/policy_gradient_check.py once for all of them.
"""

import itertools
import math
import random
from types import SimpleNamespace

import pytest
import torch

from hfacc import (
    DataCollatorForCausalLM,
    PolicyGradientObjective,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    build_tiny_llama,
)
from hfacc.data.padding_free import remove_padding
from hfacc.objectives import SetupContext
from hfacc.objectives.policy_gradient import (
    IMPORTANCE_SAMPLING_MODES,
    cispo_loss,
    clipped_surrogate_loss,
    get_aligned_values,
    importance_sampling_weights,
    k3_kl,
    normalize_policy_loss,
    policy_gradient_sums,
    sapo_loss,
    sequence_log_ratio,
)
from hfacc.ops.loss import shift_labels
from hfacc.training.window import compute_micro_batch_loss, count_window
from tests.helpers import VOCAB, flat_grad, relative_error, run_trainer, train_args
from tests.rollouts import make_rollout, reference_gradient, reference_sgd_steps, token_logps

EPS, EPS_HIGH, BETA, L = 0.2, 0.28, 0.1, 16
LOSS_TYPES = ("token", "sequence", "dr_grpo")  # the clipped surrogate's normalizations; the variants below
SPLITS = [(8, 1), (2, 4), (1, 8), (3, 3)]  # (3, 3): micro-batches of 3, 3 and 2
CPU = SimpleNamespace(device=torch.device("cpu"), num_processes=1)
collate = DataCollatorForCausalLM(pad_token_id=0)


# ---- the pure functions ------------------------------------------------------------------------------------------
def test_the_clipped_surrogate_by_cases():
    logps = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.5, 0.5, 1.1])).requires_grad_()
    old = torch.zeros(6)
    advantages = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -2.0])
    loss, low, high = clipped_surrogate_loss(logps, old, advantages, 0.2, 0.28)
    # r = 1: -A; r = 1.5 > 1.28 with A > 0: clipped to -1.28; r = 0.5 with A > 0: -0.5 (the min keeps it);
    # r = 1.5 with A < 0: 1.5 (unclipped is the min); r = 0.5 < 0.8 with A < 0: clipped to 0.8; r = 1.1: 2.2.
    assert torch.allclose(loss, torch.tensor([-1.0, -1.28, -0.5, 1.5, 0.8, 2.2]))
    assert high.tolist() == [False, True, False, False, False, False]
    assert low.tolist() == [False, False, False, False, True, False]
    loss.sum().backward()
    # d l / d logp = -A r where unclipped, 0 where clipped.
    assert torch.allclose(logps.grad, torch.tensor([-1.0, 0.0, -0.5, 1.5, 0.0, 2.2]))


def test_k3_kl_is_the_estimator_and_never_negative():
    logps, ref = torch.randn(50), torch.randn(50)
    kl = k3_kl(logps, ref)
    assert torch.allclose(kl, (ref - logps).exp() - (ref - logps) - 1) and (kl >= 0).all()
    assert k3_kl(ref, ref).abs().max() == 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_step_normalizer_is_split_invariant_and_the_micro_batch_mean_is_not(loss_type):
    """Random per-token losses of 8 completions (1-14 tokens): any split into micro-batches and ranks, each
    normalized by the step's counts, sums to the big batch's loss; per-micro-batch means divided by k do not."""
    rng = random.Random(0)
    lengths = [rng.randint(1, 14) for _ in range(8)]
    losses = [torch.randn(n, dtype=torch.float64) for n in lengths]
    tokens, completions = sum(lengths), len(lengths)
    want = {
        "token": torch.cat(losses).sum() / tokens,
        "sequence": torch.stack([x.mean() for x in losses]).mean(),
        "dr_grpo": torch.cat(losses).sum() / (completions * L),
    }[loss_type]

    def share(rows, world):  # one micro-batch's loss, as PolicyGradientObjective.loss forms it
        values = torch.cat([losses[i] for i in rows])
        ids = torch.cat([torch.full((lengths[i],), j) for j, i in enumerate(rows)])
        token_sum, sequence_sum, _ = policy_gradient_sums(values, ids, len(rows))
        s = sequence_sum if loss_type == "sequence" else token_sum
        return normalize_policy_loss(s, loss_type, tokens, completions, L, world)

    for world, size in itertools.product([1, 2, 4], [1, 2, 3]):
        ranks = [list(range(8))[r::world] for r in range(world)]  # unequal completions per rank
        total = sum(share(rows[i : i + size], world) for rows in ranks for i in range(0, len(rows), size)) / world
        assert abs(total - want) <= 1e-12 * abs(want), (world, size)
    # Negative control: each micro-batch's own mean divided by k (TRL's bnpo; its grpo and dr_grpo / GA).
    parts = [list(range(i, i + 2)) for i in range(0, 8, 2)]
    own = []
    for rows in parts:
        values = [losses[i] for i in rows]
        own.append(
            {
                "token": torch.cat(values).mean(),
                "sequence": torch.stack([x.mean() for x in values]).mean(),
                "dr_grpo": torch.cat(values).sum() / (len(rows) * L),
            }[loss_type]
        )
    if loss_type == "token":  # the other two happen to be exact for equal completions per micro-batch
        assert abs(sum(own) / 4 - want) > 1e-3 * abs(want)


def test_importance_sampling_weights_by_mode():
    """TRL's four modes, by hand: rho = exp(old - sampler) per token or summed per completion, then truncated to
    [C_min, C_max] or zeroed outside it."""
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    sampler = torch.tensor([-1.5, -1.0, -0.5, -3.1])  # d = 0.5, -1.0, 0.0, 0.1
    rows = torch.tensor([0, 0, 1, 1])
    e = math.exp
    cases = {
        ("token_truncate", 0.5, 1.5): [1.5, 0.5, 1.0, e(0.1)],
        ("token_mask", 0.5, 1.5): [0.0, 0.0, 1.0, e(0.1)],
        ("sequence_truncate", None, 0.9): [e(-0.5), e(-0.5), 0.9, 0.9],
        ("sequence_mask", 0.7, 3.0): [0.0, 0.0, e(0.1), e(0.1)],
    }
    for (mode, low, high), want in cases.items():
        weights, ratios = importance_sampling_weights(old, sampler, rows, 2, mode, low, high)
        assert torch.allclose(weights, torch.tensor(want)), mode
        assert ratios.numel() == (2 if mode.startswith("sequence") else 4)
    weights, _ = importance_sampling_weights(old, old, rows, 2, "sequence_mask")  # in step: all 1
    assert weights.tolist() == [1.0] * 4
    # A completion without tokens (row 2 of 3) has no ratio; a token the sampler could not score (NaN) counts as 1.
    _, ratios = importance_sampling_weights(old, sampler, rows, 3, "sequence_mask", None, None)
    assert ratios.numel() == 2
    weights, _ = importance_sampling_weights(old[:1], torch.tensor([math.nan]), rows[:1], 1, "token_mask")
    assert weights.tolist() == [1.0]
    with pytest.raises(ValueError, match="importance sampling mode 'tis'"):
        importance_sampling_weights(old, sampler, rows, 2, "tis")


def test_old_logps_are_read_where_the_labels_are_after_the_shift():
    labels = torch.tensor([[-100, -100, 7, 8, -100]])  # completion tokens at 2 and 3, predicted by positions 1 and 2
    values = torch.tensor([[0.0, 0.0, -1.5, -2.5, 0.0]])  # aligned with labels: values[t] belongs to token t
    mask = shift_labels(labels) != -100
    assert mask.tolist() == [[False, True, True, False, False]]
    assert get_aligned_values(values, mask).tolist() == [-1.5, -2.5]


# ---- the model: the trainer's window functions, the whole cross product --------------------------------------------
@pytest.fixture(scope="module")
def setup():
    model = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=0)
    ref = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=3)
    rows = make_rollout(model, n=8, seed=0)
    refs = {
        (loss_type, beta): reference_gradient(
            model, rows, loss_type, eps=EPS, eps_high=EPS_HIGH, beta=beta, ref_model=ref, max_completion_length=L
        )
        for loss_type in LOSS_TYPES
        for beta in (0.0, BETA)
    }
    return model, ref, rows, refs


def objective_for(loss_type, beta, ref):
    return PolicyGradientObjective(loss_type, EPS, EPS_HIGH, beta, ref_model=ref, max_completion_length=L)


def accumulate(model, objective, rows, bs, ga, layout, normalization="token"):
    """One optimizer step by hand, as TokenWeightedTrainer routes it: count the window, then each micro-batch."""
    batches = [collate(rows[i : i + bs]) for i in range(0, len(rows), bs)]
    assert len(batches) <= ga
    objective.setup(SetupContext(model, batches[0], CPU))
    counts = count_window(objective.count, batches, CPU, size=len(objective.units))
    model.zero_grad()
    for batch in batches:
        if layout != "padded":
            batch = remove_padding(batch, one_row=layout == "one row", keep=objective.row_keys)
        loss, _, _ = compute_micro_batch_loss(objective, model, batch, counts, normalization=normalization)
        loss.backward()
    grad = flat_grad(model)
    model.zero_grad()
    return grad


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, BETA])
def test_every_split_and_layout_gives_the_big_batch(setup, loss_type, beta):
    model, ref, rows, refs = setup
    want, _ = refs[(loss_type, beta)]
    objective = objective_for(loss_type, beta, ref)
    for (bs, ga), layout in itertools.product(SPLITS, ["padded", "one row", "packed rows"]):
        objective.fused = layout != "padded"  # chunked log-probs where padding-free, full logits where padded
        error = relative_error(accumulate(model, objective, rows, bs, ga, layout), want)
        assert error <= 1e-6, (bs, ga, layout, error)


@pytest.mark.parametrize("mode", IMPORTANCE_SAMPLING_MODES)
def test_importance_weighted_rollouts_give_the_big_batch_under_every_split(setup, mode):
    """The sampler's mismatch corrected (a vLLM rollout): its log-probs fixed with the rollout, the importance weights
    are data, so every split and layout still gives the hand-written big batch; leaving them out does not."""
    model, ref, rows, _ = setup
    generator = torch.Generator().manual_seed(7)
    weighted = []
    for row in rows:
        p = sum(1 for y in row["labels"] if y == -100)
        old = torch.tensor(row["old_logps"][p:])
        sampler = old + 0.3 * torch.randn(old.shape, generator=generator)  # the sampler's, a little off
        weights, _ = importance_sampling_weights(old, sampler, torch.zeros(len(old), dtype=torch.long), 1, mode,
                                                 0.5, 2.0)  # fmt: skip
        weighted.append({**row, "importance_weights": [0.0] * p + weights.tolist()})
    assert any(0 < w != 1 for r in weighted for w in r["importance_weights"][1:]), "the weights must matter"
    for loss_type, beta in (("token", 0.0), ("sequence", BETA)):
        want, _ = reference_gradient(model, weighted, loss_type, eps=EPS, eps_high=EPS_HIGH, beta=beta,
                                     ref_model=ref, max_completion_length=L)  # fmt: skip
        objective = objective_for(loss_type, beta, ref)
        # The weights are data whatever the mode: every split for TRL's default mode, a ragged one for the others.
        splits = SPLITS if mode == "sequence_mask" else [(3, 3)]
        for (bs, ga), layout in itertools.product(splits, ["padded", "packed rows"]):
            objective.fused = layout != "padded"
            error = relative_error(accumulate(model, objective, weighted, bs, ga, layout), want)
            assert error <= 1e-6, (loss_type, bs, ga, layout, error)
        unweighted = relative_error(accumulate(model, objective, rows, 2, 4, "padded"), want)
        assert unweighted > 1e-3, unweighted  # negative control: the weights change the step


def test_the_rollout_clips_on_both_sides(setup):
    """The fixed rollout exercises the clipping: ratios below 1 - eps with A < 0 and above 1 + eps_high with A > 0."""
    model, _, rows, _ = setup
    low = high = 0
    for row in rows:
        completion = torch.tensor(row["labels"][1:]) != -100
        with torch.no_grad():
            ratio = torch.exp(token_logps(model, row["input_ids"]) - torch.tensor(row["old_logps"][1:]))[completion]
        low += int((ratio < 1 - EPS).sum()) if row["advantages"] < 0 else 0
        high += int((ratio > 1 + EPS_HIGH).sum()) if row["advantages"] > 0 else 0
    assert low >= 3 and high >= 3, (low, high)


def test_per_micro_batch_normalization_is_not_the_big_batch(setup):
    """Negative control: the token loss over each micro-batch's own tokens, divided by GA (TRL's bnpo), at bs 2 x GA 4."""
    model, ref, rows, refs = setup
    objective = objective_for("token", 0.0, ref)
    error = relative_error(accumulate(model, objective, rows, 2, 4, "padded", "micro_batch"), refs[("token", 0.0)][0])
    assert error > 0.05, error


# ---- the variants: GSPO (a ratio per completion), CISPO, SAPO ------------------------------------------------------
# name: (objective settings, reference settings). GSPO's bounds are tight (its log-ratio is a mean over the tokens),
# CISPO's cap is on the ratio itself: both chosen so the fixed rollout clips some units and not others.
VARIANTS = {
    "gspo": (
        dict(loss_type="sequence", epsilon=0.03, epsilon_high=0.04, importance_sampling_level="sequence"),
        dict(loss_type="sequence", eps=0.03, eps_high=0.04, level="sequence"),
    ),
    "gspo, token loss": (
        dict(loss_type="token", epsilon=0.03, epsilon_high=0.04, importance_sampling_level="sequence"),
        dict(loss_type="token", eps=0.03, eps_high=0.04, level="sequence"),
    ),
    "cispo": (dict(loss_type="cispo", epsilon_high=1.3), dict(loss_type="cispo", eps_high=1.3)),
    "cispo, sequence ratio": (
        dict(loss_type="cispo", epsilon_high=1.1, importance_sampling_level="sequence"),
        dict(loss_type="cispo", eps_high=1.1, level="sequence"),
    ),
    "sapo": (
        dict(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05),
        dict(loss_type="sapo", tau_pos=1.0, tau_neg=1.05),
    ),
}


def variant(name, beta, ref):
    settings, reference = VARIANTS[name]
    objective = PolicyGradientObjective(**settings, beta=beta, ref_model=ref, max_completion_length=L)
    return objective, dict(reference, beta=beta, ref_model=ref, max_completion_length=L)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_under_every_split_and_layout_gives_the_big_batch(setup, name):
    """GSPO's ratio from all of a completion's tokens, CISPO's capped ratio, SAPO's gate: 8x1, 2x4, 1x8 and ragged
    3x3, padded, one padding-free row and packed rows, against the hand-written big batch (beta 0 and 0.1)."""
    model, ref, rows, _ = setup
    for beta in (0.0, BETA):
        objective, reference = variant(name, beta, ref)
        want, _ = reference_gradient(model, rows, **reference)
        for (bs, ga), layout in itertools.product(SPLITS, ["padded", "one row", "packed rows"]):
            objective.fused = layout != "padded"
            error = relative_error(accumulate(model, objective, rows, bs, ga, layout), want)
            assert error <= 1e-6, (name, beta, bs, ga, layout, error)


def test_the_variants_clip_some_units_and_not_others(setup):
    """The rollout exercises each variant's bound: some completions (GSPO) / tokens (CISPO) clipped, not all."""
    model, _, rows, _ = setup
    batch = collate(rows)
    for name, key in (("gspo", "clip_ratio/region_mean"), ("cispo", "cispo_clip_ratio")):
        objective, _ = variant(name, 0.0, None)
        with torch.no_grad():
            _, sums = objective(model, batch)
        logs = objective.metric_logs(objective.metric_sums(sums).tolist())
        assert 0 < logs[key] < 1, (name, logs)
    objective, _ = variant("sapo", 0.0, None)
    with torch.no_grad():
        _, sums = objective(model, batch)
    assert "clip_ratio/region_mean" not in objective.metric_logs(objective.metric_sums(sums).tolist())


def test_a_per_micro_batch_ratio_is_not_gspo(setup, monkeypatch):
    """Negative control: GSPO's ratio taken over each micro-batch's tokens (as a packed row read as one sequence
    would give) instead of each completion's: at bs 2 x GA 4 the step is not the big batch's."""
    from hfacc.objectives import policy_gradient

    model, ref, rows, _ = setup
    objective, reference = variant("gspo", 0.0, ref)
    want, _ = reference_gradient(model, rows, **reference)
    exact = policy_gradient.sequence_log_ratio
    monkeypatch.setattr(policy_gradient, "sequence_log_ratio", lambda x, rows, n: exact(x, torch.zeros_like(rows), 1))
    error = relative_error(accumulate(model, objective, rows, 2, 4, "padded"), want)
    assert error > 0.05, error


def test_the_variants_refuse_what_they_cannot_mean():
    with pytest.raises(ValueError, match="loss_type='cispo' caps the ratio at epsilon_high"):
        PolicyGradientObjective("cispo")
    with pytest.raises(ValueError, match="epsilon_high=0.28 <= 1 caps even the on-policy ratio"):
        PolicyGradientObjective("cispo", epsilon_high=0.28)
    with pytest.raises(ValueError, match="importance_sampling_level='sequence_token'"):
        PolicyGradientObjective(importance_sampling_level="sequence_token")
    with pytest.raises(ValueError, match="sapo_temperature_pos=0"):
        PolicyGradientObjective("sapo", sapo_temperature_pos=0)


def test_the_variants_pure_functions_by_hand():
    rows = torch.tensor([0, 0, 1])
    log_ratio = torch.tensor([0.2, 0.4, -1.0], requires_grad=True)
    s = sequence_log_ratio(log_ratio, rows, 2)
    assert torch.allclose(s, torch.tensor([0.3, 0.3, -1.0]))
    s[0].backward()  # s_0 = mean of completion 0's two tokens: 1/2 each, nothing from completion 1
    assert torch.allclose(log_ratio.grad, torch.tensor([0.5, 0.5, 0.0]))
    logps = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, clipped = cispo_loss(torch.log(torch.tensor([2.0, 0.5])), logps, torch.tensor([1.0, -1.0]), 1.5)
    loss.sum().backward()  # gradient -min(r, cap) A on every token, the clipped one included
    assert torch.allclose(logps.grad, torch.tensor([-1.5, 0.5])) and clipped.tolist() == [True, False]
    x = torch.tensor([0.3, -0.2], requires_grad=True)
    a = torch.tensor([1.0, -2.0])
    sapo_loss(x, a, 1.0, 1.05).sum().backward()
    r, tau = x.detach().exp(), torch.tensor([1.0, 1.05])
    sig = torch.sigmoid(tau * (r - 1))
    assert torch.allclose(x.grad, -4 * sig * (1 - sig) * r * a)  # d/dlogp of -(4/tau) sigmoid(tau (r - 1)) A


# ---- through TokenWeightedTrainer: a covering subset -----------------------------------------------------------------
def grpo_args(tmp_path, bs, ga, **overrides):
    return train_args(tmp_path, bs, ga, args_class=TokenWeightedArguments, **overrides)


@pytest.mark.parametrize(
    "loss_type, beta, bs, ga, padding_free",
    [
        ("token", BETA, 3, 3, True),
        ("sequence", 0.0, 2, 4, False),
        ("dr_grpo", BETA, 1, 8, True),
        ("token", 0.0, 8, 1, False),
    ],
)
def test_the_trainer_gives_the_big_batch_and_logs_it(tmp_path, setup, loss_type, beta, bs, ga, padding_free):
    model, ref, rows, refs = setup
    want, want_loss = refs[(loss_type, beta)]
    trainer, capture = run_trainer(
        TokenWeightedTrainer,
        model,
        rows,
        grpo_args(tmp_path, bs, ga, padding_free=padding_free),
        collate,
        objective=objective_for(loss_type, beta, ref),
    )
    assert trainer.padding_free == padding_free and trainer.model_setup.loss_path == "fused"
    assert len(capture.grads) == 1 and relative_error(capture.grads[0], want) <= 1e-6
    logged = next(e for e in trainer.state.log_history if "num_completions" in e)
    assert abs(logged["loss"] - want_loss) <= 1e-5 * abs(want_loss)
    assert logged["num_completions"] == 8 and logged["num_completion_tokens"] == sum(
        1 for r in rows for y in r["labels"][1:] if y != -100
    )
    assert 0 < logged["clip_ratio/region_mean"] < 1 and ("kl" in logged) == (beta > 0)
    assert "completion_tokens_per_second" in logged


def test_the_objective_by_name_keeps_its_columns_and_reads_precomputed_reference_logps(tmp_path, setup):
    """objective='grpo' (a name, as a YAML gives it): the advantages/old_logps/ref_logps columns survive the
    Trainer's column removal; ref_logps need no reference model."""
    model, ref, rows, _ = setup
    with torch.no_grad():
        ref_rows = [{**r, "ref_logps": [0.0] + token_logps(ref, r["input_ids"]).tolist()} for r in rows]
    want, _ = reference_gradient(model, ref_rows, "token", eps=EPS, eps_high=EPS, beta=BETA)
    objective = PolicyGradientObjective(beta=BETA)  # no ref_model: the rows carry ref_logps
    trainer, capture = run_trainer(
        TokenWeightedTrainer, model, ref_rows, grpo_args(tmp_path, 2, 4), collate, objective=objective
    )
    assert objective.reference is None and relative_error(capture.grads[0], want) <= 1e-6
    want, _ = reference_gradient(model, rows, "token", eps=EPS, eps_high=EPS)
    trainer, capture = run_trainer(
        TokenWeightedTrainer,
        model,
        rows,
        grpo_args(tmp_path, 2, 4, objective="grpo", remove_unused_columns=True),
        collate,
    )
    assert isinstance(trainer.objective, PolicyGradientObjective) and relative_error(capture.grads[0], want) <= 1e-6


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, BETA])
def test_one_rollout_over_two_optimizer_steps(tmp_path, setup, loss_type, beta):
    """steps_per_generation = 2 x GA: a 16-completion rollout with the sampler's old log-probs trained as two SGD steps
    of 2 x 4. Each step divides by what *it* consumes; the second runs at the updated weights (ratios move)."""
    model, ref, _, _ = setup
    rows = make_rollout(model, n=16, seed=1)
    lr = 0.5
    start = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        want = reference_sgd_steps(
            model,
            [rows[:8], rows[8:]],
            loss_type,
            lr,
            eps=EPS,
            eps_high=EPS_HIGH,
            beta=beta,
            ref_model=ref,
            max_completion_length=L,
        )
        model.load_state_dict(start)
        args = grpo_args(tmp_path, 2, 4, learning_rate=lr, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0)
        _, capture = run_trainer(
            TokenWeightedTrainer, model, rows, args, collate, objective=objective_for(loss_type, beta, ref)
        )
    finally:
        model.load_state_dict(start)
    assert len(capture.grads) == 2
    for got, expected in zip(capture.grads, want, strict=True):
        assert relative_error(got, expected) <= 1e-6
    assert relative_error(want[0], want[1]) > 0.1 and not math.isclose(want[1].norm(), 0.0)


@pytest.mark.parametrize("name", ["gspo", "cispo", "sapo"])
def test_each_variant_over_two_optimizer_steps_of_one_rollout(tmp_path, setup, name):
    """steps_per_generation = 2 x GA with the sampler's old log-probs, padding-free: the second step's ratios (GSPO's
    per completion) are taken at the updated weights, each step over its own units."""
    model, ref, _, _ = setup
    rows = make_rollout(model, n=16, seed=1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    objective, reference = variant(name, 0.0, ref)
    try:
        want = reference_sgd_steps(model, [rows[:8], rows[8:]], lr=0.5, **reference)
        model.load_state_dict(start)
        sgd = dict(learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0)
        _, capture = run_trainer(
            TokenWeightedTrainer, model, rows, grpo_args(tmp_path, 2, 4, padding_free=True, **sgd), collate,
            objective=objective,
        )  # fmt: skip
    finally:
        model.load_state_dict(start)
    assert len(capture.grads) == 2
    for got, expected in zip(capture.grads, want, strict=True):
        assert relative_error(got, expected) <= 1e-6, name


def test_a_hand_written_loop_scales_by_the_objectives_own_loss(setup):
    """hfacc.accumulation_window with PolicyGradientObjective(loss_type='sequence'): mb.scale divides by the step's
    completions, as the objective says, not by its tokens (normalize_window_loss's default)."""
    from accelerate import Accelerator

    from hfacc import accumulation_window

    model, ref, rows, refs = setup
    accelerator = Accelerator(cpu=True)
    objective = objective_for("sequence", 0.0, ref)
    batches = [collate(rows[i : i + 3]) for i in range(0, 8, 3)]
    model.zero_grad()
    for mb in accumulation_window(accelerator, model, batches, objective=objective):
        with mb.sync():
            _, sums = objective(model, mb.batch)
            accelerator.backward(mb.scale(sums))
    assert relative_error(flat_grad(model), refs[("sequence", 0.0)][0]) <= 1e-6
    model.zero_grad()


def test_one_objective_set_up_for_a_second_model_compares_with_that_models_copy(setup):
    """The same PolicyGradientObjective (beta > 0, no ref_model) set up for a second model: its KL reference is a
    frozen copy of that model, never the first one's kept from the earlier setup (review of #24)."""
    model, _, rows, _ = setup
    other = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=5)
    objective = PolicyGradientObjective(beta=BETA)
    batch = DataCollatorForCausalLM(pad_token_id=0)(rows[:2])
    for policy in (model, other):
        objective.setup(SetupContext(policy, batch, CPU))
        copy = objective.reference.module
        assert copy is not policy
        for mine, theirs in zip(copy.parameters(), policy.parameters(), strict=True):
            assert torch.equal(mine, theirs)
