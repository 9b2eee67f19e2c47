"""Distillation: hfacc vs TRL 1.16's distillation trainers on the same student, teacher and rows — student tokens/s,
peak memory per micro-batch, update error under ragged accumulation.

    python benchmarks/distill.py                   # CPU, fp32, one thread: the numbers in benchmarks/README.md
    python benchmarks/distill.py --rounds 1 --rows 8    # quicker

The contenders train the same student on the same completions:

- ``trl DistillationTrainer``: TRL's stable on-policy trainer (chunked divergence over both models' hidden states);
  its generation is replaced by the rows' own completions, so it trains on exactly the tokens the others do;
- ``trl GKDTrainer`` (``trl.experimental``, ``lmbda=0``): off-policy distillation of SFT rows from full logits;
- ``hfacc``: ``TokenWeightedTrainer`` with ``DistillationObjective`` (padding-free, chunked from the hidden states).

1. **Throughput**: a Llama-style student (vocab 32000, hidden 256, 4 layers) and teacher (hidden 384, 4 layers), 16
   rows of 56-452 tokens (30-70 % prompt), bs 2 x GA 2, beta 0.5, temperature 1. Each round trains two epochs per
   contender and times the second (process CPU time: the machine is shared); rounds alternate the order; the ratio
   is the median of the per-round ratios. Student tokens are the target tokens trained.
2. **Peak memory** of one micro-batch's forward and backward (student and teacher) for the 2 longest rows, each
   trainer's own path (the PyTorch profiler's allocation events: hfacc.runtime.memory.peak_memory).
3. **Update error** against the hand-written big batch (tests/distillation_reference.py: plain torch, float64): a
   tiny student and teacher, 8 rows with completions of 2-5 and 30-50 tokens, one step, for bs 8 x GA 1, 2 x 4, 1 x 8
   and 4 x 2; off-policy (the rows' completions) and on-policy, where each trainer's generation returns fixed
   "generated" completions of other lengths than the dataset's (TRL's GKDTrainer with lmbda=1, trl#4719).
"""

import argparse
import copy
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import add_quick, build_bench_examples, build_bench_model, count_targets, median, trl_version  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hfacc import (  # noqa: E402
    DataCollatorForCausalLM,
    DistillationArguments,
    DistillationObjective,
    DistillationTrainer,
    TokenWeightedArguments,
    TokenWeightedTrainer,
)
from hfacc.data.padding_free import remove_padding  # noqa: E402
from hfacc.ops.loss import WindowCounts  # noqa: E402
from hfacc.runtime.memory import peak_memory  # noqa: E402
from tests.distillation_reference import big_batch, make_student, make_teacher, uneven_examples  # noqa: E402

BS, GA, BETA = 2, 2, 0.5
SPLITS = [(8, 1), (2, 4), (1, 8), (4, 2)]
COLLATE = DataCollatorForCausalLM(0)


SPECIALS = {0: "<pad>", 1: "<unk>", 2: "</s>"}


def word(i):
    return SPECIALS.get(i, f"w{i}")


def word_tokenizer(vocab_size):
    """A tokenizer over the id range (pad 0, EOS 2; token i is the word ``w{i}``): the text of a row's ids gives
    exactly those ids back, so TRL's trainers and hfacc's see the same tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={word(i): i for i in range(vocab_size)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def text(ids):
    return " ".join(word(i) for i in ids)


def split(row):
    start = next(i for i, y in enumerate(row["labels"]) if y != -100)
    return row["input_ids"][:start], row["input_ids"][start:]


def common_args(tmp, bs, ga, epochs, **extra):
    return dict(
        output_dir=tmp, per_device_train_batch_size=bs, gradient_accumulation_steps=ga, num_train_epochs=epochs,
        report_to=[], save_strategy="no", logging_steps=1000, disable_tqdm=True, seed=0, use_cpu=True,
        dataloader_pin_memory=False, train_sampling_strategy="sequential", **extra,
    )  # fmt: skip


# ---- the contenders ---------------------------------------------------------------------------------------------
def trl_distillation(student, teacher, rows, tmp, bs, ga, epochs=2, completions=None, **extra):
    """TRL's DistillationTrainer; its generation returns ``completions`` (default: the rows' own) for each prompt."""
    from trl import DistillationConfig
    from trl import DistillationTrainer as TRLDistillation

    prompts = [split(r)[0] for r in rows]
    table = {tuple(p): list(c) for p, c in zip(prompts, completions or [split(r)[1] for r in rows], strict=True)}
    config = DistillationConfig(
        **common_args(tmp, bs, ga, epochs, **extra), beta=BETA, temperature=1.0, bf16=False,
        gradient_checkpointing=False, max_completion_length=max(len(c) for c in table.values()), shuffle_dataset=False,
    )  # fmt: skip
    tokenizer = word_tokenizer(student.config.vocab_size)
    dataset = Dataset.from_list([{"prompt": text(p)} for p in prompts])
    trainer = TRLDistillation(student, teacher, config, train_dataset=dataset, processing_class=tokenizer)
    vocab = tokenizer.get_vocab()
    trainer._tokenize_prompts = lambda texts: ([[vocab[t] for t in x.split()] for x in texts], None, {})
    trainer._generate_single_turn = lambda ids, *a, **k: [table[tuple(p)] for p in ids]
    return trainer


def trl_gkd(student, teacher, rows, tmp, bs, ga, epochs=2, lmbda=0.0, completions=None, **extra):
    """TRL's GKDTrainer on the rows; with ``lmbda`` > 0 its generation returns ``completions`` for each prompt."""
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    config = GKDConfig(
        **common_args(tmp, bs, ga, epochs, **extra), lmbda=lmbda, beta=BETA, bf16=False, gradient_checkpointing=False,
        max_length=None,
    )  # fmt: skip
    trainer = GKDTrainer(
        model=student, teacher_model=teacher, args=config, train_dataset=Dataset.from_list(rows),
        data_collator=COLLATE, processing_class=word_tokenizer(student.config.vocab_size),
    )  # fmt: skip
    if completions is not None:
        table = {tuple(split(r)[0]): list(c) for r, c in zip(rows, completions, strict=True)}

        def generate(model, inputs, generation_config):
            generated = []
            for ids, labels in zip(inputs["input_ids"].tolist(), inputs["labels"].tolist(), strict=True):
                prompt = ids[: next(i for i, y in enumerate(labels) if y != -100)]
                generated.append({"input_ids": prompt + table[tuple(prompt)], "labels": [-100] * len(prompt)
                                  + table[tuple(prompt)]})  # fmt: skip
            batch = COLLATE(generated)
            return batch["input_ids"], batch["attention_mask"], batch["labels"]

        trainer.generate_on_policy_outputs = generate
    return trainer


def hfacc_objective(student, teacher, rows, tmp, bs, ga, epochs=2, **extra):
    args = TokenWeightedArguments(**common_args(tmp, bs, ga, epochs, **extra))
    return TokenWeightedTrainer(
        model=student, args=args, train_dataset=Dataset.from_list(rows), data_collator=COLLATE,
        objective=DistillationObjective(teacher, beta=BETA),
    )  # fmt: skip


def hfacc_on_policy(student, teacher, rows, tmp, bs, ga, epochs=1, completions=None, **extra):
    """hfacc's DistillationTrainer (lmbda 1); its sampler returns ``completions`` for each prompt."""
    prompts = [split(r)[0] for r in rows]
    table = {tuple(p): list(c) for p, c in zip(prompts, completions, strict=True)}
    tokenizer = word_tokenizer(student.config.vocab_size)
    args = DistillationArguments(**common_args(tmp, bs, ga, epochs, **extra), lmbda=1.0, beta=BETA, max_steps=1)
    dataset = Dataset.from_list([{"prompt": text(p)} for p in prompts])
    trainer = DistillationTrainer(student, teacher, args, train_dataset=dataset, processing_class=tokenizer)
    trainer.sample = lambda ids, generation=0: ([table[tuple(p)] for p in ids], [False] * len(ids))
    return trainer


def quiet(runner):
    """The runner's trainer without the Trainer's printed log dicts."""
    from transformers import PrinterCallback

    def run(*args, **kwargs):
        trainer = runner(*args, **kwargs)
        trainer.remove_callback(PrinterCallback)
        return trainer

    return run


trl_distillation, trl_gkd, hfacc_objective, hfacc_on_policy = map(
    quiet, (trl_distillation, trl_gkd, hfacc_objective, hfacc_on_policy)
)
RUNNERS = {"trl DistillationTrainer": trl_distillation, "trl GKDTrainer": trl_gkd, "hfacc": hfacc_objective}


class EpochClock(TrainerCallback):
    def __init__(self):
        self.cpu, self.wall, self._start = [], [], None

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._start = (time.process_time(), time.perf_counter())

    def on_epoch_end(self, args, state, control, **kwargs):
        self.cpu.append(time.process_time() - self._start[0])
        self.wall.append(time.perf_counter() - self._start[1])


def tokens_per_second(kind, cli, rows):
    student, teacher = models(cli)
    clock = EpochClock()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = RUNNERS[kind](student, teacher, rows, tmp, BS, GA, learning_rate=1e-4)
        trainer.add_callback(clock)
        trainer.train()
    return count_targets(rows) / clock.cpu[-1], count_targets(rows) / clock.wall[-1]


def models(cli):
    """The student and the teacher (hidden 256 and 384, 4 layers; --quick: 32 and 48, 1 layer)."""
    layers = 1 if cli.quick else 4
    student = build_bench_model(cli.vocab, 32 if cli.quick else 256, layers)
    return student, build_bench_model(cli.vocab, 48 if cli.quick else 384, layers, seed=1)


def memory(cli, rows):
    """Peak bytes of one micro-batch's forward and backward (student + teacher) for the 2 longest rows."""
    longest = sorted(rows, key=lambda r: -len(r["input_ids"]))[:BS]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        if cli.trl:
            student, teacher = models(cli)
            trainer = trl_distillation(student, teacher, longest, tmp, BS, 1, epochs=1)
            trainer.model.train()
            inputs = trainer._generate_and_score_completions([{"prompt": text(split(r)[0])} for r in longest])
            out["trl DistillationTrainer"] = peak_memory(
                lambda: trainer.compute_loss(trainer.model, inputs).backward()
            )

            student, teacher = models(cli)
            trainer = trl_gkd(student, teacher, longest, tmp, BS, 1, epochs=1)
            trainer.model.train()
            gkd_batch = COLLATE(longest)
            out["trl GKDTrainer"] = peak_memory(lambda: trainer.compute_loss(trainer.model, gkd_batch).backward())

        student, teacher = models(cli)
        trainer = hfacc_objective(student, teacher, longest, tmp, BS, 1, epochs=1)
        batch = COLLATE(longest)
        setup = trainer.setup_model(batch)  # the per-model decisions training takes: layout, loss path, teacher
        objective = trainer.objective
        laid = remove_padding(batch, setup.one_row) if setup.padding_free else batch
        units = tuple(objective.count(batch).tolist())
        window = WindowCounts(units[0], units[1], 1, units)

        def hfacc_step():
            _, sums = objective(trainer.model, laid)
            objective.loss(sums, window).backward()

        trainer.model.train()
        out["hfacc"] = peak_memory(hfacc_step)
        out["hfacc layout"] = f"padding-free {setup.padding_free}, loss path {setup.loss_path}"
    return out


# ---- update error under ragged accumulation ---------------------------------------------------------------------
class Capture(TrainerCallback):
    def __init__(self, model):
        self.model, self.grads = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append(torch.cat([p.grad.flatten().clone() for p in self.model.parameters() if p.grad is not None]))


def update_errors(include_trl=True, modes=("off-policy", "on-policy"), splits=SPLITS):
    """Relative error of each trainer's accumulated gradient vs the big batch of the rows it trained (hfacc's alone
    without ``include_trl``: the tests run it so, and a change of the trainer's signatures cannot break it unseen)."""
    rows = uneven_examples()
    rng = random.Random(7)
    # "Generated" completions of other lengths than the dataset's: the long rows get short ones and the reverse.
    generated = [[rng.randrange(3, 64) for _ in range(3 if i % 2 == 0 else rng.randint(25, 40))] for i in range(8)]
    on_policy_rows = [{"input_ids": split(r)[0] + g, "labels": [-100] * len(split(r)[0]) + g}
                      for r, g in zip(rows, generated, strict=True)]  # fmt: skip
    cases = {
        "off-policy": [("trl GKDTrainer (lmbda 0)", trl_gkd, {}), ("hfacc", hfacc_objective, {})],
        "on-policy": [
            ("trl DistillationTrainer", trl_distillation, {"completions": generated}),
            ("trl GKDTrainer (lmbda 1)", trl_gkd, {"lmbda": 1.0, "completions": generated}),
            ("hfacc DistillationTrainer", hfacc_on_policy, {"completions": generated}),
        ],
    }
    if not include_trl:
        cases = {mode: [c for c in contenders if not c[0].startswith("trl")] for mode, contenders in cases.items()}
    cases = {mode: contenders for mode, contenders in cases.items() if mode in modes}
    out = {}
    teacher = make_teacher()
    for mode, contenders in cases.items():
        trained = rows if mode == "off-policy" else on_policy_rows
        want, _, _ = big_batch(make_student(), teacher, trained, beta=BETA, temperature=1.0, ce_weight=0.0)
        for name, runner, options in contenders:
            for bs, ga in splits:
                student = make_student()
                with tempfile.TemporaryDirectory() as tmp:
                    trainer = runner(student, copy.deepcopy(teacher), rows, tmp, bs, ga, 1, learning_rate=0.0,
                                     max_grad_norm=0.0, **options)  # fmt: skip
                    capture = Capture(student)
                    trainer.add_callback(capture)
                    trainer.train()
                got = capture.grads[0].double()
                out[(mode, name, bs, ga)] = ((got - want.double()).norm() / want.double().norm()).item()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    add_quick(parser)
    cli = parser.parse_args(argv)
    if cli.quick:
        cli.rounds, cli.rows, cli.vocab = 1, 4, 256
    if cli.threads:
        torch.set_num_threads(cli.threads)
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    version = trl_version()
    cli.trl = version is not None
    runners = [k for k in RUNNERS if cli.trl or not k.startswith("trl")]

    rows = build_bench_examples(cli.rows, cli.vocab, lengths=(8, 40) if cli.quick else (56, 452))
    student, teacher = models(cli)
    print(
        f"TRL {version or 'not installed: its contenders left out'}; {cli.rows} rows ({count_targets(rows)} student "
        f"target tokens), bs {BS} x GA {GA}, vocab {cli.vocab}, student hidden {student.config.hidden_size} / "
        f"teacher {teacher.config.hidden_size}, {student.config.num_hidden_layers} layers each, fp32, torch threads "
        f"{torch.get_num_threads()}"
    )
    speed = {k: [] for k in runners}
    wall = {k: [] for k in runners}
    for r in range(cli.rounds):
        for kind in runners if r % 2 == 0 else runners[::-1]:
            cpu, seconds = tokens_per_second(kind, cli, rows)
            speed[kind].append(cpu)
            wall[kind].append(seconds)
        print(f"round {r + 1}: " + ", ".join(f"{k} {speed[k][-1]:.0f}" for k in runners) + " tokens/s (CPU time)",
              flush=True)  # fmt: skip
    peak = memory(cli, rows)
    base = runners[0]
    print(
        f"\n| contender | student tokens/s (CPU time, median) | wall | vs {base} | micro-batch peak MiB | vs {base} |"
    )
    print("|---|---|---|---|---|---|")
    for kind in runners:
        ratio = median([a / b for a, b in zip(speed[kind], speed[base], strict=True)])
        mem = peak[kind] / 2**20
        print(f"| {kind} | {median(speed[kind]):.0f} | {median(wall[kind]):.0f} | {ratio:.2f}x | {mem:.1f} | "
              f"{peak[kind] / peak[base]:.2f}x |")  # fmt: skip
    print(f"(hfacc: {peak['hfacc layout']})")
    splits = SPLITS[::3] if cli.quick else SPLITS  # --quick: 8 x 1 and 4 x 2
    errors = update_errors(include_trl=cli.trl, splits=splits)
    print("\nupdate error vs the big batch of the rows trained (tiny Llamas, 8 rows, completions 2-50 tokens, fp32):")
    print("| rows | trainer | " + " | ".join(f"{bs} x {ga}" for bs, ga in splits) + " |")
    print("|---|---|" + "---|" * len(splits))
    for mode, name in dict.fromkeys((m, n) for m, n, _, _ in errors):
        values = " | ".join(f"{errors[(mode, name, bs, ga)]:.1e}" for bs, ga in splits)
        print(f"| {mode} | {name} | {values} |")
    return errors


if __name__ == "__main__":
    main()
