"""Resume from every checkpoint, per objective: SFT, DPO with each kind of reference, a policy gradient on a fixed
rollout, vision-language SFT, distillation (a teacher model, stored top-K), a reward model and KTO. Launched by
tests/test_resume.py on one process (in the test's own process) and on two:

    torchrun --nproc_per_node 2 tests/resume_objectives_check.py OUT_DIR

Each case builds its tiny model, rows, collator and objective with the builders of the objective's own tests, trains 4
steps on 11 rows saving a checkpoint after each (bs 2 x GA 2 per process, shuffled, cosine schedule, clipping; the
settings of tests/resume_check.py), then resumes from every checkpoint in a fresh Trainer and compares the final
weights with the uninterrupted run's (tests/resume_check.py's loop). The negative controls resume from checkpoint-1
with one thing not restored: the data position (``ignore_data_skip``: the epoch starts again), the RNG state (the SFT
case trains with dropout) and the frozen copy of DPO's reference (taken from the checkpoint's weights instead of the
policy as the run started: the bug tests/test_preference.py guards against). Rank 0 writes OUT_DIR/results.json.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datasets import Dataset  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from hfacc import (  # noqa: E402
    DataCollatorForCausalLM,
    DataCollatorForPreference,
    DataCollatorForUnpairedPreference,
    DataCollatorForVisionLM,
    DistillationObjective,
    KTOObjective,
    PolicyGradientObjective,
    RewardObjective,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    build_sft_dataset,
    build_tiny_llama,
    build_tiny_vlm,
    generate_shape_examples,
    precompute_teacher_logprobs,
)
from hfacc.jobs.console import end_process_group  # noqa: E402
from tests import resume_check  # noqa: E402
from tests.distillation_reference import make_student, make_teacher, uneven_examples  # noqa: E402
from tests.helpers import VOCAB, make_examples, relative_error  # noqa: E402
from tests.preference_check import objective_for, setting  # noqa: E402
from tests.preference_reference import imbalanced_pairs  # noqa: E402
from tests.reward_kto_check import kto_setting  # noqa: E402
from tests.reward_kto_reference import BETA, CENTER, DESIRABLE, UNDESIRABLE, imbalanced_rows  # noqa: E402
from tests.rollouts import make_rollout  # noqa: E402

CAUSAL = DataCollatorForCausalLM(pad_token_id=0)
# 11 rows, 2 x 2 per process: one process trains 3 steps an epoch (the last window's last micro-batch holds 1 row);
# two train 2, the second holding 3 real rows of 8 (accelerate repeats the rest, hfacc cuts them). 4 steps cross into
# the second epoch either way.
ROWS, STEPS = 11, 4
PAIRS = DataCollatorForPreference(pad_token_id=0)


# ---- the cases: (model, rows, collator, objective), fresh and the same on every call -------------------------------
def sft():
    model = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2, attention_dropout=0.1)
    return model, make_examples(ROWS, seed=11), CAUSAL, "causal_lm"


def dpo(kind):
    policy, given, rows, _ = setting(kind, imbalanced_pairs(ROWS))
    return policy, rows, PAIRS, objective_for("sigmoid", 0.5, given)


def policy_gradient():
    """A fixed rollout (old log-probs from the starting policy plus noise, so ratios clip) and a KL term to a frozen
    reference model."""
    policy = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=0)
    reference = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=3)
    rows = make_rollout(policy, n=ROWS)
    objective = PolicyGradientObjective("token", 0.2, 0.28, 0.1, ref_model=reference, max_completion_length=16)
    return policy, rows, CAUSAL, objective


@functools.cache
def shapes():
    model, processor = build_tiny_vlm(hidden_size=32, num_layers=1, seed=0)
    rows = build_sft_dataset(Dataset.from_list(generate_shape_examples(ROWS, seed=0)), processor)
    return processor, rows


def vision():
    processor, rows = shapes()
    model, _ = build_tiny_vlm(hidden_size=32, num_layers=1, seed=0)
    return model, rows, DataCollatorForVisionLM(processor), "causal_lm"


@functools.cache
def teacher_and_top_k():
    teacher = make_teacher()
    return teacher, precompute_teacher_logprobs(Dataset.from_list(uneven_examples(ROWS)), teacher, top_k=8,
                                                show_progress=False)  # fmt: skip


def distill_teacher():
    teacher, _ = teacher_and_top_k()
    return make_student(), uneven_examples(ROWS), CAUSAL, DistillationObjective(teacher, 0.5, 2.0, 0.5)


def distill_top_k():
    _, stored = teacher_and_top_k()
    return make_student(), stored, CAUSAL, DistillationObjective(None, 0.0, 1.0, 0.0)


def reward():
    from tests.reward_kto_reference import tiny_reward_model

    pairs = imbalanced_pairs(ROWS)
    for i, p in enumerate(pairs):
        p["margin"] = 0.25 * (i % 3) - 0.25
    return tiny_reward_model(), pairs, PAIRS, RewardObjective(CENTER)


def kto():
    policy, given, rows, _ = kto_setting("copy", imbalanced_rows(ROWS))
    objective = KTOObjective(beta=BETA, desirable_weight=DESIRABLE, undesirable_weight=UNDESIRABLE, ref_model=given)
    return policy, rows, DataCollatorForUnpairedPreference(0), objective


CASES = {
    "sft": sft,
    "dpo copy": functools.partial(dpo, "copy"),
    "dpo given": functools.partial(dpo, "given"),
    "dpo peft": functools.partial(dpo, "peft"),
    "dpo precomputed": functools.partial(dpo, "precomputed"),
    "policy gradient": policy_gradient,
    "vision": vision,
    "distill teacher": distill_teacher,
    "distill top-k": distill_top_k,
    "reward": reward,
    "kto": kto,
}


def make_trainer(out: Path, name: str, **settings):
    """The case's trainer: tests/resume_check.py's settings, with the case's model, rows and objective."""
    torch.manual_seed(0)  # a PEFT adapter's initialization draws from the global generator
    model, rows, collate, objective = CASES[name]()
    args = dict(resume_check.SETTINGS, output_dir=str(out), max_steps=STEPS, ddp_timeout=120)
    args["warmup_steps"] = 0  # with warmup, step 1 has learning rate 0 and checkpoint-1 holds the starting weights
    args.update(settings)
    train = rows if isinstance(rows, Dataset) else Dataset.from_list(rows)
    trainer = TokenWeightedTrainer(
        model=model, args=TokenWeightedArguments(**args), train_dataset=train, data_collator=collate,
        objective=objective,
    )  # fmt: skip
    return trainer, model


# ---- negative controls: one thing not restored, from checkpoint-1 ------------------------------------------------
def broken_resume(out: Path, name: str, how: str, reference: torch.Tensor) -> float:
    resumed = out / name / f"broken {how}"
    if int(os.environ.get("RANK", "0")) == 0:
        shutil.copytree(out / name / "full" / "checkpoint-1", resumed / "checkpoint-1")
    resume_check.barrier()
    if how == "data position":  # the stock setting that starts the epoch again: the resumed steps see other rows
        trainer, model = make_trainer(resumed, name, ignore_data_skip=True)
    else:
        trainer, model = make_trainer(resumed, name)
    if how == "rng state":  # dropout draws other masks than the uninterrupted run did
        trainer._load_rng_state = lambda checkpoint: None
    if how == "reference copy":  # the frozen copy taken after the weights were loaded: the policy compared with itself
        model.load_state_dict(load_file(resumed / "checkpoint-1" / "model.safetensors"), strict=False)
    trainer.train(resume_from_checkpoint=str(resumed / "checkpoint-1"))
    return relative_error(resume_check.weights(model), reference)


CONTROLS = {"sft": ("rng state",), "dpo copy": ("reference copy",)}  # and "data position" for every case


def run_case(out: Path, name: str) -> dict:
    models = []  # the first one built is the uninterrupted run's

    def make(path, name):
        trainer, model = make_trainer(path, name)
        models.append(model)
        return trainer, model

    result = resume_check.resume_every_checkpoint(out, name, name, make)
    reference = resume_check.weights(models[0])
    controls = ("data position", *CONTROLS.get(name, ()))
    result["controls"] = {how: broken_resume(out, name, how, reference) for how in controls}
    return result


def main(out_dir: str, names=tuple(CASES)) -> dict:
    torch.set_num_threads(1)
    gc.freeze()  # every train() starts with a full gc.collect(): 0.7 s over the imported modules' objects, each time
    out = Path(out_dir)
    results = {name: run_case(out, name) for name in names}
    results["world_size"] = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "results.json").write_text(json.dumps(results))
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], tuple(sys.argv[2:]) or tuple(CASES))))
    end_process_group()  # a rank that exits with the gloo group alive aborts now and then (1 in 20 here)
