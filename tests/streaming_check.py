"""Streaming on two CPU ranks (gloo), launched by tests/test_streaming.py:

    torchrun --nproc_per_node 2 tests/streaming_check.py OUT_DIR

A generated chat stream (one shard: split row by row) is trained by TokenWeightedTrainer. Per case, the window's
sequences of both ranks are gathered and the gradient (after DDP's all-reduce) is compared with the full-batch
gradient over exactly those examples, tokenized by the map-style path. A resumed run is compared with the
uninterrupted one. Rank 0 writes OUT_DIR/results.json; the test asserts on it.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datasets import Dataset, IterableDataset  # noqa: E402

from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer, build_tiny_llama  # noqa: E402
from hfacc.data.embedded import build_default_tokenizer, generate_instruction_examples  # noqa: E402
from hfacc.data.sft import build_sft_dataset  # noqa: E402
from hfacc.jobs.console import end_process_group  # noqa: E402
from tests.helpers import CaptureGradients, full_batch_causal_lm, relative_error  # noqa: E402

MAX_LENGTH = 64


def make_rows(n=64, seed=5):
    return generate_instruction_examples(n, seed=seed)


def make_stream(rows, tokenizer, buffer_size=16):
    def generate():
        yield from rows

    stream = build_sft_dataset(IterableDataset.from_generator(generate), tokenizer, max_length=MAX_LENGTH)
    stream.buffer_size = buffer_size
    return stream


def reference_examples(rows, tokenizer):
    return build_sft_dataset(Dataset.from_list(rows), tokenizer, max_length=MAX_LENGTH).to_list()


def make_model(tokenizer):
    return build_tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, seed=0)


def sequences(batch):
    """The token ids of each sequence of a micro-batch: padded rows, or packed rows (split where positions restart;
    the collator's filler at the end of a row, which has no target, left out)."""
    ids = batch["input_ids"]
    if "attention_mask" in batch:
        return [ids[r][batch["attention_mask"][r].bool()].tolist() for r in range(ids.shape[0])]
    out = []
    for r in range(ids.shape[0]):
        starts = (batch["position_ids"][r] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            if (batch["labels"][r, a + 1 : b] != -100).any():
                out.append(ids[r, a:b].tolist())
    return out


def build_trainer(model, stream, tokenizer, out, **settings):
    args = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=0.0,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        max_steps=1,
        seed=0,
        dataloader_pin_memory=False,
    )
    args.update(settings)
    capture = CaptureGradients(model)
    trainer = TokenWeightedTrainer(
        model=model,
        args=TokenWeightedArguments(**args),
        train_dataset=stream,
        data_collator=DataCollatorForCausalLM(tokenizer.pad_token_id),
        callbacks=[capture],
    )
    windows = []
    take = trainer.get_batch_samples

    def recording(*a, **k):
        result = take(*a, **k)
        windows.append([s for b in trainer.window.batches for s in sequences(b)])
        return result

    trainer.get_batch_samples = recording
    return trainer, capture, windows


def gather(value):
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def exactness_case(tokenizer, rows, out, packing=False, **settings):
    """One optimizer step: the gradient against the full batch over the window's examples of every rank."""
    reference = reference_examples(rows, tokenizer)
    model = make_model(tokenizer)
    stream = make_stream(rows, tokenizer)
    stream.pack_length = MAX_LENGTH if packing else None
    trainer, capture, windows = build_trainer(model, stream, tokenizer, out, **settings)
    trainer.train()
    per_rank = gather(windows[0])
    seen = [s for rank in per_rank for s in rank]
    index = {tuple(e["input_ids"]): i for i, e in enumerate(reference)}
    picked = [index[tuple(s)] for s in seen]  # KeyError: the stream made an example the map-style path did not
    grad, _, _ = full_batch_causal_lm(make_model(tokenizer), [reference[i] for i in picked])
    return {
        "grad_error": relative_error(capture.grads[0], grad),
        "indices_per_rank": [[index[tuple(s)] for s in rank] for rank in per_rank],
        "packed_rows": all("attention_mask" not in b for b in trainer.window.batches),
    }


def resume_case(tokenizer, rows, out: Path, **settings):
    """4 steps straight vs. 2 steps, a checkpoint, and 2 resumed steps: same weights, same windows."""
    settings = dict(learning_rate=1e-2, max_steps=4, save_strategy="steps", save_steps=2, **settings)
    rank = int(os.environ.get("RANK", "0"))
    full_model = make_model(tokenizer)
    trainer, _, full_windows = build_trainer(
        full_model, make_stream(rows, tokenizer), tokenizer, out / "full", **settings
    )
    trainer.train()
    resumed_dir = out / "resumed"
    if rank == 0:
        shutil.copytree(out / "full" / "checkpoint-2", resumed_dir / "checkpoint-2")
    if dist.is_initialized():
        dist.barrier()
    model = make_model(tokenizer)
    trainer, _, windows = build_trainer(model, make_stream(rows, tokenizer), tokenizer, resumed_dir, **settings)
    trainer.train(resume_from_checkpoint=str(resumed_dir / "checkpoint-2"))
    a = torch.cat([p.detach().flatten() for p in full_model.parameters()])
    b = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "weight_error": relative_error(b, a),
        "same_windows": gather(windows == full_windows[2:]),
        "windows_after_resume": len(windows),
        "moved": (a - torch.cat([p.detach().flatten() for p in make_model(tokenizer).parameters()])).norm().item(),
    }


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    tokenizer = build_default_tokenizer()
    rows = make_rows()
    results = {}
    results["fixed"] = exactness_case(tokenizer, rows, out / "fixed")
    results["budget"] = exactness_case(tokenizer, rows, out / "budget", max_tokens_per_batch=160)
    results["packing"] = exactness_case(tokenizer, rows, out / "packing", packing=True)
    results["resume"] = resume_case(tokenizer, rows, out / "resume")
    results["resume budget"] = resume_case(tokenizer, rows, out / "resume_budget", max_tokens_per_batch=160)
    results["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized() or dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])  # accelerate forms the gloo group (TokenWeightedArguments sets use_cpu)
    end_process_group()  # a rank that exits with the gloo group alive aborts now and then (1 in 20 here)
