"""Target tokens/s and peak memory: stock Trainer vs TRL SFTTrainer vs hfacc, interleaved in one process.

    python benchmarks/throughput.py                    # CPU, fp32: the numbers in benchmarks/README.md
    python benchmarks/throughput.py --dtype bf16 --clock cpu --threads 1     # CPU, bf16=True (bf16 autocast)
    python benchmarks/throughput.py --device cuda --dtype bf16 --vocab 128256 --hidden 1024 --layers 8  # a GPU
    python benchmarks/throughput.py --device cuda --dtype bf16 --attention flash_attention_2 ...           # varlen

Same model (Llama-style; default vocab 32000, hidden 256, 4 layers), same data (32 prompt/answer examples of
32-512 tokens, 30-70 % prompt masked with -100), same optimizer, bs 8 and GA 2 everywhere, each contender trains
two epochs per round and the second is timed (steady state: one-time start-up work such as hfacc's checks and
TRL's dataset preparation is left out and reported apart), rounds alternate the order. The user brings their own padding collator
(transformers' DataCollatorForSeq2Seq, which pads labels with -100) wherever a trainer accepts one. Contenders:

- stock:          transformers.Trainer, padded batches, the model's own loss.
- trl:            trl.SFTTrainer (its collator, padded; its fused LM head and metrics).
- trl_pf:         trl.SFTTrainer with padding_free=True (its own collator: one row per micro-batch).
- hfacc_padded:   TokenWeightedTrainer with padding_free=False: the defaults before padding-free (fused loss).
- hfacc:          TokenWeightedTrainer, defaults: fused loss and padding-free micro-batches.
- hfacc_budget:   hfacc defaults plus micro-batches of at most 8 x 512 padded tokens (sorted by length).
- hfacc_baseline: with --baseline DIR, the hfacc defaults of another checkout (e.g. main's, before a change),
                  imported as a second package and interleaved with the others (no memory measurement).

On a machine shared with other jobs, --clock cpu times each epoch in this process's CPU time (one torch thread:
the compute), steadier than the wall time the table otherwise reports.

Throughput is target tokens (labels != -100 after the shift) per second of the timed epoch; "start-up" is how
much longer the first epoch took than the second. Memory is measured with the PyTorch profiler's allocation events (CPU) or
torch.cuda.max_memory_allocated (GPU) for the micro-batch of the 8 longest sequences: the *loss step* (final hidden
states through loss and backward) and the whole forward/backward step. Ratios are to stock. The script also prints
the relative gradient difference between hfacc's padded and padding-free micro-batch.
"""

import argparse
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_quick, build_bench_examples, build_bench_model, count_targets, median, trl_version  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from hfacc import TokenWeightedArguments, TokenWeightedTrainer  # noqa: E402
from hfacc.data.padding_free import remove_padding  # noqa: E402
from hfacc.objectives import CausalLMObjective  # noqa: E402
from hfacc.ops.fused_loss import FusedOutputHead  # noqa: E402
from hfacc.ops.loss import shift_labels  # noqa: E402
from hfacc.runtime.memory import peak_memory  # noqa: E402
from hfacc.setup.layout_check import uses_one_row  # noqa: E402

BS, GA, MIN_LEN, MAX_LEN = 8, 2, 32, 512
CONTENDERS = ("stock", "trl", "trl_pf", "hfacc_padded", "hfacc", "hfacc_budget")


def common_args(tmp, device, dtype, epochs=2):
    return dict(
        output_dir=tmp,
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=GA,
        num_train_epochs=epochs,
        learning_rate=1e-4,
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        disable_tqdm=True,
        seed=0,
        use_cpu=device == "cpu",
        bf16=dtype == "bf16",
        dataloader_pin_memory=False,
    )


def user_collator():
    """The user's own padding collator: transformers' DataCollatorForSeq2Seq pads input_ids and labels (-100)."""
    return DataCollatorForSeq2Seq(bench_tokenizer(), padding=True)


def run_stock(model, examples, tmp, device, dtype):
    args = TrainingArguments(**common_args(tmp, device, dtype))
    return Trainer(model=model, args=args, train_dataset=Dataset.from_list(examples), data_collator=user_collator())


def run_hfacc(model, examples, tmp, device, dtype, **settings):
    args = TokenWeightedArguments(**common_args(tmp, device, dtype), **settings)
    return TokenWeightedTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(examples), data_collator=user_collator()
    )


def run_trl(model, examples, tmp, device, dtype, padding_free=False):
    from trl import SFTConfig, SFTTrainer

    rows = [{"input_ids": e["input_ids"], "completion_mask": [int(y != -100) for y in e["labels"]]} for e in examples]
    config = SFTConfig(
        **common_args(tmp, device, dtype),
        max_length=None,
        completion_only_loss=True,
        packing=False,
        padding_free=padding_free,
    )
    return SFTTrainer(
        model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=bench_tokenizer()
    )


def bench_tokenizer(vocab_size=32000):
    """A tokenizer TRL accepts for pre-tokenized data: word-level over the benchmark's id range, pad = id 0."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="t0", eos_token="t2", unk_token="t1")


RUNNERS = {
    "stock": run_stock,
    "trl": run_trl,
    "trl_pf": lambda *a: run_trl(*a, padding_free=True),
    "hfacc_padded": lambda *a: run_hfacc(*a, padding_free=False),
    "hfacc": run_hfacc,
    "hfacc_budget": lambda *a: run_hfacc(*a, max_tokens_per_batch=BS * MAX_LEN),
}


def add_baseline(checkout):
    """The contender hfacc_baseline: the hfacc package of another checkout, imported under that name."""
    folder = tempfile.mkdtemp()
    os.symlink(Path(checkout).resolve() / "hfacc", Path(folder) / "hfacc_baseline")
    sys.path.insert(0, folder)
    baseline = importlib.import_module("hfacc_baseline")

    def run(model, examples, tmp, device, dtype):
        args = baseline.TokenWeightedArguments(**common_args(tmp, device, dtype))
        return baseline.TokenWeightedTrainer(
            model=model, args=args, train_dataset=Dataset.from_list(examples), data_collator=user_collator()
        )

    RUNNERS["hfacc_baseline"] = run


def new_model(cli):
    model = build_bench_model(cli.vocab, cli.hidden, cli.layers)
    model.config._attn_implementation = cli.attention
    return model


class EpochTimer(TrainerCallback):
    """Wall time (or this process's CPU time) of every epoch (on CUDA, after the device has finished its work)."""

    def __init__(self, device, clock="wall"):
        self.device, self.clock, self.times, self._start = device, clock, [], None

    def _now(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.process_time() if self.clock == "cpu" else time.perf_counter()

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._start = self._now()

    def on_epoch_end(self, args, state, control, **kwargs):
        self.times.append(self._now() - self._start)


def train_epochs(kind, cli, examples, targets):
    """(target tokens/s of the last epoch, seconds the first epoch took longer than the last)."""
    model = new_model(cli)
    timer = EpochTimer(cli.device, cli.clock)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = RUNNERS[kind](model, examples, tmp, cli.device, cli.dtype)
        trainer.add_callback(timer)
        trainer.train()
    return targets / timer.times[-1], timer.times[0] - timer.times[-1]


def memory_table(cli, examples):
    """Peak memory of the loss step and of a whole micro-batch step, for the micro-batch of the 8 longest."""
    longest = sorted(examples, key=lambda e: -len(e["input_ids"]))[:BS]
    batch = {k: v.to(cli.device) for k, v in user_collator()(longest).items()}
    model = new_model(cli).to(cli.device)
    dtype = torch.bfloat16 if cli.dtype == "bf16" else torch.float32
    amp = torch.autocast(cli.device, dtype=dtype, enabled=dtype != torch.float32)
    with torch.no_grad(), amp:
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    hidden = hidden.detach()
    head, labels = model.lm_head, batch["labels"]

    def full_logits_loss():
        h = hidden.clone().requires_grad_()
        with amp:
            loss = model.loss_function(logits=head(h), labels=labels, vocab_size=cli.vocab)
        loss.backward()

    def hfacc_loss():
        h = hidden.clone().requires_grad_()
        with amp:
            fused = FusedOutputHead(head, shift_labels(labels), 0, 0.0)
            loss = fused(h) / fused.result[0].count
        loss.backward()

    def trl_loss():
        from trl.kernels import ChunkedLogProbFunction

        h = hidden.clone().requires_grad_()
        targets = labels[:, 1:]
        mask = targets != -100
        with amp:
            log_probs, *_ = ChunkedLogProbFunction.apply(
                h[:, :-1].reshape(-1, h.shape[-1]),
                head.weight,
                head.bias,
                targets.clamp(min=0).reshape(-1),
                1.0,
                32768,
                None,
                1.0,
                ("log_probs", "entropy", "is_top1"),
            )
            loss = -(log_probs.view(mask.shape) * mask).sum() / mask.sum()
        loss.backward()

    results = {}
    losses = {"stock": full_logits_loss, "trl": trl_loss, "hfacc": hfacc_loss}
    for kind, fn in losses.items() if cli.trl else [(k, f) for k, f in losses.items() if k != "trl"]:
        model.zero_grad(set_to_none=True)
        results[("loss step", kind)] = peak_memory(fn, cli.device)

    def step_stock():
        with amp:
            loss = model(**batch).loss
        loss.backward()

    unpadded = remove_padding(batch, uses_one_row(model))

    def step_hfacc(inputs):
        with amp:
            _, sums = CausalLMObjective(fused=True)(model, inputs)
            loss = sums.loss / sums.count
        loss.backward()

    trl_model = new_model(cli).to(cli.device)
    if cli.trl:
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(trl_model, outputs=("log_probs", "entropy", "is_top1"))
    one_row = remove_padding(batch, True)

    def step_trl(inputs):
        with amp:
            loss = trl_model(
                **{k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "position_ids", "labels")},
                fused_lm_head=True,
            ).loss
        loss.backward()

    steps = {
        "stock": step_stock,
        "trl": lambda: step_trl(batch),
        "trl_pf": lambda: step_trl(one_row),
        "hfacc_padded": lambda: step_hfacc(batch),
        "hfacc": lambda: step_hfacc(unpadded),
    }
    for kind, fn in steps.items():
        if kind.startswith("trl") and not cli.trl:
            continue
        model.zero_grad(set_to_none=True)
        trl_model.zero_grad(set_to_none=True)
        results[("whole step", kind)] = peak_memory(fn, cli.device)
    results[("whole step", "hfacc_budget")] = results[("whole step", "hfacc")]  # same largest micro-batch
    # Padded and padding-free give the same gradient (fp32 rounding), on the first micro-batch of the data: the 8
    # longest fill their rows (one each) whatever the layout, so they would compare a layout with itself.
    first = {k: v.to(cli.device) for k, v in user_collator()(examples[:BS]).items()}
    grads = []
    for inputs in (first, remove_padding(first, uses_one_row(model))):
        model.zero_grad(set_to_none=True)
        step_hfacc(inputs)
        grads.append(torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None]))
    results["gradient difference"] = ((grads[1] - grads[0]).norm() / grads[0].norm()).item()
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--examples", type=int, default=32, help="examples per epoch")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--attention", default="sdpa", help="attn_implementation, e.g. sdpa, flash_attention_2")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--baseline", default="", help="a checkout of hfacc: adds the contender hfacc_baseline")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="cpu: time epochs in CPU time")
    add_quick(parser)
    cli = parser.parse_args(argv)
    lengths = (MIN_LEN, MAX_LEN)
    if cli.quick:
        cli.rounds, cli.examples, cli.vocab, cli.hidden, cli.layers, lengths = 1, 16, 256, 32, 1, (8, 48)
    cli.trl = trl_version() is not None
    if cli.threads:
        torch.set_num_threads(cli.threads)
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    examples = build_bench_examples(cli.examples, vocab_size=cli.vocab, lengths=lengths)
    targets = count_targets(examples)
    kinds = [k for k in cli.contenders.split(",") if cli.trl or not k.startswith("trl")]
    if not cli.trl:
        print("TRL not installed: its contenders left out")
    if cli.baseline:
        add_baseline(cli.baseline)
        kinds += [] if "hfacc_baseline" in kinds else ["hfacc_baseline"]
    padded = sum(
        len(examples[i : i + BS]) * max(len(e["input_ids"]) for e in examples[i : i + BS])
        for i in range(0, len(examples), BS)
    )
    real = sum(len(e["input_ids"]) for e in examples)
    print(
        f"{cli.examples} examples, {targets} target tokens per epoch, {100 * (1 - real / padded):.0f} % padding in "
        f"batches of {BS}; {cli.device}, {cli.dtype}, {cli.attention}, vocab {cli.vocab}, hidden {cli.hidden}, "
        f"{cli.layers} layers, torch threads {torch.get_num_threads()}"
    )
    speed, startup = {k: [] for k in kinds}, {k: [] for k in kinds}
    for r in range(cli.rounds):
        order = kinds if r % 2 == 0 else kinds[::-1]
        for kind in order:
            tokens_per_second, extra = train_epochs(kind, cli, examples, targets)
            speed[kind].append(tokens_per_second)
            startup[kind].append(extra)
        print(
            f"round {r + 1}: " + ", ".join(f"{k} {speed[k][-1]:.0f}" for k in kinds) + " target tokens/s", flush=True
        )
    memory = memory_table(cli, examples)
    print(f"gradient, hfacc padding-free vs padded (relative): {memory['gradient difference']:.1e}")
    # Paired per round (same machine state), then the median: steadier than a ratio of medians on a shared box.
    reference = "stock" if "stock" in kinds else kinds[0]
    paired = {k: median([a / b for a, b in zip(speed[k], speed[reference], strict=True)]) for k in kinds}
    print(
        "\n| contender | target tokens/s (median) | vs stock (median of per-round ratios) | start-up s (median) "
        "| loss-step peak MiB | vs stock | whole-step peak MiB | vs stock |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ref_loss, ref_step = memory[("loss step", "stock")] / 2**20, memory[("whole step", "stock")] / 2**20
    for kind in kinds:
        if ("whole step", kind) not in memory:  # the baseline checkout: speed only
            print(
                f"| {kind} | {median(speed[kind]):.0f} | {paired[kind]:.2f}x | {median(startup[kind]):.1f} | | | | |"
            )
            continue
        loss_key = ("loss step", kind.split("_")[0])
        loss_mem = memory[loss_key] / 2**20
        step_mem = memory[("whole step", kind)] / 2**20
        print(
            f"| {kind} | {median(speed[kind]):.0f} | {paired[kind]:.2f}x | {median(startup[kind]):.1f} "
            f"| {loss_mem:.1f} | {loss_mem / ref_loss:.2f}x "
            f"| {step_mem:.1f} | {step_mem / ref_step:.2f}x |"
        )
    return {"speed": speed, "memory": memory}


if __name__ == "__main__":
    main()
