"""Step time of TokenWeightedTrainer vs stock transformers.Trainer, interleaved in one process.

    python benchmarks/trainer_overhead.py [--rounds 5] [--steps 4]

Both train the same Llama-style model (vocab 32000, hidden 256, 4 layers) on the same variable-length, prompt-masked
data with bs=2, GA=4, fp32 on the CPU. This is a model whose forward consumes `num_items_in_batch`, the one case
where the stock Trainer is already exact, so the comparison isolates hfacc's own cost: counting each window's
targets, computing the loss outside the model and logging exactly. hfacc runs its plain-logits path here
(`fused_loss=False`, `padding_free=False`) so that the speed-ups of benchmarks/throughput.py do not flatter it.
Rounds alternate which trainer goes first; the printed ratio is median(hfacc step) / median(stock step).
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import StepTimer, add_quick, bench_args, build_bench_examples, build_bench_model, median  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import Trainer  # noqa: E402

from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer  # noqa: E402


def run(kind, dataset, steps, tmp, sizes=()):
    timer = StepTimer(warmup=1)
    extra = (
        {"args_class": TokenWeightedArguments, "fused_loss": False, "padding_free": False} if kind == "hfacc" else {}
    )
    args = bench_args(tmp, bs=2, ga=4, max_steps=steps + 1, **extra)
    cls = TokenWeightedTrainer if kind == "hfacc" else Trainer
    trainer = cls(
        model=build_bench_model(*sizes),
        args=args,
        train_dataset=dataset,
        data_collator=DataCollatorForCausalLM(pad_token_id=0),
        callbacks=[timer],
    )
    trainer.train()
    return timer.steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per trainer and round")
    add_quick(parser)
    cli = parser.parse_args(argv)
    sizes, vocab, lengths = ((256, 32, 1), 256, (8, 48)) if cli.quick else ((), 32000, (56, 452))
    if cli.quick:
        cli.rounds, cli.steps = 1, 1
    dataset = Dataset.from_list(build_bench_examples(8 * (cli.steps + 1), vocab, lengths))
    times = {"stock": [], "hfacc": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(cli.rounds):
            order = ["stock", "hfacc"] if r % 2 == 0 else ["hfacc", "stock"]
            for kind in order:
                times[kind] += run(kind, dataset, cli.steps, tmp, sizes)
            print(
                f"round {r + 1}: stock {median(times['stock']):.3f} s/step, hfacc {median(times['hfacc']):.3f} s/step"
            )
    ratio = median(times["hfacc"]) / median(times["stock"])
    print(f"\nstep time hfacc / stock Trainer = {ratio:.3f} (overhead {100 * (ratio - 1):+.1f} %; target <= +3 %)")
    return ratio


if __name__ == "__main__":
    main()
