"""KTO (hfacc/objectives/kto.py): exact per row, with the step's reference point, under every split of the window.

The contract (issue 31): with each kind of reference (the default frozen copy, a given ref_model, a PEFT policy's base
with the adapter disabled, precomputed log-probs), the splits bs 8 x GA 1, 2 x 4, 1 x 8, 3 x 3 (micro-batches of 3, 3
and 2 rows), padded and padding-free give the update of a hand-written big batch (tests/reward_kto_reference.py:
plain torch, no hfacc) to <= 1e-6 relative, fp32: the reference point z0 is taken over the whole window before the
first backward (Objective.window_statistics), not per micro-batch as TRL does (the negative control); TRL's
KTOTrainer gives the values of its own loss code from the same log-probs; bad data is one named error before
training. Two ranks with uneven rows: tests/test_distributed.py (tests/reward_kto_check.py's cases).
"""

import math
import re

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model

from hfacc import (
    DataCollatorForUnpairedPreference,
    KTOObjective,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    accumulation_window,
    build_default_tokenizer,
    build_preference_dataset,
    build_tiny_llama,
    iter_windows,
    precompute_reference_logps,
)
from hfacc.data.formats import DataError
from hfacc.data.padding_free import remove_padding
from hfacc.data.preference import get_kl_partners
from hfacc.objectives.kto import REFERENCE_POINT, get_reference_point, kto_losses
from hfacc.setup.model_setup import build_model_setup
from tests.helpers import CaptureGradients, relative_error, train_args
from tests.reward_kto_reference import (
    BETA,
    DESIRABLE,
    UNDESIRABLE,
    kto_big_batch,
    kto_reference_logps,
    row_logps,
    unpaired_rows,
)

TOL = 1e-6
VOCAB = 64
SPLITS = [(8, 1), (2, 4), (1, 8), (3, 3)]  # (3, 3): micro-batches of 3, 3 and 2 rows
REFERENCES = ("copy", "given", "peft", "precomputed")
COLLATE = DataCollatorForUnpairedPreference(pad_token_id=0)

# ---- TRL's loss code on the same log-probs ------------------------------------------------------------------------
# TRL 1.16's KTOTrainer._compute_loss (precomputed reference log-probs) on a model that returns these sequence
# log-probs for the completions and the KL rows gave the values below (benchmarks/reward_kto.py --check-losses runs
# TRL's code on them again). One micro-batch on one rank: TRL's reference point is then the batch's, as hfacc's.
LOGPS = torch.tensor([-4.0, -11.5, -20.25, -7.0, -9.5, -3.25])
REF = torch.tensor([-5.0, -10.0, -21.0, -6.0, -11.0, -3.0])
KL_LOGPS = torch.tensor([-8.0, -14.5, -18.0, -9.25, -10.0, -6.5])
REF_KL = torch.tensor([-9.5, -13.0, -19.5, -10.0, -12.5, -6.0])
LABEL = torch.tensor([True, False, True, True, False, False])
TRL_KTO = {  # (beta, desirable_weight, undesirable_weight) -> (loss, metrics)
    (0.1, 1.0, 1.0): (0.4958547055721283, {"rewards/chosen": 0.025, "rewards/rejected": -0.008333333,
                                           "rewards/margins": 0.033333337}),
    (0.5, 1.0, 1.5): (0.5839135050773621, {"rewards/chosen": 0.125, "rewards/rejected": -0.041666667,
                                           "rewards/margins": 0.16666667}),
}  # fmt: skip
TRL_KTO_METRICS = {"kl": 0.7083333134651184, "logps/chosen": -10.416666666666666, "logps/rejected": -8.083333333333334}


@pytest.mark.parametrize("setting", sorted(TRL_KTO), ids=str)
def test_the_loss_and_metrics_give_trls_values(setting):
    beta, desirable, undesirable = setting
    loss, metrics = TRL_KTO[setting]
    z0 = get_reference_point((KL_LOGPS - REF_KL).sum().item(), len(LABEL))
    losses = kto_losses(LOGPS - REF, LABEL, z0, beta, desirable, undesirable)
    assert losses.mean().item() == pytest.approx(loss, rel=1e-6)
    objective = KTOObjective(beta=beta, desirable_weight=desirable, undesirable_weight=undesirable)
    from hfacc.objectives.kto import KTOSums

    ones = torch.ones(6)
    sums = KTOSums(losses, ones, LABEL.float(), LOGPS, beta * (LOGPS - REF), torch.full((6,), z0))
    logs = objective.metric_logs(objective.metric_sums(sums).double().sum(0).tolist())
    want = {**metrics, **TRL_KTO_METRICS, "loss": loss}
    assert {k: logs[k] for k in want} == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_the_reference_point_is_clamped_at_zero_and_the_formula_holds():
    assert get_reference_point(-3.0, 3) == 0.0 and get_reference_point(0.0, 0) == 0.0
    r, z0, beta = torch.tensor([0.3, -0.2]), 0.1, 2.0
    got = kto_losses(r, torch.tensor([True, False]), z0, beta, 1.0, 1.5)
    want = torch.tensor(
        [
            1 - torch.sigmoid(torch.tensor(beta * (0.3 - z0))),
            1.5 * (1 - torch.sigmoid(torch.tensor(beta * (z0 + 0.2)))),
        ]
    )
    assert torch.allclose(got, want)
    with pytest.raises(ValueError, match="beta=0"):
        KTOObjective(beta=0)
    with pytest.raises(ValueError, match="undesirable_weight=0"):
        KTOObjective(undesirable_weight=0)


# ---- the whole matrix through hfacc's loop path -------------------------------------------------------------------
@pytest.fixture(scope="module")
def rows():
    return unpaired_rows(8, VOCAB)


@pytest.fixture(scope="module")
def models():
    """The policy; another model as the given reference, its output head sharpened so that the policy puts more
    mass on mismatched completions (z0 > 0: the clamp does not hide the statistic); a PEFT policy."""
    policy = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=0)
    other = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=1)
    with torch.no_grad():
        other.lm_head.weight.mul_(10.0)
    base = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=2)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0)
    return {"policy": policy, "other": other, "peft": get_peft_model(base, lora)}


def setting(models, rows, kind):
    """``(policy, ref_model to give, examples, the reference's log-probs for the hand-written big batch)``."""
    if kind == "peft":
        policy = models["peft"]
        return policy, None, rows, kto_reference_logps(policy, rows, disable_adapter=True)
    policy = models["policy"]
    if kind == "copy":  # the policy as training starts: z0 = 0 at the first step
        return policy, None, rows, kto_reference_logps(policy, rows)
    ref = kto_reference_logps(models["other"], rows)
    if kind == "given":
        return policy, models["other"], rows, ref
    given = [{**r, "ref_logps": ref[0][i].item(), "ref_kl_logps": ref[1][i].item()} for i, r in enumerate(rows)]
    return (
        policy,
        None,
        given,
        (torch.tensor([r["ref_logps"] for r in given]), torch.tensor([r["ref_kl_logps"] for r in given])),
    )


def objective_for(ref_model=None):
    return KTOObjective(beta=BETA, desirable_weight=DESIRABLE, undesirable_weight=UNDESIRABLE, ref_model=ref_model)


def accumulate(policy, objective, setup, examples, bs, ga, accelerator):
    """One window through hfacc as training runs it: the window's counts and reference point, each micro-batch's share
    of the window loss (padding-free where decided); returns the accumulated gradient."""
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


@pytest.mark.parametrize("kind", REFERENCES)
def test_every_reference_split_and_layout_gives_the_big_batch(kind, models, rows):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    policy, given, examples, ref = setting(models, rows, kind)
    want, _, z0 = kto_big_batch(policy, rows, ref)
    if kind in ("copy", "given", "precomputed"):  # a frozen copy is the policy at its first step; the other, sharper
        assert (z0 == 0) is (kind == "copy")  # reference puts z0 well above the clamp
    worst = 0.0
    for padding_free in (False, True):
        objective = objective_for(given)
        setup = build_model_setup(policy, COLLATE(examples[:2]), accelerator, objective=objective,
                                  padding_free=padding_free)  # fmt: skip
        assert setup.padding_free is padding_free and setup.loss_path == "fused"
        assert (objective.reference is None) is (kind == "precomputed")  # no reference in memory
        for bs, ga in SPLITS:
            error = relative_error(accumulate(policy, objective, setup, examples, bs, ga, accelerator), want)
            assert error <= TOL, (kind, bs, ga, padding_free, error)
            worst = max(worst, error)
    print(f"kto {kind}: z0 {z0:.4f}, worst relative error {worst:.1e}")


def test_a_reference_point_per_micro_batch_is_not_it(models, rows):
    """Negative control, TRL's way: each micro-batch's own z0 and mean, over k. Wrong on the ragged split, and on
    2 x 4 too, where every micro-batch holds as many rows: z0 enters the loss non-linearly."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    policy, given, examples, ref = setting(models, rows, "given")
    want, _, _ = kto_big_batch(policy, rows, ref)
    objective = objective_for(given)
    build_model_setup(policy, COLLATE(examples[:2]), accelerator, objective=objective, padding_free=False)
    for bs, ga in ((3, 3), (2, 4)):
        batches = [COLLATE(examples[i : i + bs]) for i in range(0, 8, bs)]
        policy.zero_grad()
        for mb in accumulation_window(accelerator, policy, batches, objective=objective, normalization="micro_batch"):
            own = {k: v for k, v in mb.batch.items() if k != REFERENCE_POINT}  # the micro-batch is its own window
            mb.scale(objective(policy, own)[1]).backward()
        got = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
        policy.zero_grad()
        assert relative_error(got, want) > 1e-3, (bs, ga)


# ---- the trainer: a covering subset ------------------------------------------------------------------------------
TRAINER_CASES = [("copy", 8, 1, True), ("given", 3, 3, True), ("peft", 1, 8, False), ("precomputed", 2, 4, True)]


@pytest.mark.parametrize("case", TRAINER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_trainer_gives_the_big_batch(case, models, rows, tmp_path):
    kind, bs, ga, padding_free = case
    policy, given, examples, ref = setting(models, rows, kind)
    want, want_loss, z0 = kto_big_batch(policy, rows, ref)
    capture = CaptureGradients(policy)
    args = train_args(tmp_path, bs, ga, args_class=TokenWeightedArguments, padding_free=padding_free,
                      audit_every_n_steps=1)  # fmt: skip
    trainer = TokenWeightedTrainer(model=policy, args=args, train_dataset=Dataset.from_list(examples),
                                   data_collator=COLLATE, objective=objective_for(given), callbacks=[capture])  # fmt: skip
    trainer.train()
    assert trainer.padding_free is padding_free and trainer.objective.fused
    assert len(capture.grads) == 1 and relative_error(capture.grads[0], want) <= TOL
    log = trainer.state.log_history[0]
    # z0 (about 0.016 here) is the mean of differences of two sums of up to 14 log-probs near -4 each (chunked from
    # the hidden states here, from full logits by hand): fp32 rounds each sum by up to ~1e-6 absolute (9.5e-7 seen
    # in a full-suite run), which is 6e-5 of this small z0; a per-micro-batch z0 is off by far more
    # (test_a_reference_point_per_micro_batch_is_not_it).
    assert log["loss"] == pytest.approx(want_loss, rel=1e-5) and log["kl"] == pytest.approx(z0, rel=1e-5, abs=5e-6)
    assert log["num_examples"] == 8 and "examples_per_second" in log and log["accumulation_audit_error"] <= 1e-5


def test_evaluation_logs_trls_metrics_over_all_rows(models, rows, tmp_path):
    """evaluate() in one batch of 8: TRL's names, each over its own rows (a batch without a window is its own)."""
    policy, given, examples, ref = setting(models, rows, "given")
    args = train_args(tmp_path, 2, 1, args_class=TokenWeightedArguments, per_device_eval_batch_size=8)
    trainer = TokenWeightedTrainer(model=policy, args=args, eval_dataset=Dataset.from_list(examples),
                                   data_collator=COLLATE, objective=objective_for(given))  # fmt: skip
    metrics = trainer.evaluate()
    _, loss, z0 = kto_big_batch(policy, rows, ref)
    with torch.no_grad():
        logps = row_logps(policy, rows)
    good = torch.tensor([r["label"] for r in rows])
    rewards = BETA * (logps - ref[0])
    want = {
        "eval_loss": loss,
        "eval_kl": z0,
        "eval_rewards/chosen": rewards[good].mean().item(),
        "eval_rewards/rejected": rewards[~good].mean().item(),
        "eval_rewards/margins": (rewards[good].mean() - rewards[~good].mean()).item(),
        "eval_logps/chosen": logps[good].mean().item(),
        "eval_logps/rejected": logps[~good].mean().item(),
    }
    assert {k: metrics[k] for k in want} == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert metrics["eval_num_examples"] == 8


# ---- data: unpaired rows, their KL rows, and what is refused ------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return build_default_tokenizer()


PAIRS = [
    {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"},
    {"prompt": "Spell cat.", "chosen": " C A T", "rejected": " C T"},
    {"prompt": "Say hi.", "chosen": " hi", "rejected": " bye"},
]


def test_pairs_are_unpaired_as_trl_does_with_a_kl_row_each(tokenizer):
    """Chosen -> label True, rejected -> False (TRL's unpair_preference_dataset: the chosen rows, then the rejected);
    each KL row is the row's prompt and the completion of the nearest earlier row with another prompt."""
    built = build_preference_dataset(Dataset.from_list(PAIRS), tokenizer, unpaired=True)
    assert built["label"] == [True, True, True, False, False, False]
    texts = [tokenizer.decode(r["completion_input_ids"]) for r in built]
    kl = [tokenizer.decode(r["kl_input_ids"]) for r in built]
    assert texts[1].startswith("Spell cat. C A T") and texts[4].startswith("Spell cat. C T")
    # row 0 (2 + 2, chosen) wraps to the last row (Say hi., rejected); row 3 (2 + 2, rejected) takes row 2's answer
    assert kl[0].startswith("2 + 2 = bye") and kl[3].startswith("2 + 2 = hi") and kl[4].startswith("Spell cat. 5")
    for row in built:  # the KL row's targets are exactly the borrowed completion's
        assert sum(y != -100 for y in row["kl_labels"]) >= 1
    batch = COLLATE(built.to_list())
    assert batch["label"].dtype == torch.bool and batch["kl_input_ids"].shape[0] == 6
    assert get_kl_partners([7, 7, 8, 9]) == [3, 3, 1, 2]  # a prompt never borrows its own pair's completion


def test_the_kl_rows_do_not_depend_on_the_batch_size(tokenizer):
    """Paired once in the dataset: the same rows whatever the micro-batch size (TRL pairs them within each batch of
    per_device_train_batch_size, so its KL rows change with it)."""
    rows = [{"prompt": f"Q{i}.", "completion": f" A{i}", "label": i % 2 == 0} for i in range(6)]
    built = build_preference_dataset(Dataset.from_list(rows), tokenizer)
    assert [tokenizer.decode(r["kl_input_ids"]).split(" ")[-1][:2] for r in built] == [
        "A5",
        "A0",
        "A1",
        "A2",
        "A3",
        "A4",
    ]


def test_bad_unpaired_data_is_one_named_error(tokenizer):
    ok = {"prompt": "Q.", "completion": " A", "label": True}
    with pytest.raises(DataError, match="needs at least 2 rows"):
        build_preference_dataset(Dataset.from_list([ok]), tokenizer)
    with pytest.raises(DataError, match=r"row 0, field 'label': 1 \(int\) is not a boolean"):
        build_preference_dataset(Dataset.from_list([{**ok, "label": 1}, {**ok, "label": 0}]), tokenizer)
    with pytest.raises(DataError, match="missing \\['completion'\\]"):
        build_preference_dataset(Dataset.from_list([{"prompt": "Q.", "label": True}] * 2), tokenizer, unpaired=True)
    with pytest.raises(DataError, match="row 1: no field 'completion'"):
        build_preference_dataset(Dataset.from_list([ok, {**ok, "completion": None}]), tokenizer)
    with pytest.raises(ValueError, match="has no KL rows"):
        objective = KTOObjective()
        objective.window_statistics(None, [{"label": torch.tensor([True])}])


@pytest.mark.parametrize(
    "column, bad, said",
    [("ref_logps", None, "None, but row 0 has a value"), ("ref_logps", math.nan, "nan is not a finite number"),
     ("ref_kl_logps", -math.inf, "-inf is not a finite number")],
    ids=["None", "NaN", "-inf"],
)  # fmt: skip
def test_a_bad_precomputed_reference_log_prob_is_one_named_error_before_training(column, bad, said, tmp_path):
    """Row 5 of 8 with a None (a collation error mid-run before) or a non-finite value (every step it was in was
    skipped, each epoch): the trainer refuses the data when it is built, naming the column, the row and the fix."""
    rows = [{**r, "ref_logps": -5.0, "ref_kl_logps": -6.0} for r in unpaired_rows(8, VOCAB)]
    rows[5][column] = bad
    args = train_args(tmp_path, 2, 1, args_class=TokenWeightedArguments)
    with pytest.raises(DataError, match=rf"the training data, row 5, column '{column}': {said}: recompute them with "
                       r"hfacc.precompute_reference_logps, or drop the columns"):  # fmt: skip
        TokenWeightedTrainer(model=build_tiny_llama(vocab_size=VOCAB, hidden_size=16, num_layers=1), args=args,
                             train_dataset=Dataset.from_list(rows), data_collator=COLLATE, objective=KTOObjective())  # fmt: skip
    only = Dataset.from_list([{k: v for k, v in r.items() if k != "ref_kl_logps"} for r in rows[:5]])
    with pytest.raises(DataError, match=r"has \['ref_logps'\] but not \['ref_kl_logps'\], which go together"):
        KTOObjective().check_data(only)


def test_reference_log_probs_are_precomputed_for_the_kl_rows_too(models, rows):
    other = models["other"]
    built = precompute_reference_logps(
        Dataset.from_list(rows), other, pad_token_id=0, batch_size=3, show_progress=False
    )
    want = kto_reference_logps(other, rows)
    assert relative_error(torch.tensor(built["ref_logps"]), want[0]) <= 1e-6
    assert relative_error(torch.tensor(built["ref_kl_logps"]), want[1]) <= 1e-6


def test_a_batch_without_its_window_is_its_own_window(models, rows):
    """Evaluation batches carry no window's z0: the batch's own KL rows give it (and the whole data as one batch
    gives the big batch's)."""
    from accelerate import Accelerator

    policy, given, _, ref = setting(models, rows, "given")
    objective = objective_for(given)
    build_model_setup(policy, COLLATE(rows[:2]), Accelerator(cpu=True), objective=objective, padding_free=False)
    _, sums = objective(policy, COLLATE(rows))
    assert sums.reference_point[0].item() == pytest.approx(kto_big_batch(policy, rows, ref)[2], rel=1e-5, abs=1e-7)


# ---- hfacc verify --objective kto -------------------------------------------------------------------------------
VERIFY_KTO = ["verify", "--objective", "kto", "--per_device_train_batch_size", "3", "--gradient_accumulation_steps",
              "3", "--embedded_hidden_size", "32", "--embedded_num_layers", "1"]  # fmt: skip


def run_verify_kto(capsys):
    from hfacc.cli import main as cli_main

    code = cli_main(VERIFY_KTO)
    return code, capsys.readouterr().out


def test_hfacc_verify_objective_kto_on_the_embedded_rows(capsys):
    """Its reference is unlike the policy (a perturbed copy), so the window's z0 is well above 0 and TRL's
    per-micro-batch z0 and means miss the big batch by far; the window line names the examples once."""
    code, out = run_verify_kto(capsys)
    assert code == 0 and "PASS" in out and "objective   kto" in out
    assert "examples per micro-batch (rank 0): [3, 3, 3]" in out and "chunked log-probs" in out
    assert "= 9 examples\n" in out and "'kto' counts examples exactly" in out
    z0 = float(re.search(r"statistic   kto_reference_point = (\S+) over the window", out).group(1))
    stock = float(re.search(r"mean of micro-batch means \(as TRL's trainers\): relative error (\S+)", out).group(1))
    assert z0 > 1.0 and stock > 0.1, (z0, stock)


def test_hfacc_verify_objective_kto_fails_with_a_reference_point_per_micro_batch(capsys, monkeypatch):
    """Negative control: with no window statistic, each micro-batch takes its own z0 (TRL's way); verify must see it."""
    window_statistics = KTOObjective.window_statistics

    def per_micro_batch(self, model, batches, *args, **kwargs):  # none for a window: each batch takes its own z0
        return window_statistics(self, model, batches, *args, **kwargs) if len(batches) == 1 else {}

    monkeypatch.setattr(KTOObjective, "window_statistics", per_micro_batch)
    code, out = run_verify_kto(capsys)
    assert code == 1 and "FAIL" in out, out
    error = float(re.search(r"one big batch \(fp32\): relative error (\S+)", out).group(1))
    assert error > 1e-2, error


def test_rows_without_a_label_are_refused_naming_label(tokenizer):
    """A prompt and a completion but no 'label': the error names 'label' (KTO's column), not the pairs' 'chosen'."""
    with pytest.raises(DataError, match="no 'label'") as refused:
        build_preference_dataset(Dataset.from_list([{"prompt": "Q.", "completion": " A"}] * 2), tokenizer)
    assert "chosen" not in str(refused.value)


def test_unpaired_rows_given_the_pairs_collator_or_a_pairs_job_are_refused_by_name(tokenizer, tmp_path):
    """Unpaired rows in DataCollatorForPreference (the trainer's first batch) or in the reward/DPO jobs' pair
    building: one named error pointing at DataCollatorForUnpairedPreference / KTO, not KeyError 'chosen_input_ids'."""
    from hfacc import DataCollatorForPreference, TokenWeightedTrainer, build_tiny_llama
    from tests.helpers import train_args

    rows = Dataset.from_list([{"prompt": f"Q{i}.", "completion": f" A{i}", "label": i % 2 == 0} for i in range(4)])
    built = build_preference_dataset(rows, tokenizer)
    model = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, num_heads=2)
    trainer = TokenWeightedTrainer(
        model=model,
        args=train_args(tmp_path, 2, 1, remove_unused_columns=False),
        train_dataset=built,
        data_collator=DataCollatorForPreference(tokenizer.pad_token_id),
        objective=KTOObjective(),
    )
    with pytest.raises(DataError, match="unpaired \\(KTO\\) row. Use hfacc.DataCollatorForUnpairedPreference"):
        next(iter(trainer.get_train_dataloader()))
    with pytest.raises(DataError, match="These are unpaired rows \\(KTO's format\\): train them with KTO"):
        build_preference_dataset(rows, tokenizer, unpaired=False)  # what `hfacc reward` / `hfacc dpo` now call
