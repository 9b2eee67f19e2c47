"""Memory under load: thousands of small optimizer steps on the embedded default must keep memory flat.

    python benchmarks/memory_soak.py [--steps 3000]

Trains the embedded tiny Llama with micro-batches of 1 and GA 2, samples the process's resident memory (RSS) every
100 steps, and prints the growth between the first sample after warm-up and the last one, with the slope per
1000 steps. tests/test_soak.py runs a shorter version of the same function and asserts the bound.
"""

import argparse
import sys
import tempfile
from pathlib import Path

from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RSSSampler, add_quick  # noqa: E402

from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer
from hfacc.data.embedded import build_default_model, build_default_tokenizer, generate_instruction_examples
from hfacc.data.sft import build_sft_dataset


def soak(steps: int = 3000, every: int = 100, warmup: int = 300) -> dict:
    """Train ``steps`` optimizer steps; return RSS samples and the growth after ``warmup`` steps (MiB)."""
    import datasets

    datasets.disable_progress_bars()
    tokenizer = build_default_tokenizer()
    data = build_sft_dataset(Dataset.from_list(generate_instruction_examples(400, seed=3)), tokenizer, max_length=128)
    sampler = RSSSampler(every)
    with tempfile.TemporaryDirectory() as tmp:
        args = TokenWeightedArguments(
            output_dir=tmp,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=2,
            max_steps=steps,
            learning_rate=1e-3,
            logging_steps=50,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            eval_strategy="no",
        )
        trainer = TokenWeightedTrainer(
            model=build_default_model(tokenizer, hidden_size=32, num_layers=1),
            args=args,
            train_dataset=data,
            data_collator=DataCollatorForCausalLM(tokenizer.pad_token_id),
            callbacks=[sampler],
        )
        trainer.train()
    after_warmup = [rss for step, rss in sampler.samples if step >= warmup]
    growth = after_warmup[-1] - after_warmup[0]
    span = max(sampler.samples[-1][0] - warmup, 1)
    return {"samples": sampler.samples, "growth_mib": growth, "mib_per_1000_steps": 1000 * growth / span}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    add_quick(parser)
    cli = parser.parse_args(argv)
    result = soak(20, every=5, warmup=5) if cli.quick else soak(cli.steps)
    for step, rss in result["samples"]:
        print(f"step {step:6d}  RSS {rss:8.1f} MiB")
    print(
        f"\ngrowth after warm-up: {result['growth_mib']:+.1f} MiB ({result['mib_per_1000_steps']:+.2f} MiB per 1000 steps)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
