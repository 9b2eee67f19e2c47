"""Memory while streaming: a generated stream of a million rows, trained through, keeps resident memory flat.

    python benchmarks/streaming_memory.py [--rows 1000000] [--steps 300]

The rows (prompt/completion: "What is a + b?" -> "c") are made on the fly by a generator; nothing is written to
disk and nothing is tokenized ahead. TokenWeightedTrainer trains a tiny Llama on the stream (--streaming's path:
hfacc.data.streaming), with micro-batches large enough that ``--steps`` optimizer steps read every row. The process's
resident memory (RSS) is sampled ten times; the growth from the first sample (after 10 % of the rows) to the last
is what must stay near zero. For scale: the same rows as a map-style dataset would first be tokenized in full and
kept in the Arrow cache.
"""

import argparse
import random
import sys
import tempfile
from pathlib import Path

from datasets import IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RSSSampler, add_quick  # noqa: E402

from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer
from hfacc.data.embedded import build_default_model, build_default_tokenizer
from hfacc.data.sft import build_sft_dataset


def arithmetic_rows(n: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        a, b = rng.randrange(1000), rng.randrange(1000)
        yield {"prompt": f"What is {a} + {b}?", "completion": f" {a + b}"}


def run(rows: int, steps: int, ga: int = 4) -> dict:
    import datasets

    datasets.disable_progress_bars()
    tokenizer = build_default_tokenizer()
    source = IterableDataset.from_generator(arithmetic_rows, gen_kwargs={"n": rows})
    stream = build_sft_dataset(source, tokenizer, max_length=32)
    batch = -(-rows // (steps * ga))  # every row is read in `steps` steps
    sampler = RSSSampler(max(steps // 10, 1), scale=batch * ga)
    with tempfile.TemporaryDirectory() as tmp:
        args = TokenWeightedArguments(
            output_dir=tmp,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=ga,
            max_steps=steps,
            learning_rate=1e-3,
            logging_steps=steps,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            eval_strategy="no",
            dataloader_pin_memory=False,
            # Hundreds of 15-token rows per micro-batch: one padding-free row of ~4000 tokens would spend the run on
            # attention over it; the padded [rows, 16] batch is cheap. Memory is what is measured here.
            padding_free=False,
        )
        trainer = TokenWeightedTrainer(
            model=build_default_model(tokenizer, hidden_size=32, num_layers=1),
            args=args,
            train_dataset=stream,
            data_collator=DataCollatorForCausalLM(tokenizer.pad_token_id),
            callbacks=[sampler],
        )
        trainer.train()
    first, last = sampler.samples[0][1], sampler.samples[-1][1]
    return {"samples": sampler.samples, "growth_mib": last - first, "peak_mib": sampler.peak, "micro_batch": batch}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=300)
    add_quick(parser)
    cli = parser.parse_args(argv)
    if cli.quick:
        cli.rows, cli.steps = 400, 10
    result = run(cli.rows, cli.steps)
    print(f"micro-batches of {result['micro_batch']} examples, 4 per step, {cli.steps} steps")
    for rows_read, rss in result["samples"]:
        print(f"rows read {rows_read:9,d}  RSS {rss:8.1f} MiB")
    print(
        f"\nRSS growth from the first sample to the last: {result['growth_mib']:+.1f} MiB; peak {result['peak_mib']:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
