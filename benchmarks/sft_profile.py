"""Where an SFT optimizer step's CPU time goes in hfacc, beside the forward and backward (issue 38 item 4).

    python benchmarks/sft_profile.py                 # the model and data of benchmarks/throughput.py, hfacc defaults
    python benchmarks/sft_profile.py --quick         # tiny sizes: that it runs (the figures mean nothing)

benchmarks/throughput.py's setup (Llama-style, vocab 32000, hidden 256, 4 layers; 32 rows of 56-452 tokens with a
masked prompt; bs 8 x GA 2, fp32, one torch thread, hfacc's defaults: fused loss, padding-free rows). Two epochs; the
second is measured. Each part is timed by wrapping the function that does it (process CPU time, no profiler hooks
on every call, so the small Python parts are not inflated), nested parts subtracted from their callers:

- draw + collate: the dataloader's collator (the user's DataCollatorForSeq2Seq), inside ``get_batch_samples``;
- window: the rest of ``get_batch_samples`` (hfacc's per-window counting and repeat trimming);
- layout: ``remove_padding`` (padded micro-batch -> padding-free rows);
- forward: the model's own forward (to the final hidden states);
- loss: the rest of ``compute_micro_batch_loss`` (the fused output head and loss sums);
- backward, clip (``clip_grad_norm_``), optimizer (``AdamW.step`` and ``zero_grad``);
- step gate: hfacc's ``StepGate.on_pre_optimizer_step`` (audit, finiteness check, metric commit);
- callbacks: every other callback event (the meter's logging included);
- rest: the epoch's CPU time not in any part above (the Trainer's own loop).
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_quick, build_bench_examples, build_bench_model, count_targets  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import DataCollatorForSeq2Seq, TrainerCallback  # noqa: E402
from transformers.trainer_callback import CallbackHandler  # noqa: E402

import hfacc.training.trainer as trainer_module  # noqa: E402
from hfacc import TokenWeightedArguments, TokenWeightedTrainer  # noqa: E402
from hfacc.training.step_gate import StepGate  # noqa: E402

PARTS = ("draw + collate", "window", "layout", "forward", "loss", "backward", "clip", "optimizer", "step gate",
         "callbacks", "rest")  # fmt: skip


class Clock:
    """Process CPU time per part; a part's own time excludes the parts timed inside it."""

    def __init__(self):
        self.own, self.stack, self.on = defaultdict(float), [], False

    def wrap(self, part, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.process_time()
            self.stack.append(0.0)  # time of the parts nested in this call
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed, nested = time.process_time() - start, self.stack.pop()
                self.own[part] += elapsed - nested
                if self.stack:
                    self.stack[-1] += elapsed

        return timed


def patch(target, name, part, clock):
    setattr(target, name, clock.wrap(part, getattr(target, name)))


class Epochs(TrainerCallback):
    """Turns the clock on for the last epoch and keeps that epoch's CPU time and optimizer steps."""

    def __init__(self, clock, epochs):
        self.clock, self.epochs, self.total, self.steps = clock, epochs, 0.0, 0

    def on_epoch_begin(self, args, state, control, **kwargs):
        if state.epoch is not None and round(state.epoch) == self.epochs - 1:
            self.clock.on, self.start, self.first_step = True, time.process_time(), state.global_step

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.clock.on:
            self.total, self.steps = time.process_time() - self.start, state.global_step - self.first_step
            self.clock.on = False


def profile(examples, cli):
    clock = Clock()
    collator = DataCollatorForSeq2Seq(_tokenizer(cli.vocab), padding=True)
    patch(DataCollatorForSeq2Seq, "__call__", "draw + collate", clock)
    patch(TokenWeightedTrainer, "get_batch_samples", "window", clock)
    patch(trainer_module, "remove_padding", "layout", clock)
    patch(trainer_module, "compute_micro_batch_loss", "loss", clock)
    patch(torch.optim.AdamW, "step", "optimizer", clock)
    patch(torch.optim.Optimizer, "zero_grad", "optimizer", clock)
    patch(StepGate, "on_pre_optimizer_step", "step gate", clock)
    patch(CallbackHandler, "call_event", "callbacks", clock)
    model = build_bench_model(cli.vocab, cli.hidden, cli.layers)
    patch(type(model.model), "forward", "forward", clock)
    epochs = Epochs(clock, 2)
    with tempfile.TemporaryDirectory() as tmp:
        args = TokenWeightedArguments(
            output_dir=tmp, per_device_train_batch_size=8, gradient_accumulation_steps=2, num_train_epochs=2,
            learning_rate=1e-4, report_to=[], save_strategy="no", logging_steps=1000, disable_tqdm=True, seed=0,
            use_cpu=True, dataloader_pin_memory=False,
        )  # fmt: skip
        trainer = TokenWeightedTrainer(model=model, args=args, train_dataset=Dataset.from_list(examples),
                                       data_collator=collator, callbacks=[epochs])  # fmt: skip
        patch(trainer.accelerator, "backward", "backward", clock)
        patch(trainer.accelerator, "clip_grad_norm_", "clip", clock)
        trainer.train()
    parts = dict(clock.own)
    parts["rest"] = epochs.total - sum(parts.values())
    return parts, epochs.total, epochs.steps


def _tokenizer(vocab):
    from throughput import bench_tokenizer

    return bench_tokenizer(vocab)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    add_quick(parser)
    cli = parser.parse_args(argv)
    if cli.quick:
        cli.vocab, cli.hidden, cli.layers, cli.examples = 512, 32, 1, 16
    torch.set_num_threads(cli.threads)
    examples = build_bench_examples(cli.examples, cli.vocab, (24, 96) if cli.quick else (56, 452))
    parts, total, steps = profile(examples, cli)
    print(f"{steps} optimizer steps, {count_targets(examples)} target tokens, {total:.2f} CPU s (last epoch)\n")
    print("| part | CPU ms per optimizer step | share |\n|---|---|---|")
    for part in PARTS:
        print(f"| {part} | {1000 * parts.get(part, 0.0) / max(steps, 1):.1f} | {parts.get(part, 0.0) / total:.1%} |")
    print(f"| total | {1000 * total / max(steps, 1):.1f} | 100% |")
    return parts, total, steps


if __name__ == "__main__":
    main()
