"""Run on two CPU ranks (gloo): ``torchrun --nproc_per_node 2 tests/dropin_distributed_check.py OUT.json``.

1. The last, uneven window of an epoch: accelerate repeats examples so every rank gets a full batch. Each window's
   gradient (after DDP's all-reduce) is compared with the big-batch reference over the window's *real* examples.
2. Checkpoint completion marker: rank 1 writes its RNG state late; the marker must still list it.
3. evaluate() before train(): the training step must still be data parallel (all-reduced gradients).
4. Evaluation of an uneven set, with hfacc's loss and with a compute_loss_func: the repeated examples do not count.

Rank 0 writes the measured values to OUT.json; tests/test_dropin.py asserts on them.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402
from transformers import Trainer  # noqa: E402

from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer, build_tiny_llama  # noqa: E402
from hfacc.data.batching import TokenBudgetBatchSampler  # noqa: E402
from hfacc.training.checkpoint import MARKER  # noqa: E402
from tests.helpers import VOCAB, full_batch_causal_lm, make_examples, relative_error, run_trainer, train_args  # noqa: E402

COLLATE = DataCollatorForCausalLM(pad_token_id=0)


def windows_of(global_batches: list[list[int]], ga: int, world: int = 2) -> list[list[int]]:
    """The examples of each optimizer step: rank r takes global batches r, r + P, ...; a window is GA of them."""
    per_rank = [global_batches[r::world] for r in range(world)]
    steps = -(-max(len(b) for b in per_rank) // ga)
    return [
        sorted({i for r in range(world) for b in per_rank[r][s * ga : (s + 1) * ga] for i in b}) for s in range(steps)
    ]


def uneven_case(name, cls, examples, bs, ga, tmp, **extra):
    model = build_tiny_llama(vocab_size=VOCAB)
    if extra.get("max_tokens_per_batch"):
        sampler = TokenBudgetBatchSampler(
            [len(e["input_ids"]) for e in examples], extra["max_tokens_per_batch"], shuffle=False
        )
        global_batches = list(sampler)
    else:
        global_batches = [list(range(i, min(i + bs, len(examples)))) for i in range(0, len(examples), bs)]
    windows = windows_of(global_batches, ga)
    references = [full_batch_causal_lm(model, [examples[i] for i in w]) for w in windows]
    args = train_args(tmp / name, bs, ga, args_class=TokenWeightedArguments, ddp_timeout=120, **extra)
    trainer, capture = run_trainer(cls, model, examples, args, COLLATE)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "steps": len(capture.grads),
        "windows": windows,
        "grad_errors": [relative_error(g, ref[0]) for g, ref in zip(capture.grads, references, strict=True)],
        "losses": [h["loss"] for h in logs],
        "reference_losses": [ref[1] for ref in references],
        "num_targets": [h.get("num_targets") for h in logs],
        "reference_targets": [sum(sum(1 for y in examples[i]["labels"][1:] if y != -100) for i in w) for w in windows],
    }


def marker_case(tmp):
    """Rank 1 writes its RNG state 1.5 s late: the completion marker must wait for it."""
    model = build_tiny_llama(vocab_size=VOCAB)
    args = train_args(
        tmp / "ckpt",
        2,
        1,
        args_class=TokenWeightedArguments,
        save_strategy="steps",
        save_steps=1,
        max_steps=1,
        ddp_timeout=120,
    )
    from datasets import Dataset

    trainer = TokenWeightedTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(make_examples(4)), data_collator=COLLATE
    )
    original = trainer._save_rng_state

    def slow_rng_state(output_dir):
        if trainer.accelerator.process_index == 1:
            time.sleep(1.5)
        original(output_dir)

    trainer._save_rng_state = slow_rng_state
    trainer.train()
    trainer.accelerator.wait_for_everyone()
    checkpoint = Path(args.output_dir) / "checkpoint-1"
    if dist.get_rank() != 0:
        return {}
    return {
        "marker_files": sorted(json.loads((checkpoint / MARKER).read_text())["files"]),
        "files": sorted(p.name for p in checkpoint.iterdir()),
    }


def evaluate_first_case(tmp):
    """evaluate() before train(), as the recipe does: the training step must still all-reduce the gradients."""
    from datasets import Dataset

    from tests.helpers import CaptureGradients

    examples = make_examples(8)
    model = build_tiny_llama(vocab_size=VOCAB)
    reference, _, _ = full_batch_causal_lm(model, examples)
    capture = CaptureGradients(model)
    args = train_args(tmp / "evaluate_first", 2, 2, args_class=TokenWeightedArguments, ddp_timeout=120)
    trainer = TokenWeightedTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(examples),
        eval_dataset=Dataset.from_list(examples[:4]),
        data_collator=COLLATE,
        callbacks=[capture],
    )
    trainer.evaluate()
    trainer.train()
    return {"grad_error": relative_error(capture.grads[0], reference), "wrapper": type(trainer.model_wrapped).__name__}


def ce_sum_over_num_items(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func as transformers documents it: summed cross-entropy divided by num_items_in_batch."""
    import torch.nn.functional as F

    logits, targets = outputs["logits"][:, :-1], labels[:, 1:]
    return (
        F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
        / num_items_in_batch
    )


def evaluation_case(tmp):
    """Evaluation of 9 examples in batches of 2 on 2 ranks: accelerate repeats 3 of them; neither loss counts them."""
    from datasets import Dataset

    examples = make_examples(9, seed=32)
    out = {"reference": full_batch_causal_lm(build_tiny_llama(vocab_size=VOCAB), examples)[1]}
    out["reference_targets"] = sum(sum(1 for y in e["labels"][1:] if y != -100) for e in examples)
    for name, kwargs in [("hfacc", {}), ("compute_loss_func", {"compute_loss_func": ce_sum_over_num_items})]:
        args = train_args(tmp / f"eval_{name}", 2, 1, args_class=TokenWeightedArguments, per_device_eval_batch_size=2)
        trainer = TokenWeightedTrainer(
            model=build_tiny_llama(vocab_size=VOCAB), args=args, data_collator=COLLATE, **kwargs
        )
        metrics = trainer.evaluate(Dataset.from_list(examples))
        out[name] = {"loss": metrics["eval_loss"], "num_targets": metrics["eval_num_targets"]}
    return out


def main(out_path: str) -> None:
    tmp = Path(out_path).parent / "work"  # shared by the ranks: they write one checkpoint together
    examples = make_examples(11, seed=31)
    lengths = [len(e["input_ids"]) for e in examples]
    # A budget whose micro-batch count is odd: the second rank's last micro-batch is a whole repeated one.
    budget = next(b for b in range(60, 400, 4) if len(TokenBudgetBatchSampler(lengths, b, shuffle=False)) % 2 == 1)
    results = {
        "hfacc bs1 ga4 n9": uneven_case("a", TokenWeightedTrainer, examples[:9], 1, 4, tmp),
        "hfacc bs2 ga2 n11": uneven_case("b", TokenWeightedTrainer, examples, 2, 2, tmp),
        "hfacc token budget": uneven_case("c", TokenWeightedTrainer, examples, 1, 2, tmp, max_tokens_per_batch=budget),
        "stock bs1 ga4 n9": uneven_case("d", Trainer, examples[:9], 1, 4, tmp),
        "marker": marker_case(tmp),
        "evaluate first": evaluate_first_case(tmp),
        "evaluation": evaluation_case(tmp),
        "world_size": dist.get_world_size(),
    }
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
