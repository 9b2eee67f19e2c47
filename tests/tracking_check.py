"""Short SFT, DPO and GRPO runs that report to TensorBoard and Trackio (offline: Trackio's local store), each with
an evaluation where the objective has one. Launched by tests/test_tracking.py, in its own process because Trackio
reads where its store is (TRACKIO_DIR) when it is imported:

    TRACKIO_DIR=STORE python tests/tracking_check.py OUT_DIR

Each run writes its TensorBoard events under OUT_DIR/<run>/runs/ (the Trainer's default) and its Trackio logs to
project "hfacc-tracking", run <run>; OUT_DIR/<run>/log_history.json is what the Trainer logged, for the test to
compare against what it reads back from those files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datasets import Dataset  # noqa: E402

from hfacc import (  # noqa: E402
    DataCollatorForCausalLM,
    DataCollatorForPreference,
    DPOObjective,
    GRPOArguments,
    GRPOTrainer,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    build_tiny_llama,
)
from hfacc.jobs.console import end_process_group  # noqa: E402
from tests.grpo_setup import brevity, build_policy, build_prompts  # noqa: E402
from tests.helpers import VOCAB, make_examples  # noqa: E402
from tests.preference_reference import make_pairs  # noqa: E402

PROJECT = "hfacc-tracking"
REPORT_TO = ["tensorboard", "trackio"]


def settings(out: Path, name: str) -> dict:
    return dict(
        output_dir=str(out / name),
        report_to=REPORT_TO,
        project=PROJECT,  # Trackio's project (a TrainingArguments setting)
        run_name=name,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_pin_memory=False,
    )


def run(trainer, out: Path, name: str, evaluate: bool) -> None:
    trainer.train()
    if evaluate:
        trainer.evaluate()  # logged through the same callbacks, as eval_* (eval/* in the trackers)
    (out / name / "log_history.json").write_text(json.dumps(trainer.state.log_history))


def main(out: Path) -> None:
    torch.set_num_threads(1)
    examples = Dataset.from_list(make_examples(12, seed=1))
    model = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2)
    args = TokenWeightedArguments(
        **settings(out, "sft"), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2
    )
    trainer = TokenWeightedTrainer(
        model=model, args=args, train_dataset=examples, eval_dataset=examples, data_collator=DataCollatorForCausalLM(0)
    )
    run(trainer, out, "sft", evaluate=True)

    pairs = Dataset.from_list(make_pairs(8, VOCAB, seed=3))
    model = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2)
    args = TokenWeightedArguments(
        **settings(out, "dpo"), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2
    )
    trainer = TokenWeightedTrainer(
        model=model,
        args=args,
        train_dataset=pairs,
        eval_dataset=pairs,
        data_collator=DataCollatorForPreference(0),
        objective=DPOObjective(beta=0.1, nll_weight=1.0),
    )
    run(trainer, out, "dpo", evaluate=True)

    model, tokenizer = build_policy()
    args = GRPOArguments(
        **settings(out, "grpo"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        use_cpu=True,
    )
    trainer = GRPOTrainer(model, [brevity], args, train_dataset=build_prompts(8), processing_class=tokenizer)
    run(trainer, out, "grpo", evaluate=False)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_process_group()  # a rank that exits with the gloo group alive aborts now and then (1 in 20 here)
