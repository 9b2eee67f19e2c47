"""Shared pieces of the benchmarks: a Llama-style model, variable-length masked data, a step timer, an RSS sampler."""

from __future__ import annotations

import random
import statistics
import time

from transformers import TrainerCallback, TrainingArguments

from hfacc import build_tiny_llama


def build_bench_model(vocab_size=32000, hidden_size=256, num_layers=4, seed=0):
    return build_tiny_llama(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=4,
        seed=seed,
        max_position_embeddings=2048,
    )


def build_bench_examples(n, vocab_size=32000, lengths=(56, 452), seed=0):
    """Prompt/answer examples: prompts of 30-70 % of the sequence are masked with -100."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(*lengths)
        ids = [rng.randrange(3, vocab_size) for _ in range(length)]
        prompt = int(length * rng.uniform(0.3, 0.7))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def count_targets(examples):
    return sum(sum(1 for y in e["labels"][1:] if y != -100) for e in examples)


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (the first `warmup` steps are dropped)."""

    def __init__(self, warmup=1):
        self.warmup, self.times, self._t0 = warmup, [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t0)

    @property
    def steps(self):
        return self.times[self.warmup :]


def bench_args(output_dir, bs, ga, max_steps, **overrides):
    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=ga,
        max_steps=max_steps,
        learning_rate=1e-4,
        report_to=[],
        save_strategy="no",
        logging_steps=max_steps,
        use_cpu=True,
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        seed=0,
    )
    settings.update(overrides)
    cls = settings.pop("args_class", TrainingArguments)
    return cls(**settings)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


class RSSSampler(TrainerCallback):
    """Resident memory (MiB) every ``every`` optimizer steps, as ``(step * scale, rss)``, and its peak over all steps.

    ``scale`` turns steps into another unit (rows read per step, for a stream).
    """

    def __init__(self, every: int = 100, scale: int = 1):
        import psutil

        self.every, self.scale, self.samples, self.peak, self.process = every, scale, [], 0.0, psutil.Process()

    def on_step_end(self, args, state, control, **kwargs):
        rss = self.process.memory_info().rss / 2**20
        self.peak = max(self.peak, rss)
        if state.global_step % self.every == 0:
            self.samples.append((state.global_step * self.scale, rss))


def trl_version():
    """TRL's version, or None where it is not installed (as in CI): the benchmarks then leave its contenders out."""
    try:
        import trl
    except ImportError:
        return None
    return trl.__version__


def add_quick(parser):
    """``--quick``: tiny sizes and one round, TRL's contenders only where TRL is installed. tests/test_benchmarks.py
    runs every script so, so that a changed signature or name cannot break one unseen; the figures mean nothing."""
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (the tests' smoke run)")
