"""Resume from every checkpoint of a run, on 1 or 2 CPU ranks, with row counts that leave the epoch's last global
batch partial (accelerate repeats examples there on several ranks). Launched by tests/test_reliability.py:

    torchrun --nproc_per_node 2 tests/resume_check.py OUT_DIR

Per case, a reference run saves a checkpoint after every optimizer step; then, in the same processes, a fresh
Trainer resumes from each checkpoint in turn (each in its own output dir) and its final weights are compared with
the reference's. Cases: map-style fixed batches (shuffled, dropout on, cosine schedule, 2 epochs), map-style token
budget micro-batches, and a stream. Rank 0 writes OUT_DIR/results.json; the tests assert on it.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datasets import Dataset  # noqa: E402

from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer, build_tiny_llama  # noqa: E402
from hfacc.data.embedded import build_default_tokenizer  # noqa: E402
from hfacc.jobs.console import end_process_group  # noqa: E402
from tests.helpers import VOCAB, make_examples, relative_error  # noqa: E402
from tests.streaming_check import make_rows, make_stream  # noqa: E402

COLLATE = DataCollatorForCausalLM(pad_token_id=0)


class RepeatCounter(logging.Handler):
    """Counts hfacc's "accelerate repeats" warnings: the case does exercise the epoch's partial last batch."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        self.count += "accelerate repeats" in record.getMessage()


CASES = {
    # 13 rows, 2 x 2 per rank: 7 micro-batches of the sampler, 4 per rank; the last global batch holds 1 real row.
    "map": dict(rows=13, settings=dict(num_train_epochs=2)),
    # token budget: 7 micro-batches of varying size per epoch, 4 per rank (rank 1's last one a repeat)
    "budget": dict(rows=11, settings=dict(num_train_epochs=2, max_tokens_per_batch=90)),
    "stream": dict(rows=21, stream=True, settings=dict(max_steps=4)),
}


# The run every case trains (tests/resume_objectives_check.py's too): shuffled, cosine, clipped, a checkpoint a step.
SETTINGS = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    learning_rate=2e-2,
    lr_scheduler_type="cosine",
    warmup_steps=1,
    max_grad_norm=1.0,
    train_sampling_strategy="random",
    report_to=[],
    save_strategy="steps",
    save_steps=1,
    logging_steps=1,
    disable_tqdm=True,
    seed=0,
    dataloader_pin_memory=False,
)


def make_trainer(out: Path, case: dict):
    settings = dict(SETTINGS, output_dir=str(out))
    settings.update(case["settings"])
    model = build_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2, attention_dropout=0.1)
    if case.get("stream"):
        tokenizer = get_tokenizer()
        model = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2)
        train = make_stream(make_rows(case["rows"]), tokenizer, buffer_size=8)
        collate = DataCollatorForCausalLM(tokenizer.pad_token_id)
    else:
        train, collate = Dataset.from_list(make_examples(case["rows"], seed=11)), COLLATE
    trainer = TokenWeightedTrainer(
        model=model, args=TokenWeightedArguments(**settings), train_dataset=train, data_collator=collate
    )
    return trainer, model


@functools.cache
def get_tokenizer():
    return build_default_tokenizer()


def weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def resume_every_checkpoint(out: Path, name: str, case, make=None) -> dict:
    """The reference run, then a resume from each of its checkpoints: relative weight error per checkpoint.
    ``make(output_dir, case)`` builds a trainer and its model (default: :func:`make_trainer`)."""
    make = make or make_trainer
    rank = int(os.environ.get("RANK", "0"))
    counter = RepeatCounter()
    logging.getLogger("hfacc").addHandler(counter)
    trainer, model = make(out / name / "full", case)
    trainer.train()
    logging.getLogger("hfacc").removeHandler(counter)
    reference = weights(model)
    steps = trainer.state.global_step
    errors = {}
    for step in range(1, steps + 1):
        resumed = out / name / f"from-{step}"
        if rank == 0:
            shutil.copytree(out / name / "full" / f"checkpoint-{step}", resumed / f"checkpoint-{step}")
        barrier()
        trainer, model = make(resumed, case)
        trainer.train(resume_from_checkpoint=True)
        errors[step] = relative_error(weights(model), reference)
    counts = [counter.count]
    if torch.distributed.is_initialized():
        counts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(counts, counter.count)
    return {"errors": errors, "steps": steps, "repeat_warnings": sum(counts)}


def rank_dies_mid_save(out: Path) -> None:
    """Rank 1 is killed while checkpoint-2 is being saved, once rank 0 has written its trainer_state.json (the file
    a stock checkpoint ends with): the window in which hfacc used to take the half-written checkpoint for a complete
    one. Rank 0 writes what it saw to OUT/death.json if it lives long enough (torchrun stops it too)."""
    import time

    rank = int(os.environ["RANK"])
    trainer, _ = make_trainer(out, dict(rows=13, settings=dict(max_steps=3)))
    save_rng = trainer._save_rng_state

    def dying(output_dir):
        if rank == 1 and trainer.state.global_step == 2:
            state = Path(output_dir) / "trainer_state.json"
            deadline = time.time() + 60
            while not state.is_file() and time.time() < deadline:
                time.sleep(0.01)
            os._exit(9)  # as a kill -9 would: no cleanup, no message
        save_rng(output_dir)

    trainer._save_rng_state = dying
    try:
        trainer.train()
    except Exception as err:  # rank 0: the collective after the save fails, the peer being gone
        from hfacc.jobs.console import describe_user_error

        (out / "death.json").write_text(json.dumps({"error": str(err), "said": describe_user_error(err)}))
        raise


def main(out_dir: str, cases=tuple(CASES)) -> dict:
    torch.set_num_threads(1)
    gc.freeze()  # every train() starts with a full gc.collect(): 0.7 s over the imported modules' objects, each time
    out = Path(out_dir)
    results = {name: resume_every_checkpoint(out, name, CASES[name]) for name in cases}
    results["world_size"] = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "results.json").write_text(json.dumps(results))
    return results


if __name__ == "__main__":
    names = [a for a in sys.argv[2:] if a != "death"]
    print(json.dumps(main(sys.argv[1], tuple(names) or tuple(CASES))))
    if "death" in sys.argv[2:]:  # last: it ends the processes
        rank_dies_mid_save(Path(sys.argv[1]) / "death")
    else:
        end_process_group()  # a rank that exits with the gloo group alive aborts now and then (1 in 20 here)
