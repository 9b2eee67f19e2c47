"""How to share a stream between ranks: accelerate's dispatching vs. ``datasets.distributed.split_dataset_by_node``.

    torchrun --nproc_per_node 2 benchmarks/streaming_sharding.py [--batches 150]

Both read the same generated chat stream (one shard), tokenized lazily by hfacc, and time the data pipeline alone
(no model): ``--batches`` micro-batches of 8 on every rank, interleaved (dispatch, split, dispatch, split) so that
the other load on the machine hits both alike.

- dispatch: what the stock Trainer does with an iterable dataset (``accelerator.prepare``, ``dispatch_batches``
  left at its default): rank 0 reads and tokenizes the micro-batches of every rank, concatenates and broadcasts them.
  Batches are padded to a fixed 256 tokens here: with dynamic padding (micro-batches of different lengths) or
  token-budget micro-batches (different sizes) accelerate's concatenation raises ("You can't use batches of
  different size with `dispatch_batches=True`", accelerate 1.15 data_loader.py), and the other ranks wait.
- split: hfacc (:class:`hfacc.data.streaming.StreamBatches`): every rank takes every 2nd row and tokenizes its own.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator
from datasets import IterableDataset
from torch.utils.data import DataLoader

from hfacc import DataCollatorForCausalLM
from hfacc.data.embedded import build_default_tokenizer, generate_instruction_examples
from hfacc.data.sft import build_sft_dataset
from hfacc.data.streaming import StreamBatches


def chat_stream(tokenizer, n=100_000):
    def rows():
        for i in range(0, n, 1000):
            yield from generate_instruction_examples(1000, seed=i)

    return build_sft_dataset(IterableDataset.from_generator(rows), tokenizer, max_length=256)


def time_dispatch(accelerator, stream, collate, batches):
    loader = accelerator.prepare(DataLoader(stream, batch_size=8, collate_fn=collate))
    start = time.perf_counter()
    for i, _ in enumerate(loader):
        if i + 1 == batches:
            break
    return time.perf_counter() - start


def time_split(accelerator, stream, collate, batches):
    loader = StreamBatches(
        stream, collate, batch_size=8, rank=accelerator.process_index, world_size=accelerator.num_processes
    )
    start = time.perf_counter()
    for i, _ in enumerate(loader):
        if i + 1 == batches:
            break
    if dist.is_initialized():
        dist.barrier()  # the slower rank decides how fast training goes
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--quick", action="store_true", help="5 batches, one process allowed (the tests' run)")
    cli = parser.parse_args(argv)
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    if cli.quick:
        cli.batches = 5
    else:
        assert accelerator.num_processes == 2, "run with torchrun --nproc_per_node 2"
    tokenizer = build_default_tokenizer()
    stream = chat_stream(tokenizer, n=1000 if cli.quick else 100_000)
    fixed = DataCollatorForCausalLM(tokenizer.pad_token_id, pad_to_multiple_of=256)
    times = {"dispatch": [], "split": []}
    for _ in range(2):
        times["dispatch"].append(time_dispatch(accelerator, stream, fixed, cli.batches))
        times["split"].append(time_split(accelerator, stream, fixed, cli.batches))
    if accelerator.is_main_process:
        examples = accelerator.num_processes * 8 * cli.batches
        result = {k: round(examples / min(v), 1) for k, v in times.items()}
        result["split / dispatch"] = round(result["split"] / result["dispatch"], 2)
        print(json.dumps({"examples_per_second": result, "seconds": times}, indent=1))
        return result
    return None


if __name__ == "__main__":
    main()
