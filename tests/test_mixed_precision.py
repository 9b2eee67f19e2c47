"""Mixed precision: the layout checks judge semantics, not rounding, and the accumulation is exact up to rounding.

As users run it on a GPU, here on CPU: ``bf16=True`` (accelerate's autocast over fp32 master weights) and models
whose weights are bf16 (``dtype=torch.bfloat16``); fp16 where autocast applies (``torch.autocast("cpu",
dtype=torch.float16)``: accelerate does not autocast fp16 on CPU) and fp16 weights.

The bound (:func:`hfacc.ops.precision.get_rounding_bound`): a window accumulated in a precision is compared with the
big batch computed in the same precision. Both are that precision's rounding of one exact gradient (fp32's, exact to
1e-7), and the big batch lies ``floor`` from it (its noise floor, measured in each test): an exact accumulation lies
within ``2 * floor`` of the big batch (the triangle inequality). Measured here: 4.1e-3 to 4.2e-3 against a floor of
4.3e-3 under bf16 autocast, 5.8e-3 to 6.8e-3 against 6.0e-3 on bf16 weights; a mis-normalized one is off by 4.75.
"""

import copy
import json
import logging
import subprocess
from typing import NamedTuple

import pytest
import torch
from transformers import Trainer

from hfacc import (
    DataCollatorForCausalLM,
    DataCollatorForPreference,
    DataCollatorForVisionLM,
    DPOObjective,
    PolicyGradientObjective,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    build_tiny_llama,
)
from hfacc.objectives import CausalLMObjective
from hfacc.ops.precision import get_check_precision, get_rounding_bound, get_tolerance
from hfacc.setup.layout_check import check_padding_free, check_row_offsets, choose_padding_free
from hfacc.verify.equivalence import verify_accumulation
from tests.helpers import (
    ROOT,
    VOCAB,
    KwargsLM,
    build_family,
    full_batch_causal_lm,
    make_examples,
    pad,
    relative_error,
    run_trainer,
    torchrun,
    train_args,
)

COLLATE = DataCollatorForCausalLM(pad_token_id=0)
SPLITS = [(8, 1), (2, 4), (1, 8), (3, 3)]  # (3, 3): micro-batches of 3, 3 and 2
BF16, FP16 = torch.bfloat16, torch.float16
ONE = type("OneRank", (), {"num_processes": 1})()


def said(caplog, level):
    return [r.getMessage() for r in caplog.records if r.levelno == level and "padd" in r.getMessage()]


# ---- the core pattern: every split against the big batch in the same precision --------------------------------------
@pytest.fixture(scope="module")
def sft():
    """8 examples of 5-100 tokens (rows past the short check's 64: the row-offset check runs), a tiny Llama, and the
    exact (fp32) big-batch gradient."""
    examples = make_examples(8, lengths=(5, 100))
    model = build_tiny_llama(vocab_size=VOCAB)
    exact, _, _ = full_batch_causal_lm(model, examples)
    return examples, model, exact


@pytest.mark.parametrize("precision", ["bf16 autocast", "bf16 weights"])
def test_every_split_gives_the_big_batch_of_its_precision_padding_free(tmp_path, caplog, sft, precision):
    examples, model, exact = sft
    if precision == "bf16 weights":
        model = copy.deepcopy(model).to(BF16)
    with torch.autocast("cpu", dtype=BF16):
        big, _, _ = full_batch_causal_lm(model, examples)
    floor = relative_error(big, exact)
    bound = get_rounding_bound(floor)
    assert 1e-3 < floor < 2 * torch.finfo(BF16).eps  # bf16's rounding, and no more
    for bs, ga in SPLITS:
        caplog.clear()
        args = train_args(tmp_path, bs, ga, args_class=TokenWeightedArguments, bf16=True)
        with caplog.at_level(logging.INFO, logger="hfacc"):
            trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, args, COLLATE)
        assert trainer.padding_free and not said(caplog, logging.WARNING), (bs, ga, said(caplog, logging.WARNING))
        (line,) = said(caplog, logging.INFO)
        if precision == "bf16 autocast":
            assert "Checked in fp32 with autocast off (training computes in bf16 autocast" in line
        else:
            assert "Checked in bf16, as training computes (bound: bf16 rounding)" in line
        error = relative_error(capture.grads[0], big)
        assert error <= bound, (bs, ga, error, bound)
        # It trained in bf16 (the check put autocast back): as far from fp32 as bf16's rounding is.
        assert relative_error(capture.grads[0], exact) > floor / 4
    # Negative control: stock Trainer, whose loss here ignores num_items_in_batch, in the same precision.
    args = train_args(tmp_path, 2, 4, bf16=True)
    _, stock = run_trainer(Trainer, KwargsLM(model), examples, args, COLLATE)
    assert relative_error(stock.grads[0], big) > 100 * bound


@pytest.mark.distributed
def test_two_ranks_in_bf16_give_the_big_batch_of_their_precision(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        torchrun("tests/mixed_precision_check.py", str(out)), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["world_size"] == 2
    for name, case in results["cases"].items():
        assert case["padding_free"] and case["mixed_precision"] == "bf16", (name, case)
        assert 1e-3 < case["noise_floor"] and case["error"] <= get_rounding_bound(case["noise_floor"]), (name, case)


# ---- every objective takes the fast path in bf16 --------------------------------------------------------------------
class Run(NamedTuple):
    """One objective's tiny training run: its model, rows, collator and the trainer's keyword arguments."""

    model: torch.nn.Module
    rows: list
    collator: object
    trainer_kwargs: dict


def sft_run():
    return Run(build_tiny_llama(vocab_size=VOCAB), make_examples(8, seed=1), COLLATE, {})


def dpo_run():
    from tests.preference_reference import make_pairs

    objective = DPOObjective(beta=0.1)  # its reference: a frozen copy of the policy, placed like it
    return Run(
        build_tiny_llama(vocab_size=VOCAB), make_pairs(8), DataCollatorForPreference(0), {"objective": objective}
    )


def grpo_run():
    from tests.rollouts import make_rollout

    model = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1)
    return Run(model, make_rollout(model, n=8), COLLATE, {"objective": PolicyGradientObjective()})


def vlm_run():
    from tests.test_vision import examples_for
    from tests.vision_families import model_for, processor_for

    family = "qwen2_5_vl"  # multimodal rotary positions: the family whose layout needs the most care
    return Run(model_for(family), examples_for(family), DataCollatorForVisionLM(processor_for(family)), {})


def distillation_run():
    from hfacc import DistillationObjective
    from tests.distillation_reference import make_student, make_teacher, uneven_examples

    objective = DistillationObjective(make_teacher(), beta=0.5, ce_weight=0.5)  # the teacher placed like the student
    return Run(make_student(), uneven_examples(8), COLLATE, {"objective": objective})


def reward_run():
    from hfacc import RewardObjective
    from tests.reward_kto_reference import reward_pairs, tiny_reward_model

    return Run(tiny_reward_model(), reward_pairs(8), DataCollatorForPreference(0), {"objective": RewardObjective()})


def kto_run():
    from hfacc import DataCollatorForUnpairedPreference, KTOObjective
    from tests.reward_kto_reference import unpaired_rows

    model = build_tiny_llama(vocab_size=64, hidden_size=32, num_layers=1)
    # its reference a frozen copy; the reference point z0 a statistic of the window, taken in bf16 too
    return Run(model, unpaired_rows(8), DataCollatorForUnpairedPreference(0), {"objective": KTOObjective()})


# Each objective's tiny run: a function returning the Run of 8 examples its own tests train (collated by its
# collator; a teacher or reference given inside its objective). The test trains it at bs 8 x GA 1 in fp32 and bf16
# and at bs 4 x GA 2 in bf16, and asserts padding-free in each (an objective without padding-free support belongs
# elsewhere). A new objective joins with one entry.
BF16_RUNS = {
    "sft": sft_run,
    "dpo": dpo_run,
    "grpo": grpo_run,
    "vlm": vlm_run,
    "distillation": distillation_run,
    "reward": reward_run,
    "kto": kto_run,
}


@pytest.mark.parametrize("name", list(BF16_RUNS))
def test_every_objective_goes_padding_free_in_bf16_and_stays_exact(tmp_path, caplog, name):
    """bf16=True: the objective takes padding-free micro-batches (one INFO line, no WARNING), and the accumulated
    window (bs 4 x GA 2) is the big batch (bs 8) of the same precision within its rounding bound."""
    grads = {}
    for bs, ga, bf16 in [(8, 1, False), (8, 1, True), (4, 2, True)]:
        run = BF16_RUNS[name]()
        args = train_args(tmp_path, bs, ga, args_class=TokenWeightedArguments, bf16=bf16)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hfacc"):
            trainer, capture = run_trainer(
                TokenWeightedTrainer, run.model, run.rows, args, run.collator, **run.trainer_kwargs
            )
        assert trainer.padding_free and not said(caplog, logging.WARNING), said(caplog, logging.WARNING)
        assert len(said(caplog, logging.INFO)) == 1
        grads[(bs, bf16)] = capture.grads[0]
    floor = relative_error(grads[(8, True)], grads[(8, False)])
    assert floor > 0  # it computed in bf16
    assert relative_error(grads[(4, True)], grads[(8, True)]) <= get_rounding_bound(floor)


# ---- the frozen models beside the policy compute in its precision -------------------------------------------------
# accelerate's bf16=True wraps only the policy's forward in autocast. A reference (DPO, KTO) or a teacher computed in
# fp32 beside it is off by bf16's rounding: with reference == policy at lr 0 the implicit rewards were -0.019 and
# +0.041 (KTO, beta 1) instead of 0. Under the policy's autocast they are exactly 0, whichever way the reference comes.
def frozen_run(kind, reference, tmp_path):
    """A bf16=True step at lr 0 of ``kind`` ("dpo" / "kto", beta 1) whose reference equals the policy: ``given``
    (a copy passed as ref_model), ``precomputed`` (hfacc.precompute_reference_logps in bf16), ``copy`` (default)."""
    from datasets import Dataset

    from hfacc import DataCollatorForUnpairedPreference, KTOObjective, precompute_reference_logps
    from tests.preference_reference import make_pairs
    from tests.reward_kto_reference import unpaired_rows

    policy = build_tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, seed=0, initializer_range=0.1)
    if kind == "dpo":
        rows, collator, cls = make_pairs(8), DataCollatorForPreference(0), DPOObjective
    else:
        rows, collator = unpaired_rows(8, 64, completion_lengths=(20, 40)), DataCollatorForUnpairedPreference(0)
        cls = KTOObjective
    data = Dataset.from_list(rows)
    if reference == "precomputed":
        data = precompute_reference_logps(data, policy, pad_token_id=0, mixed_precision="bf16", show_progress=False)
    objective = cls(beta=1.0, ref_model=copy.deepcopy(policy) if reference == "given" else None)
    # Precomputed log-probs come from padded batches: trained padded, the policy computes them alike. (Padding-free,
    # bf16 rounds a packed row otherwise than padded ones: DPO's mean rewards here are then 0 and -3.1e-4.)
    layout = {"padding_free": False} if reference == "precomputed" else {}
    args = train_args(tmp_path, 8, 1, args_class=TokenWeightedArguments, bf16=True, **layout)
    trainer = TokenWeightedTrainer(
        model=policy, args=args, train_dataset=data, data_collator=collator, objective=objective
    )
    trainer.train()
    return trainer.state.log_history[0]


@pytest.mark.parametrize("kind", ["dpo", "kto"])
@pytest.mark.parametrize("reference", ["given", "precomputed", "copy"])
def test_a_reference_equal_to_the_policy_gives_rewards_of_exactly_zero_in_bf16(tmp_path, kind, reference):
    log = frozen_run(kind, reference, tmp_path)
    assert log["rewards/chosen"] == 0.0 and log["rewards/rejected"] == 0.0, log
    if kind == "kto":  # the reference point too, taken before the forwards (Objective.window_statistics)
        assert log["kl"] == 0.0 and log["loss"] == 0.5, log


def test_the_teacher_computes_in_the_students_precision(tmp_path):
    """bf16=True distillation from a teacher equal to the student: the teacher's forwards in every step run under
    the student's autocast (its decoder's linear outputs are bf16; its embeddings put out fp32 under autocast,
    which does not cast a lookup), so the forward KL is exactly 0; stored top-K log-probs computed with
    mixed_precision="bf16" are computed in bf16 too (fp32 otherwise, as before)."""
    from datasets import Dataset

    from hfacc import DistillationObjective, precompute_teacher_logprobs
    from tests.distillation_reference import make_student, uneven_examples

    student = make_student()
    teacher = copy.deepcopy(student)
    seen, watching = [], []
    teacher.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda module, args, out: seen.append(out.dtype) if watching else None
    )
    objective = DistillationObjective(teacher, beta=0.0)
    rows = objective.teacher_rows

    def watched(*args):
        watching.append(True)
        try:
            return rows(*args)
        finally:
            watching.clear()

    objective.teacher_rows = watched
    args = train_args(tmp_path, 8, 1, args_class=TokenWeightedArguments, bf16=True)
    trainer = TokenWeightedTrainer(
        model=student, args=args, train_dataset=Dataset.from_list(uneven_examples()), data_collator=COLLATE,
        objective=objective,
    )  # fmt: skip
    trainer.train()
    assert seen and set(seen) == {BF16}, seen
    assert trainer.state.log_history[0]["loss"] == 0.0
    stored = {}
    for precision in (None, "bf16"):
        seen.clear()
        watching.append(True)
        data = precompute_teacher_logprobs(
            Dataset.from_list(uneven_examples(2)), teacher, top_k=4, mixed_precision=precision, show_progress=False
        )
        watching.clear()
        assert set(seen) == {torch.float32 if precision is None else BF16}
        stored[precision] = torch.tensor(data["target_logprobs"][0])
    assert 0 < (stored["bf16"] - stored[None]).abs().max() < 0.1  # bf16's rounding of the same log-probs


# ---- a model that leaks is caught in every precision; one that does not passes in every precision ---------------
def in_precision(model, precision):
    """``(model, autocast)``: the model with its weights in ``precision``'s dtype, or under its autocast."""
    dtype = BF16 if precision.startswith("bf16") else FP16
    if precision.endswith("weights"):
        return copy.deepcopy(model).to(dtype), torch.autocast("cpu", enabled=False)
    return model, torch.autocast("cpu", dtype=dtype)


@pytest.fixture(scope="module")
def families():
    # Mixtral without its router loss (which counts the filler of packed rows, in any precision): regrouping only.
    return {
        "lfm2": build_family("lfm2"),
        "jamba": build_family("jamba"),
        "mixtral": build_family("mixtral", output_router_logits=False),
    }


@pytest.mark.parametrize("precision", ["bf16 autocast", "bf16 weights", "fp16 autocast", "fp16 weights"])
@pytest.mark.parametrize("family", ["lfm2", "jamba"])
def test_a_model_that_leaks_is_caught_in_every_precision(caplog, families, family, precision):
    """LFM2's convolution and Jamba's scan leak by ~1e-4 on a fresh model: below bf16's rounding bound (6.6e-2).
    Under autocast the check runs in fp32; on half weights the gradient of a sequence's loss reaching the one
    before it in its row (exactly 0 where nothing runs across them) sees the leak the logits cannot."""
    model, autocast = in_precision(families[family], precision)
    batch = pad(make_examples(8, seed=14, lengths=(5, 30)))
    with autocast, caplog.at_level(logging.WARNING, logger="hfacc"):
        choice = choose_padding_free(CausalLMObjective(), model, batch, ONE)
    assert not choice.padding_free
    (warning,) = said(caplog, logging.WARNING)
    assert warning.count("(a leak) by") >= 2  # both layouts
    if precision.endswith("autocast"):  # fp32, autocast off: no rounding in the message
        assert "Checked in fp32 with autocast off" in warning and "rounding" not in warning
    else:  # as training computes: the bound is that precision's rounding, and the leak is seen exactly
        assert f"Checked in {precision[:4]}, as training computes (bound: {precision[:4]} rounding)" in warning
        assert warning.count("reaches the one before it in its row (a leak) by") == 2


def test_bf16_autocast_is_caught_by_a_trainer_too(tmp_path, caplog, families):
    """bf16=True through the Trainer (accelerate's autocast wrapper of the forward): LFM2 trains padded, said once."""
    examples = make_examples(8, seed=14, lengths=(5, 30))
    args = train_args(tmp_path, 4, 2, args_class=TokenWeightedArguments, bf16=True)
    with caplog.at_level(logging.INFO, logger="hfacc"):
        trainer, _ = run_trainer(TokenWeightedTrainer, families["lfm2"], examples, args, COLLATE)
    assert not trainer.padding_free and trainer.accelerator.mixed_precision == "bf16"
    (warning,) = said(caplog, logging.WARNING)
    assert "(a leak) by" in warning and "Checked in fp32 with autocast off" in warning


@pytest.mark.parametrize("precision", ["bf16 weights", "fp16 weights", "fp16 autocast"])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_a_model_that_keeps_sequences_apart_passes_in_every_precision(families, family, precision):
    """Padding-free and one row pass as training computes (Mixtral regroups tokens by expert: its logits move by
    rounding, its leak gradient is still exactly 0), and so do rows of 512 tokens (the row-offset check)."""
    model = build_tiny_llama(vocab_size=VOCAB) if family == "llama" else families[family]
    model, autocast = in_precision(model, precision)
    batch = pad(make_examples(4, seed=2, lengths=(5, 30)))
    with autocast:
        dtype = get_check_precision(model).dtype
        assert dtype == (torch.float32 if precision.endswith("autocast") else model.dtype)
        assert check_padding_free(model, batch, one_row=False) is None
        assert check_padding_free(model, batch, one_row=True) is None
        assert check_row_offsets(model, batch, 512) == (512, None)
    assert get_tolerance(dtype) == 1e-6 * torch.finfo(dtype).eps / torch.finfo(torch.float32).eps


def test_weights_an_engine_computes_in_half_precision_are_judged_in_it(caplog):
    """FSDP's mixed-precision policy computes fp32-stored weights in its param_dtype whatever autocast says: the
    checks see it in what the input embeddings put out, and take that precision's bound (fp32's would fail)."""
    model = build_tiny_llama(vocab_size=VOCAB)

    def cast(module, args):  # as FSDP casts them for the forward
        module.to(BF16)

    model.register_forward_pre_hook(cast)
    batch = pad(make_examples(4, seed=2, lengths=(5, 30)))
    assert get_check_precision(model).dtype == torch.float32  # stored in fp32: nothing but a run tells
    assert "its logits by" in check_padding_free(model, batch, one_row=True, tolerance=1e-6)  # bf16's rounding
    model.float()  # stored in fp32 again, as FSDP keeps them between forwards
    assert check_padding_free(model, batch, one_row=True) is None
    model.float()
    with caplog.at_level(logging.INFO, logger="hfacc"):
        assert choose_padding_free(CausalLMObjective(), model, batch, ONE).padding_free
    (line,) = said(caplog, logging.INFO)
    assert "Checked in bf16, as the engine computes the fp32 weights (bound: bf16 rounding)" in line


# ---- hfacc verify: the accumulation against the precision's noise floor ---------------------------------------------
def test_verify_reports_exact_up_to_rounding_and_what_is_not():
    report = verify_accumulation(build_tiny_llama(vocab_size=VOCAB), make_examples(8), COLLATE, precisions=("bf16",))
    assert report.passed and report.within_rounding("bf16")
    assert 1e-3 < report.noise_floors["bf16"] < 2 * torch.finfo(BF16).eps
    assert "exact up to bf16 rounding" in report.format()
    # The stock path on a model that ignores num_items_in_batch: its bf16 accumulation is far beyond rounding.
    model = KwargsLM(build_tiny_llama(vocab_size=VOCAB))
    report = verify_accumulation(model, make_examples(8), COLLATE, path="stock", objective="causal_lm")
    assert not report.within_rounding("bf16") and "beyond bf16 rounding" in report.format()
    assert report.precision_errors["bf16"] > 100 * get_rounding_bound(report.noise_floors["bf16"])
