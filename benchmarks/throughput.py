"""Target tokens/s and peak memory: stock Trainer vs TRL SFTTrainer vs hfacc, interleaved in one process.

    python benchmarks/throughput.py                    # CPU, fp32: the numbers in benchmarks/README.md
    python benchmarks/throughput.py --device cuda --dtype bf16 --vocab 128256 --hidden 1024 --layers 8  # a GPU

Same model (Llama-style; default vocab 32000, hidden 256, 4 layers), same data (prompt/answer examples of 56-452
tokens, 30-70 % prompt masked with -100), same optimizer, each contender trains one full epoch per round, rounds
alternate the order. Contenders:

- stock:  transformers.Trainer, per_device_train_batch_size 4, GA 2, padded batches, the model's own loss.
- trl:    trl.SFTTrainer with the same batch settings (its default fused LM head and metrics; fp32 unless --dtype).
- hfacc:  TokenWeightedTrainer as the recipe runs it: fused chunked cross-entropy, micro-batches of at most
          4 x 452 padded tokens (the same memory bound as stock's largest micro-batch), GA 2.

Throughput is target tokens (labels != -100 after the shift) per second of training. Memory is measured with the
PyTorch profiler's allocation events (CPU) or torch.cuda.max_memory_allocated (GPU) for one micro-batch of 4 x 452
tokens: the *loss step* (from the final hidden states through loss and backward; full logits vs each fused head)
and the whole forward/backward step. Ratios are to stock.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import build_bench_examples, build_bench_model, count_targets, median  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer  # noqa: E402
from hfacc.loss import shift_labels  # noqa: E402
from hfacc.memory import peak_memory  # noqa: E402
from hfacc.objective import _FusedOutputHead  # noqa: E402

BS, GA, MAX_LEN = 4, 2, 452


def common_args(tmp, device, dtype):
    return dict(
        output_dir=tmp,
        per_device_train_batch_size=BS,
        gradient_accumulation_steps=GA,
        num_train_epochs=1,
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


def run_stock(model, examples, tmp, device, dtype):
    args = TrainingArguments(**common_args(tmp, device, dtype))
    return Trainer(
        model=model, args=args, train_dataset=Dataset.from_list(examples), data_collator=DataCollatorForCausalLM(0)
    )


def run_hfacc(model, examples, tmp, device, dtype, budget=BS * MAX_LEN, packing=False):
    args = TokenWeightedArguments(**common_args(tmp, device, dtype), max_tokens_per_batch=budget)
    data = examples
    if packing:
        from hfacc.batching import pack_examples

        data = pack_examples(examples, MAX_LEN)
    return TokenWeightedTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(data), data_collator=DataCollatorForCausalLM(0)
    )


def run_trl(model, examples, tmp, device, dtype):
    from trl import SFTConfig, SFTTrainer

    rows = [{"input_ids": e["input_ids"], "completion_mask": [int(y != -100) for y in e["labels"]]} for e in examples]
    config = SFTConfig(**common_args(tmp, device, dtype), max_length=None, completion_only_loss=True, packing=False)
    return SFTTrainer(
        model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=bench_tokenizer()
    )


def bench_tokenizer():
    """A tokenizer TRL accepts for pre-tokenized data: word-level over the benchmark's id range, pad = id 0."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(32000)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="t0", eos_token="t2", unk_token="t1")


RUNNERS = {"stock": run_stock, "trl": run_trl, "hfacc": run_hfacc}


def train_epoch(kind, cli, examples, targets):
    model = build_bench_model(cli.vocab, cli.hidden, cli.layers)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = RUNNERS[kind](model, examples, tmp, cli.device, cli.dtype)
        start = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - start
    return targets / elapsed


def memory_table(cli, examples):
    """Peak memory of the loss step and of a whole micro-batch step, for one micro-batch of 4 x 452 tokens."""
    from trl.trainer.utils import add_fused_lm_head

    longest = sorted(examples, key=lambda e: -len(e["input_ids"]))[:BS]
    batch = {k: v.to(cli.device) for k, v in DataCollatorForCausalLM(0)(longest).items()}
    model = build_bench_model(cli.vocab, cli.hidden, cli.layers).to(cli.device)
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
            fused = _FusedOutputHead(head, shift_labels(labels), 0, 0.0)
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

    loss_step = {"stock": full_logits_loss, "trl": trl_loss, "hfacc": hfacc_loss}
    results = {}
    for kind, fn in loss_step.items():
        model.zero_grad(set_to_none=True)
        results[("loss step", kind)] = peak_memory(fn, cli.device)

    def step_stock():
        with amp:
            loss = model(**batch).loss
        loss.backward()

    def step_hfacc():
        from hfacc.objective import CausalLMObjective

        with amp:
            _, sums = CausalLMObjective(fused=True)(model, batch)
            loss = sums.loss / sums.count
        loss.backward()

    trl_model = build_bench_model(cli.vocab, cli.hidden, cli.layers).to(cli.device)
    add_fused_lm_head(trl_model, outputs=("log_probs", "entropy", "is_top1"))

    def step_trl():
        with amp:
            loss = trl_model(**batch, fused_lm_head=True).loss
        loss.backward()

    for kind, fn in {"stock": step_stock, "trl": step_trl, "hfacc": step_hfacc}.items():
        model.zero_grad(set_to_none=True)
        trl_model.zero_grad(set_to_none=True)
        results[("whole step", kind)] = peak_memory(fn, cli.device)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--examples", type=int, default=48, help="examples per epoch")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--contenders", default="stock,trl,hfacc")
    cli = parser.parse_args()
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    examples = build_bench_examples(cli.examples, vocab_size=cli.vocab, lengths=(56, MAX_LEN))
    targets = count_targets(examples)
    kinds = cli.contenders.split(",")
    print(
        f"{cli.examples} examples, {targets} target tokens per epoch; {cli.device}, {cli.dtype}, "
        f"vocab {cli.vocab}, hidden {cli.hidden}, {cli.layers} layers, torch threads {torch.get_num_threads()}"
    )
    speed = {k: [] for k in kinds}
    for r in range(cli.rounds):
        order = kinds if r % 2 == 0 else kinds[::-1]
        for kind in order:
            speed[kind].append(train_epoch(kind, cli, examples, targets))
        print(f"round {r + 1}: " + ", ".join(f"{k} {speed[k][-1]:.0f}" for k in kinds) + " target tokens/s")
    memory = memory_table(cli, examples)
    # Paired per round (same machine state), then the median: steadier than a ratio of medians on a shared box.
    paired = {k: median([a / b for a, b in zip(speed[k], speed["stock"], strict=True)]) for k in kinds}
    print(
        "\n| contender | target tokens/s (median) | vs stock (median of per-round ratios) | loss-step peak MiB "
        "| vs stock | whole-step peak MiB | vs stock |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind in kinds:
        tps = median(speed[kind])
        loss_mem, step_mem = memory[("loss step", kind)] / 2**20, memory[("whole step", kind)] / 2**20
        ref_loss, ref_step = memory[("loss step", "stock")] / 2**20, memory[("whole step", "stock")] / 2**20
        print(
            f"| {kind} | {tps:.0f} | {paired[kind]:.2f}x | {loss_mem:.1f} | {loss_mem / ref_loss:.2f}x | "
            f"{step_mem:.1f} | {step_mem / ref_step:.2f}x |"
        )


if __name__ == "__main__":
    main()
