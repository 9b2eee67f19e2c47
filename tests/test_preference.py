"""Preference optimization (hfacc/objectives/preference.py): exact per pair under every split of the window.

The contract (issue 23): for every loss type, with and without the NLL term, with each kind of reference (the
default frozen copy, a given ref_model, a PEFT policy's base with the adapter disabled, precomputed log-probs), the
splits bs 8 x GA 1, 2 x 4, 1 x 8, 3 x 3 (micro-batches of 3, 3 and 2 pairs), padded and padding-free, and token-budget
micro-batches give the update of a hand-written big-batch reference (tests/preference_reference.py: plain torch, no
hfacc) to <= 1e-6 relative, fp32. Two ranks with uneven pairs: tests/test_distributed.py (its launch runs
tests/preference_check.py's cases too). Under DeepSpeed ZeRO-3 and FSDP2: tests/test_engines.py.

To stay within the CI budget: the loss math is checked over all types as pure functions (and against TRL's values);
the whole matrix runs through hfacc's own loop path (the per-model setup, the window's counts, the objective's loss:
what the trainer routes), one module-scoped model per loss type; the trainer itself runs a covering subset.
"""

import logging
import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model

from hfacc import (
    DataCollatorForPreference,
    DPOObjective,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    accumulation_window,
    build_tiny_llama,
    iter_windows,
)
from hfacc.data.formats import DataError
from hfacc.data.padding_free import remove_padding
from hfacc.objectives.preference import hinge_loss, ipo_loss, preference_losses, robust_loss, sigmoid_loss, simpo_loss
from hfacc.setup.model_setup import build_model_setup
from tests.helpers import CaptureGradients, relative_error, train_args
from tests.preference_reference import (
    BETA,
    GAMMA,
    LOSS_TYPES,
    SMOOTHING,
    big_batch,
    make_pairs,
    pair_loss,
    reference_logps,
)

TOL = 1e-6
VOCAB = 64
SPLITS = [(8, 1), (2, 4), (1, 8), (3, 3)]  # (3, 3): micro-batches of 3, 3 and 2 pairs
REFERENCES = ("copy", "given", "peft", "precomputed")
COLLATE = DataCollatorForPreference(pad_token_id=0)


def objective_for(loss_type, nll_weight=0.0, ref_model=None):
    return DPOObjective(
        beta=BETA,
        loss_type=loss_type,
        label_smoothing=SMOOTHING,
        nll_weight=nll_weight,
        ref_model=ref_model,
        gamma=GAMMA,
    )


# ---- the loss math ---------------------------------------------------------------------------------------------
# TRL 1.16's own loss code (DPOTrainer._compute_loss with precomputed reference log-probs; CPOTrainer.cpo_loss for
# SimPO) on these sequence log-probs gave the values below; TRL is a comparison target, not a dependency, so they are
# written here, as tests/test_batching.py ports TRL's packing expectations. (benchmarks/dpo.py --check-losses runs
# TRL's code on them again.)
CHOSEN = torch.tensor([-4.0, -11.5, -20.25, -7.0])
REJECTED = torch.tensor([-6.5, -9.0, -3.0, -15.5])
REF_CHOSEN = torch.tensor([-5.0, -10.0, -21.0, -6.0])
REF_REJECTED = torch.tensor([-5.5, -12.0, -2.5, -14.0])
CHOSEN_LENGTHS, REJECTED_LENGTHS = torch.tensor([1, 5, 9, 3]), torch.tensor([2, 7, 1, 4])
TRL_DPO = {  # loss_type -> (label_smoothing, the batch mean TRL returns); beta 0.1
    "sigmoid": (0.0, 0.7106116414070129),
    "hinge": (0.0, 1.0187499523162842),
    "ipo": (0.0, 22.289634704589844),
    "robust": (0.2, 0.7168616056442261),
}
TRL_SFT = 2.374999761581421  # loss_type="sft": the chosen tokens' mean NLL
TRL_METRICS = {"rewards/chosen": -0.01875, "rewards/accuracies": 0.75, "rewards/margins": -0.01875}
TRL_METRICS.update({"logps/chosen": -10.6875, "logps/rejected": -8.5, "rewards/rejected": 0.0})
TRL_SIMPO = {  # label_smoothing -> per-pair losses; beta 2.0, simpo_gamma 0.5
    0.0: [2.1269280910491943, 2.6053221225738525, 0.3132616877555847, 0.0728059709072113],
    0.1: [1.9269280433654785, 2.3524649143218994, 0.4132617115974426, 0.33113932609558105],
}
TRL_SIMPO_REWARDS = ([-8.0, -4.6, -4.5, -4.666666507720947], [-6.5, -2.5714285373687744, -6.0, -7.75])


def trl_inputs(loss_type, **kwargs):
    return preference_losses(
        CHOSEN,
        REJECTED,
        REF_CHOSEN,
        REF_REJECTED,
        chosen_lengths=CHOSEN_LENGTHS,
        rejected_lengths=REJECTED_LENGTHS,
        loss_type=loss_type,
        **kwargs,
    )


@pytest.mark.parametrize("loss_type", sorted(TRL_DPO))
def test_dpo_losses_give_trls_values(loss_type):
    smoothing, want = TRL_DPO[loss_type]
    scores = trl_inputs(loss_type, beta=0.1, label_smoothing=smoothing)
    assert scores.losses.mean().item() == pytest.approx(want, rel=1e-6)
    chosen, rejected = scores.chosen_rewards, scores.rejected_rewards  # TRL's logged metrics, same definitions
    got = {
        "rewards/chosen": chosen.mean().item(),
        "rewards/rejected": rejected.mean().item(),
        "rewards/accuracies": (chosen > rejected).float().mean().item(),
        "rewards/margins": (chosen - rejected).mean().item(),
        "logps/chosen": CHOSEN.mean().item(),
        "logps/rejected": REJECTED.mean().item(),
    }
    assert got == pytest.approx(TRL_METRICS, abs=1e-6)


def test_nll_term_is_trls_sft_loss():
    """TRL's ``loss_type="sft"`` term: the mean over the chosen target tokens of -log p; hfacc's NLL sum / tokens."""
    assert (-CHOSEN.sum() / CHOSEN_LENGTHS.sum()).item() == pytest.approx(TRL_SFT, rel=1e-6)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_simpo_gives_trls_cpo_values(smoothing):
    scores = trl_inputs("simpo", beta=2.0, gamma=0.5, label_smoothing=smoothing)
    assert scores.losses.tolist() == pytest.approx(TRL_SIMPO[smoothing], rel=1e-6)
    assert scores.chosen_rewards.tolist() == pytest.approx(TRL_SIMPO_REWARDS[0], rel=1e-6)
    assert scores.rejected_rewards.tolist() == pytest.approx(TRL_SIMPO_REWARDS[1], rel=1e-6)


def test_every_loss_type_is_its_formula():
    """The pure functions against the hand-written formulas (tests/preference_reference.py), with the smoothing and
    margin set, so that each term is exercised; and the gradients too (the trainer backpropagates them)."""
    torch.manual_seed(0)
    logps = (-torch.rand(12) * 30).requires_grad_()
    ref = -torch.rand(12) * 30
    lengths = torch.randint(1, 15, (12,))
    for loss_type in LOSS_TYPES:
        ours = preference_losses(
            logps[:6],
            logps[6:],
            ref[:6],
            ref[6:],
            chosen_lengths=lengths[:6],
            rejected_lengths=lengths[6:],
            loss_type=loss_type,
            beta=BETA,
            label_smoothing=SMOOTHING,
            gamma=GAMMA,
        ).losses
        want = pair_loss(loss_type, logps, ref, lengths)
        (g_ours,) = torch.autograd.grad(ours.sum(), logps)
        (g_want,) = torch.autograd.grad(want.sum(), logps)
        assert relative_error(ours.detach(), want.detach()) <= 1e-6, loss_type
        assert relative_error(g_ours, g_want) <= 1e-6, loss_type
    margin = torch.tensor([-3.0, 0.0, 5.0])
    assert torch.allclose(robust_loss(margin, 0.1, 0.0), sigmoid_loss(margin, 0.1))  # eps 0: DPO
    assert torch.equal(hinge_loss(margin, 0.1), torch.relu(1 - 0.1 * margin))
    assert ipo_loss(torch.tensor(1 / (2 * 0.1)), 0.1) == 0  # at IPO's target margin
    assert simpo_loss(torch.tensor([0.0]), torch.tensor([0.0]), 2.0, 0.0) == pytest.approx(math.log(2))


def test_settings_are_checked():
    with pytest.raises(ValueError, match="loss_type='kto'"):
        DPOObjective(loss_type="kto")
    with pytest.raises(ValueError, match="robust loss needs 0 <= label_smoothing < 0.5"):
        DPOObjective(loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="reference-free"):
        DPOObjective(loss_type="simpo", ref_model=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="nll_weight=-1"):
        DPOObjective(nll_weight=-1)


# ---- the whole matrix through hfacc's loop path -----------------------------------------------------------------
@pytest.fixture(scope="module")
def pairs():
    return make_pairs(8, VOCAB, seed=3)


@pytest.fixture(scope="module")
def models():
    """The policy, another model as the given reference, a PEFT policy (a non-zero adapter, so its base differs)."""
    policy = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=0)
    other = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=1)
    base = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=2)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0)
    peft = get_peft_model(base, lora)
    return {"policy": policy, "other": other, "peft": peft}


def setting(models, pairs, kind):
    """``(policy, ref_model to give, examples, the reference's sequence log-probs for the hand-written big batch)``."""
    if kind == "peft":
        policy = models["peft"]
        return policy, None, pairs, reference_logps(policy, pairs, disable_adapter=True)
    policy = models["policy"]
    if kind == "copy":  # the policy as training starts
        return policy, None, pairs, reference_logps(policy, pairs)
    ref = reference_logps(models["other"], pairs)
    if kind == "given":
        return policy, models["other"], pairs, ref
    b = len(pairs)  # precomputed: the numbers ride in the dataset's columns
    rows = [
        {**p, "ref_chosen_logps": ref[i].item(), "ref_rejected_logps": ref[b + i].item()} for i, p in enumerate(pairs)
    ]
    return (
        policy,
        None,
        rows,
        torch.tensor([r["ref_chosen_logps"] for r in rows] + [r["ref_rejected_logps"] for r in rows]),
    )


def accumulate(policy, objective, setup, examples, bs, ga, accelerator):
    """One window through hfacc as training runs it, with the per-model decisions ``setup`` took: the window's counts
    (one collective), each micro-batch's share of the window loss (padding-free where decided); returns the
    accumulated gradient."""
    batches = [COLLATE(examples[i : i + bs]) for i in range(0, len(examples), bs)]
    policy.zero_grad()
    for window in iter_windows(batches, ga):
        assert len(window) == len(batches)  # one window: the whole batch, split
        for mb in accumulation_window(accelerator, policy, window, objective=objective):
            laid = remove_padding(mb.batch, setup.one_row, keep=objective.row_keys) if setup.padding_free else mb.batch
            _, sums = objective(policy, laid)
            mb.scale(sums).backward()
    grad = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]).clone()
    policy.zero_grad()
    return grad


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_reference_split_and_layout_gives_the_big_batch(loss_type, models, pairs):
    """Per kind of reference and layout, the per-model setup runs once (build_model_setup: layout, loss path, the
    reference); then every split, without and with the NLL term (the same objective, its weight changed)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    kinds = REFERENCES if loss_type != "simpo" else ("none",)
    worst = 0.0
    for kind in kinds:
        policy, given, examples, ref = setting(models, pairs, "copy" if kind == "none" else kind)
        wanted = {w: big_batch(policy, pairs, loss_type, ref, w)[0] for w in (0.0, 0.5)}
        for padding_free in (False, True):
            objective = objective_for(loss_type, 0.0, given)
            setup = build_model_setup(
                policy, COLLATE(examples[:2]), accelerator, objective=objective, padding_free=padding_free
            )
            assert setup.padding_free is padding_free and setup.loss_path == "fused"
            assert (objective.reference is None) is (kind in ("precomputed", "none"))  # no reference in memory
            for nll_weight, want in wanted.items():
                objective.nll_weight = nll_weight
                for bs, ga in SPLITS:
                    error = relative_error(accumulate(policy, objective, setup, examples, bs, ga, accelerator), want)
                    assert error <= TOL, (kind, nll_weight, bs, ga, padding_free, error)
                    worst = max(worst, error)
    print(f"{loss_type}: worst relative error {worst:.1e}")


def test_the_mean_of_micro_batch_means_is_not_it(models, pairs):
    """Negative control: what peers do (each micro-batch's mean / k) misses the big batch by far more than 1e-6 on
    the ragged split, for the pairs and for the NLL term."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    policy, _, _, ref = setting(models, pairs, "given")
    for nll_weight in (0.0, 0.5):
        want, _ = big_batch(policy, pairs, "sigmoid", ref, nll_weight)
        batches = [COLLATE(pairs[i : i + 3]) for i in range(0, 8, 3)]
        objective = objective_for("sigmoid", nll_weight, models["other"])
        build_model_setup(policy, batches[0], accelerator, objective=objective, padding_free=False)
        policy.zero_grad()
        for mb in accumulation_window(accelerator, policy, batches, objective=objective, normalization="micro_batch"):
            mb.scale(objective(policy, mb.batch)[1]).backward()
        got = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
        policy.zero_grad()
        assert relative_error(got, want) > 1e-3


# ---- the trainer: a covering subset ------------------------------------------------------------------------------
# (loss type, nll weight, reference, bs, GA, padding-free): every loss type with and without the NLL term, every
# split, both layouts and every kind of reference appear, each with several of the others.
TRAINER_CASES = [
    ("sigmoid", 0.0, "copy", 8, 1, True),
    ("sigmoid", 0.5, "given", 3, 3, False),
    ("ipo", 0.5, "precomputed", 2, 4, True),
    ("ipo", 0.0, "peft", 1, 8, False),
    ("hinge", 0.0, "given", 1, 8, True),
    ("hinge", 0.5, "copy", 3, 3, True),
    ("robust", 0.0, "peft", 3, 3, True),
    ("robust", 0.5, "precomputed", 8, 1, False),
    ("simpo", 0.0, "none", 2, 4, False),
    ("simpo", 0.5, "none", 3, 3, True),
]


def run(policy, examples, objective, tmp_path, bs, ga, **overrides):
    capture = CaptureGradients(policy)
    args = train_args(tmp_path, bs, ga, args_class=TokenWeightedArguments, **overrides)
    trainer = TokenWeightedTrainer(
        model=policy,
        args=args,
        train_dataset=Dataset.from_list(examples),
        data_collator=COLLATE,
        objective=objective,
        callbacks=[capture],
    )
    trainer.train()
    return trainer, capture


@pytest.mark.parametrize("case", TRAINER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_trainer_gives_the_big_batch(case, models, pairs, tmp_path):
    loss_type, nll_weight, kind, bs, ga, padding_free = case
    policy, given, examples, ref = setting(models, pairs, "copy" if kind == "none" else kind)
    want, want_loss = big_batch(policy, pairs, loss_type, ref, nll_weight)
    trainer, capture = run(
        policy, examples, objective_for(loss_type, nll_weight, given), tmp_path, bs, ga, padding_free=padding_free
    )
    assert trainer.padding_free is padding_free and trainer.objective.fused
    assert len(capture.grads) == 1 and relative_error(capture.grads[0], want) <= TOL
    logged = trainer.state.log_history[0]
    assert logged["loss"] == pytest.approx(want_loss, rel=1e-5) and logged["num_pairs"] == 8
    assert "pairs_per_second" in logged and "token_accuracy" not in logged


@pytest.mark.parametrize(
    "loss_type, kind, padding_free", [("sigmoid", "copy", True), ("ipo", "peft", False), ("simpo", "none", True)]
)
def test_token_budget_micro_batches_give_the_big_batch(loss_type, kind, padding_free, models, pairs, tmp_path):
    """Micro-batches of at most 96 padded tokens (a pair is two rows as long as its longer side: never split), all in
    one window: their sizes differ, the update does not."""
    policy, given, examples, ref = setting(models, pairs, "copy" if kind == "none" else kind)
    want, _ = big_batch(policy, pairs, loss_type, ref, 0.5)
    objective = objective_for(loss_type, 0.5, given)
    trainer, capture = run(
        policy, examples, objective, tmp_path, 8, 16, max_tokens_per_batch=96, padding_free=padding_free
    )
    sizes = [objective.num_examples(b) for b in trainer.get_train_dataloader()]
    assert sum(sizes) == 8 and len(set(sizes)) > 1
    assert len(capture.grads) == 1 and relative_error(capture.grads[0], want) <= TOL


@pytest.mark.parametrize("objective", ["dpo", "instance"])
def test_a_resumed_run_compares_with_the_policy_as_the_run_started(objective, pairs, tmp_path):
    """The default reference is the policy as training started. A resumed run loads the checkpoint's trained
    weights before its first window: the copy is taken before that load, else the resumed steps would compare the
    policy with itself (every reward 0 again: a silently different loss: 1.6e-2 off here)."""

    def trainer_for(max_steps):
        policy = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=0)
        args = train_args(
            tmp_path,
            2,
            1,
            args_class=TokenWeightedArguments,
            learning_rate=0.5,
            optim="sgd",
            max_steps=max_steps,
            lr_scheduler_type="constant",
            save_strategy="steps",
            save_steps=1,
            padding_free=False,
        )
        capture = CaptureGradients(policy)
        trainer = TokenWeightedTrainer(
            model=policy,
            args=args,
            train_dataset=Dataset.from_list(pairs[:4]),
            data_collator=COLLATE,
            objective=DPOObjective(beta=BETA) if objective == "instance" else "dpo",
            callbacks=[capture],
        )
        return trainer, capture

    first, _ = trainer_for(1)
    first.train()
    start = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=0)
    want, _ = big_batch(first.model, pairs[2:4], "sigmoid", reference_logps(start, pairs[2:4]), eps=0.0)
    resumed, capture = trainer_for(2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert len(capture.grads) == 1 and relative_error(capture.grads[0], want) <= TOL
    step_two = next(h for h in resumed.state.log_history if h["step"] == 2 and "loss" in h)
    assert step_two["rewards/margins"] != 0.0


def test_evaluation_logs_trls_metrics_over_all_pairs(models, pairs, tmp_path):
    """evaluate(): each metric averaged over the evaluation's pairs (batches of 3, 3, 2), under TRL's names."""
    policy, given, examples, ref = setting(models, pairs, "given")
    objective = objective_for("sigmoid", 0.5, given)
    args = train_args(tmp_path, 2, 1, args_class=TokenWeightedArguments, per_device_eval_batch_size=3)
    trainer = TokenWeightedTrainer(
        model=policy, args=args, eval_dataset=Dataset.from_list(examples), data_collator=COLLATE, objective=objective
    )
    metrics = trainer.evaluate()
    with torch.no_grad():
        from tests.preference_reference import sequence_logps

        logps, lengths = sequence_logps(policy, pairs)
    chosen, rejected = BETA * (logps[:8] - ref[:8]), BETA * (logps[8:] - ref[8:])
    loss = pair_loss("sigmoid", logps, ref, lengths).mean() + 0.5 * (-logps[:8].sum()) / lengths[:8].sum()
    want = {
        "eval_loss": loss.item(),
        "eval_rewards/chosen": chosen.mean().item(),
        "eval_rewards/rejected": rejected.mean().item(),
        "eval_rewards/accuracies": (chosen > rejected).float().mean().item(),
        "eval_rewards/margins": (chosen - rejected).mean().item(),
        "eval_logps/chosen": logps[:8].mean().item(),
        "eval_logps/rejected": logps[8:].mean().item(),
        "eval_nll_loss": (-logps[:8].sum() / lengths[:8].sum()).item(),
    }
    assert {k: metrics[k] for k in want} == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert metrics["eval_num_pairs"] == 8


def test_a_window_of_pairs_with_no_reference_log_probs_is_refused(models, pairs, tmp_path):
    """Precomputed log-probs for some rows but not others: a named error, not a silent mix."""
    rows = [dict(p) for p in pairs]
    rows[0].update(ref_chosen_logps=-1.0, ref_rejected_logps=-2.0)
    with pytest.raises(ValueError, match="some pairs of the micro-batch have reference log-probs"):
        COLLATE(rows[:2])


def test_a_bad_precomputed_reference_log_prob_is_one_named_error(pairs):
    """The trainer's check of the data before training (Objective.check_data): None in one pair of precomputed
    columns, or a non-finite value, is named with its column, row and fix."""
    rows = [{**p, "ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0} for p in pairs]
    rows[3]["ref_rejected_logps"] = float("nan")
    with pytest.raises(DataError, match="the training data, row 3, column 'ref_rejected_logps': nan is not a finite"):
        DPOObjective().check_data(Dataset.from_list(rows))
    rows[3]["ref_rejected_logps"], rows[6]["ref_chosen_logps"] = -2.0, None
    with pytest.raises(DataError, match="row 6, column 'ref_chosen_logps': None, but row 0 has a value: recompute"):
        DPOObjective().check_data(Dataset.from_list(rows))


def test_one_objective_set_up_for_a_second_model_compares_with_that_models_copy(models, pairs):
    """The same DPOObjective given to a second trainer (another model): its frozen copy is the second model's, never
    the first one's kept from the earlier setup (that would train against the wrong reference, silently)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    objective = objective_for("sigmoid")
    for name in ("policy", "other"):
        model = models[name]
        build_model_setup(model, COLLATE(pairs[:2]), accelerator, objective=objective, padding_free=False)
        copy = objective.reference.module
        assert copy is not model
        for mine, theirs in zip(copy.parameters(), model.parameters(), strict=True):
            assert torch.equal(mine, theirs), name


def test_objective_by_name_keeps_the_pair_columns(models, pairs, tmp_path, caplog):
    """objective='dpo' (a name, as the recipe and verify give it): the Trainer keeps the pair columns it would drop
    as unused, and trains the default DPO; the training-time audit splits the window into pairs."""
    policy, _, examples, ref = setting(models, pairs, "copy")
    want, _ = big_batch(policy, pairs, "sigmoid", ref, 0.0, beta=0.1, eps=0.0)  # DPOObjective's defaults
    capture = CaptureGradients(policy)
    args = train_args(tmp_path, 4, 2, args_class=TokenWeightedArguments, objective="dpo", audit_every_n_steps=1)
    trainer = TokenWeightedTrainer(
        model=policy, args=args, train_dataset=Dataset.from_list(examples), data_collator=COLLATE, callbacks=[capture]
    )
    with caplog.at_level(logging.INFO, logger="hfacc"):
        trainer.train()
    assert isinstance(trainer.objective, DPOObjective) and trainer.objective.beta == 0.1
    assert relative_error(capture.grads[0], want) <= TOL
    # The audit recomputes the window pair by pair (a pair is the objective's example: two rows, kept together).
    assert trainer.state.log_history[0]["accumulation_audit_error"] <= TOL


# ---- hfacc verify --objective dpo -------------------------------------------------------------------------------
def test_verify_proves_the_preference_objective_and_shows_what_peers_do(models, pairs):
    """A ragged window (3, 3, 2 pairs) with the NLL term: hfacc's accumulation passes; the mean of micro-batch
    means (TRL's DPOTrainer, torchtune) is measured beside it and fails."""
    from hfacc import verify_accumulation

    objective = objective_for("sigmoid", 0.5, models["other"])
    common = dict(micro_batch_size=3, gradient_accumulation_steps=3, objective=objective, precisions=())
    report = verify_accumulation(models["policy"], pairs[:8] + pairs[:1], COLLATE, **common)
    assert report.passed and report.error <= 1e-6
    assert report.window["unit"] == "pairs" and report.window["targets_per_micro_batch"] == [3, 3, 3]
    stock = verify_accumulation(models["policy"], pairs[:7] + pairs[:2], COLLATE, path="stock", **common)
    assert not stock.passed and stock.error > 1e-3  # micro-batches of 3 pairs, chosen tokens differ
    finding = next(f for f in stock.findings if f.name == "peers' normalization")
    assert "mean of micro-batch means" in finding.message


def test_hfacc_verify_objective_dpo_on_the_embedded_pairs(capsys):
    from hfacc.cli import main as cli_main

    code = cli_main(["verify", "--objective", "dpo", "--per_device_train_batch_size", "2", "--precisions", "bf16"])
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out and "objective   dpo" in out
    assert "pairs per micro-batch (rank 0): [2, 2, 2, 2]" in out and "chunked log-probs" in out
